//! The embedded journal: the log is the durable record, and the queryable
//! views (outcomes by key, events by item, holds, item snapshots, the fire-and-forget
//! requests still pending) are derived from it off the commit path.
//!
//! - **Commit path.** One writer thread takes every append and accept waiting, writes
//!   each as a record, syncs once (`fdatasync`), and only then calls their callbacks:
//!   no answer goes out before its record is durable.
//! - **Views.** After the sync the same batches go to the views (SQLite, written without
//!   a sync per commit; see `docs/decisions/journal-log.md`), each with the log position
//!   it brings them to, written in the same transaction.
//! - **Reads** wait until the views hold everything durable when the read began, so a
//!   read never misses an acknowledged entry.
//! - **Recovery** reads the log from where the views stand, checking every record
//!   (checksums, chain, epochs: [`super::segment::scan`]), applies what the views lack,
//!   and then rebuilds the items from the views, checking every entry after the last
//!   snapshot ([`nrtxn_actors::verify`]).

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, SyncSender, TryRecvError, TrySendError};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use nrtxn_actors::engine::handoff::Sleeper;
use nrtxn_actors::ports::{AppendDone, HoldPage, HoldQuery, ItemPage, Recovered, RelayPage};
use nrtxn_actors::ports::{
    ItemReads, JournalWrite, Lifecycle, Outbox, OutboxReader, Outcomes, Sharing,
};
use nrtxn_actors::types::KeyHash;
use nrtxn_actors::{
    now_ms, Entry, Event, HoldView, ItemState, Metrics, Outcome, Request, StoreError,
};

use crate::log_reads::{index_error, LogReads};
use crate::views::{ReadersWaiting, SqliteStore};
use crate::{AcceptDone, RecordAt};
use nrtxn_log::codec;
use nrtxn_log::index::{Index, Refreshed};
use nrtxn_log::seal;
use nrtxn_log::segment::{self, scan, Chain, LogError, LogWriter, Unread};
use nrtxn_log::space::Space;

/// Record kinds.
const KIND_ENTRIES: u8 = 1;
const KIND_ACCEPTED: u8 = 2;
/// A new segment is started past this size.
pub const SEGMENT_BYTES: u64 = 64 * 1024 * 1024;
/// Commands waiting for the writer, at most (a sender waits beyond it).
const QUEUE_MAX: usize = 4096;
/// Entries one group commit takes at most, so its latency and memory stay bounded.
const GROUP_ENTRIES_MAX: usize = 65_536;
/// How long a read waits for the views to catch up before it fails (503).
const VIEWS_WAIT: Duration = Duration::from_secs(10);
/// How often old segments are retired and old entries pruned from the views.
const MAINTAIN_EVERY: Duration = Duration::from_secs(2);
/// Room the log's writer asks for at a time, near the disk's floor as elsewhere: each
/// grant reads the free space once (see `crate::space`).
const LOG_ROOM_STEP: u64 = 1024 * 1024;
/// Entries one prune deletes at most (one short transaction of the views' writer).
const PRUNE_MAX: usize = 10_000;

/// What the journal keeps on disk, and for how long.
#[derive(Debug, Clone, Copy)]
pub struct Retention {
    /// Entries (and so their request keys) older than this leave the views; a key used
    /// again after it is a new request.
    pub key_window_ms: i64,
    /// A new segment of the log is started past this size.
    pub segment_bytes: u64,
    /// How long an ok sale stays returnable: sales pruned past the key window are kept
    /// (their key, item, quantity and time) until then ([`nrtxn_actors::returns`]).
    pub return_window_ms: i64,
}

impl Default for Retention {
    fn default() -> Self {
        Retention {
            key_window_ms: 7 * 24 * 3_600_000,
            segment_bytes: SEGMENT_BYTES,
            return_window_ms: nrtxn_actors::returns::RETURN_WINDOW_MS_DEFAULT,
        }
    }
}

enum Command {
    Append(Vec<Entry>, AppendDone),
    Accept(Vec<Request>, AcceptDone),
    Close(mpsc::Sender<()>),
}

impl Command {
    fn weight(&self) -> usize {
        match self {
            Command::Append(e, _) => e.len(),
            Command::Accept(r, _) => r.len(),
            Command::Close(_) => 0,
        }
    }
}

/// How far the log is durable, and how far the views hold it (record numbers).
#[derive(Default)]
struct Progress {
    durable: AtomicU64,
    applied: Mutex<u64>,
    caught_up: Condvar,
    /// Entries durable in the log and not yet in the views: at most
    /// [`VIEWS_BEHIND_MAX`] before the log writer waits for the views.
    behind: AtomicUsize,
    /// The room on the disk: views waiting for it will not catch up in time, and a read
    /// waiting for them is refused at once (503 `disk_full`) rather than at the end of
    /// [`VIEWS_WAIT`].
    space: Option<Arc<nrtxn_log::space::Space>>,
    /// Where a read waiting for the views says so: their writer then lingers less.
    waiting: Arc<ReadersWaiting>,
}

/// How many entries the views may be behind the log. A read that needs the views (a
/// poll of a decided key, events, holds) waits for them to catch up, at most
/// [`VIEWS_WAIT`]: without this bound a sustained batch load put the views more than
/// that behind (seen: a poll answered after 10 s, `scripts/bench.sh` batch run, 72,000
/// decisions/s for 20 s). At the views' rate on this machine (above 70,000 entries/s)
/// this is about 3 s of their work; beyond it the log writer waits, which slows the
/// callers instead of the readers.
const VIEWS_BEHIND_MAX: usize = 200_000;

impl Progress {
    fn applied(&self, lsn: u64, entries: usize) {
        self.behind.fetch_sub(entries, Ordering::AcqRel);
        if let Ok(mut a) = self.applied.lock() {
            *a = (*a).max(lsn);
            self.caught_up.notify_all();
        }
    }

    /// Waits while the views are more than [`VIEWS_BEHIND_MAX`] entries behind.
    fn wait_room(&self) {
        let Ok(mut applied) = self.applied.lock() else {
            return;
        };
        while self.behind.load(Ordering::Acquire) > VIEWS_BEHIND_MAX {
            match self
                .caught_up
                .wait_timeout(applied, Duration::from_millis(100))
            {
                Ok((a, _)) => applied = a,
                Err(_) => return,
            }
        }
    }

    /// Waits until the views hold every record durable now, at most [`VIEWS_WAIT`].
    fn wait_views(&self) -> Result<(), StoreError> {
        self.wait_views_for(VIEWS_WAIT)
    }

