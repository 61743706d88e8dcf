//! The MongoDB journal, end to end: HTTP → WorkManager → processors → MongoDB, against
//! the MongoDB-protocol test server that `scripts/test.sh` starts on loopback.

mod common;

use common::holds::*;
use common::load::*;
use common::*;
use serde_json::{json, Value};

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
    // Two loads, five requests, and the sold_out alert after b's sale.
    assert!(text.contains("journal: 8 documents checked"), "{text}");
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

/// Damage done to the MongoDB journal behind nrtxn's back is refused, never served: a
/// document altered in a field its fingerprint covers answers 503 when polled, and with
/// the snapshots gone (so start-up replays every document) the start is refused, naming
/// the document; so is a document missing from the middle of an item's history. With
/// the journal mended, the node starts with exactly the acknowledged state.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn altered_or_missing_journal_documents_are_refused_not_served() {
    let Some(uri) = mongo_uri("damage") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let flags = ["--mongo-uri", uri.as_str()];
    let mut server = Server::start(dir.path(), &flags);
    let c = client();
    load(&c, &server, "s", &[("a", 10)]).await;
    for key in ["k1", "k2", "k3"] {
        let body = json!({"seller": "x", "item": "a", "qty": 1, "request_id": key});
        let (status, res) = post(&c, &server.url("/v1/shops/s/txns"), body).await;
        assert_eq!(status, 200, "{res}");
    }
    assert!(server.terminate().success());

    let db = mongodb::Client::with_uri_str(&uri)
        .await
        .unwrap()
        .default_database()
        .unwrap();
    let journal = db.collection::<mongodb::bson::Document>("journal");
    let k2 = mongodb::bson::doc! { "shop": "s", "request_key": "k2" };
    // Start-up replays every document once the snapshots are gone.
    let forget_snapshots = || async {
        db.collection::<mongodb::bson::Document>("items")
            .delete_many(mongodb::bson::doc! {})
            .await
            .unwrap();
        db.collection::<mongodb::bson::Document>("meta")
            .delete_many(mongodb::bson::doc! { "_id": { "$regex": "^snapshot" } })
            .await
            .unwrap();
    };

    // An altered quantity.
    journal
        .update_one(k2.clone(), mongodb::bson::doc! { "$set": { "qty": 5_i64 } })
        .await
        .unwrap();
    let mut server = Server::start(dir.path(), &flags);
    let (status, body) = get(&c, &server.url("/v1/shops/s/txns/k2")).await;
    assert_eq!(status, 503, "an altered document was served: {body}");
    assert!(server.terminate().success());
    forget_snapshots().await;
    let (status, stderr) = serve_expecting_exit(dir.path(), &flags);
    assert!(!status.success(), "started on an altered journal");
    assert!(
        stderr.contains("does not match its fingerprint") && stderr.contains("item a, seq Some(3)"),
        "{stderr}"
    );
    journal
        .update_one(k2.clone(), mongodb::bson::doc! { "$set": { "qty": 1_i64 } })
        .await
        .unwrap();

    // A document missing from the middle of the item's history.
    let kept = journal.find_one(k2.clone()).await.unwrap().unwrap();
    journal.delete_one(k2.clone()).await.unwrap();
    forget_snapshots().await;
    let (status, stderr) = serve_expecting_exit(dir.path(), &flags);
    assert!(!status.success(), "started with a document missing");
    assert!(
        stderr.contains("the journal does not add up") && stderr.contains("does not follow seq 2"),
        "{stderr}"
    );
    journal.insert_one(kept).await.unwrap();

    // Mended: exactly the acknowledged state, every answer the same.
    let server = Server::start(dir.path(), &flags);
    let (_, a) = get(&c, &server.url("/v1/shops/s/items/a")).await;
    assert_eq!(
        (a["stock"].as_i64(), a["seq"].as_u64()),
        (Some(7), Some(4)),
        "{a}"
    );
    for (key, seq) in [("k1", 2), ("k2", 3), ("k3", 4)] {
        let (status, body) = get(&c, &server.url(&format!("/v1/shops/s/txns/{key}"))).await;
        assert_eq!((status, body["seq"].as_u64()), (200, Some(seq)), "{body}");
    }
    drop_database(&uri).await;
}

/// A caller's confirm of an order keeps within one reply timeout on a journal that does
/// not tell a decision before it is durable (MongoDB), where the lines' endings are sent
/// once the record's is written: the read of the record, its ending and its lines'
/// endings share it. With each write held back 1 s and a 1.5 s reply timeout the lines'
/// endings are not durable in time: `504` at about the reply timeout, not a `200` after
/// two writes and more; the order is confirmed all the same, lines and all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_order_confirm_is_answered_within_one_reply_timeout_when_writes_are_slow() {
    let Some(uri) = mongo_uri("order_end") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    held_order_then_killed(dir.path(), &["--mongo-uri", uri.as_str()]).await;
    let c = client();
    let flags = ["--mongo-uri", uri.as_str(), "--reply-timeout-ms", "1500"];
    let server = Server::start_env(
        dir.path(),
        &flags,
        &[("NRTXN_FAULT_JOURNAL_HOLD_MS", "1000")],
    );
    wait_ready(&c, &server).await;
    let asked = std::time::Instant::now();
    let (status, body) = post(&c, &server.url("/v1/shops/s/orders/o1/confirm"), json!({})).await;
    let took = asked.elapsed();
    assert_eq!((status, &body["error"]), (504, &json!("timeout")), "{body}");
    assert!(
        took >= std::time::Duration::from_millis(1_400)
            && took < std::time::Duration::from_millis(2_200),
        "answered after {took:?}: two writes of 1 s share one reply timeout (1.5 s)"
    );
    let mut read = json!(null);
    for _ in 0..100 {
        read = get(&c, &server.url("/v1/shops/s/orders/o1")).await.1;
        let lines: Vec<&Value> = read["lines"].as_array().into_iter().flatten().collect();
        if read["status"] == "confirmed" && lines.iter().all(|l| l["status"] == "confirmed") {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert_eq!(read["status"], "confirmed", "{read}");
    assert_eq!(read["lines"][0]["status"], "confirmed", "{read}");
    assert_eq!(read["lines"][1]["status"], "confirmed", "{read}");
    drop_database(&uri).await;
}
