//! Test support: the real `nrtxn` binary as a child process on an ephemeral port, and a
//! small HTTP client over it.

#![allow(dead_code)]

pub mod holds;
pub mod load;
pub mod nodes;
pub mod receiver;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

use serde_json::{json, Value};

pub struct Server {
    child: Option<Child>,
    pub base: String,
    pub dir: PathBuf,
    /// Every line the server printed on stdout so far (its addresses).
    pub stdout: Arc<Mutex<Vec<String>>>,
}

/// Flags every test server gets (but [`Server::start_strict`]'s): the shops' check-backs
/// may reach the tests' own small servers, on loopback over plain http, which a server
/// refuses by default.
pub const CHECKS_ON_LOOPBACK: &[&str] = &["--check-allow-http", "--check-allow-net", "127.0.0.0/8"];

impl Server {
    /// Starts `nrtxn serve` on `dir` and waits until it prints its address.
    pub fn start(dir: &Path, extra: &[&str]) -> Server {
        Server::start_on(dir, "127.0.0.1:0", extra)
    }

    /// [`Server::start`] with these environment variables set (faults to inject).
    pub fn start_env(dir: &Path, extra: &[&str], env: &[(&str, &str)]) -> Server {
        Server::spawn(dir, "127.0.0.1:0", CHECKS_ON_LOOPBACK, extra, env)
    }

    /// [`Server::start`] listening on `listen`.
    pub fn start_on(dir: &Path, listen: &str, extra: &[&str]) -> Server {
        Server::spawn(dir, listen, CHECKS_ON_LOOPBACK, extra, &[])
    }

    /// [`Server::start`] with the data dir at `data` (on a disk of its own, say), its log
    /// still in `dir`.
    pub fn start_data_at(dir: &Path, data: &Path, extra: &[&str]) -> Server {
        let mut args = vec!["--data-dir", data.to_str().expect("a UTF-8 path")];
        args.extend_from_slice(extra);
        Server::spawn_in(dir, None, "127.0.0.1:0", CHECKS_ON_LOOPBACK, &args, &[])
    }

    /// [`Server::start`] with the server's own defaults for check-backs (https only,
    /// nothing inside), not [`CHECKS_ON_LOOPBACK`].
    pub fn start_strict(dir: &Path, extra: &[&str]) -> Server {
        Server::spawn(dir, "127.0.0.1:0", &[], extra, &[])
    }

    /// [`Server::start_strict`] with these environment variables set.
    pub fn start_strict_env(dir: &Path, extra: &[&str], env: &[(&str, &str)]) -> Server {
        Server::spawn(dir, "127.0.0.1:0", &[], extra, env)
    }

    fn spawn(
        dir: &Path,
        listen: &str,
        checks: &[&str],
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> Server {
        Server::spawn_in(dir, Some(&dir.join("data")), listen, checks, extra, env)
    }

    /// `data`: the data dir, or `None` when `extra` names it.
    fn spawn_in(
        dir: &Path,
        data: Option<&Path>,
        listen: &str,
        checks: &[&str],
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> Server {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.join("server.log"))
            .expect("server log");
        let mut command = Command::new(env!("CARGO_BIN_EXE_nrtxn"));
        command.args(["serve", "--listen", listen]);
        if let Some(data) = data {
            command.arg("--data-dir").arg(data);
        }
        let mut child = command
            .args(checks)
            .args(extra)
            .env("RUST_LOG", "warn,nrtxn=info")
            .envs(env.iter().copied())
            .stdout(Stdio::piped())
            .stderr(log)
            .spawn()
            .expect("spawn nrtxn");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, rx) = mpsc::channel();
        let lines = Arc::new(Mutex::new(Vec::new()));
        let seen = lines.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                seen.lock().unwrap().push(line.clone());
                if let Some(addr) = line.strip_prefix("nrtxn listening on ") {
                    let _ = tx.send(addr.to_string());
                }
            }
        });
        let base = match rx.recv_timeout(Duration::from_secs(60)) {
            Ok(base) => base,
            Err(_) => {
                let _ = child.kill();
                let log = std::fs::read_to_string(dir.join("server.log")).unwrap_or_default();
                panic!("nrtxn did not start; its log:\n{log}");
            }
        };
        Server {
            child: Some(child),
            base,
            dir: dir.to_path_buf(),
            stdout: lines,
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{}", self.base, path)
    }

    /// The process id (while it runs).
    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("running").id()
    }

    /// SIGKILL: no shutdown code runs.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            c.kill().expect("kill");
            c.wait().expect("wait");
        }
    }

    /// SIGTERM, then the exit status.
    pub fn terminate(&mut self) -> ExitStatus {
        let mut c = self.child.take().expect("running");
        let status = Command::new("kill")
            .args(["-TERM", &c.id().to_string()])
            .status()
            .expect("kill -TERM");
        assert!(status.success());
        c.wait().expect("wait")
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.kill();
    }
}

