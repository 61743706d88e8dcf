//! A WorkManager's recent outcomes, kept in memory so that a repeat or a poll of a key
//! decided lately is answered without a read of the journal.
//!
//! Two generations, not a queue of keys: outcomes go into the young map; once it holds
//! half the shop's share, the old map is dropped whole and the young one takes its
//! place. A queue evicted the oldest outcome at every new one, a hash and a probe of a
//! map entry thousands of outcomes old, whose memory was cold (1.8% of the server's CPU
//! on `hot-sales`, 3.3% on `orders`; docs/decisions/request-path.md). The cache now
//! holds between half its share and all of it, and forgets by halves.
//!
//! A key decided again (a line told to wait, then decided) has its newer outcome in the
//! young map, which is read first; the older one, if it is in the old map, is shadowed
//! until that map goes.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use crate::types::{KeyHash, Outcome};

type Map = HashMap<Arc<str>, Arc<Outcome>, KeyHash>;

#[derive(Default)]
pub struct RecentOutcomes {
    young: Map,
    old: Map,
}

impl RecentOutcomes {
    pub fn get(&self, key: &str) -> Option<&Arc<Outcome>> {
        self.young.get(key).or_else(|| self.old.get(key))
    }

    /// Outcomes held, shadowed ones included: what `cached` counts of this cache.
    pub fn len(&self) -> usize {
        self.young.len() + self.old.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Keeps `outcome`, within `share` outcomes of this cache and `total` of all the
    /// caches that count in `cached`: past the total, this cache forgets its old
    /// generation, then its young one (the journal has them all).
    pub fn keep(
        &mut self,
        outcome: Arc<Outcome>,
        share: usize,
        total: usize,
        cached: &AtomicUsize,
    ) {
        if share == 0 {
            return;
        }
        if self
            .young
            .insert(outcome.request_key.clone(), outcome)
            .is_none()
        {
            cached.fetch_add(1, Ordering::Relaxed);
        }
        // Old at most half, young under half: the two within `share`. The old
        // generation's table, emptied, is the next young one: the size a generation
        // grows to, so the young one does not grow again from nothing.
        if self.young.len() >= share.div_ceil(2) {
            self.forget_old(cached);
            std::mem::swap(&mut self.old, &mut self.young);
        }
        if cached.load(Ordering::Relaxed) > total {
            // Past the total: what is forgotten gives its memory back, tables and all.
            while cached.load(Ordering::Relaxed) > total && !self.is_empty() {
                if self.old.is_empty() {
                    std::mem::swap(&mut self.old, &mut self.young);
                }
                self.forget_old(cached);
            }
            self.old = Map::default();
            if self.young.is_empty() {
                self.young = Map::default();
            }
        }
    }

    /// Forgets everything, memory and all, and gives it back to `cached`.
    pub fn clear(&mut self, cached: &AtomicUsize) {
        self.forget_old(cached);
        self.old = std::mem::take(&mut self.young);
        self.forget_old(cached);
        self.old = Map::default();
    }

    /// Empties the old generation (its table stays) and gives its count back.
    fn forget_old(&mut self, cached: &AtomicUsize) {
        let prev = cached.fetch_sub(self.old.len(), Ordering::Relaxed);
        debug_assert!(
            prev >= self.old.len(),
            "cached outcomes forgotten that were never counted"
        );
        self.old.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::{Op, Status};

    fn outcome(key: &str, status: Status) -> Arc<Outcome> {
        let o: Outcome = serde_json::from_value(serde_json::json!({
            "shop": "s", "request_key": key, "status": status, "reason": null,
            "item": "i", "op": Op::Decrement, "qty": 1, "stock_before": 1,
            "stock_after": 0, "seq": 1, "prev_seq": null, "submitted_at": 0,
            "completed_at": 0,
        }))
        .expect("an outcome");
        Arc::new(o)
    }

    #[test]
    fn keeps_between_half_its_share_and_all_of_it_and_the_newest_always() {
        let cached = AtomicUsize::new(0);
        let mut cache = RecentOutcomes::default();
        for i in 0..1_000 {
            cache.keep(
                outcome(&format!("k{i}"), Status::Ok),
                10,
                1_000_000,
                &cached,
            );
            assert!((1..=10).contains(&cache.len()), "{} after {i}", cache.len());
            assert_eq!(cached.load(Ordering::Relaxed), cache.len());
            assert!(cache.get(&format!("k{i}")).is_some(), "the newest, k{i}");
            if i >= 10 {
                assert!(cache.len() >= 5, "{} after {i}", cache.len());
                assert!(cache.get(&format!("k{}", i - 4)).is_some());
                assert!(cache.get(&format!("k{}", i - 10)).is_none());
            }
        }
        cache.clear(&cached);
        assert_eq!((cache.len(), cached.load(Ordering::Relaxed)), (0, 0));
        assert!(cache.get("k999").is_none());
    }

    #[test]
    fn an_odd_share_of_one_keeps_one() {
        let cached = AtomicUsize::new(0);
        let mut cache = RecentOutcomes::default();
        for i in 0..5 {
            cache.keep(outcome(&format!("k{i}"), Status::Ok), 1, 100, &cached);
            assert_eq!(cache.len(), 1);
            assert!(cache.get(&format!("k{i}")).is_some());
        }
        cache.keep(outcome("none", Status::Ok), 0, 100, &cached);
        assert!(cache.get("none").is_none(), "a share of 0 keeps nothing");
    }

    #[test]
    fn the_total_over_every_cache_is_kept_by_the_one_that_passes_it() {
        let cached = AtomicUsize::new(0);
        let (mut a, mut b) = (RecentOutcomes::default(), RecentOutcomes::default());
        for i in 0..8 {
            a.keep(outcome(&format!("a{i}"), Status::Ok), 100, 10, &cached);
        }
        for i in 0..20 {
            b.keep(outcome(&format!("b{i}"), Status::Ok), 100, 10, &cached);
            assert!(cached.load(Ordering::Relaxed) <= 10);
            assert_eq!(cached.load(Ordering::Relaxed), a.len() + b.len());
        }
        assert_eq!(a.len(), 8, "the other cache keeps its own");
        assert!(b.len() <= 2);
    }

    #[test]
    fn a_key_decided_again_answers_its_newest_outcome() {
        let cached = AtomicUsize::new(0);
        let mut cache = RecentOutcomes::default();
        cache.keep(outcome("k", Status::InsufficientStock), 4, 100, &cached);
        cache.keep(outcome("x", Status::Ok), 4, 100, &cached);
        assert!(cache.old.contains_key("k"), "k has aged");
        cache.keep(outcome("k", Status::Ok), 4, 100, &cached);
        assert_eq!(cache.get("k").map(|o| o.status), Some(Status::Ok));
        assert_eq!(cached.load(Ordering::Relaxed), cache.len());
    }

    #[test]
    fn a_generation_reuses_the_table_of_the_one_it_replaces_and_the_total_frees_them() {
        let cached = AtomicUsize::new(0);
        let mut cache = RecentOutcomes::default();
        for i in 0..2_000 {
            cache.keep(outcome(&format!("k{i}"), Status::Ok), 200, 100_000, &cached);
        }
        // Generations of 100: the young one starts at the size the last one grew to.
        assert!(cache.young.capacity() >= 100, "{}", cache.young.capacity());
        assert_eq!(cached.load(Ordering::Relaxed), cache.len());
        // Past the total, the forgotten generations give their memory back.
        cache.keep(outcome("over", Status::Ok), 200, 1, &cached);
        assert_eq!(cache.len(), 1);
        assert!(cache.get("over").is_some(), "the newest stays");
        assert_eq!(cache.old.capacity(), 0);
        assert_eq!(cached.load(Ordering::Relaxed), 1);
        cache.keep(outcome("again", Status::Ok), 200, 100_000, &cached);
        cache.clear(&cached);
        assert_eq!((cache.old.capacity(), cache.young.capacity()), (0, 0));
    }
}
