//! The request log on Kafka (`--kafka-brokers`): the `RequestLog` port.
//!
//! - Requests go to the requests topic keyed by `{shop}:{item}`, so one item's requests
//!   stay in one partition, in order. The producer is idempotent with `acks=all`; a
//!   fire-and-forget request's `202` waits for the broker's acknowledgement.
//! - A reader pool (`readers` consumers in one group) takes the messages and hands each
//!   to the processor shard of its item, with its partition and offset. A reader stops
//!   fetching while `undecided_max` messages are undecided (backpressure).
//! - Offsets are committed only once every message below them is journaled: the
//!   processors report the positions of journaled entries through the dispatcher's hook.
//!   The journal records, per partition, the highest offset applied; a message at or
//!   below it (redelivered after a restart) is skipped, not applied twice.
//! - Topics are created at start if missing.
//!
//! Not yet here: several nodes (partition takeover, replies across nodes over a responses
//! topic, loads through the log). One node consumes every partition.

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use nrtxn_actors::{Dispatcher, Durable, LogPos, Request, RequestLog, StoreError};
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer, DefaultConsumerContext};
use rdkafka::error::RDKafkaErrorCode;
use rdkafka::message::Message;
use rdkafka::producer::{BaseRecord, DeliveryResult, Producer, ProducerContext, ThreadedProducer};
use rdkafka::{ClientContext, Offset, TopicPartitionList};
use serde::{Deserialize, Serialize};
use tokio::sync::oneshot;

/// Messages the producer may hold unacknowledged; above the engine's in-flight bound, so
/// admission refuses first.
const PRODUCER_QUEUE_MAX: usize = 1_000_000;

/// The Kafka options of `nrtxn serve`.
#[derive(Debug, Clone)]
pub struct KafkaSettings {
    /// `host:port,...` of the brokers.
    pub brokers: String,
    /// This node's id; recorded in each request as the node holding its reply handle.
    pub node_id: u32,
    pub requests_topic: String,
    /// Partitions of the requests topic when it is created.
    pub partitions: i32,
    /// Replication factor of the topics when they are created.
    pub replication: i32,
    /// Consumers in the reader pool.
    pub readers: usize,
    /// Consumer group of the reader pool.
    pub group: String,
    /// Most messages read and not yet journaled; readers wait beyond it.
    pub undecided_max: usize,
}

/// A message of the requests topic.
#[derive(Serialize, Deserialize, Debug)]
struct RequestMsg {
    /// The node whose WorkManager holds the reply handle.
    origin: u32,
    request: Request,
}

fn kafka_err(e: impl std::fmt::Display) -> StoreError {
    StoreError::Storage(format!("kafka: {e}"))
}

/// Creates the requests topic if it is missing.
pub fn ensure_topics(s: &KafkaSettings) -> Result<(), StoreError> {
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", &s.brokers)
        .create()
        .map_err(kafka_err)?;
    let topic = NewTopic::new(
        &s.requests_topic,
        s.partitions,
        TopicReplication::Fixed(s.replication),
    );
    let opts = AdminOptions::new().operation_timeout(Some(Duration::from_secs(30)));
    let results =
        futures::executor::block_on(admin.create_topics([&topic], &opts)).map_err(kafka_err)?;
    for r in results {
        match r {
            Ok(_) | Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
            Err((name, code)) => return Err(kafka_err(format!("create topic {name}: {code}"))),
        }
    }
    Ok(())
}

/// Resolves the `202` of a call's fire-and-forget requests once the broker has them all.
struct AckGroup {
    remaining: AtomicUsize,
    failed: AtomicBool,
    tx: Mutex<Option<oneshot::Sender<Result<(), StoreError>>>>,
}

impl AckGroup {
    fn done(&self, ok: bool) {
        if !ok {
            self.failed.store(true, Ordering::Release);
        }
        if self.remaining.fetch_sub(1, Ordering::AcqRel) == 1 {
            let result = if self.failed.load(Ordering::Acquire) {
                Err(kafka_err("a request was not acknowledged by the broker"))
            } else {
                Ok(())
            };
            if let Some(tx) = self.tx.lock().ok().and_then(|mut t| t.take()) {
                let _ = tx.send(result);
            }
        }
    }
}

