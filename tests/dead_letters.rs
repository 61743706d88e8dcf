//! Dead letters an operator can act on, against the real binary and a small
//! shop server on loopback: a retry schedule keeps a hold `checking` past its expiry
//! until a later attempt is answered; the default `ask` keeps it so until an operator
//! resolves its dead letter; dead letters are durable (a restart, another node on the
//! same MongoDB) and an operator's retry asks the shop again. Schedules are in
//! milliseconds here.

mod common;

use std::collections::VecDeque;
use std::io::Write;
use std::net::TcpListener;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::holds::{item_state, now_ms};
use common::*;
use serde_json::{json, Value};

/// The shop's check-back server: answers the scripted statuses and bodies in turn, then
/// `then` for every later call.
struct ShopServer {
    url: String,
    script: Arc<Mutex<VecDeque<(u16, Value)>>>,
    then: Arc<Mutex<(u16, Value)>>,
    /// When each call came (ms since the epoch), and its body.
    calls: Arc<Mutex<Vec<(i64, Value)>>>,
}

impl ShopServer {
    fn start() -> ShopServer {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}/check", listener.local_addr().unwrap());
        let script: Arc<Mutex<VecDeque<(u16, Value)>>> = Arc::default();
        let then = Arc::new(Mutex::new((503, json!({}))));
        let calls: Arc<Mutex<Vec<(i64, Value)>>> = Arc::default();
        let (sc, th, ca) = (script.clone(), then.clone(), calls.clone());
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(mut stream) = stream else { continue };
                let Some((_, body)) = read_http_request(&stream) else {
                    continue;
                };
                let sent: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
                ca.lock().unwrap().push((now_ms(), sent));
                let (status, answer) = sc
                    .lock()
                    .unwrap()
                    .pop_front()
                    .unwrap_or_else(|| th.lock().unwrap().clone());
                let answer = answer.to_string();
                let _ = write!(
                    stream,
                    "HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{answer}",
                    answer.len()
                );
            }
        });
        ShopServer {
            url,
            script,
            then,
            calls,
        }
    }

    /// Answers these first, in turn.
    fn script(&self, answers: &[(u16, Value)]) {
        self.script.lock().unwrap().extend(answers.iter().cloned());
    }

    /// Answers this once the script is spent.
    fn then(&self, status: u16, body: Value) {
        *self.then.lock().unwrap() = (status, body);
    }

    fn calls(&self) -> Vec<(i64, Value)> {
        self.calls.lock().unwrap().clone()
    }

    fn calls_about(&self, id: &str) -> Vec<i64> {
        self.calls()
            .into_iter()
            .filter(|(_, b)| b["id"] == id)
            .map(|(at, _)| at)
            .collect()
    }
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

async fn hold(c: &reqwest::Client, server: &Server, id: &str, qty: i64, ttl_ms: i64) -> Value {
    let (code, body) = post(
        c,
        &server.url("/v1/shops/s/holds"),
        json!({"request_id": id, "item": "a", "qty": qty, "ttl_ms": ttl_ms}),
    )
    .await;
    assert_eq!((code, &body["status"]), (200, &json!("held")), "{body}");
    body
}

async fn hold_status(c: &reqwest::Client, server: &Server, id: &str) -> Value {
    get(c, &server.url(&format!("/v1/shops/s/holds/{id}")))
        .await
        .1
}

