//! Holds and the event stream over HTTP, shared by the tests of every journal.

use std::time::Duration;

use serde_json::{json, Value};

use super::*;

pub fn holds_url(server: &Server, shop: &str, rest: &str) -> String {
    server.url(&format!("/v1/shops/{shop}/holds{rest}"))
}

pub async fn hold(
    client: &reqwest::Client,
    server: &Server,
    shop: &str,
    id: &str,
    item: &str,
    qty: i64,
    ttl_ms: i64,
) -> (u16, Value) {
    post(
        client,
        &holds_url(server, shop, ""),
        json!({"item": item, "qty": qty, "ttl_ms": ttl_ms, "request_id": id}),
    )
    .await
}

pub async fn item_state(
    client: &reqwest::Client,
    server: &Server,
    shop: &str,
    item: &str,
) -> (i64, i64) {
    let (status, body) = get(
        client,
        &server.url(&format!("/v1/shops/{shop}/items/{item}")),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    (
        body["stock"].as_i64().unwrap(),
        body["reserved"].as_i64().unwrap(),
    )
}

/// Every event of an item, read page by page (`limit` events a page).
pub async fn events(
    client: &reqwest::Client,
    server: &Server,
    shop: &str,
    item: &str,
    limit: usize,
) -> Vec<Value> {
    let mut out: Vec<Value> = Vec::new();
    loop {
        let after = out.last().map_or(0, |e| e["seq"].as_u64().unwrap());
        let url = server.url(&format!(
            "/v1/shops/{shop}/items/{item}/events?after={after}&limit={limit}"
        ));
        let (status, body) = get(client, &url).await;
        assert_eq!(status, 200, "{body}");
        let page = body["events"].as_array().unwrap().clone();
        assert!(page.len() <= limit);
        if page.is_empty() {
            return out;
        }
        out.extend(page);
    }
}

/// Waits until a hold leaves `held`, for up to 10 s, and returns its last view.
pub async fn wait_ended(client: &reqwest::Client, server: &Server, shop: &str, id: &str) -> Value {
    for _ in 0..1000 {
        let (status, body) = get(client, &holds_url(server, shop, &format!("/{id}"))).await;
        assert_eq!(status, 200, "{body}");
        if body["status"] != "held" {
            return body;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("hold {id} still held after 10 s");
}

/// The `at` of the event that ended hold `id`, minus the hold's `expires_at`.
pub fn lateness_ms(events: &[Value], id: &str, expires_at: i64) -> i64 {
    let end = events
        .iter()
        .find(|e| e["hold_id"] == id && e["kind"] == "expire")
        .unwrap_or_else(|| panic!("no expire event for {id}"));
    end["at"].as_i64().unwrap() - expires_at
}

/// The wall clock in ms since the epoch, as the server stamps it.
pub fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64
}

/// Waits until an item's durable state is `expected`, for up to 5 s. A hold's state is
/// read from the store, an item's from its processor, which learns that a write is
/// durable a moment after the store has it: right after a hold ends, the item may show
/// the state before it for that moment.
pub async fn wait_item_state(
    client: &reqwest::Client,
    server: &Server,
    shop: &str,
    item: &str,
    expected: (i64, i64),
) {
    let mut last = (0, 0);
    for _ in 0..500 {
        last = item_state(client, server, shop, item).await;
        if last == expected {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("{shop}/{item} is {last:?}, not {expected:?}, after 5 s");
}

/// Starts a server on `dir` with `flags`, loads items `a` and `b` of shop `s` (10 each),
/// places order `o1` (1 of `a`, 2 of `b`, held 10 minutes) and kills the server: a data
/// dir with one held order, for a start with faults.
pub async fn held_order_then_killed(dir: &std::path::Path, flags: &[&str]) {
    let mut server = Server::start(dir, flags);
    let c = client();
    load(&c, &server, "s", &[("a", 10), ("b", 10)]).await;
    let order = json!({"order_id": "o1", "ttl_ms": 600_000,
                       "lines": [{"item": "a", "qty": 1}, {"item": "b", "qty": 2}]});
    let (status, o) = post(&c, &server.url("/v1/shops/s/orders"), order).await;
    assert_eq!((status, &o["status"]), (200, &json!("held")), "{o}");
    server.kill();
}
