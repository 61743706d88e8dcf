//! Scheduling and batching: taking work from the pipeline, applying a batch in memory
//! and handing it to the journal, with at most [`super::BATCHES_IN_FLIGHT_MAX`] batches
//! outstanding. The decision for one request is in `decide`.

use super::*;

/// What applying a batch made so far: its entries and what is left to do once they are
/// durable.
#[derive(Default)]
struct BatchBuilder {
    entries: Vec<Entry>,
    touched: Vec<(Arc<str>, Arc<str>)>,
    loads: Vec<(pipeline::LoadReply, pipeline::LoadViews)>,
    repeats: Vec<Repeat>,
    keys: Vec<(Arc<str>, Arc<str>)>,
    ended: Vec<(Arc<str>, Arc<str>)>,
    returns: Vec<(SaleKey, Option<LogPos>)>,
    /// Outcomes to tell early, once the batch is handed to a journal that writes in
    /// order ([`crate::types::EarlySignal`]).
    early: Early,
}

/// A batch's outcomes to tell early, each with its request's sender.
type Early = Vec<(EarlySender, Arc<Outcome>)>;

impl Processor {
    pub(super) fn schedule(&mut self, ctx: &mut Context<Self>) {
        if self.pipeline.wants_drain() {
            // Through the mailbox, not a direct call: messages already waiting are taken
            // in first, so the batch is as large as the backlog allows.
            ctx.notify(Drain);
        }
    }

    pub(super) fn drain(&mut self, ctx: &mut Context<Self>) {
        self.pipeline.drain_started();
        while self.pipeline.can_send() {
            let Some(works) = self.pipeline.next_works(self.batch_max) else {
                break;
            };
            let works = match &mut self.cluster {
                Some(cluster) => {
                    if !self.pipeline.in_flight_empty() && cluster.epoch_moves(&works) {
                        self.pipeline.park(works);
                        break;
                    }
                    cluster.drop_stale(works)
                }
                None => works,
            };
            self.decide_or_read(works, ctx);
        }
        self.pipeline.publish_depth();
    }

    /// Applies `works` as one batch and hands it to the journal. Everything it is
    /// decided against is in memory or in [`Processor::prefetched`] (see
    /// [`Processor::decide_or_read`]).
    pub(super) fn run_batch(&mut self, works: Vec<Work>, ctx: &mut Context<Self>) {
        let (entries, in_flight, early) = self.apply_batch(works);
        self.arm_waiting_sweep(ctx);
        self.prefetched = Prefetched::default();
        self.evict();
        self.arm_wake(ctx);
        if entries.is_empty() {
            // Only repeats: answered with the batch before them, or now.
            match self.pipeline.last_mut() {
                Some(last) => last.repeats.extend(in_flight.repeats),
                None => {
                    let id = self.pipeline.send(in_flight);
                    self.journaled(id, Vec::new(), &[]);
                }
            }
            return;
        }
        self.ports
            .metrics
            .batch_entries
            .observe(entries.len() as f64);
        let id = self.pipeline.send(in_flight);
        self.append(id, entries, ctx);
        if !self.pipeline.holding_back() {
            // In the journal's queue, ahead of whatever their callers send next.
            for (tx, outcome) in early {
                let _ = tx.send(outcome);
            }
        }
    }

    /// Hands batch `id` to the journal. If its queue has no room, the batch is held back
    /// and sent again a moment later, before anything after it.
    pub(super) fn append(&mut self, id: u64, entries: Vec<Entry>, ctx: &mut Context<Self>) {
        let addr = ctx.address();
        let bounced = self.pipeline.bounced();
        self.ports.journal.append(
            entries,
            Box::new(move |entries, result| match result {
                Err(StoreError::Full) => {
                    if let Ok(mut slot) = bounced.lock() {
                        *slot = Some(entries);
                    }
                }
                result => addr.do_send(Journaled {
                    id,
                    entries,
                    result,
                }),
            }),
        );
        if let Some(entries) = self.pipeline.take_bounced() {
            tracing::warn!(
                shard = self.shard,
                entries = entries.len(),
                "journal queue full; batch held back and sent again"
            );
            self.pipeline.hold_back(id, entries);
            ctx.run_later(Duration::from_millis(JOURNAL_FULL_RETRY_MS), |p, ctx| {
                if let Some((id, entries)) = p.pipeline.take_held_back() {
                    p.append(id, entries, ctx);
                }
                p.schedule(ctx);
            });
        }
    }

