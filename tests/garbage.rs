//! The HTTP garbage campaign: malformed requests of every kind, sent raw over
//! TCP to the real server on every route that takes a body or a name. Every one gets a
//! 4xx: never a 5xx, a dropped connection or a hang; the server still serves afterwards,
//! and nothing of the garbage was applied. The test prints how many inputs it tried.

mod common;

use std::io::Write;
use std::net::TcpStream;
use std::time::Duration;

use common::*;
use serde_json::json;

/// Longest a garbage request may take to be answered (the body timeout below is 1 s).
const ANSWER_WAIT: Duration = Duration::from_secs(10);

/// Sends `head` then `body` on a new connection (with `Connection: close`) and returns
/// the status code of the answer, or what went wrong.
fn raw(addr: &str, head: &[u8], body: &[u8]) -> Result<u16, String> {
    let mut s = TcpStream::connect(addr).map_err(|e| format!("connect: {e}"))?;
    s.write_all(head).map_err(|e| format!("write head: {e}"))?;
    // The server may answer and close before reading a body it refused.
    let _ = s.write_all(body);
    status_code(&mut s)
}

/// The status code of the answer on `s`, waiting up to [`ANSWER_WAIT`].
fn status_code(s: &mut TcpStream) -> Result<u16, String> {
    let line = status_line(s, ANSWER_WAIT);
    line.split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| format!("no status line within {ANSWER_WAIT:?}: {line:?}"))
}

fn head(method: &str, path: &[u8], addr: &str, extra: &str, len: usize) -> Vec<u8> {
    let mut h = Vec::new();
    h.extend_from_slice(method.as_bytes());
    h.push(b' ');
    h.extend_from_slice(path);
    h.extend_from_slice(
        format!(" HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\n{extra}content-length: {len}\r\n\r\n")
            .as_bytes(),
    );
    h
}

const JSON: &str = "content-type: application/json\r\n";

