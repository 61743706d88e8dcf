//! Crash and shutdown: the real binary under concurrent load, killed with SIGKILL (or
//! stopped with SIGTERM), restarted on the same data directory.

mod common;

use common::load::*;
use common::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_under_load_loses_no_answered_or_accepted_request() {
    // Killed once a good number of requests were answered, while more are in flight.
    let enough = |s: &Seen| s.outcomes.len() >= 500 && s.accepted.len() >= 500;
    let (_dir, server, seen) = load_then_stop(&[], 32, enough, Server::kill).await;
    assert!(enough(&seen), "load too small to test");
    check_after_restart(&server, &seen).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_in_flight_work_and_exits_zero() {
    let mut status = None;
    let (_dir, server, seen) = load_then_stop(
        &[],
        16,
        |s| s.outcomes.len() >= 300,
        |server| status = Some(server.terminate()),
    )
    .await;
    let status = status.unwrap();
    assert!(status.success(), "exit status {status:?}");
    check_after_restart(&server, &seen).await;
}
