//! The engine (WorkManager and processors, no HTTP) against a simple model, over random
//! sequences of loads, decrements, increments, holds, confirms, cancels, expiries and
//! repeats, on the real embedded journal (issue 14's property test).
//!
//! After each step every outcome is the model's, and every loaded item's durable state
//! is the model's. At the end each item's events are gapless and chain from one state to
//! the next up to the item's stock. The properties:
//! - **no oversell**: a decrement or hold beyond the available stock is refused (a
//!   partial fill, `min_qty`, takes what there is down to its minimum), and the stock
//!   never goes below zero;
//! - **conservation**: stock and reserved are what loads, sales, returns and hold endings
//!   make of them, and the events add up to them;
//! - **at most once**: a repeated key answers its first outcome and changes nothing;
//! - **returns first**: in one call, an item's returns are applied before its sales;
//! - **a hold ends once**: a confirm or cancel after its ending answers that ending, and
//!   a hold past its expiry ends as expired, whatever ends it.
//!
//! `PROPTEST_CASES` sets the number of cases (24 by default: each starts an engine).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use nrtxn_actors::{
    hold_end_key, now_ms, Engine, EngineConfig, Journal, Metrics, Op, PollResult, Reply, Request,
    RequestLog, Status,
};
use nrtxn_embedded::journal::{LogJournal, Retention};
use nrtxn_embedded::request_log::EmbeddedLog;
use proptest::prelude::*;

/// Items the steps pick from; the last is never loaded.
const ITEMS: [&str; 4] = ["a", "b", "c", "never-loaded"];
/// A short hold's TTL: the step after it waits past it.
const SHORT_TTL_MS: i64 = 1;
const LONG_TTL_MS: i64 = 3_600_000;

#[derive(Debug, Clone)]
enum Step {
    Load {
        item: usize,
        stock: i64,
    },
    /// One call of decrements and increments (`true`: an increment) on any items, a
    /// decrement with its `min_qty` (a partial fill) or none.
    Txns(Vec<(usize, bool, i64, Option<i64>)>),
    Hold {
        item: usize,
        qty: i64,
        min_qty: Option<i64>,
        short: bool,
    },
    /// Ends the `nth` hold made so far (modulo their number): confirm, or cancel.
    End {
        nth: usize,
        confirm: bool,
    },
    /// Submits again the `nth` transaction made so far, and polls its key.
    Repeat {
        nth: usize,
    },
}

fn step() -> impl Strategy<Value = Step> {
    let item = 0..ITEMS.len();
    prop_oneof![
        1 => (0..3usize, 0..20i64).prop_map(|(item, stock)| Step::Load { item, stock }),
        4 => prop::collection::vec((item.clone(), any::<bool>(), 1..6i64, 0..6i64), 1..6)
            .prop_map(|txns| Step::Txns(txns.into_iter().map(|(item, inc, qty, min)| {
                (item, inc, qty, min_qty(!inc, qty, min))
            }).collect())),
        2 => (item, 1..6i64, 0..6i64, prop::bool::weighted(0.3))
            .prop_map(|(item, qty, min, short)| Step::Hold { item, qty, min_qty: min_qty(true, qty, min), short }),
        2 => (0..8usize, any::<bool>()).prop_map(|(nth, confirm)| Step::End { nth, confirm }),
        1 => (0..16usize).prop_map(|nth| Step::Repeat { nth }),
    ]
}

/// A partial fill's `min_qty` from a drawn `min` (0: none), within `1..=qty`.
fn min_qty(takes: bool, qty: i64, min: i64) -> Option<i64> {
    (takes && min > 0).then(|| min.min(qty))
}

