//! Journal reads a batch needs before it can be decided, made off the actor's thread.
//!
//! Some requests cannot be decided from memory: an item that left memory
//! ([`Items::evict`]), an item whose partition came back from another node, a key a
//! shared log may have delivered before (with the partition's keys learned first), or a
//! confirm or cancel of a hold that is no longer pending here. A read of the journal can
//! wait for a disk, the views or a database server (with retries and sleeps when it
//! fails), and every other actor on this arbiter would wait with it. So the drain
//! *plans* what the batch needs ([`Processor::plan_reads`]), the reads run on the
//! runtime's blocking pool ([`Reads::run`]), and their answers come back as a message
//! ([`Fetched`]) that puts them into memory ([`Processor::absorb`]).
//!
//! The batch waits meanwhile (nothing after it is drained, so items stay in order),
//! while the actor goes on taking messages: durable notices, item reads, new work. A
//! durable notice can change what the batch needs (a key leaves the unjournaled set, a
//! fenced item leaves memory), and nothing leaves memory by eviction while reads are
//! out. So the plan is made again when the answers are in, and the batch is applied in
//! the same handler as the plan that needed nothing: what it is decided against is what
//! was planned. Each new round is caused by a batch retired meanwhile, and none is sent
//! while the batch waits, so there are at most [`BATCHES_IN_FLIGHT_MAX`] + 1 rounds.

use std::time::Instant;

use crate::returns::SaleRecord;
use crate::types::HoldStatus;

use super::*;

/// An item by shop and item, or a key by shop and request key.
type ShopKey = (Arc<str>, Arc<str>);

/// What a batch still needs from the journal.
#[derive(Default)]
pub(super) struct Reads {
    /// Partitions whose keys the journal learns first, from an offset (under an epoch).
    learn: Vec<(i32, u64, i64)>,
    /// Items read back under a new epoch of their partition, with their pending holds.
    reload: Vec<(ShopKey, u64)>,
    /// Items that left memory.
    fault: Vec<ShopKey>,
    /// Keys whose outcome the journal may hold, by shop.
    keys: HashMap<Arc<str>, Vec<Arc<str>>>,
    /// Holds to end that are not pending here, by shop: the journal may still have one
    /// pending (see [`Processor::absorb`]).
    holds: HashMap<Arc<str>, Vec<Arc<str>>>,
    /// Sales that returns name, by shop ([`crate::returns`]).
    sales: HashMap<Arc<str>, Vec<Arc<str>>>,
}

impl Reads {
    fn is_empty(&self) -> bool {
        self.learn.is_empty()
            && self.reload.is_empty()
            && self.fault.is_empty()
            && self.keys.is_empty()
            && self.holds.is_empty()
            && self.sales.is_empty()
    }

    /// Makes the reads, in the order they depend on each other (a partition's keys are
    /// learned before they are looked up). Runs on the blocking pool; a read that keeps
    /// failing stops the process ([`retry_read`]). `since`: when the batch began to wait
    /// for reads, carried back for the `screen` stage.
    fn run(self, journal: &dyn ShardJournal, shard: usize, since: Instant) -> Fetched {
        for (partition, _, offset) in &self.learn {
            retry_read(shard, || journal.learn_partition(*partition, *offset));
        }
        let (reloaded, holds) = if self.reload.is_empty() {
            (Vec::new(), Vec::new())
        } else {
            let items: Vec<ShopKey> = self.reload.iter().map(|(k, _)| k.clone()).collect();
            let states = retry_read(shard, || journal.item_states(&items));
            let holds = retry_read(shard, || journal.pending_holds(&items));
            (self.reload.into_iter().zip(states).collect(), holds)
        };
        // The per-buyer ledgers of the items read back, with them.
        let read_back: Vec<ShopKey> = reloaded
            .iter()
            .map(|((k, _), _)| k.clone())
            .chain(self.fault.iter().cloned())
            .collect();
        let ledgers = if read_back.is_empty() {
            Vec::new()
        } else {
            let found = retry_read(shard, || journal.ledgers(&read_back));
            read_back.into_iter().zip(found).collect()
        };
        let faulted = if self.fault.is_empty() {
            Vec::new()
        } else {
            let states = retry_read(shard, || journal.item_states(&self.fault));
            self.fault.into_iter().zip(states).collect()
        };
        Fetched {
            since,
            keys: by_shop(shard, self.keys, |shop, keys| journal.outcomes(shop, keys))
                .into_iter()
                .map(|(key, outcome)| (key, outcome.map(Arc::new)))
                .collect(),
            looked_up: by_shop(shard, self.holds, |shop, ids| journal.holds(shop, ids))
                .into_iter()
                .map(|(key, view)| (key, view.filter(|v| v.status == HoldStatus::Held)))
                .collect(),
            sales: by_shop(shard, self.sales, |shop, keys| journal.sales(shop, keys)),
            learned: self.learn.into_iter().map(|(p, e, _)| (p, e)).collect(),
            reloaded,
            holds,
            faulted,
            ledgers,
        }
    }
}

