//! A full disk (issue 14). The campaign's disk-full case (`scripts/faults_disk.py`, as
//! root on a tmpfs) fills a real disk under load; here, without root, the start's check
//! is met by asking for more free space than any disk has.

mod common;

use common::*;

#[test]
fn a_start_on_a_disk_below_the_free_minimum_is_refused_saying_what_to_do() {
    let dir = tempfile::tempdir().unwrap();
    // 1 TiB free asked for: more than this machine's disk has.
    let (status, stderr) = serve_expecting_exit(
        dir.path(),
        &["--listen", "127.0.0.1:0", "--disk-free-min-mb", "1048576"],
    );
    assert!(!status.success(), "exit status {status:?}");
    let said = stderr.lines().last().unwrap_or_default();
    assert!(
        said.contains("is full")
            && said.contains("less than the 1048576.0 MiB")
            && said.contains("--disk-free-min-mb")
            && said.contains("Free space on that disk")
            && said.contains("then start again"),
        "{stderr}"
    );
    // Refused before anything is written: not even the data dir is made.
    assert!(!dir.path().join("data").exists());
}
