//! Load under which a server is stopped (SIGKILL or SIGTERM) and restarted, and the
//! checks of what the clients saw against what the restarted server answers.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::*;

pub const ITEMS: [&str; 3] = ["i0", "i1", "i2"];
pub const LOADED: i64 = 1_500;

/// What the clients saw, by request key.
#[derive(Default)]
pub struct Seen {
    /// Every key sent, with its item, op and qty.
    pub sent: HashMap<String, (String, String, i64)>,
    /// Outcomes received with a 200.
    pub outcomes: HashMap<String, Value>,
    /// Keys acknowledged with a 202.
    pub accepted: Vec<String>,
    /// When each key's call was sent.
    pub sent_at: HashMap<String, Instant>,
    /// Keys whose call got no HTTP answer (the connection failed or was cut).
    pub unanswered: Vec<String>,
    /// When the server was told to stop ([`load_then_stop`]).
    pub stopped_at: Option<Instant>,
}

impl Seen {
    /// Keys sent at least `margin` before the server was told to stop: the calls a
    /// server that drains on SIGTERM must answer.
    pub fn sent_before_stop(&self, margin: Duration) -> Vec<&String> {
        let stopped = self.stopped_at.expect("stopped by load_then_stop");
        self.sent_at
            .iter()
            .filter(|(_, at)| **at + margin <= stopped)
            .map(|(key, _)| key)
            .collect()
    }
}

