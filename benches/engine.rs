//! Engine benchmark without HTTP: one hot item, the durable SQLite journal, decrements
//! submitted through the shop's WorkManager exactly as the API submits them.
//!
//! `cargo bench --bench engine -- [decrements] [submit_chunk] [concurrent_chunks]`
//! prints decrements per second, the batch sizes the processor journaled, and the
//! journal transactions it took.

use std::sync::Arc;
use std::time::Instant;

use nrtxn::embedded_log::EmbeddedLog;
use nrtxn::sqlite::SqliteStore;
use nrtxn_actors::{
    now_ms, Admission, Engine, EngineConfig, Metrics, Op, Request, RequestLog, Status,
};

fn arg(n: usize, default: usize) -> usize {
    std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .nth(n)
        .and_then(|a| a.parse().ok())
        .unwrap_or(default)
}

fn main() {
    let total = arg(0, 1_000_000);
    let chunk = arg(1, 1_000);
    let concurrent = arg(2, 64);
    let dir = tempfile::tempdir().expect("tempdir");
    actix_rt::System::new().block_on(async move {
        let metrics = Arc::new(Metrics::new());
        let store = SqliteStore::open(dir.path(), metrics.clone()).expect("store");
        let log_store = store.clone();
        let cfg = EngineConfig {
            inflight_max: 10_000_000,
            shop_pending_max: 10_000_000,
            ..EngineConfig::default()
        };
        let engine = Engine::start(
            cfg,
            store,
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
                                ..Request::new(
                                    shop.clone(),
                                    item.clone(),
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
                    let admitted = engine.submit(&shop, reqs).await.expect("submit");
                    let mut statuses = Vec::with_capacity(admitted.admissions.len());
                    for a in admitted.admissions {
                        if let Admission::Wait(rx) = a {
                            statuses.push(rx.await.expect("outcome").status);
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
        let state = engine.item(&shop, &item).await.expect("item").expect("loaded");
        assert_eq!(ok as i64, stock, "every unit sold exactly once");
        assert_eq!(state.stock, 0, "no oversell, nothing left");
        let batches = metrics.batch_entries.get_sample_count();
        let txns = metrics.journal_txn_entries.get_sample_count();
        println!("engine: one hot item, durable SQLite journal (WAL, synchronous=FULL)");
        println!(
            "  decrements {total} (ok {ok}, insufficient_stock {rejected}) in {secs:.2} s: {:.0} decrements/s",
            total as f64 / secs
        );
        println!(
            "  processor batches {batches}, mean {:.0} entries; journal transactions {txns}, mean {:.0} entries, mean write {:.2} ms",
            metrics.batch_entries.get_sample_sum() / batches.max(1) as f64,
            metrics.journal_txn_entries.get_sample_sum() / txns.max(1) as f64,
            1000.0 * metrics.journal_write_seconds.get_sample_sum() / txns.max(1) as f64,
        );
        engine.shutdown().await;
    });
}
