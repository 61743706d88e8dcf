//! The journal's views in SQLite (bundled, WAL mode): every read of the embedded journal
//! (a key's outcome, an item's events, holds, item snapshots) is answered from here.
//!
//! [`SqliteStore`] plays one of two roles ([`Role`]), chosen when it is opened: the
//! **views** of the embedded journal, derived from the log off the commit path
//! (`synchronous=NORMAL`: the log is the record, and a start catches the views up from
//! it); or the **request store** beside a MongoDB journal (fire-and-forget requests in
//! `requests`, `synchronous=FULL`).
//!
//! Why SQLite: the most widely deployed and tested embedded database, with a documented
//! file format, crash safety proven by its own test suite (power-loss simulation), and a
//! CLI that lets an operator inspect the views with plain SQL. WAL mode lets the API's
//! readers look outcomes up while the writer commits.
//!
//! One writer thread owns the write connection. It takes every command waiting (journal
//! batches from all shards, fire-and-forget acceptances) into one transaction, so one
//! fsync serves them all (group commit), then calls each command back. Item snapshots
//! are written every [`SNAPSHOT_EVERY_TXNS`] transactions (or [`SNAPSHOT_EVERY`], when
//! fewer came) and at close; at start the
//! journal entries after the last snapshot are replayed on top of it.
//!
//! A decision is not copied here: the views of the embedded journal keep one `records`
//! row per record of its log ([`crate::records`]), and the readers of entries by journal
//! id (the outbox relay, the item states after the snapshot, the prune) read them from
//! the log; keys and events are read through the log's index. Views written before the
//! log, or by an older version, keep a `journal` row per entry (with the indexes by key
//! and by item when they hold rows the log does not), read before the records. An
//! item's sequence is kept by its single writer, asserted before each write, and checked
//! again (gapless, never negative) when recovery reads the entries back.
//!
//! Holds are rows of `holds`, written in the transaction of the entry that makes or
//! ends them, so the pending ones read at start are exactly the journal's.

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, SyncSender, TryRecvError};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use nrtxn_actors::ledger::{self, BuyerLedger};
use nrtxn_actors::ports::{
    HoldPage, HoldQuery, ItemPage, ItemReads, Lifecycle, Outbox, OutboxReader, Outcomes,
};
use nrtxn_actors::returns::SaleRecord;
use nrtxn_actors::verify::Verifier;
use nrtxn_actors::{
    bound, load_only, AppendDone, Entry, Event, HoldStatus, HoldView, ItemState, Metrics, Op,
    Outcome, Recovered, RelayPage, Request, Status, StoreError, INTERNAL_ITEMS_END,
    INTERNAL_ITEM_PREFIX,
};
use prometheus::Histogram;
use rusqlite::{params, Connection, OptionalExtension};

use crate::coalesce::{Earlier, Pending};
use crate::log_reads::LogReads;
use crate::records::{self, LogRecords, RecordAt, ALL_OPS};
use nrtxn_log::keyfilter::KeyFilter;
use nrtxn_log::segment::Chain;
use nrtxn_log::space::Space;

/// Commands waiting for the writer; senders block beyond it (admission control upstream
/// keeps it from filling in practice).
const COMMAND_QUEUE_MAX: usize = 4096;
/// Most entries one transaction takes before it commits, so one commit's latency and
/// memory stay bounded however deep the queue.
const TXN_ENTRIES_MAX: usize = 65_536;
/// Transactions between item snapshots; bounds the journal tail replayed at start.
const SNAPSHOT_EVERY_TXNS: u32 = 256;
/// The longest a change waits for a snapshot when transactions are few: the prune takes
/// only entries a snapshot covers, and the log's segments wait for the prune (they are
/// the only record of a returnable sale until the prune keeps it in `sales`).
const SNAPSHOT_EVERY: Duration = Duration::from_secs(5);
/// Read connections kept for lookups.
const READERS_MAX: usize = 8;

/// Adds an `INTEGER` column to a table made before the column existed.
fn add_column_if_missing(
    conn: &Connection,
    table: &str,
    column: &str,
) -> Result<(), rusqlite::Error> {
    add_typed_column_if_missing(conn, table, column, "INTEGER")
}

/// [`add_column_if_missing`] with the column's type.
fn add_typed_column_if_missing(
    conn: &Connection,
    table: &str,
    column: &str,
    kind: &str,
) -> Result<(), rusqlite::Error> {
    let has: i64 = conn.query_row(
        "SELECT COUNT(*) FROM pragma_table_info(?1) WHERE name = ?2",
        params![table, column],
        |r| r.get(0),
    )?;
    if has == 0 {
        conn.execute_batch(&format!("ALTER TABLE {table} ADD COLUMN {column} {kind};"))?;
    }
    Ok(())
}

/// The checksum of an item's snapshot row: xxh3-64 of its fields, as a signed integer.
fn snapshot_checksum(shop: &str, item: &str, s: ItemState) -> i64 {
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    for text in [shop, item] {
        h.update(&(text.len() as u64).to_le_bytes());
        h.update(text.as_bytes());
    }
    for n in [s.stock, s.reserved, s.seq as i64] {
        h.update(&n.to_le_bytes());
    }
    // A window's bounds, when the item has one: rows of items without one (all rows
    // written before windows existed) keep the sums they were written with.
    if (s.opens_at, s.closes_at) != (0, 0) {
        h.update(&s.opens_at.to_le_bytes());
        h.update(&s.closes_at.to_le_bytes());
    }
    // The low-stock level, the same way.
    if s.low_stock_at != 0 {
        h.update(&s.low_stock_at.to_le_bytes());
    }
    h.digest() as i64
}

/// A snapshot row's state, if its checksum matches (a row written before checksums has
/// none); a damaged row is an error that says where and what to do.
fn checked_snapshot(
    shop: &str,
    item: &str,
    state: ItemState,
    checksum: Option<i64>,
) -> Result<ItemState, rusqlite::Error> {
    match checksum {
        Some(sum) if sum != snapshot_checksum(shop, item, state) => {
            Err(rusqlite::Error::ToSqlConversionFailure(
                format!(
                    "the views (nrtxn.db) are damaged: the snapshot of item {item:?} of shop \
                     {shop:?} (seq {}) does not match its checksum. Move nrtxn.db and its \
                     -wal and -shm files away and start again: the views are rebuilt from \
                     the log, or, if the log's old segments were retired, restore a backup",
                    state.seq
                )
                .into(),
            ))
        }
        _ => Ok(state),
    }
}

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS journal (
    id             INTEGER PRIMARY KEY,
    shop           TEXT    NOT NULL,
    item           TEXT    NOT NULL,
    seq            INTEGER,
    prev_seq       INTEGER,
    request_key    TEXT,
    op             TEXT    NOT NULL,
    qty            INTEGER NOT NULL,
    status         TEXT    NOT NULL,
    reason         TEXT,
    stock_before   INTEGER,
    stock_after    INTEGER,
    reserved_after INTEGER,
    submitted_at   INTEGER NOT NULL,
    completed_at   INTEGER NOT NULL,
    seller         TEXT,
    buyer          TEXT,
    remarks        TEXT,
    hold_id        TEXT,
    expires_at     INTEGER,
    ttl_ms         INTEGER,
    -- row_checksum() of the decision's fields: a damaged row is refused, not served.
    rowsum         INTEGER,
    -- A partial fill's qty asked for (qty is what it took); NULL otherwise.
    qty_asked      INTEGER,
    -- The item's sale window after the entry, each bound only when set.
    opens_at       INTEGER,
    closes_at      INTEGER,
    -- The item's low-stock level after the entry, only when set.
    low_stock_at   INTEGER
);
CREATE TABLE IF NOT EXISTS holds (
    shop       TEXT    NOT NULL,
    hold_id    TEXT    NOT NULL,
    item       TEXT    NOT NULL,
    qty        INTEGER NOT NULL,
    expires_at INTEGER NOT NULL,
    status     TEXT    NOT NULL,
    seq        INTEGER NOT NULL,
    PRIMARY KEY (shop, hold_id)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS holds_pending ON holds (shop, item) WHERE status = 'held';
-- Ended holds are listed until the key window passes their expiry; the prune finds
-- them by a sweep of the table (`EndedSweep`), not an index (an insert each).
CREATE TABLE IF NOT EXISTS items (
    shop     TEXT    NOT NULL,
    item     TEXT    NOT NULL,
    stock    INTEGER NOT NULL,
    reserved INTEGER NOT NULL,
    seq      INTEGER NOT NULL,
    -- snapshot_checksum(shop, item, stock, reserved, seq): a damaged row is refused.
    checksum INTEGER,
    PRIMARY KEY (shop, item)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS requests (
    id          INTEGER PRIMARY KEY,
    shop        TEXT NOT NULL,
    request_key TEXT NOT NULL,
    body        TEXT NOT NULL,
    UNIQUE (shop, request_key)
);
CREATE TABLE IF NOT EXISTS buyer_limits (
    shop          TEXT    NOT NULL,
    item          TEXT    NOT NULL,
    per_buyer_max INTEGER NOT NULL,
    PRIMARY KEY (shop, item)
) WITHOUT ROWID;
-- Each buyer's units of a limited item (crate::ledger), kept from the entries as they
-- are written: rows with units above 0 only.
CREATE TABLE IF NOT EXISTS buyer_units (
    shop  TEXT    NOT NULL,
    item  TEXT    NOT NULL,
    buyer TEXT    NOT NULL,
    units INTEGER NOT NULL,
    PRIMARY KEY (shop, item, buyer)
) WITHOUT ROWID;
-- Returns (nrtxn_actors::returns): the units returned against each sale that had a
-- return, kept from the return entries as they are written, until the sale is past the
-- return window. `sold_at` is the sale's decision time: a key used again after the key
-- window names another sale, whose count starts over.
CREATE TABLE IF NOT EXISTS returned (
    shop     TEXT    NOT NULL,
    sale_key TEXT    NOT NULL,
    sold_at  INTEGER NOT NULL,
    units    INTEGER NOT NULL,
    PRIMARY KEY (shop, sale_key)
);
CREATE INDEX IF NOT EXISTS returned_sold_at ON returned (sold_at);
-- The ok sales pruned from `journal` (past the key window) that are still within the
-- return window: a sale stays returnable after its key is forgotten. Filled by the
-- prune, off the commit path, so a sale costs nothing more when it is made.
CREATE TABLE IF NOT EXISTS sales (
    shop     TEXT    NOT NULL,
    sale_key TEXT    NOT NULL,
    item     TEXT    NOT NULL,
    sold     INTEGER NOT NULL,
    sold_at  INTEGER NOT NULL,
    PRIMARY KEY (shop, sale_key)
);
CREATE INDEX IF NOT EXISTS sales_sold_at ON sales (sold_at);
CREATE TABLE IF NOT EXISTS log_offsets (
    log_partition INTEGER PRIMARY KEY,
    log_offset    INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS meta (
    key   TEXT PRIMARY KEY,
    value INTEGER NOT NULL
) WITHOUT ROWID;
";

use crate::AcceptDone;

enum Command {
    /// Entries to write; with a log mark when they come from the journal's log (the
    /// views of [`crate::journal::LogJournal`]): the mark is written in the same
    /// transaction, so the views know where in the log they stand; and where the
    /// record is in the log, which views that keep a row per record, not per entry,
    /// write instead of the entries' rows ([`crate::records`]).
    Append(Vec<Entry>, AppendDone, Option<Chain>, Option<RecordAt>),
    Accept(Vec<Request>, AcceptDone, Option<Chain>),
    /// Fire-and-forget requests decided in another journal: forget them.
    Retire(Arc<str>, Vec<Arc<str>>),
    /// The outbox relay published every event up to this journal id.
    RelaySave(OutboxReader, i64, mpsc::Sender<Result<(), StoreError>>),
    /// Forget entries decided before this time (ms), at most this many, keeping the ok
    /// sales decided from the third time (ms) on as returnable: see
    /// [`SqliteStore::prune`].
    Prune(i64, usize, i64, mpsc::Sender<Result<usize, StoreError>>),
    Close(mpsc::Sender<()>),
}

impl Command {
    fn weight(&self) -> usize {
        match self {
            Command::Append(e, ..) => e.len(),
            Command::Accept(r, ..) => r.len(),
            Command::Retire(_, keys) => keys.len(),
            Command::RelaySave(..) | Command::Prune(..) | Command::Close(_) => 0,
        }
    }
}

/// How long the views' writer gathers entries into one transaction while no read waits
/// for the views. Nobody waits for a views commit as such (the log is the durable
/// record), so fewer, larger commits cost less per entry: each commit rewrites every
/// page it touched into the WAL, checksummed, and a hold made and ended within one
/// transaction is never written (measured: `docs/decisions/derived-views.md`).
const VIEWS_LINGER: Duration = Duration::from_millis(100);

/// [`VIEWS_LINGER`] while a read waits for the views to catch up with the log (an
/// item's state, a hold, a page of events or of the stream): its wait is no longer
/// than before the linger grew.
const VIEWS_LINGER_READ: Duration = Duration::from_millis(20);

/// The reads waiting for the views to catch up with the log, which the views' writer
/// looks at while it lingers: while there is one, its transaction ends at
/// [`VIEWS_LINGER_READ`].
#[derive(Default)]
pub(crate) struct ReadersWaiting(AtomicUsize);

impl ReadersWaiting {
    /// Counts a read as waiting until the guard is dropped.
    pub(crate) fn enter(&self) -> ReaderWaits<'_> {
        self.0.fetch_add(1, Ordering::AcqRel);
        ReaderWaits(self)
    }

    fn any(&self) -> bool {
        self.0.load(Ordering::Acquire) > 0
    }
}

/// A read counted in [`ReadersWaiting`] while this lives.
pub(crate) struct ReaderWaits<'a>(&'a ReadersWaiting);

impl Drop for ReaderWaits<'_> {
    fn drop(&mut self) {
        self.0 .0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// How long the writer gathers commands into one transaction ([`gather_by_time`]).
struct Linger {
    /// While no read waits.
    alone: Duration,
    /// While one does.
    read: Duration,
    waiting: Arc<ReadersWaiting>,
}

/// How often the WAL is copied back into the database file, off the writer's thread.
const CHECKPOINT_EVERY: std::time::Duration = std::time::Duration::from_millis(500);

/// The database's page size (see [`open`]).
const PAGE_BYTES: u64 = 4_096;
/// The page cache of each connection: 64 MiB, so that the index pages a batch touches
/// stay in memory. A transaction dirtying fewer pages never spills into the WAL before
/// it commits.
const CACHE_PAGES: u64 = 16_384;
/// One WAL frame: a page and its 24-byte header.
const FRAME_BYTES: u64 = PAGE_BYTES + 24;
/// What a WAL file is cut back to when it starts over after a checkpoint
/// (`journal_size_limit`). Without it a WAL file keeps the size of its largest burst
/// (seen: 12 MB on a 64 MiB disk, 1.3 GB after the HTTP benchmark), room the disk's floor
/// then lacks; reusing this much of it still spares most appends.
const WAL_KEPT_BYTES: u64 = 4 * 1024 * 1024;
/// Pages every views transaction may dirty besides its rows' (see [`Writer::txn_pages`]):
/// page 1 (the file's header holds its size), the `meta` and `log_offsets` pages, and
/// the root of each of the thirteen tables and indexes a transaction reaches, which a
/// split below it may change.
const TXN_PAGES_FIXED: u64 = 16;
/// Pages one pruned entry may dirty: its journal row and its two index entries, the
/// `sales` row it may become, one `sales` and one `returned` row past the return window
/// (each prune deletes as many of those as entries), and one for the leaves that merge
/// and the free list.
const PRUNE_PAGES_PER_ENTRY: u64 = 7;

/// What a [`SqliteStore`] is opened as. The role sets how its commits are synced and how
/// long its writer gathers commands; the tables are the same.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// The views of the embedded journal ([`crate::journal::LogJournal`]), derived from
    /// its log: a commit is not synced by itself (the log is the record, and replays
    /// what a crash took), the writer lingers ([`VIEWS_LINGER`], [`VIEWS_LINGER_READ`]
    /// while a read waits for it) for fewer, larger commits, and the file is checked
    /// before it is read ([`check_views`]).
    Views,
    /// The request log's store beside a MongoDB journal: the fire-and-forget requests
    /// accepted and not yet decided, each commit synced before their `202`, with no
    /// linger (its callers wait for the commit).
    RequestStore,
}

impl Role {
    /// The `store` label of this store's commit figures (`nrtxn_sqlite_commit_*`).
    fn store(self) -> &'static str {
        match self {
            Role::Views => "views",
            Role::RequestStore => "requests",
        }
    }

    /// SQLite's `synchronous` setting for this role (see [`open`]).
    fn synchronous(self) -> &'static str {
        match self {
            Role::Views => "NORMAL",
            Role::RequestStore => "FULL",
        }
    }

    /// How long the writer waits for more commands after a transaction's first, with no
    /// read waiting for it and with one.
    fn linger(self, waiting: Arc<ReadersWaiting>) -> Linger {
        let (alone, read) = match self {
            Role::Views => (VIEWS_LINGER, VIEWS_LINGER_READ),
            Role::RequestStore => (Duration::ZERO, Duration::ZERO),
        };
        Linger {
            alone,
            read,
            waiting,
        }
    }
}

