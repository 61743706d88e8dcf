//! The embedded journal's append-only log and what the stores beside it share.
//!
//! The log is segment files of checksummed, hash-chained records ([`segment`]) whose
//! bodies are packed batches of entries ([`codec`]); a sealed segment ends with a footer,
//! and the durable mark tells an acknowledged record lost from a torn write ([`seal`]);
//! the next segment is zero-filled ahead by a thread of its own ([`spare`]) and then
//! written with direct I/O, a group's records in one durable write ([`direct`]);
//! see `docs/decisions/journal-log.md` and `docs/decisions/log-ends.md`. Beside it: the
//! room on the data dir's disk that every writer asks before it writes ([`space`]), the
//! fixed-size filter of request keys the journals fill at start ([`keyfilter`]), the
//! faults tests inject through the environment ([`faults`]), and files of secrets kept
//! owner-only ([`secret_file`]). The views derived from the log as sorted indexes of
//! log positions, one per segment, are in [`index`] (not wired into the journal yet);
//! the group commit that writes this log, and today's views, are in `nrtxn-embedded`.

pub mod codec;
pub mod direct;
pub mod faults;
pub mod index;
pub mod keyfilter;
pub mod record;
pub mod seal;
pub mod secret_file;
pub mod segment;
pub mod space;
pub mod spare;
