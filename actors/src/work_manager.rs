//! The WorkManager: one actor per shop. Every request of a shop passes through it, which
//! makes it the place where the at-most-once rule is kept: a key is either new (sent to
//! the request log once), in flight (the caller waits on the same decision), or decided
//! (the recorded outcome is returned, and nothing is applied).

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicI64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use actix::prelude::*;
use dashmap::DashMap;

use crate::metrics::Metrics;
use crate::ports::{Journal, RequestLog, StoreError};
use crate::reply::{Call, Deadlines, Reply};
use crate::types::{now_ms, Millis, Outcome, Request};

/// How long a passivated WorkManager stays alive to hand back requests sent to it just
/// before it left the registry (see [`SubmitError::Passivated`]) before it stops.
const PASSIVATED_STOP_DELAY: Duration = Duration::from_secs(5);

/// What the engine and the processors can see of a shop's WorkManager without asking it:
/// whether it is busy, and when it was last used, so that idle ones can be passivated to
/// make room for new shops.
#[derive(Debug, Default)]
pub struct ShopStatus {
    /// Keys of the shop in flight (admitted, undecided).
    pub in_flight: AtomicUsize,
    /// When the shop last submitted, polled or loaded (ms since the epoch).
    pub last_active_ms: AtomicI64,
}

impl ShopStatus {
    pub fn touch(&self) {
        self.last_active_ms.store(now_ms(), Ordering::Relaxed);
    }

    pub fn idle_since(&self) -> Option<Millis> {
        (self.in_flight.load(Ordering::Acquire) == 0)
            .then(|| self.last_active_ms.load(Ordering::Relaxed))
    }
}

/// A shop's WorkManager as the registry keeps it.
#[derive(Clone)]
pub struct ShopHandle {
    pub addr: Addr<WorkManager>,
    pub status: Arc<ShopStatus>,
}

/// Shops' WorkManagers by shop, shared by the engine (which creates and evicts them),
/// the processors (which send them outcomes) and the WorkManagers (which leave it when
/// they passivate). Bounded by `shops_max`.
pub type Registry = Arc<DashMap<Arc<str>, ShopHandle>>;

/// What every WorkManager shares: its bounds and the ports.
pub struct Deps {
    pub journal: Arc<dyn Journal>,
    pub log: Arc<dyn RequestLog>,
    pub metrics: Arc<Metrics>,
    /// The request log is shared by several nodes: an outcome may be decided on another
    /// node and its reply lost with that node, so keys long in flight are looked up in
    /// the journal (see [`WorkManager::sweep`]).
    pub shared_log: bool,
    /// Requests older than this when their processor reaches them are not applied.
    pub request_ttl: Duration,
    /// Admitted, undecided requests across all shops; bounded by `inflight_max`. This one
    /// bound covers every queue behind admission: request log, mailboxes, journal queue.
    pub inflight_total: AtomicUsize,
    pub inflight_max: usize,
    /// Undecided requests of one shop, so one shop's spike cannot take the whole budget.
    pub shop_pending_max: usize,
    /// Decided outcomes a WorkManager keeps in memory to answer repeats without a read.
    pub outcome_cache_max: usize,
    /// Decided outcomes all WorkManagers keep in memory together, at most: a shop that
    /// would pass it drops its own oldest first, and caches nothing when it has none.
    pub outcome_cache_total_max: usize,
    /// Outcomes cached now, in all WorkManagers.
    pub outcomes_cached: AtomicUsize,
    /// A WorkManager with nothing in flight for this long passivates: it leaves the
    /// registry and stops, and comes back on the shop's next request.
    pub shop_idle: Duration,
    pub registry: Registry,
    /// How long a caller waits for an outcome before it is told `pending`.
    pub reply_timeout: Duration,
}