pub struct SqliteStore {
    path: std::path::PathBuf,
    /// The journal's log, which the `records` rows name records in.
    log_dir: std::path::PathBuf,
    /// What the store was opened as: how its read connections are opened too.
    role: Role,
    tx: SyncSender<Command>,
    readers: Mutex<Vec<Connection>>,
    writer: Mutex<Option<JoinHandle<()>>>,
    /// Keys the journal holds, so lookups of new keys skip the store (`None` for views
    /// that read keys from the log's index, [`SqliteStore::may_hold`]).
    keys: Option<Arc<KeyFilter>>,
    /// Dropping the sender stops the checkpointer.
    checkpointer: Mutex<Option<(mpsc::Sender<()>, JoinHandle<()>)>>,
    /// The room on the data dir's disk: the writer waits for it when a transaction
    /// finds none, and the embedded journal refuses new writes while it is short.
    space: Arc<Space>,
    /// Room granted for what checkpoints will add to the database file.
    growth: Arc<FileGrowth>,
    /// The log's index, when reads by key and by item are answered from the log (set by
    /// the embedded journal once the index is open; never for views with rows before
    /// the log, see [`rows_before_log`]).
    log: Arc<OnceLock<LogReads>>,
    /// Whether the journal table keeps its indexes by key and by item.
    indexed: bool,
    /// Each item's last state since the last snapshot (the writer's, shared): with the
    /// snapshots, every item's state, without an index on the journal by item.
    latest: Arc<Mutex<States>>,
    /// The views' check ([`check_views`]) running on a thread of its own while the
    /// journal opens the log's index: views that read keys from the log fill no key
    /// filter, so nothing reads them before [`SqliteStore::checked`] waits for it.
    check: Mutex<Check>,
    /// The reads waiting for the writer to catch up with the log (the embedded
    /// journal's), which shorten its linger.
    waiting: Arc<ReadersWaiting>,
}

/// The pages the WAL holds past the database file's end, which a checkpoint will write
/// there: room for them is granted before the transaction that adds them commits
/// ([`FileGrowth::grant_to`]), so that a checkpoint, which cannot wait (it is what gives
/// the WAL's room back), never takes the disk below its floor; it is given back as the
/// file grows ([`FileGrowth::settle`]).
struct FileGrowth {
    /// The database file.
    path: std::path::PathBuf,
    /// The room granted: the file's length at the largest committed transaction, less
    /// what the file holds on the disk.
    claim: Mutex<nrtxn_log::space::Claim>,
    /// Pages of the database at its largest transaction committed (or about to be).
    pages: std::sync::atomic::AtomicU64,
}

impl FileGrowth {
    fn new(path: &Path, space: &Arc<Space>) -> FileGrowth {
        FileGrowth {
            path: path.to_path_buf(),
            claim: Mutex::new(space.claim()),
            pages: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// Before a commit that leaves the database `pages` long: room for what its
    /// checkpoint will add to the file, or a full disk's error (the transaction is then
    /// rolled back and waits for room).
    fn grant_to(&self, pages: u64) -> std::io::Result<()> {
        use std::sync::atomic::Ordering;
        let mut claim = self
            .claim
            .lock()
            .map_err(|_| std::io::Error::other("the file growth grant is poisoned"))?;
        let pages = pages.max(self.pages.load(Ordering::Acquire));
        claim.try_grow_to((pages * PAGE_BYTES).saturating_sub(allocated(&self.path)))?;
        self.pages.store(pages, Ordering::Release);
        Ok(())
    }

    /// Gives back the room of what the file now holds (after a checkpoint or a commit).
    fn settle(&self) {
        use std::sync::atomic::Ordering;
        if let Ok(mut claim) = self.claim.lock() {
            let pages = self.pages.load(Ordering::Acquire);
            claim.shrink_to((pages * PAGE_BYTES).saturating_sub(allocated(&self.path)));
        }
    }
}

/// Bytes `path` holds on its disk: its blocks, not its length (a checkpoint may write a
/// page past others not yet written). 0 if it cannot be read.
fn allocated(path: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).map_or(0, |m| m.blocks() * 512)
}

/// A WAL checkpoint (`mode`: PASSIVE, or TRUNCATE, which also cuts the WAL to nothing
/// and waits for the writer and readers, up to the busy timeout). Its growth of the file
/// was granted before ([`FileGrowth`]), and is given back once written.
fn checkpoint(
    conn: &Connection,
    growth: &FileGrowth,
    mode: &str,
) -> Result<(i64, i64, i64), rusqlite::Error> {
    let done = conn.query_row(&format!("PRAGMA wal_checkpoint({mode})"), [], |row| {
        Ok((row.get(0)?, row.get(1)?, row.get(2)?))
    });
    growth.settle();
    done
}

/// A refusal of [`Space::room_for`] as SQLite's own word for a full disk, so that the
/// views' writer waits for room as it does for that ([`sqlite_no_room`]).
fn no_room(e: std::io::Error) -> rusqlite::Error {
    let code = if nrtxn_log::space::io_no_room(&e) {
        rusqlite::ffi::SQLITE_FULL
    } else {
        rusqlite::ffi::SQLITE_IOERR
    };
    rusqlite::Error::SqliteFailure(rusqlite::ffi::Error::new(code), Some(e.to_string()))
}

/// The views' check still running on a thread of its own, if one is.
type Check = Option<JoinHandle<Result<(), StoreError>>>;

/// The views' check ([`check_views`]) for a store opened as `role`: done now for views
/// that fill a key filter from their key index (`indexed`), begun on a thread of its own
/// for the others, which are read only once it is done ([`SqliteStore::checked`]) and
/// meanwhile the log's index opens (a read of the whole file each, seconds on a big
/// journal). Beside MongoDB the file holds only the fire-and-forget requests not yet
/// decided, whose rows carry no checksum: not checked.
fn start_check(dir: &Path, role: Role, indexed: bool) -> Result<Check, StoreError> {
    match role {
        Role::Views if indexed => check_views(dir).map(|()| None),
        Role::Views => {
            let dir = dir.to_path_buf();
            std::thread::Builder::new()
                .name("journal-views-check".into())
                .spawn(move || check_views(&dir))
                .map(Some)
                .map_err(storage)
        }
        Role::RequestStore => Ok(None),
    }
}

/// Grants room for what the WAL holds now (a start after a crash), which goes into the
/// file at the first checkpoint, like any transaction's.
fn grant_wal(conn: &Connection, space: &Space, growth: &FileGrowth) -> Result<(), StoreError> {
    let pages: i64 = conn
        .query_row("PRAGMA page_count", [], |row| row.get(0))
        .map_err(storage)?;
    space
        .retry(
            "the journal's views",
            || growth.grant_to(pages.max(0) as u64),
            nrtxn_log::space::io_no_room,
        )
        .map_err(storage)
}

/// `e`, or when it is SQLite's word for a damaged file (or rusqlite's for a value of
/// the wrong type read back: a row damaged where SQLite does not look), what to do
/// about the views' file in `dir`.
fn damage_explained(dir: &Path, e: StoreError) -> StoreError {
    const DAMAGE: [&str; 5] = [
        "malformed",
        "not a database",
        "Invalid type",
        "Invalid column type",
        "out of range",
    ];
    match e {
        StoreError::Storage(msg) if DAMAGE.iter().any(|d| msg.contains(d)) => {
            let path = dir.join("nrtxn.db");
            StoreError::Storage(format!(
                "{} is damaged ({msg}). With the embedded journal it holds only views \
                 of the log: move it and its -wal and -shm files away and start again, \
                 and they are rebuilt from the log (or, if the log's old segments were \
                 retired, restore a backup). Beside MongoDB it holds the fire-and-forget \
                 requests not yet decided: restore it from a backup",
                path.display()
            ))
        }
        other => other,
    }
}

fn storage(e: impl std::fmt::Display) -> StoreError {
    StoreError::Storage(e.to_string())
}

fn open(path: &Path, role: Role) -> Result<Connection, StoreError> {
    let conn = Connection::open(path).map_err(storage)?;
    // 4 KiB pages (SQLite's default, set explicitly; takes effect when the file is
    // created). Each commit rewrites the tail page of the journal and of each index in
    // the WAL, checksummed: with small commits (a closed loop of 64 callers commits ~20
    // entries at a time) 16 KiB pages cost 1.2x the throughput (22,900 against 28,400 and
    // 26,900 requests/s on nrtxn-bench's hot run), and with multi-row inserts large
    // batches no longer gain from them (engine bench: 289k/343k against 322k/340k).
    conn.pragma_update(None, "page_size", 4_096)
        .map_err(storage)?;
    conn.busy_timeout(std::time::Duration::from_secs(5))
        .map_err(storage)?;
    conn.pragma_update(None, "journal_mode", "WAL")
        .map_err(storage)?;
    // The request store syncs every commit: it is the record of the requests it holds.
    // The log's views (rebuilt from the log after a crash) sync only at checkpoints: in
    // WAL mode that still survives a crash whole, losing at most the last commits, which
    // the log replays.
    conn.pragma_update(None, "synchronous", role.synchronous())
        .map_err(storage)?;
    // 64 MiB of page cache (see [`CACHE_PAGES`]).
    conn.pragma_update(
        None,
        "cache_size",
        -((CACHE_PAGES * PAGE_BYTES / 1024) as i64),
    )
    .map_err(storage)?;
    conn.pragma_update(None, "journal_size_limit", WAL_KEPT_BYTES as i64)
        .map_err(storage)?;
    Ok(conn)
}

impl SqliteStore {
    /// The filter of the request keys these views hold. The embedded journal's log
    /// writer adds the keys it makes durable before their views are written, so that a
    /// key the filter does not know was never decided, whatever the views' lag.
    /// `None` when reads go to the log's index instead.
    pub(crate) fn key_filter(&self) -> Option<&Arc<KeyFilter>> {
        self.keys.as_ref()
    }

    /// The room on the data dir's disk (see [`crate::space`]).
    pub fn space(&self) -> &Arc<Space> {
        &self.space
    }

    /// Where a read that waits for these views to catch up with the log says so.
    pub(crate) fn readers_waiting(&self) -> &Arc<ReadersWaiting> {
        &self.waiting
    }

    /// Opens (or creates) `dir/nrtxn.db` as the request log's store beside a MongoDB
    /// journal ([`Role::RequestStore`]) and starts its writer thread. Every write keeps
    /// the floor of `space` (see [`crate::space`]).
    pub fn open_request_store(
        dir: &Path,
        metrics: Arc<Metrics>,
        space: Arc<Space>,
    ) -> Result<Arc<SqliteStore>, StoreError> {
        SqliteStore::open_as(dir, metrics, Role::RequestStore, space)
    }

    /// Opens `dir/nrtxn.db` as views derived from the journal's log ([`Role::Views`]):
    /// commits are not synced one by one (see [`open`]). Every write keeps the floor of
    /// `space`.
    pub fn open_views(
        dir: &Path,
        metrics: Arc<Metrics>,
        space: Arc<Space>,
    ) -> Result<Arc<SqliteStore>, StoreError> {
        SqliteStore::open_as(dir, metrics, Role::Views, space)
    }

    /// [`SqliteStore::open_inner`], with SQLite's own word for a damaged file turned
    /// into what to do about it.
    fn open_as(
        dir: &Path,
        metrics: Arc<Metrics>,
        role: Role,
        space: Arc<Space>,
    ) -> Result<Arc<SqliteStore>, StoreError> {
        SqliteStore::open_inner(dir, metrics, role, space).map_err(|e| damage_explained(dir, e))
    }

    fn open_inner(
        dir: &Path,
        metrics: Arc<Metrics>,
        role: Role,
        space: Arc<Space>,
    ) -> Result<Arc<SqliteStore>, StoreError> {
        std::fs::create_dir_all(dir).map_err(storage)?;
        let path = dir.join("nrtxn.db");
        let conn = open(&path, role)?;
        prepare_schema(&conn).map_err(storage)?;
        let indexed = role == Role::Views && rows_before_log(&conn).map_err(storage)?;
        journal_indexes(&conn, indexed).map_err(storage)?;
        let check = start_check(dir, role, indexed)?;
        // SQLite's automatic checkpoint runs inside a commit, on the writer's thread, and
        // stalls every batch behind it for as long as it copies the WAL (seen: p99 of
        // the HTTP benchmark from 8 ms to 94 ms). A thread of its own checkpoints
        // instead, in PASSIVE mode, which never blocks the writer.
        conn.pragma_update(None, "wal_autocheckpoint", 0)
            .map_err(storage)?;
        let growth = Arc::new(FileGrowth::new(&path, &space));
        grant_wal(&conn, &space, &growth)?;
        let checkpointer = start_checkpointer(open(&path, role)?, &space, &growth)?;
        // Views that read keys from the log's index need no filter of their own
        // ([`SqliteStore::may_hold`]): its 16 MiB are neither made nor filled.
        let keys = if role != Role::Views || indexed {
            let keys = Arc::new(KeyFilter::new());
            load_keys(&conn, &keys).map_err(storage)?;
            Some(keys)
        } else {
            None
        };
        let (tx, rx) = mpsc::sync_channel(COMMAND_QUEUE_MAX);
        let room = Room {
            space: space.clone(),
            growth: growth.clone(),
            wal_path: dir.join("nrtxn.db-wal"),
        };
        let log = Arc::new(OnceLock::new());
        let waiting = Arc::new(ReadersWaiting::default());
        let linger = role.linger(waiting.clone());
        let mut writer = Writer::new(conn, &metrics, role, keys.clone(), linger, room);
        writer.log = log.clone();
        writer.rowless = role == Role::Views && !indexed && !nrtxn_log::faults::views_rows();
        writer.log_dir = records::log_dir(dir);
        let latest = writer.dirty.clone();
        let writer = writer.start(rx)?;
        Ok(Arc::new(SqliteStore {
            log_dir: records::log_dir(dir),
            path,
            role,
            tx,
            readers: Mutex::new(Vec::new()),
            writer: Mutex::new(Some(writer)),
            keys,
            checkpointer: Mutex::new(Some(checkpointer)),
            space,
            growth,
            log,
            indexed,
            latest,
            check: Mutex::new(check),
            waiting,
        }))
    }

    /// Waits for the views' check begun at the opening, if one is still running: what
    /// the journal calls before it reads the views.
    pub(crate) fn checked(&self) -> Result<(), StoreError> {
        let check = self.check.lock().map_err(|_| StoreError::Closed)?.take();
        match check.map(JoinHandle::join) {
            None => Ok(()),
            Some(Ok(result)) => result
                .map_err(|e| damage_explained(self.path.parent().unwrap_or(Path::new(".")), e)),
            Some(Err(_)) => Err(StoreError::Storage(
                "the check of the journal's views panicked".into(),
            )),
        }
    }

    /// Whether reads by key and by item may be answered from the log's index: views
    /// with no rows from before the log ([`rows_before_log`]).
    pub(crate) fn reads_from_log(&self) -> bool {
        self.role == Role::Views && !self.indexed
    }

    /// From now on, reads by key and by item are answered from the log's index.
    pub(crate) fn read_from_log(&self, reads: LogReads) {
        assert!(
            self.reads_from_log(),
            "views with rows before the log answer their reads themselves"
        );
        if self.log.set(reads).is_err() {
            panic!("the views were given the log's index twice");
        }
    }

    /// False: no entry under this key was ever made durable. The log's index knows it
    /// when reads go to the log (its segments' filters and its tail's keys, which the
    /// log's writer fills before anyone is answered); otherwise the key filter, filled
    /// from the views' rows at start and by the log's writer since.
    pub(crate) fn may_hold(&self, shop: &str, key: &str) -> bool {
        match self.log.get() {
            Some(log) => log.index.may_contain(shop, key),
            None => self.keys.as_ref().is_none_or(|k| k.may_contain(shop, key)),
        }
    }

    /// Whether any of `keys` may have an outcome, as [`SqliteStore::may_hold`] for each,
    /// the log's index asked under one read of its lock; none of no keys.
    pub(crate) fn may_hold_any(&self, shop: &str, keys: &[&str]) -> bool {
        match self.log.get() {
            Some(log) => log.index.may_contain_any(shop, keys),
            None => keys.iter().any(|k| self.may_hold(shop, k)),
        }
    }

    fn latest(&self) -> MutexGuard<'_, States> {
        lock_states(&self.latest)
    }

    /// Makes fire-and-forget requests durable, then calls `done`.
    pub fn accept(&self, reqs: Vec<Request>, done: AcceptDone) {
        self.accept_marked(reqs, done, None)
    }

    /// Like [`SqliteStore::accept`], recording in the same transaction that the views
    /// stand at `mark` in the journal's log.
    pub fn accept_marked(&self, reqs: Vec<Request>, done: AcceptDone, mark: Option<Chain>) {
        if let Err(mpsc::SendError(Command::Accept(_, done, _))) =
            self.tx.send(Command::Accept(reqs, done, mark))
        {
            done(Err(StoreError::Closed));
        }
    }

    /// Writes the entries of a record of the journal's log (in one transaction, then
    /// calls `done`), recording in the same transaction that the views stand at `mark`
    /// in the log; `at` is where the record is.
    pub fn append_marked(
        &self,
        entries: Vec<Entry>,
        done: AppendDone,
        mark: Option<Chain>,
        at: Option<RecordAt>,
    ) {
        if let Err(mpsc::SendError(Command::Append(entries, done, ..))) =
            self.tx.send(Command::Append(entries, done, mark, at))
        {
            done(entries, Err(StoreError::Closed));
        }
    }

    /// Deletes up to `max` entries decided before `before_ms` (ms since the epoch) that
    /// the last item snapshot covers (and the outbox relay has published); returns how
    /// many went. Their keys are then forgotten: see `docs/decisions/journal-log.md`.
    /// The ok sales among them decided at or after `returnable_from_ms` are kept (in
    /// `sales`) for returns, and sales and return counts decided before it go.
    pub fn prune(
        &self,
        before_ms: i64,
        max: usize,
        returnable_from_ms: i64,
    ) -> Result<usize, StoreError> {
        let (ack, done) = mpsc::channel();
        self.tx
            .send(Command::Prune(before_ms, max, returnable_from_ms, ack))
            .map_err(|_| StoreError::Closed)?;
        done.recv().map_err(|_| StoreError::Closed)?
    }

    /// The log mark that is on disk for good: read, then a checkpoint that copies the
    /// whole WAL into the database file and syncs it. `None` when the checkpoint could
    /// not finish (readers held frames) or the views have no mark.
    pub fn durable_mark(&self) -> Result<Option<Chain>, StoreError> {
        let mark = self.log_mark()?;
        let complete = self.read(|conn| {
            checkpoint(conn, &self.growth, "PASSIVE")
                .map(|(busy, log, done)| busy == 0 && log == done)
        })?;
        Ok(mark.filter(|_| complete))
    }

