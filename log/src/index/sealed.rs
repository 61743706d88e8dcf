//! A sealed segment's index, opened: the filter, fence and directory in memory (checked
//! at open against the footer's checksum), the blocks read from the file as they are
//! needed, each checked as it is read. No mapping: a read is a `pread` of 4 KiB, and a
//! damaged or truncated file is an error, never a fault in the middle of a lookup.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use xxhash_rust::xxh3::xxh3_64;

use super::format::{
    u32_at, u64_at, Footer, Layout, BLOCK_BYTES, COUNT_AT, DIR_ENTRY_BYTES, ENTRY_BYTES,
    FOOTER_BYTES,
};
use super::{filter, IndexError, Pos};

/// One item hash's run, from the directory.
#[derive(Debug, Clone, Copy)]
struct DirEntry {
    hash: u64,
    /// Its first entry among the item entries.
    start: u64,
    count: u64,
    first_seq: u64,
    last_seq: u64,
}

/// An opened `.idx` file. Shared by readers (`&self` only): a block read is a `pread`.
pub struct SealedIndex {
    path: PathBuf,
    file: File,
    footer: Footer,
    layout: Layout,
    filter: Vec<u8>,
    /// Each key block's first hash.
    fence: Vec<u64>,
    dir: Vec<DirEntry>,
}

type Block = [u8; BLOCK_BYTES];

