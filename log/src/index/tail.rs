//! The segment being written, indexed in memory: each request key's positions and each
//! item's events. A poll or a repeat finds a key answered a moment ago here, so nothing
//! waits for an index file to be written.
//!
//! Per entry the writer pays a hash and a push (two, with a key and a seq): the budget
//! is about 0.3 µs per entry for all of the index (`docs/decisions/derived-views.md`).
//! Its memory is bounded by the segment's: the writer starts a new tail at each seal.

use std::borrow::Cow;
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use nrtxn_actors::types::Entry;

use super::{item_hash, key_hash, Pos, OFFSET_MAX, SLOT_BITS};
use crate::record::HEADER_LEN;

/// The maps' keys are XXH3 outputs already: hashing them again would only cost time.
#[derive(Default)]
pub(crate) struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(*b);
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = v;
    }
}

type IdBuild = BuildHasherDefault<IdHasher>;

/// An item hash and its events (seq, packed position) in seq order, as the sealed
/// index stores a run: borrowed when the tail's run is in order already.
pub(crate) type ItemRun<'a> = (u64, Cow<'a, [(u64, u64)]>);

/// One item hash's events in log order: (seq, packed position).
#[derive(Default)]
pub(crate) struct Run {
    pub(crate) events: Vec<(u64, u64)>,
    /// Whether the seqs rise in log order, as one item's always do: false only when two
    /// items share the hash (a collision), and then readers sort.
    pub(crate) sorted: bool,
    /// The last event's seq, beside the map's slot: comparing with it needs no read of
    /// the events' end, a cache miss per entry when many items are written.
    last_seq: Option<u64>,
}

/// The index of the segment being written. The journal would keep it behind the
/// facade's lock, which the writer takes once per group ([`super::Index::write_group`]).
pub struct Tail {
    /// The segment's first lsn (its name).
    first_lsn: u64,
    /// Key hash → the first position with it in this segment (packed, see [`Pos`]).
    keys: HashMap<u64, u64, IdBuild>,
    /// Further positions of hashes `keys` already has: a key written again, or two keys
    /// whose hashes collide. Apart from `keys` so that the common case is 16 bytes per
    /// key, and never dropped, since a position lost could let a request apply twice.
    keys_more: HashMap<u64, Vec<u64>, IdBuild>,
    items: HashMap<u64, Run, IdBuild>,
    entries: usize,
    /// The offset of the last record added: records come in log order.
    last_offset: Option<u64>,
    /// Reads see records that start below this offset: what the writer's syncs made
    /// durable ([`Tail::mark_durable`]).
    durable_end: u64,
}

impl Tail {
    pub fn new(first_lsn: u64) -> Tail {
        Tail::with_room(first_lsn, 1024, 256)
    }

    /// A tail for the segment at `first_lsn` whose maps have room for as many keys and
    /// items as `prev` holds: the next segment is written like the last.
    pub fn sized_like(first_lsn: u64, prev: &Tail) -> Tail {
        Tail::with_room(
            first_lsn,
            prev.keys.len().max(1024),
            prev.items.len().max(256),
        )
    }

    /// An empty tail whose maps are made once, with room for `keys` and `items`.
    fn with_room(first_lsn: u64, keys: usize, items: usize) -> Tail {
        Tail {
            first_lsn,
            keys: HashMap::with_capacity_and_hasher(keys, IdBuild::default()),
            keys_more: HashMap::default(),
            items: HashMap::with_capacity_and_hasher(items, IdBuild::default()),
            entries: 0,
            last_offset: None,
            durable_end: 0,
        }
    }

    /// The first lsn of the segment this tail indexes.
    pub fn first_lsn(&self) -> u64 {
        self.first_lsn
    }

    /// The entries added, durable or not.
    pub fn entries(&self) -> usize {
        self.entries
    }

    /// Where the durable part of the segment ends.
    pub fn durable_end(&self) -> u64 {
        self.durable_end
    }

