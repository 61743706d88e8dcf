//! The embedded journal (`LogJournal`) with a double in front of its writes, for what
//! cannot be produced for real on demand: a full queue, a slow sync.
//!
//! - A journal whose queue is full holds the processor back; it never loses a batch
//!   (issue 11, the MongoDB writer queue). The MongoDB journal's queue is sized at start
//!   so that it cannot fill (shards × batches in flight), so `Full` cannot be produced
//!   for real: the double answers `Full` to every third append, as a broken bound would.
//! - An order's ending on a journal that writes appends in order sends the lines'
//!   endings as soon as the record's is handed over, without waiting for its sync; on one
//!   that does not, only once the record's ending is durable. A sync's timing cannot be
//!   chosen for real: the double holds back the record's completion.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use nrtxn_actors::orders::{Ended, NewOrder, OrderLine, Placed};
use nrtxn_actors::ports::{AppendDone, HoldPage, HoldQuery, ItemPage, Recovered, RelayPage};
use nrtxn_actors::ports::{
    ItemReads, JournalWrite, Lifecycle, Outbox, OutboxReader, Outcomes, Sharing,
};
use nrtxn_actors::{
    now_ms, Engine, EngineConfig, Entry, Event, HoldView, ItemState, Metrics, Op, Outcome, Reply,
    Request, RequestLog, Status, StoreError,
};
use nrtxn_embedded::journal::{LogJournal, Retention};
use nrtxn_embedded::request_log::EmbeddedLog;

/// What a double does in front of the real journal's writes.
trait Front: Send + Sync + 'static {
    fn append(&self, inner: &Arc<LogJournal>, entries: Vec<Entry>, done: AppendDone);
    fn in_order(&self) -> bool;
}

/// The real journal behind a [`Front`]; every read goes to it unchanged.
struct Double<F> {
    inner: Arc<LogJournal>,
    front: F,
}

impl<F: Front> JournalWrite for Double<F> {
    fn append(&self, entries: Vec<Entry>, done: AppendDone) {
        self.front.append(&self.inner, entries, done)
    }

    fn appends_in_order(&self) -> bool {
        self.front.in_order()
    }
}

impl<F: Front> Outcomes for Double<F> {
    fn outcomes(&self, shop: &str, keys: &[&str]) -> Result<Vec<Option<Outcome>>, StoreError> {
        self.inner.outcomes(shop, keys)
    }
}

impl<F: Front> ItemReads for Double<F> {
    fn item_states(
        &self,
        items: &[(Arc<str>, Arc<str>)],
    ) -> Result<Vec<Option<ItemState>>, StoreError> {
        self.inner.item_states(items)
    }

    fn item_page(
        &self,
        shop: &str,
        after: Option<&str>,
        limit: usize,
    ) -> Result<ItemPage, StoreError> {
        self.inner.item_page(shop, after, limit)
    }

    fn hold_page(
        &self,
        shop: &str,
        query: &HoldQuery,
        after: Option<&str>,
        limit: usize,
    ) -> Result<HoldPage, StoreError> {
        self.inner.hold_page(shop, query, after, limit)
    }

    fn holds(&self, shop: &str, ids: &[&str]) -> Result<Vec<Option<HoldView>>, StoreError> {
        self.inner.holds(shop, ids)
    }

    fn ledgers(
        &self,
        items: &[(Arc<str>, Arc<str>)],
    ) -> Result<Vec<Option<nrtxn_actors::ledger::BuyerLedger>>, StoreError> {
        self.inner.ledgers(items)
    }

    fn sales(
        &self,
        shop: &str,
        keys: &[&str],
    ) -> Result<Vec<Option<nrtxn_actors::returns::SaleRecord>>, StoreError> {
        self.inner.sales(shop, keys)
    }

    fn events(
        &self,
        shop: &str,
        item: &str,
        after: u64,
        limit: usize,
    ) -> Result<Vec<Event>, StoreError> {
        self.inner.events(shop, item, after, limit)
    }
}

/// Only this node writes it: the defaults.
impl<F: Front> Sharing for Double<F> {}

impl<F: Front> Outbox for Double<F> {
    fn relay_read(&self, cursor: u64, limit: usize) -> Result<RelayPage, StoreError> {
        self.inner.relay_read(cursor, limit)
    }
    fn relay_end(&self) -> Result<u64, StoreError> {
        self.inner.relay_end()
    }

    fn relay_cursor(&self, reader: OutboxReader) -> Result<Option<u64>, StoreError> {
        self.inner.relay_cursor(reader)
    }

    fn relay_save(&self, reader: OutboxReader, cursor: u64) -> Result<(), StoreError> {
        self.inner.relay_save(reader, cursor)
    }
}

