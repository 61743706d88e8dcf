//! Stock alerts, against the real binary and a real small HTTP server of the shop's on
//! loopback: the crossings of an item's levels are events of the item and signed calls
//! to the shop, in seq order; a call that fails is tried again, resumed after a SIGKILL,
//! and kept once it failed for good; the settings are merged field by field.

mod common;

use std::time::Duration;

use common::receiver::{Call, Receiver};
use common::*;
use hmac::{Hmac, KeyInit, Mac};
use serde_json::{json, Value};
use sha2::Sha256;

async fn put(c: &reqwest::Client, server: &Server, path: &str, body: Value) -> (u16, Value) {
    let url = server.url(&format!("/v1/shops/s{path}"));
    call(c, reqwest::Method::PUT, &url, Some(body.to_string())).await
}

/// Sells `qty` of `item` under key `key`; the answer's status.
async fn sell(c: &reqwest::Client, server: &Server, item: &str, qty: i64, key: &str) -> Value {
    let body = json!({"seller": "s", "item": item, "qty": qty, "request_id": key});
    let (code, answer) = post(c, &server.url("/v1/shops/s/txns"), body).await;
    assert_eq!(code, 200, "{answer}");
    answer["status"].clone()
}

/// The HMAC of a call's `X-Nrtxn-Signature` (`t=MS,v1=HEX` over `{t}.{body}`) holds.
fn assert_signed(secret: &str, call: &Call) {
    let (t, v1) = call
        .signature
        .strip_prefix("t=")
        .and_then(|h| h.split_once(",v1="))
        .unwrap_or_else(|| panic!("signature header {:?}", call.signature));
    let mut mac = <Hmac<Sha256> as KeyInit>::new_from_slice(secret.as_bytes()).unwrap();
    mac.update(format!("{t}.{}", call.body).as_bytes());
    assert_eq!(v1, hex::encode(mac.finalize().into_bytes()), "{call:?}");
}

