//! The part of the log not yet in a sorted index, held in memory: each key's position and
//! each item's events. A poll or a repeat finds a key answered a moment ago here, so
//! nothing waits for an index to be written.
//!
//! Keys are 64-bit hashes of (shop, request key), so the map holds 16 bytes per key;
//! a hit is confirmed by reading the entry from the log and comparing the key, so a hash
//! that collides costs a read, never a wrong answer. A second key with the same hash
//! goes to `key_overflow`, not over the first (losing the first would let it be applied
//! twice).

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use xxhash_rust::xxh3::{xxh3_64, xxh3_128};

/// The keys are XXH3 outputs already: hashing them again would only cost time.
#[derive(Default)]
pub struct IdHasher(u64);
impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = self.0.rotate_left(8) ^ *b as u64;
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = v;
    }
}
pub type IdBuild = BuildHasherDefault<IdHasher>;

/// XXH3-128 of shop and key: the low 64 bits index the key, 32 high bits are kept beside
/// it in the sorted index so that most false matches are told apart without a log read.
pub fn key_hash(shop: u32, rkey: &[u8]) -> (u64, u32) {
    let mut b = [0u8; 4 + 255];
    b[..4].copy_from_slice(&shop.to_le_bytes());
    b[4..4 + rkey.len()].copy_from_slice(rkey);
    let h = xxh3_128(&b[..4 + rkey.len()]);
    (h as u64, (h >> 96) as u32)
}

pub fn item_hash(shop: u32, item: u32) -> u64 {
    let mut b = [0u8; 8];
    b[..4].copy_from_slice(&shop.to_le_bytes());
    b[4..].copy_from_slice(&item.to_le_bytes());
    xxh3_64(&b)
}

pub struct Tail {
    /// key hash -> a value the owner chooses (a position, or an offset and check bits).
    keys: HashMap<u64, u64, IdBuild>,
    /// Keys whose hash another key of this tail already has.
    key_overflow: Vec<(u64, u64)>,
    /// item hash -> (seq, position) of its events in log order.
    items: HashMap<u64, Vec<(u64, u64)>, IdBuild>,
    pub entries: usize,
}

impl Tail {
    pub fn with_capacity(entries: usize) -> Tail {
        Tail {
            keys: HashMap::with_capacity_and_hasher(entries, IdBuild::default()),
            key_overflow: Vec::new(),
            items: HashMap::with_capacity_and_hasher(1024, IdBuild::default()),
            entries: 0,
        }
    }

    pub fn add(&mut self, h: u64, key_val: u64, ih: u64, seq: u64, pos: u64) {
        match self.keys.entry(h) {
            std::collections::hash_map::Entry::Vacant(v) => {
                v.insert(key_val);
            }
            std::collections::hash_map::Entry::Occupied(_) => self.key_overflow.push((h, key_val)),
        }
        let ev = self.items.entry(ih).or_default();
        assert!(
            ev.last().is_none_or(|l| l.0 < seq),
            "an item's events are added in seq order"
        );
        ev.push((seq, pos));
        self.entries += 1;
    }

    /// Calls `f` with the value of every key of this tail whose hash is `h`.
    pub fn key_candidates(&self, h: u64, mut f: impl FnMut(u64) -> bool) -> bool {
        if let Some(v) = self.keys.get(&h) {
            if f(*v) {
                return true;
            }
            return self.key_overflow.iter().any(|(oh, ov)| *oh == h && f(*ov));
        }
        false
    }

    /// Appends to `out` the item's events with seq above `after`, up to `limit` in all.
    pub fn item_events(&self, ih: u64, after: u64, limit: usize, out: &mut Vec<(u64, u64)>) {
        if let Some(ev) = self.items.get(&ih) {
            let from = ev.partition_point(|e| e.0 <= after);
            let room = limit.saturating_sub(out.len());
            out.extend_from_slice(&ev[from..(from + room).min(ev.len())]);
        }
    }

    /// The keys sorted by `order` (then by value), ready for a sorted index.
    pub fn sorted_keys<K: Ord>(&self, order: impl Fn(u64) -> K) -> Vec<(u64, u64)> {
        let mut v: Vec<(u64, u64)> = Vec::with_capacity(self.entries);
        v.extend(self.keys.iter().map(|(h, x)| (*h, *x)));
        v.extend_from_slice(&self.key_overflow);
        v.sort_unstable_by(|a, b| order(a.0).cmp(&order(b.0)).then(a.1.cmp(&b.1)));
        v
    }

    /// The items sorted by `order` of their hash, each with its events in seq order.
    pub fn sorted_items<K: Ord>(&self, order: impl Fn(u64) -> K) -> Vec<(u64, &[(u64, u64)])> {
        let mut v: Vec<(u64, &[(u64, u64)])> = self.items.iter().map(|(h, ev)| (*h, ev.as_slice())).collect();
        v.sort_unstable_by_key(|a| order(a.0));
        v
    }

    /// Empties the tail, keeping the key map's room for the next segment or run.
    pub fn clear(&mut self) {
        self.keys.clear();
        self.key_overflow.clear();
        self.items.clear();
        self.entries = 0;
    }
}