impl<F: Front> Lifecycle for Double<F> {
    fn recover(&self) -> Result<Recovered, StoreError> {
        self.inner.recover()
    }

    fn close(&self) {
        self.inner.close()
    }
}

/// An engine of two shards on `journal`, its requests logged in `store`.
fn engine_on<F: Front>(
    store: Arc<LogJournal>,
    journal: Arc<Double<F>>,
    metrics: Arc<Metrics>,
) -> Arc<Engine> {
    Engine::start(
        EngineConfig {
            shards: 2,
            ..EngineConfig::default()
        },
        journal,
        move |d, _| Arc::new(EmbeddedLog::new(store, d, true)) as Arc<dyn RequestLog>,
        metrics,
    )
    .expect("engine")
}

/// Every third append refused with `Full` before it returns, having kept nothing.
#[derive(Default)]
struct FullEveryThird {
    appends: AtomicUsize,
    refused: AtomicUsize,
}

impl Front for FullEveryThird {
    fn append(&self, inner: &Arc<LogJournal>, entries: Vec<Entry>, done: AppendDone) {
        if self.appends.fetch_add(1, Ordering::Relaxed) % 3 == 2 {
            self.refused.fetch_add(1, Ordering::Relaxed);
            return done(entries, Err(StoreError::Full));
        }
        inner.append(entries, done)
    }

    fn in_order(&self) -> bool {
        // It bounces batches, so a batch handed over may yet be written after later ones.
        false
    }
}

#[test]
fn a_full_journal_queue_holds_batches_back_and_loses_none() {
    let dir = tempfile::tempdir().unwrap();
    actix_rt::System::new().block_on(async move {
        let metrics = Arc::new(Metrics::new());
        let store =
            LogJournal::open(dir.path(), metrics.clone(), Retention::default()).expect("journal");
        let journal = Arc::new(Double {
            inner: store.clone(),
            front: FullEveryThird::default(),
        });
        let engine = engine_on(store, journal.clone(), metrics);
        let shop: Arc<str> = "s".into();
        let items: Vec<Arc<str>> = (0..4).map(|i| format!("sku-{i}").into()).collect();
        engine
            .load(&shop, items.iter().map(|i| (i.clone(), 300)).collect())
            .await
            .expect("load");
        // 1,600 decrements, 400 an item, in 40 concurrent calls: 300 of each sell.
        let calls = (0..40).map(|c| {
            let reqs: Vec<(Request, bool)> = (0..40)
                .map(|i| {
                    let n = c * 40 + i;
                    let item = items[n % 4].clone();
                    let key = format!("k{n}").into();
                    let req = Request::new(shop.clone(), item, key, Op::Decrement, 1, now_ms());
                    (req, true)
                })
                .collect();
            let (engine, shop) = (engine.clone(), shop.clone());
            async move {
                let answers = engine.submit(&shop, reqs).await.expect("admitted");
                let mut statuses = Vec::new();
                for reply in answers.replies {
                    let Reply::Decided(o) = reply else {
                        panic!("not decided: {reply:?}")
                    };
                    statuses.push(o.status);
                }
                statuses
            }
        });
        // A lost batch would leave its callers waiting: bounded, so it fails instead.
        let answered = tokio::time::timeout(
            std::time::Duration::from_secs(30),
            futures::future::join_all(calls),
        );
        let statuses: Vec<Status> = answered
            .await
            .expect("answered within 30 s")
            .into_iter()
            .flatten()
            .collect();
        assert_eq!(statuses.len(), 1_600, "every request answered");
        let sold = statuses.iter().filter(|s| **s == Status::Ok).count();
        assert_eq!(sold, 1_200);
        assert!(
            journal.front.refused.load(Ordering::Relaxed) > 0,
            "the double never refused: nothing tested"
        );
        for item in &items {
            let events = journal.events("s", item, 0, 10_000).unwrap();
            let seqs: Vec<u64> = events.iter().map(|e| e.seq).collect();
            // The load, 400 decisions, and the sold_out alert after the last sale.
            let expected: Vec<u64> = (1..=402).collect();
            assert_eq!(seqs, expected, "{item}: one entry per decision, gapless");
            let alerts = events.iter().filter(|e| e.kind == Op::SoldOut).count();
            assert_eq!(alerts, 1, "{item}: one sold_out");
            let state = engine.item(&shop, item).await.unwrap().unwrap();
            assert_eq!((state.stock, state.seq), (0, 402));
        }
        engine.shutdown().await;
    });
}

/// The order of [`SlowRecordSync`]'s test.
const ORDER: &str = "order-1";
/// Its lines, one an item.
const LINES: usize = 3;

/// What [`SlowRecordSync`] saw of the order's endings.
#[derive(Default)]
struct Seen {
    /// The lines' endings appended so far.
    line_ends: usize,
    /// How many of them were appended before the record's ending was durable.
    before_record: Option<usize>,
}

