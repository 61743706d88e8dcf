//! Building the engine whole before any shard starts.
//!
//! Everything a processor calls is made first and handed to it when it is made: the
//! journal, the registry of WorkManagers, the topology (and with a shared log, its
//! hooks), the shops' check-backs, and the queue its order nudges go to. Nothing is
//! attached to a running shard afterwards, so no shard can act on a half-built node:
//! the fault campaign once saw a restarted node decide an overdue hold's expiry in the
//! moment between its shards' start and its shared log's hooks being attached.

use tokio::sync::mpsc;

use super::*;
use crate::ledger::BuyerLedger;
use crate::processor::{OrderHook, OrderNudge, ShardShared, NUDGES_QUEUED_MAX};
use crate::types::ItemState;

/// What one shard recovers at start: its items, pending holds and buyer ledgers.
type ShardRecovered = (
    Vec<(Arc<str>, Arc<str>, ItemState)>,
    Vec<HoldView>,
    Vec<(Arc<str>, Arc<str>, BuyerLedger)>,
);

/// The engine's parts, chosen before it starts ([`EngineBuilder::start`]).
pub struct EngineBuilder {
    cfg: EngineConfig,
    journal: Arc<dyn Journal>,
    metrics: Arc<Metrics>,
    topology: Topology,
    checkback: Option<Arc<dyn CheckBack>>,
}

impl EngineBuilder {
    /// This node's own log ([`Topology::Alone`]) and no check-back, unless set.
    pub fn new(cfg: EngineConfig, journal: Arc<dyn Journal>, metrics: Arc<Metrics>) -> Self {
        EngineBuilder {
            cfg,
            journal,
            metrics,
            topology: Topology::Alone,
            checkback: None,
        }
    }

    /// Where requests come from: a log several nodes share gives its hooks here, made
    /// before the log starts reading ([`Topology::shared`]).
    pub fn topology(mut self, topology: Topology) -> Self {
        self.topology = topology;
        self
    }

    /// The shops' check-backs: a hold found past its expiry at the start (one being
    /// checked, or waiting for an operator, when the node stopped) is asked about (or
    /// left to its dead letter), never expired as it would be without one.
    pub fn checkback(mut self, checkback: Arc<dyn CheckBack>) -> Self {
        self.checkback = Some(checkback);
        self
    }

    /// Recovers every item from the journal, starts the shards, builds the request log
    /// on top of them (`make_log`, given the dispatcher), then resumes the requests the
    /// log held undecided. Call inside an actix system.
    pub fn start<F>(self, make_log: F) -> Result<Arc<Engine>, StoreError>
    where
        F: FnOnce(Dispatcher, &Recovered) -> Arc<dyn RequestLog>,
    {
        let mut recovered = self.journal.recover()?;
        let owned: Vec<Arbiter> = (0..self.cfg.arbiters.max(1))
            .map(|_| Arbiter::try_with_tokio_rt(super::handoff::engine_runtime))
            .collect::<std::io::Result<_>>()
            .map_err(|e| StoreError::Storage(format!("an engine thread cannot start: {e}")))?;
        let arbiters: Vec<ArbiterHandle> = owned.iter().map(Arbiter::handle).collect();
        if self.cfg.pin_threads {
            match placement::pin_arbiters(&arbiters) {
                Some(cores) => tracing::info!(?cores, "engine threads kept one to a core"),
                None => tracing::info!(
                    "engine threads left to the scheduler: the cores allowed are not one per arbiter"
                ),
            }
        }
        let registry: Registry = Arc::new(DashMap::default());
        let (order_hook, nudges) = nudge_queue();
        let shards = self.start_shards(&mut recovered, &arbiters, &registry, order_hook);
        let dispatcher = Dispatcher {
            shards: Arc::new(shards),
            topology: self.topology.clone(),
            registry: registry.clone(),
        };
        let log = make_log(dispatcher.clone(), &recovered);
        let pending = log.pending()?;
        let cfg = self.cfg;
        let deps = Arc::new(Deps {
            outcomes: self.journal.clone(),
            log,
            metrics: self.metrics,
            topology: self.topology.clone(),
            request_ttl: Duration::from_millis(cfg.request_ttl_ms.max(0) as u64),
            inflight_total: AtomicUsize::new(0),
            inflight_max: cfg.inflight_max,
            shop_pending_max: cfg.shop_pending_max,
            outcome_cache_max: cfg.outcome_cache_per_shop,
            outcome_cache_total_max: cfg.outcome_cache_total,
            outcomes_cached: AtomicUsize::new(0),
            shop_idle: Duration::from_millis(cfg.shop_idle_ms),
            registry: registry.clone(),
            reply_timeout: Duration::from_millis(cfg.reply_timeout_ms),
        });
        let engine = Arc::new(Engine {
            cfg,
            deps,
            journal: self.journal,
            registry,
            arbiters,
            _arbiters: Mutex::new(owned),
            next_arbiter: AtomicUsize::new(0),
            shards: dispatcher,
            closing: AtomicBool::new(false),
            load_calls: AtomicUsize::new(0),
            node_tag: format!("{}", now_ms()),
            evicting: tokio::sync::Mutex::new(()),
            settling: Default::default(),
            checkback: self.checkback,
        });
        settle_nudges(&engine, nudges);
        resume(&engine, pending);
        Ok(engine)
    }

