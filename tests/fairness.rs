//! One shop cannot starve the others, and a revoked key's stream ends,
//! through the real binary over HTTP: a shop's share of a shard's pending holds and of
//! the node's push streams, the token bucket charged by work, a stream's end at its
//! key's revocation, and cursors that are opaque and bound to their shop.

mod common;

use std::time::{Duration, Instant};

use common::holds::{hold, holds_url, item_state};
use common::*;
use serde_json::{json, Value};

/// A hold's status in its answer.
async fn held(c: &reqwest::Client, server: &Server, shop: &str, id: &str, ttl_ms: i64) -> String {
    let (status, body) = hold(c, server, shop, id, "sku", 1, ttl_ms).await;
    assert_eq!(status, 200, "{body}");
    body["status"].as_str().unwrap_or_default().to_string()
}

/// A shop at its share of a shard's pending holds gets `limit_exceeded` while another
/// shop on the same shard still holds; the share is counted right through every way a
/// hold ends (cancel, confirm, expiry, an order's line and record) and through a
/// restart, which counts the holds read back from the journal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shop_past_its_share_of_holds_is_refused_while_another_shop_still_holds() {
    let dir = tempfile::tempdir().unwrap();
    holds_share(dir.path(), &[], false, true).await;
}

/// The same with the request log on Kafka and the journal on MongoDB, but for the
/// restart (a restarted node waits tens of seconds to rejoin the Kafka group).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shops_share_of_holds_holds_with_kafka_and_mongodb() {
    let (Some(uri), Some(kafka)) = (mongo_uri("holds_share"), kafka_flags("holds_share")) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let mut extra: Vec<&str> = vec!["--mongo-uri", &uri];
    extra.extend(kafka.iter().map(String::as_str));
    holds_share(dir.path(), &extra, true, false).await;
    drop_database(&uri).await;
}

