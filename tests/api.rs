//! End to end through real HTTP against the real binary on an ephemeral port.

mod common;

use std::collections::HashMap;

use common::*;
use reqwest::Method;
use serde_json::{json, Value};

fn txn(seller: &str, item: &str, qty: i64, req_time: i64) -> Value {
    json!({ "seller": seller, "buyer": "b", "item": item, "qty": qty, "req_time": req_time })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn respond_true_answers_the_outcome_and_a_resubmission_returns_it_unchanged() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path(), &[]);
    let c = client();
    load(&c, &server, "s1", &[("sku-1", 5)]).await;
    let url = server.url("/v1/shops/s1/txns");

    let (status, first) = post(&c, &url, txn("alice", "sku-1", 3, 100)).await;
    assert_eq!(status, 200, "{first}");
    assert_eq!(first["status"], "ok");
    assert_eq!(first["request_key"], "alice:sku-1:100");
    assert_eq!(
        (
            first["stock_before"].as_i64(),
            first["stock_after"].as_i64()
        ),
        (Some(5), Some(2))
    );
    assert_eq!(
        (first["prev_seq"].as_u64(), first["seq"].as_u64()),
        (Some(1), Some(2))
    );
    for field in [
        "reason",
        "item",
        "op",
        "qty",
        "submitted_at",
        "completed_at",
    ] {
        assert!(first.get(field).is_some(), "outcome lacks {field}: {first}");
    }
    // The outcome names who asked and when nrtxn took the request.
    assert_eq!(
        (first["seller"].as_str(), first["buyer"].as_str()),
        (Some("alice"), Some("b")),
        "{first}"
    );
    let requested_at = first["requested_at"].as_i64().expect("requested_at");
    assert_eq!(Some(requested_at), first["submitted_at"].as_i64());
    assert!(requested_at <= first["completed_at"].as_i64().unwrap());

    // Same request again: the original outcome, nothing applied.
    let (status, again) = post(&c, &url, txn("alice", "sku-1", 3, 100)).await;
    assert_eq!(status, 200);
    assert_eq!(again, first);
    // Same key with another quantity is another request: refused, nothing applied.
    let (status, reused) = post(&c, &url, txn("alice", "sku-1", 1, 100)).await;
    assert_eq!(status, 409, "{reused}");
    assert_eq!(reused["error"], "key_reused");
    assert_eq!(reused["original"], first);
    let (_, item) = get(&c, &server.url("/v1/shops/s1/items/sku-1")).await;
    assert_eq!(
        item,
        json!({"shop": "s1", "item": "sku-1", "stock": 2, "reserved": 0, "seq": 2,
               "opens_at": null, "closes_at": null, "low_stock_at": null})
    );

    // Beyond the stock: an outcome, not an error, and nothing partial.
    let (status, short) = post(&c, &url, txn("alice", "sku-1", 3, 101)).await;
    assert_eq!(status, 200);
    assert_eq!(short["status"], "insufficient_stock");
    assert_eq!(short["stock_after"], 2);

    // A return goes back to stock; request_id replaces the natural key.
    let (_, ret) = post(
        &c,
        &url,
        json!({"seller": "alice", "item": "sku-1", "qty": 4, "op": "increment", "request_id": "ret-1"}),
    )
    .await;
    assert_eq!(
        (ret["status"].as_str(), ret["request_key"].as_str()),
        (Some("ok"), Some("ret-1"))
    );
    assert_eq!(ret["stock_after"], 6);

    // Unknown items are outcomes; unknown keys and items are 404s.
    let (status, unknown) = post(&c, &url, txn("alice", "nope", 1, 1)).await;
    assert_eq!(
        (status, unknown["status"].as_str()),
        (200, Some("unknown_item"))
    );
    assert_eq!(get(&c, &server.url("/v1/shops/s1/txns/never")).await.0, 404);
    assert_eq!(get(&c, &server.url("/v1/shops/s1/items/nope")).await.0, 404);
    // Polling a decided key gives the same outcome.
    let (status, polled) = get(&c, &server.url("/v1/shops/s1/txns/alice:sku-1:100")).await;
    assert_eq!((status, &polled), (200, &first));
    // Its event names them too; a load's names no seller or buyer.
    let (_, events) = get(&c, &server.url("/v1/shops/s1/items/sku-1/events")).await;
    let events = events["events"].as_array().unwrap();
    let sale = events
        .iter()
        .find(|e| e["request_key"] == "alice:sku-1:100")
        .unwrap();
    assert_eq!(
        (&sale["seller"], &sale["buyer"], &sale["requested_at"]),
        (&json!("alice"), &json!("b"), &json!(requested_at)),
        "{sale}"
    );
    assert_eq!(events[0]["kind"], "load");
    assert!(events[0].get("seller").is_none() && events[0]["requested_at"].is_i64());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fire_and_forget_is_accepted_then_decided_by_polling() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path(), &[]);
    let c = client();
    load(&c, &server, "s1", &[("sku-1", 10)]).await;
    let url = server.url("/v1/shops/s1/txns");
    for (n, respond) in [(1, json!(false)), (2, json!(0))] {
        let mut body = txn("bob", "sku-1", 2, n);
        body["respond"] = respond;
        let (status, accepted) = post(&c, &url, body).await;
        assert_eq!(status, 202, "{accepted}");
        let key = format!("bob:sku-1:{n}");
        assert_eq!(accepted, json!({"request_key": key, "status": "accepted"}));
        let (status, outcome) = poll_decided(&c, &server, "s1", &key).await;
        assert_eq!(status, 200);
        assert_eq!(outcome["status"], "ok");
        // A repeat of a decided fire-and-forget key answers its outcome.
        let mut body = txn("bob", "sku-1", 2, n);
        body["respond"] = json!(false);
        let (status, repeat) = post(&c, &url, body).await;
        assert_eq!((status, repeat), (200, outcome));
    }
    let (_, item) = get(&c, &server.url("/v1/shops/s1/items/sku-1")).await;
    assert_eq!(item["stock"], 6);
}