    /// Makes and starts one processor per shard, each with its share of what was
    /// recovered and every port it calls.
    fn start_shards(
        &self,
        recovered: &mut Recovered,
        arbiters: &[ArbiterHandle],
        registry: &Registry,
        order_hook: OrderHook,
    ) -> Vec<Addr<Processor>> {
        let cfg = &self.cfg;
        let shard_count = cfg.shards.max(1);
        split_recovered(recovered, shard_count)
            .into_iter()
            .enumerate()
            .map(|(i, (items, holds, ledgers))| {
                let p = Processor::new(
                    i,
                    cfg.batch_max,
                    cfg.request_ttl_ms,
                    items,
                    holds,
                    ledgers,
                    ShardShared {
                        journal: self.journal.clone(),
                        registry: registry.clone(),
                        metrics: self.metrics.clone(),
                        topology: self.topology.clone(),
                        holds_max: cfg.holds_max,
                        holds_per_shop_max: cfg.holds_per_shop_max,
                        items_max: cfg.items_max.div_ceil(shard_count),
                        order_hook: order_hook.clone(),
                        checkback: self.checkback.clone(),
                        return_window_ms: cfg.return_window_ms,
                        hold_expiry_copies: cfg.hold_expiry_copies,
                    },
                );
                Processor::start_in_arbiter(
                    &arbiters[arbiter_of_shard(i, arbiters.len())],
                    move |_| p,
                )
            })
            .collect()
    }
}

/// What was recovered, by the shard that owns each item.
fn split_recovered(recovered: &mut Recovered, shard_count: usize) -> Vec<ShardRecovered> {
    let mut initial: Vec<ShardRecovered> = (0..shard_count)
        .map(|_| (Vec::new(), Vec::new(), Vec::new()))
        .collect();
    for (shop, item, state) in std::mem::take(&mut recovered.items) {
        initial[shard_of(&shop, &item, shard_count)]
            .0
            .push((shop, item, state));
    }
    for hold in std::mem::take(&mut recovered.holds) {
        initial[shard_of(&hold.shop, &hold.item, shard_count)]
            .1
            .push(hold);
    }
    for (shop, item, ledger) in std::mem::take(&mut recovered.ledgers) {
        initial[shard_of(&shop, &item, shard_count)]
            .2
            .push((shop, item, ledger));
    }
    initial
}

/// The processors' order hook and the queue behind it, made before any shard starts: a
/// nudge sent while the engine is still being built waits in the queue for it, and one
/// the full queue refuses is tried again by its processor a moment later.
fn nudge_queue() -> (OrderHook, mpsc::Receiver<OrderNudge>) {
    let (tx, rx) = mpsc::channel(NUDGES_QUEUED_MAX);
    let hook: OrderHook = Arc::new(move |nudge| tx.try_send(nudge).is_ok());
    (hook, rx)
}

/// Hands the processors' nudges to the engine ([`Engine::on_nudge`]) for as long as it
/// lives; the task holds no strong reference, so it ends with the engine.
fn settle_nudges(engine: &Arc<Engine>, mut nudges: mpsc::Receiver<OrderNudge>) {
    let weak = Arc::downgrade(engine);
    actix::spawn(async move {
        while let Some(nudge) = nudges.recv().await {
            let Some(engine) = weak.upgrade() else { break };
            engine.on_nudge(nudge);
        }
    });
}

/// Sends the requests the log held undecided to their shops' WorkManagers.
fn resume(engine: &Arc<Engine>, pending: Vec<Request>) {
    let mut by_shop: HashMap<Arc<str>, Vec<Request>> = HashMap::new();
    for r in pending {
        by_shop.entry(r.shop.clone()).or_default().push(r);
    }
    if !by_shop.is_empty() {
        tracing::info!(shops = by_shop.len(), "resuming undecided requests");
    }
    for (shop, reqs) in by_shop {
        let first = reqs.first().map(|r| &*r.item);
        engine
            .work_manager_unbounded(&shop, first)
            .addr
            .do_send(Resume(reqs));
    }
}
