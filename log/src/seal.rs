//! What the log knows about itself beyond its records, so that a start can tell a cut or
//! lost part of the log from a write torn by a crash:
//!
//! - **A sealed segment's footer.** When the writer moves to a new segment it ends the
//!   old one with a 64-byte footer (below) and syncs it: the segment's first and last
//!   record, the last one's header checksum and the segment's length. A start checks
//!   every kept segment it does not read whole against its footer and against the first
//!   record of the segment after it (two small reads each), so a segment cut short,
//!   deleted or replaced refuses the start; one without a good footer (a segment written
//!   before footers existed, or a damaged one) is read whole instead ([`verify_segment`]).
//!   A full read of the footer-checked segments runs after the start, off the path.
//! - **The durable mark** (`journal/DURABLE`). After every sync the writer writes the
//!   last synced record's number and header checksum here, without a sync of its own:
//!   a record named here was acknowledged. A start whose log ends before it (the tail
//!   cut, the newest segment deleted or damaged) refuses, naming the records missing,
//!   where a tail that ends after it is a write torn by the crash and is cut off. The
//!   mark survives the process being killed (it is in the page cache); a power loss may
//!   lose its last writes, which then leaves the newest groups, and only those, where a
//!   loss cannot be told from a torn write. `docs/decisions/log-ends.md` weighs this
//!   against a second copy of every header.
//!
//! Footer layout (little-endian): `b"NRTXSEAL"`, first lsn, last lsn, last record's header
//! checksum (16 bytes), length of the segment before the footer, 8 zero bytes, XXH3-64 of
//! the 56 bytes before. A durable mark slot: `b"NRTXDURA"`, lsn, header checksum (16
//! bytes), epoch, 16 zero bytes, XXH3-64 of the 56 bytes before; two slots, written in
//! turn, so that one torn by a power loss leaves the other.

use std::fs::{File, OpenOptions};
use std::io::{self, Read, Seek};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use xxhash_rust::xxh3::xxh3_64;

use crate::record::{checked_record, Header, LogError, HEADER_LEN};

pub const FOOTER_LEN: usize = 64;
const FOOTER_MAGIC: &[u8; 8] = b"NRTXSEAL";
const MARK_MAGIC: &[u8; 8] = b"NRTXDURA";
const SLOT_LEN: usize = 64;
/// The durable mark's file, beside the segments.
pub const MARK_FILE: &str = "DURABLE";
/// What the durable mark's file holds on the disk: its two slots, written in place.
pub const MARK_BYTES: u64 = 2 * SLOT_LEN as u64;

/// A sealed segment's footer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Footer {
    pub first_lsn: u64,
    pub last_lsn: u64,
    pub last_checksum: u128,
    /// Where the footer starts: the length of the segment's records.
    pub len: u64,
}

impl Footer {
    pub fn encode(&self) -> [u8; FOOTER_LEN] {
        let mut b = [0u8; FOOTER_LEN];
        b[0..8].copy_from_slice(FOOTER_MAGIC);
        b[8..16].copy_from_slice(&self.first_lsn.to_le_bytes());
        b[16..24].copy_from_slice(&self.last_lsn.to_le_bytes());
        b[24..40].copy_from_slice(&self.last_checksum.to_le_bytes());
        b[40..48].copy_from_slice(&self.len.to_le_bytes());
        let sum = xxh3_64(&b[..56]);
        b[56..64].copy_from_slice(&sum.to_le_bytes());
        b
    }

    /// The footer `b` starts with, if it is one and its checksum holds.
    pub fn decode(b: &[u8]) -> Option<Footer> {
        let b = b.get(..FOOTER_LEN)?;
        if &b[0..8] != FOOTER_MAGIC || b[56..64] != xxh3_64(&b[..56]).to_le_bytes() {
            return None;
        }
        let u64_at = |at: usize| u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"));
        Some(Footer {
            first_lsn: u64_at(8),
            last_lsn: u64_at(16),
            last_checksum: u128::from_le_bytes(b[24..40].try_into().expect("16 bytes")),
            len: u64_at(40),
        })
    }
}

/// The last record the writer synced: every record up to it was acknowledged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Acked {
    pub lsn: u64,
    pub checksum: u128,
    pub epoch: u64,
}

impl Acked {
    fn encode(&self) -> [u8; SLOT_LEN] {
        let mut b = [0u8; SLOT_LEN];
        b[0..8].copy_from_slice(MARK_MAGIC);
        b[8..16].copy_from_slice(&self.lsn.to_le_bytes());
        b[16..32].copy_from_slice(&self.checksum.to_le_bytes());
        b[32..40].copy_from_slice(&self.epoch.to_le_bytes());
        let sum = xxh3_64(&b[..56]);
        b[56..64].copy_from_slice(&sum.to_le_bytes());
        b
    }

    fn decode(b: &[u8]) -> Option<Acked> {
        if b.len() < SLOT_LEN
            || &b[0..8] != MARK_MAGIC
            || b[56..64] != xxh3_64(&b[..56]).to_le_bytes()
        {
            return None;
        }
        Some(Acked {
            lsn: u64::from_le_bytes(b[8..16].try_into().expect("8 bytes")),
            checksum: u128::from_le_bytes(b[16..32].try_into().expect("16 bytes")),
            epoch: u64::from_le_bytes(b[32..40].try_into().expect("8 bytes")),
        })
    }
}

