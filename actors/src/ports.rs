//! The ports the core talks through: the journal's (writes, outcomes, item reads,
//! sharing, the outbox, its lifecycle: together [`Journal`]), the request log's
//! ([`RequestLog`]), the leases of a shared log ([`Leases`]) and the hooks a shared log
//! gives the processors ([`LogHooks`]). The core never names a backend: adapters (the
//! embedded journal, Kafka, MongoDB) implement these traits and are chosen by
//! configuration at start.

use std::sync::Arc;

use crate::ledger::BuyerLedger;
use crate::returns::SaleRecord;
use crate::types::{Entry, Event, HoldView, ItemState, LogPos, Outcome, Request};

/// Told the log positions of entries once they are journaled (a partitioned log commits
/// its offsets from this).
pub type JournaledHook = Arc<dyn Fn(Vec<LogPos>) + Send + Sync>;

/// Carries decided outcomes to the node (by id) whose WorkManager holds their reply
/// handles.
pub type RemoteReplies = Arc<dyn Fn(u32, Vec<Arc<Outcome>>) + Send + Sync>;

/// What a log shared by several nodes (Kafka) gives the processors, through the engine's
/// builder ([`crate::Topology::shared`]), before they start. With it, a
/// processor no longer trusts that a request reaching it is new (another node's
/// WorkManager may have sent the same key, or the log redelivers after a crash or a
/// rebalance): it checks every key against the journal before applying, and answers a
/// repeat with the recorded outcome.
pub struct LogHooks {
    /// This node's id; outcomes of requests from other nodes go through `remote`.
    pub node_id: u32,
    pub journaled: JournaledHook,
    /// Told the log positions of entries the journal refused ([`StoreError::Fenced`]):
    /// this node no longer holds their partitions' leases, so the node holding them
    /// decides those requests. The log stops waiting for them (a partition taken from
    /// this node need not drain them first) but commits no offset past them.
    pub fenced: JournaledHook,
    pub remote: RemoteReplies,
    /// Sends requests a processor makes itself (a hold's expiry) through the log, so
    /// they reach whichever node owns the item now.
    pub resubmit: Arc<dyn Fn(Vec<Request>) + Send + Sync>,
}

#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    #[error("storage error: {0}")]
    Storage(String),
    #[error("the store is closed")]
    Closed,
    #[error("the request log is full")]
    Full,
    /// The journal refused the entries read from these partitions under these epochs
    /// (`(partition, epoch)`): another node holds the partition's write lease now
    /// ([`Leases`]). Nothing of them was written; every other entry of the batch is
    /// durable.
    #[error("refused: the write lease of partitions {0:?} passed to another node")]
    Fenced(Vec<(i32, u64)>),
    /// The disk of the store has too little room for new writes (below the free space
    /// it keeps, or none at all): nothing of the call was taken. Reads still work.
    #[error("the store's disk is full")]
    DiskFull,
}

/// The write leases of a partitioned request log's partitions, kept by a journal that
/// several nodes write. A node given partitions takes their leases before it reads
/// them; each take gives the partition a new epoch, greater than any before, and from
/// then on the journal refuses entries read under an older one
/// ([`StoreError::Fenced`]). So a node that stalled while its partitions moved cannot
/// write over the items their new owner took over.
pub trait Leases: Send + Sync + 'static {
    /// Takes the lease of each partition for this node; its new epoch, in the order
    /// asked.
    fn take(&self, partitions: &[i32]) -> Result<Vec<u64>, StoreError>;
}

/// Called once a journal batch is durable (or failed), with the batch handed back so the
/// processor can fan its outcomes out without having kept a copy.
pub type AppendDone = Box<dyn FnOnce(Vec<Entry>, Result<(), StoreError>) + Send>;