    fn wait_views_for(&self, most: Duration) -> Result<(), StoreError> {
        let target = self.durable.load(Ordering::Acquire);
        let deadline = Instant::now() + most;
        let mut applied = self.applied.lock().map_err(|_| StoreError::Closed)?;
        let mut waited = false;
        let _counted = (*applied < target).then(|| self.waiting.enter());
        while *applied < target {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(StoreError::Storage(format!(
                    "the journal's views are behind the log (at record {}, durable {target})",
                    *applied
                )));
            }
            // After one wait, so that a caller that loops on this (recovery) is paced.
            if waited && self.space.as_ref().is_some_and(|s| s.waiting()) {
                return Err(StoreError::DiskFull);
            }
            waited = true;
            applied = self
                .caught_up
                .wait_timeout(applied, left.min(nrtxn_log::space::RETRY_EVERY))
                .map_err(|_| StoreError::Closed)?
                .0;
        }
        Ok(())
    }
}

pub struct LogJournal {
    views: Arc<SqliteStore>,
    /// The log's index, which answers reads by key and by item (`None`: views with rows
    /// from before the log answer them; see `crate::log_reads`).
    index: Option<Arc<Index>>,
    queue: Queue,
    progress: Arc<Progress>,
    writer: Mutex<Option<JoinHandle<()>>>,
    /// Dropping the sender stops the maintenance thread.
    maintainer: Mutex<Option<(mpsc::Sender<()>, JoinHandle<()>)>>,
    dir: PathBuf,
    /// A fault the tests inject: each read of items' states waits this long first.
    read_hold: Option<Duration>,
    /// A fault the tests inject: each read of holds waits this long first.
    read_hold_of_holds: Option<Duration>,
}

fn store_error(e: LogError) -> StoreError {
    StoreError::Storage(e.to_string())
}

fn io_error(e: std::io::Error) -> StoreError {
    store_error(LogError::Io(e))
}

/// Opens the index of the log in `dir` and hands it to the views for their reads by key
/// and by item, unless they hold rows from before the log (then they answer those reads
/// themselves, and `None`).
fn open_index(
    dir: &Path,
    views: &SqliteStore,
    retention: Retention,
) -> Result<Option<Arc<Index>>, StoreError> {
    if !views.reads_from_log() {
        return Ok(None);
    }
    let started = Instant::now();
    let open_files = nrtxn_log::index::raise_open_files_limit();
    let index = Arc::new(Index::open(dir).map_err(index_error)?);
    tracing::info!(
        open_files,
        sealed = index.sealed_segments().len(),
        rebuilt = index.rebuilt_at_open(),
        ms = started.elapsed().as_millis() as u64,
        "journal: the log's index opened"
    );
    check_retired(dir)?;
    views.read_from_log(LogReads {
        index: index.clone(),
        key_window_ms: retention.key_window_ms,
        return_window_ms: retention.return_window_ms,
    });
    Ok(Some(index))
}

impl LogJournal {
    /// Opens the journal in `data_dir` (the log in `journal/`, the views in
    /// `nrtxn.db`), recovering as the module's documentation says.
    pub fn open(
        data_dir: &Path,
        metrics: Arc<Metrics>,
        retention: Retention,
    ) -> Result<Arc<LogJournal>, StoreError> {
        LogJournal::open_in(data_dir, metrics, retention, Space::new(data_dir, 0))
    }

    /// [`LogJournal::open`] keeping the floor of `space` (see [`crate::space`]) in every
    /// write it makes, recovery's included.
    pub fn open_in(
        data_dir: &Path,
        metrics: Arc<Metrics>,
        retention: Retention,
        space: Arc<Space>,
    ) -> Result<Arc<LogJournal>, StoreError> {
        let dir = data_dir.join("journal");
        // Held from before the views are touched: a second process on this data dir is
        // refused before it can read or replay anything.
        let lock = segment::lock(&dir).map_err(store_error)?;
        // What the log holds is read back only once it is on disk for good.
        segment::sync_newest(&dir).map_err(store_error)?;
        let views = SqliteStore::open_views(data_dir, metrics.clone(), space.clone())?;
        // Before the views are brought up: their writer reads the sales that returns
        // name through it.
        let index = open_index(&dir, &views, retention)?;
        views.checked()?;
        let progress = Arc::new(Progress {
            space: Some(views.space().clone()),
            waiting: views.readers_waiting().clone(),
            ..Progress::default()
        });
        let end = bring_views_up(&dir, &views, &progress)?;
        // The durable mark's first write takes a block of its own.
        let mark_room = space
            .retry(
                "the journal's durable mark",
                || space.room_for(seal::MARK_BYTES),
                nrtxn_log::space::io_no_room,
            )
            .map_err(io_error)?;
        let mut writer =
            LogWriter::open(&dir, &end, 0, retention.segment_bytes, lock).map_err(store_error)?;
        drop(mark_room);
        // A loaded log writes into segments zero-filled ahead: its syncs skip the size.
        writer
            .prepare_spares(
                space.clone(),
                nrtxn_log::spare::SPARE_AFTER.min(retention.segment_bytes / 4),
            )
            .map_err(store_error)?;
        verify_in_background(end.unread, metrics.clone())?;
        let (queue, rx, sleeper) = Queue::new();
        let after_sync = AfterSync {
            views: views.clone(),
            index: index.clone(),
            progress: progress.clone(),
            metrics,
        };
        let writer = std::thread::Builder::new()
            .name("journal-log".into())
            .spawn(move || run(writer, rx, &sleeper, after_sync))
            .map_err(|e| StoreError::Storage(e.to_string()))?;
        let maintainer = start_maintainer(views.clone(), index.clone(), dir.clone(), retention)?;
        Ok(Arc::new(LogJournal {
            views,
            index,
            queue,
            progress,
            writer: Mutex::new(Some(writer)),
            maintainer: Mutex::new(Some(maintainer)),
            dir,
            read_hold: nrtxn_log::faults::journal_read_hold(),
            read_hold_of_holds: nrtxn_log::faults::journal_read_hold_of_holds(),
        }))
    }

    /// Makes fire-and-forget requests durable (a record of the log), then calls `done`.
    pub fn accept(&self, reqs: Vec<Request>, done: AcceptDone) {
        if let Err(mpsc::SendError(Command::Accept(_, done))) =
            self.queue.send(Command::Accept(reqs, done))
        {
            done(Err(StoreError::Closed));
        }
    }

    /// Requests accepted durably and not yet decided, in acceptance order.
    pub fn pending(&self) -> Result<Vec<Request>, StoreError> {
        self.progress.wait_views()?;
        self.views.pending()
    }

    /// Requests are retired by the journal's own entries (`logged`): nothing to do.
    pub fn retire(&self, _shop: Arc<str>, _keys: Vec<Arc<str>>) {}

    /// The log's directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The room on the data dir's disk (see [`crate::space`]).
    pub fn space(&self) -> &Arc<nrtxn_log::space::Space> {
        self.views.space()
    }
}