impl Deps {
    /// Reserves `n` places of the global in-flight budget, all or none.
    pub fn reserve(&self, n: usize) -> bool {
        let mut cur = self.inflight_total.load(Ordering::Relaxed);
        loop {
            if cur + n > self.inflight_max {
                return false;
            }
            match self.inflight_total.compare_exchange_weak(
                cur,
                cur + n,
                Ordering::AcqRel,
                Ordering::Relaxed,
            ) {
                Ok(_) => {
                    self.update_gauge(cur + n);
                    return true;
                }
                Err(actual) => cur = actual,
            }
        }
    }

    pub fn release(&self, n: usize) {
        if n > 0 {
            let prev = self.inflight_total.fetch_sub(n, Ordering::AcqRel);
            self.update_gauge(prev - n);
        }
    }

    fn update_gauge(&self, v: usize) {
        self.metrics
            .queue_depth
            .with_label_values(&["inflight"])
            .set(v as i64);
    }
}

/// A caller waiting for a key's outcome: request `index` of `call`.
struct Waiter {
    call: Arc<Call>,
    index: usize,
}

struct InFlight {
    /// The request log holds the request durably (it was sent fire-and-forget).
    logged: bool,
    waiters: Vec<Waiter>,
    since: Instant,
}

/// Keys long in flight looked up in the journal per sweep, at most.
const STALE_LOOKUPS_MAX: usize = 1_000;

pub struct WorkManager {
    shop: Arc<str>,
    deps: Arc<Deps>,
    /// Shared with the registry entry: kept current so the engine can tell idle shops.
    status: Arc<ShopStatus>,
    /// Left the registry: requests that still reach it are handed back to the engine.
    passivated: bool,
    /// Bounded by `shop_pending_max` (checked on admission).
    in_flight: HashMap<Arc<str>, InFlight>,
    /// Recent outcomes, oldest first in `recent_order`; bounded by `outcome_cache_max`.
    /// Older ones are read back from the journal.
    recent: HashMap<Arc<str>, Arc<Outcome>>,
    recent_order: VecDeque<Arc<str>>,
    /// Calls with a request still undecided, answered `pending` at their deadline.
    deadlines: Deadlines,
    /// A wake-up is set for the first deadline in `deadlines`.
    deadline_armed: bool,
}

impl WorkManager {
    pub fn new(shop: Arc<str>, deps: Arc<Deps>, status: Arc<ShopStatus>) -> WorkManager {
        WorkManager {
            shop,
            deps,
            status,
            passivated: false,
            in_flight: HashMap::new(),
            recent: HashMap::new(),
            recent_order: VecDeque::new(),
            deadlines: Deadlines::default(),
            deadline_armed: false,
        }
    }

    /// Answers the calls past their deadline, and sets a wake-up for the next one. One
    /// wake-up at a time, and none while no call waits: an idle shop costs no timer.
    fn expire_calls(&mut self, ctx: &mut Context<Self>) {
        let now = Instant::now();
        self.deadlines.expire(now);
        self.deadline_armed = false;
        self.arm_deadline(ctx);
    }

    fn arm_deadline(&mut self, ctx: &mut Context<Self>) {
        if self.deadline_armed {
            return;
        }
        if let Some(at) = self.deadlines.first_deadline() {
            self.deadline_armed = true;
            let wait = at.saturating_duration_since(Instant::now());
            ctx.run_later(wait, |wm, ctx| wm.expire_calls(ctx));
        }
    }

    fn remember(&mut self, outcome: Arc<Outcome>) {
        if self.deps.outcome_cache_max == 0 || self.passivated {
            return;
        }
        let key = outcome.request_key.clone();
        if let Some(cached) = self.recent.get_mut(&key) {
            *cached = outcome;
            return;
        }
        // Room in this shop's share and in the total, taking it from this shop's own
        // oldest outcomes; a shop with none to give caches nothing (the journal has it).
        while self.recent.len() >= self.deps.outcome_cache_max
            || self.deps.outcomes_cached.load(Ordering::Relaxed)
                >= self.deps.outcome_cache_total_max
        {
            if !self.forget_oldest() {
                return;
            }
        }
        self.recent.insert(key.clone(), outcome);
        self.recent_order.push_back(key);
        self.deps.outcomes_cached.fetch_add(1, Ordering::Relaxed);
    }

