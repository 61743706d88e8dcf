//! Faults the tests inject through the environment, to produce on purpose a state that
//! timing produces only now and then. Production never sets them; each says so in the
//! log when it is set.

use std::time::Duration;

/// `NRTXN_FAULT_JOURNAL_HOLD_MS`: each journal write of decisions waits this long before
/// it is made durable (the embedded log: before its `fdatasync`; MongoDB: inside the
/// transaction, before the fence), as a slow disk or database would. A process killed
/// or stopped under load is then caught with decisions made and not yet durable.
pub fn journal_hold() -> Option<Duration> {
    fault_ms(
        "NRTXN_FAULT_JOURNAL_HOLD_MS",
        "fault injected: each journal write is held back",
    )
}

/// `NRTXN_FAULT_JOURNAL_READ_MS`: each read of items' states from the embedded journal
/// waits this long first, as a slow disk would: an item that left memory is then read
/// back while the test checks what else the server still answers.
pub fn journal_read_hold() -> Option<Duration> {
    fault_ms(
        "NRTXN_FAULT_JOURNAL_READ_MS",
        "fault injected: each journal read of items is held back",
    )
}

/// `NRTXN_FAULT_JOURNAL_HOLD_READ_MS`: each read of holds from the embedded journal waits
/// this long first, as a slow disk would: a call that reads a hold and then decides
/// (an extension, an ending) is caught with its reply timeout partly spent reading.
pub fn journal_read_hold_of_holds() -> Option<Duration> {
    fault_ms(
        "NRTXN_FAULT_JOURNAL_HOLD_READ_MS",
        "fault injected: each journal read of holds is held back",
    )
}

/// `NRTXN_FAULT_KEEP_SEGMENTS=1`: the embedded log's segments are never retired, as
/// when the views' checkpoint falls behind: older segments the views already hold stay,
/// for the tests that damage them.
pub fn keep_segments() -> bool {
    let keep = std::env::var("NRTXN_FAULT_KEEP_SEGMENTS").is_ok_and(|v| v == "1");
    if keep {
        tracing::warn!("fault injected: the journal's segments are never retired");
    }
    keep
}

/// `NRTXN_FAULT_VIEWS_ROWS=1`: the embedded journal's views write a `journal` row per
/// entry, as versions before the views' `records` did: a data dir as such a version
/// left it, for the tests that take one over.
pub fn views_rows() -> bool {
    let rows = std::env::var("NRTXN_FAULT_VIEWS_ROWS").is_ok_and(|v| v == "1");
    if rows {
        tracing::warn!("fault injected: the views write a row per entry, as older versions did");
    }
    rows
}

/// `NRTXN_FAULT_EXPIRY_COPIES=N`: with a shared log, a node lets a hold go after N copies
/// of its expiry (at waits of 1, 2, 4, ... s) rather than the fifteen of about ten
/// minutes: the let-go, which an outage of that length produces, is reached in seconds.
pub fn expiry_copies() -> Option<u8> {
    fault_value(
        "NRTXN_FAULT_EXPIRY_COPIES",
        "fault injected: a hold's expiry is let go after fewer copies",
    )
}

/// The milliseconds in `var`, if it is set to a number: said in the log as `what`.
fn fault_ms(var: &str, what: &str) -> Option<Duration> {
    fault_value(var, what).map(Duration::from_millis)
}

/// The number in `var`, if it is set to one: said in the log as `what`.
fn fault_value<T: std::str::FromStr + std::fmt::Display>(var: &str, what: &str) -> Option<T> {
    let value: T = std::env::var(var).ok()?.parse().ok()?;
    tracing::warn!(%value, "{what}");
    Some(value)
}
