//! Waking a thread of its own (the log's writer) when the engine's thread that handed it
//! work is idle, rather than at once (docs/decisions/log-on-engine-thread.md, option 4).
//!
//! Woken at once, the writer takes the core from the engine thread that woke it (the
//! scheduler lets a thread that slept preempt the one that wakes it), writes and syncs a
//! group of the one batch handed over, and the engine thread's other ready work waits.
//! On an engine thread the wake-up is owed instead and paid when its runtime is about to
//! sleep (tokio's `on_thread_park`): the writer then wakes once for every batch handed
//! over meanwhile, onto a core that was to be idle. A thread that stays busy pays once
//! the wake-up has been owed [`OWED_MAX`], at its next handing over or by a timer.
//!
//! Off the engine's threads (the main thread of a test, a blocking reader) a wake-up is
//! paid at once.

use std::cell::{Cell, RefCell};
use std::sync::atomic::{fence, AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// A thread that sleeps when it has nothing to do and is woken by whoever hands it work.
#[derive(Default)]
pub struct Sleeper {
    asleep: AtomicBool,
    lock: Mutex<()>,
    woken: Condvar,
}

impl Sleeper {
    /// Sleeps until woken, unless `has_work` (asked after the sleep is announced, so
    /// work handed over meanwhile is seen either by it or by the waker) says otherwise.
    pub fn sleep_unless(&self, mut has_work: impl FnMut() -> bool) {
        let mut guard = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        self.asleep.store(true, Ordering::SeqCst);
        fence(Ordering::SeqCst);
        if has_work() {
            self.asleep.store(false, Ordering::SeqCst);
            return;
        }
        while self.asleep.load(Ordering::SeqCst) {
            guard = self.woken.wait(guard).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Whether the thread sleeps (or is about to), after work was handed to it.
    fn needs_waking(&self) -> bool {
        fence(Ordering::SeqCst);
        self.asleep.load(Ordering::SeqCst)
    }

    /// Wakes the thread now if it sleeps.
    pub fn wake(&self) {
        if self.needs_waking() && self.asleep.swap(false, Ordering::SeqCst) {
            // The sleeper holds the lock from its announcement until it waits.
            drop(self.lock.lock().unwrap_or_else(|e| e.into_inner()));
            self.woken.notify_one();
        }
    }

    /// Wakes the thread once this engine thread has nothing ready to run (at once on any
    /// other thread, or once the wake-up has been owed [`OWED_MAX`]). Call after handing
    /// the work over.
    pub fn wake_when_idle(self: &Arc<Self>) {
        if !self.needs_waking() {
            return;
        }
        if !DEFERS.get() {
            self.wake();
            return;
        }
        let (overdue, arm) = OWED.with_borrow_mut(|owed| {
            let now = Instant::now();
            let since = *owed.since.get_or_insert(now);
            if !owed.sleepers.iter().any(|o| Arc::ptr_eq(o, self)) {
                owed.sleepers.push(self.clone());
            }
            let arm = !std::mem::replace(&mut owed.watchdog, true);
            (now.duration_since(since) >= OWED_MAX, arm)
        });
        if arm {
            actix::spawn(async {
                actix::clock::sleep(OWED_MAX).await;
                OWED.with_borrow_mut(|owed| owed.watchdog = false);
                pay_owed();
            });
        }
        if overdue {
            pay_owed();
        }
    }
}

/// How long an engine thread that stays busy may owe a wake-up: a handing over past it
/// pays at once, and a timer pays when none comes (tokio's timers tick in whole
/// milliseconds, so that bound is up to about two).
const OWED_MAX: Duration = Duration::from_micros(500);

#[derive(Default)]
struct Owed {
    sleepers: Vec<Arc<Sleeper>>,
    /// When the oldest wake-up still owed was first owed.
    since: Option<Instant>,
    /// A timer is set to pay.
    watchdog: bool,
}

thread_local! {
    /// Set on the engine's threads: wake-ups wait until the thread is idle.
    static DEFERS: Cell<bool> = const { Cell::new(false) };
    /// The wake-ups this thread owes.
    static OWED: RefCell<Owed> = RefCell::new(Owed::default());
}

/// An engine thread's runtime, made on that thread: its wake-ups wait until it is idle,
/// and it pays the ones it owes whenever it is about to sleep.
pub(crate) fn engine_runtime() -> std::io::Result<tokio::runtime::Runtime> {
    DEFERS.set(true);
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .on_thread_park(pay_owed)
        .build()
}

/// Pays every wake-up this thread owes.
fn pay_owed() {
    let sleepers = OWED.with_borrow_mut(|owed| {
        owed.since = None;
        std::mem::take(&mut owed.sleepers)
    });
    for sleeper in sleepers {
        sleeper.wake();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;
    use std::time::Duration;

    #[test]
    fn a_sleeper_woken_before_it_sleeps_does_not_sleep() {
        let sleeper = Arc::new(Sleeper::default());
        let work = Arc::new(AtomicUsize::new(0));
        let (s, w) = (sleeper.clone(), work.clone());
        let thread = std::thread::spawn(move || {
            let mut seen = 0;
            while seen < 10_000 {
                s.sleep_unless(|| w.load(Ordering::SeqCst) > seen);
                seen = w.load(Ordering::SeqCst);
            }
        });
        for _ in 0..10_000 {
            work.fetch_add(1, Ordering::SeqCst);
            sleeper.wake();
        }
        // Lost wake-ups would leave the thread asleep with work waiting.
        for _ in 0..500 {
            if thread.is_finished() {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        panic!("the sleeper missed a wake-up");
    }

    /// Runs `f` on this thread made an engine thread, in its runtime.
    fn on_an_engine_thread(f: impl std::future::Future<Output = ()> + 'static) {
        let rt = engine_runtime().expect("a runtime");
        tokio::task::LocalSet::new().block_on(&rt, f);
    }

    fn owed_sleeper() -> Arc<Sleeper> {
        let sleeper = Arc::new(Sleeper::default());
        sleeper.asleep.store(true, Ordering::SeqCst);
        sleeper.wake_when_idle();
        sleeper.wake_when_idle();
        assert!(sleeper.needs_waking(), "woken while the thread was busy");
        assert_eq!(OWED.with_borrow(|o| o.sleepers.len()), 1, "owed once");
        sleeper
    }

    #[test]
    fn an_engine_thread_pays_its_wake_up_once_idle() {
        on_an_engine_thread(async {
            // As if a timer were set already: only the thread's going idle can pay.
            OWED.with_borrow_mut(|o| o.watchdog = true);
            let sleeper = owed_sleeper();
            let (tx, rx) = tokio::sync::oneshot::channel();
            let watched = sleeper.clone();
            // Another thread waits for the wake-up while this one goes idle on `rx`.
            std::thread::spawn(move || {
                let started = Instant::now();
                while watched.needs_waking() && started.elapsed() < Duration::from_secs(5) {
                    std::thread::yield_now();
                }
                let _ = tx.send(!watched.needs_waking());
            });
            assert_eq!(rx.await, Ok(true), "not woken once the thread was idle");
            assert!(OWED.with_borrow(|o| o.sleepers.is_empty()));
        });
    }

    #[test]
    fn an_engine_thread_that_stays_busy_pays_its_wake_up_all_the_same() {
        on_an_engine_thread(async {
            let sleeper = owed_sleeper();
            // Busy: always something ready, so the runtime never sleeps.
            let started = Instant::now();
            while sleeper.needs_waking() && started.elapsed() < Duration::from_secs(5) {
                tokio::task::yield_now().await;
            }
            assert!(
                !sleeper.needs_waking(),
                "a busy thread never paid its wake-up"
            );
            assert!(
                started.elapsed() >= OWED_MAX,
                "paid before the thread was idle"
            );
        });
    }
}
