//! The MongoDB journal (`--mongo-uri`): the `Journal` port on a MongoDB replica set.
//!
//! Collections (database from the URI's path, else `nrtxn`):
//! - `journal`: one document per decision or load, the entry's fields plus `batch` (the
//!   writer's batch number, for recovery), `node` (the id of the node that wrote it, for
//!   that node's outbox relay), `epoch` (the partition lease it was written under) and
//!   `fingerprint` (of the request's op, item, quantity and TTL, checked on every
//!   read). Unique indexes on `(shop, request_key)` for documents with a key and on
//!   `(shop, item, seq)` for documents with a sequence, so every document is covered by
//!   one and a retried batch can never insert twice. A return carries `return_of` (the
//!   sale it gives back), summed through the partial index `shop_return_of` on
//!   `(shop, return_of)` ([`nrtxn_actors::returns`]).
//! - `leases`: `{_id: partition, epoch, node, offset}` per request-log partition: the
//!   node holding its write lease, under which epoch, and how far the log is applied.
//! - `items`: the snapshot of each item (`shop, item, stock, reserved, seq`), unique on
//!   `(shop, item)`, moved forward at most every second; the item listing reads the
//!   journal from each snapshot's seq on.
//! - `meta`: `{_id: "snapshot:{node}", batch}`: every batch of node `node` up to this
//!   one is in `items`; `{_id: "relay:{node}", batch}`: the outbox relay of node `node`
//!   published every event of that node's batches up to this one (`alerts:{node}`: its
//!   stock alerts were sent).
//! - `holds`: one document per hold (`shop, hold_id, item, qty, expires_at, status,
//!   seq`), unique on `(shop, hold_id)`.
//!
//! One writer task takes the waiting batches (up to [`writer::TXN_ENTRIES_MAX`]
//! entries) into one transaction: the journal documents, the holds they change, and the
//! fence: each partition's lease must still be at the epoch its entries were read under
//! (several nodes; see [`Leases`]). Then it answers. Entries of a partition whose lease moved on
//! are refused whole ([`StoreError::Fenced`]), the rest written. Snapshots follow off the
//! answer path; recovery replays the journal after them. Only operations that MongoDB
//! 6 and 7 support on a replica set are used.
//!
//! Where things are: [`MongoJournal`] and the ports it serves here; the writer task in
//! `writer` and one transaction's statements in `txn`; recovery in `recover`; what a
//! document holds in `documents`, the collections and the commands on many documents
//! in `collections`, their indexes in `indexes`; the snapshots in `snapshots`, the
//! writer's recorded session in `sessions`; the write and read concerns in `concern`.

mod collections;
mod concern;
mod documents;
mod indexes;
mod recover;
mod sessions;
mod snapshots;
mod txn;
mod writer;

use std::collections::HashMap;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{mpsc as std_mpsc, Arc, Mutex};
use std::time::Duration;

use futures::TryStreamExt;
use mongodb::bson::{doc, Bson, Document};
use mongodb::Database;
use nrtxn_actors::ledger::BuyerLedger;
use nrtxn_actors::ports::{
    HoldPage, HoldQuery, ItemPage, ItemReads, JournalWrite, Lifecycle, Outbox, OutboxReader,
    Outcomes, Sharing,
};
use nrtxn_actors::returns::SaleRecord;
use nrtxn_actors::{
    AppendDone, Entry, Event, HoldView, ItemState, Leases, Metrics, Outcome, Recovered, RelayPage,
    StoreError, INTERNAL_ITEMS_END, INTERNAL_ITEM_PREFIX,
};
use nrtxn_log::keyfilter::KeyFilter;
use tokio::sync::mpsc;

use crate::collections::{collect, find_all, fold_ledgers, holds, items, journal, leases};
use crate::documents::{from_doc, hold_from_doc, storage};
use crate::indexes::create_indexes;
use crate::sessions::end_writer_session;
use crate::writer::{Command, Writer};

pub use crate::collections::is_duplicate;
pub use crate::concern::{durable_read_concern, durable_write_concern};

