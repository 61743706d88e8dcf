//! The shop's push stream, `GET /v1/shops/{shop}/events/stream`, through the
//! real binary over HTTP: it starts at new events, resumes from an event's id without
//! missing or repeating one, keeps each item's seq order, and drops a slow client with
//! a final message rather than buffering without bound.

mod common;

use std::collections::HashMap;
use std::io::{Read, Write};
use std::time::Duration;

use common::*;
use serde_json::{json, Value};

/// One server-sent event: its id, event name and data.
#[derive(Debug, Clone)]
struct Sse {
    id: Option<String>,
    event: Option<String>,
    data: String,
}

/// Parses a stream's text into its events (comments skipped).
fn parse(text: &str) -> Vec<Sse> {
    text.split("\n\n")
        .filter_map(|block| {
            let mut e = Sse {
                id: None,
                event: None,
                data: String::new(),
            };
            let mut any = false;
            for line in block.lines() {
                let Some((k, v)) = line.split_once(": ") else {
                    continue;
                };
                any = true;
                match k {
                    "id" => e.id = Some(v.to_string()),
                    "event" => e.event = Some(v.to_string()),
                    "data" => e.data = v.to_string(),
                    _ => {}
                }
            }
            any.then_some(e)
        })
        .collect()
}

/// Opens the stream and reads it until `until` says it has enough (or 60 s pass).
async fn read_stream(
    c: &reqwest::Client,
    url: &str,
    last_event_id: Option<&str>,
    mut until: impl FnMut(&[Sse]) -> bool,
) -> Vec<Sse> {
    let mut req = c.get(url);
    if let Some(id) = last_event_id {
        req = req.header("Last-Event-ID", id);
    }
    let mut res = req.send().await.unwrap();
    assert_eq!(res.status(), 200);
    assert_eq!(res.headers()["content-type"], "text/event-stream");
    let mut pending = String::new();
    let mut got = Vec::new();
    // Generous: a debug build streams 100,000 events slowly; the test is about what
    // arrives, not how fast.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(300);
    loop {
        if until(&got) {
            return got;
        }
        let chunk = tokio::time::timeout_at(deadline, res.chunk())
            .await
            .expect("the stream went quiet before the events came")
            .unwrap();
        match chunk {
            Some(b) => {
                pending.push_str(&String::from_utf8_lossy(&b));
                // Only whole messages: parse what ends with a blank line, keep the rest.
                if let Some((done, rest)) = pending.rsplit_once("\n\n") {
                    got.extend(parse(done));
                    pending = rest.to_string();
                }
            }
            None => {
                got.extend(parse(&pending));
                return got;
            }
        }
    }
}

/// A client for streams: no bound on the whole request (a stream has no end).
fn stream_client() -> reqwest::Client {
    reqwest::Client::builder()
        .connect_timeout(Duration::from_secs(10))
        .build()
        .unwrap()
}

/// How many of `msgs` are events (not `ready` or `dropped`), without parsing them.
fn count(msgs: &[Sse]) -> usize {
    msgs.iter().filter(|m| m.event.is_none()).count()
}

fn events_of(msgs: &[Sse]) -> Vec<(String, Value)> {
    msgs.iter()
        .filter(|m| m.event.is_none())
        .map(|m| {
            (
                m.id.clone().unwrap(),
                serde_json::from_str(&m.data).unwrap(),
            )
        })
        .collect()
}

