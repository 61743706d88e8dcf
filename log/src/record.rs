//! A record of the log: an 80-byte header and a body, checked by [`checked_record`].
//! The header carries:
//!
//! | bytes  | field                                                        |
//! |--------|--------------------------------------------------------------|
//! | 0..16  | checksum of bytes 16..80 (XXH3-128)                          |
//! | 16..32 | `parent`: the header checksum of the record before it       |
//! | 32..48 | checksum of the body (XXH3-128)                              |
//! | 48..56 | `lsn`: the record's number, one more than the record before |
//! | 56..64 | the writer's epoch, never lower than the record before's    |
//! | 64..68 | body length                                                  |
//! | 68..70 | format version                                               |
//! | 70     | kind (what the body is; the log does not read it)           |
//! | 71     | zero                                                         |
//! | 72..80 | when it was written (ms since the Unix epoch)                |
//!
//! All little-endian. A segment file is named after the `lsn` of its first record (20
//! digits, `.log`); a segment ends where the next one begins, so a missing segment is a
//! gap in the numbers.

use std::io;
use std::path::PathBuf;

use xxhash_rust::xxh3::xxh3_128;

/// The format this code writes and reads.
pub const VERSION: u16 = 1;
pub const HEADER_LEN: usize = 80;
/// A body larger than this is refused on write and read as corruption.
pub const BODY_MAX: usize = 64 * 1024 * 1024;

/// A record's header, as written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    pub checksum: u128,
    pub parent: u128,
    pub body_checksum: u128,
    pub lsn: u64,
    pub epoch: u64,
    pub body_len: u32,
    pub version: u16,
    pub kind: u8,
    pub at_ms: i64,
}

impl Header {
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[16..32].copy_from_slice(&self.parent.to_le_bytes());
        b[32..48].copy_from_slice(&self.body_checksum.to_le_bytes());
        b[48..56].copy_from_slice(&self.lsn.to_le_bytes());
        b[56..64].copy_from_slice(&self.epoch.to_le_bytes());
        b[64..68].copy_from_slice(&self.body_len.to_le_bytes());
        b[68..70].copy_from_slice(&self.version.to_le_bytes());
        b[70] = self.kind;
        b[72..80].copy_from_slice(&self.at_ms.to_le_bytes());
        let sum = xxh3_128(&b[16..]);
        b[0..16].copy_from_slice(&sum.to_le_bytes());
        b
    }

    /// The header in `b`, if its checksum holds.
    pub(super) fn decode(b: &[u8]) -> Option<Header> {
        let b: &[u8; HEADER_LEN] = b.get(..HEADER_LEN)?.try_into().ok()?;
        let checksum = u128::from_le_bytes(b[0..16].try_into().ok()?);
        if checksum != xxh3_128(&b[16..]) || b[71] != 0 {
            return None;
        }
        Some(Header {
            checksum,
            parent: u128::from_le_bytes(b[16..32].try_into().ok()?),
            body_checksum: u128::from_le_bytes(b[32..48].try_into().ok()?),
            lsn: u64::from_le_bytes(b[48..56].try_into().ok()?),
            epoch: u64::from_le_bytes(b[56..64].try_into().ok()?),
            body_len: u32::from_le_bytes(b[64..68].try_into().ok()?),
            version: u16::from_le_bytes(b[68..70].try_into().ok()?),
            kind: b[70],
            at_ms: i64::from_le_bytes(b[72..80].try_into().ok()?),
        })
    }
}

/// Where the log goes on: the next record's `lsn` and `parent`, and the highest epoch
/// written so far.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Chain {
    pub next_lsn: u64,
    pub parent: u128,
    pub epoch: u64,
}

/// What a scan found wrong. Every variant names the file and the byte offset.
#[derive(Debug, thiserror::Error)]
pub enum LogError {
    #[error("journal: {0}")]
    Io(#[from] io::Error),
    #[error(
        "journal corrupt in {file} at byte {offset} (record {lsn}): {detail}. Records after it \
         may have been acknowledged, so the start is refused: restore the data dir from a \
         backup (`nrtxn restore`)"
    )]
    Corrupt {
        file: PathBuf,
        offset: u64,
        lsn: u64,
        detail: String,
    },
    #[error(
        "journal has a gap: {detail}. A segment is missing; restore the data dir from a backup \
         (`nrtxn restore`)"
    )]
    Gap { detail: String },
}

impl LogError {
    /// Whether the disk had no room for what was written (see `crate::space`).
    pub fn no_room(&self) -> bool {
        matches!(self, LogError::Io(e) if crate::space::io_no_room(e))
    }
}

/// The record at `at`, if its header and body check out; the reason otherwise.
pub fn checked_record(data: &[u8], at: usize) -> Result<(Header, usize), String> {
    let header = Header::decode(&data[at..]).ok_or("header checksum does not match")?;
    if header.version != VERSION {
        return Err(format!(
            "format version {} (this build reads {VERSION})",
            header.version
        ));
    }
    let len = header.body_len as usize;
    let end = at + HEADER_LEN + len;
    if len > BODY_MAX || end > data.len() {
        return Err(format!("body of {len} bytes runs past the file"));
    }
    if xxh3_128(&data[at + HEADER_LEN..end]) != header.body_checksum {
        return Err("body checksum does not match".into());
    }
    Ok((header, end))
}
