//! `segidx`: per-segment sorted indexes, written once when a log segment is sealed (as
//! Kafka's offset index and Bitcask's hint files), and an in-memory [`Tail`] for the
//! segment still being written.
//!
//! One index file per segment (`<first seq>.idx` beside `<first seq>.log`), so that
//! retention deletes the two together and a backup may leave the index out:
//!
//! ```text
//! [key blocks][item blocks][filter][key fence][item directory][footer]
//! ```
//! - A block is 4 KiB: 255 entries of 16 bytes, the count (u32), 4 zero bytes and the
//!   XXH3-64 of the 4,088 bytes before it, checked on every read of the block.
//! - Key entry: key hash (u64), the entry's offset in the segment (u32), 32 more bits of
//!   the key's hash (to tell most false matches apart without reading the log). Sorted.
//! - Item entry: seq (u64), offset (u32), 4 zero bytes; an item's events are one run,
//!   in seq order, and the runs are in item-hash order.
//! - Filter: [`crate::filter`] over the key hashes; fence: each key block's first hash;
//!   directory: per item, its hash, first entry, count, first and last seq (32 bytes).
//! - Footer (64 bytes): magic, key count, item entry count, item count, filter bytes,
//!   the segment's length when sealed, XXH3-64 of filter + fence + directory, XXH3-64 of
//!   the 56 bytes before. Checked at open; a bad or missing index is rebuilt from its
//!   segment (the log is the record, the index only saves reading it).

use memmap2::Mmap;
use std::path::{Path, PathBuf};
use xxhash_rust::xxh3::xxh3_64;

use crate::filter;
use crate::seglog::{FRAME_MAX, SegLog, pos};
use crate::tail::{Tail, item_hash, key_hash};
use crate::{Entries, Store, thread_cpu_s};

const BLOCK: usize = 4096;
const PER_BLOCK: usize = 255;
const ENTRY: usize = 16;
const DIR_ENTRY: usize = 32;
const FOOTER: usize = 64;
const MAGIC: u64 = u64::from_le_bytes(*b"NRTXVIDX");

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().unwrap())
}
fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().unwrap())
}

/// First `i` in `0..n` for which `below(i)` is false (`below` true, then false).
fn lower_bound(n: usize, mut below: impl FnMut(usize) -> bool) -> usize {
    let (mut lo, mut hi) = (0, n);
    while lo < hi {
        let mid = (lo + hi) / 2;
        if below(mid) { lo = mid + 1 } else { hi = mid }
    }
    lo
}

/// Appends `n` 16-byte entries as checksummed blocks.
fn put_blocks(out: &mut Vec<u8>, n: usize, entry: impl Fn(usize) -> [u8; ENTRY]) {
    for b in 0..n.div_ceil(PER_BLOCK) {
        let start = out.len();
        let count = PER_BLOCK.min(n - b * PER_BLOCK);
        for i in b * PER_BLOCK..b * PER_BLOCK + count {
            out.extend_from_slice(&entry(i));
        }
        out.resize(start + PER_BLOCK * ENTRY, 0);
        out.extend_from_slice(&(count as u32).to_le_bytes());
        out.extend_from_slice(&[0u8; 4]);
        let sum = xxh3_64(&out[start..start + BLOCK - 8]);
        out.extend_from_slice(&sum.to_le_bytes());
    }
}

