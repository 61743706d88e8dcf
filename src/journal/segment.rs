//! The journal's log: records appended to segment files, each checksummed and chained to
//! the one before it, so that recovery can tell a torn tail (dropped) from a bad record
//! inside the acknowledged part (the start is refused).
//!
//! A record is an 80-byte header and a body. The header carries:
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

use std::fs::{File, OpenOptions};
use std::io::{self, Read, Seek, Write};
use std::path::{Path, PathBuf};

use xxhash_rust::xxh3::xxh3_128;

/// The format this code writes and reads.
pub const VERSION: u16 = 1;
pub const HEADER_LEN: usize = 80;
/// A body larger than this is refused on write and read as corruption.
pub const BODY_MAX: usize = 64 * 1024 * 1024;
const SUFFIX: &str = ".log";

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
    fn encode(&self) -> [u8; HEADER_LEN] {
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
    fn decode(b: &[u8]) -> Option<Header> {
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

/// One record, as a scan hands it over.
pub struct Record<'a> {
    pub header: Header,
    pub body: &'a [u8],
    pub file: &'a Path,
    pub offset: u64,
}

/// A tail that was dropped: a record torn by a crash while it was written (never
/// acknowledged, since an answer waits for its sync), and whatever follows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TornTail {
    pub file: PathBuf,
    pub offset: u64,
    pub bytes: u64,
}

/// What a scan ends with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScanEnd {
    pub chain: Chain,
    /// The last segment and where its last good record ends (`None`: no segment yet).
    pub last: Option<(PathBuf, u64)>,
    pub torn: Option<TornTail>,
    pub records: u64,
}

fn segment_name(first_lsn: u64) -> String {
    format!("{first_lsn:020}{SUFFIX}")
}

/// The segments in `dir`, by first lsn.
pub fn segments(dir: &Path) -> io::Result<Vec<(u64, PathBuf)>> {
    let mut out = Vec::new();
    let read = match std::fs::read_dir(dir) {
        Ok(r) => r,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(out),
        Err(e) => return Err(e),
    };
    for entry in read {
        let entry = entry?;
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        let Some(stem) = name.strip_suffix(SUFFIX) else {
            continue;
        };
        if stem.len() == 20 {
            if let Ok(lsn) = stem.parse::<u64>() {
                out.push((lsn, entry.path()));
            }
        }
    }
    out.sort();
    Ok(out)
}