/// Batches waiting for the writer at least; [`MongoJournal::open`] sizes the queue to
/// the appends the processors can have outstanding in all (shards × batches in flight
/// each), so a full queue is a broken bound, never a normal state.
const QUEUE_MIN: usize = 1024;

pub struct MongoJournal {
    /// The driver's own runtime: the callers are actix threads, which run runtimes of
    /// their own and cannot block on another one. An `Option` so `Drop` can shut it down
    /// without blocking.
    rt: Option<tokio::runtime::Runtime>,
    db: Database,
    tx: mpsc::Sender<Command>,
    keys: Arc<KeyFilter>,
    /// Per log partition, the offset from which entries may appear that the key filter
    /// has not seen (see `learn_partition`); absent: from the start.
    learned_from: Mutex<HashMap<i32, i64>>,
    closed: Mutex<bool>,
    /// This node's id, written in each document for this node's outbox relay.
    node: u32,
    /// The last batch this node's writer completed: the relay reads no further, since
    /// an `insert_many` in progress is visible document by document.
    written_batch: Arc<AtomicI64>,
}

impl MongoJournal {
    /// Connects, creates the indexes if missing, and starts the writer.
    /// `appends_in_flight_max`: the most appends the processors can have outstanding at
    /// once (shards × batches in flight per shard); the writer's queue holds at least
    /// that many, so an append is never refused for room.
    pub fn open(
        uri: &str,
        node: u32,
        appends_in_flight_max: usize,
        metrics: Arc<Metrics>,
    ) -> Result<Arc<MongoJournal>, StoreError> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("journal-mongo")
            .enable_all()
            .build()
            .map_err(storage)?;
        let uri = uri.to_string();
        let (db, keys, next_batch) = block_on(&rt, async move {
            let db = connect(&uri).await?;
            create_indexes(&db).await?;
            // A transaction this node's previous process left open (killed in it) ends
            // now, not at the server's transaction lifetime.
            end_writer_session(&db, node).await?;
            let keys = known_keys(&db).await?;
            let next_batch = last_batch(&db).await? + 1;
            Ok::<_, StoreError>((db, keys, next_batch))
        })?;
        // One more than the appends in flight, for the `Close` command.
        let (tx, rx) = mpsc::channel(QUEUE_MIN.max(appends_in_flight_max + 1));
        let written_batch = Arc::new(AtomicI64::new(next_batch - 1));
        let writer = Writer::new(
            db.clone(),
            metrics,
            keys.clone(),
            next_batch,
            node,
            written_batch.clone(),
        );
        rt.spawn(writer.run(rx));
        Ok(Arc::new(MongoJournal {
            rt: Some(rt),
            db,
            tx,
            keys,
            learned_from: Mutex::new(HashMap::new()),
            closed: Mutex::new(false),
            node,
            written_batch,
        }))
    }

    /// The outcomes of `keys`, of which only `maybe` can be in the journal.
    fn find_outcomes(
        &self,
        shop: &str,
        keys: &[&str],
        maybe: Vec<String>,
    ) -> Result<Vec<Option<Outcome>>, StoreError> {
        if maybe.is_empty() {
            return Ok(vec![None; keys.len()]);
        }
        let coll = journal(&self.db);
        let shop_owned = shop.to_string();
        let found: HashMap<String, Outcome> = self.wait(async move {
            let mut cursor = coll
                .find(doc! { "shop": shop_owned, "request_key": { "$in": maybe } })
                .await
                .map_err(storage)?;
            let mut found = HashMap::new();
            while let Some(d) = cursor.try_next().await.map_err(storage)? {
                if let Some(o) = from_doc(d)?.outcome() {
                    found.insert(o.request_key.to_string(), o);
                }
            }
            Ok(found)
        })?;
        Ok(keys.iter().map(|k| found.get(*k).cloned()).collect())
    }

    /// Runs `fut` on the adapter's runtime and waits for it from a synchronous caller
    /// (an actor's thread, which runs a runtime of its own and so cannot `block_on`).
    fn wait<T: Send + 'static>(
        &self,
        fut: impl std::future::Future<Output = Result<T, StoreError>> + Send + 'static,
    ) -> Result<T, StoreError> {
        match &self.rt {
            Some(rt) => block_on(rt, fut),
            None => Err(StoreError::Closed),
        }
    }
}

