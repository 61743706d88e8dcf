//! A shop's check-back before its holds and orders expire, against the real
//! binary and a real small HTTP server of the shop's (on loopback, in this test): it
//! answers confirm, release, extend, errors, silence, redirects and answers too large,
//! and checks every call's signature. The server's rules on where a check-back may go
//! are checked here too, and a Python receiver (docs/examples) verifies the
//! signature.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::sync::atomic::{AtomicUsize, Ordering};
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
    /// `302` to this location.
    Redirect(String),
    /// `200` with this many bytes of JSON (a confirm, padded), without a length (read to
    /// the end of the connection), once this many calls are being answered at once (or
    /// after 5 s).
    Big(usize, usize),
    /// This JSON after this long.
    Slow(Duration, Value),
}

/// Text in the shop server's answers that must never reach a dead letter.
const INSIDE_TEXT: &str = "inside-data";

/// The shop's check-back server: one thread, one connection at a time.
struct ShopServer {
    url: String,
    answer: Arc<Mutex<Answer>>,
    /// Every call: its signature header and body.
    calls: Arc<Mutex<Vec<(String, String)>>>,
    /// The most calls being answered at once.
    in_flight_max: Arc<AtomicUsize>,
}

impl ShopServer {
    fn start() -> ShopServer {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}/check", listener.local_addr().unwrap());
        let answer = Arc::new(Mutex::new(Answer::Json(json!({"action": "release"}))));
        let calls: Arc<Mutex<Vec<(String, String)>>> = Arc::default();
        let in_flight: Arc<AtomicUsize> = Arc::default();
        let in_flight_max: Arc<AtomicUsize> = Arc::default();
        let (a, c) = (answer.clone(), calls.clone());
        let (now, most) = (in_flight.clone(), in_flight_max.clone());
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(mut stream) = stream else { continue };
                let (a, c) = (a.clone(), c.clone());
                let (now, most) = (now.clone(), most.clone());
                std::thread::spawn(move || {
                    let Some((headers, body)) = read_http_request(&stream) else {
                        return;
                    };
                    let signature = headers
                        .into_iter()
                        .find(|(k, _)| k == "x-nrtxn-signature")
                        .map(|(_, v)| v)
                        .unwrap_or_default();
                    c.lock()
                        .unwrap()
                        .push((signature, String::from_utf8(body).unwrap()));
                    let answer = a.lock().unwrap().clone();
                    let at_once = now.fetch_add(1, Ordering::SeqCst) + 1;
                    most.fetch_max(at_once, Ordering::SeqCst);
                    answer_with(&mut stream, answer, &now);
                    now.fetch_sub(1, Ordering::SeqCst);
                });
            }
        });
        ShopServer {
            url,
            answer,
            calls,
            in_flight_max,
        }
    }

    fn answer(&self, a: Answer) {
        *self.answer.lock().unwrap() = a;
    }

    fn calls(&self) -> Vec<(String, String)> {
        self.calls.lock().unwrap().clone()
    }
}

