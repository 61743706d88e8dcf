//! One contract, every journal adapter `serve` uses: the embedded log (`LogJournal`) and
//! MongoDB (against the test server `scripts/test.sh` starts). Each is driven through the
//! journal's ports exactly as the engine drives it, and must answer the same: outcomes
//! by key, item states, events in seq order and by page, holds, the outbox relay's pages
//! and cursor, and after a close and a reopen, the same state recovered.

mod common;

use std::sync::mpsc;
use std::sync::Arc;

use nrtxn_actors::apply::{apply, apply_load};
use nrtxn_actors::OutboxReader::{Alerts, Events};
use nrtxn_actors::{
    Entry, HoldStatus, ItemState, Journal, LoadTerms, Metrics, Op, Request, Status, StoreError,
};
use nrtxn_embedded::journal::{LogJournal, Retention};
use nrtxn_mongo::MongoJournal;

/// Opens (or opens again) one adapter on its store.
type Open = Box<dyn Fn() -> Arc<dyn Journal>>;

const NOW: i64 = 1_800_000_000_000;

fn append(journal: &Arc<dyn Journal>, entries: Vec<Entry>) {
    let (tx, rx) = mpsc::channel();
    journal.append(
        entries,
        Box::new(move |_, result| {
            let _ = tx.send(result);
        }),
    );
    rx.recv().expect("append answered").expect("append durable");
}

fn req(key: &str, op: Op, qty: i64) -> Request {
    Request::new("s".into(), "a".into(), key.into(), op, qty, NOW)
}

/// A sale as `ItemReads::sales` finds it: item, op, status, sold, returned.
type SaleSummary = (String, Op, Status, i64, i64);