/// Reads every record from `from` on (the chain the records before it ended with, or
/// the default for an empty log), checking each header and body checksum, the lsn
/// sequence, the chain and that epochs never go down, and hands each to `visit`.
///
/// A bad record with nothing readable after it, at the end of the last segment, is a
/// torn tail: the scan stops there and reports it (the writer cuts it off). A bad record
/// with a good one after it, a segment missing, or a record out of place is corruption.
pub fn scan(
    dir: &Path,
    from: Chain,
    mut visit: impl FnMut(Record<'_>) -> Result<(), String>,
) -> Result<ScanEnd, LogError> {
    let segs = segments(dir)?;
    let mut chain = from;
    let mut records = 0u64;
    let mut last = None;
    // Segments wholly before `from` are skipped (retired ones may already be gone).
    let start = segs
        .iter()
        .rposition(|(first, _)| *first <= from.next_lsn.max(1))
        .unwrap_or(0);
    if let Some((first, _)) = segs.get(start) {
        if from.next_lsn > 0 && *first > from.next_lsn {
            return Err(LogError::Gap {
                detail: format!(
                    "the log resumes at record {first}, but the snapshot needs it from record {}",
                    from.next_lsn
                ),
            });
        }
    }
    let n = segs.len();
    // The last record number seen, skipped or not: the log must reach `from`.
    let mut seen = None::<u64>;
    for (i, (first, path)) in segs.iter().enumerate().skip(start) {
        if i > start && *first != chain.next_lsn {
            return Err(LogError::Gap {
                detail: format!(
                    "{} starts at record {first}, but the segment before it ends before record {}",
                    path.display(),
                    chain.next_lsn
                ),
            });
        }
        let mut data = Vec::new();
        File::open(path)?.read_to_end(&mut data)?;
        let mut at = 0usize;
        let mut first_in_file = true;
        while at < data.len() {
            let bad = |detail: String| (at as u64, detail);
            let checked = (|| {
                let header = Header::decode(&data[at..])
                    .ok_or_else(|| bad("header checksum does not match".into()))?;
                if header.version != VERSION {
                    return Err(bad(format!(
                        "format version {} (this build reads {VERSION})",
                        header.version
                    )));
                }
                let len = header.body_len as usize;
                let end = at + HEADER_LEN + len;
                if len > BODY_MAX || end > data.len() {
                    return Err(bad(format!("body of {len} bytes runs past the file")));
                }
                let body = &data[at + HEADER_LEN..end];
                if xxh3_128(body) != header.body_checksum {
                    return Err(bad("body checksum does not match".into()));
                }
                Ok((header, end))
            })();
            let (header, end) = match checked {
                Ok(v) => v,
                Err((offset, detail)) => {
                    if i + 1 == n && !any_record_after(&data, at + 1) {
                        // A tail cut where what was derived from the log (the views,
                        // written only after a record is durable) reaches further is no
                        // torn write: records that were acknowledged are gone (a file cut
                        // short or damaged at rest). Refused, not cut.
                        let next_in_log = seen.map_or(*first, |lsn| lsn + 1);
                        if from.next_lsn > next_in_log {
                            return Err(LogError::Corrupt {
                                file: path.clone(),
                                offset,
                                lsn: next_in_log,
                                detail: format!(
                                    "the log ends here ({detail}), but what was derived from it reaches record {}: records that were acknowledged are missing",
                                    from.next_lsn - 1
                                ),
                            });
                        }
                        let torn = TornTail {
                            file: path.clone(),
                            offset,
                            bytes: (data.len() - at) as u64,
                        };
                        return Ok(ScanEnd {
                            chain,
                            last: Some((path.clone(), offset)),
                            torn: Some(torn),
                            records,
                        });
                    }
                    return Err(LogError::Corrupt {
                        file: path.clone(),
                        offset,
                        lsn: chain.next_lsn,
                        detail,
                    });
                }
            };
            let corrupt = |detail: String| LogError::Corrupt {
                file: path.clone(),
                offset: at as u64,
                lsn: header.lsn,
                detail,
            };
            if first_in_file && header.lsn != *first {
                return Err(corrupt(format!(
                    "the segment is named for record {first} but starts with record {}",
                    header.lsn
                )));
            }
            seen = Some(header.lsn);
            let skipped = header.lsn < chain.next_lsn;
            if !skipped {
                if chain.next_lsn > 0 && header.lsn != chain.next_lsn {
                    return Err(corrupt(format!(
                        "record {} where record {} was due",
                        header.lsn, chain.next_lsn
                    )));
                }
                if chain.next_lsn > 0 && header.parent != chain.parent {
                    return Err(corrupt(
                        "it does not chain to the record before it (a record was replaced or lost)"
                            .into(),
                    ));
                }
                if header.epoch < chain.epoch {
                    return Err(corrupt(format!(
                        "written by a stale writer: epoch {} after epoch {}",
                        header.epoch, chain.epoch
                    )));
                }
                visit(Record {
                    header,
                    body: &data[at + HEADER_LEN..end],
                    file: path,
                    offset: at as u64,
                })
                .map_err(corrupt)?;
                records += 1;
                chain = Chain {
                    next_lsn: header.lsn + 1,
                    parent: header.checksum,
                    epoch: header.epoch,
                };
            } else if header.lsn + 1 == chain.next_lsn && header.checksum != chain.parent {
                return Err(corrupt(
                    "the record the snapshot ends with differs from the log's".into(),
                ));
            }
            first_in_file = false;
            at = end;
        }
        last = Some((path.clone(), data.len() as u64));
    }
    if let Some(lsn) = seen {
        if lsn + 1 < from.next_lsn {
            return Err(LogError::Gap {
                detail: format!(
                    "the log ends at record {lsn}, but what was derived from it reaches record {}",
                    from.next_lsn - 1
                ),
            });
        }
    }
    Ok(ScanEnd {
        chain,
        last,
        torn: None,
        records,
    })
}

/// Whether a record header with a good checksum starts anywhere in `data` from `from`:
/// a bad record followed by a good one is corruption, not a torn tail.
fn any_record_after(data: &[u8], from: usize) -> bool {
    (from..data.len().saturating_sub(HEADER_LEN - 1))
        .any(|at| Header::decode(&data[at..]).is_some_and(|h| h.version == VERSION))
}

/// Appends records to the newest segment, starting a new one past `segment_bytes`.
/// Only one writer may have a log open: the lock file is held while it lives.
pub struct LogWriter {
    dir: PathBuf,
    file: File,
    offset: u64,
    chain: Chain,
    epoch: u64,
    segment_bytes: u64,
    buf: Vec<u8>,
    _lock: File,
}

impl LogWriter {
    /// Opens the log for appending where `end` (a scan's) says it ends, cutting off a
    /// torn tail, under a new epoch one above every epoch in the log (or `epoch_at_least`
    /// if higher). `lock` is the log's lock ([`lock`]), held from before the scan.
    pub fn open(
        dir: &Path,
        end: &ScanEnd,
        epoch_at_least: u64,
        segment_bytes: u64,
        lock: File,
    ) -> Result<LogWriter, LogError> {
        let epoch = (end.chain.epoch + 1).max(epoch_at_least);
        let (file, offset) = match &end.last {
            Some((path, len)) => {
                let mut f = OpenOptions::new().write(true).open(path)?;
                if end.torn.is_some() {
                    f.set_len(*len)?;
                    f.sync_data()?;
                }
                f.seek(io::SeekFrom::Start(*len))?;
                (f, *len)
            }
            None => {
                let first = end.chain.next_lsn.max(1);
                (create_segment(dir, first)?, 0)
            }
        };
        let mut chain = end.chain;
        if chain.next_lsn == 0 {
            chain.next_lsn = 1;
        }
        Ok(LogWriter {
            dir: dir.to_path_buf(),
            file,
            offset,
            chain,
            epoch,
            segment_bytes: segment_bytes.max(HEADER_LEN as u64 * 2),
            buf: Vec::new(),
            _lock: lock,
        })
    }

    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    pub fn chain(&self) -> Chain {
        self.chain
    }

    /// Writes one record (not yet synced: see [`LogWriter::sync`]) and returns its lsn.
    pub fn append(&mut self, kind: u8, at_ms: i64, body: &[u8]) -> Result<u64, LogError> {
        if body.len() > BODY_MAX {
            return Err(LogError::Io(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("a record of {} bytes is over {BODY_MAX}", body.len()),
            )));
        }
        let len = (HEADER_LEN + body.len()) as u64;
        if self.offset > 0 && self.offset + len > self.segment_bytes {
            // The old segment is complete and durable before the new one is named.
            self.file.sync_data()?;
            self.file = create_segment(&self.dir, self.chain.next_lsn)?;
            self.offset = 0;
        }
        let header = Header {
            checksum: 0,
            parent: self.chain.parent,
            body_checksum: xxh3_128(body),
            lsn: self.chain.next_lsn,
            epoch: self.epoch,
            body_len: body.len() as u32,
            version: VERSION,
            kind,
            at_ms,
        };
        let encoded = header.encode();
        self.buf.clear();
        self.buf.extend_from_slice(&encoded);
        self.buf.extend_from_slice(body);
        if let Err(e) = self.file.write_all(&self.buf) {
            // A write cut short (no room left on the disk, say) may have left part of
            // the record in the file: it is cut off, so the writer stands where it stood
            // and the same record can be written again once there is room
            // (`crate::space`). Cutting frees space, so it does not fail for want of it.
            self.file.set_len(self.offset)?;
            self.file.seek(io::SeekFrom::Start(self.offset))?;
            return Err(e.into());
        }
        self.offset += len;
        let lsn = header.lsn;
        self.chain = Chain {
            next_lsn: lsn + 1,
            parent: u128::from_le_bytes(encoded[0..16].try_into().expect("16 bytes")),
            epoch: self.epoch,
        };
        Ok(lsn)
    }

    /// Makes every record appended so far durable.
    pub fn sync(&mut self) -> Result<(), LogError> {
        self.file.sync_data()?;
        Ok(())
    }

    /// See [`retire_before`].
    pub fn retire_before(&self, lsn: u64) -> Result<usize, LogError> {
        retire_before(&self.dir, lsn)
    }
}

