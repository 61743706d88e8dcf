//! Orders, against the real binary: several lines reserved all or none, ended
//! together, in the key space of holds and transactions; concurrent orders taking the
//! same items in opposite orders; a crash in the middle of orders.

mod common;

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::nodes::*;
use common::*;
use serde_json::{json, Value};

fn orders_url(server: &Server, shop: &str, rest: &str) -> String {
    server.url(&format!("/v1/shops/{shop}/orders{rest}"))
}

async fn order(c: &reqwest::Client, server: &Server, shop: &str, body: Value) -> (u16, Value) {
    post(c, &orders_url(server, shop, ""), body).await
}

async fn stock(c: &reqwest::Client, server: &Server, shop: &str, item: &str) -> (i64, i64) {
    let (status, body) = get(c, &server.url(&format!("/v1/shops/{shop}/items/{item}"))).await;
    assert_eq!(status, 200, "{body}");
    (
        body["stock"].as_i64().unwrap(),
        body["reserved"].as_i64().unwrap(),
    )
}

/// A held order reserves every line; one with a line short of stock, unknown, or past a
/// buyer's limit reserves none and names that line; confirm sells every line, cancel
/// and expiry give every line back; each ends once; a line's hold and ending are events
/// of its item naming the order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_order_reserves_every_line_or_none_and_ends_them_together() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path(), &[]);
    orders_end_to_end(&server).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_order_reserves_every_line_or_none_on_the_mongodb_journal() {
    let Some(uri) = mongo_uri("orders") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path(), &["--mongo-uri", &uri]);
    orders_end_to_end(&server).await;
    drop_database(&uri).await;
}

