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
//!   `(shop, item)`, moved forward at most every second.
//! - `meta`: `{_id: "snapshot:{node}", batch}`: every batch of node `node` up to this
//!   one is in `items`; `{_id: "relay:{node}", batch}`: the outbox relay of node `node`
//!   published every event of that node's batches up to this one.
//! - `holds`: one document per hold (`shop, hold_id, item, qty, expires_at, status,
//!   seq`), unique on `(shop, hold_id)`.
//!
//! One writer task takes the waiting batches (up to [`TXN_ENTRIES_MAX`] entries) into one
//! transaction: the journal documents, the holds they change, and the fence: each
//! partition's lease must still be at the epoch its entries were read under (several
//! nodes; see [`Leases`]). Then it answers. Entries of a partition whose lease moved on
//! are refused whole ([`StoreError::Fenced`]), the rest written. Snapshots follow off the
//! answer path; recovery replays the journal after them. Only operations that MongoDB
//! 6 and 7 support on a replica set are used.

use std::collections::HashMap;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{mpsc as std_mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use futures::TryStreamExt;
use mongodb::bson::{doc, Bson, Document};
use mongodb::error::ErrorKind;
use mongodb::options::IndexOptions;
use mongodb::{ClientSession, Collection, Database, IndexModel};
use nrtxn_actors::ledger::{self, BuyerLedger};
use nrtxn_actors::ports::{
    ItemPage, ItemReads, JournalWrite, Lifecycle, Outbox, Outcomes, Sharing,
};
use nrtxn_actors::returns::SaleRecord;
use nrtxn_actors::verify::Verifier;
use nrtxn_actors::{
    AppendDone, Entry, Event, HoldStatus, HoldView, ItemState, Leases, Metrics, Outcome, Recovered,
    RelayPage, StoreError, INTERNAL_ITEMS_END, INTERNAL_ITEM_PREFIX,
};
use tokio::sync::mpsc;

use nrtxn_log::keyfilter::KeyFilter;

/// Most entries one `insert_many` takes.
const TXN_ENTRIES_MAX: usize = 16_384;
/// Batches waiting for the writer at least; [`MongoJournal::open`] sizes the queue to
/// the appends the processors can have outstanding in all (shards × batches in flight
/// each), so a full queue is a broken bound, never a normal state.
const QUEUE_MIN: usize = 1024;
/// Statements per `update` command (the server's limit is 100,000).
const UPDATES_PER_COMMAND: usize = 10_000;
/// How long a journal transaction that failed for the connection or the server is tried
/// again before the journal gives up and the process stops: longer than a primary's
/// election, and than a stall that cost this node its connections.
const WRITE_RETRY_FOR: Duration = Duration::from_secs(60);
/// The snapshots (`items`) are written at most this often, after the answers: recovery
/// replays the journal after them.
const SNAPSHOT_EVERY: Duration = Duration::from_secs(1);

enum Command {
    Append(Vec<Entry>, AppendDone),
    Close(std_mpsc::Sender<()>),
}

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

fn storage(e: impl std::fmt::Display) -> StoreError {
    StoreError::Storage(e.to_string())
}

fn journal(db: &Database) -> Collection<Document> {
    db.collection("journal")
}

fn items(db: &Database) -> Collection<Document> {
    db.collection("items")
}

fn to_doc(entry: &Entry, batch: i64, node: u32) -> Result<Document, StoreError> {
    let mut doc = mongodb::bson::to_document(entry).map_err(storage)?;
    doc.insert("batch", batch);
    doc.insert("node", node as i64);
    doc.insert("fingerprint", fingerprint_of(entry));
    Ok(doc)
}

/// The entry's request fingerprint (kind, item, quantity, TTL), as the embedded journal
/// keeps it: stored in each document and checked when it is read, so a document altered
/// in those fields is refused, not served.
fn fingerprint_of(e: &Entry) -> i64 {
    nrtxn_log::codec::fingerprint(e.op, &e.item, e.qty, e.ttl_ms) as i64
}

fn from_doc(doc: Document) -> Result<Entry, StoreError> {
    let stored = doc.get_i64("fingerprint").ok();
    let id = doc.get("_id").cloned();
    let entry: Entry = mongodb::bson::from_document(doc).map_err(storage)?;
    // Documents written before fingerprints were kept have none.
    if stored.is_some_and(|f| f != fingerprint_of(&entry)) {
        return Err(storage(format!(
            "journal document {} (shop {}, item {}, seq {:?}) does not match its fingerprint: \
             it was altered; restore the journal from a backup",
            id.map_or_else(|| "?".to_string(), |i| i.to_string()),
            entry.shop,
            entry.item,
            entry.seq
        )));
    }
    Ok(entry)
}

fn holds(db: &Database) -> Collection<Document> {
    db.collection("holds")
}

fn hold_from_doc(d: &Document) -> Result<HoldView, StoreError> {
    let status = d.get_str("status").map_err(storage)?;
    Ok(HoldView {
        hold_id: d.get_str("hold_id").map_err(storage)?.into(),
        status: HoldStatus::parse(status)
            .ok_or_else(|| storage(format!("hold status {status}")))?,
        shop: d.get_str("shop").map_err(storage)?.into(),
        item: d.get_str("item").map_err(storage)?.into(),
        qty: d.get_i64("qty").map_err(storage)?,
        expires_at: d.get_i64("expires_at").map_err(storage)?,
        seq: d.get_i64("seq").map_err(storage)? as u64,
        buyer: d.get_str("buyer").ok().map(Into::into),
    })
}

/// Reads all documents of `filter` in `coll`.
async fn find_all(
    coll: Collection<Document>,
    filter: Document,
) -> Result<Vec<Document>, StoreError> {
    coll.find(filter)
        .await
        .map_err(storage)?
        .try_collect()
        .await
        .map_err(storage)
}

/// Each item's per-buyer ledger, folded from its entries that can change it (loads that
/// set a limit, and entries with a buyer), in seq order through the index on shop, item
/// and seq. Costs a read of those entries: done when an item comes into memory.
async fn fold_ledgers(
    db: &Database,
    items: &[(Arc<str>, Arc<str>)],
) -> Result<Vec<Option<BuyerLedger>>, StoreError> {
    let mut out = Vec::with_capacity(items.len());
    for (shop, item) in items {
        let filter = doc! {
            "shop": &**shop,
            "item": &**item,
            "seq": { "$type": "number" },
            "$or": [
                { "per_buyer_max": { "$exists": true } },
                { "buyer": { "$type": "string" } },
            ],
        };
        let docs: Vec<Document> = journal(db)
            .find(filter)
            .sort(doc! { "shop": 1, "item": 1, "seq": 1 })
            .await
            .map_err(storage)?
            .try_collect()
            .await
            .map_err(storage)?;
        let entries = docs
            .into_iter()
            .map(from_doc)
            .collect::<Result<Vec<_>, _>>()?;
        out.push(ledger::fold(&entries));
    }
    Ok(out)
}

/// The `holds` updates of a run of entries: each hold's last state in it, one statement
/// per hold (an unordered command would not keep two statements of one hold in order).
/// Like snapshots, a hold document only moves forward (`seq` filter).
fn hold_updates<'a>(entries: impl Iterator<Item = &'a Entry>) -> Vec<Document> {
    let mut set: HashMap<(Arc<str>, Arc<str>), Document> = HashMap::new();
    for e in entries {
        if let (nrtxn_actors::Status::Ok, nrtxn_actors::Op::Extend, Some(id), Some(seq)) =
            (e.status, e.op, &e.hold_id, e.seq)
        {
            // A pending hold given a new expiry (a check-back's answer).
            let d = set.entry((e.shop.clone(), id.clone())).or_default();
            d.insert("expires_at", e.expires_at.unwrap_or(0));
            d.insert("seq", seq as i64);
            continue;
        }
        let (nrtxn_actors::Status::Ok, Some(status), Some(id), Some(seq)) =
            (e.status, HoldStatus::after(e.op), &e.hold_id, e.seq)
        else {
            continue;
        };
        let d = set.entry((e.shop.clone(), id.clone())).or_default();
        if status == HoldStatus::Held {
            d.insert("item", &*e.item);
            d.insert("qty", e.qty);
            d.insert("expires_at", e.expires_at.unwrap_or(0));
            if let Some(buyer) = &e.buyer {
                d.insert("buyer", &**buyer);
            }
        }
        d.insert("status", status.as_str());
        d.insert("seq", seq as i64);
    }
    set.into_iter()
        .map(|((shop, hold_id), d)| {
            let seq = d.get_i64("seq").unwrap_or(0);
            doc! {
                "q": { "shop": &*shop, "hold_id": &*hold_id, "seq": { "$lt": seq } },
                "u": { "$set": d },
                "upsert": true,
            }
        })
        .collect()
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
            let uri = uri.as_str();
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
            let db = client
                .default_database()
                .unwrap_or_else(|| client.database("nrtxn"));
            create_indexes(&db).await?;
            // A transaction this node's previous process left open (killed in it) ends
            // now, not at the server's transaction lifetime.
            end_writer_session(&db, node).await?;
            let keys = Arc::new(KeyFilter::new());
            let mut cursor = journal(&db)
                .find(doc! { "request_key": { "$type": "string" } })
                .projection(doc! { "_id": 0, "shop": 1, "request_key": 1 })
                .await
                .map_err(storage)?;
            while let Some(d) = cursor.try_next().await.map_err(storage)? {
                if let (Ok(shop), Ok(key)) = (d.get_str("shop"), d.get_str("request_key")) {
                    keys.insert(shop, key);
                }
            }
            let last = journal(&db)
                .find_one(doc! {})
                .sort(doc! { "batch": -1 })
                .await
                .map_err(storage)?;
            let next_batch = last.and_then(|d| d.get_i64("batch").ok()).unwrap_or(0) + 1;
            Ok::<_, StoreError>((db, keys, next_batch))
        })?;
        // One more than the appends in flight, for the `Close` command.
        let queue_max = QUEUE_MIN.max(appends_in_flight_max + 1);
        assert!(queue_max > appends_in_flight_max);
        let (tx, rx) = mpsc::channel(queue_max);
        let written_batch = Arc::new(AtomicI64::new(next_batch - 1));
        let writer = Writer {
            db: db.clone(),
            metrics,
            keys: keys.clone(),
            next_batch,
            node,
            written_batch: written_batch.clone(),
            session: None,
            hold: nrtxn_log::faults::journal_hold(),
            unsnapshotted: HashMap::new(),
            snapshot_at: Instant::now(),
        };
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