/// Polls `url` until its `status` is `want` (up to `within`), and returns it.
async fn wait_status(c: &reqwest::Client, url: &str, want: &str, within: Duration) -> Value {
    let started = Instant::now();
    loop {
        let (_, v) = get(c, url).await;
        if v["status"] == want || started.elapsed() > within {
            return v;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// The shop's dead letters, by id.
async fn letters(c: &reqwest::Client, server: &Server) -> Vec<Value> {
    let (code, dead) = get(c, &server.url("/v1/shops/s/dead-letters")).await;
    assert_eq!(code, 200, "{dead}");
    dead["dead_letters"].as_array().unwrap().clone()
}

/// Waits until the shop has a dead letter for `id`, and returns it.
async fn wait_letter(c: &reqwest::Client, server: &Server, id: &str) -> Value {
    for _ in 0..400 {
        if let Some(l) = letters(c, server).await.into_iter().find(|l| l["id"] == id) {
            return l;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("no dead letter for {id}");
}

async fn act(
    c: &reqwest::Client,
    server: &Server,
    id: &str,
    what: &str,
    body: Value,
) -> (u16, Value) {
    post(
        c,
        &server.url(&format!("/v1/shops/s/dead-letters/{id}/{what}")),
        body,
    )
    .await
}

/// A retry schedule asks the shop again after each wait: the hold stays pending past
/// its expiry, reported `checking`, and the shop's answer to a later attempt sells it.
/// (Without the schedule, `check_retries: 0` would expire it at the first failure.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_schedule_keeps_a_hold_checking_until_a_later_attempt_is_answered() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path(), &[]);
    let shop = ShopServer::start();
    let c = client();
    load(&c, &server, "s", &[("a", 100)]).await;
    let (code, set) = put_settings(
        &c,
        &server,
        json!({"check_url": shop.url, "check_timeout_ms": 300, "check_retries": 0,
               "check_retry_schedule_ms": [400, 800]}),
    )
    .await;
    assert_eq!(code, 200, "{set}");
    assert_eq!(set["check_retry_schedule_ms"], json!([400, 800]), "{set}");
    let (_, read) = get(&c, &server.url("/v1/shops/s/settings")).await;
    assert_eq!(read["check_retry_schedule_ms"], json!([400, 800]), "{read}");
    shop.script(&[(503, json!({})), (503, json!({}))]);
    shop.then(200, json!({"action": "confirm"}));

    let h = hold(&c, &server, "h-1", 2, 200).await;
    let expires_at = h["expires_at"].as_i64().unwrap();
    let url = server.url("/v1/shops/s/holds/h-1");
    let checking = wait_status(&c, &url, "checking", Duration::from_secs(3)).await;
    assert_eq!(checking["status"], "checking", "{checking}");
    // Still pending (its units held) past its expiry, between the attempts.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(now_ms() > expires_at + 500);
    assert_eq!(hold_status(&c, &server, "h-1").await["status"], "checking");
    assert_eq!(item_state(&c, &server, "s", "a").await, (98, 2));

    let done = wait_status(&c, &url, "confirmed", Duration::from_secs(5)).await;
    assert_eq!(done["status"], "confirmed", "{done}");
    let calls = shop.calls_about("h-1");
    assert_eq!(calls.len(), 3, "attempts: {calls:?}");
    // Each attempt after its wait (less a little for the clocks' steps).
    assert!(calls[1] - calls[0] >= 390, "{calls:?}");
    assert!(calls[2] - calls[1] >= 790, "{calls:?}");
    assert_eq!(item_state(&c, &server, "s", "a").await, (98, 0));
    // Answered: no dead letter.
    assert!(letters(&c, &server).await.is_empty());
}

/// `ask`: a hold (and an order) whose retries are spent stays `checking`, its units
/// held, without the shop being asked again, until an operator resolves its dead
/// letter: confirm sells it, release gives its units back. A letter whose hold ended
/// answers 409 with the reason; an unknown one 404.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ask_keeps_a_hold_checking_until_an_operator_resolves_it() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path(), &[]);
    let shop = ShopServer::start();
    let c = client();
    load(&c, &server, "s", &[("a", 100), ("b", 10)]).await;
    let (code, set) = put_settings(
        &c,
        &server,
        json!({"check_url": shop.url, "check_timeout_ms": 300, "check_retries": 1,
               "check_default": "ask"}),
    )
    .await;
    assert_eq!((code, &set["check_default"]), (200, &json!("ask")), "{set}");
    hold(&c, &server, "h-sold", 2, 200).await;
    hold(&c, &server, "h-back", 3, 200).await;
    let (code, o) = post(
        &c,
        &server.url("/v1/shops/s/orders"),
        json!({"order_id": "o-1", "ttl_ms": 200,
               "lines": [{"item": "a", "qty": 1}, {"item": "b", "qty": 4}]}),
    )
    .await;
    assert_eq!((code, &o["status"]), (200, &json!("held")), "{o}");
    for (id, kind) in [("h-sold", "hold"), ("h-back", "hold"), ("o-1", "order")] {
        let letter = wait_letter(&c, &server, id).await;
        assert_eq!(
            (&letter["applied"], &letter["kind"]),
            (&json!("ask"), &json!(kind)),
            "{letter}"
        );
        assert_eq!(letter["attempts"], 2, "{letter}");
        assert_eq!(letter["resolved"], Value::Null, "{letter}");
    }
    let asked = shop.calls().len();
    assert_eq!(asked, 6, "two attempts each");
    // The engine looks again every 5 s: the letter stands, the shop is not asked again.
    tokio::time::sleep(Duration::from_millis(5_500)).await;
    assert_eq!(shop.calls().len(), asked);
    assert_eq!(
        hold_status(&c, &server, "h-sold").await["status"],
        "checking"
    );
    let (_, order) = get(&c, &server.url("/v1/shops/s/orders/o-1")).await;
    assert_eq!(order["status"], "checking", "{order}");
    assert_eq!(item_state(&c, &server, "s", "a").await, (94, 6));

    let (code, done) = act(
        &c,
        &server,
        "h-sold",
        "resolve",
        json!({"action": "confirm"}),
    )
    .await;
    assert_eq!(
        (code, &done["status"]),
        (200, &json!("confirmed")),
        "{done}"
    );
    let resolved = &done["dead_letter"]["resolved"];
    assert_eq!(
        (&resolved["action"], &resolved["by"]),
        (&json!("confirm"), &json!("operator")),
        "{done}"
    );
    assert!(resolved["at"].as_i64().unwrap() > 0, "{done}");
    let (code, done) = act(
        &c,
        &server,
        "h-back",
        "resolve",
        json!({"action": "release"}),
    )
    .await;
    assert_eq!((code, &done["status"]), (200, &json!("released")), "{done}");
    let (code, done) = act(&c, &server, "o-1", "resolve", json!({"action": "release"})).await;
    assert_eq!((code, &done["status"]), (200, &json!("released")), "{done}");
    let (_, order) = get(&c, &server.url("/v1/shops/s/orders/o-1")).await;
    assert!(
        order["lines"]
            .as_array()
            .unwrap()
            .iter()
            .all(|l| l["status"] == "released"),
        "{order}"
    );
    // Sold 2; 3 and the order's units back (`stock` is what is available).
    assert_eq!(item_state(&c, &server, "s", "a").await, (98, 0));
    assert_eq!(item_state(&c, &server, "s", "b").await, (10, 0));
    assert_eq!(
        hold_status(&c, &server, "h-sold").await["status"],
        "confirmed"
    );

    // Ended: 409 with the reason; the letter keeps how it was resolved.
    let (code, again) = act(
        &c,
        &server,
        "h-sold",
        "resolve",
        json!({"action": "release"}),
    )
    .await;
    assert_eq!(code, 409, "{again}");
    assert!(
        again["detail"].as_str().unwrap().contains("already ended"),
        "{again}"
    );
    assert_eq!(
        again["dead_letter"]["resolved"]["action"], "confirm",
        "{again}"
    );
    let (code, _) = act(&c, &server, "h-sold", "retry", json!({})).await;
    assert_eq!(code, 409);
    let (code, none) = act(&c, &server, "nope", "resolve", json!({"action": "confirm"})).await;
    assert_eq!(code, 404, "{none}");
    let (code, bad) = act(&c, &server, "h-back", "resolve", json!({"action": "maybe"})).await;
    assert_eq!(code, 400, "{bad}");
    assert!(
        bad["detail"].as_str().unwrap().starts_with("action:"),
        "{bad}"
    );
    assert_eq!(shop.calls().len(), asked, "resolving asks nobody");
}

/// Dead letters are kept in `checks.sqlite`: after a restart they are all there, the
/// hold waiting for an operator is still `checking` (and the shop is not asked again
/// at the start), and an operator's retry asks the shop again now: its answer applies
/// and resolves the letter; unanswered, the letter counts the attempts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_survive_a_restart_and_a_retry_asks_the_shop_again() {
    let dir = tempfile::tempdir().unwrap();
    let mut server = Server::start(dir.path(), &[]);
    let shop = ShopServer::start();
    let c = client();
    load(&c, &server, "s", &[("a", 100)]).await;
    let (code, set) = put_settings(
        &c,
        &server,
        json!({"check_url": shop.url, "check_timeout_ms": 300, "check_retries": 0,
               "check_default": "ask"}),
    )
    .await;
    assert_eq!(code, 200, "{set}");
    hold(&c, &server, "h-wait", 4, 200).await;
    let before = wait_letter(&c, &server, "h-wait").await;
    // Today's rule for a shop whose default is `release`: the default ends the hold,
    // and the letter records it. (A field left out would keep `ask`.)
    put_settings(&c, &server, json!({"check_default": "release"})).await;
    hold(&c, &server, "h-gone", 1, 200).await;
    let gone = wait_letter(&c, &server, "h-gone").await;
    assert_eq!(gone["applied"], "release", "{gone}");
    let url = server.url("/v1/shops/s/holds/h-gone");
    assert_eq!(
        wait_status(&c, &url, "expired", Duration::from_secs(3)).await["status"],
        "expired"
    );

    server.kill();
    let server = Server::start(dir.path(), &[]);
    let after = letters(&c, &server).await;
    let ids: Vec<&str> = after.iter().map(|l| l["id"].as_str().unwrap()).collect();
    assert_eq!(ids, ["h-wait", "h-gone"], "{after:?}");
    assert_eq!(after[0], before);
    let asked = shop.calls().len();
    // The restart re-arms the due hold; its letter stands: nobody is asked.
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    assert_eq!(shop.calls().len(), asked);
    assert_eq!(
        hold_status(&c, &server, "h-wait").await["status"],
        "checking"
    );
    assert_eq!(item_state(&c, &server, "s", "a").await, (96, 4));

    // Unanswered: the hold waits on, the letter counts the attempt.
    let (code, tried) = act(&c, &server, "h-wait", "retry", json!({})).await;
    assert_eq!(
        (code, &tried["status"]),
        (200, &json!("checking")),
        "{tried}"
    );
    assert_eq!(tried["dead_letter"]["attempts"], 2, "{tried}");
    assert_eq!(tried["dead_letter"]["resolved"], Value::Null, "{tried}");
    assert_eq!(shop.calls().len(), asked + 1);
    // Answered: applied, and the letter says so.
    shop.then(200, json!({"action": "confirm"}));
    let (code, done) = act(&c, &server, "h-wait", "retry", json!({})).await;
    assert_eq!(
        (code, &done["status"]),
        (200, &json!("confirmed")),
        "{done}"
    );
    assert_eq!(
        (
            &done["dead_letter"]["resolved"]["action"],
            &done["dead_letter"]["resolved"]["by"]
        ),
        (&json!("confirm"), &json!("retry")),
        "{done}"
    );
    assert_eq!(shop.calls().len(), asked + 2);
    assert_eq!(item_state(&c, &server, "s", "a").await, (96, 0));
    // The hold the default released: nothing to retry.
    let (code, ended) = act(&c, &server, "h-gone", "retry", json!({})).await;
    assert_eq!(code, 409, "{ended}");
    assert!(
        ended["detail"].as_str().unwrap().contains("expired"),
        "{ended}"
    );
}

/// A retry schedule is checked: an array of at most 20 waits of at least 1 ms, within
/// the 7-day life of a hold; `400` naming the field otherwise.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_retry_schedule_is_refused_naming_the_field() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path(), &[]);
    let c = client();
    let week_ms: i64 = 7 * 24 * 3600 * 1000;
    for schedule in [
        json!(1000),
        json!("1000"),
        json!([0]),
        json!([-5]),
        json!([1.5]),
        json!(["1000"]),
        json!(vec![1000; 21]),
        json!([week_ms, 1]),
        json!([week_ms + 1]),
    ] {
        let body = json!({"check_url": "http://x/c", "check_retry_schedule_ms": schedule});
        let (code, answer) = put_settings(&c, &server, body.clone()).await;
        assert_eq!(code, 400, "{body} -> {answer}");
        assert!(
            answer["detail"]
                .as_str()
                .unwrap()
                .starts_with("check_retry_schedule_ms"),
            "{body} -> {answer}"
        );
    }
    let (code, answer) = put_settings(
        &c,
        &server,
        json!({"check_url": "http://x/c", "check_default": "later"}),
    )
    .await;
    assert_eq!(code, 400, "{answer}");
    assert!(
        answer["detail"].as_str().unwrap().contains("\"ask\""),
        "{answer}"
    );
    let (code, ok) = put_settings(
        &c,
        &server,
        json!({"check_url": "http://x/c", "check_retry_schedule_ms": vec![week_ms / 20; 20]}),
    )
    .await;
    assert_eq!(code, 200, "{ok}");
}

/// On MongoDB the dead letters live in the shared `check_dead_letters` collection: a
/// letter made through one node is seen, after that node stopped, by another node with
/// a data dir of its own, which resolves it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_on_mongodb_are_seen_by_another_node() {
    let Some(uri) = mongo_uri("dead_letters") else {
        return;
    };
    let (dir0, dir1) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let mut node0 = Server::start(dir0.path(), &["--mongo-uri", &uri]);
    let shop = ShopServer::start();
    let c = client();
    load(&c, &node0, "s", &[("a", 100)]).await;
    let (code, set) = put_settings(
        &c,
        &node0,
        json!({"check_url": shop.url, "check_timeout_ms": 300, "check_retries": 0,
               "check_default": "ask"}),
    )
    .await;
    assert_eq!(code, 200, "{set}");
    hold(&c, &node0, "h-m", 5, 200).await;
    let letter = wait_letter(&c, &node0, "h-m").await;
    assert_eq!(letter["applied"], "ask", "{letter}");
    node0.kill();

    let node1 = Server::start(dir1.path(), &["--mongo-uri", &uri]);
    let seen = letters(&c, &node1).await;
    assert_eq!(seen, vec![letter], "another node's view");
    let url = node1.url("/v1/shops/s/holds/h-m");
    assert_eq!(
        wait_status(&c, &url, "checking", Duration::from_secs(5)).await["status"],
        "checking"
    );
    let (code, done) = act(&c, &node1, "h-m", "resolve", json!({"action": "confirm"})).await;
    assert_eq!(
        (code, &done["status"]),
        (200, &json!("confirmed")),
        "{done}"
    );
    assert_eq!(item_state(&c, &node1, "s", "a").await, (95, 0));
    assert_eq!(letters(&c, &node1).await[0]["resolved"]["by"], "operator");
    drop(node1);
    drop_database(&uri).await;
}
