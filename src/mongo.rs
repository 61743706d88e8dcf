//! The MongoDB journal (`--mongo-uri`): the `Journal` port on a MongoDB replica set.
//!
//! Collections (database from the URI's path, else `nrtxn`):
//! - `journal`: one document per decision or load, the entry's fields plus `batch` (the
//!   writer's batch number, for recovery, and `node`, the id of the node that wrote it,
//!   for that node's outbox relay). Unique indexes on `(shop, request_key)` for
//!   documents with a key and on `(shop, item, seq)` for documents with a sequence, so
//!   every document is covered by one and a retried batch can never insert twice.
//! - `items`: the snapshot of each item (`shop, item, stock, reserved, seq`), unique on
//!   `(shop, item)`, updated after each batch.
//! - `meta`: `{_id: "snapshot", batch}`: every batch up to this one is in `items`;
//!   `{_id: "relay:{node}", batch}`: the outbox relay of node `node` published every
//!   event of that node's batches up to this one.
//! - `holds`: one document per hold (`shop, hold_id, item, qty, expires_at, status,
//!   seq`), unique on `(shop, hold_id)`, updated with the snapshots.
//!
//! One writer task takes the waiting batches (up to [`TXN_ENTRIES_MAX`] entries) into one
//! unordered `insert_many`, then updates the snapshots, then `meta`, then answers. A crash
//! between the journal write and the snapshot update leaves `meta` behind; recovery
//! replays the journal after it and rewrites the snapshots. Only operations that MongoDB
//! 6 and 7 support on a replica set are used.

use std::collections::HashMap;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{mpsc as std_mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use futures::TryStreamExt;
use mongodb::bson::{doc, Bson, Document};
use mongodb::error::ErrorKind;
use mongodb::options::IndexOptions;
use mongodb::{Collection, Database, IndexModel};
use nrtxn_actors::verify::Verifier;
use nrtxn_actors::{
    AppendDone, Entry, Event, HoldStatus, HoldView, ItemState, Journal, Metrics, Outcome,
    Recovered, RelayPage, StoreError,
};
use tokio::sync::mpsc;

use crate::keyfilter::KeyFilter;

/// Most entries one `insert_many` takes.
const TXN_ENTRIES_MAX: usize = 16_384;
/// Batches waiting for the writer at least; [`MongoJournal::open`] sizes the queue to
/// the appends the processors can have outstanding in all (shards × batches in flight
/// each), so a full queue is a broken bound, never a normal state.
const QUEUE_MIN: usize = 1024;
/// Statements per `update` command (the server's limit is 100,000).
const UPDATES_PER_COMMAND: usize = 10_000;
/// A failed batch write is retried this many times (duplicates of a retry are skipped
/// by the unique indexes) before the journal gives up and the process stops.
const WRITE_ATTEMPTS: u32 = 3;

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
    Ok(doc)
}

