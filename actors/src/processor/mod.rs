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
//! The actor only sequences its parts; each part is a type that owns its state, keeps
//! its fields private and asserts its own invariants:
//! - `items`: `Items`, the items in memory (both states of each), their count
//!   against the bound, eviction, and the buyer ledgers of limited items;
//! - `hold_book`: `HoldBook`, the pending holds, their timers in the wheel, the
//!   per-shop counts and the endings not yet durable;
//! - `lines`: `OrderLines`, order lines held for orders not yet held, and the lines
//!   that wait for them;
//! - `pipeline`: `Pipeline`, the mailbox, the batch reading, the work parked, the
//!   batches in flight and the one held back;
//! - `cluster`: `ClusterScreen`, with a log and journal several nodes share;
//! - `returning`: `Returns`, returns of sales in batches not yet durable.
//!
//! The sequencing is one file per step: `batch` (draining, applying and appending a
//! batch), `decide` (one request), `holds` (holds through time and their endings),
//! `reads` (the journal reads a batch needs) and `fanout` (retiring a durable batch and
//! sending its outcomes). This file holds the actor, its ports and its messages.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use actix::prelude::*;
use tokio::sync::oneshot;

use crate::apply::{apply_hold_end, apply_load, apply_within, reject};
use crate::checkback::CheckBack;
use crate::ledger::BuyerLedger;
use crate::mailbox::{LoadChunk, Work};
use crate::metrics::Metrics;
use crate::ports::{LogHooks, ShardJournal, StoreError};
use crate::topology::Topology;
use crate::types::{
    hold_end_key, is_order_item, now_ms, order_of_line, EarlySender, Entry, HoldStatus, HoldView,
    ItemState, ItemView, LoadTerms, LogPos, Millis, Op, Outcome, Request, Status, LINE_PREFIX,
};
use crate::work_manager::{Decided, Registry};

mod batch;
mod cluster;
mod decide;
mod fanout;
mod hold_book;
mod holds;
mod items;
mod lines;
mod pipeline;
mod reads;
mod returning;

use cluster::ClusterScreen;
use hold_book::HoldBook;
use items::Items;
use lines::OrderLines;
use pipeline::{BatchInFlight, Pipeline, Repeat};
use reads::Prefetched;
use returning::Returns;

/// Journal appends a shard may have outstanding. Two lets applying batch N+1 overlap
/// writing batch N; more would only add latency, since one journal writer serializes them.
pub const BATCHES_IN_FLIGHT_MAX: usize = 2;
/// The hold-expiry wheel's tick: a hold is released within one tick of `expires_at`
/// (plus the wait for the shard's next batch).
pub const WHEEL_TICK_MS: u64 = 1;
/// Order nudges waiting for the engine at most (see [`OrderHook`]); past it a nudge is
/// tried again [`ORDER_HOOK_WAIT_MS`] later. Each pending order record or line nudges
/// at most once per [`ORDER_NUDGE_RETRY_MS`], and the engine settles one order at a time.
pub const NUDGES_QUEUED_MAX: usize = 65_536;
/// With a shared log, how long after sending a hold's expiry through the log it is sent
/// again if the hold is still pending here: the first wait, doubled after each copy up
/// to [`EXPIRY_RESEND_MAX_MS`] ([`hold_book::expiry_resend_wait`]).
const EXPIRY_RESEND_MS: u64 = 1_000;
/// The longest wait between two copies of one hold's expiry.
const EXPIRY_RESEND_MAX_MS: u64 = 60_000;
/// Copies of one hold's expiry sent through the log before this node lets the hold go:
/// with the waits above, copies for about ten minutes (1 + 2 + ... + 32 s, then a minute
/// apart), so that an outage of the log, whose copies are lost or refused, ends with the
/// hold expired. (Five copies a second apart were let go within one: CI's broker-kill
/// case once found a hold still held a minute past its expiry.)
pub const EXPIRY_SENDS_MAX: u8 = 15;
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
/// How long a nudge the engine's queue had no room for waits before it is tried again.
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
    /// A transfer's hold is past its time: its transfer is completed or undone, as its
    /// credit's outcome says ([`crate::transfers`]). `id` is the hold's.
    TransferDue,
}

/// A processor asks the engine to act on an order ([`crate::orders`]).
#[derive(Debug, Clone)]
pub struct OrderNudge {
    pub shop: Arc<str>,
    /// The order's id ([`Nudge::HoldDue`]: the hold's).
    pub id: Arc<str>,
    /// The hold whose timer sent the nudge: the order's record, one of its lines, or
    /// ([`Nudge::HoldDue`]) a hold of its own.
    pub hold: Arc<str>,
    pub why: Nudge,
}

/// Where the processors send [`OrderNudge`]s: made by the engine's builder before any
/// shard starts (a bounded queue the engine drains once it runs). `false`: the queue
/// had no room, and the nudge is tried again later.
pub type OrderHook = Arc<dyn Fn(OrderNudge) -> bool + Send + Sync>;

