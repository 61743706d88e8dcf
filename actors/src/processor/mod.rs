//! The Processor: one actor per shard, the only writer of its items.
//!
//! It drains its priority mailbox in batches (up to `batch_max` entries), applies each
//! batch in memory in order ([`crate::apply`]), appends the batch to the journal in one
//! durable write, and answers only once that write is durable. While one batch is being
//! written the next is applied, so the journal's fsync overlaps the work in memory; at
//! most [`BATCHES_IN_FLIGHT_MAX`] batches are in flight, so under load the waiting
//! requests pile into larger batches instead of more writes.
//!
//! Holds are the processor's too: it keeps each pending hold of its items and a timing
//! wheel ([`crate::wheel`]) of their expiries, and wakes when the next one is due (tick
//! [`WHEEL_TICK_MS`]) to release it through the mailbox's high lane, like a return.
//!
//! This file holds the actor, its state, its messages and the items it keeps in memory;
//! the rest is one module per concern: `batch` (scheduling, applying and appending
//! batches), `holds` (pending holds and the wheel), `cluster` (screening with a shared
//! log and journal) and `fanout` (retiring a durable batch and sending its outcomes).

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use actix::prelude::*;
use prometheus::IntGauge;
use tokio::sync::oneshot;

use crate::apply::{apply, apply_hold_end, apply_load, reject};
use crate::checkback::CheckBack;
use crate::ledger::BuyerLedger;
use crate::mailbox::{LoadChunk, PriorityMailbox, Work};
use crate::metrics::Metrics;
use crate::ports::{Journal, LogHooks, StoreError};
use crate::types::{
    hold_end_key, is_order_item, now_ms, order_of_line, Entry, HoldStatus, HoldView, ItemState,
    ItemView, LogPos, Millis, Op, Outcome, Request, Status, LINE_PREFIX,
};
use crate::wheel::{TimerId, TimingWheel};
use crate::work_manager::{Decided, Registry};

mod batch;
mod cluster;
mod fanout;
mod holds;
mod reads;

use reads::Prefetched;

/// Journal appends a shard may have outstanding. Two lets applying batch N+1 overlap
/// writing batch N; more would only add latency, since one journal writer serializes them.
pub const BATCHES_IN_FLIGHT_MAX: usize = 2;
/// The hold-expiry wheel's tick: a hold is released within one tick of `expires_at`
/// (plus the wait for the shard's next batch).
pub const WHEEL_TICK_MS: u64 = 1;
/// With a shared log, how long after sending a hold's expiry through the log it is sent
/// again if the hold is still pending here.
const EXPIRY_RESEND_MS: u64 = 1_000;
/// Copies of one hold's expiry sent through the log before this node lets the hold go.
const EXPIRY_SENDS_MAX: u8 = 5;
/// How long a batch the journal had no room for waits before it is sent again.
const JOURNAL_FULL_RETRY_MS: u64 = 1;
/// How long after its order's expiry an order's line's own timer fires, in case the
/// order's ending never reached it: long enough for the order's ending to arrive first.
pub const LINE_GRACE_MS: i64 = 30_000;
/// How often an order's record or line past its time nudges its order again while it
/// is still pending here.
const ORDER_NUDGE_RETRY_MS: i64 = 5_000;
/// How often a due hold of a shop with a check-back is reported again while it is
/// still pending (the check itself may take its shop's timeout times its attempts).
const CHECK_RESEND_MS: i64 = 5_000;
/// How long a nudge waits for the orders' hook while the node is starting.
const ORDER_HOOK_WAIT_MS: i64 = 100;
/// Order lines one shard keeps waiting at most; past it a line is answered
/// [`Status::Tentative`] and its order asks again a moment later.
pub const WAITING_LINES_MAX: usize = 100_000;

/// Why an order is nudged ([`OrderHook`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Nudge {
    /// Its record or a line is past its time: the order expires, if it has not ended.
    Due,
    /// Its record or a line was read back from the journal (a start, a takeover): an
    /// order whose lines are not all held is ended, and an ended one's lines follow.
    Recovered,
    /// A hold of a shop with a check-back is past its expiry: the shop is asked first
    /// ([`crate::checkback`]). `id` is the hold's.
    HoldDue,
}

/// A processor asks the engine to act on an order ([`crate::orders`]).
#[derive(Debug, Clone)]
pub struct OrderNudge {
    pub shop: Arc<str>,
    /// The order's id ([`Nudge::HoldDue`]: the hold's).
    pub id: Arc<str>,
    pub why: Nudge,
}