/// Calls that come together reach a shop's WorkManager in one burst, which it hands on
/// to the log's writer and the processor together: each is still answered (202 or its
/// outcome), each fire-and-forget request decided once, and the stock sold no further
/// than it goes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_waiting_and_fire_and_forget_calls_is_answered_and_decided_in_full() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path(), &[]);
    let c = client();
    load(&c, &server, "s1", &[("a", 20), ("b", 20)]).await;
    let url = server.url("/v1/shops/s1/txns");
    let calls = (0..60).map(|n| {
        let (c, url) = (c.clone(), url.clone());
        async move {
            let item = if n % 2 == 0 { "a" } else { "b" };
            let mut body = txn("burst", item, 1, n);
            let forget = n % 4 < 2;
            body["respond"] = json!(!forget);
            let (status, res) = post(&c, &url, body).await;
            (n, item, forget, status, res)
        }
    });
    let answers = futures::future::join_all(calls).await;
    let mut sold: HashMap<&str, i64> = HashMap::new();
    for (n, item, forget, status, res) in answers {
        let key = format!("burst:{item}:{n}");
        let outcome = if forget {
            assert_eq!(status, 202, "{res}");
            assert_eq!(res, json!({"request_key": key, "status": "accepted"}));
            let (status, outcome) = poll_decided(&c, &server, "s1", &key).await;
            assert_eq!(status, 200, "{outcome}");
            outcome
        } else {
            assert_eq!(status, 200, "{res}");
            res
        };
        match outcome["status"].as_str() {
            Some("ok") => *sold.entry(item).or_default() += 1,
            Some("insufficient_stock") => {}
            other => panic!("{key}: {other:?}"),
        }
    }
    assert_eq!(sold, HashMap::from([("a", 20), ("b", 20)]));
    for item in ["a", "b"] {
        let (_, view) = get(&c, &server.url(&format!("/v1/shops/s1/items/{item}"))).await;
        assert_eq!(view["stock"], 0, "{view}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batch_route_answers_each_entry_in_order() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path(), &[]);
    let c = client();
    load(&c, &server, "s1", &[("a", 3), ("b", 0)]).await;
    let mut forget = txn("s", "a", 1, 9);
    forget["respond"] = json!(false);
    let body = json!({"txns": [
        txn("s", "a", 2, 1),
        txn("s", "a", 2, 2),
        {"seller": "s", "item": "b", "qty": 5, "op": "increment", "req_time": 3},
        txn("s", "b", 5, 4),
        txn("s", "zzz", 1, 5),
        txn("s", "a", 2, 1),
        forget,
    ]});
    let (status, res) = post(&c, &server.url("/v1/shops/s1/txns/batch"), body).await;
    assert_eq!(status, 200, "{res}");
    let results = res["results"].as_array().unwrap();
    let statuses: Vec<&str> = results
        .iter()
        .map(|r| r["status"].as_str().unwrap())
        .collect();
    assert_eq!(
        statuses,
        [
            "ok",
            "insufficient_stock",
            "ok",
            "ok",
            "unknown_item",
            "ok",
            "accepted"
        ]
    );
    let keys: Vec<&str> = results
        .iter()
        .map(|r| r["request_key"].as_str().unwrap())
        .collect();
    assert_eq!(
        keys,
        ["s:a:1", "s:a:2", "s:b:3", "s:b:4", "s:zzz:5", "s:a:1", "s:a:9"]
    );
    // The repeated key in one batch shares the first entry's outcome.
    assert_eq!(results[5], results[0]);
    let (_, decided) = poll_decided(&c, &server, "s1", "s:a:9").await;
    assert_eq!(decided["status"], "ok");
    let (_, a) = get(&c, &server.url("/v1/shops/s1/items/a")).await;
    let (_, b) = get(&c, &server.url("/v1/shops/s1/items/b")).await;
    assert_eq!(
        (a["stock"].as_i64(), b["stock"].as_i64()),
        (Some(0), Some(0))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flash_sale_of_1500_concurrent_decrements_sells_exactly_the_stock() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path(), &[]);
    let c = client();
    load(&c, &server, "flash", &[("hot", 1000)]).await;
    let url = server.url("/v1/shops/flash/txns");
    let calls = (0..1500).map(|n| {
        let c = c.clone();
        let url = url.clone();
        async move { post(&c, &url, txn(&format!("seller{}", n % 7), "hot", 1, n)).await }
    });
    let answers = futures::future::join_all(calls).await;
    let mut by_status: HashMap<String, usize> = HashMap::new();
    let mut seqs = Vec::new();
    for (status, body) in &answers {
        assert_eq!(*status, 200, "{body}");
        *by_status
            .entry(body["status"].as_str().unwrap().to_string())
            .or_default() += 1;
        seqs.push(body["seq"].as_u64().unwrap());
    }
    assert_eq!(by_status.get("ok"), Some(&1000), "{by_status:?}");
    assert_eq!(
        by_status.get("insufficient_stock"),
        Some(&500),
        "{by_status:?}"
    );
    let (_, item) = get(&c, &server.url("/v1/shops/flash/items/hot")).await;
    assert_eq!(item["stock"], 0);
    // Every decision took its own place in the item's sequence, after the load (seq 1),
    // and so did the sold_out alert journaled right after the sale that took the last
    // unit: the one seq no answer has.
    seqs.sort_unstable();
    let last_sale = answers
        .iter()
        .filter(|(_, b)| b["status"] == "ok" && b["stock_after"] == 0)
        .map(|(_, b)| b["seq"].as_u64().unwrap())
        .collect::<Vec<_>>();
    assert_eq!(last_sale.len(), 1, "one sale took the last unit");
    let alert = last_sale[0] + 1;
    let expected: Vec<u64> = (2..=1502).filter(|s| *s != alert).collect();
    assert_eq!(seqs, expected);
    assert_eq!(item["seq"], 1502);
    let page = format!(
        "/v1/shops/flash/items/hot/events?after={}&limit=1",
        alert - 1
    );
    let (_, events) = get(&c, &server.url(&page)).await;
    let kinds: Vec<&str> = events["events"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["seq"] == alert)
        .map(|e| e["kind"].as_str().unwrap())
        .collect();
    assert_eq!(kinds, ["sold_out"], "the alert's event");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_bad_input_gets_a_400_naming_the_field() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path(), &[]);
    let c = client();
    load(&c, &server, "s1", &[("sku-1", 10)]).await;
    let long = "x".repeat(129);
    let ok = txn("s", "sku-1", 1, 1);
    let with = |field: &str, v: Value| {
        let mut b = ok.clone();
        b[field] = v;
        b.to_string()
    };
    let without = |field: &str| {
        let mut b = ok.clone();
        b.as_object_mut().unwrap().remove(field);
        b.to_string()
    };
    let cases: Vec<(String, &str)> = vec![
        ("{\"seller\": ".into(), "body: malformed JSON"),
        ("[1,2]".into(), "body: must be a JSON object"),
        ("".into(), "body: malformed JSON"),
        (without("seller"), "seller: required"),
        (without("item"), "item: required"),
        (without("qty"), "qty: required"),
        (
            without("req_time"),
            "req_time: required when request_id is absent",
        ),
        (with("qty", json!(0)), "qty: must be at least 1"),
        (with("qty", json!(-3)), "qty: must be at least 1"),
        (with("qty", json!(1.5)), "qty: must be an integer"),
        (
            with("qty", json!("5")),
            "qty: must be an integer, got a string",
        ),
        (
            with("qty", json!(1_000_000_001)),
            "qty: must be at most 1000000000",
        ),
        (with("qty", json!(u64::MAX)), "qty: must be at most"),
        (
            with("op", json!("steal")),
            "op: must be \"decrement\" or \"increment\"",
        ),
        (with("op", json!(1)), "op: must be"),
        (
            with("respond", json!("yes")),
            "respond: must be true, false, 1 or 0",
        ),
        (with("respond", json!(2)), "respond: must be"),
        (with("seller", json!("")), "seller: must not be empty"),
        (with("seller", json!(long)), "seller: longer than 128 bytes"),
        (with("item", json!(7)), "item: must be a string"),
        (with("item", json!("a/b")), "item: must not contain '/'"),
        (
            with("request_id", json!("")),
            "request_id: must not be empty",
        ),
        (
            with("req_time", json!(1.5)),
            "req_time: must be a string or an integer",
        ),
        (
            with("remarks", json!("r".repeat(1025))),
            "remarks: longer than 1024 bytes",
        ),
        (
            format!("{{\"pad\": \"{}\"}}", "p".repeat(20_000)),
            "body: larger than the limit",
        ),
    ];
    let url = server.url("/v1/shops/s1/txns");
    for (body, expected) in &cases {
        let (status, res) = call(&c, Method::POST, &url, Some(body.clone())).await;
        assert_eq!(status, 400, "{body:.80} -> {res}");
        assert_eq!(res["error"], "invalid_request");
        let detail = res["detail"].as_str().unwrap();
        assert!(
            detail.starts_with(expected),
            "{body:.80}: {detail:?} should start with {expected:?}"
        );
    }
    // Path segments.
    let (status, res) = post(
        &c,
        &server.url(&format!("/v1/shops/{long}/txns")),
        ok.clone(),
    )
    .await;
    assert_eq!(
        (
            status,
            res["detail"].as_str().map(|d| d.starts_with("shop:"))
        ),
        (400, Some(true))
    );
    // Batches: an invalid entry fails the whole call, naming the entry.
    let batch = server.url("/v1/shops/s1/txns/batch");
    let (status, res) = post(
        &c,
        &batch,
        json!({"txns": [ok, with_value(&ok, "qty", json!(0))]}),
    )
    .await;
    assert_eq!(status, 400);
    assert!(
        res["detail"].as_str().unwrap().starts_with("txns[1].qty:"),
        "{res}"
    );
    let (status, res) = post(&c, &batch, json!({"txns": []})).await;
    assert_eq!(
        (status, res["detail"].as_str()),
        (400, Some("txns: must not be empty"))
    );
    let many: Vec<Value> = (0..1001)
        .map(|n| txn("s", "sku-1", 1, 10_000 + n))
        .collect();
    let (status, res) = post(&c, &batch, json!({ "txns": many })).await;
    assert_eq!(status, 400);
    assert!(
        res["detail"]
            .as_str()
            .unwrap()
            .starts_with("txns: at most 1000 entries"),
        "{res}"
    );
    // Loads.
    let items = server.url("/v1/shops/s1/items");
    for (body, expected) in [
        (
            json!({"items": [{"item": "a", "stock": -1}]}),
            "items[0].stock: must be at least 0",
        ),
        (
            json!({"items": [{"item": "a", "stock": 1}, {"item": "a", "stock": 2}]}),
            "items[1].item: a appears more than once",
        ),
        (json!({"items": [{"stock": 2}]}), "items[0].item: required"),
        (json!({"items": "a"}), "items: must be an array"),
    ] {
        let (status, res) = call(&c, Method::PUT, &items, Some(body.to_string())).await;
        assert_eq!(status, 400, "{res}");
        assert!(
            res["detail"].as_str().unwrap().starts_with(expected),
            "{res}"
        );
    }
    let too_many: Vec<Value> = (0..10_001)
        .map(|n| json!({"item": format!("i{n}"), "stock": 1}))
        .collect();
    let (status, res) = call(
        &c,
        Method::PUT,
        &items,
        Some(json!({ "items": too_many }).to_string()),
    )
    .await;
    assert_eq!(status, 400);
    assert!(
        res["detail"]
            .as_str()
            .unwrap()
            .starts_with("items: at most 10000 entries"),
        "{res}"
    );
    // None of it changed anything.
    let (_, item) = get(&c, &server.url("/v1/shops/s1/items/sku-1")).await;
    assert_eq!(
        (item["stock"].as_i64(), item["seq"].as_u64()),
        (Some(10), Some(1))
    );
}

