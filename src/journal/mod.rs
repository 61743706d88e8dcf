//! The embedded journal's append-only log (issue 12): segment files of checksummed,
//! hash-chained records ([`segment`]) whose bodies are packed batches of entries
//! ([`codec`]). See `docs/decisions/journal-log.md` for the layout and why.

pub mod codec;
pub mod seal;
pub mod segment;
pub mod store;

pub use store::{LogJournal, Retention};