/// `wait`: for the node to be ready (a Kafka reader pool joined its group); `restart`:
/// the count is checked after a restart too.
async fn holds_share(dir: &std::path::Path, extra: &[&str], wait: bool, restart: bool) {
    let mut flags = vec![
        "--shards",
        "1",
        "--holds-max",
        "100",
        "--holds-per-shop-max",
        "3",
    ];
    flags.extend(extra);
    let c = client();
    let mut server = Server::start(dir, &flags);
    if wait {
        wait_ready(&c, &server).await;
    }
    for shop in ["greedy", "calm", "late"] {
        load(&c, &server, shop, &[("sku", 100), ("other", 100)]).await;
    }
    for i in 0..3 {
        assert_eq!(
            held(&c, &server, "greedy", &format!("g{i}"), 600_000).await,
            "held"
        );
    }
    let (status, refused) = hold(&c, &server, "greedy", "g3", "sku", 1, 600_000).await;
    assert_eq!(
        (status, &refused["status"]),
        (200, &json!("limit_exceeded")),
        "{refused}"
    );
    assert!(
        refused["reason"]
            .as_str()
            .is_some_and(|r| r.contains("shop greedy")),
        "{refused}"
    );
    assert_eq!(item_state(&c, &server, "greedy", "sku").await, (97, 3));
    // The other shop on the same (only) shard still holds, and places an order (which
    // keeps its record pending beside its line: two of the shop's three).
    assert_eq!(held(&c, &server, "calm", "c0", 600_000).await, "held");
    let (status, order) = post(
        &c,
        &server.url("/v1/shops/calm/orders"),
        json!({"order_id": "o-calm", "lines": [{"item": "other", "qty": 1}], "ttl_ms": 600_000}),
    )
    .await;
    assert_eq!((status, &order["status"]), (200, &json!("held")), "{order}");
    // The greedy shop's order finds no room for its line either, and ends whole.
    let (status, order) = post(
        &c,
        &server.url("/v1/shops/greedy/orders"),
        json!({"order_id": "o-greedy", "lines": [{"item": "other", "qty": 1}], "ttl_ms": 600_000}),
    )
    .await;
    assert_eq!(status, 200, "{order}");
    assert_eq!(order["status"], "limit_exceeded", "{order}");

    // Each ending gives one slot back: a cancel, a confirm, an expiry.
    let (status, _) = post(&c, &holds_url(&server, "greedy", "/g0/cancel"), json!({})).await;
    assert_eq!(status, 200);
    assert_eq!(held(&c, &server, "greedy", "g4", 600_000).await, "held");
    assert_eq!(
        held(&c, &server, "greedy", "g5", 600_000).await,
        "limit_exceeded"
    );
    let (status, _) = post(&c, &holds_url(&server, "greedy", "/g1/confirm"), json!({})).await;
    assert_eq!(status, 200);
    assert_eq!(held(&c, &server, "greedy", "g6", 300).await, "held");
    assert_eq!(
        held(&c, &server, "greedy", "g7", 600_000).await,
        "limit_exceeded"
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    for attempt in 0.. {
        if held(&c, &server, "greedy", &format!("g8-{attempt}"), 600_000).await == "held" {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the expired hold's slot never came back"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Three pending again (g2, g4 and the last): full, and still full after a restart,
    // which counts the holds it reads back.
    assert_eq!(
        held(&c, &server, "greedy", "g9", 600_000).await,
        "limit_exceeded"
    );
    if !restart {
        return;
    }
    assert!(server.terminate().success());
    let server = Server::start(dir, &flags);
    assert_eq!(
        held(&c, &server, "greedy", "g10", 600_000).await,
        "limit_exceeded"
    );
    assert_eq!(
        held(&c, &server, "calm", "c1", 600_000).await,
        "limit_exceeded"
    );
    assert_eq!(held(&c, &server, "late", "l0", 600_000).await, "held");
    let (status, _) = post(&c, &holds_url(&server, "greedy", "/g2/cancel"), json!({})).await;
    assert_eq!(status, 200);
    assert_eq!(held(&c, &server, "greedy", "g11", 600_000).await, "held");
}

/// A client for streams: no bound on the whole request (a stream has no end).
fn stream_client() -> reqwest::Client {
    reqwest::Client::builder()
        .connect_timeout(Duration::from_secs(10))
        .build()
        .unwrap()
}

/// Opens `shop`'s stream (with `key`, after `cursor`): the response, and for a 200 the
/// text read up to its `ready` message.
async fn open_stream(
    sc: &reqwest::Client,
    server: &Server,
    shop: &str,
    key: Option<&str>,
    cursor: Option<&str>,
) -> (reqwest::Response, String) {
    let mut req = sc.get(server.url(&format!("/v1/shops/{shop}/events/stream")));
    if let Some(key) = key {
        req = req.bearer_auth(key);
    }
    if let Some(c) = cursor {
        req = req.header("Last-Event-ID", c);
    }
    let mut res = req.send().await.unwrap();
    let mut text = String::new();
    if res.status() == 200 {
        while !text.contains("event: ready") {
            let chunk = tokio::time::timeout(Duration::from_secs(10), res.chunk())
                .await
                .expect("no ready message within 10 s")
                .unwrap()
                .expect("the stream ended before its ready message");
            text.push_str(&String::from_utf8_lossy(&chunk));
        }
    }
    (res, text)
}

/// The value of the first `field: ` line of an SSE text after `after`.
fn sse_field<'t>(text: &'t str, field: &str) -> Option<&'t str> {
    text.lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(": "))
}

/// One shop holds at most its share of the node's streams: past it 503 with
/// Retry-After, while another shop still opens one; a stream closed gives its place
/// back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shop_past_its_share_of_streams_gets_503_while_another_shop_opens_one() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path(), &["--streams-per-shop-max", "2"]);
    let sc = stream_client();
    let (a1, _) = open_stream(&sc, &server, "a", None, None).await;
    let (a2, _) = open_stream(&sc, &server, "a", None, None).await;
    assert_eq!((a1.status().as_u16(), a2.status().as_u16()), (200, 200));
    let (refused, _) = open_stream(&sc, &server, "a", None, None).await;
    assert_eq!(refused.status(), 503);
    let retry_after = refused.headers()["retry-after"]
        .to_str()
        .unwrap()
        .to_string();
    assert!(retry_after.parse::<u64>().unwrap() >= 1, "{retry_after}");
    let body: Value = refused.json().await.unwrap();
    assert_eq!(body["error"], "overloaded", "{body}");
    assert!(
        body["detail"].as_str().unwrap().contains("shop a"),
        "{body}"
    );
    let (b1, _) = open_stream(&sc, &server, "b", None, None).await;
    assert_eq!(b1.status(), 200, "another shop still opens a stream");
    drop(a1);
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let (again, _) = open_stream(&sc, &server, "a", None, None).await;
        if again.status() == 200 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "a closed stream's place never came back"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    drop((a2, b1));
}