struct Slow {
    in_order: bool,
    /// Longest the record's completion waits for every line's ending to be appended.
    hold: Duration,
    seen: Mutex<Seen>,
    appended: Condvar,
}

/// Says whether it writes in order as told; holds back the completion of the batch with
/// [`ORDER`]'s confirm (its record's ending) until every line's ending is appended, or
/// `hold` passes, and notes how many were appended by then.
#[derive(Clone)]
struct SlowRecordSync(Arc<Slow>);

impl Front for SlowRecordSync {
    fn append(&self, inner: &Arc<LogJournal>, entries: Vec<Entry>, done: AppendDone) {
        let confirms = |record: bool| {
            entries
                .iter()
                .filter(|e| e.op == Op::Confirm && (e.hold_id.as_deref() == Some(ORDER)) == record)
                .count()
        };
        let (lines, record) = (confirms(false), confirms(true));
        if lines > 0 {
            self.0.seen.lock().unwrap().line_ends += lines;
            self.0.appended.notify_all();
        }
        if record == 0 {
            return inner.append(entries, done);
        }
        let slow = self.0.clone();
        inner.append(
            entries,
            Box::new(move |entries, result| {
                // On the writer's thread, as a slow sync would: later batches complete
                // after this one, in the order the journal promises, and are appended
                // meanwhile (its queue has room).
                let seen = slow.seen.lock().unwrap();
                let (mut seen, _) = slow
                    .appended
                    .wait_timeout_while(seen, slow.hold, |s| s.line_ends < LINES)
                    .unwrap();
                seen.before_record = Some(seen.line_ends);
                drop(seen);
                done(entries, result);
            }),
        )
    }

    fn in_order(&self) -> bool {
        self.0.in_order
    }
}

/// Places [`ORDER`] and confirms it on a [`SlowRecordSync`] journal; how many of its
/// lines' endings were appended before its record's ending was durable.
fn confirm_with_a_slow_record_sync(in_order: bool) -> usize {
    let dir = tempfile::tempdir().unwrap();
    actix_rt::System::new().block_on(async move {
        let metrics = Arc::new(Metrics::new());
        let store =
            LogJournal::open(dir.path(), metrics.clone(), Retention::default()).expect("journal");
        let slow = SlowRecordSync(Arc::new(Slow {
            in_order,
            // Waited out only where the lines wait for the record (nothing to see).
            hold: Duration::from_millis(if in_order { 3_000 } else { 300 }),
            seen: Mutex::default(),
            appended: Condvar::new(),
        }));
        let journal = Arc::new(Double {
            inner: store.clone(),
            front: slow.clone(),
        });
        let engine = engine_on(store, journal, metrics);
        let shop: Arc<str> = "s".into();
        let items: Vec<Arc<str>> = (0..LINES).map(|i| format!("sku-{i}").into()).collect();
        engine
            .load(&shop, items.iter().map(|i| (i.clone(), 10)).collect())
            .await
            .expect("load");
        let order = NewOrder {
            order_id: ORDER.into(),
            lines: items
                .iter()
                .map(|item| OrderLine {
                    item: item.clone(),
                    qty: 2,
                })
                .collect(),
            ttl_ms: 60_000,
            buyer: None,
        };
        let Placed::Answer(view) = engine.place_order(&shop, order).await.expect("placed") else {
            panic!("a new order id answered as reused")
        };
        assert_eq!(view.status, "held");
        let Ended::Order { view, op } = engine
            .end_order(&shop, &ORDER.into(), Op::Confirm)
            .await
            .expect("confirmed")
        else {
            panic!("the order is unknown")
        };
        assert_eq!((view.status.as_str(), op), ("confirmed", Op::Confirm));
        let lines: Vec<&str> = view.lines.iter().map(|l| l.status).collect();
        assert_eq!(lines, ["confirmed"; LINES], "every line follows its record");
        for item in &items {
            let state = engine.item(&shop, item).await.unwrap().unwrap();
            assert_eq!((state.stock, state.reserved), (8, 0), "{item}: sold once");
        }
        engine.shutdown().await;
        let seen = slow.0.seen.lock().unwrap();
        assert_eq!(seen.line_ends, LINES, "each line ended once");
        seen.before_record.expect("the record's ending completed")
    })
}

#[test]
fn an_orders_lines_end_before_its_records_sync_only_on_a_journal_that_writes_in_order() {
    assert_eq!(
        confirm_with_a_slow_record_sync(true),
        LINES,
        "in order: the lines' endings were sent on the record's hand-over, not its sync"
    );
    assert_eq!(
        confirm_with_a_slow_record_sync(false),
        0,
        "not in order: the lines' endings waited for the record's sync"
    );
}