pub fn client() -> reqwest::Client {
    client_within(Duration::from_secs(30))
}

/// [`client`], giving up on a call after `timeout`.
pub fn client_within(timeout: Duration) -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(timeout)
        // Well inside the server's keep-alive (actix-web's 5 s): a connection idle longer
        // is not reused. Otherwise a test that waits about 5 s between two calls (for a
        // 408, an expiry) can send its next call on a connection the server is closing
        // at that moment, and get `IncompleteMessage` (seen in tests/edge.rs and, last
        // stop, tests/dashboard.rs).
        .pool_idle_timeout(Duration::from_secs(2))
        .build()
        .expect("client")
}

/// Sends a request and returns the status and JSON body (Null when not JSON).
pub async fn call(
    client: &reqwest::Client,
    method: reqwest::Method,
    url: &str,
    body: Option<String>,
) -> (u16, Value) {
    let mut req = client.request(method, url);
    if let Some(b) = body {
        req = req.header("content-type", "application/json").body(b);
    }
    let res = req.send().await.expect("request");
    let status = res.status().as_u16();
    let text = res.text().await.expect("body");
    (status, serde_json::from_str(&text).unwrap_or(Value::Null))
}

/// The server's metrics, as text.
pub async fn metrics_text(c: &reqwest::Client, server: &Server) -> String {
    c.get(server.url("/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

/// One sample of a server's metrics, by its name with labels (0 when absent).
pub async fn metric(c: &reqwest::Client, server: &Server, name: &str) -> u64 {
    metrics_text(c, server)
        .await
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{name} "))?.parse::<f64>().ok())
        .unwrap_or(0.0) as u64
}

/// The status line of the answer on `s`, waiting up to `wait` ("" if none came).
pub fn status_line(s: &mut std::net::TcpStream, wait: Duration) -> String {
    use std::io::Read;
    s.set_read_timeout(Some(wait)).unwrap();
    let mut buf = [0u8; 512];
    let n = s.read(&mut buf).unwrap_or(0);
    String::from_utf8_lossy(&buf[..n])
        .lines()
        .next()
        .unwrap_or("")
        .to_string()
}

pub async fn post(client: &reqwest::Client, url: &str, body: Value) -> (u16, Value) {
    call(client, reqwest::Method::POST, url, Some(body.to_string())).await
}

pub async fn get(client: &reqwest::Client, url: &str) -> (u16, Value) {
    call(client, reqwest::Method::GET, url, None).await
}

pub async fn load(client: &reqwest::Client, server: &Server, shop: &str, items: &[(&str, i64)]) {
    let items: Vec<Value> = items
        .iter()
        .map(|(item, stock)| json!({ "item": item, "stock": stock }))
        .collect();
    let (status, body) = call(
        client,
        reqwest::Method::PUT,
        &server.url(&format!("/v1/shops/{shop}/items")),
        Some(json!({ "items": items }).to_string()),
    )
    .await;
    assert_eq!(status, 200, "{body}");
}

/// Polls a key until it is decided (200) or unknown (404), for up to 30 s.
pub async fn poll_decided(
    client: &reqwest::Client,
    server: &Server,
    shop: &str,
    key: &str,
) -> (u16, Value) {
    let url = server.url(&format!("/v1/shops/{shop}/txns/{key}"));
    for _ in 0..600 {
        let (status, body) = get(client, &url).await;
        if status != 202 {
            return (status, body);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("{key} still pending after 30 s");
}

/// A MongoDB URI with a database of its own for one test, from `NRTXN_TEST_MONGO_URI`
/// (which `scripts/test.sh` sets after starting the test servers). `None` when unset and
/// servers are not required: the test then says it was skipped. With
/// `NRTXN_REQUIRE_SERVICES=1` (CI) a missing URI fails the test.
pub fn mongo_uri(test: &str) -> Option<String> {
    match std::env::var("NRTXN_TEST_MONGO_URI") {
        Ok(base) => {
            let db = format!("nrtxn_{test}_{}", std::process::id());
            let (head, query) = base.split_once('?').unwrap_or((&base, ""));
            let head = head.trim_end_matches('/');
            Some(format!("{head}/{db}?{query}"))
        }
        Err(_) if std::env::var("NRTXN_REQUIRE_SERVICES").is_ok() => {
            panic!("NRTXN_TEST_MONGO_URI is not set but NRTXN_REQUIRE_SERVICES is")
        }
        Err(_) => {
            eprintln!("SKIPPED {test}: no NRTXN_TEST_MONGO_URI (run scripts/test.sh)");
            None
        }
    }
}

/// Drops a test's database: the MongoDB-protocol test server slows down as the data it
/// stores grows, so each test cleans up after itself when it passes.
pub async fn drop_database(uri: &str) {
    let client = mongodb::Client::with_uri_str(uri).await.expect("mongo uri");
    client
        .default_database()
        .expect("a test uri names its database")
        .drop()
        .await
        .expect("drop the test database");
}

/// Waits until `/readyz` answers 200 (a Kafka reader pool has joined its group), for up
/// to 90 s.
pub async fn wait_ready(client: &reqwest::Client, server: &Server) {
    for _ in 0..900 {
        if get(client, &server.url("/readyz")).await.0 == 200 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("{} never became ready", server.base);
}

/// Flags for a server whose request log is on the test Kafka broker, with a topic and a
/// group of its own, from `NRTXN_TEST_KAFKA_BROKERS` (set by `scripts/test.sh`). `None`
/// (the test is skipped) when unset and servers are not required.
pub fn kafka_flags(test: &str) -> Option<Vec<String>> {
    match std::env::var("NRTXN_TEST_KAFKA_BROKERS") {
        Ok(brokers) => {
            let name = format!("nrtxn-test-{test}-{}", std::process::id());
            Some(vec![
                "--kafka-brokers".into(),
                brokers,
                "--kafka-requests-topic".into(),
                name.clone(),
                "--kafka-group".into(),
                name.clone(),
                "--kafka-responses-topic".into(),
                format!("{name}.responses"),
                "--kafka-events-topic".into(),
                format!("{name}.events"),
                "--kafka-partitions".into(),
                "4".into(),
            ])
        }
        Err(_) if std::env::var("NRTXN_REQUIRE_SERVICES").is_ok() => {
            panic!("NRTXN_TEST_KAFKA_BROKERS is not set but NRTXN_REQUIRE_SERVICES is")
        }
        Err(_) => {
            eprintln!("SKIPPED {test}: no NRTXN_TEST_KAFKA_BROKERS (run scripts/test.sh)");
            None
        }
    }
}

/// Runs `nrtxn serve` that is expected to refuse to start: its exit status and stderr.
pub fn serve_expecting_exit(dir: &Path, args: &[&str]) -> (std::process::ExitStatus, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_nrtxn"))
        .arg("serve")
        .args(args)
        .arg("--data-dir")
        .arg(dir.join("data"))
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn nrtxn");
    let start = std::time::Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if start.elapsed() > Duration::from_secs(30) {
            let _ = child.kill();
            panic!("nrtxn serve {args:?} did not exit");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut stderr = String::new();
    use std::io::Read;
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut stderr)
        .unwrap();
    (status, stderr)
}

/// `nrtxn ARGS` (a command other than `serve`: `keys`, `backup`, ...) with the test's
/// environment's `NRTXN_*` variables out of the way, so only the arguments count.
pub fn nrtxn(args: &[&str]) -> std::process::Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_nrtxn"));
    cmd.args(args).env("RUST_LOG", "warn");
    for (key, _) in std::env::vars_os() {
        if key.to_string_lossy().starts_with("NRTXN_") {
            cmd.env_remove(key);
        }
    }
    cmd.output().expect("run nrtxn")
}

/// Creates a key in the data dir `data` and returns its secret (alone on stdout).
pub fn create_key_in(data: &Path, shop: Option<&str>, role: &str) -> String {
    let data = data.to_str().expect("a UTF-8 path");
    let mut args = vec!["keys", "create", "--role", role, "--data-dir", data];
    if let Some(shop) = shop {
        args.extend(["--shop", shop]);
    }
    let out = nrtxn(&args);
    assert!(out.status.success(), "keys create failed: {out:?}");
    String::from_utf8(out.stdout)
        .expect("UTF-8")
        .trim_end()
        .to_string()
}

/// A request's headers (names in lower case, in order) and body.
pub type HttpRequest = (Vec<(String, String)>, Vec<u8>);

/// Reads one HTTP/1.1 request from `stream` (a test's own small server): its headers,
/// names in lower case, and its body (by `content-length`). `None` if the caller hung up.
pub fn read_http_request(stream: &std::net::TcpStream) -> Option<HttpRequest> {
    use std::io::Read;
    let mut reader = BufReader::new(stream.try_clone().ok()?);
    let mut headers = Vec::new();
    let mut line = String::new();
    loop {
        line.clear();
        if reader.read_line(&mut line).unwrap_or(0) == 0 {
            return None;
        }
        let l = line.trim_end();
        if l.is_empty() {
            break;
        }
        if let Some((k, v)) = l.split_once(':') {
            headers.push((k.to_ascii_lowercase(), v.trim().to_string()));
        }
    }
    let len = headers
        .iter()
        .find(|(k, _)| k == "content-length")
        .and_then(|(_, v)| v.parse().ok())
        .unwrap_or(0usize);
    let mut body = vec![0u8; len];
    reader.read_exact(&mut body).ok()?;
    Some((headers, body))
}
