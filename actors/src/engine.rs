//! Wiring of the core: arbiters (one per core), processor shards spread over them, the
//! shops' WorkManagers created on first use, and the calls the HTTP front makes.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use actix::prelude::*;
use dashmap::DashMap;
use tokio::sync::oneshot;

use crate::checkback::CheckBack;
use crate::mailbox::{LoadChunk, LoadItem};
use crate::metrics::Metrics;
use crate::ports::{Journal, Recovered, RequestLog, StoreError};
use crate::processor::{Enqueue, Flush, GetItem, ItemRead, Load, Processor};
use crate::reply::{Answers, Call, Reply};
use crate::topology::Topology;
use crate::types::{
    now_ms, Event, HoldView, ItemView, LoadTerms, Millis, Op, Outcome, Request, Status,
};
use crate::work_manager::{
    Decided, Deps, Passivate, Poll, PollResult, Registry, Resume, ShopHandle, ShopStatus, Submit,
    SubmitError, WorkManager,
};

mod builder;
pub mod handoff;
mod placement;

pub use builder::EngineBuilder;

/// The engine's bounds and timings. Every field is set from the binary's configuration.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Processor shards; items are hashed to them. More shards than cores spreads hot
    /// items apart; each shard is one actor and one journal append stream.
    pub shards: usize,
    /// Threads (actix arbiters) the shards and WorkManagers are spread over.
    pub arbiters: usize,
    /// Most entries a shard applies and journals as one batch.
    pub batch_max: usize,
    /// A request older than this when its shard reaches it is not applied (`expired`).
    pub request_ttl_ms: i64,
    /// How long a respond=true caller waits before being told `pending`.
    pub reply_timeout_ms: u64,
    /// Admitted, undecided requests across all shops; beyond it the API answers 429.
    pub inflight_max: usize,
    /// Undecided requests of one shop; beyond it that shop's callers get 429.
    pub shop_pending_max: usize,
    /// Outcomes each WorkManager keeps in memory for repeats and polls.
    pub outcome_cache_per_shop: usize,
    /// Outcomes all WorkManagers keep in memory together.
    pub outcome_cache_total: usize,
    /// Most shops with a WorkManager in memory at once; beyond it the idle ones that
    /// were used longest ago passivate to make room, and only when none is idle is a
    /// new shop refused (429).
    pub shops_max: usize,
    /// A WorkManager with nothing in flight for this long passivates.
    pub shop_idle_ms: u64,
    /// Most pending holds one shard keeps; beyond it a hold is `limit_exceeded`.
    pub holds_max: usize,
    /// Most pending holds of one shop one shard keeps; beyond it that shop's hold is
    /// `limit_exceeded`, while other shops still hold.
    pub holds_per_shop_max: usize,
    /// Most items in memory, over every shard (each keeps its share); beyond it idle
    /// items leave memory and are read back from the journal when next needed.
    pub items_max: usize,
    /// How long a sale stays returnable, in ms ([`crate::returns`]).
    pub return_window_ms: i64,
    /// With a shared log, copies of a hold's expiry sent through it (at waits that
    /// double from 1 s to a minute) before the node whose timer fired lets the hold go:
    /// [`crate::processor::EXPIRY_SENDS_MAX`], about ten minutes of copies. The tests lower
    /// it (`NRTXN_FAULT_EXPIRY_COPIES`) to reach the let-go in seconds.
    pub hold_expiry_copies: u8,
    /// Keep each arbiter on a core of its own when the process may use exactly one core
    /// per arbiter ([`placement`]).
    pub pin_threads: bool,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            shards: 8,
            arbiters: 2,
            batch_max: 4096,
            request_ttl_ms: 30_000,
            reply_timeout_ms: 5_000,
            inflight_max: 200_000,
            shop_pending_max: 100_000,
            // At about 0.7 KB an outcome (measured: 2,000 shops × 500 keys took RSS from
            // 37 to 716 MB), the total is about 140 MB at most.
            outcome_cache_per_shop: 10_000,
            outcome_cache_total: 200_000,
            shops_max: 10_000,
            shop_idle_ms: 60_000,
            holds_max: 1_000_000,
            // A quarter of a shard's holds: one shop cannot fill a shard alone (it takes
            // four to), and 250,000 holds pending on one shard (2,000,000 on 8) is far
            // more than a checkout flow keeps, even with the 7-day longest hold.
            holds_per_shop_max: 250_000,
            // At about 0.25 KB an item in memory (docs/reliability.md), about 0.5 GB.
            items_max: 2_000_000,
            return_window_ms: crate::returns::RETURN_WINDOW_MS_DEFAULT,
            hold_expiry_copies: crate::processor::EXPIRY_SENDS_MAX,
            // The server's default is on; engines made in tests share their process.
            pin_threads: false,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("too many requests in flight")]
    Overloaded,
    #[error("too many shops busy at once")]
    TooManyShops,
    #[error("shutting down")]
    ShuttingDown,
    #[error("no outcome within the reply timeout")]
    Timeout,
    /// A read of the journal a caller waited for did not finish within the reply timeout
    /// (the store slow or down); what the call would have changed, if anything, was not.
    /// The message is the engine's own, with no path or store error in it, so the caller
    /// is told it.
    #[error("{0}")]
    NotReadInTime(String),
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl From<SubmitError> for EngineError {
    fn from(e: SubmitError) -> Self {
        match e {
            SubmitError::Overloaded => EngineError::Overloaded,
            SubmitError::Store(s) => EngineError::Store(s),
            // Handled by `Engine::submit`, which sends the call to the new WorkManager.
            SubmitError::Passivated(..) => EngineError::ShuttingDown,
        }
    }
}

