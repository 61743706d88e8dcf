//! `nrtxn backup` and `nrtxn restore`: a copy of an embedded data dir, taken while the
//! server runs, that starts as the acknowledged state at the moment it was taken.
//!
//! A backup copies, in this order:
//! 1. the log's segments as they are;
//! 2. the views (`nrtxn.db`), the access keys (`keys.sqlite`) and the shops' check-back
//!    settings (`checks.sqlite`), each as one consistent snapshot (`VACUUM INTO`), the
//!    views' log position with them;
//! 3. the segments again: every one that is new or has grown since step 1, so the copy
//!    of the log reaches at least as far as the views do.
//!
//! Then the copy is checked as a start would check it ([`scan`] from the views'
//! position: every checksum, the chain, no gap), and the older segments are read whole
//! as well ([`verify_unread`]): a backup of a damaged log is refused. A segment retired between steps 1 and 3
//! could leave a gap; the backup then starts over (a few times at most).
//!
//! The last record of a segment still being written may be copied half: that is a torn
//! tail, which a start of the copy cuts off. It was not yet acknowledged when the copy
//! reached it, so the copy holds everything acknowledged before the backup began.
//!
//! The backup folder and the keys' and settings' copies are owner-only (they hold key
//! hashes and signing secrets).
//!
//! A restore brings the access keys back only when asked ([`KeysFrom`]): a key revoked
//! after the backup was taken (say, a leaked one) must not come back to life without a
//! word. `--keys-from backup` takes the backup's keys and prints every active one it
//! brings back; `--keys-from DIR` takes the keys of another data dir (the one being
//! replaced, with its revocations up to now). The check-back settings always come back:
//! without them the restored server would stop checking back without a word.
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use rusqlite::{Connection, OpenFlags};

use nrtxn_embedded::views::read_log_mark;
use nrtxn_log::segment::{scan, segments, verify_unread, Chain};

const VIEWS: &str = "nrtxn.db";
const KEYS: &str = "keys.sqlite";
const CHECKS: &str = "checks.sqlite";
/// The push stream's cursor key: without it a restored server would refuse every cursor
/// handed out before (a follower resuming would have to start over).
const CURSOR_KEY: &str = crate::stream::CURSOR_KEY_FILE;
const LOG_DIR: &str = "journal";
const ATTEMPTS: u32 = 5;

/// What a backup holds, for the message at its end.
#[derive(Debug)]
pub struct BackupReport {
    pub segments: usize,
    pub bytes: u64,
    pub records: u64,
}

/// Copies the data dir `from` into the new folder `to` (see the module's documentation).
pub fn backup(from: &Path, to: &Path) -> anyhow::Result<BackupReport> {
    if !from.join(VIEWS).exists() {
        bail!(
            "{} holds no embedded journal (no {VIEWS}); with --mongo-uri, back MongoDB up with its own tools",
            from.display()
        );
    }
    let mut last_err = None;
    for attempt in 1..=ATTEMPTS {
        if to.exists() && std::fs::read_dir(to)?.next().is_some() {
            if attempt == 1 {
                bail!("--to {} exists and is not empty", to.display());
            }
            std::fs::remove_dir_all(to)?;
        }
        match try_backup(from, to) {
            Ok(report) => return Ok(report),
            Err(e) => {
                tracing::warn!(attempt, error = %e, "backup not consistent; starting over");
                last_err = Some(e);
            }
        }
    }
    Err(last_err.expect("at least one attempt")).context("backup failed")
}

