//! The holds a shard keeps pending, the timing wheel of their expiries, and the endings
//! of holds in batches not yet durable.
//!
//! A part of its own because three things must move together: a pending hold, its one
//! timer in the wheel, and its shop's count (checked against the per-shop bound at
//! every hold). Every hold goes in and out through here (made, recovered, read back,
//! confirmed, cancelled, expired, let go), so none of them can part.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use actix::SpawnHandle;

use crate::types::{is_order_item, now_ms, order_of_line, HoldView, KeyHash, Millis, Outcome};
use crate::wheel::{TimerId, TimingWheel};

use super::items::ItemKey;
use super::{EXPIRY_RESEND_MAX_MS, EXPIRY_RESEND_MS, LINE_GRACE_MS, WHEEL_TICK_MS};

/// A hold by shop and hold id.
pub(super) type HoldKey = (Arc<str>, Arc<str>);

/// A hold the processor keeps until it is confirmed, cancelled or expires.
pub(super) struct PendingHold {
    pub(super) item: Arc<str>,
    pub(super) qty: i64,
    pub(super) expires_at: Millis,
    /// Its expiry's timer in the wheel (one at most).
    timer: TimerId,
    /// Copies of its expiry sent through a shared log so far.
    expiries_sent: u8,
    /// Its buyer, whose units of a limited item go back when it does.
    pub(super) buyer: Option<Arc<str>>,
    /// An order's line whose order is not yet held: counted in
    /// [`super::lines::OrderLines`]'s tentative quantities.
    pub(super) tentative: bool,
    /// An order's record or line read back from the journal, not yet checked with its
    /// order ([`super::Nudge::Recovered`]).
    pub(super) check: bool,
}

pub(super) struct HoldBook {
    /// Pending holds of this shard's items by shop and hold id; at most `max`, and at
    /// most `per_shop_max` of one shop (for holds made here; recovered ones are kept).
    pending: PendingHolds,
    /// The expiry of every pending hold, by shop and hold id.
    wheel: TimingWheel<HoldKey>,
    /// When the actor wakes next for the wheel, and the handle to move that wake-up.
    wake: Option<(u64, SpawnHandle)>,
    /// The endings of holds in batches not yet durable: a confirm or cancel that comes
    /// after one is answered with it (the journal does not have it yet). Bounded by the
    /// batches in flight.
    ended: HashMap<HoldKey, Arc<Outcome>, KeyHash>,
    /// See [`super::ShardShared::holds_max`].
    max: usize,
    /// See [`super::ShardShared::holds_per_shop_max`].
    per_shop_max: usize,
    /// See [`super::ShardShared::hold_expiry_copies`].
    expiry_copies: u8,
}

impl HoldBook {
    pub(super) fn new(max: usize, per_shop_max: usize, expiry_copies: u8) -> HoldBook {
        HoldBook {
            pending: PendingHolds::default(),
            wheel: TimingWheel::new(WHEEL_TICK_MS, now_ms().max(0) as u64),
            wake: None,
            ended: HashMap::default(),
            max,
            per_shop_max,
            expiry_copies,
        }
    }

    pub(super) fn get(&self, key: &HoldKey) -> Option<&PendingHold> {
        self.pending.get(key)
    }

    pub(super) fn contains(&self, key: &HoldKey) -> bool {
        self.pending.contains_key(key)
    }

    /// Why a new hold of `shop` is refused (`limit_exceeded`), `None` if there is room.
    pub(super) fn refusal(&self, shop: &Arc<str>) -> Option<String> {
        if self.pending.len() >= self.max {
            return Some(format!(
                "this shard already keeps {} pending holds, its limit",
                self.max
            ));
        }
        if self.pending.of_shop(shop) >= self.per_shop_max {
            return Some(format!(
                "shop {shop} already keeps {} pending holds on this shard, a shop's limit",
                self.per_shop_max
            ));
        }
        None
    }

    /// Arms the expiry of hold `h`, in place of any hold with its key, which is given
    /// back (its timer cancelled). `recovered`: read back from the journal (a start, or
    /// an item taken over), not just made here; an order's record or line read back is
    /// due at once, to be checked with its order.
    pub(super) fn arm(&mut self, h: HoldView, recovered: bool) -> Option<PendingHold> {
        let order = is_order_item(&h.item) || order_of_line(&h.hold_id).is_some();
        let check = recovered && order;
        let deadline = if check {
            now_ms()
        } else {
            due_at(&h.hold_id, h.expires_at)
        };
        let key = (h.shop, h.hold_id);
        let timer = self.wheel.insert(deadline.max(0) as u64, key.clone());
        let old = self.pending.insert(
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
        );
        if let Some(old) = &old {
            self.wheel.cancel(old.timer);
        }
        self.assert_one_timer_each();
        old
    }

    /// Arms again, at `at`, the timer of a pending hold whose timer fired.
    pub(super) fn rearm(&mut self, key: &HoldKey, at: Millis) {
        if !self.pending.contains_key(key) {
            return;
        }
        let timer = self.wheel.insert(at.max(0) as u64, key.clone());
        if let Some(h) = self.pending.get_mut(key) {
            h.timer = timer;
        }
        self.assert_one_timer_each();
    }

