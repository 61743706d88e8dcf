//! The MongoDB journal, end to end: HTTP → WorkManager → processors → MongoDB, against
//! the MongoDB-protocol test server that `scripts/test.sh` starts on loopback.

mod common;

use common::holds::*;
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
    let mut server = Server::start(dir.path(), &["--mongo-uri", &uri]);
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
    // The snapshots (`items`) follow the journal within a second; a clean stop writes
    // them at once.
    assert!(server.terminate().success());
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mongo_journal_keeps_holds_and_expires_them_after_a_sigkill() {
    let Some(uri) = mongo_uri("holds") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let flags = ["--mongo-uri", uri.as_str()];
    let mut server = Server::start(dir.path(), &flags);
    let c = client();
    load(&c, &server, "s", &[("a", 10)]).await;
    assert_eq!(hold(&c, &server, "s", "sold", "a", 2, 60_000).await.0, 200);
    let (status, body) = post(&c, &holds_url(&server, "s", "/sold/confirm"), json!({})).await;
    assert_eq!(
        (status, &body["status"]),
        (200, &json!("confirmed")),
        "{body}"
    );
    let (_, pending) = hold(&c, &server, "s", "pending", "a", 3, 3_000).await;
    assert_eq!(pending["status"], "held", "{pending}");
    server.kill();
    let server = Server::start(dir.path(), &flags);
    let restarted = now_ms();
    assert_eq!(item_state(&c, &server, "s", "a").await, (5, 3));
    assert_eq!(
        wait_ended(&c, &server, "s", "pending").await["status"],
        "expired"
    );
    wait_item_state(&c, &server, "s", "a", (8, 0)).await;
    let all = events(&c, &server, "s", "a", 1000).await;
    let kinds: Vec<&str> = all.iter().map(|e| e["kind"].as_str().unwrap()).collect();
    assert_eq!(kinds, ["load", "hold", "confirm", "hold", "expire"]);
    let expires_at = pending["expires_at"].as_i64().unwrap();
    let late = lateness_ms(&all, "pending", expires_at);
    assert!(late >= 0, "expired early");
    if expires_at > restarted {
        assert!(late <= 50, "expired {late} ms late");
    }
    drop_database(&uri).await;
}
