//! The next segment, zero-filled and synced ahead of time by a thread of its own, so that
//! the log's records overwrite blocks the file already has: a record's `fdatasync` then
//! writes the data and flushes the device, but no longer waits for the file's new size
//! (an inode update through the filesystem's journal) as an append does. Measured on
//! this machine's ext4 with 3 KB writes: 98 µs per sync into a zero-filled file against
//! 140 µs appending (`docs/decisions/log-groups.md`).
//!
//! A spare is prepared only once the log has carried load (`after` bytes written since
//! it was opened): an idle server, and most tests, never write one. It takes a claim on
//! the disk's room while it is written, and is skipped when the disk has none.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use rustix::fs::OFlags;

use crate::direct::BLOCK;
use crate::space::Space;

const PREFIX: &str = "spare-";
const SUFFIX: &str = ".tmp";
/// Bytes of zeros written at a time.
const CHUNK: usize = 1 << 20;
/// The pause after each chunk is flushed, which leaves the device to the log's syncs.
const CHUNK_PAUSE: std::time::Duration = std::time::Duration::from_millis(2);
/// Bytes the log writes after it is opened before the first spare is prepared.
pub const SPARE_AFTER: u64 = 1 << 20;

/// Names spares uniquely within the process: a writer closed and opened again may still
/// have its old spare's thread running.
static NEXT: AtomicU64 = AtomicU64::new(0);

enum State {
    /// Not prepared yet: waits for `after` bytes of log.
    Idle,
    Preparing(JoinHandle<io::Result<PathBuf>>),
    Ready(PathBuf),
}

/// The log writer's spare segments: at most one prepared or being prepared at a time.
pub struct Spares {
    dir: PathBuf,
    bytes: u64,
    space: Arc<Space>,
    after: u64,
    /// Bytes of log written since the last spare was taken (or the writer opened).
    written: u64,
    state: State,
    /// Set when the writer goes: a spare being written stops and is removed.
    stop: Arc<AtomicBool>,
}

impl Spares {
    /// Spares of `bytes` each in the log's `dir`, the first once `after` bytes are
    /// written. Spares left by an earlier process are removed: one may be half written.
    pub fn new(dir: &Path, bytes: u64, space: Arc<Space>, after: u64) -> io::Result<Spares> {
        for entry in std::fs::read_dir(dir)? {
            let entry = entry?;
            let name = entry.file_name();
            let name = name.to_string_lossy();
            if name.starts_with(PREFIX) && name.ends_with(SUFFIX) {
                remove(&entry.path());
            }
        }
        Ok(Spares {
            dir: dir.to_path_buf(),
            bytes,
            space,
            after,
            written: 0,
            state: State::Idle,
            stop: Arc::new(AtomicBool::new(false)),
        })
    }

    /// Counts `n` bytes of log written; starts preparing a spare once there were enough.
    pub fn wrote(&mut self, n: u64) {
        self.written += n;
        if matches!(self.state, State::Idle) && self.written >= self.after {
            let path = self.dir.join(format!(
                "{PREFIX}{}-{}{SUFFIX}",
                std::process::id(),
                NEXT.fetch_add(1, Ordering::Relaxed)
            ));
            let (bytes, space, stop) = (self.bytes, self.space.clone(), self.stop.clone());
            let spawned = std::thread::Builder::new()
                .name("journal-spare".into())
                .spawn(move || prepare(path, bytes, &space, &stop));
            match spawned {
                Ok(handle) => self.state = State::Preparing(handle),
                Err(e) => {
                    tracing::warn!(error = %e, "journal: no thread to prepare a spare segment");
                    self.written = 0;
                }
            }
        }
    }

    /// Whether a spare is ready to be taken (never waits for one).
    pub fn ready(&mut self) -> bool {
        if let State::Preparing(handle) = &self.state {
            if !handle.is_finished() {
                return false;
            }
            let State::Preparing(handle) = std::mem::replace(&mut self.state, State::Idle) else {
                unreachable!("matched above")
            };
            match handle.join() {
                Ok(Ok(path)) => self.state = State::Ready(path),
                // Tried again after as many bytes again: no room, say, which may come.
                Ok(Err(e)) => {
                    tracing::debug!(error = %e, "journal: no spare segment");
                    self.written = 0;
                }
                Err(_) => {
                    tracing::warn!("journal: the spare segment's thread panicked");
                    self.written = 0;
                }
            }
        }
        matches!(self.state, State::Ready(_))
    }

