//! The decision for one request: a stock change, a load, a hold or a hold's ending, an
//! order's record or line, against the parts it concerns. Only the apply step
//! ([`crate::apply`]) changes an item's numbers; this picks what it is asked to do.

use super::*;

impl Processor {
    /// Decides one request: a stock change, a hold or a hold's ending, or (from a shared
    /// log) an operator's load routed to the item's owner.
    pub(super) fn decide(
        &mut self,
        req: &Request,
        now: Millis,
        touched: &mut Vec<(Arc<str>, Arc<str>)>,
    ) -> Decision {
        if req.op == Op::Load {
            return self.decide_load(req, now, touched);
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
            Op::ReleaseHolds => return self.mark(req, now, touched),
            _ => {}
        }
        let line = req.op == Op::Hold && req.key.starts_with(LINE_PREFIX);
        if line {
            if let Some(wait) = self.line_waits(req, now) {
                return wait;
            }
        }
        let entry = self.decide_change(req, now, touched);
        if let (Op::Hold, Status::Ok, Some(expires_at)) = (entry.op, entry.status, entry.expires_at)
        {
            self.arm_hold(made_hold(req, expires_at, entry.qty), false);
            if line {
                // Tentative until its order is held ([`Op::Firm`]).
                self.holds
                    .make_tentative(&(req.shop.clone(), req.key.clone()));
                self.lines
                    .held((req.shop.clone(), req.item.clone()), req.qty);
            }
        }
        Decision::Apply(entry)
    }

