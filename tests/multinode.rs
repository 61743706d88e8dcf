//! Two nodes sharing one Kafka group and one MongoDB database, against the test servers
//! `scripts/test.sh` starts on loopback: the partitions (and so the items) are shared,
//! every caller is answered by the node it called, and when one node is killed the other
//! takes its partitions over without losing or repeating anything.

mod common;

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::nodes::*;
use common::*;
use futures::TryStreamExt;
use mongodb::bson::{doc, Document};
use serde_json::{json, Value};

const ITEMS: usize = 20;

fn item(i: usize) -> String {
    format!("sku-{}", i % ITEMS)
}

/// Decisions this node's processors made, from its metrics.
async fn decisions(c: &reqwest::Client, server: &Server) -> u64 {
    metrics_text(c, server)
        .await
        .lines()
        .filter(|l| l.starts_with("nrtxn_decisions_total{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

/// Requests this node's processors answered with an outcome recorded before.
async fn repeats(c: &reqwest::Client, server: &Server) -> u64 {
    metric(c, server, "nrtxn_repeats_total").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_nodes_share_the_items_and_answer_their_own_callers() {
    let Some(two) = start_two("two").await else {
        return;
    };
    let c = client();
    let [n0, n1] = &two.nodes;
    // Loaded through node 0; each load travels to the node that owns its item.
    let items: Vec<(String, i64)> = (0..ITEMS).map(|i| (item(i), 30)).collect();
    let items: Vec<(&str, i64)> = items.iter().map(|(i, s)| (i.as_str(), *s)).collect();
    load(&c, n0, "shop", &items).await;

    // 60 decrements per item, sent alternately to the two nodes; one in ten is
    // fire-and-forget and polled on the other node.
    let results = Arc::new(Mutex::new(Vec::new()));
    let tasks = (0..24).map(|t| {
        let (c, results) = (c.clone(), results.clone());
        let bases = [n0.base.clone(), n1.base.clone()];
        tokio::spawn(async move {
            for k in 0..50 {
                let i = t * 50 + k;
                let node = i % 2;
                let respond = i % 10 != 0;
                let key = format!("k{i}");
                let body = json!({"seller": "s", "item": item(i), "qty": 1,
                                  "request_id": key, "respond": respond});
                let url = format!("{}/v1/shops/shop/txns", bases[node]);
                let (status, body) = post(&c, &url, body).await;
                results
                    .lock()
                    .unwrap()
                    .push((i, node, respond, status, body));
            }
        })
    });
    for t in futures::future::join_all(tasks).await {
        t.unwrap();
    }
    let results = std::mem::take(&mut *results.lock().unwrap());
    assert_eq!(results.len(), 1200);
    let mut ok_per_item: BTreeMap<String, i64> = BTreeMap::new();
    // One key decided ok and one refused, each with the node that took it.
    let mut decided_on: BTreeMap<&'static str, (usize, usize)> = BTreeMap::new();
    for (i, node, respond, status, body) in results {
        let key = format!("k{i}");
        let outcome = if respond {
            assert_eq!(status, 200, "{key} on node {node}: {body}");
            body
        } else {
            assert_eq!(status, 202, "{key} on node {node}: {body}");
            let other = &two.nodes[1 - node];
            let (status, polled) = poll_decided(&c, other, "shop", &key).await;
            assert_eq!(status, 200, "{key} polled on node {}: {polled}", 1 - node);
            polled
        };
        assert_eq!(outcome["request_key"], key.as_str());
        assert_eq!(outcome["item"], item(i).as_str());
        match outcome["status"].as_str() {
            Some("ok") => {
                *ok_per_item.entry(item(i)).or_default() += 1;
                decided_on.entry("ok").or_insert((i, node));
            }
            Some("insufficient_stock") => {
                decided_on.entry("insufficient_stock").or_insert((i, node));
            }
            other => panic!("{key}: {other:?} in {outcome}"),
        }
    }
    // A key means one request across nodes: reused on the other node for another qty,
    // ok or refused, it is 409 with the original outcome; an exact repeat there is the
    // original.
    for (status, (i, node)) in &decided_on {
        let key = format!("k{i}");
        let url = two.nodes[1 - node].url("/v1/shops/shop/txns");
        let (code, reused) = post(
            &c,
            &url,
            json!({"seller": "s", "item": item(*i), "qty": 2, "request_id": key}),
        )
        .await;
        assert_eq!(
            (code, &reused["error"], &reused["original"]["status"]),
            (409, &json!("key_reused"), &json!(status)),
            "{key}: {reused}"
        );
        let (code, again) = post(
            &c,
            &url,
            json!({"seller": "s", "item": item(*i), "qty": 1, "request_id": key}),
        )
        .await;
        assert_eq!(
            (code, &again["status"]),
            (200, &json!(status)),
            "{key}: {again}"
        );
    }
    assert_eq!(
        decided_on.len(),
        2,
        "an ok and a refused key: {decided_on:?}"
    );
    // One key sent to both nodes at once: both WorkManagers take it as new, both send
    // it, and the item's processor applies it once and answers the other as a repeat.
    for i in 0..ITEMS {
        let key = format!("both-{i}");
        let body = json!({"seller": "s", "item": item(i), "qty": 1, "request_id": key});
        let (u0, u1) = (n0.url("/v1/shops/shop/txns"), n1.url("/v1/shops/shop/txns"));
        let (a, b) = tokio::join!(post(&c, &u0, body.clone()), post(&c, &u1, body));
        assert_eq!((a.0, b.0), (200, 200), "{key}: {} / {}", a.1, b.1);
        assert_eq!(a.1, b.1, "{key} answered differently by the two nodes");
        // Its item sold out above: the sold_out alert took a seq of its own.
        assert_eq!(a.1["seq"], 63, "{key}");
    }
    let repeats = repeats(&c, n0).await + repeats(&c, n1).await;
    eprintln!("keys sent to both nodes at once that reached a processor twice: {repeats}");
    for i in 0..ITEMS {
        assert_eq!(
            ok_per_item.get(&item(i)),
            Some(&30),
            "{}: no oversell",
            item(i)
        );
        for node in [n0, n1] {
            let (_, state) = get(&c, &node.url(&format!("/v1/shops/shop/items/{}", item(i)))).await;
            assert_eq!(
                (state["stock"].as_i64(), state["seq"].as_u64()),
                (Some(0), Some(63)),
                "{} read on {}",
                item(i),
                node.base
            );
        }
    }
    // The partitions really are shared: both nodes' processors decided, and together
    // exactly once per key (20 loads, 1,200 requests and the 20 sent to both).
    let (d0, d1) = (decisions(&c, n0).await, decisions(&c, n1).await);
    eprintln!(
        "decided by node 0: {d0} ({:.0}%), by node 1: {d1} ({:.0}%)",
        100.0 * d0 as f64 / (d0 + d1) as f64,
        100.0 * d1 as f64 / (d0 + d1) as f64
    );
    assert!(d0 > 0 && d1 > 0, "one node decided everything: {d0} / {d1}");
    assert_eq!(d0 + d1, 1240);
    // A key unknown here may be in flight on the other node: the 404 says so, so that
    // a poller knows to ask again rather than take it for lost.
    let (status, body) = get(&c, &n1.url("/v1/shops/shop/txns/never-sent")).await;
    assert_eq!(status, 404, "{body}");
    assert!(
        body["detail"].as_str().unwrap().contains("another node"),
        "{body}"
    );

    // Transfers between items the two nodes own: a ring of ten, asked of both nodes,
    // each both sides or neither, no unit made or lost.
    let ring: Vec<(String, i64)> = (0..10).map(|i| (format!("ring-{i}"), 10)).collect();
    let ring: Vec<(&str, i64)> = ring.iter().map(|(i, s)| (i.as_str(), *s)).collect();
    load(&c, n0, "shop", &ring).await;
    for i in 0..10 {
        let node = [n0, n1][i % 2];
        let body = json!({"request_id": format!("x{i}"), "from": format!("ring-{i}"),
                          "to": format!("ring-{}", (i + 1) % 10), "qty": 3});
        let (status, t) = post(&c, &node.url("/v1/shops/shop/transfers"), body).await;
        assert_eq!((status, &t["status"]), (200, &json!("ok")), "x{i}: {t}");
        let other = [n1, n0][i % 2];
        let (_, read) = get(&c, &other.url(&format!("/v1/shops/shop/transfers/x{i}"))).await;
        assert_eq!(read, t, "x{i} read on the other node");
    }
    let mut total = 0;
    for (item, _) in &ring {
        let (_, state) = get(&c, &n1.url(&format!("/v1/shops/shop/items/{item}"))).await;
        assert_eq!(state["reserved"], 0, "{state}");
        total += state["stock"].as_i64().unwrap();
    }
    assert_eq!(total, 100);
    drop_database(&two.mongo).await;
}

/// Holds pending in the journal and overdue when the nodes start again: each node arms
/// every pending hold of the shared journal, and an overdue one fires at once, before
/// the request log is attached. Its expiry must still go through the log to the item's
/// owner and be written under that partition's lease, not be decided by whichever
/// node's timer fired first: such a write carries no lease, so nothing fences it, and a
/// node that does not own the item conflicts with the one that does (the fault
/// campaign, issue 14, saw a restarted node stop on that conflict).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn holds_overdue_at_a_restart_expire_through_the_log_under_a_lease() {
    const TEST: &str = "overdue";
    const STOCK: i64 = 10;
    let Some(mut two) = start_two(TEST).await else {
        return;
    };
    let c = client();
    let items: Vec<(String, i64)> = (0..ITEMS).map(|i| (item(i), STOCK)).collect();
    let items: Vec<(&str, i64)> = items.iter().map(|(i, s)| (i.as_str(), *s)).collect();
    load(&c, &two.nodes[0], "shop", &items).await;
    for i in 0..ITEMS {
        let (status, body) = common::holds::hold(
            &c,
            &two.nodes[i % 2],
            "shop",
            &format!("h{i}"),
            &item(i),
            1,
            1_500,
        )
        .await;
        assert_eq!((status, &body["status"]), (200, &json!("held")), "{body}");
    }
    // Both nodes die with the holds pending, and start again once every one is overdue.
    two.nodes[0].kill();
    two.nodes[1].kill();
    tokio::time::sleep(Duration::from_millis(2_000)).await;
    for (n, node) in two.nodes.iter_mut().enumerate() {
        let flags = node_flags(TEST, n as u32).unwrap();
        let f: Vec<&str> = flags.iter().map(String::as_str).collect();
        *node = Server::start(two.dirs[n].path(), &f);
    }
    for n in [0, 1, 0] {
        wait_ready(&c, &two.nodes[n]).await;
    }
    for i in 0..ITEMS {
        let url = common::holds::holds_url(&two.nodes[1], "shop", &format!("/h{i}"));
        let mut ended = Value::Null;
        for _ in 0..300 {
            let (status, body) = get(&c, &url).await;
            assert_eq!(status, 200, "h{i}: {body}");
            if body["status"] != "held" {
                ended = body;
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert_eq!(ended["status"], "expired", "h{i} did not expire: {ended}");
    }
    // Every entry, the expiries too, was written under its partition's lease.
    let client = mongodb::Client::with_uri_str(&two.mongo).await.unwrap();
    let docs: Vec<Document> = client
        .default_database()
        .unwrap()
        .collection::<Document>("journal")
        .find(doc! { "shop": "shop" })
        .await
        .unwrap()
        .try_collect()
        .await
        .unwrap();
    let expiries: Vec<&Document> = docs
        .iter()
        .filter(|d| d.get_str("op") == Ok("expire"))
        .collect();
    assert_eq!(expiries.len(), ITEMS, "one expiry per hold");
    for d in &docs {
        assert!(d.get_i64("epoch").unwrap_or(0) >= 1, "no lease epoch: {d}");
    }
    // Both nodes still serve (one that met a conflicting write would have stopped), and
    // every item has its stock back.
    for node in &two.nodes {
        for i in 0..ITEMS {
            let (stock, reserved) = common::holds::item_state(&c, node, "shop", &item(i)).await;
            assert_eq!(
                (stock, reserved),
                (STOCK, 0),
                "{} on {}",
                item(i),
                node.base
            );
        }
    }
    drop_database(&two.mongo).await;
}

/// A hold whose expiry goes unanswered for longer than its copies are sent is let go by
/// the processor that armed it (it may belong to another node by then); a copy that
/// reaches it later must still expire it, from the journal, where it is pending. Here
/// each journal write is held 9 s and one shard has its two batches in flight, so the
/// expiry's copies wait in the mailbox past the let-go, which comes after two copies
/// (at 1 and 2 s past the expiry, let go at 4 s: `NRTXN_FAULT_EXPIRY_COPIES`, since the
/// fifteen copies a node sends take about ten minutes); in the fault campaign the broker
/// or the database was down, and the hold stayed held for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_hold_let_go_while_its_expiry_waited_expires_when_the_expiry_arrives() {
    const TEST: &str = "letgo";
    let Some(mut flags) = node_flags(TEST, 0) else {
        return;
    };
    for (flag, value) in [("--shards", "1"), ("--reply-timeout-ms", "60000")] {
        let at = flags.iter().position(|f| f == flag).unwrap() + 1;
        flags[at] = value.to_string();
    }
    let dir = tempfile::tempdir().unwrap();
    let f: Vec<&str> = flags.iter().map(String::as_str).collect();
    let node = Server::start_env(
        dir.path(),
        &f,
        &[
            ("NRTXN_FAULT_JOURNAL_HOLD_MS", "9000"),
            ("NRTXN_FAULT_EXPIRY_COPIES", "2"),
        ],
    );
    let c = reqwest::Client::builder()
        .timeout(Duration::from_secs(90))
        .build()
        .unwrap();
    wait_ready(&c, &node).await;
    load(&c, &node, "shop", &[("held", 10), ("other", 10)]).await;
    let hold = {
        let (c, url) = (c.clone(), common::holds::holds_url(&node, "shop", ""));
        tokio::spawn(async move {
            post(
                &c,
                &url,
                json!({"item": "held", "qty": 1, "ttl_ms": 1_000, "request_id": "h"}),
            )
            .await
        })
    };
    // A second batch in flight behind the hold's: the shard takes no more meanwhile.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let sale_url = node.url("/v1/shops/shop/txns");
    let sale = post(
        &c,
        &sale_url,
        json!({"seller": "s", "item": "other", "qty": 1, "request_id": "k"}),
    );
    let ((status, held), (sold, _)) = tokio::join!(async { hold.await.unwrap() }, sale);
    assert_eq!((status, &held["status"]), (200, &json!("held")), "{held}");
    assert_eq!(sold, 200);
    let url = common::holds::holds_url(&node, "shop", "/h");
    let mut ended = Value::Null;
    for _ in 0..600 {
        let (status, body) = get(&c, &url).await;
        assert_eq!(status, 200, "{body}");
        if body["status"] != "held" {
            ended = body;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        server_log(&node).contains("let go"),
        "the hold was never let go: the test did not make the case it is about"
    );
    assert_eq!(
        ended["status"], "expired",
        "the hold did not expire: {ended}"
    );
    let (stock, reserved) = common::holds::item_state(&c, &node, "shop", "held").await;
    assert_eq!((stock, reserved), (10, 0));
    drop_database(&mongo_uri(TEST).unwrap()).await;
}

/// What the clients of the takeover test saw, by key.
#[derive(Default)]
struct Seen {
    /// Every key sent: item, op, qty.
    sent: HashMap<String, (String, &'static str, i64)>,
    outcomes: HashMap<String, Value>,
    accepted: Vec<String>,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn node_0_takes_over_when_node_1_is_killed_under_load() {
    takeover_under_load("takeover", Fault::Kill).await;
}

/// Node 1 stalls (SIGSTOP) past the session timeout under load, node 0 takes its
/// partitions (and their leases) over, then node 1 goes on (SIGCONT) with batches it
/// decided under the old leases: the journal refuses them (fencing), node 1 keeps
/// serving, and the journal holds exactly one gapless history.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_node_that_stalls_past_the_session_timeout_is_fenced_and_goes_on() {
    takeover_under_load("stall", Fault::Stall).await;
}

#[derive(PartialEq)]
enum Fault {
    /// SIGKILL node 1.
    Kill,
    /// SIGSTOP node 1 until node 0 holds its partitions, then SIGCONT.
    Stall,
}

/// [`poll_decided`] on node 0, which on a key still pending after 30 s fails with what
/// both nodes logged about partitions moving, draining and being fenced: a key accepted
/// and never decided is a broken promise, and the logs are all that says why.
async fn poll_or_explain(c: &reqwest::Client, two: &Nodes, key: &str) -> (u16, Value) {
    let url = two.nodes[0].url(&format!("/v1/shops/shop/txns/{key}"));
    for _ in 0..600 {
        let (status, body) = get(c, &url).await;
        if status != 202 {
            return (status, body);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let moves = |server: &Server| {
        server_log(server)
            .lines()
            .filter(|l| {
                ["revoked", "assigned", "drained", "fenced", "ERROR", "WARN"]
                    .iter()
                    .any(|w| l.contains(w))
            })
            .collect::<Vec<_>>()
            .join("\n")
    };
    panic!(
        "{key} was accepted (202) and is still pending after 30 s.\nnode 0:\n{}\nnode 1:\n{}",
        moves(&two.nodes[0]),
        moves(&two.nodes[1])
    );
}

/// How many times a server's log says it was assigned partitions.
fn assignments(server: &Server) -> usize {
    server_log(server).matches("partitions assigned").count()
}

/// What a server logged so far, but the protected-mode notice.
fn server_log(server: &Server) -> String {
    std::fs::read_to_string(server.dir.join("server.log"))
        .unwrap_or_default()
        .lines()
        .filter(|l| !l.contains("protected mode"))
        .collect::<Vec<_>>()
        .join("\n")
}

fn signal(server: &Server, sig: &str) {
    let status = std::process::Command::new("kill")
        .args([sig, &server.pid().to_string()])
        .status()
        .unwrap();
    assert!(status.success(), "kill {sig}");
}

/// Two nodes under load from 16 clients, half on each; node 1 meets `fault`; node 0
/// takes its partitions over. Then every answer polls the same, every item's journal is
/// gapless and conserves stock, and every key is journaled once.
async fn takeover_under_load(test: &str, fault: Fault) {
    const LOADED: i64 = 1_000;
    // A stalled node is stopped inside a journal transaction, with decisions not yet
    // written: each of node 1's transactions is held open a while (a slow database).
    let env1: &[(&str, &str)] = match fault {
        Fault::Kill => &[],
        Fault::Stall => &[("NRTXN_FAULT_JOURNAL_HOLD_MS", "300")],
    };
    let Some(mut two) = start_two_env(test, env1).await else {
        return;
    };
    let c = client();
    let items: Vec<(String, i64)> = (0..ITEMS).map(|i| (item(i), LOADED)).collect();
    let items: Vec<(&str, i64)> = items.iter().map(|(i, s)| (i.as_str(), *s)).collect();
    load(&c, &two.nodes[0], "shop", &items).await;

    let seen = Arc::new(Mutex::new(Seen::default()));
    let stop = Arc::new(AtomicBool::new(false));
    let tasks: Vec<_> = (0..16)
        .map(|t| {
            let (c, seen, stop) = (c.clone(), seen.clone(), stop.clone());
            // Half the clients call each node; node 1's stop when it dies.
            let base = two.nodes[t % 2].base.clone();
            tokio::spawn(async move {
                let mut n = 0usize;
                while !stop.load(Ordering::Relaxed) {
                    n += 1;
                    let i = n * 16 + t;
                    let op = if n.is_multiple_of(10) {
                        "increment"
                    } else {
                        "decrement"
                    };
                    let qty = (n % 3 + 1) as i64;
                    let key = format!("c{t}-{n}");
                    seen.lock()
                        .unwrap()
                        .sent
                        .insert(key.clone(), (item(i), op, qty));
                    let body = json!({"seller": "s", "item": item(i), "qty": qty, "op": op,
                                      "request_id": key, "respond": n.is_multiple_of(2)});
                    let Ok(res) = c
                        .post(format!("{base}/v1/shops/shop/txns"))
                        .json(&body)
                        .send()
                        .await
                    else {
                        break;
                    };
                    let status = res.status().as_u16();
                    let Ok(body) = res.json::<Value>().await else {
                        break;
                    };
                    let mut s = seen.lock().unwrap();
                    match status {
                        200 => {
                            s.outcomes.insert(key, body);
                        }
                        202 => s.accepted.push(key),
                        429 | 503 | 504 => {}
                        other => panic!("unexpected {other}: {body}"),
                    }
                }
            })
        })
        .collect();
    let enough = |s: &Seen| s.outcomes.len() >= 300 && s.accepted.len() >= 300;
    for _ in 0..1200 {
        tokio::time::sleep(Duration::from_millis(50)).await;
        if enough(&seen.lock().unwrap()) {
            break;
        }
    }
    let assigned_before = assignments(&two.nodes[0]);
    match fault {
        Fault::Kill => two.nodes[1].kill(),
        Fault::Stall => signal(&two.nodes[1], "-STOP"),
    }
    let killed = std::time::Instant::now();
    let at_kill = seen.lock().unwrap().outcomes.len();
    if fault == Fault::Stall {
        // Node 0 is given node 1's partitions once the group notices (10 s); node 1
        // goes on 2 s after, or after 40 s if that never shows.
        while killed.elapsed() < Duration::from_secs(40)
            && assignments(&two.nodes[0]) == assigned_before
        {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
        eprintln!(
            "node 0 assigned again: {}; node 1 goes on {} ms after its stall",
            assignments(&two.nodes[0]) > assigned_before,
            killed.elapsed().as_millis()
        );
        signal(&two.nodes[1], "-CONT");
    }
    // Node 0's clients keep going while the group notices and node 0 takes over, until
    // node 0 has answered 200 more.
    let after = |s: &Seen| s.outcomes.len() >= at_kill + 200;
    while killed.elapsed() < Duration::from_secs(90) && !after(&seen.lock().unwrap()) {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    if fault == Fault::Stall {
        // And a while more, both nodes serving, node 1 back in the group.
        let more = seen.lock().unwrap().outcomes.len() + 200;
        let t = std::time::Instant::now();
        while t.elapsed() < Duration::from_secs(60) && seen.lock().unwrap().outcomes.len() < more {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    stop.store(true, Ordering::Relaxed);
    eprintln!(
        "node 0 answered 200 more {} ms after the fault",
        killed.elapsed().as_millis()
    );
    for t in futures::future::join_all(tasks).await {
        t.unwrap();
    }
    let seen = std::mem::take(&mut *seen.lock().unwrap());
    assert!(enough(&seen), "load too small to test");
    assert!(after(&seen), "node 0 stopped deciding after the kill");
    let n0 = &two.nodes[0];
    // Every item is answered by node 0 now, each after everything sent before it.
    let mut sent = seen.sent.clone();
    let mut decided: HashMap<String, Value> = HashMap::new();
    for i in 0..ITEMS {
        let key = format!("barrier-{i}");
        let body = json!({"seller": "s", "item": item(i), "qty": 1, "request_id": key});
        let (status, outcome) = post(&c, &n0.url("/v1/shops/shop/txns"), body).await;
        assert_eq!(status, 200, "barrier on {}: {outcome}", item(i));
        sent.insert(key.clone(), (item(i), "decrement", 1));
        decided.insert(key, outcome);
    }
    eprintln!(
        "sent {}, 200s {} ({at_kill} before the kill), 202s {}",
        seen.sent.len(),
        seen.outcomes.len(),
        seen.accepted.len()
    );
    for (key, outcome) in &seen.outcomes {
        let (status, polled) = poll_decided(&c, n0, "shop", key).await;
        assert_eq!((status, &polled), (200, outcome), "{key}");
        decided.insert(key.clone(), polled);
    }
    for key in &seen.accepted {
        let (status, polled) = poll_or_explain(&c, &two, key).await;
        assert_eq!(status, 200, "{key} was accepted (202) but is now {status}");
        decided.insert(key.clone(), polled);
    }
    // Keys whose answer died with node 1: decided or unknown, nothing in between.
    for key in sent.keys() {
        if !decided.contains_key(key) {
            let (status, polled) = poll_decided(&c, n0, "shop", key).await;
            match status {
                200 => {
                    decided.insert(key.clone(), polled);
                }
                404 => {}
                other => panic!("{key}: {other}"),
            }
        }
    }

    // The journal itself: per item, one entry per seq from 1 (the load) on, each taking
    // the stock the one before left, one entry per key, and every decided key in it.
    let client = mongodb::Client::with_uri_str(&two.mongo).await.unwrap();
    let db = client.default_database().unwrap();
    let docs: Vec<Document> = db
        .collection::<Document>("journal")
        .find(doc! { "shop": "shop" })
        .await
        .unwrap()
        .try_collect()
        .await
        .unwrap();
    let mut per_item: BTreeMap<String, Vec<&Document>> = BTreeMap::new();
    let mut keys: HashMap<&str, &Document> = HashMap::new();
    for d in &docs {
        // Every entry was written under its partition's lease.
        assert!(d.get_i64("epoch").unwrap_or(0) >= 1, "no lease epoch: {d}");
        if let Ok(key) = d.get_str("request_key") {
            assert!(keys.insert(key, d).is_none(), "{key} journaled twice");
        }
        per_item
            .entry(d.get_str("item").unwrap().to_string())
            .or_default()
            .push(d);
    }
    for (key, outcome) in &decided {
        let d = keys
            .get(key.as_str())
            .unwrap_or_else(|| panic!("{key} not journaled"));
        assert_eq!(
            d.get_str("status").unwrap(),
            outcome["status"].as_str().unwrap()
        );
        assert_eq!(
            d.get_i64("seq").unwrap() as u64,
            outcome["seq"].as_u64().unwrap()
        );
    }
    for i in 0..ITEMS {
        let name = item(i);
        let entries = per_item.get_mut(&name).unwrap();
        entries.sort_by_key(|d| d.get_i64("seq").unwrap());
        let mut stock = 0;
        let mut delta = 0;
        for (n, d) in entries.iter().enumerate() {
            assert_eq!(d.get_i64("seq").unwrap(), n as i64 + 1, "{name}: seq gap");
            assert_eq!(
                d.get_i64("stock_before").unwrap(),
                stock,
                "{name}: fork at {d}"
            );
            stock = d.get_i64("stock_after").unwrap();
            assert!(stock >= 0, "{name}: oversold at {d}");
            if let Ok(key) = d.get_str("request_key") {
                if !key.starts_with("~load:") && d.get_str("status").unwrap() == "ok" {
                    let (_, op, qty) = &sent[key];
                    delta += if *op == "increment" { *qty } else { -qty };
                }
            }
        }
        assert_eq!(stock, LOADED + delta, "{name}: stock does not conserve");
        let (_, state) = get(&c, &n0.url(&format!("/v1/shops/shop/items/{name}"))).await;
        assert_eq!(
            (state["stock"].as_i64(), state["seq"].as_u64()),
            (Some(stock), Some(entries.len() as u64)),
            "{name}"
        );
    }
    // Nothing accepted or decided is missing from the journal, and nothing in it was
    // never sent.
    for key in keys.keys() {
        assert!(
            key.starts_with("~load:") || sent.contains_key(*key),
            "{key} journaled but never sent"
        );
    }
    if fault == Fault::Stall {
        // Node 1 is serving, and the journal refused what it decided under the leases
        // it had lost.
        let n1 = &two.nodes[1];
        let res = c.get(n1.url("/v1/shops/shop/items/sku-0")).send().await;
        assert!(
            res.is_ok_and(|r| r.status() == 200),
            "node 1 no longer serves; its log:\n{}",
            server_log(n1)
        );
        let fenced = metric(&c, n1, "nrtxn_journal_fenced_total").await;
        eprintln!("node 1: {fenced} batches fenced");
        assert!(
            fenced > 0,
            "node 1 had no batch fenced; its log:\n{}",
            server_log(n1)
        );
        // What the journal refused is no longer node 1's to wait for: a partition
        // taken from it after that is handed on at once, not after the drain's 20 s
        // (during which the whole group waits).
        assert!(
            !server_log(n1).contains("revoked before they drained"),
            "node 1 waited for fenced messages at a revocation; its log:\n{}",
            server_log(n1)
        );
    }
    drop_database(&two.mongo).await;
}
