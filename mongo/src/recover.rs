//! Recovery: the snapshots, then every journal entry written after them, each checked
//! as the processor checked it when it wrote it; the snapshots and holds brought up to
//! date; the pending holds, how far the request log is applied, and the ledgers of
//! items with a per-buyer limit.

use std::collections::HashMap;
use std::sync::Arc;

use futures::TryStreamExt;
use mongodb::bson::{doc, Document};
use mongodb::Database;
use nrtxn_actors::verify::Verifier;
use nrtxn_actors::{Entry, HoldView, ItemState, Recovered, StoreError};

use crate::collections::{find_all, fold_ledgers, holds, items, journal, update_now};
use crate::documents::{from_doc, hold_from_doc, hold_updates, storage};
use crate::snapshots::write_snapshots;

type Items = HashMap<(Arc<str>, Arc<str>), ItemState>;

/// The journal after the snapshots, as recovery reads it.
struct Tail {
    /// Its entries of an item (with a seq), in each item's seq order.
    entries: Vec<Entry>,
    /// Its entries that change a hold, in the order read.
    hold_changes: Vec<Entry>,
    /// Per node, the last batch of it read.
    last_batch: HashMap<u32, i64>,
}

pub(crate) async fn recover(db: Database) -> Result<Recovered, StoreError> {
    let snapshot = read_snapshots(&db).await?;
    let tail = read_tail(&db).await?;
    let (states, touched) = replay(snapshot, &tail.entries)?;
    if !touched.is_empty() {
        tracing::info!(
            items = touched.len(),
            "rebuilding snapshots from the journal"
        );
        update_now(&db, "holds", hold_updates(tail.hold_changes.iter())).await?;
        let mut nodes = tail.last_batch.into_iter();
        if let Some((node, batch)) = nodes.next() {
            write_snapshots(&db, touched, node, batch).await?;
        }
        for (node, batch) in nodes {
            write_snapshots(&db, HashMap::new(), node, batch).await?;
        }
    }
    let pending = pending_holds(&db).await?;
    tracing::info!(items = states.len(), "journal recovered");
    Ok(Recovered {
        items: states
            .into_iter()
            .map(|((shop, item), state)| (shop, item, state))
            .collect(),
        log_offsets: log_offsets(&db).await?,
        holds: pending,
        ledgers: limited_ledgers(&db).await?,
    })
}

/// Each item's state as the snapshots (`items`) hold it.
async fn read_snapshots(db: &Database) -> Result<Items, StoreError> {
    let mut states = HashMap::new();
    let mut cursor = items(db).find(doc! {}).await.map_err(storage)?;
    while let Some(d) = cursor.try_next().await.map_err(storage)? {
        let (Ok(shop), Ok(item)) = (d.get_str("shop"), d.get_str("item")) else {
            continue;
        };
        let state = ItemState {
            stock: d.get_i64("stock").map_err(storage)?,
            reserved: d.get_i64("reserved").map_err(storage)?,
            seq: d.get_i64("seq").map_err(storage)? as u64,
            // Snapshots of earlier versions have no window or low-stock level.
            opens_at: d.get_i64("opens_at").unwrap_or(0),
            closes_at: d.get_i64("closes_at").unwrap_or(0),
            low_stock_at: d.get_i64("low_stock_at").unwrap_or(0),
        };
        states.insert((shop.into(), item.into()), state);
    }
    Ok(states)
}

/// The filter of the journal documents after the snapshots: per node, those of its
/// batches past its mark (`snapshot:{node}`; the single `snapshot` of earlier versions
/// stands for the nodes without one).
async fn after_snapshots(db: &Database) -> Result<Document, StoreError> {
    let mut marks: Vec<(i64, i64)> = Vec::new();
    let mut legacy = 0;
    for d in find_all(db.collection("meta"), doc! {}).await? {
        let batch = d.get_i64("batch").unwrap_or(0);
        match d.get_str("_id") {
            Ok("snapshot") => legacy = batch,
            Ok(id) => {
                if let Some(node) = id.strip_prefix("snapshot:").and_then(|n| n.parse().ok()) {
                    marks.push((node, batch));
                }
            }
            Err(_) => {}
        }
    }
    let mut after: Vec<Document> = marks
        .iter()
        .map(|(node, batch)| doc! { "node": node, "batch": { "$gt": batch } })
        .collect();
    let known: Vec<i64> = marks.iter().map(|(n, _)| *n).collect();
    after.push(doc! { "node": { "$nin": known }, "batch": { "$gt": legacy } });
    Ok(doc! { "$or": after })
}