/// A batch costs a token per entry: with a bucket of 50, three batches of 20 entries
/// get 429 at the third, while three single sales of another shop pass; a batch larger
/// than the bucket still passes a full one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_heavy_shop_gets_429_sooner_than_single_calls_by_token_count() {
    let dir = tempfile::tempdir().unwrap();
    // A token every 10 s: nothing refills within the test.
    let server = Server::start(dir.path(), &["--shop-rate", "0.1", "--shop-burst", "50"]);
    let c = client();
    for shop in ["batchy", "single"] {
        load(&c, &server, shop, &[("sku", 10_000)]).await; // one token: one item
    }
    let sale =
        |i: usize| json!({"seller": "s", "item": "sku", "qty": 1, "request_id": format!("r{i}")});
    let batch =
        |from: usize, n: usize| json!({"txns": (from..from + n).map(sale).collect::<Vec<_>>()});
    let url = |shop: &str, rest: &str| server.url(&format!("/v1/shops/{shop}/txns{rest}"));
    for i in 0..2 {
        let (status, body) = post(&c, &url("batchy", "/batch"), batch(i * 20, 20)).await;
        assert_eq!(status, 200, "batch {i}: {body}");
    }
    let res = c
        .post(url("batchy", "/batch"))
        .json(&batch(40, 20))
        .send()
        .await
        .unwrap();
    assert_eq!(
        res.status(),
        429,
        "the third batch of 20 passed a bucket of 50"
    );
    let retry_after: u64 = res.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(retry_after >= 1, "{retry_after}");
    let body: Value = res.json().await.unwrap();
    assert_eq!(body["error"], "rate_limited", "{body}");
    // Nothing of the refused batch was applied: 40 sold.
    assert_eq!(item_state(&c, &server, "batchy", "sku").await, (9_960, 0));
    // As many calls, each a single sale: all pass.
    for i in 0..3 {
        let (status, body) = post(&c, &url("single", ""), sale(i)).await;
        assert_eq!(status, 200, "single sale {i}: {body}");
    }
    // A batch of 100 entries costs the bucket's size, at most: it passes a full one (a
    // shop that made no call yet; its item unknown, which the batch answers entry by
    // entry).
    let (status, body) = post(&c, &url("big", "/batch"), batch(0, 100)).await;
    assert_eq!(status, 200, "{body}");
    let (status, body) = post(&c, &url("big", ""), sale(100)).await;
    assert_eq!(status, 429, "the bucket is empty after it: {body}");
}

/// `nrtxn keys ARGS` on the data dir of a server started on `dir`, with the test's
/// environment's NRTXN_* variables out of the way.
fn keys(dir: &std::path::Path, args: &[&str]) -> std::process::Output {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_nrtxn"));
    cmd.arg("keys")
        .args(args)
        .arg("--data-dir")
        .arg(dir.join("data"))
        .env("RUST_LOG", "warn");
    for (key, _) in std::env::vars_os() {
        if key.to_string_lossy().starts_with("NRTXN_") {
            cmd.env_remove(key);
        }
    }
    cmd.output().expect("run nrtxn keys")
}

/// A push stream opened with a key ends, with a final `dropped` event saying why,
/// within 5 s of the key's revocation (as every other request is refused within 5 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_ends_within_5_s_of_its_keys_revocation() {
    let dir = tempfile::tempdir().unwrap();
    let out = keys(
        dir.path(),
        &["create", "--role", "operator", "--shop", "acme"],
    );
    assert!(out.status.success(), "{out:?}");
    let secret = String::from_utf8(out.stdout).unwrap().trim().to_string();
    let id = secret.split('_').nth(1).unwrap().to_string();
    let server = Server::start(dir.path(), &[]);
    let sc = stream_client();
    let (mut res, ready) = open_stream(&sc, &server, "acme", Some(&secret), None).await;
    assert_eq!(res.status(), 200);
    let out = keys(dir.path(), &["revoke", &id]);
    assert!(out.status.success(), "{out:?}");
    let revoked_at = Instant::now();
    let mut text = String::new();
    loop {
        let left = Duration::from_secs(5).saturating_sub(revoked_at.elapsed());
        match tokio::time::timeout(left, res.chunk()).await {
            Err(_) => panic!("the stream still open 5 s after its key's revocation: {text}"),
            Ok(chunk) => match chunk.unwrap() {
                Some(b) => text.push_str(&String::from_utf8_lossy(&b)),
                None => break,
            },
        }
    }
    assert!(text.contains("event: dropped"), "{text}");
    let data: Value = serde_json::from_str(sse_field(&text, "data").unwrap()).unwrap();
    assert_eq!(data["reason"], "key_revoked", "{text}");
    assert_eq!(
        data["resume_after"].as_str(),
        sse_field(&ready, "id"),
        "resumes after the last event sent: here the stream's start"
    );
    // And the key opens no other.
    let (again, _) = open_stream(&sc, &server, "acme", Some(&secret), None).await;
    assert_eq!(again.status(), 401);
}