impl SealedIndex {
    /// Opens the index at `path` of a segment now `segment_len` bytes long: checks the
    /// footer, that the sections add up to the file's length, the checksum of the parts
    /// kept in memory and their order, and that the segment is as long as when it was
    /// indexed. Any error means: rebuild it from its segment ([`super::rebuild`]).
    pub fn open(path: &Path, segment_len: u64) -> Result<SealedIndex, IndexError> {
        let bad = |detail: String| IndexError::bad(path, detail);
        let file = File::open(path).map_err(IndexError::io(path))?;
        let len = file.metadata().map_err(IndexError::io(path))?.len();
        if len < FOOTER_BYTES as u64 {
            return Err(bad(format!("{len} bytes, shorter than a footer")));
        }
        let mut fb = [0u8; FOOTER_BYTES];
        file.read_exact_at(&mut fb, len - FOOTER_BYTES as u64)
            .map_err(IndexError::io(path))?;
        let footer = Footer::decode(&fb).map_err(bad)?;
        let layout = Layout::of(&footer);
        if layout.file_len() != len {
            return Err(bad(format!(
                "{len} bytes, but its footer's counts make {}",
                layout.file_len()
            )));
        }
        if footer.segment_len != segment_len {
            return Err(bad(format!(
                "built for a segment of {} bytes, which is now {segment_len}",
                footer.segment_len
            )));
        }
        let mut meta = vec![0u8; (layout.footer_at - layout.filter_at) as usize];
        file.read_exact_at(&mut meta, layout.filter_at)
            .map_err(IndexError::io(path))?;
        if xxh3_64(&meta) != footer.meta_sum {
            return Err(bad(
                "the checksum of its filter, fence and directory does not match".into(),
            ));
        }
        let (filter, rest) = meta.split_at(layout.filter_len as usize);
        let (fence, dir) = rest.split_at(layout.key_blocks as usize * 8);
        let fence: Vec<u64> = (0..layout.key_blocks as usize)
            .map(|b| u64_at(fence, b * 8))
            .collect();
        let dir = parse_directory(dir, &footer).map_err(bad)?;
        if !fence.is_sorted() {
            return Err(bad("its key fence is out of order".into()));
        }
        Ok(SealedIndex {
            path: path.to_path_buf(),
            file,
            footer,
            layout,
            filter: filter.to_vec(),
            fence,
            dir,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn first_lsn(&self) -> u64 {
        self.footer.first_lsn
    }

    pub fn last_lsn(&self) -> u64 {
        self.footer.last_lsn
    }

    /// The segment file's length when it was indexed.
    pub fn segment_len(&self) -> u64 {
        self.footer.segment_len
    }

    pub fn keys(&self) -> u64 {
        u64::from(self.footer.keys)
    }

    /// False: no entry of the segment has this key hash. True: one may have.
    pub fn may_contain(&self, key_hash: u64) -> bool {
        filter::may_contain(&self.filter, key_hash)
    }

    /// Reads block `b` of the file (key blocks first, then item blocks) and checks it:
    /// its checksum, and that it holds the count of entries its place says.
    fn block(&self, b: u64) -> Result<Block, IndexError> {
        let damaged = |detail: String| IndexError::Block {
            file: self.path.clone(),
            block: b,
            detail,
        };
        let mut blk = [0u8; BLOCK_BYTES];
        self.file
            .read_exact_at(&mut blk, b * BLOCK_BYTES as u64)
            .map_err(IndexError::io(&self.path))?;
        if xxh3_64(&blk[..BLOCK_BYTES - 8]) != u64_at(&blk, BLOCK_BYTES - 8) {
            return Err(damaged("its checksum does not match".into()));
        }
        let l = &self.layout;
        let want = if b < l.key_blocks {
            Layout::block_count(u64::from(self.footer.keys), b)
        } else {
            Layout::block_count(u64::from(self.footer.item_entries), b - l.key_blocks)
        };
        let count = u32_at(&blk, COUNT_AT) as usize;
        if count != want {
            return Err(damaged(format!(
                "it holds {count} entries where {want} are due"
            )));
        }
        Ok(blk)
    }

    /// The positions of the entries whose key hash is `h`, in log order.
    pub fn key_positions(&self, h: u64) -> Result<Vec<Pos>, IndexError> {
        let mut out = Vec::new();
        if !self.may_contain(h) {
            return Ok(out);
        }
        let first = self.fence.partition_point(|f| *f < h).saturating_sub(1);
        for b in first..self.fence.len() {
            if self.fence[b] > h {
                break;
            }
            let blk = self.block(b as u64)?;
            let n = u32_at(&blk, COUNT_AT) as usize;
            let hash = |i: usize| u64_at(&blk, i * ENTRY_BYTES);
            let mut i = lower_bound(n, |i| hash(i) < h);
            while i < n && hash(i) == h {
                out.push(entry_pos(&blk, i));
                i += 1;
            }
            if i < n {
                break;
            }
        }
        Ok(out)
    }

    /// Calls `f` with every key hash of the segment, reading its key blocks (each
    /// checked): what the filter over all sealed segments is built from
    /// (the filter of `keys.rs`).
    pub fn for_each_key(&self, mut f: impl FnMut(u64)) -> Result<(), IndexError> {
        for b in 0..self.layout.key_blocks {
            let blk = self.block(b)?;
            let n = u32_at(&blk, COUNT_AT) as usize;
            (0..n).for_each(|i| f(u64_at(&blk, i * ENTRY_BYTES)));
        }
        Ok(())
    }

    /// The events of item hash `ih` from `from_seq` on, in seq order, at most `limit`.
    pub fn item_events(
        &self,
        ih: u64,
        from_seq: u64,
        limit: usize,
    ) -> Result<Vec<(u64, Pos)>, IndexError> {
        let Ok(i) = self.dir.binary_search_by_key(&ih, |d| d.hash) else {
            return Ok(Vec::new());
        };
        let d = self.dir[i];
        if d.last_seq < from_seq || limit == 0 {
            return Ok(Vec::new());
        }
        let mut run = RunReader {
            index: self,
            run: d,
            cached: None,
        };
        // The first entry at or after `from_seq`: a binary search, one block per probe.
        let (mut lo, mut hi) = (0u64, d.count);
        while lo < hi {
            let mid = (lo + hi) / 2;
            if run.entry(mid)?.0 < from_seq {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        let mut out = Vec::with_capacity(limit.min((d.count - lo) as usize));
        for k in lo..d.count {
            if out.len() == limit {
                break;
            }
            out.push(run.entry(k)?);
        }
        Ok(out)
    }

    /// Reads and checks every block: what a start would run off the path, as the log's
    /// full read of the segments checked by their footers alone.
    pub fn check_blocks(&self) -> Result<(), IndexError> {
        let blocks = self.layout.key_blocks + self.layout.item_blocks;
        (0..blocks).try_for_each(|b| self.block(b).map(drop))
    }
}

/// Reads a run's entries, keeping the last block read.
struct RunReader<'a> {
    index: &'a SealedIndex,
    run: DirEntry,
    cached: Option<(u64, Block)>,
}

impl RunReader<'_> {
    /// The run's `k`th entry: (seq, position).
    fn entry(&mut self, k: u64) -> Result<(u64, Pos), IndexError> {
        let at = self.run.start + k;
        let per = super::format::PER_BLOCK as u64;
        let b = self.index.layout.key_blocks + at / per;
        if self.cached.as_ref().is_none_or(|(cb, _)| *cb != b) {
            self.cached = Some((b, self.index.block(b)?));
        }
        let (_, blk) = self.cached.as_ref().expect("cached just above");
        let i = (at % per) as usize;
        Ok((u64_at(blk, i * ENTRY_BYTES), entry_pos(blk, i)))
    }
}

fn entry_pos(blk: &[u8], i: usize) -> Pos {
    Pos {
        offset: u64::from(u32_at(blk, i * ENTRY_BYTES + 8)),
        slot: u32_at(blk, i * ENTRY_BYTES + 12),
    }
}

/// First `i` in `0..n` for which `below(i)` is false (`below` true, then false).
fn lower_bound(n: usize, mut below: impl FnMut(usize) -> bool) -> usize {
    let (mut lo, mut hi) = (0, n);
    while lo < hi {
        let mid = (lo + hi) / 2;
        if below(mid) {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    lo
}

/// The directory's entries, checked: hashes rising, runs that follow each other and
/// cover the item entries, seqs in order. A directory that passed its checksum and
/// fails these was written wrong: rebuilt all the same.
fn parse_directory(b: &[u8], footer: &Footer) -> Result<Vec<DirEntry>, String> {
    let mut dir = Vec::with_capacity(footer.items as usize);
    let mut next_start = 0u64;
    for i in 0..footer.items as usize {
        let at = i * DIR_ENTRY_BYTES;
        let d = DirEntry {
            hash: u64_at(b, at),
            start: u64::from(u32_at(b, at + 8)),
            count: u64::from(u32_at(b, at + 12)),
            first_seq: u64_at(b, at + 16),
            last_seq: u64_at(b, at + 24),
        };
        let after_last = dir.last().is_none_or(|p: &DirEntry| p.hash < d.hash);
        if !after_last || d.start != next_start || d.count == 0 || d.first_seq > d.last_seq {
            return Err(format!("its item directory is inconsistent at item {i}"));
        }
        next_start += d.count;
        dir.push(d);
    }
    if next_start != u64::from(footer.item_entries) {
        return Err("its item directory does not cover its item entries".into());
    }
    Ok(dir)
}
