//! The `nrtxn` binary's library: configuration, the embedded adapters (SQLite journal,
//! in-process request log), the wiring of `serve`, and the event follower of `follow`.

pub mod backup;
pub mod checkback;
pub mod config;
pub mod embedded_log;
pub mod faults;
pub mod journal;
pub mod keyfilter;
pub mod keys;
pub mod memory;
pub mod mongo;
pub mod outbound;
pub mod secret_file;
pub mod server;
pub mod space;
pub mod sqlite;
pub mod stream;