struct Delivery;

impl ClientContext for Delivery {}

impl ProducerContext for Delivery {
    type DeliveryOpaque = Box<Option<Arc<AckGroup>>>;

    fn delivery(&self, result: &DeliveryResult<'_>, ack: Self::DeliveryOpaque) {
        if let Err((e, _)) = result {
            tracing::error!(error = %e, "request not delivered to the broker");
        }
        if let Some(group) = *ack {
            group.done(result.is_ok());
        }
    }
}

/// Per partition: the offsets dispatched and not yet journaled, and the highest seen.
#[derive(Default)]
struct PartitionProgress {
    pending: BTreeSet<i64>,
    next: i64,
    committed: i64,
}

/// What the readers have handed on and what of it is journaled.
#[derive(Default)]
struct Tracker {
    partitions: Mutex<HashMap<i32, PartitionProgress>>,
    undecided: AtomicUsize,
}

impl Tracker {
    fn dispatched(&self, pos: LogPos) {
        if let Ok(mut parts) = self.partitions.lock() {
            let p = parts.entry(pos.partition).or_default();
            p.pending.insert(pos.offset);
            p.next = p.next.max(pos.offset + 1);
        }
        self.undecided.fetch_add(1, Ordering::AcqRel);
    }

    /// A message that needs no decision (already applied, or unreadable).
    fn passed(&self, pos: LogPos) {
        if let Ok(mut parts) = self.partitions.lock() {
            let p = parts.entry(pos.partition).or_default();
            p.next = p.next.max(pos.offset + 1);
        }
    }

    fn journaled(&self, positions: &[LogPos]) {
        let mut n = 0;
        if let Ok(mut parts) = self.partitions.lock() {
            for pos in positions {
                if let Some(p) = parts.get_mut(&pos.partition) {
                    if p.pending.remove(&pos.offset) {
                        n += 1;
                    }
                }
            }
        }
        self.undecided.fetch_sub(n, Ordering::AcqRel);
    }

    /// Offsets that may be committed now (the next offset to read: every message below
    /// it is journaled), for the given partitions, marked as committed.
    fn commit_points(&self, assigned: &[i32]) -> Vec<(i32, i64)> {
        let mut out = Vec::new();
        if let Ok(mut parts) = self.partitions.lock() {
            for partition in assigned {
                if let Some(p) = parts.get_mut(partition) {
                    let point = p.pending.first().copied().unwrap_or(p.next);
                    if point > p.committed {
                        p.committed = point;
                        out.push((*partition, point));
                    }
                }
            }
        }
        out
    }
}

pub struct KafkaLog {
    producer: ThreadedProducer<Delivery>,
    settings: KafkaSettings,
    tracker: Arc<Tracker>,
    stop: Arc<AtomicBool>,
    /// Readers with at least one partition assigned.
    assigned: Arc<AtomicUsize>,
    readers: Mutex<Vec<JoinHandle<()>>>,
}

