//! The views' index of the log's records by journal id: one row per entries record of
//! the log (`records`), not one per decision (`docs/decisions/derived-views.md`, "The
//! views keep a row per record, not per decision").
//!
//! Journal ids number the decisions in commit order, one after another; the outbox's
//! readers (the stream, the stock alerts, the Kafka relay) follow them as cursors, the
//! item snapshot says which it covers, and the prune goes by them. A row here names the
//! first id of a record's entries, how many it holds, and where the record is in the
//! log (its segment and byte offset); the entries themselves are read from the log,
//! under its checksums. Views written before this kept a `journal` row per decision:
//! those rows are read as they were, and ids go on after them.

use std::path::{Path, PathBuf};

use nrtxn_actors::{Entry, Op, Status};
use nrtxn_log::index::{IndexError, SegmentFile};
use rusqlite::{params, Connection, OptionalExtension};

pub(crate) const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS records (
    first_id   INTEGER PRIMARY KEY,
    entries    INTEGER NOT NULL,
    segment    INTEGER NOT NULL,
    offset     INTEGER NOT NULL,
    -- The latest decision time among the record's entries (ms).
    decided_to INTEGER NOT NULL,
    -- The ops of its entries, a bit each (op_bit): a reader of a few ops skips the
    -- records without them, unread.
    ops        INTEGER NOT NULL,
    -- record_checksum() of the other columns: a damaged row is refused.
    checksum   INTEGER NOT NULL
);
";

/// Where a record of the log is: its segment (the segment's first lsn) and its byte
/// offset in the segment's file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecordAt {
    pub segment: u64,
    pub offset: u64,
}

/// A row of `records`.
#[derive(Debug, Clone, Copy)]
struct Row {
    first_id: i64,
    entries: i64,
    at: RecordAt,
    decided_to: i64,
    ops: i64,
}

impl Row {
    fn last_id(&self) -> i64 {
        self.first_id + self.entries - 1
    }
}

/// The bit of `op` in a record's `ops`.
pub(crate) fn op_bit(op: Op) -> i64 {
    1 << Op::ALL
        .iter()
        .position(|o| *o == op)
        .expect("every op is listed")
}

/// Every op's bit: a reader of every entry.
pub(crate) const ALL_OPS: i64 = -1;

/// The bits of every op in `ops`.
pub(crate) fn op_bits(ops: &[Op]) -> i64 {
    ops.iter().fold(0, |bits, op| bits | op_bit(*op))
}

fn record_checksum(r: &Row) -> i64 {
    let mut b = [0u8; 48];
    for (i, v) in [
        r.first_id as u64,
        r.entries as u64,
        r.at.segment,
        r.at.offset,
        r.decided_to as u64,
        r.ops as u64,
    ]
    .into_iter()
    .enumerate()
    {
        b[i * 8..i * 8 + 8].copy_from_slice(&v.to_le_bytes());
    }
    xxhash_rust::xxh3::xxh3_64(&b) as i64
}

/// The error of a `records` row found damaged, saying what to do.
fn damaged(what: String) -> rusqlite::Error {
    rusqlite::Error::ToSqlConversionFailure(
        format!(
            "the views (nrtxn.db) are damaged: {what}. Move nrtxn.db and its -wal and -shm \
             files away and start again: the views are rebuilt from the log, or, if the \
             log's old segments were retired, restore a backup"
        )
        .into(),
    )
}

const COLUMNS: &str = "first_id, entries, segment, offset, decided_to, ops, checksum";

/// A row read with [`COLUMNS`], checked against its checksum.
fn checked_row(row: &rusqlite::Row<'_>) -> Result<Row, rusqlite::Error> {
    let r = Row {
        first_id: row.get(0)?,
        entries: row.get(1)?,
        at: RecordAt {
            segment: row.get::<_, i64>(2)? as u64,
            offset: row.get::<_, i64>(3)? as u64,
        },
        decided_to: row.get(4)?,
        ops: row.get(5)?,
    };
    let sum: i64 = row.get(6)?;
    if sum != record_checksum(&r) || r.entries < 1 {
        return Err(damaged(format!(
            "the views' row of the log's record of journal id {} does not match its checksum",
            r.first_id
        )));
    }
    Ok(r)
}

