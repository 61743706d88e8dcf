//! The items a shard keeps in memory: each item's state twice (as the next request is
//! judged against it, and as the journal has it), the per-buyer ledgers of the limited
//! ones, how many there are, and which leave memory when there are too many.
//!
//! A part of its own because its count is a bound ([`super::ShardShared::items_max`])
//! that every insertion and removal must keep true: they all go through here.

use std::collections::HashMap;
use std::sync::Arc;

use prometheus::IntGauge;

use crate::ledger::BuyerLedger;
use crate::types::{ItemState, ItemView, KeyHash};

use super::ItemRead;

/// An item by shop and item name.
pub(super) type ItemKey = (Arc<str>, Arc<str>);

/// Of the items past the bound, this share of the bound leaves at once, so the scan
/// that picks them runs once per that many new items, not once per item.
const EVICT_SHARE: usize = 64;

/// Up to this many items, a debug build recounts them at each insertion or removal and
/// asserts the count is right (more would make tests with many items slow).
#[cfg(debug_assertions)]
const RECOUNT_ITEMS_MAX: usize = 1_024;

/// An item's state twice: `live` is what the next request is judged against; `journaled`
/// is what the journal holds, and what readers are shown.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Slot {
    pub(super) live: ItemState,
    pub(super) journaled: ItemState,
    /// The partition assignment epoch under which `live` was read or last checked
    /// against the journal (a shared log and journal only).
    pub(super) epoch: u64,
    /// The id of the last batch that touched the item: the idle ones with the lowest
    /// leave memory first.
    used: u64,
}

impl Slot {
    fn read(state: ItemState, epoch: u64) -> Slot {
        Slot {
            live: state,
            journaled: state,
            epoch,
            used: 0,
        }
    }

    /// Whether the item may leave memory: the journal has its state (no batch in flight
    /// touches it) and no pending hold refers to it.
    fn evictable(&self) -> bool {
        self.live == self.journaled && self.live.reserved == 0
    }
}

pub(super) struct Items {
    /// Items by shop, then by item: a request carries both, and nesting avoids building
    /// a composite key per lookup. A shop with no item here has no entry. Two lookups
    /// per decision, of names callers choose: [`KeyHash`].
    by_shop: HashMap<Arc<str>, HashMap<Arc<str>, Slot, KeyHash>, KeyHash>,
    /// Items in `by_shop`, and the most kept there ([`super::ShardShared::items_max`]).
    resident: usize,
    max: usize,
    /// This shard's share of `nrtxn_bound_used{bound="items"}`: follows `resident`.
    gauge: IntGauge,
    /// Whether every item the journal knows on this shard is in memory (nothing left
    /// since the start): then an item missing from `by_shop` is unknown, and is not
    /// looked up in the journal.
    complete: bool,
    /// The per-buyer limits and counts of the limited items in memory
    /// ([`crate::ledger`]). A limited item stays in memory (see [`Items::evict`]).
    ledgers: HashMap<ItemKey, BuyerLedger>,
}

impl Items {
    /// The items recovered at start, all of them: the shard is complete until one leaves.
    pub(super) fn new(
        initial: Vec<(Arc<str>, Arc<str>, ItemState)>,
        ledgers: Vec<(Arc<str>, Arc<str>, BuyerLedger)>,
        max: usize,
        gauge: IntGauge,
    ) -> Items {
        let mut by_shop: HashMap<Arc<str>, HashMap<Arc<str>, Slot, KeyHash>, KeyHash> =
            HashMap::default();
        let mut resident = 0;
        for (shop, item, state) in initial {
            if by_shop
                .entry(shop)
                .or_default()
                .insert(item, Slot::read(state, 0))
                .is_none()
            {
                resident += 1;
            }
        }
        gauge.add(resident as i64);
        let items = Items {
            by_shop,
            resident,
            max: max.max(1),
            gauge,
            complete: true,
            ledgers: ledgers
                .into_iter()
                .map(|(shop, item, l)| ((shop, item), l))
                .collect(),
        };
        items.assert_counted();
        items
    }

    pub(super) fn get(&self, shop: &Arc<str>, item: &Arc<str>) -> Option<&Slot> {
        self.by_shop.get(shop)?.get(item)
    }

    pub(super) fn get_mut(&mut self, shop: &Arc<str>, item: &Arc<str>) -> Option<&mut Slot> {
        self.by_shop.get_mut(shop)?.get_mut(item)
    }

    pub(super) fn contains(&self, shop: &Arc<str>, item: &Arc<str>) -> bool {
        self.get(shop, item).is_some()
    }

    /// See [`Items::complete`]'s field.
    pub(super) fn complete(&self) -> bool {
        self.complete
    }