/// Where the processors send [`OrderNudge`]s: set by the engine once it is running.
pub type OrderHook = Arc<dyn Fn(OrderNudge) + Send + Sync>;

/// What every shard shares with the others.
#[derive(Clone)]
pub struct ShardShared {
    pub journal: Arc<dyn Journal>,
    /// Where outcomes go: the shops' WorkManagers.
    pub registry: Registry,
    pub metrics: Arc<Metrics>,
    /// Set by a log that several nodes share (Kafka): see [`LogHooks`].
    pub hooks: Arc<OnceLock<LogHooks>>,
    /// Set once the request log is made: from then on, `hooks` unset means no shared
    /// log will attach (the embedded log beside a shared journal).
    pub log_made: Arc<OnceLock<()>>,
    /// Pending holds one shard keeps at most; a hold beyond it is refused
    /// (`limit_exceeded`), so the holds map and the wheel stay bounded.
    pub holds_max: usize,
    /// Pending holds of one shop one shard keeps at most; a hold beyond it is refused
    /// (`limit_exceeded`) while other shops' holds are still taken, so one shop cannot
    /// take every slot of `holds_max` for the life of its holds.
    pub holds_per_shop_max: usize,
    /// Items one shard keeps in memory; beyond it the idle ones used longest ago leave
    /// (see [`Processor::evict`]) and are read back from the journal when next needed.
    pub items_max: usize,
    /// Where orders' records and lines past their time are reported.
    pub order_hook: Arc<OnceLock<OrderHook>>,
    /// The shops' check-backs: a due hold of a shop with one is reported rather than
    /// expired here.
    pub checkback: Arc<OnceLock<Arc<dyn CheckBack>>>,
    /// How long a sale stays returnable ([`crate::returns`]).
    pub return_window_ms: i64,
}

/// A hold the processor keeps until it is confirmed, cancelled or expires.
struct PendingHold {
    item: Arc<str>,
    qty: i64,
    expires_at: Millis,
    timer: TimerId,
    /// Copies of its expiry sent through a shared log so far.
    expiries_sent: u8,
    /// Its buyer, whose units of a limited item go back when it does.
    buyer: Option<Arc<str>>,
    /// An order's line whose order is not yet held: counted in [`Processor::tentative`].
    tentative: bool,
    /// An order's record or line read back from the journal, not yet checked with its
    /// order ([`Nudge::Recovered`]).
    check: bool,
}

/// What the processor makes of one request.
// Returned and matched at once, never stored: boxing the entry would only add an
// allocation per request.
#[allow(clippy::large_enum_variant)]
enum Decision {
    /// A new journal entry.
    Apply(Entry),
    /// An outcome that already stands (a hold ended before this request reached it).
    Answer(Arc<Outcome>),
    /// Nothing to do: an expiry for a hold that is no longer pending here.
    Drop,
    /// An order's line that waits for other orders' tentative lines on its item
    /// ([`Processor::waiting`]): decided again when they are.
    Wait,
}

/// An item's state twice: `live` is what the next request is judged against; `durable`
/// is what the journal holds, and what readers are shown.
#[derive(Debug, Clone, Copy, Default)]
struct Slot {
    live: ItemState,
    durable: ItemState,
    /// The partition assignment epoch under which `live` was read or last checked
    /// against the journal (a shared log and journal only).
    epoch: u64,
    /// The id of the last batch that touched the item: the idle ones with the lowest
    /// leave memory first.
    used: u64,
}

impl Slot {
    fn read(state: ItemState, epoch: u64) -> Slot {
        Slot {
            live: state,
            durable: state,
            epoch,
            used: 0,
        }
    }

    /// Whether the item may leave memory: the journal has its state (no batch in flight
    /// touches it) and no pending hold refers to it.
    fn evictable(&self) -> bool {
        self.live == self.durable && self.live.reserved == 0
    }
}

/// Of the items past the bound, this share of the bound leaves at once, so the scan
/// that picks them runs once per that many new items, not once per item.
const EVICT_SHARE: usize = 64;

/// A request whose key already has an outcome: it is answered with that outcome, once
/// the batches before it are durable, and applied no more.
struct Repeat {
    origin: Option<u32>,
    /// `None`: nobody is answered, only the log position is reported journaled.
    outcome: Option<Arc<Outcome>>,
    pos: Option<LogPos>,
}

