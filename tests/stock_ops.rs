//! Stock operations an operator can trust during a sale, against the real
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

async fn sale(
    c: &reqwest::Client,
    server: &Server,
    key: &str,
    buyer: Option<&str>,
    qty: i64,
    op: &str,
) -> Value {
    let mut body =
        json!({"seller": "s", "item": "limited", "qty": qty, "request_id": key, "op": op});
    if let Some(b) = buyer {
        body["buyer"] = json!(b);
    }
    let (status, answer) = post(c, &server.url("/v1/shops/shop/txns"), body).await;
    assert_eq!(status, 200, "{answer}");
    answer
}

async fn hold_for(
    c: &reqwest::Client,
    server: &Server,
    key: &str,
    buyer: &str,
    qty: i64,
    ttl_ms: i64,
) -> Value {
    let (status, answer) = post(
        c,
        &server.url("/v1/shops/shop/holds"),
        json!({"item": "limited", "qty": qty, "ttl_ms": ttl_ms, "request_id": key, "buyer": buyer}),
    )
    .await;
    assert_eq!(status, 200, "{answer}");
    answer
}

/// Per-buyer limits: a buyer's sales and pending or confirmed holds, less returns and
/// holds that went back, may not pass the item's `per_buyer_max`; a request without a
/// buyer is refused too. The counts survive a crash (SIGKILL), and a load with 0 lifts
/// the limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_per_buyer_limit_counts_sales_and_holds_and_survives_a_crash() {
    per_buyer_limits(&[], true).await;
}

/// The same on the MongoDB journal, whose ledgers are folded from the item's entries.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_per_buyer_limit_survives_a_crash_on_the_mongodb_journal() {
    let Some(uri) = mongo_uri("per_buyer") else {
        return;
    };
    per_buyer_limits(&["--mongo-uri", &uri], false).await;
    drop_database(&uri).await;
}