    /// The hold's order was asked to check it ([`super::Nudge::Recovered`] sent).
    pub(super) fn checked(&mut self, key: &HoldKey) {
        if let Some(h) = self.pending.get_mut(key) {
            h.check = false;
        }
    }

    /// One more copy of a fired hold's expiry is sent through the log at `now`, and its
    /// timer armed again ([`expiry_resend_wait`] later) in case the copy is lost; after
    /// the book's `expiry_copies` the hold is let go instead, and the copies sent are
    /// given back as the error.
    pub(super) fn send_expiry(&mut self, key: &HoldKey, now: Millis) -> Result<(), u8> {
        let sent = self.pending.get(key).map_or(0, |h| h.expiries_sent);
        if sent >= self.expiry_copies {
            // Its timer fired: nothing of it is left in the wheel.
            self.pending.remove(key);
            return Err(sent);
        }
        self.rearm(key, now.saturating_add(expiry_resend_wait(sent)));
        if let Some(h) = self.pending.get_mut(key) {
            h.expiries_sent += 1;
        }
        Ok(())
    }

    /// Takes a hold out (it ends), with its timer.
    pub(super) fn end(&mut self, key: &HoldKey) -> Option<PendingHold> {
        let hold = self.pending.remove(key)?;
        self.wheel.cancel(hold.timer);
        self.assert_one_timer_each();
        Some(hold)
    }

    /// Gives a pending hold a new expiry (its shop's check-back answered); `false` if it
    /// is not pending.
    pub(super) fn extend(&mut self, key: &HoldKey, expires_at: Millis) -> bool {
        let Some(h) = self.pending.get_mut(key) else {
            return false;
        };
        let timer = self
            .wheel
            .insert(due_at(&key.1, expires_at).max(0) as u64, key.clone());
        self.wheel.cancel(h.timer);
        h.timer = timer;
        h.expires_at = expires_at;
        h.check = false;
        h.expiries_sent = 0;
        self.assert_one_timer_each();
        true
    }

    /// Marks a line just held tentative (its order is not yet held).
    pub(super) fn make_tentative(&mut self, key: &HoldKey) {
        if let Some(h) = self.pending.get_mut(key) {
            h.tentative = true;
        }
    }

    /// A tentative line made firm (its order is held): its item and quantity, to take
    /// out of the item's tentative count. `None` if it is not pending or not tentative.
    pub(super) fn firm(&mut self, key: &HoldKey) -> Option<(Arc<str>, i64)> {
        let h = self.pending.get_mut(key)?;
        if !h.tentative {
            return None;
        }
        h.tentative = false;
        Some((h.item.clone(), h.qty))
    }

    /// Drops the pending holds of items read back from the journal (their partition
    /// came back): the journal's replace them, since the node that owned the items
    /// meanwhile may have made, confirmed or expired some.
    pub(super) fn forget_moved(&mut self, moved: &HashSet<ItemKey>) {
        let gone: Vec<HoldKey> = self
            .pending
            .iter()
            .filter(|((shop, _), h)| moved.contains(&(shop.clone(), h.item.clone())))
            .map(|(k, _)| k.clone())
            .collect();
        for key in gone {
            self.end(&key);
        }
    }

    /// The holds whose timers are due by `now`.
    pub(super) fn fire(&mut self, now: Millis) -> Vec<HoldKey> {
        let mut fired = Vec::new();
        self.wheel.advance(now.max(0) as u64, &mut fired);
        fired.into_iter().map(|(_, key)| key).collect()
    }

    /// When the actor should wake for the next expiry, if earlier than the wake-up set;
    /// with the handle of that wake-up, to cancel.
    pub(super) fn wake_needed(&self) -> Option<(u64, Option<SpawnHandle>)> {
        let next = self.wheel.next_deadline_hint()?;
        match self.wake {
            Some((at, _)) if at <= next => None,
            Some((_, handle)) => Some((next, Some(handle))),
            None => Some((next, None)),
        }
    }

    pub(super) fn set_wake(&mut self, at: u64, handle: SpawnHandle) {
        self.wake = Some((at, handle));
    }

    /// The wake-up came.
    pub(super) fn woke(&mut self) {
        self.wake = None;
    }

    /// The ending of a hold in a batch not yet durable.
    pub(super) fn note_ended(&mut self, key: HoldKey, outcome: Arc<Outcome>) {
        // Its ending took it out of the pending holds just before.
        debug_assert!(
            !self.pending.contains_key(&key),
            "an ended hold still pending"
        );
        self.ended.insert(key, outcome);
    }

    pub(super) fn ended(&self, key: &HoldKey) -> Option<&Arc<Outcome>> {
        self.ended.get(key)
    }

    /// The batch with the ending is durable: the journal answers for it now.
    pub(super) fn retire_ended(&mut self, key: &HoldKey) {
        self.ended.remove(key);
    }

    /// Each pending hold has one timer at most (none while its expiry is on its way), so
    /// the wheel never holds more timers than there are pending holds.
    fn assert_one_timer_each(&self) {
        debug_assert!(
            self.wheel.len() <= self.pending.len(),
            "{} timers for {} pending holds",
            self.wheel.len(),
            self.pending.len()
        );
    }
}

