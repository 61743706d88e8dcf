//! Reads by key and by item through the log's index (`nrtxn_log::index`), against the
//! real binary with 1 MiB segments, so that most keys are in sealed segments: a poll and
//! a resubmission find every key across segments and restarts, an item's events are
//! gapless across segments, a damaged block of a segment's index is rebuilt from its
//! segment, a damaged record of the log is refused when read, never served, and an ended
//! hold is read from the log once its row has left the views.

mod common;

use std::path::{Path, PathBuf};

use common::holds::{hold, holds_url};
use common::*;
use serde_json::{json, Value};

const FLAGS: [&str; 2] = ["--journal-segment-mb", "1"];
/// Batches of 1,000 sales: about 3 MB of log (some 40 bytes a sale), so two sealed
/// segments or more.
const BATCHES: usize = 80;

/// The files of the log with extension `ext` (`log`, `idx`), oldest first.
fn log_files(data: &Path, ext: &str) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(data.join("journal"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == ext))
        .collect();
    files.sort();
    files
}

fn sale(n: usize) -> Value {
    json!({"seller": "s", "item": "a", "qty": 1, "request_id": format!("k{n}")})
}

/// Loads `a` and sells one unit per key `k0`, `k1`, ... in batches of 1,000; returns the
/// answers, by key number.
async fn sell_in_batches(c: &reqwest::Client, server: &Server) -> Vec<Value> {
    load(c, server, "shop", &[("a", 1_000_000)]).await;
    let mut answers = Vec::new();
    for b in 0..BATCHES {
        let txns: Vec<Value> = (b * 1000..(b + 1) * 1000).map(sale).collect();
        let (status, res) = post(
            c,
            &server.url("/v1/shops/shop/txns/batch"),
            json!({ "txns": txns }),
        )
        .await;
        assert_eq!(status, 200, "{res}");
        answers.extend(res["results"].as_array().unwrap().iter().cloned());
    }
    assert!(answers.iter().all(|a| a["status"] == "ok"));
    answers
}

/// Checks `done` every 200 ms for up to 20 s; fails with `missing` if it never holds.
async fn wait_until(done: impl Fn() -> bool, missing: impl Fn() -> String) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while !done() {
        assert!(std::time::Instant::now() < deadline, "{}", missing());
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
}

/// Waits until the sealed segments have their index files (written off the log's
/// writer, every 2 s at most).
async fn wait_for_indexes(data: &Path) {
    wait_until(
        || {
            log_files(data, "idx").len() + 1 >= log_files(data, "log").len()
                && !log_files(data, "idx").is_empty()
        },
        || {
            format!(
                "sealed segments without an index: {:?} {:?}",
                log_files(data, "log"),
                log_files(data, "idx")
            )
        },
    )
    .await;
}

/// Waits until the server's log in `dir` says the filter over the sealed segments' keys
/// was built (the maintenance thread, every 2 s): from then on a key check asks it,
/// not each segment's own filter.
async fn wait_for_key_filter(dir: &Path) {
    let built = "filter over the sealed segments' keys was built";
    wait_until(
        || {
            std::fs::read_to_string(dir.join("server.log"))
                .unwrap_or_default()
                .contains(built)
        },
        || "no filter over the sealed segments' keys".to_string(),
    )
    .await;
}

/// Keys from every part of the log poll as they were answered, and a resubmission of
/// each is answered the same, applied once.
async fn keys_answer_as_before(c: &reqwest::Client, server: &Server, answers: &[Value]) {
    let sample: Vec<usize> = (0..answers.len())
        .step_by(997)
        .chain([answers.len() - 1])
        .collect();
    for &n in &sample {
        let (status, polled) = get(c, &server.url(&format!("/v1/shops/shop/txns/k{n}"))).await;
        assert_eq!((status, &polled), (200, &answers[n]), "k{n}");
        let (status, again) = post(c, &server.url("/v1/shops/shop/txns"), sale(n)).await;
        assert_eq!((status, &again), (200, &answers[n]), "k{n} resubmitted");
    }
    let (_, item) = get(c, &server.url("/v1/shops/shop/items/a")).await;
    let sold = answers.len() as i64;
    assert_eq!(
        (item["stock"].as_i64(), item["seq"].as_i64()),
        (Some(1_000_000 - sold), Some(sold + 1)),
        "{item}"
    );
}

