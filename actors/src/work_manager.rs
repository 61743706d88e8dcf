//! The WorkManager: one actor per shop. Every request of a shop passes through it, which
//! makes it the place where the at-most-once rule is kept: a key is either new (sent to
//! the request log once), in flight (the caller waits on the same decision), or decided
//! (the recorded outcome is returned, and nothing is applied).

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicI64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use actix::prelude::*;
use dashmap::DashMap;

use crate::metrics::Metrics;
use crate::ports::{Outcomes, RequestLog, StoreError};
use crate::recent::RecentOutcomes;
pub use crate::reply::SubmitError;
use crate::reply::{Call, Deadlines, Reply};
use crate::topology::Topology;
use crate::types::{now_ms, KeyHash, Millis, Outcome, Request};

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
/// Looked up for every request and every batch of outcomes: hashed as other per-request
/// maps are ([`KeyHash`]).
pub type Registry = Arc<DashMap<Arc<str>, ShopHandle, KeyHash>>;

/// What every WorkManager shares: its bounds and the ports.
pub struct Deps {
    /// The journal's recorded outcomes: repeats and polls of keys not in memory.
    pub outcomes: Arc<dyn Outcomes>,
    pub log: Arc<dyn RequestLog>,
    pub metrics: Arc<Metrics>,
    /// Where requests come from, chosen when the engine was built. With a log several
    /// nodes share, an outcome may be decided on another node and its reply lost with
    /// that node, so keys long in flight are looked up in the journal (see
    /// [`WorkManager::sweep`]), and polls read the journal itself, not its filter.
    pub topology: Topology,
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
            // Paired with `reserve`: every answer gives back room an admission took.
            assert!(prev >= n, "{n} requests answered with {prev} admitted");
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
    /// When this WorkManager took the call: the `total` stage runs from then until the
    /// reply is set. The caller's own, not the key's `since`: a repeat that joins a key in
    /// flight has waited only since it came.
    taken: Instant,
}

struct InFlight {
    /// The request log holds the request durably (it was sent fire-and-forget).
    logged: bool,
    waiters: Vec<Waiter>,
    since: Instant,
}

/// Where a request of a call goes ([`WorkManager::place_keys`]).
enum Place {
    /// Decided recently: answered with that outcome.
    Known(Arc<Outcome>),
    /// Its key is in flight, or new and first met earlier in the same call.
    Waits,
    /// Its key is new: claimed by this call.
    New,
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
    /// Bounded by `shop_pending_max` (checked on admission). Keyed by request key:
    /// looked up, inserted and removed for every request, so hashed with a randomly
    /// keyed hash faster than std's on short keys ([`KeyHash`]).
    in_flight: HashMap<Arc<str>, InFlight, KeyHash>,
    /// Recent outcomes, within `outcome_cache_max` ([`RecentOutcomes`]). Older ones are
    /// read back from the journal.
    recent: RecentOutcomes,
    /// Calls with a request still undecided, answered `pending` at their deadline.
    deadlines: Deadlines,
    /// A wake-up is set for the first deadline in `deadlines`.
    deadline_armed: bool,
    /// A sweep's lookup of keys long in flight is under way: one at a time, so a slow
    /// store does not pile them up.
    stale_lookup: bool,
    /// Requests were handed to the request log to be held ([`RequestLog::append_held`]);
    /// `Some(true)` once their release is queued behind the calls already in the mailbox.
    held: Option<bool>,
}

/// A call's new requests, kept as one list that is handed to the request log whole (a
/// request is a few hundred bytes, and a call can carry thousands), with each one's place
/// in the call and whether its caller waits.
struct Fresh {
    reqs: Vec<Request>,
    at: Vec<(usize, bool)>,
}

impl Fresh {
    /// The new requests of a call (those `places` says are new, whose places are `at`):
    /// when every request is new (the usual), the call's list as it came.
    fn of_call(reqs: Vec<Request>, places: &[Place], at: Vec<(usize, bool)>) -> Fresh {
        let reqs = if at.len() == reqs.len() {
            reqs
        } else {
            reqs.into_iter()
                .zip(places)
                .filter(|(_, p)| matches!(p, Place::New))
                .map(|(r, _)| r)
                .collect()
        };
        Fresh { reqs, at }
    }

    fn with_capacity(n: usize) -> Fresh {
        Fresh {
            reqs: Vec::with_capacity(n),
            at: Vec::with_capacity(n),
        }
    }
}