/// One read per shop of the keys asked for it, each answer paired with its key.
fn by_shop<T>(
    shard: usize,
    asked: HashMap<Arc<str>, Vec<Arc<str>>>,
    read: impl Fn(&str, &[&str]) -> Result<Vec<T>, StoreError>,
) -> Vec<(ShopKey, T)> {
    let mut found = Vec::new();
    for (shop, keys) in asked {
        let refs: Vec<&str> = keys.iter().map(|k| &**k).collect();
        let answers = retry_read(shard, || read(&shop, &refs));
        found.extend(
            keys.into_iter()
                .zip(answers)
                .map(|(key, answer)| ((shop.clone(), key), answer)),
        );
    }
    found
}

/// The journal's answers to [`Reads`], back on the actor's thread.
#[derive(Message)]
#[rtype(result = "()")]
pub(super) struct Fetched {
    /// When the batch began to wait for reads (its first round's, if it took several).
    since: Instant,
    learned: Vec<(i32, u64)>,
    reloaded: Vec<((ShopKey, u64), Option<ItemState>)>,
    holds: Vec<HoldView>,
    faulted: Vec<(ShopKey, Option<ItemState>)>,
    keys: Vec<(ShopKey, Option<Arc<Outcome>>)>,
    /// Holds by shop and id, with their journal record if it is still pending there.
    looked_up: Vec<(ShopKey, Option<HoldView>)>,
    /// The per-buyer ledgers of the items read back (`None`: no limit).
    ledgers: Vec<(ShopKey, Option<BuyerLedger>)>,
    /// The sales returns name, by shop and key, as durable (`None`: no such sale).
    sales: Vec<(ShopKey, Option<SaleRecord>)>,
}

/// What the journal answered for the batch waiting to be applied; emptied once it is.
#[derive(Default)]
pub(super) struct Prefetched {
    /// Outcomes of keys looked up (`None`: the journal has none).
    pub(super) keys: HashMap<ShopKey, Option<Arc<Outcome>>>,
    /// Items the journal does not know: not asked again in a later round.
    unknown: HashSet<ShopKey>,
    /// Holds (by shop and id) whose journal record was read: not asked again.
    holds: HashSet<ShopKey>,
    /// Sales read for the batch's returns, by shop and key (`None`: the journal has
    /// none). Exact while the batch waits: a sale read here had no return in flight
    /// (see [`Returns`]), and nothing is applied until the batch is.
    pub(super) sales: HashMap<ShopKey, Option<SaleRecord>>,
}

impl Handler<Fetched> for Processor {
    type Result = ();
    fn handle(&mut self, msg: Fetched, ctx: &mut Self::Context) {
        let since = msg.since;
        self.absorb(msg);
        let Some(works) = self.pipeline.take_reading() else {
            tracing::error!(
                shard = self.shard,
                "journal reads answered with no batch waiting"
            );
            return;
        };
        self.decide_or_read_since(works, Some(since), ctx);
        self.drain(ctx);
    }
}

/// What a batch's plan gathers before it becomes [`Reads`], each set once.
#[derive(Default)]
struct Plan {
    learn: HashMap<i32, (u64, i64)>,
    reload: HashMap<ShopKey, u64>,
    fault: HashSet<ShopKey>,
    keys: HashSet<ShopKey>,
    held: HashSet<ShopKey>,
    sales: HashSet<ShopKey>,
}

impl Plan {
    fn into_reads(self) -> Reads {
        let mut reads = Reads {
            learn: self
                .learn
                .into_iter()
                .map(|(p, (e, o))| (p, e, o))
                .collect(),
            reload: self.reload.into_iter().collect(),
            fault: self.fault.into_iter().collect(),
            ..Reads::default()
        };
        reads.reload.sort_unstable();
        reads.fault.sort_unstable();
        for (shop, key) in self.keys {
            reads.keys.entry(shop).or_default().push(key);
        }
        for (shop, hold_id) in self.held {
            reads.holds.entry(shop).or_default().push(hold_id);
        }
        for (shop, sale) in self.sales {
            reads.sales.entry(shop).or_default().push(sale);
        }
        reads
    }
}

