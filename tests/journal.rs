//! The embedded journal's log, against the real binary: a torn tail is cut
//! off with every acknowledged outcome kept, a damaged record inside the log refuses the
//! start naming the file and offset, and lost views are rebuilt from the log whole.

mod common;

use std::path::{Path, PathBuf};

use common::*;
use serde_json::{json, Value};

/// The log's segments, oldest first.
fn segments(data: &Path) -> Vec<PathBuf> {
    let mut segs: Vec<PathBuf> = std::fs::read_dir(data.join("journal"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "log"))
        .collect();
    segs.sort();
    segs
}

/// Loads `sku` with 100 and sells 1 twenty times, then kills the server: the outcomes
/// every caller was given.
async fn sell_then_kill(dir: &Path) -> Vec<Value> {
    sell_then_kill_env(dir, &[]).await
}

/// The views as versions before their `records` left them: a `journal` row per entry.
const ROWS: [(&str, &str); 1] = [("NRTXN_FAULT_VIEWS_ROWS", "1")];

/// [`sell_then_kill`] with the server's environment given `env`.
async fn sell_then_kill_env(dir: &Path, env: &[(&str, &str)]) -> Vec<Value> {
    let mut server = Server::start_env(dir, &[], env);
    let c = client();
    load(&c, &server, "shop", &[("sku", 100)]).await;
    let mut answered = Vec::new();
    for i in 0..20 {
        let (status, body) = post(
            &c,
            &server.url("/v1/shops/shop/txns"),
            json!({"seller": "s", "item": "sku", "qty": 1, "request_id": format!("k{i}")}),
        )
        .await;
        assert_eq!((status, &body["status"]), (200, &json!("ok")), "{body}");
        answered.push(body);
    }
    server.kill();
    answered
}

/// Every outcome polls as it was answered, and the item adds up.
async fn check_answers(server: &Server, answered: &[Value]) {
    let c = client();
    for a in answered {
        let key = a["request_key"].as_str().unwrap();
        let (status, polled) = get(&c, &server.url(&format!("/v1/shops/shop/txns/{key}"))).await;
        assert_eq!((status, &polled), (200, a), "{key}");
    }
    let (_, item) = get(&c, &server.url("/v1/shops/shop/items/sku")).await;
    assert_eq!(
        (item["stock"].as_i64(), item["seq"].as_u64()),
        (Some(80), Some(21))
    );
}

/// Starts the server on `dir` and stops it cleanly (SIGTERM), which writes every item's
/// snapshot into the views.
async fn start_and_stop(dir: &Path) {
    start_and_stop_env(dir, &[]).await
}

/// [`start_and_stop`] with the server's environment given `env`.
async fn start_and_stop_env(dir: &Path, env: &[(&str, &str)]) {
    let mut server = Server::start_env(dir, &[], env);
    wait_ready(&client(), &server).await;
    let stopped = server.terminate();
    assert!(
        stopped.success(),
        "{stopped}: {}",
        std::fs::read_to_string(dir.join("server.log")).unwrap_or_default()
    );
}

/// A start on damaged views (`what`) is refused, its message saying each of `says`;
/// once the views are moved away the next start rebuilds them from the log, whole.
async fn refused_then_rebuilt(dir: &Path, answered: &[Value], what: &str, says: &[&str]) {
    let (status, stderr) = serve_expecting_exit(dir, &["--listen", "127.0.0.1:0"]);
    assert!(!status.success(), "started on {what}");
    assert!(says.iter().all(|s| stderr.contains(s)), "{stderr}");
    delete_views(&dir.join("data"));
    let server = Server::start(dir, &[]);
    check_answers(&server, answered).await;
}

/// Deletes the views (SQLite's files), as an operator moving damaged ones away does.
fn delete_views(data: &Path) {
    for f in ["nrtxn.db", "nrtxn.db-wal", "nrtxn.db-shm"] {
        let _ = std::fs::remove_file(data.join(f));
    }
}