    /// When the oldest entry still in the views' journal was decided (ms; `None`: none
    /// is). The prune takes entries oldest first, so every entry decided before this one
    /// was pruned (and its sale, if still returnable, kept in `sales`).
    pub fn oldest_entry_at(&self) -> Result<Option<i64>, StoreError> {
        self.read(|conn| {
            let row: Option<i64> = conn
                .query_row(
                    "SELECT completed_at FROM journal ORDER BY id LIMIT 1",
                    [],
                    |r| r.get(0),
                )
                .optional()?;
            // Rows of `journal` are older than every record's (ids go on after them).
            Ok(match row {
                Some(at) => Some(at),
                None => records::oldest_decided(conn)?,
            })
        })
    }

    /// Where in the journal's log the views stand: the chain after the last record they
    /// hold (`None`: they hold none, or were written before the log existed).
    pub fn log_mark(&self) -> Result<Option<Chain>, StoreError> {
        self.read(read_log_mark)
    }

    /// Forgets fire-and-forget requests whose outcomes another journal holds. Not
    /// durable by itself: a crash before it leaves them to be found decided at start.
    pub fn retire(&self, shop: Arc<str>, keys: Vec<Arc<str>>) {
        let _ = self.tx.send(Command::Retire(shop, keys));
    }

    /// Requests accepted durably and not yet decided, in acceptance order.
    pub fn pending(&self) -> Result<Vec<Request>, StoreError> {
        self.read(|conn| {
            let mut stmt = conn.prepare_cached("SELECT body FROM requests ORDER BY id")?;
            let rows = stmt.query_map([], |row| row.get::<_, String>(0))?;
            let mut out = Vec::new();
            for body in rows {
                let body = body?;
                match serde_json::from_str::<Request>(&body) {
                    Ok(mut r) => {
                        r.logged = true;
                        out.push(r);
                    }
                    Err(e) => {
                        return Err(rusqlite::Error::ToSqlConversionFailure(Box::new(e)));
                    }
                }
            }
            Ok(out)
        })
    }

    fn read<T>(
        &self,
        f: impl FnOnce(&Connection) -> Result<T, rusqlite::Error>,
    ) -> Result<T, StoreError> {
        let conn = self.readers.lock().map_err(storage)?.pop();
        let conn = match conn {
            Some(c) => c,
            None => open(&self.path, self.role)?,
        };
        let result = f(&conn).map_err(storage);
        if let Ok(mut pool) = self.readers.lock() {
            if pool.len() < READERS_MAX {
                pool.push(conn);
            }
        }
        result
    }
}

/// Brings a journal made by an earlier version up to the schema: columns added since are
/// added (empty for the rows before).
fn migrate(conn: &Connection) -> Result<(), rusqlite::Error> {
    let mut stmt = conn.prepare("SELECT name FROM pragma_table_info('journal')")?;
    let columns: Vec<String> = stmt
        .query_map([], |row| row.get(0))?
        .collect::<Result<_, _>>()?;
    if columns.is_empty() {
        return Ok(()); // a new file: the schema creates it whole
    }
    for (column, kind) in [
        ("hold_id", "TEXT"),
        ("expires_at", "INTEGER"),
        ("ttl_ms", "INTEGER"),
        ("qty_asked", "INTEGER"),
        ("opens_at", "INTEGER"),
        ("closes_at", "INTEGER"),
        ("low_stock_at", "INTEGER"),
    ] {
        if !columns.iter().any(|c| c == column) {
            conn.execute_batch(&format!("ALTER TABLE journal ADD COLUMN {column} {kind}"))?;
        }
    }
    Ok(())
}

/// Brings the file up to the schema: the tables and indexes made if missing, and the
/// columns added since an earlier version made it.
fn prepare_schema(conn: &Connection) -> Result<(), rusqlite::Error> {
    migrate(conn)?;
    conn.execute_batch(SCHEMA)?;
    conn.execute_batch(records::SCHEMA)?;
    // Views made before rows had checksums: their rows get one when next written, and
    // are trusted until then.
    add_column_if_missing(conn, "items", "checksum")?;
    add_column_if_missing(conn, "journal", "rowsum")?;
    // An item's sale window (NULL: no bound), in its snapshot as in its state.
    add_column_if_missing(conn, "items", "opens_at")?;
    add_column_if_missing(conn, "items", "closes_at")?;
    // An item's low-stock level (NULL: none), the same way.
    add_column_if_missing(conn, "items", "low_stock_at")?;
    // A pending hold's buyer counts against an item's per-buyer limit until it ends.
    add_typed_column_if_missing(conn, "holds", "buyer", "TEXT")
}

/// The journal's indexes by key and by item, made only for views that hold rows the
/// log does not (`indexed`, see [`rows_before_log`]); otherwise those reads go to the
/// log's index and the views' indexes are dropped, so a decision costs the views an
/// append, not three B-tree inserts (`docs/decisions/derived-views.md`).
fn journal_indexes(conn: &Connection, indexed: bool) -> Result<(), rusqlite::Error> {
    conn.execute_batch(if indexed {
        "CREATE UNIQUE INDEX IF NOT EXISTS journal_request_key ON journal (shop, request_key)
            WHERE request_key IS NOT NULL;
         CREATE INDEX IF NOT EXISTS journal_item_seq ON journal (shop, item, seq)
            WHERE seq IS NOT NULL;"
    } else {
        "DROP INDEX IF EXISTS journal_request_key;
         DROP INDEX IF EXISTS journal_item_seq;"
    })
}

/// Whether these views may hold journal rows the log does not: rows written by the
/// SQLite journal before the log existed (a data dir taken over as it is), or by a
/// version that kept no word of where its rows came from (views found with rows when
/// this was first asked). Such views keep their indexes by key and by item and answer
/// those reads themselves, since the log's index may lack the rows. The answer is kept
/// in `meta` (`rows_before_log`); once yes, for good.
fn rows_before_log(conn: &Connection) -> Result<bool, rusqlite::Error> {
    let said: Option<i64> = conn
        .query_row(
            "SELECT value FROM meta WHERE key = 'rows_before_log'",
            [],
            |r| r.get(0),
        )
        .optional()?;
    let rows: bool = conn.query_row("SELECT EXISTS (SELECT 1 FROM journal)", [], |r| r.get(0))?;
    let before = match said {
        Some(v) => v != 0 || (rows && read_log_mark(conn)?.is_none()),
        None => rows,
    };
    if said != Some(i64::from(before)) {
        conn.execute(
            "INSERT OR REPLACE INTO meta (key, value) VALUES ('rows_before_log', ?1)",
            params![i64::from(before)],
        )?;
    }
    Ok(before)
}

/// Starts the thread that checkpoints the WAL every [`CHECKPOINT_EVERY`] on `conn`, off
/// the writer's thread; dropping the returned sender stops it.
fn start_checkpointer(
    conn: Connection,
    space: &Arc<Space>,
    growth: &Arc<FileGrowth>,
) -> Result<(mpsc::Sender<()>, JoinHandle<()>), StoreError> {
    let (space, growth) = (space.clone(), growth.clone());
    let (stop_tx, stop_rx) = mpsc::channel::<()>();
    let handle = std::thread::Builder::new()
        .name("journal-checkpoint".into())
        .spawn(move || {
            while let Err(mpsc::RecvTimeoutError::Timeout) = stop_rx.recv_timeout(CHECKPOINT_EVERY)
            {
                // When room is short the WAL is also cut to nothing, which PASSIVE never
                // does: its file keeps its size until a transaction starts it over, and
                // the views' writer may be waiting for that very room.
                let mode = if space.short() { "TRUNCATE" } else { "PASSIVE" };
                if let Err(e) = checkpoint(&conn, &growth, mode) {
                    tracing::warn!(error = %e, mode, "WAL checkpoint failed; retrying");
                }
            }
        })
        .map_err(storage)?;
    Ok((stop_tx, handle))
}

/// Journal rows per multi-row `INSERT` (20 parameters each, far below SQLite's limit of
/// 32,766 per statement).
const ROWS_PER_INSERT: usize = 32;
/// The columns [`bind_entry`] binds, in its order.
const JOURNAL_COLUMNS: [&str; 25] = [
    "shop",
    "item",
    "seq",
    "prev_seq",
    "request_key",
    "op",
    "qty",
    "status",
    "reason",
    "stock_before",
    "stock_after",
    "reserved_after",
    "submitted_at",
    "completed_at",
    "seller",
    "buyer",
    "remarks",
    "hold_id",
    "expires_at",
    "ttl_ms",
    "rowsum",
    "qty_asked",
    "opens_at",
    "closes_at",
    "low_stock_at",
];

/// `INSERT OR FAIL INTO journal (...) VALUES (...), ...` with `rows` rows of parameters.
///
/// `OR FAIL`, not the default `ABORT`: a statement that may abort halfway through its
/// rows and indexes makes SQLite copy every page it touches first into a statement
/// journal, to undo just that statement. Here any failed statement fails the whole
/// transaction (see `Writer::run`), so that copy bought nothing, and it was about a fifth
/// of the views writer's CPU (`subjournalPage`, 4.6% of the server's samples on
/// hot-sales).
fn journal_insert(rows: usize) -> String {
    let row = format!("({})", vec!["?"; JOURNAL_COLUMNS.len()].join(","));
    format!(
        "INSERT OR FAIL INTO journal ({}) VALUES {}",
        JOURNAL_COLUMNS.join(", "),
        vec![row; rows].join(",")
    )
}

/// Binds `e` as row `row` (from 0) of a [`journal_insert`] statement.
fn bind_entry(
    stmt: &mut rusqlite::Statement<'_>,
    row: usize,
    e: &Entry,
) -> Result<(), rusqlite::Error> {
    let at = row * JOURNAL_COLUMNS.len();
    stmt.raw_bind_parameter(at + 1, &*e.shop)?;
    stmt.raw_bind_parameter(at + 2, &*e.item)?;
    stmt.raw_bind_parameter(at + 3, e.seq)?;
    stmt.raw_bind_parameter(at + 4, e.prev_seq)?;
    stmt.raw_bind_parameter(at + 5, e.request_key.as_deref())?;
    stmt.raw_bind_parameter(at + 6, e.op.as_str())?;
    stmt.raw_bind_parameter(at + 7, e.qty)?;
    stmt.raw_bind_parameter(at + 8, e.status.as_str())?;
    stmt.raw_bind_parameter(at + 9, e.reason.as_deref())?;
    stmt.raw_bind_parameter(at + 10, e.stock_before)?;
    stmt.raw_bind_parameter(at + 11, e.stock_after)?;
    stmt.raw_bind_parameter(at + 12, e.reserved_after)?;
    stmt.raw_bind_parameter(at + 13, e.submitted_at)?;
    stmt.raw_bind_parameter(at + 14, e.completed_at)?;
    stmt.raw_bind_parameter(at + 15, e.seller.as_deref())?;
    stmt.raw_bind_parameter(at + 16, e.buyer.as_deref())?;
    stmt.raw_bind_parameter(at + 17, e.remarks.as_deref())?;
    stmt.raw_bind_parameter(at + 18, e.hold_id.as_deref())?;
    stmt.raw_bind_parameter(at + 19, e.expires_at)?;
    stmt.raw_bind_parameter(at + 20, e.ttl_ms)?;
    stmt.raw_bind_parameter(
        at + 21,
        row_checksum(&RowFields {
            shop: &e.shop,
            item: &e.item,
            request_key: e.request_key.as_deref(),
            op: e.op.as_str(),
            qty: e.qty,
            status: e.status.as_str(),
            stock_before: e.stock_before,
            stock_after: e.stock_after,
            reserved_after: e.reserved_after,
            seq: e.seq.map(|s| s as i64),
            prev_seq: e.prev_seq.map(|s| s as i64),
            later: [e.qty_asked, e.opens_at, e.closes_at],
            low_stock_at: e.low_stock_at,
        }),
    )?;
    stmt.raw_bind_parameter(at + 22, e.qty_asked)?;
    stmt.raw_bind_parameter(at + 23, e.opens_at)?;
    stmt.raw_bind_parameter(at + 24, e.closes_at)?;
    stmt.raw_bind_parameter(at + 25, e.low_stock_at)?;
    Ok(())
}

/// The fields of a views journal row that its checksum covers: the decision.
struct RowFields<'a> {
    shop: &'a str,
    item: &'a str,
    request_key: Option<&'a str>,
    op: &'a str,
    qty: i64,
    status: &'a str,
    stock_before: Option<i64>,
    stock_after: Option<i64>,
    reserved_after: Option<i64>,
    seq: Option<i64>,
    prev_seq: Option<i64>,
    /// A partial fill's asked `qty` and the item's window bounds: covered when a row
    /// has any of them (rows without keep the sums they were written with).
    later: [Option<i64>; 3],
    /// The item's low-stock level: covered when the row has one.
    low_stock_at: Option<i64>,
}

/// xxh3-64 of a row's decision fields, as a signed integer: one hash of their bytes
/// laid end to end (as many streamed updates of them would give, at a fraction of the
/// cost for rows this small).
fn row_checksum(f: &RowFields<'_>) -> i64 {
    let mut b = Vec::with_capacity(160);
    for text in [
        Some(f.shop),
        Some(f.item),
        f.request_key,
        Some(f.op),
        Some(f.status),
    ] {
        match text {
            Some(t) => {
                b.push(1);
                b.extend_from_slice(&(t.len() as u64).to_le_bytes());
                b.extend_from_slice(t.as_bytes());
            }
            None => b.push(0),
        }
    }
    for n in [
        Some(f.qty),
        f.stock_before,
        f.stock_after,
        f.reserved_after,
        f.seq,
        f.prev_seq,
    ] {
        match n {
            Some(n) => {
                b.push(1);
                b.extend_from_slice(&n.to_le_bytes());
            }
            None => b.push(0),
        }
    }
    if f.later.iter().any(Option::is_some) {
        for n in f.later {
            b.extend_from_slice(&n.unwrap_or(i64::MIN).to_le_bytes());
        }
    }
    if let Some(n) = f.low_stock_at {
        b.extend_from_slice(b"low");
        b.extend_from_slice(&n.to_le_bytes());
    }
    xxhash_rust::xxh3::xxh3_64(&b) as i64
}

/// Checks a row read back against its checksum (rows written before checksums have
/// none); a damaged one is an error that says what to do.
fn check_row(f: &RowFields<'_>, sum: Option<i64>) -> Result<(), rusqlite::Error> {
    match sum {
        Some(sum) if sum != row_checksum(f) => Err(rusqlite::Error::ToSqlConversionFailure(
            format!(
                "the views (nrtxn.db) are damaged: the entry of item {:?} of shop {:?} at seq \
                 {:?} (key {:?}) does not match its checksum. Stop nrtxn, move nrtxn.db and \
                 its -wal and -shm files away and start again: the views are rebuilt from the \
                 log (or, if its old segments were retired, restore a backup)",
                f.item, f.shop, f.seq, f.request_key
            )
            .into(),
        )),
        _ => Ok(()),
    }
}

/// An op or status read back that is none of the known ones: the row is damaged.
fn unknown(what: &str, value: &str) -> rusqlite::Error {
    rusqlite::Error::ToSqlConversionFailure(
        format!("the views (nrtxn.db) are damaged: an entry has the unknown {what} {value:?}")
            .into(),
    )
}

/// A row's [`Entry::taken`], from its op, status and `qty` columns.
fn taken(op: &str, status: &str, qty: i64) -> Option<i64> {
    (op == Op::Decrement.as_str() || op == Op::Hold.as_str()).then_some(
        if status == Status::Ok.as_str() {
            qty
        } else {
            0
        },
    )
}

/// Most journal ids one [`Outbox::relay_read_kinds`] looks through.
const KINDS_SCAN_MAX: i64 = 200_000;

/// The columns [`event_row`] reads, in its order (a query may add its own after them).
const EVENT_COLUMNS: &str = "shop, item, seq, prev_seq, op, status, request_key, qty, \
    stock_after, reserved_after, completed_at, hold_id, stock_before, rowsum, reason, seller, \
    buyer, submitted_at, qty_asked, opens_at, closes_at, low_stock_at";

fn event_row(row: &rusqlite::Row<'_>) -> Result<Event, rusqlite::Error> {
    let op: String = row.get(4)?;
    let status: String = row.get(5)?;
    let (shop, item): (String, String) = (row.get(0)?, row.get(1)?);
    let request_key: Option<String> = row.get(6)?;
    let (seq, prev_seq): (i64, i64) = (row.get(2)?, row.get(3)?);
    let (qty, stock_after): (i64, i64) = (row.get(7)?, row.get(8)?);
    let reserved_after: i64 = row.get(9)?;
    let hold_id: Option<String> = row.get(11)?;
    check_row(
        &RowFields {
            shop: &shop,
            item: &item,
            request_key: request_key.as_deref(),
            op: &op,
            qty,
            status: &status,
            stock_before: row.get(12)?,
            stock_after: Some(stock_after),
            reserved_after: Some(reserved_after),
            seq: Some(seq),
            prev_seq: Some(prev_seq),
            later: [row.get(18)?, row.get(19)?, row.get(20)?],
            low_stock_at: row.get(21)?,
        },
        row.get(13)?,
    )?;
    let order_id = nrtxn_actors::order_id_of(&item, hold_id.as_deref(), request_key.as_deref());
    let transfer_id = hold_id
        .as_deref()
        .or(request_key.as_deref())
        .and_then(nrtxn_actors::transfer_of)
        .map(Into::into);
    Ok(Event {
        shop: shop.into(),
        item: item.into(),
        seq: seq as u64,
        prev_seq: prev_seq as u64,
        kind: Op::parse(&op).ok_or_else(|| unknown("op", &op))?,
        status: Status::parse(&status).ok_or_else(|| unknown("status", &status))?,
        request_key: request_key.map(Into::into),
        qty: row.get::<_, Option<i64>>(18)?.unwrap_or(qty),
        qty_taken: taken(&op, &status, qty),
        stock_after,
        reserved_after,
        at: row.get(10)?,
        order_id,
        transfer_id,
        hold_id: hold_id.map(Into::into),
        reason: row
            .get::<_, Option<String>>(14)?
            .filter(|_| op == Op::Adjust.as_str()),
        seller: row.get::<_, Option<String>>(15)?.map(Into::into),
        buyer: row.get::<_, Option<String>>(16)?.map(Into::into),
        requested_at: row.get(17)?,
        opens_at: row.get(19)?,
        closes_at: row.get(20)?,
        low_stock_at: row.get(21)?,
    })
}

