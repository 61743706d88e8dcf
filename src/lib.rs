//! The `nrtxn` binary's library: configuration, the wiring of `serve` (the journal, the
//! request log, the engine, the HTTP front), the access key store, the push stream,
//! backup and restore. The stores are crates of their own (`nrtxn-log`,
//! `nrtxn-embedded`, `nrtxn-mongo`), as are the check-back (`nrtxn-checkback`) and the
//! clients (`nrtxn-client`).

pub mod backup;
pub mod config;
mod front;
pub mod keys;
pub mod memory;
pub mod server;
pub mod stream;