async fn create_indexes(db: &Database) -> Result<(), StoreError> {
    let unique = |name: &str, partial: Document| {
        IndexOptions::builder()
            .name(name.to_string())
            .unique(true)
            .partial_filter_expression(partial)
            .build()
    };
    journal(db)
        .create_indexes([
            IndexModel::builder()
                .keys(doc! { "shop": 1, "request_key": 1 })
                .options(unique(
                    "shop_request_key_unique",
                    doc! { "request_key": { "$type": "string" } },
                ))
                .build(),
            IndexModel::builder()
                .keys(doc! { "shop": 1, "item": 1, "seq": 1 })
                .options(unique(
                    "shop_item_seq_unique",
                    doc! { "seq": { "$type": "number" } },
                ))
                .build(),
            IndexModel::builder().keys(doc! { "batch": 1 }).build(),
            // Each node's outbox relay reads its own batches in order.
            IndexModel::builder()
                .keys(doc! { "node": 1, "batch": 1 })
                .build(),
            // A return's sale: the units returned against it are summed through this
            // one ([`nrtxn_actors::returns`]); only returns have the field.
            IndexModel::builder()
                .keys(doc! { "shop": 1, "return_of": 1 })
                .options(
                    IndexOptions::builder()
                        .name("shop_return_of".to_string())
                        .partial_filter_expression(doc! { "return_of": { "$type": "string" } })
                        .build(),
                )
                .build(),
            // A node taking a log partition over learns the keys journaled for it.
            IndexModel::builder()
                .keys(doc! { "partition": 1, "offset": 1 })
                .options(
                    IndexOptions::builder()
                        .name("partition_offset".to_string())
                        .build(),
                )
                .build(),
        ])
        .await
        .map_err(storage)?;
    holds(db)
        .create_indexes([
            IndexModel::builder()
                .keys(doc! { "shop": 1, "hold_id": 1 })
                .options(
                    IndexOptions::builder()
                        .name("shop_hold_id_unique".to_string())
                        .unique(true)
                        .build(),
                )
                .build(),
            // A node taking an item over re-arms its pending holds through this one.
            IndexModel::builder()
                .keys(doc! { "shop": 1, "item": 1, "status": 1 })
                .build(),
        ])
        .await
        .map_err(storage)?;
    items(db)
        .create_index(
            IndexModel::builder()
                .keys(doc! { "shop": 1, "item": 1 })
                .options(
                    IndexOptions::builder()
                        .name("shop_item_unique".to_string())
                        .unique(true)
                        .build(),
                )
                .build(),
        )
        .await
        .map_err(storage)?;
    Ok(())
}