/// How long after sending copy `sent` (from 0) of a hold's expiry through the log the
/// next is sent, while the hold is still pending here: [`EXPIRY_RESEND_MS`] doubled
/// after each copy, at most [`EXPIRY_RESEND_MAX_MS`]. Copies lost to an outage of the log
/// are sent again after it without flooding it meanwhile.
pub(super) fn expiry_resend_wait(sent: u8) -> Millis {
    let wait = EXPIRY_RESEND_MS.saturating_mul(1u64 << sent.min(32));
    wait.min(EXPIRY_RESEND_MAX_MS) as Millis
}

/// When a pending hold's timer is due: a hold's or an order record's at its expiry; an
/// order's line a grace period later, since its order's own expiry ends it (the line's
/// timer only makes sure it is not forgotten if that ending is lost).
pub(super) fn due_at(hold_id: &str, expires_at: Millis) -> Millis {
    if order_of_line(hold_id).is_some() {
        expires_at.saturating_add(LINE_GRACE_MS)
    } else {
        expires_at
    }
}

/// The pending holds of a shard, by shop and hold id, with how many each shop has: the
/// per-shop bound ([`super::ShardShared::holds_per_shop_max`]) is checked against that count at
/// every hold, so it is kept here, where every hold goes in and out (made, recovered,
/// read back, confirmed, cancelled, expired, let go), rather than recounted.
#[derive(Default)]
struct PendingHolds {
    by_key: HashMap<(Arc<str>, Arc<str>), PendingHold, KeyHash>,
    /// Pending holds per shop; a shop with none has no entry, so the map stays as small
    /// as the shops with holds on this shard.
    per_shop: HashMap<Arc<str>, usize, KeyHash>,
}

/// Up to this many pending holds, a debug build recounts the holds per shop at each
/// change and asserts the counts match (more would make tests with many holds slow).
#[cfg(debug_assertions)]
const RECOUNT_HOLDS_MAX: usize = 1_024;

impl PendingHolds {
    fn len(&self) -> usize {
        self.by_key.len()
    }

    /// Pending holds of `shop` on this shard.
    fn of_shop(&self, shop: &str) -> usize {
        self.per_shop.get(shop).copied().unwrap_or(0)
    }

    fn get(&self, key: &(Arc<str>, Arc<str>)) -> Option<&PendingHold> {
        self.by_key.get(key)
    }

    fn get_mut(&mut self, key: &(Arc<str>, Arc<str>)) -> Option<&mut PendingHold> {
        self.by_key.get_mut(key)
    }

    fn contains_key(&self, key: &(Arc<str>, Arc<str>)) -> bool {
        self.by_key.contains_key(key)
    }

    fn iter(&self) -> impl Iterator<Item = (&(Arc<str>, Arc<str>), &PendingHold)> {
        self.by_key.iter()
    }

    /// Puts a hold in (or in place of the one with its key, which is returned).
    fn insert(&mut self, key: (Arc<str>, Arc<str>), hold: PendingHold) -> Option<PendingHold> {
        let shop = key.0.clone();
        let old = self.by_key.insert(key, hold);
        if old.is_none() {
            *self.per_shop.entry(shop).or_default() += 1;
        }
        self.assert_paired();
        old
    }

    fn remove(&mut self, key: &(Arc<str>, Arc<str>)) -> Option<PendingHold> {
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

    #[test]
    fn a_holds_expiry_is_sent_again_for_minutes_at_waits_that_double_then_let_go() {
        use super::super::EXPIRY_SENDS_MAX as MAX;
        let waits: Vec<Millis> = (0..MAX).map(expiry_resend_wait).collect();
        assert_eq!(
            &waits[..7],
            &[1_000, 2_000, 4_000, 8_000, 16_000, 32_000, 60_000]
        );
        assert!(waits[7..].iter().all(|w| *w == 60_000));
        // About ten minutes of copies: an outage of the log shorter than that ends the hold.
        let span: Millis = waits.iter().sum();
        assert!((9 * 60_000..=11 * 60_000).contains(&span), "{span} ms");

        let mut book = HoldBook::new(10, 10, MAX);
        let mut t = now_ms();
        book.arm(
            HoldView {
                hold_id: "h1".into(),
                status: crate::types::HoldStatus::Held,
                shop: "a".into(),
                item: "x".into(),
                qty: 1,
                expires_at: t,
                seq: 1,
                buyer: None,
            },
            false,
        );
        let k = key("a", "h1");
        assert_eq!(book.fire(t), vec![k.clone()]);
        for wait in waits {
            assert_eq!(book.send_expiry(&k, t), Ok(()));
            assert!(book.fire(t + wait - 1).is_empty(), "not before its wait");
            t += wait;
            assert_eq!(book.fire(t), vec![k.clone()], "armed again after {wait} ms");
        }
        assert_eq!(book.send_expiry(&k, t), Err(MAX));
        assert!(!book.contains(&k), "let go after the last copy");
    }
}
