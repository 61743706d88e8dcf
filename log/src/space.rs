//! Room on the data dir's disk: a full disk, and the floor the server's writes keep.
//!
//! A full disk must not stop the server, lose an answer or hang a caller, and the
//! server's own writes must leave `--disk-free-min-mb` free (the **floor**) for everything
//! else on that disk. So:
//! - **Every write the server makes asks for room first** ([`Space::room_for`]), with an
//!   upper bound of the bytes it may add to the disk, and is granted it only if the disk
//!   keeps the floor free with every other grant still outstanding. Every file the
//!   server writes in the data dir after its start: the log's segments (each record, the
//!   footer that seals a segment) and its durable mark (`journal/store.rs`); the views'
//!   WAL and its index, each transaction's frames, and the database file, which their
//!   checkpoints write through a standing grant the views' writer takes before it
//!   commits pages the checkpoint will add ([`Claim::try_grow_to`], `sqlite.rs`); and
//!   `checks.sqlite` (`checkback.rs`). Grants are counted until the write is on the disk
//!   (where `statvfs` sees it) or, for the standing one, until the checkpoint has
//!   copied it. A store needs no more than this to keep the floor, whatever holds the
//!   views: ask before it writes, with a bound it can show holds.
//! - **A write not granted waits for room** ([`Space::retry`]) instead of stopping the
//!   process: the log's writer tries its record again, the views' writer rolls its
//!   transaction back and runs it again. While one waits, new writes are refused, and
//!   the views give back what they can ([`Space::short`]: their WAL is checkpointed and
//!   cut to nothing, which the standing grant has room for). Nothing waiting is answered
//!   before it is durable, so its callers get their outcome late, or `504 pending` at
//!   the reply timeout and poll it later. A stop gives up the wait
//!   ([`Space::stop_waiting`]): what was not written was never acknowledged.
//! - **New writes are refused** (`503 disk_full`) while the free space, less what is
//!   granted, is under the floor plus a **headroom** of an eighth of the floor: room for
//!   what was admitted before the gate closed, read at most every [`CHECK_EVERY`] as
//!   calls come in ([`Space::admit`]). Reads, polls and repeats of decided keys go on.
//!   Writes are taken again as soon as that much is free: nothing else must be made
//!   whole first.
//! - **A start on a disk below the floor plus [`START_BYTES`] is refused**
//!   ([`check_at_start`]) with what is free and what to do: a start writes (the key and
//!   check-back stores, the stream's cursor key, the views' schema) before its writers
//!   ask, and recovery itself writes (the views catch up with the log, within the floor
//!   like any write).
//!
//! The floor's default, 64 MiB, leaves room for other programs on that disk. The
//! headroom (8 MiB by default) covers the requests admitted in the last [`CHECK_EVERY`]
//! at the campaign's rates; under heavier load (the batch benchmark's 70,000 entries/s
//! add some 8 MB to the log and more to the views' WAL in that time) what does not fit
//! waits for room at the floor, as above.

use std::fmt::Display;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nrtxn_actors::StoreError;

/// How often the free space is read for the gate (one `statvfs`, about a microsecond),
/// by the first call after this long: a caller pays it at most ten times a second in all.
pub const CHECK_EVERY: Duration = Duration::from_millis(100);
/// How long a writer that found no room waits before it tries again.
pub const RETRY_EVERY: Duration = Duration::from_millis(200);
/// The default of `--disk-free-min-mb` (see the module's documentation).
pub const FREE_MIN_MB_DEFAULT: u64 = 64;
/// Free space a start needs above the floor: what it writes before its writers ask for
/// room (seen on a tmpfs: 0.35 MiB on a new data dir: the key and check-back stores with
/// their WAL and index files, the views' schema, the log's first segment and mark).
pub const START_BYTES: u64 = MIB;
/// The headroom above the floor at which the gate closes, as a part of the floor.
const HEADROOM_PART: u64 = 8;
/// The block a disk allocates, at most: 4 KiB for ext4, XFS and tmpfs on x86-64.
pub const BLOCK_BYTES: u64 = 4096;

/// The room on one data dir's disk, shared by its writers and its admission gate.
pub struct Space {
    /// The data dir: the free space of its filesystem is what counts.
    dir: PathBuf,
    /// The floor: free bytes the server's writes never take (`--disk-free-min-mb`; 0: no
    /// floor, and no accounting).
    free_min_bytes: u64,
    /// When this was made: `checked_ms` counts from it.
    born: Instant,
    /// When the free space was last read, in ms since `born`, plus one (0: never).
    checked_ms: AtomicU64,
    /// Whether new writes are refused now: the last reading was below the floor plus the
    /// headroom, or a writer is waiting for room.
    refusing: AtomicBool,
    /// Writers waiting for room now: while any does, writes stay refused whatever the
    /// reading says, since what they wait to write comes first.
    waiting: AtomicUsize,
    /// Set once the server stops: a writer waiting for room gives up.
    stopping: AtomicBool,
    /// Bytes granted ([`Claim`]s alive) that `statvfs` may not see yet. Changed only
    /// under `grants` when it grows, so that two writers are never granted the same room.
    granted: AtomicU64,
    /// Held while a grant is decided: one `statvfs` and a sum. A `std` mutex: held by
    /// writer threads only, never across an await or a write.
    grants: Mutex<()>,
}