/// Makes the journal's writes acknowledged only once a majority of the replica set has
/// them in its on-disk journal (`w: "majority", j: true`), unless the URI asks for a
/// write concern of its own; then it is kept, and what it gives up is returned, to be
/// said at start. Why: an outcome is answered once its transaction commits. With `w: 1`
/// the commit is acknowledged by the primary alone, and a primary that fails over
/// before a secondary has it takes the decision with it (the new primary never saw it,
/// and the old one rolls it back): an answered sale would be lost, its stock sold again.
/// Without `j` a majority may hold it in memory only. The server's default is majority
/// since MongoDB 5.0, but not every deployment's: nrtxn says what it needs rather than
/// inherit it. Every write of the journal is in a transaction, or takes the database's
/// write concern (`update_all`): this one setting covers them all.
pub fn durable_write_concern(options: &mut mongodb::options::ClientOptions) -> Option<String> {
    use mongodb::options::{Acknowledgment, WriteConcern};
    let Some(given) = &options.write_concern else {
        options.write_concern = Some(
            WriteConcern::builder()
                .w(Acknowledgment::Majority)
                .journal(true)
                .build(),
        );
        return None;
    };
    let majority = matches!(given.w, Some(Acknowledgment::Majority) | None);
    let journaled = given.journal != Some(false);
    (!majority || !journaled).then(|| {
        format!(
            "the MongoDB URI asks for write concern {given:?}: the journal's commits are then \
             acknowledged before a majority of the replica set has them on disk, and an \
             answered decision can be lost if the primary fails over. Leave w and journal \
             out of the URI (nrtxn then asks for w=majority, journal=true) unless the \
             replica set has one member"
        )
    })
}

/// Sets the client's read concern to `majority` unless the URI names one (`readConcernLevel`),
/// and returns what a weaker one gives up, to be said at start. Why: what nrtxn answers
/// from a read (a poll's outcome, an item's stock, what a node taking over a partition
/// rebuilds from) must not be rolled back by a failover. A `local` read on a primary can
/// see a write that a majority does not hold yet; if that primary then fails over, the
/// write is rolled back, and the answer (or the takeover's state) names a decision that
/// never happened. Every read of the journal's client inherits this setting, inside
/// transactions too.
pub fn durable_read_concern(options: &mut mongodb::options::ClientOptions) -> Option<String> {
    use mongodb::options::{ReadConcern, ReadConcernLevel};
    let Some(given) = &options.read_concern else {
        options.read_concern = Some(ReadConcern::majority());
        return None;
    };
    let durable = matches!(
        given.level,
        ReadConcernLevel::Majority | ReadConcernLevel::Linearizable
    );
    (!durable).then(|| {
        format!(
            "the MongoDB URI asks for read concern {:?}: polls, item reads and a takeover \
             may then see a write that a failover rolls back. Leave readConcernLevel out of \
             the URI (nrtxn then reads with majority)",
            given.level
        )
    })
}

/// Runs `updates` (statements of the `update` command) in as few commands as possible:
/// one round trip instead of one per document (13 ms each on the test server). Outside
/// a transaction (`session` `None`) with the database's write concern; inside one, the
/// commit's. A statement that fails only because its upsert hit a unique index (code
/// 11000) is not an error: callers use a filter that does not match when the stored
/// document is already newer. Returns how many documents the statements matched.
async fn update_all(
    db: &Database,
    collection: &str,
    updates: Vec<Document>,
    mut session: Option<&mut ClientSession>,
) -> Result<u64, mongodb::error::Error> {
    let mut matched = 0;
    for chunk in updates.chunks(UPDATES_PER_COMMAND) {
        let mut cmd = doc! { "update": collection, "updates": chunk.to_vec(), "ordered": false };
        let reply = match session.as_deref_mut() {
            Some(s) => db.run_command(cmd).session(s).await?,
            None => {
                if let Some(wc) = db.write_concern() {
                    let wc = mongodb::bson::to_document(wc)
                        .map_err(|e| mongodb::error::Error::custom(e.to_string()))?;
                    cmd.insert("writeConcern", wc);
                }
                db.run_command(cmd).await?
            }
        };
        if let Ok(wc) = reply.get_document("writeConcernError") {
            return Err(mongodb::error::Error::custom(format!(
                "{collection}: write concern: {wc}"
            )));
        }
        if let Ok(errors) = reply.get_array("writeErrors") {
            for e in errors {
                let code = e.as_document().and_then(|d| d.get_i32("code").ok());
                if code != Some(11000) {
                    return Err(mongodb::error::Error::custom(format!("{collection}: {e}")));
                }
            }
        }
        matched += match reply.get("n") {
            Some(Bson::Int32(n)) => *n as u64,
            Some(Bson::Int64(n)) => *n as u64,
            _ => 0,
        };
    }
    Ok(matched)
}

/// [`update_all`] outside a transaction, its error a [`StoreError`].
async fn update_now(
    db: &Database,
    collection: &str,
    updates: Vec<Document>,
) -> Result<(), StoreError> {
    update_all(db, collection, updates, None)
        .await
        .map(drop)
        .map_err(storage)
}

