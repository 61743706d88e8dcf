//! The writer task: it takes the waiting batches into one journal transaction, fenced by
//! the leases of the partitions their entries were read from, retries what the
//! connection or the server failed, answers each batch, and writes the snapshots after.

use std::collections::HashMap;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{mpsc as std_mpsc, Arc};
use std::time::{Duration, Instant};

use mongodb::bson::{doc, Document};
use mongodb::{ClientSession, Database};
use nrtxn_actors::verify::check_entry;
use nrtxn_actors::{AppendDone, Entry, ItemState, Metrics, StoreError};
use nrtxn_log::keyfilter::KeyFilter;
use tokio::sync::mpsc;

use crate::collections::is_duplicate;
use crate::documents::{storage, to_doc};
use crate::sessions::writer_mark;
use crate::snapshots::write_snapshots;
use crate::txn::{already_written, stale_fences, transaction_body, Fences, Txn, TxnError};

/// Most entries one `insert_many` takes.
pub(crate) const TXN_ENTRIES_MAX: usize = 16_384;
/// How long a journal transaction that failed for the connection or the server is tried
/// again before the journal gives up and the process stops: longer than a primary's
/// election, and than a stall that cost this node its connections.
const WRITE_RETRY_FOR: Duration = Duration::from_secs(60);
/// The snapshots (`items`) are written at most this often, after the answers: recovery
/// replays the journal after them.
const SNAPSHOT_EVERY: Duration = Duration::from_secs(1);

pub(crate) enum Command {
    Append(Vec<Entry>, AppendDone),
    Close(std_mpsc::Sender<()>),
}

/// Appends taken together into one transaction, each with its answer.
type Appends = Vec<(Vec<Entry>, AppendDone)>;

pub(crate) struct Writer {
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
    /// A writer whose first batch is `next_batch`, for node `node`; it says in
    /// `written_batch` the last batch it completed, and adds the keys it writes to `keys`.
    pub(crate) fn new(
        db: Database,
        metrics: Arc<Metrics>,
        keys: Arc<KeyFilter>,
        next_batch: i64,
        node: u32,
        written_batch: Arc<AtomicI64>,
    ) -> Writer {
        Writer {
            db,
            metrics,
            keys,
            next_batch,
            node,
            written_batch,
            session: None,
            hold: nrtxn_log::faults::journal_hold(),
            unsnapshotted: HashMap::new(),
            snapshot_at: Instant::now(),
        }
    }