async fn sell(c: &reqwest::Client, server: &Server, shop: &str, item: &str, id: &str) {
    let (status, body) = post(
        c,
        &server.url(&format!("/v1/shops/{shop}/txns")),
        json!({"seller": "s", "item": item, "qty": 1, "request_id": id}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
}

/// Checks that every item's events come in seq order with no gap, starting after
/// `from[item]`.
fn check_order(events: &[(String, Value)], from: &HashMap<String, u64>) {
    let mut last = from.clone();
    for (_, e) in events {
        let item = e["item"].as_str().unwrap().to_string();
        let seq = e["seq"].as_u64().unwrap();
        let before = last.get(&item).copied().unwrap_or(0);
        assert_eq!(seq, before + 1, "{item}: seq {seq} after {before}");
        last.insert(item, seq);
    }
}

async fn starts_at_new_events_and_resumes_missing_nothing(server: &Server) {
    let c = client();
    let items = ["a", "b", "c"];
    load(&c, server, "shop", &[("a", 1000), ("b", 1000), ("c", 1000)]).await;
    load(&c, server, "other", &[("a", 1000)]).await;
    let url = server.url("/v1/shops/shop/events/stream");
    // Opened after the loads: it starts at new events (the loads are not in it).
    let mut res = c.get(&url).send().await.unwrap();
    let mut text = String::new();
    while !text.contains("event: ready") {
        text.push_str(&String::from_utf8_lossy(
            &res.chunk().await.unwrap().unwrap(),
        ));
    }
    let ready = parse(&text)[0].clone();
    assert_eq!(ready.event.as_deref(), Some("ready"));
    for i in 0..60 {
        sell(&c, server, "shop", items[i % 3], &format!("s-{i}")).await;
        sell(&c, server, "other", "a", &format!("o-{i}")).await;
    }
    // The first 30 events on this connection, then it is closed.
    let mut first = Vec::new();
    while events_of(&first).len() < 30 {
        text.push_str(&String::from_utf8_lossy(
            &res.chunk().await.unwrap().unwrap(),
        ));
        first = parse(text.rsplit_once("\n\n").map_or("", |(d, _)| d));
    }
    drop(res);
    let first: Vec<_> = events_of(&first).into_iter().take(30).collect();
    // More sales while no one listens, then a resume from the 30th event's id.
    for i in 60..90 {
        sell(&c, server, "shop", items[i % 3], &format!("s-{i}")).await;
    }
    let resume_id = first.last().unwrap().0.clone();
    let sc = stream_client();
    let rest = read_stream(&sc, &url, Some(&resume_id), |m| count(m) >= 60).await;
    let rest = events_of(&rest);
    // And the same from `?after=`.
    let after = read_stream(&sc, &format!("{url}?after={resume_id}"), None, |m| {
        events_of(m).len() >= 60
    })
    .await;
    let after = events_of(&after);
    for resumed in [&rest, &after] {
        let all: Vec<_> = first.iter().chain(resumed.iter()).cloned().collect();
        assert_eq!(all.len(), 90);
        for (_, e) in &all {
            assert_eq!(e["shop"], "shop", "{e}");
            assert_eq!(e["kind"], "decrement", "{e}");
        }
        // Loaded at seq 1: the sales are 2, 3, ... per item, none missed or repeated.
        let from = items.iter().map(|i| (i.to_string(), 1)).collect();
        check_order(&all, &from);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_stream_starts_at_new_events_and_a_resumed_one_misses_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path(), &[]);
    starts_at_new_events_and_resumes_missing_nothing(&server).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_cursor_gets_400_naming_where_it_came_from() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path(), &[]);
    let c = client();
    let url = server.url("/v1/shops/shop/events/stream");
    for (req, field) in [
        (c.get(format!("{url}?after=nope")), "after"),
        (c.get(format!("{url}?after=j1.99999")), "after"),
        (c.get(&url).header("Last-Event-ID", "k1-2"), "Last-Event-ID"),
        (c.get(format!("{url}?colour=red")), "colour"),
    ] {
        let res = req.send().await.unwrap();
        assert_eq!(res.status(), 400);
        let body: Value = res.json().await.unwrap();
        let detail = body["detail"].as_str().unwrap();
        assert!(detail.starts_with(&format!("{field}:")), "{detail}");
    }
}

/// A client that reads nothing while 120,000 events come: once its buffer (1,024 events)
/// has been full for 5 s it is dropped. It then reads what was sent, ending with a
/// `dropped` event naming the cursor to resume from, and a resume from there brings the
/// rest: every event once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_client_is_dropped_with_a_final_message_and_resumes_missing_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path(), &[]);
    let c = client();
    let addr = server.base.trim_start_matches("http://").to_string();
    let mut s = std::net::TcpStream::connect(&addr).unwrap();
    write!(
        s,
        "GET /v1/shops/shop/events/stream HTTP/1.0\r\nHost: {addr}\r\nAccept: text/event-stream\r\n\r\n"
    )
    .unwrap();
    // Wait for the start (`ready`), then read nothing while the events come.
    let mut head = vec![0u8; 4096];
    let mut got = Vec::new();
    while !String::from_utf8_lossy(&got).contains("event: ready") {
        let n = s.read(&mut head).unwrap();
        got.extend_from_slice(&head[..n]);
    }
    // Enough to fill the loopback socket's buffers (autotuned to several MB) and the channel.
    const LOADS: usize = 12;
    for round in 0..LOADS {
        let items: Vec<Value> = (0..10_000)
            .map(|i| json!({"item": format!("i-{round}-{i:05}"), "stock": 1}))
            .collect();
        let (status, body) = call(
            &c,
            reqwest::Method::PUT,
            &server.url("/v1/shops/shop/items"),
            Some(json!({ "items": items }).to_string()),
        )
        .await;
        assert_eq!(status, 200, "{body}");
    }
    // Longer than the grace, then read everything to the end.
    tokio::time::sleep(Duration::from_secs(8)).await;
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let mut rest = Vec::new();
    // HTTP/1.0: no chunked framing, and the server closes the connection at the end.
    s.read_to_end(&mut rest).expect("the stream ends");
    got.extend_from_slice(&rest);
    let text = String::from_utf8_lossy(&got).into_owned();
    let msgs = parse(&text);
    let last = msgs.last().expect("messages");
    assert_eq!(last.event.as_deref(), Some("dropped"), "{last:?}");
    let data: Value = serde_json::from_str(&last.data).unwrap();
    assert_eq!(data["reason"], "slow_client");
    let first = events_of(&msgs);
    assert!(first.len() < LOADS * 10_000, "not dropped: {}", first.len());
    assert_eq!(data["resume_after"], json!(first.last().unwrap().0));
    // Resumed from the cursor the final message named: the rest, each event once. This
    // reader (a debug build parsing as it goes) may be dropped too while it catches up:
    // it resumes again from the cursor each final message names, as a client should.
    let mut resume = data["resume_after"].as_str().unwrap().to_string();
    let mut second = Vec::new();
    let mut drops = 0;
    while first.len() + second.len() < LOADS * 10_000 {
        let want = LOADS * 10_000 - first.len() - second.len();
        let msgs = read_stream(
            &stream_client(),
            &server.url("/v1/shops/shop/events/stream"),
            Some(&resume),
            |m| count(m) >= want,
        )
        .await;
        second.extend(events_of(&msgs));
        match msgs.last() {
            Some(m) if m.event.as_deref() == Some("dropped") => {
                let d: Value = serde_json::from_str(&m.data).unwrap();
                resume = d["resume_after"].as_str().unwrap().to_string();
                drops += 1;
                assert!(drops < 100, "dropped {drops} times");
            }
            _ => {}
        }
    }
    let mut seen = std::collections::HashSet::new();
    for (_, e) in first.iter().chain(&second) {
        assert_eq!(e["seq"], 1);
        assert!(
            seen.insert(e["item"].as_str().unwrap().to_string()),
            "twice: {e}"
        );
    }
    assert_eq!(seen.len(), LOADS * 10_000);
}