/// Where a load chunk's item states go, in the caller's order (index, state).
type LoadReply = oneshot::Sender<LoadViews>;
/// A load chunk's items: (index, state, `Ok` or `SeqMoved`).
type LoadViews = Vec<(usize, ItemView, Status)>;

/// What a batch leaves to do once it is durable.
struct BatchInFlight {
    /// This shard's number for the batch: the journal answers each append with it, so a
    /// failed append retires its own bookkeeping, not another batch's.
    id: u64,
    /// State of each item the batch touched, as of the end of the batch.
    states: Vec<(Arc<str>, Arc<str>, ItemState)>,
    loads: Vec<(LoadReply, LoadViews)>,
    weight: usize,
    repeats: Vec<Repeat>,
    /// Keys of this batch in `Processor::undurable` (a shared log only).
    keys: Vec<(Arc<str>, Arc<str>)>,
    /// Holds this batch ended, in `Processor::ended`.
    ended: Vec<(Arc<str>, Arc<str>)>,
    /// Sales (by shop and key) with an `ok` return in this batch, once per return, in
    /// `Processor::returning`, with the return's log position (a fenced one was not
    /// written).
    returns: Vec<(SaleKey, Option<LogPos>)>,
}

/// A sale by shop and request key.
type SaleKey = (Arc<str>, Arc<str>);

/// A sale with returns in batches not yet durable ([`Processor::returning`]).
struct Returning {
    /// The sale as the journal had it, with this node's returns applied since.
    record: crate::returns::SaleRecord,
    /// Returns of it in batches in flight.
    in_flight: usize,
}

pub struct Processor {
    shard: usize,
    batch_max: usize,
    request_ttl_ms: i64,
    /// Items by shop, then by item: a request carries both, and nesting avoids building a
    /// composite key per lookup.
    items: HashMap<Arc<str>, HashMap<Arc<str>, Slot>>,
    /// Items in `items`, and the most kept there ([`ShardShared::items_max`]).
    resident: usize,
    items_max: usize,
    /// This shard's share of `nrtxn_bound_used{bound="items"}`.
    resident_gauge: IntGauge,
    /// Whether every item the journal knows on this shard is in memory (nothing left
    /// since the start): then an item missing from `items` is unknown, and is not
    /// looked up in the journal.
    complete: bool,
    mailbox: PriorityMailbox,
    in_flight: VecDeque<BatchInFlight>,
    /// The id the next batch gets.
    next_batch_id: u64,
    drain_scheduled: bool,
    /// Where the journal puts a batch back when its queue has no room
    /// ([`StoreError::Full`], reported before `append` returns).
    bounced: Arc<std::sync::Mutex<Option<Vec<Entry>>>>,
    /// A batch the journal had no room for, sent again before any batch after it, so
    /// the journal keeps each item's entries in sequence order. Nothing new is sent
    /// while it waits: that is the back-pressure.
    held_back: Option<(u64, Vec<Entry>)>,
    /// Work taken from the mailbox that carries a partition's new epoch while batches
    /// are in flight: it waits until they are all durable or fenced, so that the items
    /// read again under the new epoch are read with nothing of the old one pending.
    parked: Option<Vec<Work>>,
    journal: Arc<dyn Journal>,
    registry: Registry,
    metrics: Arc<Metrics>,
    depth_gauge: IntGauge,
    hooks: Arc<OnceLock<LogHooks>>,
    /// See [`ShardShared::log_made`].
    log_made: Arc<OnceLock<()>>,
    /// Outcomes of keys applied but not yet durable, by shop and key: a repeat of one of
    /// them is found here, since the journal does not hold it yet (a shared log only;
    /// bounded by the batches in flight).
    undurable: HashMap<(Arc<str>, Arc<str>), Arc<Outcome>>,
    /// The newest assignment epoch seen per partition; a request read under an older one
    /// was read before its partition moved, and is dropped (the log delivers it again
    /// to the partition's owner).
    partition_epochs: HashMap<i32, u64>,
    /// Per partition, the epoch under which this shard last had the journal learn the
    /// partition's keys ([`crate::ports::Sharing::learn_partition`]).
    learned: HashMap<i32, u64>,
    flush_waiters: Vec<oneshot::Sender<()>>,
    /// Pending holds of this shard's items by shop and hold id; at most `holds_max`, and
    /// at most `holds_per_shop_max` of one shop.
    holds: holds::PendingHolds,
    /// The per-buyer limits and counts of this shard's limited items in memory
    /// ([`crate::ledger`]). A limited item stays in memory (see [`Processor::evict`]).
    ledgers: HashMap<(Arc<str>, Arc<str>), BuyerLedger>,
    holds_max: usize,
    holds_per_shop_max: usize,
    /// Per item, the quantity held by lines of orders not yet held: a line that finds
    /// too little stock but enough with these counted back waits ([`Status::Tentative`]).
    tentative: HashMap<(Arc<str>, Arc<str>), i64>,
    /// Order lines waiting for the tentative lines of their item to be decided, by
    /// item: put back in the mailbox when a tentative line of the item becomes firm or
    /// ends, or when they have waited the request TTL. At most [`WAITING_LINES_MAX`].
    waiting: HashMap<(Arc<str>, Arc<str>), Vec<Request>>,
    waiting_count: usize,
    /// Whether a sweep of lines waiting past the request TTL is armed.
    waiting_sweep: bool,
    order_hook: Arc<OnceLock<OrderHook>>,
    checkback: Arc<OnceLock<Arc<dyn CheckBack>>>,
    /// The expiry of every pending hold, by shop and hold id.
    wheel: TimingWheel<(Arc<str>, Arc<str>)>,
    /// When the actor wakes next for the wheel, and the handle to move that wake-up.
    wake: Option<(u64, SpawnHandle)>,
    /// The endings of holds in batches not yet durable: a confirm or cancel that comes
    /// after one is answered with it (the journal does not have it yet). Bounded by the
    /// batches in flight.
    ended: HashMap<(Arc<str>, Arc<str>), Arc<Outcome>>,
    /// A batch waiting for journal reads made off this thread (see `reads`): nothing
    /// after it is drained until it is applied, and no item leaves memory meanwhile.
    reading: Option<Vec<Work>>,
    /// The journal's answers for the batch about to be applied.
    prefetched: Prefetched,
    /// See [`ShardShared::return_window_ms`].
    return_window_ms: i64,
    /// Sales (by shop and key) with an `ok` return in a batch not yet durable: what a
    /// later return of the same sale is decided against, since the journal does not have
    /// those returns yet. An entry leaves when its last such batch is durable (or
    /// fenced), so this holds at most one entry per return in flight
    /// ([`BATCHES_IN_FLIGHT_MAX`] × `batch_max`); sales are read from the journal
    /// otherwise ([`crate::returns`]).
    returning: HashMap<SaleKey, Returning>,
}

