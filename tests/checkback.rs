//! A shop's check-back before its holds and orders expire (issue 15), against the real
//! binary and a real small HTTP server of the shop's (on loopback, in this test): it
//! answers confirm, release, extend, errors and silence, and checks every call's
//! signature.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::holds::now_ms;
use common::*;
use hmac::{Hmac, KeyInit, Mac};
use serde_json::{json, Value};
use sha2::Sha256;

/// What the shop's server answers.
#[derive(Clone, Debug)]
enum Answer {
    Json(Value),
    Status(u16),
    Silence,
}

/// The shop's check-back server: one thread, one connection at a time.
struct ShopServer {
    url: String,
    answer: Arc<Mutex<Answer>>,
    /// Every call: its signature header and body.
    calls: Arc<Mutex<Vec<(String, String)>>>,
}

impl ShopServer {
    fn start() -> ShopServer {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}/check", listener.local_addr().unwrap());
        let answer = Arc::new(Mutex::new(Answer::Json(json!({"action": "release"}))));
        let calls: Arc<Mutex<Vec<(String, String)>>> = Arc::default();
        let (a, c) = (answer.clone(), calls.clone());
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(mut stream) = stream else { continue };
                let (a, c) = (a.clone(), c.clone());
                std::thread::spawn(move || {
                    let mut reader = BufReader::new(stream.try_clone().unwrap());
                    let (mut len, mut signature) = (0usize, String::new());
                    let mut line = String::new();
                    loop {
                        line.clear();
                        if reader.read_line(&mut line).unwrap_or(0) == 0 {
                            return;
                        }
                        let l = line.trim_end();
                        if l.is_empty() {
                            break;
                        }
                        if let Some((k, v)) = l.split_once(':') {
                            match k.to_ascii_lowercase().as_str() {
                                "content-length" => len = v.trim().parse().unwrap_or(0),
                                "x-nrtxn-signature" => signature = v.trim().to_string(),
                                _ => {}
                            }
                        }
                    }
                    let mut body = vec![0u8; len];
                    reader.read_exact(&mut body).unwrap();
                    c.lock()
                        .unwrap()
                        .push((signature, String::from_utf8(body).unwrap()));
                    let answer = a.lock().unwrap().clone();
                    let (status, body) = match answer {
                        Answer::Json(v) => (200, v.to_string()),
                        Answer::Status(s) => (s, "{}".to_string()),
                        Answer::Silence => {
                            std::thread::sleep(Duration::from_secs(5));
                            return;
                        }
                    };
                    let _ = write!(
                        stream,
                        "HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                        body.len()
                    );
                });
            }
        });
        ShopServer { url, answer, calls }
    }

    fn answer(&self, a: Answer) {
        *self.answer.lock().unwrap() = a;
    }

    fn calls(&self) -> Vec<(String, String)> {
        self.calls.lock().unwrap().clone()
    }
}

fn signature(secret: &str, body: &str) -> String {
    let mut mac = <Hmac<Sha256> as KeyInit>::new_from_slice(secret.as_bytes()).unwrap();
    mac.update(body.as_bytes());
    format!("sha256={}", hex::encode(mac.finalize().into_bytes()))
}

async fn put_settings(c: &reqwest::Client, server: &Server, body: Value) -> (u16, Value) {
    call(
        c,
        reqwest::Method::PUT,
        &server.url("/v1/shops/s/settings"),
        Some(body.to_string()),
    )
    .await
}

async fn hold(c: &reqwest::Client, server: &Server, id: &str, ttl_ms: i64) -> Value {
    let (code, body) = post(
        c,
        &server.url("/v1/shops/s/holds"),
        json!({"request_id": id, "item": "a", "qty": 1, "ttl_ms": ttl_ms}),
    )
    .await;
    assert_eq!((code, &body["status"]), (200, &json!("held")), "{body}");
    body
}

