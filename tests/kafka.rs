//! The Kafka request log, end to end on one node: HTTP → WorkManager → Kafka → reader
//! pool → processors → journal, and the outbox relay from the journal to the events
//! topic and on to followers, against the Kafka-protocol test broker that
//! `scripts/test.sh` starts on loopback.

mod common;

use common::holds::*;
use common::load::*;
use common::*;
use nrtxn_actors::{Event, Op};
use nrtxn_client::follow::{Follower, HttpBackfill};
use nrtxn_kafka::EventsTopic;
use serde_json::json;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_through_kafka_are_answered_and_polled() {
    let Some(flags) = kafka_flags("api") else {
        return;
    };
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path(), &flags);
    let c = client();
    wait_ready(&c, &server).await;
    load(&c, &server, "s1", &[("sku-1", 5)]).await;
    let url = server.url("/v1/shops/s1/txns");

    let (status, first) = post(
        &c,
        &url,
        json!({"seller": "a", "item": "sku-1", "qty": 2, "req_time": 1}),
    )
    .await;
    assert_eq!(
        (status, first["status"].as_str()),
        (200, Some("ok")),
        "{first}"
    );
    assert_eq!(
        (first["stock_after"].as_i64(), first["seq"].as_u64()),
        (Some(3), Some(2))
    );
    // Who and when, through Kafka and MongoDB: a buyer the request left out is left out.
    assert_eq!(first["seller"], "a");
    assert!(first.get("buyer").is_none(), "{first}");
    assert_eq!(first["requested_at"], first["submitted_at"]);
    let (status, again) = post(
        &c,
        &url,
        json!({"seller": "a", "item": "sku-1", "qty": 2, "req_time": 1}),
    )
    .await;
    assert_eq!((status, &again), (200, &first));

    let body = json!({"seller": "a", "item": "sku-1", "qty": 4, "req_time": 2, "respond": false});
    let (status, accepted) = post(&c, &url, body).await;
    assert_eq!(
        (status, accepted["status"].as_str()),
        (202, Some("accepted"))
    );
    let (status, decided) = poll_decided(&c, &server, "s1", "a:sku-1:2").await;
    assert_eq!(
        (status, decided["status"].as_str()),
        (200, Some("insufficient_stock"))
    );
    assert_eq!(decided["seller"], "a");
    assert!(decided["requested_at"].as_i64() <= decided["completed_at"].as_i64());
    let events = route_events(&server, "s1", "sku-1").await;
    let sale = events
        .iter()
        .find(|e| e.request_key.as_deref() == Some("a:sku-1:1"))
        .unwrap();
    assert_eq!(
        (sale.seller.as_deref(), sale.requested_at),
        (Some("a"), first["requested_at"].as_i64().unwrap())
    );

    let (_, item) = get(&c, &server.url("/v1/shops/s1/items/sku-1")).await;
    assert_eq!(
        (item["stock"].as_i64(), item["seq"].as_u64()),
        (Some(3), Some(3))
    );
    // Stock alerts through Kafka and MongoDB: the settings in MongoDB, the alert sent
    // by the node that journaled it.
    let shop = receiver::Receiver::start();
    let (status, settings) = call(
        &c,
        reqwest::Method::PUT,
        &server.url("/v1/shops/s1/settings"),
        Some(json!({"notify_url": shop.url, "notify_events": ["sold_out"]}).to_string()),
    )
    .await;
    assert_eq!(status, 200, "{settings}");
    // A partial fill through Kafka and MongoDB: 5 asked, at least 1, the 3 left taken.
    let body =
        json!({"seller": "a", "item": "sku-1", "qty": 5, "min_qty": 1, "request_id": "part"});
    let (_, part) = post(&c, &url, body).await;
    assert_eq!(
        (&part["status"], &part["qty"], &part["qty_taken"]),
        (&json!("ok"), &json!(5), &json!(3)),
        "{part}"
    );
    let (_, polled) = get(&c, &server.url("/v1/shops/s1/txns/part")).await;
    assert_eq!(polled, part);
    // A sale window through the log: not open yet, the window in the answer.
    let opens = holds::now_ms() + 3_600_000;
    let window = json!({"items": [{"item": "later", "stock": 5, "opens_at": opens}]});
    let (status, loaded) = call(
        &c,
        reqwest::Method::PUT,
        &server.url("/v1/shops/s1/items"),
        Some(window.to_string()),
    )
    .await;
    assert_eq!(
        (status, &loaded["items"][0]["opens_at"]),
        (200, &json!(opens)),
        "{loaded}"
    );
    let (_, early) = post(
        &c,
        &url,
        json!({"seller": "a", "item": "later", "qty": 1, "request_id": "early"}),
    )
    .await;
    assert_eq!(
        (&early["status"], &early["opens_at"]),
        (&json!("not_open"), &json!(opens)),
        "{early}"
    );
    let (_, later) = get(&c, &server.url("/v1/shops/s1/items/later")).await;
    assert_eq!(
        (&later["opens_at"], &later["closes_at"], &later["stock"]),
        (&json!(opens), &serde_json::Value::Null, &json!(5)),
        "{later}"
    );
    // The partial fill took the last 3: its item's sold_out alert follows it.
    let sold = route_events(&server, "s1", "sku-1").await;
    let kinds: Vec<_> = sold
        .iter()
        .rev()
        .take(2)
        .map(|e| (e.kind, e.qty, e.qty_taken))
        .collect();
    assert_eq!(kinds, [(Op::SoldOut, 0, None), (Op::Decrement, 5, Some(3))]);
    let alert_seq = sold.last().unwrap().seq;
    let calls = shop
        .wait_for(std::time::Duration::from_secs(20), |c| !c.is_empty())
        .await;
    let alert = calls[0].json();
    assert_eq!(
        (
            &alert["kind"],
            &alert["item"],
            &alert["stock"],
            &alert["seq"]
        ),
        (
            &json!("sold_out"),
            &json!("sku-1"),
            &json!(0),
            &json!(alert_seq)
        ),
        "{alert}"
    );

    // Every stage of the path through Kafka was timed (the journal's is
    // nrtxn_journal_write_seconds).
    for stage in ["produce", "consume", "screen", "reply", "total"] {
        let name = format!("nrtxn_stage_seconds_count{{stage=\"{stage}\"}}");
        let observed = metric(&c, &server, &name).await;
        assert!(observed >= 1, "stage {stage} never observed");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_log_keeps_every_answer_and_applies_nothing_twice_across_a_sigkill() {
    let Some(flags) = kafka_flags("sigkill") else {
        return;
    };
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let enough = |s: &Seen| s.outcomes.len() >= 300 && s.accepted.len() >= 300;
    let (_dir, server, seen) = load_then_stop(&flags, 16, enough, Server::kill).await;
    assert!(enough(&seen), "load too small to test");
    // Redelivered messages (read, journaled, offset not yet committed) must be skipped:
    // the sequence check in here fails if any were applied twice.
    check_after_restart(&server, &seen).await;
}

/// With a shared journal (Kafka and MongoDB) a hold's expiry travels through the log to
/// the item's owner, and confirm and cancel travel like any request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn holds_through_kafka_and_mongo_expire_through_the_log() {
    let (Some(flags), Some(uri)) = (kafka_flags("holds"), mongo_uri("kafka_holds")) else {
        return;
    };
    let brokers = flag_value(&flags, "--kafka-brokers");
    let events_topic = flag_value(&flags, "--kafka-events-topic");
    let mut flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    flags.extend(["--mongo-uri", uri.as_str()]);
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path(), &flags);
    let c = client();
    wait_ready(&c, &server).await;
    load(&c, &server, "s", &[("a", 10)]).await;
    let (status, body) = hold(&c, &server, "s", "kept", "a", 2, 60_000).await;
    assert_eq!((status, &body["status"]), (200, &json!("held")), "{body}");
    // Extended through the log: journaled in MongoDB as the item's next entry.
    let asked = holds::now_ms();
    let (status, ext) = post(
        &c,
        &holds_url(&server, "s", "/kept/extend"),
        json!({"ttl_ms": 120_000}),
    )
    .await;
    assert_eq!((status, &ext["status"]), (200, &json!("held")), "{ext}");
    assert!(
        ext["expires_at"].as_i64().unwrap() >= asked + 120_000,
        "{ext}"
    );
    let (status, body) = post(&c, &holds_url(&server, "s", "/kept/cancel"), json!({})).await;
    assert_eq!(
        (status, &body["status"]),
        (200, &json!("released")),
        "{body}"
    );
    let (_, short) = hold(&c, &server, "s", "short", "a", 3, 300).await;
    assert_eq!(short["status"], "held", "{short}");
    assert_eq!(item_state(&c, &server, "s", "a").await, (7, 3));
    // Listed from MongoDB: the released one and the pending one, by state.
    let (_, listed) = get(&c, &holds_url(&server, "s", "?item=a")).await;
    let states: Vec<(&str, &str)> = listed["holds"]
        .as_array()
        .unwrap()
        .iter()
        .map(|h| {
            (
                h["hold_id"].as_str().unwrap(),
                h["status"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        states,
        [("kept", "released"), ("short", "held")],
        "{listed}"
    );
    let (_, held) = get(&c, &holds_url(&server, "s", "?state=held")).await;
    assert_eq!(held["holds"].as_array().map(Vec::len), Some(1), "{held}");
    // A load travels through the log too, and its answer shows the stock still held.
    let reload = c
        .put(server.url("/v1/shops/s/items"))
        .json(&json!({"items": [{"item": "a", "stock": 7}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(reload.status(), 200);
    let reload: serde_json::Value = reload.json().await.unwrap();
    assert_eq!(
        (
            &reload["items"][0]["stock"],
            &reload["items"][0]["reserved"]
        ),
        (&json!(7), &json!(3)),
        "{reload}"
    );
    assert_eq!(
        wait_ended(&c, &server, "s", "short").await["status"],
        "expired"
    );
    wait_item_state(&c, &server, "s", "a", (10, 0)).await;
    let all = events(&c, &server, "s", "a", 1000).await;
    let kinds: Vec<&str> = all.iter().map(|e| e["kind"].as_str().unwrap()).collect();
    assert_eq!(
        kinds,
        ["load", "hold", "extend", "release", "hold", "load", "expire"]
    );
    let late = lateness_ms(&all, "short", short["expires_at"].as_i64().unwrap());
    assert!(late >= 0, "expired early");

    // The MongoDB journal's outbox relay (this node's batches) published them in order.
    let journal = route_events(&server, "s", "a").await;
    let truth = HashMap::from([("a".to_string(), journal.len() as u64)]);
    let mut read = read_topic_until(&brokers, &events_topic, &truth).await;
    read.dedup_by_key(|e| e.seq);
    assert_eq!(read, journal);

    // An operator's release of the item's holds, through the log: once per request_id.
    let (_, long) = hold(&c, &server, "s", "long", "a", 4, 60_000).await;
    assert_eq!(long["status"], "held", "{long}");
    let url = server.url("/v1/shops/s/items/a/release-holds");
    let (status, released) = post(&c, &url, json!({"request_id": "r1"})).await;
    assert_eq!(
        (status, &released["holds_released"]),
        (200, &json!(1)),
        "{released}"
    );
    assert_eq!(item_state(&c, &server, "s", "a").await, (10, 0));
    let (_, again) = post(&c, &url, json!({"request_id": "r1"})).await;
    assert_eq!(again, released);
    drop_database(&uri).await;
}

/// Every event of `item`, from the server's events route, page by page.
async fn route_events(server: &Server, shop: &str, item: &str) -> Vec<Event> {
    let route = HttpBackfill::new(&server.base, Duration::from_secs(30)).unwrap();
    let mut all: Vec<Event> = Vec::new();
    loop {
        let after = all.last().map_or(0, |e| e.seq);
        let page = route.page(shop, item, after, 1000).await.unwrap();
        if page.is_empty() {
            return all;
        }
        all.extend(page);
    }
}

/// Changes `items` of `shop` from one task per item (one in five a return), until
/// `stop` is set; failed calls (the server killed under it) are let go.
fn change_items(
    base: String,
    shop: &'static str,
    items: &[&'static str],
    stop: Arc<AtomicBool>,
    tag: &'static str,
) -> Vec<tokio::task::JoinHandle<u64>> {
    items
        .iter()
        .map(|&item| {
            let (base, stop) = (base.clone(), stop.clone());
            tokio::spawn(async move {
                let c = client();
                let url = format!("{base}/v1/shops/{shop}/txns");
                let mut n = 0u64;
                while !stop.load(Ordering::Acquire) {
                    let op = if n % 5 == 4 { "increment" } else { "decrement" };
                    let body = json!({
                        "seller": "s-1", "item": item, "qty": 1, "op": op,
                        "request_id": format!("{tag}-{item}-{n}"),
                    });
                    if c.post(&url).json(&body).send().await.is_err() {
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                    n += 1;
                }
                n
            })
        })
        .collect()
}

/// Reads the events topic until it holds, for each item, the last seq of `truth`
/// (for up to 60 s); returns what it read, in topic order.
async fn read_topic_until(brokers: &str, topic: &str, truth: &HashMap<String, u64>) -> Vec<Event> {
    let mut topic = EventsTopic::open(brokers, topic, |_| true).expect("events topic");
    let mut read = Vec::new();
    let mut top: HashMap<String, u64> = HashMap::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    while truth.iter().any(|(item, last)| top.get(item) < Some(last)) {
        let left = deadline.saturating_duration_since(Instant::now());
        let Ok(Some(e)) = tokio::time::timeout(left, topic.next()).await else {
            panic!("the events topic stopped short: read up to {top:?}, the journal has {truth:?}");
        };
        let seq = top.entry(e.item.to_string()).or_default();
        *seq = (*seq).max(e.seq);
        read.push(e);
    }
    read
}

/// The outbox relay publishes each committed event, keyed by item, in seq order per
/// item, and its progress survives a SIGKILL: after the restart the topic still holds
/// every event (an event may appear twice, never be missing or out of order).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_outbox_relay_publishes_every_event_in_seq_order_and_resumes_after_a_sigkill() {
    let Some(flags) = kafka_flags("relay") else {
        return;
    };
    let brokers = flag_value(&flags, "--kafka-brokers");
    let events_topic = flag_value(&flags, "--kafka-events-topic");
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let dir = tempfile::tempdir().unwrap();
    let mut server = Server::start(dir.path(), &flags);
    let c = client();
    wait_ready(&c, &server).await;
    let items = ["a", "b", "c"];
    load(
        &c,
        &server,
        "s",
        &[("a", 100_000), ("b", 100_000), ("c", 100_000)],
    )
    .await;

    // Killed while changes are being made and relayed.
    let stop = Arc::new(AtomicBool::new(false));
    let tasks = change_items(server.base.clone(), "s", &items, stop.clone(), "before");
    tokio::time::sleep(Duration::from_millis(1500)).await;
    server.kill();
    stop.store(true, Ordering::Release);
    for t in tasks {
        assert!(t.await.unwrap() > 10, "too few changes before the kill");
    }
    let server = Server::start(dir.path(), &flags);
    wait_ready(&c, &server).await;
    let stop = Arc::new(AtomicBool::new(false));
    let tasks = change_items(server.base.clone(), "s", &items, stop.clone(), "after");
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.store(true, Ordering::Release);
    for t in tasks {
        t.await.unwrap();
    }

    let mut truth = HashMap::new();
    let mut journal = HashMap::new();
    for item in items {
        let events = route_events(&server, "s", item).await;
        truth.insert(item.to_string(), events.last().unwrap().seq);
        journal.insert(item.to_string(), events);
    }
    let read = read_topic_until(&brokers, &events_topic, &truth).await;
    let mut seen: HashMap<String, u64> = HashMap::new();
    let mut repeats = 0;
    for e in &read {
        let last = seen.entry(e.item.to_string()).or_default();
        if e.seq <= *last {
            repeats += 1;
            continue;
        }
        // The next new event of an item is always the one after the last: none is lost
        // or overtaken.
        assert_eq!(e.seq, *last + 1, "{}: {} after {}", e.item, e.seq, *last);
        assert_eq!(e, &journal[&*e.item][e.seq as usize - 1], "as journaled");
        *last = e.seq;
    }
    eprintln!(
        "relay: {} events read for {:?}, {repeats} repeated",
        read.len(),
        truth
    );
}

/// `nrtxn follow --kafka-brokers` and the `Follower` library, fed from the events topic:
/// messages dropped and duplicated between the relay and the follower are filled from
/// the events route and dropped again, so every item's output is its journal, gapless
/// and in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn following_the_events_topic_through_dropped_and_duplicated_messages_is_gapless() {
    let Some(flags) = kafka_flags("follow") else {
        return;
    };
    let brokers = flag_value(&flags, "--kafka-brokers");
    let events_topic = flag_value(&flags, "--kafka-events-topic");
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path(), &flags);
    let c = client();
    wait_ready(&c, &server).await;
    let items = ["a", "b"];
    load(&c, &server, "s", &[("a", 100_000), ("b", 100_000)]).await;
    load(&c, &server, "other", &[("a", 5)]).await;
    let stop = Arc::new(AtomicBool::new(false));
    let tasks = change_items(server.base.clone(), "s", &items, stop.clone(), "f");
    tokio::time::sleep(Duration::from_millis(1000)).await;
    stop.store(true, Ordering::Release);
    for t in tasks {
        assert!(t.await.unwrap() > 10, "too few changes");
    }
    let mut journal = HashMap::new();
    for item in items {
        journal.insert(item.to_string(), route_events(&server, "s", item).await);
    }
    let total: usize = journal.values().map(Vec::len).sum();

    // The library, with faults injected between the topic and the follower: one message
    // in four lost (with a run of five), one in six delivered twice, and a replay of an
    // earlier stretch, as a consumer re-reading from an older offset would see.
    let truth = journal
        .iter()
        .map(|(item, events)| (item.clone(), events.last().unwrap().seq))
        .collect();
    let read = read_topic_until(&brokers, &events_topic, &truth).await;
    let read: Vec<Event> = read.into_iter().filter(|e| &*e.shop == "s").collect();
    let mut faulty = Vec::new();
    for (n, e) in read.iter().enumerate() {
        let last_of_item = e.seq == truth[&*e.item];
        let lost = !last_of_item && (n % 4 == 1 || (20..25).contains(&n));
        if !lost {
            faulty.push(e.clone());
            if n % 6 == 0 {
                faulty.push(e.clone());
            }
        }
        if n == 40 {
            faulty.extend(read[10..30].iter().cloned());
        }
    }
    let backfill = HttpBackfill::new(&server.base, Duration::from_secs(30)).unwrap();
    let mut follower = Follower::new(backfill);
    let mut out = Vec::new();
    for e in faulty {
        follower.push_into(e, &mut out).await.unwrap();
    }
    for item in items {
        let of_item: Vec<Event> = out.iter().filter(|e| &*e.item == item).cloned().collect();
        assert_eq!(of_item, journal[item], "{item}");
    }
    let stats = follower.stats();
    assert!(
        stats.gaps_filled > 0 && stats.duplicates_dropped > 0,
        "{stats:?}"
    );

    // The subcommand: a whole shop (the other shop's events are not printed).
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_nrtxn"))
        .args(["follow", "--url", &server.base, "--shop", "s"])
        .args([
            "--kafka-brokers",
            &brokers,
            "--kafka-events-topic",
            &events_topic,
        ])
        .args(["--max-events", &total.to_string()])
        .env("RUST_LOG", "warn")
        .output()
        .expect("nrtxn follow");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    let printed: Vec<Event> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l:?}")))
        .collect();
    assert_eq!(printed.len(), total, "{err}");
    for item in items {
        let of_item: Vec<Event> = printed
            .iter()
            .filter(|e| &*e.item == item)
            .cloned()
            .collect();
        assert_eq!(of_item, journal[item], "{item}");
    }
    assert!(err.contains(&format!("{total} events printed")), "{err}");
}

fn flag_value(flags: &[String], name: &str) -> String {
    let at = flags.iter().position(|f| f == name).expect(name);
    flags[at + 1].clone()
}