/// The page of at most `limit` of `holds` (read one past the limit, to tell if more
/// follow).
fn page_of(mut holds: Vec<HoldView>, limit: usize) -> HoldPage {
    let more = holds.len() > limit;
    holds.truncate(limit);
    HoldPage { holds, more }
}

fn hold_view(row: &rusqlite::Row<'_>) -> Result<HoldView, rusqlite::Error> {
    let status: String = row.get(5)?;
    Ok(HoldView {
        shop: row.get::<_, String>(0)?.into(),
        hold_id: row.get::<_, String>(1)?.into(),
        item: row.get::<_, String>(2)?.into(),
        qty: row.get(3)?,
        expires_at: row.get(4)?,
        status: HoldStatus::parse(&status).unwrap_or(HoldStatus::Held),
        seq: row.get(6)?,
        buyer: row.get::<_, Option<String>>(7)?.map(Into::into),
    })
}

/// The log mark the views' `meta` holds (see [`SqliteStore::log_mark`]), read on `conn`.
pub fn read_log_mark(conn: &Connection) -> Result<Option<Chain>, rusqlite::Error> {
    let get = |key: &str| -> Result<Option<i64>, rusqlite::Error> {
        conn.query_row("SELECT value FROM meta WHERE key = ?1", [key], |r| r.get(0))
            .optional()
    };
    let Some(next) = get("log_next_lsn")? else {
        return Ok(None);
    };
    let hi = get("log_parent_hi")?.unwrap_or(0) as u64;
    let lo = get("log_parent_lo")?.unwrap_or(0) as u64;
    Ok(Some(Chain {
        next_lsn: next as u64,
        parent: (u128::from(hi) << 64) | u128::from(lo),
        epoch: get("log_epoch")?.unwrap_or(0) as u64,
    }))
}

/// Wake-ups of the views' writer while it lingers: it looks at its queue (and at the
/// reads waiting for it) this often rather than waking for every group the log hands
/// it, so its wake-ups follow the clock, not the load.
const LINGER_SLICE: Duration = Duration::from_millis(4);

/// The views' next transaction: the first command, then whatever comes within the
/// linger (the shorter one while a read waits), looked at every [`LINGER_SLICE`], ended
/// early by a command someone waits for (weight 0) or by `max` entries.
fn gather_by_time(rx: &Receiver<Command>, max: usize, linger: &Linger) -> Option<Vec<Command>> {
    let first = rx.recv().ok()?;
    let started = Instant::now();
    let mut total = first.weight();
    let mut urgent = total == 0;
    let mut cmds = vec![first];
    loop {
        loop {
            match rx.try_recv() {
                Ok(c) => {
                    let w = c.weight();
                    urgent |= w == 0;
                    total += w;
                    cmds.push(c);
                    if total >= max {
                        return Some(cmds);
                    }
                }
                Err(TryRecvError::Disconnected) => return Some(cmds),
                Err(TryRecvError::Empty) => break,
            }
        }
        let lingered = if linger.waiting.any() {
            linger.read
        } else {
            linger.alone
        };
        let left = (started + lingered).saturating_duration_since(Instant::now());
        if urgent || left.is_zero() {
            return Some(cmds);
        }
        std::thread::sleep(left.min(LINGER_SLICE));
    }
}

/// Item states by shop and item.
type States = HashMap<(Arc<str>, Arc<str>), ItemState>;

/// The lock on item states shared by the views' writer and readers; held for memory
/// work only. A writer that panicked while holding it left a map of states it had
/// finished writing: still good to read.
fn lock_states(states: &Mutex<States>) -> MutexGuard<'_, States> {
    states
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The last state of every item with entries after the last snapshot: the `journal`
/// rows', then the records' of the log in `log_dir` ([`crate::records`]).
fn tail_states(conn: &Connection, log_dir: &Path) -> Result<States, rusqlite::Error> {
    let upto = snapshot_journal_id(conn)?;
    let mut stmt = conn.prepare(
        "SELECT shop, item, stock_after, COALESCE(reserved_after, 0), seq, opens_at, closes_at,
                low_stock_at
         FROM journal WHERE id > ?1 AND seq IS NOT NULL ORDER BY id",
    )?;
    let mut rows = stmt.query([upto])?;
    let mut out = HashMap::new();
    while let Some(row) = rows.next()? {
        out.insert(
            (
                Arc::<str>::from(row.get::<_, String>(0)?),
                Arc::<str>::from(row.get::<_, String>(1)?),
            ),
            state_at(row, 2)?,
        );
    }
    LogRecords::new(log_dir).each(conn, (upto, i64::MAX), ALL_OPS, |_, e| {
        if let Some(state) = e.state_after() {
            out.insert((e.shop, e.item), state);
        }
        Ok(true)
    })?;
    Ok(out)
}

/// An item's state from a row's columns `first` (stock), `first + 1` (reserved),
/// `first + 2` (seq), `first + 3` and `first + 4` (the window's bounds, 0 or NULL when
/// unset) and `first + 5` (the low-stock level, the same way).
fn state_at(row: &rusqlite::Row, first: usize) -> Result<ItemState, rusqlite::Error> {
    Ok(ItemState {
        stock: row.get(first)?,
        reserved: row.get(first + 1)?,
        seq: row.get(first + 2)?,
        opens_at: row.get::<_, Option<i64>>(first + 3)?.unwrap_or(0),
        closes_at: row.get::<_, Option<i64>>(first + 4)?.unwrap_or(0),
        low_stock_at: row.get::<_, Option<i64>>(first + 5)?.unwrap_or(0),
    })
}

/// At most this many of SQLite's integrity problems are read and reported.
const INTEGRITY_PROBLEMS_MAX: usize = 20;

/// SQLite's `integrity_check` of the open file: the problems it reports, none when the
/// file is sound. Besides the pages' structure it compares every index with its table,
/// which is what keeps a lookup by key honest: our row checksums cover a row, not the
/// index entries that lead to it.
fn integrity_problems(conn: &Connection) -> Result<Vec<String>, rusqlite::Error> {
    let mut stmt = conn.prepare(&format!("PRAGMA integrity_check({INTEGRITY_PROBLEMS_MAX})"))?;
    let lines = stmt
        .query_map([], |r| r.get::<_, String>(0))?
        .collect::<Result<Vec<_>, _>>()?;
    Ok(if lines.len() == 1 && lines[0] == "ok" {
        Vec::new()
    } else {
        lines
    })
}

/// Rows of the journal and item snapshots whose checksums do not match, read by
/// scanning the tables themselves (never an index): how many, and the first one's
/// description.
fn damaged_rows(conn: &Connection) -> Result<(u64, Option<String>), rusqlite::Error> {
    let (mut n, mut first) = (0u64, None);
    let mut note = |e: rusqlite::Error| {
        n += 1;
        first.get_or_insert_with(|| e.to_string());
    };
    let mut stmt = conn.prepare(
        "SELECT shop, item, request_key, op, qty, status, stock_before, stock_after, \
         reserved_after, seq, prev_seq, rowsum, qty_asked, opens_at, closes_at, low_stock_at \
         FROM journal NOT INDEXED",
    )?;
    let mut rows = stmt.query([])?;
    while let Some(row) = rows.next()? {
        let fields = RowFields {
            shop: row.get_ref(0)?.as_str()?,
            item: row.get_ref(1)?.as_str()?,
            request_key: row.get_ref(2)?.as_str_or_null()?,
            op: row.get_ref(3)?.as_str()?,
            qty: row.get(4)?,
            status: row.get_ref(5)?.as_str()?,
            stock_before: row.get(6)?,
            stock_after: row.get(7)?,
            reserved_after: row.get(8)?,
            seq: row.get(9)?,
            prev_seq: row.get(10)?,
            later: [row.get(12)?, row.get(13)?, row.get(14)?],
            low_stock_at: row.get(15)?,
        };
        if let Err(e) = check_row(&fields, row.get(11)?) {
            note(e);
        }
    }
    let mut stmt = conn.prepare(
        "SELECT shop, item, stock, reserved, seq, opens_at, closes_at, low_stock_at, checksum
         FROM items",
    )?;
    let mut rows = stmt.query([])?;
    while let Some(row) = rows.next()? {
        let state = state_at(row, 2)?;
        let (shop, item) = (row.get_ref(0)?.as_str()?, row.get_ref(1)?.as_str()?);
        if let Err(e) = checked_snapshot(shop, item, state, row.get(8)?) {
            note(e);
        }
    }
    let (records_damaged, first_record) = records::damaged_rows(conn)?;
    if let Some(what) = first_record {
        first.get_or_insert(what);
    }
    Ok((n + records_damaged, first))
}

/// Checks the views' file (`dir/nrtxn.db`, if there is one) before they are opened for
/// use, on a connection of its own. A byte flipped in an index entry leaves the row
/// intact and unreachable by its key: the key would poll `404` and a resubmission of it
/// would be applied again. So an index that does not match its table is rebuilt from
/// the table (`REINDEX`), but only when every row still matches its checksum (a row
/// whose key was damaged would be indexed under the wrong key); otherwise the start is
/// refused, with what to do. Costs a read of the whole file: 6.25 s for 2,438,000
/// entries (docs/reliability.md).
pub(crate) fn check_views(dir: &Path) -> Result<(), StoreError> {
    let path = dir.join("nrtxn.db");
    if !path.exists() {
        return Ok(());
    }
    let started = Instant::now();
    let conn = open(&path, Role::Views)?;
    let problems = integrity_problems(&conn).map_err(storage)?;
    if problems.is_empty() {
        tracing::info!(
            ms = started.elapsed().as_millis() as u64,
            "views checked (SQLite integrity_check)"
        );
        return Ok(());
    }
    tracing::warn!(
        problems = %problems.join("; "),
        "the views (nrtxn.db) fail SQLite's integrity check; checking every row against its checksum"
    );
    let refuse = |what: String| {
        StoreError::Storage(format!(
            "{} is damaged: {what}. With the embedded journal it holds only views of the \
             log: move it and its -wal and -shm files away and start again, and they are \
             rebuilt from the log (or, if the log's old segments were retired, restore a \
             backup)",
            path.display()
        ))
    };
    let (bad, first) = damaged_rows(&conn).map_err(storage)?;
    if bad > 0 {
        return Err(refuse(format!(
            "{bad} row(s) do not match their checksums (the first: {}), and SQLite's \
             integrity check finds: {}",
            first.unwrap_or_default(),
            problems.join("; ")
        )));
    }
    conn.execute_batch("REINDEX").map_err(storage)?;
    let after = integrity_problems(&conn).map_err(storage)?;
    if !after.is_empty() {
        return Err(refuse(format!(
            "SQLite's integrity check still finds, after its indexes were rebuilt: {}",
            after.join("; ")
        )));
    }
    tracing::warn!(
        ms = started.elapsed().as_millis() as u64,
        problems = %problems.join("; "),
        "the views' indexes did not match their tables and were rebuilt from them (every row matches its checksum)"
    );
    Ok(())
}

/// An item's per-buyer ledger, by shop and item.
type ItemLedger = (Arc<str>, Arc<str>, BuyerLedger);

/// The per-buyer limits and units of every limited item, or of one.
fn read_ledgers(
    conn: &Connection,
    only: Option<(&str, &str)>,
) -> Result<Vec<ItemLedger>, rusqlite::Error> {
    let (shop, item) = only.unwrap_or(("", ""));
    let all = only.is_none();
    let mut limits = conn.prepare_cached(
        "SELECT shop, item, per_buyer_max FROM buyer_limits
         WHERE ?1 OR (shop = ?2 AND item = ?3)",
    )?;
    let mut out: Vec<ItemLedger> = limits
        .query_map(params![all, shop, item], |r| {
            Ok((
                Arc::<str>::from(r.get::<_, String>(0)?),
                Arc::<str>::from(r.get::<_, String>(1)?),
                BuyerLedger::new(r.get(2)?),
            ))
        })?
        .collect::<Result<_, _>>()?;
    let mut units =
        conn.prepare_cached("SELECT buyer, units FROM buyer_units WHERE shop = ?1 AND item = ?2")?;
    for (shop, item, ledger) in &mut out {
        let rows = units.query_map(params![&**shop, &**item], |r| {
            Ok((
                Arc::<str>::from(r.get::<_, String>(0)?),
                r.get::<_, i64>(1)?,
            ))
        })?;
        for row in rows {
            let (buyer, n) = row?;
            ledger.units.insert(buyer, n);
        }
    }
    Ok(out)
}

/// The views writer's statements that keep `buyer_limits` and `buyer_units` from the
/// entries (the rules of [`nrtxn_actors::ledger`]).
struct LedgerStatements<'t> {
    set_limit: rusqlite::CachedStatement<'t>,
    lift_limit: rusqlite::CachedStatement<'t>,
    forget_units: rusqlite::CachedStatement<'t>,
    add_units: rusqlite::CachedStatement<'t>,
    drop_empty: rusqlite::CachedStatement<'t>,
}

impl<'t> LedgerStatements<'t> {
    fn prepare(tx: &'t rusqlite::Transaction<'_>) -> Result<Self, rusqlite::Error> {
        Ok(LedgerStatements {
            set_limit: tx.prepare_cached(
                "INSERT INTO buyer_limits (shop, item, per_buyer_max) VALUES (?1, ?2, ?3)
                 ON CONFLICT (shop, item) DO UPDATE SET per_buyer_max = excluded.per_buyer_max",
            )?,
            lift_limit: tx
                .prepare_cached("DELETE FROM buyer_limits WHERE shop = ?1 AND item = ?2")?,
            forget_units: tx
                .prepare_cached("DELETE FROM buyer_units WHERE shop = ?1 AND item = ?2")?,
            add_units: tx.prepare_cached(
                "INSERT INTO buyer_units (shop, item, buyer, units) VALUES (?1, ?2, ?3, MAX(0, ?4))
                 ON CONFLICT (shop, item, buyer) DO UPDATE SET units = MAX(0, units + ?4)",
            )?,
            drop_empty: tx.prepare_cached(
                "DELETE FROM buyer_units WHERE shop = ?1 AND item = ?2 AND buyer = ?3 AND units = 0",
            )?,
        })
    }

    /// Moves the item's limit and units past `e`; `limited` is the writer's set of
    /// limited items, kept with the tables.
    fn step(
        &mut self,
        limited: &mut HashSet<(Arc<str>, Arc<str>)>,
        e: &Entry,
    ) -> Result<(), rusqlite::Error> {
        match ledger::limit_set(e) {
            Some(0) => {
                self.lift_limit.execute(params![&*e.shop, &*e.item])?;
                self.forget_units.execute(params![&*e.shop, &*e.item])?;
                limited.remove(&(e.shop.clone(), e.item.clone()));
            }
            Some(max) => {
                self.set_limit.execute(params![&*e.shop, &*e.item, max])?;
                limited.insert((e.shop.clone(), e.item.clone()));
            }
            None => {
                if let Some((buyer, delta)) = ledger::delta(e) {
                    if limited.contains(&(e.shop.clone(), e.item.clone())) {
                        let at = params![&*e.shop, &*e.item, &**buyer];
                        self.add_units
                            .execute(params![&*e.shop, &*e.item, &**buyer, delta])?;
                        self.drop_empty.execute(at)?;
                    }
                }
            }
        }
        Ok(())
    }
}

/// When sale `sale` of shop `shop` was decided, as the views hold it: its journal entry
/// (an ok decrement), else its row in `sales` (pruned from the journal, still
/// returnable).
fn sale_decided_at(
    conn: &Connection,
    log: Option<&LogReads>,
    shop: &str,
    sale: &str,
) -> Result<Option<i64>, rusqlite::Error> {
    let found = match log {
        Some(log) => log.sale_decided_at(shop, sale).map_err(as_sqlite)?,
        None => sale_decided_in_journal(conn, shop, sale)?,
    };
    if found.is_some() {
        return Ok(found);
    }
    conn.prepare_cached("SELECT sold_at FROM sales WHERE shop = ?1 AND sale_key = ?2")?
        .query_row(params![shop, sale], |r| r.get(0))
        .optional()
}

/// When the ok sale under `sale` was decided, as the journal table holds it.
fn sale_decided_in_journal(
    conn: &Connection,
    shop: &str,
    sale: &str,
) -> Result<Option<i64>, rusqlite::Error> {
    conn.prepare_cached(
        "SELECT completed_at FROM journal WHERE shop = ?1 AND request_key = ?2
             AND op = 'decrement' AND status = 'ok'",
    )?
    .query_row(params![shop, sale], |r| r.get(0))
    .optional()
}

/// Adds an ok return's units to its sale's count in `returned` (a count kept for
/// another sale under the same key, before the key window let the key be used again,
/// starts over). Returns are few: the lookups cost the hot path nothing.
fn count_return(
    conn: &Connection,
    log: Option<&LogReads>,
    e: &Entry,
    sale: &str,
) -> Result<(), rusqlite::Error> {
    let sold_at = match sale_decided_at(conn, log, &e.shop, sale)? {
        Some(at) => at,
        None => {
            // The processor returns only against a sale the views held; kept all the
            // same, until the return window passes from the return itself.
            tracing::error!(shop = %e.shop, sale, "a return of a sale the views do not hold");
            e.completed_at
        }
    };
    conn.prepare_cached(
        "INSERT INTO returned (shop, sale_key, sold_at, units) VALUES (?1, ?2, ?3, ?4)
         ON CONFLICT (shop, sale_key) DO UPDATE SET
            units = CASE WHEN sold_at = excluded.sold_at THEN units + excluded.units
                         ELSE excluded.units END,
            sold_at = excluded.sold_at",
    )?
    .execute(params![&*e.shop, sale, sold_at, e.qty])?;
    Ok(())
}

/// A store error as SQLite's, inside a read of the views.
fn as_sqlite(e: StoreError) -> rusqlite::Error {
    rusqlite::Error::ToSqlConversionFailure(e.to_string().into())
}

