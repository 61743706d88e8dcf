//! Holds and their timing wheel: arming a hold's expiry, waking for the next one, and
//! ending a hold (confirm, cancel, expiry) against the pending holds this shard keeps.
//! Apart because it is the one part of the processor driven by time, not by requests.

use super::*;

impl Processor {
    /// Arms the expiry of hold `h`. `recovered`: read back from the journal (a start,
    /// or an item taken over), not just made here; an order's record or line read back
    /// is checked with its order at once ([`OrderNudge`]).
    pub(super) fn arm_hold(&mut self, h: HoldView, recovered: bool) {
        let order = is_order_item(&h.item) || order_of_line(&h.hold_id).is_some();
        let check = recovered && order;
        let deadline = if check {
            now_ms()
        } else {
            due_at(&h.hold_id, h.expires_at)
        };
        let key_shop = h.shop.clone();
        let key = (h.shop, h.hold_id);
        let timer = self.wheel.insert(deadline.max(0) as u64, key.clone());
        if let Some(old) = self.holds.insert(
            key,
            PendingHold {
                item: h.item,
                qty: h.qty,
                expires_at: h.expires_at,
                timer,
                expiries_sent: 0,
                buyer: h.buyer,
                tentative: false,
                check,
            },
        ) {
            self.wheel.cancel(old.timer);
            self.untentative(&key_shop, &old);
        }
    }

    /// Takes a pending line's quantity out of its item's tentative count, if it counts.
    pub(super) fn untentative(&mut self, shop: &Arc<str>, h: &PendingHold) {
        if !h.tentative {
            return;
        }
        self.tentative_done(shop, &h.item, h.qty);
    }

    /// An order's record or line whose timer fired: its order decides, off this actor
    /// ([`OrderNudge`]). The timer is armed again, so the nudge is repeated until the
    /// hold ends here.
    fn nudge_order(&mut self, key: &(Arc<str>, Arc<str>), now: Millis) {
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
        let due = due_at(&key.1, h.expires_at);
        let (why, next) = match self.order_hook.get() {
            // Not attached yet: the node is starting.
            None => (None, now.saturating_add(ORDER_HOOK_WAIT_MS)),
            Some(_) if h.check && now < due => (Some(Nudge::Recovered), due),
            Some(_) if h.check => (
                Some(Nudge::Recovered),
                now.saturating_add(ORDER_NUDGE_RETRY_MS),
            ),
            Some(_) => (Some(Nudge::Due), now.saturating_add(ORDER_NUDGE_RETRY_MS)),
        };
        let timer = self.wheel.insert(next.max(0) as u64, key.clone());
        if let Some(h) = self.holds.get_mut(key) {
            h.timer = timer;
            if why.is_some() {
                h.check = false;
            }
        }
        if let (Some(why), Some(hook)) = (why, self.order_hook.get()) {
            hook(OrderNudge {
                shop: key.0.clone(),
                id: order_id,
                why,
            });
        }
    }