/// What the journal holds at start: every item's state (snapshot plus replayed tail).
#[derive(Debug, Default)]
pub struct Recovered {
    pub items: Vec<(Arc<str>, Arc<str>, ItemState)>,
    /// The highest request-log offset applied, per partition: a redelivered message at
    /// or below it is skipped, not applied again.
    pub log_offsets: std::collections::HashMap<i32, i64>,
    /// Holds still pending (`held`), to be re-armed; those already past `expires_at`
    /// expire at once.
    pub holds: Vec<HoldView>,
    /// The per-buyer limit and counts of every item that has one ([`crate::ledger`]).
    pub ledgers: Vec<(Arc<str>, Arc<str>, BuyerLedger)>,
}

/// The durable record of every decision, as the narrow ports its callers use: the
/// processors write through [`JournalWrite`] and read through [`Outcomes`],
/// [`ItemReads`] and [`Sharing`] (together [`ShardJournal`]), the WorkManagers read
/// [`Outcomes`] only, the outbox relay reads [`Outbox`], and the engine starts and stops
/// it through [`Lifecycle`]. Every adapter implements them all ([`Journal`]); each method
/// is required unless its default is right for a journal only this node writes.
pub trait Journal: ShardJournal + Outbox + Lifecycle {}

impl<T: ShardJournal + Outbox + Lifecycle> Journal for T {}

/// What a processor calls of the journal: its batches' writes, the outcomes of keys (its
/// duplicate check), the items it brings into memory and, with a journal several nodes
/// write, the keys and holds of a partition that comes to it.
pub trait ShardJournal: JournalWrite + Outcomes + ItemReads + Sharing {}

impl<T: JournalWrite + Outcomes + ItemReads + Sharing> ShardJournal for T {}

/// The processors' port: one durable write per batch.
pub trait JournalWrite: Send + Sync + 'static {
    /// Appends one batch in one durable write, in call order, then calls `done` (from any
    /// thread). Entries of one item arrive in sequence order; the adapter keeps it.
    /// An adapter whose queue has no room calls `done` with [`StoreError::Full`] before
    /// returning, having kept nothing: the caller sends the batch again later, before any
    /// batch after it. Every other error is reported as the write's result.
    fn append(&self, entries: Vec<Entry>, done: AppendDone);

    /// Whether a batch whose `append` returned without [`StoreError::Full`] is written
    /// before every batch appended after it, by any processor, and a crash keeps a
    /// prefix of them: one writer and one log. Then a processor may tell a request's
    /// outcome early ([`crate::types::EarlySignal`]). A journal whose batches are
    /// written apart (several nodes, a database) says no.
    fn appends_in_order(&self) -> bool {
        false
    }
}

/// Recorded outcomes by request key: the WorkManagers (repeats, polls) and the
/// processors' duplicate check.
pub trait Outcomes: Send + Sync + 'static {
    /// The recorded outcome of each key, in the order asked.
    fn outcomes(&self, shop: &str, keys: &[&str]) -> Result<Vec<Option<Outcome>>, StoreError>;

    /// Like [`Outcomes::outcomes`], but read from the store itself, never answered from a
    /// filter that only knows this node's writes: the processors' duplicate check.
    fn decided(&self, shop: &str, keys: &[&str]) -> Result<Vec<Option<Outcome>>, StoreError> {
        self.outcomes(shop, keys)
    }

    /// Whether [`Outcomes::outcomes`] would find none of these keys, known from memory
    /// (a filter of the keys written), with no I/O: the WorkManager then takes them in at
    /// once, and reads the store, off its thread, only for the others. `false` when it
    /// cannot tell without a read.
    fn surely_new(&self, _shop: &str, _keys: &[&str]) -> bool {
        false
    }
}

