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
//! - Several nodes share the topic through the group. A message may reach a processor
//!   twice (redelivered after a crash or a rebalance, or one key sent by two nodes): the
//!   processor checks every key against the journal and answers a repeat with the
//!   recorded outcome, so nothing is applied twice.
//! - Partitions move between nodes in rebalances. When one is taken from this node, its
//!   reader waits (up to [`DRAIN_TIMEOUT`]) until every message of it already handed on
//!   is journaled and commits, before the group may give it to another node. When one
//!   is given to this node it gets a new assignment epoch; a processor reads an item's
//!   state back from the journal the first time it sees the item under a new epoch.
//! - Replies across nodes: the outcome of a request accepted by another node goes to
//!   the responses topic, to the partition numbered by that node's id; each node reads
//!   only its own partition and hands the outcomes to its WorkManagers.
//! - Topics are created at start if missing.
//! - Two stages of a request are timed here (`nrtxn_stage_seconds`): `produce`, an
//!   append until the broker acknowledged it, and `consume`, the message's timestamp
//!   until a reader handed it to its shard.

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use nrtxn_actors::metrics::Stages;
use nrtxn_actors::{
    Dispatcher, Leases, LogAck, LogHooks, LogPos, Outcome, Request, RequestLog, StoreError,
};
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer, ConsumerContext, Rebalance};
use rdkafka::error::RDKafkaErrorCode;
use rdkafka::message::Message;
use rdkafka::producer::{BaseRecord, DeliveryResult, Producer, ProducerContext, ThreadedProducer};
use rdkafka::{ClientContext, Offset, TopicPartitionList};
use serde::{Deserialize, Serialize};

mod relay;
mod security;
pub use relay::{EventsRelay, EventsTopic, TopicFeed, RELAY_IDLE_POLL, RELAY_PAGE_MAX};
pub use security::{KafkaSecurity, Secret, SASL_MECHANISMS, SECURITY_PROTOCOLS};

/// Messages the producer may hold unacknowledged; above the engine's in-flight bound, so
/// admission refuses first.
const PRODUCER_QUEUE_MAX: usize = 1_000_000;

/// Longest a reader holds up a rebalance to let the messages of a partition taken from
/// it be journaled; below `max.poll.interval.ms`, which bounds a rebalance.
pub const DRAIN_TIMEOUT: Duration = Duration::from_secs(20);

/// Most outcomes in one message of the responses topic (well under a message's 1 MB).
const RESPONSES_PER_MESSAGE: usize = 500;

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
    /// Longest the broker holds a reader's fetch (of requests or of responses) open when
    /// it has nothing new (`fetch.wait.max.ms`): an idle partition delays the next
    /// request up to this long, so it is small; but a broker whose storage answers a
    /// fetch more slowly than this (tansu on S3 storage lists a partition's objects per
    /// fetch, about 20 ms on the test S3 server) returns nothing, every time, and its
    /// readers stall.
    pub fetch_wait_ms: u64,
    /// Where outcomes travel to the node that accepted their request.
    pub responses_topic: String,
    /// Partitions of the responses topic when it is created: one per node id, so node
    /// ids run from 0 to this minus one.
    pub response_partitions: i32,
    /// Where the outbox relay publishes every committed event, keyed `{shop}:{item}`
    /// (created with the requests topic's partitions).
    pub events_topic: String,
    /// TLS and credentials of every client.
    pub security: KafkaSecurity,
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

/// The settings every nrtxn producer shares: idempotent, `acks=all`, and keys hashed as
/// the Java client hashes them (so other clients agree on which partition holds an
/// item, and an item's events land in the partition number its requests do).
fn durable_producer(security: &KafkaSecurity, brokers: &str) -> ClientConfig {
    let mut config = security.client_config(brokers);
    config
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .set("partitioner", "murmur2_random")
        .set("linger.ms", "1");
    config
}