/// Writes `answer` on `stream` (write errors, such as the caller hanging up, ignored).
fn answer_with(stream: &mut std::net::TcpStream, answer: Answer, in_flight: &AtomicUsize) {
    let (status, extra, body) = match answer {
        Answer::Json(v) => (200, String::new(), v.to_string()),
        Answer::Slow(wait, v) => {
            std::thread::sleep(wait);
            (200, String::new(), v.to_string())
        }
        Answer::Status(s) => (
            s,
            String::new(),
            json!({ "detail": INSIDE_TEXT }).to_string(),
        ),
        Answer::Silence => {
            std::thread::sleep(Duration::from_secs(5));
            return;
        }
        Answer::Redirect(to) => (302, format!("location: {to}\r\n"), String::new()),
        Answer::Big(len, at_once) => {
            let waited = Instant::now();
            while in_flight.load(Ordering::SeqCst) < at_once
                && waited.elapsed() < Duration::from_secs(5)
            {
                std::thread::sleep(Duration::from_millis(5));
            }
            let _ = write!(
                stream,
                "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: close\r\n\r\n{{\"action\":\"confirm\",\"pad\":\""
            );
            let chunk = INSIDE_TEXT.repeat(64 * 1024 / INSIDE_TEXT.len());
            let mut sent = 0;
            while sent < len {
                if stream.write_all(chunk.as_bytes()).is_err() {
                    return;
                }
                sent += chunk.len();
            }
            let _ = stream.write_all(b"\"}");
            return;
        }
    };
    let _ = write!(
        stream,
        "HTTP/1.1 {status} X\r\ncontent-type: application/json\r\n{extra}content-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
}

/// The HMAC of a call's `X-Nrtxn-Signature` (`t=MS,v1=HEX` over `{t}.{body}`) holds, and
/// its time is now.
fn assert_signed(secret: &str, header: &str, body: &str) {
    let (t, v1) = header
        .strip_prefix("t=")
        .and_then(|h| h.split_once(",v1="))
        .unwrap_or_else(|| panic!("signature header {header:?}"));
    let mut mac = <Hmac<Sha256> as KeyInit>::new_from_slice(secret.as_bytes()).unwrap();
    mac.update(format!("{t}.{body}").as_bytes());
    assert_eq!(v1, hex::encode(mac.finalize().into_bytes()), "{header}");
    let t: i64 = t.parse().unwrap();
    assert!((now_ms() - t).abs() < 60_000, "signed at {t}");
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

/// A clean stop leaves the settings file whole, with no `-wal` or `-shm` beside it (an
/// operator copying the data dir of a stopped server copies one file), and a restart
/// reads the settings back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clean_stop_leaves_the_settings_file_whole_with_no_wal_beside_it() {
    let dir = tempfile::tempdir().unwrap();
    let mut server = Server::start(dir.path(), &[]);
    let c = client();
    let (code, set) = put_settings(
        &c,
        &server,
        json!({"check_url": "https://shop.example/check", "check_timeout_ms": 500}),
    )
    .await;
    assert_eq!(code, 200, "{set}");
    assert!(server.terminate().success());
    let data = dir.path().join("data");
    for left in ["checks.sqlite-wal", "checks.sqlite-shm"] {
        assert!(!data.join(left).exists(), "{left} left after a clean stop");
    }
    let server = Server::start(dir.path(), &[]);
    let (_, read) = get(&c, &server.url("/v1/shops/s/settings")).await;
    assert_eq!(read["check_url"], "https://shop.example/check", "{read}");
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
    assert_signed(&secret, sig, body);
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
        (
            "h-garbage",
            Answer::Json(json!({"action": "maybe", "detail": INSIDE_TEXT})),
        ),
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
    assert_eq!(dead["dead_letters"][0]["error"], "status 503", "{dead}");
    assert!(
        dead["dead_letters"][1]["error"]
            .as_str()
            .unwrap()
            .starts_with("timeout"),
        "{dead}"
    );
    // Short reasons: nothing of the answers, nothing of the URL.
    let text = dead.to_string();
    for leak in [INSIDE_TEXT, "127.0.0.1", "/check"] {
        assert!(!text.contains(leak), "{leak} in {dead}");
    }
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
    assert_signed(&secret, &sig, &body);
    drop_database(&uri).await;
}

async fn put_shop_settings(
    c: &reqwest::Client,
    server: &Server,
    shop: &str,
    body: Value,
) -> (u16, Value) {
    call(
        c,
        reqwest::Method::PUT,
        &server.url(&format!("/v1/shops/{shop}/settings")),
        Some(body.to_string()),
    )
    .await
}

async fn dead_letters(c: &reqwest::Client, server: &Server, shop: &str) -> Vec<Value> {
    let (_, dead) = get(c, &server.url(&format!("/v1/shops/{shop}/dead-letters"))).await;
    dead["dead_letters"].as_array().cloned().unwrap_or_default()
}

/// Kilobytes of a process's memory line (`VmRSS`, `VmHWM`) in /proc/PID/status.
fn memory_kb(pid: u32, line: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix(line)?.strip_prefix(':'))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or_else(|| panic!("no {line} in /proc/{pid}/status"))
}