/// The contract, on the adapter `open` opens.
fn contract(name: &str, open: Open) {
    let journal = open();
    let (shop, item): (Arc<str>, Arc<str>) = ("s".into(), "a".into());
    let mut state = ItemState::default();
    let load = apply_load(&mut state, &shop, &item, 10, LoadTerms::KEEP, NOW);
    let sold = apply(Some(&mut state), &req("k1", Op::Decrement, 3), NOW, 30_000);
    let refused = apply(
        Some(&mut state),
        &req("k2", Op::Decrement, 100),
        NOW,
        30_000,
    );
    assert_eq!(refused.status, Status::InsufficientStock);
    append(&journal, vec![load, sold, refused]);
    let hold = Request {
        hold_id: Some("h1".into()),
        ttl_ms: 60_000,
        ..req("h1", Op::Hold, 2)
    };
    append(&journal, vec![apply(Some(&mut state), &hold, NOW, 30_000)]);
    assert_eq!(
        state,
        ItemState {
            stock: 5,
            reserved: 2,
            seq: 4,
            ..ItemState::default()
        }
    );

    // Outcomes by key, also from the store itself; an unknown key has none.
    for found in [
        journal.outcomes("s", &["k1", "k2", "nope"]).unwrap(),
        journal.decided("s", &["k1", "k2", "nope"]).unwrap(),
    ] {
        let summary: Vec<_> = found
            .iter()
            .map(|o| o.as_ref().map(|o| (o.status, o.seq)))
            .collect();
        assert_eq!(
            summary,
            [
                Some((Status::Ok, Some(2))),
                Some((Status::InsufficientStock, Some(3))),
                None
            ],
            "{name}: outcomes"
        );
    }
    assert_eq!(
        journal.outcomes("other", &["k1"]).unwrap(),
        [None],
        "{name}: keys are per shop"
    );

    // Item states as the last entry has them.
    let states = journal
        .item_states(&[(shop.clone(), item.clone()), (shop.clone(), "zz".into())])
        .unwrap();
    assert_eq!(states, [Some(state), None], "{name}: item states");

    // Events in seq order, paged.
    let events = journal.events("s", "a", 0, 100).unwrap();
    let seqs: Vec<u64> = events.iter().map(|e| e.seq).collect();
    assert_eq!(seqs, [1, 2, 3, 4], "{name}: events");
    let kinds: Vec<Op> = events.iter().map(|e| e.kind).collect();
    assert_eq!(
        kinds,
        [Op::Load, Op::Decrement, Op::Decrement, Op::Hold],
        "{name}"
    );
    let page = journal.events("s", "a", 1, 1).unwrap();
    assert_eq!(
        page.iter().map(|e| e.seq).collect::<Vec<_>>(),
        [2],
        "{name}: a page"
    );

    // Holds by id.
    let holds = journal.holds("s", &["h1", "nope"]).unwrap();
    let h = holds[0]
        .as_ref()
        .unwrap_or_else(|| panic!("{name}: hold h1"));
    assert_eq!(
        (h.status, h.qty, h.seq),
        (HoldStatus::Held, 2, 4),
        "{name}: hold"
    );
    assert!(holds[1].is_none(), "{name}");
    // A journal every node writes (MongoDB) finds the pending holds of items taken over.
    if name == "mongodb" {
        let pending = journal
            .pending_holds(&[(shop.clone(), item.clone())])
            .unwrap();
        assert_eq!(pending.len(), 1, "{name}: pending holds");
    }

    // The outbox relay: every event once, in commit order; the cursor is kept.
    let first = journal.relay_read(0, 100).unwrap();
    let relayed: Vec<u64> = first.events.iter().map(|e| e.seq).collect();
    assert_eq!(relayed, [1, 2, 3, 4], "{name}: relay page");
    assert_eq!(
        journal.relay_cursor(Events).unwrap(),
        None,
        "{name}: no cursor yet"
    );
    journal.relay_save(Events, first.next).unwrap();
    assert_eq!(
        journal.relay_cursor(Events).unwrap(),
        Some(first.next),
        "{name}"
    );
    // Each reader keeps its own cursor.
    assert_eq!(
        journal.relay_cursor(Alerts).unwrap(),
        None,
        "{name}: alerts"
    );
    journal.relay_save(Alerts, 1).unwrap();
    let after = journal.relay_read(first.next, 100).unwrap();
    assert!(after.events.is_empty(), "{name}: relay read past its end");

    // Closed and opened again: the same state, the same answers.
    journal.close();
    drop(journal);
    let journal = open();
    let recovered = journal.recover().unwrap();
    let items: Vec<_> = recovered
        .items
        .iter()
        .map(|(s, i, st)| (s.to_string(), i.to_string(), *st))
        .collect();
    assert_eq!(
        items,
        [("s".into(), "a".into(), state)],
        "{name}: recovered"
    );
    assert_eq!(
        recovered
            .holds
            .iter()
            .map(|h| h.hold_id.to_string())
            .collect::<Vec<_>>(),
        ["h1"],
        "{name}: pending holds recovered"
    );
    let found = journal.outcomes("s", &["k1"]).unwrap();
    assert_eq!(found[0].as_ref().map(|o| o.seq), Some(Some(2)), "{name}");
    assert_eq!(
        journal.relay_cursor(Events).unwrap(),
        Some(first.next),
        "{name}"
    );
    assert_eq!(
        journal.relay_cursor(Alerts).unwrap(),
        Some(1),
        "{name}: alerts kept"
    );

    // Returns: what a sale sold and the units returned against it, as the
    // journal holds them, also after a close and a reopen.
    let b: Arc<str> = "b".into();
    let mut state_b = ItemState::default();
    let on_b = |key: &str, op: Op, qty: i64| Request {
        item: b.clone(),
        ..req(key, op, qty)
    };
    let load_b = apply_load(&mut state_b, &shop, &b, 10, LoadTerms::KEEP, NOW);
    let sale_b = apply(
        Some(&mut state_b),
        &on_b("kb", Op::Decrement, 3),
        NOW,
        30_000,
    );
    let returned = Request {
        return_of: Some("kb".into()),
        ..on_b("r1", Op::Increment, 2)
    };
    let returned = apply(Some(&mut state_b), &returned, NOW, 30_000);
    assert_eq!(returned.return_of.as_deref(), Some("kb"));
    let refused = nrtxn_actors::apply::reject(
        &mut state_b,
        &Request {
            return_of: Some("kb".into()),
            ..on_b("r2", Op::Increment, 2)
        },
        NOW,
        Status::ReturnRefused,
        "sale kb sold 3 and 2 were returned already".into(),
    );
    append(&journal, vec![load_b, sale_b, returned, refused]);
    let summary = |journal: &Arc<dyn Journal>| -> Vec<Option<SaleSummary>> {
        journal
            .sales("s", &["kb", "k1", "k2", "nope", "r1"])
            .unwrap()
            .into_iter()
            .map(|r| r.map(|r| (r.item.to_string(), r.op, r.status, r.sold, r.returned)))
            .collect()
    };
    let expected = vec![
        Some(("b".to_string(), Op::Decrement, Status::Ok, 3, 2)),
        Some(("a".to_string(), Op::Decrement, Status::Ok, 3, 0)),
        Some((
            "a".to_string(),
            Op::Decrement,
            Status::InsufficientStock,
            100,
            0,
        )),
        None,
        Some(("b".to_string(), Op::Increment, Status::Ok, 2, 0)),
    ];
    assert_eq!(summary(&journal), expected, "{name}: sales");
    assert_eq!(
        journal.outcomes("s", &["r2"]).unwrap()[0]
            .as_ref()
            .map(|o| o.status),
        Some(Status::ReturnRefused),
        "{name}: a refused return is journaled"
    );
    journal.close();
    drop(journal);
    let journal = open();
    journal.recover().unwrap();
    assert_eq!(summary(&journal), expected, "{name}: sales after a reopen");
    journal.close();
}