/// Bodies that no route may accept: malformed, truncated, of the wrong type, with
/// numbers out of range, invalid UTF-8, deep nesting, repeated keys, or too large.
fn bad_bodies() -> Vec<Vec<u8>> {
    let valid = json!({"seller": "s", "item": "i", "qty": 1, "request_id": "g"}).to_string();
    let mut bodies: Vec<Vec<u8>> = Vec::new();
    // Truncated: every cut of a valid body.
    for cut in 0..valid.len() {
        bodies.push(valid.as_bytes()[..cut].to_vec());
    }
    for b in [
        "null",
        "[]",
        "1",
        "\"s\"",
        "true",
        "{",
        "}",
        "{]",
        "[{}]",
        "{\"a\":}",
        "{,}",
        // Numbers: huge, negative, fractional, as strings, past every bound.
        r#"{"seller":"s","item":"i","qty":0,"request_id":"g"}"#,
        r#"{"seller":"s","item":"i","qty":-1,"request_id":"g"}"#,
        r#"{"seller":"s","item":"i","qty":-9223372036854775808,"request_id":"g"}"#,
        r#"{"seller":"s","item":"i","qty":99999999999999999999999999,"request_id":"g"}"#,
        r#"{"seller":"s","item":"i","qty":1e400,"request_id":"g"}"#,
        r#"{"seller":"s","item":"i","qty":1.5,"request_id":"g"}"#,
        r#"{"seller":"s","item":"i","qty":"1","request_id":"g"}"#,
        r#"{"seller":"s","item":"i","qty":NaN,"request_id":"g"}"#,
        r#"{"items":[{"item":"i","stock":-1}]}"#,
        r#"{"items":[{"item":"i","stock":1e30}]}"#,
        r#"{"items":[{"item":"i","stock":18446744073709551616}]}"#,
        // Repeated keys, wrong types, names with control characters or too long.
        r#"{"seller":"s","item":"i","qty":1,"qty":2,"request_id":"g"}"#,
        r#"{"seller":["s"],"item":"i","qty":1,"request_id":"g"}"#,
        r#"{"seller":"s","item":{"i":1},"qty":1,"request_id":"g"}"#,
        "{\"seller\":\"s\",\"item\":\"a\\u0000b\",\"qty\":1,\"request_id\":\"g\"}",
        "{\"seller\":\"s\",\"item\":\"a\\nb\",\"qty\":1,\"request_id\":\"g\"}",
        r#"{"seller":"s","item":"a/b","qty":1,"request_id":"g"}"#,
        r#"{"seller":"s","item":"i","qty":1,"request_id":""}"#,
        r#"{"txns":"x"}"#,
        r#"{"txns":[1,2]}"#,
        r#"{"items":"x"}"#,
        r#"{"items":[]}"#,
    ] {
        bodies.push(b.as_bytes().to_vec());
    }
    let long = "x".repeat(1_000);
    bodies.push(
        json!({"seller": "s", "item": long, "qty": 1, "request_id": "g"})
            .to_string()
            .into_bytes(),
    );
    // Invalid UTF-8 inside a string, and as the whole body.
    let mut bad_utf8 = br#"{"seller":"s","item":""#.to_vec();
    bad_utf8.extend_from_slice(&[0xff, 0xfe, 0xc3]);
    bad_utf8.extend_from_slice(br#"","qty":1,"request_id":"g"}"#);
    bodies.push(bad_utf8);
    bodies.push(vec![0xc3, 0x28, 0xa0, 0xa1, 0xe2, 0x28, 0xa1]);
    // Deep nesting, in a field and as the body.
    for depth in [200, 100_000] {
        let mut b = br#"{"seller":"s","item":"i","qty":1,"request_id":"g","remarks":"#.to_vec();
        b.extend_from_slice("[".repeat(depth).as_bytes());
        b.extend_from_slice("]".repeat(depth).as_bytes());
        b.push(b'}');
        bodies.push(b);
        bodies.push(format!("{}{}", "[".repeat(depth), "]".repeat(depth)).into_bytes());
    }
    // Past every route's body limit (4 MiB is the largest).
    bodies.push(format!("{{\"remarks\":\"{}\"}}", "x".repeat(5 << 20)).into_bytes());
    bodies
}

#[test]
fn garbage_on_every_route_is_answered_4xx_and_nothing_is_applied() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path(), &["--body-timeout-ms", "1000"]);
    let addr = server.base.trim_start_matches("http://").to_string();
    let mut tried = 0usize;
    let mut wrong = Vec::new();
    let mut expect_4xx = |what: String, result: Result<u16, String>| {
        tried += 1;
        match result {
            Ok(code) if (400..500).contains(&code) => {}
            other => wrong.push(format!("{what}: {other:?}")),
        }
    };
    let body_routes: [(&str, &str); 6] = [
        ("POST", "/v1/shops/g/txns"),
        ("POST", "/v1/shops/g/txns/batch"),
        ("PUT", "/v1/shops/g/items"),
        ("POST", "/v1/shops/g/holds"),
        ("POST", "/v1/shops/g/holds/h/confirm"),
        ("POST", "/v1/shops/g/holds/h/cancel"),
    ];
    let bodies = bad_bodies();
    for (method, path) in body_routes {
        for (i, body) in bodies.iter().enumerate() {
            let h = head(method, path.as_bytes(), &addr, JSON, body.len());
            expect_4xx(format!("{method} {path} body #{i}"), raw(&addr, &h, body));
        }
        // A valid body under a content type that is not JSON, or none.
        let body = json!({"seller": "s", "item": "i", "qty": 1, "request_id": "g"}).to_string();
        for ctype in [
            "",
            "content-type: text/plain\r\n",
            "content-type: application/x-www-form-urlencoded\r\n",
            "content-type: multipart/form-data; boundary=x\r\n",
            "content-type: application/jsonx\r\n",
        ] {
            let h = head(method, path.as_bytes(), &addr, ctype, body.len());
            expect_4xx(
                format!("{method} {path} with {ctype:?}"),
                raw(&addr, &h, body.as_bytes()),
            );
        }
        // A body that never finishes: 408 once the body timeout passes.
        let h = head(method, path.as_bytes(), &addr, JSON, 1_000);
        expect_4xx(
            format!("{method} {path}, body never finished"),
            raw(&addr, &h, b"{\"seller\":"),
        );
    }
    // A hold's TTL out of range (other routes take no TTL, and ignore fields they do
    // not know).
    for ttl in ["-5", "0", "1e99", "604800001", "\"1\""] {
        let body = format!(r#"{{"item":"i","qty":1,"ttl_ms":{ttl},"request_id":"g"}}"#);
        let h = head("POST", b"/v1/shops/g/holds", &addr, JSON, body.len());
        expect_4xx(
            format!("POST hold with ttl_ms {ttl}"),
            raw(&addr, &h, body.as_bytes()),
        );
    }
    // Names in paths that do not decode, escape a separator, hold NUL or are far too
    // long, on every route that takes one.
    let long = "a".repeat(100 * 1024);
    let bad_names: Vec<&str> = vec![
        "%2F", "a%2Fb", "%00", "a%00b", "%FF", "%C3%28", "%0A", &long,
    ];
    let name_routes = [
        ("GET", "/v1/shops/{}/items/i"),
        ("GET", "/v1/shops/g/items/{}"),
        ("GET", "/v1/shops/g/items/{}/events"),
        ("GET", "/v1/shops/g/txns/{}"),
        ("GET", "/v1/shops/g/loads/{}"),
        ("GET", "/v1/shops/g/holds/{}"),
        ("POST", "/v1/shops/{}/txns"),
        ("PUT", "/v1/shops/{}/items"),
        ("POST", "/v1/shops/g/holds/{}/confirm"),
    ];
    let body = json!({"seller": "s", "item": "i", "qty": 1, "request_id": "g"}).to_string();
    for (method, pattern) in name_routes {
        for name in &bad_names {
            let path = pattern.replace("{}", name);
            let h = head(method, path.as_bytes(), &addr, JSON, body.len());
            let shown = &path[..path.len().min(60)];
            expect_4xx(format!("{method} {shown}"), raw(&addr, &h, body.as_bytes()));
        }
    }
    // Raw bytes that are not UTF-8 in the path itself, and a head sent a byte at a time
    // (a slow client): both refused.
    let mut path = b"/v1/shops/".to_vec();
    path.extend_from_slice(&[0xff, 0xfe]);
    path.extend_from_slice(b"/items/i");
    expect_4xx(
        "GET with raw non-UTF-8 bytes in the path".into(),
        raw(&addr, &head("GET", &path, &addr, "", 0), b""),
    );
    let slow = {
        let h = head("POST", b"/v1/shops/g/txns", &addr, JSON, 5);
        let mut s = TcpStream::connect(&addr).unwrap();
        for b in h.iter().chain(b"{\"q\":") {
            s.write_all(&[*b]).unwrap();
            std::thread::sleep(Duration::from_millis(5));
        }
        status_code(&mut s)
    };
    expect_4xx("a head sent a byte at a time, then a bad body".into(), slow);
    println!("garbage campaign: {tried} inputs tried");
    assert!(
        wrong.is_empty(),
        "{} of {tried} not answered 4xx:\n{}",
        wrong.len(),
        wrong.join("\n")
    );
    // The server still serves, and none of the garbage reached shop g.
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let c = client();
        let (status, _) = get(&c, &server.url("/healthz")).await;
        assert_eq!(status, 200);
        let (status, _) = get(&c, &server.url("/v1/shops/g/items/i")).await;
        assert_eq!(status, 404, "garbage created an item");
        let (status, _) = get(&c, &server.url("/v1/shops/g/txns/g")).await;
        assert_eq!(status, 404, "garbage was decided");
        load(&c, &server, "g", &[("i", 3)]).await;
        let (status, sold) = post(
            &c,
            &server.url("/v1/shops/g/txns"),
            json!({"seller": "s", "item": "i", "qty": 1, "request_id": "after"}),
        )
        .await;
        assert_eq!((status, &sold["status"]), (200, &json!("ok")), "{sold}");
    });
}