/// Routes requests to the shard that owns their item. Handed to the request log, which
/// calls it once a request may be processed.
#[derive(Clone)]
pub struct Dispatcher {
    shards: Arc<Vec<Addr<Processor>>>,
    /// Chosen before the shards started ([`EngineBuilder::topology`]).
    topology: Topology,
    registry: Registry,
}

impl Dispatcher {
    /// The shard of an item: a fixed hash of shop and item, so one item always has one
    /// writer for the life of the process.
    pub fn shard_of(&self, shop: &str, item: &str) -> usize {
        shard_of(shop, item, self.shards.len())
    }

    /// Hands outcomes decided on another node to this node's WorkManagers, which hold
    /// their reply handles. Outcomes of shops without one here are dropped: nobody here
    /// waits for them, and they are in the journal.
    pub fn deliver(&self, outcomes: Vec<Outcome>) {
        let mut by_shop: HashMap<Arc<str>, Vec<Arc<Outcome>>> = HashMap::new();
        for o in outcomes {
            by_shop.entry(o.shop.clone()).or_default().push(Arc::new(o));
        }
        for (shop, outcomes) in by_shop {
            if let Some(wm) = self.registry.get(&shop) {
                wm.addr.do_send(Decided::new(outcomes));
            }
        }
    }

    /// Sends each request to its shard, one message per shard, keeping arrival order.
    pub fn dispatch(&self, reqs: Vec<Request>) {
        let Some(first) = reqs.first() else {
            return;
        };
        // Most often every request is of one shard (one item, a shop's few, or one shard
        // in all): the list goes whole, not copied request by request into a new one.
        let s = self.shard_of(&first.shop, &first.item);
        if self.shards.len() == 1
            || reqs[1..]
                .iter()
                .all(|r| self.shard_of(&r.shop, &r.item) == s)
        {
            self.shards[s].do_send(Enqueue(reqs));
            return;
        }
        let mut per: HashMap<usize, Vec<Request>> = HashMap::new();
        for r in reqs {
            per.entry(self.shard_of(&r.shop, &r.item))
                .or_default()
                .push(r);
        }
        for (s, reqs) in per {
            self.shards[s].do_send(Enqueue(reqs));
        }
    }
}

/// The request key of item `index` of the load with `request_id`: nrtxn's own (`~`), so a
/// load's `request_id` never meets a transaction's or a hold's.
pub fn load_key(request_id: &str, index: usize) -> Arc<str> {
    format!("~loadid:{request_id}:{index}").into()
}

/// One item of a load: its stock, and the seq it must still have (`if_seq`) when the
/// load is conditional.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LoadEntry {
    pub item: Arc<str>,
    pub stock: i64,
    pub if_seq: Option<u64>,
    /// The item's new per-buyer limit: 0 lifts it, `None` leaves it ([`crate::ledger`]).
    pub per_buyer_max: Option<i64>,
    /// What the load does to the item's sale window and low-stock level.
    pub terms: LoadTerms,
}

/// A load's items as keyed requests, item `i` under `key(i)`.
fn load_requests(
    shop: &Arc<str>,
    items: Vec<LoadEntry>,
    key: impl Fn(usize) -> Arc<str>,
) -> Vec<Request> {
    let now = now_ms();
    items
        .into_iter()
        .enumerate()
        .map(|(i, e)| Request {
            if_seq: e.if_seq,
            per_buyer_max: e.per_buyer_max,
            opens_at: e.terms.opens_at,
            closes_at: e.terms.closes_at,
            low_stock_at: e.terms.low_stock_at,
            ..Request::new(shop.clone(), e.item, key(i), Op::Load, e.stock, now)
        })
        .collect()
}

