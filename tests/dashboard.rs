//! The dashboard at `/`, in a real browser: Debian's Chromium, headless, driven by
//! ChromeDriver over the WebDriver protocol (plain HTTP, so no client crate), against the
//! real server. `scripts/browser.sh` installs both; `scripts/test.sh` calls it.
//!
//! The screenshots are kept in `target/test-artifacts/`.

mod common;

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use base64::Engine as _;
use common::*;
use serde_json::{json, Value};

const CHROMIUM: &str = "/usr/bin/chromium";
const CHROMEDRIVER: &str = "/usr/bin/chromedriver";
/// What the issue promises: a decision is on the page within this.
const PAGE_SHOWS_WITHIN: Duration = Duration::from_secs(2);
/// The WebDriver key for an element reference.
const ELEMENT: &str = "element-6066-11e4-a52e-4f735466cecf";

/// A headless Chromium session through its own ChromeDriver.
struct Browser {
    driver: Child,
    base: String,
    session: String,
    http: reqwest::Client,
    _profile: tempfile::TempDir,
}

impl Browser {
    /// `None` (the test is skipped) when Chromium is not installed, unless the test
    /// servers are required (`NRTXN_REQUIRE_SERVICES=1`, as `scripts/test.sh` sets).
    async fn start() -> Option<Browser> {
        if !Path::new(CHROMIUM).exists() || !Path::new(CHROMEDRIVER).exists() {
            assert!(
                std::env::var("NRTXN_REQUIRE_SERVICES").as_deref() != Ok("1"),
                "{CHROMIUM} or {CHROMEDRIVER} is missing: run scripts/browser.sh install"
            );
            eprintln!("skipped: no {CHROMIUM} or {CHROMEDRIVER} (scripts/browser.sh install)");
            return None;
        }
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        // In a process group of its own, so that its browser goes with it (below).
        let driver = Command::new(CHROMEDRIVER)
            .process_group(0)
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start chromedriver");
        let base = format!("http://127.0.0.1:{port}");
        let http = client();
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Ok(r) = http.get(format!("{base}/status")).send().await {
                let v: Value = r.json().await.unwrap_or_default();
                if v["value"]["ready"] == json!(true) {
                    break;
                }
            }
            assert!(Instant::now() < deadline, "chromedriver did not start");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let profile = tempfile::tempdir().unwrap();
        // The flags the machine's notes give for Chromium as root on a closed network:
        // without the background-networking ones it keeps trying to reach Google.
        let args = [
            "--headless=new".to_string(),
            "--no-sandbox".into(),
            "--disable-gpu".into(),
            "--disable-quic".into(),
            "--no-first-run".into(),
            "--disable-background-networking".into(),
            "--disable-component-update".into(),
            "--disable-sync".into(),
            "--disable-dev-shm-usage".into(),
            "--window-size=1280,1100".into(),
            format!("--user-data-dir={}", profile.path().display()),
        ];
        let caps = json!({ "capabilities": { "alwaysMatch": {
            "browserName": "chrome",
            "goog:chromeOptions": { "binary": CHROMIUM, "args": args },
        } } });
        let r: Value = http
            .post(format!("{base}/session"))
            .json(&caps)
            .send()
            .await
            .expect("new session")
            .json()
            .await
            .unwrap();
        let session = r["value"]["sessionId"]
            .as_str()
            .unwrap_or_else(|| panic!("no session: {r}"))
            .to_string();
        Some(Browser {
            driver,
            base,
            session,
            http,
            _profile: profile,
        })
    }

    async fn cmd(&self, method: reqwest::Method, path: &str, body: Value) -> Value {
        let url = format!("{}/session/{}{path}", self.base, self.session);
        let mut req = self.http.request(method, url);
        if !body.is_null() {
            req = req.json(&body);
        }
        let r: Value = req.send().await.expect("webdriver").json().await.unwrap();
        if let Some(err) = r["value"]["error"].as_str() {
            panic!("webdriver {path}: {err}: {}", r["value"]["message"]);
        }
        r["value"].clone()
    }

    async fn goto(&self, url: &str) {
        self.cmd(reqwest::Method::POST, "/url", json!({ "url": url }))
            .await;
    }