    /// Drops the oldest cached outcome; `false` when there is none.
    fn forget_oldest(&mut self) -> bool {
        while let Some(old) = self.recent_order.pop_front() {
            if self.recent.remove(&old).is_some() {
                self.deps.outcomes_cached.fetch_sub(1, Ordering::Relaxed);
                return true;
            }
        }
        false
    }

    /// Keeps the shared status in step with the keys in flight.
    fn publish_in_flight(&self) {
        self.status
            .in_flight
            .store(self.in_flight.len(), Ordering::Release);
    }

    /// Leaves the registry (if it is still this WorkManager's entry), gives its cached
    /// outcomes back to the total, and stops a little later: a request that found it in
    /// the registry just before may still arrive, and is handed back to the engine.
    fn passivate(&mut self, ctx: &mut Context<Self>) {
        if self.passivated {
            return;
        }
        self.passivated = true;
        let me = ctx.address();
        self.deps
            .registry
            .remove_if(&self.shop, |_, h| h.addr == me);
        self.deps
            .outcomes_cached
            .fetch_sub(self.recent.len(), Ordering::Relaxed);
        self.recent = HashMap::new();
        self.recent_order = VecDeque::new();
        ctx.run_later(PASSIVATED_STOP_DELAY, |wm, ctx| {
            if wm.in_flight.is_empty() {
                ctx.stop();
            }
        });
    }

    /// Outcomes recorded in the journal for keys that are neither in flight nor cached.
    /// `exact`: read the store itself, not a filter that knows only this node's writes
    /// (a poll must find a key another node decided; a submission need not, since the
    /// item's processor checks every key against the journal anyway).
    fn look_up(&mut self, keys: &[&str], exact: bool) -> Result<(), StoreError> {
        if keys.is_empty() {
            return Ok(());
        }
        let found = if exact {
            self.deps.journal.decided(&self.shop, keys)?
        } else {
            self.deps.journal.outcomes(&self.shop, keys)?
        };
        for outcome in found.into_iter().flatten() {
            self.remember(Arc::new(outcome));
        }
        Ok(())
    }

    fn submit(&mut self, reqs: Vec<(Request, bool)>, call: Arc<Call>, ctx: &mut Context<Self>) {
        if self.passivated {
            return call.fail(SubmitError::Passivated(reqs));
        }
        self.status.touch();
        match self.admit(reqs, &call) {
            Ok(()) => {
                self.deadlines.push(call);
                self.arm_deadline(ctx);
            }
            Err(e) => call.fail(e),
        }
        self.publish_in_flight();
    }

