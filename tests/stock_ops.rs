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