impl WorkManager {
    pub fn new(shop: Arc<str>, deps: Arc<Deps>, status: Arc<ShopStatus>) -> WorkManager {
        WorkManager {
            shop,
            deps,
            status,
            passivated: false,
            in_flight: HashMap::default(),
            recent: RecentOutcomes::default(),
            deadlines: Deadlines::default(),
            deadline_armed: false,
            stale_lookup: false,
            held: None,
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
        // A line told to wait asks again under its key: nothing was decided.
        if self.deps.outcome_cache_max == 0
            || self.passivated
            || outcome.status == crate::types::Status::Tentative
        {
            return;
        }
        // Within this shop's share and the total; a shop with no other to give lets
        // its own go (the journal has them).
        self.recent.keep(
            outcome,
            self.deps.outcome_cache_max,
            self.deps.outcome_cache_total_max,
            &self.deps.outcomes_cached,
        );
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
        self.recent.clear(&self.deps.outcomes_cached);
        ctx.run_later(PASSIVATED_STOP_DELAY, |wm, ctx| {
            if wm.in_flight.is_empty() {
                ctx.stop();
            }
        });
    }

    /// Runs a read of recorded outcomes off this actor's thread (on the runtime's blocking pool: a
    /// store call may take a network round trip, and every actor of the arbiter would
    /// wait behind it) and hands its result to `then`, back on this actor's thread.
    fn read_then<T: Send + 'static>(
        &self,
        ctx: &mut Context<Self>,
        read: impl FnOnce(&dyn Outcomes) -> Result<T, StoreError> + Send + 'static,
        then: impl FnOnce(&mut WorkManager, Result<T, StoreError>, &mut Context<Self>) + 'static,
    ) {
        let outcomes = self.deps.outcomes.clone();
        let read = async move {
            tokio::task::spawn_blocking(move || read(&*outcomes))
                .await
                .unwrap_or(Err(StoreError::Closed))
        };
        ctx.spawn(
            read.into_actor(self)
                .map(move |r, wm, ctx| then(wm, r, ctx)),
        );
    }

    fn submit(
        &mut self,
        reqs: Vec<Request>,
        respond: Vec<bool>,
        call: Arc<Call>,
        ctx: &mut Context<Self>,
    ) {
        if self.passivated {
            return call.fail(SubmitError::Passivated(reqs, respond));
        }
        self.status.touch();
        let taken = Instant::now();
        match self.admit(reqs, &respond, &call, taken, ctx) {
            Ok(()) => {
                self.deadlines.push(call);
                self.arm_deadline(ctx);
            }
            Err(e) => call.fail(e),
        }
        self.publish_in_flight();
    }

    /// Takes a call's requests in, all of them or (overload) none. Each new key is
    /// claimed at once, before anything else can happen to it: a repeat that arrives
    /// from now on waits for the same decision. Keys the journal may already hold are
    /// read off this thread first ([`WorkManager::screened`]); the others are handed on
    /// to the request log now ([`WorkManager::hand_on`]).
    fn admit(
        &mut self,
        reqs: Vec<Request>,
        respond: &[bool],
        call: &Arc<Call>,
        taken: Instant,
        ctx: &mut Context<Self>,
    ) -> Result<(), SubmitError> {
        let places = self.place_keys(&reqs);
        let unknown: Vec<Arc<str>> = reqs
            .iter()
            .zip(&places)
            .filter(|(_, p)| matches!(p, Place::New))
            .map(|(r, _)| r.key.clone())
            .collect();
        // Admission: reserve room for every new key or refuse the whole call.
        let n_new = unknown.len();
        if self.in_flight.len() + n_new > self.deps.shop_pending_max || !self.deps.reserve(n_new) {
            return Err(SubmitError::Overloaded);
        }
        let screen = !unknown.is_empty() && {
            let refs: Vec<&str> = unknown.iter().map(|k| &**k).collect();
            !self.deps.outcomes.surely_new(&self.shop, &refs)
        };
        let mut known = Vec::new();
        let mut at = Vec::with_capacity(n_new);
        for (index, ((req, &respond), place)) in reqs.iter().zip(respond).zip(&places).enumerate() {
            let waiter = Waiter {
                call: call.clone(),
                index,
                taken,
            };
            match place {
                Place::Known(outcome) => known.push((index, Reply::Repeat(outcome.clone()))),
                // A repeat of a key in flight waits for the same decision. That is also
                // how a fire-and-forget repeat gets its 202: this call cannot know
                // whether the first submission is durable yet, but a journaled outcome
                // is.
                Place::Waits => {
                    // Placed as waiting only when in flight, or claimed earlier in this
                    // loop; nothing leaves `in_flight` meanwhile.
                    let flight = self.in_flight.get_mut(&req.key);
                    debug_assert!(
                        flight.is_some(),
                        "key {} placed waiting, not in flight",
                        req.key
                    );
                    if let Some(flight) = flight {
                        flight.waiters.push(waiter);
                    }
                }
                Place::New => {
                    let flight = InFlight {
                        logged: false,
                        waiters: if respond { vec![waiter] } else { Vec::new() },
                        since: taken,
                    };
                    self.in_flight.insert(req.key.clone(), flight);
                    at.push((index, respond));
                }
            }
        }
        let new = Fresh::of_call(reqs, &places, at);
        if !screen {
            return self.hand_on(call, known, new);
        }
        self.screen(call.clone(), known, new, unknown, ctx);
        Ok(())
    }