/// Deletes the segments of the log in `dir` whose records all come before `lsn` (the
/// views hold them for good); returns how many went. The newest segment always stays.
pub fn retire_before(dir: &Path, lsn: u64) -> Result<usize, LogError> {
    let segs = segments(dir)?;
    let mut gone = 0;
    for w in segs.windows(2) {
        let ((_, path), (next_first, _)) = (&w[0], &w[1]);
        if *next_first <= lsn {
            match std::fs::remove_file(path) {
                Ok(()) => gone += 1,
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(e.into()),
            }
        }
    }
    if gone > 0 {
        File::open(dir)?.sync_all()?;
    }
    Ok(gone)
}

/// Takes the log's lock (`dir/LOCK`), which one process holds while it reads or writes
/// the log and what derives from it: a second one is refused.
pub fn lock(dir: &Path) -> Result<File, LogError> {
    std::fs::create_dir_all(dir)?;
    let lock = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(dir.join("LOCK"))?;
    lock.try_lock().map_err(|_| {
        io::Error::new(
            io::ErrorKind::WouldBlock,
            format!(
                "{} is in use by another nrtxn process (it holds {})",
                dir.display(),
                dir.join("LOCK").display()
            ),
        )
    })?;
    Ok(lock)
}

/// Makes what was written to the newest segment durable before it is read: a record
/// written but not synced when the process died is then read back only if it is on
/// disk for good.
pub fn sync_newest(dir: &Path) -> Result<(), LogError> {
    if let Some((_, path)) = segments(dir)?.pop() {
        File::open(path)?.sync_data()?;
    }
    Ok(())
}