    /// Expires the holds that are due, through the mailbox's high lane, and sleeps until
    /// the next one.
    pub(super) fn tick(&mut self, ctx: &mut Context<Self>) {
        self.wake = None;
        let now = now_ms();
        let mut fired = Vec::new();
        self.wheel.advance(now.max(0) as u64, &mut fired);
        let mut via_log = Vec::new();
        let shared = self.journal.shared();
        let resubmit = self
            .hooks
            .get()
            .filter(|_| shared)
            .map(|h| h.resubmit.clone());
        for (_, (shop, hold_id)) in fired {
            let pending = (shop.clone(), hold_id.clone());
            let Some(h) = self.holds.get(&pending) else {
                continue;
            };
            if is_order_item(&h.item) || order_of_line(&hold_id).is_some() {
                self.nudge_order(&pending, now);
                continue;
            }
            if self.checkback.get().is_some_and(|c| c.enabled(&shop)) {
                self.nudge_check(&pending, now);
                continue;
            }
            if shared && resubmit.is_none() && self.log_made.get().is_none() {
                // The request log is not made yet: the node is starting, and armed
                // every pending hold of the shared journal, overdue ones firing at
                // once. Such an expiry must reach the item's owner through the log,
                // never be decided here: this node may not own the item, and a write
                // that did not come through the log carries no lease, so nothing
                // fences it (the campaign saw a restarted node write an expiry of
                // another node's item and stop on the conflict). Tried again later,
                // without counting as a copy sent.
                let retry_at = (now.max(0) as u64).saturating_add(EXPIRY_RESEND_MS);
                let timer = self.wheel.insert(retry_at, pending.clone());
                if let Some(h) = self.holds.get_mut(&pending) {
                    h.timer = timer;
                }
                continue;
            }
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
                // owns now (which re-armed it from the journal), or its copies wait out
                // an outage (the broker or the database down), or were all lost: this
                // node lets it go. A copy that reaches its owner later finds it pending
                // in the journal and arms it again (`Processor::absorb`); a restart or
                // takeover re-arms it from the journal too.
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

    /// A due hold of a shop with a check-back: the engine asks the shop, off this actor.
    /// Asked again every [`CHECK_RESEND_MS`] while the hold is still pending here (the
    /// engine asks once at a time per hold).
    fn nudge_check(&mut self, key: &(Arc<str>, Arc<str>), now: Millis) {
        let next = now.saturating_add(CHECK_RESEND_MS);
        let timer = self.wheel.insert(next.max(0) as u64, key.clone());
        if let Some(h) = self.holds.get_mut(key) {
            h.timer = timer;
        }
        match self.order_hook.get() {
            Some(hook) => hook(OrderNudge {
                shop: key.0.clone(),
                id: key.1.clone(),
                why: Nudge::HoldDue,
            }),
            None => {
                tracing::debug!(hold = %key.1, "hold due before the engine attached; asked again later")
            }
        }
    }

    /// Sets the wake-up for the wheel's next expiry, if it is earlier than the one set.
    pub(super) fn arm_wake(&mut self, ctx: &mut Context<Self>) {
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
            Some(due) => {
                let Some(hold) = self.holds.remove(&key) else {
                    return Decision::Drop;
                };
                self.wheel.cancel(hold.timer);
                self.untentative(&req.shop, &hold);
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
                // The ending names the hold's buyer, so the entries alone say whose
                // units of a limited item went back.
                end.buyer = hold.buyer.clone();
                // A check-back's decision stands past the expiry it was asked at.
                if due && !req.by_check {
                    end.op = Op::Expire;
                }
                let entry = apply_hold_end(&mut slot.live, &end, hold.qty, now);
                if let Some(l) = self.ledgers.get_mut(&(req.shop.clone(), hold.item.clone())) {
                    if let Some((buyer, delta)) = crate::ledger::delta(&entry) {
                        l.apply(buyer, delta);
                    }
                }
                touched.push((req.shop.clone(), hold.item));
                Decision::Apply(entry)
            }
            None => {
                if let Some(o) = self.ended.get(&key) {
                    return Decision::Answer(o.clone());
                }
                let key = (req.shop.clone(), req.key.clone());
                let found = match self.prefetched.keys.get(&key) {
                    Some(found) => found.clone(),
                    None => {
                        // `plan_reads` asks for every ending of a hold not pending at the
                        // plan, and the batch is applied right after it: a hold that
                        // left the pending set in between was ended by this batch, and
                        // is in `ended`. Read here all the same rather than guess.
                        tracing::error!(shard = self.shard, key = %req.key, "hold ending not planned for; journal read on the actor's thread");
                        retry_read(self.shard, || self.journal.outcomes(&req.shop, &[&req.key]))
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
                        reason: Some(format!("no hold {hold_id} in shop {}", req.shop)),
                        ..Entry::of_request(req, now)
                    }),
                }
            }
        }
    }
}

/// When a pending hold's timer is due: a hold's or an order record's at its expiry; an
/// order's line a grace period later, since its order's own expiry ends it (the line's
/// timer only makes sure it is not forgotten if that ending is lost).
fn due_at(hold_id: &str, expires_at: Millis) -> Millis {
    if order_of_line(hold_id).is_some() {
        expires_at.saturating_add(LINE_GRACE_MS)
    } else {
        expires_at
    }
}

impl Processor {
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
        let (item, qty) = (h.item.clone(), h.qty);
        let Some(slot) = self.items.get_mut(&req.shop).and_then(|m| m.get_mut(&item)) else {
            tracing::error!(hold = %hold_id, "pending hold of an unknown item");
            return Decision::Drop;
        };
        let mut ext = req.clone();
        ext.item = item.clone();
        let entry = crate::apply::apply_extend(&mut slot.live, &ext, qty, now);
        let expires_at = entry.expires_at.unwrap_or(now);
        let timer = self
            .wheel
            .insert(due_at(&hold_id, expires_at).max(0) as u64, key.clone());
        if let Some(h) = self.holds.get_mut(&key) {
            self.wheel.cancel(h.timer);
            h.timer = timer;
            h.expires_at = expires_at;
            h.check = false;
            h.expiries_sent = 0;
        }
        touched.push((req.shop.clone(), item));
        Decision::Apply(entry)
    }
}

/// The pending holds of a shard, by shop and hold id, with how many each shop has: the
/// per-shop bound ([`ShardShared::holds_per_shop_max`]) is checked against that count at
/// every hold, so it is kept here, where every hold goes in and out (made, recovered,
/// read back, confirmed, cancelled, expired, let go), rather than recounted.
#[derive(Default)]
pub(super) struct PendingHolds {
    by_key: HashMap<(Arc<str>, Arc<str>), PendingHold>,
    /// Pending holds per shop; a shop with none has no entry, so the map stays as small
    /// as the shops with holds on this shard.
    per_shop: HashMap<Arc<str>, usize>,
}