/// Polls hold `id` until it is no longer `held` or `checking` (past its expiry, while
/// the shop is asked) (up to `within`), and returns it.
async fn ended(c: &reqwest::Client, server: &Server, id: &str, within: Duration) -> Value {
    let started = Instant::now();
    loop {
        let (_, h) = get(c, &server.url(&format!("/v1/shops/s/holds/{id}"))).await;
        let pending = h["status"] == "held" || h["status"] == "checking";
        if !pending || started.elapsed() > within {
            return h;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The shop's answer decides each due hold: confirm sells it, release expires it,
/// extend gives it longer; every call is signed with the secret the settings call
/// returned once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_check_back_decides_each_due_hold_and_every_call_is_signed() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path(), &[]);
    let shop = ShopServer::start();
    let c = client();
    load(&c, &server, "s", &[("a", 100)]).await;
    let (code, set) = put_settings(
        &c,
        &server,
        json!({"check_url": shop.url, "check_timeout_ms": 500, "check_retries": 1}),
    )
    .await;
    assert_eq!(code, 200, "{set}");
    let secret = set["check_secret"].as_str().unwrap().to_string();
    assert_eq!(set["check_default"], "release");
    // Shown once: set again, the secret is kept and not shown.
    let (_, again) = put_settings(
        &c,
        &server,
        json!({"check_url": shop.url, "check_timeout_ms": 500, "check_retries": 1}),
    )
    .await;
    assert!(again.get("check_secret").is_none(), "{again}");
    let (_, read) = get(&c, &server.url("/v1/shops/s/settings")).await;
    assert_eq!(read["check_url"], json!(shop.url));
    assert!(read.get("check_secret").is_none(), "{read}");

    shop.answer(Answer::Json(json!({"action": "confirm"})));
    let h = hold(&c, &server, "h-confirm", 200).await;
    let done = ended(&c, &server, "h-confirm", Duration::from_secs(5)).await;
    assert_eq!(done["status"], "confirmed", "{done}");
    let calls = shop.calls();
    let (sig, body) = calls.last().unwrap();
    assert_eq!(sig, &signature(&secret, body));
    let sent: Value = serde_json::from_str(body).unwrap();
    assert_eq!(
        sent,
        json!({"shop": "s", "kind": "hold", "id": "h-confirm",
               "lines": [{"item": "a", "qty": 1}], "expires_at": h["expires_at"]})
    );

    shop.answer(Answer::Json(json!({"action": "release"})));
    hold(&c, &server, "h-release", 200).await;
    let done = ended(&c, &server, "h-release", Duration::from_secs(5)).await;
    assert_eq!(done["status"], "expired", "{done}");

    shop.answer(Answer::Json(json!({"action": "extend", "ttl_ms": 1500})));
    let h = hold(&c, &server, "h-extend", 200).await;
    let first_expiry = h["expires_at"].as_i64().unwrap();
    // Past its first expiry, still held: extended (and asked again at the new one).
    tokio::time::sleep(Duration::from_millis(800)).await;
    let (_, now) = get(&c, &server.url("/v1/shops/s/holds/h-extend")).await;
    assert_eq!(now["status"], "held", "{now}");
    assert!(now["expires_at"].as_i64().unwrap() > first_expiry, "{now}");
    shop.answer(Answer::Json(json!({"action": "release"})));
    let done = ended(&c, &server, "h-extend", Duration::from_secs(5)).await;
    assert_eq!(done["status"], "expired", "{done}");
    let (_, events) = get(&c, &server.url("/v1/shops/s/items/a/events?after=0")).await;
    let kinds: Vec<&str> = events["events"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["hold_id"] == "h-extend")
        .map(|e| e["kind"].as_str().unwrap())
        .collect();
    assert_eq!(kinds, ["hold", "extend", "expire"], "{events}");
    assert_eq!(
        get(&c, &server.url("/v1/shops/s/items/a")).await.1["stock"],
        99
    );
}

/// A shop that answers errors, or nothing, is asked again up to its retries, within
/// timeout x (retries + 1) + 2 s; then its default applies (here `confirm`), and the
/// case is a dead letter, counted in the metrics.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unanswered_check_back_applies_the_default_and_is_a_dead_letter() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path(), &[]);
    let shop = ShopServer::start();
    let c = client();
    load(&c, &server, "s", &[("a", 100)]).await;
    let (code, set) = put_settings(
        &c,
        &server,
        json!({"check_url": shop.url, "check_timeout_ms": 300, "check_retries": 2,
               "check_default": "confirm"}),
    )
    .await;
    assert_eq!(code, 200, "{set}");
    for (id, answer) in [
        ("h-error", Answer::Status(503)),
        ("h-silent", Answer::Silence),
        ("h-garbage", Answer::Json(json!({"action": "maybe"}))),
    ] {
        shop.answer(answer);
        let before = shop.calls().len();
        let h = hold(&c, &server, id, 100).await;
        let done = ended(&c, &server, id, Duration::from_secs(10)).await;
        assert_eq!(done["status"], "confirmed", "{id}: {done}");
        let ended_at = now_ms();
        // The whole check: 3 attempts of 300 ms, plus 2 s (and the wheel's and this
        // poll's own steps).
        let bound = h["expires_at"].as_i64().unwrap() + 3 * 300 + 2_000 + 500;
        assert!(ended_at <= bound, "{id} ended {} ms late", ended_at - bound);
        assert_eq!(shop.calls().len() - before, 3, "{id}: attempts");
    }
    let (_, dead) = get(&c, &server.url("/v1/shops/s/dead-letters")).await;
    let ids: Vec<&str> = dead["dead_letters"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["h-error", "h-silent", "h-garbage"], "{dead}");
    assert_eq!(dead["dead_letters"][0]["applied"], "confirm");
    assert_eq!(dead["dead_letters"][0]["attempts"], 3);
    assert!(
        dead["dead_letters"][1]["error"]
            .as_str()
            .unwrap()
            .contains("did not answer"),
        "{dead}"
    );
    assert_eq!(
        metric(&c, &server, "nrtxn_check_dead_letters_total").await,
        3
    );

    // Removed: a hold expires as without a check-back, and nobody is called.
    let (code, _) = put_settings(&c, &server, json!({"check_url": null})).await;
    assert_eq!(code, 200);
    let before = shop.calls().len();
    hold(&c, &server, "h-plain", 100).await;
    let done = ended(&c, &server, "h-plain", Duration::from_secs(5)).await;
    assert_eq!(done["status"], "expired", "{done}");
    assert_eq!(shop.calls().len(), before);
}

/// An order's check-back names its lines; `confirm` sells every line together.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_check_back_confirms_a_due_order_whole() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path(), &[]);
    let shop = ShopServer::start();
    let c = client();
    load(&c, &server, "s", &[("a", 10), ("b", 10)]).await;
    put_settings(&c, &server, json!({"check_url": shop.url})).await;
    shop.answer(Answer::Json(json!({"action": "confirm"})));
    let (code, o) = post(
        &c,
        &server.url("/v1/shops/s/orders"),
        json!({"order_id": "o-1", "ttl_ms": 200,
               "lines": [{"item": "b", "qty": 2}, {"item": "a", "qty": 3}]}),
    )
    .await;
    assert_eq!((code, &o["status"]), (200, &json!("held")), "{o}");
    let mut view = Value::Null;
    for _ in 0..100 {
        view = get(&c, &server.url("/v1/shops/s/orders/o-1")).await.1;
        // The record first, then its lines, each with its own entry.
        if view["status"] == "confirmed"
            && view["lines"]
                .as_array()
                .unwrap()
                .iter()
                .all(|l| l["status"] == "confirmed")
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(view["status"], "confirmed", "{view}");
    let sent: Value = serde_json::from_str(&shop.calls().last().unwrap().1).unwrap();
    assert_eq!(sent["kind"], "order");
    assert_eq!(
        sent["lines"],
        json!([{"item": "b", "qty": 2}, {"item": "a", "qty": 3}])
    );
    for (item, stock) in [("a", 7), ("b", 8)] {
        let (_, it) = get(&c, &server.url(&format!("/v1/shops/s/items/{item}"))).await;
        assert_eq!(
            (&it["stock"], &it["reserved"]),
            (&json!(stock), &json!(0)),
            "{it}"
        );
    }
}

/// Settings are checked field by field, and only an operator's key may set them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_back_settings_are_validated() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path(), &[]);
    let c = client();
    for (body, field) in [
        (json!({}), "check_url"),
        (json!({"check_url": "ftp://x/y"}), "check_url"),
        (json!({"check_url": "http://"}), "check_url"),
        (json!({"check_url": 3}), "check_url"),
        (
            json!({"check_url": "http://x/c", "check_timeout_ms": 5}),
            "check_timeout_ms",
        ),
        (
            json!({"check_url": "http://x/c", "check_retries": 11}),
            "check_retries",
        ),
        (
            json!({"check_url": "http://x/c", "check_default": "maybe"}),
            "check_default",
        ),
        (
            json!({"check_url": "http://x/c", "rotate_secret": "yes"}),
            "rotate_secret",
        ),
    ] {
        let (code, answer) = put_settings(&c, &server, body.clone()).await;
        assert_eq!(code, 400, "{body} -> {answer}");
        assert!(
            answer["detail"]
                .as_str()
                .unwrap()
                .starts_with(&format!("{field}:")),
            "{body} -> {answer}"
        );
    }
    let (_, first) = put_settings(&c, &server, json!({"check_url": "http://x/c"})).await;
    let (_, rotated) = put_settings(
        &c,
        &server,
        json!({"check_url": "http://x/c", "rotate_secret": true}),
    )
    .await;
    assert_ne!(first["check_secret"], rotated["check_secret"]);
    assert!(rotated["check_secret"]
        .as_str()
        .unwrap()
        .starts_with("nrtxn_chk_"));
}

/// On MongoDB the settings live in the shared `shop_checks` collection: set through
/// one server, they survive its restart, and a due hold is decided by the shop.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_back_settings_on_mongodb_survive_a_restart() {
    let Some(uri) = mongo_uri("checkback") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let mut server = Server::start(dir.path(), &["--mongo-uri", &uri]);
    let shop = ShopServer::start();
    let c = client();
    load(&c, &server, "s", &[("a", 100)]).await;
    let (code, set) = put_settings(&c, &server, json!({"check_url": shop.url})).await;
    assert_eq!(code, 200, "{set}");
    let secret = set["check_secret"].as_str().unwrap().to_string();
    server.kill();
    let server = Server::start(dir.path(), &["--mongo-uri", &uri]);
    shop.answer(Answer::Json(json!({"action": "confirm"})));
    hold(&c, &server, "h-1", 200).await;
    let done = ended(&c, &server, "h-1", Duration::from_secs(10)).await;
    assert_eq!(done["status"], "confirmed", "{done}");
    let (sig, body) = shop.calls().last().unwrap().clone();
    assert_eq!(sig, signature(&secret, &body));
    drop_database(&uri).await;
}