/// Reads of items as durable: their states, holds and events.
pub trait ItemReads: Send + Sync + 'static {
    /// The state of each item as its last journal entry has it (`None`: no entry), in
    /// the order asked: an item that left memory, or one another node may have changed.
    fn item_states(
        &self,
        items: &[(Arc<str>, Arc<str>)],
    ) -> Result<Vec<Option<ItemState>>, StoreError>;

    /// Holds by id, as durable (`None`: no such hold), in the order asked.
    fn holds(&self, shop: &str, hold_ids: &[&str]) -> Result<Vec<Option<HoldView>>, StoreError>;

    /// Each item's per-buyer limit and counts as durable (`None`: no limit), in the
    /// order asked: read with its state when an item comes (back) into memory.
    fn ledgers(
        &self,
        items: &[(Arc<str>, Arc<str>)],
    ) -> Result<Vec<Option<BuyerLedger>>, StoreError>;

    /// What the journal holds, durably, of each request key a return names (`None`: no
    /// decided request under it, or a sale past the return window the journal no longer
    /// keeps), in the order asked: the keyed entry's item, op, status, quantity and time,
    /// and the units of `ok` returns journaled against it ([`crate::returns`]). Read by an
    /// item's processor for the returns of a batch, never for any other request.
    fn sales(&self, shop: &str, keys: &[&str]) -> Result<Vec<Option<SaleRecord>>, StoreError>;

    /// A page of the shop's items as durable, in name order (bytewise): at most `limit`
    /// items named after `after` (from the first when `None`), without the internal ones
    /// ([`crate::INTERNAL_ITEM_PREFIX`]), each with its state; `more` tells whether items
    /// come after the page.
    fn item_page(
        &self,
        shop: &str,
        after: Option<&str>,
        limit: usize,
    ) -> Result<ItemPage, StoreError>;

    /// A page of the shop's holds as durable, in hold id order (bytewise): at most
    /// `limit` of those `query` asks for, with ids after `after` (from the first when
    /// `None`); `more` tells whether any come after the page. Ended holds are listed
    /// while the journal keeps their entries.
    fn hold_page(
        &self,
        shop: &str,
        query: &HoldQuery,
        after: Option<&str>,
        limit: usize,
    ) -> Result<HoldPage, StoreError>;

    /// The item's durable events with `seq > after`, in seq order, at most `limit`.
    fn events(
        &self,
        shop: &str,
        item: &str,
        after: u64,
        limit: usize,
    ) -> Result<Vec<Event>, StoreError>;
}

/// What a journal several nodes write adds (MongoDB, with a log they share:
/// [`crate::JournalWriters::AllNodes`]). The defaults are those of a journal only this
/// node writes.
pub trait Sharing: Send + Sync + 'static {
    /// Makes [`Outcomes::outcomes`] know every key journaled so far for requests read
    /// from log partition `partition`, by any node. Called by a processor when the
    /// partition comes (back) to this node, before it checks that partition's keys: the
    /// node that had it before has journaled all it read (its readers drain on
    /// revocation), and entries below offset `from` will from now on come from this node
    /// only, so the next call may start there. A journal that only this node writes
    /// knows its keys already.
    fn learn_partition(&self, partition: i32, from: i64) -> Result<(), StoreError> {
        let _ = (partition, from);
        Ok(())
    }

    /// The pending (`held`) holds of these items, as durable: a node taking an item over
    /// re-arms its holds. A journal only this node writes re-arms them all at start.
    fn pending_holds(&self, items: &[(Arc<str>, Arc<str>)]) -> Result<Vec<HoldView>, StoreError> {
        let _ = items;
        Ok(Vec::new())
    }
}