/// With the server's own defaults, a `check_url` whose host is an inside address (an IP
/// literal in any of its spellings, or `localhost`) or a plain `http` one is refused at
/// the settings call, naming the field; `--check-allow-http` lets `http` through, not
/// inside addresses.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inside_addresses_and_plain_http_are_refused_in_the_settings() {
    let dir = tempfile::tempdir().unwrap();
    let strict = Server::start_strict(dir.path(), &[]);
    let c = client();
    for url in [
        "https://127.0.0.1:9/c",
        "https://[::1]/c",
        "https://[::ffff:169.254.169.254]/c",
        "https://169.254.169.254/latest/meta-data",
        "https://10.1.2.3/c",
        "https://192.168.0.1/c",
        "https://[fd00::1]/c",
        "https://2130706433/c",
        "https://0.0.0.0/c",
        "https://localhost:8443/c",
        "http://shop.example/c",
    ] {
        let (code, answer) = put_settings(&c, &strict, json!({ "check_url": url })).await;
        assert_eq!(code, 400, "{url} -> {answer}");
        let detail = answer["detail"].as_str().unwrap();
        assert!(detail.starts_with("check_url:"), "{url} -> {answer}");
    }
    let (_, answer) =
        put_settings(&c, &strict, json!({"check_url": "http://shop.example/c"})).await;
    assert!(
        answer["detail"]
            .as_str()
            .unwrap()
            .contains("--check-allow-http"),
        "{answer}"
    );
    let (code, answer) =
        put_settings(&c, &strict, json!({"check_url": "https://shop.example/c"})).await;
    assert_eq!(code, 200, "{answer}");

    let dir = tempfile::tempdir().unwrap();
    let plain = Server::start_strict(dir.path(), &["--check-allow-http"]);
    let (code, answer) =
        put_settings(&c, &plain, json!({"check_url": "http://shop.example/c"})).await;
    assert_eq!(code, 200, "{answer}");
    for url in ["http://127.0.0.1:9/c", "http://localhost:9/c"] {
        let (code, answer) = put_settings(&c, &plain, json!({ "check_url": url })).await;
        assert_eq!(code, 400, "{url} -> {answer}");
        assert!(answer["detail"]
            .as_str()
            .unwrap()
            .contains("--check-allow-net"));
    }

    // The operator's networks, from the environment (comma-separated).
    let dir = tempfile::tempdir().unwrap();
    let nets = Server::start_strict_env(
        dir.path(),
        &[],
        &[
            ("NRTXN_CHECK_ALLOW_NET", "10.0.0.0/8,192.168.0.0/16"),
            ("NRTXN_CHECK_ALLOW_HTTP", "true"),
        ],
    );
    for (url, expected) in [
        ("http://10.1.2.3/c", 200),
        ("http://192.168.1.1/c", 200),
        ("http://[::ffff:10.0.0.1]/c", 200),
        ("http://127.0.0.1/c", 400),
        ("http://172.16.0.1/c", 400),
    ] {
        let (code, answer) = put_settings(&c, &nets, json!({ "check_url": url })).await;
        assert_eq!(code, expected, "{url} -> {answer}");
    }
    // A network that is not one is refused at start, naming the option.
    let dir = tempfile::tempdir().unwrap();
    let (status, stderr) = serve_expecting_exit(dir.path(), &["--check-allow-net", "10.0.0.0/33"]);
    assert!(!status.success());
    assert!(stderr.contains("check_allow_net:"), "{stderr}");
}

