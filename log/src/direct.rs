//! The records of a zero-filled segment (a spare, [`crate::spare`]) written with direct
//! I/O: a group's records are gathered in memory and written once, as whole blocks, by
//! one `pwrite` on a file opened `O_DIRECT | O_DSYNC`, durable when it returns. The page
//! cache is left out: no page is copied, dirtied, written back and waited for, which on
//! this project's machines is about a third of a group commit's CPU
//! (`docs/decisions/log-groups.md`). The device is still flushed once per group, as
//! `fdatasync` does.
//!
//! The block the records end in is written again, with what follows, by the next group:
//! its bytes already durable are written unchanged, and the rest of the block is zeros,
//! as the spare has there. A write torn by a crash leaves each sector old or new, and
//! both hold the same acknowledged bytes; past them a scan finds a torn tail, as with a
//! torn write through the page cache.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;

/// The unit of a direct write: its offset, its length and its buffer's address are
/// multiples of it. 4 KiB is a multiple of any device's logical block (512 or 4096).
pub const BLOCK: usize = 4096;
/// The buffer's first size: a group of tens of entries fits; a larger one grows it.
const FIRST_CAPACITY: usize = 16 * BLOCK;
/// A buffer grown past this by a large group goes back to its first size once that
/// group is written, so that memory does not keep the largest group ever seen.
const SHRINK_ABOVE: usize = 1 << 20;

/// The end of a segment being written directly: the bytes from the block the durable
/// records end in, then the records appended since the last [`DirectTail::flush`].
pub struct DirectTail {
    file: File,
    /// Over-allocated by a block, so that an aligned window of it can be taken.
    raw: Vec<u8>,
    /// Where the aligned window starts in `raw`.
    align: usize,
    /// The window's size: whole blocks.
    cap: usize,
    /// The file offset of the window's first byte: a multiple of [`BLOCK`].
    start: u64,
    /// Bytes of records in the window.
    len: usize,
    /// Of them, those already written (durable).
    written: usize,
}

impl DirectTail {
    /// Opens the segment `path`, whose records end at `offset` and which holds zeros past
    /// them, for direct writes from there. `None` where the file system takes no direct
    /// I/O (tmpfs, say), or where the file is not whole blocks (a segment size of a few
    /// bytes, as tests use), so that a write never passes its end: the writer then goes
    /// through the page cache.
    pub fn open(path: &Path, offset: u64) -> io::Result<Option<DirectTail>> {
        if !std::fs::metadata(path)?.len().is_multiple_of(BLOCK as u64) {
            return Ok(None);
        }
        // `libc`'s O_DSYNC, not rustix's `OFlags::DSYNC`, which is O_SYNC on Linux: a
        // write would then also write the inode whenever its mtime moved (every few
        // milliseconds under load), one more device write and wait in about one group
        // of ten.
        let file = match OpenOptions::new()
            .write(true)
            .custom_flags(libc::O_DIRECT | libc::O_DSYNC)
            .open(path)
        {
            Ok(f) => f,
            Err(e) if e.raw_os_error() == Some(rustix::io::Errno::INVAL.raw_os_error()) => {
                return Ok(None)
            }
            Err(e) => return Err(e),
        };
        let start = offset - offset % BLOCK as u64;
        let len = (offset - start) as usize;
        let mut tail = DirectTail {
            file,
            raw: Vec::new(),
            align: 0,
            cap: 0,
            start,
            len: 0,
            written: 0,
        };
        tail.reallocate(FIRST_CAPACITY);
        if len > 0 {
            // The durable bytes of the block the records end in, written again with the
            // next group's: read through the page cache, which direct reads need not be.
            let window = tail.align;
            File::open(path)?.read_exact_at(&mut tail.raw[window..window + len], start)?;
        }
        tail.len = len;
        tail.written = len;
        Ok(Some(tail))
    }

    /// Appends `bytes` after the records (not written until [`DirectTail::flush`]).
    pub fn push(&mut self, bytes: &[u8]) {
        self.reserve(self.len + bytes.len());
        let at = self.align + self.len;
        self.raw[at..at + bytes.len()].copy_from_slice(bytes);
        self.len += bytes.len();
    }

    /// Whether records were appended since the last flush.
    pub fn pending(&self) -> bool {
        self.len > self.written
    }