/// Changes the views behind nrtxn's back with `sql`, which must change one row.
fn tamper_views(data: &Path, sql: &str) {
    let views = rusqlite::Connection::open(data.join("nrtxn.db")).unwrap();
    assert_eq!(views.execute(sql, []).unwrap(), 1, "{sql}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_torn_tail_is_cut_off_and_every_acknowledged_outcome_stays() {
    let dir = tempfile::tempdir().unwrap();
    let answered = sell_then_kill(dir.path()).await;
    // A record half written when the process died: a header's worth of bytes that do
    // not check out, at the end of the last segment.
    let last = segments(&dir.path().join("data")).pop().unwrap();
    let mut data = std::fs::read(&last).unwrap();
    let good = data.len();
    data.extend_from_slice(&[0xAB; 50]);
    std::fs::write(&last, &data).unwrap();
    let server = Server::start(dir.path(), &[]);
    check_answers(&server, &answered).await;
    assert_eq!(
        std::fs::metadata(&last).unwrap().len() as usize,
        good,
        "tail cut off"
    );
    // And the log goes on from there.
    let c = client();
    let (status, next) = post(
        &c,
        &server.url("/v1/shops/shop/txns"),
        json!({"seller": "s", "item": "sku", "qty": 1, "request_id": "after"}),
    )
    .await;
    assert_eq!((status, &next["seq"]), (200, &json!(22)), "{next}");
}

/// Cuts the last `bytes` bytes of the file at `path`.
fn cut_end(path: &Path, bytes: u64) {
    let f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    let len = f.metadata().unwrap().len();
    f.set_len(len - bytes).unwrap();
}

/// Acknowledged sales cut from the log's tail are no torn write: the start is refused,
/// naming the records missing, where a cut taken for a torn tail would answer their keys
/// 404 and give their seqs to other sales. The views are moved away first, so that only
/// the log (and its durable mark) says what was acknowledged, as when the views had not
/// yet caught up at the kill.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acknowledged_records_cut_from_the_tail_refuse_the_start_naming_them() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let answered = sell_then_kill(dir.path()).await;
    delete_views(&data);
    let last = segments(&data).pop().unwrap();
    let whole = std::fs::read(&last).unwrap();
    cut_end(&last, 100);
    let (status, stderr) = serve_expecting_exit(dir.path(), &["--listen", "127.0.0.1:0"]);
    assert!(!status.success(), "started on a log cut short");
    assert!(
        stderr.contains(&last.display().to_string())
            && stderr.contains("were acknowledged and are missing")
            && stderr.contains("DURABLE"),
        "{stderr}"
    );
    // The bytes put back, everything answered is there again.
    std::fs::write(&last, &whole).unwrap();
    let server = Server::start(dir.path(), &[]);
    check_answers(&server, &answered).await;
}