/// The outbox relay's port: committed events in commit order, and where it stopped.
pub trait Outbox: Send + Sync + 'static {
    /// The relay's next page: committed events after `cursor`, in the order they were
    /// committed (so each item's in seq order), about `limit` of them, and the cursor
    /// after them. A cursor is the journal's own position (opaque to the relay); 0 is the
    /// start. Entries that are not events (an unknown item's) are skipped, and the cursor
    /// passes them.
    fn relay_read(&self, cursor: u64, limit: usize) -> Result<RelayPage, StoreError>;

    /// [`Outbox::relay_read`], of the events of `kinds` only: the cursor passes the
    /// others. A journal that can pick them without reading the others does (the stock
    /// alerts read only alerts).
    fn relay_read_kinds(
        &self,
        cursor: u64,
        limit: usize,
        kinds: &[crate::types::Op],
    ) -> Result<RelayPage, StoreError> {
        // Pages with none of `kinds` are passed at once, up to a bound, so a reader that
        // waits after a page keeps up with a busy journal. A page is not always `limit`
        // events long (MongoDB's end at a batch's edge), so the read goes on while the
        // cursor moves, not while the pages are full.
        const EMPTY_PAGES_MAX: usize = 64;
        let mut page = self.relay_read(cursor, limit)?;
        page.events.retain(|e| kinds.contains(&e.kind));
        for _ in 1..EMPTY_PAGES_MAX {
            if !page.events.is_empty() || page.next == cursor {
                break;
            }
            let from = page.next;
            let next = self.relay_read(from, limit)?;
            if next.next == from {
                break;
            }
            page = next;
            page.events.retain(|e| kinds.contains(&e.kind));
        }
        Ok(page)
    }

    /// The cursor after everything committed now: a reader that starts here sees only
    /// what is committed from now on.
    fn relay_end(&self) -> Result<u64, StoreError>;

    /// Where `reader` stopped: every event up to this cursor was passed (`None`: it
    /// never saved one).
    fn relay_cursor(&self, reader: OutboxReader) -> Result<Option<u64>, StoreError>;

    /// Records durably (in the journal's own store) that `reader` passed every event up
    /// to `cursor`; returns once it is written. A cursor never goes back.
    fn relay_save(&self, reader: OutboxReader, cursor: u64) -> Result<(), StoreError>;
}

/// Who follows the outbox from a cursor of its own ([`Outbox::relay_cursor`]): the
/// journal keeps the entries neither has passed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutboxReader {
    /// The outbox relay, to the events topic.
    Events,
    /// The stock alerts, to the shops' `notify_url`.
    Alerts,
}

impl OutboxReader {
    /// The reader's name in the journal's store.
    pub fn name(self) -> &'static str {
        match self {
            OutboxReader::Events => "relay",
            OutboxReader::Alerts => "alerts",
        }
    }
}

/// A shop's events as they are committed, for a push stream (`GET .../events/stream`):
/// the journal's commit order on a node that writes its journal alone, the events topic's
/// partitions with several nodes. A position in it is a cursor, opaque to the caller.
pub trait EventFeed: Send + Sync + 'static {
    /// A reader of `shop`'s events after `after` (from now when `None`), and the cursor
    /// of where it starts. `Err(FeedError::BadCursor)` when `after` is not a cursor of
    /// this feed.
    fn open(
        &self,
        shop: Arc<str>,
        after: Option<&str>,
    ) -> Result<(Box<dyn FeedReader>, String), FeedError>;
}

/// One reader of a feed, used from one thread (its calls block).
pub trait FeedReader: Send + 'static {
    /// The shop's next events, each with the cursor just after it, in order (each item's
    /// in seq order), waiting up to about `wait` when there are none.
    fn next(&mut self, wait: std::time::Duration) -> Result<Vec<(String, Event)>, StoreError>;
}

#[derive(Debug, thiserror::Error)]
pub enum FeedError {
    #[error("not a cursor of this stream: {0}")]
    BadCursor(String),
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// Start and stop.
pub trait Lifecycle: Send + Sync + 'static {
    /// Every item's state, rebuilt from the last snapshot and the journal after it.
    fn recover(&self) -> Result<Recovered, StoreError>;

    /// Waits for the writes in flight, writes a final snapshot, and closes.
    fn close(&self);
}

/// A page of a shop's items ([`ItemReads::item_page`]).
#[derive(Debug, Default)]
pub struct ItemPage {
    /// `(item, state)`, in name order.
    pub items: Vec<(Arc<str>, ItemState)>,
    /// Whether the shop has items after the last one of the page.
    pub more: bool,
}

/// Which of a shop's holds a listing asks for ([`ItemReads::hold_page`]): each filter
/// when set.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HoldQuery {
    pub item: Option<Arc<str>>,
    pub buyer: Option<Arc<str>>,
    pub status: Option<crate::types::HoldStatus>,
    /// Orders' records (holds of the shop's order items) instead of holds of items.
    pub orders: bool,
}

/// A page of a shop's holds ([`ItemReads::hold_page`]).
#[derive(Debug, Default)]
pub struct HoldPage {
    pub holds: Vec<HoldView>,
    /// Whether the shop has holds the query asks for after the last one of the page.
    pub more: bool,
}