/// Moves the snapshots of `states` forward and records that `node`'s batches up to
/// `batch` are in them.
async fn write_snapshots(
    db: &Database,
    states: HashMap<(Arc<str>, Arc<str>), ItemState>,
    node: u32,
    batch: i64,
) -> Result<(), StoreError> {
    // Each only ever moves a snapshot forward: with several nodes, one that owned the
    // item before may write an older state after a newer one, and then the upsert's
    // insert hits the unique index on shop and item, which is fine.
    let updates: Vec<Document> = states
        .into_iter()
        .map(|((shop, item), s)| {
            doc! {
                "q": { "shop": &*shop, "item": &*item, "seq": { "$lt": s.seq as i64 } },
                "u": { "$set": { "stock": s.stock, "reserved": s.reserved, "seq": s.seq as i64 } },
                "upsert": true,
            }
        })
        .collect();
    update_now(db, "items", updates).await?;
    db.collection::<Document>("meta")
        .update_one(
            doc! { "_id": snapshot_mark(node) },
            doc! { "$max": { "batch": batch } },
        )
        .upsert(true)
        .await
        .map_err(storage)?;
    Ok(())
}

/// The `meta` document recording how far node `node`'s batches are in the snapshots.
fn snapshot_mark(node: u32) -> String {
    format!("snapshot:{node}")
}

/// The `meta` document naming the session node `node`'s journal writer runs its
/// transactions in: `{_id: "writer:{node}", lsid}`.
fn writer_mark(node: u32) -> String {
    format!("writer:{node}")
}

/// Ends the session node `node`'s writer recorded, and so aborts any transaction it
/// left open (a process killed or stalled in the middle of one): its uncommitted
/// documents would otherwise hold their keys until the server's transaction lifetime
/// (60 s) runs out. A live writer whose session is ended retries in a new one. Ending
/// it may fail (the user lacks the right): that is logged, not fatal.
async fn end_writer_session(db: &Database, node: u32) -> Result<(), StoreError> {
    let mark = db
        .collection::<Document>("meta")
        .find_one(doc! { "_id": writer_mark(node) })
        .await
        .map_err(storage)?;
    if let Some(lsid) = mark.as_ref().and_then(|d| d.get_document("lsid").ok()) {
        let ended = db
            .client()
            .database("admin")
            .run_command(doc! { "killSessions": [lsid.clone()] })
            .await;
        match ended {
            Ok(_) => tracing::info!(node, "ended the journal session node {node} left"),
            // Not fatal: the fence holds without it; only a transaction left open keeps
            // its keys until the server's transaction lifetime ends it.
            Err(e) => tracing::warn!(
                node,
                error = %e,
                "could not end the journal session node {node} left (the user needs killAnySession); a transaction it left open holds its keys until it times out"
            ),
        }
    }
    Ok(())
}

/// A partition's lease document: `{_id: partition, epoch, node, offset}`.
fn leases(db: &Database) -> Collection<Document> {
    db.collection("leases")
}

/// The fence of a write: per partition its entries were read from, the epoch they were
/// read under, and the highest offset among them (recorded in the lease, as how far the
/// request log is applied).
type Fences = HashMap<i32, (u64, i64)>;

/// How one journal transaction ended, short of an error.
enum Txn {
    Committed,
    /// Refused: these partitions' leases are no longer at the epochs written under.
    Stale(Vec<(i32, u64)>),
    /// Refused: these documents (by index) are in the journal already, exactly so (a
    /// retried commit that had committed after all).
    Written(Vec<usize>),
}

/// An error of a transaction: one worth retrying (a lost connection, a write
/// conflict, a primary stepping down), or one that no retry mends.
enum TxnError {
    Retry(mongodb::error::Error),
    Fatal(StoreError),
}

impl From<mongodb::error::Error> for TxnError {
    fn from(e: mongodb::error::Error) -> TxnError {
        TxnError::Retry(e)
    }
}

/// The journal documents that say the same decision as `mine` (same item, seq, key,
/// status and quantity): duplicates of a write that had committed.
fn same_decision(mine: &Document, theirs: &Document) -> bool {
    ["shop", "item", "seq", "request_key", "status", "qty"]
        .iter()
        .all(|f| mine.get(f) == theirs.get(f))
}

/// The filter finding the journal document that holds `doc`'s place: its key, or for
/// a load (no key) its item and seq.
fn place_of(doc: &Document) -> Document {
    match doc.get("request_key") {
        Some(Bson::String(key)) => doc! { "shop": doc.get("shop"), "request_key": key },
        _ => doc! { "shop": doc.get("shop"), "item": doc.get("item"), "seq": doc.get("seq") },
    }
}

struct Writer {
    db: Database,
    metrics: Arc<Metrics>,
    keys: Arc<KeyFilter>,
    next_batch: i64,
    node: u32,
    written_batch: Arc<AtomicI64>,
    /// The session the transactions run in; made again after an error.
    session: Option<ClientSession>,
    /// A fault for tests ([`nrtxn_log::faults::journal_hold`]).
    hold: Option<Duration>,
    /// Items' states written since the last snapshot, which is written at most every
    /// [`SNAPSHOT_EVERY`], off the answer path (recovery replays what it lacks).
    unsnapshotted: HashMap<(Arc<str>, Arc<str>), ItemState>,
    snapshot_at: Instant,
}