/// An older segment, which the views already hold and a start does not read, cut short
/// refuses the start naming it: it is checked against its footer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_older_segment_cut_short_refuses_the_start_and_a_flip_inside_is_reported() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let flags = ["--journal-segment-mb", "1"];
    // Older segments kept (as a checkpoint falling behind keeps them), so that there
    // are some the views hold and the start does not read.
    let keep = [("NRTXN_FAULT_KEEP_SEGMENTS", "1")];
    let mut server = Server::start_env(dir.path(), &flags, &keep);
    let c = client();
    let names: Vec<String> = (0..2_000).map(|i| format!("item-{i:05}")).collect();
    for round in 0..60 {
        let items: Vec<(&str, i64)> = names.iter().map(|n| (n.as_str(), round)).collect();
        load(&c, &server, "shop", &items).await;
    }
    server.kill();
    let segs = segments(&data);
    assert!(segs.len() >= 3, "{segs:?}");
    // The second newest: sealed, and before what the views hold.
    let older = &segs[segs.len() - 2];
    let whole = std::fs::read(older).unwrap();
    cut_end(older, 100);
    let (status, stderr) = serve_expecting_exit(dir.path(), &["--listen", "127.0.0.1:0"]);
    assert!(!status.success(), "started on an older segment cut short");
    assert!(stderr.contains(&older.display().to_string()), "{stderr}");
    std::fs::write(older, &whole).unwrap();
    // A clean stop: the item snapshot covers every entry, so no start reads the oldest
    // segment's records for the items' states.
    let mut server = Server::start_env(dir.path(), &flags, &keep);
    wait_ready(&c, &server).await;
    assert!(server.terminate().success());

    // A byte flipped inside the oldest one's records: the start checks it by its footer
    // and goes on; the full read after the start finds it and says so.
    let mut oldest = std::fs::read(&segs[0]).unwrap();
    let at = oldest.len() / 2;
    oldest[at] ^= 0x20;
    std::fs::write(&segs[0], &oldest).unwrap();
    let server = Server::start_env(dir.path(), &flags, &keep);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        let text = c
            .get(server.url("/metrics"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        if text.contains("nrtxn_journal_damaged_segments 1") {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the damage was not reported: {}",
            text.lines()
                .filter(|l| l.contains("damaged"))
                .collect::<Vec<_>>()
                .join("\n")
        );
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    let log = std::fs::read_to_string(dir.path().join("server.log")).unwrap();
    assert!(log.contains(&segs[0].display().to_string()), "{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_damaged_record_inside_the_log_refuses_the_start_with_file_and_offset() {
    let dir = tempfile::tempdir().unwrap();
    sell_then_kill(dir.path()).await;
    let seg = segments(&dir.path().join("data")).remove(0);
    let mut data = std::fs::read(&seg).unwrap();
    // A byte in the middle of the log: records after it were acknowledged.
    let at = data.len() / 2;
    data[at] ^= 0x40;
    std::fs::write(&seg, &data).unwrap();
    let (status, stderr) = serve_expecting_exit(dir.path(), &["--listen", "127.0.0.1:0"]);
    assert!(!status.success());
    assert!(
        stderr.contains(&seg.display().to_string()) && stderr.contains("at byte"),
        "{stderr}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_views_are_rebuilt_from_the_log() {
    let dir = tempfile::tempdir().unwrap();
    let answered = sell_then_kill(dir.path()).await;
    delete_views(&dir.path().join("data"));
    let server = Server::start(dir.path(), &[]);
    check_answers(&server, &answered).await;
    let c = client();
    let (_, page) = get(
        &c,
        &server.url("/v1/shops/shop/items/sku/events?after=0&limit=100"),
    )
    .await;
    let seqs: Vec<u64> = page["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["seq"].as_u64().unwrap())
        .collect();
    assert_eq!(seqs, (1..=21).collect::<Vec<u64>>());
}

/// A bit flipped in an item's snapshot in the views (here: its stock changed behind
/// nrtxn's back) is refused at start, naming the item and saying what to do, never served
/// as the item's stock; moving the views away rebuilds them from the log, whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_damaged_snapshot_in_the_views_refuses_the_start_and_the_log_rebuilds_them() {
    let dir = tempfile::tempdir().unwrap();
    let answered = sell_then_kill(dir.path()).await;
    start_and_stop(dir.path()).await;
    let data = dir.path().join("data");
    tamper_views(
        &data,
        "UPDATE items SET stock = (stock | 4) - (stock & 4) WHERE item = 'sku'",
    );
    refused_then_rebuilt(
        dir.path(),
        &answered,
        "a damaged snapshot",
        &[
            "the snapshot of item \"sku\" of shop \"shop\" (seq 21) does not match its checksum",
            "rebuilt from the log",
        ],
    )
    .await;
}

/// An entry in views an older version wrote (a row per entry) damaged behind nrtxn's
/// back (here: a sale's status changed) changes no answer: a key's outcome and an item's
/// events are read from the log, under the log's checksums, not from the views' rows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_damaged_entry_in_an_older_versions_views_changes_no_outcome_or_event() {
    let dir = tempfile::tempdir().unwrap();
    let answered = sell_then_kill_env(dir.path(), &ROWS).await;
    let c = client();
    start_and_stop_env(dir.path(), &ROWS).await;
    let data = dir.path().join("data");
    tamper_views(
        &data,
        "UPDATE journal SET status = 'insufficient_stock' WHERE request_key = 'k5'",
    );
    let server = Server::start(dir.path(), &[]);
    check_answers(&server, &answered).await;
    let (status, body) = get(
        &c,
        &server.url("/v1/shops/shop/items/sku/events?after=0&limit=100"),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let k5: Vec<&Value> = body["events"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["request_key"] == "k5")
        .collect();
    assert_eq!(k5.len(), 1, "{body}");
    assert_eq!(k5[0]["status"], "ok", "{body}");
}

/// Flips one bit of the first occurrence of `pattern` in a page of the views whose
/// B-tree page type is `page_type` (0x0A an index leaf, 0x0D a table leaf), as a
/// disk would: below SQLite, which keeps no checksum of its own. The WAL is folded into
/// the file first, so the bytes are where the test looks.
fn flip_in_views_page(data: &Path, page_type: u8, pattern: &[u8]) {
    let path = data.join("nrtxn.db");
    {
        let views = rusqlite::Connection::open(&path).unwrap();
        views
            .query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |_| Ok(()))
            .unwrap();
    }
    let mut bytes = std::fs::read(&path).unwrap();
    let page = 4096;
    let at = (0..bytes.len() / page)
        .filter(|p| bytes[p * page + if *p == 0 { 100 } else { 0 }] == page_type)
        .find_map(|p| {
            bytes[p * page..(p + 1) * page]
                .windows(pattern.len())
                .position(|w| w == pattern)
                .map(|i| p * page + i)
        })
        .unwrap_or_else(|| {
            panic!(
                "{:?} in no page of type {page_type:#x}",
                String::from_utf8_lossy(pattern)
            )
        });
    // The key's first byte: `k` becomes `j`.
    let key_at = at + pattern.len()
        - b"k5".len()
        - if pattern.ends_with(b"decrement") {
            9
        } else {
            0
        };
    assert_eq!(bytes[key_at], b'k');
    bytes[key_at] ^= 1;
    std::fs::write(&path, bytes).unwrap();
}

/// A bit flipped in the key of a views row (found by the fault campaign, issue 14, in
/// the views' key index when they had one): the key is still found, since keys are read
/// from the log's index and the log, and a resubmission is answered with its outcome,
/// applied once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flipped_bit_in_a_views_rows_key_changes_no_answer() {
    let dir = tempfile::tempdir().unwrap();
    // Rows with keys: views as an older version wrote them.
    let answered = sell_then_kill_env(dir.path(), &ROWS).await;
    start_and_stop_env(dir.path(), &ROWS).await;
    let data = dir.path().join("data");
    // A journal row: ..., prev_seq, request_key, op, ...
    flip_in_views_page(&data, 0x0D, b"k5decrement");
    let server = Server::start(dir.path(), &[]);
    check_answers(&server, &answered).await;
    let c = client();
    let (status, again) = post(
        &c,
        &server.url("/v1/shops/shop/txns"),
        json!({"seller": "s", "item": "sku", "qty": 1, "request_id": "k5"}),
    )
    .await;
    assert_eq!((status, &again), (200, &answered[5]), "k5 resubmitted");
    check_answers(&server, &answered).await;
}

/// The views file cut short (a disk that lost its end, a copy cut off) refuses the start
/// with a message naming it and saying what to do; moved away, the views are rebuilt
/// from the log, whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn truncated_views_refuse_the_start_and_the_log_rebuilds_them() {
    let dir = tempfile::tempdir().unwrap();
    let answered = sell_then_kill(dir.path()).await;
    start_and_stop(dir.path()).await;
    let data = dir.path().join("data");
    let views = data.join("nrtxn.db");
    let len = std::fs::metadata(&views).unwrap().len();
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&views)
        .unwrap();
    f.set_len(len / 2).unwrap();
    drop(f);
    refused_then_rebuilt(
        dir.path(),
        &answered,
        "truncated views",
        &["nrtxn.db", "rebuilt from the log"],
    )
    .await;
}