    /// Runs `script` (a function body) in the page and returns its value.
    async fn js(&self, script: &str) -> Value {
        self.cmd(
            reqwest::Method::POST,
            "/execute/sync",
            json!({ "script": script, "args": [] }),
        )
        .await
    }

    /// Waits until `script` returns true; panics with `what` and the page's state after
    /// `within`. Returns how long it took.
    async fn wait_for(&self, what: &str, script: &str, within: Duration) -> Duration {
        let started = Instant::now();
        loop {
            if self.js(script).await == json!(true) {
                return started.elapsed();
            }
            if started.elapsed() > within {
                let page = self.js("return document.body.innerText").await;
                panic!(
                    "{what}: not seen within {within:?}; the page:\n{}",
                    page.as_str().unwrap_or("")
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    async fn element(&self, css: &str) -> String {
        let v = self
            .cmd(
                reqwest::Method::POST,
                "/element",
                json!({ "using": "css selector", "value": css }),
            )
            .await;
        v[ELEMENT]
            .as_str()
            .unwrap_or_else(|| panic!("{css}: no element id in {v}"))
            .to_string()
    }

    /// Types `text` into the element (for a file input: the file's path).
    async fn type_into(&self, css: &str, text: &str) {
        let id = self.element(css).await;
        self.cmd(
            reqwest::Method::POST,
            &format!("/element/{id}/value"),
            json!({ "text": text }),
        )
        .await;
    }

    async fn click(&self, css: &str) {
        let id = self.element(css).await;
        self.cmd(
            reqwest::Method::POST,
            &format!("/element/{id}/click"),
            json!({}),
        )
        .await;
    }

    /// Saves a screenshot of the page in `target/test-artifacts/{name}.png`.
    async fn screenshot(&self, name: &str) -> PathBuf {
        let png = self
            .cmd(reqwest::Method::GET, "/screenshot", Value::Null)
            .await;
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(png.as_str().expect("base64 PNG"))
            .expect("base64");
        assert!(bytes.starts_with(b"\x89PNG"), "not a PNG");
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
            .parent()
            .expect("target/")
            .join("test-artifacts");
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(format!("{name}.png"));
        std::fs::write(&path, bytes).unwrap();
        eprintln!("screenshot: {}", path.display());
        path
    }
}

impl Drop for Browser {
    /// Kills ChromeDriver and the Chromium it started (its process group): killing the
    /// driver alone leaves the browser running, as the first version of this test did.
    fn drop(&mut self) {
        let group = format!("-{}", self.driver.id());
        let _ = Command::new("kill").args(["-KILL", "--", &group]).status();
        let _ = self.driver.wait();
    }
}

/// A client that opens a connection per request. Between its calls the test waits on
/// the browser for seconds, past the server's 5 s keep-alive: a pooled connection could
/// be closed by the server just as a POST is written on it, and hyper does not retry a
/// POST (seen once in CI: `IncompleteMessage`).
fn unpooled_client() -> reqwest::Client {
    reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .timeout(Duration::from_secs(30))
        .build()
        .expect("client")
}

/// A script: the text of the `td.{cell}` of the item's row, or null.
fn cell(item: &str, cell: &str) -> String {
    format!(
        "const r = document.querySelector('#items tr[data-item=\"{item}\"] td.{cell}'); \
         return r ? r.textContent : null"
    )
}

/// A script: whether the `td.{cell}` of the item's row reads `text`.
fn cell_is(item: &str, cell: &str, text: &str) -> String {
    format!(
        "const r = document.querySelector('#items tr[data-item=\"{item}\"] td.{cell}'); \
         return !!r && r.textContent === '{text}'"
    )
}

async fn sell(
    c: &reqwest::Client,
    server: &Server,
    shop: &str,
    id: &str,
    item: &str,
    qty: i64,
) -> Value {
    let (status, body) = post(
        c,
        &server.url(&format!("/v1/shops/{shop}/txns")),
        json!({ "seller": "s1", "item": item, "qty": qty, "request_id": id }),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    body
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_loads_a_csv_and_shows_each_decision_live() {
    let Some(browser) = Browser::start().await else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path(), &[]);
    let c = unpooled_client();
    wait_ready(&c, &server).await;
    browser.goto(&server.url("/#shop=dash")).await;
    browser
        .wait_for(
            "the stream live",
            "return document.getElementById('live').textContent === 'live'",
            Duration::from_secs(10),
        )
        .await;

    // A CSV with a malformed line, a quoted name and a per-buyer limit, loaded from the page.
    let csv = dir.path().join("stock.csv");
    std::fs::write(
        &csv,
        "item,stock,per_buyer_max\nsku-1,10,\nsku-2,5,2\nsku-3,ten,\n\"sku,4\",7,\n",
    )
    .unwrap();
    browser.type_into("#csv", &csv.to_string_lossy()).await;
    browser.click("#csv-load").await;
    browser
        .wait_for(
            "the load's report",
            "return document.getElementById('csv-result').textContent.startsWith('Loaded 3 items')",
            Duration::from_secs(10),
        )
        .await;
    let report = browser
        .js("return document.getElementById('csv-result').textContent")
        .await;
    assert!(
        report.as_str().unwrap().contains("line 4: stock"),
        "the malformed line is named by its number: {report}"
    );
    // The server has what the page loaded; the page shows it.
    let (_, item) = get(&c, &server.url("/v1/shops/dash/items/sku%2C4")).await;
    assert_eq!(item["stock"], 7, "{item}");
    let (status, _) = get(&c, &server.url("/v1/shops/dash/items/sku-3")).await;
    assert_eq!(status, 404, "the malformed line was not loaded");
    for (item, stock) in [("sku-1", "10"), ("sku-2", "5"), ("sku,4", "7")] {
        browser
            .wait_for(
                &format!("{item} at {stock}"),
                &cell_is(item, "stock", stock),
                PAGE_SHOWS_WITHIN,
            )
            .await;
    }

    // Decrements through the API: the page shows the new stock within 2 s of each answer.
    for (i, qty) in [3, 2, 4].iter().enumerate() {
        let answer = sell(&c, &server, "dash", &format!("o-{i}"), "sku-1", *qty).await;
        assert_eq!(answer["status"], "ok", "{answer}");
        let stock = answer["stock_after"].as_i64().unwrap();
        let took = browser
            .wait_for(
                &format!("sku-1 at {stock}"),
                &format!(
                    "const r = document.querySelector('#items tr[data-item=\"sku-1\"]'); \
                     return !!r && r.querySelector('td.stock').textContent === '{stock}' \
                     && r.querySelector('td.seq').textContent === '{}'",
                    answer["seq"]
                ),
                PAGE_SHOWS_WITHIN,
            )
            .await;
        eprintln!("sku-1 at {stock} on the page {took:?} after the answer");
    }
    // A refusal: in the refused list and the status rates, with the decisions charted.
    let refused = sell(&c, &server, "dash", "o-short", "sku-1", 5).await;
    assert_eq!(refused["status"], "insufficient_stock", "{refused}");
    browser
        .wait_for(
            "the refusal listed",
            "return !!document.querySelector('#refused tr[data-key=\"o-short\"]')",
            Duration::from_secs(5),
        )
        .await;
    browser
        .wait_for(
            "the status rates",
            "const ok = document.querySelector('#statuses tr[data-status=\"ok\"] td.num'); \
             const no = document.querySelector('#statuses tr[data-status=\"insufficient_stock\"] td.num'); \
             return !!ok && !!no && Number(ok.textContent) > 0 && Number(no.textContent) > 0",
            Duration::from_secs(5),
        )
        .await;
    let drawn = browser
        .js("return document.querySelector('#chart-rate polyline').getAttribute('points').split(' ').length")
        .await;
    assert_eq!(drawn, json!(120), "a point a second for two minutes");
    let change = browser.js(&cell("sku-1", "change")).await;
    assert!(
        change
            .as_str()
            .unwrap()
            .contains("decrement (insufficient_stock) 5"),
        "the last change is the refused decrement: {change}"
    );
    // A sale window set by a load shows in the item's row, through the stream.
    let window =
        json!({"items": [{"item": "sku-2", "stock": 5, "opens_at": 4_102_444_800_000i64}]});
    let (status, _) = call(
        &c,
        reqwest::Method::PUT,
        &server.url("/v1/shops/dash/items"),
        Some(window.to_string()),
    )
    .await;
    assert_eq!(status, 200);
    browser
        .wait_for(
            "the sale window shown",
            "const r = document.querySelector('#items tr[data-item=\"sku-2\"] td.window'); \
             return !!r && r.textContent.startsWith('opens ')",
            Duration::from_secs(5),
        )
        .await;
    browser.screenshot("dashboard").await;
}

/// A key as `nrtxn keys create` makes it, in the server's data dir.
fn create_key(data: &Path, shop: &str, role: &str) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_nrtxn"))
        .args([
            "keys",
            "create",
            "--role",
            role,
            "--shop",
            shop,
            "--data-dir",
        ])
        .arg(data)
        .env("RUST_LOG", "warn")
        .output()
        .expect("nrtxn keys create");
    assert!(out.status.success(), "{out:?}");
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_keys_the_dashboard_asks_for_one_and_shows_what_it_may_see() {
    let Some(browser) = Browser::start().await else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let seller = create_key(&data, "keyed", "seller");
    let operator = create_key(&data, "keyed", "operator");
    let server = Server::start(dir.path(), &[]);
    let c = unpooled_client();
    wait_ready(&c, &server).await;
    let r = c
        .put(server.url("/v1/shops/keyed/items"))
        .bearer_auth(&operator)
        .json(&json!({ "items": [{ "item": "cap", "stock": 4 }] }))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);

    // No key: the page asks for one and shows nothing of a shop, even one it names.
    browser.goto(&server.url("/#shop=other")).await;
    let asks = "return !document.getElementById('key-panel').hidden \
                && document.getElementById('main').hidden";
    browser
        .wait_for("the key asked for", asks, Duration::from_secs(10))
        .await;
    browser.type_into("#key", "nrtxn_nope_nope").await;
    browser.click("#key-form button").await;
    browser
        .wait_for(
            "a refused key said so",
            "return document.getElementById('key-error').textContent.includes('refused')",
            Duration::from_secs(5),
        )
        .await;

    // A seller's key: its own shop's items, and none of the operators' parts.
    browser.type_into("#key", &seller).await;
    browser.click("#key-form button").await;
    browser
        .wait_for(
            "the seller's shop",
            &cell_is("cap", "stock", "4"),
            Duration::from_secs(10),
        )
        .await;
    let seen = browser
        .js("return [document.getElementById('shop').value, document.getElementById('shop').disabled, \
             [...document.querySelectorAll('.operator-only')].every(e => e.hidden), \
             document.getElementById('who').textContent]")
        .await;
    assert_eq!(
        seen[0], "keyed",
        "the key's shop, not the one in the address"
    );
    assert_eq!(seen[1], true, "a shop's key cannot pick another shop");
    assert_eq!(
        seen[2], true,
        "figures, refusals and the CSV load are an operator's"
    );
    assert!(seen[3].as_str().unwrap().contains("seller"), "{seen}");
    // The seller's view follows the stock too (by polling the list).
    let r = c
        .post(server.url("/v1/shops/keyed/txns"))
        .bearer_auth(&seller)
        .json(&json!({ "seller": "s1", "item": "cap", "qty": 1, "request_id": "k-1" }))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    browser
        .wait_for(
            "the seller's view at 3",
            &cell_is("cap", "stock", "3"),
            Duration::from_secs(5),
        )
        .await;

    // An operator's key of the same shop: the live figures and the stream.
    browser.click("#forget-key").await;
    browser
        .wait_for("the key asked for again", asks, Duration::from_secs(5))
        .await;
    browser.type_into("#key", &operator).await;
    browser.click("#key-form button").await;
    browser
        .wait_for(
            "the operator's live view",
            "return document.getElementById('live').textContent === 'live' \
             && !document.getElementById('figures').hidden",
            Duration::from_secs(10),
        )
        .await;
    browser.screenshot("dashboard-operator-key").await;
}