/// Two nodes on Kafka and MongoDB: the stream reads the events topic, where each node's
/// relay publishes the events of the items it owns. Opened on node 0, it gets every
/// change made through either node, each once and in seq order per item; closed, then
/// resumed on node 1 from the last event's id, it misses nothing and repeats nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_two_nodes_the_stream_has_every_change_once_and_resumes_on_the_other_node() {
    let Some(n) = nodes::start_two("stream_two_nodes").await else {
        return;
    };
    let c = client();
    let items = ["a", "b", "c", "d", "e", "f", "g", "h"];
    let stock: Vec<(&str, i64)> = items.iter().map(|i| (*i, 1000)).collect();
    load(&c, &n.nodes[0], "shop", &stock).await;
    load(&c, &n.nodes[1], "other", &[("a", 1000)]).await;
    // The stream starts at what the topic has now (its high watermarks), so the loads'
    // events are mostly not in it: the relays publish them before the stream opens.
    // Mostly: the test broker, tansu, was seen to answer the watermark query without an
    // event it had acknowledged (for seconds, until more came); such an event comes at
    // the stream's start, once. Loads are left out of the checks below for that reason.
    for _ in 0..600 {
        let mut relayed = 0;
        for node in &n.nodes {
            relayed += metric(&c, node, "nrtxn_events_relayed_total").await;
        }
        if relayed >= 9 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let url0 = n.nodes[0].url("/v1/shops/shop/events/stream");
    let sc = stream_client();
    let mut res = sc.get(&url0).send().await.unwrap();
    assert_eq!(res.status(), 200);
    let mut text = String::new();
    while !text.contains("event: ready") {
        text.push_str(&String::from_utf8_lossy(
            &res.chunk().await.unwrap().unwrap(),
        ));
    }
    let ready = parse(&text)[0].clone();
    // Sealed: the topic's offsets are inside, opaque; another node of the
    // deployment opens it (below), since the nodes share the sealing key.
    assert!(
        ready
            .id
            .as_deref()
            .is_some_and(|c| c.starts_with('c') && !c.contains('-')),
        "a sealed cursor: {ready:?}"
    );
    // Sales through both nodes, and another shop's, which the stream leaves out.
    for i in 0..40 {
        let node = &n.nodes[i % 2];
        sell(&c, node, "shop", items[i % items.len()], &format!("s-{i}")).await;
        if i % 4 == 0 {
            sell(&c, node, "other", "a", &format!("o-{i}")).await;
        }
    }
    // The sales' events only (see above for loads); a load at most once, at seq 1.
    let sales = |msgs: &[Sse]| -> Vec<(String, Value)> {
        let events = events_of(msgs);
        let loads: Vec<_> = events.iter().filter(|(_, e)| e["kind"] == "load").collect();
        let items: std::collections::BTreeSet<_> = loads
            .iter()
            .map(|(_, e)| e["item"].as_str().unwrap())
            .collect();
        assert_eq!(items.len(), loads.len(), "a load twice: {loads:?}");
        assert!(loads.iter().all(|(_, e)| e["seq"] == 1), "{loads:?}");
        events
            .into_iter()
            .filter(|(_, e)| e["kind"] != "load")
            .collect()
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let mut first = Vec::new();
    while sales(&first).len() < 40 {
        let chunk = tokio::time::timeout_at(deadline, res.chunk())
            .await
            .unwrap_or_else(|_| {
                panic!(
                    "{} of 40 events after 60 s: {:?}",
                    sales(&first).len(),
                    events_of(&first)
                )
            })
            .unwrap()
            .unwrap();
        text.push_str(&String::from_utf8_lossy(&chunk));
        first = parse(text.rsplit_once("\n\n").map_or("", |(d, _)| d));
    }
    drop(res);
    let first = sales(&first);
    assert_eq!(first.len(), 40, "an event twice? {first:?}");
    let from: HashMap<String, u64> = items.iter().map(|i| (i.to_string(), 1)).collect();
    for (_, e) in &first {
        assert_eq!(e["shop"], "shop", "{e}");
        assert_eq!(e["kind"], "decrement", "{e}");
    }
    check_order(&first, &from);

    // Closed after its 25th event; 16 more sales while no one listens; resumed on node 1.
    let kept: Vec<_> = first[..25].to_vec();
    for i in 40..56 {
        let node = &n.nodes[i % 2];
        sell(&c, node, "shop", items[i % items.len()], &format!("s-{i}")).await;
    }
    let resume_id = kept.last().unwrap().0.clone();
    let url1 = n.nodes[1].url("/v1/shops/shop/events/stream");
    let rest = read_stream(&sc, &url1, Some(&resume_id), |m| sales(m).len() >= 31).await;
    let rest = sales(&rest);
    let all: Vec<_> = kept.iter().chain(&rest).cloned().collect();
    assert_eq!(all.len(), 56, "missed or repeated: {rest:?}");
    check_order(&all, &from);
    // Every sale is there, once.
    let keys: std::collections::BTreeSet<String> = all
        .iter()
        .map(|(_, e)| e["request_key"].as_str().unwrap().to_string())
        .collect();
    let want: std::collections::BTreeSet<String> = (0..56).map(|i| format!("s-{i}")).collect();
    assert_eq!(keys, want);
    drop_database(&n.mongo).await;
}

/// A stream its client closed gives its slot back at once (not at the next keep-alive
/// comment, 15 s later): 200 streams opened and closed one after the other, more than
/// the node's 64, are each served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_closed_stream_gives_its_slot_back_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path(), &[]);
    let url = server.url("/v1/shops/shop/events/stream");
    let sc = stream_client();
    for i in 0..200 {
        let mut res = sc.get(&url).send().await.unwrap();
        if res.status() != 200 {
            let status = res.status();
            panic!("stream {i}: {status} {}", res.text().await.unwrap());
        }
        let mut text = String::new();
        while !text.contains("event: ready") {
            text.push_str(&String::from_utf8_lossy(
                &res.chunk().await.unwrap().unwrap(),
            ));
        }
        drop(res);
    }
}