/// The check is made on what a name resolves to, at each call: `localhost`, saved while
/// the operator allowed loopback, is refused once they no longer do, also with plain
/// `http` allowed; the shop's local server is never contacted, and the dead letter says
/// why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_name_resolving_inside_is_refused_at_call_time_even_with_plain_http() {
    let dir = tempfile::tempdir().unwrap();
    let shop = ShopServer::start();
    shop.answer(Answer::Json(json!({"action": "confirm"})));
    let url = shop.url.replace("127.0.0.1", "localhost");
    let c = client();
    let mut allowed = Server::start(dir.path(), &[]);
    let (code, set) = put_settings(
        &c,
        &allowed,
        json!({"check_url": url, "check_timeout_ms": 300, "check_retries": 1}),
    )
    .await;
    assert_eq!(code, 200, "{set}");
    allowed.kill();

    let server = Server::start_strict(dir.path(), &["--check-allow-http"]);
    load(&c, &server, "s", &[("a", 10)]).await;
    hold(&c, &server, "h-local", 100).await;
    let done = ended(&c, &server, "h-local", Duration::from_secs(10)).await;
    assert_eq!(done["status"], "expired", "{done}");
    let dead = dead_letters(&c, &server, "s").await;
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert_eq!(dead[0]["error"], "address not allowed", "{dead:?}");
    assert_eq!(dead[0]["attempts"], 2);
    assert!(shop.calls().is_empty(), "the local server was called");
}

/// A `3xx` is a failed attempt: its target is never called, and the dead letter names the
/// redirect, not where it pointed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redirect_is_not_followed() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path(), &[]);
    let target = ShopServer::start();
    target.answer(Answer::Json(json!({"action": "confirm"})));
    let shop = ShopServer::start();
    shop.answer(Answer::Redirect(format!("{}?token=t0ps3cret", target.url)));
    let c = client();
    load(&c, &server, "s", &[("a", 10)]).await;
    let (code, set) = put_settings(
        &c,
        &server,
        json!({"check_url": shop.url, "check_timeout_ms": 500, "check_retries": 1}),
    )
    .await;
    assert_eq!(code, 200, "{set}");
    hold(&c, &server, "h-redirect", 100).await;
    let done = ended(&c, &server, "h-redirect", Duration::from_secs(10)).await;
    assert_eq!(done["status"], "expired", "{done}");
    assert_eq!(shop.calls().len(), 2, "both attempts went to the shop");
    assert!(target.calls().is_empty(), "the redirect was followed");
    let dead = dead_letters(&c, &server, "s").await;
    assert_eq!(dead.len(), 1, "{dead:?}");
    let error = dead[0]["error"].as_str().unwrap();
    assert!(error.contains("redirect 302"), "{error}");
    for leak in ["t0ps3cret", "127.0.0.1", "/check"] {
        assert!(!error.contains(leak), "{error}");
    }
}

/// Twenty shops' check-backs answered at once with 8 MiB each: each is read up to 64 KiB
/// and then fails (the default applies; the dead letter quotes nothing of the answer),
/// and the server's peak memory grows by less than 20 MB.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn answers_too_large_fail_and_twenty_at_once_stay_in_bounded_memory() {
    const SHOPS: usize = 20;
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path(), &[]);
    let shop = ShopServer::start();
    shop.answer(Answer::Big(8 << 20, SHOPS));
    let c = client();
    for i in 0..SHOPS {
        let name = format!("s{i}");
        load(&c, &server, &name, &[("a", 10)]).await;
        let (code, set) = put_shop_settings(
            &c,
            &server,
            &name,
            json!({"check_url": shop.url, "check_timeout_ms": 10_000, "check_retries": 0}),
        )
        .await;
        assert_eq!(code, 200, "{set}");
    }
    let rss_before_kb = memory_kb(server.pid(), "VmRSS");
    let holds = (0..SHOPS).map(|i| {
        let (c, url) = (c.clone(), server.url(&format!("/v1/shops/s{i}/holds")));
        async move {
            let (code, body) = post(
                &c,
                &url,
                json!({"request_id": "h-big", "item": "a", "qty": 1, "ttl_ms": 300}),
            )
            .await;
            assert_eq!((code, &body["status"]), (200, &json!("held")), "{body}");
        }
    });
    futures::future::join_all(holds).await;
    let mut ends = Vec::new();
    for i in 0..SHOPS {
        let url = server.url(&format!("/v1/shops/s{i}/holds/h-big"));
        let started = Instant::now();
        ends.push(loop {
            let (_, h) = get(&c, &url).await;
            // `checking` while the shop is asked, past the hold's expiry.
            let open = h["status"] == "held" || h["status"] == "checking";
            if !open || started.elapsed() > Duration::from_secs(20) {
                break h;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        });
    }
    let peak_kb = memory_kb(server.pid(), "VmHWM");
    assert!(
        shop.in_flight_max.load(Ordering::SeqCst) >= SHOPS / 2,
        "the answers were not at once"
    );
    let grown_kb = peak_kb.saturating_sub(rss_before_kb);
    eprintln!("RSS {rss_before_kb} kB before, peak {peak_kb} kB after");
    assert!(grown_kb < 20 * 1024, "peak RSS grew by {grown_kb} kB");
    for (i, h) in ends.iter().enumerate() {
        assert_eq!(h["status"], "expired", "s{i}: {h}");
    }
    for i in 0..SHOPS {
        let dead = dead_letters(&c, &server, &format!("s{i}")).await;
        assert_eq!(dead.len(), 1, "s{i}: {dead:?}");
        let error = dead[0]["error"].as_str().unwrap();
        assert!(error.starts_with("answer too large"), "{error}");
        assert!(
            !error.contains(INSIDE_TEXT) && error.len() <= 200,
            "{error}"
        );
    }
}