fn metrics() -> Arc<Metrics> {
    Arc::new(Metrics::new())
}

#[test]
fn the_embedded_log_keeps_the_contract() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().to_path_buf();
    contract(
        "log",
        Box::new(move || {
            LogJournal::open(&path, metrics(), Retention::default()).unwrap() as Arc<dyn Journal>
        }),
    );
}

#[test]
fn the_mongodb_journal_keeps_the_contract() {
    let Some(uri) = common::mongo_uri("contract") else {
        return;
    };
    let open_uri = uri.clone();
    contract(
        "mongodb",
        Box::new(move || {
            MongoJournal::open(&open_uri, 0, 64, metrics()).unwrap() as Arc<dyn Journal>
        }),
    );
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(common::drop_database(&uri));
}

/// A closed journal refuses what comes after, and says so.
#[test]
fn a_closed_journal_answers_closed() {
    let dir = tempfile::tempdir().unwrap();
    let journal: Arc<dyn Journal> =
        LogJournal::open(dir.path(), metrics(), Retention::default()).unwrap();
    journal.close();
    let (tx, rx) = mpsc::channel();
    journal.append(
        Vec::new(),
        Box::new(move |_, result| {
            let _ = tx.send(result);
        }),
    );
    assert!(matches!(rx.recv().unwrap(), Err(StoreError::Closed)));
}

/// The embedded journal's views are derived from its log: rebuilt from it (the views
/// file lost), they count the same returned units.
#[test]
fn returned_units_are_rebuilt_from_the_log_with_the_views() {
    let dir = tempfile::tempdir().unwrap();
    let journal: Arc<dyn Journal> =
        LogJournal::open(dir.path(), metrics(), Retention::default()).unwrap();
    let (shop, item): (Arc<str>, Arc<str>) = ("s".into(), "a".into());
    let mut state = ItemState::default();
    let load = apply_load(&mut state, &shop, &item, 10, LoadTerms::KEEP, NOW);
    let sale = apply(Some(&mut state), &req("k1", Op::Decrement, 4), NOW, 30_000);
    let give_back = Request {
        return_of: Some("k1".into()),
        ..req("r1", Op::Increment, 3)
    };
    let give_back = apply(Some(&mut state), &give_back, NOW, 30_000);
    append(&journal, vec![load, sale, give_back]);
    journal.close();
    drop(journal);
    for name in ["nrtxn.db", "nrtxn.db-wal", "nrtxn.db-shm"] {
        let _ = std::fs::remove_file(dir.path().join(name));
    }
    let journal: Arc<dyn Journal> =
        LogJournal::open(dir.path(), metrics(), Retention::default()).unwrap();
    let sale = journal.sales("s", &["k1"]).unwrap()[0]
        .clone()
        .expect("sale k1");
    assert_eq!((sale.sold, sale.returned), (4, 3));
    journal.close();
}

