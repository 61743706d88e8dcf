//! The MongoDB journal, end to end: HTTP → WorkManager → processors → MongoDB, against
//! the MongoDB-protocol test server that `scripts/test.sh` starts on loopback.

mod common;

use common::load::*;
use common::*;
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mongo_journal_keeps_every_answer_across_a_sigkill() {
    let Some(uri) = mongo_uri("sigkill") else {
        return;
    };
    let flags = ["--mongo-uri", uri.as_str()];
    let enough = |s: &Seen| s.outcomes.len() >= 200 && s.accepted.len() >= 200;
    let (_dir, server, seen) = load_then_stop(&flags, 16, enough, Server::kill).await;
    assert!(enough(&seen), "load too small to test");
    check_after_restart(&server, &seen).await;
    drop_database(&uri).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn journal_documents_and_indexes_are_as_documented_to_another_client() {
    let Some(uri) = mongo_uri("schema") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path(), &["--mongo-uri", &uri]);
    let c = client();
    load(&c, &server, "s1", &[("a", 3), ("b", 1)]).await;
    let url = server.url("/v1/shops/s1/txns");
    for body in [
        json!({"seller": "x", "buyer": "y", "item": "a", "qty": 2, "req_time": 1, "remarks": "r"}),
        json!({"seller": "x", "item": "a", "qty": 2, "req_time": 2}),
        json!({"seller": "x", "item": "a", "qty": 5, "op": "increment", "request_id": "ret-1"}),
        json!({"seller": "x", "item": "nope", "qty": 1, "req_time": 3}),
        json!({"seller": "x", "item": "b", "qty": 1, "req_time": 4, "respond": false}),
    ] {
        let (status, res) = post(&c, &url, body).await;
        assert!(status == 200 || status == 202, "{res}");
    }
    poll_decided(&c, &server, "s1", "x:b:4").await;
    let python =
        std::env::var("NRTXN_TEST_PYTHON").expect("NRTXN_TEST_PYTHON (scripts/test.sh sets it)");
    let out = std::process::Command::new(python)
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/mongo_schema.py"
        ))
        .arg(&uri)
        .output()
        .expect("run pymongo check");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "pymongo check failed:\n{text}");
    // Two loads and five requests.
    assert!(text.contains("journal: 7 documents checked"), "{text}");
}
