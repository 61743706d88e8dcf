//! Stock operations an operator can trust during a sale (issue 15), against the real
//! binary: a conditional load applies only while the item is at the seq it was read at.

mod common;

use common::*;
use serde_json::{json, Value};

async fn put_items(c: &reqwest::Client, server: &Server, body: Value) -> (u16, Value) {
    call(
        c,
        reqwest::Method::PUT,
        &server.url("/v1/shops/shop/items"),
        Some(body.to_string()),
    )
    .await
}

async fn item(c: &reqwest::Client, server: &Server, item: &str) -> Value {
    let (status, body) = get(c, &server.url(&format!("/v1/shops/shop/items/{item}"))).await;
    assert_eq!(status, 200, "{body}");
    body
}

/// An operator reads an item at seq N and loads it `if_seq: N`. A sale in between moves
/// the seq: that entry is answered `seq_moved` with the item's state, and the item keeps
/// its stock; the other entries of the call apply. `if_seq: 0` loads only an item not
/// loaded yet. The same holds for a load with a `request_id`, which is answered the
/// same when retried.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conditional_load_applies_only_while_the_item_is_at_the_seq_given() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path(), &[]);
    let c = client();
    load(&c, &server, "shop", &[("hot", 10), ("calm", 10)]).await;
    let read = item(&c, &server, "hot").await;
    assert_eq!(read["seq"], 1);
    // A sale after the operator's read.
    let (status, sold) = post(
        &c,
        &server.url("/v1/shops/shop/txns"),
        json!({"seller": "s", "item": "hot", "qty": 3, "request_id": "sale-1"}),
    )
    .await;
    assert_eq!((status, &sold["status"]), (200, &json!("ok")), "{sold}");

    for request_id in [None, Some("restock-1")] {
        let mut body = json!({"items": [
            {"item": "hot", "stock": 100, "if_seq": 1},
            {"item": "calm", "stock": 50, "if_seq": 1},
            {"item": "fresh", "stock": 5, "if_seq": 0},
        ]});
        if let Some(id) = request_id {
            body["request_id"] = json!(id);
        }
        let (status, answer) = put_items(&c, &server, body.clone()).await;
        assert_eq!(status, 200, "{answer}");
        let items = &answer["items"];
        assert_eq!(
            (&items[0]["status"], &items[0]["stock"], &items[0]["seq"]),
            (&json!("seq_moved"), &json!(7), &json!(2)),
            "{answer}"
        );
        if request_id.is_none() {
            assert_eq!(
                (&items[1]["status"], &items[1]["stock"], &items[1]["seq"]),
                (&json!("ok"), &json!(50), &json!(2)),
                "{answer}"
            );
            assert_eq!(
                (&items[2]["status"], &items[2]["stock"], &items[2]["seq"]),
                (&json!("ok"), &json!(5), &json!(1)),
                "{answer}"
            );
        } else {
            // calm and fresh moved with the first call: their conditions no longer hold.
            assert_eq!(
                (&items[1]["status"], &items[1]["seq"]),
                (&json!("seq_moved"), &json!(2))
            );
            assert_eq!(
                (&items[2]["status"], &items[2]["seq"]),
                (&json!("seq_moved"), &json!(1))
            );
            let (status, again) = put_items(&c, &server, body).await;
            assert_eq!((status, &again), (200, &answer), "a retry answers the same");
        }
        let hot = item(&c, &server, "hot").await;
        assert_eq!(
            (&hot["stock"], &hot["seq"]),
            (&json!(7), &json!(2)),
            "{hot}"
        );
    }
    // A refused condition is no event of the item.
    let (_, events) = get(
        &c,
        &server.url("/v1/shops/shop/items/hot/events?after=0&limit=100"),
    )
    .await;
    let kinds: Vec<&str> = events["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["kind"].as_str().unwrap())
        .collect();
    assert_eq!(kinds, ["load", "decrement"]);
    // With the seq it was just told, the operator's load applies.
    let (status, answer) = put_items(
        &c,
        &server,
        json!({"items": [{"item": "hot", "stock": 100, "if_seq": 2}]}),
    )
    .await;
    assert_eq!(
        (
            status,
            &answer["items"][0]["status"],
            &answer["items"][0]["stock"]
        ),
        (200, &json!("ok"), &json!(100)),
        "{answer}"
    );
    // A bad condition is refused, naming the field.
    for bad in [json!(-1), json!("1"), json!(1.5)] {
        let (status, answer) = put_items(
            &c,
            &server,
            json!({"items": [{"item": "hot", "stock": 1}, {"item": "calm", "stock": 1, "if_seq": bad}]}),
        )
        .await;
        assert_eq!(status, 400, "{answer}");
        assert!(
            answer["detail"]
                .as_str()
                .unwrap_or_default()
                .starts_with("items[1].if_seq"),
            "{answer}"
        );
    }
    assert_eq!(
        item(&c, &server, "hot").await["stock"],
        100,
        "nothing half-applied"
    );
}

