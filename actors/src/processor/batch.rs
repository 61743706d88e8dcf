//! Scheduling and batching: taking work from the priority mailbox, applying a batch in
//! memory and handing it to the journal, with at most [`super::BATCHES_IN_FLIGHT_MAX`]
//! batches outstanding. The decision for one request ([`Processor::decide`]) is here too.

use super::*;

impl Processor {
    pub(super) fn schedule(&mut self, ctx: &mut Context<Self>) {
        if !self.drain_scheduled
            && self.held_back.is_none()
            && self.reading.is_none()
            && (!self.mailbox.is_empty() || (self.parked.is_some() && self.in_flight.is_empty()))
            && self.in_flight.len() < BATCHES_IN_FLIGHT_MAX
        {
            self.drain_scheduled = true;
            // Through the mailbox, not a direct call: messages already waiting are taken
            // in first, so the batch is as large as the backlog allows.
            ctx.notify(Drain);
        }
    }

    pub(super) fn drain(&mut self, ctx: &mut Context<Self>) {
        self.drain_scheduled = false;
        while self.reading.is_none()
            && self.held_back.is_none()
            && self.in_flight.len() < BATCHES_IN_FLIGHT_MAX
        {
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
            let works = if self.hooks.get().is_some() {
                self.drop_stale(works)
            } else {
                works
            };
            self.decide_or_read(works, ctx);
        }
        self.depth_gauge.set(self.mailbox.len() as i64);
    }

