//! The embedded journal, which needs no server: the log's group commit ([`journal`]:
//! `LogJournal`, one writer thread making batches of decisions durable with one
//! `fdatasync`), the views derived from the log that every read is answered from
//! ([`views`]: SQLite, `nrtxn.db`), and the request log that makes fire-and-forget
//! requests durable before their `202` ([`request_log`]). Beside a MongoDB journal the
//! same views store keeps the request log on its own. The log's format is `nrtxn-log`'s.

use nrtxn_actors::StoreError;
pub use records::RecordAt;

mod coalesce;
pub mod journal;
mod log_reads;
mod records;
pub mod request_log;
pub mod views;

/// Called once requests handed to a request log's `accept` are durable (or failed).
pub type AcceptDone = Box<dyn FnOnce(Result<(), StoreError>) + Send>;