impl Processor {
    pub fn new(
        shard: usize,
        batch_max: usize,
        request_ttl_ms: i64,
        initial: Vec<(Arc<str>, Arc<str>, ItemState)>,
        holds: Vec<HoldView>,
        ledgers: Vec<(Arc<str>, Arc<str>, BuyerLedger)>,
        shared: ShardShared,
    ) -> Processor {
        let ShardShared {
            journal,
            registry,
            metrics,
            hooks,
            log_made,
            holds_max,
            holds_per_shop_max,
            items_max,
            order_hook,
            checkback,
            return_window_ms,
        } = shared;
        let mut items: HashMap<Arc<str>, HashMap<Arc<str>, Slot>> = HashMap::new();
        let resident = initial.len();
        for (shop, item, state) in initial {
            items
                .entry(shop)
                .or_default()
                .insert(item, Slot::read(state, 0));
        }
        let resident_gauge = metrics.bound_used.with_label_values(&["items"]);
        resident_gauge.add(resident as i64);
        let depth_gauge = metrics
            .queue_depth
            .with_label_values(&[&format!("shard_{shard}")]);
        let mut processor = Processor {
            shard,
            batch_max: batch_max.max(1),
            request_ttl_ms,
            items,
            resident,
            items_max: items_max.max(1),
            resident_gauge,
            complete: true,
            mailbox: PriorityMailbox::default(),
            in_flight: VecDeque::new(),
            next_batch_id: 0,
            drain_scheduled: false,
            bounced: Arc::default(),
            held_back: None,
            parked: None,
            journal,
            registry,
            metrics,
            depth_gauge,
            hooks,
            log_made,
            undurable: HashMap::new(),
            partition_epochs: HashMap::new(),
            learned: HashMap::new(),
            flush_waiters: Vec::new(),
            holds: holds::PendingHolds::default(),
            holds_max,
            holds_per_shop_max,
            tentative: HashMap::new(),
            waiting: HashMap::new(),
            waiting_count: 0,
            waiting_sweep: false,
            order_hook,
            checkback,
            wheel: TimingWheel::new(WHEEL_TICK_MS, now_ms().max(0) as u64),
            wake: None,
            ended: HashMap::new(),
            reading: None,
            prefetched: Prefetched::default(),
            return_window_ms,
            returning: HashMap::new(),
            ledgers: ledgers
                .into_iter()
                .map(|(shop, item, l)| ((shop, item), l))
                .collect(),
        };
        // Re-armed from the journal; those already past their expiry go at the first
        // tick, which `started` runs.
        for h in holds {
            processor.arm_hold(h, true);
        }
        processor.evict();
        processor
    }