impl Writer {
    async fn run(mut self, mut rx: mpsc::Receiver<Command>) {
        loop {
            let first = if self.unsnapshotted.is_empty() {
                rx.recv().await
            } else {
                let due = SNAPSHOT_EVERY.saturating_sub(self.snapshot_at.elapsed());
                match tokio::time::timeout(due, rx.recv()).await {
                    Ok(cmd) => cmd,
                    Err(_) => {
                        self.snapshot().await;
                        continue;
                    }
                }
            };
            let Some(first) = first else { return };
            let mut appends = Vec::new();
            let mut close = None;
            let mut weight = 0;
            let mut next = Some(first);
            while let Some(cmd) = next.take() {
                match cmd {
                    Command::Append(entries, done) => {
                        weight += entries.len();
                        appends.push((entries, done));
                    }
                    Command::Close(ack) => close = Some(ack),
                }
                if weight < TXN_ENTRIES_MAX && close.is_none() {
                    next = rx.try_recv().ok();
                }
            }
            if !appends.is_empty() {
                // The callbacks are not `Sync`: keep them out of the awaited borrow.
                let (batches, dones): (Vec<Vec<Entry>>, Vec<AppendDone>) =
                    appends.into_iter().unzip();
                let started = Instant::now();
                let result = self.write(&batches).await;
                self.metrics
                    .journal_write_seconds
                    .observe(started.elapsed().as_secs_f64());
                self.metrics.journal_txn_entries.observe(weight as f64);
                let fatal = match result {
                    Ok(fenced) => {
                        for (entries, done) in batches.into_iter().zip(dones) {
                            let refused = entries.iter().any(|e| {
                                e.log_pos
                                    .is_some_and(|p| fenced.contains(&(p.partition, p.epoch)))
                            });
                            let result = match refused {
                                true => Err(StoreError::Fenced(fenced.clone())),
                                false => Ok(()),
                            };
                            done(entries, result);
                        }
                        false
                    }
                    Err(e) => {
                        tracing::error!(error = %e, "journal batch failed");
                        for (entries, done) in batches.into_iter().zip(dones) {
                            done(entries, Err(e.clone()));
                        }
                        true
                    }
                };
                if fatal {
                    nrtxn_actors::fatal::stop_not_durable("the journal can no longer be written");
                }
                if self.snapshot_at.elapsed() >= SNAPSHOT_EVERY {
                    self.snapshot().await;
                }
            }
            if let Some(ack) = close {
                self.snapshot().await;
                let _ = ack.send(());
                return;
            }
        }
    }

    /// Writes the snapshots of the items changed since the last one. A failure is only
    /// logged: the states stay, to be written next time, and recovery replays the
    /// journal after the last snapshot anyway.
    async fn snapshot(&mut self) {
        self.snapshot_at = Instant::now();
        if self.unsnapshotted.is_empty() {
            return;
        }
        let states = std::mem::take(&mut self.unsnapshotted);
        let batch = self.written_batch.load(Ordering::Acquire);
        if let Err(e) = write_snapshots(&self.db, states.clone(), self.node, batch).await {
            tracing::warn!(error = %e, "snapshot write failed; retried later");
            for (k, s) in states {
                self.unsnapshotted.entry(k).or_insert(s);
            }
        }
    }

    /// Writes the batches as one journal transaction, fenced by the leases of the
    /// partitions their entries were read from. Returns the `(partition, epoch)` whose
    /// entries were refused (not written: their lease passed to another node).
    /// Errors of the connection or the server (a node stalled past the session timeout
    /// finds its connections gone) are retried for [`WRITE_RETRY_FOR`]: the fence is
    /// what makes a retry safe, and duplicates of a commit that went through are found
    /// and taken as written.
    async fn write(&mut self, batches: &[Vec<Entry>]) -> Result<Vec<(i32, u64)>, StoreError> {
        let batch = self.next_batch;
        self.next_batch += 1;
        let entries: Vec<&Entry> = batches.iter().flatten().collect();
        let mut docs = Vec::with_capacity(entries.len());
        for e in &entries {
            docs.push(to_doc(e, batch, self.node)?);
        }
        let tags: Vec<Option<(i32, u64)>> = entries
            .iter()
            .map(|e| e.log_pos.map(|p| (p.partition, p.epoch)))
            .collect();
        // Entries read under an older epoch than others of their partition in this write
        // are stale already.
        let mut newest: HashMap<i32, u64> = HashMap::new();
        for (p, e) in tags.iter().flatten() {
            let n = newest.entry(*p).or_insert(*e);
            *n = (*n).max(*e);
        }
        let mut refused: Vec<(i32, u64)> = Vec::new();
        for (p, e) in tags.iter().flatten() {
            if *e < newest[p] && !refused.contains(&(*p, *e)) {
                refused.push((*p, *e));
            }
        }
        let mut written = vec![false; docs.len()];
        let started = Instant::now();
        let mut wait = Duration::from_millis(50);
        loop {
            let live: Vec<usize> = (0..docs.len())
                .filter(|&i| !written[i] && !tags[i].is_some_and(|t| refused.contains(&t)))
                .collect();
            let mut fences: Fences = HashMap::new();
            for &i in &live {
                if let (Some((p, e)), Some(pos)) = (tags[i], entries[i].log_pos) {
                    let f = fences.entry(p).or_insert((e, pos.offset));
                    f.1 = f.1.max(pos.offset);
                }
            }
            // The holds of every entry not refused, also those a previous attempt wrote:
            // their updates only move a hold forward, so applying one again is harmless.
            let kept: Vec<&Entry> = (0..docs.len())
                .filter(|&i| !tags[i].is_some_and(|t| refused.contains(&t)))
                .map(|i| entries[i])
                .collect();
            match self.transaction(&docs, &live, &kept, &fences).await {
                Ok(Txn::Committed) => break,
                Ok(Txn::Stale(stale)) => {
                    tracing::warn!(?stale, "journal write fenced: partitions' leases moved on");
                    refused.extend(stale);
                }
                Ok(Txn::Written(found)) => {
                    for i in found {
                        written[i] = true;
                    }
                }
                Err(TxnError::Fatal(e)) => return Err(e),
                Err(TxnError::Retry(e)) if started.elapsed() < WRITE_RETRY_FOR => {
                    tracing::warn!(error = %e, "journal transaction failed; retrying");
                    self.session = None;
                    tokio::time::sleep(wait).await;
                    wait = (wait * 2).min(Duration::from_secs(2));
                }
                Err(TxnError::Retry(e)) => return Err(storage(e)),
            }
        }
        for (i, e) in entries.iter().enumerate() {
            if tags[i].is_some_and(|t| refused.contains(&t)) {
                continue;
            }
            if let Some(key) = &e.request_key {
                self.keys.insert(&e.shop, key);
            }
            if let Some(state) = e.state_after() {
                self.unsnapshotted
                    .insert((e.shop.clone(), e.item.clone()), state);
            }
        }
        self.written_batch.store(batch, Ordering::Release);
        Ok(refused)
    }