/// An item as a load's outcome leaves it.
pub fn load_view(shop: &Arc<str>, o: &Outcome) -> ItemView {
    ItemView {
        shop: shop.clone(),
        item: o.item.clone(),
        stock: o.stock_after.unwrap_or(0),
        reserved: o.reserved_after.unwrap_or(0),
        seq: o.seq.unwrap_or(0),
        opens_at: o.opens_at,
        closes_at: o.closes_at,
        low_stock_at: o.low_stock_at,
    }
}

pub use crate::types::shard_of;

pub struct Engine {
    cfg: EngineConfig,
    deps: Arc<Deps>,
    /// The journal: the engine reads items, holds and events from it for callers, and
    /// closes it at shutdown. Its actors hold only the ports they call ([`Deps`],
    /// [`ShardShared`]).
    journal: Arc<dyn Journal>,
    registry: Registry,
    arbiters: Vec<ArbiterHandle>,
    /// Owned so the arbiter threads live as long as the engine.
    _arbiters: Mutex<Vec<Arbiter>>,
    next_arbiter: AtomicUsize,
    shards: Dispatcher,
    closing: AtomicBool,
    /// Load calls made through a shared log, and what makes their keys this process's
    /// own (its start time): both go into each load's request key.
    load_calls: AtomicUsize,
    node_tag: String,
    /// New shops come in one at a time under it: each looks for room in the registry,
    /// evicts idle WorkManagers at the bound, and takes the room it made.
    evicting: tokio::sync::Mutex<()>,
    /// Orders being settled after a processor's nudge ([`crate::orders`]).
    settling: crate::settling::Settling,
    /// The shops' check-backs, if built with them ([`EngineBuilder::checkback`]).
    checkback: Option<Arc<dyn CheckBack>>,
}

/// Idle WorkManagers asked to passivate in one eviction, as a share of `shops_max`: a
/// scan of the registry pays for room for many new shops, not one.
const EVICT_SHARE: usize = 64;
/// Evictions one new shop at the bound asks for at most before it is refused (each may
/// find its idle shops busy again by the time they are asked to passivate).
const EVICT_ROUNDS_MAX: usize = 4;

/// The arbiter (of `arbiters`) that shard `shard`'s processor runs on: from the last
/// one down, so that with fewer shards than arbiters (the embedded journal's default)
/// the first arbiter keeps none. Measured on `hot`, one shard on the last of two
/// arbiters against the first: 1.046 decisions/s, 0.967 CPU per decision (why the
/// first is the busier was not profiled; `docs/decisions/shards.md`).
fn arbiter_of_shard(shard: usize, arbiters: usize) -> usize {
    arbiters - 1 - shard % arbiters
}

impl Engine {
    /// Recovers every item from the journal, starts the shards and builds the request log
    /// on top of them, then resumes the requests the log held undecided: this node's own
    /// log, no check-back ([`EngineBuilder`] for the rest). Call inside an actix system.
    pub fn start<F>(
        cfg: EngineConfig,
        journal: Arc<dyn Journal>,
        make_log: F,
        metrics: Arc<Metrics>,
    ) -> Result<Arc<Engine>, StoreError>
    where
        F: FnOnce(Dispatcher, &Recovered) -> Arc<dyn RequestLog>,
    {
        EngineBuilder::new(cfg, journal, metrics).start(make_log)
    }

    /// The shops' check-backs, if the engine was built with them.
    pub fn checkback(&self) -> Option<Arc<dyn CheckBack>> {
        self.checkback.clone()
    }

    /// How long a caller waits for an outcome before it is answered `pending`.
    pub fn reply_timeout(&self) -> Duration {
        self.deps.reply_timeout
    }

    /// How old a request may be when it is decided; older, it is answered `expired`.
    pub(crate) fn request_ttl(&self) -> Duration {
        self.deps.request_ttl
    }

    /// Whether other nodes write the same journal (a shared log and journal).
    pub fn shares_journal(&self) -> bool {
        self.shards.topology.shares_journal()
    }

    pub(crate) fn settling(&self) -> &crate::settling::Settling {
        &self.settling
    }

    /// Sends requests nrtxn makes itself, which nobody waits for, to their items'
    /// processors: through the shared log when there is one (the item's owner may be
    /// another node), else straight to the shard.
    pub(crate) fn send_internal(&self, reqs: Vec<Request>) {
        if reqs.is_empty() {
            return;
        }
        match self.shards.topology.log() {
            Some(log) => (log.hooks.resubmit)(reqs),
            None => self.shards.dispatch(reqs),
        }
    }