    /// Counts a slot put into `items` (see [`Processor::resident`]).
    fn inserted(&mut self) {
        self.resident += 1;
        self.resident_gauge.inc();
    }

    /// Past the bound, the idle items used longest ago leave memory, down to
    /// `items_max` less a share of it. Only items the journal has as they are and
    /// without pending holds leave (see [`Slot::evictable`]), so the others may keep
    /// the shard above the bound for as long as they are busy.
    fn evict(&mut self) {
        // A batch waiting for reads was planned against the items in memory now.
        if self.resident <= self.items_max || self.reading.is_some() {
            return;
        }
        let target = self.items_max - (self.items_max / EVICT_SHARE).min(self.items_max - 1);
        let mut idle: Vec<(u64, Arc<str>, Arc<str>)> = self
            .items
            .iter()
            .flat_map(|(shop, m)| {
                m.iter()
                    .filter(|(item, slot)| {
                        slot.evictable()
                            && (self.ledgers.is_empty()
                                || !self.ledgers.contains_key(&(shop.clone(), (*item).clone())))
                    })
                    .map(|(item, slot)| (slot.used, shop.clone(), item.clone()))
            })
            .collect();
        let n = (self.resident - target).min(idle.len());
        if n == 0 {
            return;
        }
        if n < idle.len() {
            idle.select_nth_unstable_by_key(n, |(used, _, _)| *used);
        }
        for (_, shop, item) in idle.drain(..n) {
            if let Some(m) = self.items.get_mut(&shop) {
                m.remove(&item);
                if m.is_empty() {
                    self.items.remove(&shop);
                }
            }
        }
        self.resident -= n;
        self.resident_gauge.sub(n as i64);
        self.complete = false;
        tracing::debug!(shard = self.shard, evicted = n, "idle items left memory");
    }
}

/// Work reaches a shard with `do_send`, which the actix mailbox never refuses: admission
/// control in front (the WorkManagers' in-flight bound) is what bounds it.
impl Actor for Processor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        // Holds re-armed at start that are already due expire now.
        self.tick(ctx);
    }
}

/// Requests for this shard, in arrival order.
#[derive(Message)]
#[rtype(result = "()")]
pub struct Enqueue(pub Vec<Request>);

impl Handler<Enqueue> for Processor {
    type Result = ();
    fn handle(&mut self, msg: Enqueue, ctx: &mut Self::Context) {
        for req in msg.0 {
            self.mailbox.push(Work::Txn(req));
        }
        self.schedule(ctx);
    }
}

/// The part of a load call that falls on this shard.
#[derive(Message)]
#[rtype(result = "()")]
pub struct Load(pub LoadChunk);

impl Handler<Load> for Processor {
    type Result = ();
    fn handle(&mut self, msg: Load, ctx: &mut Self::Context) {
        self.mailbox.push(Work::Load(msg.0));
        self.schedule(ctx);
    }
}

#[derive(Message)]
#[rtype(result = "()")]
struct Drain;

impl Handler<Drain> for Processor {
    type Result = ();
    fn handle(&mut self, _: Drain, ctx: &mut Self::Context) {
        self.drain(ctx);
    }
}

#[derive(Message)]
#[rtype(result = "()")]
struct Durable {
    /// The batch's id (see [`BatchInFlight::id`]).
    id: u64,
    entries: Vec<Entry>,
    result: Result<(), StoreError>,
}