/// The per-buyer scenario on a server started with `flags`; `rebuild_views`: also move
/// the embedded journal's views away and check the counts rebuilt from its log.
async fn per_buyer_limits(flags: &[&str], rebuild_views: bool) {
    let dir = tempfile::tempdir().unwrap();
    let mut server = Server::start(dir.path(), flags);
    let c = client();
    let (status, loaded) = put_items(
        &c,
        &server,
        json!({"items": [{"item": "limited", "stock": 100, "per_buyer_max": 3}]}),
    )
    .await;
    assert_eq!(status, 200, "{loaded}");
    let status_of = |v: &Value| v["status"].as_str().unwrap_or_default().to_string();
    assert_eq!(
        status_of(&sale(&c, &server, "a1", Some("ann"), 2, "decrement").await),
        "ok"
    );
    let over = sale(&c, &server, "a2", Some("ann"), 2, "decrement").await;
    assert_eq!(status_of(&over), "buyer_limit", "{over}");
    assert!(over["reason"].as_str().unwrap().contains("has 2"), "{over}");
    assert_eq!(
        status_of(&sale(&c, &server, "a3", Some("ann"), 1, "decrement").await),
        "ok"
    );
    let anonymous = sale(&c, &server, "x1", None, 1, "decrement").await;
    assert_eq!(status_of(&anonymous), "buyer_limit");
    assert!(anonymous["reason"]
        .as_str()
        .unwrap()
        .contains("must name its buyer"));
    // A pending hold counts; once it expires, its units go back.
    assert_eq!(
        status_of(&hold_for(&c, &server, "bh1", "bob", 3, 300).await),
        "held"
    );
    assert_eq!(
        status_of(&sale(&c, &server, "b1", Some("bob"), 1, "decrement").await),
        "buyer_limit"
    );
    let ended = common::holds::wait_ended(&c, &server, "shop", "bh1").await;
    assert_eq!(ended["status"], "expired", "{ended}");
    assert_eq!(
        status_of(&sale(&c, &server, "b2", Some("bob"), 1, "decrement").await),
        "ok"
    );
    // A confirmed hold stays counted, as a sale.
    assert_eq!(
        status_of(&hold_for(&c, &server, "ch1", "cat", 3, 60_000).await),
        "held"
    );
    let (status, _) = post(
        &c,
        &server.url("/v1/shops/shop/holds/ch1/confirm"),
        json!({}),
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(
        status_of(&sale(&c, &server, "c1", Some("cat"), 1, "decrement").await),
        "buyer_limit"
    );
    // A return gives units back.
    assert_eq!(
        status_of(&sale(&c, &server, "a4", Some("ann"), 1, "increment").await),
        "ok"
    );
    // The counts survive a crash: ann has 2, bob 1, cat 3.
    server.kill();
    let mut server = Server::start(dir.path(), flags);
    for (key, buyer, qty, want) in [
        ("a5", "ann", 2, "buyer_limit"),
        ("a6", "ann", 1, "ok"),
        ("b3", "bob", 3, "buyer_limit"),
    ] {
        let answer = sale(&c, &server, key, Some(buyer), qty, "decrement").await;
        assert_eq!(
            status_of(&answer),
            want,
            "{key} after the restart: {answer}"
        );
    }
    // And views rebuilt from the log alone (moved away, as after damage) count the
    // same: the log's entries carry the limit and every buyer, a hold's ending its
    // hold's.
    assert!(server.terminate().success());
    if rebuild_views {
        for f in ["nrtxn.db", "nrtxn.db-wal", "nrtxn.db-shm"] {
            let _ = std::fs::remove_file(dir.path().join("data").join(f));
        }
    }
    let server = Server::start(dir.path(), flags);
    for (key, buyer, qty, want) in [
        ("a7", "ann", 1, "buyer_limit"),
        ("b4", "bob", 2, "ok"),
        ("c2", "cat", 1, "buyer_limit"),
    ] {
        let answer = sale(&c, &server, key, Some(buyer), qty, "decrement").await;
        assert_eq!(
            status_of(&answer),
            want,
            "{key} after the views were rebuilt: {answer}"
        );
    }
    // A limit is not reset by a load that leaves it; 0 lifts it.
    put_items(
        &c,
        &server,
        json!({"items": [{"item": "limited", "stock": 100}]}),
    )
    .await;
    assert_eq!(
        status_of(&sale(&c, &server, "c3", Some("cat"), 1, "decrement").await),
        "buyer_limit"
    );
    put_items(
        &c,
        &server,
        json!({"items": [{"item": "limited", "stock": 100, "per_buyer_max": 0}]}),
    )
    .await;
    assert_eq!(
        status_of(&sale(&c, &server, "c4", Some("cat"), 5, "decrement").await),
        "ok"
    );
    assert_eq!(
        status_of(&sale(&c, &server, "x2", None, 1, "decrement").await),
        "ok"
    );
    // A bad limit names its field.
    let (status, bad) = put_items(
        &c,
        &server,
        json!({"items": [{"item": "limited", "stock": 1, "per_buyer_max": -1}]}),
    )
    .await;
    assert_eq!(status, 400);
    assert!(
        bad["detail"]
            .as_str()
            .unwrap()
            .starts_with("items[0].per_buyer_max"),
        "{bad}"
    );
}

/// Through Kafka with two nodes sharing MongoDB, every stock operation of issue 15 works
/// whichever node is called: a conditional load through node 1 of an item read through
/// node 0, an adjustment and its reason, a per-buyer limit counted across the sales of
/// both nodes, and a check-back set through node 0 deciding a hold made through node 1.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn stock_operations_through_kafka_with_two_nodes() {
    let Some(two) = common::nodes::start_two("stockops").await else {
        return;
    };
    let [n0, n1] = &two.nodes;
    let c = client();
    let (status, loaded) = put_items(
        &c,
        n0,
        json!({"items": [{"item": "hot", "stock": 10},
                         {"item": "limited", "stock": 100, "per_buyer_max": 3}]}),
    )
    .await;
    assert_eq!(status, 200, "{loaded}");
    // Conditional load: read at seq 1, a sale moves it, the load through node 1 is refused.
    let (_, sold) = post(
        &c,
        &n0.url("/v1/shops/shop/txns"),
        json!({"seller": "s", "item": "hot", "qty": 1, "request_id": "sale-1"}),
    )
    .await;
    assert_eq!(sold["status"], "ok", "{sold}");
    let (_, cond) = put_items(
        &c,
        n1,
        json!({"items": [{"item": "hot", "stock": 50, "if_seq": 1}]}),
    )
    .await;
    assert_eq!(
        (&cond["items"][0]["status"], &cond["items"][0]["stock"]),
        (&json!("seq_moved"), &json!(9)),
        "{cond}"
    );
    // Adjustment through node 1, with its reason in the events.
    let (status, adj) = adjust(
        &c,
        n1,
        json!([{"item": "hot", "delta": -2, "reason": "damage", "request_id": "adj-k1"}]),
    )
    .await;
    assert_eq!(
        (status, &adj["results"][0]["stock_after"]),
        (200, &json!(7)),
        "{adj}"
    );
    let (_, events) = get(&c, &n0.url("/v1/shops/shop/items/hot/events?after=2")).await;
    assert_eq!(events["events"][0]["reason"], "damage", "{events}");
    // A buyer's limit counts the sales made through both nodes.
    let mut statuses = Vec::new();
    for (i, node) in [n0, n1, n0, n1].into_iter().enumerate() {
        let s = sale(&c, node, &format!("lim-{i}"), Some("ann"), 1, "decrement").await;
        statuses.push(s["status"].as_str().unwrap().to_string());
    }
    assert_eq!(statuses, ["ok", "ok", "ok", "buyer_limit"]);
    // A check-back set through node 0 decides a hold made through node 1.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}/paid", listener.local_addr().unwrap());
    std::thread::spawn(move || {
        use std::io::{Read, Write};
        for stream in listener.incoming() {
            let Ok(mut s) = stream else { continue };
            let mut buf = [0u8; 4096];
            let _ = s.read(&mut buf);
            let body = r#"{"action":"confirm"}"#;
            let _ = write!(
                s,
                "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            );
        }
    });
    let (status, set) = call(
        &c,
        reqwest::Method::PUT,
        &n0.url("/v1/shops/shop/settings"),
        Some(json!({"check_url": url}).to_string()),
    )
    .await;
    assert_eq!(status, 200, "{set}");
    // Node 1 reads the settings again within 2 s.
    tokio::time::sleep(std::time::Duration::from_millis(2_500)).await;
    let (status, held) = post(
        &c,
        &n1.url("/v1/shops/shop/holds"),
        json!({"item": "hot", "qty": 1, "ttl_ms": 200, "request_id": "pay-1"}),
    )
    .await;
    assert_eq!((status, &held["status"]), (200, &json!("held")), "{held}");
    let mut hold = Value::Null;
    for _ in 0..200 {
        hold = get(&c, &n0.url("/v1/shops/shop/holds/pay-1")).await.1;
        // `checking`: past its expiry, while the shop is asked.
        if hold["status"] != "held" && hold["status"] != "checking" {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert_eq!(hold["status"], "confirmed", "{hold}");
    assert_eq!(item(&c, n0, "hot").await["stock"], 6);
    drop_database(&two.mongo).await;
}

/// Partial fills: a sale or hold with `min_qty` takes as much of its `qty` as is
/// available down to `min_qty`, else is refused as a whole; answers, polls and events
/// carry `qty_taken`; a buyer's limit caps what is taken; a return gives back at most
/// what the sale took; all of it unchanged after a SIGKILL. Bad `min_qty`s are 400s
/// naming the field.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partial_fill_takes_what_is_available_down_to_min_qty() {
    let dir = tempfile::tempdir().unwrap();
    let mut server = Server::start(dir.path(), &[]);
    let c = client();
    let txns = server.url("/v1/shops/shop/txns");
    let (status, _) = put_items(
        &c,
        &server,
        json!({"items": [{"item": "few", "stock": 3}, {"item": "limited", "stock": 100, "per_buyer_max": 4}]}),
    )
    .await;
    assert_eq!(status, 200);
    let ask = |key: &str, item: &str, qty: i64, min: i64| json!({"seller": "s", "buyer": "b", "item": item, "qty": qty, "min_qty": min, "request_id": key});

    // 5 asked, at least 2: the 3 there are taken.
    let (_, part) = post(&c, &txns, ask("p1", "few", 5, 2)).await;
    assert_eq!(
        (
            &part["status"],
            &part["qty"],
            &part["qty_taken"],
            &part["stock_after"]
        ),
        (&json!("ok"), &json!(5), &json!(3), &json!(0)),
        "{part}"
    );
    // Nothing left: below min_qty, refused whole, with the minimum in the reason.
    let (_, none) = post(&c, &txns, ask("p2", "few", 2, 1)).await;
    assert_eq!(
        (&none["status"], &none["qty_taken"]),
        (&json!("insufficient_stock"), &json!(0)),
        "{none}"
    );
    assert!(
        none["reason"].as_str().unwrap().contains("at least 1"),
        "{none}"
    );
    // The same request again is the same answer; a plain sale says qty_taken too.
    assert_eq!(post(&c, &txns, ask("p1", "few", 5, 2)).await.1, part);
    let (_, plain) = post(
        &c,
        &txns,
        json!({"seller": "s", "item": "limited", "qty": 1, "request_id": "n1", "buyer": "c"}),
    )
    .await;
    assert_eq!((&plain["qty"], &plain["qty_taken"]), (&json!(1), &json!(1)));

    // A buyer with 3 of 4 allowed asks for 3, at least 1: takes 1; at least 2: refused.
    sale(&c, &server, "l1", Some("b"), 3, "decrement").await;
    let (_, capped) = post(&c, &txns, ask("l2", "limited", 3, 1)).await;
    assert_eq!(
        (&capped["status"], &capped["qty_taken"]),
        (&json!("ok"), &json!(1)),
        "{capped}"
    );
    let (_, over) = post(&c, &txns, ask("l3", "limited", 3, 1)).await;
    assert_eq!(
        (&over["status"], &over["qty_taken"]),
        (&json!("buyer_limit"), &json!(0)),
        "{over}"
    );

    // A hold takes part too, and holds (and confirms) what it took.
    let holds = server.url("/v1/shops/shop/holds");
    put_items(&c, &server, json!({"items": [{"item": "few", "stock": 2}]})).await;
    let (_, held) = post(
        &c,
        &holds,
        json!({"item": "few", "qty": 4, "min_qty": 2, "ttl_ms": 60000, "request_id": "h1"}),
    )
    .await;
    assert_eq!(
        (&held["status"], &held["qty"], &held["qty_taken"]),
        (&json!("held"), &json!(4), &json!(2)),
        "{held}"
    );
    let (_, hold) = get(&c, &server.url("/v1/shops/shop/holds/h1")).await;
    assert_eq!(hold["qty"], 2, "{hold}");
    let (status, done) = post(
        &c,
        &server.url("/v1/shops/shop/holds/h1/confirm"),
        json!({}),
    )
    .await;
    assert_eq!(
        (status, &done["status"], &done["qty"]),
        (200, &json!("confirmed"), &json!(2)),
        "{done}"
    );
    assert_eq!(item(&c, &server, "few").await["reserved"], 0);

    // A return gives back at most what the sale took: 3 of p1's 5 asked.
    let ret = |key: &str, qty: i64| json!({"seller": "s", "item": "few", "qty": qty, "op": "increment", "request_id": key, "return_of": "p1"});
    assert_eq!(
        post(&c, &txns, ret("r1", 4)).await.1["status"],
        "return_refused"
    );
    assert_eq!(post(&c, &txns, ret("r2", 3)).await.1["status"], "ok");

    // Bad input names the field; nothing is applied.
    for (body, says) in [
        (ask("b1", "few", 2, 0), "min_qty: must be at least 1"),
        (ask("b2", "few", 2, 3), "min_qty: must be at most 2"),
        (
            json!({"seller": "s", "item": "few", "qty": 2, "min_qty": "1", "request_id": "b3"}),
            "min_qty: must be an integer",
        ),
        (
            json!({"seller": "s", "item": "few", "qty": 2, "min_qty": 1, "op": "increment", "request_id": "b4"}),
            "min_qty: only a decrement or a hold",
        ),
    ] {
        let (status, err) = post(&c, &txns, body).await;
        assert_eq!(status, 400, "{err}");
        assert!(
            err["message"].as_str().unwrap_or_default().contains(says)
                || err.to_string().contains(says),
            "{err}"
        );
    }

    // After a SIGKILL, polls and events say the same.
    let events_before = get(&c, &server.url("/v1/shops/shop/items/few/events"))
        .await
        .1;
    server.kill();
    let server = Server::start(dir.path(), &[]);
    let (_, polled) = get(&c, &server.url("/v1/shops/shop/txns/p1")).await;
    assert_eq!(polled, part);
    let (_, polled) = get(&c, &server.url("/v1/shops/shop/txns/l2")).await;
    assert_eq!(polled, capped);
    let events = get(&c, &server.url("/v1/shops/shop/items/few/events"))
        .await
        .1;
    assert_eq!(events, events_before);
    let sold = events["events"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["request_key"] == "p1")
        .unwrap()
        .clone();
    assert_eq!(
        (&sold["qty"], &sold["qty_taken"]),
        (&json!(5), &json!(3)),
        "{sold}"
    );
}

/// Sale windows: a load sets `opens_at` and `closes_at`; a sale, hold or order line
/// decided before `opens_at` is `not_open`, at or after `closes_at` `closed`, with the
/// window in the answer and nothing taken; returns and adjustments are not bound; the
/// item and the listing show the bounds (`null` when unset); a load that leaves them out
/// keeps them, `null` clears one; all of it as it was after a SIGKILL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sale_window_serves_only_between_opens_at_and_closes_at() {
    let dir = tempfile::tempdir().unwrap();
    let mut server = Server::start(dir.path(), &[]);
    let c = client();
    let txns = server.url("/v1/shops/shop/txns");
    let now = common::holds::now_ms();
    let (opens, closes) = (now + 1_500, now + 600_000);
    let (status, loaded) = put_items(
        &c,
        &server,
        json!({"items": [
            {"item": "drop", "stock": 10, "opens_at": opens, "closes_at": closes},
            {"item": "past", "stock": 10, "closes_at": now - 1},
            {"item": "plain", "stock": 10}]}),
    )
    .await;
    assert_eq!(status, 200, "{loaded}");
    assert_eq!(
        (
            &loaded["items"][0]["opens_at"],
            &loaded["items"][2]["opens_at"]
        ),
        (&json!(opens), &Value::Null),
        "{loaded}"
    );
    let sale =
        |key: &str, item: &str| json!({"seller": "s", "item": item, "qty": 1, "request_id": key});

    // Before the opening: refused, the window in the answer, nothing taken.
    let (_, early) = post(&c, &txns, sale("e1", "drop")).await;
    assert_eq!(
        (
            &early["status"],
            &early["opens_at"],
            &early["closes_at"],
            &early["stock_after"]
        ),
        (
            &json!("not_open"),
            &json!(opens),
            &json!(closes),
            &json!(10)
        ),
        "{early}"
    );
    let (_, held) = post(
        &c,
        &server.url("/v1/shops/shop/holds"),
        json!({"item": "drop", "qty": 1, "ttl_ms": 60000, "request_id": "h-early"}),
    )
    .await;
    assert_eq!(held["status"], "not_open", "{held}");
    let (_, order) = post(
        &c,
        &server.url("/v1/shops/shop/orders"),
        json!({"order_id": "o-early", "ttl_ms": 60000, "lines": [{"item": "plain", "qty": 1}, {"item": "drop", "qty": 1}]}),
    )
    .await;
    assert_eq!(
        (&order["status"], &order["failed_line"]),
        (&json!("not_open"), &json!(1)),
        "{order}"
    );
    // After the close: refused as closed; a return and an adjustment still apply.
    let (_, late) = post(&c, &txns, sale("l1", "past")).await;
    assert_eq!(
        (&late["status"], &late["closes_at"]),
        (&json!("closed"), &json!(now - 1)),
        "{late}"
    );
    let (_, adjusted) = call(
        &c,
        reqwest::Method::POST,
        &server.url("/v1/shops/shop/items/adjust"),
        Some(json!({"adjustments": [{"item": "past", "delta": 2, "reason": "restock", "request_id": "a1"}]}).to_string()),
    )
    .await;
    assert_eq!(adjusted["results"][0]["status"], "ok", "{adjusted}");

    // At the opening: served.
    let wait = (opens - common::holds::now_ms()).max(0) as u64;
    tokio::time::sleep(std::time::Duration::from_millis(wait)).await;
    let (_, sold) = post(&c, &txns, sale("s1", "drop")).await;
    assert_eq!(
        (&sold["status"], &sold["stock_after"]),
        (&json!("ok"), &json!(9)),
        "{sold}"
    );
    assert!(sold["completed_at"].as_i64().unwrap() >= opens, "{sold}");

    // The item, the listing and the events show the window.
    let shown = item(&c, &server, "drop").await;
    assert_eq!(
        (&shown["opens_at"], &shown["closes_at"]),
        (&json!(opens), &json!(closes)),
        "{shown}"
    );
    let (_, page) = get(&c, &server.url("/v1/shops/shop/items")).await;
    let plain = page["items"]
        .as_array()
        .unwrap()
        .iter()
        .find(|i| i["item"] == "plain")
        .unwrap()
        .clone();
    assert_eq!(
        (&plain["opens_at"], &plain["closes_at"]),
        (&Value::Null, &Value::Null),
        "{plain}"
    );
    let (_, events) = get(&c, &server.url("/v1/shops/shop/items/drop/events")).await;
    let kinds: Vec<(Value, Value)> = events["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| (e["status"].clone(), e["opens_at"].clone()))
        .collect();
    assert!(
        kinds.contains(&(json!("not_open"), json!(opens))),
        "{kinds:?}"
    );

    // A load that leaves the window out keeps it; `null` clears a bound.
    put_items(
        &c,
        &server,
        json!({"items": [{"item": "drop", "stock": 20}]}),
    )
    .await;
    assert_eq!(item(&c, &server, "drop").await["opens_at"], opens);
    put_items(
        &c,
        &server,
        json!({"items": [{"item": "past", "stock": 5, "closes_at": null}]}),
    )
    .await;
    assert_eq!(post(&c, &txns, sale("l2", "past")).await.1["status"], "ok");

    // Bad bounds name the field.
    for (entry, says) in [
        (
            json!({"item": "x", "stock": 1, "opens_at": 0}),
            "items[0].opens_at: must be at least 1",
        ),
        (
            json!({"item": "x", "stock": 1, "closes_at": "soon"}),
            "items[0].closes_at: must be an integer",
        ),
        (
            json!({"item": "x", "stock": 1, "opens_at": 20, "closes_at": 10}),
            "items[0].closes_at: must be after opens_at",
        ),
    ] {
        let (status, err) = put_items(&c, &server, json!({"items": [entry]})).await;
        assert_eq!(status, 400, "{err}");
        assert!(err.to_string().contains(says), "{err}");
    }

    // After a SIGKILL: the windows stand, as do the answers.
    server.kill();
    let server = Server::start(dir.path(), &[]);
    let shown = item(&c, &server, "drop").await;
    assert_eq!(
        (&shown["opens_at"], &shown["closes_at"], &shown["stock"]),
        (&json!(opens), &json!(closes), &json!(20)),
        "{shown}"
    );
    let (_, polled) = get(&c, &server.url("/v1/shops/shop/txns/e1")).await;
    assert_eq!(polled, early);
    let (_, again) = post(&c, &server.url("/v1/shops/shop/txns"), sale("s2", "drop")).await;
    assert_eq!(
        (&again["status"], &again["opens_at"]),
        (&json!("ok"), &json!(opens)),
        "{again}"
    );
}