/// The durable mark of the log in `dir`: `None` when there is none yet (a new log, or
/// one written before the mark existed). A mark file that holds something but no good
/// slot refuses: it was damaged, and what it vouched for can no longer be checked.
pub fn read_mark(dir: &Path) -> Result<Option<Acked>, LogError> {
    let path = dir.join(MARK_FILE);
    let bytes = match std::fs::read(&path) {
        Ok(b) => b,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e.into()),
    };
    let best = bytes
        .chunks(SLOT_LEN)
        .take(2)
        .filter_map(Acked::decode)
        .max_by_key(|a| a.lsn);
    if best.is_none() && bytes.iter().any(|b| *b != 0) {
        return Err(LogError::Corrupt {
            file: path,
            offset: 0,
            lsn: 0,
            detail: format!(
                "the durable mark is damaged, so whether the log's tail was acknowledged \
                 cannot be checked. To start from what the log holds (a tail that was cut \
                 would then be taken for a torn write), remove {MARK_FILE}"
            ),
        });
    }
    Ok(best)
}

/// Writes the durable mark in turn into its two slots (no sync: see the module's
/// documentation).
pub struct MarkWriter {
    file: File,
    slot: u64,
    /// The last record this writer said was acknowledged.
    lsn: u64,
}

impl MarkWriter {
    pub fn open(dir: &Path) -> Result<MarkWriter, LogError> {
        let file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .read(true)
            .write(true)
            .open(dir.join(MARK_FILE))?;
        Ok(MarkWriter {
            file,
            slot: 0,
            lsn: 0,
        })
    }

    pub fn write(&mut self, acked: Acked) -> io::Result<()> {
        // A record once said acknowledged stays so: a start whose log ends before the
        // mark refuses, so a mark that moved back would hide records that were lost.
        assert!(
            acked.lsn >= self.lsn,
            "the durable mark would move back from record {} to record {}",
            self.lsn,
            acked.lsn
        );
        self.file
            .write_all_at(&acked.encode(), self.slot * SLOT_LEN as u64)?;
        self.slot ^= 1;
        self.lsn = acked.lsn;
        Ok(())
    }
}

/// Where a sealed segment leads: the next segment's first lsn and its first record's
/// parent (the checksum the sealed one must end with).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Successor {
    pub first_lsn: u64,
    pub parent: Option<u128>,
}

/// The first record's header of the segment at `path`, if it reads.
pub fn first_header(path: &Path) -> io::Result<Option<Header>> {
    let mut b = [0u8; HEADER_LEN];
    let mut f = File::open(path)?;
    match f.read_exact(&mut b) {
        Ok(()) => Ok(Header::decode(&b)),
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => Ok(None),
        Err(e) => Err(e),
    }
}

/// Checks the sealed segment `path` (named for `first`) by its footer alone: present,
/// whole, matching the file's length, and leading to `next`. `Ok(false)` when there is
/// no good footer (read the segment whole to know more).
pub fn footer_holds(path: &Path, first: u64, next: Successor) -> io::Result<bool> {
    let mut f = File::open(path)?;
    let len = f.metadata()?.len();
    if len < FOOTER_LEN as u64 {
        return Ok(false);
    }
    let mut b = [0u8; FOOTER_LEN];
    f.seek(io::SeekFrom::Start(len - FOOTER_LEN as u64))?;
    f.read_exact(&mut b)?;
    Ok(Footer::decode(&b).is_some_and(|ft| {
        ft.first_lsn == first
            && ft.len + FOOTER_LEN as u64 == len
            && ft.last_lsn + 1 == next.first_lsn
            && next.parent.is_none_or(|p| p == ft.last_checksum)
    }))
}

/// Reads the sealed segment `path` (named for `first`) whole: every record's checksums,
/// their numbers from `first` on, their chain, the footer if there is one, and that it
/// leads to `next`. The error names the file and the byte.
pub fn verify_segment(path: &Path, first: u64, next: Successor) -> Result<(), LogError> {
    let data = std::fs::read(path)?;
    let corrupt = |offset: usize, lsn: u64, detail: String| LogError::Corrupt {
        file: PathBuf::from(path),
        offset: offset as u64,
        lsn,
        detail,
    };
    let (mut at, mut lsn, mut parent) = (0usize, first, None::<u128>);
    while at < data.len() {
        if data.len() - at == FOOTER_LEN {
            if let Some(ft) = Footer::decode(&data[at..]) {
                if ft.first_lsn != first || ft.len != at as u64 || ft.last_lsn + 1 != lsn {
                    return Err(corrupt(
                        at,
                        lsn,
                        "the footer does not match the segment".into(),
                    ));
                }
                break;
            }
        }
        let (header, end) = checked_record(&data, at).map_err(|d| corrupt(at, lsn, d))?;
        if header.lsn != lsn || parent.is_some_and(|p| p != header.parent) {
            return Err(corrupt(
                at,
                lsn,
                format!(
                    "record {} does not follow on from the one before it",
                    header.lsn
                ),
            ));
        }
        parent = Some(header.checksum);
        lsn += 1;
        at = end;
    }
    if lsn != next.first_lsn {
        return Err(corrupt(
            data.len(),
            lsn,
            format!(
                "the segment ends before record {lsn}, but the next segment starts at record {}: \
                 records are missing",
                next.first_lsn
            ),
        ));
    }
    if let (Some(p), Some(want)) = (parent, next.parent) {
        if p != want {
            return Err(corrupt(
                data.len(),
                lsn,
                "the next segment does not chain to this one's last record".into(),
            ));
        }
    }
    Ok(())
}