    /// Applies a batch in memory: its entries, and what is left to do once they are
    /// durable (numbered when it is sent).
    fn apply_batch(&mut self, works: Vec<Work>) -> (Vec<Entry>, BatchInFlight, Early) {
        let now = now_ms();
        let mut b = BatchBuilder {
            entries: Vec::with_capacity(works.iter().map(Work::weight).sum()),
            ..BatchBuilder::default()
        };
        for work in works {
            match work {
                Work::Txn(req) => self.apply_txn(req, now, &mut b),
                Work::Load(chunk) => self.apply_load_chunk(chunk, now, &mut b),
            }
        }
        // One state per touched item, as of the end of the batch.
        b.touched.sort_unstable();
        b.touched.dedup();
        let batch_id = self.pipeline.next_id();
        let states = b
            .touched
            .into_iter()
            .map(|(shop, item)| {
                let live = self.items.touch(&shop, &item, batch_id);
                (shop, item, live)
            })
            .collect();
        let weight = b.entries.len();
        let in_flight = BatchInFlight {
            // Numbered by the pipeline when the batch is sent.
            id: 0,
            states,
            loads: b.loads,
            weight,
            repeats: b.repeats,
            keys: b.keys,
            ended: b.ended,
            returns: b.returns,
        };
        (b.entries, in_flight, b.early)
    }

    /// One request of a batch: a repeat of a key in flight or in the journal (a shared
    /// log), or decided.
    fn apply_txn(&mut self, req: Request, now: Millis, b: &mut BatchBuilder) {
        // Told only of an outcome this batch writes, and only where that is early
        // enough: otherwise dropped here, and its caller waits for the durable one.
        let early = req
            .early
            .take()
            .filter(|_| self.ports.journal.appends_in_order());
        if let Some(cluster) = &self.cluster {
            let key = (req.shop.clone(), req.key.clone());
            // Not removed from `prefetched` when found: a second copy of the key in
            // this batch is a repeat too.
            let found = match cluster.unjournaled(&key) {
                Some(o) => Some(o.clone()),
                None => self.prefetched.keys.get(&key).cloned().flatten(),
            };
            if let Some(outcome) = found {
                b.repeats.push(Repeat {
                    origin: req.origin,
                    outcome: Some(outcome),
                    pos: req.log_pos,
                });
                return;
            }
        }
        match self.decide(&req, now, &mut b.touched) {
            Decision::Apply(entry) => {
                // An outcome is built only where one is kept or told: a tuple such as
                // `(&self.cluster, entry.outcome())` would build it for every entry.
                if let Some(cluster) = &mut self.cluster {
                    if let Some(o) = entry.outcome() {
                        let key = (req.shop.clone(), req.key.clone());
                        cluster.applied(key.clone(), Arc::new(o));
                        b.keys.push(key);
                    }
                }
                if let (Status::Ok, Some(sale)) = (entry.status, &entry.return_of) {
                    b.returns
                        .push(((entry.shop.clone(), sale.clone()), entry.log_pos));
                }
                if let (true, Some(hold_id)) = (entry.op.ends_hold(), &entry.hold_id) {
                    if let Some(o) = entry.outcome() {
                        let key = (entry.shop.clone(), hold_id.clone());
                        self.holds.note_ended(key.clone(), Arc::new(o));
                        b.ended.push(key);
                    }
                }
                if let Some(tx) = early {
                    if let Some(o) = entry.outcome() {
                        b.early.push((tx, Arc::new(o)));
                    }
                }
                self.push_entry(entry, b);
            }
            Decision::Answer(outcome) => b.repeats.push(Repeat {
                origin: req.origin,
                outcome: Some(outcome),
                pos: req.log_pos,
            }),
            Decision::Drop => b.repeats.push(Repeat {
                origin: None,
                outcome: None,
                pos: req.log_pos,
            }),
            Decision::Wait => {}
        }
    }

    /// The part of an operator's load call that falls on this shard.
    fn apply_load_chunk(&mut self, chunk: LoadChunk, now: Millis, b: &mut BatchBuilder) {
        let LoadChunk { shop, items, reply } = chunk;
        let mut views = Vec::with_capacity(items.len());
        for load in items {
            if let Some(view) = self.items.seq_moved(&shop, &load.item, load.if_seq) {
                views.push((load.index, view, Status::SeqMoved));
                continue;
            }
            let slot = self.items.slot_for(&shop, &load.item, 0);
            let mut entry = apply_load(
                &mut slot.live,
                &shop,
                &load.item,
                load.stock,
                load.terms,
                now,
            );
            entry.per_buyer_max = load.per_buyer_max;
            self.items.set_limit(&shop, &load.item, load.per_buyer_max);
            self.push_entry(entry, b);
            // As the load leaves the item: after the alert it may call for.
            let live = self.items.get(&shop, &load.item).map(|s| s.live);
            let view = ItemView::of(shop.clone(), load.item.clone(), live.unwrap_or_default());
            views.push((load.index, view, Status::Ok));
            b.touched.push((shop.clone(), load.item));
        }
        b.loads.push((reply, views));
    }

    /// Adds `entry` to the batch, then the stock alert its change calls for, if it
    /// crossed one of its item's levels ([`crate::apply::crossing`]): the alert takes
    /// the item's next seq, in the same durable write.
    fn push_entry(&mut self, entry: Entry, b: &mut BatchBuilder) {
        let alert = match crate::apply::crossing_of(&entry) {
            None => None,
            Some(_) => self
                .items
                .get_mut(&entry.shop, &entry.item)
                .and_then(|slot| crate::apply::crossing(&mut slot.live, &entry)),
        };
        b.entries.push(entry);
        b.entries.extend(alert);
    }
}