impl Drop for MongoJournal {
    fn drop(&mut self) {
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
    }
}

/// Runs `fut` on `rt` and waits for it with a plain channel, which works from any thread.
fn block_on<T: Send + 'static>(
    rt: &tokio::runtime::Runtime,
    fut: impl std::future::Future<Output = Result<T, StoreError>> + Send + 'static,
) -> Result<T, StoreError> {
    let (tx, rx) = std_mpsc::channel();
    rt.spawn(async move {
        let _ = tx.send(fut.await);
    });
    rx.recv().map_err(|_| StoreError::Closed)?
}

/// The journal's database on the replica set at `uri` (its path, else `nrtxn`), its
/// client asking for durable writes and reads unless the URI names its own (then said).
async fn connect(uri: &str) -> Result<Database, StoreError> {
    let mut options = mongodb::options::ClientOptions::parse(uri)
        .await
        .map_err(storage)?;
    if let Some(weaker) = durable_write_concern(&mut options) {
        tracing::warn!("{weaker}");
    }
    if let Some(weaker) = durable_read_concern(&mut options) {
        tracing::warn!("{weaker}");
    }
    let client = mongodb::Client::with_options(options).map_err(storage)?;
    Ok(client
        .default_database()
        .unwrap_or_else(|| client.database("nrtxn")))
}

/// Every request key in the journal, in a new key filter.
async fn known_keys(db: &Database) -> Result<Arc<KeyFilter>, StoreError> {
    let keys = Arc::new(KeyFilter::new());
    insert_keys(db, doc! { "request_key": { "$type": "string" } }, &keys).await?;
    Ok(keys)
}

/// Adds to `keys` the shop and request key of every journal entry `filter` finds.
async fn insert_keys(db: &Database, filter: Document, keys: &KeyFilter) -> Result<(), StoreError> {
    let mut cursor = journal(db)
        .find(filter)
        .projection(doc! { "_id": 0, "shop": 1, "request_key": 1 })
        .await
        .map_err(storage)?;
    while let Some(d) = cursor.try_next().await.map_err(storage)? {
        if let (Ok(shop), Ok(key)) = (d.get_str("shop"), d.get_str("request_key")) {
            keys.insert(shop, key);
        }
    }
    Ok(())
}

/// The highest batch number in the journal, any node's; 0 when it is empty.
async fn last_batch(db: &Database) -> Result<i64, StoreError> {
    let last = journal(db)
        .find_one(doc! {})
        .sort(doc! { "batch": -1 })
        .await
        .map_err(storage)?;
    Ok(last.and_then(|d| d.get_i64("batch").ok()).unwrap_or(0))
}

impl Leases for MongoJournal {
    /// Per partition, one `findAndModify`: the lease's epoch raised by one, this node
    /// named as its holder. Before that, the session of each other node that held one
    /// of them is ended, so a transaction it left open (it stalled in one) no longer
    /// holds keys this node is about to write; whatever it writes after finds the epoch
    /// moved and is refused.
    fn take(&self, partitions: &[i32]) -> Result<Vec<u64>, StoreError> {
        let db = self.db.clone();
        let (me, partitions) = (self.node, partitions.to_vec());
        let node = me as i64;
        self.wait(async move {
            let held = find_all(leases(&db), doc! { "_id": { "$in": partitions.clone() } }).await?;
            let mut others: Vec<u32> = held
                .iter()
                .filter_map(|d| d.get_i64("node").ok())
                .map(|n| n as u32)
                .filter(|n| *n != me)
                .collect();
            others.sort_unstable();
            others.dedup();
            for other in others {
                end_writer_session(&db, other).await?;
            }
            let mut epochs = Vec::with_capacity(partitions.len());
            for p in partitions {
                let before = held
                    .iter()
                    .find(|d| d.get_i32("_id").ok() == Some(p))
                    .and_then(|d| d.get_i64("epoch").ok())
                    .unwrap_or(0);
                let lease = leases(&db)
                    .find_one_and_update(
                        doc! { "_id": p },
                        doc! { "$inc": { "epoch": 1_i64 }, "$set": { "node": node } },
                    )
                    .upsert(true)
                    .return_document(mongodb::options::ReturnDocument::After)
                    .await
                    .map_err(storage)?
                    .ok_or_else(|| storage("lease upsert returned no document"))?;
                let epoch = lease.get_i64("epoch").map_err(storage)?;
                // A lease taken is at an epoch no writer before held it under: the
                // fence of every write rests on it.
                assert!(
                    epoch > before,
                    "lease of partition {p} taken at epoch {epoch}, not past {before}"
                );
                epochs.push(epoch as u64);
            }
            Ok(epochs)
        })
    }
}

