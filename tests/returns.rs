//! Returns: a seller cannot create stock. A seller key's increment must name
//! the sale it returns (`return_of`), and may give back at most what that sale sold
//! less what was returned against it already, across restarts; through the real binary,
//! on the embedded journal and on Kafka + MongoDB.

mod common;

use std::path::Path;

use common::*;
use reqwest::Method;
use serde_json::{json, Value};

/// A new key of `role` for shop `shop` in the data dir `Server::start(dir, ..)` uses.
fn create_key(dir: &Path, shop: &str, role: &str) -> String {
    create_key_in(&dir.join("data"), Some(shop), role)
}

/// One call with an optional key: status and JSON body.
async fn send(
    c: &reqwest::Client,
    method: Method,
    url: &str,
    key: Option<&str>,
    body: Option<Value>,
) -> (u16, Value) {
    let mut req = c.request(method, url);
    if let Some(key) = key {
        req = req.bearer_auth(key);
    }
    if let Some(body) = body {
        req = req.json(&body);
    }
    let res = req.send().await.expect("request");
    let status = res.status().as_u16();
    let text = res.text().await.expect("body");
    (status, serde_json::from_str(&text).unwrap_or(Value::Null))
}

/// A transaction of `qty` of item `item` in shop `s` under `key`: a sale, or with
/// `return_of` an increment that returns that sale.
fn txn(key: &str, item: &str, qty: i64, return_of: Option<&str>) -> Value {
    let mut body = json!({"seller": "sel", "item": item, "qty": qty, "request_id": key});
    if let Some(sale) = return_of {
        body["op"] = json!("increment");
        body["return_of"] = json!(sale);
    }
    body
}

async fn post_txn(
    c: &reqwest::Client,
    server: &Server,
    key: Option<&str>,
    body: Value,
) -> (u16, Value) {
    send(
        c,
        Method::POST,
        &server.url("/v1/shops/s/txns"),
        key,
        Some(body),
    )
    .await
}

async fn stock(c: &reqwest::Client, server: &Server, key: Option<&str>, item: &str) -> i64 {
    let (status, body) = send(
        c,
        Method::GET,
        &server.url(&format!("/v1/shops/s/items/{item}")),
        key,
        None,
    )
    .await;
    assert_eq!(status, 200, "{body}");
    body["stock"].as_i64().expect("stock")
}