fn try_backup(from: &Path, to: &Path) -> anyhow::Result<BackupReport> {
    let log_to = to.join(LOG_DIR);
    nrtxn_log::secret_file::create_dir(to)?;
    std::fs::create_dir_all(&log_to)?;
    let mut copied: Vec<(PathBuf, u64)> = Vec::new();
    copy_segments(&from.join(LOG_DIR), &log_to, &mut copied)?;
    snapshot_sqlite(&from.join(VIEWS), &to.join(VIEWS))?;
    for f in [KEYS, CHECKS] {
        if from.join(f).exists() {
            nrtxn_log::secret_file::prepare(&to.join(f))?;
            snapshot_sqlite(&from.join(f), &to.join(f))?;
        }
    }
    copy_segments(&from.join(LOG_DIR), &log_to, &mut copied)?;
    copy_private(&from.join(CURSOR_KEY), &to.join(CURSOR_KEY))?;
    // The copy starts as a start would: from where its views stand.
    let mark = views_mark(&to.join(VIEWS))?;
    let from_chain = match mark {
        Some(m) => m,
        None if !copied.is_empty() => Chain {
            next_lsn: 1,
            ..Chain::default()
        },
        None => Chain::default(),
    };
    let end =
        scan(&log_to, from_chain, None, |_| Ok(())).context("the copied log does not check out")?;
    // A backup is read again only when it is needed: every segment is read whole now.
    verify_unread(&end.unread).context("the copied log does not check out")?;
    for f in [VIEWS, KEYS, CHECKS, CURSOR_KEY] {
        if to.join(f).exists() {
            std::fs::File::open(to.join(f))?.sync_all()?;
        }
    }
    std::fs::File::open(&log_to)?.sync_all()?;
    std::fs::File::open(to)?.sync_all()?;
    Ok(BackupReport {
        segments: segments(&log_to)?.len(),
        bytes: copied.iter().map(|(_, n)| n).sum(),
        records: end.records,
    })
}

/// Copies every segment of `from` that `copied` does not have at its current length, and
/// the newest one always: written into a spare, it holds more records at the same length.
fn copy_segments(from: &Path, to: &Path, copied: &mut Vec<(PathBuf, u64)>) -> anyhow::Result<()> {
    let segs = segments(from)?;
    let newest = segs.last().map(|(first, _)| *first);
    for (first, path) in segs {
        let name = path.file_name().expect("a segment has a name");
        let len = match std::fs::metadata(&path) {
            Ok(m) => m.len(),
            // Retired since it was listed: the views hold it for good.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(e.into()),
        };
        if Some(first) != newest && copied.iter().any(|(p, n)| p == &path && *n >= len) {
            continue;
        }
        let target = to.join(name);
        let n = match std::fs::copy(&path, &target) {
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(e.into()),
        };
        std::fs::File::open(&target)?.sync_all()?;
        copied.retain(|(p, _)| p != &path);
        copied.push((path, n));
    }
    Ok(())
}

/// Copies a small secret file, if there is one, into a new owner-only file.
fn copy_private(from: &Path, to: &Path) -> anyhow::Result<()> {
    let bytes = match std::fs::read(from) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e).with_context(|| format!("cannot read {}", from.display())),
    };
    nrtxn_log::secret_file::prepare(to)?;
    std::fs::write(to, bytes).with_context(|| format!("cannot write {}", to.display()))
}

/// One consistent copy of a live SQLite database (its WAL included).
fn snapshot_sqlite(from: &Path, to: &Path) -> anyhow::Result<()> {
    let conn = Connection::open_with_flags(from, OpenFlags::SQLITE_OPEN_READ_ONLY)
        .with_context(|| format!("cannot open {}", from.display()))?;
    conn.busy_timeout(std::time::Duration::from_secs(10))?;
    let target = to.to_str().context("the backup's path is not UTF-8")?;
    conn.execute("VACUUM INTO ?1", [target])
        .with_context(|| format!("cannot copy {}", from.display()))?;
    Ok(())
}

fn views_mark(views: &Path) -> anyhow::Result<Option<Chain>> {
    let conn = Connection::open_with_flags(views, OpenFlags::SQLITE_OPEN_READ_ONLY)?;
    Ok(read_log_mark(&conn)?)
}

/// Where a restore takes the access keys from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KeysFrom {
    /// Nowhere: the restored data dir starts with no key (create new ones).
    Nothing,
    /// The backup's own keys, as they were when it was taken.
    Backup,
    /// The key store of this data dir, as it is now (revocations since the backup kept).
    DataDir(PathBuf),
}

