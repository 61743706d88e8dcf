//! Transfers between two items of a shop, against the real binary: both sides or
//! neither, once per request_id, each side an event of its item naming the transfer,
//! and after a SIGKILL in the middle of many, every one is finished or undone by its
//! hold's timer with no unit made or lost.

mod common;

use std::time::{Duration, Instant};

use common::holds::{events, item_state};
use common::*;
use serde_json::{json, Value};

async fn transfer(c: &reqwest::Client, server: &Server, body: Value) -> (u16, Value) {
    post(c, &server.url("/v1/shops/s/transfers"), body).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transfer_moves_stock_both_sides_or_neither_once_per_request_id() {
    let dir = tempfile::tempdir().unwrap();
    let mut server = Server::start(dir.path(), &[]);
    let c = client();
    // `a` is outside its sale window and has a buyer's limit: neither binds an
    // operator's transfer.
    let opens = holds::now_ms() + 3_600_000;
    let load = json!({"items": [{"item": "a", "stock": 10, "opens_at": opens, "per_buyer_max": 1},
                                {"item": "b", "stock": 0}]});
    let url = server.url("/v1/shops/s/items");
    assert_eq!(
        call(&c, reqwest::Method::PUT, &url, Some(load.to_string()))
            .await
            .0,
        200
    );

    let t1 = json!({"request_id": "t1", "from": "a", "to": "b", "qty": 4, "reason": "rebalance"});
    let (status, first) = transfer(&c, &server, t1.clone()).await;
    assert_eq!((status, &first["status"]), (200, &json!("ok")), "{first}");
    assert_eq!(
        (&first["from"], &first["to"], &first["qty"]),
        (&json!("a"), &json!("b"), &json!(4))
    );
    assert_eq!(item_state(&c, &server, "s", "a").await, (6, 0));
    assert_eq!(item_state(&c, &server, "s", "b").await, (4, 0));
    // Each side is an event of its item naming the transfer.
    let named = |evs: &[Value]| -> Vec<String> {
        evs.iter()
            .filter(|e| e["transfer_id"] == "t1")
            .map(|e| e["kind"].as_str().unwrap().to_string())
            .collect()
    };
    assert_eq!(
        named(&events(&c, &server, "s", "a", 100).await),
        ["hold", "confirm"]
    );
    assert_eq!(
        named(&events(&c, &server, "s", "b", 100).await),
        ["increment"]
    );

    // Again: the same answer, nothing moved; another transfer under its id: 409.
    assert_eq!(transfer(&c, &server, t1).await, (200, first.clone()));
    assert_eq!(item_state(&c, &server, "s", "a").await, (6, 0));
    let other = json!({"request_id": "t1", "from": "a", "to": "b", "qty": 5});
    let (status, reused) = transfer(&c, &server, other).await;
    assert_eq!(
        (status, &reused["error"]),
        (409, &json!("key_reused")),
        "{reused}"
    );

    // Ids that end like another transfer's keys are transfers of their own.
    for id in ["y:in", "y"] {
        let body = json!({"request_id": id, "from": "a", "to": "b", "qty": 1});
        let (status, t) = transfer(&c, &server, body).await;
        assert_eq!(
            (status, &t["status"], &t["to_seq"].is_u64()),
            (200, &json!("ok"), &true),
            "{id}: {t}"
        );
    }
    assert_eq!(item_state(&c, &server, "s", "a").await, (4, 0));
    assert_eq!(item_state(&c, &server, "s", "b").await, (6, 0));
    let reload = json!({"items": [{"item": "a", "stock": 6}, {"item": "b", "stock": 4}]});
    assert_eq!(
        call(&c, reqwest::Method::PUT, &url, Some(reload.to_string()))
            .await
            .0,
        200
    );

    // Too much: nothing moves. An unknown `to`: the hold on `from` is released.
    let (status, short) = transfer(
        &c,
        &server,
        json!({"request_id": "t2", "from": "a", "to": "b", "qty": 7}),
    )
    .await;
    assert_eq!(
        (status, &short["status"]),
        (200, &json!("insufficient_stock")),
        "{short}"
    );
    let (status, nowhere) = transfer(
        &c,
        &server,
        json!({"request_id": "t3", "from": "a", "to": "nope", "qty": 1}),
    )
    .await;
    assert_eq!(
        (status, &nowhere["status"]),
        (200, &json!("unknown_item")),
        "{nowhere}"
    );
    assert_eq!(item_state(&c, &server, "s", "a").await, (6, 0));

    // Read back, also after a SIGKILL.
    for _ in 0..2 {
        let (status, read) = get(&c, &server.url("/v1/shops/s/transfers/t1")).await;
        assert_eq!((status, &read), (200, &first));
        let (status, read) = get(&c, &server.url("/v1/shops/s/transfers/t3")).await;
        assert_eq!(
            (status, &read["status"]),
            (200, &json!("unknown_item")),
            "{read}"
        );
        let (status, read) = get(&c, &server.url("/v1/shops/s/transfers/t2")).await;
        assert_eq!(
            (status, &read["status"], &read["to"]),
            (200, &json!("insufficient_stock"), &Value::Null),
            "refused at its source: no `to` recorded: {read}"
        );
        server.kill();
        server = Server::start(dir.path(), &[]);
    }
    assert_eq!(
        get(&c, &server.url("/v1/shops/s/transfers/t9")).await.0,
        404
    );
    for (body, field) in [
        (json!({"from": "a", "to": "b", "qty": 1}), "request_id:"),
        (
            json!({"request_id": "x", "from": "a", "to": "a", "qty": 1}),
            "to:",
        ),
        (
            json!({"request_id": "x", "from": "a", "to": "b", "qty": 0}),
            "qty:",
        ),
        (
            json!({"request_id": "x", "from": "a", "to": "b", "qty": 1, "reason": "Bad!"}),
            "reason:",
        ),
        (
            json!({"request_id": "x", "from": "a", "to": "b", "qty": 1, "color": 1}),
            "color:",
        ),
    ] {
        let (status, bad) = transfer(&c, &server, body.clone()).await;
        assert_eq!(status, 400, "{body}: {bad}");
        assert!(
            bad["detail"].as_str().unwrap().starts_with(field),
            "{body}: {bad}"
        );
    }
}

/// Many transfers both ways at once, cut by a SIGKILL: after the restart, every one
/// that was begun is finished or undone (its hold's timer settles it, 30 s on), and the
/// two items hold exactly the units they started with, none reserved.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transfers_cut_by_a_sigkill_are_settled_with_no_unit_made_or_lost() {
    let dir = tempfile::tempdir().unwrap();
    let mut server = Server::start(dir.path(), &[]);
    let c = client();
    load(&c, &server, "s", &[("a", 100), ("b", 100)]).await;
    let url = server.url("/v1/shops/s/transfers");
    let calls: Vec<_> = (0..300)
        .map(|i| {
            let (c, url) = (c.clone(), url.clone());
            let (from, to) = if i % 2 == 0 { ("a", "b") } else { ("b", "a") };
            let body =
                json!({"request_id": format!("t{i}"), "from": from, "to": to, "qty": 1 + i % 5});
            tokio::spawn(async move { c.post(url).json(&body).send().await.map(|r| r.status()) })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(150)).await;
    server.kill();
    for call in calls {
        let _ = call.await;
    }
    server = Server::start(dir.path(), &[]);
    let until = Instant::now() + Duration::from_secs(90);
    loop {
        let mut pending = 0;
        for i in 0..300 {
            let (status, t) = get(&c, &server.url(&format!("/v1/shops/s/transfers/t{i}"))).await;
            match (status, t["status"].as_str()) {
                (404, _) => {}
                (_, Some("pending")) => pending += 1,
                (200, Some("ok" | "insufficient_stock")) => {}
                other => panic!("t{i}: {other:?} {t}"),
            }
        }
        if pending == 0 {
            break;
        }
        assert!(Instant::now() < until, "{pending} transfers still pending");
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    let (a, b) = (
        item_state(&c, &server, "s", "a").await,
        item_state(&c, &server, "s", "b").await,
    );
    assert_eq!((a.0 + b.0, a.1, b.1), (200, 0, 0), "a {a:?} b {b:?}");
}