/// What the views hold of the request keys returns name ([`ItemReads::sales`]); a sale
/// still in the log is read there when the views read by key from the log (`log`).
fn read_sales(
    conn: &Connection,
    log: Option<&LogReads>,
    shop: &str,
    keys: &[&str],
) -> Result<Vec<Option<SaleRecord>>, rusqlite::Error> {
    let mut in_journal = conn.prepare_cached(
        "SELECT item, op, status, qty, completed_at, stock_before, stock_after,
                reserved_after, seq, prev_seq, rowsum, qty_asked, opens_at, closes_at,
                low_stock_at
         FROM journal WHERE shop = ?1 AND request_key = ?2",
    )?;
    let mut pruned = conn.prepare_cached(
        "SELECT item, sold, sold_at FROM sales WHERE shop = ?1 AND sale_key = ?2",
    )?;
    let mut returned = conn
        .prepare_cached("SELECT units, sold_at FROM returned WHERE shop = ?1 AND sale_key = ?2")?;
    let mut out = Vec::with_capacity(keys.len());
    for key in keys {
        let from_log = log.map(|log| log.sale(shop, key));
        let found = match &from_log {
            Some(Ok(found)) => found.clone(),
            // No log's index, or a damaged record of the log: the views' rows.
            _ => in_journal
                .query_row(params![shop, key], |row| sale_in_journal(row, shop, key))
                .optional()?,
        };
        let found = match found {
            Some(r) => Some(r),
            None => pruned
                .query_row(params![shop, key], pruned_sale)
                .optional()?,
        };
        let Some(mut record) = found else {
            // A sale in a damaged record of the log that no row holds: the read fails,
            // rather than say there was no such sale.
            if let Some(Err(e)) = from_log {
                return Err(as_sqlite(e));
            }
            out.push(None);
            continue;
        };
        let counted: Option<(i64, i64)> = returned
            .query_row(params![shop, key], |r| Ok((r.get(0)?, r.get(1)?)))
            .optional()?;
        if let Some((units, sold_at)) = counted {
            // A count of an earlier sale under the same key is not this sale's.
            if sold_at == record.decided_at {
                record.returned = units;
            }
        }
        out.push(Some(record));
    }
    Ok(out)
}

/// A sale's journal row (the columns [`read_sales`] selects), checked against its
/// checksum.
fn sale_in_journal(
    row: &rusqlite::Row<'_>,
    shop: &str,
    key: &str,
) -> Result<SaleRecord, rusqlite::Error> {
    let (item, op_text, status): (String, String, String) = (row.get(0)?, row.get(1)?, row.get(2)?);
    let qty: i64 = row.get(3)?;
    check_row(
        &RowFields {
            shop,
            item: &item,
            request_key: Some(key),
            op: &op_text,
            qty,
            status: &status,
            stock_before: row.get(5)?,
            stock_after: row.get(6)?,
            reserved_after: row.get(7)?,
            seq: row.get(8)?,
            prev_seq: row.get(9)?,
            later: [row.get(11)?, row.get(12)?, row.get(13)?],
            low_stock_at: row.get(14)?,
        },
        row.get(10)?,
    )?;
    Ok(SaleRecord {
        item: item.into(),
        op: Op::parse(&op_text).ok_or_else(|| unknown("op", &op_text))?,
        status: Status::parse(&status).ok_or_else(|| unknown("status", &status))?,
        sold: qty,
        decided_at: row.get(4)?,
        returned: 0,
    })
}

/// A sale's row in `sales` (pruned from the journal, still returnable): an ok sale.
fn pruned_sale(row: &rusqlite::Row<'_>) -> Result<SaleRecord, rusqlite::Error> {
    Ok(SaleRecord {
        item: row.get::<_, String>(0)?.into(),
        op: Op::Decrement,
        status: Status::Ok,
        sold: row.get(1)?,
        decided_at: row.get(2)?,
        returned: 0,
    })
}

/// Fills the key filter from the journal's key index (a covering scan).
fn load_keys(conn: &Connection, keys: &KeyFilter) -> Result<(), rusqlite::Error> {
    let started = Instant::now();
    let mut stmt =
        conn.prepare("SELECT shop, request_key FROM journal WHERE request_key IS NOT NULL")?;
    let mut rows = stmt.query([])?;
    let mut n = 0u64;
    while let Some(row) = rows.next()? {
        keys.insert(row.get_ref(0)?.as_str()?, row.get_ref(1)?.as_str()?);
        n += 1;
    }
    tracing::info!(
        keys = n,
        ms = started.elapsed().as_millis() as u64,
        "key filter loaded"
    );
    Ok(())
}

/// A journal row's outcome (the columns [`Outcomes::outcomes`] selects), checked against
/// its checksum.
fn outcome_row(row: &rusqlite::Row<'_>) -> Result<Outcome, rusqlite::Error> {
    let op_text: String = row.get(3)?;
    let status: String = row.get(5)?;
    let (shop, item, key): (String, String, String) = (row.get(0)?, row.get(1)?, row.get(2)?);
    let (stock_before, stock_after): (Option<i64>, Option<i64>) = (row.get(7)?, row.get(8)?);
    let (seq, prev_seq): (Option<i64>, Option<i64>) = (row.get(9)?, row.get(10)?);
    let qty: i64 = row.get(4)?;
    check_row(
        &RowFields {
            shop: &shop,
            item: &item,
            request_key: Some(&key),
            op: &op_text,
            qty,
            status: &status,
            stock_before,
            stock_after,
            reserved_after: row.get(15)?,
            seq,
            prev_seq,
            later: [row.get(20)?, row.get(21)?, row.get(22)?],
            low_stock_at: row.get(23)?,
        },
        row.get(17)?,
    )?;
    let op = Op::parse(&op_text).ok_or_else(|| unknown("op", &op_text))?;
    Ok(Outcome {
        shop: shop.into(),
        item: item.into(),
        request_key: key.into(),
        op,
        qty: row.get::<_, Option<i64>>(20)?.unwrap_or(qty),
        qty_taken: taken(op.as_str(), &status, qty),
        status: Status::parse(&status).ok_or_else(|| unknown("status", &status))?,
        reason: row.get(6)?,
        stock_before,
        stock_after,
        seq: seq.map(|s| s as u64),
        prev_seq: prev_seq.map(|s| s as u64),
        submitted_at: row.get(11)?,
        completed_at: row.get(12)?,
        hold_id: row.get::<_, Option<String>>(13)?.map(Into::into),
        expires_at: row.get(14)?,
        ttl_ms: row.get(16)?,
        reserved_after: load_only(op, row.get(15)?),
        seller: row.get::<_, Option<String>>(18)?.map(Into::into),
        buyer: row.get::<_, Option<String>>(19)?.map(Into::into),
        requested_at: row.get(11)?,
        opens_at: row.get(21)?,
        closes_at: row.get(22)?,
        low_stock_at: row.get(23)?,
    })
}

impl Outcomes for SqliteStore {
    fn surely_new(&self, shop: &str, keys: &[&str]) -> bool {
        !self.may_hold_any(shop, keys)
    }

    fn outcomes(&self, shop: &str, keys: &[&str]) -> Result<Vec<Option<Outcome>>, StoreError> {
        let Some(log) = self.log.get() else {
            return self.outcomes_in_rows(shop, keys);
        };
        let may_hold = |k: &str| self.may_hold(shop, k);
        match log.outcomes(shop, keys, may_hold) {
            Ok(found) => Ok(found),
            // A damaged record of the log. Key by key: a key it holds is answered from
            // the views' rows if an older version wrote them (read without an index:
            // slow, and only here), or the read fails; never taken for a new key.
            Err(e) => {
                tracing::error!(error = %e, "journal: outcomes read from the views instead of the log");
                keys.iter()
                    .map(|k| match log.outcomes(shop, &[k], may_hold) {
                        Ok(mut one) => Ok(one.pop().flatten()),
                        Err(e) => match self.outcomes_in_rows(shop, &[k])?.pop().flatten() {
                            Some(found) => Ok(Some(found)),
                            None => Err(e),
                        },
                    })
                    .collect()
            }
        }
    }
}

impl SqliteStore {
    /// The outcomes of `keys` as the views' `journal` rows hold them (views an older
    /// version wrote, or that hold rows from before the log).
    fn outcomes_in_rows(
        &self,
        shop: &str,
        keys: &[&str],
    ) -> Result<Vec<Option<Outcome>>, StoreError> {
        if !keys.iter().any(|k| self.may_hold(shop, k)) {
            return Ok(vec![None; keys.len()]);
        }
        self.read(|conn| {
            let mut stmt = conn.prepare_cached(
                "SELECT shop, item, request_key, op, qty, status, reason, stock_before,
                        stock_after, seq, prev_seq, submitted_at, completed_at, hold_id,
                        expires_at, reserved_after, ttl_ms, rowsum, seller, buyer, qty_asked,
                        opens_at, closes_at, low_stock_at
                 FROM journal WHERE shop = ?1 AND request_key = ?2",
            )?;
            keys.iter()
                .map(|key| {
                    if !self.may_hold(shop, key) {
                        return Ok(None);
                    }
                    stmt.query_row(params![shop, key], outcome_row).optional()
                })
                .collect()
        })
    }
}

/// The state of one item as its snapshot has it (`None`: no snapshot of it).
fn snapshot_state(
    conn: &Connection,
    shop: &str,
    item: &str,
) -> Result<Option<ItemState>, rusqlite::Error> {
    let mut snapshot = conn.prepare_cached(
        "SELECT stock, reserved, seq, opens_at, closes_at, low_stock_at, checksum FROM items
         WHERE shop = ?1 AND item = ?2",
    )?;
    snapshot
        .query_row(params![shop, item], |row| {
            Ok((state_at(row, 0)?, row.get(6)?))
        })
        .optional()?
        .map(|(st, sum)| checked_snapshot(shop, item, st, sum))
        .transpose()
}

impl SqliteStore {
    /// The state of one item: its last entry's since the last snapshot, else its
    /// snapshot's (`None`: no such item).
    fn item_state(
        &self,
        conn: &Connection,
        shop: &str,
        item: &str,
    ) -> Result<Option<ItemState>, rusqlite::Error> {
        let key = (Arc::<str>::from(shop), Arc::<str>::from(item));
        if let Some(s) = self.latest().get(&key) {
            return Ok(Some(*s));
        }
        snapshot_state(conn, shop, item)
    }

    /// The names of the shop's items changed since the last snapshot, after `after`, in
    /// order.
    fn latest_names(&self, shop: &str, after: &str) -> std::collections::BTreeSet<Arc<str>> {
        self.latest()
            .keys()
            .filter(|(s, item)| **s == *shop && **item > *after)
            .map(|(_, item)| item.clone())
            .collect()
    }
}

/// The shop's next item name after `prev`: from the items changed since the last
/// snapshot (`changed`, the shop's, in order) or from the snapshots (a loose index scan,
/// so a page costs its own items, not the shop's).
fn next_item(
    conn: &Connection,
    changed: &std::collections::BTreeSet<Arc<str>>,
    shop: &str,
    prev: &str,
) -> Result<Option<String>, rusqlite::Error> {
    use std::ops::Bound::{Excluded, Unbounded};
    let a = changed
        .range::<str, _>((Excluded(prev), Unbounded))
        .next()
        .map(|n| n.to_string());
    let b: Option<String> = conn
        .prepare_cached(
            "SELECT item FROM items WHERE shop = ?1 AND item > ?2 ORDER BY item LIMIT 1",
        )?
        .query_row(params![shop, prev], |r| r.get(0))
        .optional()?;
    Ok(match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    })
}

impl ItemReads for SqliteStore {
    fn item_states(
        &self,
        items: &[(Arc<str>, Arc<str>)],
    ) -> Result<Vec<Option<ItemState>>, StoreError> {
        self.read(|conn| {
            items
                .iter()
                .map(|(shop, item)| self.item_state(conn, shop, item))
                .collect()
        })
    }

    fn item_page(
        &self,
        shop: &str,
        after: Option<&str>,
        limit: usize,
    ) -> Result<ItemPage, StoreError> {
        let changed = self.latest_names(shop, after.unwrap_or(""));
        self.read(|conn| {
            let mut page = ItemPage::default();
            let mut prev = after.unwrap_or("").to_string();
            while let Some(next) = next_item(conn, &changed, shop, &prev)? {
                if next.starts_with(INTERNAL_ITEM_PREFIX) {
                    prev = INTERNAL_ITEMS_END.to_string();
                    continue;
                }
                if let Some(state) = self.item_state(conn, shop, &next)? {
                    if page.items.len() == limit {
                        page.more = true;
                        break;
                    }
                    page.items.push((next.as_str().into(), state));
                }
                prev = next;
            }
            Ok(page)
        })
    }

    /// Holds from `holds`; those without a row (an order's ended lines, or rows the
    /// sweep dropped) from the log when the views read there.
    fn holds(&self, shop: &str, hold_ids: &[&str]) -> Result<Vec<Option<HoldView>>, StoreError> {
        let log = self.log.get();
        self.read(|conn| {
            let mut stmt = conn.prepare_cached(
                "SELECT shop, hold_id, item, qty, expires_at, status, seq, buyer FROM holds
                 WHERE shop = ?1 AND hold_id = ?2",
            )?;
            hold_ids
                .iter()
                .map(|id| {
                    match (
                        stmt.query_row(params![shop, id], hold_view).optional()?,
                        log,
                    ) {
                        (None, Some(log)) => log.ended_hold(shop, id).map_err(as_sqlite),
                        (found, _) => Ok(found),
                    }
                })
                .collect()
        })
    }

    fn sales(&self, shop: &str, keys: &[&str]) -> Result<Vec<Option<SaleRecord>>, StoreError> {
        self.read(|conn| read_sales(conn, self.log.get(), shop, keys))
    }

    fn hold_page(
        &self,
        shop: &str,
        query: &HoldQuery,
        after: Option<&str>,
        limit: usize,
    ) -> Result<HoldPage, StoreError> {
        self.read(|conn| {
            // Order items sort between these two: `~orders/` and the byte after `/`.
            let mut stmt = conn.prepare_cached(
                "SELECT shop, hold_id, item, qty, expires_at, status, seq, buyer FROM holds
                 WHERE shop = ?1 AND hold_id > ?2
                   AND (?3 IS NULL OR item = ?3) AND (?4 IS NULL OR buyer = ?4)
                   AND (?5 IS NULL OR status = ?5)
                   AND (item >= '~orders/' AND item < '~orders0') = ?6
                 ORDER BY hold_id LIMIT ?7",
            )?;
            let holds = stmt
                .query_map(
                    params![
                        shop,
                        after.unwrap_or(""),
                        query.item.as_deref(),
                        query.buyer.as_deref(),
                        query.status.map(HoldStatus::as_str),
                        query.orders,
                        limit as i64 + 1
                    ],
                    hold_view,
                )?
                .collect::<Result<Vec<_>, _>>()?;
            Ok(page_of(holds, limit))
        })
    }

    fn ledgers(
        &self,
        items: &[(Arc<str>, Arc<str>)],
    ) -> Result<Vec<Option<BuyerLedger>>, StoreError> {
        self.read(|conn| {
            items
                .iter()
                .map(|(shop, item)| {
                    Ok(read_ledgers(conn, Some((shop, item)))?
                        .into_iter()
                        .next()
                        .map(|(_, _, l)| l))
                })
                .collect()
        })
    }

    fn events(
        &self,
        shop: &str,
        item: &str,
        after: u64,
        limit: usize,
    ) -> Result<Vec<Event>, StoreError> {
        let in_log = self
            .log
            .get()
            .map(|log| log.events(shop, item, after, limit));
        if let Some(Ok(events)) = in_log {
            return Ok(events);
        }
        if let Some(Err(e)) = &in_log {
            tracing::error!(error = %e, "journal: events read from the views instead of the log");
        }
        let in_rows = self.read(|conn| {
            // Through the index on (shop, item, seq), when the views keep it.
            let mut stmt = conn.prepare_cached(&format!(
                "SELECT {EVENT_COLUMNS} FROM journal WHERE shop = ?1 AND item = ?2 AND seq > ?3
                 ORDER BY seq LIMIT ?4"
            ))?;
            let rows = stmt.query_map(params![shop, item, after, limit as i64], event_row)?;
            rows.collect::<Result<Vec<_>, _>>()
        })?;
        match in_log {
            // The events of a damaged record that no row holds: the read fails, rather
            // than end the item's events early.
            Some(Err(e)) if in_rows.first().is_none_or(|ev| ev.seq != after + 1) => Err(e),
            _ => Ok(in_rows),
        }
    }
}

impl Outbox for SqliteStore {
    fn relay_read(&self, cursor: u64, limit: usize) -> Result<RelayPage, StoreError> {
        self.read(|conn| {
            // Journal ids are given by the one writer in commit order, and a reader sees
            // only committed transactions: reading by id never skips a later commit.
            let mut stmt = conn.prepare_cached(&format!(
                "SELECT {EVENT_COLUMNS}, id FROM journal WHERE id > ?1 ORDER BY id LIMIT ?2"
            ))?;
            let mut rows = stmt.query(params![cursor as i64, limit as i64])?;
            let mut page = RelayPage {
                events: Vec::new(),
                next: cursor,
            };
            let mut read = 0;
            while let Some(row) = rows.next()? {
                read += 1;
                page.next = row.get::<_, i64>(22)? as u64;
                // An unknown item's entry has no seq: not an event.
                if row.get_ref(2)?.data_type() != rusqlite::types::Type::Null {
                    page.events.push(event_row(row)?);
                }
            }
            // Ids go on in the records after the rows.
            if read < limit {
                let after = page.next as i64;
                let ids = (after, i64::MAX);
                LogRecords::new(&self.log_dir).each(conn, ids, ALL_OPS, |id, e| {
                    read += 1;
                    page.next = id as u64;
                    page.events.extend(e.event());
                    Ok(read < limit)
                })?;
            }
            Ok(page)
        })
    }

