//! The embedded request log: an in-process hand-off to the processors, with the
//! fire-and-forget requests made durable in the embedded store first.
//!
//! A caller that waits (respond=true) needs no durable request: its answer is given only
//! once the outcome is journaled, and a crash before that leaves no promise behind. A
//! fire-and-forget caller is promised an outcome by its 202, so its request is made
//! durable before the 202 (a record of the embedded journal's log, or a row of
//! `requests` in the SQLite store beside a MongoDB journal) and retired when its outcome
//! is journaled; at start, what is left is resumed.

use std::cell::RefCell;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use nrtxn_actors::{Dispatcher, LogAck, Request, RequestLog, StoreError};

use crate::journal::LogJournal;
use crate::views::SqliteStore;
use crate::AcceptDone;

/// Where fire-and-forget requests are made durable before their 202: the journal's log
/// when it is the embedded journal, or the SQLite store beside a MongoDB journal.
pub trait RequestStore: Send + Sync + 'static {
    /// Makes the requests durable, then calls `done`.
    fn accept(&self, reqs: Vec<Request>, done: AcceptDone);
    /// Requests accepted durably and not yet decided, in acceptance order.
    fn pending(&self) -> Result<Vec<Request>, StoreError>;
    /// Forgets requests whose outcomes another journal holds (not durable by itself).
    fn retire(&self, shop: Arc<str>, keys: Vec<Arc<str>>);
    /// `Err` ([`StoreError::DiskFull`]) while the data dir's disk has no room for new
    /// writes (see [`crate::space`]).
    fn admit(&self) -> Result<(), StoreError>;
}

impl RequestStore for SqliteStore {
    fn accept(&self, reqs: Vec<Request>, done: AcceptDone) {
        SqliteStore::accept(self, reqs, done)
    }
    fn pending(&self) -> Result<Vec<Request>, StoreError> {
        SqliteStore::pending(self)
    }
    fn retire(&self, shop: Arc<str>, keys: Vec<Arc<str>>) {
        SqliteStore::retire(self, shop, keys)
    }
    fn admit(&self) -> Result<(), StoreError> {
        self.space().admit()
    }
}

impl RequestStore for LogJournal {
    fn accept(&self, reqs: Vec<Request>, done: AcceptDone) {
        LogJournal::accept(self, reqs, done)
    }
    fn pending(&self) -> Result<Vec<Request>, StoreError> {
        LogJournal::pending(self)
    }
    fn retire(&self, shop: Arc<str>, keys: Vec<Arc<str>>) {
        LogJournal::retire(self, shop, keys)
    }
    fn admit(&self) -> Result<(), StoreError> {
        self.space().admit()
    }
}

pub struct EmbeddedLog {
    store: Arc<dyn RequestStore>,
    dispatcher: Dispatcher,
    /// The journal is another store (MongoDB): decided requests are retired by a write
    /// of their own, not by the journal's transaction.
    retire_separately: bool,
    /// This log's number in the process: what a thread holds for it is kept apart.
    id: usize,
}

/// Requests a thread was handed by [`RequestLog::append_held`] and has not handed on
/// yet, per log: in the order they came, those to be made durable first among them
/// (copies), and their calls' acknowledgements.
#[derive(Default)]
struct Held {
    reqs: Vec<Request>,
    logged: Vec<Request>,
    acks: Vec<LogAck>,
}

thread_local! {
    static HELD: RefCell<Vec<(usize, Held)>> = const { RefCell::new(Vec::new()) };
}

/// Numbers the embedded logs of the process.
static LOGS: AtomicUsize = AtomicUsize::new(0);

impl EmbeddedLog {
    /// `journal_is_store`: the request store is the journal itself (the embedded
    /// journal, whose entries retire the requests they decide).
    pub fn new(
        store: Arc<dyn RequestStore>,
        dispatcher: Dispatcher,
        journal_is_store: bool,
    ) -> EmbeddedLog {
        EmbeddedLog {
            store,
            dispatcher,
            retire_separately: !journal_is_store,
            id: LOGS.fetch_add(1, Ordering::Relaxed),
        }
    }

