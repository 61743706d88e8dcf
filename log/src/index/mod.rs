//! `segidx`: the views derived from the log, as sorted indexes of log positions, one
//! per sealed segment, and an in-memory [`Tail`] for the segment being written
//! (`docs/decisions/derived-views.md`). Nothing here stores an outcome: a hit names a
//! record and an entry in it, the entry is read from the log under the log's own checks,
//! and its shop and key (or item) are compared, so a hash that collides costs a read,
//! never a wrong answer.
//!
//! - [`Tail`]: the segment being written. The log writer adds each entries record as it
//!   writes it and marks what its sync made durable; reads see only the durable part.
//! - [`SealedIndex`]: `<20-digit first lsn>.idx` beside `<first lsn>.log`, written from
//!   the tail when the segment is sealed, or rebuilt from the segment alone. Its layout
//!   is in [`mod@format`]. Opened with its footer and the parts kept in memory checked; every
//!   4 KiB block is checked when it is read.
//! - [`Index`]: the facade the journal calls: key lookups newest first, an item's
//!   events across segments in seq order (gapless or refused), seals and retirements.
//!   Its documentation says what the journal's writer, readers and maintenance call.
//! - `keys::SealedKeys`: one filter over every sealed segment's keys, so that a key
//!   check costs one memory access however many segments the key window keeps.

mod facade;
mod filter;
pub mod format;
mod keys;
mod sealed;
mod segfile;
mod tail;
#[cfg(test)]
mod tests;

use std::io;
use std::path::{Path, PathBuf};

use xxhash_rust::xxh3::xxh3_64;

pub use facade::{Index, Refreshed, Written, EVENTS_MAX};
pub use sealed::SealedIndex;
pub use segfile::{rebuild, SegmentFile};
pub use tail::Tail;

/// Raises this process's soft limit of open files to its hard limit, and returns the
/// limit it has. A sealed segment and its index stay open once read, and segments are
/// kept for the key window: thousands of them at full rate for 7 days, past the usual
/// soft limit of 1,024.
pub fn raise_open_files_limit() -> Option<u64> {
    use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
    let now = getrlimit(Resource::Nofile);
    if now.current != now.maximum {
        let raised = Rlimit {
            current: now.maximum,
            maximum: now.maximum,
        };
        if setrlimit(Resource::Nofile, raised).is_ok() {
            return now.maximum;
        }
    }
    now.current
}

/// The record kind whose body is a batch of entries (`codec`): the only records
/// indexed. The embedded journal writes its entries records with this kind (its own
/// `KIND_ENTRIES` must stay equal to it).
pub const KIND_ENTRIES: u8 = 1;

/// Where an entry is in its segment: the record's byte offset in the segment file and
/// the entry's index among the record's decoded entries. The segment itself (its first
/// lsn) is known from the index or tail the position came from. Ordered as the log is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Pos {
    pub offset: u64,
    pub slot: u32,
}

/// Bits of a packed position that hold the slot: a record body is at most 64 MiB
/// (`record::BODY_MAX`) and an entry takes at least 11 bytes (flags, codes, quantity,
/// fingerprint), so a record holds fewer than 2^23 entries.
const SLOT_BITS: u32 = 24;
/// A packed position's offset takes the other 40 bits: segments are at most 1 GiB
/// (the configuration's bound) plus one record, far below 2^40 bytes.
const OFFSET_MAX: u64 = 1 << (64 - SLOT_BITS);

impl Pos {
    /// The position in one `u64`, ordered as `Pos` is: the tail keeps 8 bytes per
    /// position instead of 16.
    fn pack(self) -> u64 {
        debug_assert!(self.offset < OFFSET_MAX && self.slot < 1 << SLOT_BITS);
        (self.offset << SLOT_BITS) | u64::from(self.slot)
    }

    fn unpack(v: u64) -> Pos {
        Pos {
            offset: v >> SLOT_BITS,
            slot: (v & ((1 << SLOT_BITS) - 1)) as u32,
        }
    }
}

/// XXH3-64 of `shop`, a 0 byte and `name`. Names hold no control characters (the
/// request's validation), so the 0 byte keeps (shop, name) pairs apart; the tests use
/// names with a 0 byte in them to make real collisions.
fn pair_hash(shop: &str, name: &str) -> u64 {
    let len = shop.len() + 1 + name.len();
    let mut stack = [0u8; 256];
    let mut heap = Vec::new();
    let buf: &mut [u8] = if len <= stack.len() {
        &mut stack[..len]
    } else {
        heap.resize(len, 0);
        &mut heap
    };
    buf[..shop.len()].copy_from_slice(shop.as_bytes());
    buf[shop.len()] = 0;
    buf[shop.len() + 1..].copy_from_slice(name.as_bytes());
    xxh3_64(buf)
}

/// The hash a request key is indexed by.
pub fn key_hash(shop: &str, key: &str) -> u64 {
    pair_hash(shop, key)
}

/// The hash an item's events are indexed by.
pub fn item_hash(shop: &str, item: &str) -> u64 {
    pair_hash(shop, item)
}

/// The index file of the segment at `segment_path`: the same name, `.idx`.
pub fn idx_path(segment_path: &Path) -> PathBuf {
    segment_path.with_extension("idx")
}

/// What went wrong with an index or a read through it. Every variant names the file.
#[derive(Debug, thiserror::Error)]
pub enum IndexError {
    /// The index file cannot be used as a whole (missing, short, footer or the parts
    /// kept in memory damaged, built for another length of its segment): rebuild it
    /// from its segment.
    #[error("segment index {}: {detail}; it is rebuilt from its segment", file.display())]
    Bad { file: PathBuf, detail: String },
    /// A block failed its check when it was read: the answer is refused; rebuild the
    /// index from its segment ([`Index::rebuild`]).
    #[error(
        "segment index {} is damaged in block {block} (byte {}): {detail}; the read is \
         refused, rebuild the index from its segment",
        file.display(),
        block * format::BLOCK_BYTES as u64
    )]
    Block {
        file: PathBuf,
        block: u64,
        detail: String,
    },
    /// A record the index points at, or a segment read whole, failed the log's checks.
    #[error("log segment {} at byte {offset}: {detail}", file.display())]
    Log {
        file: PathBuf,
        offset: u64,
        detail: String,
    },
    /// An item's events skip a seq: they are refused, not served short.
    #[error("the events of item {item} of shop {shop} have a gap: {detail}")]
    Gap {
        shop: String,
        item: String,
        detail: String,
    },
    #[error("{}: {source}", file.display())]
    Io { file: PathBuf, source: io::Error },
}

impl IndexError {
    fn io(file: &Path) -> impl FnOnce(io::Error) -> IndexError + '_ {
        move |source| IndexError::Io {
            file: file.to_path_buf(),
            source,
        }
    }

    fn bad(file: &Path, detail: impl Into<String>) -> IndexError {
        IndexError::Bad {
            file: file.to_path_buf(),
            detail: detail.into(),
        }
    }
}