fn from_doc(doc: Document) -> Result<Entry, StoreError> {
    mongodb::bson::from_document(doc).map_err(storage)
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

/// The `holds` updates of a run of entries: each hold's last state in it, one statement
/// per hold (an unordered command would not keep two statements of one hold in order).
/// Like snapshots, a hold document only moves forward (`seq` filter).
fn hold_updates<'a>(entries: impl Iterator<Item = &'a Entry>) -> Vec<Document> {
    let mut set: HashMap<(Arc<str>, Arc<str>), Document> = HashMap::new();
    for e in entries {
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
            let client = mongodb::Client::with_uri_str(uri).await.map_err(storage)?;
            let db = client
                .default_database()
                .unwrap_or_else(|| client.database("nrtxn"));
            create_indexes(&db).await?;
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

/// The last state of every item a batch touched.
fn last_states<'a>(
    entries: impl Iterator<Item = &'a Entry>,
) -> HashMap<(Arc<str>, Arc<str>), ItemState> {
    let mut out = HashMap::new();
    for e in entries {
        if let Some(state) = e.state_after() {
            out.insert((e.shop.clone(), e.item.clone()), state);
        }
    }
    out
}

/// How far the request log is applied, per partition (`offsets`: `{_id: partition,
/// offset}`), only ever raised.
async fn write_offsets(db: &Database, batches: &[Vec<Entry>]) -> Result<(), StoreError> {
    let mut offsets: HashMap<i32, i64> = HashMap::new();
    for pos in batches.iter().flatten().filter_map(|e| e.log_pos) {
        let o = offsets.entry(pos.partition).or_insert(pos.offset);
        *o = (*o).max(pos.offset);
    }
    let updates: Vec<Document> = offsets
        .into_iter()
        .map(|(partition, offset)| {
            doc! {
                "q": { "_id": partition },
                "u": { "$max": { "offset": offset } },
                "upsert": true,
            }
        })
        .collect();
    update_all(db, "offsets", updates).await
}

/// Runs `updates` (statements of the `update` command) in as few commands as possible,
/// with the database's write concern: one round trip instead of one per document (13 ms
/// each on the test server). A statement that fails only because its upsert hit a
/// unique index (code 11000) is not an error: callers use a filter that does not match
/// when the stored document is already newer.
async fn update_all(
    db: &Database,
    collection: &str,
    updates: Vec<Document>,
) -> Result<(), StoreError> {
    for chunk in updates.chunks(UPDATES_PER_COMMAND) {
        let mut cmd = doc! { "update": collection, "updates": chunk.to_vec(), "ordered": false };
        if let Some(wc) = db.write_concern() {
            cmd.insert(
                "writeConcern",
                mongodb::bson::to_document(wc).map_err(storage)?,
            );
        }
        let reply = db.run_command(cmd).await.map_err(storage)?;
        if let Ok(wc) = reply.get_document("writeConcernError") {
            return Err(storage(format!("{collection}: write concern: {wc}")));
        }
        if let Ok(errors) = reply.get_array("writeErrors") {
            for e in errors {
                let code = e.as_document().and_then(|d| d.get_i32("code").ok());
                if code != Some(11000) {
                    return Err(storage(format!("{collection}: {e}")));
                }
            }
        }
    }
    Ok(())
}

async fn write_snapshots(
    db: &Database,
    states: HashMap<(Arc<str>, Arc<str>), ItemState>,
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
    update_all(db, "items", updates).await?;
    db.collection::<Document>("meta")
        .update_one(
            doc! { "_id": "snapshot" },
            doc! { "$max": { "batch": batch } },
        )
        .upsert(true)
        .await
        .map_err(storage)?;
    Ok(())
}

struct Writer {
    db: Database,
    metrics: Arc<Metrics>,
    keys: Arc<KeyFilter>,
    next_batch: i64,
    node: u32,
    written_batch: Arc<AtomicI64>,
}

impl Writer {
    async fn run(mut self, mut rx: mpsc::Receiver<Command>) {
        while let Some(first) = rx.recv().await {
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
                let failed = result.is_err();
                if let Err(e) = &result {
                    tracing::error!(error = %e, "journal batch failed");
                }
                for (entries, done) in batches.into_iter().zip(dones) {
                    done(entries, result.clone());
                }
                if failed {
                    tracing::error!("stopping: the journal can no longer be written");
                    std::process::exit(70);
                }
            }
            if let Some(ack) = close {
                let _ = ack.send(());
                return;
            }
        }
    }

    async fn write(&mut self, batches: &[Vec<Entry>]) -> Result<(), StoreError> {
        let batch = self.next_batch;
        self.next_batch += 1;
        let mut docs = Vec::new();
        for entries in batches {
            for e in entries {
                if let Some(key) = &e.request_key {
                    self.keys.insert(&e.shop, key);
                }
                docs.push(to_doc(e, batch, self.node)?);
            }
        }
        let mut attempt = 0;
        loop {
            attempt += 1;
            match self.insert(&docs).await {
                Ok(()) => break,
                Err(e) if attempt < WRITE_ATTEMPTS => {
                    tracing::warn!(error = %e, attempt, "journal insert failed; retrying");
                    tokio::time::sleep(Duration::from_millis(100 * attempt as u64)).await;
                }
                Err(e) => return Err(e),
            }
        }
        write_offsets(&self.db, batches).await?;
        update_all(&self.db, "holds", hold_updates(batches.iter().flatten())).await?;
        write_snapshots(&self.db, last_states(batches.iter().flatten()), batch).await?;
        self.written_batch.store(batch, Ordering::Release);
        Ok(())
    }

    /// One unordered `insert_many`. Duplicates are documents a previous attempt already
    /// wrote: each is checked to be the very same decision, and then skipped.
    async fn insert(&self, docs: &[Document]) -> Result<(), StoreError> {
        let err = match journal(&self.db).insert_many(docs).ordered(false).await {
            Ok(_) => return Ok(()),
            Err(e) => e,
        };
        let ErrorKind::InsertMany(failure) = err.kind.as_ref() else {
            return Err(storage(err));
        };
        if let Some(wc) = &failure.write_concern_error {
            return Err(storage(format!("write concern: {}", wc.message)));
        }
        for w in failure.write_errors.iter().flatten() {
            if w.code != 11000 {
                return Err(storage(format!("insert: {}", w.message)));
            }
            let mine = &docs[w.index];
            let filter = match mine.get("request_key") {
                Some(Bson::String(key)) => doc! { "shop": mine.get("shop"), "request_key": key },
                _ => {
                    doc! { "shop": mine.get("shop"), "item": mine.get("item"), "seq": mine.get("seq") }
                }
            };
            let theirs = journal(&self.db)
                .find_one(filter)
                .await
                .map_err(storage)?
                .ok_or_else(|| storage("duplicate key, but no document holds it"))?;
            let same = ["item", "seq", "request_key", "status", "qty"]
                .iter()
                .all(|f| mine.get(f) == theirs.get(f));
            if !same {
                // Two writers decided the same item or key: the single-writer rule is
                // broken and nothing written after this can be trusted.
                return Err(storage(format!(
                    "conflicting journal entry: {mine} against {theirs}"
                )));
            }
        }
        Ok(())
    }
}