    /// An operator's load that came through a shared log (one keyed request per item).
    fn decide_load(
        &mut self,
        req: &Request,
        now: Millis,
        touched: &mut Vec<(Arc<str>, Arc<str>)>,
    ) -> Decision {
        if let Some(view) = self.items.seq_moved(&req.shop, &req.item, req.if_seq) {
            // A refused condition changes nothing, so nothing is journaled: the answer
            // stands on its own (a retry is judged again, against a seq that only grows).
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
        let slot = self.items.slot_for(&req.shop, &req.item, req.epoch());
        let terms = LoadTerms {
            opens_at: req.opens_at,
            closes_at: req.closes_at,
            low_stock_at: req.low_stock_at,
        };
        let mut entry = apply_load(&mut slot.live, &req.shop, &req.item, req.qty, terms, now);
        entry.per_buyer_max = req.per_buyer_max;
        self.items
            .set_limit(&req.shop, &req.item, req.per_buyer_max);
        entry.request_key = Some(req.key.clone());
        entry.submitted_at = req.submitted_at;
        entry.logged = req.logged;
        entry.log_pos = req.log_pos;
        entry.origin = req.origin;
        touched.push((req.shop.clone(), req.item.clone()));
        Decision::Apply(entry)
    }

    /// A sale, a return or a hold: refused before the apply step when a rule outside it
    /// says so (a return past its sale, a buyer's limit, the holds' bounds), else
    /// applied.
    fn decide_change(
        &mut self,
        req: &Request,
        now: Millis,
        touched: &mut Vec<(Arc<str>, Arc<str>)>,
    ) -> Entry {
        // Only a return pays for this: every other request has no `return_of`.
        let return_refused = match &req.return_of {
            Some(sale) if req.op == Op::Increment => {
                self.returns
                    .refusal(req, sale, now, self.request_ttl_ms, &self.prefetched.sales)
            }
            _ => None,
        };
        let hold_refused = match req.op {
            Op::Hold => self.holds.refusal(&req.shop),
            _ => None,
        };
        let (slot, ledger) = self.items.slot_and_ledger(&req.shop, &req.item);
        let known = slot.is_some();
        // A transfer's hold is an operator's change: no window, no buyer's limit.
        let transfer = req.key.starts_with(crate::types::TRANSFER_PREFIX);
        let ledger = ledger.filter(|_| !transfer);
        let (cap, over_limit) = buyer_cap(ledger.as_deref(), req);
        // The sale window binds what takes stock: sales, holds, order lines.
        let outside = match (&slot, req.op) {
            (Some(slot), Op::Decrement | Op::Hold) if !transfer => slot.live.outside_window(now),
            _ => None,
        };
        let refused = outside
            .into_iter()
            .chain(
                [
                    (Status::ReturnRefused, return_refused),
                    (Status::BuyerLimit, over_limit),
                    (Status::LimitExceeded, hold_refused),
                ]
                .into_iter()
                .filter_map(|(status, why)| why.map(|why| (status, why))),
            )
            .next();
        let entry = match (slot, refused) {
            (Some(slot), Some((status, why))) => reject(&mut slot.live, req, now, status, why),
            (slot, _) => apply_within(
                slot.map(|s| &mut s.live),
                req,
                now,
                self.request_ttl_ms,
                cap,
            ),
        };
        if let (Some(l), Some((buyer, delta))) = (ledger, crate::ledger::delta(&entry)) {
            l.apply(buyer, delta);
        }
        if let (Status::Ok, Some(sale)) = (entry.status, &req.return_of) {
            self.returns
                .returned(&req.shop, sale, req.qty, &self.prefetched.sales);
        }
        if known {
            touched.push((req.shop.clone(), req.item.clone()));
        }
        entry
    }

    /// An order's line that finds too little stock available, but enough with the
    /// lines of other orders not yet held counted back: it waits
    /// ([`Decision::Wait`]) until one of those is decided, or (past
    /// [`WAITING_LINES_MAX`], or a line of an order's first attempt, which never waits:
    /// [`Request::no_wait`]) is answered [`Status::Tentative`], not journaled, and its
    /// order asks again.
    fn line_waits(&mut self, req: &Request, now: Millis) -> Option<Decision> {
        let live = self.items.get(&req.shop, &req.item)?.live;
        if req.qty <= live.stock {
            return None;
        }
        let tentative = self.lines.tentative(&(req.shop.clone(), req.item.clone()));
        if req.qty > live.stock + tentative {
            return None;
        }
        let fresh = now.saturating_sub(req.submitted_at) <= self.request_ttl_ms;
        if fresh && !req.no_wait && self.lines.wait(req) {
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
        if let Some((item, qty)) = self.holds.firm(&key) {
            self.tentative_done(&req.shop, &item, qty);
        }
    }

    /// `qty` of the item's tentative lines are decided (firm, or ended): the lines
    /// waiting on the item go back into the pipeline, to be decided again.
    pub(super) fn tentative_done(&mut self, shop: &Arc<str>, item: &Arc<str>, qty: i64) {
        for req in self.lines.done(&(shop.clone(), item.clone()), qty) {
            self.pipeline.push(Work::Txn(req));
        }
    }

    /// Puts back in the pipeline the waiting lines older than the request TTL, which
    /// are then decided (`expired`, if nothing moved meanwhile), and sweeps again later
    /// while lines wait.
    fn sweep_waiting(&mut self, ctx: &mut Context<Self>) {
        for req in self.lines.sweep(now_ms(), self.request_ttl_ms) {
            self.pipeline.push(Work::Txn(req));
        }
        self.arm_waiting_sweep(ctx);
        self.schedule(ctx);
    }

    pub(super) fn arm_waiting_sweep(&mut self, ctx: &mut Context<Self>) {
        if self.lines.arm_sweep() {
            let after = Duration::from_millis(self.request_ttl_ms.max(1) as u64);
            ctx.run_later(after, |p, ctx| p.sweep_waiting(ctx));
        }
    }

    /// An operator's marker on an item ([`Op::ReleaseHolds`]): its next entry, nothing
    /// moved; an unknown item's is refused as any request on it.
    fn mark(
        &mut self,
        req: &Request,
        now: Millis,
        touched: &mut Vec<(Arc<str>, Arc<str>)>,
    ) -> Decision {
        let entry = match self.items.get_mut(&req.shop, &req.item) {
            Some(slot) => {
                touched.push((req.shop.clone(), req.item.clone()));
                crate::apply::apply_mark(&mut slot.live, req, now)
            }
            None => {
                let mut entry = Entry::of_request(req, now);
                entry.status = Status::UnknownItem;
                entry.reason = Some(format!("item {} is not loaded in this shop", req.item));
                entry
            }
        };
        Decision::Apply(entry)
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
        let slot = self.items.slot_for(&req.shop, &req.item, req.epoch());
        let entry = crate::apply::apply_order(&mut slot.live, req, now);
        touched.push((req.shop.clone(), req.item.clone()));
        if let Some(expires_at) = entry.expires_at {
            self.arm_hold(made_hold(req, expires_at, req.qty), false);
        }
        Decision::Apply(entry)
    }
}

/// What a buyer's limit (`ledger`, the item's) lets sale or hold `req` take: at most
/// this much (a partial fill takes no more than the limit leaves its buyer), and why it
/// is refused, if it is (for a partial fill, when the limit leaves less than `min_qty`).
fn buyer_cap(ledger: Option<&BuyerLedger>, req: &Request) -> (i64, Option<String>) {
    let Some(l) = ledger.filter(|_| matches!(req.op, Op::Decrement | Op::Hold)) else {
        return (req.qty, None);
    };
    let cap = match req.min_qty {
        Some(min) => l.room(req.buyer.as_ref()).max(min).min(req.qty),
        None => req.qty,
    };
    (cap, l.check(&req.item, req.buyer.as_ref(), cap))
}

/// The pending hold request `req` makes of `qty` (less than asked for a partial fill),
/// expiring at `expires_at`.
fn made_hold(req: &Request, expires_at: Millis, qty: i64) -> HoldView {
    HoldView {
        hold_id: req.key.clone(),
        status: HoldStatus::Held,
        shop: req.shop.clone(),
        item: req.item.clone(),
        qty,
        expires_at,
        seq: 0,
        buyer: req.buyer.clone(),
    }
}
