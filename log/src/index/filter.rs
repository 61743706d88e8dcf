//! A blocked Bloom filter over 64-bit key hashes, kept as bytes (it is written into the
//! index file as it is held in memory).
//!
//! Why blocked: all probes of a key fall in one 64-byte block (one cache line), so a
//! test costs one memory access, and a lookup tests every sealed segment's filter. Why
//! a Bloom filter and not an xor filter: it is built in one pass with no retry, and at
//! 10 bits per key its false positives (about 1%) cost one index block read, never a
//! wrong answer.

/// Bits of filter per key: about 1% false positives with [`PROBES`] probes.
pub const BITS_PER_KEY: usize = 10;
/// Probes per key, each 9 bits of a second hash (7 × 9 = 63 bits).
pub(super) const PROBES: u32 = 7;
/// A block is 512 bits, one cache line.
pub(super) const BLOCK_BYTES: usize = 64;

/// The filter's length in bytes for `n` keys (at least one block), so that the index
/// file's footer need not store it.
pub fn len_for(n: usize) -> usize {
    let blocks = (n * BITS_PER_KEY).div_ceil(BLOCK_BYTES * 8).max(1);
    blocks * BLOCK_BYTES
}

/// The block and the probe bits: the block from the hash itself, the probes from a
/// second hash mixed out of it (the key hashes are XXH3, so their bits are independent).
pub(super) fn probes(h: u64, blocks: usize) -> (usize, u64) {
    let block = (h % blocks as u64) as usize;
    let h2 = (h ^ (h >> 29)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    (block, h2)
}

pub(super) fn bit(h2: u64, i: u32) -> usize {
    ((h2 >> (i * 9)) & 511) as usize
}

pub fn insert(filter: &mut [u8], h: u64) {
    let blocks = filter.len() / BLOCK_BYTES;
    let (block, h2) = probes(h, blocks);
    let b = &mut filter[block * BLOCK_BYTES..(block + 1) * BLOCK_BYTES];
    for i in 0..PROBES {
        let k = bit(h2, i);
        b[k / 8] |= 1 << (k % 8);
    }
}

/// False: the key was never inserted. True: it may have been.
pub fn may_contain(filter: &[u8], h: u64) -> bool {
    let blocks = filter.len() / BLOCK_BYTES;
    let (block, h2) = probes(h, blocks);
    let b = &filter[block * BLOCK_BYTES..(block + 1) * BLOCK_BYTES];
    (0..PROBES).all(|i| {
        let k = bit(h2, i);
        b[k / 8] & (1 << (k % 8)) != 0
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inserted_keys_are_always_found_and_false_positives_stay_near_one_percent() {
        let n = 100_000u64;
        let mut f = vec![0u8; len_for(n as usize)];
        let h = |i: u64| xxhash_rust::xxh3::xxh3_64(&i.to_le_bytes());
        for i in 0..n {
            insert(&mut f, h(i));
        }
        assert!((0..n).all(|i| may_contain(&f, h(i))));
        let fp = (n..2 * n).filter(|&i| may_contain(&f, h(i))).count();
        assert!(fp < (n as usize) * 2 / 100, "false positives {fp} of {n}");
    }
}