    /// What a reader is told of an item ([`super::GetItem`]).
    pub(super) fn read(&self, shop: &Arc<str>, item: &Arc<str>) -> ItemRead {
        match self.get(shop, item) {
            // An item whose load is not yet durable does not exist for readers.
            Some(slot) if slot.journaled.seq > 0 => ItemRead::Found(slot.journaled),
            Some(_) => ItemRead::Unknown,
            None if self.complete => ItemRead::Unknown,
            None => ItemRead::AskJournal,
        }
    }

    /// The item's slot, made (at seq 0, under `epoch`) if it is not in memory.
    pub(super) fn slot_for(&mut self, shop: &Arc<str>, item: &Arc<str>, epoch: u64) -> &mut Slot {
        let made = !self.contains(shop, item);
        if made {
            self.inserted(
                shop,
                item,
                Slot {
                    epoch,
                    ..Slot::default()
                },
            );
        }
        self.get_mut(shop, item).expect("the slot was just made")
    }

    /// An item's slot and, if it is limited, its ledger.
    pub(super) fn slot_and_ledger(
        &mut self,
        shop: &Arc<str>,
        item: &Arc<str>,
    ) -> (Option<&mut Slot>, Option<&mut BuyerLedger>) {
        let slot = self.by_shop.get_mut(shop).and_then(|m| m.get_mut(item));
        let ledger = if self.ledgers.is_empty() {
            None
        } else {
            self.ledgers.get_mut(&(shop.clone(), item.clone()))
        };
        (slot, ledger)
    }

