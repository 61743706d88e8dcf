//! Room on the data dir's disk (issue 14, the disk-full case).
//!
//! A full disk must not stop the server, lose an answer or hang a caller. So:
//! - **New writes are refused** (`503 disk_full`) while the disk holding the data dir has
//!   less than `--disk-free-min-mb` free, read at most every [`CHECK_EVERY`] as calls
//!   come in ([`Space::admit`]). Reads, polls and repeats of decided keys go on.
//! - **A write that finds no room waits for it** ([`Space::retry`]) instead of stopping
//!   the process: the log's writer cuts off the record it could not finish and writes it
//!   again, the views' writer rolls its transaction back and runs it again. Nothing
//!   waiting is answered before it is durable, so its callers get their outcome late, or
//!   `504 pending` at the reply timeout and poll it later. A stop gives up the wait
//!   ([`Space::stop_waiting`]): what was not written was never acknowledged.
//! - **A start on a disk below the minimum is refused** ([`check_at_start`]) with what
//!   is free and what to do: recovery itself writes (the views catch up with the log),
//!   and every write would be refused anyway.
//!
//! The minimum's default, 64 MiB, is room for what is under way when the gate closes:
//! the requests admitted in the last [`CHECK_EVERY`] (about 7,000 at the 70,000/s the
//! batch benchmark reaches, some 8 MB in the log and the views) and the views' usual lag
//! behind the log. The views may lag by more (up to 200,000 entries at 530 B to 2 KB
//! each, `journal/store.rs`): past the room left, their writer waits for space as above.

use std::fmt::Display;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use nrtxn_actors::StoreError;

/// How often the free space is read (one `statvfs`, about a microsecond), by the first
/// call after this long: a caller pays it at most ten times a second in all.
pub const CHECK_EVERY: Duration = Duration::from_millis(100);
/// How long a writer that found no room waits before it tries again.
pub const RETRY_EVERY: Duration = Duration::from_millis(200);
/// The default of `--disk-free-min-mb` (see the module's documentation).
pub const FREE_MIN_MB_DEFAULT: u64 = 64;

/// The room on one data dir's disk, shared by its writers and its admission gate.
pub struct Space {
    /// The data dir: the free space of its filesystem is what counts.
    dir: PathBuf,
    /// Below this many free bytes, new writes are refused (`--disk-free-min-mb`).
    /// Atomic because the server sets it after the store that made this is open.
    free_min_bytes: AtomicU64,
    /// When this was made: `checked_ms` counts from it.
    born: Instant,
    /// When the free space was last read, in ms since `born`, plus one (0: never).
    checked_ms: AtomicU64,
    /// Whether new writes are refused now: the last reading was below the minimum, or
    /// a writer is waiting for room.
    refusing: AtomicBool,
    /// Writers waiting for room now: while any does, writes stay refused whatever the
    /// reading says, since what they wait to write comes first.
    waiting: AtomicUsize,
    /// Set once the server stops: a writer waiting for room gives up.
    stopping: AtomicBool,
}

impl Space {
    pub fn new(dir: &Path) -> Arc<Space> {
        Arc::new(Space {
            dir: dir.to_path_buf(),
            free_min_bytes: AtomicU64::new(FREE_MIN_MB_DEFAULT * MIB),
            born: Instant::now(),
            checked_ms: AtomicU64::new(0),
            refusing: AtomicBool::new(false),
            waiting: AtomicUsize::new(0),
            stopping: AtomicBool::new(false),
        })
    }

    /// Sets the free space below which new writes are refused.
    pub fn set_free_min(&self, bytes: u64) {
        self.free_min_bytes.store(bytes, Ordering::Relaxed);
        self.checked_ms.store(0, Ordering::Relaxed);
    }