impl KafkaLog {
    /// Creates the topics if missing, starts the producer and the reader pool.
    /// `applied`: the highest offset the journal holds per partition.
    pub fn start(
        settings: KafkaSettings,
        dispatcher: Dispatcher,
        applied: HashMap<i32, i64>,
    ) -> Result<Arc<KafkaLog>, StoreError> {
        ensure_topics(&settings)?;
        let producer: ThreadedProducer<Delivery> = ClientConfig::new()
            .set("bootstrap.servers", &settings.brokers)
            .set("enable.idempotence", "true")
            .set("acks", "all")
            // Keys hash as the Java client hashes them, so other clients agree on
            // which partition holds an item.
            .set("partitioner", "murmur2_random")
            .set("linger.ms", "1")
            // Above the engine's in-flight bound: admission refuses first, so a send is
            // never refused half-way through a call.
            .set(
                "queue.buffering.max.messages",
                PRODUCER_QUEUE_MAX.to_string(),
            )
            .set("message.timeout.ms", "30000")
            .create_with_context(Delivery)
            .map_err(kafka_err)?;
        let tracker = Arc::new(Tracker::default());
        let hook_tracker = tracker.clone();
        dispatcher.on_journaled(Arc::new(move |positions| {
            hook_tracker.journaled(&positions)
        }));
        let log = Arc::new(KafkaLog {
            producer,
            settings: settings.clone(),
            tracker,
            stop: Arc::new(AtomicBool::new(false)),
            assigned: Arc::new(AtomicUsize::new(0)),
            readers: Mutex::new(Vec::new()),
        });
        let applied = Arc::new(applied);
        let mut handles = Vec::new();
        for i in 0..settings.readers.max(1) {
            let consumer: BaseConsumer = ClientConfig::new()
                .set("bootstrap.servers", &settings.brokers)
                .set("group.id", &settings.group)
                .set("client.id", format!("nrtxn-{}-{i}", settings.node_id))
                .set("enable.auto.commit", "false")
                .set("enable.auto.offset.store", "false")
                .set("auto.offset.reset", "earliest")
                // A group join stalls on some brokers unless this is small.
                .set("max.poll.interval.ms", "30000")
                .set("session.timeout.ms", "10000")
                // The broker answers a fetch as soon as there is data or after this: with
                // the default 500 ms an idle partition delays the next request that
                // much (seen: p50 252 ms on the HTTP benchmark).
                .set("fetch.wait.max.ms", "5")
                .create()
                .map_err(kafka_err)?;
            consumer
                .subscribe(&[&settings.requests_topic])
                .map_err(kafka_err)?;
            let reader = Reader {
                consumer,
                dispatcher: dispatcher.clone(),
                tracker: log.tracker.clone(),
                applied: applied.clone(),
                stop: log.stop.clone(),
                assigned: log.assigned.clone(),
                topic: settings.requests_topic.clone(),
                undecided_max: settings.undecided_max.max(1),
            };
            handles.push(
                std::thread::Builder::new()
                    .name(format!("kafka-reader-{i}"))
                    .spawn(move || reader.run())
                    .map_err(kafka_err)?,
            );
        }
        if let Ok(mut r) = log.readers.lock() {
            *r = handles;
        }
        Ok(log)
    }
}

struct Reader {
    consumer: BaseConsumer<DefaultConsumerContext>,
    dispatcher: Dispatcher,
    tracker: Arc<Tracker>,
    applied: Arc<HashMap<i32, i64>>,
    stop: Arc<AtomicBool>,
    assigned: Arc<AtomicUsize>,
    topic: String,
    undecided_max: usize,
}

impl Reader {
    fn run(self) {
        let mut had_assignment = false;
        let mut last_commit = Instant::now();
        while !self.stop.load(Ordering::Acquire) {
            if self.tracker.undecided.load(Ordering::Acquire) >= self.undecided_max {
                // Backpressure: let the processors catch up before fetching more.
                std::thread::sleep(Duration::from_millis(2));
            } else if let Some(msg) = self.consumer.poll(Duration::from_millis(50)) {
                match msg {
                    Ok(msg) => self.handle(msg.partition(), msg.offset(), msg.payload()),
                    Err(e) => tracing::warn!(error = %e, "kafka poll"),
                }
            }
            if last_commit.elapsed() >= Duration::from_millis(20) {
                last_commit = Instant::now();
                let partitions = self.partitions();
                let has = !partitions.is_empty();
                if has != had_assignment {
                    had_assignment = has;
                    if has {
                        self.assigned.fetch_add(1, Ordering::AcqRel);
                    } else {
                        self.assigned.fetch_sub(1, Ordering::AcqRel);
                    }
                }
                self.commit(&partitions);
            }
        }
        self.commit(&self.partitions());
        if had_assignment {
            self.assigned.fetch_sub(1, Ordering::AcqRel);
        }
    }

    fn partitions(&self) -> Vec<i32> {
        self.consumer
            .assignment()
            .map(|tpl| tpl.elements().iter().map(|e| e.partition()).collect())
            .unwrap_or_default()
    }