/// The index file of a segment whose entries `tail` holds (values: offset | check << 32).
fn build(tail: &Tail, seg_len: u64) -> Vec<u8> {
    let keys = tail.sorted_keys(|h| h);
    let items = tail.sorted_items(|h| h);
    let n_item_entries: usize = items.iter().map(|(_, ev)| ev.len()).sum();
    let mut out = Vec::with_capacity((keys.len() + n_item_entries) * 17 + items.len() * 32 + 2 * BLOCK);
    put_blocks(&mut out, keys.len(), |i| {
        let mut e = [0u8; ENTRY];
        e[..8].copy_from_slice(&keys[i].0.to_le_bytes());
        e[8..].copy_from_slice(&keys[i].1.to_le_bytes());
        e
    });
    let flat: Vec<(u64, u64)> = items.iter().flat_map(|(_, ev)| ev.iter().copied()).collect();
    put_blocks(&mut out, flat.len(), |i| {
        let mut e = [0u8; ENTRY];
        e[..8].copy_from_slice(&flat[i].0.to_le_bytes());
        e[8..12].copy_from_slice(&(flat[i].1 as u32).to_le_bytes());
        e
    });
    let meta_at = out.len();
    let mut f = vec![0u8; filter::len_for(keys.len())];
    for (h, _) in &keys {
        filter::insert(&mut f, *h);
    }
    out.extend_from_slice(&f);
    for b in 0..keys.len().div_ceil(PER_BLOCK) {
        out.extend_from_slice(&keys[b * PER_BLOCK].0.to_le_bytes());
    }
    let mut start = 0u32;
    for (ih, ev) in &items {
        out.extend_from_slice(&ih.to_le_bytes());
        out.extend_from_slice(&start.to_le_bytes());
        out.extend_from_slice(&(ev.len() as u32).to_le_bytes());
        out.extend_from_slice(&ev[0].0.to_le_bytes());
        out.extend_from_slice(&ev[ev.len() - 1].0.to_le_bytes());
        start += ev.len() as u32;
    }
    let meta_sum = xxh3_64(&out[meta_at..]);
    let foot_at = out.len();
    for v in [
        MAGIC,
        keys.len() as u64,
        n_item_entries as u64,
        items.len() as u64,
        f.len() as u64,
        seg_len,
        meta_sum,
    ] {
        out.extend_from_slice(&v.to_le_bytes());
    }
    let sum = xxh3_64(&out[foot_at..]);
    out.extend_from_slice(&sum.to_le_bytes());
    out
}

/// A sealed segment's index, mapped.
struct Sealed {
    map: Mmap,
    key_blocks: usize,
    item_at: usize,
    filter_at: usize,
    filter_len: usize,
    fence_at: usize,
    dir_at: usize,
    items: usize,
}

impl Sealed {
    /// Maps and checks an index file: footer, sizes, the checksum of filter, fence and
    /// directory, and that the segment is still as long as when it was indexed.
    fn load(path: &Path, seg_len: u64) -> Result<Sealed, String> {
        let file = std::fs::File::open(path).map_err(|e| format!("{}: {e}", path.display()))?;
        // The file is written whole before it is mapped, and never written again.
        let map = unsafe { Mmap::map(&file) }.map_err(|e| e.to_string())?;
        let bad = |why: &str| format!("{}: {why}", path.display());
        if map.len() < FOOTER {
            return Err(bad("shorter than a footer"));
        }
        let foot = map.len() - FOOTER;
        if xxh3_64(&map[foot..foot + 56]) != u64_at(&map, foot + 56) || u64_at(&map, foot) != MAGIC {
            return Err(bad("bad footer"));
        }
        let [n_keys, n_ev, n_items, filter_len, indexed_len, meta_sum] =
            std::array::from_fn(|i| u64_at(&map, foot + 8 + 8 * i) as usize);
        let (kb, ib) = (n_keys.div_ceil(PER_BLOCK), n_ev.div_ceil(PER_BLOCK));
        let filter_at = (kb + ib) * BLOCK;
        let dir_at = filter_at + filter_len + kb * 8;
        if dir_at + n_items * DIR_ENTRY != foot {
            return Err(bad("sizes do not add up"));
        }
        if xxh3_64(&map[filter_at..foot]) as usize != meta_sum {
            return Err(bad("bad filter, fence or directory"));
        }
        if indexed_len as u64 != seg_len {
            return Err(bad("its segment's length changed"));
        }
        Ok(Sealed {
            key_blocks: kb,
            item_at: kb * BLOCK,
            filter_at,
            filter_len,
            fence_at: filter_at + filter_len,
            dir_at,
            items: n_items,
            map,
        })
    }

    fn block(&self, at: usize) -> Result<&[u8], String> {
        let b = &self.map[at..at + BLOCK];
        if xxh3_64(&b[..BLOCK - 8]) != u64_at(b, BLOCK - 8) {
            return Err(format!("bad index block at byte {at}"));
        }
        Ok(b)
    }