/// The item's events from `after` on, page by page: (seqs, the first status other
/// than 200 with its body).
async fn walk_events(
    c: &reqwest::Client,
    server: &Server,
    mut after: u64,
) -> (Vec<u64>, Option<(u16, Value)>) {
    let mut seqs = Vec::new();
    loop {
        let url = server.url(&format!(
            "/v1/shops/shop/items/a/events?after={after}&limit=1000"
        ));
        let (status, body) = get(c, &url).await;
        if status != 200 {
            return (seqs, Some((status, body)));
        }
        let page = body["events"].as_array().unwrap();
        if page.is_empty() {
            return (seqs, None);
        }
        for e in page {
            after = e["seq"].as_u64().unwrap();
            seqs.push(after);
        }
    }
}

/// Sells in batches on a fresh server in `dir`, waits for the sealed segments' index
/// files, and stops it cleanly: the answers, by key number.
async fn sold_and_stopped(dir: &Path) -> Vec<Value> {
    sold_and_stopped_env(dir, &[]).await
}

/// [`sold_and_stopped`] by a server whose environment is given `env`.
async fn sold_and_stopped_env(dir: &Path, env: &[(&str, &str)]) -> Vec<Value> {
    let mut server = Server::start_env(dir, &FLAGS, env);
    let answers = sell_in_batches(&client(), &server).await;
    wait_for_indexes(&dir.join("data")).await;
    assert!(server.terminate().success());
    answers
}

/// Flips one bit of byte `at` of the file at `path`, as a disk would.
fn flip_bit(path: &Path, at: impl FnOnce(usize) -> usize) {
    let mut bytes = std::fs::read(path).unwrap();
    let at = at(bytes.len());
    bytes[at] ^= 1;
    std::fs::write(path, bytes).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_and_events_are_found_across_sealed_segments_and_restarts() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let mut server = Server::start(dir.path(), &FLAGS);
    let c = client();
    let answers = sell_in_batches(&c, &server).await;
    wait_for_indexes(&data).await;
    assert!(
        log_files(&data, "log").len() >= 3,
        "{:?}",
        log_files(&data, "log")
    );
    // Resubmissions screened through the filter over the sealed segments' keys: each
    // found there, none applied again.
    wait_for_key_filter(dir.path()).await;
    keys_answer_as_before(&c, &server, &answers).await;
    // Every event, gapless across the segments: the load, then each sale.
    let (seqs, failed) = walk_events(&c, &server, 0).await;
    assert_eq!(failed, None);
    assert_eq!(seqs, (1..=answers.len() as u64 + 1).collect::<Vec<u64>>());
    // After a clean stop and after a kill, from the index files and the newest segment.
    assert!(server.terminate().success());
    let mut server = Server::start(dir.path(), &FLAGS);
    keys_answer_as_before(&c, &server, &answers).await;
    server.kill();
    let server = Server::start(dir.path(), &FLAGS);
    keys_answer_as_before(&c, &server, &answers).await;
    let log = std::fs::read_to_string(dir.path().join("server.log")).unwrap();
    assert!(!log.contains("rebuilding"), "an index was rebuilt: {log}");
}