/// What a sale or hold of `qty` (with `min_qty`) takes of `available`, `None`: refused.
fn taking(qty: i64, min_qty: Option<i64>, available: i64) -> Option<i64> {
    match min_qty {
        None => (qty <= available).then_some(qty),
        Some(min) => Some(qty.min(available)).filter(|n| *n >= min),
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum HoldState {
    Held {
        short: bool,
    },
    /// Ended by this op (Confirm, Release or Expire).
    Ended(Op),
}

struct ModelHold {
    id: Arc<str>,
    item: usize,
    qty: i64,
    state: HoldState,
}

/// What the engine must show.
#[derive(Default)]
struct Model {
    /// (available, reserved) of each loaded item.
    items: HashMap<usize, (i64, i64)>,
    holds: Vec<ModelHold>,
    /// Every transaction submitted, with the outcome it got: (request, status, seq,
    /// qty_taken).
    txns: Vec<(Request, Status, Option<u64>, Option<i64>)>,
}

impl Model {
    /// Applies one decrement or increment; the status it must get, and (a decrement)
    /// what it takes.
    fn txn(&mut self, item: usize, increment: bool, qty: i64, min: Option<i64>) -> (Status, i64) {
        let Some((stock, _)) = self.items.get_mut(&item) else {
            return (Status::UnknownItem, 0);
        };
        if increment {
            *stock += qty;
            return (Status::Ok, 0);
        }
        match taking(qty, min, *stock) {
            Some(n) => {
                *stock -= n;
                (Status::Ok, n)
            }
            None => (Status::InsufficientStock, 0),
        }
    }

    /// Holds past their TTL have expired by now: the engine's wheel or the next ending
    /// of each releases it.
    fn expire_short_holds(&mut self) {
        for h in &mut self.holds {
            if h.state == (HoldState::Held { short: true }) {
                h.state = HoldState::Ended(Op::Expire);
                let (stock, reserved) = self.items.get_mut(&h.item).expect("held item");
                *stock += h.qty;
                *reserved -= h.qty;
            }
        }
    }
}

fn request(shop: &Arc<str>, item: usize, key: String, op: Op, qty: i64) -> Request {
    Request {
        seller: Some("model".into()),
        ..Request::new(
            shop.clone(),
            ITEMS[item].into(),
            key.into(),
            op,
            qty,
            now_ms(),
        )
    }
}

/// The outcome of each request of one call, as the engine answers them.
async fn submit(
    engine: &Engine,
    shop: &Arc<str>,
    reqs: Vec<Request>,
) -> Vec<Arc<nrtxn_actors::Outcome>> {
    let n = reqs.len();
    let answers = engine
        .submit(shop, reqs.into_iter().map(|r| (r, true)).collect())
        .await
        .expect("submit");
    let outcomes: Vec<_> = answers
        .replies
        .into_iter()
        .map(|r| match r {
            Reply::Decided(o) | Reply::Repeat(o) => o,
            other => panic!("a respond=true request answered {other:?}"),
        })
        .collect();
    assert_eq!(outcomes.len(), n);
    outcomes
}

/// Every loaded item's durable state is the model's. A short hold's expiry is decided by
/// the wheel on its own, so its item may take a moment to get there: waited for, up to
/// 5 s.
async fn check_items(engine: &Engine, shop: &Arc<str>, model: &Model) {
    for (&item, &want) in &model.items {
        let name: Arc<str> = ITEMS[item].into();
        let mut got = None;
        for _ in 0..500 {
            let view = engine
                .item(shop, &name)
                .await
                .expect("item")
                .expect("loaded item");
            assert!(view.stock >= 0 && view.reserved >= 0, "{view:?}");
            got = Some((view.stock, view.reserved));
            if got == Some(want) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(got, Some(want), "item {name}: (stock, reserved)");
    }
}

async fn run(steps: Vec<Step>) {
    let dir = tempfile::tempdir().expect("tempdir");
    let metrics = Arc::new(Metrics::new());
    let journal =
        LogJournal::open(dir.path(), metrics.clone(), Retention::default()).expect("journal");
    let log_store = journal.clone();
    let engine = Engine::start(
        EngineConfig::default(),
        journal as Arc<dyn Journal>,
        move |d, _| Arc::new(EmbeddedLog::new(log_store, d, true)) as Arc<dyn RequestLog>,
        metrics,
    )
    .expect("engine");
    let shop: Arc<str> = "model".into();
    let mut model = Model::default();
    let mut keys = 0usize;
    for step in steps {
        match step {
            Step::Load { item, stock } => {
                let views = engine
                    .load(&shop, vec![(ITEMS[item].into(), stock)])
                    .await
                    .expect("load");
                let reserved = model.items.get(&item).map_or(0, |s| s.1);
                model.items.insert(item, (stock, reserved));
                assert_eq!((views[0].stock, views[0].reserved), (stock, reserved));
            }
            Step::Txns(txns) => {
                let reqs: Vec<Request> = txns
                    .iter()
                    .map(|&(item, inc, qty, min_qty)| {
                        keys += 1;
                        let op = if inc { Op::Increment } else { Op::Decrement };
                        Request {
                            min_qty,
                            ..request(&shop, item, format!("t{keys}"), op, qty)
                        }
                    })
                    .collect();
                let outcomes = submit(&engine, &shop, reqs.clone()).await;
                // Returns first: each item's increments of the call, then its decrements.
                let mut want = vec![(Status::Ok, 0); txns.len()];
                for inc_pass in [true, false] {
                    for (i, &(item, inc, qty, min)) in txns.iter().enumerate() {
                        if inc == inc_pass {
                            want[i] = model.txn(item, inc, qty, min);
                        }
                    }
                }
                for ((req, o), (status, taken)) in reqs.into_iter().zip(&outcomes).zip(want) {
                    let want_taken = (req.op == Op::Decrement).then_some(taken);
                    assert_eq!(
                        (o.status, o.qty_taken, o.qty),
                        (status, want_taken, req.qty),
                        "{} {:?} {} (min {:?}): {o:?}",
                        req.item,
                        req.op,
                        req.qty,
                        req.min_qty
                    );
                    if let Some(after) = o.stock_after {
                        assert!(after >= 0, "oversold: {o:?}");
                    }
                    model.txns.push((req, o.status, o.seq, o.qty_taken));
                }
            }
            Step::Hold {
                item,
                qty,
                min_qty,
                short,
            } => {
                keys += 1;
                let id = format!("h{keys}");
                let ttl_ms = if short { SHORT_TTL_MS } else { LONG_TTL_MS };
                let req = Request {
                    ttl_ms,
                    min_qty,
                    ..request(&shop, item, id.clone(), Op::Hold, qty)
                };
                let o = submit(&engine, &shop, vec![req]).await.remove(0);
                let want = match model.items.get_mut(&item) {
                    None => (Status::UnknownItem, 0),
                    Some((stock, reserved)) => match taking(qty, min_qty, *stock) {
                        Some(n) => {
                            *stock -= n;
                            *reserved += n;
                            model.holds.push(ModelHold {
                                id: id.into(),
                                item,
                                qty: n,
                                state: HoldState::Held { short },
                            });
                            (Status::Ok, n)
                        }
                        None => (Status::InsufficientStock, 0),
                    },
                };
                assert_eq!(
                    (o.status, o.qty_taken),
                    (want.0, Some(want.1)),
                    "hold {item} {qty} (min {min_qty:?}): {o:?}"
                );
                if short {
                    // Past its TTL before the next step.
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    model.expire_short_holds();
                }
            }
            Step::End { nth, confirm } => {
                if model.holds.is_empty() {
                    continue;
                }
                let h = nth % model.holds.len();
                let (id, item, qty, state) = {
                    let h = &model.holds[h];
                    (h.id.clone(), h.item, h.qty, h.state)
                };
                let view = engine
                    .hold(&shop, &id)
                    .await
                    .expect("hold")
                    .expect("a made hold");
                assert_eq!((&*view.item, view.qty), (ITEMS[item], qty));
                let op = if confirm { Op::Confirm } else { Op::Release };
                let req = Request {
                    hold_id: Some(id.clone()),
                    ..Request::new(
                        shop.clone(),
                        ITEMS[item].into(),
                        hold_end_key(&id),
                        op,
                        qty,
                        now_ms(),
                    )
                };
                let o = submit(&engine, &shop, vec![req]).await.remove(0);
                let ended = match state {
                    HoldState::Ended(ended) => ended,
                    HoldState::Held { .. } => {
                        let (stock, reserved) = model.items.get_mut(&item).expect("held item");
                        *reserved -= qty;
                        if !confirm {
                            *stock += qty;
                        }
                        model.holds[h].state = HoldState::Ended(op);
                        op
                    }
                };
                // The first ending of a hold is its only one.
                assert_eq!((o.status, o.op), (Status::Ok, ended), "ending {id}: {o:?}");
            }
            Step::Repeat { nth } => {
                if model.txns.is_empty() {
                    continue;
                }
                let (req, status, seq, taken) = model.txns[nth % model.txns.len()].clone();
                let key = req.key.clone();
                let again = Request {
                    submitted_at: now_ms(),
                    ..req
                };
                let first = (status, seq, taken);
                let o = submit(&engine, &shop, vec![again]).await.remove(0);
                assert_eq!(
                    (o.status, o.seq, o.qty_taken),
                    first,
                    "repeat of {key}: {o:?}"
                );
                match engine.poll(&shop, key.clone()).await.expect("poll") {
                    PollResult::Decided(o) => {
                        assert_eq!(
                            (o.status, o.seq, o.qty_taken),
                            first,
                            "poll of {key}: {o:?}"
                        )
                    }
                    other => panic!("poll of {key}: {other:?}"),
                }
            }
        }
        check_items(&engine, &shop, &model).await;
    }
    // Each item's events: gapless, each from the state the one before left.
    for (&item, &(stock, reserved)) in &model.items {
        let name: Arc<str> = ITEMS[item].into();
        let events = engine
            .events(&shop, &name, 0, 10_000)
            .await
            .expect("events");
        for (i, e) in events.iter().enumerate() {
            assert_eq!(
                (e.seq, e.prev_seq),
                (i as u64 + 1, i as u64),
                "{name}: {e:?}"
            );
            assert!(e.stock_after >= 0 && e.reserved_after >= 0, "{name}: {e:?}");
        }
        let last = events.last().expect("a loaded item has events");
        assert_eq!(
            (last.stock_after, last.reserved_after),
            (stock, reserved),
            "{name}"
        );
    }
    engine.shutdown().await;
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: std::env::var("PROPTEST_CASES").ok().and_then(|c| c.parse().ok()).unwrap_or(24),
        // Each case starts an engine; shrinking a failure is worth its time, not more.
        max_shrink_iters: 200,
        ..ProptestConfig::default()
    })]

    #[test]
    fn the_engine_agrees_with_a_simple_model(steps in prop::collection::vec(step(), 1..40)) {
        actix_rt::System::new().block_on(run(steps));
    }
}