/// Asserts an answer is a refused return that says `why`.
fn assert_refused(status: u16, body: &Value, why: &str) {
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["status"], "return_refused", "{body}");
    let reason = body["reason"].as_str().unwrap_or_default();
    assert!(
        reason.contains(why),
        "reason {reason:?} does not say {why:?}"
    );
    assert_eq!(body["stock_before"], body["stock_after"], "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_seller_key_adds_stock_only_by_returning_what_a_sale_sold() {
    let dir = tempfile::tempdir().unwrap();
    let seller = create_key(dir.path(), "s", "seller");
    let operator = create_key(dir.path(), "s", "operator");
    let (sk, ok) = (Some(seller.as_str()), Some(operator.as_str()));
    let mut server = Server::start(dir.path(), &[]);
    let c = client();
    let (status, body) = send(
        &c,
        Method::PUT,
        &server.url("/v1/shops/s/items"),
        ok,
        Some(json!({"items": [{"item": "a", "stock": 10}, {"item": "b", "stock": 10}]})),
    )
    .await;
    assert_eq!(status, 200, "{body}");

    // A seller's free increment is refused, saying why; nothing changes.
    let free = json!({"seller": "sel", "item": "a", "qty": 1000, "op": "increment",
        "request_id": "free-1"});
    let (status, body) = post_txn(&c, &server, sk, free.clone()).await;
    assert_eq!(status, 403, "{body}");
    assert_eq!(body["error"], "forbidden", "{body}");
    let detail = body["detail"].as_str().unwrap();
    assert!(
        detail.contains("return_of") && detail.contains("seller"),
        "{detail}"
    );
    assert_eq!(stock(&c, &server, sk, "a").await, 10);

    // A sale of 5, then its return: 3 back, then the other 2; a third is refused.
    let (status, body) = post_txn(&c, &server, sk, txn("sale-1", "a", 5, None)).await;
    assert_eq!((status, &body["status"]), (200, &json!("ok")), "{body}");
    let (status, body) = post_txn(&c, &server, sk, txn("ret-1", "a", 3, Some("sale-1"))).await;
    assert_eq!((status, &body["status"]), (200, &json!("ok")), "{body}");
    assert_eq!(stock(&c, &server, sk, "a").await, 8, "stock back");
    let (status, body) = post_txn(&c, &server, sk, txn("ret-2", "a", 3, Some("sale-1"))).await;
    assert_refused(status, &body, "2 left to return, 3 asked");
    assert_eq!(stock(&c, &server, sk, "a").await, 8, "stock unchanged");
    // A refused return is journaled like any refusal: its key answers it again.
    let (status, again) = send(
        &c,
        Method::GET,
        &server.url("/v1/shops/s/txns/ret-2"),
        sk,
        None,
    )
    .await;
    assert_eq!(
        (status, &again["status"]),
        (200, &json!("return_refused")),
        "{again}"
    );

    // Unknown sales, sales that were refused, and other items' sales give nothing back.
    let (status, body) =
        post_txn(&c, &server, sk, txn("ret-3", "a", 1, Some("no-such-sale"))).await;
    assert_refused(status, &body, "no sale no-such-sale");
    let (status, body) = post_txn(&c, &server, sk, txn("sale-big", "a", 100, None)).await;
    assert_eq!(body["status"], "insufficient_stock", "{status} {body}");
    let (status, body) = post_txn(&c, &server, sk, txn("ret-4", "a", 1, Some("sale-big"))).await;
    assert_refused(status, &body, "insufficient_stock");
    let (status, body) = post_txn(&c, &server, sk, txn("sale-b", "b", 4, None)).await;
    assert_eq!((status, &body["status"]), (200, &json!("ok")), "{body}");
    let (status, body) = post_txn(&c, &server, sk, txn("ret-5", "a", 1, Some("sale-b"))).await;
    assert_refused(status, &body, "sold item b, not a");
    assert_eq!(stock(&c, &server, sk, "a").await, 8);

    // `return_of` belongs to increments: on a decrement it is a 400 naming it.
    let mut bad = txn("bad-1", "a", 1, Some("sale-b"));
    bad["op"] = json!("decrement");
    let (status, body) = post_txn(&c, &server, sk, bad).await;
    assert_eq!(status, 400, "{body}");
    assert!(
        body["detail"].as_str().unwrap().starts_with("return_of:"),
        "{body}"
    );
    let (status, body) = post_txn(&c, &server, sk, txn("bad-2", "a", 1, Some("~end:x"))).await;
    assert_eq!(status, 400, "{body}");

    // An operator's increment stays free.
    let (status, body) = post_txn(&c, &server, ok, free.clone()).await;
    assert_eq!((status, &body["status"]), (200, &json!("ok")), "{body}");
    assert_eq!(stock(&c, &server, ok, "a").await, 1008);

    // The batch route: a seller's free increment fails the whole call, naming the entry;
    // a batch of returns is decided entry by entry (4 of sale-b: 3, then 2 refused).
    let batch = |txns: Vec<Value>| Some(json!({ "txns": txns }));
    let url = server.url("/v1/shops/s/txns/batch");
    let mut free_b = free.clone();
    free_b["request_id"] = json!("free-2");
    let (status, body) = send(
        &c,
        Method::POST,
        &url,
        sk,
        batch(vec![txn("sale-2", "a", 1, None), free_b]),
    )
    .await;
    assert_eq!(status, 403, "{body}");
    assert!(
        body["detail"]
            .as_str()
            .unwrap()
            .starts_with("txns[1].return_of"),
        "{body}"
    );
    let (status, body) = send(
        &c,
        Method::POST,
        &url,
        sk,
        batch(vec![
            txn("ret-b1", "b", 3, Some("sale-b")),
            txn("ret-b2", "b", 2, Some("sale-b")),
        ]),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["results"][0]["status"], "ok", "{body}");
    assert_eq!(body["results"][1]["status"], "return_refused", "{body}");
    assert_eq!(stock(&c, &server, sk, "b").await, 9);
    // A return in the same drain as its sale: returns go first in the mailbox, so the
    // sale is not yet decided, and the return is refused.
    let (status, body) = send(
        &c,
        Method::POST,
        &url,
        sk,
        batch(vec![
            txn("sale-3", "b", 1, None),
            txn("ret-b3", "b", 1, Some("sale-3")),
        ]),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["results"][0]["status"], "ok", "{body}");
    assert_eq!(body["results"][1]["status"], "return_refused", "{body}");
    assert!(
        body["results"][1]["reason"]
            .as_str()
            .unwrap()
            .contains("not yet decided"),
        "{body}"
    );
    assert_eq!(stock(&c, &server, sk, "b").await, 8);

    // The returned units survive a restart: 2 of sale-1 and 1 of sale-b are left.
    assert!(server.terminate().success());
    let server = Server::start(dir.path(), &[]);
    let (status, body) = post_txn(&c, &server, sk, txn("ret-6", "a", 3, Some("sale-1"))).await;
    assert_refused(status, &body, "2 left to return, 3 asked");
    let (status, body) = post_txn(&c, &server, sk, txn("ret-7", "b", 2, Some("sale-b"))).await;
    assert_refused(status, &body, "1 left to return, 2 asked");
    let (status, body) = post_txn(&c, &server, sk, txn("ret-8", "a", 2, Some("sale-1"))).await;
    assert_eq!((status, &body["status"]), (200, &json!("ok")), "{body}");
    assert_eq!(stock(&c, &server, sk, "a").await, 1010);
    let (status, body) = post_txn(&c, &server, sk, txn("ret-9", "a", 1, Some("sale-1"))).await;
    assert_refused(status, &body, "0 left to return, 1 asked");
}

