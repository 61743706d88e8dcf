//! Holds through time: arming a hold's expiry, waking for the next one, and ending a
//! hold (confirm, cancel, expiry, a check-back's extension) against the hold book.
//! Apart because it is the one part of the processor driven by time, not by requests.

use super::hold_book::{HoldKey, PendingHold};
use super::*;

/// What a fired timer of a plain hold becomes ([`Processor::expiry_of`]).
enum Fired {
    /// An expiry for this shard's mailbox.
    Here(Request),
    /// An expiry to send through the shared log, to the item's owner.
    ViaLog(Request),
    /// Nothing now: armed again, or let go.
    Later,
}

impl Processor {
    /// Arms the expiry of hold `h`. `recovered`: read back from the journal (a start,
    /// or an item taken over), not just made here; an order's record or line read back
    /// is checked with its order at once ([`OrderNudge`]).
    pub(super) fn arm_hold(&mut self, h: HoldView, recovered: bool) {
        let shop = h.shop.clone();
        if let Some(old) = self.holds.arm(h, recovered) {
            self.untentative(&shop, &old);
        }
    }

    /// Takes a pending line's quantity out of its item's tentative count, if it counts.
    fn untentative(&mut self, shop: &Arc<str>, h: &PendingHold) {
        if !h.tentative {
            return;
        }
        self.tentative_done(shop, &h.item, h.qty);
    }

    /// An order's record or line whose timer fired: its order decides, off this actor
    /// ([`OrderNudge`]). The timer is armed again, so the nudge is repeated until the
    /// hold ends here.
    fn nudge_order(&mut self, key: &HoldKey, now: Millis) {
        let Some(h) = self.holds.get(key) else {
            return;
        };
        let order_id: Arc<str> = if is_order_item(&h.item) {
            key.1.clone()
        } else {
            match order_of_line(&key.1) {
                Some((order, _)) => order.into(),
                None => return,
            }
        };
        let due = hold_book::due_at(&key.1, h.expires_at);
        let (why, next) = match h.check {
            true if now < due => (Nudge::Recovered, due),
            true => (Nudge::Recovered, now.saturating_add(ORDER_NUDGE_RETRY_MS)),
            false => (Nudge::Due, now.saturating_add(ORDER_NUDGE_RETRY_MS)),
        };
        let taken = (self.ports.order_hook)(OrderNudge {
            shop: key.0.clone(),
            id: order_id,
            hold: key.1.clone(),
            why,
        });
        if taken {
            self.holds.rearm(key, next);
            self.holds.checked(key);
        } else {
            // The engine's queue of nudges is full: asked again a moment later.
            self.holds
                .rearm(key, now.saturating_add(ORDER_HOOK_WAIT_MS));
        }
    }