    /// `Err(StoreError::DiskFull)` while new writes are refused (see the module's
    /// documentation). Reads the free space if the last reading is older than
    /// [`CHECK_EVERY`]; otherwise costs two atomic loads and a clock read.
    pub fn admit(&self) -> Result<(), StoreError> {
        let now = self.born.elapsed().as_millis() as u64 + 1;
        let last = self.checked_ms.load(Ordering::Relaxed);
        if (last == 0 || now.saturating_sub(last) >= CHECK_EVERY.as_millis() as u64)
            && self
                .checked_ms
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            self.check();
        }
        if self.refusing.load(Ordering::Acquire) {
            Err(StoreError::DiskFull)
        } else {
            Ok(())
        }
    }

    /// Reads the free space and opens or closes the gate, saying so in the log when it
    /// changes. A failed reading leaves the gate as it was.
    fn check(&self) {
        let free = match free_bytes(&self.dir) {
            Ok(free) => free,
            Err(e) => {
                tracing::warn!(dir = %self.dir.display(), error = %e, "cannot read the data dir's free space");
                return;
            }
        };
        let min = self.free_min_bytes.load(Ordering::Relaxed);
        let refuse = free < min || self.waiting.load(Ordering::Acquire) > 0;
        let was = self.refusing.swap(refuse, Ordering::AcqRel);
        if refuse && !was {
            tracing::error!(
                data_dir = %self.dir.display(),
                free = %mib(free),
                min = %mib(min),
                "the data dir's disk is full: new writes are refused (503 disk_full) until it \
                 has room again; free space on that disk (do not delete files in the data \
                 dir, they hold acknowledged requests)"
            );
        } else if was && !refuse {
            tracing::warn!(
                data_dir = %self.dir.display(),
                free = %mib(free),
                "the data dir's disk has room again: writes are taken"
            );
        }
    }

    /// Runs `write` until it succeeds, fails for a reason other than want of room
    /// (`no_room` tells), or the server stops. While it finds no room, new writes are
    /// refused, and it tries again every [`RETRY_EVERY`]: `write` must leave nothing
    /// behind when it fails (a log record cut off, a transaction rolled back), so that
    /// each try writes the same thing. Waits for as long as the disk stays full: the
    /// operator's freeing space or the stop ends it.
    pub fn retry<T, E: Display>(
        &self,
        what: &str,
        mut write: impl FnMut() -> Result<T, E>,
        no_room: impl Fn(&E) -> bool,
    ) -> Result<T, E> {
        let mut since: Option<Instant> = None;
        loop {
            match write() {
                Err(e) if no_room(&e) && !self.stopping.load(Ordering::Acquire) => {
                    if since.is_none() {
                        since = Some(Instant::now());
                        self.waiting.fetch_add(1, Ordering::AcqRel);
                        if !self.refusing.swap(true, Ordering::AcqRel) {
                            tracing::error!(
                                data_dir = %self.dir.display(),
                                error = %e,
                                "{what}: no room left on the data dir's disk: new writes are \
                                 refused (503 disk_full), and this one waits for room; free \
                                 space on that disk (do not delete files in the data dir, \
                                 they hold acknowledged requests)"
                            );
                        }
                    }
                    std::thread::sleep(RETRY_EVERY);
                }
                other => {
                    if let Some(since) = since {
                        self.waiting.fetch_sub(1, Ordering::AcqRel);
                        // The next call reads the free space again and opens the gate.
                        self.checked_ms.store(0, Ordering::Relaxed);
                        match &other {
                            Ok(_) => tracing::warn!(
                                waited_ms = since.elapsed().as_millis() as u64,
                                "{what}: written once the disk had room again"
                            ),
                            Err(e) if no_room(e) => tracing::error!(
                                data_dir = %self.dir.display(),
                                "{what}: stopping with the data dir's disk still full; what \
                                 was not written was never acknowledged (its callers got 503, \
                                 or 504 and a poll). Free space on that disk, then start again"
                            ),
                            Err(_) => {}
                        }
                    }
                    return other;
                }
            }
        }
    }

    /// Whether a writer is waiting for room now.
    pub fn waiting(&self) -> bool {
        self.waiting.load(Ordering::Acquire) > 0
    }

    /// The server is stopping: a writer waiting for room gives up, and the next one that
    /// finds none fails at once.
    pub fn stop_waiting(&self) {
        self.stopping.store(true, Ordering::Release);
    }
}

const MIB: u64 = 1024 * 1024;

fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / MIB as f64)
}

/// Bytes an unprivileged writer may still use on the filesystem holding `path`, or
/// holding its nearest existing parent (the data dir may not exist yet).
pub fn free_bytes(path: &Path) -> io::Result<u64> {
    let mut at = Some(path);
    while let Some(p) = at {
        let probe = if p.as_os_str().is_empty() {
            Path::new(".")
        } else {
            p
        };
        match rustix::fs::statvfs(probe) {
            Ok(st) => return Ok(st.f_bavail.saturating_mul(st.f_frsize)),
            Err(e) if e == rustix::io::Errno::NOENT && !p.as_os_str().is_empty() => {
                at = p.parent();
            }
            Err(e) => return Err(e.into()),
        }
    }
    Err(io::Error::new(
        io::ErrorKind::NotFound,
        format!("no existing folder above {}", path.display()),
    ))
}

