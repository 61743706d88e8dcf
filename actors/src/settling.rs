//! The orders being settled after a nudge, kept by the engine and used by the orders'
//! endings (`orders.rs`): many lines of one order nudging at once settle it once, and the
//! due ones of shops with a check-back are bounded per shop and per node.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// Due holds and orders of one shop with a check-back settling at once on a node (most
/// of them waiting for their turn to call the shop, which the adapter bounds): past it
/// a due one waits for its processor's next report, a few seconds later, rather than as
/// a task, so a shop whose check-backs are slow holds a bounded number of tasks.
pub const CHECKS_SETTLING_PER_SHOP: usize = 1_000;
/// [`CHECKS_SETTLING_PER_SHOP`] over every shop.
pub const CHECKS_SETTLING_MAX: usize = 20_000;

/// The orders being settled after a nudge, so that many lines of one order nudging at
/// once settle it once; and how many of them wait on a shop's check-back.
#[derive(Default)]
pub(crate) struct Settling(Mutex<SettlingSet>);

#[derive(Default)]
struct SettlingSet {
    /// Each key settling, and whether it counts as a check.
    keys: HashMap<(Arc<str>, Arc<str>), bool>,
    checks_of: HashMap<Arc<str>, usize>,
    checks: usize,
}

impl Settling {
    /// Whether `key` may settle now: not already settling, and (`check`: a due one of a
    /// shop with a check-back) within the bounds of checks settling.
    pub(crate) fn take(&self, key: &(Arc<str>, Arc<str>), check: bool) -> bool {
        let Ok(mut s) = self.0.lock() else {
            return false;
        };
        if s.keys.contains_key(key) {
            return false;
        }
        if check {
            let of_shop = s.checks_of.get(&key.0).copied().unwrap_or(0);
            if of_shop >= CHECKS_SETTLING_PER_SHOP || s.checks >= CHECKS_SETTLING_MAX {
                return false;
            }
            s.checks_of.insert(key.0.clone(), of_shop + 1);
            s.checks += 1;
        }
        s.keys.insert(key.clone(), check);
        true
    }

    pub(crate) fn done(&self, key: &(Arc<str>, Arc<str>)) {
        let Ok(mut s) = self.0.lock() else {
            return;
        };
        if s.keys.remove(key) == Some(true) {
            s.checks -= 1;
            if let Some(n) = s.checks_of.get_mut(&key.0) {
                *n -= 1;
                if *n == 0 {
                    s.checks_of.remove(&key.0);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checks_settling_are_bounded_per_shop_and_freed_when_done() {
        let settling = Settling::default();
        let key = |shop: &str, i: usize| -> (Arc<str>, Arc<str>) {
            (shop.into(), format!("h-{i}").into())
        };
        for i in 0..CHECKS_SETTLING_PER_SHOP {
            assert!(settling.take(&key("slow", i), true));
        }
        assert!(!settling.take(&key("slow", 0), false), "already settling");
        assert!(
            !settling.take(&key("slow", usize::MAX), true),
            "past the shop's bound"
        );
        assert!(
            settling.take(&key("slow", usize::MAX), false),
            "not a check"
        );
        assert!(settling.take(&key("other", 0), true), "another shop's");
        settling.done(&key("slow", 0));
        assert!(
            settling.take(&key("slow", usize::MAX - 1), true),
            "a turn freed"
        );
        for i in 1..CHECKS_SETTLING_PER_SHOP {
            settling.done(&key("slow", i));
        }
        settling.done(&key("slow", usize::MAX - 1));
        settling.done(&key("other", 0));
        let s = settling.0.lock().unwrap();
        assert_eq!((s.checks, s.checks_of.len()), (0, 0));
    }
}