impl Processor {
    /// Applies `works` as a batch and sends it to the journal if memory has all it needs;
    /// otherwise sends the reads it needs to the blocking pool and keeps `works` until
    /// they are answered ([`Fetched`]).
    pub(super) fn decide_or_read(&mut self, works: Vec<Work>, ctx: &mut Context<Self>) {
        self.decide_or_read_since(works, None, ctx);
    }

    /// [`Processor::decide_or_read`] for a batch that has waited for reads `since` then
    /// (`None`: not yet). Its wait is one `screen` observation, however many rounds it
    /// took, observed when it is applied.
    fn decide_or_read_since(
        &mut self,
        works: Vec<Work>,
        since: Option<Instant>,
        ctx: &mut Context<Self>,
    ) {
        let reads = self.plan_reads(&works);
        if reads.is_empty() {
            if let Some(since) = since {
                let waited = since.elapsed().as_secs_f64();
                self.ports.metrics.stage.screen.observe(waited);
            }
            self.run_batch(works, ctx);
            return;
        }
        self.pipeline.start_reading(works);
        let journal = self.ports.journal.clone();
        let shard = self.shard;
        let addr = ctx.address();
        let since = since.unwrap_or_else(Instant::now);
        tokio::task::spawn_blocking(move || addr.do_send(reads.run(&*journal, shard, since)));
    }

    /// What `works` need from the journal that memory and the earlier rounds' answers
    /// do not have.
    fn plan_reads(&self, works: &[Work]) -> Reads {
        let mut plan = Plan::default();
        for work in works {
            match work {
                Work::Txn(req) => self.plan_txn(req, &mut plan),
                Work::Load(chunk) => {
                    for load in &chunk.items {
                        self.want(&chunk.shop, &load.item, &mut plan);
                    }
                }
            }
        }
        plan.into_reads()
    }

    /// An item the batch needs that left memory (and is not known to be unknown).
    fn want(&self, shop: &Arc<str>, item: &Arc<str>, plan: &mut Plan) {
        let key = (shop.clone(), item.clone());
        if !self.items.complete()
            && !self.items.contains(shop, item)
            && !self.prefetched.unknown.contains(&key)
        {
            plan.fault.insert(key);
        }
    }

    /// What one request needs read: its sale (a return), its key and partition (a
    /// shared log), its item (moved or left memory), its hold (an ending).
    fn plan_txn(&self, req: &Request, plan: &mut Plan) {
        if let (Op::Increment, Some(sale)) = (req.op, &req.return_of) {
            let key = (req.shop.clone(), sale.clone());
            if !self.returns.in_flight(&key) && !self.prefetched.sales.contains_key(&key) {
                plan.sales.insert(key);
            }
        }
        if let Some(cluster) = &self.cluster {
            self.plan_key(cluster, req, plan);
        }
        let reloaded = self
            .cluster
            .as_ref()
            .is_some_and(ClusterScreen::journal_shared)
            && req.log_pos.is_some();
        if reloaded {
            // Read under another epoch: another node may have changed it.
            let current = self.items.get(&req.shop, &req.item).map(|s| s.epoch);
            let item = (req.shop.clone(), req.item.clone());
            if current != Some(req.epoch()) && !self.prefetched.unknown.contains(&item) {
                plan.reload.entry(item).or_insert(req.epoch());
            }
        }
        if req.op.ends_hold() {
            self.plan_ending(req, plan);
        } else if !reloaded {
            self.want(&req.shop, &req.item, plan);
        }
    }

    /// With a shared log: the request's partition learned by the journal (under a new
    /// epoch), and its key looked up unless it was applied here in a batch in flight.
    fn plan_key(&self, cluster: &ClusterScreen, req: &Request, plan: &mut Plan) {
        if let Some(pos) = req.log_pos {
            // The journal learns the keys of a partition seen under a new epoch, so its
            // lookups are exact for them.
            if cluster.learned(pos.partition) != Some(req.epoch()) {
                let f = plan
                    .learn
                    .entry(pos.partition)
                    .or_insert((req.epoch(), pos.offset));
                f.1 = f.1.min(pos.offset);
            }
        }
        let key = (req.shop.clone(), req.key.clone());
        if cluster.unjournaled(&key).is_none() && !self.prefetched.keys.contains_key(&key) {
            plan.keys.insert(key);
        }
    }