    /// Takes a call's requests in, all of them or (overload, a store error) none, and
    /// seals the call: its replies are set here for repeats and fire-and-forget requests,
    /// and by [`WorkManager::decided`] for the others.
    fn admit(&mut self, reqs: Vec<(Request, bool)>, call: &Arc<Call>) -> Result<(), SubmitError> {
        // Keys this call does not already know about, read from the journal in one go.
        let unknown: Vec<&str> = {
            let mut seen = std::collections::HashSet::new();
            reqs.iter()
                .map(|(r, _)| &*r.key)
                .filter(|k| !self.in_flight.contains_key(*k) && !self.recent.contains_key(*k))
                .filter(|k| seen.insert(*k))
                .collect()
        };
        let unknown: Vec<String> = unknown.into_iter().map(str::to_owned).collect();
        let unknown_refs: Vec<&str> = unknown.iter().map(String::as_str).collect();
        self.look_up(&unknown_refs, false)
            .map_err(SubmitError::Store)?;

        // Admission: count what is new, reserve room for all of it or refuse all of it.
        let mut new_keys = std::collections::HashSet::new();
        for (r, _) in &reqs {
            if !self.in_flight.contains_key(&r.key) && !self.recent.contains_key(&r.key) {
                new_keys.insert(r.key.clone());
            }
        }
        let n_new = new_keys.len();
        if self.in_flight.len() + n_new > self.deps.shop_pending_max || !self.deps.reserve(n_new) {
            return Err(SubmitError::Overloaded);
        }

        // Replies known now are set only once the call is taken in whole: a call refused
        // below must not have half its replies.
        let mut known = Vec::new();
        let mut to_log = Vec::with_capacity(n_new);
        for (index, (mut req, respond)) in reqs.into_iter().enumerate() {
            if let Some(outcome) = self.recent.get(&req.key) {
                known.push((index, Reply::Repeat(outcome.clone())));
                continue;
            }
            let waiter = Waiter {
                call: call.clone(),
                index,
            };
            if let Some(flight) = self.in_flight.get_mut(&req.key) {
                // A repeat of a key in flight waits for the same decision. That is also
                // how a fire-and-forget repeat gets its 202: this call cannot know
                // whether the first submission is durable yet, but a journaled outcome
                // is.
                flight.waiters.push(waiter);
                continue;
            }
            req.logged = !respond;
            let mut flight = InFlight {
                logged: !respond,
                waiters: Vec::new(),
                since: Instant::now(),
            };
            if respond {
                flight.waiters.push(waiter);
            } else {
                known.push((index, Reply::Accepted));
            }
            self.in_flight.insert(req.key.clone(), flight);
            to_log.push(req);
        }
        let durable = if to_log.is_empty() {
            None
        } else {
            let keys: Vec<Arc<str>> = to_log.iter().map(|r| r.key.clone()).collect();
            match self.deps.log.append(to_log) {
                Ok(durable) => durable,
                Err(e) => {
                    // Nothing was handed on: undo the admission entirely, the waiters
                    // this call left on keys already in flight included.
                    for k in &keys {
                        self.in_flight.remove(k);
                    }
                    for flight in self.in_flight.values_mut() {
                        flight.waiters.retain(|w| !Arc::ptr_eq(&w.call, call));
                    }
                    self.deps.release(keys.len());
                    return Err(match e {
                        StoreError::Full => SubmitError::Overloaded,
                        other => SubmitError::Store(other),
                    });
                }
            }
        };
        for (index, reply) in known {
            call.set(index, reply);
        }
        call.seal(durable);
        Ok(())
    }

    fn decided(&mut self, outcomes: Vec<Arc<Outcome>>) {
        let mut answers = Vec::new();
        let mut retired = Vec::new();
        for outcome in outcomes {
            if let Some(flight) = self.in_flight.remove(&outcome.request_key) {
                if flight.logged {
                    retired.push(outcome.request_key.clone());
                }
                answers.push((flight.waiters, outcome.clone()));
            }
            self.remember(outcome);
        }
        if !retired.is_empty() {
            self.deps.log.retire(&self.shop, retired);
        }
        self.publish_in_flight();
        // Room is given back before anyone is answered, so a caller that sees its answer
        // also sees the bound freed.
        self.deps.release(answers.len());
        for (waiters, outcome) in answers {
            for w in waiters {
                w.call.set(w.index, Reply::Decided(outcome.clone()));
            }
        }
    }