/// A block of a sealed segment's index damaged on disk (its checksum no longer matches)
/// is found when a lookup reads it: the index is rebuilt from its segment and the key
/// answered, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_damaged_block_of_a_segments_index_is_rebuilt_from_the_segment() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let answers = sold_and_stopped(dir.path()).await;
    let c = client();
    // The first key block holds the segment's smallest key hashes: among the first
    // batch's keys (all in the first segment), the smallest hash is read from it.
    flip_bit(&log_files(&data, "idx")[0], |_| 100);
    let n = (0..1000)
        .min_by_key(|n| nrtxn_log::index::key_hash("shop", &format!("k{n}")))
        .unwrap();
    let server = Server::start(dir.path(), &FLAGS);
    let (status, polled) = get(&c, &server.url(&format!("/v1/shops/shop/txns/k{n}"))).await;
    assert_eq!((status, &polled), (200, &answers[n]), "k{n}");
    let log = std::fs::read_to_string(dir.path().join("server.log")).unwrap();
    assert!(
        log.contains("rebuilding the index from its segment"),
        "{log}"
    );
    keys_answer_as_before(&c, &server, &answers).await;
}

/// The views as versions before their `records` wrote them: a `journal` row per entry.
const ROWS: [(&str, &str); 1] = [("NRTXN_FAULT_VIEWS_ROWS", "1")];

/// A record of a sealed segment damaged on disk (a bit flipped in its body) is never
/// served: the read that finds it fails its checksum, and the item's events are read
/// from the views' rows an older version wrote instead, whole and gapless.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_damaged_record_of_the_log_is_not_served_its_events_come_from_older_rows() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let answers = sold_and_stopped_env(dir.path(), &ROWS).await;
    let c = client();
    flip_bit(&log_files(&data, "log")[0], |len| len / 2);
    let server = Server::start(dir.path(), &FLAGS);
    let (seqs, failed) = walk_events(&c, &server, 0).await;
    assert_eq!(failed, None);
    assert_eq!(seqs, (1..=answers.len() as u64 + 1).collect::<Vec<u64>>());
    let log = std::fs::read_to_string(dir.path().join("server.log")).unwrap();
    assert!(log.contains("checksum does not match"), "{log}");
    assert!(
        log.contains("events read from the views instead of the log"),
        "{log}"
    );
}

/// A hold that ended keeps its row in the views' `holds` table (the listing reads it)
/// until the key window has passed its expiry; once the row is gone, its state is read
/// from the log, its making and its ending, across a restart too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ended_hold_is_read_from_the_log_once_its_row_is_gone() {
    let dir = tempfile::tempdir().unwrap();
    let mut server = Server::start(dir.path(), &[]);
    let c = client();
    load(&c, &server, "s", &[("sku", 10)]).await;
    let (status, h1) = hold(&c, &server, "s", "h1", "sku", 3, 60_000).await;
    assert_eq!(status, 200, "{h1}");
    let (status, _) = hold(&c, &server, "s", "h2", "sku", 1, 60_000).await;
    assert_eq!(status, 200);
    let (status, confirmed) = post(&c, &holds_url(&server, "s", "/h1/confirm"), json!({})).await;
    assert_eq!(
        (status, &confirmed["status"]),
        (200, &json!("confirmed")),
        "{confirmed}"
    );
    let read = |server: &Server, id: &str| {
        let url = holds_url(server, "s", &format!("/{id}"));
        let c = c.clone();
        async move { get(&c, &url).await }
    };
    let want = |h: &Value| {
        (
            h["status"].clone(),
            h["qty"].clone(),
            h["item"].clone(),
            h["seq"].clone(),
        )
    };
    let (status, got) = read(&server, "h1").await;
    assert_eq!(status, 200, "{got}");
    assert_eq!(
        want(&got),
        (json!("confirmed"), json!(3), json!("sku"), json!(4))
    );
    assert!(server.terminate().success());
    let views = rusqlite::Connection::open(dir.path().join("data/nrtxn.db")).unwrap();
    let status: String = views
        .query_row("SELECT status FROM holds WHERE hold_id = 'h1'", [], |r| {
            r.get(0)
        })
        .unwrap();
    assert_eq!(status, "confirmed", "the ended hold keeps its row");
    // As the prune past the key window leaves it.
    views
        .execute("DELETE FROM holds WHERE hold_id = 'h1'", [])
        .unwrap();
    let rows: Vec<String> = views
        .prepare("SELECT hold_id FROM holds ORDER BY hold_id")
        .unwrap()
        .query_map([], |r| r.get(0))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    assert_eq!(rows, ["h2"]);
    drop(views);
    let server = Server::start(dir.path(), &[]);
    let (status, got) = read(&server, "h1").await;
    assert_eq!(status, 200, "{got}");
    assert_eq!(
        want(&got),
        (json!("confirmed"), json!(3), json!("sku"), json!(4))
    );
    let (status, got) = read(&server, "h2").await;
    assert_eq!((status, &got["status"]), (200, &json!("held")), "{got}");
    // Ending it again is answered with its state, from the log.
    let (status, again) = post(&c, &holds_url(&server, "s", "/h1/cancel"), json!({})).await;
    assert_eq!(
        (status, &again["status"]),
        (409, &json!("confirmed")),
        "{again}"
    );
}

