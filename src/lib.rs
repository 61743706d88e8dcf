//! The `nrtxn` binary's library: configuration, the embedded adapters (SQLite journal,
//! in-process request log) and the wiring of `serve`.

pub mod config;
pub mod embedded_log;
pub mod keyfilter;
pub mod mongo;
pub mod server;
pub mod sqlite;