impl JournalWrite for MongoJournal {
    fn append(&self, entries: Vec<Entry>, done: AppendDone) {
        if let Err(e) = self.tx.try_send(Command::Append(entries, done)) {
            // The queue is sized for every append the processors can have outstanding,
            // so `Full` is a broken bound; it is still only back-pressure: the processor
            // keeps the batch and sends it again, before anything after it.
            let (error, command) = match e {
                mpsc::error::TrySendError::Full(c) => (StoreError::Full, c),
                mpsc::error::TrySendError::Closed(c) => (StoreError::Closed, c),
            };
            if let Command::Append(entries, done) = command {
                done(entries, Err(error));
            }
        }
    }
}

impl Outcomes for MongoJournal {
    /// What [`Outcomes::outcomes`] answers: this node's writes (the processors check
    /// every key against the store itself).
    fn surely_new(&self, shop: &str, keys: &[&str]) -> bool {
        !keys.iter().any(|k| self.keys.may_contain(shop, k))
    }

    fn outcomes(&self, shop: &str, keys: &[&str]) -> Result<Vec<Option<Outcome>>, StoreError> {
        let maybe: Vec<String> = keys
            .iter()
            .filter(|k| self.keys.may_contain(shop, k))
            .map(|k| k.to_string())
            .collect();
        self.find_outcomes(shop, keys, maybe)
    }

    fn decided(&self, shop: &str, keys: &[&str]) -> Result<Vec<Option<Outcome>>, StoreError> {
        // Other nodes write this journal too: the filter knows only this node's keys.
        let all = keys.iter().map(|k| k.to_string()).collect();
        self.find_outcomes(shop, keys, all)
    }
}

impl ItemReads for MongoJournal {
    fn item_states(
        &self,
        wanted: &[(Arc<str>, Arc<str>)],
    ) -> Result<Vec<Option<ItemState>>, StoreError> {
        let coll = journal(&self.db);
        let wanted: Vec<(String, String)> = wanted
            .iter()
            .map(|(s, i)| (s.to_string(), i.to_string()))
            .collect();
        self.wait(async move {
            let mut out = Vec::with_capacity(wanted.len());
            for (shop, item) in wanted {
                // The item's last entry, through the unique index on shop, item and seq.
                let last = coll
                    .find_one(doc! { "shop": shop, "item": item, "seq": { "$type": "number" } })
                    .sort(doc! { "shop": 1, "item": 1, "seq": -1 })
                    .await
                    .map_err(storage)?;
                out.push(match last {
                    Some(d) => from_doc(d)?.state_after(),
                    None => None,
                });
            }
            Ok(out)
        })
    }

    fn item_page(
        &self,
        shop: &str,
        after: Option<&str>,
        limit: usize,
    ) -> Result<ItemPage, StoreError> {
        let db = self.db.clone();
        let shop = shop.to_string();
        let after = after.unwrap_or("").to_string();
        self.wait(async move {
            let mut names = page_names(&db, &shop, &after, limit).await?;
            let more = names.len() > limit;
            names.truncate(limit);
            let mut lasts = last_entries(&db, &shop, &names).await?;
            let mut page = ItemPage {
                more,
                ..ItemPage::default()
            };
            for name in names {
                let last = lasts.remove(&name).map(from_doc).transpose()?;
                if let Some(state) = last.and_then(|e| e.state_after()) {
                    page.items.push((name.as_str().into(), state));
                }
            }
            Ok(page)
        })
    }