fn create_segment(dir: &Path, first_lsn: u64) -> Result<File, LogError> {
    let path = dir.join(segment_name(first_lsn));
    let f = OpenOptions::new()
        .create_new(true)
        .write(true)
        .open(&path)?;
    // The new name is durable before a record in it is acknowledged. If it cannot be
    // made so, the file goes again, so that a writer that tries again can create it.
    if let Err(e) = File::open(dir).and_then(|d| d.sync_all()) {
        let _ = std::fs::remove_file(&path);
        return Err(e.into());
    }
    Ok(f)
}

#[cfg(test)]
mod tests {
    use super::*;

    type Bodies = Vec<(u64, Vec<u8>)>;

    fn bodies(dir: &Path, from: Chain) -> Result<(Bodies, ScanEnd), LogError> {
        let mut out = Vec::new();
        let end = scan(dir, from, |r| {
            out.push((r.header.lsn, r.body.to_vec()));
            Ok(())
        })?;
        Ok((out, end))
    }

    fn write(dir: &Path, n: u64, segment_bytes: u64) -> ScanEnd {
        let (_, end) = bodies(dir, Chain::default()).unwrap();
        let mut w = LogWriter::open(dir, &end, 0, segment_bytes, lock(dir).unwrap()).unwrap();
        for i in 0..n {
            w.append(3, i as i64, format!("body {i}").as_bytes())
                .unwrap();
        }
        w.sync().unwrap();
        drop(w);
        bodies(dir, Chain::default()).unwrap().1
    }