    fn relay_read_kinds(
        &self,
        cursor: u64,
        limit: usize,
        kinds: &[Op],
    ) -> Result<RelayPage, StoreError> {
        // Rows are read by id and only those of `kinds` decoded: the others cost a look
        // at their `op`, a few thousand ids per millisecond. The records' entries are
        // decoded from the log, each, and filtered by their op.
        let ops: Vec<String> = kinds.iter().map(|k| format!("'{}'", k.as_str())).collect();
        self.read(|conn| {
            let upto = records::last_id(conn)?.min(cursor as i64 + KINDS_SCAN_MAX);
            let mut stmt = conn.prepare_cached(&format!(
                "SELECT {EVENT_COLUMNS}, id FROM journal
                 WHERE id > ?1 AND id <= ?2 AND op IN ({}) ORDER BY id LIMIT ?3",
                ops.join(", ")
            ))?;
            let mut rows = stmt.query(params![cursor as i64, upto, limit as i64])?;
            let mut page = RelayPage {
                events: Vec::new(),
                next: (upto.max(cursor as i64)) as u64,
            };
            while let Some(row) = rows.next()? {
                if row.get_ref(2)?.data_type() != rusqlite::types::Type::Null {
                    page.events.push(event_row(row)?);
                }
                if page.events.len() == limit {
                    // A full page: the next one starts after its last row.
                    page.next = row.get::<_, i64>(22)? as u64;
                    return Ok(page);
                }
            }
            // Ids go on in the records after the rows.
            // Records without an entry of `kinds` are not read.
            let ids = (cursor as i64, upto);
            LogRecords::new(&self.log_dir).each(conn, ids, records::op_bits(kinds), |id, e| {
                if kinds.contains(&e.op) {
                    page.events.extend(e.event());
                }
                if page.events.len() == limit {
                    page.next = id as u64;
                    return Ok(false);
                }
                Ok(true)
            })?;
            Ok(page)
        })
    }

    fn relay_end(&self) -> Result<u64, StoreError> {
        self.read(records::last_id).map(|v| v.max(0) as u64)
    }

    fn relay_cursor(&self, reader: OutboxReader) -> Result<Option<u64>, StoreError> {
        self.read(|conn| {
            conn.query_row(
                "SELECT value FROM meta WHERE key = ?1",
                [cursor_key(reader)],
                |row| row.get::<_, i64>(0),
            )
            .optional()
        })
        .map(|v| v.map(|v| v.max(0) as u64))
    }

    fn relay_save(&self, reader: OutboxReader, cursor: u64) -> Result<(), StoreError> {
        let (ack, done) = mpsc::channel();
        self.tx
            .send(Command::RelaySave(reader, cursor as i64, ack))
            .map_err(|_| StoreError::Closed)?;
        done.recv().map_err(|_| StoreError::Closed)?
    }
}

impl Lifecycle for SqliteStore {
    fn recover(&self) -> Result<Recovered, StoreError> {
        self.read(|conn| {
            let (items, replayed) = verify_tail(conn, &self.log_dir, read_snapshot(conn)?)?;
            let mut stmt = conn.prepare(
                "SELECT shop, hold_id, item, qty, expires_at, status, seq, buyer FROM holds
                 WHERE status = 'held'",
            )?;
            let holds = stmt
                .query_map([], hold_view)?
                .collect::<Result<Vec<_>, _>>()?;
            tracing::info!(
                items = items.len(),
                replayed,
                holds = holds.len(),
                "journal recovered"
            );
            let mut stmt = conn.prepare("SELECT log_partition, log_offset FROM log_offsets")?;
            let log_offsets = stmt
                .query_map([], |row| Ok((row.get(0)?, row.get(1)?)))?
                .collect::<Result<HashMap<i32, i64>, _>>()?;
            let ledgers = read_ledgers(conn, None)?;
            Ok(Recovered {
                items,
                log_offsets,
                holds,
                ledgers,
            })
        })
    }

    fn close(&self) {
        let (ack, done) = mpsc::channel();
        if self.tx.send(Command::Close(ack)).is_ok() {
            let _ = done.recv();
        }
        if let Some(handle) = self.writer.lock().ok().and_then(|mut w| w.take()) {
            let _ = handle.join();
        }
        if let Some((stop, handle)) = self.checkpointer.lock().ok().and_then(|mut c| c.take()) {
            drop(stop);
            let _ = handle.join();
        }
    }
}

/// Items' states, with their shop and item.
type ItemStates = Vec<(Arc<str>, Arc<str>, ItemState)>;

/// Every item's snapshot, each checked against its checksum.
fn read_snapshot(conn: &Connection) -> Result<ItemStates, rusqlite::Error> {
    let mut snapshot = Vec::new();
    let mut stmt = conn.prepare(
        "SELECT shop, item, stock, reserved, seq, opens_at, closes_at, low_stock_at, checksum
         FROM items",
    )?;
    let rows = stmt.query_map([], |row| {
        Ok((
            Arc::<str>::from(row.get::<_, String>(0)?),
            Arc::<str>::from(row.get::<_, String>(1)?),
            state_at(row, 2)?,
            row.get::<_, Option<i64>>(8)?,
        ))
    })?;
    for row in rows {
        let (shop, item, state, sum) = row?;
        let state = checked_snapshot(&shop, &item, state, sum)?;
        snapshot.push((shop, item, state));
    }
    Ok(snapshot)
}

/// The journal id the last item snapshot covers entries up to (0: no snapshot yet).
fn snapshot_journal_id(conn: &Connection) -> Result<i64, rusqlite::Error> {
    Ok(conn
        .query_row(
            "SELECT value FROM meta WHERE key = 'snapshot_journal_id'",
            [],
            |r| r.get(0),
        )
        .optional()?
        .unwrap_or(0))
}

/// The items rebuilt from `snapshot` and the journal entries after it, and how many
/// entries moved an item on. Every entry after the snapshot is checked as the processor
/// checked it when it wrote it (gapless, never negative, each state following from the
/// last): a journal that fails refuses the start.
fn verify_tail(
    conn: &Connection,
    log_dir: &Path,
    snapshot: ItemStates,
) -> Result<(ItemStates, u64), rusqlite::Error> {
    let upto = snapshot_journal_id(conn)?;
    let snapshot_seqs: HashMap<(Arc<str>, Arc<str>), u64> = snapshot
        .iter()
        .map(|(shop, item, state)| ((shop.clone(), item.clone()), state.seq))
        .collect();
    let mut verifier = Verifier::new(snapshot);
    let mut stmt = conn.prepare(
        "SELECT shop, item, op, qty, status, stock_before, stock_after,
                reserved_after, seq, prev_seq, opens_at, closes_at, low_stock_at FROM journal
         WHERE id > ?1 AND seq IS NOT NULL ORDER BY id",
    )?;
    let not_adding_up = |why: String| {
        rusqlite::Error::ToSqlConversionFailure(
            format!("the journal does not add up: {why}").into(),
        )
    };
    let mut rows = stmt.query([upto])?;
    while let Some(row) = rows.next()? {
        verifier.check(&tail_entry(row)?).map_err(not_adding_up)?;
    }
    LogRecords::new(log_dir).each(conn, (upto, i64::MAX), ALL_OPS, |_, e| {
        if e.seq.is_some() {
            verifier.check(&e).map_err(not_adding_up)?;
        }
        Ok(true)
    })?;
    let replayed = verifier.checked();
    let items: ItemStates = verifier
        .into_items()
        .map(|(shop, item, state, _)| (shop, item, state))
        .collect();
    // What the snapshot holds and what recovery rebuilds on it: the tail only moves an
    // item on from its snapshot, never back.
    for (shop, item, state) in &items {
        let from = snapshot_seqs.get(&(shop.clone(), item.clone()));
        assert!(
            from.is_none_or(|seq| state.seq >= *seq),
            "recovery rebuilt item {shop}/{item} at seq {} before its snapshot's {from:?}",
            state.seq
        );
    }
    Ok((items, replayed))
}

/// A journal row after the snapshot (the columns [`verify_tail`] selects) as the entry
/// the processor wrote, to be checked again.
fn tail_entry(row: &rusqlite::Row<'_>) -> Result<Entry, rusqlite::Error> {
    let op: String = row.get(2)?;
    let status: String = row.get(4)?;
    let unreadable = |what: &str, v: &str| {
        rusqlite::Error::ToSqlConversionFailure(
            format!("the journal has an entry with an unknown {what} {v:?}").into(),
        )
    };
    let status = Status::parse(&status).ok_or_else(|| unreadable("status", &status))?;
    let op = Op::parse(&op).ok_or_else(|| unreadable("op", &op))?;
    Ok(Entry {
        status,
        stock_before: row.get(5)?,
        stock_after: row.get(6)?,
        reserved_after: Some(row.get::<_, Option<i64>>(7)?.unwrap_or(0)),
        seq: row.get(8)?,
        prev_seq: row.get(9)?,
        opens_at: row.get(10)?,
        closes_at: row.get(11)?,
        low_stock_at: row.get(12)?,
        ..Entry::decided(
            row.get::<_, String>(0)?.into(),
            row.get::<_, String>(1)?.into(),
            op,
            row.get(3)?,
            0,
            0,
        )
    })
}

struct Writer {
    conn: Connection,
    /// This store's figures: entries per commit, and a commit's time.
    commit_entries: Histogram,
    commit_seconds: Histogram,
    keys: Option<Arc<KeyFilter>>,
    /// Latest state of every item written since the last snapshot; shared with the
    /// readers ([`SqliteStore::latest`]), which find every other item's in the snapshot.
    dirty: Arc<Mutex<States>>,
    /// The log's index, once reads by key go there ([`SqliteStore::read_from_log`]).
    log: Arc<OnceLock<LogReads>>,
    /// Entries the last [`Command::Prune`] deleted.
    pruned: usize,
    /// Where the prune's sweep of ended holds goes on from.
    ended_sweep: EndedSweep,
    /// Entries the prunes of the running transaction may still delete: fewer than asked
    /// when the disk's room near the floor holds no more (a prune is asked for again
    /// every 2 s, and deletes what is left then).
    prune_left: usize,
    txns_since_snapshot: u32,
    last_snapshot: Instant,
    /// The items with a per-buyer limit (`buyer_limits`): the entries of these keep
    /// their buyers' units in `buyer_units`.
    limited: HashSet<(Arc<str>, Arc<str>)>,
    /// How long a transaction waits for more commands after its first
    /// ([`Role::linger`]).
    linger: Linger,
    /// The room on the disk: every transaction asks it first.
    room: Room,
    /// Whether a record of the log is written as one row of `records`, not a `journal`
    /// row per entry: views that read keys and events from the log
    /// ([`SqliteStore::reads_from_log`]).
    rowless: bool,
    /// The journal id the next entry takes.
    next_id: i64,
    /// The log's directory, which `records` rows name records in.
    log_dir: std::path::PathBuf,
}

/// What the views' writer needs to keep the disk's floor (see [`crate::space`]).
struct Room {
    space: Arc<Space>,
    /// Room for what checkpoints add to the database file, granted before each commit.
    growth: Arc<FileGrowth>,
    /// The WAL: what a transaction added to it (and to its index, `-shm`) is checked
    /// against the transaction's bound.
    wal_path: std::path::PathBuf,
}

impl Room {
    /// Bytes the WAL and its index hold on the disk.
    fn wal_allocated(&self) -> u64 {
        allocated(&self.wal_path) + allocated(&self.wal_path.with_extension("db-shm"))
    }
}

/// What a transaction that dirties at most `pages` pages may add to the WAL: a frame per
/// page (a page written twice in one transaction, when the cache spills, is written over
/// its frame), the WAL's header, and its index (`-shm`: 32 KiB per 4,096 frames, one more
/// for frames that cross into the next 32 KiB).
fn wal_bytes(pages: u64) -> u64 {
    pages * FRAME_BYTES + 32 + (pages.div_ceil(4_096) + 1) * 32 * 1024
}

/// Pages the rows one entry writes may dirty: a leaf for each row, and one more for the
/// leaves that split and the pages above them (a row is at most a quarter of a page, so a
/// leaf splits at most once in several rows, and a split dirties at most its two
/// neighbours and its parent besides). A lifted per-buyer limit's units are counted apart
/// ([`Writer::command_pages`]).
fn entry_pages(e: &Entry) -> u64 {
    // The journal's row and its (shop, item, seq) index entry, and the splits.
    let mut pages = 3;
    if e.request_key.is_some() {
        pages += 1; // journal_request_key
    }
    if e.hold_id.is_some() {
        pages += 2; // holds, holds_pending
    }
    if e.buyer.is_some() || ledger::limit_set(e).is_some() {
        pages += 1; // buyer_units, or buyer_limits
    }
    if e.return_of.is_some() {
        pages += 1; // returned
    }
    if e.logged {
        pages += 2; // the requests row it retires, and its key's index entry
    }
    pages
}

impl Writer {
    fn new(
        conn: Connection,
        metrics: &Metrics,
        role: Role,
        keys: Option<Arc<KeyFilter>>,
        linger: Linger,
        room: Room,
    ) -> Writer {
        let store = [role.store()];
        Writer {
            conn,
            commit_entries: metrics.sqlite_commit_entries.with_label_values(&store),
            commit_seconds: metrics.sqlite_commit_seconds.with_label_values(&store),
            keys,
            dirty: Arc::default(),
            log: Arc::default(),
            pruned: 0,
            ended_sweep: EndedSweep::default(),
            prune_left: usize::MAX,
            txns_since_snapshot: 0,
            last_snapshot: Instant::now(),
            limited: HashSet::new(),
            linger,
            room,
            rowless: false,
            next_id: 1,
            log_dir: std::path::PathBuf::new(),
        }
    }

    /// Starts the writer's thread on `rx`, after reading what it carries over from the
    /// file: the items changed after the last snapshot (before a crash), which go into
    /// the next snapshot with the ones changed from now on (that snapshot covers every
    /// entry up to it, so it must hold each of those items' last state), and the items
    /// with a per-buyer limit.
    fn start(mut self, rx: Receiver<Command>) -> Result<JoinHandle<()>, StoreError> {
        *lock_states(&self.dirty) = tail_states(&self.conn, &self.log_dir).map_err(storage)?;
        self.next_id = records::last_id(&self.conn).map_err(storage)? + 1;
        self.limited = read_ledgers(&self.conn, None)
            .map_err(storage)?
            .into_iter()
            .map(|(shop, item, _)| (shop, item))
            .collect();
        std::thread::Builder::new()
            .name("journal-writer".into())
            .spawn(move || self.run(rx))
            .map_err(storage)
    }

    fn run(mut self, rx: Receiver<Command>) {
        let mut closing = None;
        while closing.is_none() {
            let Some(mut cmds) = gather_by_time(&rx, TXN_ENTRIES_MAX, &self.linger) else {
                break;
            };
            // Near the disk's floor, a group in transactions that each fit in the room.
            while !cmds.is_empty() {
                let rest = cmds.split_off(self.commands_fitting(&cmds));
                if let Some(ack) = self.commit(cmds) {
                    closing = Some(ack);
                }
                cmds = rest;
            }
        }
        let space = self.room.space.clone();
        let last = space.retry(
            "the journal's views",
            || self.write_within(&[], true),
            sqlite_no_room,
        );
        if let Err(e) = last {
            tracing::error!(error = %e, "final snapshot failed; the next start replays the tail");
        }
        if let Some(ack) = closing {
            let _ = ack.send(());
        }
    }

    /// One transaction of `cmds`, then their callbacks. Returns the acknowledgement of a
    /// `Close` among them.
    fn commit(&mut self, cmds: Vec<Command>) -> Option<mpsc::Sender<()>> {
        let mut closing = None;
        let weight: usize = cmds.iter().map(Command::weight).sum();
        let snapshot = self.snapshot_due();
        let started = Instant::now();
        // A transaction that finds the disk full (or is not granted room above its
        // floor) is rolled back and run again once there is room (see `crate::space`),
        // rather than stopping the process.
        let space = self.room.space.clone();
        let result = space
            .retry(
                "the journal's views",
                || self.write_within(&cmds, snapshot),
                sqlite_no_room,
            )
            .map_err(storage);
        self.commit_seconds.observe(started.elapsed().as_secs_f64());
        self.commit_entries.observe(weight as f64);
        match &result {
            Ok(()) if snapshot => {
                self.txns_since_snapshot = 0;
                self.last_snapshot = Instant::now();
                // After the commit: a reader finds each item here or in its snapshot.
                lock_states(&self.dirty).clear();
            }
            Ok(()) => self.txns_since_snapshot += 1,
            Err(e) => tracing::error!(error = %e, "journal transaction failed"),
        }
        let failed = result.is_err();
        for cmd in cmds {
            match cmd {
                Command::Append(entries, done, ..) => done(entries, result.clone()),
                Command::Accept(_, done, _) => done(result.clone()),
                Command::Retire(..) => {}
                Command::RelaySave(_, _, ack) => {
                    let _ = ack.send(result.clone());
                }
                Command::Prune(_, _, _, ack) => {
                    let _ = ack.send(result.clone().map(|()| self.pruned));
                }
                Command::Close(ack) => closing = Some(ack),
            }
        }
        if snapshot && !failed {
            self.checkpoint_as("PASSIVE");
        }
        if failed {
            // Memory (the processors' state, admitted requests) is now ahead of the
            // store. Stopping is the only honest move: a restart rebuilds every item
            // from what is durable, and callers poll or resubmit their keys.
            nrtxn_actors::fatal::stop_not_durable("the journal can no longer be written");
        }
        closing
    }

    /// Whether the next transaction writes the item snapshot: every
    /// [`SNAPSHOT_EVERY_TXNS`] transactions, or [`SNAPSHOT_EVERY`] after the last one
    /// when something changed since.
    fn snapshot_due(&self) -> bool {
        self.txns_since_snapshot + 1 >= SNAPSHOT_EVERY_TXNS
            || (self.txns_since_snapshot > 0 && self.last_snapshot.elapsed() >= SNAPSHOT_EVERY)
    }

    /// A checkpoint from the writer's own thread. After a snapshot (PASSIVE), it
    /// completes the background checkpointer's work after the batch's callers are
    /// answered: with no commit running concurrently it can copy the last frames, so the
    /// next transaction starts the WAL over; without this, under sustained writes the
    /// WAL only grows (seen: 1.3 GB after 15 s of the HTTP benchmark). The background
    /// thread has copied most frames already, so this stall is short. Near the floor
    /// (TRUNCATE), it gives the WAL's room back before a transaction that found none.
    fn checkpoint_as(&mut self, mode: &str) {
        match checkpoint(&self.conn, &self.room.growth, mode) {
            Ok((_, log, done)) => tracing::debug!(log, done, mode, "WAL checkpoint"),
            Err(e) => tracing::warn!(error = %e, mode, "WAL checkpoint failed; retrying later"),
        }
    }