    /// Calls `found` with the offset of each key whose hash and check bits match, until it
    /// returns true.
    fn key(&self, h: u64, chk: u32, mut found: impl FnMut(u32) -> bool) -> Result<bool, String> {
        if !filter::may_contain(&self.map[self.filter_at..self.filter_at + self.filter_len], h) {
            return Ok(false);
        }
        let fence = |b: usize| u64_at(&self.map, self.fence_at + 8 * b);
        let first = lower_bound(self.key_blocks, |b| fence(b) < h).saturating_sub(1);
        for b in first..self.key_blocks {
            if fence(b) > h {
                break;
            }
            let blk = self.block(b * BLOCK)?;
            let n = u32_at(blk, PER_BLOCK * ENTRY) as usize;
            let mut i = lower_bound(n, |i| u64_at(blk, i * ENTRY) < h);
            while i < n && u64_at(blk, i * ENTRY) == h {
                if u32_at(blk, i * ENTRY + 12) == chk && found(u32_at(blk, i * ENTRY + 8)) {
                    return Ok(true);
                }
                i += 1;
            }
        }
        Ok(false)
    }

    /// Appends the item's events after `after` (seq, offset) to `out`, up to `limit`.
    fn item(&self, ih: u64, after: u64, limit: usize, out: &mut Vec<(u64, u32)>) -> Result<(), String> {
        let d = |i: usize| self.dir_at + i * DIR_ENTRY;
        let i = lower_bound(self.items, |i| u64_at(&self.map, d(i)) < ih);
        if i == self.items || u64_at(&self.map, d(i)) != ih || u64_at(&self.map, d(i) + 24) <= after {
            return Ok(());
        }
        let start = u32_at(&self.map, d(i) + 8) as usize;
        let count = u32_at(&self.map, d(i) + 12) as usize;
        let checked = std::cell::Cell::new(usize::MAX);
        let entry = |k: usize| -> Result<(u64, u32), String> {
            let (b, slot) = ((start + k) / PER_BLOCK, (start + k) % PER_BLOCK);
            let at = self.item_at + b * BLOCK;
            if checked.get() != b {
                self.block(at)?;
                checked.set(b);
            }
            let e = at + slot * ENTRY;
            Ok((u64_at(&self.map, e), u32_at(&self.map, e + 8)))
        };
        let mut err = None;
        let mut k = lower_bound(count, |k| match entry(k) {
            Ok(e) => e.0 <= after,
            Err(x) => {
                err = Some(x);
                false
            }
        });
        if let Some(x) = err {
            return Err(x);
        }
        while k < count && out.len() < limit {
            out.push(entry(k)?);
            k += 1;
        }
        Ok(())
    }

    /// Reads every block: the check a start runs after it is ready, off the path.
    fn check_all(&self) -> Result<(), String> {
        for at in (0..self.filter_at).step_by(BLOCK) {
            self.block(at)?;
        }
        Ok(())
    }
}

pub struct SegIdx {
    log: SegLog,
    /// One per segment, oldest first; the newest segment has none while it is active.
    sealed: Vec<Sealed>,
    /// The active segment's keys (offset | check << 32) and events (offsets).
    tail: Tail,
    active: bool,
    offs: Vec<u32>,
    log_cpu_s: f64,
    seal_cpu_s: f64,
    /// Indexes found bad or missing at open and rebuilt from their segments.
    pub rebuilt: usize,
}

fn idx_path(log_path: &Path) -> PathBuf {
    log_path.with_extension("idx")
}

/// Adds segment `seg`'s entries to `tail`, read back from the log.
fn scan_into(log: &SegLog, seg: u32, tail: &mut Tail) -> Result<(), String> {
    log.scan(seg, |off, f| {
        let (h, chk) = key_hash(f.shop, f.key);
        tail.add(
            h,
            off as u64 | (chk as u64) << 32,
            item_hash(f.shop, f.item),
            f.seq,
            off as u64,
        );
    })
}

impl SegIdx {
    pub fn create(dir: &Path, seg_bytes_max: u64) -> SegIdx {
        SegIdx {
            log: SegLog::create(dir, seg_bytes_max),
            sealed: Vec::new(),
            tail: Tail::with_capacity((seg_bytes_max / 64) as usize),
            active: false,
            offs: Vec::new(),
            log_cpu_s: 0.0,
            seal_cpu_s: 0.0,
            rebuilt: 0,
        }
    }