async fn adjust(c: &reqwest::Client, server: &Server, adjustments: Value) -> (u16, Value) {
    post(
        c,
        &server.url("/v1/shops/shop/items/adjust"),
        json!({ "adjustments": adjustments }),
    )
    .await
}

/// Relative adjustments with a reason: sequenced and journaled like any change, never
/// below 0, applied at most once by `request_id`, and in the item's events with their
/// reason, also after a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adjustments_change_stock_relatively_with_their_reason_at_most_once() {
    let dir = tempfile::tempdir().unwrap();
    let mut server = Server::start(dir.path(), &[]);
    let c = client();
    load(&c, &server, "shop", &[("hot", 10)]).await;
    let batch = json!([
        {"item": "hot", "delta": -3, "reason": "damage", "request_id": "adj-1"},
        {"item": "hot", "delta": 20, "reason": "restock", "request_id": "adj-2"},
        {"item": "hot", "delta": -100, "reason": "correction", "request_id": "adj-3"},
        {"item": "ghost", "delta": 5, "reason": "shelf-7", "request_id": "adj-4"},
    ]);
    let (status, first) = adjust(&c, &server, batch.clone()).await;
    assert_eq!(status, 200, "{first}");
    let got: Vec<(&Value, &Value, &Value)> = first["results"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| (&r["status"], &r["stock_after"], &r["op"]))
        .collect();
    assert_eq!(
        got,
        [
            (&json!("ok"), &json!(7), &json!("adjust")),
            (&json!("ok"), &json!(27), &json!("adjust")),
            (&json!("insufficient_stock"), &json!(27), &json!("adjust")),
            (&json!("unknown_item"), &Value::Null, &json!("adjust")),
        ],
        "{first}"
    );
    assert_eq!(first["results"][0]["reason"], "damage");
    assert!(
        first["results"][2]["reason"]
            .as_str()
            .unwrap()
            .contains("below 0"),
        "{first}"
    );
    // A retry is answered with the first outcomes, and applies nothing.
    let (status, again) = adjust(&c, &server, batch).await;
    assert_eq!((status, &again), (200, &first));
    assert_eq!(item(&c, &server, "hot").await["stock"], 27);
    // A key used again for another adjustment is refused, not applied.
    let (status, reused) = adjust(
        &c,
        &server,
        json!([{"item": "hot", "delta": -4, "reason": "damage", "request_id": "adj-1"}]),
    )
    .await;
    assert_eq!(
        (status, &reused["results"][0]["error"]),
        (200, &json!("key_reused")),
        "{reused}"
    );
    assert_eq!(item(&c, &server, "hot").await["stock"], 27);
    // Bad adjustments are refused whole, naming the field.
    for (bad, field) in [
        (
            json!({"item": "hot", "delta": 0, "reason": "damage", "request_id": "b"}),
            "delta",
        ),
        (
            json!({"item": "hot", "delta": 1, "reason": "Bad Code", "request_id": "b"}),
            "reason",
        ),
        (
            json!({"item": "hot", "delta": 1, "request_id": "b"}),
            "reason",
        ),
        (
            json!({"item": "hot", "delta": 1, "reason": "restock"}),
            "request_id",
        ),
        (
            json!({"item": "hot", "delta": 1_000_000_001i64, "reason": "restock", "request_id": "b"}),
            "delta",
        ),
    ] {
        let (status, answer) = adjust(
            &c,
            &server,
            json!([{"item": "hot", "delta": 1, "reason": "restock", "request_id": "fine"}, bad]),
        )
        .await;
        assert_eq!(status, 400, "{answer}");
        let detail = answer["detail"].as_str().unwrap_or_default();
        assert!(
            detail.starts_with(&format!("adjustments[1].{field}")),
            "{detail}"
        );
    }
    assert_eq!(
        item(&c, &server, "hot").await["stock"],
        27,
        "nothing half-applied"
    );
    // The events carry the reasons, also once the server has started again.
    assert!(server.terminate().success());
    let server = Server::start(dir.path(), &[]);
    let (_, events) = get(
        &c,
        &server.url("/v1/shops/shop/items/hot/events?after=0&limit=100"),
    )
    .await;
    let seen: Vec<(&Value, &Value, &Value)> = events["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| (&e["kind"], &e["qty"], &e["status"]))
        .collect();
    assert_eq!(
        seen,
        [
            (&json!("load"), &json!(10), &json!("ok")),
            (&json!("adjust"), &json!(-3), &json!("ok")),
            (&json!("adjust"), &json!(20), &json!("ok")),
            (&json!("adjust"), &json!(-100), &json!("insufficient_stock")),
        ],
        "{events}"
    );
    assert_eq!(events["events"][1]["reason"], "damage");
    assert_eq!(events["events"][2]["reason"], "restock");
    assert_eq!(events["events"][0].get("reason"), None);
}
