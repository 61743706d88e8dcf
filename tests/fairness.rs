//! One shop cannot starve the others, and a revoked key's stream ends (issue 25),
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
    let flags = [
        "--shards",
        "1",
        "--holds-max",
        "100",
        "--holds-per-shop-max",
        "3",
    ];
    let mut server = Server::start(dir.path(), &flags);
    let c = client();
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
    assert!(server.terminate().success());
    let server = Server::start(dir.path(), &flags);
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