    /// Reads what the journal holds of a call's `unknown` keys off this thread, then goes
    /// on with the call ([`WorkManager::screened`]).
    fn screen(
        &mut self,
        call: Arc<Call>,
        known: Vec<(usize, Reply)>,
        new: Fresh,
        unknown: Vec<Arc<str>>,
        ctx: &mut Context<Self>,
    ) {
        let shop = self.shop.clone();
        self.read_then(
            ctx,
            move |journal| {
                let refs: Vec<&str> = unknown.iter().map(|k| &**k).collect();
                let found = journal.outcomes(&shop, &refs)?;
                Ok(found.into_iter().flatten().collect::<Vec<_>>())
            },
            move |wm, found, ctx| {
                wm.screened(call, known, new, found);
                wm.publish_in_flight();
                wm.release_held_later(ctx);
            },
        );
    }

    /// Where each of a call's requests goes: answered from a recent outcome, waiting for
    /// a decision in flight (or for an earlier request of the same call), or new. One
    /// look at the recent outcomes and one at the keys in flight per request; a call of
    /// one request (the API's usual) needs no set of the keys it has seen.
    fn place_keys(&self, reqs: &[Request]) -> Vec<Place> {
        let mut seen: HashSet<&Arc<str>, KeyHash> = HashSet::default();
        reqs.iter()
            .map(|r| {
                if let Some(outcome) = self.recent.get(&r.key) {
                    Place::Known(outcome.clone())
                } else if self.in_flight.contains_key(&r.key)
                    || (reqs.len() > 1 && !seen.insert(&r.key))
                {
                    Place::Waits
                } else {
                    Place::New
                }
            })
            .collect()
    }

    /// A call's new keys as the journal has them: those it holds are answered with that
    /// outcome (they were decided before, and are not applied again), the rest go on.
    fn screened(
        &mut self,
        call: Arc<Call>,
        mut known: Vec<(usize, Reply)>,
        new: Fresh,
        found: Result<Vec<Outcome>, StoreError>,
    ) {
        let found = match found {
            Ok(found) => found,
            Err(e) => {
                // Nothing of the call was handed on: its claims go. A repeat that came
                // meanwhile is answered `pending` at its deadline, and may be sent again.
                let keys: Vec<Arc<str>> = new.reqs.iter().map(|r| r.key.clone()).collect();
                self.unclaim(&call, &keys);
                return call.fail(SubmitError::Store(e));
            }
        };
        let found: HashMap<Arc<str>, Arc<Outcome>> = found
            .into_iter()
            .map(|o| (o.request_key.clone(), Arc::new(o)))
            .collect();
        let mut rest = Fresh::with_capacity(new.reqs.len());
        let mut decided = Vec::new();
        for (req, (index, respond)) in new.reqs.into_iter().zip(new.at) {
            match found.get(&req.key) {
                Some(o) => {
                    if !respond {
                        known.push((index, Reply::Repeat(o.clone())));
                    }
                    decided.push(o.clone());
                }
                None => {
                    rest.reqs.push(req);
                    rest.at.push((index, respond));
                }
            }
        }
        if !decided.is_empty() {
            // Answers the claims' waiters (this call's among them) and lets them go.
            self.decided(decided, None);
        }
        if let Err(e) = self.hand_on(&call, known, rest) {
            call.fail(e);
        }
    }