    /// Whether an entry added (durable or not) may have key hash `h`.
    pub fn has_key(&self, h: u64) -> bool {
        self.keys.contains_key(&h)
    }

    /// The offset of the last record added, if any.
    pub fn last_offset(&self) -> Option<u64> {
        self.last_offset
    }

    /// Adds the entries of the record written at `offset` in this tail's segment. Not
    /// readable until [`Tail::mark_durable`] passes the record.
    pub fn add_record(&mut self, offset: u64, entries: &[Entry]) {
        // Positions are ordered as the log: a record at or before the last one means the
        // writer's offsets and this tail's disagree (a record added twice, or a segment
        // change the tail was not told of).
        assert!(
            self.last_offset.is_none_or(|last| offset > last),
            "segment {}: a record at byte {offset} added after one at byte {:?}",
            self.first_lsn,
            self.last_offset
        );
        assert!(
            offset < OFFSET_MAX && entries.len() < 1 << SLOT_BITS,
            "segment {}: a record at byte {offset} with {} entries does not fit a position",
            self.first_lsn,
            entries.len()
        );
        self.last_offset = Some(offset);
        // A batch names one item many times in a row: its hash is reused, not recomputed.
        let mut prev: Option<(&Entry, u64)> = None;
        for (slot, e) in entries.iter().enumerate() {
            let pos = Pos {
                offset,
                slot: slot as u32,
            }
            .pack();
            if let Some(key) = &e.request_key {
                self.add_key(key_hash(&e.shop, key), pos);
            }
            if let Some(seq) = e.seq {
                let ih = match prev {
                    Some((p, h)) if p.item == e.item && p.shop == e.shop => h,
                    _ => item_hash(&e.shop, &e.item),
                };
                let run = self.items.entry(ih).or_insert_with(|| Run {
                    events: Vec::new(),
                    sorted: true,
                    last_seq: None,
                });
                run.sorted &= run.last_seq.is_none_or(|s| s < seq);
                run.last_seq = Some(seq);
                run.events.push((seq, pos));
                prev = Some((e, ih));
            }
        }
        self.entries += entries.len();
    }

    fn add_key(&mut self, h: u64, pos: u64) {
        match self.keys.entry(h) {
            std::collections::hash_map::Entry::Vacant(v) => {
                v.insert(pos);
            }
            std::collections::hash_map::Entry::Occupied(_) => {
                self.keys_more.entry(h).or_default().push(pos)
            }
        }
    }

    /// Marks every record that starts below `offset_end` durable: the writer calls it
    /// after the sync of the records it added.
    pub fn mark_durable(&mut self, offset_end: u64) {
        // What was durable stays so; and a sync covers every record written before it,
        // so a mark that leaves out a record added (and so written) is a writer's error.
        assert!(
            offset_end >= self.durable_end,
            "segment {}: the durable mark would move back from byte {} to byte {offset_end}",
            self.first_lsn,
            self.durable_end
        );
        assert!(
            self.last_offset
                .is_none_or(|last| offset_end >= last + HEADER_LEN as u64),
            "segment {}: the durable mark at byte {offset_end} leaves out the record at byte {:?}",
            self.first_lsn,
            self.last_offset
        );
        self.durable_end = offset_end;
    }

    /// The durable positions of entries whose key hash is `h`, in log order.
    pub fn key_positions(&self, h: u64) -> Vec<Pos> {
        let Some(first) = self.keys.get(&h) else {
            return Vec::new();
        };
        let mut out: Vec<u64> = vec![*first];
        if let Some(more) = self.keys_more.get(&h) {
            out.extend_from_slice(more);
        }
        out.iter()
            .map(|p| Pos::unpack(*p))
            .filter(|p| p.offset < self.durable_end)
            .collect()
    }

