use std::process::ExitCode;

use clap::Parser;
use nrtxn::config::{Cli, Command};
use tracing_subscriber::EnvFilter;

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Serve(args) => args.resolve().and_then(|settings| {
            actix_web::rt::System::new().block_on(nrtxn::server::run(settings))
        }),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("nrtxn: {e:#}");
            ExitCode::FAILURE
        }
    }
}