impl std::str::FromStr for KeysFrom {
    type Err = std::convert::Infallible;
    fn from_str(s: &str) -> Result<KeysFrom, Self::Err> {
        Ok(match s {
            "backup" => KeysFrom::Backup,
            "none" => KeysFrom::Nothing,
            dir => KeysFrom::DataDir(PathBuf::from(dir)),
        })
    }
}

/// What a restore brought back, for its message.
#[derive(Debug, Default)]
pub struct RestoreReport {
    /// The active keys now in the restored store: (id, name, shop or `*`, role).
    pub keys: Vec<(String, String, String, String)>,
    /// Keys the backup holds that were left out (with [`KeysFrom::Nothing`]).
    pub keys_left_out: usize,
    /// Whether the shops' check-back settings came back.
    pub checks: bool,
}

/// Copies a backup into a new data dir, which must not exist or be empty.
pub fn restore(backup: &Path, data_dir: &Path, keys: &KeysFrom) -> anyhow::Result<RestoreReport> {
    if !backup.join(VIEWS).exists() {
        bail!("{} is not an nrtxn backup (no {VIEWS})", backup.display());
    }
    if data_dir.exists() && std::fs::read_dir(data_dir)?.next().is_some() {
        bail!(
            "--data-dir {} is not empty: restore into a new folder (and stop any server on the old one)",
            data_dir.display()
        );
    }
    let keys_source = match keys {
        KeysFrom::Nothing => None,
        KeysFrom::Backup => Some(backup.join(KEYS)),
        KeysFrom::DataDir(dir) => {
            let path = dir.join(KEYS);
            if !path.exists() {
                bail!("--keys-from {}: no {KEYS} there", dir.display());
            }
            Some(path)
        }
    };
    let log_to = data_dir.join(LOG_DIR);
    std::fs::create_dir_all(&log_to)?;
    std::fs::copy(backup.join(VIEWS), data_dir.join(VIEWS))?;
    let mut report = RestoreReport::default();
    if backup.join(CHECKS).exists() {
        nrtxn_log::secret_file::prepare(&data_dir.join(CHECKS))?;
        snapshot_sqlite(&backup.join(CHECKS), &data_dir.join(CHECKS))?;
        report.checks = true;
    }
    match keys_source {
        Some(path) if path.exists() => {
            nrtxn_log::secret_file::prepare(&data_dir.join(KEYS))?;
            snapshot_sqlite(&path, &data_dir.join(KEYS))?;
            report.keys = active_keys(&data_dir.join(KEYS))?;
        }
        Some(_) => {}
        None if backup.join(KEYS).exists() => {
            report.keys_left_out = active_keys(&backup.join(KEYS))?.len();
        }
        None => {}
    }
    copy_private(&backup.join(CURSOR_KEY), &data_dir.join(CURSOR_KEY))?;
    for f in [VIEWS, KEYS, CHECKS, CURSOR_KEY] {
        if data_dir.join(f).exists() {
            std::fs::File::open(data_dir.join(f))?.sync_all()?;
        }
    }
    let mut copied = Vec::new();
    copy_segments(&backup.join(LOG_DIR), &log_to, &mut copied)?;
    std::fs::File::open(&log_to)?.sync_all()?;
    std::fs::File::open(data_dir)?.sync_all()?;
    Ok(report)
}

/// The unrevoked keys of a key store: (id, name, shop or `*`, role).
fn active_keys(path: &Path) -> anyhow::Result<Vec<(String, String, String, String)>> {
    let conn = Connection::open_with_flags(path, OpenFlags::SQLITE_OPEN_READ_ONLY)
        .with_context(|| format!("cannot open {}", path.display()))?;
    let mut stmt = conn.prepare(
        "SELECT id, name, COALESCE(shop, '*'), role FROM keys WHERE revoked_at IS NULL ORDER BY id",
    )?;
    let rows = stmt
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)))?
        .collect::<Result<Vec<_>, _>>()?;
    Ok(rows)
}