/// What every shard shares with the others.
#[derive(Clone)]
pub struct ShardShared {
    pub journal: Arc<dyn ShardJournal>,
    /// Where outcomes go: the shops' WorkManagers.
    pub registry: Registry,
    pub metrics: Arc<Metrics>,
    /// Whether requests come through a log several nodes share (then the cluster
    /// screen is on), chosen before the shards start.
    pub topology: Topology,
    /// Pending holds one shard keeps at most; a hold beyond it is refused
    /// (`limit_exceeded`), so the holds map and the wheel stay bounded.
    pub holds_max: usize,
    /// Pending holds of one shop one shard keeps at most; a hold beyond it is refused
    /// (`limit_exceeded`) while other shops' holds are still taken, so one shop cannot
    /// take every slot of `holds_max` for the life of its holds.
    pub holds_per_shop_max: usize,
    /// Items one shard keeps in memory; beyond it the idle ones used longest ago leave
    /// (see `Items::evict`) and are read back from the journal when next needed.
    pub items_max: usize,
    /// Where orders' records and lines past their time are reported.
    pub order_hook: OrderHook,
    /// The shops' check-backs: a due hold of a shop with one is reported rather than
    /// expired here.
    pub checkback: Option<Arc<dyn CheckBack>>,
    /// How long a sale stays returnable ([`crate::returns`]).
    pub return_window_ms: i64,
    /// See [`crate::EngineConfig::hold_expiry_copies`].
    pub hold_expiry_copies: u8,
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
    /// ([`OrderLines`]): decided again when they are.
    Wait,
}

/// A sale by shop and request key.
type SaleKey = (Arc<str>, Arc<str>);

/// What the processor calls outside itself.
struct Ports {
    journal: Arc<dyn ShardJournal>,
    /// Where outcomes go: the shops' WorkManagers.
    registry: Registry,
    metrics: Arc<Metrics>,
    /// Where orders' records and lines past their time, and due holds of shops with a
    /// check-back, are reported.
    order_hook: OrderHook,
    checkback: Option<Arc<dyn CheckBack>>,
}

/// The actor: it sequences its parts, each of which owns its state and keeps its own
/// invariants. A request goes through the pipeline, is screened (a shared log), decided
/// against the items, the holds, the order lines and the returns, journaled, and
/// answered through the ports.
pub struct Processor {
    shard: usize,
    /// Most entries applied and journaled as one batch.
    batch_max: usize,
    /// A request older than this when it is decided is answered `expired`.
    request_ttl_ms: i64,
    items: Items,
    holds: HoldBook,
    lines: OrderLines,
    pipeline: Pipeline,
    /// On with a log several nodes share, off (`None`) with this node's own.
    cluster: Option<ClusterScreen>,
    returns: Returns,
    /// The journal's answers for the batch about to be applied (see `reads`).
    prefetched: Prefetched,
    ports: Ports,
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
            topology,
            holds_max,
            holds_per_shop_max,
            items_max,
            order_hook,
            checkback,
            return_window_ms,
            hold_expiry_copies,
        } = shared;
        let resident_gauge = metrics.bound_used.with_label_values(&["items"]);
        let depth_gauge = metrics
            .queue_depth
            .with_label_values(&[&format!("shard_{shard}")]);
        let mut processor = Processor {
            shard,
            batch_max: batch_max.max(1),
            request_ttl_ms,
            items: Items::new(initial, ledgers, items_max, resident_gauge),
            holds: HoldBook::new(holds_max, holds_per_shop_max, hold_expiry_copies),
            lines: OrderLines::default(),
            pipeline: Pipeline::new(depth_gauge),
            cluster: topology.log().cloned().map(ClusterScreen::new),
            returns: Returns::new(return_window_ms),
            prefetched: Prefetched::default(),
            ports: Ports {
                journal,
                registry,
                metrics,
                order_hook,
                checkback,
            },
        };
        // Re-armed from the journal; those already past their expiry go at the first
        // tick, which `started` runs.
        for h in holds {
            processor.arm_hold(h, true);
        }
        processor.evict();
        processor
    }

    /// Past the bound, idle items leave memory ([`Items::evict`]); not while a batch
    /// waits for reads, since it was planned against the items in memory now.
    fn evict(&mut self) {
        if !self.pipeline.reading() {
            self.items.evict(self.shard);
        }
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
            self.pipeline.push(Work::Txn(req));
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
        self.pipeline.push(Work::Load(msg.0));
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

/// A batch's journal write is done: durable, or failed.
#[derive(Message)]
#[rtype(result = "()")]
struct Journaled {
    /// The batch's id (see [`BatchInFlight::id`]).
    id: u64,
    entries: Vec<Entry>,
    result: Result<(), StoreError>,
}

impl Handler<Journaled> for Processor {
    type Result = ();
    fn handle(&mut self, msg: Journaled, ctx: &mut Self::Context) {
        if let Err(StoreError::Closed) = msg.result {
            // Only at shutdown, for work that reached the shard after its flush: nothing
            // of it was written or answered. Fire-and-forget requests among it are still
            // in the request log and are resumed at the next start.
            tracing::warn!(
                shard = self.shard,
                entries = msg.entries.len(),
                "journal closed; batch dropped"
            );
            self.pipeline.drop_closed(msg.id);
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
                self.ports.metrics.journal_fenced.inc();
                fenced
            }
            Err(e) => {
                // Memory is now ahead of the journal. Going on would answer callers with
                // outcomes that are not durable; stopping lets a restart rebuild every
                // item from what the journal really holds, and callers poll or retry
                // their keys.
                crate::fatal::stop_not_durable(format_args!(
                    "shard {}: journal write failed: {e}",
                    self.shard
                ));
            }
        };
        self.journaled(msg.id, msg.entries, &fenced);
        // Its items may leave memory now that the journal has them.
        self.evict();
        self.schedule(ctx);
        self.pipeline.notify_flushed();
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
        self.items.read(&msg.shop, &msg.item)
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
        self.pipeline.add_flush_waiter(tx);
        self.schedule(ctx);
        self.pipeline.notify_flushed();
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
                crate::fatal::stop_not_durable(format_args!(
                    "shard {shard}: journal read failed: {e}"
                ));
            }
        }
    }
}