/// The journal's entries after the snapshots.
async fn read_tail(db: &Database) -> Result<Tail, StoreError> {
    let mut cursor = journal(db)
        .find(after_snapshots(db).await?)
        .sort(doc! { "batch": 1, "seq": 1 })
        .await
        .map_err(storage)?;
    let mut tail = Tail {
        entries: Vec::new(),
        hold_changes: Vec::new(),
        last_batch: HashMap::new(),
    };
    while let Some(d) = cursor.try_next().await.map_err(storage)? {
        if let (Ok(node), Ok(batch)) = (d.get_i64("node"), d.get_i64("batch")) {
            let b = tail.last_batch.entry(node as u32).or_insert(batch);
            *b = (*b).max(batch);
        }
        let entry = from_doc(d)?;
        if entry.hold_id.is_some() {
            tail.hold_changes.push(entry.clone());
        }
        if entry.seq.is_some() {
            tail.entries.push(entry);
        }
    }
    // Batch numbers are each node's own: an item that moved between nodes may have its
    // entries in batches out of order, so each item's go in seq order.
    tail.entries
        .sort_by(|a, b| (&a.shop, &a.item, a.seq).cmp(&(&b.shop, &b.item, b.seq)));
    Ok(tail)
}

/// Every item's state: its snapshot moved on by `entries`, each checked as the
/// processor checked it when it wrote it (gapless, never negative, each state following
/// from the last): a journal that fails refuses the start. Also the states of the items
/// the entries moved, whose snapshots are behind.
fn replay(snapshot: Items, entries: &[Entry]) -> Result<(Items, Items), StoreError> {
    let mut verifier = Verifier::new(
        snapshot
            .iter()
            .map(|((shop, item), state)| (shop.clone(), item.clone(), *state)),
    );
    for entry in entries {
        verifier
            .check(entry)
            .map_err(|why| storage(format!("the journal does not add up: {why}")))?;
    }
    let mut states = HashMap::new();
    let mut touched = HashMap::new();
    for (shop, item, state, moved) in verifier.into_items() {
        // What the snapshots say and what recovery made of them: an item the journal
        // did not move is its snapshot, one it moved is past it.
        let snapped = snapshot.get(&(shop.clone(), item.clone()));
        assert!(
            match snapped {
                Some(s) if moved => state.seq > s.seq,
                Some(s) => state == *s,
                None => moved,
            },
            "recovery made item {shop}/{item} {state:?} (moved: {moved}) of its snapshot {snapped:?}"
        );
        if moved {
            touched.insert((shop.clone(), item.clone()), state);
        }
        states.insert((shop, item), state);
    }
    Ok((states, touched))
}

/// The holds still pending.
async fn pending_holds(db: &Database) -> Result<Vec<HoldView>, StoreError> {
    find_all(holds(db), doc! { "status": "held" })
        .await?
        .iter()
        .map(hold_from_doc)
        .collect()
}

/// How far the request log is applied, per partition: in the leases, and in `offsets`
/// as earlier versions kept it.
async fn log_offsets(db: &Database) -> Result<HashMap<i32, i64>, StoreError> {
    let mut log_offsets: HashMap<i32, i64> = HashMap::new();
    for coll in ["leases", "offsets"] {
        for d in find_all(db.collection(coll), doc! {}).await? {
            if let (Ok(p), Ok(o)) = (d.get_i32("_id"), d.get_i64("offset")) {
                let at = log_offsets.entry(p).or_insert(o);
                *at = (*at).max(o);
            }
        }
    }
    Ok(log_offsets)
}

/// The ledgers of the items whose loads ever set a per-buyer limit, folded from their
/// entries (this journal keeps every entry).
async fn limited_ledgers(
    db: &Database,
) -> Result<Vec<(Arc<str>, Arc<str>, nrtxn_actors::ledger::BuyerLedger)>, StoreError> {
    let mut limited: Vec<(Arc<str>, Arc<str>)> = Vec::new();
    for d in find_all(
        journal(db),
        doc! { "op": "load", "per_buyer_max": { "$exists": true } },
    )
    .await?
    {
        let key = (
            Arc::<str>::from(d.get_str("shop").map_err(storage)?),
            Arc::<str>::from(d.get_str("item").map_err(storage)?),
        );
        if !limited.contains(&key) {
            limited.push(key);
        }
    }
    let mut ledgers = Vec::new();
    for ((shop, item), ledger) in limited
        .iter()
        .cloned()
        .zip(fold_ledgers(db, &limited).await?)
    {
        if let Some(l) = ledger {
            ledgers.push((shop, item, l));
        }
    }
    Ok(ledgers)
}