    /// Pages `cmd` may dirty, at most (prunes are counted by [`Writer::write_within`]).
    fn command_pages(&self, cmd: &Command) -> u64 {
        match cmd {
            Command::Append(entries, ..) => entries
                .iter()
                .map(|e| entry_pages(e) + self.units_lifted(e))
                .sum(),
            // A request's row and its key's index entry, and the splits.
            Command::Accept(reqs, ..) => reqs.len() as u64 * 3,
            Command::Retire(_, keys) => keys.len() as u64 * 3,
            Command::RelaySave(..) => 1,
            Command::Prune(..) | Command::Close(_) => 0,
        }
    }

    /// Rows of `buyer_units` that entry `e` deletes by lifting its item's per-buyer
    /// limit (rare: an operator's load), counted as a page each.
    fn units_lifted(&self, e: &Entry) -> u64 {
        if ledger::limit_set(e) != Some(0) {
            return 0;
        }
        self.conn
            .query_row(
                "SELECT COUNT(*) FROM buyer_units WHERE shop = ?1 AND item = ?2",
                params![&*e.shop, &*e.item],
                |row| row.get::<_, i64>(0),
            )
            .map_or(0, |n| n.max(0) as u64)
    }

    /// Pages a transaction of `cmds` may dirty, prunes aside: its commands', the fixed
    /// ones, and with a snapshot two for each item it writes (its row, and the splits).
    fn txn_pages(&self, cmds: &[Command], snapshot: bool) -> u64 {
        let commands: u64 = cmds.iter().map(|c| self.command_pages(c)).sum();
        let items = if snapshot {
            let entries: usize = cmds.iter().map(Command::weight).sum();
            2 * (lock_states(&self.dirty).len() + entries) as u64
        } else {
            0
        };
        TXN_PAGES_FIXED + commands + items
    }

    /// How many of `cmds`, from the first, one transaction takes: all of them while the
    /// disk has room, or as many as fit in half its room above the floor (the other half
    /// for what their checkpoint adds to the file), and at least one: a command is
    /// written whole (its log mark covers all of it), and one larger than the room waits
    /// for room.
    fn commands_fitting(&self, cmds: &[Command]) -> usize {
        let room = self.room.space.room();
        if room == u64::MAX {
            return cmds.len();
        }
        let snapshot = self.snapshot_due();
        let mut budget = (room / 2).saturating_sub(wal_bytes(self.txn_pages(&[], snapshot)));
        let mut fit = 0;
        for cmd in cmds {
            let bytes = self.command_pages(cmd) * FRAME_BYTES;
            if fit > 0 && bytes > budget {
                break;
            }
            budget = budget.saturating_sub(bytes);
            fit += 1;
        }
        fit
    }

    /// [`Writer::write`] within the disk's floor ([`Writer::write_claimed`]). Without
    /// room, a checkpoint that cuts the WAL to nothing is tried first, then the
    /// transaction once more; then it fails as on a full disk, and is tried again once
    /// there is room ([`Space::retry`]).
    fn write_within(&mut self, cmds: &[Command], snapshot: bool) -> Result<(), rusqlite::Error> {
        match self.write_claimed(cmds, snapshot) {
            Err(e) if sqlite_no_room(&e) => {
                self.checkpoint_as("TRUNCATE");
                self.write_claimed(cmds, snapshot)
            }
            other => other,
        }
    }

    /// [`Writer::write`] with room asked for what it adds to the WAL and its index
    /// ([`wal_bytes`]) before anything is written there: before the commit, for one
    /// frame per page the transaction may have dirtied (its bound, [`Writer::txn_pages`],
    /// with the prunes cut to what fits; and never more than the database's pages), and
    /// before its statements when the bound is over [`CACHE_PAGES`] (the page cache may
    /// then spill into the WAL before the commit). Before the commit too, room for what
    /// its checkpoint will add to the file ([`FileGrowth::grant_to`]).
    fn write_claimed(&mut self, cmds: &[Command], snapshot: bool) -> Result<(), rusqlite::Error> {
        let prunes: usize = cmds
            .iter()
            .map(|c| match c {
                Command::Prune(_, max, _, _) => *max,
                _ => 0,
            })
            .sum();
        let pages = self.txn_pages(cmds, snapshot);
        self.prune_left = prunes;
        if prunes > 0 {
            let room_pages = self.room.space.room() / FRAME_BYTES;
            let spare = room_pages.saturating_sub(2 * pages) / 2;
            self.prune_left = (spare / PRUNE_PAGES_PER_ENTRY).min(prunes as u64) as usize;
        }
        let bound = pages + self.prune_left as u64 * PRUNE_PAGES_PER_ENTRY;
        let mut claim = if bound >= CACHE_PAGES {
            self.room
                .space
                .room_for(wal_bytes(bound))
                .map_err(no_room)?
        } else {
            self.room.space.claim()
        };
        let before = self.room.wal_allocated();
        let frames = self.write(cmds, snapshot, bound, &mut claim)?;
        let grown = self.room.wal_allocated().saturating_sub(before);
        drop(claim);
        self.room.growth.settle();
        if grown > wal_bytes(frames) {
            // A bound that does not hold: the floor may have been crossed by the rest.
            tracing::error!(
                grown,
                bound = wal_bytes(frames),
                "a views transaction grew the WAL past its bound"
            );
        }
        Ok(())
    }

    /// Writes `cmds` in one transaction, which dirties at most `bound` pages; `claim`
    /// is grown to what its commit may add to the WAL before it commits. Returns the
    /// frames that bound came to.
    fn write(
        &mut self,
        cmds: &[Command],
        snapshot: bool,
        bound: u64,
        claim: &mut nrtxn_log::space::Claim,
    ) -> Result<u64, rusqlite::Error> {
        let tx = self.conn.transaction()?;
        let mut next_id = self.next_id;
        {
            let mut st = TxnStatements::prepare(&tx)?;
            let mut offsets: HashMap<i32, i64> = HashMap::new();
            let mut mark: Option<Chain> = None;
            for cmd in cmds {
                mark = mark_after(mark, cmd);
                match cmd {
                    Command::Append(entries, _, _, at) => {
                        let at = at.filter(|_| self.rowless);
                        next_id = st.number_entries(entries, at, next_id)?;
                        let memory = WriterMemory {
                            limited: &mut self.limited,
                            keys: self.keys.as_deref(),
                            dirty: &mut lock_states(&self.dirty),
                            log: self.log.get(),
                            offsets: &mut offsets,
                        };
                        st.entries_written(entries, memory)?;
                    }
                    Command::Accept(reqs, ..) => st.accept_requests(reqs)?,
                    Command::Retire(shop, keys) => st.retire_requests(shop, keys)?,
                    Command::Prune(before, max, returnable_from, _) => {
                        // What fits in the disk's room (see `write_claimed`).
                        let max = (*max).min(self.prune_left);
                        self.prune_left -= max;
                        let window = (*before, *returnable_from);
                        self.pruned =
                            prune_rows_and_records(&tx, &self.log_dir, window, max, next_id - 1)?;
                        self.ended_sweep.step(&tx, *before)?;
                    }
                    Command::RelaySave(reader, id, _) => save_relay_cursor(&tx, *reader, *id)?,
                    Command::Close(_) => {}
                }
            }
            st.write_pending()?;
            write_positions(&tx, offsets, mark)?;
        }
        if snapshot {
            write_snapshot(&tx, &lock_states(&self.dirty), next_id - 1)?;
        }
        // The commit writes a frame for each page dirtied (a page written before in
        // this transaction is written over its frame, but for the last), so at most one
        // more than the database's pages; and room for the pages this adds past the
        // file's end, which a checkpoint will write there.
        let pages = tx.query_row("PRAGMA page_count", [], |row| row.get::<_, i64>(0))?;
        let pages = pages.max(0) as u64;
        let frames = bound.min(pages + 1);
        claim.try_grow_to(wal_bytes(frames)).map_err(no_room)?;
        self.room.growth.grant_to(pages).map_err(no_room)?;
        tx.commit()?;
        self.next_id = next_id;
        Ok(frames)
    }
}

/// Where in the log the views stand after `cmd`, from `mark` before it.
fn mark_after(mark: Option<Chain>, cmd: &Command) -> Option<Chain> {
    let (Command::Append(_, _, Some(m), _) | Command::Accept(_, _, Some(m))) = cmd else {
        return mark;
    };
    // The log's writer hands its records to the views in the log's order.
    debug_assert!(
        mark.is_none_or(|had| had.next_lsn < m.next_lsn),
        "the views were given the log's record {} after {mark:?}",
        m.next_lsn.saturating_sub(1)
    );
    match mark {
        Some(had) if had.next_lsn >= m.next_lsn => mark,
        _ => Some(*m),
    }
}

/// What the views' writer keeps in memory of the entries it writes, lent to one
/// transaction ([`TxnStatements::entries_written`]).
struct WriterMemory<'w> {
    /// The writer's limited items ([`Writer::limited`]).
    limited: &'w mut HashSet<(Arc<str>, Arc<str>)>,
    /// The request keys the views hold ([`SqliteStore::key_filter`]), if they keep them.
    keys: Option<&'w KeyFilter>,
    /// Each item's last state since the last snapshot ([`Writer::dirty`]).
    dirty: &'w mut States,
    /// The log's index, when sales are read there ([`SqliteStore::read_from_log`]).
    log: Option<&'w LogReads>,
    /// The request log's furthest offset applied, by partition, in this transaction.
    offsets: &'w mut HashMap<i32, i64>,
}

/// The statements one views transaction writes entries, holds, ledgers and requests
/// with, prepared once per transaction.
struct TxnStatements<'t> {
    conn: &'t Connection,
    /// Entries go in by statements of ROWS_PER_INSERT rows (the rest one by one): one
    /// statement's setup and VDBE program run serves many rows.
    insert_many: rusqlite::CachedStatement<'t>,
    insert: rusqlite::CachedStatement<'t>,
    hold_made: rusqlite::CachedStatement<'t>,
    hold_ended: rusqlite::CachedStatement<'t>,
    hold_extended: rusqlite::CachedStatement<'t>,
    retire: rusqlite::CachedStatement<'t>,
    accept: rusqlite::CachedStatement<'t>,
    ledgers: LedgerStatements<'t>,
    /// Holds and requests made in this transaction, written when it ends
    /// ([`TxnStatements::write_pending`]).
    pending: Pending,
    hold_gone: rusqlite::CachedStatement<'t>,
}

impl<'t> TxnStatements<'t> {
    /// Ended holds keep their rows (a listing reads them) until [`prune`] drops them.
    fn prepare(tx: &'t rusqlite::Transaction<'_>) -> Result<Self, rusqlite::Error> {
        Ok(TxnStatements {
            conn: tx,
            insert_many: tx.prepare_cached(&journal_insert(ROWS_PER_INSERT))?,
            insert: tx.prepare_cached(&journal_insert(1))?,
            hold_made: tx.prepare_cached(
                // An ended hold's row stays past its key's window: an id used again
                // after it replaces the row. A pending one's never is (two holds made
                // under one id fail the transaction, as they always did).
                "INSERT INTO holds (shop, hold_id, item, qty, expires_at, status, seq, buyer)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)
                 ON CONFLICT (shop, hold_id) DO UPDATE SET
                    item = excluded.item, qty = excluded.qty, expires_at = excluded.expires_at,
                    status = excluded.status, seq = excluded.seq, buyer = excluded.buyer
                 WHERE holds.status != 'held'",
            )?,
            hold_ended: tx.prepare_cached(
                "UPDATE holds SET status = ?3, seq = ?4 WHERE shop = ?1 AND hold_id = ?2",
            )?,
            hold_extended: tx.prepare_cached(
                "UPDATE holds SET expires_at = ?3, seq = ?4 WHERE shop = ?1 AND hold_id = ?2",
            )?,
            retire: tx
                .prepare_cached("DELETE FROM requests WHERE shop = ?1 AND request_key = ?2")?,
            accept: tx.prepare_cached(
                "INSERT OR FAIL INTO requests (shop, request_key, body) VALUES (?1, ?2, ?3)",
            )?,
            ledgers: LedgerStatements::prepare(tx)?,
            pending: Pending::new(),
            hold_gone: tx.prepare_cached("DELETE FROM holds WHERE shop = ?1 AND hold_id = ?2")?,
        })
    }

    /// Writes the holds and requests made in this transaction, as they stand at its end.
    fn write_pending(&mut self) -> Result<(), rusqlite::Error> {
        let (holds, requests) = self.pending.take();
        for h in holds {
            let written = self.hold_made.execute(params![
                &*h.shop,
                &*h.hold_id,
                &*h.item,
                h.qty,
                h.expires_at,
                h.status.as_str(),
                h.seq,
                h.buyer.as_deref()
            ])?;
            if written == 0 {
                return Err(rusqlite::Error::ToSqlConversionFailure(
                    format!(
                        "hold {:?} of shop {:?} made while one of that id is pending",
                        h.hold_id, h.shop
                    )
                    .into(),
                ));
            }
        }
        for r in requests {
            let body = serde_json::to_string(&r)
                .map_err(|e| rusqlite::Error::ToSqlConversionFailure(Box::new(e)))?;
            self.accept.execute(params![&*r.shop, &*r.key, body])?;
        }
        Ok(())
    }

    /// Numbers `entries` from journal id `next_id` on, with a `records` row for the
    /// record of the log they are (`at`), else a `journal` row each; returns the id after
    /// them.
    fn number_entries(
        &mut self,
        entries: &[Entry],
        at: Option<RecordAt>,
        next_id: i64,
    ) -> Result<i64, rusqlite::Error> {
        match at {
            // Nothing to number.
            _ if entries.is_empty() => Ok(next_id),
            Some(at) => {
                records::insert(self.conn, next_id, entries, at)?;
                Ok(next_id + entries.len() as i64)
            }
            None => {
                self.insert_entries(entries)?;
                // The last row's id, just given by SQLite.
                Ok(next_id.max(self.conn.last_insert_rowid() + 1))
            }
        }
    }

    /// Inserts the journal rows of `entries`, in their order.
    fn insert_entries(&mut self, entries: &[Entry]) -> Result<(), rusqlite::Error> {
        let mut rows_written = 0;
        for rows in entries.chunks(ROWS_PER_INSERT) {
            if rows.len() == ROWS_PER_INSERT {
                for (row, e) in rows.iter().enumerate() {
                    bind_entry(&mut self.insert_many, row, e)?;
                }
                rows_written += self.insert_many.raw_execute()?;
            } else {
                for e in rows {
                    bind_entry(&mut self.insert, 0, e)?;
                    rows_written += self.insert.raw_execute()?;
                }
            }
        }
        // What the log made durable is what the views hold: a row for every entry.
        debug_assert_eq!(
            rows_written,
            entries.len(),
            "the views wrote a different number of journal rows than entries given"
        );
        Ok(())
    }

    /// Writes what each of `entries` changes besides its journal row (its hold, its
    /// item's per-buyer ledger, its sale's returned units, the request it retires), and
    /// keeps `memory` up to date with it.
    fn entries_written(
        &mut self,
        entries: &[Entry],
        memory: WriterMemory<'_>,
    ) -> Result<(), rusqlite::Error> {
        for (i, e) in entries.iter().enumerate() {
            // The views take each item's entries as the log's writer checked them before
            // it wrote them: each right after the item's entry before it.
            debug_assert!(
                i == 0 || follows(&entries[i - 1], e),
                "item {}/{}: the views were given seq {:?} (prev {:?}) after seq {:?}",
                e.shop,
                e.item,
                e.seq,
                e.prev_seq,
                entries[i.saturating_sub(1)].seq
            );
            self.hold_step(e)?;
            self.ledgers.step(memory.limited, e)?;
            if let (Status::Ok, Op::Increment, Some(sale)) = (e.status, e.op, &e.return_of) {
                count_return(self.conn, memory.log, e, sale)?;
            }
            if let (Some(key), Some(filter)) = (&e.request_key, memory.keys) {
                // Before the commit, so the key is in the filter before its outcome can
                // be looked for.
                filter.insert(&e.shop, key);
            }
            if let Some(pos) = e.log_pos {
                let o = memory.offsets.entry(pos.partition).or_insert(pos.offset);
                *o = (*o).max(pos.offset);
            }
            if let (true, Some(key)) = (e.logged, &e.request_key) {
                self.retire_requests(&e.shop, std::slice::from_ref(key))?;
            }
            // Only the last state of each run of one item's entries matters: a hot
            // item's batch costs one map update, not one per entry.
            let run_ends = entries
                .get(i + 1)
                .is_none_or(|next| next.item != e.item || next.shop != e.shop);
            if let (true, Some(state)) = (run_ends, e.state_after()) {
                memory.dirty.insert((e.shop.clone(), e.item.clone()), state);
            }
        }
        Ok(())
    }

    /// Keeps fire-and-forget requests in `requests` until their outcomes are written.
    fn accept_requests(&mut self, reqs: &[Request]) -> Result<(), rusqlite::Error> {
        for r in reqs {
            self.pending.accepted(r)?;
        }
        Ok(())
    }

    /// Forgets fire-and-forget requests of `shop` decided (here or in another journal).
    fn retire_requests(
        &mut self,
        shop: &Arc<str>,
        keys: &[Arc<str>],
    ) -> Result<(), rusqlite::Error> {
        for key in keys {
            if !self.pending.retired(shop, key) {
                self.retire.execute(params![&**shop, &**key])?;
            }
        }
        Ok(())
    }

