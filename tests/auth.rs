//! Access keys, roles, protected mode, the per-shop token bucket, /metrics and TLS,
//! through the real binary over real HTTP.

mod common;

use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::{Duration, Instant};

use common::*;
use reqwest::{Method, StatusCode};
use serde_json::{json, Value};

/// How long a revocation or a new key may take to reach a running server (the promise).
const KEYS_PROPAGATION_MAX: Duration = Duration::from_secs(5);

/// The store flags of the server `Server::start(dir, ..)` runs.
fn store_of(dir: &Path) -> Vec<String> {
    vec![
        "--data-dir".into(),
        dir.join("data").to_string_lossy().into_owned(),
    ]
}

fn keys(store: &[String], args: &[&str]) -> Output {
    let mut all: Vec<&str> = vec!["keys"];
    all.extend(args);
    all.extend(store.iter().map(String::as_str));
    nrtxn(&all)
}

/// Creates a key and returns its secret, checking that stdout is exactly it.
fn create(store: &[String], shop: Option<&str>, role: &str) -> String {
    let mut args = vec!["create", "--role", role];
    if let Some(shop) = shop {
        args.extend(["--shop", shop]);
    }
    let out = keys(store, &args);
    assert!(out.status.success(), "keys create failed: {out:?}");
    let stdout = String::from_utf8(out.stdout).unwrap();
    let secret = stdout
        .strip_suffix('\n')
        .expect("stdout ends with a newline");
    assert!(
        !secret.contains('\n') && secret.starts_with("nrtxn_"),
        "stdout is not one secret: {stdout:?}"
    );
    secret.to_string()
}

fn key_id(secret: &str) -> &str {
    secret.split('_').nth(1).expect("nrtxn_{id}_{random}")
}

/// One request with an optional key: status, headers and JSON body (Null if not JSON).
async fn send(
    c: &reqwest::Client,
    method: Method,
    url: &str,
    key: Option<&str>,
    body: Option<Value>,
) -> (StatusCode, reqwest::header::HeaderMap, Value) {
    let mut req = c.request(method, url);
    if let Some(key) = key {
        req = req.bearer_auth(key);
    }
    if let Some(body) = body {
        req = req.json(&body);
    }
    let res = req.send().await.expect("request");
    let status = res.status();
    let headers = res.headers().clone();
    let text = res.text().await.expect("body");
    (
        status,
        headers,
        serde_json::from_str(&text).unwrap_or(Value::Null),
    )
}

async fn status_of(c: &reqwest::Client, url: &str, key: Option<&str>) -> StatusCode {
    send(c, Method::GET, url, key, None).await.0
}