/// Creates the requests, responses and events topics if they are missing.
pub fn ensure_topics(s: &KafkaSettings) -> Result<(), StoreError> {
    let admin: AdminClient<DefaultClientContext> = s
        .security
        .client_config(&s.brokers)
        .create()
        .map_err(kafka_err)?;
    let requests = NewTopic::new(
        &s.requests_topic,
        s.partitions,
        TopicReplication::Fixed(s.replication),
    );
    let responses = NewTopic::new(
        &s.responses_topic,
        s.response_partitions,
        TopicReplication::Fixed(s.replication),
    );
    let events = NewTopic::new(
        &s.events_topic,
        s.partitions,
        TopicReplication::Fixed(s.replication),
    );
    let opts = AdminOptions::new().operation_timeout(Some(Duration::from_secs(30)));
    let results =
        futures::executor::block_on(admin.create_topics([&requests, &responses, &events], &opts))
            .map_err(kafka_err)?;
    for r in results {
        match r {
            Ok(_) | Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
            Err((name, code)) => return Err(kafka_err(format!("create topic {name}: {code}"))),
        }
    }
    Ok(())
}

/// Tells a call that its fire-and-forget requests are durable (owed a `202`) once the
/// broker has them all.
struct AckGroup {
    remaining: AtomicUsize,
    failed: AtomicBool,
    ack: Mutex<Option<LogAck>>,
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
            if let Some(ack) = self.ack.lock().ok().and_then(|mut a| a.take()) {
                ack.done(result);
            }
        }
    }
}

/// What the producer keeps of each message until the broker answers for it. One box per
/// message, which the producer needed anyway for the ack group.
struct Sent {
    /// The call's fire-and-forget group, told of a `logged` request's delivery.
    ack: Option<Arc<AckGroup>>,
    /// When the request log took it ([`KafkaLog::append`]), for the `produce` stage;
    /// `None` for messages that are not a request's append (responses, expiries).
    appended: Option<Instant>,
}

struct Delivery {
    /// Where `produce` is observed.
    stages: Stages,
}

impl ClientContext for Delivery {}

impl ProducerContext for Delivery {
    type DeliveryOpaque = Box<Sent>;

    fn delivery(&self, result: &DeliveryResult<'_>, sent: Self::DeliveryOpaque) {
        if let Err((e, _)) = result {
            tracing::error!(error = %e, "request not delivered to the broker");
        }
        let Sent { ack, appended } = *sent;
        if let (Some(at), Ok(_)) = (appended, result) {
            self.stages.produce.observe(at.elapsed().as_secs_f64());
        }
        if let Some(group) = ack {
            group.done(result.is_ok());
        }
    }
}

/// Per partition: the offsets dispatched and not yet journaled, and the highest seen.
#[derive(Default)]
struct PartitionProgress {
    pending: BTreeSet<i64>,
    /// Offsets the journal refused (fenced: another node holds the partition's lease and
    /// decides them): not waited for, but no offset past them is committed from here.
    fenced: BTreeSet<i64>,
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

    /// Messages the journal refused ([`LogHooks::fenced`]): no longer this node's to
    /// decide, so no longer waited for, and never committed past.
    fn fenced(&self, positions: &[LogPos]) {
        let mut n = 0;
        if let Ok(mut parts) = self.partitions.lock() {
            for pos in positions {
                if let Some(p) = parts.get_mut(&pos.partition) {
                    if p.pending.remove(&pos.offset) {
                        p.fenced.insert(pos.offset);
                        n += 1;
                    }
                }
            }
        }
        self.undecided.fetch_sub(n, Ordering::AcqRel);
    }

    /// Messages of these partitions handed on and not yet journaled.
    fn pending_in(&self, partitions: &[i32]) -> usize {
        self.partitions
            .lock()
            .map(|parts| {
                partitions
                    .iter()
                    .filter_map(|p| parts.get(p))
                    .map(|p| p.pending.len())
                    .sum()
            })
            .unwrap_or(0)
    }

    /// Partitions taken from this node: whatever of them is still undecided is no longer
    /// this node's to count (another node reads it again from the committed offset).
    fn forget(&self, partitions: &[i32]) {
        let mut n = 0;
        if let Ok(mut parts) = self.partitions.lock() {
            for p in partitions {
                if let Some(progress) = parts.remove(p) {
                    n += progress.pending.len();
                }
            }
        }
        if n > 0 {
            self.undecided.fetch_sub(n, Ordering::AcqRel);
        }
    }