    /// Holds as durable, in the order of `hold_ids` (`None`: no such hold).
    pub async fn holds_of(
        &self,
        shop: &Arc<str>,
        hold_ids: Vec<Arc<str>>,
    ) -> Result<Vec<Option<HoldView>>, EngineError> {
        let (journal, shop) = (self.journal.clone(), shop.clone());
        self.read_for_caller("holds", move || {
            let ids: Vec<&str> = hold_ids.iter().map(|h| &**h).collect();
            journal.holds(&shop, &ids)
        })
        .await
    }

    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    /// The threads the shards and WorkManagers run on: the API is served on them too
    /// (the binary's `front`), so a call meets its shard on the thread that read it.
    pub fn arbiter_handles(&self) -> &[ArbiterHandle] {
        &self.arbiters
    }

    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.deps.metrics
    }

    pub fn is_closing(&self) -> bool {
        self.closing.load(Ordering::Acquire)
    }

    /// Recovered, its request log ready, and not shutting down.
    pub fn is_ready(&self) -> bool {
        !self.is_closing() && self.deps.log.ready()
    }

    /// The shop's WorkManager, started if it has none, on the thread of the shard of
    /// `item`, the item of the call that starts it ([`Engine::arbiter_for`]). At
    /// `shops_max`, idle ones make room first; a new shop is refused only when every
    /// shop in memory is busy.
    async fn work_manager(
        &self,
        shop: &Arc<str>,
        item: Option<&str>,
    ) -> Result<ShopHandle, EngineError> {
        if let Some(wm) = self.registry.get(shop) {
            return Ok(wm.clone());
        }
        // New shops come in one at a time: each looks for room and takes it (at the
        // bound, making room first) before the next looks, so room made for one is not
        // taken by another, and a burst of new shops larger than one eviction's share
        // is not refused while idle shops remain (the fault campaign's memory case saw
        // 429s there). Making a WorkManager is quick: the wait is short.
        let _one_at_a_time = self.evicting.lock().await;
        for _ in 0..EVICT_ROUNDS_MAX {
            if let Some(wm) = self.registry.get(shop) {
                return Ok(wm.clone());
            }
            if self.registry.len() < self.cfg.shops_max {
                return Ok(self.work_manager_unbounded(shop, item));
            }
            if !self.evict_idle().await {
                break;
            }
        }
        Err(EngineError::TooManyShops)
    }

    /// Asks idle WorkManagers, used longest ago first, to passivate, until a share of
    /// `shops_max` has; each leaves the registry before it answers, unless it took work
    /// in meanwhile (a WorkManager just made for a new shop looks idle until its first
    /// request reaches it), and then the next is asked. Whether any passivated. The
    /// caller holds `evicting`.
    async fn evict_idle(&self) -> bool {
        let mut idle: Vec<(Millis, Addr<WorkManager>)> = self
            .registry
            .iter()
            .filter_map(|e| e.status.idle_since().map(|at| (at, e.addr.clone())))
            .collect();
        idle.sort_unstable_by_key(|(at, _)| *at);
        let share = (self.cfg.shops_max / EVICT_SHARE).max(1);
        let mut passivated = 0;
        for (_, addr) in idle {
            if passivated == share {
                break;
            }
            if let Ok(true) = addr.send(Passivate).await {
                passivated += 1;
            }
        }
        passivated > 0
    }

    /// The thread (arbiter) a new WorkManager of `shop` lives on: that of the shard of
    /// `item`, the item of the call that makes it, else the next one in turn. A shop's
    /// traffic in a sale is mostly its few hot items: with its WorkManager on their shard's
    /// thread, the hand-offs between the two (requests one way, outcomes the other) stay
    /// on one thread and wake no other. Items hash evenly over the shards, so shops still
    /// spread evenly over the threads. Measured on `hot-sales` (`docs/decisions/request-path.md`,
    /// "A shop's WorkManager beside its first item's shard").
    fn arbiter_for(&self, shop: &str, item: Option<&str>) -> usize {
        let n = self.arbiters.len();
        match item {
            Some(item) => arbiter_of_shard(shard_of(shop, item, self.shards.shards.len()), n),
            None => self.next_arbiter.fetch_add(1, Ordering::Relaxed) % n,
        }
    }

    fn work_manager_unbounded(&self, shop: &Arc<str>, item: Option<&str>) -> ShopHandle {
        self.registry
            .entry(shop.clone())
            .or_insert_with(|| {
                let n = self.arbiter_for(shop, item);
                let status = Arc::new(ShopStatus::default());
                status.touch();
                let wm = WorkManager::new(shop.clone(), self.deps.clone(), status.clone());
                ShopHandle {
                    addr: WorkManager::start_in_arbiter(&self.arbiters[n], move |_| wm),
                    status,
                }
            })
            .clone()
    }

    /// Sets the engine's `nrtxn_bound_used` gauges to what is in use now.
    pub fn publish_bounds(&self) {
        let used = &self.deps.metrics.bound_used;
        used.with_label_values(&["shops"])
            .set(self.shops_in_memory() as i64);
        used.with_label_values(&["outcomes_cached"])
            .set(self.outcomes_cached() as i64);
        used.with_label_values(&["shops_with_figures"])
            .set(self.deps.metrics.shops.tracked() as i64);
    }

    /// Shops with a WorkManager in memory now.
    pub fn shops_in_memory(&self) -> usize {
        self.registry.len()
    }

    /// Outcomes cached in memory now, in all WorkManagers.
    pub fn outcomes_cached(&self) -> usize {
        self.deps.outcomes_cached.load(Ordering::Relaxed)
    }

    /// Submits requests of one shop (`bool`: whether the caller waits for the outcome)
    /// and waits for the call's replies: outcomes, `Accepted` for fire-and-forget
    /// requests (owed a 202 if [`Answers::durable`] says so), `Pending` for what is
    /// undecided at the reply timeout. The shop's WorkManager answers once, when the last
    /// reply is known, on the handle carried with the requests.
    pub async fn submit(
        &self,
        shop: &Arc<str>,
        reqs: Vec<(Request, bool)>,
    ) -> Result<Answers, EngineError> {
        let deadline = std::time::Instant::now() + self.deps.reply_timeout;
        self.submit_by(shop, reqs, deadline).await
    }

    /// [`Engine::submit`], answered by `deadline` (of a call that did something before,
    /// so that the whole call keeps within the reply timeout).
    pub(crate) async fn submit_by(
        &self,
        shop: &Arc<str>,
        reqs: Vec<(Request, bool)>,
        deadline: std::time::Instant,
    ) -> Result<Answers, EngineError> {
        if self.is_closing() {
            return Err(EngineError::ShuttingDown);
        }
        // Split here, on the caller's thread: the requests travel on as one list.
        let (mut reqs, mut respond): (Vec<Request>, Vec<bool>) = reqs.into_iter().unzip();
        // A WorkManager that passivated after it was looked up hands the call back, and it
        // goes to the shop's next one (a few times at most: each is new and busy), by the
        // same deadline.
        for _ in 0..3 {
            let first = reqs.first().map(|r| &*r.item);
            let wm = self.work_manager(shop, first).await?;
            let (call, answered) = Call::new(reqs.len(), deadline);
            match wm.addr.try_send(Submit {
                reqs,
                respond,
                call,
            }) {
                Ok(()) => {}
                // The shop's mailbox is the queue in front of its WorkManager: full, the
                // call is refused (429) rather than queued without bound.
                Err(SendError::Full(_)) => return Err(EngineError::Overloaded),
                Err(SendError::Closed(msg)) => {
                    (reqs, respond) = (msg.reqs, msg.respond);
                    continue;
                }
            }
            match answered.await {
                Ok(Err(SubmitError::Passivated(back, waits))) => (reqs, respond) = (back, waits),
                Ok(result) => return Ok(result?),
                // The WorkManager stopped with the call unanswered: only at shutdown.
                Err(_) => return Err(EngineError::ShuttingDown),
            }
        }
        Err(EngineError::Overloaded)
    }

    /// What is known of a request key.
    pub async fn poll(&self, shop: &Arc<str>, key: Arc<str>) -> Result<PollResult, EngineError> {
        let mut found = self.poll_many(shop, vec![key]).await?;
        Ok(found.pop().unwrap_or(PollResult::Unknown))
    }

    /// What is known of each of `keys`, in their order, in one round trip to the shop's
    /// WorkManager (and at most one read of the journal).
    pub async fn poll_many(
        &self,
        shop: &Arc<str>,
        keys: Vec<Arc<str>>,
    ) -> Result<Vec<PollResult>, EngineError> {
        let Some(wm) = self.registry.get(shop).map(|w| w.addr.clone()) else {
            // No WorkManager yet: nothing is in flight for this shop in this process,
            // so the journal alone knows the answer (read off the HTTP worker's thread).
            let (journal, shop, exact) = (
                self.deps.outcomes.clone(),
                shop.clone(),
                self.deps.topology.is_shared(),
            );
            let found = self
                .read_for_caller("an outcome", move || {
                    let refs: Vec<&str> = keys.iter().map(|k| &**k).collect();
                    if exact {
                        journal.decided(&shop, &refs)
                    } else {
                        journal.outcomes(&shop, &refs)
                    }
                })
                .await?;
            return Ok(found
                .into_iter()
                .map(|o| match o {
                    Some(o) => PollResult::Decided(Arc::new(o)),
                    None => PollResult::Unknown,
                })
                .collect());
        };
        // The WorkManager answers from memory, or reads the journal off its thread:
        // bounded like a read of the caller's own.
        let within = self.deps.reply_timeout;
        match tokio::time::timeout(within, wm.send(Poll(keys))).await {
            Ok(answer) => Ok(answer.map_err(|_| EngineError::ShuttingDown)??),
            Err(_) => Err(EngineError::NotReadInTime(format!(
                "an outcome: the journal did not answer within the reply timeout ({} ms)",
                within.as_millis()
            ))),
        }
    }

    /// Sets the available stock of items (creating unknown ones) through their
    /// processors, and returns their durable states in the order given.
    pub async fn load(
        &self,
        shop: &Arc<str>,
        items: Vec<(Arc<str>, i64)>,
    ) -> Result<Vec<ItemView>, EngineError> {
        let entries = items
            .into_iter()
            .map(|(item, stock)| LoadEntry {
                item,
                stock,
                if_seq: None,
                per_buyer_max: None,
                terms: LoadTerms::KEEP,
            })
            .collect();
        let loaded = self.load_entries(shop, entries).await?;
        Ok(loaded.into_iter().map(|(view, _)| view).collect())
    }

    /// [`Engine::load`] with conditions: an entry with `if_seq` applies only if its
    /// item's seq is still that, and is otherwise answered [`Status::SeqMoved`] with the
    /// item's state, that item unchanged. Each item's state in the order given, with
    /// `Ok` or `SeqMoved`.
    pub async fn load_entries(
        &self,
        shop: &Arc<str>,
        items: Vec<LoadEntry>,
    ) -> Result<Vec<(ItemView, Status)>, EngineError> {
        if self.is_closing() {
            return Err(EngineError::ShuttingDown);
        }
        if self.shards.topology.is_shared() {
            return self.load_through_log(shop, items).await;
        }
        // Straight to the processors, not through the log: asked here what the log's
        // append asks for every other call (a full disk refuses it at once).
        self.deps.log.admit()?;
        // A load makes its shop one of those in memory, like any request, so loads too
        // are held to `shops_max`.
        let first = items.first().map(|i| &*i.item);
        self.work_manager(shop, first).await?.status.touch();
        let n = items.len();
        if !self.deps.reserve(n) {
            return Err(EngineError::Overloaded);
        }
        let mut per: HashMap<usize, Vec<LoadItem>> = HashMap::new();
        for (index, e) in items.into_iter().enumerate() {
            per.entry(self.shards.shard_of(shop, &e.item))
                .or_default()
                .push(LoadItem {
                    item: e.item,
                    stock: e.stock,
                    if_seq: e.if_seq,
                    per_buyer_max: e.per_buyer_max,
                    terms: e.terms,
                    index,
                });
        }
        let mut waits = Vec::with_capacity(per.len());
        for (s, items) in per {
            let (reply, rx) = oneshot::channel();
            self.shards.shards[s].do_send(Load(LoadChunk {
                shop: shop.clone(),
                items,
                reply,
            }));
            waits.push(rx);
        }
        let mut out: Vec<Option<(ItemView, Status)>> = vec![None; n];
        let mut result = Ok(());
        for rx in waits {
            match rx.await {
                Ok(views) => {
                    for (i, v, status) in views {
                        out[i] = Some((v, status));
                    }
                }
                Err(_) => result = Err(EngineError::ShuttingDown),
            }
        }
        self.deps.release(n);
        result?;
        Ok(out.into_iter().flatten().collect())
    }

    /// With a shared log an item's processor may run on another node, so a load travels
    /// through the log like any request, as one keyed request per item; the keys are
    /// this node's own, so a load is never confused with a seller's request.
    async fn load_through_log(
        &self,
        shop: &Arc<str>,
        items: Vec<LoadEntry>,
    ) -> Result<Vec<(ItemView, Status)>, EngineError> {
        let node = self.shards.topology.log().map_or(0, |l| l.hooks.node_id);
        let call = self.load_calls.fetch_add(1, Ordering::Relaxed);
        let prefix = format!("~load:{node}:{}:{call}", self.node_tag);
        let reqs = load_requests(shop, items, |i| format!("{prefix}:{i}").into());
        let outcomes = self.load_keyed(shop, reqs).await?;
        Ok(outcomes
            .iter()
            .map(|o| (load_view(shop, o), o.status))
            .collect())
    }

    /// A load the caller gave a `request_id`: one keyed request per item, under
    /// [`load_key`]`(request_id, index)`, so a retried load is answered with what the
    /// first one did, never applied twice (it would reset the stock sold in between).
    /// Returns the requests as submitted and each item's outcome, in order; an outcome
    /// of a different request under the same key is the caller's to refuse
    /// ([`Request::reuse_conflict`]).
    pub async fn load_once(
        &self,
        shop: &Arc<str>,
        request_id: &str,
        items: Vec<LoadEntry>,
    ) -> Result<Vec<(Request, Arc<Outcome>)>, EngineError> {
        if self.is_closing() {
            return Err(EngineError::ShuttingDown);
        }
        let reqs = load_requests(shop, items, |i| load_key(request_id, i));
        let outcomes = self.load_keyed(shop, reqs.clone()).await?;
        Ok(reqs.into_iter().zip(outcomes).collect())
    }

    /// Submits a load's keyed requests and waits for every outcome.
    async fn load_keyed(
        &self,
        shop: &Arc<str>,
        reqs: Vec<Request>,
    ) -> Result<Vec<Arc<Outcome>>, EngineError> {
        let reqs = reqs.into_iter().map(|r| (r, true)).collect();
        let answers = self.submit(shop, reqs).await?;
        answers
            .replies
            .into_iter()
            .map(|reply| match reply {
                Reply::Repeat(o) | Reply::Decided(o) => Ok(o),
                Reply::Accepted | Reply::Pending => Err(EngineError::Timeout),
            })
            .collect()
    }

    /// What is known of the load with `request_id`: its items' outcomes in order, as far
    /// as they are decided without a gap, and whether any item is still in flight.
    pub async fn poll_load(
        &self,
        shop: &Arc<str>,
        request_id: &str,
    ) -> Result<(Vec<Arc<Outcome>>, bool), EngineError> {
        const CHUNK: usize = 1_000;
        let mut decided = Vec::new();
        let mut start = 0;
        while start < crate::types::LOAD_ITEMS_MAX {
            let keys: Vec<Arc<str>> = (start..start + CHUNK)
                .map(|i| load_key(request_id, i))
                .collect();
            let (journal, shop_owned, asked) = (self.deps.outcomes.clone(), shop.clone(), keys);
            let found = self
                .read_for_caller("a load's outcomes", move || {
                    let refs: Vec<&str> = asked.iter().map(|k| &**k).collect();
                    journal.decided(&shop_owned, &refs)
                })
                .await?;
            let n = found.len();
            let mut complete = true;
            for o in found {
                match o {
                    Some(o) => decided.push(Arc::new(o)),
                    None => {
                        complete = false;
                        break;
                    }
                }
            }
            if !complete || n < CHUNK {
                break;
            }
            start += CHUNK;
        }
        // The next item is in flight if the shop's WorkManager says so.
        let next = load_key(request_id, decided.len());
        let pending = matches!(self.poll(shop, next).await?, PollResult::Pending);
        Ok((decided, pending))
    }

    /// Runs a caller's read of the journal on the blocking pool, and gives up waiting
    /// for it at the reply timeout: a journal that does not answer (its database down)
    /// is a `503` to the caller, not a wait as long as the outage (the fault campaign's
    /// db-kill case saw reads wait 12.7 s). The read itself runs on until the store
    /// answers or fails. Not for the processors, which must wait for their reads.
    async fn read_for_caller<T: Send + 'static>(
        &self,
        what: &'static str,
        read: impl FnOnce() -> Result<T, StoreError> + Send + 'static,
    ) -> Result<T, EngineError> {
        let within = self.deps.reply_timeout;
        match tokio::time::timeout(within, tokio::task::spawn_blocking(read)).await {
            Ok(joined) => Ok(joined.map_err(|_| EngineError::ShuttingDown)??),
            Err(_) => Err(EngineError::NotReadInTime(format!(
                "{what}: the journal did not answer within the reply timeout ({} ms)",
                within.as_millis()
            ))),
        }
    }

    /// A hold as durable, `None` if there is no such hold.
    pub async fn hold(
        &self,
        shop: &Arc<str>,
        hold_id: &Arc<str>,
    ) -> Result<Option<HoldView>, EngineError> {
        let (journal, shop, hold_id) = (self.journal.clone(), shop.clone(), hold_id.clone());
        let found = self
            .read_for_caller("a hold", move || journal.holds(&shop, &[&hold_id]))
            .await?;
        Ok(found.into_iter().next().flatten())
    }

    /// A page of the shop's holds (or orders' records) as durable, those `query` asks
    /// for, in id order after `after`: at most `limit`, and the id to ask after for the
    /// next page (`None` at the end).
    pub async fn hold_page(
        &self,
        shop: &Arc<str>,
        query: crate::HoldQuery,
        after: Option<Arc<str>>,
        limit: usize,
    ) -> Result<(Vec<HoldView>, Option<Arc<str>>), EngineError> {
        let (journal, shop) = (self.journal.clone(), shop.clone());
        let page = self
            .read_for_caller("a shop's holds", move || {
                journal.hold_page(&shop, &query, after.as_deref(), limit)
            })
            .await?;
        let next = match page.more {
            true => page.holds.last().map(|h| h.hold_id.clone()),
            false => None,
        };
        Ok((page.holds, next))
    }

    /// An item's durable events after `after`, in seq order, at most `limit`.
    pub async fn events(
        &self,
        shop: &Arc<str>,
        item: &Arc<str>,
        after: u64,
        limit: usize,
    ) -> Result<Vec<Event>, EngineError> {
        let (journal, shop, item) = (self.journal.clone(), shop.clone(), item.clone());
        self.read_for_caller("an item's events", move || {
            journal.events(&shop, &item, after, limit)
        })
        .await
    }

    /// A page of the shop's items as durable, in name order, after `after`: at most
    /// `limit` ([`crate::ITEMS_LIMIT_MAX`]) items, and the name to ask after for the next
    /// page (`None` at the end). Internal pseudo-items are left out.
    pub async fn items(
        &self,
        shop: &Arc<str>,
        after: Option<Arc<str>>,
        limit: usize,
    ) -> Result<(Vec<ItemView>, Option<Arc<str>>), EngineError> {
        let (journal, s) = (self.journal.clone(), shop.clone());
        let page = self
            .read_for_caller("a shop's items", move || {
                journal.item_page(&s, after.as_deref(), limit)
            })
            .await?;
        let next = if page.more {
            page.items.last().map(|(item, _)| item.clone())
        } else {
            None
        };
        let views = page
            .items
            .into_iter()
            .map(|(item, st)| ItemView::of(shop.clone(), item, st))
            .collect();
        Ok((views, next))
    }

    /// The durable state of an item, `None` if unknown.
    pub async fn item(
        &self,
        shop: &Arc<str>,
        item: &Arc<str>,
    ) -> Result<Option<ItemView>, EngineError> {
        // With several nodes its processor may be on another one.
        let read = if self.shares_journal() {
            ItemRead::AskJournal
        } else {
            let s = self.shards.shard_of(shop, item);
            self.shards.shards[s]
                .send(GetItem {
                    shop: shop.clone(),
                    item: item.clone(),
                })
                .await
                .map_err(|_| EngineError::ShuttingDown)?
        };
        let state = match read {
            ItemRead::Found(st) => Some(st),
            ItemRead::Unknown => None,
            // The journal has the durable state (newer than when the shard was asked,
            // if the item came back and changed since: durable all the same).
            ItemRead::AskJournal => {
                let journal = self.journal.clone();
                let key = [(shop.clone(), item.clone())];
                self.read_for_caller("an item", move || journal.item_states(&key))
                    .await?
                    .into_iter()
                    .next()
                    .flatten()
            }
        };
        Ok(state.map(|st| ItemView::of(shop.clone(), item.clone(), st)))
    }

    /// Stops taking requests, waits until every shard has applied and journaled what it
    /// holds, and closes the journal.
    /// Stops taking requests from the log and flushes every shard's batches to the
    /// journal, which stays open (for the outbox relay's last pass, say). Idempotent;
    /// [`Engine::shutdown`] does it first.
    pub async fn drain(&self) {
        self.closing.store(true, Ordering::Release);
        self.deps.log.close();
        for shard in self.shards.shards.iter() {
            let _ = shard.send(Flush).await;
        }
    }

    pub async fn shutdown(&self) {
        self.drain().await;
        self.journal.close();
        if let Ok(mut owned) = self._arbiters.lock() {
            for a in owned.drain(..) {
                a.stop();
            }
        }
    }
}
