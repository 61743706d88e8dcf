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

/// Resolves with the name of the first of SIGINT or SIGTERM to arrive.
pub async fn stop_signal() -> anyhow::Result<&'static str> {
    use actix_rt::signal::unix::{signal, SignalKind};
    use anyhow::Context;
    let mut term = signal(SignalKind::terminate()).context("cannot listen for SIGTERM")?;
    tokio::select! {
        r = actix_rt::signal::ctrl_c() => r.map(|()| "SIGINT").context("cannot listen for SIGINT"),
        _ = term.recv() => Ok("SIGTERM"),
    }
}
