//! Per-buyer limits: an item loaded with `per_buyer_max` N lets no buyer hold
//! more than N of its units at once, counting what each buyer bought and has reserved.
//!
//! A buyer's units are their `ok` sales and holds, less their returns and the holds that
//! went back (released or expired); a confirmed hold stays counted, as a sale. Units
//! never go below 0. The count starts when the limit is set: sales before it do not
//! count. A load with `per_buyer_max` 0 lifts the limit and forgets the counts.
//!
//! One set of rules, used three ways: the processor decides with it ([`BuyerLedger::check`]
//! and [`BuyerLedger::apply`]); the embedded journal's views keep the counts from the
//! entries as they are written; and a journal that keeps every entry rebuilds an item's
//! ledger by folding its entries ([`fold`]). Entries carry what it needs: the buyer (a
//! hold's ending carries its hold's buyer) and, on a load, `per_buyer_max`.

use std::collections::HashMap;
use std::sync::Arc;

use crate::types::{Entry, Op, Status};

/// Most buyers one limited item counts at once. A buyer beyond it, with no units yet,
/// is refused `buyer_limit` (saying why) until others' units go back to 0: the bound
/// keeps a hot item's count at about 100,000 × 0.1 KB = 10 MB.
pub const BUYERS_PER_ITEM_MAX: usize = 100_000;

/// An item's limit and each buyer's units under it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BuyerLedger {
    pub max: i64,
    /// Buyers with units above 0.
    pub units: HashMap<Arc<str>, i64>,
}

impl BuyerLedger {
    pub fn new(max: i64) -> BuyerLedger {
        BuyerLedger {
            max,
            units: HashMap::new(),
        }
    }

    /// Why a request of `qty` units by `buyer` would pass the limit, `None` if it may go
    /// ahead. Called for the requests that take stock (sales and holds).
    pub fn check(&self, item: &str, buyer: Option<&Arc<str>>, qty: i64) -> Option<String> {
        let Some(buyer) = buyer else {
            return Some(format!(
                "item {item} allows at most {} per buyer: the request must name its buyer",
                self.max
            ));
        };
        let has = self.units.get(buyer).copied().unwrap_or(0);
        if has + qty > self.max {
            return Some(format!(
                "buyer {buyer} has {has} of item {item}, and may have at most {}: {qty} more \
                 would pass it",
                self.max
            ));
        }
        if has == 0 && self.units.len() >= BUYERS_PER_ITEM_MAX {
            return Some(format!(
                "item {item} already counts {BUYERS_PER_ITEM_MAX} buyers, its bound: a new \
                 buyer can be counted once another's units go back to 0"
            ));
        }
        None
    }

    /// How many more units `buyer` may take under the limit (0 for no buyer).
    pub fn room(&self, buyer: Option<&Arc<str>>) -> i64 {
        buyer.map_or(0, |b| {
            (self.max - self.units.get(b).copied().unwrap_or(0)).max(0)
        })
    }

    /// Adds `delta` to `buyer`'s units (never below 0); their units after it.
    pub fn apply(&mut self, buyer: &Arc<str>, delta: i64) -> i64 {
        let units = (self.units.get(buyer).copied().unwrap_or(0) + delta).max(0);
        if units == 0 {
            self.units.remove(buyer);
        } else {
            self.units.insert(buyer.clone(), units);
        }
        units
    }
}

/// The change an entry makes to its buyer's units, if any: `ok` sales and holds add
/// their quantity; returns and holds that went back take it away.
pub fn delta(e: &Entry) -> Option<(&Arc<str>, i64)> {
    // An order's record is not stock: its lines count, each on its own item.
    if e.status != Status::Ok || crate::types::is_order_item(&e.item) {
        return None;
    }
    let buyer = e.buyer.as_ref()?;
    match e.op {
        Op::Decrement | Op::Hold => Some((buyer, e.qty)),
        Op::Increment | Op::Release | Op::Expire => Some((buyer, -e.qty)),
        Op::Confirm
        | Op::Load
        | Op::Adjust
        | Op::Order
        | Op::Firm
        | Op::Extend
        | Op::SoldOut
        | Op::LowStock
        | Op::BackInStock
        | Op::ReleaseHolds => None,
    }
}