    /// The keyed entries (this journal is never pruned, so a sale is there for as long
    /// as it is returnable), and the units of ok returns journaled against them, summed
    /// through the index on shop and `return_of`.
    fn sales(&self, shop: &str, keys: &[&str]) -> Result<Vec<Option<SaleRecord>>, StoreError> {
        let coll = journal(&self.db);
        let shop_owned = shop.to_string();
        let asked: Vec<String> = keys.iter().map(|k| k.to_string()).collect();
        let found: HashMap<String, SaleRecord> = self.wait(async move {
            let mut found = HashMap::new();
            let mut cursor = coll
                .find(doc! { "shop": &shop_owned, "request_key": { "$in": &asked } })
                .await
                .map_err(storage)?;
            while let Some(d) = cursor.try_next().await.map_err(storage)? {
                let e = from_doc(d)?;
                if let Some(key) = &e.request_key {
                    found.insert(
                        key.to_string(),
                        SaleRecord {
                            item: e.item.clone(),
                            op: e.op,
                            status: e.status,
                            sold: e.qty,
                            decided_at: e.completed_at,
                            returned: 0,
                        },
                    );
                }
            }
            if found.is_empty() {
                return Ok(found);
            }
            let mut sums = coll
                .aggregate([
                    doc! { "$match": {
                        "shop": &shop_owned,
                        "return_of": { "$in": &asked },
                        "op": "increment",
                        "status": "ok",
                    } },
                    doc! { "$group": { "_id": "$return_of", "units": { "$sum": "$qty" } } },
                ])
                .await
                .map_err(storage)?;
            while let Some(d) = sums.try_next().await.map_err(storage)? {
                let units = match d.get("units") {
                    Some(Bson::Int64(n)) => *n,
                    Some(Bson::Int32(n)) => i64::from(*n),
                    other => return Err(storage(format!("returned units {other:?}"))),
                };
                if let Some(r) = d.get_str("_id").ok().and_then(|k| found.get_mut(k)) {
                    r.returned = units;
                }
            }
            Ok(found)
        })?;
        Ok(keys.iter().map(|k| found.get(*k).cloned()).collect())
    }

    fn ledgers(
        &self,
        items: &[(Arc<str>, Arc<str>)],
    ) -> Result<Vec<Option<BuyerLedger>>, StoreError> {
        let (db, items) = (self.db.clone(), items.to_vec());
        self.wait(async move { fold_ledgers(&db, &items).await })
    }

    fn hold_page(
        &self,
        shop: &str,
        query: &HoldQuery,
        after: Option<&str>,
        limit: usize,
    ) -> Result<HoldPage, StoreError> {
        let mut filter = doc! { "shop": shop, "hold_id": { "$gt": after.unwrap_or("") } };
        // Order items sort between `~orders/` and the byte after `/`.
        let order_items = doc! { "$gte": nrtxn_actors::ORDER_ITEM_PREFIX, "$lt": "~orders0" };
        match (&query.item, query.orders) {
            (Some(item), _) => filter.insert("item", &**item),
            (None, true) => filter.insert("item", order_items),
            (None, false) => filter.insert("item", doc! { "$not": order_items }),
        };
        if let Some(buyer) = &query.buyer {
            filter.insert("buyer", &**buyer);
        }
        if let Some(status) = query.status {
            filter.insert("status", status.as_str());
        }
        let coll = holds(&self.db);
        let docs = self.wait(async move {
            collect(
                coll.find(filter)
                    .sort(doc! { "hold_id": 1 })
                    .limit(limit as i64 + 1),
            )
            .await
        })?;
        let mut holds = docs
            .iter()
            .map(hold_from_doc)
            .collect::<Result<Vec<_>, _>>()?;
        let more = holds.len() > limit;
        holds.truncate(limit);
        Ok(HoldPage { holds, more })
    }