/// The same rule on the shared journal: Kafka carries the returns to the item's owner,
/// which reads the sale and its returns from MongoDB.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn returns_through_kafka_and_mongo_are_bounded_by_the_sale() {
    let (Some(flags), Some(uri)) = (kafka_flags("returns"), mongo_uri("returns")) else {
        return;
    };
    let mut flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    flags.extend(["--mongo-uri", uri.as_str()]);
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path(), &flags);
    let c = client();
    wait_ready(&c, &server).await;
    load(&c, &server, "s", &[("a", 10)]).await;
    // Keyless: increments are free, but a return is still held to its sale.
    let (status, body) = post_txn(&c, &server, None, txn("sale-1", "a", 5, None)).await;
    assert_eq!((status, &body["status"]), (200, &json!("ok")), "{body}");
    let (status, body) = post_txn(&c, &server, None, txn("ret-1", "a", 4, Some("sale-1"))).await;
    assert_eq!((status, &body["status"]), (200, &json!("ok")), "{body}");
    let (status, body) = post_txn(&c, &server, None, txn("ret-2", "a", 2, Some("sale-1"))).await;
    assert_refused(status, &body, "1 left to return, 2 asked");
    let (status, body) = post_txn(&c, &server, None, txn("ret-3", "a", 1, Some("nope"))).await;
    assert_refused(status, &body, "no sale nope");
    let (status, body) = post_txn(&c, &server, None, txn("ret-4", "a", 1, Some("sale-1"))).await;
    assert_eq!((status, &body["status"]), (200, &json!("ok")), "{body}");
    assert_eq!(stock(&c, &server, None, "a").await, 10);
    drop(server);
    drop_database(&uri).await;
}

/// A sale stays returnable after its key leaves the embedded journal's key window (here
/// 1 s): the views keep the sales they prune, and their returned units, for the return
/// window.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sale_stays_returnable_after_its_key_is_forgotten() {
    let dir = tempfile::tempdir().unwrap();
    let flags = ["--key-window-secs", "1"];
    let mut server = Server::start(dir.path(), &flags);
    let c = client();
    load(&c, &server, "s", &[("a", 10)]).await;
    let (status, body) = post_txn(&c, &server, None, txn("sale-1", "a", 5, None)).await;
    assert_eq!((status, &body["status"]), (200, &json!("ok")), "{body}");
    let (status, body) = post_txn(&c, &server, None, txn("ret-1", "a", 2, Some("sale-1"))).await;
    assert_eq!((status, &body["status"]), (200, &json!("ok")), "{body}");
    // A restart writes the snapshot that lets the entries be pruned.
    assert!(server.terminate().success());
    let server = Server::start(dir.path(), &flags);
    let forgotten = std::time::Instant::now();
    loop {
        let (status, _) = get(&c, &server.url("/v1/shops/s/txns/sale-1")).await;
        if status == 404 {
            break;
        }
        assert!(
            forgotten.elapsed() < std::time::Duration::from_secs(20),
            "sale-1 was never pruned"
        );
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    let (status, body) = post_txn(&c, &server, None, txn("ret-2", "a", 4, Some("sale-1"))).await;
    assert_refused(status, &body, "3 left to return, 4 asked");
    let (status, body) = post_txn(&c, &server, None, txn("ret-3", "a", 3, Some("sale-1"))).await;
    assert_eq!((status, &body["status"]), (200, &json!("ok")), "{body}");
    let (status, body) = post_txn(&c, &server, None, txn("ret-4", "a", 1, Some("sale-1"))).await;
    assert_refused(status, &body, "0 left to return, 1 asked");
    assert_eq!(stock(&c, &server, None, "a").await, 10);
    // The command line client names the sale too, and says when a return is refused.
    let out = nrtxn(&[
        "txn",
        "submit",
        "--item",
        "a",
        "--qty",
        "1",
        "--op",
        "increment",
        "--return-of",
        "sale-1",
        "--request-id",
        "ret-5",
        "--url",
        &server.base,
        "--shop",
        "s",
    ]);
    assert!(!out.status.success(), "{out:?}");
    let outcome: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(outcome["status"], "return_refused", "{outcome}");
}

/// Returns of one sale decided while earlier ones are still being written (concurrent
/// callers: batches overlap in flight) never give back more than the sale sold.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_returns_never_pass_what_the_sale_sold() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path(), &[]);
    let c = client();
    load(&c, &server, "s", &[("a", 100)]).await;
    let (status, body) = post_txn(&c, &server, None, txn("sale-1", "a", 40, None)).await;
    assert_eq!((status, &body["status"]), (200, &json!("ok")), "{body}");
    let calls = (0..100).map(|i| {
        let (c, server) = (c.clone(), &server);
        async move {
            let (status, body) = post_txn(
                &c,
                server,
                None,
                txn(&format!("r{i}"), "a", 1, Some("sale-1")),
            )
            .await;
            assert_eq!(status, 200, "{body}");
            body["status"].as_str().unwrap().to_string()
        }
    });
    let statuses = futures::future::join_all(calls).await;
    let ok = statuses.iter().filter(|s| *s == "ok").count();
    let refused = statuses.iter().filter(|s| *s == "return_refused").count();
    assert_eq!((ok, refused), (40, 60), "{statuses:?}");
    assert_eq!(stock(&c, &server, None, "a").await, 100);
}