    /// Offsets that may be committed now (the next offset to read: every message below
    /// it is journaled), for the given partitions, marked as committed.
    fn commit_points(&self, assigned: &[i32]) -> Vec<(i32, i64)> {
        let mut out = Vec::new();
        if let Ok(mut parts) = self.partitions.lock() {
            for partition in assigned {
                if let Some(p) = parts.get_mut(partition) {
                    let point = p
                        .pending
                        .first()
                        .into_iter()
                        .chain(p.fenced.first())
                        .copied()
                        .min()
                        .unwrap_or(p.next);
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
    producer: Arc<ThreadedProducer<Delivery>>,
    settings: KafkaSettings,
    tracker: Arc<Tracker>,
    stop: Arc<AtomicBool>,
    /// Readers with at least one partition assigned.
    assigned: Arc<AtomicUsize>,
    readers: Mutex<Vec<JoinHandle<()>>>,
}

/// The log's producer and its hooks, made before the engine's shards start
/// ([`KafkaLog::prepare`]); its readers start once the shards run
/// ([`PreparedKafka::start`]).
pub struct PreparedKafka {
    settings: KafkaSettings,
    producer: Arc<ThreadedProducer<Delivery>>,
    tracker: Arc<Tracker>,
    stages: Stages,
}

impl KafkaLog {
    /// Creates the topics if missing and starts the producer: what the processors'
    /// hooks need ([`PreparedKafka::hooks`]), before the processors are made.
    pub fn prepare(settings: KafkaSettings, stages: Stages) -> Result<PreparedKafka, StoreError> {
        if settings.node_id as i64 >= i64::from(settings.response_partitions) {
            return Err(kafka_err(format!(
                "node id {} needs a responses topic with more than {} partitions",
                settings.node_id, settings.response_partitions
            )));
        }
        ensure_topics(&settings)?;
        let producer: ThreadedProducer<Delivery> =
            durable_producer(&settings.security, &settings.brokers)
                // Above the engine's in-flight bound: admission refuses first, so a send is
                // never refused half-way through a call.
                .set(
                    "queue.buffering.max.messages",
                    PRODUCER_QUEUE_MAX.to_string(),
                )
                .set("message.timeout.ms", "30000")
                .create_with_context(Delivery {
                    stages: stages.clone(),
                })
                .map_err(kafka_err)?;
        Ok(PreparedKafka {
            settings,
            producer: Arc::new(producer),
            tracker: Arc::new(Tracker::default()),
            stages,
        })
    }
}

impl PreparedKafka {
    /// What the processors are given to work with this log ([`LogHooks`]).
    pub fn hooks(&self) -> LogHooks {
        let hook_tracker = self.tracker.clone();
        let fence_tracker = self.tracker.clone();
        let reply_producer = self.producer.clone();
        let responses_topic = self.settings.responses_topic.clone();
        let (expiry_producer, requests_topic, node_id) = (
            self.producer.clone(),
            self.settings.requests_topic.clone(),
            self.settings.node_id,
        );
        LogHooks {
            resubmit: Arc::new(move |reqs| {
                send_requests(&expiry_producer, &requests_topic, node_id, reqs, None, None)
            }),
            node_id,
            journaled: Arc::new(move |positions| hook_tracker.journaled(&positions)),
            fenced: Arc::new(move |positions| fence_tracker.fenced(&positions)),
            remote: Arc::new(move |node, outcomes| {
                send_responses(&reply_producer, &responses_topic, node, &outcomes)
            }),
        }
    }

    /// Starts the reader pool and the reader of this node's responses partition, which
    /// hand what they read to the shards through `dispatcher`. `leases`: the journal's
    /// partition leases when several nodes write it; each partition assigned is then
    /// read under the epoch its lease take gave.
    pub fn start(
        self,
        dispatcher: Dispatcher,
        leases: Option<Arc<dyn Leases>>,
    ) -> Result<Arc<KafkaLog>, StoreError> {
        let PreparedKafka {
            settings,
            producer,
            tracker,
            stages,
        } = self;
        let log = Arc::new(KafkaLog {
            producer,
            settings: settings.clone(),
            tracker,
            stop: Arc::new(AtomicBool::new(false)),
            assigned: Arc::new(AtomicUsize::new(0)),
            readers: Mutex::new(Vec::new()),
        });
        let epochs = Arc::new(AtomicU64::new(0));
        let mut handles = Vec::new();
        for i in 0..settings.readers.max(1) {
            let context = ReaderContext {
                tracker: log.tracker.clone(),
                next_epoch: epochs.clone(),
                epochs: Mutex::new(HashMap::new()),
                leases: leases.clone(),
                stop: log.stop.clone(),
                topic: settings.requests_topic.clone(),
            };
            let consumer: BaseConsumer<ReaderContext> = settings
                .security
                .client_config(&settings.brokers)
                .set("group.id", &settings.group)
                .set("client.id", format!("nrtxn-{}-{i}", settings.node_id))
                .set("enable.auto.commit", "false")
                .set("enable.auto.offset.store", "false")
                .set("auto.offset.reset", "earliest")
                // A group join stalls on some brokers unless this is small. It also
                // bounds a rebalance, and so the drain of a partition taken away.
                .set("max.poll.interval.ms", "30000")
                .set("session.timeout.ms", "10000")
                // The broker answers a fetch as soon as there is data or after this: with
                // the default 500 ms an idle partition delays the next request that
                // much (seen: p50 252 ms on the HTTP benchmark).
                .set("fetch.wait.max.ms", settings.fetch_wait_ms.to_string())
                .create_with_context(context)
                .map_err(kafka_err)?;
            consumer
                .subscribe(&[&settings.requests_topic])
                .map_err(kafka_err)?;
            let reader = Reader {
                consumer,
                dispatcher: dispatcher.clone(),
                tracker: log.tracker.clone(),
                stop: log.stop.clone(),
                assigned: log.assigned.clone(),
                topic: settings.requests_topic.clone(),
                undecided_max: settings.undecided_max.max(1),
                stages: stages.clone(),
            };
            handles.push(
                std::thread::Builder::new()
                    .name(format!("kafka-reader-{i}"))
                    .spawn(move || reader.run())
                    .map_err(kafka_err)?,
            );
        }
        handles.push(start_responses_reader(
            &settings,
            dispatcher,
            log.stop.clone(),
        )?);
        if let Ok(mut r) = log.readers.lock() {
            *r = handles;
        }
        Ok(log)
    }
}

/// Queues requests on the requests topic, keyed by `{shop}:{item}`; `ack` (the call's
/// fire-and-forget group) is told of each `logged` one's delivery. `appended`: when the
/// request log took them, if they are an append (timed to their acknowledgement).
fn send_requests(
    producer: &ThreadedProducer<Delivery>,
    topic: &str,
    origin: u32,
    reqs: Vec<Request>,
    ack: Option<Arc<AckGroup>>,
    appended: Option<Instant>,
) {
    for req in reqs {
        let key = format!("{}:{}", req.shop, req.item);
        let ack = if req.logged { ack.clone() } else { None };
        let msg = RequestMsg {
            origin,
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
        let record = BaseRecord::with_opaque_to(topic, Box::new(Sent { ack, appended }))
            .key(&key)
            .payload(&payload);
        if let Err((e, record)) = producer.send(record) {
            // Refused locally after the caller's room check (an unknown topic, say). The
            // others of the call are queued already, so the call stands; this one's
            // fire-and-forget caller gets a 503, and it stays in flight at its
            // WorkManager (a repeat of its key waits rather than sending it twice).
            tracing::error!(error = %e, key = %key, "request not sent");
            if let Some(group) = record.delivery_opaque.ack {
                group.done(false);
            }
        }
    }
}

/// Sends outcomes to the responses partition of the node that holds their reply
/// handles. Not acknowledged to anyone: if one is lost (this node dies first), that
/// node's WorkManager finds the outcome in the journal once the key has been in flight
/// longer than the reply timeout.
fn send_responses(
    producer: &ThreadedProducer<Delivery>,
    topic: &str,
    node: u32,
    outcomes: &[Arc<Outcome>],
) {
    for chunk in outcomes.chunks(RESPONSES_PER_MESSAGE) {
        let refs: Vec<&Outcome> = chunk.iter().map(|o| &**o).collect();
        let payload = match serde_json::to_vec(&refs) {
            Ok(p) => p,
            Err(e) => {
                tracing::error!(error = %e, "responses not encoded");
                continue;
            }
        };
        let unacked = Box::new(Sent {
            ack: None,
            appended: None,
        });
        let record = BaseRecord::<(), [u8], _>::with_opaque_to(topic, unacked)
            .partition(node as i32)
            .payload(&payload);
        if let Err((e, _)) = producer.send(record) {
            tracing::warn!(error = %e, node, "responses not sent; that node reads the journal");
        }
    }
}

/// Reads this node's partition of the responses topic from its end as of now (outcomes
/// sent while this node was down have no waiting caller here) and hands what it reads
/// to the WorkManagers.
fn start_responses_reader(
    settings: &KafkaSettings,
    dispatcher: Dispatcher,
    stop: Arc<AtomicBool>,
) -> Result<JoinHandle<()>, StoreError> {
    let consumer: BaseConsumer = settings
        .security
        .client_config(&settings.brokers)
        .set(
            "group.id",
            format!("{}.responses.{}", settings.group, settings.node_id),
        )
        .set("client.id", format!("nrtxn-{}-responses", settings.node_id))
        .set("enable.auto.commit", "false")
        .set("fetch.wait.max.ms", settings.fetch_wait_ms.to_string())
        .create()
        .map_err(kafka_err)?;
    // The end offset is read before anything is sent (not left to `Offset::End`, which
    // is resolved later): a reply to any request of this process comes after it.
    let partition = settings.node_id as i32;
    let (_, end) = consumer
        .fetch_watermarks(
            &settings.responses_topic,
            partition,
            Duration::from_secs(30),
        )
        .map_err(kafka_err)?;
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition_offset(&settings.responses_topic, partition, Offset::Offset(end))
        .map_err(kafka_err)?;
    consumer.assign(&tpl).map_err(kafka_err)?;
    std::thread::Builder::new()
        .name("kafka-responses".into())
        .spawn(move || {
            while !stop.load(Ordering::Acquire) {
                match consumer.poll(Duration::from_millis(50)) {
                    Some(Ok(msg)) => {
                        match msg.payload().map(serde_json::from_slice::<Vec<Outcome>>) {
                            Some(Ok(outcomes)) => dispatcher.deliver(outcomes),
                            other => tracing::error!(?other, "unreadable responses skipped"),
                        }
                    }
                    Some(Err(e)) => tracing::warn!(error = %e, "kafka poll (responses)"),
                    None => {}
                }
            }
        })
        .map_err(kafka_err)
}

/// A reader's part in rebalances: drains a partition taken away, and gives each
/// partition assigned a new epoch.
struct ReaderContext {
    tracker: Arc<Tracker>,
    /// Shared by the pool: epochs only grow, across readers (without leases).
    next_epoch: Arc<AtomicU64>,
    epochs: Mutex<HashMap<i32, u64>>,
    /// The journal's partition leases (several nodes): the epochs come from them.
    leases: Option<Arc<dyn Leases>>,
    stop: Arc<AtomicBool>,
    topic: String,
}

impl ReaderContext {
    fn epoch(&self, partition: i32) -> u64 {
        self.epochs
            .lock()
            .ok()
            .and_then(|e| e.get(&partition).copied())
            .unwrap_or(0)
    }
}

impl ReaderContext {
    /// Takes the partitions' leases before any of their messages is read, retrying
    /// while the journal cannot be reached: a message read without its lease would be
    /// fenced anyway. Gives up only at shutdown (epoch 0: whatever is read then is
    /// refused by the journal).
    fn take_leases(&self, leases: &Arc<dyn Leases>, partitions: &[i32]) -> Vec<u64> {
        let mut wait = Duration::from_millis(100);
        loop {
            match leases.take(partitions) {
                Ok(epochs) => return epochs,
                Err(e) if self.stop.load(Ordering::Acquire) => {
                    tracing::warn!(error = %e, "partition leases not taken at shutdown");
                    return vec![0; partitions.len()];
                }
                Err(e) => {
                    tracing::warn!(error = %e, ?partitions, "taking partition leases failed; retrying");
                    std::thread::sleep(wait);
                    wait = (wait * 2).min(Duration::from_secs(2));
                }
            }
        }
    }
}

impl ClientContext for ReaderContext {}

impl ConsumerContext for ReaderContext {
    fn pre_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        let Rebalance::Revoke(tpl) = rebalance else {
            return;
        };
        let partitions: Vec<i32> = tpl.elements().iter().map(|e| e.partition()).collect();
        if partitions.is_empty() {
            return;
        }
        // Until this returns, the group gives these partitions to nobody: let what was
        // handed on be journaled, so the next owner reads the items' states after it.
        let started = Instant::now();
        let mut left = self.tracker.pending_in(&partitions);
        while left > 0 && started.elapsed() < DRAIN_TIMEOUT {
            std::thread::sleep(Duration::from_millis(5));
            left = self.tracker.pending_in(&partitions);
        }
        if left > 0 {
            // The next owner may apply them too; the journal's unique indexes refuse
            // the second writer of a key or sequence, which then stops.
            tracing::error!(?partitions, left, "partitions revoked before they drained");
        }
        let points = self.tracker.commit_points(&partitions);
        if !points.is_empty() {
            let mut commit = TopicPartitionList::new();
            for (p, offset) in points {
                let _ = commit.add_partition_offset(&self.topic, p, Offset::Offset(offset));
            }
            if let Err(e) = consumer.commit(&commit, CommitMode::Sync) {
                tracing::warn!(error = %e, "offset commit on revocation failed");
            }
        }
        self.tracker.forget(&partitions);
        if let Ok(mut epochs) = self.epochs.lock() {
            for p in &partitions {
                epochs.remove(p);
            }
        }
        tracing::info!(
            ?partitions,
            waited_ms = started.elapsed().as_millis() as u64,
            "partitions revoked"
        );
    }

    fn post_rebalance(&self, _: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        let Rebalance::Assign(tpl) = rebalance else {
            return;
        };
        let partitions: Vec<i32> = tpl.elements().iter().map(|e| e.partition()).collect();
        let taken = match &self.leases {
            Some(leases) if !partitions.is_empty() => self.take_leases(leases, &partitions),
            _ => partitions
                .iter()
                .map(|_| self.next_epoch.fetch_add(1, Ordering::AcqRel) + 1)
                .collect(),
        };
        if let Ok(mut epochs) = self.epochs.lock() {
            for (p, epoch) in partitions.iter().zip(&taken) {
                epochs.insert(*p, *epoch);
            }
        }
        tracing::info!(?partitions, epochs = ?taken, "partitions assigned");
    }
}

struct Reader {
    consumer: BaseConsumer<ReaderContext>,
    dispatcher: Dispatcher,
    tracker: Arc<Tracker>,
    stop: Arc<AtomicBool>,
    assigned: Arc<AtomicUsize>,
    topic: String,
    undecided_max: usize,
    /// Where `consume` is observed.
    stages: Stages,
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
                    Ok(msg) => {
                        self.handle(msg.partition(), msg.offset(), msg.payload());
                        if let Some(stamped_ms) = msg.timestamp().to_millis() {
                            let waited_ms = since_epoch_ms(stamped_ms);
                            self.stages.consume.observe(waited_ms / 1_000.0);
                        }
                    }
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
        let pos = LogPos {
            partition,
            offset,
            epoch: self.consumer.context().epoch(partition),
        };
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
        req.origin = Some(msg.origin);
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

/// Milliseconds from `stamped_ms` (since the epoch: a message's broker timestamp) until
/// now, never below 0 (the producer's clock may run ahead of this node's). The stamp is
/// in whole ms, so this reads up to 1 ms long, 0.5 ms on average.
fn since_epoch_ms(stamped_ms: i64) -> f64 {
    let now_ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64() * 1_000.0);
    (now_ms - stamped_ms as f64).max(0.0)
}

impl RequestLog for KafkaLog {
    fn append(&self, reqs: Vec<Request>, ack: Option<LogAck>) -> Result<(), StoreError> {
        let appended = Instant::now();
        let logged = reqs.iter().filter(|r| r.logged).count();
        let group = match ack {
            Some(ack) if logged > 0 => Some(Arc::new(AckGroup {
                remaining: AtomicUsize::new(logged),
                failed: AtomicBool::new(false),
                ack: Mutex::new(Some(ack)),
            })),
            Some(ack) => {
                ack.done(Ok(()));
                None
            }
            None => None,
        };
        // All or nothing: refuse the whole call up front if the producer's queue cannot
        // take it, because once one message is queued it will be decided, and the
        // WorkManager may only undo an admission of which nothing was handed on.
        if self.producer.in_flight_count() as usize + reqs.len() > PRODUCER_QUEUE_MAX {
            return Err(StoreError::Full);
        }
        send_requests(
            &self.producer,
            &self.settings.requests_topic,
            self.settings.node_id,
            reqs,
            group,
            Some(appended),
        );
        Ok(())
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
