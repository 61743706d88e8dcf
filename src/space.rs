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
//! - **Every write the server makes keeps the floor** (issue 26): the log's writer, the
//!   views' writer and the views' checkpoints ask [`Space::room_for`] before they write,
//!   with an upper bound of what the write adds to the disk. The floor is never the room
//!   of those writes: what is under way when the gate closes (the requests admitted in the
//!   last [`CHECK_EVERY`], the views' lag behind the log, their WAL copied back into the
//!   database file) is written in the room above the floor and in a **reserve**, a file
//!   of [`RESERVE_BYTES`] in the data dir ([`RESERVE_FILE`]), which a write that would
//!   cross the floor shrinks by what it needs before it writes. A write that does not fit
//!   even so waits for room as above. The reserve is made whole again once the disk has
//!   room for it above the floor; until then new writes are refused, so the writes that
//!   follow a closing gate find it whole. Whatever holds the views, their writer need only
//!   ask before it writes and say how much it may add.
//!
//! The minimum's default, 64 MiB, leaves room beside the reserve for what other programs
//! write on that disk. The views may lag the log by much more than the reserve holds (up
//! to 200,000 entries at 530 B to 2 KB each, `journal/store.rs`): past the room left, their
//! writer waits for space, at the floor, as above.

use std::fmt::Display;
use std::fs::File;
use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nrtxn_actors::StoreError;

/// How often the free space is read (one `statvfs`, about a microsecond), by the first
/// call after this long: a caller pays it at most ten times a second in all.
pub const CHECK_EVERY: Duration = Duration::from_millis(100);
/// How long a writer that found no room waits before it tries again.
pub const RETRY_EVERY: Duration = Duration::from_millis(200);
/// The default of `--disk-free-min-mb` (see the module's documentation).
pub const FREE_MIN_MB_DEFAULT: u64 = 64;
/// The reserve's size: room for the writes already under way when the gate closes,
/// without crossing the floor. Its largest parts: the views' checkpoint, which copies the
/// pages their WAL added into the database file before the WAL can be cut back (the WAL
/// is checkpointed every 500 ms, and every 256 views transactions from their writer; seen
/// on a 64 MiB tmpfs under batch load: 12 MB of WAL, most of it pages already in the
/// file), a views transaction (one 4 KiB page a random key index touches per entry: about
/// 4 MB for a batch of 1,000), and the log's records admitted in the last [`CHECK_EVERY`]
/// (about 1 MB at 70,000 entries/s). Past it, writers wait at the floor.
pub const RESERVE_BYTES: u64 = 16 * MIB;
/// The reserve's file, in the data dir. Not the server's data: deleting it loses nothing
/// (it is made again), but leaves the writes under way no room of their own.
pub const RESERVE_FILE: &str = "disk-reserve";

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
    /// The reserve (see the module's documentation). A `std` mutex: held only by writer
    /// threads and the gate's reading, for one `statvfs` and at most one `ftruncate` or
    /// `fallocate`, and it serializes the room's accounting between the writers.
    reserve: Mutex<Reserve>,
    /// Bytes writers have been granted by [`Space::room_for`] and may not have written
    /// yet: counted as used, since `statvfs` does not see them until they are written.
    claimed: AtomicU64,
}

/// The reserve's file and how much of the disk it holds now.
#[derive(Default)]
struct Reserve {
    /// `None` while the floor is off (`--disk-free-min-mb 0`) or the file cannot be made.
    file: Option<File>,
    /// Bytes the file holds on the disk (allocated, not only its length).
    held: u64,
}

/// Room granted to one write by [`Space::room_for`], counted as used until dropped:
/// drop it once the write is done (or failed).
#[must_use = "the room is counted as used only while the claim lives"]
pub struct Claim<'a> {
    space: &'a Space,
    bytes: u64,
}