    /// Opens the log, maps each sealed segment's index (rebuilding a bad or missing one
    /// from its segment), and reads the active segment back into the tail.
    pub fn open(dir: &Path, seg_bytes_max: u64) -> SegIdx {
        let mut s = SegIdx::create(dir, seg_bytes_max);
        s.log = SegLog::open(dir, seg_bytes_max);
        for i in 0..s.log.segs.len() {
            let seg = &s.log.segs[i];
            let path = idx_path(&seg.path);
            let last = i + 1 == s.log.segs.len();
            if last && !path.exists() {
                scan_into(&s.log, i as u32, &mut s.tail).unwrap();
                s.active = true;
                break;
            }
            match Sealed::load(&path, seg.len) {
                Ok(x) => s.sealed.push(x),
                Err(why) => {
                    eprintln!("rebuilding index: {why}");
                    scan_into(&s.log, i as u32, &mut s.tail).unwrap();
                    s.seal(i);
                    s.rebuilt += 1;
                }
            }
        }
        s
    }

    fn seal(&mut self, seg: usize) {
        assert_eq!(seg, self.sealed.len(), "segments are sealed in order");
        let t = thread_cpu_s();
        let s = &self.log.segs[seg];
        let path = idx_path(&s.path);
        std::fs::write(&path, build(&self.tail, s.len)).unwrap();
        self.sealed.push(Sealed::load(&path, s.len).unwrap());
        self.tail.clear();
        self.active = false;
        self.seal_cpu_s += thread_cpu_s() - t;
    }

    fn confirm(&self, seg: usize, off: u32, shop: u32, rkey: &[u8]) -> Option<usize> {
        let mut buf = [0u8; FRAME_MAX];
        let f = self.log.read(seg as u32, off, &mut buf);
        (f.shop == shop && f.key == rkey).then_some(f.val.len())
    }

    fn gather(&self, shop: u32, item: u32, after: u64, limit: usize) -> Vec<(u64, u64)> {
        let ih = item_hash(shop, item);
        let mut out = Vec::with_capacity(limit);
        let mut part = Vec::with_capacity(limit);
        for (seg, s) in self.sealed.iter().enumerate() {
            part.clear();
            s.item(ih, after, limit - out.len(), &mut part).unwrap();
            out.extend(part.iter().map(|(q, o)| (*q, pos(seg as u32, *o))));
            if out.len() == limit {
                return out;
            }
        }
        if self.active {
            let seg = self.sealed.len() as u32;
            let from = out.len();
            self.tail.item_events(ih, after, limit, &mut out);
            for e in &mut out[from..] {
                e.1 = pos(seg, e.1 as u32);
            }
        }
        out
    }

    pub fn check_all(&self) -> Result<(), String> {
        self.sealed.iter().try_for_each(|s| s.check_all())
    }
}

impl Store for SegIdx {
    fn write_batch(&mut self, e: &Entries, range: std::ops::Range<usize>, _b: usize) {
        let t = thread_cpu_s();
        let rolled = self.log.append(e, range.clone(), &mut self.offs);
        self.log_cpu_s += thread_cpu_s() - t;
        if rolled && self.active {
            self.seal(self.log.segs.len() - 2);
        }
        self.active = true;
        for (k, i) in range.enumerate() {
            let (h, chk) = key_hash(e.shop[i], e.rkey(i));
            let off = self.offs[k] as u64;
            self.tail.add(
                h,
                off | (chk as u64) << 32,
                item_hash(e.shop[i], e.item[i]),
                e.seq[i],
                off,
            );
        }
    }
    fn finish_and_settle(&mut self) {}
    /// Pays the seal still owed for the active segment: its index is built and written
    /// as `<first seq>.idx.owed`, which a start ignores, so the segment stays active and
    /// the reopen measured next reads it back into the tail, as a start after a crash does.
    fn force(&mut self) -> &'static str {
        if self.active {
            let t = thread_cpu_s();
            let s = self.log.segs.last().unwrap();
            std::fs::write(idx_path(&s.path).with_extension("idx.owed"), build(&self.tail, s.len)).unwrap();
            self.seal_cpu_s += thread_cpu_s() - t;
        }
        "active segment's index built and written aside (seal owed); the segment stays active"
    }
    fn get_outcome(&self, shop: u32, rkey: &[u8], _okey: &[u8]) -> Option<usize> {
        let (h, chk) = key_hash(shop, rkey);
        let mut hit = None;
        if self.active {
            let seg = self.sealed.len();
            self.tail.key_candidates(h, |v| {
                hit = if (v >> 32) as u32 == chk {
                    self.confirm(seg, v as u32, shop, rkey)
                } else {
                    None
                };
                hit.is_some()
            });
        }
        for (seg, s) in self.sealed.iter().enumerate().rev() {
            if hit.is_some() {
                break;
            }
            s.key(h, chk, |off| {
                hit = self.confirm(seg, off, shop, rkey);
                hit.is_some()
            })
            .unwrap();
        }
        hit
    }
    fn range_events(&self, shop: u32, item: u32, after: u64, limit: usize) -> usize {
        let ev = self.gather(shop, item, after, limit);
        std::hint::black_box(&ev);
        ev.len()
    }
    fn range_fetch(&self, shop: u32, item: u32, after: u64, limit: usize) -> Option<usize> {
        Some(fetch_events(
            &self.log,
            &self.gather(shop, item, after, limit),
            shop,
            item,
        ))
    }
    fn log_cpu_s(&self) -> f64 {
        self.log_cpu_s
    }
    fn bulk_cpu_s(&self) -> f64 {
        self.seal_cpu_s
    }
}