/// Writes the row of a record holding `entries`, the first of them under `first_id`.
pub(crate) fn insert(
    tx: &Connection,
    first_id: i64,
    entries: &[Entry],
    at: RecordAt,
) -> Result<(), rusqlite::Error> {
    let r = Row {
        first_id,
        entries: entries.len() as i64,
        at,
        decided_to: entries.iter().map(|e| e.completed_at).max().unwrap_or(0),
        ops: entries.iter().fold(0, |bits, e| bits | op_bit(e.op)),
    };
    tx.prepare_cached(&format!(
        "INSERT INTO records ({COLUMNS}) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)"
    ))?
    .execute(params![
        r.first_id,
        r.entries,
        r.at.segment as i64,
        r.at.offset as i64,
        r.decided_to,
        r.ops,
        record_checksum(&r)
    ])?;
    Ok(())
}

/// The last journal id the views gave (rows of `journal` and of `records`; 0: none).
pub(crate) fn last_id(conn: &Connection) -> Result<i64, rusqlite::Error> {
    let rows: i64 = conn.query_row("SELECT COALESCE(MAX(id), 0) FROM journal", [], |r| r.get(0))?;
    let records: Option<i64> = conn
        .prepare_cached(
            "SELECT first_id + entries - 1 FROM records ORDER BY first_id DESC LIMIT 1",
        )?
        .query_row([], |r| r.get(0))
        .optional()?;
    Ok(rows.max(records.unwrap_or(0)))
}

/// When the oldest record still held was decided, at the latest (ms).
pub(crate) fn oldest_decided(conn: &Connection) -> Result<Option<i64>, rusqlite::Error> {
    // Checked: the log's segments are retired by it.
    conn.prepare_cached(&format!(
        "SELECT {COLUMNS} FROM records ORDER BY first_id LIMIT 1"
    ))?
    .query_row([], checked_row)
    .optional()
    .map(|r| r.map(|r| r.decided_to))
}

/// The log's directory beside the views' file in `data_dir`.
pub(crate) fn log_dir(data_dir: &Path) -> PathBuf {
    data_dir.join("journal")
}

/// Reads records of the log from the views' `records` rows.
pub(crate) struct LogRecords<'a> {
    dir: &'a Path,
    /// The segment read last, kept open for the next record.
    open: Option<SegmentFile>,
}

