//! The log as the index reads it: one entry at a position (a `pread` of its record,
//! checked as a scan checks it, then decoded), and one segment read whole, to rebuild
//! its index or to fill the tail at a start.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use nrtxn_actors::types::Entry;
use xxhash_rust::xxh3::xxh3_128;

use super::format::{self, SegmentSeal};
use super::{idx_path, IndexError, Pos, SealedIndex, Tail, KIND_ENTRIES};
use crate::codec;
use crate::record::{checked_record, Header, BODY_MAX, HEADER_LEN, VERSION};
use crate::seal::{self, FOOTER_LEN};

/// A segment file that positions are read from; opened at the first read and kept
/// open, so that a lookup pays no `open`.
pub struct SegmentFile {
    path: PathBuf,
    first_lsn: u64,
    file: OnceLock<File>,
}

impl SegmentFile {
    pub fn new(path: PathBuf, first_lsn: u64) -> SegmentFile {
        SegmentFile {
            path,
            first_lsn,
            file: OnceLock::new(),
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn first_lsn(&self) -> u64 {
        self.first_lsn
    }

    fn file(&self) -> Result<&File, IndexError> {
        if let Some(f) = self.file.get() {
            return Ok(f);
        }
        let f = File::open(&self.path).map_err(IndexError::io(&self.path))?;
        // Two readers may race to open it: either file will do.
        Ok(self.file.get_or_init(|| f))
    }

    /// The entries of the record at `offset`, if its header and body check out and it
    /// is an entries record of this segment.
    pub fn record(&self, offset: u64) -> Result<Vec<Entry>, IndexError> {
        let bad = |detail: String| IndexError::Log {
            file: self.path.clone(),
            offset,
            detail,
        };
        let file = self.file()?;
        let mut hb = [0u8; HEADER_LEN];
        file.read_exact_at(&mut hb, offset)
            .map_err(|e| bad(format!("the record's header cannot be read: {e}")))?;
        let h = Header::decode(&hb).ok_or_else(|| bad("header checksum does not match".into()))?;
        if h.version != VERSION || h.kind != KIND_ENTRIES || h.lsn < self.first_lsn {
            return Err(bad(format!(
                "record {} (version {}, kind {}) is not an entries record of this segment",
                h.lsn, h.version, h.kind
            )));
        }
        let len = h.body_len as usize;
        if len > BODY_MAX {
            return Err(bad(format!("body of {len} bytes is over {BODY_MAX}")));
        }
        let mut body = vec![0u8; len];
        file.read_exact_at(&mut body, offset + HEADER_LEN as u64)
            .map_err(|e| bad(format!("the record's body cannot be read: {e}")))?;
        if xxh3_128(&body) != h.body_checksum {
            return Err(bad("body checksum does not match".into()));
        }
        codec::decode(&body, h.at_ms).map_err(bad)
    }

    /// The entry at `pos`.
    pub fn entry(&self, pos: Pos) -> Result<Entry, IndexError> {
        let mut entries = self.record(pos.offset)?;
        if pos.slot as usize >= entries.len() {
            return Err(IndexError::Log {
                file: self.path.clone(),
                offset: pos.offset,
                detail: format!(
                    "the index names entry {} of a record of {} entries",
                    pos.slot,
                    entries.len()
                ),
            });
        }
        Ok(entries.swap_remove(pos.slot as usize))
    }
}

/// A segment read whole into a tail.
pub(crate) struct SegmentRead {
    pub(crate) tail: Tail,
    /// The last record's lsn (`None`: no record).
    pub(crate) last_lsn: Option<u64>,
    pub(crate) file_len: u64,
}

/// The first lsn a segment file is named for.
pub(crate) fn first_lsn_of(path: &Path) -> Result<u64, IndexError> {
    path.file_stem()
        .and_then(|s| s.to_str())
        .filter(|s| s.len() == 20)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| IndexError::Log {
            file: path.to_path_buf(),
            offset: 0,
            detail: "not a segment's name (20 digits, .log)".into(),
        })
}

/// Reads the segment at `path` into a tail (all of it durable). `whole`: every byte
/// must be a record or the footer, as in a sealed segment (a bad record is an error
/// naming its byte); otherwise the records end at the first that does not check, as
/// the newest segment's do after a start cut its torn tail or before its zeros.
pub(crate) fn read_segment(path: &Path, whole: bool) -> Result<SegmentRead, IndexError> {
    let first = first_lsn_of(path)?;
    let data = std::fs::read(path).map_err(IndexError::io(path))?;
    let bad = |offset: usize, detail: String| IndexError::Log {
        file: path.to_path_buf(),
        offset: offset as u64,
        detail,
    };
    let (mut tail, mut at, mut lsn) = (Tail::new(first), 0usize, first);
    while at < data.len() {
        if data.len() - at == FOOTER_LEN {
            if let Some(ft) = seal::Footer::decode(&data[at..]) {
                if ft.first_lsn != first || ft.len != at as u64 || ft.last_lsn + 1 != lsn {
                    return Err(bad(at, "the footer does not match the segment".into()));
                }
                break;
            }
        }
        let (h, end) = match checked_record(&data, at) {
            Ok(v) => v,
            Err(_) if !whole => break,
            Err(detail) => return Err(bad(at, detail)),
        };
        if h.lsn != lsn {
            return Err(bad(
                at,
                format!("record {} where record {lsn} was due", h.lsn),
            ));
        }
        if h.kind == KIND_ENTRIES {
            let entries =
                codec::decode(&data[at + HEADER_LEN..end], h.at_ms).map_err(|d| bad(at, d))?;
            tail.add_record(at as u64, &entries);
        }
        lsn += 1;
        at = end;
    }
    tail.mark_durable(at as u64);
    Ok(SegmentRead {
        tail,
        last_lsn: (lsn > first).then(|| lsn - 1),
        file_len: data.len() as u64,
    })
}

/// Writes the index of the sealed segment `seal`, whose entries `tail` holds, beside
/// the segment at `segment_path`, and opens it.
pub(crate) fn write_index(
    segment_path: &Path,
    tail: &Tail,
    seal: SegmentSeal,
) -> Result<SealedIndex, IndexError> {
    let path = idx_path(segment_path);
    format::write_file(&path, &format::build(tail, seal))?;
    SealedIndex::open(&path, seal.len)
}

/// Rebuilds the index of the sealed segment at `segment_path` from the segment alone,
/// replacing whatever index file was there, and opens it.
pub fn rebuild(segment_path: &Path) -> Result<SealedIndex, IndexError> {
    let read = read_segment(segment_path, true)?;
    let Some(last_lsn) = read.last_lsn else {
        return Err(IndexError::Log {
            file: segment_path.to_path_buf(),
            offset: 0,
            detail: "a sealed segment with no record".into(),
        });
    };
    let seal = SegmentSeal {
        first_lsn: read.tail.first_lsn(),
        last_lsn,
        len: read.file_len,
    };
    write_index(segment_path, &read.tail, seal)
}