fn with_value(base: &Value, field: &str, v: Value) -> Value {
    let mut b = base.clone();
    b[field] = v;
    b
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overload_answers_429_with_retry_after_and_applies_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path(), &["--shop-pending-max", "5"]);
    let c = client();
    load(&c, &server, "s1", &[("sku-1", 100)]).await;
    let many: Vec<Value> = (0..6).map(|n| txn("s", "sku-1", 1, n)).collect();
    let res = c
        .post(server.url("/v1/shops/s1/txns/batch"))
        .json(&json!({ "txns": many }))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status().as_u16(), 429);
    assert_eq!(res.headers()["retry-after"], "1");
    let body: Value = res.json().await.unwrap();
    assert_eq!(body["error"], "overloaded");
    for n in 0..6 {
        assert_eq!(
            get(&c, &server.url(&format!("/v1/shops/s1/txns/s:sku-1:{n}")))
                .await
                .0,
            404
        );
    }
    let (_, item) = get(&c, &server.url("/v1/shops/s1/items/sku-1")).await;
    assert_eq!(
        (item["stock"].as_i64(), item["seq"].as_u64()),
        (Some(100), Some(1))
    );
    // Within the bound, the same batch goes through.
    let five: Vec<Value> = (0..5).map(|n| txn("s", "sku-1", 1, n)).collect();
    let (status, _) = post(
        &c,
        &server.url("/v1/shops/s1/txns/batch"),
        json!({ "txns": five }),
    )
    .await;
    assert_eq!(status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_readiness_and_metrics_are_served() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path(), &[]);
    let c = client();
    assert_eq!(get(&c, &server.url("/healthz")).await.0, 200);
    assert_eq!(
        get(&c, &server.url("/readyz")).await,
        (200, json!({"status": "ready"}))
    );
    load(&c, &server, "s1", &[("sku-1", 1)]).await;
    post(
        &c,
        &server.url("/v1/shops/s1/txns"),
        txn("s", "sku-1", 1, 1),
    )
    .await;
    // A request refused before routing (its shop's name does not decode to UTF-8) is
    // counted too, under the route its path has.
    let (status, _) = post(
        &c,
        &server.url("/v1/shops/%FF/txns"),
        txn("s", "sku-1", 1, 2),
    )
    .await;
    assert_eq!(status, 400);
    let text = metrics_text(&c, &server).await;
    for needle in [
        "nrtxn_http_requests_total{route=\"/v1/shops/{shop}/txns\",status=\"200\"} 1",
        "nrtxn_http_requests_total{route=\"/v1/shops/{shop}/txns\",status=\"400\"} 1",
        "nrtxn_queue_depth{queue=\"inflight\"} 0",
        "nrtxn_batch_entries_count",
        "nrtxn_journal_write_seconds_count",
        "nrtxn_decisions_total{status=\"ok\"} 1",
    ] {
        assert!(text.contains(needle), "metrics lack {needle}:\n{text}");
    }
    // Each entry (the load's and the sale's) counts once in the log's group commits,
    // and once, later, in the views' commits, which are figures of their own.
    let journal = "nrtxn_journal_txn_entries_sum";
    let views = "nrtxn_sqlite_commit_entries_sum{store=\"views\"}";
    let (mut logged, mut derived) = (0, 0);
    for _ in 0..100 {
        logged = metric(&c, &server, journal).await;
        derived = metric(&c, &server, views).await;
        if derived == logged {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert!(logged >= 2, "the log's commits count {logged} entries");
    assert_eq!(derived, logged, "the views' commits");
}

/// A text log written to a file holds no terminal escape sequences (colours), and a
/// warning in it still reads as one: `serve 2> file` is for reading with `less` and
/// `grep`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_text_log_written_to_a_file_carries_no_colour_codes() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path(), &[]);
    let c = client();
    // A refused call logs nothing by itself; a sale does (at info, `nrtxn=info`).
    load(&c, &server, "s", &[("sku", 1)]).await;
    let log = std::fs::read_to_string(server.dir.join("server.log")).unwrap();
    assert!(log.contains(" INFO "), "no info line in the log:\n{log}");
    assert!(
        !log.contains('\u{1b}'),
        "the log holds escape sequences:\n{}",
        log.escape_debug()
    );
}