/// A value of the wrong type in the views (a row damaged where SQLite's own check does
/// not look) refuses the start saying what is damaged and what to do, not with the bare
/// "Invalid type" of the row's reader.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_views_value_of_the_wrong_type_refuses_the_start_saying_what_to_do() {
    damaged_record_row_refuses_the_start(
        "offset = CAST(offset AS BLOB)",
        &["nrtxn.db is damaged", "rebuilt from the log"],
    )
    .await;
}

/// Changes the newest `records` row with `set` (an SQL `SET` clause) in a clean data dir,
/// makes the snapshot cover no entry (so the start reads that row), and checks that the
/// start is refused saying each of `says`, then that the views are rebuilt once moved.
async fn damaged_record_row_refuses_the_start(set: &str, says: &[&str]) {
    let dir = tempfile::tempdir().unwrap();
    let answered = sell_then_kill(dir.path()).await;
    start_and_stop(dir.path()).await;
    let data = dir.path().join("data");
    tamper_views(
        &data,
        &format!("UPDATE records SET {set} WHERE first_id = (SELECT max(first_id) FROM records)"),
    );
    tamper_views(
        &data,
        "UPDATE meta SET value = 0 WHERE key = 'snapshot_journal_id'",
    );
    refused_then_rebuilt(dir.path(), &answered, "a damaged record row", says).await;
}

