//! One filter over the keys of every sealed segment, so that asking whether a key is new
//! costs one cache line however many segments the key window keeps
//! (`docs/decisions/derived-views.md`, "One filter for the sealed segments").
//!
//! Each sealed segment also has its own filter (in its index file), about 1% false
//! positives. Asked one by one, they cost a memory access per segment and their false
//! positives add up: with 70 segments most new keys looked like repeats and were read
//! from the log. This filter is built from the sealed indexes' key blocks off the
//! request path (the journal's maintenance thread), extended as segments are sealed, and
//! built again, sized for the keys kept, once retired segments' keys or new ones have
//! filled it. The segments it does not cover yet (sealed since, or before it is first
//! built) are still asked one by one: it is a shortcut, never the only record.
//!
//! Its bits are atomic: the maintenance thread sets bits while readers test them. A bit
//! set early only adds a false positive; a segment counts as covered only once all its
//! keys are in (the facade moves `through` under its lock after the inserts).

use std::sync::atomic::{AtomicU64, Ordering};

use super::filter;

/// The fewest keys the filter is sized for: 1.25 MiB at 10 bits per key.
pub const CAPACITY_MIN: u64 = 1 << 20;

/// A blocked Bloom filter of [`filter`]'s layout, in 64-bit words that may be set while
/// they are read.
pub struct SealedKeys {
    words: Box<[AtomicU64]>,
    /// The keys it is sized for at about 1% false positives.
    capacity: u64,
    /// Keys put in so far (retired segments' included, until it is built again).
    inserted: AtomicU64,
}

/// 64-bit words per 512-bit block.
const WORDS_PER_BLOCK: usize = filter::BLOCK_BYTES / 8;

impl SealedKeys {
    /// An empty filter for `keys` keys (at least [`CAPACITY_MIN`]).
    pub fn with_capacity(keys: u64) -> SealedKeys {
        let capacity = keys.max(CAPACITY_MIN);
        let words = filter::len_for(capacity as usize) / 8;
        SealedKeys {
            words: (0..words).map(|_| AtomicU64::new(0)).collect(),
            capacity,
            inserted: AtomicU64::new(0),
        }
    }

    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    pub fn inserted(&self) -> u64 {
        self.inserted.load(Ordering::Relaxed)
    }

    /// Whether `more` keys still fit within the capacity.
    pub fn has_room(&self, more: u64) -> bool {
        self.inserted() + more <= self.capacity
    }

    fn probe(&self, h: u64) -> (usize, impl Iterator<Item = (usize, u64)>) {
        let blocks = self.words.len() / WORDS_PER_BLOCK;
        let (block, h2) = filter::probes(h, blocks);
        let bits = (0..filter::PROBES).map(move |i| {
            let k = filter::bit(h2, i);
            (k / 64, 1u64 << (k % 64))
        });
        (block * WORDS_PER_BLOCK, bits)
    }

    pub fn insert(&self, h: u64) {
        let (at, bits) = self.probe(h);
        for (w, mask) in bits {
            self.words[at + w].fetch_or(mask, Ordering::Relaxed);
        }
        self.inserted.fetch_add(1, Ordering::Relaxed);
    }

    /// False: no key put in has this hash. True: one may have.
    pub fn may_contain(&self, h: u64) -> bool {
        let (at, mut bits) = self.probe(h);
        bits.all(|(w, mask)| self.words[at + w].load(Ordering::Relaxed) & mask != 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_put_in_are_always_found_and_false_positives_stay_near_one_percent_at_capacity() {
        let n = CAPACITY_MIN;
        let f = SealedKeys::with_capacity(n);
        let h = |i: u64| xxhash_rust::xxh3::xxh3_64(&i.to_le_bytes());
        for i in 0..n {
            f.insert(h(i));
        }
        assert_eq!(f.inserted(), n);
        assert!(!f.has_room(1));
        assert!((0..n).all(|i| f.may_contain(h(i))));
        let fp = (n..n + 100_000).filter(|&i| f.may_contain(h(i))).count();
        assert!(fp < 2_000, "false positives {fp} of 100000");
    }

    #[test]
    fn the_same_key_hash_sets_the_same_bits_as_a_segments_filter() {
        // The layout is the segment filter's, so that both stay one design.
        let f = SealedKeys::with_capacity(0);
        let mut bytes = vec![0u8; filter::len_for(CAPACITY_MIN as usize)];
        for i in 0..1_000u64 {
            let h = xxhash_rust::xxh3::xxh3_64(&i.to_le_bytes());
            f.insert(h);
            filter::insert(&mut bytes, h);
        }
        let words: Vec<u8> = f
            .words
            .iter()
            .flat_map(|w| w.load(Ordering::Relaxed).to_le_bytes())
            .collect();
        assert_eq!(words, bytes);
    }
}