    fn holds(&self, shop: &str, hold_ids: &[&str]) -> Result<Vec<Option<HoldView>>, StoreError> {
        let filter = doc! { "shop": shop, "hold_id": { "$in": hold_ids.to_vec() } };
        let found = self.wait(find_all(holds(&self.db), filter))?;
        let mut by_id = HashMap::new();
        for d in &found {
            let h = hold_from_doc(d)?;
            by_id.insert(h.hold_id.to_string(), h);
        }
        Ok(hold_ids.iter().map(|id| by_id.remove(*id)).collect())
    }

    fn events(
        &self,
        shop: &str,
        item: &str,
        after: u64,
        limit: usize,
    ) -> Result<Vec<Event>, StoreError> {
        let coll = journal(&self.db);
        let filter = doc! { "shop": shop, "item": item, "seq": { "$gt": after as i64 } };
        let docs = self.wait(async move {
            // Through the unique index on shop, item and seq.
            let find = coll
                .find(filter)
                .sort(doc! { "shop": 1, "item": 1, "seq": 1 });
            collect(find.limit(limit as i64)).await
        })?;
        let mut out = Vec::with_capacity(docs.len());
        for d in docs {
            out.extend(from_doc(d)?.event());
        }
        Ok(out)
    }
}

/// The names of a page of the shop's items after `after`, at most `limit + 1` (one more
/// tells that there are more), internal ones left out: each item's first entry (seq 1;
/// sequences are gapless and this journal is never pruned), in name order through the
/// unique index on shop, item and seq, one query per range around the internal items.
async fn page_names(
    db: &Database,
    shop: &str,
    after: &str,
    limit: usize,
) -> Result<Vec<String>, StoreError> {
    let mut names = Vec::with_capacity(limit + 1);
    let (end, internal) = (INTERNAL_ITEMS_END, INTERNAL_ITEM_PREFIX.to_string());
    for (from, below) in [(after, Some(internal.as_str())), (after.max(end), None)] {
        if names.len() > limit || below.is_some_and(|b| from >= b) {
            continue;
        }
        let mut range = doc! { "$gt": from };
        if let Some(b) = below {
            range.insert("$lt", b);
        }
        let first = doc! { "$type": "number", "$eq": 1_i64 };
        let found = collect(
            journal(db)
                .find(doc! { "shop": shop, "item": range, "seq": first })
                .sort(doc! { "shop": 1, "item": 1, "seq": 1 })
                .projection(doc! { "_id": 0, "item": 1 })
                .limit((limit + 1 - names.len()) as i64),
        )
        .await?;
        let found = found.iter().filter_map(|d| d.get_str("item").ok());
        names.extend(found.map(String::from));
    }
    Ok(names)
}

/// The last entry of each of `names` (by name): read from its snapshot's seq on
/// (snapshots trail the journal by about a second), so that only the entries since are
/// read, in one aggregation for them all. The entry at the snapshot's seq comes from the
/// journal too, checked like every entry read.
async fn last_entries(
    db: &Database,
    shop: &str,
    names: &[String],
) -> Result<HashMap<String, Document>, StoreError> {
    let mut lasts = HashMap::with_capacity(names.len());
    if names.is_empty() {
        return Ok(lasts);
    }
    let snapshots = collect(
        items(db)
            .find(doc! { "shop": shop, "item": { "$in": names } })
            .projection(doc! { "_id": 0, "item": 1, "seq": 1 }),
    )
    .await?;
    let from: HashMap<&str, i64> = snapshots
        .iter()
        .filter_map(|d| Some((d.get_str("item").ok()?, d.get_i64("seq").ok()?)))
        .collect();
    let since: Vec<Document> = names
        .iter()
        .map(|n| {
            let seq = from.get(n.as_str()).copied().unwrap_or(1);
            doc! { "item": n, "seq": { "$type": "number", "$gte": seq } }
        })
        .collect();
    let mut found = journal(db)
        .aggregate([
            doc! { "$match": { "shop": shop, "$or": since } },
            doc! { "$sort": { "shop": 1, "item": 1, "seq": -1 } },
            doc! { "$group": { "_id": "$item", "last": { "$first": "$$ROOT" } } },
        ])
        .await
        .map_err(storage)?;
    while let Some(d) = found.try_next().await.map_err(storage)? {
        if let (Ok(item), Ok(last)) = (d.get_str("_id"), d.get_document("last")) {
            lasts.insert(item.to_string(), last.clone());
        }
    }
    Ok(lasts)
}

