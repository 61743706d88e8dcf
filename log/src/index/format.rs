//! The sealed index file, `<20-digit first lsn>.idx` beside its segment:
//!
//! ```text
//! [key blocks][item blocks][filter][key fence][item directory][footer]
//! ```
//!
//! - **A block** is 4 KiB: 255 entries of 16 bytes, the count of entries used (u32), 4
//!   zero bytes, and the XXH3-64 of the 4,088 bytes before it, checked whenever the
//!   block is read. Every block but a section's last is full.
//! - **Key entry**: key hash (u64), record offset (u32), slot (u32); sorted by hash,
//!   then position. No extra hash bits beside the 64: two keys of one segment share all
//!   64 with odds near n²/2⁶⁵ (10⁻⁸ for 500,000 keys), so extra bits would save a log
//!   read that practically never happens, for a second hash per entry in the tail.
//! - **Item entry**: seq (u64), record offset (u32), slot (u32). An item hash's events
//!   are one run in seq order; the runs follow each other in item-hash order.
//! - **Filter**: a blocked Bloom filter over the key hashes, 10 bits per key
//!   (`filter.rs`; its length follows from the key count).
//! - **Key fence**: each key block's first hash (u64): a lookup reads one block.
//! - **Item directory**: per item hash, 32 bytes: hash (u64), first item entry (u32),
//!   count (u32), first seq (u64), last seq (u64); in hash order.
//! - **Footer** (64 bytes): magic `NRTXSIDX`, [`FORMAT_VERSION`] (u32), key count, item
//!   entry count, item count (u32 each), the segment's first lsn, last lsn and length
//!   when sealed (u64 each), XXH3-64 of filter + fence + directory, XXH3-64 of the 56
//!   bytes before it.
//!
//! All little-endian. Counts and offsets fit 32 bits because a segment does: at most
//! 1 GiB plus one record of 64 MiB.

use std::path::Path;

use xxhash_rust::xxh3::xxh3_64;

use super::tail::ItemRun;
use super::{filter, IndexError, Tail};

pub const BLOCK_BYTES: usize = 4096;
/// Entries per block: 255 × 16 = 4,080 bytes, then the count, 4 zeros and the checksum.
pub const PER_BLOCK: usize = 255;
pub const ENTRY_BYTES: usize = 16;
pub const DIR_ENTRY_BYTES: usize = 32;
pub const FOOTER_BYTES: usize = 64;
const MAGIC: &[u8; 8] = b"NRTXSIDX";
/// The layout this code writes and reads; an index of another version is rebuilt.
pub const FORMAT_VERSION: u32 = 1;
/// Where a block's count is, after its entries.
pub const COUNT_AT: usize = PER_BLOCK * ENTRY_BYTES;

/// What an index file records of itself and its segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Footer {
    pub keys: u32,
    pub item_entries: u32,
    pub items: u32,
    pub first_lsn: u64,
    pub last_lsn: u64,
    /// The segment file's length when it was indexed (its footer included).
    pub segment_len: u64,
    /// XXH3-64 of the filter, fence and directory.
    pub meta_sum: u64,
}

pub(crate) fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

pub(crate) fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

impl Footer {
    pub fn encode(&self) -> [u8; FOOTER_BYTES] {
        let mut b = [0u8; FOOTER_BYTES];
        b[0..8].copy_from_slice(MAGIC);
        b[8..12].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
        b[12..16].copy_from_slice(&self.keys.to_le_bytes());
        b[16..20].copy_from_slice(&self.item_entries.to_le_bytes());
        b[20..24].copy_from_slice(&self.items.to_le_bytes());
        b[24..32].copy_from_slice(&self.first_lsn.to_le_bytes());
        b[32..40].copy_from_slice(&self.last_lsn.to_le_bytes());
        b[40..48].copy_from_slice(&self.segment_len.to_le_bytes());
        b[48..56].copy_from_slice(&self.meta_sum.to_le_bytes());
        let sum = xxh3_64(&b[..56]);
        b[56..64].copy_from_slice(&sum.to_le_bytes());
        b
    }

    /// The footer in `b`, or what is wrong with it.
    pub fn decode(b: &[u8]) -> Result<Footer, String> {
        let b = b.get(..FOOTER_BYTES).ok_or("shorter than a footer")?;
        if &b[0..8] != MAGIC {
            return Err("no index footer (magic)".into());
        }
        if u64_at(b, 56) != xxh3_64(&b[..56]) {
            return Err("the footer's checksum does not match".into());
        }
        let version = u32_at(b, 8);
        if version != FORMAT_VERSION {
            return Err(format!(
                "format version {version} (this build reads {FORMAT_VERSION})"
            ));
        }
        Ok(Footer {
            keys: u32_at(b, 12),
            item_entries: u32_at(b, 16),
            items: u32_at(b, 20),
            first_lsn: u64_at(b, 24),
            last_lsn: u64_at(b, 32),
            segment_len: u64_at(b, 40),
            meta_sum: u64_at(b, 48),
        })
    }
}

/// Where each section of a file with `footer`'s counts is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    pub key_blocks: u64,
    pub item_blocks: u64,
    pub filter_at: u64,
    pub filter_len: u64,
    pub fence_at: u64,
    pub dir_at: u64,
    pub footer_at: u64,
}

