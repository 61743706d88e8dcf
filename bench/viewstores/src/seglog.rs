//! A stand-in for nrtxn's log (`log/src/segment.rs`): each batch is appended as one
//! checksummed record to the current segment file, and a new segment starts when the
//! next record would pass `seg_bytes_max` (64 MiB, as `embedded::journal::SEGMENT_BYTES`).
//!
//! Why simulate it: the per-segment indexes point into the log by position, and their
//! reads (a hit, a range of events, the rebuild of an index) read records back from it.
//! Its writes are not the derivation's cost (the real log writes them anyway), so the
//! candidates time them apart and subtract them.
//!
//! Simplified against the real log: a 16-byte record header (magic, body length, XXH3-64
//! of the body) instead of 80 bytes with a chain; each entry is its own frame, so a
//! position names one entry (the real log packs a batch with varints, and a position
//! would name the record and the entry's index in it).
//!
//! Frame: `len u16` (bytes after it), `shop u32`, `item u32`, `seq u64`, `key_len u8`,
//! key, outcome value; all little-endian.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use xxhash_rust::xxh3::xxh3_64;

use crate::Entries;

const REC_MAGIC: u32 = 0x4e52_5842;
const REC_HEADER: usize = 16;
/// Bytes of a frame before its key.
const FRAME_FIXED: usize = 2 + 4 + 4 + 8 + 1;
/// The largest frame: key and value are at most 255 bytes each here.
pub const FRAME_MAX: usize = FRAME_FIXED + 255 + 255;
/// Bytes read at once when records are fetched in order (a range of events).
const FETCH_BYTES: usize = 64 * 1024;

pub struct Frame<'a> {
    pub shop: u32,
    pub item: u32,
    pub seq: u64,
    pub key: &'a [u8],
    pub val: &'a [u8],
}

pub struct Segment {
    /// The seq of its first entry: its file is named after it, as the real log's are.
    pub first_seq: u64,
    pub file: File,
    pub len: u64,
    pub path: PathBuf,
}

pub struct SegLog {
    dir: PathBuf,
    pub segs: Vec<Segment>,
    seg_bytes_max: u64,
    buf: Vec<u8>,
}

/// A position in the log: the segment's index in `segs` above, and the frame's offset.
pub fn pos(seg: u32, off: u32) -> u64 {
    ((seg as u64) << 32) | off as u64
}
pub fn pos_parts(p: u64) -> (u32, u32) {
    ((p >> 32) as u32, p as u32)
}

/// Parses the frame at the start of `b`; None if `b` holds less than the whole frame.
pub fn parse(b: &[u8]) -> Option<(Frame<'_>, usize)> {
    if b.len() < FRAME_FIXED {
        return None;
    }
    let len = u16::from_le_bytes([b[0], b[1]]) as usize + 2;
    if b.len() < len {
        return None;
    }
    let klen = b[18] as usize;
    assert!(FRAME_FIXED + klen <= len, "frame's key runs past the frame");
    let f = Frame {
        shop: u32::from_le_bytes(b[2..6].try_into().unwrap()),
        item: u32::from_le_bytes(b[6..10].try_into().unwrap()),
        seq: u64::from_le_bytes(b[10..18].try_into().unwrap()),
        key: &b[FRAME_FIXED..FRAME_FIXED + klen],
        val: &b[FRAME_FIXED + klen..len],
    };
    Some((f, len))
}

fn segment_path(dir: &Path, first_seq: u64) -> PathBuf {
    dir.join(format!("{first_seq:020}.log"))
}

impl SegLog {
    pub fn create(dir: &Path, seg_bytes_max: u64) -> SegLog {
        std::fs::create_dir_all(dir).unwrap();
        SegLog {
            dir: dir.to_path_buf(),
            segs: Vec::new(),
            seg_bytes_max,
            buf: Vec::with_capacity(1 << 20),
        }
    }