/// Where in the log in `dir` the views start reading: after the last record they hold.
/// Views with no mark hold nothing of the log: either they were written before the log
/// existed (a data dir of the SQLite journal, migrated as it is: the log starts after
/// them), or they were lost, and are rebuilt from the log's first record, which must
/// then still be there.
fn views_start(dir: &Path, views: &SqliteStore) -> Result<Chain, StoreError> {
    let log_exists = !segment::segments(dir)
        .map_err(|e| StoreError::Storage(e.to_string()))?
        .is_empty();
    Ok(match views.log_mark()? {
        Some(mark) => mark,
        None if log_exists => Chain {
            next_lsn: 1,
            ..Chain::default()
        },
        None => Chain::default(),
    })
}

/// Recovery: reads the log in `dir` from where the views stand, checking every record,
/// hands the views what they lack, and waits until they hold it all. Returns where the
/// log ends, for its writer to go on from.
fn bring_views_up(
    dir: &Path,
    views: &Arc<SqliteStore>,
    progress: &Arc<Progress>,
) -> Result<segment::ScanEnd, StoreError> {
    let from = views_start(dir, views)?;
    progress.applied(from.next_lsn.saturating_sub(1), 0);
    let started = Instant::now();
    let mut replayed = 0u64;
    // The records replayed start right after the views' mark, one lsn after another.
    let mut due = from.next_lsn.max(1);
    let acked = seal::read_mark(dir).map_err(store_error)?;
    let end = scan(dir, from, acked, |record: segment::Record<'_>| {
        assert_eq!(
            record.header.lsn, due,
            "recovery was handed a record out of the log's order after {from:?}"
        );
        due += 1;
        replayed += replay(views, progress, record)?;
        Ok(())
    })
    .map_err(store_error)?;
    if let Some(torn) = &end.torn {
        tracing::warn!(
            file = %torn.file.display(),
            offset = torn.offset,
            bytes = torn.bytes,
            "journal: a torn tail (written when the process stopped, never acknowledged) is cut off"
        );
    }
    progress
        .durable
        .store(end.chain.next_lsn.saturating_sub(1), Ordering::Release);
    // Views rebuilt from a long log take as long as the log is: no limit at start,
    // only word of the progress.
    while let Err(e) = progress.wait_views() {
        if matches!(e, StoreError::Closed) {
            return Err(e);
        }
        tracing::info!("journal: bringing the views up to the log ({e})");
    }
    if end.records > 0 {
        // What the log holds and what the views hold now end at the same record.
        assert_eq!(
            views.log_mark()?,
            Some(end.chain),
            "the views do not stand where the log they were brought up to ends"
        );
    }
    tracing::info!(
        records = end.records,
        entries = replayed,
        ms = started.elapsed().as_millis() as u64,
        "journal log read and views brought up to it"
    );
    Ok(end)
}

/// Hands one record of the log read at start to the views, marked with where it brings
/// them; returns the entries it holds.
fn replay(
    views: &SqliteStore,
    progress: &Arc<Progress>,
    record: segment::Record<'_>,
) -> Result<u64, String> {
    let mark = Chain {
        next_lsn: record.header.lsn + 1,
        parent: record.header.checksum,
        epoch: record.header.epoch,
    };
    let applied = progress.clone();
    let lsn = record.header.lsn;
    match record.header.kind {
        KIND_ENTRIES => {
            let entries = codec::decode(record.body, record.header.at_ms)?;
            let n = entries.len() as u64;
            let segment = record
                .file
                .file_stem()
                .and_then(|s| s.to_str())
                .and_then(|s| s.parse::<u64>().ok())
                .ok_or_else(|| format!("{} is not named for its segment", record.file.display()))?;
            let at = RecordAt {
                segment,
                offset: record.offset,
            };
            views.append_marked(
                entries,
                Box::new(move |_, r| {
                    if r.is_ok() {
                        applied.applied(lsn, 0)
                    }
                }),
                Some(mark),
                Some(at),
            );
            Ok(n)
        }
        KIND_ACCEPTED => {
            let reqs: Vec<Request> = serde_json::from_slice(record.body)
                .map_err(|e| format!("accepted requests: {e}"))?;
            views.accept_marked(
                reqs,
                Box::new(move |r| {
                    if r.is_ok() {
                        applied.applied(lsn, 0)
                    }
                }),
                Some(mark),
            );
            Ok(0)
        }
        other => Err(format!("unknown record kind {other}")),
    }
}

/// Starts the thread that retires old segments and prunes old entries every
/// [`MAINTAIN_EVERY`]; dropping the returned sender stops it.
fn start_maintainer(
    views: Arc<SqliteStore>,
    index: Option<Arc<Index>>,
    dir: PathBuf,
    retention: Retention,
) -> Result<(mpsc::Sender<()>, JoinHandle<()>), StoreError> {
    let (stop, stopped) = mpsc::channel::<()>();
    let keep_segments = nrtxn_log::faults::keep_segments();
    let maintainer = std::thread::Builder::new()
        .name("journal-retention".into())
        .spawn(move || {
            while let Err(mpsc::RecvTimeoutError::Timeout) = stopped.recv_timeout(MAINTAIN_EVERY) {
                if let Err(e) = maintain(&views, index.as_deref(), &dir, retention, keep_segments) {
                    tracing::warn!(error = %e, "journal retention failed; retrying");
                }
            }
        })
        .map_err(|e| StoreError::Storage(e.to_string()))?;
    Ok((stop, maintainer))
}