    /// A hold's ending: a hold no longer pending here is answered with how it ended,
    /// which the journal has (or it is unknown). A pending one whose item is read back
    /// may have ended on another node.
    fn plan_ending(&self, req: &Request, plan: &mut Plan) {
        let hold = (req.shop.clone(), req.hold_id.clone().unwrap_or_default());
        let pending = self.holds.get(&hold).is_some_and(|h| {
            !plan
                .reload
                .contains_key(&(req.shop.clone(), h.item.clone()))
        });
        let key = (req.shop.clone(), req.key.clone());
        let ended = self.holds.ended(&hold).is_some();
        if !pending && !ended && !self.prefetched.keys.contains_key(&key) {
            plan.keys.insert(key);
        }
        if !self.holds.contains(&hold) && !ended && !self.prefetched.holds.contains(&hold) {
            // Not pending here, yet the journal may have it pending: this node let it go
            // (see `Processor::tick`) or never armed it. Its record, and its item, are
            // read.
            self.want(&req.shop, &req.item, plan);
            plan.held.insert(hold);
        }
    }

    /// Puts the journal's answers into memory: partitions learned, items read back (and
    /// their holds, which replace any armed here), outcomes found.
    fn absorb(&mut self, fetched: Fetched) {
        let Fetched {
            learned,
            reloaded,
            holds,
            faulted,
            keys,
            looked_up,
            ledgers,
            sales,
            since: _,
        } = fetched;
        self.prefetched.sales.extend(sales);
        self.take_ledgers(&reloaded, &faulted, ledgers);
        if let Some(cluster) = &mut self.cluster {
            for (partition, epoch) in learned {
                cluster.learn(partition, epoch);
            }
        }
        if !reloaded.is_empty() {
            // The holds of these items as the journal has them replace any armed here:
            // the node that owned them meanwhile may have made, confirmed or expired some.
            let moved: HashSet<ShopKey> = reloaded.iter().map(|((k, _), _)| k.clone()).collect();
            self.holds.forget_moved(&moved);
            for h in holds {
                self.arm_hold(h, true);
            }
        }
        for (((shop, item), epoch), state) in reloaded {
            if !self.items.reload(shop.clone(), item.clone(), epoch, state) {
                // Unknown here and there: not read again this batch.
                self.prefetched.unknown.insert((shop, item));
            }
        }
        for ((shop, item), state) in faulted {
            match state {
                Some(state) => self.items.fault_in(&shop, &item, state),
                None => {
                    self.prefetched.unknown.insert((shop, item));
                }
            }
        }
        self.prefetched.keys.extend(keys);
        self.rearm_looked_up(looked_up);
    }

    /// An item's ledger is taken from the journal with its state: when the item was not
    /// in memory, or its state is taken as the journal has it (see [`Items::reload`]).
    /// This node's own batches in flight are ahead of both, and keep what they counted.
    fn take_ledgers(
        &mut self,
        reloaded: &[((ShopKey, u64), Option<ItemState>)],
        faulted: &[(ShopKey, Option<ItemState>)],
        ledgers: Vec<(ShopKey, Option<BuyerLedger>)>,
    ) {
        let taken: HashSet<ShopKey> = reloaded
            .iter()
            .filter(|((k, _), st)| {
                let live = self.items.get(&k.0, &k.1).map(|s| s.live.seq);
                match (live, st) {
                    (None, _) => true,
                    (Some(live), Some(st)) => st.seq >= live,
                    (Some(_), None) => false,
                }
            })
            .map(|((k, _), _)| k.clone())
            .chain(
                faulted
                    .iter()
                    .filter(|(k, _)| !self.items.contains(&k.0, &k.1))
                    .map(|(k, _)| k.clone()),
            )
            .collect();
        for (key, ledger) in ledgers {
            if taken.contains(&key) {
                self.items.take_ledger(key, ledger);
            }
        }
    }

    /// A hold the journal has pending that is not pending here is armed again, so that
    /// the request ending it ends it: it reached this shard through the log under its
    /// partition's current epoch (an older one is dropped), so this node owns its item.
    /// Without this, a hold this node let go after its expiry went unanswered for a
    /// while (the broker or the database was down) would be held for good once its
    /// expiry arrived, and a confirm of it refused as unknown.
    fn rearm_looked_up(&mut self, looked_up: Vec<(ShopKey, Option<HoldView>)>) {
        for (key, view) in looked_up {
            self.prefetched.holds.insert(key.clone());
            let Some(h) = view else { continue };
            if self.holds.contains(&key) || self.holds.ended(&key).is_some() {
                continue;
            }
            self.arm_hold(h, true);
        }
    }
}
