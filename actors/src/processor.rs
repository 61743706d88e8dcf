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

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use actix::prelude::*;
use prometheus::IntGauge;
use tokio::sync::oneshot;

use crate::apply::{apply, apply_hold_end, apply_load, reject};
use crate::mailbox::{LoadChunk, PriorityMailbox, Work};
use crate::metrics::Metrics;
use crate::ports::{Journal, LogHooks, StoreError};
use crate::types::{
    hold_end_key, now_ms, Entry, HoldView, ItemState, ItemView, LogPos, Millis, Op, Outcome,
    Request, Status,
};
use crate::wheel::{TimerId, TimingWheel};
use crate::work_manager::{Decided, Registry};

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

/// What every shard shares with the others.
#[derive(Clone)]
pub struct ShardShared {
    pub journal: Arc<dyn Journal>,
    /// Where outcomes go: the shops' WorkManagers.
    pub registry: Registry,
    pub metrics: Arc<Metrics>,
    /// Set by a log that several nodes share (Kafka): see [`LogHooks`].
    pub hooks: Arc<OnceLock<LogHooks>>,
    /// Pending holds one shard keeps at most; a hold beyond it is refused
    /// (`limit_exceeded`), so the holds map and the wheel stay bounded.
    pub holds_max: usize,
    /// Items one shard keeps in memory; beyond it the idle ones used longest ago leave
    /// (see [`Processor::evict`]) and are read back from the journal when next needed.
    pub items_max: usize,
}

