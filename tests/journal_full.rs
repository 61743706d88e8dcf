//! A journal whose queue is full holds the processor back; it never loses a batch
//! (issue 11, the MongoDB writer queue). The MongoDB journal's queue is sized at start so
//! that it cannot fill (shards × batches in flight), so `Full` cannot be produced for
//! real: this test wraps the embedded journal (`LogJournal`) in a double that answers
//! `Full` to every third append, as a broken bound would, and checks that every request
//! is still decided once, answered, and journaled with a gapless seq.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use nrtxn_actors::ports::{AppendDone, HoldPage, HoldQuery, ItemPage, Recovered, RelayPage};
use nrtxn_actors::ports::{
    ItemReads, JournalWrite, Lifecycle, Outbox, OutboxReader, Outcomes, Sharing,
};
use nrtxn_actors::{
    now_ms, Engine, EngineConfig, Event, HoldView, ItemState, Metrics, Op, Outcome, Reply, Request,
    RequestLog, Status, StoreError,
};
use nrtxn_embedded::journal::{LogJournal, Retention};
use nrtxn_embedded::request_log::EmbeddedLog;

/// The real journal, except that every third append is refused with `Full` before it
/// returns, having kept nothing (the fault double).
struct FullEveryThird {
    inner: Arc<LogJournal>,
    appends: AtomicUsize,
    refused: AtomicUsize,
}

impl JournalWrite for FullEveryThird {
    fn append(&self, entries: Vec<nrtxn_actors::Entry>, done: AppendDone) {
        if self.appends.fetch_add(1, Ordering::Relaxed) % 3 == 2 {
            self.refused.fetch_add(1, Ordering::Relaxed);
            return done(entries, Err(StoreError::Full));
        }
        self.inner.append(entries, done)
    }
}

impl Outcomes for FullEveryThird {
    fn outcomes(&self, shop: &str, keys: &[&str]) -> Result<Vec<Option<Outcome>>, StoreError> {
        self.inner.outcomes(shop, keys)
    }
}

impl ItemReads for FullEveryThird {
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
impl Sharing for FullEveryThird {}

impl Outbox for FullEveryThird {
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

impl Lifecycle for FullEveryThird {
    fn recover(&self) -> Result<Recovered, StoreError> {
        self.inner.recover()
    }

    fn close(&self) {
        self.inner.close()
    }
}

#[test]
fn a_full_journal_queue_holds_batches_back_and_loses_none() {
    let dir = tempfile::tempdir().unwrap();
    actix_rt::System::new().block_on(async move {
        let metrics = Arc::new(Metrics::new());
        let store =
            LogJournal::open(dir.path(), metrics.clone(), Retention::default()).expect("journal");
        let journal = Arc::new(FullEveryThird {
            inner: store.clone(),
            appends: AtomicUsize::new(0),
            refused: AtomicUsize::new(0),
        });
        let engine = Engine::start(
            EngineConfig {
                shards: 2,
                ..EngineConfig::default()
            },
            journal.clone(),
            move |d, _| Arc::new(EmbeddedLog::new(store, d, true)) as Arc<dyn RequestLog>,
            metrics,
        )
        .expect("engine");
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
            journal.refused.load(Ordering::Relaxed) > 0,
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