/// Reads the events' entries from the log, checking each is the one indexed.
pub fn fetch_events(log: &SegLog, ev: &[(u64, u64)], shop: u32, item: u32) -> usize {
    let positions: Vec<u64> = ev.iter().map(|e| e.1).collect();
    let mut k = 0;
    log.fetch(&positions, |f| {
        assert!(
            f.shop == shop && f.item == item && f.seq == ev[k].0,
            "the log holds the event indexed"
        );
        k += 1;
    });
    k
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{SeedableRng, rngs::StdRng};

    const N: usize = 40_000;
    const SEG_BYTES: u64 = 1 << 20;

    fn written(name: &str, mix: &str) -> (PathBuf, Entries) {
        let dir = std::env::temp_dir().join(format!("viewbench-test-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let e = crate::gen_entries(mix, N, &mut StdRng::seed_from_u64(7));
        let mut s = SegIdx::create(&dir, SEG_BYTES);
        for b in 0..N.div_ceil(crate::BATCH) {
            s.write_batch(&e, b * crate::BATCH..((b + 1) * crate::BATCH).min(N), b);
        }
        (dir, e)
    }

    fn all_found(s: &SegIdx, e: &Entries) -> bool {
        (0..e.len()).all(|i| s.get_outcome(e.shop[i], e.rkey(i), e.okey(i)) == Some(e.oval(i).len()))
    }

    #[test]
    fn every_key_is_found_before_and_after_reopen_and_a_fresh_key_is_not() {
        let (dir, e) = written("keys", "spread");
        let s = SegIdx::open(&dir, SEG_BYTES);
        assert!(
            s.sealed.len() >= 3 && s.active,
            "several sealed segments and an active one"
        );
        assert!(all_found(&s, &e));
        assert_eq!(s.get_outcome(0, b"never-sent-key-0001", b""), None);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn an_items_events_are_gathered_across_segments_in_seq_order() {
        let (dir, e) = written("events", "hot");
        let s = SegIdx::open(&dir, SEG_BYTES);
        let ev = s.gather(0, 0, 100, 30_000);
        assert_eq!(ev.len(), 30_000);
        assert!(
            ev.iter().enumerate().all(|(k, (seq, _))| *seq == 101 + k as u64),
            "gapless, in order"
        );
        assert_eq!(fetch_events(&s.log, &ev, 0, 0), 30_000);
        assert_eq!(s.gather(0, 0, N as u64, 10).len(), 0, "nothing after the last event");
        let _ = e;
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn an_index_with_a_damaged_footer_region_is_rebuilt_from_its_segment() {
        let (dir, e) = written("rebuild", "spread");
        let idx = dir.join("00000000000000000001.idx");
        let mut b = std::fs::read(&idx).unwrap();
        let at = b.len() - FOOTER - 1;
        b[at] ^= 1;
        std::fs::write(&idx, b).unwrap();
        let s = SegIdx::open(&dir, SEG_BYTES);
        assert_eq!(s.rebuilt, 1);
        assert!(all_found(&s, &e));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_flipped_byte_in_an_index_block_is_refused_when_read() {
        let (dir, _) = written("block", "spread");
        let idx = dir.join("00000000000000000001.idx");
        let mut b = std::fs::read(&idx).unwrap();
        b[100] ^= 1;
        std::fs::write(&idx, b).unwrap();
        let s = SegIdx::open(&dir, SEG_BYTES);
        assert_eq!(s.rebuilt, 0, "blocks are checked when read, not at open");
        assert!(s.check_all().is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