    /// Hands a call's new requests to the request log, sets the replies known now, and
    /// seals the call; the others are set by [`WorkManager::decided`].
    fn hand_on(
        &mut self,
        call: &Arc<Call>,
        known: Vec<(usize, Reply)>,
        new: Fresh,
    ) -> Result<(), SubmitError> {
        let mut known = known;
        let Fresh {
            reqs: mut to_log,
            at,
        } = new;
        let mut keys = Vec::with_capacity(to_log.len());
        for (req, &(index, respond)) in to_log.iter_mut().zip(&at) {
            req.logged = !respond;
            if !respond {
                // Every new flight starts not `logged`: only fire-and-forget marks it.
                if let Some(flight) = self.in_flight.get_mut(&req.key) {
                    flight.logged = true;
                }
                known.push((index, Reply::Accepted));
            }
            keys.push(req.key.clone());
        }
        if !to_log.is_empty() {
            let ack = to_log.iter().any(|r| r.logged).then(|| call.log_ack());
            let handed = self.deps.log.append_held(to_log, ack);
            if let Ok(true) = handed {
                self.held.get_or_insert(false);
            }
            if let Err(e) = handed {
                // Nothing was handed on: undo the admission entirely. (The ack, dropped
                // untold, told the call the log closed; it is answered with `e`.)
                self.unclaim(call, &keys);
                return Err(match e {
                    StoreError::Full => SubmitError::Overloaded,
                    other => SubmitError::Store(other),
                });
            }
        }
        for (index, reply) in known {
            call.set(index, reply);
        }
        call.seal();
        Ok(())
    }

    /// Queues the release of what this burst's calls left held in the request log behind
    /// the calls already in the mailbox: they go on together once those are taken in.
    fn release_held_later(&mut self, ctx: &mut Context<Self>) {
        if self.held == Some(false) {
            self.held = Some(true);
            ctx.notify(ReleaseHeld);
        }
    }

    /// Lets go of the keys a call claimed and of its waiters on other keys.
    fn unclaim(&mut self, call: &Arc<Call>, claimed: &[Arc<str>]) {
        let mut n = 0;
        for key in claimed {
            if self.in_flight.remove(key).is_some() {
                n += 1;
            }
        }
        for flight in self.in_flight.values_mut() {
            flight.waiters.retain(|w| !Arc::ptr_eq(&w.call, call));
        }
        self.deps.release(n);
    }