    /// Opens the segments in `dir`, oldest first.
    pub fn open(dir: &Path, seg_bytes_max: u64) -> SegLog {
        let mut names: Vec<PathBuf> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|x| x == "log"))
            .collect();
        names.sort();
        let segs = names
            .into_iter()
            .map(|path| {
                let first_seq = path.file_stem().unwrap().to_str().unwrap().parse().unwrap();
                let file = OpenOptions::new().read(true).append(true).open(&path).unwrap();
                let len = file.metadata().unwrap().len();
                Segment {
                    first_seq,
                    file,
                    len,
                    path,
                }
            })
            .collect();
        SegLog {
            dir: dir.to_path_buf(),
            segs,
            seg_bytes_max,
            buf: Vec::with_capacity(1 << 20),
        }
    }

    /// Appends entries `range` as one record and puts each frame's offset in `offs`.
    /// Returns true if the record started a new segment (the previous one is then sealed).
    pub fn append(&mut self, e: &Entries, range: std::ops::Range<usize>, offs: &mut Vec<u32>) -> bool {
        let first_seq = e.seq[range.start];
        self.buf.clear();
        self.buf.resize(REC_HEADER, 0);
        let mut rel = Vec::with_capacity(range.len());
        for i in range {
            let (k, v) = (e.rkey(i), e.oval(i));
            assert!(k.len() <= 255 && v.len() <= 255, "frame fields are at most 255 bytes");
            rel.push(self.buf.len() as u32);
            let len = FRAME_FIXED - 2 + k.len() + v.len();
            self.buf.extend_from_slice(&(len as u16).to_le_bytes());
            self.buf.extend_from_slice(&e.shop[i].to_le_bytes());
            self.buf.extend_from_slice(&e.item[i].to_le_bytes());
            self.buf.extend_from_slice(&e.seq[i].to_le_bytes());
            self.buf.push(k.len() as u8);
            self.buf.extend_from_slice(k);
            self.buf.extend_from_slice(v);
        }
        let body_len = self.buf.len() - REC_HEADER;
        let sum = xxh3_64(&self.buf[REC_HEADER..]);
        self.buf[0..4].copy_from_slice(&REC_MAGIC.to_le_bytes());
        self.buf[4..8].copy_from_slice(&(body_len as u32).to_le_bytes());
        self.buf[8..16].copy_from_slice(&sum.to_le_bytes());
        let rolled = match self.segs.last() {
            None => true,
            Some(s) => s.len > 0 && s.len + self.buf.len() as u64 > self.seg_bytes_max,
        };
        if rolled {
            let path = segment_path(&self.dir, first_seq);
            let file = OpenOptions::new()
                .create_new(true)
                .read(true)
                .append(true)
                .open(&path)
                .unwrap();
            self.segs.push(Segment {
                first_seq,
                file,
                len: 0,
                path,
            });
        }
        let seg = self.segs.last_mut().unwrap();
        seg.file.write_all(&self.buf).unwrap();
        offs.clear();
        offs.extend(rel.iter().map(|r| (seg.len + *r as u64) as u32));
        seg.len += self.buf.len() as u64;
        rolled && self.segs.len() > 1
    }

    /// Reads the frame at `off` of segment `seg` into `buf` and parses it.
    pub fn read<'b>(&self, seg: u32, off: u32, buf: &'b mut [u8; FRAME_MAX]) -> Frame<'b> {
        let s = &self.segs[seg as usize];
        let n = (FRAME_MAX as u64).min(s.len - off as u64) as usize;
        s.file.read_exact_at(&mut buf[..n], off as u64).unwrap();
        parse(&buf[..n]).expect("a frame at an indexed position").0
    }

    /// Reads the frames at `positions` (in log order) and calls `f` with each. One read
    /// covers the frames that follow within 64 KiB (a hot item's run of events), and no
    /// more than the frame where the next is further (an item's events scattered).
    /// Returns the number of reads made.
    pub fn fetch(&self, positions: &[u64], mut f: impl FnMut(Frame<'_>)) -> usize {
        let mut buf = vec![0u8; FETCH_BYTES];
        let (mut at_seg, mut at_off, mut have) = (u32::MAX, 0u32, 0usize);
        let mut reads = 0;
        for (k, &p) in positions.iter().enumerate() {
            let (seg, off) = pos_parts(p);
            let inside = seg == at_seg && off >= at_off && ((off - at_off) as usize) < have;
            let whole = inside && parse(&buf[(off - at_off) as usize..have]).is_some();
            if !whole {
                let s = &self.segs[seg as usize];
                let mut end = off as u64 + FRAME_MAX as u64;
                for &q in &positions[k + 1..] {
                    let (qs, qo) = pos_parts(q);
                    if qs != seg || qo as u64 + FRAME_MAX as u64 > off as u64 + FETCH_BYTES as u64 {
                        break;
                    }
                    end = end.max(qo as u64 + FRAME_MAX as u64);
                }
                have = (end.min(s.len) - off as u64) as usize;
                s.file.read_exact_at(&mut buf[..have], off as u64).unwrap();
                (at_seg, at_off) = (seg, off);
                reads += 1;
            }
            let (fr, _) = parse(&buf[(off - at_off) as usize..have]).expect("a frame at an indexed position");
            f(fr);
        }
        reads
    }

    /// Reads segment `seg` whole, checks every record's checksum, and calls `f` with each
    /// frame and its offset. A bad record stops the scan with its offset (the real log
    /// would tell a torn tail from damage; here both are refused).
    pub fn scan(&self, seg: u32, mut f: impl FnMut(u32, Frame<'_>)) -> Result<(), String> {
        let s = &self.segs[seg as usize];
        let bytes = std::fs::read(&s.path).map_err(|e| e.to_string())?;
        let mut at = 0usize;
        while at < bytes.len() {
            let bad = || format!("{}: bad record at byte {at}", s.path.display());
            if bytes.len() - at < REC_HEADER || u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap()) != REC_MAGIC {
                return Err(bad());
            }
            let body_len = u32::from_le_bytes(bytes[at + 4..at + 8].try_into().unwrap()) as usize;
            let sum = u64::from_le_bytes(bytes[at + 8..at + 16].try_into().unwrap());
            let body = bytes.get(at + REC_HEADER..at + REC_HEADER + body_len).ok_or_else(bad)?;
            if xxh3_64(body) != sum {
                return Err(bad());
            }
            let mut k = 0;
            while k < body.len() {
                let (fr, len) = parse(&body[k..]).ok_or_else(bad)?;
                f((at + REC_HEADER + k) as u32, fr);
                k += len;
            }
            at += REC_HEADER + body_len;
        }
        Ok(())
    }
}