/// Writes the index files of segments sealed since and the filter over their keys,
/// retires the segments no longer needed, and prunes entries past the key window from
/// the views (a batch at a time, so the writer is never held for long).
fn maintain(
    views: &SqliteStore,
    index: Option<&Index>,
    dir: &Path,
    retention: Retention,
    keep_segments: bool,
) -> Result<(), StoreError> {
    if let Some(index) = index {
        // A failure leaves the frozen tail read in its place; tried again next time.
        if index.has_frozen() {
            if let Err(e) = index.write_frozen() {
                tracing::warn!(error = %e, "journal: a sealed segment's index could not be written");
            }
        }
        // A failure leaves the segments not covered asked one by one, as before.
        let started = Instant::now();
        let ms = || started.elapsed().as_millis() as u64;
        match index.refresh_sealed_keys() {
            Ok(Refreshed::Built { keys }) => tracing::info!(
                keys,
                ms = ms(),
                "journal: the filter over the sealed segments' keys was built"
            ),
            Ok(Refreshed::Extended { keys }) => tracing::debug!(
                keys,
                ms = ms(),
                "journal: the filter over the sealed segments' keys was extended"
            ),
            Ok(Refreshed::Unchanged) => {}
            Err(e) => {
                tracing::warn!(error = %e, "journal: the sealed segments' key filter was not refreshed")
            }
        }
    }
    let now = now_ms();
    if let Some(mark) = views.durable_mark()?.filter(|_| !keep_segments) {
        let before = match index {
            Some(index) => {
                // Keys past the window, and entries the views' prune has taken (it keeps
                // the sales still returnable, which the log would otherwise be their
                // only record of).
                let pruned_before = views.oldest_entry_at()?.unwrap_or(i64::MAX);
                let window_start = (now - retention.key_window_ms).min(pruned_before);
                kept_for_keys(dir, index, mark.next_lsn, window_start)?
            }
            None => mark.next_lsn,
        };
        let gone = segment::retire_before(dir, before).map_err(store_error)?;
        if gone > 0 {
            tracing::info!(segments = gone, before, "journal segments retired");
        }
    }
    let before = now - retention.key_window_ms;
    let pruned = views.prune(before, PRUNE_MAX, now - retention.return_window_ms)?;
    if pruned > 0 {
        tracing::debug!(entries = pruned, "entries past the key window pruned");
    }
    Ok(())
}

/// The file that says where the log's retired segments end: its first kept record (a
/// decimal number). Kept when reads go to the log, whose segments then hold the keys:
/// a segment missing after it is damage, not retirement.
const RETIRED_FILE: &str = "RETIRED";