/// The log's oldest segment deleted by hand (not retired: its keys are within the key
/// window) refuses the start, rather than answering its keys as never seen.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_oldest_segment_refuses_the_start() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    sold_and_stopped(dir.path()).await;
    std::fs::remove_file(&log_files(&data, "log")[0]).unwrap();
    let (status, stderr) = serve_expecting_exit(dir.path(), &["--listen", "127.0.0.1:0"]);
    assert!(!status.success(), "started without its oldest segment");
    assert!(
        stderr.contains("journal has a gap")
            && stderr.contains("segments were retired only up to record 1"),
        "{stderr}"
    );
}

/// A damaged record of an older segment (the start reads those by their footers alone)
/// does not cost its keys their answers when an older version's views hold them: a poll
/// that finds the record damaged is answered from the views' rows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_in_a_damaged_record_is_answered_from_older_rows() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let answers = sold_and_stopped_env(dir.path(), &ROWS).await;
    flip_bit(&log_files(&data, "log")[0], |len| len / 2);
    let server = Server::start(dir.path(), &FLAGS);
    let c = client();
    // Every key of the first batches: some are in the damaged record.
    for (n, a) in answers.iter().enumerate().take(20_000).step_by(7) {
        let (status, polled) = get(&c, &server.url(&format!("/v1/shops/shop/txns/k{n}"))).await;
        assert_eq!((status, &polled), (200, a), "k{n}");
    }
    let log = std::fs::read_to_string(dir.path().join("server.log")).unwrap();
    assert!(
        log.contains("outcomes read from the views instead of the log"),
        "{log}"
    );
}

/// Views that keep a row per record of the log, not per entry, hold no second copy of a
/// decision: a key in a damaged record of an older segment is answered with an error
/// (never `404`, which would take it for a new key), its resubmission is refused, not
/// applied again, and the item's events stop at the damage with an error, not a short
/// page.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_in_a_damaged_record_is_refused_never_taken_for_a_new_one() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let answers = sold_and_stopped(dir.path()).await;
    flip_bit(&log_files(&data, "log")[0], |len| len / 2);
    let server = Server::start(dir.path(), &FLAGS);
    let c = client();
    let mut refused = None;
    for (n, a) in answers.iter().enumerate().take(20_000).step_by(7) {
        let (status, polled) = get(&c, &server.url(&format!("/v1/shops/shop/txns/k{n}"))).await;
        match status {
            200 => assert_eq!(&polled, a, "k{n}"),
            _ => {
                assert!(status >= 500, "k{n}: {status} {polled}");
                refused.get_or_insert(n);
            }
        }
    }
    let n = refused.expect("a key of the damaged record");
    let (_, before) = get(&c, &server.url("/v1/shops/shop/items/a")).await;
    let (status, again) = post(&c, &server.url("/v1/shops/shop/txns"), sale(n)).await;
    assert!(status >= 500, "k{n} resubmitted: {status} {again}");
    let (_, after) = get(&c, &server.url("/v1/shops/shop/items/a")).await;
    assert_eq!(after["seq"], before["seq"], "nothing applied: {after}");
    let (_, failed) = walk_events(&c, &server, 0).await;
    assert!(
        failed.as_ref().is_some_and(|(s, _)| *s >= 500),
        "{failed:?}"
    );
}
