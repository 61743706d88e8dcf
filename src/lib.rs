//! The `nrtxn` binary's library: configuration, the wiring of `serve` (the journal, the
//! request log, the engine, the HTTP front), the check-back's calls to shops, the access
//! key store, backup and restore. The stores are crates of their own: `nrtxn-log`,
//! `nrtxn-embedded`, `nrtxn-mongo`; the clients are `nrtxn-client`.

pub mod backup;
pub mod checkback;
pub mod config;
pub mod keys;
pub mod memory;
pub mod outbound;
pub mod secret_file;
pub mod server;
pub mod stream;