    /// A load's `per_buyer_max`: `Some(0)` lifts the item's limit and forgets its
    /// counts, `Some(n)` sets it (keeping the counts), `None` leaves it.
    pub(super) fn set_limit(
        &mut self,
        shop: &Arc<str>,
        item: &Arc<str>,
        per_buyer_max: Option<i64>,
    ) {
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

    /// An item's ledger as the journal has it (`None`: no limit), taken with its state.
    pub(super) fn take_ledger(&mut self, key: ItemKey, ledger: Option<BuyerLedger>) {
        match ledger {
            Some(l) => {
                self.ledgers.insert(key, l);
            }
            None => {
                self.ledgers.remove(&key);
            }
        }
    }

    /// The item's state when a load's condition `if_seq` does not hold: its seq (0 for
    /// an item this shard does not know) is no longer the one given. `None` when the
    /// load may go ahead.
    pub(super) fn seq_moved(
        &self,
        shop: &Arc<str>,
        item: &Arc<str>,
        if_seq: Option<u64>,
    ) -> Option<ItemView> {
        let want = if_seq?;
        let live = self.get(shop, item).map(|s| s.live).unwrap_or_default();
        (live.seq != want).then(|| ItemView::of(shop.clone(), item.clone(), live))
    }

    /// Marks a touched item used by batch `batch_id`; its state as of now.
    pub(super) fn touch(&mut self, shop: &Arc<str>, item: &Arc<str>, batch_id: u64) -> ItemState {
        let slot = self
            .get_mut(shop, item)
            .expect("a touched item is in memory");
        slot.used = batch_id;
        slot.live
    }

    /// What the journal now holds of an item a durable batch touched.
    pub(super) fn set_journaled(&mut self, shop: &Arc<str>, item: &Arc<str>, state: ItemState) {
        if let Some(slot) = self.get_mut(shop, item) {
            // Paired with the apply step's assertion: what became durable is sane.
            assert!(state.stock >= 0 && state.seq >= slot.journaled.seq);
            slot.journaled = state;
        }
    }

    /// An item read back under partition epoch `epoch` (its partition came back), with
    /// its state as the journal has it (`None`: unknown there). `false` when it is
    /// unknown both here and there.
    pub(super) fn reload(
        &mut self,
        shop: Arc<str>,
        item: Arc<str>,
        epoch: u64,
        state: Option<ItemState>,
    ) -> bool {
        match (self.get_mut(&shop, &item), state) {
            (Some(slot), Some(st)) => {
                // Ahead of the journal only by this node's own batches in flight.
                if st.seq >= slot.live.seq {
                    slot.live = st;
                    slot.journaled = st;
                }
                slot.epoch = epoch;
            }
            (Some(slot), None) => slot.epoch = epoch,
            (None, Some(st)) => self.inserted(&shop, &item, Slot::read(st, epoch)),
            (None, None) => return false,
        }
        true
    }

    /// An item that had left memory, read back: taken unless it came back meanwhile.
    pub(super) fn fault_in(&mut self, shop: &Arc<str>, item: &Arc<str>, state: ItemState) {
        if !self.contains(shop, item) {
            self.inserted(shop, item, Slot::read(state, 0));
        }
    }

    /// An item whose entries the journal refused (its partition moved): it leaves
    /// memory, to be read again if the partition comes back.
    pub(super) fn drop_fenced(&mut self, shop: &Arc<str>, item: &Arc<str>) {
        if let Some(m) = self.by_shop.get_mut(shop) {
            if m.remove(item).is_some() {
                assert!(
                    self.resident > 0,
                    "an item left memory that was not counted"
                );
                self.resident -= 1;
                self.gauge.dec();
            }
            if m.is_empty() {
                self.by_shop.remove(shop);
            }
        }
        self.complete = false;
        self.assert_counted();
    }

    /// Past the bound, the idle items used longest ago leave memory, down to the bound
    /// less a share of it. Only items the journal has as they are, without pending holds
    /// and without a buyer limit leave (see [`Slot::evictable`]), so the others may keep
    /// the shard above the bound for as long as they are busy. Not while a batch waits
    /// for reads: it was planned against the items in memory now.
    pub(super) fn evict(&mut self, shard: usize) {
        if self.resident <= self.max {
            return;
        }
        let target = self.max - (self.max / EVICT_SHARE).min(self.max - 1);
        let mut idle: Vec<(u64, Arc<str>, Arc<str>)> = self
            .by_shop
            .iter()
            .flat_map(|(shop, m)| {
                m.iter()
                    .filter(|(item, slot)| {
                        slot.evictable()
                            && (self.ledgers.is_empty()
                                || !self.ledgers.contains_key(&(shop.clone(), (*item).clone())))
                    })
                    .map(|(item, slot)| (slot.used, shop.clone(), item.clone()))
            })
            .collect();
        let n = (self.resident - target).min(idle.len());
        if n == 0 {
            return;
        }
        if n < idle.len() {
            idle.select_nth_unstable_by_key(n, |(used, _, _)| *used);
        }
        for (_, shop, item) in idle.drain(..n) {
            if let Some(m) = self.by_shop.get_mut(&shop) {
                m.remove(&item);
                if m.is_empty() {
                    self.by_shop.remove(&shop);
                }
            }
        }
        self.resident -= n;
        self.gauge.sub(n as i64);
        self.complete = false;
        self.assert_counted();
        tracing::debug!(shard, evicted = n, "idle items left memory");
    }

    /// Puts a slot in that was not there, and counts it.
    fn inserted(&mut self, shop: &Arc<str>, item: &Arc<str>, slot: Slot) {
        let old = self
            .by_shop
            .entry(shop.clone())
            .or_default()
            .insert(item.clone(), slot);
        assert!(
            old.is_none(),
            "item {item} of shop {shop} put in memory twice"
        );
        self.resident += 1;
        self.gauge.inc();
        self.assert_counted();
    }

    /// Asserts that `resident` is the items in memory and no shop is left empty (a
    /// debug build, while the items are few enough to recount at each change).
    fn assert_counted(&self) {
        #[cfg(debug_assertions)]
        if self.resident <= RECOUNT_ITEMS_MAX {
            let counted: usize = self.by_shop.values().map(HashMap::len).sum();
            assert_eq!(counted, self.resident, "items in memory");
            assert!(
                self.by_shop.values().all(|m| !m.is_empty()),
                "a shop with no item in memory"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn items(max: usize) -> Items {
        let gauge = IntGauge::new("items_test", "items").expect("a gauge");
        Items::new(Vec::new(), Vec::new(), max, gauge)
    }

    fn key(s: &str) -> Arc<str> {
        s.into()
    }

    #[test]
    fn every_item_in_or_out_is_counted_once() {
        let mut items = items(10);
        items.slot_for(&key("a"), &key("x"), 0).live.stock = 5;
        items.slot_for(&key("a"), &key("x"), 0);
        items.fault_in(&key("a"), &key("y"), ItemState::default());
        assert!(items.reload(key("b"), key("z"), 3, Some(ItemState::default())));
        assert!(
            !items.reload(key("c"), key("w"), 3, None),
            "unknown both places"
        );
        assert_eq!(items.resident, 3);
        items.drop_fenced(&key("b"), &key("z"));
        items.drop_fenced(&key("b"), &key("z"));
        assert_eq!(items.resident, 2);
        assert!(
            !items.by_shop.contains_key("b"),
            "no empty shop left behind"
        );
        assert!(!items.complete(), "an item left memory");
    }

    #[test]
    fn idle_items_leave_past_the_bound_but_limited_ones_stay() {
        let mut items = items(2);
        for name in ["p", "q", "r", "s"] {
            items.slot_for(&key("a"), &key(name), 0);
        }
        items.set_limit(&key("a"), &key("p"), Some(1));
        items.evict(0);
        assert_eq!(items.resident, 2);
        assert!(items.contains(&key("a"), &key("p")), "a limited item stays");
    }
}
