use std::io::Write;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use clap::{Args, Parser, Subcommand};
use nrtxn::config::{Command, ServeArgs};
use nrtxn::follow::{FollowError, Follower, HttpBackfill};
use nrtxn_actors::EVENTS_LIMIT_MAX;
use tracing_subscriber::EnvFilter;

/// The binary's commands: the server's (declared with its configuration in
/// `nrtxn::config`) and the clients' (declared here, beside the code that runs them).
#[derive(Parser, Debug)]
#[command(
    name = "nrtxn",
    version,
    about = "Near-realtime inventory transactions"
)]
struct Cli {
    #[command(subcommand)]
    command: MainCommand,
}

#[derive(Subcommand, Debug)]
#[allow(
    clippy::large_enum_variant,
    reason = "parsed once at start: its size costs nothing"
)]
enum MainCommand {
    #[command(flatten)]
    Server(Command),
    /// Print an item's events as JSON lines, gapless and in seq order, following new
    /// ones as they come (polls the server's events route).
    Follow(FollowArgs),
}

/// Options of `nrtxn follow`.
#[derive(Args, Debug)]
struct FollowArgs {
    /// Base URL of an `nrtxn serve`.
    #[arg(long, default_value = "http://127.0.0.1:8080")]
    url: String,
    /// Shop of the item.
    #[arg(long)]
    shop: String,
    /// Item to follow. Required: with no events topic, `follow` polls the events route,
    /// which serves one item at a time.
    #[arg(long)]
    item: String,
    /// Print the events after this seq (0: the item's whole history). To resume, pass the
    /// last seq printed.
    #[arg(long, default_value_t = 0)]
    after: u64,
    /// Wait between polls that found nothing new, in ms (1 to 60000).
    #[arg(long, default_value_t = 200, value_parser = clap::value_parser!(u64).range(1..=60_000))]
    poll_ms: u64,
    /// Stop after printing this many events [default: follow until interrupted].
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    max_events: Option<u64>,
    /// Bound on each HTTP request (connect and answer), in ms (1 to 600000).
    #[arg(long, default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(1..=600_000))]
    request_timeout_ms: u64,
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        MainCommand::Server(Command::Serve(args)) => serve(args),
        MainCommand::Follow(args) => tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .context("cannot start the runtime")
            .and_then(|rt| rt.block_on(follow(args))),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("nrtxn: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn serve(args: ServeArgs) -> anyhow::Result<()> {
    args.resolve()
        .and_then(|settings| actix_web::rt::System::new().block_on(nrtxn::server::run(settings)))
}

/// `nrtxn follow`: polls the item's events route from the last seq printed and feeds each
/// page through a [`Follower`] (so duplicates and gaps are handled as they will be for a
/// topic), printing what it emits. Stops after `--max-events`, on SIGINT or SIGTERM (with
/// a summary on stderr either way), or on an error.
async fn follow(args: FollowArgs) -> anyhow::Result<()> {
    let backfill = HttpBackfill::new(&args.url, Duration::from_millis(args.request_timeout_ms))
        .context("--url")?;
    // The poller reads the same route the follower fills gaps from; clones share a pool.
    let source = backfill.clone();
    let mut follower = Follower::new(backfill);
    follower.start_at(&args.shop, &args.item, args.after)?;
    let mut run = FollowRun {
        out: std::io::BufWriter::new(std::io::stdout()),
        buffered: 0,
        last_seq_buffered: args.after,
        printed: 0,
        last_seq_printed: args.after,
    };
    let stopped_by = tokio::select! {
        result = run.poll(&args, &source, &mut follower) => result.map(|()| None),
        signal = stop_signal() => signal.map(Some),
    };
    // Whatever stopped it, what was read reaches stdout, and the summary says where to
    // resume: after the last event known to have been written.
    let flushed = run.flush();
    let stats = follower.stats();
    let last_seq = run.last_seq_printed;
    eprintln!(
        "nrtxn follow: {} events printed (last seq {last_seq}; resume with --after {last_seq}), \
         {} duplicates dropped, {} gaps filled with {} events{}",
        run.printed,
        stats.duplicates_dropped,
        stats.gaps_filled,
        stats.events_filled,
        match stopped_by {
            Ok(Some(signal)) => format!(", stopped by {signal}"),
            _ => String::new(),
        }
    );
    stopped_by?;
    match flushed {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        other => other.context("stdout"),
    }
}

/// What `follow` has printed so far: kept outside the polling future, so it is still
/// there for the summary when a signal cancels that future.
struct FollowRun {
    /// Flushed after each page: a reader sees each page whole and as soon as it is read.
    out: std::io::BufWriter<std::io::Stdout>,
    /// Events in `out`'s buffer, not yet known to be written.
    buffered: u64,
    last_seq_buffered: u64,
    /// Events written to stdout (a flush succeeded after them): what the summary counts
    /// and the resume point, so a failed write is printed again rather than skipped.
    printed: u64,
    last_seq_printed: u64,
}

impl FollowRun {
    async fn poll(
        &mut self,
        args: &FollowArgs,
        source: &HttpBackfill,
        follower: &mut Follower<HttpBackfill>,
    ) -> anyhow::Result<()> {
        let events_max = args.max_events.unwrap_or(u64::MAX);
        while self.printed + self.buffered < events_max {
            let after_seq = follower.last_seq(&args.shop, &args.item);
            // Never read more than is left to print.
            let left = events_max - self.printed - self.buffered;
            let limit = left.min(EVENTS_LIMIT_MAX as u64) as usize;
            let page = source
                .page(&args.shop, &args.item, after_seq, limit)
                .await
                .with_context(|| {
                    format!(
                        "cannot read the events of {}/{} from {} (is `nrtxn serve` running \
                         there?)",
                        args.shop, args.item, args.url
                    )
                })?;
            if page.is_empty() {
                tokio::time::sleep(Duration::from_millis(args.poll_ms)).await;
                continue;
            }
            for event in page {
                let pushed = follower
                    .push(event, |e| {
                        if self.printed + self.buffered >= events_max {
                            return Ok(());
                        }
                        serde_json::to_writer(&mut self.out, &e)?;
                        self.out.write_all(b"\n")?;
                        self.buffered += 1;
                        self.last_seq_buffered = e.seq;
                        Ok::<(), std::io::Error>(())
                    })
                    .await;
                match pushed {
                    Err(e) if is_broken_pipe(&e) => return Ok(()),
                    other => other?,
                }
            }
            match self.flush() {
                // The reader went away (`| head`): a normal end.
                Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => return Ok(()),
                other => other.context("stdout")?,
            }
        }
        Ok(())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.out.flush()?;
        self.printed += self.buffered;
        self.buffered = 0;
        self.last_seq_printed = self.last_seq_buffered;
        Ok(())
    }
}

fn is_broken_pipe(e: &FollowError) -> bool {
    // The emit callback's errors are `io::Error`s (serde_json's convert into them, kind
    // kept).
    matches!(e, FollowError::Emit { source }
        if source.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe))
}

/// Resolves with the name of the first of SIGINT or SIGTERM to arrive.
async fn stop_signal() -> anyhow::Result<&'static str> {
    use actix_rt::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).context("cannot listen for SIGTERM")?;
    tokio::select! {
        r = actix_rt::signal::ctrl_c() => r.map(|()| "SIGINT").context("cannot listen for SIGINT"),
        _ = term.recv() => Ok("SIGTERM"),
    }
}