/// Room granted by [`Space::room_for`], counted as taken until dropped (or shrunk): keep
/// it until what it was for is written, so that `statvfs` sees it.
#[must_use = "the room is counted as taken only while the claim lives"]
pub struct Claim {
    space: Arc<Space>,
    bytes: u64,
}

impl Claim {
    /// Bytes this claim holds.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Grows the claim to `bytes` if the disk has room for the difference (as
    /// [`Space::room_for`]); a claim already that large stays as it is.
    pub fn try_grow_to(&mut self, bytes: u64) -> io::Result<()> {
        let bytes = blocks(bytes);
        if bytes <= self.bytes || self.space.free_min_bytes == 0 {
            return Ok(());
        }
        self.space.grant(bytes - self.bytes)?;
        self.bytes = bytes;
        Ok(())
    }

    /// Gives back what this claim holds beyond `bytes` (what it was for is written).
    pub fn shrink_to(&mut self, bytes: u64) {
        if bytes < self.bytes {
            self.space
                .granted
                .fetch_sub(self.bytes - bytes, Ordering::AcqRel);
            self.bytes = bytes;
        }
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        self.shrink_to(0);
    }
}

impl Space {
    /// The room on `dir`'s disk, keeping `free_min_bytes` free (0: no floor).
    pub fn new(dir: &Path, free_min_bytes: u64) -> Arc<Space> {
        Arc::new(Space {
            dir: dir.to_path_buf(),
            free_min_bytes,
            born: Instant::now(),
            checked_ms: AtomicU64::new(0),
            refusing: AtomicBool::new(false),
            waiting: AtomicUsize::new(0),
            stopping: AtomicBool::new(false),
            granted: AtomicU64::new(0),
            grants: Mutex::new(()),
        })
    }

    /// The free space above the floor plus this at which new writes are refused.
    fn headroom(&self) -> u64 {
        self.free_min_bytes / HEADROOM_PART
    }

    /// Grants room for a write of at most `bytes` more on the disk, if the disk keeps the
    /// floor free after it and after every grant still outstanding. The grant covers the
    /// blocks those bytes may take (rounded up, and one more for a write that starts in
    /// a block already partly used). Without room: an error of kind
    /// [`io::ErrorKind::StorageFull`], which the writer meets as a full disk: it waits
    /// for room ([`Space::retry`]). Without a floor, always granted and not counted.
    pub fn room_for(self: &Arc<Self>, bytes: u64) -> io::Result<Claim> {
        let mut claim = self.claim();
        claim.try_grow_to(bytes)?;
        Ok(claim)
    }

    /// A claim of nothing yet, to grow as a write goes ([`Claim::try_grow_to`]).
    pub fn claim(self: &Arc<Self>) -> Claim {
        Claim {
            space: self.clone(),
            bytes: 0,
        }
    }

    /// Counts `bytes` as granted if there is room for them.
    fn grant(&self, bytes: u64) -> io::Result<()> {
        let _one = self
            .grants
            .lock()
            .map_err(|_| io::Error::other("the disk's grants are poisoned"))?;
        let free = free_bytes(&self.dir)?;
        let granted = self.granted.load(Ordering::Acquire);
        let room = free
            .saturating_sub(granted)
            .saturating_sub(self.free_min_bytes);
        if bytes > room {
            return Err(io::Error::new(
                io::ErrorKind::StorageFull,
                format!(
                    "{} wanted above the disk's floor of {}: {} free, {} of it granted to \
                     writes under way",
                    mib(bytes),
                    mib(self.free_min_bytes),
                    mib(free),
                    mib(granted)
                ),
            ));
        }
        self.granted.fetch_add(bytes, Ordering::AcqRel);
        Ok(())
    }

    /// Bytes a write could be granted now: the free space above the floor, less what is
    /// granted. `u64::MAX` without a floor, or when the free space cannot be read.
    pub fn room(&self) -> u64 {
        if self.free_min_bytes == 0 {
            return u64::MAX;
        }
        match free_bytes(&self.dir) {
            Ok(free) => free
                .saturating_sub(self.granted.load(Ordering::Acquire))
                .saturating_sub(self.free_min_bytes),
            Err(_) => u64::MAX,
        }
    }