    #[test]
    fn records_come_back_in_order_across_segments_and_restarts() {
        let dir = tempfile::tempdir().unwrap();
        write(dir.path(), 50, 1_000);
        let end = write(dir.path(), 50, 1_000);
        assert!(segments(dir.path()).unwrap().len() > 5);
        let (got, _) = bodies(dir.path(), Chain::default()).unwrap();
        assert_eq!(got.len(), 100);
        for (i, (lsn, _)) in got.iter().enumerate() {
            assert_eq!(*lsn, i as u64 + 1);
        }
        assert_eq!(got[49].1, b"body 49");
        assert_eq!(got[50].1, b"body 0");
        assert_eq!(end.chain.epoch, 2, "one epoch per writer");
        assert_eq!(end.torn, None);
    }

    #[test]
    fn a_torn_tail_is_cut_off_and_writing_goes_on_after_the_last_good_record() {
        let dir = tempfile::tempdir().unwrap();
        let end = write(dir.path(), 10, 1 << 20);
        let (path, len) = end.last.clone().unwrap();
        // Half of a last record written, as a crash mid-write leaves it.
        let f = OpenOptions::new().write(true).open(&path).unwrap();
        f.set_len(len - 5).unwrap();
        drop(f);
        let (got, end) = bodies(dir.path(), Chain::default()).unwrap();
        assert_eq!(got.len(), 9);
        let torn = end.torn.clone().unwrap();
        assert_eq!(torn.bytes, (HEADER_LEN + b"body 9".len()) as u64 - 5);
        let end = write(dir.path(), 3, 1 << 20);
        assert_eq!((end.records, end.torn), (12, None));
    }

    #[test]
    fn a_tail_cut_before_what_the_views_hold_refuses_the_start() {
        let dir = tempfile::tempdir().unwrap();
        let end = write(dir.path(), 10, 1 << 20);
        let (path, len) = end.last.clone().unwrap();
        // Cut inside record 8, where the views (derived from durable records only) hold
        // up to record 10: acknowledged records are gone, not a write torn by a crash.
        let record = (HEADER_LEN + b"body 9".len()) as u64;
        let f = OpenOptions::new().write(true).open(&path).unwrap();
        f.set_len(len - 2 * record - 5).unwrap();
        drop(f);
        let views = Chain {
            next_lsn: 11,
            ..end.chain
        };
        let msg = bodies(dir.path(), views).expect_err("refused").to_string();
        assert!(
            msg.contains(&path.display().to_string()) && msg.contains("reaches record 10"),
            "{msg}"
        );
        // Views that hold no more than the log kept: a torn tail, cut as before.
        let (got, end) = bodies(dir.path(), Chain::default()).unwrap();
        assert_eq!((got.len(), end.torn.is_some()), (7, true));
    }

    #[test]
    fn a_flipped_byte_inside_the_log_refuses_the_start_naming_file_and_offset() {
        let dir = tempfile::tempdir().unwrap();
        write(dir.path(), 10, 1 << 20);
        let (_, path) = segments(dir.path()).unwrap().remove(0);
        let mut data = std::fs::read(&path).unwrap();
        let second = (HEADER_LEN + b"body 0".len()) as u64;
        for at in [second as usize + 82, second as usize + 3] {
            let mut bad = data.clone();
            bad[at] ^= 0x10;
            std::fs::write(&path, &bad).unwrap();
            let err = bodies(dir.path(), Chain::default()).expect_err("refused");
            let msg = err.to_string();
            assert!(
                msg.contains(&path.display().to_string())
                    && msg.contains(&format!("byte {second}")),
                "{msg}"
            );
        }
        // A bad byte in the last record alone is a torn tail.
        let last = data.len() - 2;
        data[last] ^= 0x01;
        std::fs::write(&path, &data).unwrap();
        let (got, end) = bodies(dir.path(), Chain::default()).unwrap();
        assert_eq!((got.len(), end.torn.is_some()), (9, true));
    }