impl Handler<Durable> for Processor {
    type Result = ();
    fn handle(&mut self, msg: Durable, ctx: &mut Self::Context) {
        if let Err(StoreError::Closed) = msg.result {
            // Only at shutdown, for work that reached the shard after its flush: nothing
            // of it was written or answered. Fire-and-forget requests among it are still
            // in the request log and are resumed at the next start.
            tracing::warn!(
                shard = self.shard,
                entries = msg.entries.len(),
                "journal closed; batch dropped"
            );
            self.in_flight.retain(|b| b.id != msg.id);
            return;
        }
        let fenced = match msg.result {
            Ok(()) => Vec::new(),
            Err(StoreError::Fenced(fenced)) => {
                // This node lost the partitions' leases while it stalled: their entries
                // were not written, and another node decides their requests now.
                tracing::warn!(
                    shard = self.shard,
                    ?fenced,
                    "journal refused entries of partitions this node no longer holds; their items leave memory"
                );
                self.metrics.journal_fenced.inc();
                fenced
            }
            Err(e) => {
                // Memory is now ahead of the journal. Going on would answer callers with
                // outcomes that are not durable; stopping lets a restart rebuild every
                // item from what the journal really holds, and callers poll or retry
                // their keys.
                tracing::error!(shard = self.shard, error = %e, "journal write failed; exiting");
                std::process::exit(70);
            }
        };
        self.durable(msg.id, msg.entries, &fenced);
        // Its items may leave memory now that the journal has them.
        self.evict();
        self.schedule(ctx);
        self.notify_flushed();
    }
}

/// The durable state of one item.
#[derive(Message)]
#[rtype(result = "ItemRead")]
pub struct GetItem {
    pub shop: Arc<str>,
    pub item: Arc<str>,
}

/// What a shard knows of an item asked for ([`GetItem`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, MessageResponse)]
pub enum ItemRead {
    /// In memory: its durable state.
    Found(ItemState),
    /// Unknown to the shard (or loaded, but the load is not yet durable).
    Unknown,
    /// Not in memory, but it may have left it: the journal has its durable state.
    AskJournal,
}

impl Handler<GetItem> for Processor {
    type Result = ItemRead;
    fn handle(&mut self, msg: GetItem, _: &mut Self::Context) -> ItemRead {
        match self.items.get(&msg.shop).and_then(|m| m.get(&msg.item)) {
            // An item whose load is not yet durable does not exist for readers.
            Some(slot) if slot.durable.seq > 0 => ItemRead::Found(slot.durable),
            Some(_) => ItemRead::Unknown,
            None if self.complete => ItemRead::Unknown,
            None => ItemRead::AskJournal,
        }
    }
}

/// Answers once everything queued so far is applied and durable (shutdown).
#[derive(Message)]
#[rtype(result = "()")]
pub struct Flush;

impl Handler<Flush> for Processor {
    type Result = ResponseFuture<()>;
    fn handle(&mut self, _: Flush, ctx: &mut Self::Context) -> Self::Result {
        let (tx, rx) = oneshot::channel();
        self.flush_waiters.push(tx);
        self.schedule(ctx);
        self.notify_flushed();
        Box::pin(async move {
            let _ = rx.await;
        })
    }
}

/// A read the processor cannot go on without (a shared log's duplicate check or an
/// item's state): retried a few times, then the process stops as it does when a journal
/// write fails, since applying without the answer could apply a request twice.
fn retry_read<T>(shard: usize, mut read: impl FnMut() -> Result<T, StoreError>) -> T {
    const ATTEMPTS: u32 = 5;
    let mut attempt = 0;
    loop {
        attempt += 1;
        match read() {
            Ok(v) => return v,
            Err(e) if attempt < ATTEMPTS => {
                tracing::warn!(shard, error = %e, attempt, "journal read failed; retrying");
                std::thread::sleep(std::time::Duration::from_millis(100 * u64::from(attempt)));
            }
            Err(e) => {
                tracing::error!(shard, error = %e, "journal read failed; exiting");
                std::process::exit(70);
            }
        }
    }
}

/// The item's slot, made (at seq 0, under `epoch`) if it is not in memory; `true` when
/// it was made.
fn slot_for<'a>(
    items: &'a mut HashMap<Arc<str>, HashMap<Arc<str>, Slot>>,
    shop: &Arc<str>,
    item: &Arc<str>,
    epoch: u64,
) -> (&'a mut Slot, bool) {
    match items.entry(shop.clone()).or_default().entry(item.clone()) {
        std::collections::hash_map::Entry::Occupied(o) => (o.into_mut(), false),
        std::collections::hash_map::Entry::Vacant(v) => (
            v.insert(Slot {
                epoch,
                ..Slot::default()
            }),
            true,
        ),
    }
}