/// Where the retired segments end, as `RETIRED` says (`None`: no such file).
fn retired_before(dir: &Path) -> Result<Option<u64>, StoreError> {
    match std::fs::read_to_string(dir.join(RETIRED_FILE)) {
        Ok(text) => text.trim().parse().map(Some).map_err(|_| {
            StoreError::Storage(format!(
                "{} holds {text:?}, not a record number",
                dir.join(RETIRED_FILE).display()
            ))
        }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(io_error(e)),
    }
}

/// Says durably that the log's segments before record `first_kept` are retired: written
/// before they are deleted.
fn mark_retired(dir: &Path, first_kept: u64) -> Result<(), StoreError> {
    segment::replace_file(
        &dir.join(RETIRED_FILE),
        &dir.join(format!("{RETIRED_FILE}.tmp")),
        format!("{first_kept}\n").as_bytes(),
    )
    .map_err(io_error)
}

/// At a start that reads keys from the log: its first segment must start where the
/// retired ones ended, or a segment holding keys of the window is missing (deleted by
/// hand, lost): the start is refused rather than answering those keys as never seen. A
/// data dir without the file (restored from a backup, or written before it existed)
/// takes its log's first record as the mark.
fn check_retired(dir: &Path) -> Result<(), StoreError> {
    let segs = segment::segments(dir).map_err(io_error)?;
    let first = segs.first().map_or(1, |(f, _)| *f);
    match retired_before(dir)? {
        None => mark_retired(dir, first),
        Some(kept) if first > kept => Err(StoreError::Storage(format!(
            "journal has a gap: its first segment starts at record {first}, but the \
             segments were retired only up to record {kept} ({}): records {kept} to {} \
             are missing, and the keys they decided would be taken for new ones. Restore \
             the missing segment, or the data dir from a backup",
            dir.join(RETIRED_FILE).display(),
            first - 1
        ))),
        Some(_) => Ok(()),
    }
}

/// Where the segments that must stay begin, when reads by key and by item go to the
/// log: the views must hold them for good (`held_before`, the first record they may not),
/// every entry in them must be older than `window_start` (ms; a segment's file was last
/// written at or after each of its entries), and the index must have moved past them
/// (its tail stays on a segment the log left until an entry of the next one comes). The
/// segments that go are dropped from `index`, and said gone in `RETIRED`, first.
fn kept_for_keys(
    dir: &Path,
    index: &Index,
    held_before: u64,
    window_start: i64,
) -> Result<u64, StoreError> {
    let segs = segment::segments(dir).map_err(io_error)?;
    let mut before = held_before;
    let mut first_kept = segs.first().map(|(f, _)| *f);
    for w in segs.windows(2) {
        let ((first, path), (next_first, _)) = (&w[0], &w[1]);
        // The file's time is its last write's, at or after every record's in it.
        let written = std::fs::metadata(path)
            .and_then(|m| m.modified())
            .map_err(io_error)?;
        let written_ms = written
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(i64::MAX, |d| d.as_millis() as i64);
        if *next_first > before || written_ms >= window_start || *first >= index.tail_first_lsn() {
            before = before.min(*first);
            break;
        }
        index.retire(*first).map_err(index_error)?;
        first_kept = Some(*next_first);
    }
    if first_kept != segs.first().map(|(f, _)| *f) {
        mark_retired(dir, first_kept.unwrap_or(before))?;
    }
    Ok(before)
}

/// Reads whole, off the path, the kept segments the start checked by their footer
/// alone. What it finds damaged is logged and counted
/// (`nrtxn_journal_damaged_segments`); a backup reads the log whole again and refuses it.
fn verify_in_background(unread: Vec<Unread>, metrics: Arc<Metrics>) -> Result<(), StoreError> {
    if unread.is_empty() {
        return Ok(());
    }
    std::thread::Builder::new()
        .name("journal-verify".into())
        .spawn(move || {
            let started = Instant::now();
            let mut damaged = 0;
            for u in &unread {
                if let Err(e) = segment::verify_unread(std::slice::from_ref(u)) {
                    damaged += 1;
                    metrics.journal_damaged_segments.set(damaged);
                    tracing::error!(
                        error = %e,
                        "journal: an older segment is damaged (the views hold its records, so \
                         serving goes on; a backup of this data dir is refused until it is \
                         restored from one)"
                    );
                }
            }
            tracing::info!(
                segments = unread.len(),
                damaged,
                ms = started.elapsed().as_millis() as u64,
                "journal: older segments read whole"
            );
        })
        .map_err(|e| StoreError::Storage(e.to_string()))?;
    Ok(())
}

/// What a group's sync is followed by: the log's index, the views, the reads' progress.
struct AfterSync {
    views: Arc<SqliteStore>,
    index: Option<Arc<Index>>,
    progress: Arc<Progress>,
    metrics: Arc<Metrics>,
}

/// The writer thread: group commits until closed.
fn run(mut log: LogWriter, rx: Receiver<Command>, sleeper: &Sleeper, after: AfterSync) {
    let mut body = Vec::new();
    let mut closing = None;
    let hold = nrtxn_log::faults::journal_hold();
    while closing.is_none() {
        after.progress.wait_room();
        let Some((cmds, weight)) = next_group(&rx, sleeper) else {
            break;
        };
        match hold {
            Some(hold) if cmds.iter().any(|c| matches!(c, Command::Append(..))) => {
                // The fault: accepted requests are made durable (and answered) at once,
                // the decisions only after the hold.
                let (accepts, decisions): (Vec<Command>, Vec<Command>) = cmds
                    .into_iter()
                    .partition(|c| matches!(c, Command::Accept(..)));
                let weight = accepts.iter().map(Command::weight).sum();
                if !accepts.is_empty() {
                    commit(&mut log, &mut body, accepts, weight, &after);
                }
                std::thread::sleep(hold);
                let weight = decisions.iter().map(Command::weight).sum();
                closing = commit(&mut log, &mut body, decisions, weight, &after);
            }
            _ => closing = commit(&mut log, &mut body, cmds, weight, &after),
        }
    }
    if let Some(ack) = closing {
        let _ = ack.send(());
    }
}

/// The next group: the first command to come, then every one already waiting, up to
/// [`GROUP_ENTRIES_MAX`] entries; no wait for more (docs/decisions/log-groups.md).
/// `None` once every sender is gone.
fn next_group(rx: &Receiver<Command>, sleeper: &Sleeper) -> Option<(Vec<Command>, usize)> {
    let first = next_command(rx, sleeper)?;
    let mut weight = first.weight();
    let mut cmds = vec![first];
    while weight < GROUP_ENTRIES_MAX {
        let Ok(cmd) = rx.try_recv() else { break };
        weight += cmd.weight();
        cmds.push(cmd);
    }
    Some((cmds, weight))
}

/// The next command, sleeping until one is handed over; `None` once every sender is gone.
fn next_command(rx: &Receiver<Command>, sleeper: &Sleeper) -> Option<Command> {
    loop {
        let mut got = rx.try_recv();
        if matches!(got, Err(TryRecvError::Empty)) {
            sleeper.sleep_unless(|| {
                got = rx.try_recv();
                !matches!(got, Err(TryRecvError::Empty))
            });
        }
        match got {
            Ok(cmd) => return Some(cmd),
            Err(TryRecvError::Disconnected) => return None,
            Err(TryRecvError::Empty) => {}
        }
    }
}

/// The writer's queue: commands handed over, and its wake-up.
struct Queue {
    tx: SyncSender<Command>,
    writer: Arc<Sleeper>,
}

impl Queue {
    /// The queue, its receiving end and the writer's `Sleeper`, for the writer thread.
    fn new() -> (Queue, Receiver<Command>, Arc<Sleeper>) {
        let (tx, rx) = mpsc::sync_channel(QUEUE_MAX);
        let writer = Arc::new(Sleeper::default());
        let sleeper = writer.clone();
        (Queue { tx, writer }, rx, sleeper)
    }

    /// Hands `cmd` to the writer. Its wake-up waits until the engine thread handing it
    /// over is idle ([`Sleeper::wake_when_idle`]), so one wake-up takes several batches
    /// and none preempts the engine thread; a full queue wakes it at once and waits for
    /// room.
    fn send(&self, cmd: Command) -> Result<(), mpsc::SendError<Command>> {
        match self.tx.try_send(cmd) {
            Ok(()) => self.writer.wake_when_idle(),
            Err(TrySendError::Full(cmd)) => {
                self.writer.wake();
                self.tx.send(cmd)?;
                self.writer.wake();
            }
            Err(TrySendError::Disconnected(cmd)) => return Err(mpsc::SendError(cmd)),
        }
        Ok(())
    }
}

impl Drop for Queue {
    /// The writer learns every sender is gone only once it is awake: the sender is
    /// dropped first, then the writer woken.
    fn drop(&mut self) {
        drop(std::mem::replace(&mut self.tx, mpsc::sync_channel(0).0));
        self.writer.wake();
    }
}

/// One group commit: every command's record, one sync, then the callbacks and the
/// views. Returns the acknowledgement of a `Close` among them.
fn commit(
    log: &mut LogWriter,
    body: &mut Vec<u8>,
    mut cmds: Vec<Command>,
    weight: usize,
    after: &AfterSync,
) -> Option<mpsc::Sender<()>> {
    let (views, progress, metrics) = (&after.views, &after.progress, &after.metrics);
    let weight = weight - accepts_decided_alongside(&mut cmds);
    // The processors hand each item's entries over in seq order, each following the
    // last; the log keeps the order it is given, and recovery checks it again.
    debug_assert!(
        chained_per_item(&cmds),
        "a group commit's entries are not in each item's seq order"
    );
    let started = Instant::now();
    let Records {
        marks,
        places,
        result,
        room,
    } = write_records(log, body, &cmds, views.space());
    let result = result.and_then(|()| log.sync());
    drop(room);
    metrics
        .journal_write_seconds
        .observe(started.elapsed().as_secs_f64());
    metrics.journal_txn_entries.observe(weight as f64);
    if let Err(e) = result {
        // Memory is ahead of the journal: stopping is the only honest move; a
        // restart rebuilds every item from what is durable.
        let err = StoreError::Storage(e.to_string());
        for cmd in cmds {
            match cmd {
                Command::Append(entries, done) => done(entries, Err(err.clone())),
                Command::Accept(_, done) => done(Err(err.clone())),
                Command::Close(_) => {}
            }
        }
        nrtxn_actors::fatal::stop_not_durable(format!(
            "the journal's log can no longer be written: {e}"
        ));
    }
    // Every command has its record (a close none), or the group would have failed: a
    // command without one would be neither answered nor handed to the views.
    assert_eq!(
        marks.len(),
        cmds.len(),
        "a group commit wrote records for only some of its commands"
    );
    make_keys_known(after, &cmds, &places);
    let durable = log.chain().next_lsn - 1;
    let before = progress.durable.swap(durable, Ordering::AcqRel);
    // The log's durable record number only moves on: reads wait for the views to reach it.
    assert!(
        before <= durable,
        "the log's durable record went back from {before} to {durable}"
    );
    answer_and_hand_on(cmds, marks, &places, views, progress)
}

/// Takes out of the group's acceptances the fire-and-forget requests that the same
/// group also decides, and marks their decisions as not `logged`; returns how many.
///
/// The decision's record holds the request, and the group is made durable (and its
/// callbacks called) as a whole, so the acceptance's record would add nothing a crash
/// could need: a 202 still goes out only after the sync. An acceptance always comes
/// before its decision in the writer's queue (the request reaches a processor only
/// after its acceptance was handed over), so a decision in this group whose request was
/// accepted in an earlier one keeps `logged`: it retires that acceptance's record.
fn accepts_decided_alongside(cmds: &mut [Command]) -> usize {
    if !cmds.iter().any(|c| matches!(c, Command::Accept(..))) {
        return 0;
    }
    // Found by the entries' and requests' own strings, then changed by position: no
    // string copied, no reference counted.
    let (requests, decisions, taken) = {
        fn key_of(e: &Entry) -> Option<(&str, &str)> {
            Some((&*e.shop, &**e.request_key.as_ref()?))
        }
        fn logged(c: &Command) -> Option<&Vec<Entry>> {
            match c {
                Command::Append(entries, _) => Some(entries),
                _ => None,
            }
        }
        let decided: HashSet<(&str, &str), KeyHash> = cmds
            .iter()
            .filter_map(logged)
            .flatten()
            .filter(|e| e.logged)
            .filter_map(key_of)
            .collect();
        if decided.is_empty() {
            return 0;
        }
        let mut taken: HashSet<(&str, &str), KeyHash> = HashSet::default();
        let mut requests = Vec::new();
        for (i, cmd) in cmds.iter().enumerate() {
            if let Command::Accept(reqs, _) = cmd {
                for (j, r) in reqs.iter().enumerate() {
                    let key = (&*r.shop, &*r.key);
                    if decided.contains(&key) {
                        taken.insert(key);
                        requests.push((i, j));
                    }
                }
            }
        }
        let mut decisions = Vec::new();
        if !taken.is_empty() {
            for (i, cmd) in cmds.iter().enumerate() {
                for (j, e) in logged(cmd).into_iter().flatten().enumerate() {
                    if e.logged && key_of(e).is_some_and(|k| taken.contains(&k)) {
                        decisions.push((i, j));
                    }
                }
            }
        }
        (requests, decisions, taken.len())
    };
    let mut requests = requests.into_iter().peekable();
    for (i, cmd) in cmds.iter_mut().enumerate() {
        if let Command::Accept(reqs, _) = cmd {
            let mut j = 0;
            reqs.retain(|_| {
                let keep = requests.next_if_eq(&(i, j)).is_none();
                j += 1;
                keep
            });
        }
    }
    for (i, j) in decisions {
        if let Command::Append(entries, _) = &mut cmds[i] {
            entries[j].logged = false;
        }
    }
    taken
}

/// Every key now durable goes into the log's index (or, for views that answer keys
/// themselves, the key filter) before anyone is answered: a key it does not know was
/// never decided, and reads need not wait for the views.
fn make_keys_known(after: &AfterSync, cmds: &[Command], places: &[Option<Place>]) {
    if let Some(index) = &after.index {
        return index_group(index, cmds, places);
    }
    let Some(filter) = after.views.key_filter() else {
        return;
    };
    for cmd in cmds {
        if let Command::Append(entries, _) = cmd {
            for e in entries {
                if let Some(key) = &e.request_key {
                    filter.insert(&e.shop, key);
                }
            }
        }
    }
}

/// Hands a synced group's entries records to the log's index, before anyone is
/// answered: a poll that follows an answer finds its key. An index that cannot follow
/// the log would answer reads wrong: the process stops.
fn index_group(index: &Index, cmds: &[Command], places: &[Option<Place>]) {
    let records: Vec<nrtxn_log::index::Written<'_>> = cmds
        .iter()
        .zip(places)
        .filter_map(|(cmd, place)| match (cmd, place) {
            (Command::Append(entries, _), Some(p)) => Some(nrtxn_log::index::Written {
                first_lsn: p.first_lsn,
                offset: p.offset,
                end: p.end,
                entries,
            }),
            _ => None,
        })
        .collect();
    if let Err(e) = index.add_synced(&records) {
        nrtxn_actors::fatal::stop_not_durable(format!(
            "the log's index can no longer follow the log: {e}"
        ));
    }
}

/// Where a record was written: its segment (first lsn) and its bytes there.
#[derive(Debug, Clone, Copy)]
struct Place {
    first_lsn: u64,
    offset: u64,
    end: u64,
}

impl Place {
    /// The place of the record `log` appended last, whose body is `body_len` bytes.
    fn of_last(log: &LogWriter, body_len: usize) -> Place {
        let (first_lsn, end) = log.segment_end();
        Place {
            first_lsn,
            offset: end - (segment::HEADER_LEN + body_len) as u64,
            end,
        }
    }
}

/// What [`write_records`] did: each command's mark after its record (`None`: a close,
/// which has none) and where the record went, and whether every record was written.
struct Records {
    marks: Vec<Option<Chain>>,
    places: Vec<Option<Place>>,
    result: Result<(), LogError>,
    /// The room the records were written in, held until they are synced.
    room: nrtxn_log::space::Claim,
}

/// Writes a record for each command of a group (not synced), each within the disk's
/// floor; stops at the first that fails.
fn write_records(
    log: &mut LogWriter,
    body: &mut Vec<u8>,
    cmds: &[Command],
    space: &Arc<Space>,
) -> Records {
    let now = now_ms();
    let mut marks = Vec::with_capacity(cmds.len());
    let mut places = Vec::with_capacity(cmds.len());
    // Room for the group's records within the disk's floor (see `crate::space`), asked
    // for by the MiB rather than by the record: one reading of the free space per MiB.
    let mut room = space.claim();
    let mut used = 0;
    for cmd in cmds {
        let kind = match encode_record(cmd, now, body) {
            Ok(Some(kind)) => kind,
            Ok(None) => {
                marks.push(None);
                places.push(None);
                continue;
            }
            Err(e) => {
                return Records {
                    marks,
                    places,
                    result: Err(e),
                    room,
                }
            }
        };
        // A record that finds the disk full, or no room above its floor, is cut off
        // and written again once there is room, while new writes are refused; nothing
        // of this group is answered before its sync. Its bound: the record, the footer
        // of the segment it may end first, and the block the next segment starts in.
        let need = used + (segment::HEADER_LEN + body.len() + seal::FOOTER_LEN) as u64;
        let appended = space.retry(
            "the journal's log",
            || {
                if need + nrtxn_log::space::BLOCK_BYTES > room.bytes()
                    && room.try_grow_to(need + LOG_ROOM_STEP).is_err()
                {
                    room.try_grow_to(need + nrtxn_log::space::BLOCK_BYTES)
                        .map_err(LogError::Io)?;
                }
                log.append(kind, now, body)
            },
            LogError::no_room,
        );
        if let Err(e) = appended {
            return Records {
                marks,
                places,
                result: Err(e),
                room,
            };
        }
        used = need;
        marks.push(Some(log.chain()));
        places.push(Some(Place::of_last(log, body.len())));
    }
    Records {
        marks,
        places,
        result: Ok(()),
        room,
    }
}

/// Encodes `cmd` as a record's body in `body`; returns the record's kind (`None`: a
/// close, or an acceptance whose requests the group decides, which have no record).
fn encode_record(cmd: &Command, now: i64, body: &mut Vec<u8>) -> Result<Option<u8>, LogError> {
    body.clear();
    match cmd {
        Command::Append(entries, _) => {
            codec::encode(entries, now, body);
            // What the log writes is what recovery reads back (a debug build decodes
            // every record it writes: a codec change that loses a field fails here).
            debug_assert_eq!(
                codec::decode(body, now).map(|back| back.len()),
                Ok(entries.len()),
                "a record does not decode to the entries written"
            );
            Ok(Some(KIND_ENTRIES))
        }
        // Every request of it is decided in the same group: no record.
        Command::Accept(reqs, _) if reqs.is_empty() => Ok(None),
        Command::Accept(reqs, _) => serde_json::to_writer(&mut *body, reqs)
            .map(|()| Some(KIND_ACCEPTED))
            .map_err(|e| LogError::Io(std::io::Error::other(e))),
        Command::Close(_) => Ok(None),
    }
}

/// Whether the entries of `cmds`, in order, follow each other within each item: each
/// entry with a seq comes right after the item's entry before it in the group.
fn chained_per_item(cmds: &[Command]) -> bool {
    let mut last: std::collections::HashMap<(&str, &str), u64> = Default::default();
    cmds.iter()
        .filter_map(|c| match c {
            Command::Append(entries, _) => Some(entries),
            _ => None,
        })
        .flatten()
        .all(|e| {
            let Some(seq) = e.seq else { return true };
            let before = last.insert((&*e.shop, &*e.item), seq);
            before.is_none_or(|b| e.prev_seq == Some(b) && seq == b + 1)
        })
}

/// After a group's sync: answers each command, and hands what it wrote to the views,
/// marked with where in the log it brings them. Returns the acknowledgement of a
/// `Close` among them.
fn answer_and_hand_on(
    cmds: Vec<Command>,
    marks: Vec<Option<Chain>>,
    places: &[Option<Place>],
    views: &Arc<SqliteStore>,
    progress: &Arc<Progress>,
) -> Option<mpsc::Sender<()>> {
    let mut closing = None;
    for ((cmd, mark), place) in cmds.into_iter().zip(marks).zip(places) {
        let at = place.map(|p| RecordAt {
            segment: p.first_lsn,
            offset: p.offset,
        });
        let lsn = mark.map_or(0, |m| m.next_lsn - 1);
        let applied = progress.clone();
        let on_views = move |r: Result<(), StoreError>, entries: usize| match r {
            Ok(()) => applied.applied(lsn, entries),
            Err(e) => nrtxn_actors::fatal::stop_not_durable(format!(
                "the journal's views can no longer be written: {e}"
            )),
        };
        match cmd {
            Command::Append(entries, done) => {
                let copy = entries.clone();
                done(entries, Ok(()));
                progress.behind.fetch_add(copy.len(), Ordering::AcqRel);
                views.append_marked(copy, Box::new(move |e, r| on_views(r, e.len())), mark, at);
            }
            Command::Accept(reqs, done) if reqs.is_empty() => done(Ok(())),
            Command::Accept(reqs, done) => {
                done(Ok(()));
                views.accept_marked(reqs, Box::new(move |r| on_views(r, 0)), mark);
            }
            Command::Close(ack) => closing = Some(ack),
        }
    }
    closing
}

impl JournalWrite for LogJournal {
    fn append(&self, entries: Vec<Entry>, done: AppendDone) {
        if let Err(mpsc::SendError(Command::Append(entries, done))) =
            self.queue.send(Command::Append(entries, done))
        {
            done(entries, Err(StoreError::Closed));
        }
    }

    /// One writer thread takes the appends from one queue in the order they were
    /// handed over (`append` blocks while the queue is full rather than bouncing), and
    /// writes them to one log whose syncs each cover everything before them; a failed
    /// write stops the process. So a batch is on disk only after every batch before it.
    fn appends_in_order(&self) -> bool {
        true
    }
}

impl Outcomes for LogJournal {
    fn surely_new(&self, shop: &str, keys: &[&str]) -> bool {
        self.views.surely_new(shop, keys)
    }

    /// A key the filter does not know was never made durable (the log writer adds each
    /// key before anyone is answered): most keys, new ones, are answered at once. A key
    /// that may be there is read from the log's index, which the log writer also fills
    /// before anyone is answered (or, for views with rows from before the log, from the
    /// views once they hold everything durable).
    fn outcomes(&self, shop: &str, keys: &[&str]) -> Result<Vec<Option<Outcome>>, StoreError> {
        // The views ask each key's filter once (the log's index, or their own).
        if self.index.is_none() && self.views.may_hold_any(shop, keys) {
            self.progress.wait_views()?;
        }
        self.views.outcomes(shop, keys)
    }
}

impl ItemReads for LogJournal {
    fn item_states(
        &self,
        items: &[(Arc<str>, Arc<str>)],
    ) -> Result<Vec<Option<ItemState>>, StoreError> {
        if let Some(hold) = self.read_hold {
            std::thread::sleep(hold);
        }
        self.progress.wait_views()?;
        self.views.item_states(items)
    }

    fn item_page(
        &self,
        shop: &str,
        after: Option<&str>,
        limit: usize,
    ) -> Result<ItemPage, StoreError> {
        self.progress.wait_views()?;
        self.views.item_page(shop, after, limit)
    }

    fn holds(&self, shop: &str, hold_ids: &[&str]) -> Result<Vec<Option<HoldView>>, StoreError> {
        if let Some(hold) = self.read_hold_of_holds {
            std::thread::sleep(hold);
        }
        self.progress.wait_views()?;
        self.views.holds(shop, hold_ids)
    }

    fn hold_page(
        &self,
        shop: &str,
        query: &HoldQuery,
        after: Option<&str>,
        limit: usize,
    ) -> Result<HoldPage, StoreError> {
        self.progress.wait_views()?;
        self.views.hold_page(shop, query, after, limit)
    }

    fn sales(
        &self,
        shop: &str,
        keys: &[&str],
    ) -> Result<Vec<Option<nrtxn_actors::returns::SaleRecord>>, StoreError> {
        self.progress.wait_views()?;
        self.views.sales(shop, keys)
    }

    fn ledgers(
        &self,
        items: &[(Arc<str>, Arc<str>)],
    ) -> Result<Vec<Option<nrtxn_actors::ledger::BuyerLedger>>, StoreError> {
        self.progress.wait_views()?;
        self.views.ledgers(items)
    }

    fn events(
        &self,
        shop: &str,
        item: &str,
        after: u64,
        limit: usize,
    ) -> Result<Vec<Event>, StoreError> {
        // The log's index holds every durable event (the views may lag).
        if self.index.is_none() {
            self.progress.wait_views()?;
        }
        self.views.events(shop, item, after, limit)
    }
}

/// Only this node writes it: the defaults.
impl Sharing for LogJournal {}

impl Outbox for LogJournal {
    fn relay_read(&self, cursor: u64, limit: usize) -> Result<RelayPage, StoreError> {
        self.progress.wait_views()?;
        self.views.relay_read(cursor, limit)
    }

    /// Read from what the views hold now, with no wait for them: its reader (the stock
    /// alerts) follows a cursor, which stops where the views do, and the rest comes at
    /// its next read (the views hold every entry up to their last, in order). A wait
    /// would count as a read waiting, and end the views' linger early at every poll.
    fn relay_read_kinds(
        &self,
        cursor: u64,
        limit: usize,
        kinds: &[nrtxn_actors::Op],
    ) -> Result<RelayPage, StoreError> {
        self.views.relay_read_kinds(cursor, limit, kinds)
    }

    fn relay_end(&self) -> Result<u64, StoreError> {
        self.progress.wait_views()?;
        self.views.relay_end()
    }

    fn relay_cursor(&self, reader: OutboxReader) -> Result<Option<u64>, StoreError> {
        self.views.relay_cursor(reader)
    }

    fn relay_save(&self, reader: OutboxReader, cursor: u64) -> Result<(), StoreError> {
        self.views.relay_save(reader, cursor)
    }
}

impl Lifecycle for LogJournal {
    fn recover(&self) -> Result<Recovered, StoreError> {
        self.progress.wait_views()?;
        self.views.recover()
    }

    fn close(&self) {
        if let Some((stop, handle)) = self.maintainer.lock().ok().and_then(|mut m| m.take()) {
            drop(stop);
            let _ = handle.join();
        }
        let (ack, done) = mpsc::channel();
        if self.queue.send(Command::Close(ack)).is_ok() {
            let _ = done.recv();
        }
        if let Some(handle) = self.writer.lock().ok().and_then(|mut w| w.take()) {
            let _ = handle.join();
        }
        let _ = self.progress.wait_views();
        self.views.close();
        // A segment sealed since the last maintenance gets its index file now, rather
        // than being rebuilt from the segment at the next start.
        if let Some(index) = &self.index {
            if let Err(e) = index.write_frozen() {
                tracing::warn!(error = %e, "journal: a sealed segment's index could not be written");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nrtxn_actors::apply::apply;
    use nrtxn_actors::Op;

    fn accepted(key: &str) -> Request {
        let mut r = Request::new("s".into(), "a".into(), key.into(), Op::Decrement, 1, 0);
        r.logged = true;
        r
    }

    fn decided(key: &str) -> Entry {
        let mut state = ItemState {
            stock: 10,
            ..ItemState::default()
        };
        apply(Some(&mut state), &accepted(key), 0, 30_000)
    }

    fn accept_cmd(keys: &[&str]) -> Command {
        Command::Accept(keys.iter().map(|k| accepted(k)).collect(), Box::new(|_| {}))
    }

    fn append_cmd(keys: &[&str]) -> Command {
        Command::Append(
            keys.iter().map(|k| decided(k)).collect(),
            Box::new(|_, _| {}),
        )
    }

    /// A group that accepts `a` and `b` and decides `a` and `c` (accepted in an earlier
    /// group): `a`'s acceptance leaves the group and its decision retires nothing; `b`
    /// stays accepted; `c`'s decision still retires its earlier acceptance.
    #[test]
    fn a_group_writes_no_acceptance_for_a_request_it_also_decides() {
        let mut cmds = vec![accept_cmd(&["a", "b"]), append_cmd(&["a", "c"])];
        assert!(
            decided("a").logged,
            "the decision mirrors its request's `logged`"
        );
        assert_eq!(accepts_decided_alongside(&mut cmds), 1);
        let Command::Accept(reqs, _) = &cmds[0] else {
            unreachable!()
        };
        let kept: Vec<&str> = reqs.iter().map(|r| &*r.key).collect();
        assert_eq!(kept, ["b"]);
        let Command::Append(entries, _) = &cmds[1] else {
            unreachable!()
        };
        let logged: Vec<(&str, bool)> = entries
            .iter()
            .map(|e| (e.request_key.as_deref().unwrap(), e.logged))
            .collect();
        assert_eq!(logged, [("a", false), ("c", true)]);
    }

    /// Several acceptances and decisions in one group, interleaved: each request the
    /// group decides leaves its own acceptance, whatever its place, and only its
    /// decisions stop retiring one.
    #[test]
    fn decided_requests_leave_their_acceptances_wherever_they_stand_in_the_group() {
        let mut cmds = vec![
            accept_cmd(&["a", "b"]),
            append_cmd(&["x"]),
            accept_cmd(&["c", "d", "e"]),
            append_cmd(&["d", "a", "y"]),
        ];
        assert_eq!(accepts_decided_alongside(&mut cmds), 2);
        let kept = |c: &Command| match c {
            Command::Accept(reqs, _) => reqs.iter().map(|r| r.key.to_string()).collect(),
            _ => Vec::new(),
        };
        assert_eq!(kept(&cmds[0]), ["b"]);
        assert_eq!(kept(&cmds[2]), ["c", "e"]);
        let logged = |c: &Command| match c {
            Command::Append(entries, _) => entries
                .iter()
                .map(|e| (e.request_key.as_deref().unwrap().to_string(), e.logged))
                .collect(),
            _ => Vec::new(),
        };
        assert_eq!(logged(&cmds[1]), [("x".to_string(), true)]);
        assert_eq!(
            logged(&cmds[3]),
            [
                ("d".to_string(), false),
                ("a".to_string(), false),
                ("y".to_string(), true)
            ]
        );
    }

    /// An acceptance whose every request the group decides has no record; the other
    /// commands still get theirs.
    #[test]
    fn an_acceptance_left_empty_has_no_record() {
        let mut cmds = vec![accept_cmd(&["a"]), append_cmd(&["a"])];
        assert_eq!(accepts_decided_alongside(&mut cmds), 1);
        let mut body = Vec::new();
        assert_eq!(encode_record(&cmds[0], 0, &mut body).unwrap(), None);
        assert_eq!(
            encode_record(&cmds[1], 0, &mut body).unwrap(),
            Some(KIND_ENTRIES)
        );
    }

    /// Without a decision of an accepted request in the group, nothing changes.
    #[test]
    fn acceptances_without_their_decisions_are_kept_whole() {
        let mut cmds = vec![accept_cmd(&["a", "b"]), append_cmd(&["c"])];
        assert_eq!(accepts_decided_alongside(&mut cmds), 0);
        let Command::Accept(reqs, _) = &cmds[0] else {
            unreachable!()
        };
        assert_eq!(reqs.len(), 2);
    }
}