    /// The durable events of item hash `ih` from `from_seq` on, in seq order, at most
    /// `limit`.
    pub fn item_events(&self, ih: u64, from_seq: u64, limit: usize) -> Vec<(u64, Pos)> {
        let Some(run) = self.items.get(&ih) else {
            return Vec::new();
        };
        let durable = |(_, p): &&(u64, u64)| Pos::unpack(*p).offset < self.durable_end;
        let events: Cow<'_, [(u64, u64)]> = if run.sorted {
            // Log order is seq order: the durable events are a prefix.
            let from = run.events.partition_point(|(s, _)| *s < from_seq);
            Cow::Borrowed(&run.events[from..])
        } else {
            let mut v: Vec<(u64, u64)> = run.events.iter().filter(durable).copied().collect();
            v.retain(|(s, _)| *s >= from_seq);
            v.sort_unstable();
            Cow::Owned(v)
        };
        events
            .iter()
            .take_while(durable)
            .take(limit)
            .map(|(s, p)| (*s, Pos::unpack(*p)))
            .collect()
    }

    /// Every key hash with its position (packed), sorted by hash then position: the
    /// sealed index's key blocks.
    pub(crate) fn sorted_keys(&self) -> Vec<(u64, u64)> {
        let more: usize = self.keys_more.values().map(Vec::len).sum();
        let mut v = Vec::with_capacity(self.keys.len() + more);
        v.extend(self.keys.iter().map(|(h, p)| (*h, *p)));
        for (h, ps) in &self.keys_more {
            v.extend(ps.iter().map(|p| (*h, *p)));
        }
        v.sort_unstable();
        v
    }

    /// Every item hash with its events in seq order (then log order), sorted by hash:
    /// the sealed index's item runs and directory.
    pub(crate) fn sorted_items(&self) -> Vec<ItemRun<'_>> {
        let mut v: Vec<ItemRun<'_>> = self
            .items
            .iter()
            .map(|(h, run)| {
                let events = if run.sorted {
                    Cow::Borrowed(run.events.as_slice())
                } else {
                    let mut e = run.events.clone();
                    e.sort_unstable();
                    Cow::Owned(e)
                };
                (*h, events)
            })
            .collect();
        v.sort_unstable_by_key(|(h, _)| *h);
        v
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use nrtxn_actors::types::{Entry, Op};

    use super::Tail;

    fn entry(item: &str, key: &str, seq: u64) -> Entry {
        let mut e = Entry::decided("s".into(), item.into(), Op::Decrement, 1, 0, 0);
        e.request_key = Some(Arc::from(key));
        e.seq = Some(seq);
        e
    }

    #[test]
    fn a_tail_sized_like_the_last_takes_as_many_keys_and_items_without_growing() {
        let mut full = Tail::new(1);
        let entries: Vec<Entry> = (0..3_000u64)
            .map(|n| entry(&format!("i{}", n % 300), &format!("k{n}"), n / 300 + 1))
            .collect();
        full.add_record(0, &entries[..1_500]);
        full.add_record(4_096, &entries[1_500..]);
        // Each item's run rose in seq order across both records.
        assert_eq!(full.items.len(), 300);
        assert!(full
            .items
            .values()
            .all(|run| run.sorted && run.events.len() == 10));
        let next = Tail::sized_like(3_001, &full);
        assert_eq!((next.first_lsn(), next.entries()), (3_001, 0));
        assert!(next.keys.capacity() >= 3_000, "{}", next.keys.capacity());
        assert!(next.items.capacity() >= 300, "{}", next.items.capacity());
    }

    #[test]
    fn an_items_run_out_of_seq_order_is_marked_for_readers_to_sort() {
        // Two items sharing a hash interleave their seqs in one run; here one item
        // written with a seq below its last stands in for that.
        let mut tail = Tail::new(1);
        tail.add_record(0, &[entry("i", "a", 5), entry("i", "b", 6)]);
        assert!(tail.items.values().all(|run| run.sorted));
        tail.add_record(4_096, &[entry("i", "c", 2)]);
        assert!(tail.items.values().all(|run| !run.sorted));
    }
}