impl<'a> LogRecords<'a> {
    pub(crate) fn new(dir: &'a Path) -> LogRecords<'a> {
        LogRecords { dir, open: None }
    }

    /// The entries of `r`'s record; `None` if its segment is no longer in the log (retired
    /// after the views let it go, and the views' forgetting lost with a crash).
    fn entries(&mut self, r: &Row) -> Result<Option<Vec<Entry>>, rusqlite::Error> {
        if self.open.as_ref().map(SegmentFile::first_lsn) != Some(r.at.segment) {
            let path = self.dir.join(format!("{:020}.log", r.at.segment));
            if !path.exists() {
                tracing::warn!(
                    segment = r.at.segment,
                    first_id = r.first_id,
                    "journal: a record the views name is in a segment no longer kept"
                );
                return Ok(None);
            }
            self.open = Some(SegmentFile::new(path, r.at.segment));
        }
        let file = self.open.as_ref().expect("opened above");
        // The log holds the only copy of the entries: a record that does not check out
        // is the log's damage, not the views'.
        let entries = file.record(r.at.offset).map_err(|e: IndexError| {
            rusqlite::Error::ToSqlConversionFailure(
                format!(
                    "journal corrupt: the log's record of journal id {} cannot be read \
                     ({e}). Restore the data dir from a backup (`nrtxn restore`)",
                    r.first_id
                )
                .into(),
            )
        })?;
        if entries.len() as i64 != r.entries {
            return Err(damaged(format!(
                "the views name {} entries at journal id {}, the log's record holds {}",
                r.entries,
                r.first_id,
                entries.len()
            )));
        }
        Ok(Some(entries))
    }

    /// Calls `f` with each entry whose journal id is in `after + 1 ..= upto`, with its id,
    /// in id order, until `f` says to stop (returns false); of the records with an op of
    /// `ops` (bits, [`op_bits`]) only, the others unread.
    pub(crate) fn each(
        &mut self,
        conn: &Connection,
        (after, upto): (i64, i64),
        ops: i64,
        mut f: impl FnMut(i64, Entry) -> Result<bool, rusqlite::Error>,
    ) -> Result<(), rusqlite::Error> {
        let mut stmt = conn.prepare_cached(&format!(
            "SELECT {COLUMNS} FROM records
             WHERE first_id >= (SELECT COALESCE(MAX(first_id), 0) FROM records
                                WHERE first_id <= ?1)
               AND first_id <= ?2
             ORDER BY first_id"
        ))?;
        let mut rows = stmt.query(params![after + 1, upto])?;
        while let Some(row) = rows.next()? {
            let r = checked_row(row)?;
            if r.last_id() <= after || r.first_id > upto || r.ops & ops == 0 {
                continue;
            }
            let Some(entries) = self.entries(&r)? else {
                continue;
            };
            for (i, e) in entries.into_iter().enumerate() {
                let id = r.first_id + i as i64;
                if id <= after || id > upto {
                    continue;
                }
                if !f(id, e)? {
                    return Ok(());
                }
            }
        }
        Ok(())
    }
}

/// Every `records` row checked against its checksum, as [`crate::views`]' check reads
/// the tables: how many are damaged, and the first one's description.
pub(crate) fn damaged_rows(conn: &Connection) -> Result<(u64, Option<String>), rusqlite::Error> {
    let (mut n, mut first) = (0u64, None);
    let mut stmt = conn.prepare(&format!("SELECT {COLUMNS} FROM records"))?;
    let mut rows = stmt.query([])?;
    while let Some(row) = rows.next()? {
        if let Err(e) = checked_row(row) {
            n += 1;
            first.get_or_insert_with(|| e.to_string());
        }
    }
    Ok((n, first))
}

/// Forgets the records whose entries the prune may take (see [`crate::views`]' `prune`):
/// up to `max` entries, of the oldest records all decided before `before` (ms), each
/// under `covered` (the last id the snapshot and the outbox's readers have passed) and
/// not holding the newest id `newest`. The ok sales among them decided from
/// `returnable_from` (ms) on are kept in `sales`, read from the log. Returns how many
/// entries went.
pub(crate) fn prune(
    tx: &Connection,
    log_dir: &Path,
    before: i64,
    max: usize,
    returnable_from: i64,
    covered: i64,
    newest: i64,
) -> Result<usize, rusqlite::Error> {
    if max == 0 {
        return Ok(0);
    }
    let candidates: Vec<Row> = {
        let mut stmt = tx.prepare_cached(&format!(
            "SELECT {COLUMNS} FROM records WHERE first_id + entries - 1 <= ?1
               AND first_id + entries - 1 < ?2 AND decided_to < ?4
             ORDER BY first_id LIMIT ?3"
        ))?;
        let rows = stmt.query_map(params![covered, newest, max as i64, before], checked_row)?;
        // A damaged row stops the prune there (the views' transaction it runs in must not
        // fail for it: that would stop the server); the reads that need the row refuse.
        let mut candidates = Vec::new();
        for row in rows {
            match row {
                Ok(r) => candidates.push(r),
                Err(e) => {
                    tracing::error!(error = %e, "journal: the prune stops at a damaged row of the views");
                    break;
                }
            }
        }
        candidates
    };
    let mut sale = tx.prepare_cached(
        "INSERT OR REPLACE INTO sales (shop, sale_key, item, sold, sold_at)
         VALUES (?1, ?2, ?3, ?4, ?5)",
    )?;
    let mut forget = tx.prepare_cached("DELETE FROM records WHERE first_id = ?1")?;
    let mut log = LogRecords::new(log_dir);
    let mut pruned = 0usize;
    for r in candidates {
        // The query took only records wholly past the window. A record is taken whole,
        // the first one even when it holds more entries than `max` (a large batch), or
        // the prune would stop there.
        if pruned > 0 && pruned + r.entries as usize > max {
            break;
        }
        let entries = match log.entries(&r) {
            Ok(entries) => entries.unwrap_or_default(),
            Err(e) => {
                tracing::error!(error = %e, "journal: the prune stops at a record it cannot read");
                break;
            }
        };
        for e in entries {
            let Some(key) = e.request_key.as_deref() else {
                continue;
            };
            if e.op == Op::Decrement && e.status == Status::Ok && e.completed_at >= returnable_from
            {
                sale.execute(params![&*e.shop, key, &*e.item, e.qty, e.completed_at])?;
            }
        }
        forget.execute([r.first_id])?;
        pruned += r.entries as usize;
    }
    Ok(pruned)
}