/// A hold the processor keeps until it is confirmed, cancelled or expires.
struct PendingHold {
    item: Arc<str>,
    qty: i64,
    expires_at: Millis,
    timer: TimerId,
    /// Copies of its expiry sent through a shared log so far.
    expiries_sent: u8,
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
type LoadReply = oneshot::Sender<Vec<(usize, ItemView)>>;

/// What a batch leaves to do once it is durable.
struct BatchInFlight {
    /// This shard's number for the batch: the journal answers each append with it, so a
    /// failed append retires its own bookkeeping, not another batch's.
    id: u64,
    /// State of each item the batch touched, as of the end of the batch.
    states: Vec<(Arc<str>, Arc<str>, ItemState)>,
    loads: Vec<(LoadReply, Vec<(usize, ItemView)>)>,
    weight: usize,
    repeats: Vec<Repeat>,
    /// Keys of this batch in `Processor::undurable` (a shared log only).
    keys: Vec<(Arc<str>, Arc<str>)>,
    /// Holds this batch ended, in `Processor::ended`.
    ended: Vec<(Arc<str>, Arc<str>)>,
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
    /// Pending holds of this shard's items by shop and hold id; at most `holds_max`.
    holds: HashMap<(Arc<str>, Arc<str>), PendingHold>,
    holds_max: usize,
    /// The expiry of every pending hold, by shop and hold id.
    wheel: TimingWheel<(Arc<str>, Arc<str>)>,
    /// When the actor wakes next for the wheel, and the handle to move that wake-up.
    wake: Option<(u64, SpawnHandle)>,
    /// The endings of holds in batches not yet durable: a confirm or cancel that comes
    /// after one is answered with it (the journal does not have it yet). Bounded by the
    /// batches in flight.
    ended: HashMap<(Arc<str>, Arc<str>), Arc<Outcome>>,
}

impl Processor {
    pub fn new(
        shard: usize,
        batch_max: usize,
        request_ttl_ms: i64,
        initial: Vec<(Arc<str>, Arc<str>, ItemState)>,
        holds: Vec<HoldView>,
        shared: ShardShared,
    ) -> Processor {
        let ShardShared {
            journal,
            registry,
            metrics,
            hooks,
            holds_max,
            items_max,
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
            undurable: HashMap::new(),
            partition_epochs: HashMap::new(),
            learned: HashMap::new(),
            flush_waiters: Vec::new(),
            holds: HashMap::new(),
            holds_max,
            wheel: TimingWheel::new(WHEEL_TICK_MS, now_ms().max(0) as u64),
            wake: None,
            ended: HashMap::new(),
        };
        // Re-armed from the journal; those already past their expiry go at the first
        // tick, which `started` runs.
        for h in holds {
            processor.arm_hold(h.shop, h.hold_id, h.item, h.qty, h.expires_at);
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
        if self.resident <= self.items_max {
            return;
        }
        let target = self.items_max - (self.items_max / EVICT_SHARE).min(self.items_max - 1);
        let mut idle: Vec<(u64, Arc<str>, Arc<str>)> = self
            .items
            .iter()
            .flat_map(|(shop, m)| {
                m.iter()
                    .filter(|(_, slot)| slot.evictable())
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

    /// Reads back from the journal the items of `works` that left memory, before they
    /// are decided (a load too: its seq goes on from the item's). Items that a shared
    /// journal reads back anyway ([`Processor::reload`]) and hold endings (a pending
    /// hold keeps its item in memory) are not looked up here.
    fn fault_in(&mut self, works: &[Work]) {
        if self.complete {
            return;
        }
        let reloads = self.journal.shared();
        let mut missing: Vec<(Arc<str>, Arc<str>)> = Vec::new();
        let mut want = |items: &HashMap<Arc<str>, HashMap<Arc<str>, Slot>>,
                        shop: &Arc<str>,
                        item: &Arc<str>| {
            if !items.get(shop).is_some_and(|m| m.contains_key(item)) {
                missing.push((shop.clone(), item.clone()));
            }
        };
        for work in works {
            match work {
                Work::Txn(req) if req.op.ends_hold() => {}
                Work::Txn(req) if reloads && req.log_pos.is_some() => {}
                Work::Txn(req) => want(&self.items, &req.shop, &req.item),
                Work::Load(chunk) => {
                    for load in &chunk.items {
                        want(&self.items, &chunk.shop, &load.item);
                    }
                }
            }
        }
        if missing.is_empty() {
            return;
        }
        missing.sort_unstable();
        missing.dedup();
        let states = retry_read(self.shard, || self.journal.item_states(&missing));
        for ((shop, item), state) in missing.into_iter().zip(states) {
            if let Some(state) = state {
                self.items
                    .entry(shop)
                    .or_default()
                    .insert(item, Slot::read(state, 0));
                self.inserted();
            }
        }
    }

    fn arm_hold(
        &mut self,
        shop: Arc<str>,
        hold_id: Arc<str>,
        item: Arc<str>,
        qty: i64,
        expires_at: Millis,
    ) {
        let key = (shop, hold_id);
        let timer = self.wheel.insert(expires_at.max(0) as u64, key.clone());
        if let Some(old) = self.holds.insert(
            key,
            PendingHold {
                item,
                qty,
                expires_at,
                timer,
                expiries_sent: 0,
            },
        ) {
            self.wheel.cancel(old.timer);
        }
    }

    /// Expires the holds that are due, through the mailbox's high lane, and sleeps until
    /// the next one.
    fn tick(&mut self, ctx: &mut Context<Self>) {
        self.wake = None;
        let now = now_ms();
        let mut fired = Vec::new();
        self.wheel.advance(now.max(0) as u64, &mut fired);
        let mut via_log = Vec::new();
        let resubmit = self
            .hooks
            .get()
            .filter(|_| self.journal.shared())
            .map(|h| h.resubmit.clone());
        for (_, (shop, hold_id)) in fired {
            let Some(h) = self.holds.get(&(shop.clone(), hold_id.clone())) else {
                continue;
            };
            let key = hold_end_key(&hold_id);
            let req = Request {
                hold_id: Some(hold_id),
                ..Request::new(shop, h.item.clone(), key, Op::Expire, h.qty, now)
            };
            if resubmit.is_some() {
                // Armed again, in case this copy is lost on its way (the producer refuses
                // it, say): sent once more a second later while the hold is still pending
                // here, a few times. Every copy has the same key, so it is one decision.
                // A hold still here after the last copy belongs to an item another node
                // owns now (which re-armed it from the journal), or its copies were all
                // lost: either way this node lets it go, and a restart or takeover re-arms
                // it from the journal.
                let key = (req.shop.clone(), req.hold_id.clone().unwrap_or_default());
                let retry_at = (now.max(0) as u64).saturating_add(EXPIRY_RESEND_MS);
                let sent = self.holds.get(&key).map_or(0, |h| h.expiries_sent);
                if sent >= EXPIRY_SENDS_MAX {
                    self.holds.remove(&key);
                    tracing::warn!(shop = %key.0, hold = %key.1, "hold's expiry sent {sent} times and still pending here; let go");
                    continue;
                }
                let timer = self.wheel.insert(retry_at, key.clone());
                if let Some(h) = self.holds.get_mut(&key) {
                    h.timer = timer;
                    h.expiries_sent += 1;
                }
                via_log.push(req);
            } else {
                self.mailbox.push(Work::Txn(req));
            }
        }
        if let (Some(send), false) = (resubmit, via_log.is_empty()) {
            // With several nodes the item may have moved to another node since this one
            // armed the timer: the expiry goes to whoever owns the item now, through
            // the log, and its key makes every copy of it one decision.
            send(via_log);
        }
        self.schedule(ctx);
        self.arm_wake(ctx);
    }

    /// Sets the wake-up for the wheel's next expiry, if it is earlier than the one set.
    fn arm_wake(&mut self, ctx: &mut Context<Self>) {
        let Some(next) = self.wheel.next_deadline_hint() else {
            return;
        };
        if let Some((at, handle)) = self.wake {
            if at <= next {
                return;
            }
            ctx.cancel_future(handle);
        }
        let delay = next.saturating_sub(now_ms().max(0) as u64);
        let handle = ctx.run_later(Duration::from_millis(delay), |p, ctx| p.tick(ctx));
        self.wake = Some((next, handle));
    }

    fn schedule(&mut self, ctx: &mut Context<Self>) {
        if !self.drain_scheduled
            && self.held_back.is_none()
            && (!self.mailbox.is_empty() || (self.parked.is_some() && self.in_flight.is_empty()))
            && self.in_flight.len() < BATCHES_IN_FLIGHT_MAX
        {
            self.drain_scheduled = true;
            // Through the mailbox, not a direct call: messages already waiting are taken
            // in first, so the batch is as large as the backlog allows.
            ctx.notify(Drain);
        }
    }

    fn drain(&mut self, ctx: &mut Context<Self>) {
        self.drain_scheduled = false;
        while self.held_back.is_none() && self.in_flight.len() < BATCHES_IN_FLIGHT_MAX {
            let works = match self.parked.take() {
                Some(works) if self.in_flight.is_empty() => works,
                Some(works) => {
                    self.parked = Some(works);
                    break;
                }
                None if self.mailbox.is_empty() => break,
                None => self.mailbox.drain(self.batch_max),
            };
            if !self.in_flight.is_empty() && self.epoch_moves(&works) {
                self.parked = Some(works);
                break;
            }
            let batch = self.apply_batch(works);
            self.evict();
            self.arm_wake(ctx);
            let BatchBuilt {
                entries,
                mut in_flight,
            } = batch;
            in_flight.id = self.next_batch_id;
            self.next_batch_id += 1;
            if entries.is_empty() {
                // Only repeats: answered with the batch before them, or now.
                match self.in_flight.back_mut() {
                    Some(last) => last.repeats.extend(in_flight.repeats),
                    None => {
                        let id = in_flight.id;
                        self.in_flight.push_back(in_flight);
                        self.durable(id, Vec::new(), &[]);
                    }
                }
                continue;
            }
            self.metrics.batch_entries.observe(entries.len() as f64);
            let id = in_flight.id;
            self.in_flight.push_back(in_flight);
            self.append(id, entries, ctx);
        }
        self.depth_gauge.set(self.mailbox.len() as i64);
    }

    /// Hands batch `id` to the journal. If its queue has no room, the batch is held back
    /// and sent again a moment later, before anything after it.
    fn append(&mut self, id: u64, entries: Vec<Entry>, ctx: &mut Context<Self>) {
        let addr = ctx.address();
        let bounced = self.bounced.clone();
        self.journal.append(
            entries,
            Box::new(move |entries, result| match result {
                Err(StoreError::Full) => {
                    if let Ok(mut slot) = bounced.lock() {
                        *slot = Some(entries);
                    }
                }
                result => addr.do_send(Durable {
                    id,
                    entries,
                    result,
                }),
            }),
        );
        let bounced = self.bounced.lock().ok().and_then(|mut slot| slot.take());
        if let Some(entries) = bounced {
            tracing::warn!(
                shard = self.shard,
                entries = entries.len(),
                "journal queue full; batch held back and sent again"
            );
            self.held_back = Some((id, entries));
            ctx.run_later(Duration::from_millis(JOURNAL_FULL_RETRY_MS), |p, ctx| {
                if let Some((id, entries)) = p.held_back.take() {
                    p.append(id, entries, ctx);
                }
                p.schedule(ctx);
            });
        }
    }

    fn apply_batch(&mut self, works: Vec<Work>) -> BatchBuilt {
        let shared_log = self.hooks.get().is_some();
        let (works, mut journaled) = if shared_log {
            self.screen(works)
        } else {
            (works, HashMap::new())
        };
        self.fault_in(&works);
        let now = now_ms();
        let mut entries = Vec::with_capacity(works.iter().map(Work::weight).sum());
        let mut touched: Vec<(Arc<str>, Arc<str>)> = Vec::new();
        let mut loads = Vec::new();
        let mut repeats = Vec::new();
        let mut keys = Vec::new();
        let mut ended = Vec::new();
        for work in works {
            match work {
                Work::Txn(req) => {
                    if shared_log {
                        let key = (req.shop.clone(), req.key.clone());
                        let found = match self.undurable.get(&key) {
                            Some(o) => Some(o.clone()),
                            None => journaled.remove(&key),
                        };
                        if let Some(outcome) = found {
                            repeats.push(Repeat {
                                origin: req.origin,
                                outcome: Some(outcome),
                                pos: req.log_pos,
                            });
                            continue;
                        }
                    }
                    match self.decide(&req, now, &mut touched) {
                        Decision::Apply(entry) => {
                            if shared_log {
                                if let Some(o) = entry.outcome() {
                                    let key = (req.shop.clone(), req.key.clone());
                                    self.undurable.insert(key.clone(), Arc::new(o));
                                    keys.push(key);
                                }
                            }
                            if let (true, Some(hold_id)) = (entry.op.ends_hold(), &entry.hold_id) {
                                if let Some(o) = entry.outcome() {
                                    let key = (entry.shop.clone(), hold_id.clone());
                                    self.ended.insert(key.clone(), Arc::new(o));
                                    ended.push(key);
                                }
                            }
                            entries.push(entry);
                        }
                        Decision::Answer(outcome) => repeats.push(Repeat {
                            origin: req.origin,
                            outcome: Some(outcome),
                            pos: req.log_pos,
                        }),
                        Decision::Drop => repeats.push(Repeat {
                            origin: None,
                            outcome: None,
                            pos: req.log_pos,
                        }),
                    }
                }
                Work::Load(LoadChunk { shop, items, reply }) => {
                    let mut views = Vec::with_capacity(items.len());
                    for load in items {
                        let (slot, new) = slot_for(&mut self.items, &shop, &load.item, 0);
                        if new {
                            self.resident += 1;
                            self.resident_gauge.inc();
                        }
                        let entry = apply_load(&mut slot.live, &shop, &load.item, load.stock, now);
                        views.push((
                            load.index,
                            ItemView {
                                shop: shop.clone(),
                                item: load.item.clone(),
                                stock: slot.live.stock,
                                reserved: slot.live.reserved,
                                seq: slot.live.seq,
                            },
                        ));
                        touched.push((shop.clone(), load.item));
                        entries.push(entry);
                    }
                    loads.push((reply, views));
                }
            }
        }
        // One state per touched item, as of the end of the batch.
        touched.sort_unstable();
        touched.dedup();
        let batch_id = self.next_batch_id;
        let states = touched
            .into_iter()
            .map(|(shop, item)| {
                let slot = self
                    .items
                    .get_mut(&shop)
                    .and_then(|m| m.get_mut(&item))
                    .expect("a touched item is in memory");
                slot.used = batch_id;
                let live = slot.live;
                (shop, item, live)
            })
            .collect();
        let weight = entries.len();
        BatchBuilt {
            entries,
            in_flight: BatchInFlight {
                // Numbered by `drain` when the batch is sent.
                id: 0,
                states,
                loads,
                weight,
                repeats,
                keys,
                ended,
            },
        }
    }

    /// Decides one request: a stock change, a hold or a hold's ending, or (from a shared
    /// log) an operator's load routed to the item's owner.
    fn decide(
        &mut self,
        req: &Request,
        now: Millis,
        touched: &mut Vec<(Arc<str>, Arc<str>)>,
    ) -> Decision {
        if req.op == Op::Load {
            let (slot, new) = slot_for(&mut self.items, &req.shop, &req.item, req.epoch());
            if new {
                self.resident += 1;
                self.resident_gauge.inc();
            }
            let mut entry = apply_load(&mut slot.live, &req.shop, &req.item, req.qty, now);
            entry.request_key = Some(req.key.clone());
            entry.submitted_at = req.submitted_at;
            entry.logged = req.logged;
            entry.log_pos = req.log_pos;
            entry.origin = req.origin;
            touched.push((req.shop.clone(), req.item.clone()));
            return Decision::Apply(entry);
        }
        if req.op.ends_hold() {
            return self.end_hold(req, now, touched);
        }
        let slot = self
            .items
            .get_mut(&req.shop)
            .and_then(|items| items.get_mut(&req.item));
        let known = slot.is_some();
        let entry = match slot {
            Some(slot) if req.op == Op::Hold && self.holds.len() >= self.holds_max => reject(
                &mut slot.live,
                req,
                now,
                Status::LimitExceeded,
                format!(
                    "this shard already keeps {} pending holds, its limit",
                    self.holds_max
                ),
            ),
            slot => apply(slot.map(|s| &mut s.live), req, now, self.request_ttl_ms),
        };
        if known {
            touched.push((req.shop.clone(), req.item.clone()));
        }
        if let (Op::Hold, Status::Ok, Some(expires_at)) = (entry.op, entry.status, entry.expires_at)
        {
            self.arm_hold(
                req.shop.clone(),
                req.key.clone(),
                req.item.clone(),
                req.qty,
                expires_at,
            );
        }
        Decision::Apply(entry)
    }

    /// Confirms, cancels or expires a hold. A hold past its `expires_at` expires
    /// whatever the request was, so a confirm that comes too late is answered with the
    /// expiry; a hold that already ended answers every later request with its ending.
    fn end_hold(
        &mut self,
        req: &Request,
        now: Millis,
        touched: &mut Vec<(Arc<str>, Arc<str>)>,
    ) -> Decision {
        let Some(hold_id) = req.hold_id.clone() else {
            tracing::error!(key = %req.key, "hold ending without a hold id; dropped");
            return Decision::Drop;
        };
        let key = (req.shop.clone(), hold_id.clone());
        let due = self.holds.get(&key).map(|h| h.expires_at <= now);
        match due {
            // An expiry that is not due yet: sent by a node whose clock runs ahead.
            Some(false) if req.op == Op::Expire => Decision::Drop,
            Some(due) => {
                let Some(hold) = self.holds.remove(&key) else {
                    return Decision::Drop;
                };
                self.wheel.cancel(hold.timer);
                let Some(slot) = self
                    .items
                    .get_mut(&req.shop)
                    .and_then(|m| m.get_mut(&hold.item))
                else {
                    tracing::error!(hold = %hold_id, "pending hold of an unknown item");
                    return Decision::Drop;
                };
                let mut end = req.clone();
                end.item = hold.item.clone();
                if due {
                    end.op = Op::Expire;
                }
                let entry = apply_hold_end(&mut slot.live, &end, hold.qty, now);
                touched.push((req.shop.clone(), hold.item));
                Decision::Apply(entry)
            }
            None => {
                if let Some(o) = self.ended.get(&key) {
                    return Decision::Answer(o.clone());
                }
                let found =
                    retry_read(self.shard, || self.journal.outcomes(&req.shop, &[&req.key]));
                match found.into_iter().next().flatten() {
                    Some(o) => Decision::Answer(Arc::new(o)),
                    None if req.op == Op::Expire => Decision::Drop,
                    None => Decision::Apply(Entry {
                        status: Status::UnknownHold,
                        reason: Some(format!("no hold {hold_id} in shop {}", req.shop)),
                        ..Entry::of_request(req, now)
                    }),
                }
            }
        }
    }

    /// Before a batch from a shared log is applied: drops requests read under an older
    /// assignment of their partition, reads back from a shared journal the items whose
    /// partition came to this node since they were last read, and looks up in the
    /// journal every key not applied here in a batch still in flight (through the
    /// journal's key filter, which knows every key of the partitions this node reads:
    /// see [`crate::ports::Sharing::learn_partition`]). Returns the requests to apply and the outcomes
    /// found.
    /// Whether `works` carry a partition's epoch newer than the one this shard last
    /// saw: the partition was assigned again (a lease taken again, with leases).
    fn epoch_moves(&self, works: &[Work]) -> bool {
        works.iter().any(|w| match w {
            Work::Txn(req) => req.log_pos.is_some_and(|pos| {
                self.partition_epochs
                    .get(&pos.partition)
                    .is_some_and(|seen| pos.epoch > *seen)
            }),
            _ => false,
        })
    }

    #[allow(clippy::type_complexity)]
    fn screen(
        &mut self,
        works: Vec<Work>,
    ) -> (Vec<Work>, HashMap<(Arc<str>, Arc<str>), Arc<Outcome>>) {
        let mut kept = Vec::with_capacity(works.len());
        for work in works {
            if let Work::Txn(req) = &work {
                if let Some(pos) = req.log_pos {
                    let newest = self.partition_epochs.entry(pos.partition).or_insert(0);
                    if req.epoch() < *newest {
                        tracing::debug!(
                            partition = pos.partition,
                            offset = pos.offset,
                            "request read before its partition moved; dropped"
                        );
                        continue;
                    }
                    *newest = req.epoch();
                }
            }
            kept.push(work);
        }
        if self.journal.shared() {
            self.reload(&kept);
        }
        self.learn(&kept);
        let mut asked: HashMap<Arc<str>, Vec<Arc<str>>> = HashMap::new();
        for work in &kept {
            if let Work::Txn(req) = work {
                if !self
                    .undurable
                    .contains_key(&(req.shop.clone(), req.key.clone()))
                {
                    asked
                        .entry(req.shop.clone())
                        .or_default()
                        .push(req.key.clone());
                }
            }
        }
        let mut found = HashMap::new();
        for (shop, keys) in asked {
            let refs: Vec<&str> = keys.iter().map(|k| &**k).collect();
            let outcomes = retry_read(self.shard, || self.journal.outcomes(&shop, &refs));
            for (key, outcome) in keys.iter().zip(outcomes) {
                if let Some(o) = outcome {
                    found.insert((shop.clone(), key.clone()), Arc::new(o));
                }
            }
        }
        (kept, found)
    }

    /// Has the journal learn the keys of partitions seen under a new epoch, so that its
    /// key lookups are exact for them (from the lowest offset of each in this batch).
    fn learn(&mut self, works: &[Work]) {
        let mut from: HashMap<i32, (u64, i64)> = HashMap::new();
        for work in works {
            let Work::Txn(req) = work else { continue };
            let Some(pos) = req.log_pos else { continue };
            if self.learned.get(&pos.partition) == Some(&req.epoch()) {
                continue;
            }
            let f = from
                .entry(pos.partition)
                .or_insert((req.epoch(), pos.offset));
            f.1 = f.1.min(pos.offset);
        }
        for (partition, (epoch, offset)) in from {
            retry_read(self.shard, || {
                self.journal.learn_partition(partition, offset)
            });
            self.learned.insert(partition, epoch);
        }
    }

    /// Reads back from the shared journal the items of `works` not read under their
    /// request's epoch: another node may have changed them while it owned the partition.
    fn reload(&mut self, works: &[Work]) {
        let mut stale: Vec<(Arc<str>, Arc<str>)> = Vec::new();
        let mut epochs: HashMap<(Arc<str>, Arc<str>), u64> = HashMap::new();
        for work in works {
            let Work::Txn(req) = work else { continue };
            if req.log_pos.is_none() {
                continue;
            }
            let current = self
                .items
                .get(&req.shop)
                .and_then(|m| m.get(&req.item))
                .map(|s| s.epoch);
            if current != Some(req.epoch()) {
                let key = (req.shop.clone(), req.item.clone());
                if epochs.insert(key.clone(), req.epoch()).is_none() {
                    stale.push(key);
                }
            }
        }
        if stale.is_empty() {
            return;
        }
        let states = retry_read(self.shard, || self.journal.item_states(&stale));
        // The holds of these items as the journal has them replace any armed here: the
        // node that owned them meanwhile may have made, confirmed or expired some.
        let holds = retry_read(self.shard, || self.journal.pending_holds(&stale));
        let moved: std::collections::HashSet<&(Arc<str>, Arc<str>)> = stale.iter().collect();
        let gone: Vec<(Arc<str>, Arc<str>)> = self
            .holds
            .iter()
            .filter(|((shop, _), h)| moved.contains(&(shop.clone(), h.item.clone())))
            .map(|(k, _)| k.clone())
            .collect();
        for key in gone {
            if let Some(h) = self.holds.remove(&key) {
                self.wheel.cancel(h.timer);
            }
        }
        for h in holds {
            self.arm_hold(h.shop, h.hold_id, h.item, h.qty, h.expires_at);
        }
        for ((shop, item), state) in stale.into_iter().zip(states) {
            let epoch = epochs[&(shop.clone(), item.clone())];
            let shop_items = self.items.entry(shop.clone()).or_default();
            match (shop_items.get_mut(&item), state) {
                (Some(slot), Some(st)) => {
                    // Ahead of the journal only by this node's own batches in flight.
                    if st.seq >= slot.live.seq {
                        slot.live = st;
                        slot.durable = st;
                    }
                    slot.epoch = epoch;
                }
                (Some(slot), None) => slot.epoch = epoch,
                (None, Some(st)) => {
                    shop_items.insert(item, Slot::read(st, epoch));
                    self.resident += 1;
                    self.resident_gauge.inc();
                }
                (None, None) => {
                    // An unknown item: no empty map left behind for its shop.
                    if shop_items.is_empty() {
                        self.items.remove(&shop);
                    }
                }
            }
        }
    }

    /// Retires batch `id` once the journal answered it: what it wrote is answered; the
    /// entries of `fenced` partitions (see [`StoreError::Fenced`]) are not, and their
    /// items leave memory, to be read again from the journal if the partition comes
    /// back.
    fn durable(&mut self, id: u64, entries: Vec<Entry>, fenced: &[(i32, u64)]) {
        let Some(mut batch) = self.in_flight.pop_front() else {
            tracing::error!(
                shard = self.shard,
                "durable batch without a batch in flight"
            );
            return;
        };
        // The journal completes one shard's appends in the order they were sent.
        assert_eq!(batch.id, id, "journal appends completed out of order");
        debug_assert_eq!(batch.weight, entries.len());
        let is_fenced =
            |pos: &Option<LogPos>| pos.is_some_and(|p| fenced.contains(&(p.partition, p.epoch)));
        let mut dropped: HashSet<(Arc<str>, Arc<str>)> = HashSet::new();
        let entries: Vec<Entry> = if fenced.is_empty() {
            entries
        } else {
            let (kept, refused): (Vec<Entry>, Vec<Entry>) =
                entries.into_iter().partition(|e| !is_fenced(&e.log_pos));
            dropped.extend(refused.into_iter().map(|e| (e.shop, e.item)));
            batch
                .states
                .retain(|(shop, item, _)| !dropped.contains(&(shop.clone(), item.clone())));
            // A load with a refused item is not answered: its caller sees it fail.
            batch.loads.retain(|(_, views)| {
                views
                    .iter()
                    .all(|(_, v)| !dropped.contains(&(v.shop.clone(), v.item.clone())))
            });
            batch.repeats.retain(|r| !is_fenced(&r.pos));
            kept
        };
        for key in &batch.keys {
            self.undurable.remove(key);
        }
        for key in &batch.ended {
            self.ended.remove(key);
        }
        for (shop, item, state) in batch.states {
            if let Some(slot) = self.items.get_mut(&shop).and_then(|m| m.get_mut(&item)) {
                // Paired with the apply step's assertion: what became durable is sane.
                assert!(state.stock >= 0 && state.seq >= slot.durable.seq);
                slot.durable = state;
            }
        }
        for (reply, views) in batch.loads {
            let _ = reply.send(views);
        }
        let hooks = self.hooks.get();
        if let Some(hooks) = hooks {
            let positions: Vec<_> = entries
                .iter()
                .filter_map(|e| e.log_pos)
                .chain(batch.repeats.iter().filter_map(|r| r.pos))
                .collect();
            if !positions.is_empty() {
                (hooks.journaled)(positions);
            }
        }
        // Outcomes to the WorkManagers that hold the reply handles: this node's, one
        // message per shop, and other nodes' through the log's hook.
        let mut by_shop: HashMap<Arc<str>, Vec<Arc<Outcome>>> = HashMap::new();
        let mut remote: HashMap<u32, Vec<Arc<Outcome>>> = HashMap::new();
        let mut counts = [0u64; Status::ALL.len()];
        let mut route = |origin: Option<u32>, outcome: Arc<Outcome>| match (origin, hooks) {
            (Some(node), Some(h)) if node != h.node_id => {
                remote.entry(node).or_default().push(outcome)
            }
            _ => by_shop
                .entry(outcome.shop.clone())
                .or_default()
                .push(outcome),
        };
        for entry in &entries {
            if let Some(outcome) = entry.outcome() {
                counts[status_index(outcome.status)] += 1;
                route(entry.origin, Arc::new(outcome));
            }
        }
        let answered = batch.repeats.iter().filter(|r| r.outcome.is_some()).count();
        if answered > 0 {
            self.metrics.repeats.inc_by(answered as u64);
        }
        for r in batch.repeats {
            if let Some(outcome) = r.outcome {
                route(r.origin, outcome);
            }
        }
        if let Some(h) = hooks {
            for (node, outcomes) in remote {
                (h.remote)(node, outcomes);
            }
        }
        for (i, n) in counts.iter().enumerate() {
            if *n > 0 {
                self.metrics
                    .decisions
                    .with_label_values(&[Status::ALL[i].as_str()])
                    .inc_by(*n);
            }
        }
        for (shop, outcomes) in by_shop {
            match self.registry.get(&shop) {
                Some(wm) => wm.addr.do_send(Decided(outcomes)),
                // The shop's WorkManager passivated (it had nothing in flight, so nobody
                // waits for these) or was dropped at shutdown: they are durable and can
                // be polled.
                None => tracing::debug!(%shop, "no WorkManager for decided outcomes"),
            }
        }
        for (shop, item) in dropped {
            if let Some(m) = self.items.get_mut(&shop) {
                if m.remove(&item).is_some() {
                    self.resident -= 1;
                    self.resident_gauge.dec();
                }
                if m.is_empty() {
                    self.items.remove(&shop);
                }
            }
            self.complete = false;
        }
    }

    fn notify_flushed(&mut self) {
        if self.mailbox.is_empty() && self.in_flight.is_empty() && self.parked.is_none() {
            for w in self.flush_waiters.drain(..) {
                let _ = w.send(());
            }
        }
    }
}

fn status_index(s: Status) -> usize {
    Status::ALL.iter().position(|x| *x == s).unwrap_or(0)
}

struct BatchBuilt {
    entries: Vec<Entry>,
    in_flight: BatchInFlight,
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
