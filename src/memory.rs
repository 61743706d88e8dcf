//! The process's memory as `/metrics` shows it (`nrtxn_memory_bytes{part}`), read from the
//! allocator: jemalloc, which also serves SQLite's and librdkafka's `malloc`
//! (docs/decisions/allocator.md).
//!
//! - `allocated`: bytes in live blocks, all of the process's heap;
//! - `resident`: the allocator's pages in RAM (live blocks, its metadata, and freed pages
//!   not yet returned: its background threads return pages unused for a second);
//! - `sqlite`: SQLite's share of `allocated` (its page caches, at most 64 MiB a
//!   connection).
//!
//! What a burst leaves behind shows as `resident` well above `allocated` after it; a
//! cache filling shows as `sqlite` rising towards its bound.

use std::sync::{Arc, Weak};
use std::time::Duration;

use nrtxn_actors::Metrics;

/// How often the figures are read: one allocator epoch, a few `mallctl` reads.
const EVERY: Duration = Duration::from_secs(1);

/// The figures, read now; `None` for one the allocator cannot give.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Figures {
    pub allocated: Option<u64>,
    pub resident: Option<u64>,
    pub sqlite: u64,
}

pub fn read() -> Figures {
    use tikv_jemalloc_ctl::{epoch, stats};
    // The statistics are a snapshot taken at each epoch.
    let fresh = epoch::advance().is_ok();
    let pick = |v: Result<usize, tikv_jemalloc_ctl::Error>| match v {
        Ok(v) if fresh => Some(v as u64),
        _ => None,
    };
    Figures {
        allocated: pick(stats::allocated::read()),
        resident: pick(stats::resident::read()),
        sqlite: sqlite_used(),
    }
}

/// SQLite's memory in use (`sqlite3_status64(SQLITE_STATUS_MEMORY_USED)`), 0 if unread.
fn sqlite_used() -> u64 {
    let (mut current, mut highest) = (0i64, 0i64);
    // SAFETY: both pointers are to live locals; the call only writes them.
    let rc = unsafe {
        rusqlite::ffi::sqlite3_status64(
            rusqlite::ffi::SQLITE_STATUS_MEMORY_USED,
            &mut current,
            &mut highest,
            0,
        )
    };
    if rc == rusqlite::ffi::SQLITE_OK {
        current.max(0) as u64
    } else {
        0
    }
}

/// Fills the gauge every second, on a thread of its own, for as long as `metrics` lives.
pub fn start_gauges(metrics: &Arc<Metrics>) {
    let weak: Weak<Metrics> = Arc::downgrade(metrics);
    let spawned = std::thread::Builder::new()
        .name("nrtxn-memory".into())
        .spawn(move || {
            while let Some(metrics) = weak.upgrade() {
                let figures = read();
                let set = |part: &str, v: Option<u64>| {
                    if let Some(v) = v {
                        metrics
                            .memory
                            .with_label_values(&[part])
                            .set(v.min(i64::MAX as u64) as i64);
                    }
                };
                set("allocated", figures.allocated);
                set("resident", figures.resident);
                set("sqlite", Some(figures.sqlite));
                drop(metrics);
                std::thread::sleep(EVERY);
            }
        });
    if let Err(e) = spawned {
        tracing::warn!(error = %e, "cannot start the memory gauges' thread: nrtxn_memory_bytes stays unset");
    }
}