    /// One transaction: the documents `live` of `docs`, the holds they change, then the
    /// fence (each partition's lease still at its epoch, raised to the highest offset
    /// written), then the commit: three round trips, four when holds change. The lease
    /// is written last so that it is locked only for the commit's round trip.
    async fn transaction(
        &mut self,
        docs: &[Document],
        live: &[usize],
        kept: &[&Entry],
        fences: &Fences,
    ) -> Result<Txn, TxnError> {
        let db = self.db.clone();
        if fences.is_empty() {
            // Nothing to fence (no partitioned log: one node writes): no transaction,
            // two round trips at most. A duplicate is found as after a transaction.
            return match Self::transaction_body(&db, None, docs, live, kept, fences, self.hold)
                .await
            {
                Err(TxnError::Retry(e)) if is_duplicate(&e) => {
                    Self::already_written(&db, docs, live).await
                }
                other => other,
            };
        }
        if self.session.is_none() {
            let session = self.db.client().start_session().await?;
            // Recorded so that whoever comes after this process (its restart, or a node
            // taking its partitions) can end a transaction it left open: until then
            // its uncommitted documents would hold their keys.
            self.db
                .collection::<Document>("meta")
                .update_one(
                    doc! { "_id": writer_mark(self.node) },
                    doc! { "$set": { "lsid": session.id().clone() } },
                )
                .upsert(true)
                .await?;
            self.session = Some(session);
        }
        let session = self.session.as_mut().expect("made above");
        session.start_transaction().await?;
        let outcome = Self::transaction_body(
            &db,
            Some(&mut *session),
            docs,
            live,
            kept,
            fences,
            self.hold,
        )
        .await;
        match outcome {
            Ok(Txn::Committed) => {
                // A commit whose result is unknown is retried by the driver once; past
                // that, the whole transaction is retried, and finds its own documents.
                session.commit_transaction().await?;
                Ok(Txn::Committed)
            }
            Err(TxnError::Retry(e)) if is_duplicate(&e) => {
                let _ = session.abort_transaction().await;
                // The node that holds a lease now may have written these places: the
                // fence decides first. Duplicates under leases still held are this
                // writer's own commit that went through.
                let stale = stale_fences(&db, fences).await?;
                if !stale.is_empty() {
                    return Ok(Txn::Stale(stale));
                }
                Self::already_written(&db, docs, live).await
            }
            other => {
                let _ = session.abort_transaction().await;
                match other {
                    Ok(Txn::Stale(_)) => match stale_fences(&db, fences).await? {
                        stale if stale.is_empty() => {
                            // The lease update matched fewer than asked, yet every lease
                            // is at its epoch: try again.
                            Err(TxnError::Retry(mongodb::error::Error::custom(
                                "fence matched fewer leases than asked",
                            )))
                        }
                        stale => Ok(Txn::Stale(stale)),
                    },
                    other => other,
                }
            }
        }
    }

    /// The statements of a batch: in `session`'s transaction, or (no fences) on their
    /// own, the insert unordered so that a duplicate does not stop the others.
    async fn transaction_body(
        db: &Database,
        mut session: Option<&mut ClientSession>,
        docs: &[Document],
        live: &[usize],
        kept: &[&Entry],
        fences: &Fences,
        hold: Option<Duration>,
    ) -> Result<Txn, TxnError> {
        if !live.is_empty() {
            let coll = journal(db);
            let insert = coll.insert_many(live.iter().map(|&i| &docs[i]));
            match session.as_deref_mut() {
                Some(s) => insert.session(s).await?,
                None => insert.ordered(false).await?,
            };
        }
        let holds = hold_updates(kept.iter().copied());
        if !holds.is_empty() {
            update_all(db, "holds", holds, session.as_deref_mut()).await?;
        }
        if let Some(hold) = hold {
            tokio::time::sleep(hold).await;
        }
        if !fences.is_empty() {
            let updates: Vec<Document> = fences
                .iter()
                .map(|(p, (epoch, offset))| {
                    doc! {
                        "q": { "_id": p, "epoch": *epoch as i64 },
                        "u": { "$max": { "offset": offset } },
                    }
                })
                .collect();
            let matched = update_all(db, "leases", updates, session).await?;
            if matched < fences.len() as u64 {
                return Ok(Txn::Stale(Vec::new()));
            }
        }
        Ok(Txn::Committed)
    }

    /// After a transaction refused for duplicates: which of the `live` documents are in
    /// the journal already, exactly so. A different decision in a document's place is
    /// fatal: two writers decided the same item or key.
    async fn already_written(
        db: &Database,
        docs: &[Document],
        live: &[usize],
    ) -> Result<Txn, TxnError> {
        let mut found = Vec::new();
        for chunk in live.chunks(500) {
            let filter =
                doc! { "$or": chunk.iter().map(|&i| place_of(&docs[i])).collect::<Vec<_>>() };
            let theirs = find_all(journal(db), filter)
                .await
                .map_err(|e| TxnError::Retry(mongodb::error::Error::custom(e.to_string())))?;
            for &i in chunk {
                let mine = &docs[i];
                let place = place_of(mine);
                let Some(t) = theirs
                    .iter()
                    .find(|t| place.iter().all(|(k, v)| t.get(k) == Some(v)))
                else {
                    continue;
                };
                if !same_decision(mine, t) {
                    return Err(TxnError::Fatal(storage(format!(
                        "conflicting journal entry: {mine} against {t}"
                    ))));
                }
                found.push(i);
            }
        }
        if found.is_empty() {
            return Err(TxnError::Retry(mongodb::error::Error::custom(
                "duplicate key, but no document holds it",
            )));
        }
        Ok(Txn::Written(found))
    }
}

/// Whether `e` is a unique index's refusal (code 11000).
pub fn is_duplicate(e: &mongodb::error::Error) -> bool {
    match e.kind.as_ref() {
        ErrorKind::InsertMany(f) => f.write_errors.iter().flatten().any(|w| w.code == 11000),
        ErrorKind::Write(mongodb::error::WriteFailure::WriteError(w)) => w.code == 11000,
        ErrorKind::Command(c) => c.code == 11000,
        _ => false,
    }
}

