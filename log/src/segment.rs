//! The journal's log: records appended to segment files, each checksummed and chained to
//! the one before it, so that recovery can tell a torn tail (dropped) from a bad record
//! inside the acknowledged part (the start is refused).
//!
//! Records (`crate::record`) are appended to segment files: a segment file is named after
//! the `lsn` of its first record (20 digits, `.log`); a segment ends where the next one
//! begins, so a missing segment is a gap in the numbers.

use std::fs::{File, OpenOptions};
use std::io::{self, Read, Seek, Write};
use std::path::{Path, PathBuf};

use xxhash_rust::xxh3::xxh3_128;

use crate::direct::DirectTail;
pub use crate::record::{checked_record, Chain, Header, LogError, BODY_MAX, HEADER_LEN, VERSION};
use crate::seal::{self, Acked, Footer, MarkWriter, Successor};
use crate::space::Space;
use crate::spare::Spares;
use std::sync::Arc;

const SUFFIX: &str = ".log";

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
    /// What was wrong with the first bad record.
    pub detail: String,
}

/// The last segment, as a scan found it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tail {
    pub path: PathBuf,
    /// The first record number it is named for.
    pub first: u64,
    /// Where its last good record ends.
    pub len: u64,
    /// Whether it ends with a footer (the writer then starts the next segment).
    pub sealed: bool,
}

/// A kept segment a scan checked by its footer alone: [`verify_unread`] reads it whole.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unread {
    pub path: PathBuf,
    pub first: u64,
    pub next: Successor,
}