/// The kinds and seqs of the alerts delivered (answered 200), in the order sent.
fn delivered(calls: &[Call]) -> Vec<(String, u64)> {
    calls
        .iter()
        .filter(|c| c.status == 200)
        .map(|c| {
            let v = c.json();
            (
                v["kind"].as_str().unwrap().to_string(),
                v["seq"].as_u64().unwrap(),
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crossings_are_events_and_signed_alerts_in_seq_order_resumed_after_a_sigkill() {
    let dir = tempfile::tempdir().unwrap();
    let mut server = Server::start(dir.path(), &[]);
    let c = client();
    let shop = Receiver::start();
    // Alerts without a check-back: the secret is made for them.
    let (code, settings) = put(&c, &server, "/settings", json!({"notify_url": shop.url})).await;
    assert_eq!(code, 200, "{settings}");
    assert_eq!(settings["check_url"], Value::Null);
    assert_eq!(
        settings["notify_events"],
        json!(["sold_out", "low_stock", "back_in_stock", "dead_letter"])
    );
    let secret = settings["check_secret"].as_str().unwrap().to_string();

    // The first load is no crossing.
    let load = json!({"items": [{"item": "a", "stock": 5, "low_stock_at": 2}]});
    let (code, loaded) = put(&c, &server, "/items", load).await;
    assert_eq!(
        (code, &loaded["items"][0]["low_stock_at"]),
        (200, &json!(2))
    );
    assert_eq!(sell(&c, &server, "a", 2, "k1").await, "ok", "5 -> 3");
    assert_eq!(sell(&c, &server, "a", 1, "k2").await, "ok", "3 -> 2: low");
    assert_eq!(
        sell(&c, &server, "a", 1, "k3").await,
        "ok",
        "2 -> 1: still low"
    );
    assert_eq!(
        sell(&c, &server, "a", 1, "k4").await,
        "ok",
        "1 -> 0: sold out"
    );
    assert_eq!(sell(&c, &server, "a", 1, "k5").await, "insufficient_stock");
    let reload = json!({"items": [{"item": "a", "stock": 4}]});
    assert_eq!(put(&c, &server, "/items", reload).await.0, 200, "0 -> 4");

    // The item's events: each alert right after the change that crossed.
    let (_, events) = get(&c, &server.url("/v1/shops/s/items/a/events")).await;
    let kinds: Vec<(u64, &str)> = events["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| (e["seq"].as_u64().unwrap(), e["kind"].as_str().unwrap()))
        .collect();
    assert_eq!(
        kinds,
        [
            (1, "load"),
            (2, "decrement"),
            (3, "decrement"),
            (4, "low_stock"),
            (5, "decrement"),
            (6, "decrement"),
            (7, "sold_out"),
            (8, "decrement"),
            (9, "load"),
            (10, "back_in_stock")
        ]
    );
    let want = [("low_stock", 4), ("sold_out", 7), ("back_in_stock", 10)];
    let calls = shop
        .wait_for(Duration::from_secs(10), |c| delivered(c).len() >= 3)
        .await;
    let got = delivered(&calls);
    assert_eq!(
        got,
        want.map(|(k, s)| (k.to_string(), s)),
        "once each, in seq order"
    );
    for call in &calls {
        assert_signed(&secret, call);
    }
    let body = calls[1].json();
    assert_eq!(
        (
            &body["shop"],
            &body["item"],
            &body["stock"],
            &body["reserved"]
        ),
        (&json!("s"), &json!("a"), &json!(0), &json!(0)),
        "{body}"
    );
    assert!(body["at"].as_i64().unwrap() > 0, "{body}");

    // A shop that fails: the alert is tried again, and a SIGKILL before it got through
    // leaves it to the next start.
    shop.answer(503);
    assert_eq!(sell(&c, &server, "a", 4, "k6").await, "ok", "4 -> 0");
    shop.wait_for(Duration::from_secs(10), |c| {
        c.iter().any(|c| c.status == 503)
    })
    .await;
    server.kill();
    shop.answer(200);
    let server = Server::start(dir.path(), &[]);
    let calls = shop
        .wait_for(Duration::from_secs(20), |c| delivered(c).len() >= 4)
        .await;
    assert_eq!(
        delivered(&calls)[3],
        ("sold_out".to_string(), 12),
        "the sold_out after the restart"
    );

    // One that keeps failing is kept, with why, once its attempts are spent.
    shop.answer(500);
    let reload = json!({"items": [{"item": "a", "stock": 1}]});
    assert_eq!(put(&c, &server, "/items", reload).await.0, 200);
    let url = server.url("/v1/shops/s/notifications");
    let until = std::time::Instant::now() + Duration::from_secs(30);
    let failed = loop {
        let (code, body) = get(&c, &url).await;
        assert_eq!(code, 200, "{body}");
        if let Some(f) = body["notifications"].as_array().and_then(|n| n.first()) {
            break f.clone();
        }
        assert!(std::time::Instant::now() < until, "nothing failed for good");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(
        (
            &failed["alert"]["kind"],
            &failed["alert"]["seq"],
            &failed["error"],
            &failed["attempts"]
        ),
        (
            &json!("back_in_stock"),
            &json!(14),
            &json!("status 500"),
            &json!(5)
        ),
        "{failed}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn settings_are_merged_field_by_field_and_bad_ones_name_the_field() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path(), &[]);
    let c = client();
    for (body, field) in [
        (json!({"notify_events": ["sold_out"]}), "notify_url:"),
        (json!({"check_retries": 2}), "check_url:"),
        (json!({"notify_url": "ftp://x/y"}), "notify_url:"),
        (
            json!({"notify_url": "http://x/a", "notify_events": ["soon"]}),
            "notify_events[0]:",
        ),
        (
            json!({"notify_url": "http://x/a", "notify_events": []}),
            "notify_events:",
        ),
        (
            json!({"notify_url": "http://x/a", "notify_events": ["sold_out", "sold_out"]}),
            "notify_events[1]:",
        ),
    ] {
        let (code, answer) = put(&c, &server, "/settings", body.clone()).await;
        assert_eq!(code, 400, "{body} -> {answer}");
        let detail = answer["detail"].as_str().unwrap();
        assert!(detail.starts_with(field), "{body} -> {answer}");
    }
    let set = json!({"check_url": "http://x/c", "check_retries": 5});
    let (_, first) = put(&c, &server, "/settings", set).await;
    assert!(first["check_secret"].is_string(), "{first}");
    // Alerts added: the check-back keeps its fields, and the secret stays.
    let alerts = json!({"notify_url": "http://x/a", "notify_events": ["sold_out"]});
    let (code, both) = put(&c, &server, "/settings", alerts).await;
    assert_eq!(code, 200, "{both}");
    assert_eq!(
        (
            &both["check_url"],
            &both["check_retries"],
            &both["notify_events"]
        ),
        (&json!("http://x/c"), &json!(5), &json!(["sold_out"]))
    );
    assert!(both.get("check_secret").is_none(), "{both}");
    // An empty body changes nothing; the check-back removed leaves the alerts.
    let (_, same) = put(&c, &server, "/settings", json!({})).await;
    assert_eq!(same, both);
    let (_, alerts_only) = put(&c, &server, "/settings", json!({"check_url": null})).await;
    assert_eq!(
        (&alerts_only["check_url"], &alerts_only["notify_url"]),
        (&Value::Null, &json!("http://x/a"))
    );
    let (_, read) = get(&c, &server.url("/v1/shops/s/settings")).await;
    assert_eq!(read, alerts_only);
    // A bad level names its field.
    let bad = json!({"items": [{"item": "a", "stock": 5, "low_stock_at": 0}]});
    let (code, answer) = put(&c, &server, "/items", bad).await;
    assert_eq!(code, 400, "{answer}");
    assert!(answer["detail"]
        .as_str()
        .unwrap()
        .starts_with("items[0].low_stock_at:"));
}

/// A check-back that found no answer is a `dead_letter` alert to a shop that asked for
/// them, signed like the others.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unanswered_check_back_is_a_dead_letter_alert() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path(), &[]);
    let c = client();
    let shop = Receiver::start();
    // The check-back's answer is not JSON: no answer, the default applies.
    let settings = json!({"check_url": format!("{}/check", shop.url), "check_timeout_ms": 300,
                          "check_retries": 0, "notify_url": shop.url,
                          "notify_events": ["dead_letter"]});
    let (code, set) = put(&c, &server, "/settings", settings).await;
    assert_eq!(code, 200, "{set}");
    let secret = set["check_secret"].as_str().unwrap().to_string();
    load(&c, &server, "s", &[("a", 5)]).await;
    let body = json!({"item": "a", "qty": 1, "ttl_ms": 200, "request_id": "h-late"});
    let (code, held) = post(&c, &server.url("/v1/shops/s/holds"), body).await;
    assert_eq!(code, 200, "{held}");
    let calls = shop
        .wait_for(Duration::from_secs(15), |calls| {
            calls.iter().any(|c| c.body.contains("dead_letter"))
        })
        .await;
    let alert = calls
        .iter()
        .find(|c| c.body.contains("dead_letter"))
        .unwrap();
    assert_signed(&secret, alert);
    let body = alert.json();
    assert_eq!(
        (&body["shop"], &body["kind"], &body["id"], &body["applied"]),
        (
            &json!("s"),
            &json!("dead_letter"),
            &json!("h-late"),
            &json!("release")
        ),
        "{body}"
    );
}

/// A shop whose endpoint fails does not hold another shop's alerts up: each shop's
/// alerts go on their own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_shop_does_not_hold_up_another_shops_alerts() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path(), &[]);
    let c = client();
    let (failing, fine) = (Receiver::start(), Receiver::start());
    failing.answer(503);
    for (shop, r) in [("s", &failing), ("t", &fine)] {
        let url = server.url(&format!("/v1/shops/{shop}/settings"));
        let body = json!({"notify_url": r.url}).to_string();
        assert_eq!(
            call(&c, reqwest::Method::PUT, &url, Some(body)).await.0,
            200
        );
        load(&c, &server, shop, &[("a", 1)]).await;
    }
    // The failing shop's sold_out is read first, and is being retried for seconds.
    let sale = |key: &str| json!({"seller": "x", "item": "a", "qty": 1, "request_id": key});
    post(&c, &server.url("/v1/shops/s/txns"), sale("k1")).await;
    failing
        .wait_for(Duration::from_secs(5), |c| !c.is_empty())
        .await;
    let asked = std::time::Instant::now();
    post(&c, &server.url("/v1/shops/t/txns"), sale("k2")).await;
    fine.wait_for(Duration::from_secs(3), |c| !c.is_empty())
        .await;
    let took = asked.elapsed();
    assert!(
        failing.calls().iter().all(|c| c.status == 503) && took < Duration::from_secs(3),
        "the other shop's alert took {took:?}"
    );
}