/// A data dir whose views an older version wrote (a `journal` row per entry) is taken
/// over: the entries since are kept as rows naming the log's records, their event ids go
/// on after the rows', and a stream from the start, or resumed from a row's id or a
/// record's, has every event once, in order; a crash after it is recovered from both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_runs_on_from_an_older_versions_rows_into_the_logs_records() {
    let dir = tempfile::tempdir().unwrap();
    let c = client();
    let rows = [("NRTXN_FAULT_VIEWS_ROWS", "1")];
    let mut server = Server::start_env(dir.path(), &[], &rows);
    let sc = stream_client();
    let url = server.url("/v1/shops/shop/events/stream");
    // The cursor a stream opened before any entry starts at.
    let ready = read_stream(&sc, &url, None, |m| !m.is_empty()).await;
    let start = ready[0]
        .id
        .clone()
        .expect("the ready message has the stream's cursor");
    load(&c, &server, "shop", &[("a", 1000), ("b", 1000)]).await;
    for i in 0..10 {
        sell(&c, &server, "shop", ["a", "b"][i % 2], &format!("s-{i}")).await;
    }
    assert!(server.terminate().success());
    let mut server = Server::start(dir.path(), &[]);
    for i in 10..20 {
        sell(&c, &server, "shop", ["a", "b"][i % 2], &format!("s-{i}")).await;
    }
    // Killed: the next start reads the entries after the last snapshot from the log.
    server.kill();
    let server = Server::start(dir.path(), &[]);
    for i in 20..24 {
        sell(&c, &server, "shop", ["a", "b"][i % 2], &format!("s-{i}")).await;
    }
    let url = server.url("/v1/shops/shop/events/stream");
    let all = read_stream(&sc, &url, Some(&start), |m| count(m) >= 26).await;
    let all = events_of(&all);
    assert_eq!(all.len(), 26, "two loads and 24 sales");
    check_order(&all, &HashMap::new());
    // Resumed from a row's id (the 5th event, written by the older version) and from a
    // record's (the 20th).
    for from in [4, 19] {
        let rest = read_stream(&sc, &url, Some(&all[from].0), |m| count(m) >= 25 - from).await;
        let rest = events_of(&rest);
        assert_eq!(rest.len(), 25 - from);
        let want: Vec<&str> = all[from + 1..].iter().map(|(id, _)| id.as_str()).collect();
        let got: Vec<&str> = rest.iter().map(|(id, _)| id.as_str()).collect();
        assert_eq!(got, want, "resumed after the event of id {}", all[from].0);
    }
    for (item, sold) in [("a", 12), ("b", 12)] {
        let (status, state) = get(&c, &server.url(&format!("/v1/shops/shop/items/{item}"))).await;
        assert_eq!(status, 200, "{state}");
        assert_eq!(
            (state["stock"].as_i64(), state["seq"].as_i64()),
            (Some(1000 - sold), Some(1 + sold)),
            "{state}"
        );
    }
}