    /// Writes the hold that `e` makes, ends or extends, if it is an ok one: a hold made
    /// in this transaction is written once, as it stands at its end ([`Pending`]).
    fn hold_step(&mut self, e: &Entry) -> Result<(), rusqlite::Error> {
        let earlier = match (e.status, HoldStatus::after(e.op), &e.hold_id) {
            (Status::Ok, Some(HoldStatus::Held), Some(id)) => {
                return self.pending.hold_made(e, id);
            }
            (Status::Ok, Some(status), Some(id)) => self.pending.hold_changed(e, id, Some(status)),
            (Status::Ok, None, Some(id)) if e.op == Op::Extend => {
                self.pending.hold_changed(e, id, None)
            }
            _ => None,
        };
        let id = e.hold_id.as_deref();
        match earlier {
            Some(Earlier::Ended(status)) => {
                self.hold_ended
                    .execute(params![&*e.shop, id, status.as_str(), e.seq])?;
            }
            Some(Earlier::Gone) => {
                self.hold_gone.execute(params![&*e.shop, id])?;
            }
            Some(Earlier::Extended) => {
                self.hold_extended
                    .execute(params![&*e.shop, id, e.expires_at, e.seq])?;
            }
            None => {}
        }
        Ok(())
    }
}

/// Whether `e` may come right after `before` in one batch: another item's entry, or one
/// of the same item that follows it (an entry without a seq, an unknown item's, follows
/// nothing and is followed by anything).
fn follows(before: &Entry, e: &Entry) -> bool {
    let same_item = before.shop == e.shop && before.item == e.item;
    match (same_item, before.seq, e.seq) {
        (true, Some(seq), Some(next)) => e.prev_seq == Some(seq) && next == seq + 1,
        _ => true,
    }
}

/// Deletes up to `max` entries decided before `before` (ms) that the last snapshot
/// covers and the outbox relay has published, keeping the ok sales among them decided
/// from `returnable_from` (ms) on in `sales`, and forgets sales and return counts
/// decided before it. Returns how many entries went.
fn prune(
    tx: &Connection,
    before: i64,
    max: usize,
    returnable_from: i64,
    newest: i64,
) -> Result<usize, rusqlite::Error> {
    // Only entries a snapshot covers (recovery starts after it), and only those the
    // outbox's readers (the relay, the alerts) have passed, if they run; never the
    // newest id given, `newest` (the journal's ids would start again at 1, behind the
    // readers' cursors).
    // Of them, the oldest `max` by id are looked at, and those decided before `before`
    // go: ids follow the log, whose entries come in the order they were decided, so
    // the entries past the window are the first ones. Looking further would read the
    // whole table (no index on `completed_at`) at every prune while nothing is old
    // enough, as during the key window's first week; an entry out of order by a clock
    // step waits for the ones before it.
    const PRUNED: &str = "SELECT id FROM (
                SELECT id, completed_at FROM journal
                WHERE id <= (SELECT COALESCE(MAX(value), 0) FROM meta
                             WHERE key = 'snapshot_journal_id')
                  AND id <= COALESCE((SELECT MIN(value) FROM meta
                                      WHERE key IN ('relay_journal_id',
                                                    'alerts_journal_id')),
                                     9223372036854775807)
                  AND id < ?4
                ORDER BY id LIMIT ?2)
                WHERE completed_at < ?1";
    // The sales among them that may still be returned stay findable by their key (the
    // same rows: same query, same transaction).
    tx.prepare_cached(&format!(
        "INSERT OR REPLACE INTO sales (shop, sale_key, item, sold, sold_at)
         SELECT shop, request_key, item, qty, completed_at FROM journal
         WHERE id IN ({PRUNED}) AND op = 'decrement' AND status = 'ok'
           AND request_key IS NOT NULL AND completed_at >= ?3"
    ))?
    .execute(params![before, max as i64, returnable_from, newest])?;
    let pruned = tx
        .prepare_cached(&format!("DELETE FROM journal WHERE id IN ({PRUNED})"))?
        .execute(params![before, max as i64, returnable_from, newest])?;
    // Sales past the return window, and their counts, go.
    for table in ["sales", "returned"] {
        tx.prepare_cached(&format!(
            "DELETE FROM {table} WHERE rowid IN (
                SELECT rowid FROM {table} WHERE sold_at < ?1 LIMIT ?2)"
        ))?
        .execute(params![returnable_from, max as i64])?;
    }
    Ok(pruned)
}

/// [`prune`] of the `journal` rows, then [`records::prune`] of the records, within
/// `window` (the key window's start, the return window's; ms), up to `max` entries in
/// all, never the newest id `newest`. Returns how many entries went.
fn prune_rows_and_records(
    tx: &Connection,
    log_dir: &Path,
    (before, returnable_from): (i64, i64),
    max: usize,
    newest: i64,
) -> Result<usize, rusqlite::Error> {
    let rows = prune(tx, before, max, returnable_from, newest)?;
    let covered = prune_covered(tx)?;
    let in_records = max.saturating_sub(rows);
    Ok(rows
        + records::prune(
            tx,
            log_dir,
            before,
            in_records,
            returnable_from,
            covered,
            newest,
        )?)
}

/// The last journal id both the item snapshot and the outbox's readers (the relay, the
/// alerts; those that run) have passed: what the prune may take.
fn prune_covered(tx: &Connection) -> Result<i64, rusqlite::Error> {
    tx.query_row(
        "SELECT MIN(
            (SELECT COALESCE(MAX(value), 0) FROM meta WHERE key = 'snapshot_journal_id'),
            COALESCE((SELECT MIN(value) FROM meta
                      WHERE key IN ('relay_journal_id', 'alerts_journal_id')),
                     9223372036854775807))",
        [],
        |r| r.get(0),
    )
}

/// Rows of `holds` one prune's sweep looks at.
const ENDED_SWEEP_ROWS: i64 = 10_000;

/// A sweep of `holds` in key order, a slice per prune, that drops the ended holds whose
/// expiry is past the key window (the listing's reach). Without an index on the ended
/// ones (which would cost an insert per hold), each row is looked at once per pass.
#[derive(Default)]
struct EndedSweep {
    /// The last key looked at (`None`: from the first).
    after: Option<(String, String)>,
}

impl EndedSweep {
    fn step(&mut self, tx: &Connection, before: i64) -> Result<(), rusqlite::Error> {
        let (shop, hold) = self.after.clone().unwrap_or_default();
        let last: Option<(String, String)> = tx
            .prepare_cached(
                "SELECT shop, hold_id FROM holds WHERE (shop, hold_id) > (?1, ?2)
                 ORDER BY shop, hold_id LIMIT 1 OFFSET ?3",
            )?
            .query_row(params![shop, hold, ENDED_SWEEP_ROWS - 1], |r| {
                Ok((r.get(0)?, r.get(1)?))
            })
            .optional()?;
        let (to_shop, to_hold) = last
            .clone()
            .unwrap_or_else(|| ("\u{10FFFF}".into(), String::new()));
        tx.prepare_cached(
            "DELETE FROM holds WHERE (shop, hold_id) > (?1, ?2) AND (shop, hold_id) <= (?3, ?4)
               AND status != 'held' AND expires_at < ?5",
        )?
        .execute(params![shop, hold, to_shop, to_hold, before])?;
        // At the end of the table the next pass starts again from the first key.
        self.after = last;
        Ok(())
    }
}

/// The key in `meta` of an outbox reader's cursor.
fn cursor_key(reader: OutboxReader) -> &'static str {
    match reader {
        OutboxReader::Events => "relay_journal_id",
        OutboxReader::Alerts => "alerts_journal_id",
    }
}

/// Keeps an outbox reader's cursor (the journal id it passed up to); it never goes back.
fn save_relay_cursor(
    tx: &Connection,
    reader: OutboxReader,
    id: i64,
) -> Result<(), rusqlite::Error> {
    tx.prepare_cached(
        "INSERT INTO meta (key, value) VALUES (?1, ?2)
         ON CONFLICT (key) DO UPDATE SET value = MAX(value, excluded.value)",
    )?
    .execute(params![cursor_key(reader), id])?;
    Ok(())
}

/// Writes how far the request log is applied (`offsets`, by partition) and where in the
/// journal's log the views stand (`mark`), in the transaction of the entries that bring
/// them there.
fn write_positions(
    tx: &Connection,
    offsets: HashMap<i32, i64>,
    mark: Option<Chain>,
) -> Result<(), rusqlite::Error> {
    let mut applied = tx.prepare_cached(
        "INSERT INTO log_offsets (log_partition, log_offset) VALUES (?1, ?2)
         ON CONFLICT (log_partition)
         DO UPDATE SET log_offset = MAX(log_offset, excluded.log_offset)",
    )?;
    for (partition, offset) in offsets {
        applied.execute(params![partition, offset])?;
    }
    if let Some(m) = mark {
        let mut set = tx.prepare_cached(
            "INSERT INTO meta (key, value) VALUES (?1, ?2)
             ON CONFLICT (key) DO UPDATE SET value = excluded.value",
        )?;
        set.execute(params!["log_next_lsn", m.next_lsn as i64])?;
        set.execute(params!["log_parent_hi", (m.parent >> 64) as u64 as i64])?;
        set.execute(params!["log_parent_lo", m.parent as u64 as i64])?;
        set.execute(params!["log_epoch", m.epoch as i64])?;
    }
    Ok(())
}

/// Writes the item snapshot: the last state of every item in `dirty`, and that it
/// covers every entry written so far.
fn write_snapshot(tx: &Connection, dirty: &States, upto: i64) -> Result<(), rusqlite::Error> {
    let mut upsert = tx.prepare_cached(
        "INSERT INTO items (shop, item, stock, reserved, seq, opens_at, closes_at, low_stock_at,
                            checksum)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)
         ON CONFLICT (shop, item) DO UPDATE SET
            stock = excluded.stock, reserved = excluded.reserved, seq = excluded.seq,
            opens_at = excluded.opens_at, closes_at = excluded.closes_at,
            low_stock_at = excluded.low_stock_at, checksum = excluded.checksum",
    )?;
    for ((shop, item), s) in dirty {
        let sum = snapshot_checksum(shop, item, *s);
        let (opens, closes, low) = (bound(s.opens_at), bound(s.closes_at), bound(s.low_stock_at));
        upsert.execute(params![
            &**shop, &**item, s.stock, s.reserved, s.seq, opens, closes, low, sum
        ])?;
    }
    drop(upsert);
    tx.execute(
        "INSERT INTO meta (key, value) VALUES ('snapshot_journal_id', ?1)
         ON CONFLICT (key) DO UPDATE SET value = excluded.value",
        [upto],
    )?;
    Ok(())
}

/// Whether an SQLite error means the disk has no room (`SQLITE_FULL`).
pub fn sqlite_no_room(e: &rusqlite::Error) -> bool {
    matches!(e, rusqlite::Error::SqliteFailure(f, _) if f.code == rusqlite::ErrorCode::DiskFull)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The checksum rows were written with before it was computed in one pass: each
    /// field streamed into the hasher. Rows already on disk carry it, so both must agree.
    fn streamed_row_checksum(f: &RowFields<'_>) -> i64 {
        let mut h = xxhash_rust::xxh3::Xxh3::new();
        for t in [
            Some(f.shop),
            Some(f.item),
            f.request_key,
            Some(f.op),
            Some(f.status),
        ] {
            match t {
                Some(t) => {
                    h.update(&[1]);
                    h.update(&(t.len() as u64).to_le_bytes());
                    h.update(t.as_bytes());
                }
                None => h.update(&[0]),
            }
        }
        let numbers = [Some(f.qty), f.stock_before, f.stock_after, f.reserved_after];
        for n in numbers.into_iter().chain([f.seq, f.prev_seq]) {
            match n {
                Some(n) => {
                    h.update(&[1]);
                    h.update(&n.to_le_bytes());
                }
                None => h.update(&[0]),
            }
        }
        if f.later.iter().any(Option::is_some) {
            for n in f.later {
                h.update(&n.unwrap_or(i64::MIN).to_le_bytes());
            }
        }
        if let Some(n) = f.low_stock_at {
            h.update(b"low");
            h.update(&n.to_le_bytes());
        }
        h.digest() as i64
    }

    #[test]
    fn a_rows_checksum_is_the_one_rows_on_disk_were_written_with() {
        let long_key = "k".repeat(300);
        for (i, key) in [None, Some("order-1"), Some(long_key.as_str())]
            .into_iter()
            .enumerate()
        {
            for full in [false, true] {
                let some = |n: i64| full.then_some(n);
                let f = RowFields {
                    shop: "shop-a",
                    item: "sku-ü",
                    request_key: key,
                    op: "decrement",
                    qty: 3 + i as i64,
                    status: "ok",
                    stock_before: some(10),
                    stock_after: Some(7),
                    reserved_after: some(0),
                    seq: Some(42),
                    prev_seq: some(41),
                    later: [some(2), None, some(-5)],
                    low_stock_at: some(1),
                };
                assert_eq!(row_checksum(&f), streamed_row_checksum(&f), "{i} {full}");
            }
        }
    }

    /// A transaction gathers what comes within the linger while no read waits (a command
    /// 50 ms after the first, with 2 s to linger), and ends at the shorter linger while
    /// one does (here the long one is a minute: a writer that missed the read would fail
    /// the bound).
    #[test]
    fn the_writer_lingers_alone_and_ends_early_while_a_read_waits() {
        let retire = |k: &str| Command::Retire("s".into(), vec![k.into()]);
        let keys = |cmds: &[Command]| -> Vec<String> {
            cmds.iter()
                .map(|c| match c {
                    Command::Retire(_, k) => k[0].to_string(),
                    _ => "?".into(),
                })
                .collect()
        };
        let waiting = Arc::new(ReadersWaiting::default());
        let (tx, rx) = mpsc::sync_channel(16);
        let lingering = Linger {
            alone: Duration::from_secs(2),
            read: Duration::ZERO,
            waiting: waiting.clone(),
        };
        tx.send(retire("a")).unwrap();
        let later = tx.clone();
        let sender = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            later.send(retire("b")).unwrap();
        });
        let cmds = gather_by_time(&rx, 100, &lingering).unwrap();
        sender.join().unwrap();
        assert_eq!(keys(&cmds), ["a", "b"], "what came within the linger");

        let long = Linger {
            alone: Duration::from_secs(60),
            ..lingering
        };
        let started = Instant::now();
        let read = waiting.enter();
        tx.send(retire("c")).unwrap();
        let cmds = gather_by_time(&rx, 100, &long).unwrap();
        assert_eq!(keys(&cmds), ["c"]);
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "a read waited, yet the writer lingered {:?}",
            started.elapsed()
        );
        drop(read);
        assert!(!waiting.any(), "the read no longer counts once it is done");
    }

    /// A prune looks at the oldest entries only, `max` at a time, and takes those past
    /// the window among them: it does not read the rest of the table to find none, and
    /// an entry out of order (here id 3, decided late) stays until it is old enough.
    #[test]
    fn a_prune_takes_the_oldest_entries_past_the_window_a_batch_at_a_time() {
        let conn = Connection::open_in_memory().unwrap();
        prepare_schema(&conn).unwrap();
        for id in 1..=20i64 {
            let at = if id <= 10 && id != 3 { 100 } else { 5_000 };
            conn.execute(
                "INSERT INTO journal (id, shop, item, op, qty, status, submitted_at,
                                      completed_at)
                 VALUES (?1, 's', 'i', 'decrement', 1, 'ok', ?2, ?2)",
                params![id, at],
            )
            .unwrap();
        }
        conn.execute(
            "INSERT INTO meta (key, value) VALUES ('snapshot_journal_id', 20)",
            [],
        )
        .unwrap();
        let ids = || -> Vec<i64> {
            let mut stmt = conn.prepare("SELECT id FROM journal ORDER BY id").unwrap();
            let rows = stmt.query_map([], |r| r.get(0)).unwrap();
            rows.map(Result::unwrap).collect()
        };
        // The oldest 5: ids 1 to 5, of which 3 is too young.
        assert_eq!(prune(&conn, 1_000, 5, 0, 20).unwrap(), 4);
        assert_eq!(ids()[..3], [3, 6, 7]);
        // Then 3 and 6 to 9 (3 still too young): 6 to 9 go.
        assert_eq!(prune(&conn, 1_000, 5, 0, 20).unwrap(), 4);
        assert_eq!(ids()[..3], [3, 10, 11]);
        // 3, 10, 11, 12, 13: only 10 is old enough; then nothing among the oldest.
        assert_eq!(prune(&conn, 1_000, 5, 0, 20).unwrap(), 1);
        assert_eq!(prune(&conn, 1_000, 5, 0, 20).unwrap(), 0);
        // Once the window passes them, the rest go but the newest.
        assert_eq!(prune(&conn, 10_000, 100, 0, 20).unwrap(), 10);
        assert_eq!(ids(), [20]);
    }

    /// The sweep drops ended holds past the window, a slice at a time, and keeps pending
    /// ones and recent ended ones; a pass ends at the table's end and starts again.
    #[test]
    fn the_sweep_drops_only_ended_holds_past_the_window() {
        let conn = Connection::open_in_memory().unwrap();
        prepare_schema(&conn).unwrap();
        let n = ENDED_SWEEP_ROWS * 2 + 5;
        for i in 0..n {
            let (status, expires_at) = match i % 3 {
                0 => ("held", 10),
                1 => ("confirmed", 10),
                _ => ("released", 5_000),
            };
            conn.execute(
                "INSERT INTO holds (shop, hold_id, item, qty, expires_at, status, seq)
                 VALUES ('s', ?1, 'i', 1, ?2, ?3, 1)",
                params![format!("h{i:06}"), expires_at, status],
            )
            .unwrap();
        }
        let count = |status: &str| -> i64 {
            conn.query_row(
                "SELECT COUNT(*) FROM holds WHERE status = ?1",
                [status],
                |r| r.get(0),
            )
            .unwrap()
        };
        let confirmed = count("confirmed");
        let mut sweep = EndedSweep::default();
        sweep.step(&conn, 1_000).unwrap();
        let left = count("confirmed");
        assert!(
            left < confirmed && left > 0,
            "one slice: {left} of {confirmed} left"
        );
        for _ in 0..3 {
            sweep.step(&conn, 1_000).unwrap();
        }
        assert_eq!(count("confirmed"), 0, "past the window: gone");
        assert_eq!(count("held"), (n + 2) / 3, "pending: kept");
        assert_eq!(count("released"), n / 3, "within the window: kept");
    }
}