impl Drop for Claim<'_> {
    fn drop(&mut self) {
        self.space.claimed.fetch_sub(self.bytes, Ordering::AcqRel);
    }
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
            reserve: Mutex::new(Reserve::default()),
            claimed: AtomicU64::new(0),
        })
    }

    /// Sets the free space below which new writes are refused and the server's own writes
    /// do not go, and makes the reserve (or removes it, with 0: the floor is off).
    pub fn set_free_min(&self, bytes: u64) {
        self.free_min_bytes.store(bytes, Ordering::Relaxed);
        self.checked_ms.store(0, Ordering::Relaxed);
        let Ok(mut reserve) = self.reserve.lock() else {
            return;
        };
        let path = self.dir.join(RESERVE_FILE);
        if bytes == 0 {
            *reserve = Reserve::default();
            let _ = std::fs::remove_file(&path);
            return;
        }
        let opened = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .read(true)
            .write(true)
            .open(&path)
            .and_then(|f| Ok((allocated(&f)?, f)));
        match opened {
            Ok((held, file)) => {
                *reserve = Reserve {
                    file: Some(file),
                    held,
                }
            }
            Err(e) => tracing::warn!(
                file = %path.display(),
                error = %e,
                "cannot make the disk's reserve: the server's writes under way when the \
                 gate closes wait at the floor instead"
            ),
        }
        if let Ok(free) = free_bytes(&self.dir) {
            self.keep_reserve(&mut reserve, free);
        }
    }

    /// Grants a write room for `bytes` more on the disk (an upper bound of what it adds)
    /// without crossing the floor, while `then` more bytes stay to be had after it (room
    /// the write's own sequel needs: the views' checkpoint of what it adds to the WAL).
    /// Uses the room above the floor first, then shrinks the reserve by what is missing.
    /// An error of kind [`io::ErrorKind::StorageFull`] when both together are too small:
    /// the caller waits for room ([`Space::retry`]) as if the disk had none.
    ///
    /// A write that finds the disk already below the floor (another program filled it)
    /// is granted its bytes from the reserve alone: it never takes the disk lower.
    pub fn room_for(&self, bytes: u64, then: u64) -> io::Result<Claim<'_>> {
        // A disk allocates whole blocks: a write of a few bytes at a file's end may take
        // one (seen on tmpfs: the floor crossed by 4 KiB, a log record's page).
        let bytes = bytes.div_ceil(BLOCK_BYTES) * BLOCK_BYTES + BLOCK_BYTES;
        let min = self.free_min_bytes.load(Ordering::Relaxed);
        let claim = |bytes| {
            self.claimed.fetch_add(bytes, Ordering::AcqRel);
            Claim { space: self, bytes }
        };
        if min == 0 {
            return Ok(claim(bytes));
        }
        let mut reserve = self
            .reserve
            .lock()
            .map_err(|_| io::Error::other("the disk's reserve is poisoned"))?;
        let above = self.above_floor(free_bytes(&self.dir)?, min);
        let draw = bytes.saturating_sub(above);
        if above + reserve.held < bytes + then {
            return Err(io::Error::new(
                io::ErrorKind::StorageFull,
                format!(
                    "{} wanted above the floor and {} after it, {} there and {} in the \
                     reserve",
                    mib(bytes),
                    mib(then),
                    mib(above),
                    mib(reserve.held)
                ),
            ));
        }
        if draw > 0 {
            let left = reserve.held - draw;
            let file = reserve.file.as_ref().ok_or_else(|| {
                io::Error::new(io::ErrorKind::StorageFull, "no reserve to draw on")
            })?;
            file.set_len(left)?;
            reserve.held = left;
            // The gate reads again at the next call: refused until the reserve is whole.
            self.checked_ms.store(0, Ordering::Relaxed);
            tracing::debug!(
                drawn = %mib(draw),
                left = %mib(left),
                "a write under way near the floor drew on the disk's reserve"
            );
        }
        Ok(claim(bytes))
    }

    /// Whether room is short: new writes are refused, or the reserve is not whole. Then
    /// the writers give back what they can (the views' WAL is cut back at its checkpoint)
    /// even at some cost to their speed.
    pub fn short(&self) -> bool {
        self.refusing.load(Ordering::Acquire)
            || (self.free_min_bytes.load(Ordering::Relaxed) > 0
                && self
                    .reserve
                    .lock()
                    .is_ok_and(|r| r.file.is_some() && r.held < RESERVE_BYTES))
    }

    /// Bytes the server's writes may still add without crossing the floor: the room above
    /// it and the reserve. `u64::MAX` while the floor is off.
    pub fn room(&self) -> u64 {
        let min = self.free_min_bytes.load(Ordering::Relaxed);
        if min == 0 {
            return u64::MAX;
        }
        let held = self.reserve.lock().map_or(0, |r| r.held);
        match free_bytes(&self.dir) {
            Ok(free) => self.above_floor(free, min) + held,
            Err(_) => u64::MAX,
        }
    }

    /// The room above the floor, less what writers were granted and may not have written.
    fn above_floor(&self, free: u64, min: u64) -> u64 {
        free.saturating_sub(self.claimed.load(Ordering::Acquire))
            .saturating_sub(min)
    }

    /// Makes the reserve whole if the disk has room for it above the floor. Whether it is
    /// whole (always, while the floor is off).
    fn keep_reserve(&self, reserve: &mut Reserve, free: u64) -> bool {
        let min = self.free_min_bytes.load(Ordering::Relaxed);
        if min == 0 {
            return true;
        }
        let Some(file) = &reserve.file else {
            // It could not be made (said at start): the writers have the floor's room only.
            return true;
        };
        if reserve.held >= RESERVE_BYTES {
            return true;
        }
        if self.above_floor(free, min) < RESERVE_BYTES - reserve.held {
            return false;
        }
        if let Err(e) = fill(file, RESERVE_BYTES) {
            tracing::warn!(error = %e, "cannot make the disk's reserve whole; trying again");
        }
        reserve.held = allocated(file).unwrap_or(reserve.held);
        if reserve.held >= RESERVE_BYTES {
            tracing::debug!(reserve = %mib(reserve.held), "the disk's reserve is whole again");
        }
        reserve.held >= RESERVE_BYTES
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
        let (whole, held) = match self.reserve.lock() {
            Ok(mut reserve) => (self.keep_reserve(&mut reserve, free), reserve.held),
            Err(_) => (true, 0),
        };
        let refuse = free < min || !whole || self.waiting.load(Ordering::Acquire) > 0;
        let was = self.refusing.swap(refuse, Ordering::AcqRel);
        if refuse && !was {
            tracing::error!(
                data_dir = %self.dir.display(),
                free = %mib(free),
                min = %mib(min),
                reserve = %mib(held),
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
/// The block a disk allocates, at most: 4 KiB for ext4, XFS and tmpfs on x86-64.
const BLOCK_BYTES: u64 = 4096;

/// Bytes `file` holds on its disk: its allocated blocks, not its length (a file cut short
/// by a crash of `fill`, or copied sparse, holds less than its length says).
fn allocated(file: &File) -> io::Result<u64> {
    let meta = file.metadata()?;
    Ok(meta.len().min(meta.blocks() * 512))
}

/// Allocates `file`'s first `len` bytes on the disk.
fn fill(file: &File, len: u64) -> io::Result<()> {
    match rustix::fs::fallocate(file, rustix::fs::FallocateFlags::empty(), 0, len) {
        Ok(()) => Ok(()),
        // A filesystem without fallocate: zeros, written.
        Err(rustix::io::Errno::OPNOTSUPP) => {
            use std::io::{Seek, Write};
            let mut f = file;
            let from = allocated(file)?;
            f.seek(io::SeekFrom::Start(from))?;
            let zeros = vec![0u8; 1 << 20];
            let mut at = from;
            while at < len {
                let n = (len - at).min(zeros.len() as u64) as usize;
                f.write_all(&zeros[..n])?;
                at += n as u64;
            }
            f.sync_data()
        }
        Err(e) => Err(e.into()),
    }
}

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
    fn a_write_past_the_floor_draws_on_the_reserve_which_is_made_whole_once_there_is_room() {
        let dir = tempfile::tempdir().unwrap();
        let space = Space::new(dir.path());
        let free = free_bytes(dir.path()).unwrap();
        // The floor just under the free space: the reserve, made at once, takes the rest.
        space.set_free_min(free.saturating_sub(RESERVE_BYTES + MIB));
        let made = space.reserve.lock().unwrap().held;
        assert_eq!(made, RESERVE_BYTES);
        assert!(space.admit().is_ok());
        // Room for more than is above the floor: drawn from the reserve, and the gate
        // closes until the reserve can be made whole again.
        let claim = space.room_for(4 * MIB, 0).unwrap();
        assert!(space.reserve.lock().unwrap().held < RESERVE_BYTES);
        drop(claim);
        space.set_free_min(free_bytes(dir.path()).unwrap() + MIB);
        assert!(matches!(space.admit(), Err(StoreError::DiskFull)));
        // More than the room and the reserve together: refused as a full disk.
        let err = space.room_for(2 * RESERVE_BYTES, 0).err().unwrap();
        assert!(io_no_room(&err), "{err}");
        // Room again: the reserve is made whole and the gate opens.
        space.set_free_min(MIB);
        assert!(space.admit().is_ok());
        assert_eq!(space.reserve.lock().unwrap().held, RESERVE_BYTES);
        space.set_free_min(0);
        assert!(!dir.path().join(RESERVE_FILE).exists());
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