    /// Expires the holds that are due, through the mailbox's high lane, and sleeps until
    /// the next one.
    pub(super) fn tick(&mut self, ctx: &mut Context<Self>) {
        self.holds.woke();
        let now = now_ms();
        let mut via_log = Vec::new();
        // With a shared log and journal, expiries go through the log to the item's owner.
        let resubmit = self
            .cluster
            .as_ref()
            .filter(|c| c.journal_shared())
            .map(|c| c.hooks().resubmit.clone());
        for key in self.holds.fire(now) {
            let Some(h) = self.holds.get(&key) else {
                continue;
            };
            if is_order_item(&h.item) || order_of_line(&key.1).is_some() {
                self.nudge_order(&key, now);
                continue;
            }
            if key.1.starts_with(crate::types::TRANSFER_PREFIX) {
                // Never expired blindly: its credit may be made already.
                self.nudge_hold(&key, now, Nudge::TransferDue);
                continue;
            }
            if self
                .ports
                .checkback
                .as_ref()
                .is_some_and(|c| c.enabled(&key.0))
            {
                self.nudge_hold(&key, now, Nudge::HoldDue);
                continue;
            }
            match self.expiry_of(key, now, resubmit.is_some()) {
                Fired::Here(req) => self.pipeline.push(Work::Txn(req)),
                Fired::ViaLog(req) => via_log.push(req),
                Fired::Later => {}
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

    /// The expiry of a plain hold whose timer fired. `via_log`: a shared log and journal,
    /// whose expiries go through the log.
    fn expiry_of(&mut self, key: HoldKey, now: Millis, via_log: bool) -> Fired {
        let Some(h) = self.holds.get(&key) else {
            return Fired::Later;
        };
        let (shop, hold_id) = key;
        let end_key = hold_end_key(&hold_id);
        let req = Request {
            hold_id: Some(hold_id.clone()),
            ..Request::new(
                shop.clone(),
                h.item.clone(),
                end_key,
                Op::Expire,
                h.qty,
                now,
            )
        };
        if !via_log {
            // This node owns the item: its own log, or a journal only it writes. (With a
            // shared log and journal, `via_log` is known from the first tick, since the
            // topology is chosen before the shards start: an overdue expiry recovered at
            // start never is decided here for an item another node may own, which a
            // write with no lease would not be fenced from.)
            return Fired::Here(req);
        }
        // Armed again, in case this copy is lost on its way (the producer refuses it,
        // or the broker restarts without it): sent once more while the hold is still
        // pending here, at waits that double from a second to a minute, for about ten
        // minutes, so that an outage of the log does not end with the hold still held.
        // Every copy has the same key, so it is one decision. A hold still here after
        // the last copy belongs to an item another node owns now (which re-armed it
        // from the journal), or its copies wait out a longer outage, or were all lost:
        // this node lets it go. A copy that reaches its owner later finds it pending in
        // the journal and arms it again (`Processor::absorb`); a restart or takeover
        // re-arms it from the journal too.
        let key = (shop, hold_id);
        match self.holds.send_expiry(&key, now) {
            Ok(()) => Fired::ViaLog(req),
            Err(sent) => {
                tracing::warn!(shop = %key.0, hold = %key.1, "hold's expiry sent {sent} times and still pending here; let go");
                Fired::Later
            }
        }
    }

    /// A due hold the engine settles, off this actor: one of a shop with a check-back
    /// (the shop is asked), or a transfer's. Nudged again every [`CHECK_RESEND_MS`]
    /// while the hold is still pending here (the engine settles once at a time per hold).
    fn nudge_hold(&mut self, key: &HoldKey, now: Millis, why: Nudge) {
        self.holds.rearm(key, now.saturating_add(CHECK_RESEND_MS));
        let taken = (self.ports.order_hook)(OrderNudge {
            shop: key.0.clone(),
            id: key.1.clone(),
            hold: key.1.clone(),
            why,
        });
        if !taken {
            tracing::debug!(hold = %key.1, "the engine's queue of nudges is full; asked again later");
        }
    }

    /// Sets the wake-up for the wheel's next expiry, if it is earlier than the one set.
    pub(super) fn arm_wake(&mut self, ctx: &mut Context<Self>) {
        let Some((next, old)) = self.holds.wake_needed() else {
            return;
        };
        if let Some(handle) = old {
            ctx.cancel_future(handle);
        }
        let delay = next.saturating_sub(now_ms().max(0) as u64);
        let handle = ctx.run_later(Duration::from_millis(delay), |p, ctx| p.tick(ctx));
        self.holds.set_wake(next, handle);
    }
}

impl Processor {
    /// Confirms, cancels or expires a hold. A hold past its `expires_at` expires
    /// whatever the request was, so a confirm that comes too late is answered with the
    /// expiry; a hold that already ended answers every later request with its ending.
    pub(super) fn end_hold(
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
        // An order's line ends as its order decided: expired only when the order's
        // ending says so, whenever the request reaches it.
        let line = order_of_line(&hold_id).is_some();
        let due = self.holds.get(&key).map(|h| {
            if line {
                req.op == Op::Expire
            } else {
                h.expires_at <= now
            }
        });
        match due {
            // An expiry that is not due yet: sent by a node whose clock runs ahead.
            Some(false) if req.op == Op::Expire => Decision::Drop,
            Some(due) => self.end_pending(req, &key, due, now, touched),
            None => self.end_not_pending(req, &key, now),
        }
    }

    /// Ends pending hold `key` as `req` asks, or as an expiry if it is `due`.
    fn end_pending(
        &mut self,
        req: &Request,
        key: &HoldKey,
        due: bool,
        now: Millis,
        touched: &mut Vec<(Arc<str>, Arc<str>)>,
    ) -> Decision {
        let Some(hold) = self.holds.end(key) else {
            return Decision::Drop;
        };
        self.untentative(&req.shop, &hold);
        let (slot, ledger) = self.items.slot_and_ledger(&req.shop, &hold.item);
        let Some(slot) = slot else {
            tracing::error!(hold = %key.1, "pending hold of an unknown item");
            return Decision::Drop;
        };
        let mut end = req.clone();
        end.item = hold.item.clone();
        // The ending names the hold's buyer, so the entries alone say whose units of a
        // limited item went back.
        end.buyer = hold.buyer.clone();
        // A check-back's decision stands past the expiry it was asked at.
        if due && !req.by_check {
            end.op = Op::Expire;
        }
        let mut entry = apply_hold_end(&mut slot.live, &end, hold.qty, now);
        // The expiry the hold had when it ended (an extension may have moved it since
        // it was made): what the ended hold shows when read back from its entries.
        entry.expires_at = Some(hold.expires_at);
        if let (Some(l), Some((buyer, delta))) = (ledger, crate::ledger::delta(&entry)) {
            l.apply(buyer, delta);
        }
        touched.push((req.shop.clone(), hold.item));
        Decision::Apply(entry)
    }

    /// The ending of a hold not pending here: answered with how it ended (in a batch in
    /// flight, or as the journal has it), else refused as unknown.
    fn end_not_pending(&mut self, req: &Request, key: &HoldKey, now: Millis) -> Decision {
        if let Some(o) = self.holds.ended(key) {
            return Decision::Answer(o.clone());
        }
        let by_key = (req.shop.clone(), req.key.clone());
        let found = match self.prefetched.keys.get(&by_key) {
            Some(found) => found.clone(),
            None => {
                // `plan_reads` asks for every ending of a hold not pending at the plan,
                // and the batch is applied right after it: a hold that left the pending
                // set in between was ended by this batch, and is in the ended ones. Read
                // here all the same rather than guess.
                tracing::error!(shard = self.shard, key = %req.key, "hold ending not planned for; journal read on the actor's thread");
                retry_read(self.shard, || {
                    self.ports.journal.outcomes(&req.shop, &[&req.key])
                })
                .into_iter()
                .next()
                .flatten()
                .map(Arc::new)
            }
        };
        match found {
            Some(o) => Decision::Answer(o),
            None if req.op == Op::Expire => Decision::Drop,
            None => Decision::Apply(Entry {
                status: Status::UnknownHold,
                reason: Some(format!("no hold {} in shop {}", key.1, req.shop)),
                ..Entry::of_request(req, now)
            }),
        }
    }

    /// Gives a pending hold (or order record or line) a new expiry, as its shop's
    /// check-back answered. A hold no longer pending is answered `unknown_hold`, not
    /// journaled: it ended meanwhile, and its ending stands.
    pub(super) fn extend_hold(
        &mut self,
        req: &Request,
        now: Millis,
        touched: &mut Vec<(Arc<str>, Arc<str>)>,
    ) -> Decision {
        let Some(hold_id) = req.hold_id.clone() else {
            return Decision::Drop;
        };
        let key = (req.shop.clone(), hold_id.clone());
        let Some(h) = self.holds.get(&key) else {
            let mut entry = Entry::of_request(req, now);
            entry.status = Status::UnknownHold;
            entry.reason = Some(format!("hold {hold_id} is no longer pending"));
            return match entry.outcome() {
                Some(o) => Decision::Answer(Arc::new(o)),
                None => Decision::Drop,
            };
        };
        // A caller's extension comes too late for a hold past its expiry (its expiry
        // may still be on its way): a check-back's, asked at the expiry, stands.
        if now >= h.expires_at && !req.by_check {
            let mut entry = Entry::of_request(req, now);
            entry.status = Status::UnknownHold;
            entry.reason = Some(format!("hold {hold_id} is past its expiry"));
            return match entry.outcome() {
                Some(o) => Decision::Answer(Arc::new(o)),
                None => Decision::Drop,
            };
        }
        let (item, qty) = (h.item.clone(), h.qty);
        let Some(slot) = self.items.get_mut(&req.shop, &item) else {
            tracing::error!(hold = %hold_id, "pending hold of an unknown item");
            return Decision::Drop;
        };
        let mut ext = req.clone();
        ext.item = item.clone();
        let entry = crate::apply::apply_extend(&mut slot.live, &ext, qty, now);
        self.holds.extend(&key, entry.expires_at.unwrap_or(now));
        touched.push((req.shop.clone(), item));
        Decision::Apply(entry)
    }
}