    pub(crate) async fn run(mut self, mut rx: mpsc::Receiver<Command>) {
        while let Some(first) = self.next_command(&mut rx).await {
            let (appends, close) = gather(first, &mut rx);
            if !appends.is_empty() {
                self.write_and_answer(appends).await;
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

    /// The next command, writing the snapshots whenever they fall due while none comes;
    /// `None` once every sender is gone.
    async fn next_command(&mut self, rx: &mut mpsc::Receiver<Command>) -> Option<Command> {
        loop {
            if self.unsnapshotted.is_empty() {
                return rx.recv().await;
            }
            let due = SNAPSHOT_EVERY.saturating_sub(self.snapshot_at.elapsed());
            match tokio::time::timeout(due, rx.recv()).await {
                Ok(cmd) => return cmd,
                Err(_) => self.snapshot().await,
            }
        }
    }

    /// Writes `appends` as one transaction and answers each: written, or refused for
    /// its partition's lease. An error no retry mended is answered to all, then stops
    /// the process.
    async fn write_and_answer(&mut self, appends: Appends) {
        let weight: usize = appends.iter().map(|(entries, _)| entries.len()).sum();
        // The callbacks are not `Sync`: keep them out of the awaited borrow.
        let (batches, dones): (Vec<Vec<Entry>>, Vec<AppendDone>) = appends.into_iter().unzip();
        let started = Instant::now();
        let result = self.write(&batches).await;
        self.metrics
            .journal_write_seconds
            .observe(started.elapsed().as_secs_f64());
        self.metrics.journal_txn_entries.observe(weight as f64);
        match result {
            Ok(fenced) => answer_written(batches, dones, &fenced),
            Err(e) => {
                tracing::error!(error = %e, "journal batch failed");
                for (entries, done) in batches.into_iter().zip(dones) {
                    done(entries, Err(e.clone()));
                }
                nrtxn_actors::fatal::stop_not_durable("the journal can no longer be written");
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
        for entries in batches {
            let follows = follows_within(entries);
            assert!(
                follows.is_ok(),
                "a batch handed to the journal does not add up: {follows:?}"
            );
        }
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
        let mut refused = stale_within(&tags);
        self.commit(&entries, &docs, &tags, &mut refused).await?;
        for (i, e) in entries.iter().enumerate() {
            if !tags[i].is_some_and(|t| refused.contains(&t)) {
                self.remember(e);
            }
        }
        self.written_batch.store(batch, Ordering::Release);
        Ok(refused)
    }

    /// Runs transactions until `docs` are in the journal, but those of the partitions
    /// in `refused` (to which it adds those whose lease moved on meanwhile), or an error
    /// no retry mends.
    async fn commit(
        &mut self,
        entries: &[&Entry],
        docs: &[Document],
        tags: &[Option<(i32, u64)>],
        refused: &mut Vec<(i32, u64)>,
    ) -> Result<(), StoreError> {
        let mut written = vec![false; docs.len()];
        let started = Instant::now();
        let mut wait = Duration::from_millis(50);
        loop {
            let is_refused = |i: usize| tags[i].is_some_and(|t| refused.contains(&t));
            let live: Vec<usize> = (0..docs.len())
                .filter(|&i| !written[i] && !is_refused(i))
                .collect();
            let fences = fences_of(&live, entries, tags);
            // The holds of every entry not refused, also those a previous attempt wrote:
            // their updates only move a hold forward, so applying one again is harmless.
            let kept: Vec<&Entry> = (0..docs.len())
                .filter(|&i| !is_refused(i))
                .map(|i| entries[i])
                .collect();
            match self.transaction(docs, &live, &kept, &fences).await {
                Ok(Txn::Committed) => return Ok(()),
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
    }

    /// What the writer keeps of an entry it wrote: its key (for the key filter) and its
    /// item's state (for the next snapshot).
    fn remember(&mut self, e: &Entry) {
        if let Some(key) = &e.request_key {
            self.keys.insert(&e.shop, key);
        }
        if let Some(state) = e.state_after() {
            self.unsnapshotted
                .insert((e.shop.clone(), e.item.clone()), state);
        }
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
        let (db, hold) = (self.db.clone(), self.hold);
        if fences.is_empty() {
            // Nothing to fence (no partitioned log: one node writes): no transaction,
            // two round trips at most. A duplicate is found as after a transaction.
            return match transaction_body(&db, None, docs, live, kept, fences, hold).await {
                Err(TxnError::Retry(e)) if is_duplicate(&e) => {
                    already_written(&db, docs, live).await
                }
                other => other,
            };
        }
        let session = self.session().await?;
        session.start_transaction().await?;
        let outcome =
            transaction_body(&db, Some(&mut *session), docs, live, kept, fences, hold).await;
        settle(&db, session, outcome, docs, live, fences).await
    }

    /// The session the transactions run in, started (and recorded) if there is none.
    async fn session(&mut self) -> Result<&mut ClientSession, TxnError> {
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
        Ok(self.session.as_mut().expect("made above"))
    }
}

/// The first command and those waiting behind it, up to [`TXN_ENTRIES_MAX`] entries or
/// a `Close`: the appends, and the acknowledgement the close waits for.
fn gather(
    first: Command,
    rx: &mut mpsc::Receiver<Command>,
) -> (Appends, Option<std_mpsc::Sender<()>>) {
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
    (appends, close)
}

/// Answers each batch of a write that went through: written, or refused whole when one
/// of its entries was read under a `fenced` `(partition, epoch)`.
fn answer_written(batches: Vec<Vec<Entry>>, dones: Vec<AppendDone>, fenced: &[(i32, u64)]) {
    for (entries, done) in batches.into_iter().zip(dones) {
        let refused = entries.iter().any(|e| {
            e.log_pos
                .is_some_and(|p| fenced.contains(&(p.partition, p.epoch)))
        });
        let result = match refused {
            true => Err(StoreError::Fenced(fenced.to_vec())),
            false => Ok(()),
        };
        done(entries, result);
    }
}

/// The `(partition, epoch)` of entries read under an older epoch than others of their
/// partition in the same write: stale already, refused without asking the leases.
fn stale_within(tags: &[Option<(i32, u64)>]) -> Vec<(i32, u64)> {
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
    refused
}

/// The fence of the documents `live`: per partition, the epoch their entries were read
/// under and the highest offset among them.
fn fences_of(live: &[usize], entries: &[&Entry], tags: &[Option<(i32, u64)>]) -> Fences {
    let mut fences: Fences = HashMap::new();
    for &i in live {
        if let (Some((p, e)), Some(pos)) = (tags[i], entries[i].log_pos) {
            let f = fences.entry(p).or_insert((e, pos.offset));
            f.1 = f.1.max(pos.offset);
        }
    }
    fences
}

/// Ends `session`'s transaction after its statements gave `outcome`: commits it, or
/// aborts it and says why (a lease moved on, or duplicates of a commit that went
/// through after all).
async fn settle(
    db: &Database,
    session: &mut ClientSession,
    outcome: Result<Txn, TxnError>,
    docs: &[Document],
    live: &[usize],
    fences: &Fences,
) -> Result<Txn, TxnError> {
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
            let stale = stale_fences(db, fences).await?;
            if !stale.is_empty() {
                return Ok(Txn::Stale(stale));
            }
            already_written(db, docs, live).await
        }
        other => {
            let _ = session.abort_transaction().await;
            match other {
                Ok(Txn::Stale(_)) => match stale_fences(db, fences).await? {
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

/// Whether each item's entries in one batch follow one another by the rule the
/// processor asserted before it sent them ([`check_entry`]): the journal's half of that
/// pair, checked before the batch is written, as recovery checks it after.
fn follows_within(entries: &[Entry]) -> Result<(), String> {
    let mut last: HashMap<(&str, &str), ItemState> = HashMap::new();
    for e in entries {
        let Some(after) = e.state_after() else {
            continue;
        };
        if let Some(before) = last.get(&(&*e.shop, &*e.item)) {
            check_entry(*before, e).map_err(|why| format!("item {}/{}: {why}", e.shop, e.item))?;
        }
        last.insert((&e.shop, &e.item), after);
    }
    Ok(())
}