    /// Answers the waiters of `outcomes` and lets their keys go. `sent`: when a processor
    /// (or the responses reader) sent them, for the `reply` stage; `None` when they were
    /// read from the journal here.
    fn decided(&mut self, outcomes: Vec<Arc<Outcome>>, sent: Option<Instant>) {
        // Outcomes come to the WorkManager of their shop, which holds their callers.
        debug_assert!(
            outcomes.iter().all(|o| o.shop == self.shop),
            "an outcome of another shop reached {}",
            self.shop
        );
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
        for (waiters, outcome) in &answers {
            for w in waiters {
                w.call.set(w.index, Reply::Decided(outcome.clone()));
            }
        }
        // One clock read for the lot: their replies were set together, just now. A call
        // past its deadline was answered `pending` then, not with this outcome.
        let mut waiters = answers.iter().flat_map(|(w, _)| w).peekable();
        if waiters.peek().is_none() {
            return;
        }
        let now = Instant::now();
        let stage = &self.deps.metrics.stage;
        let reply = sent.map(|sent| now.saturating_duration_since(sent).as_secs_f64());
        // Counted here and added to the shared histograms once for the lot.
        let (total_seen, reply_seen) = (stage.total.local(), stage.reply.local());
        for w in waiters.filter(|w| w.call.deadline > now) {
            total_seen.observe(now.saturating_duration_since(w.taken).as_secs_f64());
            if let Some(reply) = reply {
                reply_seen.observe(reply);
            }
        }
        total_seen.flush();
        reply_seen.flush();
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
        // Once per sweep: the tables a burst grew give their room back as they drain
        // (up to `shop_pending_max` entries while full; see `crate::shrink`).
        crate::shrink::map(&mut self.in_flight);
        self.deadlines.shrink();
        let idle_ms = now_ms() - self.status.last_active_ms.load(Ordering::Relaxed);
        if self.in_flight.is_empty() && idle_ms >= self.deps.shop_idle.as_millis() as i64 {
            self.passivate(ctx);
            return;
        }
        if !self.deps.topology.is_shared() || self.stale_lookup {
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
        self.stale_lookup = true;
        let shop = self.shop.clone();
        self.read_then(
            ctx,
            move |journal| {
                let refs: Vec<&str> = stale.iter().map(|k| &**k).collect();
                Ok((journal.decided(&shop, &refs)?, stale))
            },
            |wm, found, _| {
                wm.stale_lookup = false;
                match found {
                    Ok((found, stale)) => wm.settle_stale(stale, found),
                    Err(e) => {
                        tracing::warn!(shop = %wm.shop, error = %e, "stale keys not looked up")
                    }
                }
            },
        );
    }

    /// Keys long in flight as the journal has them (see [`WorkManager::sweep`]).
    fn settle_stale(&mut self, stale: Vec<Arc<str>>, found: Vec<Option<Outcome>>) {
        let now = Instant::now();
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
            self.decided(decided, None);
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
        // A release still queued when the actor stopped: what it would release goes on.
        if self.held.take().is_some() {
            self.deps.log.release_held();
        }
        if !self.passivated {
            self.recent.clear(&self.deps.outcomes_cached);
        }
    }
}

/// New requests of this shop, with whether each caller waits for the outcome, and the
/// call's reply handle: the answer goes there, not back as the message's result.
#[derive(Message)]
#[rtype(result = "()")]
pub struct Submit {
    /// The call's requests, in order: kept as one list from the caller to the request
    /// log (a request is a few hundred bytes, and a call can carry thousands).
    pub reqs: Vec<Request>,
    /// For each request, whether its caller waits for the outcome.
    pub respond: Vec<bool>,
    pub call: Arc<Call>,
}

impl Handler<Submit> for WorkManager {
    type Result = ();
    fn handle(&mut self, msg: Submit, ctx: &mut Self::Context) {
        self.submit(msg.reqs, msg.respond, msg.call, ctx);
        self.release_held_later(ctx);
    }
}

/// Hands on what this WorkManager's calls left held in the request log
/// ([`RequestLog::append_held`]).
#[derive(Message)]
#[rtype(result = "()")]
struct ReleaseHeld;

impl Handler<ReleaseHeld> for WorkManager {
    type Result = ();
    fn handle(&mut self, _: ReleaseHeld, _: &mut Self::Context) {
        self.held = None;
        self.deps.log.release_held();
    }
}

/// Outcomes that became durable, and when they were sent to this WorkManager: the
/// `reply` stage runs from then until their callers' replies are set.
#[derive(Message)]
#[rtype(result = "()")]
pub struct Decided {
    pub outcomes: Vec<Arc<Outcome>>,
    pub sent: Instant,
}

impl Decided {
    /// Outcomes sent now.
    pub fn new(outcomes: Vec<Arc<Outcome>>) -> Decided {
        Decided {
            outcomes,
            sent: Instant::now(),
        }
    }
}

impl Handler<Decided> for WorkManager {
    type Result = ();
    fn handle(&mut self, msg: Decided, _: &mut Self::Context) {
        self.decided(msg.outcomes, Some(msg.sent))
    }
}

/// Requests the request log held durably across a restart, still undecided.
#[derive(Message)]
#[rtype(result = "()")]
pub struct Resume(pub Vec<Request>);

impl Handler<Resume> for WorkManager {
    type Result = ();
    fn handle(&mut self, msg: Resume, ctx: &mut Self::Context) {
        // Already admitted before the restart: not refused by the bounds, but claimed
        // and counted in flight so that the bounds see them.
        let mut claimed = Vec::with_capacity(msg.0.len());
        for req in msg.0 {
            if self.in_flight.contains_key(&req.key) {
                continue;
            }
            self.in_flight.insert(
                req.key.clone(),
                InFlight {
                    logged: true,
                    waiters: Vec::new(),
                    since: Instant::now(),
                },
            );
            claimed.push(req);
        }
        self.deps
            .inflight_total
            .fetch_add(claimed.len(), Ordering::AcqRel);
        self.publish_in_flight();
        // A request can be both decided and still in the log when the journal and the
        // log are written separately and the process died in between: its outcome
        // stands, and it must not be applied again.
        let (shop, keys) = (
            self.shop.clone(),
            claimed.iter().map(|r| r.key.clone()).collect::<Vec<_>>(),
        );
        self.read_then(
            ctx,
            move |journal| {
                let refs: Vec<&str> = keys.iter().map(|k| &**k).collect();
                journal.outcomes(&shop, &refs)
            },
            move |wm, found, _| {
                let found = match found {
                    Ok(found) => found,
                    Err(e) => {
                        // Without the journal's answer nothing can be resumed safely;
                        // the requests stay in the log for the next start.
                        tracing::error!(shop = %wm.shop, error = %e, "cannot resume requests");
                        let mut n = 0;
                        for req in &claimed {
                            n += usize::from(wm.in_flight.remove(&req.key).is_some());
                        }
                        wm.deps.release(n);
                        wm.publish_in_flight();
                        return;
                    }
                };
                let mut decided = Vec::new();
                let mut pending = Vec::new();
                for (req, outcome) in claimed.into_iter().zip(found) {
                    match outcome {
                        Some(o) => decided.push(Arc::new(o)),
                        None => pending.push(req),
                    }
                }
                // Lets the decided ones go, retired from the log (they are `logged`).
                if !decided.is_empty() {
                    wm.decided(decided, None);
                }
                wm.deps.log.redeliver(pending);
            },
        );
    }
}

/// What polling a key finds.
#[derive(Debug)]
pub enum PollResult {
    Decided(Arc<Outcome>),
    Pending,
    Unknown,
}

/// What is known of each key, in their order: one message for several keys (an
/// order's lines), and at most one read of the journal for those memory cannot answer.
#[derive(Message)]
#[rtype(result = "Result<Vec<PollResult>, StoreError>")]
pub struct Poll(pub Vec<Arc<str>>);

impl WorkManager {
    /// What memory knows of `key`: in flight, decided lately, or surely never decided;
    /// `None` when the journal must be read.
    fn known(&self, key: &Arc<str>, exact: bool) -> Option<PollResult> {
        if let Some(flight) = self.in_flight.get(key) {
            // Long in flight with a shared log: its reply may have been lost with the
            // node that decided it, so the journal is asked.
            return (!(exact && flight.since.elapsed() > self.deps.reply_timeout))
                .then_some(PollResult::Pending);
        }
        if let Some(o) = self.recent.get(key) {
            return Some(PollResult::Decided(o.clone()));
        }
        // Never decided, known from memory: no read (an order's endings ask for each
        // line's second key, which most lines never have).
        (!exact && self.deps.outcomes.surely_new(&self.shop, &[&**key]))
            .then_some(PollResult::Unknown)
    }
}

impl Handler<Poll> for WorkManager {
    type Result = ResponseActFuture<Self, Result<Vec<PollResult>, StoreError>>;
    fn handle(&mut self, msg: Poll, _: &mut Self::Context) -> Self::Result {
        self.status.touch();
        let exact = self.deps.topology.is_shared();
        let mut results: Vec<Option<PollResult>> = Vec::with_capacity(msg.0.len());
        // Each key read from the journal, with whether it was in flight when asked.
        let mut asked: Vec<(usize, Arc<str>, bool)> = Vec::new();
        for (i, key) in msg.0.into_iter().enumerate() {
            let known = self.known(&key, exact);
            if known.is_none() {
                let flying = self.in_flight.contains_key(&key);
                asked.push((i, key, flying));
            }
            results.push(known);
        }
        if asked.is_empty() {
            return Box::pin(fut::ready(Ok(results.into_iter().flatten().collect())));
        }
        // Read off this thread: a store call may take a network round trip.
        let (journal, shop) = (self.deps.outcomes.clone(), self.shop.clone());
        let keys: Vec<Arc<str>> = asked.iter().map(|(_, k, _)| k.clone()).collect();
        let read = async move {
            tokio::task::spawn_blocking(move || {
                let refs: Vec<&str> = keys.iter().map(|k| &**k).collect();
                if exact {
                    journal.decided(&shop, &refs)
                } else {
                    journal.outcomes(&shop, &refs)
                }
            })
            .await
            .unwrap_or(Err(StoreError::Closed))
        };
        Box::pin(read.into_actor(self).map(move |found, wm, _| {
            let found = found?;
            debug_assert_eq!(found.len(), asked.len(), "one outcome or none per key");
            for ((i, key, flying), o) in asked.into_iter().zip(found) {
                results[i] = Some(match o.map(Arc::new) {
                    Some(o) => {
                        if wm.in_flight.contains_key(&key) {
                            wm.decided(vec![o.clone()], None);
                        } else {
                            wm.remember(o.clone());
                        }
                        PollResult::Decided(o)
                    }
                    None => match wm.recent.get(&key) {
                        // Decided while the journal was read, after the read looked.
                        Some(o) => PollResult::Decided(o.clone()),
                        // In flight when asked, so accepted: never answered unknown (its
                        // outcome may have come and gone while the journal was read).
                        None if flying || wm.in_flight.contains_key(&key) => PollResult::Pending,
                        None => PollResult::Unknown,
                    },
                });
            }
            Ok(results.into_iter().flatten().collect())
        }))
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