    /// Whether room is short: new writes are refused, or a writer waits, or the room left
    /// is under twice the headroom. The stores then give back what they can even at some
    /// cost to their speed (the views cut their WAL to nothing at each checkpoint).
    pub fn short(&self) -> bool {
        self.refusing.load(Ordering::Acquire)
            || self.waiting()
            || (self.free_min_bytes > 0 && self.room() < 2 * self.headroom())
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
        let min = self.free_min_bytes;
        let granted = if min == 0 {
            0
        } else {
            self.granted.load(Ordering::Acquire)
        };
        let short = min > 0 && free.saturating_sub(granted) < min + self.headroom();
        let refuse = short || self.waiting.load(Ordering::Acquire) > 0;
        let was = self.refusing.swap(refuse, Ordering::AcqRel);
        if refuse && !was {
            tracing::error!(
                data_dir = %self.dir.display(),
                free = %mib(free),
                granted = %mib(granted),
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

/// `bytes` as whole blocks, and one more: a write that starts inside a block already
/// partly used takes one block past its own length's worth.
fn blocks(bytes: u64) -> u64 {
    if bytes == 0 {
        return 0;
    }
    (bytes.div_ceil(BLOCK_BYTES) + 1) * BLOCK_BYTES
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

/// Refuses a start on a disk with less than `free_min_bytes` and [`START_BYTES`] free,
/// saying how much is free and what to do. A reading that fails is not a refusal: the start goes on and
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
    if free < free_min_bytes + START_BYTES {
        anyhow::bail!(
            "data_dir: the disk holding {} is full: {} free, less than the {} the server keeps \
             free (--disk-free-min-mb) and the {} a start writes, so it does not start: \
             recovery writes, and every write would be refused. Free space on that disk \
             (remove files that are not the server's, or grow the volume; do not delete \
             files in the data dir, they hold acknowledged requests), then start again",
            data_dir.display(),
            mib(free),
            mib(free_min_bytes),
            mib(START_BYTES),
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

#[cfg(test)]
mod tests {
    use super::*;

    fn no_room() -> io::Error {
        io::Error::from_raw_os_error(28)
    }

    #[test]
    fn a_write_that_finds_no_room_refuses_new_writes_and_is_tried_again_until_it_fits() {
        let dir = tempfile::tempdir().unwrap();
        let space = Space::new(dir.path(), 0);
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
        let space = Space::new(dir.path(), 0);
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
        let space = Space::new(dir.path(), 0);
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
    fn a_floor_above_the_free_space_refuses_new_writes_every_grant_and_the_start() {
        let dir = tempfile::tempdir().unwrap();
        let free = free_bytes(dir.path()).unwrap();
        let space = Space::new(dir.path(), free.saturating_mul(2).max(1));
        assert!(matches!(space.admit(), Err(StoreError::DiskFull)));
        let err = space.room_for(1).err().unwrap();
        assert!(io_no_room(&err), "{err}");
        assert!(space.short());
        let err = check_at_start(&dir.path().join("not-yet"), free.saturating_mul(2).max(1))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("is full") && err.contains("Free space on that disk"),
            "{err}"
        );
        let space = Space::new(dir.path(), 0);
        assert!(space.admit().is_ok());
        assert!(space.room_for(u64::MAX / 2).is_ok());
        assert!(check_at_start(dir.path(), 0).is_ok());
    }

    #[test]
    fn grants_keep_the_floor_together_and_room_comes_back_as_they_are_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let free = free_bytes(dir.path()).unwrap();
        // A floor 16 MiB under the free space: other writers on a test machine's disk
        // move it by far less while this runs.
        let space = Space::new(dir.path(), free - 16 * MIB);
        // 1 MiB is granted as its blocks and one more (a write may start in a used one).
        let a = space.room_for(MIB).unwrap();
        assert_eq!(a.bytes(), MIB + BLOCK_BYTES);
        let mut b = space.room_for(4 * MIB).unwrap();
        assert_eq!(
            space.granted.load(Ordering::Relaxed),
            5 * MIB + 2 * BLOCK_BYTES
        );
        // What is granted is counted: 14 MiB more would cross the floor.
        assert!(space.room() < 11 * MIB, "{}", space.room());
        let err = b.try_grow_to(18 * MIB).err().unwrap();
        assert!(io_no_room(&err), "{err}");
        assert_eq!(b.bytes(), 4 * MIB + BLOCK_BYTES);
        assert!(space.room_for(14 * MIB).is_err());
        drop(a);
        b.shrink_to(0);
        assert_eq!(space.granted.load(Ordering::Relaxed), 0);
        assert!(b.try_grow_to(14 * MIB).is_ok());
        drop(b);
        assert_eq!(space.granted.load(Ordering::Relaxed), 0);
    }
}