    /// Writes the records appended since the last flush, durably (the device is flushed
    /// before it returns), then keeps only the block they end in.
    pub fn flush(&mut self) -> io::Result<()> {
        if !self.pending() {
            return Ok(());
        }
        let whole = self.len.div_ceil(BLOCK) * BLOCK;
        self.reserve(whole);
        let window = &self.raw[self.align..self.align + whole];
        self.file.write_all_at(window, self.start)?;
        // Keep the block the records end in; zero what went past them.
        let keep_from = self.len - self.len % BLOCK;
        let keep = self.len - keep_from;
        let a = self.align;
        self.raw.copy_within(a + keep_from..a + self.len, a);
        self.raw[a + keep..a + whole].fill(0);
        self.start += keep_from as u64;
        self.len = keep;
        self.written = keep;
        if self.cap > SHRINK_ABOVE {
            self.reallocate(FIRST_CAPACITY);
        }
        Ok(())
    }

    /// Makes the aligned window at least `need` bytes.
    fn reserve(&mut self, need: usize) {
        if need > self.cap {
            self.reallocate(need.div_ceil(BLOCK) * BLOCK);
        }
    }

    /// A new aligned window of `cap` bytes (whole blocks, at least the records'), with
    /// the records copied over and zeros past them.
    fn reallocate(&mut self, cap: usize) {
        let mut raw = vec![0u8; cap + BLOCK];
        let align = raw.as_ptr().align_offset(BLOCK);
        raw[align..align + self.len].copy_from_slice(&self.raw[self.align..self.align + self.len]);
        self.raw = raw;
        self.align = align;
        self.cap = cap;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn zero_filled(dir: &Path, bytes: usize) -> std::path::PathBuf {
        let path = dir.join("seg");
        std::fs::write(&path, vec![0u8; bytes]).unwrap();
        path
    }

    #[test]
    fn records_written_directly_read_back_with_zeros_after_them() {
        let dir = tempfile::tempdir().unwrap();
        let path = zero_filled(dir.path(), SHRINK_ABOVE + 8 * BLOCK);
        let Some(mut tail) = DirectTail::open(&path, 0).unwrap() else {
            eprintln!("no direct I/O on this file system: nothing to test");
            return;
        };
        let mut expected = Vec::new();
        // Groups that end inside a block, exactly on one, span several, and one past
        // the buffer's first size (after which it shrinks back).
        let sizes = [100usize, 3996, 5000, 1, 9000, SHRINK_ABOVE + 3000, 7];
        for (i, n) in sizes.into_iter().enumerate() {
            let bytes = vec![i as u8 + 1; n];
            tail.push(&bytes);
            expected.extend_from_slice(&bytes);
            assert!(tail.pending());
            tail.flush().unwrap();
            assert!(!tail.pending());
            let data = std::fs::read(&path).unwrap();
            assert_eq!(&data[..expected.len()], &expected[..], "after group {i}");
            assert!(
                data[expected.len()..].iter().all(|b| *b == 0),
                "after group {i}"
            );
            assert_eq!(tail.cap, FIRST_CAPACITY, "after group {i}");
        }
    }

    #[test]
    fn the_tail_is_opened_for_data_syncs_not_for_syncs_of_the_inode_too() {
        use std::os::fd::AsRawFd;
        let dir = tempfile::tempdir().unwrap();
        let path = zero_filled(dir.path(), 4 * BLOCK);
        let Some(tail) = DirectTail::open(&path, 0).unwrap() else {
            return;
        };
        // The flags the kernel holds for the open file, in octal.
        let info = std::fs::read_to_string(format!("/proc/self/fdinfo/{}", tail.file.as_raw_fd()))
            .unwrap();
        let flags = info
            .lines()
            .find_map(|l| l.strip_prefix("flags:"))
            .map(|f| i32::from_str_radix(f.trim(), 8).unwrap())
            .unwrap();
        assert_eq!(flags & libc::O_DIRECT, libc::O_DIRECT, "{info}");
        // O_SYNC is O_DSYNC and one more bit: the whole of it must not be there.
        assert_eq!(flags & libc::O_SYNC, libc::O_DSYNC, "{info}");
    }

    #[test]
    fn a_tail_opened_inside_a_block_keeps_the_bytes_before_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = zero_filled(dir.path(), 4 * BLOCK);
        let first = vec![7u8; BLOCK + 300];
        std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .write_all_at(&first, 0)
            .unwrap();
        let Some(mut tail) = DirectTail::open(&path, first.len() as u64).unwrap() else {
            return;
        };
        tail.push(&[9u8; 50]);
        tail.flush().unwrap();
        let data = std::fs::read(&path).unwrap();
        assert_eq!(&data[..first.len()], &first[..]);
        assert_eq!(&data[first.len()..first.len() + 50], &[9u8; 50][..]);
        assert!(data[first.len() + 50..].iter().all(|b| *b == 0));
        assert_eq!(
            data.len(),
            4 * BLOCK,
            "an overwrite in place leaves the size"
        );
    }
}
