//! Hold-expiry lateness with many holds pending: how long after its `expires_at` each
//! hold is released, through the engine and the embedded journal (`LogJournal`), no HTTP.
//!
//! `cargo bench --bench holds -- [holds] [ttl_min_ms] [ttl_spread_ms]` makes `holds`
//! holds of 1 on 100 items, with TTLs spread uniformly over
//! `ttl_min_ms..ttl_min_ms + ttl_spread_ms`, waits for all of them to expire, and prints
//! the lateness (the expiry's decision time minus `expires_at`) at p50, p99 and max,
//! read back from the items' event streams.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use nrtxn_actors::{
    now_ms, Engine, EngineConfig, ItemReads, Metrics, Op, Reply, Request, RequestLog, Status,
};
use nrtxn_embedded::journal::{LogJournal, Retention};
use nrtxn_embedded::request_log::EmbeddedLog;

const ITEMS: usize = 100;

fn arg(n: usize, default: usize) -> usize {
    std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .nth(n)
        .and_then(|a| a.parse().ok())
        .unwrap_or(default)
}

fn main() {
    let total = arg(0, 10_000);
    let ttl_min = arg(1, 2_000) as i64;
    let ttl_spread = arg(2, 2_000).max(1) as i64;
    let dir = tempfile::tempdir().expect("tempdir");
    actix_rt::System::new().block_on(async move {
        let metrics = Arc::new(Metrics::new());
        let store =
            LogJournal::open(dir.path(), metrics.clone(), Retention::default()).expect("journal");
        let log_store = store.clone();
        let cfg = EngineConfig {
            inflight_max: 10_000_000,
            shop_pending_max: 10_000_000,
            ..EngineConfig::default()
        };
        let engine = Engine::start(
            cfg,
            store.clone(),
            move |d, _| Arc::new(EmbeddedLog::new(log_store, d, true)) as Arc<dyn RequestLog>,
            metrics.clone(),
        )
        .expect("engine");
        let shop: Arc<str> = "bench".into();
        let items: Vec<Arc<str>> = (0..ITEMS).map(|i| format!("i{i}").into()).collect();
        let stock = (total / ITEMS + 1) as i64;
        engine
            .load(&shop, items.iter().map(|i| (i.clone(), stock)).collect())
            .await
            .expect("load");
        let started = Instant::now();
        let mut expires_at: HashMap<Arc<str>, i64> = HashMap::with_capacity(total);
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        for chunk in (0..total).collect::<Vec<_>>().chunks(1_000) {
            let reqs = chunk
                .iter()
                .map(|&n| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    let req = Request {
                        ttl_ms: ttl_min + (x % ttl_spread as u64) as i64,
                        ..Request::new(
                            shop.clone(),
                            items[n % ITEMS].clone(),
                            format!("h{n}").into(),
                            Op::Hold,
                            1,
                            now_ms(),
                        )
                    };
                    (req, true)
                })
                .collect();
            let answers = engine.submit(&shop, reqs).await.expect("submit");
            for reply in answers.replies {
                let Reply::Decided(o) = reply else {
                    panic!("a new hold is decided: {reply:?}")
                };
                assert_eq!(o.status, Status::Ok, "{o:?}");
                expires_at.insert(o.request_key.clone(), o.expires_at.expect("expires_at"));
            }
        }
        let made = started.elapsed();
        println!(
            "holds: {total} pending on {ITEMS} items, made in {:.2} s; TTLs {ttl_min}..{} ms; wheel tick {} ms",
            made.as_secs_f64(),
            ttl_min + ttl_spread,
            nrtxn_actors::processor::WHEEL_TICK_MS
        );
        let last = expires_at.values().copied().max().unwrap_or(0);
        let wait = (last - now_ms()).max(0) as u64 + 500;
        tokio::time::sleep(Duration::from_millis(wait)).await;
        engine.shutdown().await;
        let mut late = Vec::with_capacity(total);
        for item in &items {
            let mut after = 0;
            loop {
                let page = store.events(&shop, item, after, 1_000).expect("events");
                let Some(last) = page.last() else { break };
                after = last.seq;
                for e in &page {
                    if e.kind == Op::Expire {
                        let id = e.hold_id.as_ref().expect("hold id");
                        late.push(e.at - expires_at[id]);
                    }
                }
            }
        }
        late.sort_unstable();
        let pick = |q: f64| late[((late.len() - 1) as f64 * q) as usize];
        println!(
            "expired {} of {total}: lateness p50 {} ms, p99 {} ms, max {} ms, min {} ms",
            late.len(),
            pick(0.5),
            pick(0.99),
            late.last().copied().unwrap_or(0),
            late.first().copied().unwrap_or(0),
        );
    });
}