/// Refuses a start on a disk with less than `free_min_bytes` free, saying how much is
/// free and what to do. A reading that fails is not a refusal: the start goes on and
/// meets whatever the disk says.
pub fn check_at_start(data_dir: &Path, free_min_bytes: u64) -> anyhow::Result<()> {
    if free_min_bytes == 0 {
        return Ok(());
    }
    let free = match free_bytes(data_dir) {
        Ok(free) => free,
        Err(e) => {
            tracing::warn!(dir = %data_dir.display(), error = %e, "cannot read the data dir's free space");
            return Ok(());
        }
    };
    if free < free_min_bytes {
        anyhow::bail!(
            "data_dir: the disk holding {} is full: {} free, less than the {} the server keeps \
             free (--disk-free-min-mb), so it does not start: recovery writes, and every \
             write would be refused. Free space on that disk (remove files that are not the \
             server's, or grow the volume; do not delete files in the data dir, they hold \
             acknowledged requests), then start again",
            data_dir.display(),
            mib(free),
            mib(free_min_bytes),
        );
    }
    Ok(())
}

/// Whether an I/O error means the disk (or the user's quota) has no room.
pub fn io_no_room(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::StorageFull | io::ErrorKind::QuotaExceeded
    )
}

/// Whether an SQLite error means the disk has no room (`SQLITE_FULL`).
pub fn sqlite_no_room(e: &rusqlite::Error) -> bool {
    matches!(e, rusqlite::Error::SqliteFailure(f, _) if f.code == rusqlite::ErrorCode::DiskFull)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn no_room() -> io::Error {
        io::Error::from_raw_os_error(28)
    }

    #[test]
    fn a_write_that_finds_no_room_refuses_new_writes_and_is_tried_again_until_it_fits() {
        let dir = tempfile::tempdir().unwrap();
        let space = Space::new(dir.path());
        space.set_free_min(0);
        assert!(space.admit().is_ok());
        let mut tries = 0;
        let seen_refusing = std::sync::Mutex::new(Vec::new());
        let result = space.retry(
            "test",
            || {
                tries += 1;
                seen_refusing.lock().unwrap().push(space.admit().is_err());
                if tries < 3 {
                    Err(no_room())
                } else {
                    Ok(tries)
                }
            },
            io_no_room,
        );
        assert_eq!(result.unwrap(), 3);
        // Refused from the first failure on (the first try saw the gate open).
        assert_eq!(*seen_refusing.lock().unwrap(), vec![false, true, true]);
        // Open again once the write went through and the disk reads as having room.
        assert!(space.admit().is_ok());
    }

    #[test]
    fn a_stop_ends_the_wait_for_room_with_the_error() {
        let dir = tempfile::tempdir().unwrap();
        let space = Space::new(dir.path());
        space.stop_waiting();
        let mut tries = 0;
        let result: Result<(), io::Error> = space.retry(
            "test",
            || {
                tries += 1;
                Err(no_room())
            },
            io_no_room,
        );
        assert!(io_no_room(&result.unwrap_err()));
        assert_eq!(tries, 1);
    }

    #[test]
    fn other_errors_are_not_retried() {
        let dir = tempfile::tempdir().unwrap();
        let space = Space::new(dir.path());
        let mut tries = 0;
        let result: Result<(), io::Error> = space.retry(
            "test",
            || {
                tries += 1;
                Err(io::Error::other("broken"))
            },
            io_no_room,
        );
        assert!(result.is_err());
        assert_eq!(tries, 1);
    }

    #[test]
    fn a_minimum_above_the_free_space_refuses_new_writes_and_the_start() {
        let dir = tempfile::tempdir().unwrap();
        let free = free_bytes(dir.path()).unwrap();
        let space = Space::new(dir.path());
        space.set_free_min(free.saturating_mul(2).max(1));
        assert!(matches!(space.admit(), Err(StoreError::DiskFull)));
        let err = check_at_start(&dir.path().join("not-yet"), free.saturating_mul(2).max(1))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("is full") && err.contains("Free space on that disk"),
            "{err}"
        );
        space.set_free_min(0);
        assert!(space.admit().is_ok());
        assert!(check_at_start(dir.path(), 0).is_ok());
    }
}