impl Journal for MongoJournal {
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

    fn outcomes(&self, shop: &str, keys: &[&str]) -> Result<Vec<Option<Outcome>>, StoreError> {
        let maybe: Vec<String> = keys
            .iter()
            .filter(|k| self.keys.may_contain(shop, k))
            .map(|k| k.to_string())
            .collect();
        self.find_outcomes(shop, keys, maybe)
    }

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

    fn decided(&self, shop: &str, keys: &[&str]) -> Result<Vec<Option<Outcome>>, StoreError> {
        // Other nodes write this journal too: the filter knows only this node's keys.
        let all = keys.iter().map(|k| k.to_string()).collect();
        self.find_outcomes(shop, keys, all)
    }

    fn shared(&self) -> bool {
        true
    }

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
                    let mut find = coll.find(filter).sort(doc! { "batch": 1, "seq": 1 });
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
            let upto = db
                .collection::<Document>("meta")
                .find_one(doc! { "_id": "snapshot" })
                .await
                .map_err(storage)?
                .and_then(|d| d.get_i64("batch").ok())
                .unwrap_or(0);
            let mut tail = journal(&db)
                .find(doc! { "batch": { "$gt": upto } })
                .sort(doc! { "batch": 1, "seq": 1 })
                .await
                .map_err(storage)?;
            let mut last_batch = upto;
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
                last_batch = last_batch.max(d.get_i64("batch").unwrap_or(upto));
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
                update_all(&db, "holds", hold_updates(hold_changes.iter())).await?;
                write_snapshots(&db, touched, last_batch).await?;
            }
            let pending = find_all(holds(&db), doc! { "status": "held" })
                .await?
                .iter()
                .map(hold_from_doc)
                .collect::<Result<Vec<_>, _>>()?;
            tracing::info!(items = states.len(), "journal recovered");
            let mut log_offsets = HashMap::new();
            let mut cursor = db
                .collection::<Document>("offsets")
                .find(doc! {})
                .await
                .map_err(storage)?;
            while let Some(d) = cursor.try_next().await.map_err(storage)? {
                if let (Ok(p), Ok(o)) = (d.get_i32("_id"), d.get_i64("offset")) {
                    log_offsets.insert(p, o);
                }
            }
            Ok(Recovered {
                items: states
                    .into_iter()
                    .map(|((shop, item), state)| (shop, item, state))
                    .collect(),
                log_offsets,
                holds: pending,
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