/// What a load entry does to the limit: `Some(0)` lifts it, `Some(n)` sets it to `n`.
pub fn limit_set(e: &Entry) -> Option<i64> {
    (e.op == Op::Load && e.status == Status::Ok)
        .then_some(e.per_buyer_max)
        .flatten()
}

/// Moves `ledger` (the item's, `None` while it has no limit) past one of its entries.
pub fn step(ledger: &mut Option<BuyerLedger>, e: &Entry) {
    match limit_set(e) {
        Some(0) => *ledger = None,
        Some(max) => ledger.get_or_insert_with(|| BuyerLedger::new(max)).max = max,
        None => {
            if let (Some(l), Some((buyer, d))) = (ledger.as_mut(), delta(e)) {
                l.apply(buyer, d);
            }
        }
    }
}

/// An item's ledger from all its entries, in seq order.
pub fn fold<'a>(entries: impl IntoIterator<Item = &'a Entry>) -> Option<BuyerLedger> {
    let mut ledger = None;
    for e in entries {
        step(&mut ledger, e);
    }
    ledger
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(op: Op, qty: i64, buyer: Option<&str>) -> Entry {
        Entry {
            buyer: buyer.map(Into::into),
            ..Entry::decided("s".into(), "i".into(), op, qty, 0, 0)
        }
    }

    fn load(max: i64) -> Entry {
        Entry {
            per_buyer_max: Some(max),
            ..entry(Op::Load, 100, None)
        }
    }

    #[test]
    fn units_count_sales_and_holds_less_returns_and_holds_that_went_back() {
        let entries = [
            entry(Op::Decrement, 1, Some("b")), // before the limit: not counted
            load(5),
            entry(Op::Decrement, 2, Some("b")),
            entry(Op::Hold, 2, Some("b")),
            entry(Op::Confirm, 2, Some("b")),
            entry(Op::Hold, 1, Some("b")),
            entry(Op::Expire, 1, Some("b")),
            entry(Op::Increment, 1, Some("b")),
            entry(Op::Decrement, 3, Some("c")),
            Entry {
                status: Status::InsufficientStock,
                ..entry(Op::Decrement, 3, Some("c"))
            },
            entry(Op::Increment, 9, Some("c")), // never below 0
        ];
        let l = fold(&entries).unwrap();
        assert_eq!(l.max, 5);
        assert_eq!(l.units.get("b"), Some(&3));
        assert_eq!(l.units.get("c"), None);
        // b has 3 of at most 5: 2 more may go, 3 may not.
        assert!(l.check("i", Some(&"b".into()), 3).is_some());
        assert!(l.check("i", Some(&"b".into()), 2).is_none());
        assert!(l
            .check("i", None, 1)
            .unwrap()
            .contains("must name its buyer"));
        // A new max keeps the counts; 0 lifts the limit.
        let mut more = entries.to_vec();
        more.push(load(10));
        assert_eq!(fold(&more).unwrap().units.get("b"), Some(&3));
        more.push(load(0));
        assert_eq!(fold(&more), None);
    }

    #[test]
    fn a_new_buyer_past_the_bound_is_refused_saying_why() {
        let mut l = BuyerLedger::new(1);
        for i in 0..BUYERS_PER_ITEM_MAX {
            l.apply(&format!("b{i}").into(), 1);
        }
        let why = l.check("i", Some(&"new".into()), 1).unwrap();
        assert!(why.contains("its bound"), "{why}");
        assert!(l.check("i", Some(&"b7".into()), 0).is_none());
        l.apply(&"b7".into(), -1);
        assert!(l.check("i", Some(&"new".into()), 1).is_none());
    }
}