/// A shop's check-backs in flight are bounded (4 per shop): eight holds due at once are
/// all decided by the shop, at most four calls at a time, the others waiting their turn
/// (not failing).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shops_check_backs_in_flight_are_bounded_and_the_rest_wait_their_turn() {
    const HOLDS: usize = 8;
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path(), &[]);
    let shop = ShopServer::start();
    shop.answer(Answer::Slow(
        Duration::from_millis(300),
        json!({"action": "confirm"}),
    ));
    let c = client();
    load(&c, &server, "s", &[("a", 100)]).await;
    let (code, set) = put_settings(
        &c,
        &server,
        json!({"check_url": shop.url, "check_timeout_ms": 1_000, "check_retries": 0}),
    )
    .await;
    assert_eq!(code, 200, "{set}");
    let holds = (0..HOLDS).map(|i| {
        let (c, url) = (c.clone(), server.url("/v1/shops/s/holds"));
        async move {
            let (code, body) = post(
                &c,
                &url,
                json!({"request_id": format!("h-{i}"), "item": "a", "qty": 1, "ttl_ms": 200}),
            )
            .await;
            assert_eq!((code, &body["status"]), (200, &json!("held")), "{body}");
        }
    });
    futures::future::join_all(holds).await;
    // Meanwhile `nrtxn_bound_used` shows the calls in flight and those waiting.
    let (mut in_flight_seen, mut waiting_seen) = (0, 0);
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(3) && waiting_seen == 0 {
        let text = metrics_text(&c, &server).await;
        let value = |bound: &str| {
            text.lines()
                .find_map(|l| {
                    l.strip_prefix(&format!("nrtxn_bound_used{{bound=\"{bound}\"}} "))?
                        .parse::<u64>()
                        .ok()
                })
                .unwrap_or(0)
        };
        in_flight_seen = in_flight_seen.max(value("checks_in_flight"));
        waiting_seen = waiting_seen.max(value("checks_waiting"));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(waiting_seen > 0, "no check-back seen waiting its turn");
    assert!(in_flight_seen <= 4, "{in_flight_seen} in flight");
    for i in 0..HOLDS {
        let done = ended(&c, &server, &format!("h-{i}"), Duration::from_secs(15)).await;
        assert_eq!(done["status"], "confirmed", "h-{i}: {done}");
    }
    let most = shop.in_flight_max.load(Ordering::SeqCst);
    assert!((2..=4).contains(&most), "{most} calls at once");
    assert!(dead_letters(&c, &server, "s").await.is_empty());
    for bound in ["checks_in_flight", "checks_waiting"] {
        let name = format!("nrtxn_bound_used{{bound=\"{bound}\"}}");
        assert_eq!(metric(&c, &server, &name).await, 0, "{name}");
    }
}