/// Polls until `url` with `key` answers `want`, for at most the propagation promise.
async fn wait_for_status(c: &reqwest::Client, url: &str, key: Option<&str>, want: StatusCode) {
    let start = Instant::now();
    loop {
        let got = status_of(c, url, key).await;
        if got == want {
            return;
        }
        assert!(
            start.elapsed() < KEYS_PROPAGATION_MAX,
            "{url} still answers {got}, not {want}, after {KEYS_PROPAGATION_MAX:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn assert_unauthorized(status: StatusCode, headers: &reqwest::header::HeaderMap, body: &Value) {
    assert_eq!(status, StatusCode::UNAUTHORIZED, "{body}");
    assert_eq!(body["error"], "unauthorized", "{body}");
    assert!(body["detail"].is_string(), "{body}");
    assert_eq!(
        headers
            .get("www-authenticate")
            .and_then(|v| v.to_str().ok()),
        Some("Bearer")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_without_a_valid_key_get_401_and_a_revoked_key_stops_working_within_5_s() {
    let dir = tempfile::tempdir().unwrap();
    let store = store_of(dir.path());
    let seller = create(&store, Some("acme"), "seller");
    let server = Server::start(dir.path(), &[]);
    let c = client();
    let url = server.url("/v1/shops/acme/items/sku-1");

    let (status, headers, body) = send(&c, Method::GET, &url, None, None).await;
    assert_unauthorized(status, &headers, &body);
    assert!(body["detail"]
        .as_str()
        .unwrap()
        .starts_with("no access key"));

    for malformed in [
        "Basic YWxhZGRpbjpvcGVu",
        "Bearer",
        "Bearer a b",
        "nrtxn_x_y",
    ] {
        let res = c
            .get(&url)
            .header("authorization", malformed)
            .send()
            .await
            .unwrap();
        let (status, headers) = (res.status(), res.headers().clone());
        let body: Value = res.json().await.unwrap();
        assert_unauthorized(status, &headers, &body);
        assert!(
            body["detail"].as_str().unwrap().starts_with("malformed"),
            "{malformed}: {body}"
        );
    }

    // An unknown key, and the right id with a wrong secret.
    let unknown = format!("nrtxn_0000000000000000_{}", "0".repeat(64));
    let wrong = format!("nrtxn_{}_{}", key_id(&seller), "0".repeat(64));
    for key in [unknown.as_str(), wrong.as_str()] {
        let (status, headers, body) = send(&c, Method::GET, &url, Some(key), None).await;
        assert_unauthorized(status, &headers, &body);
    }

    // The key works (404: the item is unknown, but the request got through) ...
    assert_eq!(
        status_of(&c, &url, Some(&seller)).await,
        StatusCode::NOT_FOUND
    );
    // ... until it is revoked while the server runs.
    let out = keys(&store, &["revoke", key_id(&seller)]);
    assert!(out.status.success(), "{out:?}");
    wait_for_status(&c, &url, Some(&seller), StatusCode::UNAUTHORIZED).await;
    let (status, headers, body) = send(&c, Method::GET, &url, Some(&seller), None).await;
    assert_unauthorized(status, &headers, &body);

    // Revoking an unknown id is an error that names it.
    let out = keys(&store, &["revoke", "feedfacefeedface"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("feedfacefeedface"));

    // Nothing the server logged holds a secret.
    let log = std::fs::read_to_string(dir.path().join("server.log")).unwrap();
    assert!(
        !log.contains(&seller[seller.len() - 64..]),
        "a secret is in the log"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_role_reaches_exactly_its_routes_and_other_shops_keys_get_403() {
    let dir = tempfile::tempdir().unwrap();
    let store = store_of(dir.path());
    let seller = create(&store, Some("acme"), "seller");
    let operator = create(&store, Some("acme"), "operator");
    let admin = create(&store, None, "admin");
    let other_operator = create(&store, Some("other"), "operator");
    let server = Server::start(dir.path(), &[]);
    let c = client();
    let url = |p: &str| server.url(p);

    let load = json!({ "items": [{ "item": "sku-1", "stock": 100 }] });
    let (status, _, body) = send(
        &c,
        Method::PUT,
        &url("/v1/shops/acme/items"),
        Some(&admin),
        Some(load.clone()),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{body}");

    // One route per group, and who may use it.
    let txn = json!({ "seller": "s", "item": "sku-1", "qty": 1 });
    let hold = json!({ "item": "sku-1", "qty": 1, "ttl_ms": 60000 });
    /// What a route is, how to call it, and whether [seller, operator, admin] may.
    type Route<'a> = (&'a str, Method, String, Option<Value>, [bool; 3]);
    let routes: Vec<Route> = vec![
        // [seller, operator, admin]
        (
            "txn",
            Method::POST,
            url("/v1/shops/acme/txns"),
            Some(txn),
            [true, true, true],
        ),
        (
            "hold",
            Method::POST,
            url("/v1/shops/acme/holds"),
            Some(hold),
            [true, true, true],
        ),
        (
            "item read",
            Method::GET,
            url("/v1/shops/acme/items/sku-1"),
            None,
            [true, true, true],
        ),
        (
            "item list",
            Method::GET,
            url("/v1/shops/acme/items?limit=5"),
            None,
            [true, true, true],
        ),
        (
            "poll",
            Method::GET,
            url("/v1/shops/acme/txns/nope"),
            None,
            [true, true, true],
        ),
        (
            "load",
            Method::PUT,
            url("/v1/shops/acme/items"),
            Some(load),
            [false, true, true],
        ),
        (
            "events",
            Method::GET,
            url("/v1/shops/acme/items/sku-1/events"),
            None,
            [false, true, true],
        ),
        (
            "shop stats (the dashboard's figures)",
            Method::GET,
            url("/v1/shops/acme/stats"),
            None,
            [false, true, true],
        ),
        (
            "unlisted shop route",
            Method::GET,
            url("/v1/shops/acme/settings"),
            None,
            [false, true, true],
        ),
        (
            "metrics",
            Method::GET,
            url("/metrics"),
            None,
            [false, false, true],
        ),
    ];
    let mut n = 0;
    for (what, method, route, body, allowed) in routes {
        for (key, role, allowed) in [
            (&seller, "seller", allowed[0]),
            (&operator, "operator", allowed[1]),
            (&admin, "admin", allowed[2]),
        ] {
            // Each submission a key of its own, so none is a repeat of another.
            n += 1;
            let body = body.clone().map(|mut b| {
                if b.get("qty").is_some() {
                    b["request_id"] = json!(format!("r-{n}"));
                }
                b
            });
            let (status, _, answer) = send(&c, method.clone(), &route, Some(key), body).await;
            if allowed {
                assert!(
                    status != StatusCode::UNAUTHORIZED && status != StatusCode::FORBIDDEN,
                    "{role} on {what}: {status} {answer}"
                );
            } else {
                assert_eq!(status, StatusCode::FORBIDDEN, "{role} on {what}: {answer}");
                assert_eq!(answer["error"], "forbidden");
                let detail = answer["detail"].as_str().unwrap();
                assert!(
                    detail.contains("needs an operator key")
                        || detail.contains("needs an admin key"),
                    "{role} on {what}: {detail}"
                );
            }
        }
    }

    // Another shop's key: 403 naming the shop it is for, also for the routes it could use
    // in its own shop.
    for (method, route) in [
        (Method::GET, url("/v1/shops/acme/items/sku-1")),
        (Method::GET, url("/v1/shops/acme/items")),
        (Method::PUT, url("/v1/shops/acme/items")),
    ] {
        let (status, _, body) = send(&c, method, &route, Some(&other_operator), None).await;
        assert_eq!(status, StatusCode::FORBIDDEN, "{body}");
        assert!(
            body["detail"].as_str().unwrap().contains("for shop other"),
            "{body}"
        );
    }
    // A seller trying a load (the first finding): refused, and nothing changed.
    let (status, _, _) = send(
        &c,
        Method::PUT,
        &url("/v1/shops/acme/items"),
        Some(&seller),
        Some(json!({ "items": [{ "item": "sku-1", "stock": 0 }] })),
    )
    .await;
    assert_eq!(status, StatusCode::FORBIDDEN);
    let (_, _, item) = send(
        &c,
        Method::GET,
        &url("/v1/shops/acme/items/sku-1"),
        Some(&seller),
        None,
    )
    .await;
    assert_ne!(item["stock"], 0, "{item}");

    // An admin key works on every shop, and the shop in the path is decoded as the routes
    // decode it: a seller of "a b" may use /shops/a%20b.
    for shop in ["acme", "other", "zzz"] {
        let route = url(&format!("/v1/shops/{shop}/items/sku-1/events"));
        let status = status_of(&c, &route, Some(&admin)).await;
        assert_eq!(status, StatusCode::OK, "admin on {shop}");
    }
    let spaced = create(&store, Some("a b"), "seller");
    wait_for_status(
        &c,
        &url("/v1/shops/a%20b/items/sku-1"),
        Some(&spaced),
        StatusCode::NOT_FOUND,
    )
    .await;
    // The health checks stay open, and so does the dashboard's page (it holds no data).
    assert_eq!(status_of(&c, &url("/healthz"), None).await, StatusCode::OK);
    assert_eq!(status_of(&c, &url("/readyz"), None).await, StatusCode::OK);
    assert_eq!(status_of(&c, &url("/"), None).await, StatusCode::OK);
    assert_eq!(
        status_of(&c, &url("/dashboard.js"), None).await,
        StatusCode::OK
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn whoami_tells_a_keys_shop_and_role_and_never_its_secret() {
    let dir = tempfile::tempdir().unwrap();
    let store = store_of(dir.path());
    let seller = create(&store, Some("acme"), "seller");
    let admin = create(&store, None, "admin");
    let server = Server::start(dir.path(), &[]);
    let c = client();
    let url = server.url("/v1/whoami");

    let (status, headers, body) = send(&c, Method::GET, &url, None, None).await;
    assert_unauthorized(status, &headers, &body);
    let (status, headers, body) = send(&c, Method::GET, &url, Some("nrtxn_x_y"), None).await;
    assert_unauthorized(status, &headers, &body);

    let (status, _, body) = send(&c, Method::GET, &url, Some(&seller), None).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["keys_required"], true);
    assert_eq!(body["key"]["id"], key_id(&seller));
    assert_eq!(body["key"]["shop"], "acme");
    assert_eq!(body["key"]["role"], "seller");
    assert!(
        !body.to_string().contains(&seller),
        "the secret is not echoed: {body}"
    );
    let (_, _, body) = send(&c, Method::GET, &url, Some(&admin), None).await;
    assert_eq!(body["key"]["shop"], Value::Null);
    assert_eq!(body["key"]["role"], "admin");

    // A server without keys says so: the dashboard then asks for none.
    let open_dir = tempfile::tempdir().unwrap();
    let open = Server::start(open_dir.path(), &[]);
    let (status, _, body) = send(&c, Method::GET, &open.url("/v1/whoami"), None, None).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body, json!({ "keys_required": false, "key": null }));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_created_while_the_server_runs_works_within_5_s() {
    let dir = tempfile::tempdir().unwrap();
    let store = store_of(dir.path());
    create(&store, None, "admin");
    let server = Server::start(dir.path(), &[]);
    let c = client();
    let url = server.url("/v1/shops/acme/items/sku-1");
    let operator = create(&store, Some("acme"), "operator");
    wait_for_status(&c, &url, Some(&operator), StatusCode::NOT_FOUND).await;
}

#[test]
fn keys_create_prints_only_the_secret_and_neither_list_nor_the_file_holds_it() {
    let dir = tempfile::tempdir().unwrap();
    let store = store_of(dir.path());
    let out = keys(
        &store,
        &[
            "create", "--shop", "acme", "--role", "seller", "--name", "till 1",
        ],
    );
    assert!(out.status.success(), "{out:?}");
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert_eq!(stdout.lines().count(), 1, "{stdout:?}");
    let seller = stdout.trim_end_matches('\n').to_string();
    assert_eq!(stdout, format!("{seller}\n"));
    let id = key_id(&seller).to_string();
    assert_eq!(id.len(), 16);
    let random = &seller[seller.len() - 64..];
    assert!(random.chars().all(|c| c.is_ascii_hexdigit()), "{seller}");

    let admin = create(&store, None, "admin");
    let revoked = create(&store, Some("acme"), "operator");
    assert!(keys(&store, &["revoke", key_id(&revoked)]).status.success());

    let list = keys(&store, &["list"]);
    assert!(list.status.success(), "{list:?}");
    let list = String::from_utf8(list.stdout).unwrap();
    let rows: Vec<Vec<&str>> = list.lines().map(|l| l.split('\t').collect()).collect();
    assert_eq!(
        rows,
        vec![
            vec![id.as_str(), "till 1", "acme", "seller"],
            vec![key_id(&admin), "admin", "*", "admin"],
        ],
        "{list}"
    );
    let all = String::from_utf8(keys(&store, &["list", "--all"]).stdout).unwrap();
    let rows: Vec<Vec<&str>> = all.lines().map(|l| l.split('\t').collect()).collect();
    assert_eq!(rows.len(), 3, "{all}");
    assert!(rows.iter().all(|r| r.len() == 5), "{all}");
    let revoked_row = rows.iter().find(|r| r[0] == key_id(&revoked)).unwrap();
    assert_eq!(
        revoked_row[1..],
        ["acme-operator", "acme", "operator", "revoked"]
    );

    for secret in [&seller, &admin, &revoked] {
        let random = &secret[secret.len() - 64..];
        assert!(!list.contains(random) && !all.contains(random));
        // keys.sqlite and its WAL: the hash only.
        for entry in std::fs::read_dir(dir.path().join("data")).unwrap() {
            let path = entry.unwrap().path();
            if path
                .file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("keys.sqlite")
            {
                let bytes = std::fs::read(&path).unwrap();
                let found = bytes.windows(random.len()).any(|w| w == random.as_bytes());
                assert!(!found, "{} holds a secret", path.display());
            }
        }
    }

    // Admin keys have no shop, seller and operator keys one.
    let out = keys(&store, &["create", "--role", "admin", "--shop", "acme"]);
    assert!(!out.status.success() && out.stdout.is_empty());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("--shop"),
        "{out:?}"
    );
    let out = keys(&store, &["create", "--role", "seller"]);
    assert!(!out.status.success() && out.stdout.is_empty());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("--shop"),
        "{out:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn protected_mode_refuses_a_non_loopback_address_without_a_key() {
    let dir = tempfile::tempdir().unwrap();
    let (status, stderr) = serve_expecting_exit(dir.path(), &["--listen", "0.0.0.0:0"]);
    assert!(!status.success());
    assert!(
        stderr.contains("protected mode")
            && stderr.contains("nrtxn keys create")
            && stderr.contains("--insecure-no-auth"),
        "{stderr}"
    );

    // With --insecure-no-auth it serves, open.
    let c = client();
    {
        let mut server = Server::start_on(dir.path(), "0.0.0.0:0", &["--insecure-no-auth"]);
        server.base = server.base.replace("0.0.0.0", "127.0.0.1");
        let url = server.url("/v1/shops/acme/items/sku-1");
        assert_eq!(status_of(&c, &url, None).await, StatusCode::NOT_FOUND);
        server.terminate();
    }

    // With a key it starts, and requires it.
    let admin = create(&store_of(dir.path()), None, "admin");
    let mut server = Server::start_on(dir.path(), "0.0.0.0:0", &[]);
    server.base = server.base.replace("0.0.0.0", "127.0.0.1");
    let url = server.url("/v1/shops/acme/items/sku-1");
    assert_eq!(status_of(&c, &url, None).await, StatusCode::UNAUTHORIZED);
    assert_eq!(
        status_of(&c, &url, Some(&admin)).await,
        StatusCode::NOT_FOUND
    );

    // Its only key revoked, it does not fall open: every call is refused.
    assert!(keys(&store_of(dir.path()), &["revoke", key_id(&admin)])
        .status
        .success());
    wait_for_status(&c, &url, Some(&admin), StatusCode::UNAUTHORIZED).await;
    assert_eq!(status_of(&c, &url, None).await, StatusCode::UNAUTHORIZED);

    // The loopback quick start stays open with no key, and says so.
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path(), &[]);
    let url = server.url("/v1/shops/acme/items/sku-1");
    assert_eq!(status_of(&c, &url, None).await, StatusCode::NOT_FOUND);
    let log = std::fs::read_to_string(dir.path().join("server.log")).unwrap();
    assert!(log.contains("protected mode:"), "{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_need_an_admin_key_except_on_the_metrics_listener() {
    let dir = tempfile::tempdir().unwrap();
    let store = store_of(dir.path());
    let admin = create(&store, None, "admin");
    let seller = create(&store, Some("acme"), "seller");
    let server = Server::start(dir.path(), &["--metrics-listen", "127.0.0.1:0"]);
    let c = client();
    let url = server.url("/metrics");
    let (status, headers, body) = send(&c, Method::GET, &url, None, None).await;
    assert_unauthorized(status, &headers, &body);
    assert_eq!(
        status_of(&c, &url, Some(&seller)).await,
        StatusCode::FORBIDDEN
    );
    let res = c.get(&url).bearer_auth(&admin).send().await.unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert!(res
        .text()
        .await
        .unwrap()
        .contains("nrtxn_http_requests_total"));

    let open = server
        .stdout
        .lock()
        .unwrap()
        .iter()
        .find_map(|l| l.strip_prefix("nrtxn metrics on ").map(str::to_string))
        .expect("the metrics address is printed");
    let res = c.get(&open).send().await.unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert!(res
        .text()
        .await
        .unwrap()
        .contains("nrtxn_http_requests_total"));
    // That listener serves nothing else.
    let other = open.replace("/metrics", "/v1/shops/acme/items/sku-1");
    assert_eq!(
        status_of(&c, &other, Some(&admin)).await,
        StatusCode::NOT_FOUND
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_beyond_a_shops_bucket_gets_429_with_retry_after_and_other_shops_go_on() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path(), &["--shop-rate", "5", "--shop-burst", "5"]);
    let c = client();
    let url = server.url("/v1/shops/busy/items/sku-1");
    let mut limited = None;
    for i in 0..50 {
        let (status, headers, body) = send(&c, Method::GET, &url, None, None).await;
        if i < 5 {
            assert_eq!(
                status,
                StatusCode::NOT_FOUND,
                "request {i} is within the burst: {body}"
            );
        }
        if status == StatusCode::TOO_MANY_REQUESTS {
            limited = Some((headers, body));
            break;
        }
    }
    let (headers, body) = limited.expect("50 requests at once never got 429");
    assert_eq!(body["error"], "rate_limited", "{body}");
    let retry_after: u64 = headers["retry-after"].to_str().unwrap().parse().unwrap();
    assert!(retry_after >= 1, "{retry_after}");
    // Another shop has a bucket of its own.
    let other = server.url("/v1/shops/calm/items/sku-1");
    assert_eq!(status_of(&c, &other, None).await, StatusCode::NOT_FOUND);
    // The health checks are not counted against anyone.
    assert_eq!(
        status_of(&c, &server.url("/healthz"), None).await,
        StatusCode::OK
    );
}

/// A self-signed certificate for localhost and 127.0.0.1, written as PEM files.
fn self_signed(dir: &Path) -> (PathBuf, PathBuf, String) {
    let certified =
        rcgen::generate_simple_self_signed(vec!["localhost".to_string(), "127.0.0.1".to_string()])
            .expect("certificate");
    let cert_pem = certified.cert.pem();
    let (cert, key) = (dir.join("cert.pem"), dir.join("key.pem"));
    std::fs::write(&cert, &cert_pem).unwrap();
    std::fs::write(&key, certified.key_pair.serialize_pem()).unwrap();
    (cert, key, cert_pem)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_serves_https_with_the_given_certificate_and_checks_keys_over_it() {
    let dir = tempfile::tempdir().unwrap();
    let (cert, key, cert_pem) = self_signed(dir.path());
    let admin = create(&store_of(dir.path()), None, "admin");
    let server = Server::start(
        dir.path(),
        &[
            "--tls-cert",
            cert.to_str().unwrap(),
            "--tls-key",
            key.to_str().unwrap(),
        ],
    );
    assert!(server.base.starts_with("https://"), "{}", server.base);
    let c = reqwest::Client::builder()
        .use_rustls_tls()
        .add_root_certificate(reqwest::Certificate::from_pem(cert_pem.as_bytes()).unwrap())
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap();
    assert_eq!(
        status_of(&c, &server.url("/healthz"), None).await,
        StatusCode::OK
    );
    let url = server.url("/v1/shops/acme/items/sku-1");
    assert_eq!(status_of(&c, &url, None).await, StatusCode::UNAUTHORIZED);
    assert_eq!(
        status_of(&c, &url, Some(&admin)).await,
        StatusCode::NOT_FOUND
    );
    // Plain HTTP to that port is not served.
    let plain = server.url("/healthz").replace("https://", "http://");
    let answered = client()
        .get(&plain)
        .send()
        .await
        .map(|r| r.status() == StatusCode::OK)
        .unwrap_or(false);
    assert!(!answered, "plain HTTP was served on the TLS port");

    // One file without the other is refused with the option's name.
    let (status, stderr) = serve_expecting_exit(
        dir.path(),
        &[
            "--listen",
            "127.0.0.1:0",
            "--tls-cert",
            cert.to_str().unwrap(),
        ],
    );
    assert!(!status.success());
    assert!(stderr.contains("tls_key"), "{stderr}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_mongodb_key_store_creates_lists_revokes_and_serves() {
    let Some(uri) = mongo_uri("auth_keys") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let store = vec!["--mongo-uri".to_string(), uri.clone()];
    let admin = create(&store, None, "admin");
    let seller = create(&store, Some("acme"), "seller");
    let list = String::from_utf8(keys(&store, &["list"]).stdout).unwrap();
    assert_eq!(list.lines().count(), 2, "{list}");
    assert!(
        list.contains(&format!("{}\tacme-seller\tacme\tseller", key_id(&seller))),
        "{list}"
    );
    assert!(!list.contains(&seller[seller.len() - 64..]));

    // Nothing of the key store is in the embedded data dir.
    let server = Server::start(dir.path(), &["--mongo-uri", &uri]);
    assert!(!dir.path().join("data").join("keys.sqlite").exists());
    let c = client();
    let url = server.url("/v1/shops/acme/items/sku-1");
    assert_eq!(status_of(&c, &url, None).await, StatusCode::UNAUTHORIZED);
    assert_eq!(
        status_of(&c, &url, Some(&seller)).await,
        StatusCode::NOT_FOUND
    );
    assert!(keys(&store, &["revoke", key_id(&seller)]).status.success());
    wait_for_status(&c, &url, Some(&seller), StatusCode::UNAUTHORIZED).await;
    let all = String::from_utf8(keys(&store, &["list", "--all"]).stdout).unwrap();
    assert!(
        all.contains(&format!(
            "{}\tacme-seller\tacme\tseller\trevoked",
            key_id(&seller)
        )),
        "{all}"
    );
    assert_eq!(
        status_of(&c, &url, Some(&admin)).await,
        StatusCode::NOT_FOUND
    );
    drop(server);
    drop_database(&uri).await;
}