    /// Drops reply handles whose caller has given up (timed out or disconnected). With
    /// a shared log, also settles keys in flight longer than the reply timeout: the node
    /// that decided one may have died before its reply reached this node, so the journal
    /// is asked. A key still unknown there after twice the request TTL can no longer be
    /// applied as sent (it would expire), and is let go: a resubmission is checked
    /// against the journal by the item's processor, so it is never applied twice.
    fn sweep(&mut self, ctx: &mut Context<Self>) {
        let now = Instant::now();
        for flight in self.in_flight.values_mut() {
            flight.waiters.retain(|w| !w.call.is_done());
        }
        let idle_ms = now_ms() - self.status.last_active_ms.load(Ordering::Relaxed);
        if self.in_flight.is_empty() && idle_ms >= self.deps.shop_idle.as_millis() as i64 {
            self.passivate(ctx);
            return;
        }
        if !self.deps.shared_log {
            return;
        }
        // A key with a caller waiting is looked up once it has been in flight longer
        // than the reply timeout; one without (fire-and-forget, or its caller gave up)
        // only after the request TTL: nobody waits for it, polls look it up themselves,
        // and under a backlog of accepted requests thousands of lookups per sweep would
        // compete with the journal's own writes (seen on the test MongoDB server:
        // decisions fell to a few hundred per second behind them).
        let (reply_timeout, request_ttl) = (self.deps.reply_timeout, self.deps.request_ttl);
        let stale: Vec<Arc<str>> = self
            .in_flight
            .iter()
            .filter(|(_, f)| {
                let age = now.duration_since(f.since);
                age > reply_timeout && (!f.waiters.is_empty() || age > request_ttl)
            })
            .map(|(k, _)| k.clone())
            .take(STALE_LOOKUPS_MAX)
            .collect();
        if stale.is_empty() {
            return;
        }
        let refs: Vec<&str> = stale.iter().map(|k| &**k).collect();
        let found = match self.deps.journal.decided(&self.shop, &refs) {
            Ok(found) => found,
            Err(e) => {
                tracing::warn!(shop = %self.shop, error = %e, "stale keys not looked up");
                return;
            }
        };
        let give_up = self.deps.request_ttl * 2 + self.deps.reply_timeout;
        let mut decided = Vec::new();
        let mut dropped = 0;
        for (key, outcome) in stale.iter().zip(found) {
            match outcome {
                Some(o) => decided.push(Arc::new(o)),
                None => {
                    if self
                        .in_flight
                        .get(key)
                        .is_some_and(|f| now.duration_since(f.since) > give_up)
                        && self.in_flight.remove(key).is_some()
                    {
                        dropped += 1;
                    }
                }
            }
        }
        if dropped > 0 {
            tracing::warn!(shop = %self.shop, dropped, "keys never decided let go");
            self.deps.release(dropped);
            self.publish_in_flight();
        }
        if !decided.is_empty() {
            self.decided(decided);
        }
    }
}