    fn handle(&self, partition: i32, offset: i64, payload: Option<&[u8]>) {
        let pos = LogPos { partition, offset };
        if self.applied.get(&partition).is_some_and(|a| offset <= *a) {
            // Journaled before a restart, redelivered because its offset was not yet
            // committed: applying it again would apply it twice.
            self.tracker.passed(pos);
            return;
        }
        let msg = match payload.map(serde_json::from_slice::<RequestMsg>) {
            Some(Ok(msg)) => msg,
            other => {
                tracing::error!(
                    partition,
                    offset,
                    ?other,
                    "unreadable request message skipped"
                );
                self.tracker.passed(pos);
                return;
            }
        };
        let mut req = msg.request;
        req.log_pos = Some(pos);
        self.tracker.dispatched(pos);
        self.dispatcher.dispatch(vec![req]);
    }

    fn commit(&self, partitions: &[i32]) {
        let points = self.tracker.commit_points(partitions);
        if points.is_empty() {
            return;
        }
        let mut tpl = TopicPartitionList::new();
        for (p, offset) in points {
            if let Err(e) = tpl.add_partition_offset(&self.topic, p, Offset::Offset(offset)) {
                tracing::warn!(error = %e, "offset list");
            }
        }
        if let Err(e) = self.consumer.commit(&tpl, CommitMode::Async) {
            tracing::warn!(error = %e, "offset commit failed; a later commit covers it");
        }
    }
}

impl RequestLog for KafkaLog {
    fn append(&self, reqs: Vec<Request>) -> Result<Option<Durable>, StoreError> {
        let logged = reqs.iter().filter(|r| r.logged).count();
        let (group, rx) = if logged > 0 {
            let (tx, rx) = oneshot::channel();
            let group = Arc::new(AckGroup {
                remaining: AtomicUsize::new(logged),
                failed: AtomicBool::new(false),
                tx: Mutex::new(Some(tx)),
            });
            (Some(group), Some(rx))
        } else {
            (None, None)
        };
        // All or nothing: refuse the whole call up front if the producer's queue cannot
        // take it, because once one message is queued it will be decided, and the
        // WorkManager may only undo an admission of which nothing was handed on.
        if self.producer.in_flight_count() as usize + reqs.len() > PRODUCER_QUEUE_MAX {
            return Err(StoreError::Full);
        }
        for req in reqs {
            let key = format!("{}:{}", req.shop, req.item);
            let ack = if req.logged { group.clone() } else { None };
            let msg = RequestMsg {
                origin: self.settings.node_id,
                request: req,
            };
            let payload = match serde_json::to_vec(&msg) {
                Ok(p) => p,
                Err(e) => {
                    tracing::error!(error = %e, "request not encoded");
                    if let Some(group) = ack {
                        group.done(false);
                    }
                    continue;
                }
            };
            let record = BaseRecord::with_opaque_to(&self.settings.requests_topic, Box::new(ack))
                .key(&key)
                .payload(&payload);
            if let Err((e, record)) = self.producer.send(record) {
                // Refused locally after the check above (an unknown topic, say). The
                // others of the call are queued already, so the call stands; this one's
                // fire-and-forget caller gets a 503, and it stays in flight at its
                // WorkManager (a repeat of its key waits rather than sending it twice).
                tracing::error!(error = %e, key = %key, "request not sent");
                if let Some(group) = *record.delivery_opaque {
                    group.done(false);
                }
            }
        }
        Ok(rx)
    }

    fn pending(&self) -> Result<Vec<Request>, StoreError> {
        // Kafka redelivers what was not committed; nothing to resume by hand.
        Ok(Vec::new())
    }

    fn redeliver(&self, _reqs: Vec<Request>) {}

    fn ready(&self) -> bool {
        self.assigned.load(Ordering::Acquire) > 0
    }

    fn close(&self) {
        self.stop.store(true, Ordering::Release);
        if let Ok(mut readers) = self.readers.lock() {
            for r in readers.drain(..) {
                let _ = r.join();
            }
        }
        let _ = self.producer.flush(Duration::from_secs(10));
    }
}