    #[test]
    fn a_missing_segment_is_a_gap_and_a_stale_writer_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        write(dir.path(), 40, 500);
        let segs = segments(dir.path()).unwrap();
        std::fs::remove_file(&segs[2].1).unwrap();
        let err = bodies(dir.path(), Chain::default()).expect_err("refused");
        assert!(matches!(err, LogError::Gap { .. }), "{err}");

        // A writer that kept an old epoch (a second process, or a restored copy running
        // on) appends after a newer one: its records are refused.
        let dir = tempfile::tempdir().unwrap();
        let end = write(dir.path(), 2, 1 << 20);
        let mut w =
            LogWriter::open(dir.path(), &end, 0, 1 << 20, lock(dir.path()).unwrap()).unwrap();
        assert_eq!(w.epoch(), 2);
        w.append(3, 0, b"newer").unwrap();
        w.epoch = 1;
        w.append(3, 0, b"stale").unwrap();
        w.sync().unwrap();
        drop(w);
        let err = bodies(dir.path(), Chain::default()).expect_err("refused");
        assert!(err.to_string().contains("stale writer"), "{err}");
    }

    /// Every older segment truncated (by any amount) refuses the scan, naming the file:
    /// only the newest segment may end in a torn record.
    #[test]
    fn a_truncated_older_segment_refuses_naming_the_file() {
        let dir = tempfile::tempdir().unwrap();
        write(dir.path(), 40, 500);
        let segs = segments(dir.path()).unwrap();
        let (_, newest) = segs.last().unwrap().clone();
        for (_, path) in &segs[..segs.len() - 1] {
            let data = std::fs::read(path).unwrap();
            for cut in [1, HEADER_LEN as u64, data.len() as u64 / 2] {
                let f = OpenOptions::new().write(true).open(path).unwrap();
                f.set_len(data.len() as u64 - cut).unwrap();
                drop(f);
                let err = bodies(dir.path(), Chain::default()).expect_err("refused");
                assert!(
                    matches!(err, LogError::Corrupt { .. } | LogError::Gap { .. }),
                    "{}: cut {cut}: {err}",
                    path.display()
                );
                assert!(
                    err.to_string().contains(&path.display().to_string()),
                    "{err}"
                );
                std::fs::write(path, &data).unwrap();
            }
        }
        assert_ne!(segs.len(), 1);
        assert!(
            bodies(dir.path(), Chain::default()).is_ok(),
            "{}",
            newest.display()
        );
    }

    #[test]
    fn a_second_writer_on_the_same_log_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let end = write(dir.path(), 1, 1 << 20);
        let _w = LogWriter::open(dir.path(), &end, 0, 1 << 20, lock(dir.path()).unwrap()).unwrap();
        let err = lock(dir.path()).expect_err("refused");
        assert!(err.to_string().contains("in use"), "{err}");
    }

    #[test]
    fn retired_segments_go_and_a_scan_resumes_from_a_snapshot_chain() {
        let dir = tempfile::tempdir().unwrap();
        write(dir.path(), 40, 500);
        let (all, _) = bodies(dir.path(), Chain::default()).unwrap();
        let mut chain_at_25 = Chain::default();
        scan(dir.path(), Chain::default(), |r| {
            if r.header.lsn == 25 {
                chain_at_25 = Chain {
                    next_lsn: 26,
                    parent: r.header.checksum,
                    epoch: r.header.epoch,
                };
            }
            Ok(())
        })
        .unwrap();
        let end = bodies(dir.path(), Chain::default()).unwrap().1;
        let w = LogWriter::open(dir.path(), &end, 0, 500, lock(dir.path()).unwrap()).unwrap();
        assert!(w.retire_before(26).unwrap() > 0);
        drop(w);
        let (tail, _) = bodies(dir.path(), chain_at_25).unwrap();
        assert_eq!(tail, all[25..].to_vec());
        // From the start, the log now begins later than record 1: a gap.
        assert!(bodies(
            dir.path(),
            Chain {
                next_lsn: 1,
                ..Chain::default()
            }
        )
        .is_err());
    }
}