impl Sharing for MongoJournal {
    fn learn_partition(&self, partition: i32, from: i64) -> Result<(), StoreError> {
        let start = self
            .learned_from
            .lock()
            .map_err(|_| StoreError::Closed)?
            .get(&partition)
            .copied()
            .unwrap_or(i64::MIN);
        let (db, keys) = (self.db.clone(), self.keys.clone());
        self.wait(async move {
            // Through the index on partition and offset.
            let filter = doc! {
                "partition": partition,
                "offset": { "$gte": start },
                "request_key": { "$type": "string" },
            };
            insert_keys(&db, filter, &keys).await
        })?;
        let mut learned = self.learned_from.lock().map_err(|_| StoreError::Closed)?;
        let at = learned.entry(partition).or_insert(from);
        *at = (*at).max(from);
        Ok(())
    }

    fn pending_holds(&self, wanted: &[(Arc<str>, Arc<str>)]) -> Result<Vec<HoldView>, StoreError> {
        if wanted.is_empty() {
            return Ok(Vec::new());
        }
        let any: Vec<Document> = wanted
            .iter()
            .map(|(shop, item)| doc! { "shop": &**shop, "item": &**item, "status": "held" })
            .collect();
        self.wait(find_all(holds(&self.db), doc! { "$or": any }))?
            .iter()
            .map(hold_from_doc)
            .collect()
    }
}

impl Outbox for MongoJournal {
    /// Several nodes write this journal and their batch numbers are their own, so there
    /// is no commit order across nodes: each node relays the events it wrote, batch by
    /// batch (its cursor is its batch number). An item's events keep their seq order on
    /// the topic except around a partition takeover, when the old owner's relay may still
    /// be publishing the item's last events as the new owner's publishes its next ones;
    /// a follower fills the apparent gap from the events route and drops the late ones.
    fn relay_read(&self, cursor: u64, limit: usize) -> Result<RelayPage, StoreError> {
        let upto = self.written_batch.load(Ordering::Acquire);
        let cursor = cursor as i64;
        if upto <= cursor {
            return Ok(RelayPage {
                events: Vec::new(),
                next: cursor as u64,
            });
        }
        let (coll, node) = (journal(&self.db), self.node as i64);
        let (docs, complete) =
            self.wait(async move { relay_docs(coll, node, cursor, upto, limit).await })?;
        let mut page = RelayPage {
            events: Vec::with_capacity(docs.len()),
            next: cursor as u64,
        };
        for d in docs {
            let batch = d.get_i64("batch").map_err(storage)?;
            page.next = page.next.max(batch as u64);
            page.events.extend(from_doc(d)?.event());
        }
        if complete {
            // Every batch up to `upto` was read (batches with no document are passed too).
            page.next = page.next.max(upto as u64);
        }
        // The relay never passes a batch the writer has not completed: its documents
        // are visible one by one while it is written, and the rest would be skipped.
        assert!(
            page.next <= upto as u64,
            "the relay read up to batch {} of node {}, past the last written ({upto})",
            page.next,
            self.node
        );
        Ok(page)
    }

    fn relay_end(&self) -> Result<u64, StoreError> {
        Ok(self.written_batch.load(Ordering::Acquire).max(0) as u64)
    }

    fn relay_cursor(&self, reader: OutboxReader) -> Result<Option<u64>, StoreError> {
        let meta = self.db.collection::<Document>("meta");
        let id = format!("{}:{}", reader.name(), self.node);
        let found =
            self.wait(async move { meta.find_one(doc! { "_id": id }).await.map_err(storage) })?;
        Ok(found
            .and_then(|d| d.get_i64("batch").ok())
            .map(|b| b.max(0) as u64))
    }