/// A views row that names a record of the log (its first journal id, its entries, where
/// it is) changed behind nrtxn's back no longer matches its checksum: the start that
/// reads it refuses, saying what to do, rather than reading the wrong record or too
/// few entries.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_views_record_row_that_does_not_match_its_checksum_refuses_the_start() {
    damaged_record_row_refuses_the_start(
        "entries = entries + 1",
        &["does not match its checksum", "rebuilt from the log"],
    )
    .await;
}

/// A damaged `records` row that the start does not read (the snapshot covers it) is
/// found by the retention, which stops there and says so: the server goes on answering
/// (the prune runs in the views' transaction, whose failure would stop it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_damaged_records_row_stops_the_prune_not_the_server() {
    let dir = tempfile::tempdir().unwrap();
    let answered = sell_then_kill(dir.path()).await;
    start_and_stop(dir.path()).await;
    tamper_views(
        &dir.path().join("data"),
        "UPDATE records SET decided_to = 0 WHERE first_id = (SELECT min(first_id) FROM records)",
    );
    // Its decision time, set to 1970, puts it past the key window: the prune reads it.
    let server = Server::start(dir.path(), &[]);
    // Past a prune or two (every 2 s), which reach the damaged row.
    tokio::time::sleep(std::time::Duration::from_secs(5)).await;
    check_answers(&server, &answered).await;
    let log = std::fs::read_to_string(dir.path().join("server.log")).unwrap();
    // Said, each time the retention reaches it.
    assert!(log.contains("does not match its checksum"), "{log}");
}