/// Of `fences`, the `(partition, epoch)` whose lease is at another epoch now.
async fn stale_fences(db: &Database, fences: &Fences) -> Result<Vec<(i32, u64)>, TxnError> {
    if fences.is_empty() {
        return Ok(Vec::new());
    }
    let parts: Vec<i32> = fences.keys().copied().collect();
    let current: HashMap<i32, i64> = leases(db)
        .find(doc! { "_id": { "$in": parts } })
        .await?
        .try_collect::<Vec<Document>>()
        .await?
        .iter()
        .filter_map(|d| Some((d.get_i32("_id").ok()?, d.get_i64("epoch").ok()?)))
        .collect();
    Ok(fences
        .iter()
        .filter(|(p, (epoch, _))| current.get(p) != Some(&(*epoch as i64)))
        .map(|(p, (epoch, _))| (*p, *epoch))
        .collect())
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
                epochs.push(lease.get_i64("epoch").map_err(storage)? as u64);
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
        let coll = journal(&self.db);
        let shop = shop.to_string();
        let mut prev = after.unwrap_or("").to_string();
        self.wait(async move {
            let mut page = ItemPage::default();
            loop {
                // A loose scan of the unique index on shop, item and seq: the next item's
                // first sequenced entry (one seek), then its last (its state). Every
                // item has entries here: this journal is never pruned.
                let found = coll
                    .find_one(doc! {
                        "shop": &shop,
                        "item": { "$gt": &prev },
                        "seq": { "$type": "number" },
                    })
                    .sort(doc! { "shop": 1, "item": 1, "seq": 1 })
                    .projection(doc! { "_id": 0, "item": 1 })
                    .await
                    .map_err(storage)?;
                let Some(next) = found.and_then(|d| d.get_str("item").ok().map(String::from))
                else {
                    break;
                };
                if next.starts_with(INTERNAL_ITEM_PREFIX) {
                    prev = INTERNAL_ITEMS_END.to_string();
                    continue;
                }
                if page.items.len() == limit {
                    page.more = true;
                    break;
                }
                let last = coll
                    .find_one(doc! { "shop": &shop, "item": &next, "seq": { "$type": "number" } })
                    .sort(doc! { "shop": 1, "item": 1, "seq": -1 })
                    .await
                    .map_err(storage)?;
                if let Some(state) = last
                    .map(from_doc)
                    .transpose()?
                    .and_then(|e| e.state_after())
                {
                    page.items.push((next.as_str().into(), state));
                }
                prev = next;
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
            coll.find(filter)
                .sort(doc! { "shop": 1, "item": 1, "seq": 1 })
                .limit(limit as i64)
                .await
                .map_err(storage)?
                .try_collect::<Vec<Document>>()
                .await
                .map_err(storage)
        })?;
        let mut out = Vec::with_capacity(docs.len());
        for d in docs {
            out.extend(from_doc(d)?.event());
        }
        Ok(out)
    }
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
        let coll = journal(&self.db);
        let keys = self.keys.clone();
        self.wait(async move {
            // Through the index on partition and offset.
            let mut cursor = coll
                .find(doc! {
                    "partition": partition,
                    "offset": { "$gte": start },
                    "request_key": { "$type": "string" },
                })
                .projection(doc! { "_id": 0, "shop": 1, "request_key": 1 })
                .await
                .map_err(storage)?;
            while let Some(d) = cursor.try_next().await.map_err(storage)? {
                if let (Ok(shop), Ok(key)) = (d.get_str("shop"), d.get_str("request_key")) {
                    keys.insert(shop, key);
                }
            }
            Ok(())
        })?;
        let mut learned = self.learned_from.lock().map_err(|_| StoreError::Closed)?;
        let at = learned.entry(partition).or_insert(from);
        *at = (*at).max(from);
        Ok(())
    }

    fn shared(&self) -> bool {
        true
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
        let coll = journal(&self.db);
        let node = self.node as i64;
        let (docs, complete) = self.wait(async move {
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
                    find.await
                        .map_err(storage)?
                        .try_collect::<Vec<Document>>()
                        .await
                        .map_err(storage)
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
        })?;
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
        Ok(page)
    }

    fn relay_end(&self) -> Result<u64, StoreError> {
        Ok(self.written_batch.load(Ordering::Acquire).max(0) as u64)
    }

    fn relay_cursor(&self) -> Result<u64, StoreError> {
        let meta = self.db.collection::<Document>("meta");
        let id = format!("relay:{}", self.node);
        let found =
            self.wait(async move { meta.find_one(doc! { "_id": id }).await.map_err(storage) })?;
        Ok(found
            .and_then(|d| d.get_i64("batch").ok())
            .unwrap_or(0)
            .max(0) as u64)
    }

    fn relay_save(&self, cursor: u64) -> Result<(), StoreError> {
        let meta = self.db.collection::<Document>("meta");
        let id = format!("relay:{}", self.node);
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

impl Lifecycle for MongoJournal {
    fn recover(&self) -> Result<Recovered, StoreError> {
        let db = self.db.clone();
        self.wait(async move {
            let mut states: HashMap<(Arc<str>, Arc<str>), ItemState> = HashMap::new();
            let mut cursor = items(&db).find(doc! {}).await.map_err(storage)?;
            while let Some(d) = cursor.try_next().await.map_err(storage)? {
                let (Ok(shop), Ok(item)) = (d.get_str("shop"), d.get_str("item")) else {
                    continue;
                };
                let state = ItemState {
                    stock: d.get_i64("stock").map_err(storage)?,
                    reserved: d.get_i64("reserved").map_err(storage)?,
                    seq: d.get_i64("seq").map_err(storage)? as u64,
                };
                states.insert((shop.into(), item.into()), state);
            }
            // How far each node's batches are in the snapshots (`snapshot:{node}`; the
            // single `snapshot` of earlier versions stands for the nodes without one).
            let mut marks: Vec<(i64, i64)> = Vec::new();
            let mut legacy = 0;
            for d in find_all(db.collection("meta"), doc! {}).await? {
                let batch = d.get_i64("batch").unwrap_or(0);
                match d.get_str("_id") {
                    Ok("snapshot") => legacy = batch,
                    Ok(id) => {
                        if let Some(node) =
                            id.strip_prefix("snapshot:").and_then(|n| n.parse().ok())
                        {
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
            let mut tail = journal(&db)
                .find(doc! { "$or": after })
                .sort(doc! { "batch": 1, "seq": 1 })
                .await
                .map_err(storage)?;
            let mut last_batch: HashMap<u32, i64> = HashMap::new();
            let mut hold_changes = Vec::new();
            // Every entry after the snapshot is checked as the processor checked it when
            // it wrote it (gapless, never negative, each state following from the last):
            // a journal that fails refuses the start.
            let mut verifier = Verifier::new(
                states
                    .into_iter()
                    .map(|((shop, item), state)| (shop, item, state)),
            );
            let mut entries = Vec::new();
            while let Some(d) = tail.try_next().await.map_err(storage)? {
                if let (Ok(node), Ok(batch)) = (d.get_i64("node"), d.get_i64("batch")) {
                    let b = last_batch.entry(node as u32).or_insert(batch);
                    *b = (*b).max(batch);
                }
                let entry = from_doc(d)?;
                if entry.hold_id.is_some() {
                    hold_changes.push(entry.clone());
                }
                if entry.seq.is_some() {
                    entries.push(entry);
                }
            }
            // Batch numbers are each node's own: an item that moved between nodes may
            // have its entries in batches out of order, so each item's go in seq order.
            entries.sort_by(|a, b| (&a.shop, &a.item, a.seq).cmp(&(&b.shop, &b.item, b.seq)));
            for entry in &entries {
                verifier
                    .check(entry)
                    .map_err(|why| storage(format!("the journal does not add up: {why}")))?;
            }
            let mut states = HashMap::new();
            let mut touched = HashMap::new();
            for (shop, item, state, moved) in verifier.into_items() {
                if moved {
                    touched.insert((shop.clone(), item.clone()), state);
                }
                states.insert((shop, item), state);
            }
            if !touched.is_empty() {
                tracing::info!(
                    items = touched.len(),
                    "rebuilding snapshots from the journal"
                );
                update_now(&db, "holds", hold_updates(hold_changes.iter())).await?;
                let mut nodes = last_batch.into_iter();
                if let Some((node, batch)) = nodes.next() {
                    write_snapshots(&db, touched, node, batch).await?;
                }
                for (node, batch) in nodes {
                    write_snapshots(&db, HashMap::new(), node, batch).await?;
                }
            }
            let pending = find_all(holds(&db), doc! { "status": "held" })
                .await?
                .iter()
                .map(hold_from_doc)
                .collect::<Result<Vec<_>, _>>()?;
            tracing::info!(items = states.len(), "journal recovered");
            // How far the request log is applied, per partition: in the leases, and in
            // `offsets` as earlier versions kept it.
            let mut log_offsets: HashMap<i32, i64> = HashMap::new();
            for coll in ["leases", "offsets"] {
                for d in find_all(db.collection(coll), doc! {}).await? {
                    if let (Ok(p), Ok(o)) = (d.get_i32("_id"), d.get_i64("offset")) {
                        let at = log_offsets.entry(p).or_insert(o);
                        *at = (*at).max(o);
                    }
                }
            }
            // Items whose loads ever set a per-buyer limit: their ledgers, folded from
            // their entries (this journal keeps every entry).
            let mut limited: Vec<(Arc<str>, Arc<str>)> = Vec::new();
            for d in find_all(
                journal(&db),
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
                .zip(fold_ledgers(&db, &limited).await?)
            {
                if let Some(l) = ledger {
                    ledgers.push((shop, item, l));
                }
            }
            Ok(Recovered {
                items: states
                    .into_iter()
                    .map(|((shop, item), state)| (shop, item, state))
                    .collect(),
                log_offsets,
                holds: pending,
                ledgers,
            })
        })
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

#[cfg(test)]
mod tests {
    use super::{durable_read_concern, durable_write_concern};
    use mongodb::options::{Acknowledgment, ClientOptions, ReadConcernLevel};

    async fn parsed(uri: &str) -> (ClientOptions, Option<String>) {
        let mut options = ClientOptions::parse(uri).await.unwrap();
        let warning = durable_write_concern(&mut options);
        (options, warning)
    }

    #[tokio::test]
    async fn without_one_in_the_uri_the_journal_asks_for_majority_on_disk() {
        let (options, warning) = parsed("mongodb://127.0.0.1:1/nrtxn?directConnection=true").await;
        let wc = options.write_concern.expect("set");
        assert_eq!(wc.w, Some(Acknowledgment::Majority));
        assert_eq!(wc.journal, Some(true));
        assert_eq!(warning, None);
    }

    #[tokio::test]
    async fn a_weaker_write_concern_in_the_uri_is_kept_and_said_at_start() {
        for uri in [
            "mongodb://127.0.0.1:1/?w=1",
            "mongodb://127.0.0.1:1/?w=majority&journal=false",
        ] {
            let (options, warning) = parsed(uri).await;
            assert_ne!(
                options.write_concern.as_ref().unwrap().journal,
                Some(true),
                "{uri}: kept as given"
            );
            let warning = warning.unwrap_or_else(|| panic!("{uri}: no warning"));
            assert!(warning.contains("can be lost"), "{warning}");
        }
        let (options, warning) = parsed("mongodb://127.0.0.1:1/?w=majority&journal=true").await;
        assert_eq!(
            options.write_concern.unwrap().w,
            Some(Acknowledgment::Majority)
        );
        assert_eq!(warning, None);
    }

    #[tokio::test]
    async fn reads_ask_for_majority_unless_the_uri_names_a_level_which_is_kept_and_said() {
        let mut options = ClientOptions::parse("mongodb://127.0.0.1:1/nrtxn")
            .await
            .unwrap();
        assert_eq!(durable_read_concern(&mut options), None);
        assert_eq!(
            options.read_concern.expect("set").level,
            ReadConcernLevel::Majority
        );
        let mut options = ClientOptions::parse("mongodb://127.0.0.1:1/?readConcernLevel=local")
            .await
            .unwrap();
        let warning = durable_read_concern(&mut options).expect("a warning");
        assert!(warning.contains("rolls back"), "{warning}");
        assert_eq!(
            options.read_concern.expect("kept").level,
            ReadConcernLevel::Local
        );
    }
}