    fn relay_save(&self, reader: OutboxReader, cursor: u64) -> Result<(), StoreError> {
        let meta = self.db.collection::<Document>("meta");
        let id = format!("{}:{}", reader.name(), self.node);
        self.wait(async move {
            meta.update_one(
                doc! { "_id": id },
                doc! { "$max": { "batch": cursor as i64 } },
            )
            .upsert(true)
            .await
            .map_err(storage)
        })?;
        Ok(())
    }
}

/// The documents of node `node`'s batches after `cursor`, up to `upto`, about `limit` of
/// them in whole batches (batch by batch, in seq order); and whether they are all of
/// them (the page was not full).
async fn relay_docs(
    coll: mongodb::Collection<Document>,
    node: i64,
    cursor: i64,
    upto: i64,
    limit: usize,
) -> Result<(Vec<Document>, bool), StoreError> {
    let page = |filter: Document, limit: Option<i64>| {
        let coll = coll.clone();
        async move {
            // Ties broken by shop and item: the same page read twice comes in the same
            // order (a push stream's cursor counts events into a batch).
            let mut find = coll
                .find(filter)
                .sort(doc! { "batch": 1, "seq": 1, "shop": 1, "item": 1 });
            if let Some(n) = limit {
                find = find.limit(n);
            }
            collect(find).await
        }
    };
    let mut docs = page(
        doc! { "node": node, "batch": { "$gt": cursor, "$lte": upto } },
        Some(limit.max(1) as i64),
    )
    .await?;
    let complete = docs.len() < limit.max(1);
    if !complete {
        // Full: the last batch may be cut. Keep whole batches only, or, when one
        // batch fills the page, read that batch whole (at most one writer batch).
        let last = docs.last().and_then(|d| d.get_i64("batch").ok());
        let first = docs.first().and_then(|d| d.get_i64("batch").ok());
        if let (Some(first), Some(last)) = (first, last) {
            if first == last {
                docs = page(doc! { "node": node, "batch": last }, None).await?;
            } else {
                docs.retain(|d| d.get_i64("batch").ok() != Some(last));
            }
        }
    }
    Ok((docs, complete))
}

impl Lifecycle for MongoJournal {
    fn recover(&self) -> Result<Recovered, StoreError> {
        self.wait(recover::recover(self.db.clone()))
    }

    fn close(&self) {
        let Ok(mut closed) = self.closed.lock() else {
            return;
        };
        if *closed {
            return;
        }
        *closed = true;
        let (ack, done) = std_mpsc::channel();
        let tx = self.tx.clone();
        if let Some(rt) = &self.rt {
            rt.spawn(async move {
                let _ = tx.send(Command::Close(ack)).await;
            });
            let _ = done.recv_timeout(Duration::from_secs(30));
        }
    }
}

/// The database of a MongoDB URI (its path, else `nrtxn`), for the stores that live beside
/// the journal (keys, check-back settings, the stream's cursor key). An error names the
/// URI without its credentials.
pub async fn mongo_database(uri: &str) -> anyhow::Result<mongodb::Database> {
    use anyhow::Context as _;
    let client = mongodb::Client::with_uri_str(uri)
        .await
        .with_context(|| format!("mongo_uri: cannot use {}", redact_uri(uri)))?;
    Ok(client
        .default_database()
        .unwrap_or_else(|| client.database("nrtxn")))
}

/// A MongoDB URI with its password replaced by `***`, for messages and logs.
pub fn redact_uri(uri: &str) -> String {
    let Some((scheme, rest)) = uri.split_once("://") else {
        return uri.to_string();
    };
    // Credentials end at the last '@' before the host list's first '/'.
    let authority_end = rest.find('/').unwrap_or(rest.len());
    match rest[..authority_end].rfind('@') {
        Some(at) => {
            let user = rest[..at].split(':').next().unwrap_or("");
            format!("{scheme}://{user}:***@{}", &rest[at + 1..])
        }
        None => uri.to_string(),
    }
}