/// A stream's cursors are opaque (no journal position in them, every shop's events
/// counted), and one the server did not hand to this shop is refused with 400: another
/// shop's, a made-up one, one changed by a character. This shop's own resumes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cursor_is_opaque_and_refused_for_another_shop_or_forged() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path(), &[]);
    let c = client();
    load(&c, &server, "a", &[("sku", 100)]).await;
    load(&c, &server, "b", &[("sku", 100)]).await;
    let sc = stream_client();
    let (mut res, text) = open_stream(&sc, &server, "a", None, None).await;
    assert_eq!(res.status(), 200);
    let ready = sse_field(&text, "id").unwrap().to_string();
    // Another shop's traffic, then one sale of this shop.
    for i in 0..20 {
        let (status, _) = post(
            &c,
            &server.url("/v1/shops/b/txns"),
            json!({"seller": "s", "item": "sku", "qty": 1, "request_id": format!("b{i}")}),
        )
        .await;
        assert_eq!(status, 200);
    }
    let (status, _) = post(
        &c,
        &server.url("/v1/shops/a/txns"),
        json!({"seller": "s", "item": "sku", "qty": 1, "request_id": "a0"}),
    )
    .await;
    assert_eq!(status, 200);
    let mut more = String::new();
    while !more.contains("\n\n") {
        let chunk = tokio::time::timeout(Duration::from_secs(10), res.chunk())
            .await
            .expect("no event within 10 s")
            .unwrap()
            .unwrap();
        more.push_str(&String::from_utf8_lossy(&chunk));
    }
    drop(res);
    let after_sale = sse_field(&more, "id").unwrap().to_string();
    for cursor in [&ready, &after_sale] {
        assert!(
            cursor.starts_with('c') && cursor[1..].bytes().all(|b| b.is_ascii_hexdigit()),
            "not an opaque cursor: {cursor}"
        );
        assert!(!cursor.contains('.'), "{cursor}");
    }
    assert_eq!(
        ready.len(),
        after_sale.len(),
        "the length tells nothing of the events passed"
    );
    let mut flipped = after_sale.clone().into_bytes();
    let last = flipped.len() - 1;
    flipped[last] = if flipped[last] == b'0' { b'1' } else { b'0' };
    let flipped = String::from_utf8(flipped).unwrap();
    for (shop, cursor, why) in [
        ("b", after_sale.as_str(), "another shop's"),
        ("a", "j0.0", "a journal position"),
        ("a", "k0-0", "topic offsets"),
        ("a", flipped.as_str(), "changed"),
    ] {
        let (res, _) = open_stream(&sc, &server, shop, None, Some(cursor)).await;
        assert_eq!(res.status(), 400, "{why}: {cursor}");
        let body: Value = res.json().await.unwrap();
        assert!(
            body["detail"]
                .as_str()
                .unwrap()
                .starts_with("Last-Event-ID:"),
            "{body}"
        );
    }
    // This shop's own cursor resumes: from before the sale, the sale comes again.
    let (mut res, _) = open_stream(&sc, &server, "a", None, Some(&ready)).await;
    assert_eq!(res.status(), 200);
    let mut text = String::new();
    while !text.contains("\"request_key\":\"a0\"") {
        let chunk = tokio::time::timeout(Duration::from_secs(10), res.chunk())
            .await
            .expect("the resumed stream did not bring the sale")
            .unwrap()
            .unwrap();
        text.push_str(&String::from_utf8_lossy(&chunk));
    }
}
