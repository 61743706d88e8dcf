//! Capacity a queue or table keeps once a burst has passed.
//!
//! A `VecDeque` or `HashMap` grows to the largest backlog it ever held and keeps that
//! capacity: a shard's mailbox that once queued 131,072 requests (248 bytes each) kept
//! 31 MiB, and a shop's table of requests in flight 14 MiB at 200,000 undecided, long after
//! both were empty. The admission bounds (`--inflight-max`, `--shop-pending-max`) bound what
//! is held during a burst, not what stays allocated after it; with eight shards and a
//! WorkManager per shop, that was about 100 MB held at idle after the repeated-burst case
//! (`scripts/faults_burst.py`, measured with mimalloc's statistics: 106 MiB of blocks
//! over 512 KiB still allocated, growing round after round).
//!
//! The rule: once a collection holds a quarter of its capacity or less, and the capacity
//! is past [`KEPT`], it shrinks to twice what it holds (at least [`KEPT`]). Callers check
//! it once per batch or per sweep, never per request. Shrinking as the backlog drains
//! gives memory back by halves; a backlog that comes back regrows by doubling, about two
//! moves of an entry per entry queued, paid only while more than [`KEPT`] wait.

use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasher, Hash};

/// Entries a collection keeps room for, whatever it held: 4,096 mailbox entries are about
/// 1 MiB, so eight shards' two lanes keep at most 16 MiB between bursts.
pub const KEPT: usize = 4_096;

/// Whether a collection of `len` entries in `capacity` should shrink, and to what.
fn target(len: usize, capacity: usize) -> Option<usize> {
    (capacity > KEPT && len <= capacity / 4).then(|| (len * 2).max(KEPT))
}

/// Shrinks `queue` after a burst (see the module's rule).
pub fn queue<T>(queue: &mut VecDeque<T>) {
    if let Some(to) = target(queue.len(), queue.capacity()) {
        queue.shrink_to(to);
    }
}

/// Shrinks `map` after a burst (see the module's rule).
pub fn map<K: Eq + Hash, V, S: BuildHasher>(map: &mut HashMap<K, V, S>) {
    if let Some(to) = target(map.len(), map.capacity()) {
        map.shrink_to(to);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_queue_emptied_after_a_burst_gives_back_all_but_the_kept_room() {
        let mut q: VecDeque<u64> = (0..200_000).collect();
        let grown = q.capacity();
        assert!(grown >= 200_000);
        q.truncate(100_000);
        queue(&mut q);
        assert_eq!(q.capacity(), grown, "half full: kept, it may fill again");
        q.clear();
        queue(&mut q);
        assert!(
            q.capacity() >= KEPT && q.capacity() < 2 * KEPT,
            "{}",
            q.capacity()
        );
        assert!(q.capacity() < grown / 16);
    }

    #[test]
    fn a_map_draining_shrinks_by_halves_and_keeps_what_it_holds() {
        let mut m: HashMap<u64, u64> = (0..100_000).map(|i| (i, i)).collect();
        let grown = m.capacity();
        // A map's capacity counts the room left before it grows, which the tombstones of
        // removed entries take: after `retain` it reads less than its buckets hold.
        m.retain(|k, _| *k < 10_000);
        map(&mut m);
        assert!(
            m.capacity() >= 10_000 && m.capacity() < grown / 2,
            "{}",
            m.capacity()
        );
        assert_eq!(m.len(), 10_000);
        assert_eq!(m.get(&9_999), Some(&9_999));
        m.clear();
        map(&mut m);
        assert!(
            m.capacity() >= KEPT && m.capacity() < 4 * KEPT,
            "{}",
            m.capacity()
        );
    }

    #[test]
    fn a_small_collection_is_never_touched() {
        let mut q: VecDeque<u64> = VecDeque::with_capacity(KEPT);
        let before = q.capacity();
        queue(&mut q);
        assert_eq!(q.capacity(), before);
    }
}