impl Actor for WorkManager {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        ctx.set_mailbox_capacity(1024);
        self.status.touch();
        let every = (self.deps.reply_timeout / 2)
            .min(self.deps.shop_idle)
            .max(Duration::from_millis(100));
        ctx.run_interval(every, |wm, ctx| wm.sweep(ctx));
    }

    fn stopped(&mut self, _: &mut Self::Context) {
        if !self.passivated {
            self.deps
                .outcomes_cached
                .fetch_sub(self.recent.len(), Ordering::Relaxed);
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SubmitError {
    #[error("too many requests in flight")]
    Overloaded,
    /// This WorkManager has passivated: nothing of the call was taken in, and the engine
    /// sends it to the shop's new WorkManager.
    #[error("the shop's WorkManager passivated")]
    Passivated(Vec<(Request, bool)>),
    #[error(transparent)]
    Store(StoreError),
}

/// New requests of this shop, with whether each caller waits for the outcome, and the
/// call's reply handle: the answer goes there, not back as the message's result.
#[derive(Message)]
#[rtype(result = "()")]
pub struct Submit {
    pub reqs: Vec<(Request, bool)>,
    pub call: Arc<Call>,
}

impl Handler<Submit> for WorkManager {
    type Result = ();
    fn handle(&mut self, msg: Submit, ctx: &mut Self::Context) {
        self.submit(msg.reqs, msg.call, ctx)
    }
}

/// Outcomes that became durable.
#[derive(Message)]
#[rtype(result = "()")]
pub struct Decided(pub Vec<Arc<Outcome>>);

impl Handler<Decided> for WorkManager {
    type Result = ();
    fn handle(&mut self, msg: Decided, _: &mut Self::Context) {
        self.decided(msg.0)
    }
}

/// Requests the request log held durably across a restart, still undecided.
#[derive(Message)]
#[rtype(result = "()")]
pub struct Resume(pub Vec<Request>);

impl Handler<Resume> for WorkManager {
    type Result = ();
    fn handle(&mut self, msg: Resume, _: &mut Self::Context) {
        // A request can be both decided and still in the log when the journal and the
        // log are written separately and the process died in between: its outcome
        // stands, and it must not be applied again.
        let keys: Vec<String> = msg.0.iter().map(|r| r.key.to_string()).collect();
        let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        if let Err(e) = self.look_up(&refs, false) {
            // Without the journal's answer nothing can be resumed safely; the requests
            // stay in the log for the next start.
            tracing::error!(shop = %self.shop, error = %e, "cannot resume requests");
            return;
        }
        let (decided, pending): (Vec<Request>, Vec<Request>) = msg
            .0
            .into_iter()
            .partition(|r| self.recent.contains_key(&r.key));
        if !decided.is_empty() {
            self.deps
                .log
                .retire(&self.shop, decided.into_iter().map(|r| r.key).collect());
        }
        // Already admitted before the restart: not refused by the bounds, but counted in
        // flight so that the bounds see them.
        let mut n = 0;
        for req in &pending {
            if self.in_flight.contains_key(&req.key) {
                continue;
            }
            n += 1;
            self.in_flight.insert(
                req.key.clone(),
                InFlight {
                    logged: true,
                    waiters: Vec::new(),
                    since: Instant::now(),
                },
            );
        }
        self.deps.inflight_total.fetch_add(n, Ordering::AcqRel);
        self.publish_in_flight();
        self.deps.log.redeliver(pending);
    }
}

/// What polling a key finds.
#[derive(Debug)]
pub enum PollResult {
    Decided(Arc<Outcome>),
    Pending,
    Unknown,
}

#[derive(Message)]
#[rtype(result = "Result<PollResult, StoreError>")]
pub struct Poll(pub Arc<str>);

impl Handler<Poll> for WorkManager {
    type Result = Result<PollResult, StoreError>;
    fn handle(&mut self, msg: Poll, _: &mut Self::Context) -> Self::Result {
        self.status.touch();
        if let Some(flight) = self.in_flight.get(&msg.0) {
            if !(self.deps.shared_log && flight.since.elapsed() > self.deps.reply_timeout) {
                return Ok(PollResult::Pending);
            }
            // Long in flight with a shared log: its reply may have been lost with the
            // node that decided it.
            let found = self.deps.journal.decided(&self.shop, &[&msg.0])?;
            return Ok(match found.into_iter().next().flatten() {
                Some(o) => {
                    let o = Arc::new(o);
                    self.decided(vec![o.clone()]);
                    PollResult::Decided(o)
                }
                None => PollResult::Pending,
            });
        }
        if !self.recent.contains_key(&msg.0) {
            self.look_up(&[&msg.0], self.deps.shared_log)?;
        }
        Ok(match self.recent.get(&msg.0) {
            Some(o) => PollResult::Decided(o.clone()),
            None => PollResult::Unknown,
        })
    }
}

/// The engine asks an idle WorkManager to passivate, to make room for another shop.
/// It does so (leaving the registry before it answers) only if nothing is in flight:
/// a request it took in since the engine looked makes it busy, and it stays.
#[derive(Message)]
#[rtype(result = "bool")]
pub struct Passivate;

impl Handler<Passivate> for WorkManager {
    type Result = bool;
    fn handle(&mut self, _: Passivate, ctx: &mut Self::Context) -> bool {
        if self.in_flight.is_empty() {
            self.passivate(ctx);
        }
        self.passivated
    }
}