    /// The spare, renamed to `path` and synced there, open for writing at its start; the
    /// next one is prepared after `after` bytes more. `None`: no spare is ready.
    pub fn take_as(&mut self, path: &Path) -> io::Result<Option<File>> {
        if !self.ready() {
            return Ok(None);
        }
        let State::Ready(spare) = std::mem::replace(&mut self.state, State::Idle) else {
            unreachable!("ready() said so")
        };
        self.written = 0;
        if path.exists() {
            remove(&spare);
            return Err(io::Error::new(
                io::ErrorKind::AlreadyExists,
                format!("{} exists already", path.display()),
            ));
        }
        std::fs::rename(&spare, path)?;
        // The name is durable before a record in the file is acknowledged.
        File::open(&self.dir)?.sync_all()?;
        let file = OpenOptions::new().write(true).open(path)?;
        debug_assert_eq!(
            file.metadata()?.len(),
            self.bytes,
            "a spare of the wrong size"
        );
        Ok(Some(file))
    }
}

impl Drop for Spares {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let State::Ready(path) = &self.state {
            remove(path);
        }
    }
}

fn remove(path: &Path) {
    if let Err(e) = std::fs::remove_file(path) {
        if e.kind() != io::ErrorKind::NotFound {
            tracing::warn!(path = %path.display(), error = %e, "journal: a spare segment stays");
        }
    }
}

/// Writes `bytes` of zeros to a new file at `path` and syncs it, size and all, within the
/// disk's room; a spare not finished is removed.
///
/// The zeros go with direct I/O where the file system takes it: not copied into the page
/// cache, dirtied and written back (about 6% of the engine benchmark's CPU went into
/// that copy), and no cached page left for the log's own direct writes to drop.
fn prepare(
    path: PathBuf,
    bytes: u64,
    space: &Arc<Space>,
    stop: &AtomicBool,
) -> io::Result<PathBuf> {
    let _room = space.room_for(bytes)?;
    let written = (|| {
        let created = OpenOptions::new()
            .create_new(true)
            .write(true)
            .open(&path)?;
        // Opened again for direct writes: a failed `O_DIRECT | O_CREAT` open may leave
        // the file made.
        let (f, zeros, at) = match open_direct(&path, bytes)? {
            Some(direct) => {
                let raw = vec![0u8; CHUNK + BLOCK];
                let at = raw.as_ptr().align_offset(BLOCK);
                (direct, raw, at)
            }
            None => (created, vec![0u8; CHUNK], 0),
        };
        let mut offset = 0;
        while offset < bytes {
            if stop.load(Ordering::Acquire) {
                return Err(io::Error::new(io::ErrorKind::Interrupted, "the log closed"));
            }
            let n = (bytes - offset).min(CHUNK as u64) as usize;
            f.write_all_at(&zeros[at..at + n], offset)?;
            offset += n as u64;
            // Flushed a chunk at a time, with a pause: one flush of the whole segment
            // at the end held the device for long enough to stall the log's own syncs
            // (p99.9 of `hot-sales` 25 to 35 ms against 21 to 26 without spares).
            f.sync_data()?;
            std::thread::sleep(CHUNK_PAUSE);
        }
        f.sync_all()
    })();
    match written {
        Ok(()) => Ok(path),
        Err(e) => {
            remove(&path);
            Err(e)
        }
    }
}

/// `path` open for direct writes, or `None` where they cannot be used: a file system
/// without direct I/O (tmpfs, say), or a size that is not whole blocks (as tests use).
fn open_direct(path: &Path, bytes: u64) -> io::Result<Option<File>> {
    if !bytes.is_multiple_of(BLOCK as u64) {
        return Ok(None);
    }
    match OpenOptions::new()
        .write(true)
        .custom_flags(OFlags::DIRECT.bits() as i32)
        .open(path)
    {
        Ok(f) => Ok(Some(f)),
        Err(e) if e.raw_os_error() == Some(rustix::io::Errno::INVAL.raw_os_error()) => Ok(None),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wait_ready(s: &mut Spares) {
        for _ in 0..500 {
            if s.ready() {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        panic!("no spare within 5 s");
    }

    #[test]
    fn a_spare_is_prepared_after_enough_log_and_taken_zero_filled_under_its_name() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = Spares::new(dir.path(), 8192, Space::new(dir.path(), 0), 100).unwrap();
        s.wrote(99);
        assert!(!s.ready(), "prepared before `after` bytes were written");
        s.wrote(1);
        wait_ready(&mut s);
        let target = dir.path().join("00000000000000000007.log");
        let f = s.take_as(&target).unwrap().expect("a spare was ready");
        drop(f);
        let bytes = std::fs::read(&target).unwrap();
        assert_eq!(bytes.len(), 8192);
        assert!(bytes.iter().all(|b| *b == 0));
        assert!(!s.ready(), "the next spare waits for more log");
        let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
        assert_eq!(left.len(), 1, "only the segment remains");
    }

    #[test]
    fn spares_left_by_an_earlier_writer_are_removed_and_a_dropped_one_goes() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("spare-1-1.tmp"), b"half").unwrap();
        let mut s = Spares::new(dir.path(), 4096, Space::new(dir.path(), 0), 1).unwrap();
        assert!(!dir.path().join("spare-1-1.tmp").exists());
        s.wrote(1);
        wait_ready(&mut s);
        drop(s);
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }
}