/// A page of committed events for the outbox relay (see [`Outbox::relay_read`]).
#[derive(Debug, Default)]
pub struct RelayPage {
    pub events: Vec<Event>,
    /// The cursor after this page (equal to the one asked when nothing was committed
    /// since).
    pub next: u64,
}

/// Told once the requests marked `logged` are durable in the request log, or that they
/// cannot be made so: by whichever thread learns it (the log's writer, the producer's
/// delivery callback), so that the call it belongs to is answered from there, with one
/// wake-up of its caller. Dropped untold (the log closed first), it tells
/// [`StoreError::Closed`].
pub struct LogAck(Option<Tell>);

/// What a [`LogAck`] calls with what it is told.
type Tell = Box<dyn FnOnce(Result<(), StoreError>) + Send>;

impl LogAck {
    pub fn new(tell: impl FnOnce(Result<(), StoreError>) + Send + 'static) -> LogAck {
        LogAck(Some(Box::new(tell)))
    }

    pub fn done(mut self, result: Result<(), StoreError>) {
        if let Some(tell) = self.0.take() {
            tell(result);
        }
    }
}

impl Drop for LogAck {
    fn drop(&mut self) {
        if let Some(tell) = self.0.take() {
            tell(Err(StoreError::Closed));
        }
    }
}

/// Carries accepted requests to the processors.
pub trait RequestLog: Send + Sync + 'static {
    /// Hands requests to the processors that own their items. Requests with `logged` set
    /// are made durable first, and `ack` is told once they are (at once if none is); the
    /// log then guarantees they reach a processor, also after a crash. An `Err` means
    /// none of the requests was handed on (the caller undoes their admission); once one
    /// is, the call must answer `Ok`.
    fn append(&self, reqs: Vec<Request>, ack: Option<LogAck>) -> Result<(), StoreError>;

    /// Like [`RequestLog::append`] (admitted, or refused whole, at once), but the log may
    /// hold the requests on the calling thread until [`RequestLog::release_held`] is
    /// called on that thread, so that the calls of one burst reach the journal's writer
    /// and the processors together: one hand-off, one wake-up, instead of one per call.
    /// `Ok(true)`: the requests are held, and whoever called must call `release_held`
    /// soon after, on the same thread (the WorkManager does at the end of its mailbox's
    /// burst); `Ok(false)`: they were handed on at once (the default), nothing to release.
    fn append_held(&self, reqs: Vec<Request>, ack: Option<LogAck>) -> Result<bool, StoreError> {
        self.append(reqs, ack).map(|()| false)
    }

    /// Hands on what [`RequestLog::append_held`] held on this thread, in the order it
    /// was given.
    fn release_held(&self) {}

    /// Requests that were made durable but have no outcome yet (after a restart).
    fn pending(&self) -> Result<Vec<Request>, StoreError>;

    /// Hands requests that are already durable to the processors again, writing nothing.
    fn redeliver(&self, reqs: Vec<Request>);

    /// Logged requests whose outcomes are now journaled: the log may forget them. A log
    /// whose records are retired in the journal's own write has nothing to do here.
    fn retire(&self, _shop: &Arc<str>, _keys: Vec<Arc<str>>) {}

    /// Whether new requests may be taken now: `Err` ([`StoreError::DiskFull`]) while
    /// the log's disk has no room, so that a caller is refused at once instead of
    /// waiting for a write that cannot be made. Called once per call, before anything of
    /// it is applied: it must cost no I/O most of the time. [`RequestLog::append`]
    /// checks it too; calls that bypass the log (loads) ask it themselves.
    fn admit(&self) -> Result<(), StoreError> {
        Ok(())
    }

    /// Whether requests appended now will be read (a consumer group has assigned this
    /// node its partitions, say). `/readyz` answers 503 until it is.
    fn ready(&self) -> bool {
        true
    }

    /// Stops handing requests to the processors (shutdown); what was handed on is still
    /// journaled by the processors' flush.
    fn close(&self) {}
}