async fn orders_end_to_end(server: &Server) {
    let c = client();
    load(&c, server, "s", &[("a", 10), ("b", 3), ("c", 1)]).await;
    let (status, limited) = call(
        &c,
        reqwest::Method::PUT,
        &server.url("/v1/shops/s/items"),
        Some(json!({"items": [{"item": "lim", "stock": 50, "per_buyer_max": 2}]}).to_string()),
    )
    .await;
    assert_eq!(status, 200, "{limited}");

    // Held: every line.
    let (status, held) = order(
        &c,
        server,
        "s",
        json!({"order_id": "o-1", "lines": [{"item": "b", "qty": 2}, {"item": "a", "qty": 4}],
               "ttl_ms": 60_000, "buyer": "ann"}),
    )
    .await;
    assert_eq!((status, &held["status"]), (200, &json!("held")), "{held}");
    assert_eq!(held["lines"][0]["item"], "b");
    assert!(held["lines"][0]["seq"].as_u64().is_some(), "{held}");
    assert!(held["expires_at"].as_i64().is_some(), "{held}");
    assert_eq!(stock(&c, server, "s", "a").await, (6, 4));
    assert_eq!(stock(&c, server, "s", "b").await, (1, 2));

    // Refused, for each reason, naming the first failing line; nothing stays reserved.
    for (id, lines, status, failed) in [
        (
            "o-short",
            json!([{"item": "a", "qty": 1}, {"item": "b", "qty": 2}]),
            "insufficient_stock",
            1,
        ),
        (
            "o-unknown",
            json!([{"item": "nope", "qty": 1}, {"item": "a", "qty": 1}]),
            "unknown_item",
            0,
        ),
        (
            "o-limit",
            json!([{"item": "a", "qty": 1}, {"item": "lim", "qty": 3}]),
            "buyer_limit",
            1,
        ),
    ] {
        let (code, body) = order(
            &c,
            server,
            "s",
            json!({"order_id": id, "lines": lines, "ttl_ms": 60_000, "buyer": "bob"}),
        )
        .await;
        assert_eq!(code, 200, "{body}");
        assert_eq!(
            (&body["status"], &body["failed_line"]),
            (&json!(status), &json!(failed)),
            "{body}"
        );
        assert!(
            body["reason"].as_str().is_some_and(|r| !r.is_empty()),
            "{body}"
        );
        // Answered again the same, from its record.
        let (_, again) = order(
            &c,
            server,
            "s",
            json!({"order_id": id, "lines": lines, "ttl_ms": 60_000, "buyer": "bob"}),
        )
        .await;
        assert_eq!(
            (&again["status"], &again["failed_line"]),
            (&json!(status), &json!(failed)),
            "{again}"
        );
    }
    assert_eq!(stock(&c, server, "s", "a").await, (6, 4));
    assert_eq!(stock(&c, server, "s", "b").await, (1, 2));
    assert_eq!(stock(&c, server, "s", "lim").await, (50, 0));
    let (_, short) = get(&c, &orders_url(server, "s", "/o-short")).await;
    assert_eq!(short["status"], "insufficient_stock", "{short}");
    assert_eq!(short["lines"][0]["status"], "released", "{short}");

    // The key space is shared with holds and transactions.
    let (code, body) = post(
        &c,
        &server.url("/v1/shops/s/holds"),
        json!({"request_id": "o-1", "item": "a", "qty": 1, "ttl_ms": 1000}),
    )
    .await;
    assert_eq!(
        (code, &body["error"]),
        (409, &json!("key_reused")),
        "{body}"
    );
    let (code, body) = post(
        &c,
        &server.url("/v1/shops/s/txns"),
        json!({"request_id": "sale-9", "seller": "x", "item": "a", "qty": 1}),
    )
    .await;
    assert_eq!(code, 200, "{body}");
    let (code, body) = order(
        &c,
        server,
        "s",
        json!({"order_id": "sale-9", "lines": [{"item": "a", "qty": 1}], "ttl_ms": 1000}),
    )
    .await;
    assert_eq!(
        (code, &body["error"]),
        (409, &json!("key_reused")),
        "{body}"
    );
    let (code, body) = order(
        &c,
        server,
        "s",
        json!({"order_id": "o-1", "lines": [{"item": "a", "qty": 1}], "ttl_ms": 60_000}),
    )
    .await;
    assert_eq!(
        (code, &body["error"]),
        (409, &json!("key_reused")),
        "{body}"
    );
    // A line of an order is not a hold of the caller's.
    let (code, _) = post(
        &c,
        &server.url("/v1/shops/s/holds/~line:o-1:0/confirm"),
        json!({}),
    )
    .await;
    assert_eq!(code, 404);

    // Confirm sells every line; a second confirm is answered the same; a cancel is 409.
    let (code, confirmed) = post(&c, &orders_url(server, "s", "/o-1/confirm"), json!({})).await;
    assert_eq!(
        (code, &confirmed["status"]),
        (200, &json!("confirmed")),
        "{confirmed}"
    );
    assert_eq!(confirmed["lines"][1]["status"], "confirmed", "{confirmed}");
    let (code, _) = post(&c, &orders_url(server, "s", "/o-1/confirm"), json!({})).await;
    assert_eq!(code, 200);
    let (code, body) = post(&c, &orders_url(server, "s", "/o-1/cancel"), json!({})).await;
    assert_eq!((code, &body["error"]), (409, &json!("conflict")), "{body}");
    assert_eq!(stock(&c, server, "s", "a").await, (5, 0));
    assert_eq!(stock(&c, server, "s", "b").await, (1, 0));

    // Cancel gives every line back.
    let (_, o2) = order(
        &c,
        server,
        "s",
        json!({"order_id": "o-2", "lines": [{"item": "a", "qty": 5}, {"item": "c", "qty": 1}],
               "ttl_ms": 60_000}),
    )
    .await;
    assert_eq!(o2["status"], "held", "{o2}");
    let (code, cancelled) = post(&c, &orders_url(server, "s", "/o-2/cancel"), json!({})).await;
    assert_eq!(
        (code, &cancelled["status"]),
        (200, &json!("cancelled")),
        "{cancelled}"
    );
    assert_eq!(stock(&c, server, "s", "a").await, (5, 0));
    assert_eq!(stock(&c, server, "s", "c").await, (1, 0));

    // Expiry gives every line back, and a confirm after it is 409.
    let (_, o3) = order(
        &c,
        server,
        "s",
        json!({"order_id": "o-3", "lines": [{"item": "a", "qty": 2}, {"item": "c", "qty": 1}],
               "ttl_ms": 300}),
    )
    .await;
    assert_eq!(o3["status"], "held", "{o3}");
    let mut expired = Value::Null;
    for _ in 0..100 {
        expired = get(&c, &orders_url(server, "s", "/o-3")).await.1;
        if expired["status"] == "expired"
            && expired["lines"]
                .as_array()
                .unwrap()
                .iter()
                .all(|l| l["status"] == "expired")
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(expired["status"], "expired", "{expired}");
    assert_eq!(stock(&c, server, "s", "a").await, (5, 0));
    assert_eq!(stock(&c, server, "s", "c").await, (1, 0));
    let (code, _) = post(&c, &orders_url(server, "s", "/o-3/confirm"), json!({})).await;
    assert_eq!(code, 409);

    // Every line's hold and ending is an event of its item, naming the order.
    let (_, events) = get(&c, &server.url("/v1/shops/s/items/c/events?after=0")).await;
    let of_orders: Vec<(String, String)> = events["events"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|e| {
            Some((
                e["order_id"].as_str()?.to_string(),
                e["kind"].as_str()?.to_string(),
            ))
        })
        .collect();
    assert_eq!(
        of_orders,
        [
            ("o-2".to_string(), "hold".to_string()),
            ("o-2".to_string(), "release".to_string()),
            ("o-3".to_string(), "hold".to_string()),
            ("o-3".to_string(), "expire".to_string()),
        ],
        "{events}"
    );
    let (code, _) = get(&c, &orders_url(server, "s", "/nope")).await;
    assert_eq!(code, 404);
}

/// Malformed orders are refused with the field and the reason, and reserve nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_order_is_refused_naming_the_field() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path(), &[]);
    let c = client();
    load(&c, &server, "s", &[("a", 10)]).await;
    let many: Vec<Value> = (0..101)
        .map(|i| json!({"item": format!("i{i}"), "qty": 1}))
        .collect();
    for (body, field) in [
        (
            json!({"lines": [{"item": "a", "qty": 1}], "ttl_ms": 1000}),
            "order_id",
        ),
        (
            json!({"order_id": "~x", "lines": [{"item": "a", "qty": 1}], "ttl_ms": 1000}),
            "order_id",
        ),
        (json!({"order_id": "x", "ttl_ms": 1000}), "lines"),
        (
            json!({"order_id": "x", "lines": [], "ttl_ms": 1000}),
            "lines",
        ),
        (
            json!({"order_id": "x", "lines": many, "ttl_ms": 1000}),
            "lines",
        ),
        (
            json!({"order_id": "x", "lines": [{"item": "a", "qty": 1}, {"item": "a", "qty": 2}], "ttl_ms": 1000}),
            "lines[1].item",
        ),
        (
            json!({"order_id": "x", "lines": [{"item": "a", "qty": 0}], "ttl_ms": 1000}),
            "lines[0].qty",
        ),
        (
            json!({"order_id": "x", "lines": [{"qty": 1}], "ttl_ms": 1000}),
            "lines[0].item",
        ),
        (
            json!({"order_id": "x", "lines": [{"item": "a", "qty": 1}]}),
            "ttl_ms",
        ),
    ] {
        let (code, answer) = order(&c, &server, "s", body.clone()).await;
        assert_eq!(code, 400, "{body} -> {answer}");
        let detail = answer["detail"].as_str().unwrap_or_default();
        assert!(
            detail.starts_with(&format!("{field}:")),
            "{body} -> {answer}"
        );
    }
    assert_eq!(stock(&c, &server, "s", "a").await, (10, 0));
}