/// The access lines (`nrtxn::http` at debug) of the server's JSON log, in order: each
/// line of the log must be a JSON object.
fn access_lines(server: &Server) -> Vec<Value> {
    let log = std::fs::read_to_string(server.dir.join("server.log")).unwrap();
    log.lines()
        .map(|l| {
            serde_json::from_str::<Value>(l)
                .unwrap_or_else(|e| panic!("a log line that is not JSON ({e}): {l}"))
        })
        .filter(|v| v["target"] == "nrtxn::http")
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_log_lines_carry_the_request_span_with_its_route_and_key() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_env(
        dir.path(),
        &["--log-format", "json"],
        &[("RUST_LOG", "warn,nrtxn::http=debug")],
    );
    let c = client();
    load(&c, &server, "s1", &[("sku-1", 5)]).await;
    let base = server.url("/v1/shops/s1");
    let with_id = json!({ "seller": "a", "item": "sku-1", "qty": 1, "request_id": "o-1" });
    assert_eq!(post(&c, &format!("{base}/txns"), with_id).await.0, 200);
    assert_eq!(
        post(&c, &format!("{base}/txns"), txn("a", "sku-1", 1, 7))
            .await
            .0,
        200
    );
    let hold = json!({ "item": "sku-1", "qty": 1, "ttl_ms": 60000, "request_id": "h 1" });
    assert_eq!(post(&c, &format!("{base}/holds"), hold).await.0, 200);
    // A path key, %-escaped: the span carries it decoded.
    assert_eq!(get(&c, &format!("{base}/holds/h%201")).await.0, 200);
    assert_eq!(get(&c, &format!("{base}/items/sku-1")).await.0, 200);
    assert_eq!(get(&c, &server.url("/nowhere/s1")).await.0, 404);

    // Each access line is written when its answer is: wait for the last one.
    let mut lines = Vec::new();
    for _ in 0..100 {
        lines = access_lines(&server);
        if lines.len() >= 7 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    let spans: Vec<(&str, &str, &str, &str, &str, u64)> = lines
        .iter()
        .map(|l| {
            assert_eq!(l["message"], "answered", "{l}");
            assert_eq!(l["level"], "DEBUG", "{l}");
            assert!(l["timestamp"].is_string(), "{l}");
            assert!(l["elapsed_us"].is_u64(), "{l}");
            let s = &l["span"];
            assert_eq!(s["name"], "request", "{l}");
            let f = |k: &str| s[k].as_str().unwrap_or("-");
            (
                f("method"),
                f("route"),
                f("shop"),
                f("item"),
                f("request_key"),
                l["status"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        spans,
        vec![
            ("PUT", "/v1/shops/{shop}/items", "s1", "-", "-", 200),
            ("POST", "/v1/shops/{shop}/txns", "s1", "-", "o-1", 200),
            ("POST", "/v1/shops/{shop}/txns", "s1", "-", "a:sku-1:7", 200),
            ("POST", "/v1/shops/{shop}/holds", "s1", "-", "h 1", 200),
            (
                "GET",
                "/v1/shops/{shop}/holds/{hold_id}",
                "s1",
                "-",
                "h 1",
                200
            ),
            (
                "GET",
                "/v1/shops/{shop}/items/{item}",
                "s1",
                "sku-1",
                "-",
                200
            ),
            ("GET", "unmatched", "-", "-", "-", 404),
        ]
    );
}

#[tokio::test]
async fn an_unknown_field_anywhere_in_a_body_is_refused_naming_it_and_nothing_applies() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path(), &[]);
    let c = client();
    load(&c, &server, "s", &[("x", 100)]).await;
    let (code, sale) = post(
        &c,
        &server.url("/v1/shops/s/txns"),
        json!({"seller": "a", "item": "x", "qty": 30, "request_id": "sale-1"}),
    )
    .await;
    assert_eq!((code, &sale["status"]), (200, &json!("ok")), "{sale}");
    // A misspelt guard (`if_sq` for `if_seq`) must not load 100 unguarded.
    let (code, body) = call(
        &c,
        reqwest::Method::PUT,
        &server.url("/v1/shops/s/items"),
        Some(json!({"items": [{"item": "x", "stock": 100, "if_sq": 1}]}).to_string()),
    )
    .await;
    assert_eq!(code, 400, "{body}");
    let detail = body["detail"].as_str().unwrap();
    assert!(
        detail.starts_with("items[0].if_sq: unknown field") && detail.contains("if_seq"),
        "{detail}"
    );
    let (_, item) = get(&c, &server.url("/v1/shops/s/items/x")).await;
    assert_eq!(item["stock"], 70, "the load was not applied: {item}");

    for (path, body, named) in [
        (
            "/v1/shops/s/txns",
            json!({"seller": "a", "item": "x", "qty": 1, "request_id": "k-1", "quantity": 5}),
            "quantity: unknown field",
        ),
        (
            "/v1/shops/s/txns/batch",
            json!({"txns": [
                {"seller": "a", "item": "x", "qty": 1, "request_id": "k-2"},
                {"seller": "a", "item": "x", "qty": 1, "request_id": "k-3", "respnd": false},
            ]}),
            "txns[1].respnd: unknown field",
        ),
        (
            "/v1/shops/s/holds",
            json!({"item": "x", "qty": 1, "ttl_ms": 1000, "request_id": "h-1", "ttl": 5}),
            "ttl: unknown field",
        ),
        (
            "/v1/shops/s/orders",
            json!({"order_id": "o-1", "ttl_ms": 1000, "lines": [{"item": "x", "qty": 1, "sku": "y"}]}),
            "lines[0].sku: unknown field",
        ),
    ] {
        let (code, answer) = post(&c, &server.url(path), body).await;
        assert_eq!(code, 400, "{path}: {answer}");
        let detail = answer["detail"].as_str().unwrap();
        assert!(detail.starts_with(named), "{path}: {detail}");
    }
    let (_, item) = get(&c, &server.url("/v1/shops/s/items/x")).await;
    assert_eq!(
        (&item["stock"], &item["reserved"]),
        (&json!(70), &json!(0)),
        "nothing of the refused bodies was applied: {item}"
    );
}

#[tokio::test]
async fn a_body_in_a_charset_other_than_utf_8_is_415_and_answers_are_json() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path(), &[]);
    let c = client();
    load(&c, &server, "s", &[("x", 10)]).await;
    let body = json!({"seller": "a", "item": "x", "qty": 1, "request_id": "k"}).to_string();
    for (content_type, status) in [
        ("application/json; charset=latin1", 415),
        ("application/json; charset=\"ISO-8859-1\"", 415),
        ("application/json;charset=UTF-8", 200),
        ("application/json; charset=utf-8", 200),
        ("Application/JSON", 200),
    ] {
        let res = c
            .post(server.url("/v1/shops/s/txns"))
            .header("content-type", content_type)
            .body(body.clone())
            .send()
            .await
            .unwrap();
        assert_eq!(res.status().as_u16(), status, "{content_type}");
        if status == 200 {
            assert_eq!(res.headers()["content-type"], "application/json");
            let outcome: Value = res.json().await.unwrap();
            assert_eq!(outcome["request_key"], "k", "{outcome}");
        }
    }
    let poll = c
        .get(server.url("/v1/shops/s/txns/k"))
        .send()
        .await
        .unwrap();
    assert_eq!(poll.status().as_u16(), 200);
    assert_eq!(poll.headers()["content-type"], "application/json");
    let (_, item) = get(&c, &server.url("/v1/shops/s/items/x")).await;
    assert_eq!(
        item["stock"], 9,
        "one sale, sent twice with the same key: {item}"
    );
}