impl Layout {
    pub fn of(f: &Footer) -> Layout {
        let key_blocks = (f.keys as u64).div_ceil(PER_BLOCK as u64);
        let item_blocks = (f.item_entries as u64).div_ceil(PER_BLOCK as u64);
        let filter_at = (key_blocks + item_blocks) * BLOCK_BYTES as u64;
        let filter_len = filter::len_for(f.keys as usize) as u64;
        let fence_at = filter_at + filter_len;
        let dir_at = fence_at + key_blocks * 8;
        Layout {
            key_blocks,
            item_blocks,
            filter_at,
            filter_len,
            fence_at,
            dir_at,
            footer_at: dir_at + f.items as u64 * DIR_ENTRY_BYTES as u64,
        }
    }

    /// The file's whole length.
    pub fn file_len(&self) -> u64 {
        self.footer_at + FOOTER_BYTES as u64
    }

    /// The entries block `b` of a section of `n` entries holds.
    pub fn block_count(n: u64, b: u64) -> usize {
        (n - b * PER_BLOCK as u64).min(PER_BLOCK as u64) as usize
    }
}

/// What a sealed segment is, as its index records it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SegmentSeal {
    pub first_lsn: u64,
    pub last_lsn: u64,
    /// The segment file's length (its footer included).
    pub len: u64,
}

/// Appends `n` 16-byte entries as checksummed blocks.
fn put_blocks(out: &mut Vec<u8>, n: usize, entry: impl Fn(usize) -> [u8; ENTRY_BYTES]) {
    for b in 0..n.div_ceil(PER_BLOCK) {
        let start = out.len();
        let count = PER_BLOCK.min(n - b * PER_BLOCK);
        for i in b * PER_BLOCK..b * PER_BLOCK + count {
            out.extend_from_slice(&entry(i));
        }
        out.resize(start + COUNT_AT, 0);
        out.extend_from_slice(&(count as u32).to_le_bytes());
        out.extend_from_slice(&[0u8; 4]);
        let sum = xxh3_64(&out[start..start + BLOCK_BYTES - 8]);
        out.extend_from_slice(&sum.to_le_bytes());
    }
}

fn entry_bytes(first: u64, packed_pos: u64) -> [u8; ENTRY_BYTES] {
    let pos = super::Pos::unpack(packed_pos);
    let mut e = [0u8; ENTRY_BYTES];
    e[..8].copy_from_slice(&first.to_le_bytes());
    e[8..12].copy_from_slice(&(pos.offset as u32).to_le_bytes());
    e[12..16].copy_from_slice(&pos.slot.to_le_bytes());
    e
}

/// The index file's bytes for the segment `seal` whose entries `tail` holds.
pub(crate) fn build(tail: &Tail, seal: SegmentSeal) -> Vec<u8> {
    let keys = tail.sorted_keys();
    let items = tail.sorted_items();
    let flat: Vec<(u64, u64)> = items
        .iter()
        .flat_map(|(_, ev)| ev.iter().copied())
        .collect();
    // Offsets are stored in 32 bits: the segment's length bounds them.
    assert!(
        seal.len <= u64::from(u32::MAX) && keys.len().max(flat.len()) <= u32::MAX as usize,
        "segment {} of {} bytes is too long to index",
        seal.first_lsn,
        seal.len
    );
    let footer = Footer {
        keys: keys.len() as u32,
        item_entries: flat.len() as u32,
        items: items.len() as u32,
        first_lsn: seal.first_lsn,
        last_lsn: seal.last_lsn,
        segment_len: seal.len,
        meta_sum: 0,
    };
    let layout = Layout::of(&footer);
    let mut out = Vec::with_capacity(layout.file_len() as usize);
    put_blocks(&mut out, keys.len(), |i| entry_bytes(keys[i].0, keys[i].1));
    put_blocks(&mut out, flat.len(), |i| entry_bytes(flat[i].0, flat[i].1));
    let mut f = vec![0u8; layout.filter_len as usize];
    for (h, _) in &keys {
        filter::insert(&mut f, *h);
    }
    out.extend_from_slice(&f);
    for b in 0..keys.len().div_ceil(PER_BLOCK) {
        out.extend_from_slice(&keys[b * PER_BLOCK].0.to_le_bytes());
    }
    put_directory(&mut out, &items);
    // The sections written are where a reader will look for them: the layout a reader
    // derives from the footer's counts, computed apart from the writing above.
    assert_eq!(
        out.len() as u64,
        layout.footer_at,
        "segment {}: the index's sections do not add up to its layout",
        seal.first_lsn
    );
    let meta_sum = xxh3_64(&out[layout.filter_at as usize..]);
    out.extend_from_slice(&Footer { meta_sum, ..footer }.encode());
    out
}

/// Appends the item directory: per item hash, where its run starts, its length, and
/// its first and last seq.
fn put_directory(out: &mut Vec<u8>, items: &[ItemRun<'_>]) {
    let mut start = 0u32;
    for (ih, ev) in items {
        let (first, last) = (ev[0].0, ev[ev.len() - 1].0);
        out.extend_from_slice(&ih.to_le_bytes());
        out.extend_from_slice(&start.to_le_bytes());
        out.extend_from_slice(&(ev.len() as u32).to_le_bytes());
        out.extend_from_slice(&first.to_le_bytes());
        out.extend_from_slice(&last.to_le_bytes());
        start += ev.len() as u32;
    }
}

/// Writes `bytes` as the file `path`: under a temporary name, synced, then renamed and
/// the directory synced, so that a crash leaves the old file, the whole new one, or a
/// temporary file that [`super::Index::open`] deletes, never a torn index.
pub(crate) fn write_file(path: &Path, bytes: &[u8]) -> Result<(), IndexError> {
    crate::segment::replace_file(path, &path.with_extension("idx.tmp"), bytes)
        .map_err(IndexError::io(path))
}