/// The Python receiver of docs/examples (run with `NRTXN_TEST_PYTHON`, else `python3`)
/// verifies the signature and confirms a hold through it; a replayed call, a tampered
/// one and an old one are refused by it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_python_receiver_verifies_the_signature_and_refuses_replays() {
    struct Receiver(std::process::Child);
    impl Drop for Receiver {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let python = std::env::var("NRTXN_TEST_PYTHON").unwrap_or_else(|_| "python3".into());
    let dir = tempfile::tempdir().unwrap();
    let secret_file = dir.path().join("check_secret");
    std::fs::write(&secret_file, "").unwrap();
    let mut child = std::process::Command::new(&python)
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/docs/examples/checkback_receiver.py"
        ))
        .arg("--secret-file")
        .arg(&secret_file)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("{python}: {e}"));
    let stdout = child.stdout.take().unwrap();
    let _receiver = Receiver(child);
    let mut lines = BufReader::new(stdout).lines();
    let first = lines.next().unwrap().unwrap();
    let port: u16 = first
        .strip_prefix("listening on ")
        .unwrap()
        .parse()
        .unwrap();
    let seen: Arc<Mutex<Vec<Value>>> = Arc::default();
    let into = seen.clone();
    std::thread::spawn(move || {
        for line in lines.map_while(Result::ok) {
            into.lock()
                .unwrap()
                .push(serde_json::from_str(&line).unwrap());
        }
    });

    let server = Server::start(dir.path(), &[]);
    let c = client();
    load(&c, &server, "s", &[("a", 10)]).await;
    let url = format!("http://127.0.0.1:{port}/check");
    let (code, set) = put_settings(&c, &server, json!({ "check_url": url })).await;
    assert_eq!(code, 200, "{set}");
    let secret = set["check_secret"].as_str().unwrap().to_string();
    std::fs::write(&secret_file, &secret).unwrap();
    hold(&c, &server, "h-py", 100).await;
    let done = ended(&c, &server, "h-py", Duration::from_secs(10)).await;
    assert_eq!(
        done["status"],
        "confirmed",
        "{done} {:?}",
        seen.lock().unwrap()
    );
    let accepted = seen
        .lock()
        .unwrap()
        .iter()
        .find(|l| l["accepted"] == true)
        .cloned()
        .unwrap();
    let (signature, body) = (
        accepted["signature"].as_str().unwrap().to_string(),
        accepted["body"].as_str().unwrap().to_string(),
    );
    assert!(body.contains("h-py"), "{body}");

    let send = |signature: String, body: String| {
        let (c, url) = (c.clone(), url.clone());
        async move {
            c.post(&url)
                .header("content-type", "application/json")
                .header("x-nrtxn-signature", signature)
                .body(body)
                .send()
                .await
                .unwrap()
                .status()
                .as_u16()
        }
    };
    let sign_at = |t: i64, body: &str| {
        let mut mac = <Hmac<Sha256> as KeyInit>::new_from_slice(secret.as_bytes()).unwrap();
        mac.update(format!("{t}.{body}").as_bytes());
        format!("t={t},v1={}", hex::encode(mac.finalize().into_bytes()))
    };
    assert_eq!(send(signature.clone(), body.clone()).await, 409, "replayed");
    let tampered = body.replace("\"qty\":1", "\"qty\":9");
    assert_ne!(tampered, body);
    assert_eq!(send(signature.clone(), tampered).await, 401, "tampered");
    let (t, _) = signature
        .strip_prefix("t=")
        .and_then(|s| s.split_once(','))
        .unwrap();
    let later = format!(
        "t={},{}",
        t.parse::<i64>().unwrap() + 1,
        signature.split_once(',').unwrap().1
    );
    assert_eq!(
        send(later, body.clone()).await,
        401,
        "another time, same MAC"
    );
    let old = now_ms() - 6 * 60 * 1000;
    assert_eq!(send(sign_at(old, &body), body.clone()).await, 401, "old");
    assert_eq!(
        send(sign_at(now_ms(), &body), body.clone()).await,
        200,
        "fresh"
    );
}