    /// Applies `works` as one batch and hands it to the journal. Everything it is
    /// decided against is in memory or in [`Processor::prefetched`] (see
    /// [`Processor::decide_or_read`]).
    pub(super) fn run_batch(&mut self, works: Vec<Work>, ctx: &mut Context<Self>) {
        let batch = self.apply_batch(works);
        self.arm_waiting_sweep(ctx);
        self.prefetched = Prefetched::default();
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
            return;
        }
        self.metrics.batch_entries.observe(entries.len() as f64);
        let id = in_flight.id;
        self.in_flight.push_back(in_flight);
        self.append(id, entries, ctx);
    }

    /// Hands batch `id` to the journal. If its queue has no room, the batch is held back
    /// and sent again a moment later, before anything after it.
    pub(super) fn append(&mut self, id: u64, entries: Vec<Entry>, ctx: &mut Context<Self>) {
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

    pub(super) fn apply_batch(&mut self, works: Vec<Work>) -> BatchBuilt {
        let shared_log = self.hooks.get().is_some();
        let now = now_ms();
        let mut entries = Vec::with_capacity(works.iter().map(Work::weight).sum());
        let mut touched: Vec<(Arc<str>, Arc<str>)> = Vec::new();
        let mut loads = Vec::new();
        let mut repeats = Vec::new();
        let mut keys = Vec::new();
        let mut ended = Vec::new();
        let mut returns = Vec::new();
        for work in works {
            match work {
                Work::Txn(req) => {
                    if shared_log {
                        let key = (req.shop.clone(), req.key.clone());
                        // Not removed from `prefetched` when found: a second copy of
                        // the key in this batch is a repeat too.
                        let found = match self.undurable.get(&key) {
                            Some(o) => Some(o.clone()),
                            None => self.prefetched.keys.get(&key).cloned().flatten(),
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
                            if let (Status::Ok, Some(sale)) = (entry.status, &entry.return_of) {
                                returns.push(((entry.shop.clone(), sale.clone()), entry.log_pos));
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
                        Decision::Wait => {}
                    }
                }
                Work::Load(LoadChunk { shop, items, reply }) => {
                    let mut views = Vec::with_capacity(items.len());
                    for load in items {
                        if let Some(view) = self.seq_moved(&shop, &load.item, load.if_seq) {
                            views.push((load.index, view, Status::SeqMoved));
                            continue;
                        }
                        let (slot, new) = slot_for(&mut self.items, &shop, &load.item, 0);
                        if new {
                            self.resident += 1;
                            self.resident_gauge.inc();
                        }
                        let mut entry =
                            apply_load(&mut slot.live, &shop, &load.item, load.stock, now);
                        entry.per_buyer_max = load.per_buyer_max;
                        views.push((
                            load.index,
                            ItemView {
                                shop: shop.clone(),
                                item: load.item.clone(),
                                stock: slot.live.stock,
                                reserved: slot.live.reserved,
                                seq: slot.live.seq,
                            },
                            Status::Ok,
                        ));
                        self.set_limit(&shop, &load.item, load.per_buyer_max);
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
                returns,
            },
        }
    }

    /// Decides one request: a stock change, a hold or a hold's ending, or (from a shared
    /// log) an operator's load routed to the item's owner.
    pub(super) fn decide(
        &mut self,
        req: &Request,
        now: Millis,
        touched: &mut Vec<(Arc<str>, Arc<str>)>,
    ) -> Decision {
        if req.op == Op::Load {
            if let Some(view) = self.seq_moved(&req.shop, &req.item, req.if_seq) {
                // A refused condition changes nothing, so nothing is journaled: the
                // answer stands on its own (a retry is judged again, against a seq that
                // only grows).
                let mut entry = Entry::of_request(req, now);
                entry.status = Status::SeqMoved;
                entry.reason = Some(format!(
                    "if_seq {}, but the item is at seq {}",
                    req.if_seq.unwrap_or_default(),
                    view.seq
                ));
                (entry.stock_after, entry.reserved_after, entry.seq) =
                    (Some(view.stock), Some(view.reserved), Some(view.seq));
                return match entry.outcome() {
                    Some(o) => Decision::Answer(Arc::new(o)),
                    None => Decision::Drop,
                };
            }
            let (slot, new) = slot_for(&mut self.items, &req.shop, &req.item, req.epoch());
            if new {
                self.resident += 1;
                self.resident_gauge.inc();
            }
            let mut entry = apply_load(&mut slot.live, &req.shop, &req.item, req.qty, now);
            entry.per_buyer_max = req.per_buyer_max;
            self.set_limit(&req.shop, &req.item, req.per_buyer_max);
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
        match req.op {
            Op::Firm => {
                self.firm(req);
                return Decision::Drop;
            }
            Op::Order => return self.record_order(req, now, touched),
            Op::Extend => return self.extend_hold(req, now, touched),
            _ => {}
        }
        let line = req.op == Op::Hold && req.key.starts_with(LINE_PREFIX);
        if line {
            if let Some(wait) = self.line_waits(req, now) {
                return wait;
            }
        }
        // Only a return pays for this: every other request has no `return_of`.
        let return_refused = match &req.return_of {
            Some(sale) if req.op == Op::Increment => self.return_refusal(req, sale, now),
            _ => None,
        };
        let slot = self
            .items
            .get_mut(&req.shop)
            .and_then(|items| items.get_mut(&req.item));
        let known = slot.is_some();
        let ledger = if self.ledgers.is_empty() {
            None
        } else {
            self.ledgers.get_mut(&(req.shop.clone(), req.item.clone()))
        };
        let over_limit = match &ledger {
            Some(l) if matches!(req.op, Op::Decrement | Op::Hold) => {
                l.check(&req.item, req.buyer.as_ref(), req.qty)
            }
            _ => None,
        };
        let entry = match slot {
            Some(slot) if return_refused.is_some() => reject(
                &mut slot.live,
                req,
                now,
                Status::ReturnRefused,
                return_refused.unwrap_or_default(),
            ),
            Some(slot) if over_limit.is_some() => reject(
                &mut slot.live,
                req,
                now,
                Status::BuyerLimit,
                over_limit.unwrap_or_default(),
            ),
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
            Some(slot)
                if req.op == Op::Hold
                    && self.holds.of_shop(&req.shop) >= self.holds_per_shop_max =>
            {
                reject(
                    &mut slot.live,
                    req,
                    now,
                    Status::LimitExceeded,
                    format!(
                        "shop {} already keeps {} pending holds on this shard, a shop's limit",
                        req.shop, self.holds_per_shop_max
                    ),
                )
            }
            slot => apply(slot.map(|s| &mut s.live), req, now, self.request_ttl_ms),
        };
        if let (Some(l), Some((buyer, delta))) = (ledger, crate::ledger::delta(&entry)) {
            l.apply(buyer, delta);
        }
        if let (Status::Ok, Some(sale)) = (entry.status, &req.return_of) {
            self.returned(&req.shop, sale, req.qty);
        }
        if known {
            touched.push((req.shop.clone(), req.item.clone()));
        }
        if let (Op::Hold, Status::Ok, Some(expires_at)) = (entry.op, entry.status, entry.expires_at)
        {
            self.arm_hold(made_hold(req, expires_at), false);
            if line {
                // Tentative until its order is held ([`Op::Firm`]).
                let key = (req.shop.clone(), req.key.clone());
                if let Some(h) = self.holds.get_mut(&key) {
                    h.tentative = true;
                }
                *self
                    .tentative
                    .entry((req.shop.clone(), req.item.clone()))
                    .or_default() += req.qty;
            }
        }
        Decision::Apply(entry)
    }

    /// An order's line that finds too little stock available, but enough with the
    /// lines of other orders not yet held counted back: it waits here
    /// ([`Decision::Wait`]) until one of those is decided, or (past
    /// [`WAITING_LINES_MAX`]) is answered [`Status::Tentative`], not journaled, and its
    /// order asks again.
    fn line_waits(&mut self, req: &Request, now: Millis) -> Option<Decision> {
        let live = self.items.get(&req.shop)?.get(&req.item)?.live;
        if req.qty <= live.stock {
            return None;
        }
        let tentative = self
            .tentative
            .get(&(req.shop.clone(), req.item.clone()))
            .copied()
            .unwrap_or(0);
        if req.qty > live.stock + tentative {
            return None;
        }
        let fresh = now.saturating_sub(req.submitted_at) <= self.request_ttl_ms;
        if fresh && self.waiting_count < WAITING_LINES_MAX {
            self.waiting
                .entry((req.shop.clone(), req.item.clone()))
                .or_default()
                .push(req.clone());
            self.waiting_count += 1;
            return Some(Decision::Wait);
        }
        let mut entry = Entry::of_request(req, now);
        entry.status = Status::Tentative;
        entry.reason = Some(format!(
            "requested {}, available {}, and {tentative} more held by orders being reserved",
            req.qty, live.stock
        ));
        (entry.stock_after, entry.reserved_after, entry.seq) =
            (Some(live.stock), Some(live.reserved), Some(live.seq));
        entry.outcome().map(|o| Decision::Answer(Arc::new(o)))
    }

    /// An order's line made firm: its order is held.
    fn firm(&mut self, req: &Request) {
        let Some(hold_id) = &req.hold_id else { return };
        let key = (req.shop.clone(), hold_id.clone());
        let Some(h) = self.holds.get_mut(&key) else {
            return;
        };
        if !h.tentative {
            return;
        }
        h.tentative = false;
        let (item, qty) = (h.item.clone(), h.qty);
        self.tentative_done(&req.shop, &item, qty);
    }

    /// `qty` of the item's tentative lines are decided (firm, or ended): the lines
    /// waiting on the item are decided again.
    pub(super) fn tentative_done(&mut self, shop: &Arc<str>, item: &Arc<str>, qty: i64) {
        let key = (shop.clone(), item.clone());
        if let Some(n) = self.tentative.get_mut(&key) {
            *n -= qty;
            if *n <= 0 {
                self.tentative.remove(&key);
            }
        }
        if let Some(lines) = self.waiting.remove(&key) {
            self.waiting_count -= lines.len();
            for req in lines {
                self.mailbox.push(Work::Txn(req));
            }
        }
    }

    /// Puts back in the mailbox the waiting lines older than the request TTL, which are
    /// then decided (`expired`, if nothing moved meanwhile), and sweeps again later
    /// while lines wait.
    pub(super) fn sweep_waiting(&mut self, ctx: &mut Context<Self>) {
        self.waiting_sweep = false;
        let now = now_ms();
        let ttl = self.request_ttl_ms;
        let mut back = Vec::new();
        for lines in self.waiting.values_mut() {
            let (old, keep): (Vec<Request>, Vec<Request>) = std::mem::take(lines)
                .into_iter()
                .partition(|r| now.saturating_sub(r.submitted_at) > ttl);
            *lines = keep;
            back.extend(old);
        }
        self.waiting.retain(|_, lines| !lines.is_empty());
        self.waiting_count -= back.len();
        for req in back {
            self.mailbox.push(Work::Txn(req));
        }
        self.arm_waiting_sweep(ctx);
        self.schedule(ctx);
    }

    pub(super) fn arm_waiting_sweep(&mut self, ctx: &mut Context<Self>) {
        if self.waiting_sweep || self.waiting_count == 0 {
            return;
        }
        self.waiting_sweep = true;
        let after = Duration::from_millis(self.request_ttl_ms.max(1) as u64);
        ctx.run_later(after, |p, ctx| p.sweep_waiting(ctx));
    }

    /// Journals an order's record on its order item (made on first use): a pending
    /// record of `qty` lines, ended like a hold.
    fn record_order(
        &mut self,
        req: &Request,
        now: Millis,
        touched: &mut Vec<(Arc<str>, Arc<str>)>,
    ) -> Decision {
        if !is_order_item(&req.item) {
            tracing::error!(key = %req.key, item = %req.item, "order record off an order item; dropped");
            return Decision::Drop;
        }
        let (slot, new) = slot_for(&mut self.items, &req.shop, &req.item, req.epoch());
        if new {
            self.resident += 1;
            self.resident_gauge.inc();
        }
        let entry = crate::apply::apply_order(&mut slot.live, req, now);
        touched.push((req.shop.clone(), req.item.clone()));
        if let Some(expires_at) = entry.expires_at {
            self.arm_hold(made_hold(req, expires_at), false);
        }
        Decision::Apply(entry)
    }
}

/// The pending hold request `req` makes, expiring at `expires_at`.
fn made_hold(req: &Request, expires_at: Millis) -> HoldView {
    HoldView {
        hold_id: req.key.clone(),
        status: HoldStatus::Held,
        shop: req.shop.clone(),
        item: req.item.clone(),
        qty: req.qty,
        expires_at,
        seq: 0,
        buyer: req.buyer.clone(),
    }
}

impl Processor {
    /// Why return `req` of sale `sale` is refused, `None` if it may go ahead (to the
    /// apply step, which may still refuse it as expired or past the stock limit). An
    /// expired return is left to the apply step, to be answered `expired` like any
    /// request that waited too long.
    fn return_refusal(&self, req: &Request, sale: &Arc<str>, now: Millis) -> Option<String> {
        if now.saturating_sub(req.submitted_at) > self.request_ttl_ms {
            return None;
        }
        let key = (req.shop.clone(), sale.clone());
        let record = match self.returning.get(&key) {
            Some(r) => Some(&r.record),
            // Read for this batch ([`Processor::plan_reads`]); a sale the journal does not
            // have (or that was not read) is refused, never taken on trust.
            None => self.prefetched.sales.get(&key).and_then(Option::as_ref),
        };
        match record {
            Some(r) => r.refusal(sale, &req.item, req.qty, now, self.return_window_ms),
            None => Some(crate::returns::unknown_sale(sale)),
        }
    }

    /// Counts an `ok` return of `qty` against sale `sale`, in memory until the batch that
    /// journals it is durable (see [`Processor::returning`]).
    fn returned(&mut self, shop: &Arc<str>, sale: &Arc<str>, qty: i64) {
        let key = (shop.clone(), sale.clone());
        let entry = match self.returning.entry(key) {
            std::collections::hash_map::Entry::Occupied(o) => o.into_mut(),
            std::collections::hash_map::Entry::Vacant(v) => {
                let Some(Some(record)) = self.prefetched.sales.get(v.key()).cloned() else {
                    // `return_refusal` found the record in one of the two places.
                    unreachable!("an ok return of a sale neither read nor in flight");
                };
                v.insert(Returning {
                    record,
                    in_flight: 0,
                })
            }
        };
        entry.record.returned += qty;
        entry.in_flight += 1;
        // The rule this module exists for: never more back than was sold.
        assert!(
            entry.record.returned <= entry.record.sold,
            "return past the sale: {} returned of {} sold (sale {sale})",
            entry.record.returned,
            entry.record.sold
        );
    }

    /// A load's `per_buyer_max`: `Some(0)` lifts the item's limit and forgets its
    /// counts, `Some(n)` sets it (keeping the counts), `None` leaves it.
    fn set_limit(&mut self, shop: &Arc<str>, item: &Arc<str>, per_buyer_max: Option<i64>) {
        match per_buyer_max {
            None => {}
            Some(0) => {
                self.ledgers.remove(&(shop.clone(), item.clone()));
            }
            Some(max) => {
                self.ledgers
                    .entry((shop.clone(), item.clone()))
                    .or_insert_with(|| BuyerLedger::new(max))
                    .max = max;
            }
        }
    }

    /// The item's state when a load's condition `if_seq` does not hold: its seq (0 for
    /// an item this shard does not know) is no longer the one given. `None` when the
    /// load may go ahead.
    fn seq_moved(&self, shop: &Arc<str>, item: &Arc<str>, if_seq: Option<u64>) -> Option<ItemView> {
        let want = if_seq?;
        let live = self
            .items
            .get(shop)
            .and_then(|m| m.get(item))
            .map(|s| s.live)
            .unwrap_or_default();
        (live.seq != want).then(|| ItemView {
            shop: shop.clone(),
            item: item.clone(),
            stock: live.stock,
            reserved: live.reserved,
            seq: live.seq,
        })
    }
}

pub(super) struct BatchBuilt {
    pub(super) entries: Vec<Entry>,
    pub(super) in_flight: BatchInFlight,
}
