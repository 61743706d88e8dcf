//! The one place the process stops on its own, with the reason.
//!
//! nrtxn stops itself only when memory is ahead of what is durable: a journal write (or
//! a read a batch depends on) that cannot be made after its retries. Going on would
//! answer callers with outcomes that are not durable, or decide on state the journal
//! does not hold; stopping lets a restart rebuild every item from what the journal
//! really holds, and callers poll or resubmit their keys (at most once either way).
//! Every other way out of `serve` returns an error to `main`, after the node is drained
//! and shut down.

/// The exit status of such a stop (`EX_SOFTWARE`): a supervisor restarts the process.
pub const EXIT_NOT_DURABLE: i32 = 70;

/// Logs `reason` and exits with [`EXIT_NOT_DURABLE`]. Called from the writer or reader
/// that failed, on its own thread: nothing else may run on state that is not durable.
pub fn stop_not_durable(reason: impl std::fmt::Display) -> ! {
    tracing::error!("stopping (exit {EXIT_NOT_DURABLE}): {reason}");
    std::process::exit(EXIT_NOT_DURABLE)
}