/// The stock alerts' reader follows the outbox by its cursor, a page at a time, and
/// finds every crossing once, in order. The embedded log answers it from what its views
/// hold at the moment, with no wait for them (a wait would end the views' linger early
/// at every poll): a read may come back short, and the next goes on from its cursor.
#[test]
fn the_alerts_reader_follows_every_crossing_once_in_order() {
    let dir = tempfile::tempdir().unwrap();
    let journal: Arc<dyn Journal> =
        LogJournal::open(dir.path(), metrics(), Retention::default()).unwrap();
    let (shop, item): (Arc<str>, Arc<str>) = ("s".into(), "a".into());
    let mut state = ItemState::default();
    let load = apply_load(&mut state, &shop, &item, 2, LoadTerms::KEEP, NOW);
    let sale = apply(Some(&mut state), &req("k1", Op::Decrement, 2), NOW, 30_000);
    let sold_out = nrtxn_actors::apply::crossing(&mut state, &sale).expect("sold out");
    let back = apply(Some(&mut state), &req("k2", Op::Increment, 1), NOW, 30_000);
    let in_stock = nrtxn_actors::apply::crossing(&mut state, &back).expect("back in stock");
    append(&journal, vec![load, sale, sold_out, back, in_stock]);
    let kinds = [Op::SoldOut, Op::LowStock, Op::BackInStock];
    let (mut cursor, mut found) = (0, Vec::new());
    let until = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while found.len() < 2 && std::time::Instant::now() < until {
        let page = journal.relay_read_kinds(cursor, 1, &kinds).unwrap();
        assert!(page.next >= cursor, "the cursor went back");
        cursor = page.next;
        found.extend(page.events.iter().map(|e| (e.kind.as_str(), e.seq)));
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    assert_eq!(found, [("sold_out", 3), ("back_in_stock", 5)]);
    let past = journal.relay_read_kinds(cursor, 1, &kinds).unwrap();
    assert!(
        past.events.is_empty(),
        "read past the end: {:?}",
        past.events
    );
    journal.close();
}

/// Fire-and-forget requests on the embedded log: an acceptance and its decision often
/// share a group commit, and then only the decision is written. Whichever way each
/// request went, after a reopen the decided ones are not pending (not decided twice)
/// and the undecided ones are (not lost).
#[test]
fn accepted_requests_are_pending_after_a_reopen_until_decided() {
    let dir = tempfile::tempdir().unwrap();
    let log = LogJournal::open(dir.path(), metrics(), Retention::default()).unwrap();
    let journal: Arc<dyn Journal> = log.clone();
    let (shop, item): (Arc<str>, Arc<str>) = ("s".into(), "a".into());
    let mut state = ItemState::default();
    let load = apply_load(&mut state, &shop, &item, 1_000, LoadTerms::KEEP, NOW);
    append(&journal, vec![load]);
    let mut answers = Vec::new();
    let mut undecided = Vec::new();
    for round in 0..50 {
        let reqs: Vec<Request> = (0..4)
            .map(|i| Request {
                logged: true,
                ..req(&format!("f{round}-{i}"), Op::Decrement, 1)
            })
            .collect();
        let (tx, rx) = mpsc::channel();
        log.accept(
            reqs.clone(),
            Box::new(move |r| {
                let _ = tx.send(r);
            }),
        );
        answers.push(rx);
        // Three of the four are decided at once (as a processor does), the fourth never.
        let entries: Vec<Entry> = reqs[..3]
            .iter()
            .map(|r| apply(Some(&mut state), r, NOW, 30_000))
            .collect();
        let (tx, rx) = mpsc::channel();
        journal.append(
            entries,
            Box::new(move |_, r| {
                let _ = tx.send(r);
            }),
        );
        answers.push(rx);
        undecided.push(reqs[3].key.to_string());
    }
    for rx in answers {
        rx.recv().unwrap().expect("durable");
    }
    journal.close();
    drop((journal, log));
    let log = LogJournal::open(dir.path(), metrics(), Retention::default()).unwrap();
    let pending: Vec<String> = log
        .pending()
        .unwrap()
        .iter()
        .map(|r| r.key.to_string())
        .collect();
    assert_eq!(pending, undecided);
    let journal: Arc<dyn Journal> = log;
    let states = journal.item_states(&[(shop, item)]).unwrap();
    assert_eq!(states[0].map(|s| s.stock), Some(1_000 - 150));
    journal.close();
}