/// Clients send decrements (one in ten a return), half of them fire-and-forget, until
/// `stop` is set; connection errors (the server died) end a client.
pub async fn run_load(base: String, seen: Arc<Mutex<Seen>>, stop: Arc<AtomicBool>, clients: usize) {
    let c = client();
    let tasks = (0..clients).map(|n| {
        let (c, base, seen, stop) = (c.clone(), base.clone(), seen.clone(), stop.clone());
        tokio::spawn(async move {
            let mut i = 0u64;
            while !stop.load(Ordering::Relaxed) {
                i += 1;
                let item = ITEMS[(i as usize + n) % ITEMS.len()];
                let op = if i.is_multiple_of(10) {
                    "increment"
                } else {
                    "decrement"
                };
                let qty = (i % 3 + 1) as i64;
                let respond = i.is_multiple_of(2);
                let key = format!("c{n}-{i}");
                {
                    let mut s = seen.lock().unwrap();
                    s.sent.insert(key.clone(), (item.into(), op.into(), qty));
                    s.sent_at.insert(key.clone(), Instant::now());
                }
                let body = json!({"seller": "s", "item": item, "qty": qty, "op": op,
                                  "request_id": key, "respond": respond});
                let res = c
                    .post(format!("{base}/v1/shops/shop/txns"))
                    .json(&body)
                    .send()
                    .await;
                // No answer: the server died (or cut the call); the client stops.
                let answered = match res {
                    Ok(res) => {
                        let status = res.status().as_u16();
                        res.json::<Value>().await.ok().map(|body| (status, body))
                    }
                    Err(_) => None,
                };
                let Some((status, body)) = answered else {
                    seen.lock().unwrap().unanswered.push(key);
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
    });
    for t in futures::future::join_all(tasks).await {
        t.unwrap();
    }
}

/// After the restart: every outcome and every 202 a client got is answered the same by
/// polling, each item's stock is what its ok outcomes say, and the item's sequence is
/// exactly the load plus one entry per decided key, so no key was applied twice.
pub async fn check_after_restart(server: &Server, seen: &Seen) {
    let c = client();
    wait_ready(&c, server).await;
    // A barrier per item: once it is decided, everything sent before it for that item
    // is decided too (one item's requests are decided in order, whatever the log). With
    // a request log that is read back after the restart (Kafka), keys can be unknown to
    // the new process until then.
    let mut seen_sent = seen.sent.clone();
    let mut barriers = HashMap::new();
    for item in ITEMS {
        let key = format!("barrier-{item}");
        let body = json!({"seller": "s", "item": item, "qty": 1, "request_id": key});
        let (status, outcome) = post(&c, &server.url("/v1/shops/shop/txns"), body).await;
        if status != 200 {
            let log = std::fs::read_to_string(server.dir.join("server.log")).unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(40).collect();
            panic!(
                "barrier on {item}: {status} {outcome}; the server's log ends:\n{}",
                tail.into_iter().rev().collect::<Vec<_>>().join("\n")
            );
        }
        seen_sent.insert(key.clone(), (item.to_string(), "decrement".to_string(), 1));
        barriers.insert(key, outcome);
    }
    for (key, outcome) in &seen.outcomes {
        let (status, polled) = poll_decided(&c, server, "shop", key).await;
        assert_eq!(status, 200, "{key} had an outcome, now {status}");
        assert_eq!(
            &polled, outcome,
            "{key} answered differently after the restart"
        );
    }
    let mut decided: HashMap<String, Value> = barriers;
    for key in &seen.accepted {
        let (status, polled) = poll_decided(&c, server, "shop", key).await;
        assert_eq!(status, 200, "{key} was accepted (202) but is now {status}");
        decided.insert(key.clone(), polled);
    }
    // Keys whose answer the crash swallowed: decided or unknown, nothing in between.
    for key in seen_sent.keys() {
        if decided.contains_key(key) {
            continue;
        }
        let (status, polled) = poll_decided(&c, server, "shop", key).await;
        match status {
            200 => {
                decided.insert(key.clone(), polled);
            }
            404 => {}
            other => panic!("{key}: {other}"),
        }
    }
    eprintln!(
        "sent {}, answered 200 {}, answered 202 {}, decided after restart {}",
        seen.sent.len(),
        seen.outcomes.len(),
        seen.accepted.len(),
        decided.len()
    );
    let mut per_item: BTreeMap<String, (i64, Vec<u64>)> = BTreeMap::new();
    for (key, outcome) in &decided {
        let (item, op, qty) = &seen_sent[key];
        assert_eq!(outcome["item"], item.as_str());
        assert_eq!(outcome["qty"], *qty);
        let entry = per_item.entry(item.clone()).or_default();
        if outcome["status"] == "ok" {
            entry.0 += if op == "increment" { *qty } else { -qty };
        }
        entry
            .1
            .push(outcome["seq"].as_u64().expect("known item has a seq"));
    }
    for item in ITEMS {
        let (_, state) = get(&c, &server.url(&format!("/v1/shops/shop/items/{item}"))).await;
        let (delta, mut seqs) = per_item.remove(item).unwrap_or_default();
        assert_eq!(
            state["stock"].as_i64().unwrap(),
            LOADED + delta,
            "{item}: stock does not conserve"
        );
        assert!(state["stock"].as_i64().unwrap() >= 0);
        seqs.push(1); // the load
        seqs.sort_unstable();
        let last = state["seq"].as_u64().unwrap();
        assert_eq!(
            seqs,
            (1..=last).collect::<Vec<u64>>(),
            "{item}: each seq belongs to exactly one key"
        );
    }
}

/// Loads the items, runs `clients` clients until `enough` of what they saw, stops the
/// server with `stop_server` while they are still sending, then restarts it on the same
/// data directory and returns it with what the clients saw.
pub async fn load_then_stop<F>(
    flags: &[&str],
    clients: usize,
    enough: impl Fn(&Seen) -> bool,
    stop_server: F,
) -> (tempfile::TempDir, Server, Seen)
where
    F: FnOnce(&mut Server),
{
    load_then_stop_env(flags, &[], clients, enough, stop_server).await
}

/// [`load_then_stop`] with these environment variables set on the first server (faults
/// to inject); the restarted one runs without them.
pub async fn load_then_stop_env<F>(
    flags: &[&str],
    env: &[(&str, &str)],
    clients: usize,
    enough: impl Fn(&Seen) -> bool,
    stop_server: F,
) -> (tempfile::TempDir, Server, Seen)
where
    F: FnOnce(&mut Server),
{
    let dir = tempfile::tempdir().unwrap();
    let mut server = Server::start_env(dir.path(), flags, env);
    wait_ready(&client(), &server).await;
    let items: Vec<(&str, i64)> = ITEMS.iter().map(|i| (*i, LOADED)).collect();
    load(&client(), &server, "shop", &items).await;

    let seen = Arc::new(Mutex::new(Seen::default()));
    let stop = Arc::new(AtomicBool::new(false));
    let base = server.base.clone();
    let load_task = tokio::spawn(run_load(base, seen.clone(), stop.clone(), clients));
    for _ in 0..600 {
        tokio::time::sleep(Duration::from_millis(50)).await;
        if enough(&seen.lock().unwrap()) {
            break;
        }
    }
    seen.lock().unwrap().stopped_at = Some(Instant::now());
    stop_server(&mut server);
    stop.store(true, Ordering::Relaxed);
    load_task.await.unwrap();

    let server = Server::start(dir.path(), flags);
    let seen = std::mem::take(&mut *seen.lock().unwrap());
    (dir, server, seen)
}