/// Up to this many pending holds, a debug build recounts the holds per shop at each
/// change and asserts the counts match (more would make tests with many holds slow).
#[cfg(debug_assertions)]
const RECOUNT_HOLDS_MAX: usize = 1_024;

impl PendingHolds {
    pub(super) fn len(&self) -> usize {
        self.by_key.len()
    }

    /// Pending holds of `shop` on this shard.
    pub(super) fn of_shop(&self, shop: &str) -> usize {
        self.per_shop.get(shop).copied().unwrap_or(0)
    }

    pub(super) fn get(&self, key: &(Arc<str>, Arc<str>)) -> Option<&PendingHold> {
        self.by_key.get(key)
    }

    pub(super) fn get_mut(&mut self, key: &(Arc<str>, Arc<str>)) -> Option<&mut PendingHold> {
        self.by_key.get_mut(key)
    }

    pub(super) fn contains_key(&self, key: &(Arc<str>, Arc<str>)) -> bool {
        self.by_key.contains_key(key)
    }

    pub(super) fn iter(&self) -> impl Iterator<Item = (&(Arc<str>, Arc<str>), &PendingHold)> {
        self.by_key.iter()
    }

    /// Puts a hold in (or in place of the one with its key, which is returned).
    pub(super) fn insert(
        &mut self,
        key: (Arc<str>, Arc<str>),
        hold: PendingHold,
    ) -> Option<PendingHold> {
        let shop = key.0.clone();
        let old = self.by_key.insert(key, hold);
        if old.is_none() {
            *self.per_shop.entry(shop).or_default() += 1;
        }
        self.assert_paired();
        old
    }

    pub(super) fn remove(&mut self, key: &(Arc<str>, Arc<str>)) -> Option<PendingHold> {
        let hold = self.by_key.remove(key)?;
        match self.per_shop.get_mut(&key.0) {
            Some(n) if *n > 1 => *n -= 1,
            Some(_) => {
                self.per_shop.remove(&key.0);
            }
            // A hold whose shop has no count: the count and the holds have parted, and
            // the per-shop bound would be wrong from here on.
            None => panic!("pending hold {} of shop {} was not counted", key.1, key.0),
        }
        self.assert_paired();
        Some(hold)
    }

    /// Asserts that the counts per shop are the holds per shop (a debug build, while
    /// the holds are few enough to recount at each change).
    fn assert_paired(&self) {
        #[cfg(debug_assertions)]
        if self.by_key.len() <= RECOUNT_HOLDS_MAX {
            let mut counted: HashMap<&str, usize> = HashMap::new();
            for (shop, _) in self.by_key.keys() {
                *counted.entry(shop).or_default() += 1;
            }
            assert_eq!(
                counted.len(),
                self.per_shop.len(),
                "shops with pending holds"
            );
            for (shop, n) in &self.per_shop {
                assert_eq!(
                    counted.get(&**shop).copied(),
                    Some(*n),
                    "pending holds of shop {shop}"
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hold(item: &str) -> PendingHold {
        PendingHold {
            item: item.into(),
            qty: 1,
            expires_at: 0,
            timer: TimingWheel::new(1, 0).insert(0, ()),
            expiries_sent: 0,
            buyer: None,
            tentative: false,
            check: false,
        }
    }

    fn key(shop: &str, id: &str) -> (Arc<str>, Arc<str>) {
        (shop.into(), id.into())
    }

    #[test]
    fn the_count_per_shop_follows_every_hold_in_and_out() {
        let mut holds = PendingHolds::default();
        assert!(holds.insert(key("a", "h1"), hold("x")).is_none());
        assert!(holds.insert(key("a", "h2"), hold("x")).is_none());
        assert!(holds.insert(key("b", "h1"), hold("x")).is_none());
        // The same hold again (armed again from the journal) is not counted twice.
        assert!(holds.insert(key("a", "h1"), hold("y")).is_some());
        assert_eq!(
            (holds.of_shop("a"), holds.of_shop("b"), holds.len()),
            (2, 1, 3)
        );
        assert!(holds.remove(&key("a", "h1")).is_some());
        assert!(holds.remove(&key("a", "h1")).is_none(), "gone already");
        assert!(holds.remove(&key("b", "h1")).is_some());
        assert_eq!(
            (holds.of_shop("a"), holds.of_shop("b"), holds.len()),
            (1, 0, 1)
        );
        assert!(
            !holds.per_shop.contains_key("b"),
            "a shop with none leaves the map"
        );
    }
}
