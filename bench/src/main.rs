//! `nrtxn-bench`: the flash-sale benchmark of nrtxn against the systems users would pick
//! instead.
//!
//! - `run`: drives one scenario against any server speaking nrtxn's HTTP API and checks
//!   the outcome (no oversell; stock = loaded − Σ ok decrements + Σ ok increments; each
//!   key one outcome);
//! - `peer`: the reference services (Redis + Lua, PostgreSQL row, ceiling) behind the
//!   same routes;
//! - `report`: gathers results into `latest.json`, renders Markdown and an SVG chart;
//! - `flash-open`: the opening of a sale on nrtxn's sale windows.
//!
//! `scripts/bench.sh` runs them all.

mod check;
mod client;
mod flash_open;
mod peer;
mod report;
mod run;
mod stats;
mod zipf;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "nrtxn-bench",
    version,
    about = "Flash-sale benchmark harness for nrtxn and its peers"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Load items, drive one scenario, check correctness; prints one JSON line.
    Run(run::RunArgs),
    /// Serve nrtxn's routes in front of another engine.
    Peer(peer::PeerArgs),
    /// Gather run results and render them as Markdown and SVG.
    Report(report::ReportArgs),
    /// The opening of a flash sale on nrtxn's sale windows (nrtxn only).
    FlashOpen(flash_open::FlashOpenArgs),
}

fn main() {
    let cli = Cli::parse();
    let result = match cli.cmd {
        Cmd::Run(args) => tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()
            .map_err(anyhow::Error::from)
            .and_then(|rt| rt.block_on(run_and_print(args))),
        // actix-web runs on its own system of single-threaded runtimes (one per worker);
        // the backend's connections live on this main one.
        Cmd::Peer(args) => actix_web::rt::System::new().block_on(peer::serve(args)),
        Cmd::Report(args) => report::report(args),
        Cmd::FlashOpen(args) => tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()
            .map_err(anyhow::Error::from)
            .and_then(|rt| rt.block_on(flash_open::flash_open(args))),
    };
    if let Err(e) = result {
        eprintln!("nrtxn-bench: {e:#}");
        std::process::exit(1);
    }
}

/// Exit code when the run worked but its correctness check failed, so scripts notice.
const EXIT_CHECK_FAILED: i32 = 3;

async fn run_and_print(args: run::RunArgs) -> anyhow::Result<()> {
    let json_path = args.json.clone();
    let result = run::run(args).await?;
    let line = serde_json::to_string(&result)?;
    println!("{line}");
    eprintln!(
        "nrtxn-bench: {} {} ({}): {}/s, p50 {} ms, p99 {} ms, p99.9 {} ms; ok {}, rejected {}, 429 {}, errors {}; check {}; peak RSS {} MB{}",
        result.system,
        result.scenario,
        result.mode,
        result.throughput_rps,
        result.p50_ms,
        result.p99_ms,
        result.p999_ms,
        result.ok,
        result.rejected,
        result.overloaded,
        result.errors,
        result.check.get("verdict").and_then(|v| v.as_str()).unwrap_or("?"),
        result.peak_rss_mb.map(|m| m.to_string()).unwrap_or_else(|| "n/a".into()),
        result
            .entries_per_sync
            .map(|e| format!("; {e} entries per sync"))
            .unwrap_or_default(),
    );
    if let Some(path) = json_path {
        std::fs::write(&path, format!("{line}\n"))
            .map_err(|e| anyhow::anyhow!("--json: cannot write {}: {e}", path.display()))?;
    }
    if result.check.get("verdict").and_then(|v| v.as_str()) == Some("failed") {
        eprintln!(
            "nrtxn-bench: {} {}: the correctness check FAILED: {}",
            result.system, result.scenario, result.check
        );
        std::process::exit(EXIT_CHECK_FAILED);
    }
    Ok(())
}