/// What a scan ends with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScanEnd {
    pub chain: Chain,
    /// The last segment (`None`: no segment yet).
    pub last: Option<Tail>,
    pub torn: Option<TornTail>,
    pub records: u64,
    /// The kept segments before the first one read, checked by their footer alone.
    pub unread: Vec<Unread>,
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
/// sequence, the chain and that epochs never go down, and hands each to `visit`. Every
/// kept segment before the first one read is checked by its footer (or read whole
/// without one): see [`super::seal`].
///
/// A bad record with nothing readable after it, at the end of the last segment, is a
/// torn tail: the scan stops there and reports it (the writer cuts it off), unless
/// `acked` (the durable mark) or `from` says records at or after it were acknowledged. A
/// bad record with a good one after it, a segment missing, or a record out of place is
/// corruption.
pub fn scan(
    dir: &Path,
    from: Chain,
    acked: Option<Acked>,
    visit: impl FnMut(Record<'_>) -> Result<(), String>,
) -> Result<ScanEnd, LogError> {
    let segs = segments(dir)?;
    let start = first_to_read(&segs, from)?;
    let unread = check_kept(&segs, start)?;
    let mut s = Scanner {
        from,
        acked,
        chain: from,
        records: 0,
        seen: None,
        begins: None,
        visit,
    };
    let (mut last, mut torn) = (None, None);
    for (i, (first, path)) in segs.iter().enumerate().skip(start) {
        if i > start && *first != s.chain.next_lsn {
            return Err(LogError::Gap {
                detail: format!(
                    "{} starts at record {first}, but the segment before it ends before record {}",
                    path.display(),
                    s.chain.next_lsn
                ),
            });
        }
        let mut data = Vec::new();
        File::open(path)?.read_to_end(&mut data)?;
        s.begins.get_or_insert(*first);
        let (len, sealed) = match s.segment(*first, path, &data, i + 1 == segs.len())? {
            SegmentEnd::Open(len) => (len, false),
            SegmentEnd::Sealed(len) => (len, true),
            SegmentEnd::Torn(t) => {
                let len = t.offset;
                torn = Some(t);
                (len, false)
            }
        };
        last = Some(Tail {
            path: path.clone(),
            first: *first,
            len,
            sealed,
        });
    }
    s.check_end(torn.as_ref())?;
    Ok(ScanEnd {
        chain: s.chain,
        last,
        torn,
        records: s.records,
        unread,
    })
}

/// The index of the first segment a scan from `from` reads: segments wholly before
/// `from` are not read (retired ones may already be gone). A log that resumes after
/// `from` has a gap.
fn first_to_read(segs: &[(u64, PathBuf)], from: Chain) -> Result<usize, LogError> {
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
    Ok(start)
}

/// Checks every kept segment before `start` (the first one a scan reads) by its footer
/// against the segment after it, or whole when the footer does not hold; returns those
/// checked by their footer alone, for a full read later ([`verify_unread`]).
fn check_kept(segs: &[(u64, PathBuf)], start: usize) -> Result<Vec<Unread>, LogError> {
    let mut unread = Vec::new();
    for i in 0..start {
        let ((first, path), (next_first, next_path)) = (&segs[i], &segs[i + 1]);
        let parent = match seal::first_header(next_path)? {
            Some(h) => Some(h.parent),
            // The newest segment's only record may be torn: the scan judges it.
            None if i + 2 == segs.len() => None,
            None => {
                return Err(LogError::Corrupt {
                    file: next_path.clone(),
                    offset: 0,
                    lsn: *next_first,
                    detail: "header checksum does not match".into(),
                })
            }
        };
        let next = Successor {
            first_lsn: *next_first,
            parent,
        };
        if seal::footer_holds(path, *first, next)? {
            unread.push(Unread {
                path: path.clone(),
                first: *first,
                next,
            });
        } else {
            seal::verify_segment(path, *first, next)?;
        }
    }
    Ok(unread)
}

/// Reads whole the segments a scan checked by their footer alone: the first damage
/// found, naming the file and byte.
pub fn verify_unread(unread: &[Unread]) -> Result<(), LogError> {
    for u in unread {
        seal::verify_segment(&u.path, u.first, u.next)?;
    }
    Ok(())
}

/// How one segment's bytes end.
enum SegmentEnd {
    /// After a whole record, at this offset: the end of the file, or where the zeros of
    /// a segment written ahead of its records begin (see [`crate::spare`]).
    Open(u64),
    /// With a footer that starts at this offset.
    Sealed(u64),
    /// With a torn tail (the last segment only).
    Torn(TornTail),
}

/// A scan's state from segment to segment.
struct Scanner<V> {
    from: Chain,
    acked: Option<Acked>,
    chain: Chain,
    records: u64,
    /// The last record number seen, skipped or not: the log must reach `from`.
    seen: Option<u64>,
    /// The first segment read's first record number.
    begins: Option<u64>,
    visit: V,
}

impl<V: FnMut(Record<'_>) -> Result<(), String>> Scanner<V> {
    /// Reads the segment `path` (named for `first`, `data` its bytes).
    fn segment(
        &mut self,
        first: u64,
        path: &Path,
        data: &[u8],
        last: bool,
    ) -> Result<SegmentEnd, LogError> {
        let mut at = 0usize;
        let mut last_checksum = None::<u128>;
        while at < data.len() {
            if data.len() - at == seal::FOOTER_LEN {
                if let Some(ft) = Footer::decode(&data[at..]) {
                    let due = self.seen.map_or(first, |lsn| lsn + 1);
                    if ft.first_lsn != first
                        || ft.len != at as u64
                        || ft.last_lsn + 1 != due
                        || Some(ft.last_checksum) != last_checksum
                    {
                        return Err(LogError::Corrupt {
                            file: path.to_path_buf(),
                            offset: at as u64,
                            lsn: due,
                            detail: "the segment's footer does not match its records".into(),
                        });
                    }
                    return Ok(SegmentEnd::Sealed(at as u64));
                }
            }
            let (header, end) = match checked_record(data, at) {
                Ok(v) => v,
                Err(detail) if last => {
                    return last_end(path, data, at, self.chain.next_lsn, detail)
                }
                Err(detail) => {
                    return Err(LogError::Corrupt {
                        file: path.to_path_buf(),
                        offset: at as u64,
                        lsn: self.chain.next_lsn,
                        detail,
                    })
                }
            };
            let corrupt = |detail: String| LogError::Corrupt {
                file: path.to_path_buf(),
                offset: at as u64,
                lsn: header.lsn,
                detail,
            };
            if last_checksum.is_none() && header.lsn != first {
                return Err(corrupt(format!(
                    "the segment is named for record {first} but starts with record {}",
                    header.lsn
                )));
            }
            self.record(header, &data[at + HEADER_LEN..end], path, at)
                .map_err(corrupt)?;
            last_checksum = Some(header.checksum);
            at = end;
        }
        Ok(SegmentEnd::Open(data.len() as u64))
    }

    /// Checks one record against the records before it and hands it on, unless it
    /// comes before `from` (skipped).
    fn record(
        &mut self,
        header: Header,
        body: &[u8],
        path: &Path,
        at: usize,
    ) -> Result<(), String> {
        self.seen = Some(header.lsn);
        if let Some(acked) = self.acked.filter(|a| a.lsn == header.lsn) {
            if header.checksum != acked.checksum {
                return Err(format!(
                    "the record differs from the one acknowledged as record {} ({})",
                    acked.lsn,
                    seal::MARK_FILE
                ));
            }
        }
        let chain = self.chain;
        if header.lsn < chain.next_lsn {
            if header.lsn + 1 == chain.next_lsn && header.checksum != chain.parent {
                return Err("the record the snapshot ends with differs from the log's".into());
            }
            return Ok(());
        }
        if chain.next_lsn > 0 && header.lsn != chain.next_lsn {
            return Err(format!(
                "record {} where record {} was due",
                header.lsn, chain.next_lsn
            ));
        }
        if chain.next_lsn > 0 && header.parent != chain.parent {
            return Err(
                "it does not chain to the record before it (a record was replaced or lost)".into(),
            );
        }
        if header.epoch < chain.epoch {
            return Err(format!(
                "written by a stale writer: epoch {} after epoch {}",
                header.epoch, chain.epoch
            ));
        }
        (self.visit)(Record {
            header,
            body,
            file: path,
            offset: at as u64,
        })?;
        self.records += 1;
        self.chain = Chain {
            next_lsn: header.lsn + 1,
            parent: header.checksum,
            epoch: header.epoch,
        };
        Ok(())
    }

    /// Where the log ends must be at or past what was derived from it (`from`) and what
    /// was acknowledged (`acked`): a tail that ends before either lost records that were
    /// answered, and is refused, not cut.
    fn check_end(&self, torn: Option<&TornTail>) -> Result<(), LogError> {
        let next_in_log = match (self.seen, self.begins) {
            (Some(lsn), _) => lsn + 1,
            (None, Some(first)) => first,
            (None, None) => self.chain.next_lsn,
        }
        .max(1);
        let views = self.from.next_lsn.saturating_sub(1);
        let acked = self.acked.map_or(0, |a| a.lsn);
        let (reach, by, todo) = if acked > views {
            (
                acked,
                format!(
                    "record {acked} was synced and acknowledged ({})",
                    seal::MARK_FILE
                ),
                format!(
                    " (if losing them is accepted rather than restoring a backup, remove {} \
                     to start from what the log holds)",
                    seal::MARK_FILE
                ),
            )
        } else {
            (
                views,
                format!("what was derived from it reaches record {views}"),
                String::new(),
            )
        };
        if reach == 0 || reach < next_in_log {
            return Ok(());
        }
        let missing =
            format!("records {next_in_log} to {reach} were acknowledged and are missing{todo}");
        match torn {
            Some(t) => Err(LogError::Corrupt {
                file: t.file.clone(),
                offset: t.offset,
                lsn: next_in_log,
                detail: format!("the log ends here ({}), but {by}: {missing}", t.detail),
            }),
            None => Err(LogError::Gap {
                detail: match next_in_log.saturating_sub(1) {
                    0 => format!("the log holds no record, but {by}: {missing}"),
                    end => format!("the log ends at record {end}, but {by}: {missing}"),
                },
            }),
        }
    }
}

/// How the last segment ends at `at`, where no good record starts (`detail` says why):
/// only zeros from there on are the room a spare segment had left (the records end
/// there); a bad record with no good one after it is a torn tail; anything else is
/// corruption.
fn last_end(
    path: &Path,
    data: &[u8],
    at: usize,
    lsn: u64,
    detail: String,
) -> Result<SegmentEnd, LogError> {
    let used = data.iter().rposition(|b| *b != 0).map_or(0, |p| p + 1);
    if at >= used {
        return Ok(SegmentEnd::Open(at as u64));
    }
    if any_record_after(&data[..used], at + 1) {
        return Err(LogError::Corrupt {
            file: path.to_path_buf(),
            offset: at as u64,
            lsn,
            detail,
        });
    }
    Ok(SegmentEnd::Torn(TornTail {
        file: path.to_path_buf(),
        offset: at as u64,
        bytes: (data.len() - at) as u64,
        detail,
    }))
}

/// Whether a record header with a good checksum starts anywhere in `data` from `from`:
/// a bad record followed by a good one is corruption, not a torn tail.
fn any_record_after(data: &[u8], from: usize) -> bool {
    (from..data.len().saturating_sub(HEADER_LEN - 1))
        .any(|at| Header::decode(&data[at..]).is_some_and(|h| h.version == VERSION))
}

/// Appends records to the newest segment, sealing it with a footer and starting a new
/// one past `segment_bytes`, and writes the durable mark after every sync. Only one
/// writer may have a log open: the lock file is held while it lives.
pub struct LogWriter {
    dir: PathBuf,
    file: File,
    /// The first record number of the segment being written.
    first: u64,
    offset: u64,
    chain: Chain,
    epoch: u64,
    segment_bytes: u64,
    /// Whether the file holds zeros past `offset` to its size, written and synced ahead
    /// (a spare, see [`crate::spare`]): records then overwrite them.
    preallocated: bool,
    /// A preallocated segment's records, written directly (`Some`: see [`crate::direct`]);
    /// `None`: through `file`, synced by `fdatasync`.
    direct: Option<DirectTail>,
    /// The next segments, prepared ahead (`None`: each segment is created as it comes).
    spares: Option<Spares>,
    buf: Vec<u8>,
    mark: MarkWriter,
    _lock: File,
}

impl LogWriter {
    /// Opens the log for appending where `end` (a scan's) says it ends, cutting off a
    /// torn tail, under a new epoch one above every epoch in the log (or `epoch_at_least`
    /// if higher). `lock` is the log's lock ([`lock`]), held from before the scan; what
    /// the log holds is durable (see [`sync_newest`]).
    pub fn open(
        dir: &Path,
        end: &ScanEnd,
        epoch_at_least: u64,
        segment_bytes: u64,
        lock: File,
    ) -> Result<LogWriter, LogError> {
        let epoch = (end.chain.epoch + 1).max(epoch_at_least);
        let mut chain = end.chain;
        if chain.next_lsn == 0 {
            chain.next_lsn = 1;
        }
        let (file, first, offset, preallocated) = match &end.last {
            Some(tail) if !tail.sealed => {
                let mut f = OpenOptions::new().write(true).open(&tail.path)?;
                if end.torn.is_some() {
                    f.set_len(tail.len)?;
                    f.sync_data()?;
                }
                f.seek(io::SeekFrom::Start(tail.len))?;
                let preallocated = f.metadata()?.len() > tail.len;
                (f, tail.first, tail.len, preallocated)
            }
            // None yet, or the last one sealed before the process stopped.
            _ => (
                create_segment(dir, chain.next_lsn)?,
                chain.next_lsn,
                0,
                false,
            ),
        };
        let direct = match &end.last {
            Some(tail) if preallocated => direct_or_not(&tail.path, offset),
            _ => None,
        };
        let mut mark = MarkWriter::open(dir)?;
        if chain.next_lsn > 1 {
            mark.write(Acked {
                lsn: chain.next_lsn - 1,
                checksum: chain.parent,
                epoch: chain.epoch,
            })?;
        }
        Ok(LogWriter {
            dir: dir.to_path_buf(),
            file,
            first,
            offset,
            chain,
            epoch,
            segment_bytes: segment_bytes.max(HEADER_LEN as u64 * 2),
            preallocated,
            direct,
            spares: None,
            buf: Vec::new(),
            mark,
            _lock: lock,
        })
    }

    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Prepares each next segment ahead, zero-filled within `space`'s room, once `after`
    /// bytes were written (see [`crate::spare`]); the segment being written is ended
    /// early for the first one, so that a loaded log soon writes into one.
    pub fn prepare_spares(&mut self, space: Arc<Space>, after: u64) -> Result<(), LogError> {
        self.spares = Some(Spares::new(&self.dir, self.segment_bytes, space, after)?);
        Ok(())
    }

    pub fn chain(&self) -> Chain {
        self.chain
    }

    /// The segment being written (its first lsn) and where its records end: after an
    /// [`LogWriter::append`], the record just written ends there, so that the index of
    /// the log ([`crate::index`]) can name it by segment and offset.
    pub fn segment_end(&self) -> (u64, u64) {
        (self.first, self.offset)
    }

    /// Ends the segment being written with its footer and makes it durable, then starts
    /// the next one. A footer that finds no room is cut off again, as a record is.
    fn roll(&mut self) -> Result<(), LogError> {
        // The records written directly go first; the footer through the file.
        self.leave_direct()?;
        // The footer says where the segment's records end, and a start checks it against
        // the file: the writer's count must be the file's.
        let at = self.file.stream_position()?;
        assert_eq!(
            at, self.offset,
            "segment {} ends at byte {at}, but its writer counted {} bytes",
            self.first, self.offset
        );
        let footer = Footer {
            first_lsn: self.first,
            last_lsn: self.chain.next_lsn - 1,
            last_checksum: self.chain.parent,
            len: self.offset,
        };
        if self.preallocated {
            // The footer ends the file: the zeros the records did not take go.
            self.file.set_len(self.offset)?;
            self.preallocated = false;
        }
        self.write_or_cut(&footer.encode())?;
        self.file.sync_data()?;
        let next = self.dir.join(segment_name(self.chain.next_lsn));
        let spare = match self.spares.as_mut().map(|s| s.take_as(&next)) {
            Some(Ok(spare)) => spare,
            Some(Err(e)) => {
                tracing::warn!(error = %e, "journal: a spare segment could not be taken");
                None
            }
            None => None,
        };
        self.preallocated = spare.is_some();
        self.file = match spare {
            Some(f) => f,
            None => create_segment(&self.dir, self.chain.next_lsn)?,
        };
        if self.preallocated {
            self.direct = direct_or_not(&next, 0);
        }
        self.first = self.chain.next_lsn;
        self.offset = 0;
        Ok(())
    }

    /// Writes the records gathered for a direct write, if any, and goes on through the
    /// file from where they end.
    fn leave_direct(&mut self) -> Result<(), LogError> {
        if let Some(mut direct) = self.direct.take() {
            direct.flush()?;
            self.file.seek(io::SeekFrom::Start(self.offset))?;
        }
        Ok(())
    }

    /// Writes `bytes` at the end of the segment. A write cut short (no room left on the
    /// disk, say) may have left part of them in the file: it is cut off, so the writer
    /// stands where it stood and the same bytes can be written again once there is room
    /// (`crate::space`). Cutting frees space, so it does not fail for want of it.
    fn write_or_cut(&mut self, bytes: &[u8]) -> Result<(), LogError> {
        if let Err(e) = self.file.write_all(bytes) {
            self.preallocated = false;
            self.file.set_len(self.offset)?;
            self.file.seek(io::SeekFrom::Start(self.offset))?;
            return Err(e.into());
        }
        Ok(())
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
        // A segment written by appending ends early once a spare is ready.
        let spare_waits = !self.preallocated && self.spares.as_mut().is_some_and(|s| s.ready());
        if self.offset > 0 && (self.offset + len > self.segment_bytes || spare_waits) {
            self.roll()?;
        }
        if self.offset + len > self.segment_bytes {
            // A record larger than a segment on its own passes the spare's end: it is
            // written through the file, which waits for room if the disk has none.
            self.leave_direct()?;
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
        // The header written reads back as itself, chained to the record before it.
        debug_assert_eq!(
            Header::decode(&encoded).map(|h| (h.lsn, h.parent, h.body_checksum)),
            Some((header.lsn, self.chain.parent, header.body_checksum)),
            "a header does not read back as written"
        );
        let mut buf = std::mem::take(&mut self.buf);
        buf.clear();
        buf.extend_from_slice(&encoded);
        buf.extend_from_slice(body);
        let written = match self.direct.as_mut() {
            Some(direct) => {
                direct.push(&buf);
                Ok(())
            }
            None => self.write_or_cut(&buf),
        };
        self.buf = buf;
        written?;
        self.offset += len;
        if let Some(spares) = self.spares.as_mut() {
            spares.wrote(len);
        }
        // A segment passes its size only by a record that is larger on its own.
        assert!(
            self.offset <= self.segment_bytes || self.offset == len,
            "segment past its size: {} bytes of {}",
            self.offset,
            self.segment_bytes
        );
        let lsn = header.lsn;
        self.chain = Chain {
            next_lsn: lsn + 1,
            parent: u128::from_le_bytes(encoded[0..16].try_into().expect("16 bytes")),
            epoch: self.epoch,
        };
        Ok(lsn)
    }

    /// Makes every record appended so far durable, then says so in the durable mark.
    pub fn sync(&mut self) -> Result<(), LogError> {
        match self.direct.as_mut() {
            Some(direct) => direct.flush()?,
            None => self.file.sync_data()?,
        }
        assert!(self.chain.next_lsn >= 1, "a log's first record is number 1");
        let acked = Acked {
            lsn: self.chain.next_lsn - 1,
            checksum: self.chain.parent,
            epoch: self.epoch,
        };
        if let Err(e) = self.mark.write(acked) {
            // The records are durable all the same; only a cut of them could not be
            // told from a torn write until the next mark is written.
            tracing::warn!(error = %e, "journal: the durable mark could not be written");
        }
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

/// Writes `bytes` as the file `path` so that a crash leaves the old file or the whole
/// new one: under the temporary name `tmp` (beside it), synced, renamed, and the
/// directory synced. A `tmp` left by a crash is the caller's to clear.
pub fn replace_file(path: &Path, tmp: &Path, bytes: &[u8]) -> io::Result<()> {
    let mut f = OpenOptions::new()
        .create(true)
        .truncate(true)
        .write(true)
        .open(tmp)?;
    f.write_all(bytes)?;
    f.sync_all()?;
    drop(f);
    std::fs::rename(tmp, path)?;
    File::open(path.parent().unwrap_or(Path::new(".")))?.sync_all()
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

/// The segment `path` opened for direct writes from `offset` ([`DirectTail::open`]);
/// `None` where that is not taken or fails: the writer then writes through the page
/// cache, as it can always do.
fn direct_or_not(path: &Path, offset: u64) -> Option<DirectTail> {
    DirectTail::open(path, offset).unwrap_or_else(|e| {
        tracing::warn!(
            error = %e,
            segment = %path.display(),
            "journal: the segment could not be opened for direct writes; writing it through the page cache"
        );
        None
    })
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
        let end = scan(dir, from, None, |r| {
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
        let Tail { path, len, .. } = end.last.clone().unwrap();
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
        let Tail { path, len, .. } = end.last.clone().unwrap();
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
        scan(dir.path(), Chain::default(), None, |r| {
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

    /// The durable mark read back, as a start reads it.
    fn acked(dir: &Path) -> Option<Acked> {
        seal::read_mark(dir).unwrap()
    }

    fn cut(path: &Path, bytes: u64) {
        let f = OpenOptions::new().write(true).open(path).unwrap();
        let len = f.metadata().unwrap().len();
        f.set_len(len - bytes).unwrap();
    }

    #[test]
    fn a_tail_cut_after_its_sync_refuses_naming_the_records_missing() {
        let dir = tempfile::tempdir().unwrap();
        let end = write(dir.path(), 10, 1 << 20);
        assert_eq!(acked(dir.path()).map(|a| a.lsn), Some(10));
        // The last 100 bytes go: record 10 and part of record 9 were synced, so
        // acknowledged; the views (`from`) hold none of them.
        cut(&end.last.unwrap().path, 100);
        let err =
            scan(dir.path(), Chain::default(), acked(dir.path()), |_| Ok(())).expect_err("refused");
        let msg = err.to_string();
        assert!(
            msg.contains("records 9 to 10 were acknowledged and are missing")
                && msg.contains(seal::MARK_FILE),
            "{msg}"
        );
        // The newest segment deleted whole: the log ends before the mark as well.
        let dir = tempfile::tempdir().unwrap();
        write(dir.path(), 40, 500);
        let (_, newest) = segments(dir.path()).unwrap().pop().unwrap();
        std::fs::remove_file(&newest).unwrap();
        let err =
            scan(dir.path(), Chain::default(), acked(dir.path()), |_| Ok(())).expect_err("refused");
        assert!(err.to_string().contains("to 40 were acknowledged"), "{err}");
        // Every segment gone: nothing to read, and still refused.
        for (_, path) in segments(dir.path()).unwrap() {
            std::fs::remove_file(path).unwrap();
        }
        let err =
            scan(dir.path(), Chain::default(), acked(dir.path()), |_| Ok(())).expect_err("refused");
        assert!(err.to_string().contains("the log holds no record"), "{err}");
    }

    #[test]
    fn a_tail_torn_after_the_last_sync_is_cut_off_whatever_the_mark() {
        let dir = tempfile::tempdir().unwrap();
        let end = write(dir.path(), 10, 1 << 20);
        let mut w =
            LogWriter::open(dir.path(), &end, 0, 1 << 20, lock(dir.path()).unwrap()).unwrap();
        // Written but never synced (so never acknowledged), then torn.
        w.append(3, 0, b"unsynced").unwrap();
        drop(w);
        cut(&segments(dir.path()).unwrap().pop().unwrap().1, 3);
        let end = scan(dir.path(), Chain::default(), acked(dir.path()), |_| Ok(())).unwrap();
        assert_eq!((end.records, end.torn.is_some()), (10, true));
    }

    #[test]
    fn a_record_replaced_at_the_mark_refuses() {
        let dir = tempfile::tempdir().unwrap();
        write(dir.path(), 3, 1 << 20);
        let real = acked(dir.path()).unwrap();
        let fake = Acked {
            checksum: real.checksum ^ 1,
            ..real
        };
        let err = scan(dir.path(), Chain::default(), Some(fake), |_| Ok(())).expect_err("refused");
        assert!(
            err.to_string()
                .contains("differs from the one acknowledged"),
            "{err}"
        );
    }

    #[test]
    fn sealed_segments_end_with_a_footer_that_a_start_checks_without_reading_them() {
        let dir = tempfile::tempdir().unwrap();
        write(dir.path(), 40, 500);
        let segs = segments(dir.path()).unwrap();
        assert!(segs.len() > 4);
        for (first, path) in &segs[..segs.len() - 1] {
            let data = std::fs::read(path).unwrap();
            let ft = Footer::decode(&data[data.len() - seal::FOOTER_LEN..]).expect("a footer");
            assert_eq!((ft.first_lsn, ft.len), (*first, (data.len() - 64) as u64));
        }
        // A start from the views' position, past the older segments: they are checked
        // by their footers, and left for the full read.
        let mut from = Chain::default();
        scan(dir.path(), Chain::default(), None, |r| {
            if r.header.lsn == 35 {
                from = Chain {
                    next_lsn: 36,
                    parent: r.header.checksum,
                    epoch: r.header.epoch,
                };
            }
            Ok(())
        })
        .unwrap();
        let end = scan(dir.path(), from, acked(dir.path()), |_| Ok(())).unwrap();
        assert_eq!(end.unread.len(), segs.len() - 1);
        assert_eq!(end.records, 5);
        verify_unread(&end.unread).unwrap();

        // A byte flipped inside an older body: the start does not see it, the full
        // read does, naming the file.
        let (_, second) = &segs[1];
        let mut data = std::fs::read(second).unwrap();
        data[HEADER_LEN + 2] ^= 0x08;
        std::fs::write(second, &data).unwrap();
        let end = scan(dir.path(), from, acked(dir.path()), |_| Ok(())).unwrap();
        let err = verify_unread(&end.unread).expect_err("found");
        assert!(
            err.to_string().contains(&second.display().to_string()),
            "{err}"
        );
        data[HEADER_LEN + 2] ^= 0x08;
        std::fs::write(second, &data).unwrap();

        // An older segment cut or deleted refuses the start itself. (One that lost its
        // footer alone, 64 bytes, is read whole instead, as one written before footers
        // existed is: no record is missing.)
        for bytes in [1, 63, 65, 100] {
            let data = std::fs::read(second).unwrap();
            cut(second, bytes);
            let err = scan(dir.path(), from, acked(dir.path()), |_| Ok(())).expect_err("refused");
            assert!(
                err.to_string().contains(&second.display().to_string()),
                "{bytes}: {err}"
            );
            std::fs::write(second, &data).unwrap();
        }
        std::fs::remove_file(&segs[2].1).unwrap();
        let err = scan(dir.path(), from, acked(dir.path()), |_| Ok(())).expect_err("refused");
        assert!(err.to_string().contains("records are missing"), "{err}");
    }

    #[test]
    fn a_log_whose_newest_segment_was_sealed_goes_on_in_a_new_one() {
        let dir = tempfile::tempdir().unwrap();
        write(dir.path(), 40, 500);
        // The process stopped between a footer and the next segment's first record:
        // here, by taking that segment and the mark away.
        let (_, newest) = segments(dir.path()).unwrap().pop().unwrap();
        std::fs::remove_file(&newest).unwrap();
        std::fs::remove_file(dir.path().join(seal::MARK_FILE)).unwrap();
        let end = bodies(dir.path(), Chain::default()).unwrap().1;
        assert!(end.last.as_ref().unwrap().sealed);
        let n = end.records;
        let end = write(dir.path(), 3, 500);
        assert_eq!((end.records, end.torn), (n + 3, None));
    }
    /// Writes `n` records into a log whose segments are spares of `segment_bytes`,
    /// waiting for each spare so that every segment after the first is written into one.
    /// Whether the records of the last spare were written directly ([`crate::direct`]).
    fn write_into_spares(dir: &Path, n: u64, segment_bytes: u64) -> bool {
        let (_, end) = bodies(dir, Chain::default()).unwrap();
        let mut w = LogWriter::open(dir, &end, 0, segment_bytes, lock(dir).unwrap()).unwrap();
        w.prepare_spares(Space::new(dir, 0), 1).unwrap();
        for i in 0..n {
            w.append(3, i as i64, format!("body {i}").as_bytes())
                .unwrap();
            if i % 7 == 0 {
                // Groups of a few records, as the journal syncs them.
                w.sync().unwrap();
            }
            let spares = w.spares.as_mut().unwrap();
            for _ in 0..500 {
                if w.preallocated && w.offset + 64 < segment_bytes || spares.ready() {
                    break;
                }
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
        }
        w.sync().unwrap();
        w.direct.is_some()
    }

    /// Whether files in `dir` take direct I/O (not on tmpfs, say).
    fn direct_io_here(dir: &Path) -> bool {
        let probe = dir.join("probe");
        std::fs::write(&probe, vec![0u8; crate::direct::BLOCK]).unwrap();
        let direct = crate::direct::DirectTail::open(&probe, 0)
            .unwrap()
            .is_some();
        std::fs::remove_file(probe).unwrap();
        direct
    }

    /// Records written into spares of `segment_bytes` (`n` per writer, two writers) read
    /// back in order, with the zeros after them taken for no torn tail.
    fn spares_read_back(segment_bytes: u64, n: u64) {
        let dir = tempfile::tempdir().unwrap();
        let direct = write_into_spares(dir.path(), n, segment_bytes);
        // Whole blocks are written directly where the file system can; a few bytes not.
        let whole_blocks = segment_bytes.is_multiple_of(crate::direct::BLOCK as u64);
        assert_eq!(direct, whole_blocks && direct_io_here(dir.path()));
        let segs = segments(dir.path()).unwrap();
        assert!(segs.len() > 3, "{} segments", segs.len());
        let newest = std::fs::metadata(&segs.last().unwrap().1).unwrap().len();
        assert_eq!(
            newest, segment_bytes,
            "the newest segment is a spare, zeros and all"
        );
        let (got, end) = bodies(dir.path(), Chain::default()).unwrap();
        assert_eq!(got.len(), n as usize);
        assert_eq!(
            end.torn, None,
            "the zeros after the records are not a torn tail"
        );
        let last = end.last.clone().unwrap();
        assert!(last.len < segment_bytes && !last.sealed);
        // Sealed spares end at their footer, as any segment does.
        for (_, path) in &segs[1..segs.len() - 1] {
            let data = std::fs::read(path).unwrap();
            assert_ne!(data.last(), Some(&0), "{} ends in zeros", path.display());
        }
        write_into_spares(dir.path(), n, segment_bytes);
        let (got, end) = bodies(dir.path(), Chain::default()).unwrap();
        assert_eq!(got.len(), 2 * n as usize);
        assert!(got
            .iter()
            .enumerate()
            .all(|(i, (lsn, _))| *lsn == i as u64 + 1));
        assert_eq!(got[n as usize].1, b"body 0");
        assert_eq!(end.torn, None);
        let spares_left = std::fs::read_dir(dir.path())
            .unwrap()
            .filter(|e| {
                e.as_ref()
                    .unwrap()
                    .file_name()
                    .to_string_lossy()
                    .starts_with("spare-")
            })
            .count();
        assert!(spares_left <= 1, "{spares_left} spare files");
    }

    #[test]
    fn records_written_into_spare_segments_read_back_and_a_new_writer_goes_on_after_them() {
        spares_read_back(1_000, 60);
        // Segments of whole blocks: written directly, a block at a time or several.
        spares_read_back(2 * crate::direct::BLOCK as u64, 400);
    }

    #[test]
    fn a_record_larger_than_a_spare_is_written_through_the_file_and_reads_back() {
        let dir = tempfile::tempdir().unwrap();
        let bytes = 2 * crate::direct::BLOCK as u64;
        let (_, end) = bodies(dir.path(), Chain::default()).unwrap();
        let mut w = LogWriter::open(dir.path(), &end, 0, bytes, lock(dir.path()).unwrap()).unwrap();
        w.prepare_spares(Space::new(dir.path(), 0), 1).unwrap();
        w.append(3, 0, b"first").unwrap();
        for _ in 0..500 {
            if w.spares.as_mut().unwrap().ready() {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        // The spare is taken for it, then left for the file: past its end.
        let big = vec![b'x'; 3 * bytes as usize];
        w.append(3, 0, &big).unwrap();
        assert!(w.preallocated, "the large record went into the spare");
        assert!(w.direct.is_none(), "and leaves direct writes");
        w.append(3, 0, b"after").unwrap();
        w.sync().unwrap();
        drop(w);
        let (got, end) = bodies(dir.path(), Chain::default()).unwrap();
        let got: Vec<&[u8]> = got.iter().map(|(_, b)| b.as_slice()).collect();
        assert_eq!(got, [&b"first"[..], &big[..], &b"after"[..]]);
        assert_eq!(end.torn, None);
    }

    #[test]
    fn a_torn_record_before_a_spares_zeros_is_cut_and_an_acknowledged_one_zeroed_refuses() {
        let dir = tempfile::tempdir().unwrap();
        write_into_spares(dir.path(), 30, 2_000);
        let (_, end) = bodies(dir.path(), Chain::default()).unwrap();
        let Tail { path, len, .. } = end.last.clone().unwrap();
        assert_eq!(std::fs::metadata(&path).unwrap().len(), 2_000);
        let mut data = std::fs::read(&path).unwrap();
        let acked = seal::read_mark(dir.path())
            .unwrap()
            .expect("a durable mark");
        // The last record's bytes gone back to zeros: acknowledged, so refused.
        let kept = data.clone();
        let last_start = (0..len as usize)
            .rev()
            .find(|at| checked_record(&data, *at).is_ok_and(|(_, end)| end == len as usize))
            .unwrap();
        data[last_start..len as usize].fill(0);
        std::fs::write(&path, &data).unwrap();
        let err = scan(dir.path(), Chain::default(), Some(acked), |_| Ok(()))
            .expect_err("an acknowledged record lost to zeros refuses");
        assert!(err.to_string().contains("acknowledged"), "{err}");
        // Half of it written, then zeros: a torn write, cut off when not acknowledged.
        let mut torn = kept;
        torn[last_start + 10..len as usize].fill(0);
        std::fs::write(&path, &torn).unwrap();
        let (got, end) = bodies(dir.path(), Chain::default()).unwrap();
        assert_eq!(got.len(), 29);
        let t = end.torn.clone().expect("a torn tail");
        assert_eq!(t.offset, last_start as u64);
        let w = LogWriter::open(dir.path(), &end, 0, 2_000, lock(dir.path()).unwrap()).unwrap();
        assert!(!w.preallocated, "the cut took the zeros with it");
        drop(w);
        assert_eq!(std::fs::metadata(&path).unwrap().len(), last_start as u64);
    }
}
