//! The embedded request log: an in-process hand-off to the processors, with the
//! fire-and-forget requests made durable in the embedded store first.
//!
//! A caller that waits (respond=true) needs no durable request: its answer is given only
//! once the outcome is journaled, and a crash before that leaves no promise behind. A
//! fire-and-forget caller is promised an outcome by its 202, so its request is written
//! to the store's `requests` table before the 202 and retired in the same transaction
//! that journals its outcome; at start, what is left there is resumed.

use std::sync::Arc;

use nrtxn_actors::{Dispatcher, Durable, Request, RequestLog, StoreError};
use tokio::sync::oneshot;

use crate::sqlite::SqliteStore;

pub struct EmbeddedLog {
    store: Arc<SqliteStore>,
    dispatcher: Dispatcher,
    /// The journal is another store (MongoDB): decided requests are retired by a write
    /// of their own, not by the journal's transaction.
    retire_separately: bool,
}

impl EmbeddedLog {
    /// `journal_is_store`: the same SQLite store is also the journal.
    pub fn new(
        store: Arc<SqliteStore>,
        dispatcher: Dispatcher,
        journal_is_store: bool,
    ) -> EmbeddedLog {
        EmbeddedLog {
            store,
            dispatcher,
            retire_separately: !journal_is_store,
        }
    }
}

impl RequestLog for EmbeddedLog {
    fn append(&self, reqs: Vec<Request>) -> Result<Option<Durable>, StoreError> {
        let (logged, direct): (Vec<Request>, Vec<Request>) =
            reqs.into_iter().partition(|r| r.logged);
        if !direct.is_empty() {
            self.dispatcher.dispatch(direct);
        }
        if logged.is_empty() {
            return Ok(None);
        }
        let (tx, rx) = oneshot::channel();
        let dispatcher = self.dispatcher.clone();
        let forward = logged.clone();
        self.store.accept(
            logged,
            Box::new(move |result| {
                // Only a durable request may reach a processor: its outcome's journal
                // write retires the durable record, which must exist by then.
                if result.is_ok() {
                    dispatcher.dispatch(forward);
                }
                let _ = tx.send(result);
            }),
        );
        Ok(Some(rx))
    }

    fn pending(&self) -> Result<Vec<Request>, StoreError> {
        self.store.pending()
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