/// The first record number of a segment, from its name.
fn first_lsn(seg: &Path) -> u64 {
    seg.file_stem().unwrap().to_str().unwrap().parse().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn segments_the_views_hold_for_good_are_retired_past_the_key_window() {
    let dir = tempfile::tempdir().unwrap();
    // The log answers reads by key until the key window has passed over a segment.
    let flags = ["--journal-segment-mb", "1", "--key-window-secs", "1"];
    let server = Server::start(dir.path(), &flags);
    let c = client();
    // 40 loads of 2,000 items: about 3 MB of log, so several 1 MiB segments.
    let names: Vec<String> = (0..2_000).map(|i| format!("item-{i:05}")).collect();
    for round in 0..40 {
        let items: Vec<(&str, i64)> = names.iter().map(|n| (n.as_str(), round)).collect();
        load(&c, &server, "shop", &items).await;
        if round == 1 {
            let (status, body) = post(
                &c,
                &server.url("/v1/shops/shop/txns"),
                json!({"seller": "s", "item": "item-00000", "qty": 1, "request_id": "early-sale"}),
            )
            .await;
            assert_eq!((status, &body["status"]), (200, &json!("ok")), "{body}");
        }
    }
    let data = dir.path().join("data");
    // Once the views are checkpointed the old segments go; the newest always stays.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        let segs = segments(&data);
        if first_lsn(&segs[0]) > 1 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "nothing retired: {segs:?}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    // A sale made before the loads, in the retired segment, stays returnable: the
    // prune kept it (read from the log) before the segment could go.
    let (status, body) = post(
        &c,
        &server.url("/v1/shops/shop/txns"),
        json!({"seller": "s", "item": "item-00000", "qty": 1, "op": "increment",
               "return_of": "early-sale", "request_id": "ret-early"}),
    )
    .await;
    assert_eq!((status, &body["status"]), (200, &json!("ok")), "{body}");
    let (status, body) = post(
        &c,
        &server.url("/v1/shops/shop/txns"),
        json!({"seller": "s", "item": "item-00000", "qty": 1, "op": "increment",
               "return_of": "early-sale", "request_id": "ret-early-2"}),
    )
    .await;
    assert_eq!(
        (status, &body["status"]),
        (200, &json!("return_refused")),
        "{body}"
    );
    // The state is whole after a restart, from the views and what is left of the log.
    drop(server);
    let server = Server::start(dir.path(), &flags);
    let (_, item) = get(&c, &server.url("/v1/shops/shop/items/item-01999")).await;
    assert_eq!(
        (item["stock"].as_i64(), item["seq"].as_u64()),
        // 40 loads, and the back_in_stock alert after the second (0 to 1).
        (Some(39), Some(41))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_past_their_window_are_forgotten_and_the_item_stays_whole() {
    let dir = tempfile::tempdir().unwrap();
    let flags = ["--key-window-secs", "1"];
    let mut server = Server::start(dir.path(), &flags);
    let c = client();
    load(&c, &server, "shop", &[("sku", 100)]).await;
    let sale = |key: &str| json!({"seller": "s", "item": "sku", "qty": 1, "request_id": key});
    let url = server.url("/v1/shops/shop/txns");
    let (status, first) = post(&c, &url, sale("old")).await;
    assert_eq!((status, &first["seq"]), (200, &json!(2)), "{first}");
    // A clean stop snapshots every item: its entries may then be pruned.
    assert!(server.terminate().success());
    let server = Server::start(dir.path(), &flags);
    let poll = server.url("/v1/shops/shop/txns/old");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while get(&c, &poll).await.0 != 404 {
        assert!(
            std::time::Instant::now() < deadline,
            "the key was never forgotten"
        );
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    // The item's state survives its entries: sold once, and the next seq follows.
    let (_, item) = get(&c, &server.url("/v1/shops/shop/items/sku")).await;
    assert_eq!(
        (item["stock"].as_i64(), item["seq"].as_u64()),
        (Some(99), Some(2))
    );
    // A key used again after its window is a new request.
    let (status, again) = post(&c, &server.url("/v1/shops/shop/txns"), sale("old")).await;
    assert_eq!(
        (status, &again["status"], &again["seq"]),
        (200, &json!("ok"), &json!(3)),
        "{again}"
    );
}

/// Runs `nrtxn ARGS`, which must succeed.
fn nrtxn(args: &[&str]) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_nrtxn"))
        .args(args)
        .output()
        .expect("run nrtxn");
    assert!(out.status.success(), "nrtxn {args:?}: {out:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backup_taken_under_load_restores_every_outcome_acknowledged_before_it() {
    use std::sync::{Arc, Mutex};
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path(), &["--journal-segment-mb", "1"]);
    let c = client();
    load(&c, &server, "shop", &[("a", 1_000_000), ("b", 1_000_000)]).await;
    // Sales on two items from four callers until told to stop; every answer is kept
    // with the time it came.
    let answers: Arc<Mutex<Vec<(std::time::Instant, Value)>>> = Arc::default();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let callers: Vec<_> = (0..4)
        .map(|t| {
            let (c, url) = (c.clone(), server.url("/v1/shops/shop/txns"));
            let (answers, stop) = (answers.clone(), stop.clone());
            tokio::spawn(async move {
                let mut i = 0;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let item = ["a", "b"][i % 2];
                    let body = json!({"seller": "s", "item": item, "qty": 1,
                                      "request_id": format!("t{t}-{i}")});
                    let (status, outcome) = post(&c, &url, body).await;
                    assert_eq!(status, 200, "{outcome}");
                    answers
                        .lock()
                        .unwrap()
                        .push((std::time::Instant::now(), outcome));
                    i += 1;
                }
            })
        })
        .collect();
    tokio::time::sleep(std::time::Duration::from_millis(1_500)).await;
    let data = dir.path().join("data");
    let copy = dir.path().join("backup");
    let began = std::time::Instant::now();
    let (d, b) = (data.to_str().unwrap(), copy.to_str().unwrap());
    tokio::task::spawn_blocking({
        let (d, b) = (d.to_string(), b.to_string());
        move || nrtxn(&["backup", "--data-dir", &d, "--to", &b])
    })
    .await
    .unwrap();
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for caller in callers {
        caller.await.unwrap();
    }
    drop(server);
    let before: Vec<Value> = answers
        .lock()
        .unwrap()
        .iter()
        .filter(|(at, _)| *at < began)
        .map(|(_, o)| o.clone())
        .collect();
    assert!(before.len() > 100, "too little load: {}", before.len());

    let restored = tempfile::tempdir().unwrap();
    let r = restored.path().join("data");
    nrtxn(&["restore", "--from", b, "--data-dir", r.to_str().unwrap()]);
    let server = Server::start(restored.path(), &[]);
    for o in &before {
        let key = o["request_key"].as_str().unwrap();
        let (status, polled) = get(&c, &server.url(&format!("/v1/shops/shop/txns/{key}"))).await;
        assert_eq!((status, &polled), (200, o), "{key}");
    }
    // Each item adds up: every entry in the copy is a sale of one.
    for item in ["a", "b"] {
        let (_, state) = get(&c, &server.url(&format!("/v1/shops/shop/items/{item}"))).await;
        let seq = state["seq"].as_i64().unwrap();
        assert_eq!(
            state["stock"].as_i64().unwrap(),
            1_000_000 - (seq - 1),
            "{state}"
        );
    }
    eprintln!(
        "{} outcomes acknowledged before the backup, all restored",
        before.len()
    );
}

/// Writes a data dir as the SQLite journal left it before the log existed: `sku` loaded
/// with 10 and three sales, keys `m0`..`m2`. That journal was the store that now holds
/// the views, with the same tables, and wrote no log and no log mark. So the data dir is
/// written by the embedded journal, and then its log (`journal/`) and the views' log
/// mark are taken away.
fn legacy_data_dir(data: &Path) {
    use nrtxn_actors::{now_ms, Engine, EngineConfig, Metrics, Op, Reply, Request};
    use nrtxn_embedded::journal::{LogJournal, Retention};
    use nrtxn_embedded::request_log::EmbeddedLog;
    let data = data.to_path_buf();
    let written = data.clone();
    std::thread::spawn(move || {
        actix_rt::System::new().block_on(async move {
            let metrics = std::sync::Arc::new(Metrics::new());
            // A row per entry, as the SQLite journal wrote (and the views until their
            // `records`): read when the views are opened. Another test's server started
            // meanwhile would write rows too, which every version still reads.
            std::env::set_var("NRTXN_FAULT_VIEWS_ROWS", "1");
            let store = LogJournal::open(&data, metrics.clone(), Retention::default()).unwrap();
            std::env::remove_var("NRTXN_FAULT_VIEWS_ROWS");
            let log = store.clone();
            let engine = Engine::start(
                EngineConfig::default(),
                store,
                move |d, _| std::sync::Arc::new(EmbeddedLog::new(log, d, true)) as _,
                metrics,
            )
            .unwrap();
            let shop: std::sync::Arc<str> = "shop".into();
            engine.load(&shop, vec![("sku".into(), 10)]).await.unwrap();
            for i in 0..3 {
                let req = Request {
                    seller: Some("s".into()),
                    ..Request::new(
                        shop.clone(),
                        "sku".into(),
                        format!("m{i}").into(),
                        Op::Decrement,
                        1,
                        now_ms(),
                    )
                };
                let answers = engine.submit(&shop, vec![(req, true)]).await.unwrap();
                assert!(matches!(answers.replies[..], [Reply::Decided(_)]));
            }
            engine.shutdown().await;
        })
    })
    .join()
    .unwrap();
    std::fs::remove_dir_all(written.join("journal")).unwrap();
    let views = rusqlite::Connection::open(written.join("nrtxn.db")).unwrap();
    let gone = views
        .execute(
            "DELETE FROM meta
             WHERE key IN ('log_next_lsn', 'log_parent_hi', 'log_parent_lo', 'log_epoch')",
            [],
        )
        .unwrap();
    assert_eq!(gone, 4, "the views' log mark is four rows of meta");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_data_dir_of_the_sqlite_journal_is_taken_over_as_it_is() {
    let dir = tempfile::tempdir().unwrap();
    legacy_data_dir(&dir.path().join("data"));
    assert!(!dir.path().join("data/journal").exists());
    let c = client();
    for round in 0..2 {
        let server = Server::start(dir.path(), &[]);
        for i in 0..3 {
            let (status, polled) = get(&c, &server.url(&format!("/v1/shops/shop/txns/m{i}"))).await;
            assert_eq!((status, &polled["seq"]), (200, &json!(i + 2)), "{polled}");
        }
        let (status, next) = post(
            &c,
            &server.url("/v1/shops/shop/txns"),
            json!({"seller": "s", "item": "sku", "qty": 1, "request_id": format!("new{round}")}),
        )
        .await;
        assert_eq!((status, &next["seq"]), (200, &json!(5 + round)), "{next}");
    }
}

/// Items changed after the last snapshot before a crash are in the next snapshot too:
/// a snapshot taken after the restart (here, at a clean stop) covers their entries, so
/// it must hold their last state, or the start after it would serve an old one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_after_a_crash_holds_the_items_changed_before_it() {
    let dir = tempfile::tempdir().unwrap();
    let answered = sell_then_kill(dir.path()).await;
    let mut server = Server::start(dir.path(), &[]);
    check_answers(&server, &answered).await;
    assert!(server.terminate().success());
    // The views alone (the log gone with its segments) must now hold the items whole.
    let server = Server::start(dir.path(), &[]);
    check_answers(&server, &answered).await;
    drop(server);
    let data = dir.path().join("data");
    let views = rusqlite::Connection::open(data.join("nrtxn.db")).unwrap();
    let (stock, seq): (i64, i64) = views
        .query_row(
            "SELECT stock, seq FROM items WHERE shop = 'shop' AND item = 'sku'",
            [],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .expect("the snapshot holds the item");
    assert_eq!((stock, seq), (80, 21));
}
