//! Engine benchmark without HTTP: one hot item, the embedded journal, decrements
//! submitted through the shop's WorkManager exactly as the API submits them.
//!
//! `cargo bench --bench engine -- [decrements] [submit_chunk] [concurrent_chunks]`
//! prints decrements per second, the batch sizes the processor journaled, and the
//! journal's group commits.

use std::sync::Arc;
use std::time::Instant;

use nrtxn_actors::{now_ms, Engine, EngineConfig, Metrics, Op, Reply, Request, RequestLog, Status};
use nrtxn_embedded::journal::{LogJournal, Retention};
use nrtxn_embedded::request_log::EmbeddedLog;

// The server's allocator (src/main.rs), so the engine is measured as it runs there.
#[global_allocator]
static GLOBAL: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

fn arg(n: usize, default: usize) -> usize {
    std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .nth(n)
        .and_then(|a| a.parse().ok())
        .unwrap_or(default)
}

/// This process's CPU time so far (user + system), from `/proc/self/stat`.
fn cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // Fields after the command name (which is in parentheses): utime is the 12th, stime
    // the 13th, in clock ticks (100 a second on Linux).
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<f64> = rest
        .split_whitespace()
        .map(|x| x.parse().unwrap_or(0.0))
        .collect();
    (f.get(11).copied().unwrap_or(0.0) + f.get(12).copied().unwrap_or(0.0)) / 100.0
}

/// `NRTXN_PIN_THREADS` as the server's flag reads it: `true` (or unset) or `false`.
fn pin_threads() -> bool {
    match std::env::var("NRTXN_PIN_THREADS").as_deref() {
        Err(_) | Ok("true") => true,
        Ok("false") => false,
        Ok(other) => {
            eprintln!("NRTXN_PIN_THREADS: `{other}` is neither `true` nor `false`");
            std::process::exit(2)
        }
    }
}

fn main() {
    let total = arg(0, 1_000_000);
    let chunk = arg(1, 1_000);
    let concurrent = arg(2, 64);
    let dir = tempfile::tempdir().expect("tempdir");
    actix_rt::System::new().block_on(async move {
        let metrics = Arc::new(Metrics::new());
        let journal =
            LogJournal::open(dir.path(), metrics.clone(), Retention::default()).expect("journal");
        let log_store = journal.clone();
        let cfg = EngineConfig {
            inflight_max: 10_000_000,
            shop_pending_max: 10_000_000,
            // As the server places its threads by default (`NRTXN_PIN_THREADS=false`
            // leaves them to the scheduler, as the server's flag does).
            pin_threads: pin_threads(),
            ..EngineConfig::default()
        };
        let engine = Engine::start(
            cfg,
            journal,
            move |d, _| Arc::new(EmbeddedLog::new(log_store, d, true)) as Arc<dyn RequestLog>,
            metrics.clone(),
        )
        .expect("engine");
        let shop: Arc<str> = "bench".into();
        let item: Arc<str> = "hot".into();
        let stock = (total as i64) * 9 / 10;
        engine
            .load(&shop, vec![(item.clone(), stock)])
            .await
            .expect("load");

        let started = Instant::now();
        let cpu_started = cpu_seconds();
        let mut ok = 0usize;
        let mut rejected = 0usize;
        let mut sent = 0usize;
        let mut running = futures::stream::FuturesUnordered::new();
        use futures::StreamExt;
        loop {
            while running.len() < concurrent && sent < total {
                let n = chunk.min(total - sent);
                let reqs: Vec<(Request, bool)> = (sent..sent + n)
                    .map(|i| {
                        (
                            Request {
                                seller: Some("seller".into()),
                                // Names of their own, as the API parses each request's
                                // (`validate::path_segment`): one name shared by every
                                // request would have its count bounce between the
                                // benchmark's thread and the engine's at each clone.
                                ..Request::new(
                                    Arc::from(&*shop),
                                    Arc::from(&*item),
                                    format!("seller:hot:{i}").into(),
                                    Op::Decrement,
                                    1,
                                    now_ms(),
                                )
                            },
                            true,
                        )
                    })
                    .collect();
                sent += n;
                let engine = engine.clone();
                let shop = shop.clone();
                running.push(async move {
                    let answers = engine.submit(&shop, reqs).await.expect("submit");
                    let mut statuses = Vec::with_capacity(answers.replies.len());
                    for reply in answers.replies {
                        if let Reply::Decided(o) = reply {
                            statuses.push(o.status);
                        }
                    }
                    statuses
                });
            }
            match running.next().await {
                Some(statuses) => {
                    for s in statuses {
                        if s == Status::Ok {
                            ok += 1
                        } else {
                            rejected += 1
                        }
                    }
                }
                None => break,
            }
        }
        let secs = started.elapsed().as_secs_f64();
        let cpu = cpu_seconds() - cpu_started;
        let state = engine.item(&shop, &item).await.expect("item").expect("loaded");
        assert_eq!(ok as i64, stock, "every unit sold exactly once");
        assert_eq!(state.stock, 0, "no oversell, nothing left");
        let batches = metrics.batch_entries.get_sample_count();
        let txns = metrics.journal_txn_entries.get_sample_count();
        println!(
            "engine: one hot item, the embedded journal's log (one fdatasync per group) and its SQLite views"
        );
        println!(
            "  decrements {total} (ok {ok}, insufficient_stock {rejected}) in {secs:.2} s: {:.0} decrements/s, CPU {:.0} ns per decision",
            total as f64 / secs,
            cpu * 1e9 / total as f64
        );
        println!(
            "  processor batches {batches}, mean {:.0} entries; journal group commits {txns}, mean {:.0} entries, mean write {:.2} ms",
            metrics.batch_entries.get_sample_sum() / batches.max(1) as f64,
            metrics.journal_txn_entries.get_sample_sum() / txns.max(1) as f64,
            1000.0 * metrics.journal_write_seconds.get_sample_sum() / txns.max(1) as f64,
        );
        engine.shutdown().await;
    });
}
