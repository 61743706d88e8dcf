//! The Kafka request log, end to end on one node: HTTP → WorkManager → Kafka → reader
//! pool → processors → journal, against the Kafka-protocol test broker that
//! `scripts/test.sh` starts on loopback.

mod common;

use common::holds::*;
use common::load::*;
use common::*;
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_through_kafka_are_answered_and_polled() {
    let Some(flags) = kafka_flags("api") else {
        return;
    };
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path(), &flags);
    let c = client();
    wait_ready(&c, &server).await;
    load(&c, &server, "s1", &[("sku-1", 5)]).await;
    let url = server.url("/v1/shops/s1/txns");

    let (status, first) = post(
        &c,
        &url,
        json!({"seller": "a", "item": "sku-1", "qty": 2, "req_time": 1}),
    )
    .await;
    assert_eq!(
        (status, first["status"].as_str()),
        (200, Some("ok")),
        "{first}"
    );
    assert_eq!(
        (first["stock_after"].as_i64(), first["seq"].as_u64()),
        (Some(3), Some(2))
    );
    let (status, again) = post(
        &c,
        &url,
        json!({"seller": "a", "item": "sku-1", "qty": 2, "req_time": 1}),
    )
    .await;
    assert_eq!((status, &again), (200, &first));

    let body = json!({"seller": "a", "item": "sku-1", "qty": 4, "req_time": 2, "respond": false});
    let (status, accepted) = post(&c, &url, body).await;
    assert_eq!(
        (status, accepted["status"].as_str()),
        (202, Some("accepted"))
    );
    let (status, decided) = poll_decided(&c, &server, "s1", "a:sku-1:2").await;
    assert_eq!(
        (status, decided["status"].as_str()),
        (200, Some("insufficient_stock"))
    );

    let (_, item) = get(&c, &server.url("/v1/shops/s1/items/sku-1")).await;
    assert_eq!(
        (item["stock"].as_i64(), item["seq"].as_u64()),
        (Some(3), Some(3))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_log_keeps_every_answer_and_applies_nothing_twice_across_a_sigkill() {
    let Some(flags) = kafka_flags("sigkill") else {
        return;
    };
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let enough = |s: &Seen| s.outcomes.len() >= 300 && s.accepted.len() >= 300;
    let (_dir, server, seen) = load_then_stop(&flags, 16, enough, Server::kill).await;
    assert!(enough(&seen), "load too small to test");
    // Redelivered messages (read, journaled, offset not yet committed) must be skipped:
    // the sequence check in here fails if any were applied twice.
    check_after_restart(&server, &seen).await;
}

/// With a shared journal (Kafka and MongoDB) a hold's expiry travels through the log to
/// the item's owner, and confirm and cancel travel like any request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn holds_through_kafka_and_mongo_expire_through_the_log() {
    let (Some(flags), Some(uri)) = (kafka_flags("holds"), mongo_uri("kafka_holds")) else {
        return;
    };
    let mut flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    flags.extend(["--mongo-uri", uri.as_str()]);
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path(), &flags);
    let c = client();
    wait_ready(&c, &server).await;
    load(&c, &server, "s", &[("a", 10)]).await;
    let (status, body) = hold(&c, &server, "s", "kept", "a", 2, 60_000).await;
    assert_eq!((status, &body["status"]), (200, &json!("held")), "{body}");
    let (status, body) = post(&c, &holds_url(&server, "s", "/kept/cancel"), json!({})).await;
    assert_eq!(
        (status, &body["status"]),
        (200, &json!("released")),
        "{body}"
    );
    let (_, short) = hold(&c, &server, "s", "short", "a", 3, 300).await;
    assert_eq!(short["status"], "held", "{short}");
    assert_eq!(item_state(&c, &server, "s", "a").await, (7, 3));
    assert_eq!(
        wait_ended(&c, &server, "s", "short").await["status"],
        "expired"
    );
    wait_item_state(&c, &server, "s", "a", (10, 0)).await;
    let all = events(&c, &server, "s", "a", 1000).await;
    let kinds: Vec<&str> = all.iter().map(|e| e["kind"].as_str().unwrap()).collect();
    assert_eq!(kinds, ["load", "hold", "release", "hold", "expire"]);
    let late = lateness_ms(&all, "short", short["expires_at"].as_i64().unwrap());
    assert!(late >= 0, "expired early");
    drop_database(&uri).await;
}
