//! A Bloom filter of the request keys the journal holds, so that the common case, a key
//! never seen before, is answered without reading the store.
//!
//! Every new request's key must be checked against the journal (at most once); without
//! this filter each check is an SQLite index probe on the WorkManager's thread, measured
//! at about a sixth of the engine's CPU. A "no" from the filter is certain; a "maybe"
//! (a key really there, or a false positive) falls through to the store, so the filter
//! changes cost, never answers.
//!
//! Fixed size ([`BITS`] bits, 16 MiB): about 1% false positives near 12 million keys,
//! degrading gracefully past that (more probes, same answers). Bits are set with atomic
//! `fetch_or`, so the writer adds keys while WorkManagers test them, without a lock. It is
//! rebuilt at start from the journal's key index.

use std::sync::atomic::{AtomicU64, Ordering};

/// Number of bits (a power of two).
pub const BITS: usize = 1 << 27;
/// Bits set per key: about right for 10 bits of filter per key.
const PROBES: u64 = 7;

pub struct KeyFilter {
    words: Box<[AtomicU64]>,
}

/// FNV-1a over shop, a separator no name can contain, and key; then a SplitMix64 step
/// for the second hash of double hashing. Stable: it does not depend on the Rust
/// version or a random seed.
fn hashes(shop: &str, key: &str) -> (u64, u64) {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in shop.bytes().chain(std::iter::once(0u8)).chain(key.bytes()) {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    let mut z = h.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^= z >> 31;
    (h, z | 1)
}

impl KeyFilter {
    pub fn new() -> KeyFilter {
        KeyFilter {
            words: (0..BITS / 64).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    /// The word and bit masks of a key: all probes fall in one 512-bit block (one cache
    /// line), so a test or an insert costs one memory access, not seven (a blocked Bloom
    /// filter; its false-positive rate is a little above the plain one's).
    fn probes(shop: &str, key: &str) -> (usize, [u64; 8]) {
        let (h1, h2) = hashes(shop, key);
        let blocks = BITS / 512;
        let block = (h1 as usize) & (blocks - 1);
        let mut masks = [0u64; 8];
        let mut h = h2;
        for _ in 0..PROBES {
            let bit = (h & 511) as usize;
            masks[bit / 64] |= 1 << (bit % 64);
            h = h.rotate_right(9);
        }
        (block * 8, masks)
    }

    pub fn insert(&self, shop: &str, key: &str) {
        let (base, masks) = Self::probes(shop, key);
        for (i, m) in masks.iter().enumerate() {
            if *m != 0 {
                self.words[base + i].fetch_or(*m, Ordering::Relaxed);
            }
        }
    }

    /// False: the key was never inserted. True: it may have been.
    pub fn may_contain(&self, shop: &str, key: &str) -> bool {
        let (base, masks) = Self::probes(shop, key);
        masks
            .iter()
            .enumerate()
            .all(|(i, m)| self.words[base + i].load(Ordering::Relaxed) & m == *m)
    }
}

impl Default for KeyFilter {
    fn default() -> Self {
        KeyFilter::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inserted_keys_are_always_found() {
        let f = KeyFilter::new();
        for n in 0..100_000 {
            f.insert("shop", &format!("key-{n}"));
        }
        assert!((0..100_000).all(|n| f.may_contain("shop", &format!("key-{n}"))));
    }

    #[test]
    fn absent_keys_are_mostly_ruled_out_and_shops_are_kept_apart() {
        let f = KeyFilter::new();
        for n in 0..100_000 {
            f.insert("shop", &format!("key-{n}"));
        }
        let false_positives = (0..100_000)
            .filter(|n| f.may_contain("shop", &format!("other-{n}")))
            .count();
        // Far below 1% at this load (about 0.0001% expected).
        assert!(false_positives < 100, "{false_positives}");
        let other_shop = (0..1000)
            .filter(|n| f.may_contain("elsewhere", &format!("key-{n}")))
            .count();
        assert!(other_shop < 5, "{other_shop}");
    }
}