/// `orders` two-line orders per pair of items of stock `each`, all at once, half of
/// them in reversed line order: exactly `each` orders of each pair are held, both items
/// at stock 0 and reserved `each`, and every caller is answered (no refusal while
/// stock is only tentatively taken, no deadlock). Several pairs, so lines on different
/// shards are covered.
async fn contended_pairs(servers: &[&Server], pairs: usize, orders: usize, each: i64) {
    let server = servers[0];
    // An order's reserving is bounded by the server's reply timeout (20 s on the
    // nodes), and its answer may wait after that for its lines' release to be written:
    // the default 30 s is too close to that bound to tell a slow answer from none.
    let c = client_within(Duration::from_secs(90));
    let items: Vec<(String, i64)> = (0..pairs)
        .flat_map(|p| [(format!("x{p}"), each), (format!("y{p}"), each)])
        .collect();
    let refs: Vec<(&str, i64)> = items.iter().map(|(i, s)| (i.as_str(), *s)).collect();
    load(&c, server, "flash", &refs).await;
    let mut tasks = Vec::new();
    for p in 0..pairs {
        for n in 0..orders {
            let on = servers[n % servers.len()];
            let (c, url) = (c.clone(), orders_url(on, "flash", ""));
            let (x, y) = (format!("x{p}"), format!("y{p}"));
            let lines = if n % 2 == 0 {
                json!([{"item": x, "qty": 1}, {"item": y, "qty": 1}])
            } else {
                json!([{"item": y, "qty": 1}, {"item": x, "qty": 1}])
            };
            tasks.push(tokio::spawn(async move {
                let body =
                    json!({"order_id": format!("p{p}-{n}"), "lines": lines, "ttl_ms": 600_000});
                (p, post(&c, &url, body).await)
            }));
        }
    }
    let mut held = vec![0i64; pairs];
    for t in tasks {
        let (p, (code, body)) = t.await.unwrap();
        if code != 200 {
            for s in servers {
                let log = std::fs::read_to_string(s.dir.join("server.log")).unwrap_or_default();
                eprintln!(
                    "--- {}:\n{}",
                    s.base,
                    log.lines()
                        .filter(|l| !l.contains("protected mode"))
                        .take(40)
                        .collect::<Vec<_>>()
                        .join("\n")
                );
            }
        }
        assert_eq!(code, 200, "{body}");
        match body["status"].as_str() {
            Some("held") => held[p] += 1,
            Some("insufficient_stock") => {}
            _ => panic!("unexpected answer {body}"),
        }
    }
    assert_eq!(held, vec![each; pairs], "held orders per pair");
    for (item, _) in &items {
        assert_eq!(stock(&c, server, "flash", item).await, (0, each), "{item}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_orders_in_opposite_line_orders_hold_exactly_the_stock() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path(), &["--shards", "4"]);
    // Lines on different shards are certain to be covered.
    let pairs = 4;
    let apart = (0..pairs)
        .filter(|p| {
            let shard = |i: &str| nrtxn_actors::engine::shard_of("flash", i, 4);
            shard(&format!("x{p}")) != shard(&format!("y{p}"))
        })
        .count();
    assert!(apart > 0, "no pair of items on two shards");
    contended_pairs(&[&server], pairs, 300, 100).await;
}

/// Reads orders `ids` of `shop` until none is `reserving` and no line is held under an
/// order that is not (for up to `rounds` × 200 ms), and checks that each is held
/// with every line held, or ended with none held.
/// Their counts by status, and the quantity the held ones reserve per item.
async fn settled(
    c: &reqwest::Client,
    server: &Server,
    shop: &str,
    ids: &[String],
    rounds: usize,
) -> (BTreeMap<String, usize>, BTreeMap<String, i64>) {
    let mut views: HashMap<String, Value> = HashMap::new();
    let deadline = std::time::Instant::now() + Duration::from_millis(200 * rounds as u64);
    while std::time::Instant::now() < deadline {
        views.clear();
        for id in ids {
            let (code, body) = get(c, &orders_url(server, shop, &format!("/{id}"))).await;
            if code == 200 {
                views.insert(id.clone(), body);
            }
        }
        // Settled: no order still reserving, and no line held under an order that is
        // not (a late line is released once past the request TTL).
        let line_astray = |v: &Value| {
            v["status"] != "held"
                && v["lines"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .any(|l| l["status"] == "held")
        };
        if views
            .values()
            .all(|v| v["status"] != "reserving" && !line_astray(v))
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let mut counts: BTreeMap<String, usize> = BTreeMap::new();
    let mut reserved: BTreeMap<String, i64> = BTreeMap::new();
    for (id, v) in &views {
        let status = v["status"].as_str().unwrap().to_string();
        *counts.entry(status.clone()).or_default() += 1;
        assert_ne!(status, "reserving", "{id}: {v}");
        for line in v["lines"].as_array().unwrap() {
            if status == "held" {
                assert_eq!(line["status"], "held", "{id}: {v}");
                *reserved
                    .entry(line["item"].as_str().unwrap().to_string())
                    .or_default() += line["qty"].as_i64().unwrap();
            } else if line["status"] == "held" {
                let item = line["item"].as_str().unwrap();
                let (_, ev) = get(
                    c,
                    &server.url(&format!("/v1/shops/{shop}/items/{item}/events?after=0")),
                )
                .await;
                let mine: Vec<&Value> = ev["events"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .filter(|e| e["order_id"] == id.as_str())
                    .collect();
                let (_, rec) = get(c, &orders_url(server, shop, &format!("/{id}"))).await;
                panic!("{id}: a line held while its order is not: {v}\nline events: {mine:?}\nagain: {rec}");
            }
        }
    }
    (counts, reserved)
}

/// A SIGKILL in the middle of many three-line orders, then a restart: every order is
/// held with all its lines held, or ended with none; each item's `reserved` is the sum
/// of the held orders' lines on it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sigkill_in_the_middle_of_orders_leaves_no_line_held_unless_its_order_is() {
    sigkill_mid_orders(&["--shards", "4"]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sigkill_in_the_middle_of_orders_on_the_mongodb_journal() {
    let Some(uri) = mongo_uri("orders_kill") else {
        return;
    };
    sigkill_mid_orders(&["--shards", "4", "--mongo-uri", &uri]).await;
    drop_database(&uri).await;
}

async fn sigkill_mid_orders(flags: &[&str]) {
    let dir = tempfile::tempdir().unwrap();
    let mut server = Server::start(dir.path(), flags);
    let c = client();
    let items: Vec<String> = (0..6).map(|i| format!("k{i}")).collect();
    let refs: Vec<(&str, i64)> = items.iter().map(|i| (i.as_str(), 1_000_000)).collect();
    load(&c, &server, "s", &refs).await;
    let stop = Arc::new(AtomicBool::new(false));
    let sent: Arc<Mutex<Vec<String>>> = Arc::default();
    let mut tasks = Vec::new();
    for w in 0..16 {
        let (c, url, stop, sent, items) = (
            c.clone(),
            orders_url(&server, "s", ""),
            stop.clone(),
            sent.clone(),
            items.clone(),
        );
        tasks.push(tokio::spawn(async move {
            let mut n = 0usize;
            while !stop.load(Ordering::Relaxed) {
                let id = format!("w{w}-{n}");
                let lines: Vec<Value> = (0..3)
                    .map(|j| json!({"item": items[(w + n + j * 2) % items.len()], "qty": 1 + j}))
                    .collect();
                sent.lock().unwrap().push(id.clone());
                let body = json!({"order_id": id, "lines": lines, "ttl_ms": 600_000});
                if c.post(&url).json(&body).send().await.is_err() {
                    break;
                }
                n += 1;
            }
        }));
    }
    // Killed in the middle: once enough orders were sent (a slow store on a busy
    // machine sends fewer a second), and at least 1.5 s in.
    let started = std::time::Instant::now();
    while started.elapsed() < Duration::from_millis(1500)
        || (sent.lock().unwrap().len() < 80 && started.elapsed() < Duration::from_secs(30))
    {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    server.kill();
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        let _ = t.await;
    }
    let server = Server::start(&server.dir.clone(), flags);
    let ids = sent.lock().unwrap().clone();
    assert!(ids.len() > 50, "only {} orders sent", ids.len());
    // Recovery settles every order: none stays `reserving`.
    let (counts, reserved) = settled(&c, &server, "s", &ids, 100).await;
    eprintln!("orders after the restart: {counts:?} of {} sent", ids.len());
    assert!(counts.get("held").copied().unwrap_or(0) > 0, "{counts:?}");
    // Each item's `reserved` is the held orders' lines. A line written without its
    // order's record (the two go in one call, and the kill may fall between them) is
    // released by the check at the start, which on a shared journal first waits twice
    // the reply timeout: so the figures are read until they agree, for up to 30 s.
    let expected = |item: &String| reserved.get(item).copied().unwrap_or(0);
    let mut last = Vec::new();
    for _ in 0..150 {
        last.clear();
        for item in &items {
            last.push(stock(&c, &server, "s", item).await.1);
        }
        if items
            .iter()
            .zip(&last)
            .all(|(item, r)| *r == expected(item))
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    for (item, r) in items.iter().zip(&last) {
        assert_eq!(*r, expected(item), "{item}: reserved");
    }
}

/// An order is refused only for stock really short: orders that will fail on a second
/// line (an item of stock 0) take the first item tentatively for a moment, and orders
/// that could be served wait for them rather than being refused. Of 150 such failing
/// orders and 150 servable ones on an item of stock 100, exactly 100 servable orders
/// are held, and the item ends at stock 0. Servable orders whose first attempt (every
/// line at once) met the item held tentatively released the line they had taken past
/// it and held it again, in item order, under its second key.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_line_taken_only_tentatively_by_another_order_waits_instead_of_being_refused() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path(), &["--shards", "4"]);
    let c = client();
    load(
        &c,
        &server,
        "s",
        &[("a", 100), ("b-gone", 0), ("c-plenty", 1_000)],
    )
    .await;
    let mut tasks = Vec::new();
    for n in 0..300 {
        let (c, url) = (c.clone(), orders_url(&server, "s", ""));
        let second = if n % 2 == 0 { "b-gone" } else { "c-plenty" };
        tasks.push(tokio::spawn(async move {
            let body = json!({"order_id": format!("o{n}"), "ttl_ms": 600_000,
                              "lines": [{"item": "a", "qty": 1}, {"item": second, "qty": 1}]});
            (second, post(&c, &url, body).await)
        }));
    }
    let mut held = 0;
    for t in tasks {
        let (second, (code, body)) = t.await.unwrap();
        assert_eq!(code, 200, "{body}");
        if body["status"] == "held" {
            assert_eq!(second, "c-plenty", "{body}");
            held += 1;
        } else {
            assert_eq!(body["status"], "insufficient_stock", "{body}");
        }
    }
    assert_eq!(held, 100, "servable orders held");
    assert_eq!(stock(&c, &server, "s", "a").await, (0, 100));
    assert_eq!(stock(&c, &server, "s", "c-plenty").await, (900, 100));
    // The servable orders' first attempts (every line at once, none waiting) met `a`
    // held tentatively by the others: they released the `c-plenty` line they had
    // taken past it, went on in item order, and held it again under a key of its own
    // (orders/reserve.rs). The stock above is what that path left.
    let url = server.url("/v1/shops/s/items/c-plenty/events?after=0&limit=1000");
    let (_, events) = get(&c, &url).await;
    let events = events["events"].as_array().unwrap();
    let hold_id = |e: &Value| e["hold_id"].as_str().unwrap_or_default().to_string();
    let again: Vec<String> = events
        .iter()
        .filter(|e| e["kind"] == "hold" && e["status"] == "ok")
        .map(hold_id)
        .filter_map(|h| {
            let (order, i) = h.rsplit_once(':')?;
            let i: usize = i.parse().ok()?;
            // The first key of a line held again (its index is past LINE_RETRY).
            (i >= nrtxn_actors::types::LINE_RETRY)
                .then(|| format!("{order}:{}", i - nrtxn_actors::types::LINE_RETRY))
        })
        .collect();
    assert!(!again.is_empty(), "no first attempt met contention");
    for first in &again {
        assert!(
            events
                .iter()
                .any(|e| e["kind"] == "release" && hold_id(e) == *first),
            "{first} was held again without its first hold released"
        );
    }
}

/// Through Kafka with two nodes sharing MongoDB: the callers of 150 orders on a pair of
/// items of stock 50 alternate between the nodes (the lines travel through the log to
/// their items' owners). Then orders are ended through the node that did not place
/// them, and a node is killed in the middle of orders and started again: recovery
/// settles every order whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn orders_through_kafka_with_two_nodes() {
    let Some(mut two) = start_two("orders").await else {
        return;
    };
    let c = client();
    {
        let [n0, n1] = &two.nodes;
        let started = std::time::Instant::now();
        // 150 orders, not 300 as on the embedded log: the test server for MongoDB
        // (secantusdb) scans the whole holds collection for each hold's update (its
        // filter has a range on `seq`), so each journal write costs more as the holds
        // grow. 300 orders took 11 to 19 s on a developer's machine and past the
        // client's 30 s in a CI run (the answers all came, held or refused, but late).
        contended_pairs(&[n0, n1], 1, 150, 50).await;
        eprintln!(
            "150 orders on two nodes in {} ms",
            started.elapsed().as_millis()
        );
        // Placed through node 0 (even numbers), ended through node 1.
        let (code, body) = post(&c, &orders_url(n1, "flash", "/p0-0/confirm"), json!({})).await;
        assert!(code == 200 || code == 409, "{body}");
        if code == 200 {
            assert_eq!(body["status"], "confirmed", "{body}");
        }
        let (code, body) = post(&c, &orders_url(n1, "flash", "/p0-2/cancel"), json!({})).await;
        assert!(code == 200 || code == 409, "{body}");
        let (_, p12) = get(&c, &orders_url(n0, "flash", "/p0-2")).await;
        assert!(
            p12["lines"]
                .as_array()
                .unwrap()
                .iter()
                .all(|l| l["status"] != "held"),
            "{p12}"
        );
    }
    kill_mid_orders(&mut two).await;
    drop_database(&two.mongo).await;
}

/// Orders to both nodes; node 1 is killed after a while and started again; then every
/// order is held whole or ended whole.
async fn kill_mid_orders(two: &mut Nodes) {
    let c = client();
    load(
        &c,
        &two.nodes[0],
        "k",
        &[("m0", 100_000), ("m1", 100_000), ("m2", 100_000)],
    )
    .await;
    let stop = Arc::new(AtomicBool::new(false));
    let sent: Arc<Mutex<Vec<String>>> = Arc::default();
    let mut tasks = Vec::new();
    for w in 0..8 {
        let url = orders_url(&two.nodes[w % 2], "k", "");
        let (c, stop, sent) = (c.clone(), stop.clone(), sent.clone());
        tasks.push(tokio::spawn(async move {
            let mut n = 0usize;
            while !stop.load(Ordering::Relaxed) {
                let id = format!("k{w}-{n}");
                sent.lock().unwrap().push(id.clone());
                let lines: Vec<Value> = (0..3)
                    .map(|j| json!({"item": format!("m{}", (n + j) % 3), "qty": 1}))
                    .collect();
                let body = json!({"order_id": id, "lines": lines, "ttl_ms": 600_000});
                if c.post(&url).json(&body).send().await.is_err() {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                n += 1;
            }
        }));
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    two.nodes[1].kill();
    tokio::time::sleep(Duration::from_secs(1)).await;
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        let _ = t.await;
    }
    let f1 = node_flags("orders", 1).unwrap();
    let f1: Vec<&str> = f1.iter().map(String::as_str).collect();
    two.nodes[1] = Server::start(two.dirs[1].path(), &f1);
    wait_ready(&c, &two.nodes[1]).await;
    let ids = sent.lock().unwrap().clone();
    // The restarted node checks what it reads back after twice the reply timeout.
    let (counts, reserved) = settled(&c, &two.nodes[0], "k", &ids, 600).await;
    eprintln!(
        "orders after node 1's restart: {counts:?} of {} sent",
        ids.len()
    );
    for item in ["m0", "m1", "m2"] {
        let (_, r) = stock(&c, &two.nodes[0], "k", item).await;
        assert_eq!(r, reserved.get(item).copied().unwrap_or(0), "{item}");
    }
}