    /// Makes `logged` durable (a copy of each, handed to the log's writer first), then
    /// hands `reqs` to the processors and tells `acks` once `logged` is durable.
    fn hand_on(&self, reqs: Vec<Request>, logged: Vec<Request>, acks: Vec<LogAck>) {
        if !logged.is_empty() {
            self.store.accept(
                logged,
                Box::new(move |result| {
                    for ack in acks {
                        ack.done(result.clone());
                    }
                }),
            );
        } else {
            for ack in acks {
                ack.done(Ok(()));
            }
        }
        if !reqs.is_empty() {
            self.dispatcher.dispatch(reqs);
        }
    }
}

impl RequestLog for EmbeddedLog {
    fn append(&self, reqs: Vec<Request>, ack: Option<LogAck>) -> Result<(), StoreError> {
        // Before anything is handed on: a refusal takes back the whole call.
        self.store.admit()?;
        if !self.retire_separately {
            // The embedded journal: the acceptances' record is handed to the log's writer
            // now, before any decision of these requests can be (a processor gets them
            // only after it), and that writer keeps the order it is handed records in, so
            // a decision's record follows its acceptance's, in the same group commit or a
            // later one. The requests go to the processors at once: the acceptance and the
            // decision share a group commit more often than not (the writer then writes
            // the decision's record alone: see `journal::accepts_decided_alongside`), and
            // the log's writer wakes no processor. The 202 still waits for the
            // acceptance's sync: the writer tells the call after it.
            let logged = reqs.iter().filter(|r| r.logged).cloned().collect();
            self.hand_on(reqs, logged, ack.into_iter().collect());
            return Ok(());
        }
        let (logged, direct): (Vec<Request>, Vec<Request>) =
            reqs.into_iter().partition(|r| r.logged);
        if !direct.is_empty() {
            self.dispatcher.dispatch(direct);
        }
        let tell = move |result| {
            if let Some(ack) = ack {
                ack.done(result);
            }
        };
        if logged.is_empty() {
            tell(Ok(()));
            return Ok(());
        }
        let dispatcher = self.dispatcher.clone();
        let forward = logged.clone();
        self.store.accept(
            logged,
            Box::new(move |result| {
                // Only a durable request may reach a processor: its outcome's journal
                // write (MongoDB) retires the durable record (SQLite), which must exist
                // by then, and the two stores keep no order between them.
                if result.is_ok() {
                    dispatcher.dispatch(forward);
                }
                tell(result);
            }),
        );
        Ok(())
    }

    /// On the embedded journal, held on this thread until released: the acceptances of
    /// the burst's fire-and-forget requests go to the log's writer as one, and all its
    /// requests to the processors then, one message per shard. Each acceptance is still
    /// handed to the writer before its request reaches a processor. Beside another
    /// journal, as [`RequestLog::append`].
    fn append_held(&self, reqs: Vec<Request>, ack: Option<LogAck>) -> Result<bool, StoreError> {
        if self.retire_separately {
            return self.append(reqs, ack).map(|()| false);
        }
        self.store.admit()?;
        HELD.with(|held| {
            let mut held = held.borrow_mut();
            let at = match held.iter().position(|(id, _)| *id == self.id) {
                Some(at) => at,
                None => {
                    held.push((self.id, Held::default()));
                    held.len() - 1
                }
            };
            let h = &mut held[at].1;
            let logged = h.logged.len();
            h.logged.extend(reqs.iter().filter(|r| r.logged).cloned());
            // The burst's first call's list is kept whole, not copied.
            if h.reqs.is_empty() {
                h.reqs = reqs;
            } else {
                h.reqs.extend(reqs);
            }
            match ack {
                Some(ack) if h.logged.len() > logged => h.acks.push(ack),
                Some(ack) => ack.done(Ok(())),
                None => {}
            }
        });
        Ok(true)
    }

    fn release_held(&self) {
        let held = HELD.with(|held| {
            let mut held = held.borrow_mut();
            let at = held.iter().position(|(id, _)| *id == self.id)?;
            Some(held.swap_remove(at).1)
        });
        if let Some(Held { reqs, logged, acks }) = held {
            self.hand_on(reqs, logged, acks);
        }
    }

    fn pending(&self) -> Result<Vec<Request>, StoreError> {
        self.store.pending()
    }

    fn admit(&self) -> Result<(), StoreError> {
        self.store.admit()
    }

    fn redeliver(&self, reqs: Vec<Request>) {
        self.dispatcher.dispatch(reqs);
    }

    fn retire(&self, shop: &Arc<str>, keys: Vec<Arc<str>>) {
        if self.retire_separately {
            self.store.retire(shop.clone(), keys);
        }
    }
}
