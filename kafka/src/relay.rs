//! The outbox relay: publishes every committed journal event to the events topic.
//!
//! The journal is the outbox. One thread reads it page by page after a cursor kept in
//! the journal's own store ([`Outbox::relay_read`]), sends the page to the events topic
//! keyed `{shop}:{item}` (so one item's events share a partition and stay in seq order),
//! waits until the broker has acknowledged all of it (`acks=all`, idempotent producer),
//! and only then saves the cursor after the page. A crash anywhere in between sends the
//! page again after the restart: delivery is at least once, never lossy, and a consumer
//! drops what it has seen by `seq` (see `nrtxn follow`). A failed send is retried from
//! the same cursor, so a page is never skipped.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use nrtxn_actors::{Event, Metrics, Outbox, OutboxReader, StoreError};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::producer::{BaseProducer, BaseRecord, DeliveryResult, Producer, ProducerContext};
use rdkafka::ClientContext;

use crate::{durable_producer, kafka_err, KafkaSecurity, KafkaSettings};

/// Most journal entries read (and events sent) per page.
pub const RELAY_PAGE_MAX: usize = 2_000;
/// How long the relay sleeps when nothing new is committed: the most an event waits
/// before it is read, at idle.
pub const RELAY_IDLE_POLL: Duration = Duration::from_millis(5);
/// Pause after a failed read, send or save before the same page is tried again.
const RETRY_PAUSE: Duration = Duration::from_millis(500);
/// Longest one page may take to be acknowledged before it is sent again.
const PAGE_ACK_TIMEOUT: Duration = Duration::from_secs(30);
/// Longest the final pass at shutdown goes on (then the rest waits for the next start).
const FINAL_PASS_MAX: Duration = Duration::from_secs(10);

/// Counts the page's messages the broker refused or timed out.
#[derive(Default)]
struct PageAcks {
    failed: AtomicU64,
}

impl ClientContext for PageAcks {}

impl ProducerContext for PageAcks {
    type DeliveryOpaque = ();

    fn delivery(&self, result: &DeliveryResult<'_>, _: ()) {
        if let Err((e, _)) = result {
            tracing::warn!(error = %e, "events topic refused an event; its page is sent again");
            self.failed.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// The running relay; [`EventsRelay::stop`] ends it after a last pass.
pub struct EventsRelay {
    stop: Arc<AtomicBool>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl EventsRelay {
    /// Starts the relay thread from the cursor the journal has saved.
    pub fn start(
        settings: &KafkaSettings,
        journal: Arc<dyn Outbox>,
        metrics: Arc<Metrics>,
    ) -> Result<EventsRelay, StoreError> {
        let producer: BaseProducer<PageAcks> =
            durable_producer(&settings.security, &settings.brokers)
                .set("client.id", format!("nrtxn-{}-relay", settings.node_id))
                .set("message.timeout.ms", "20000")
                .create_with_context(PageAcks::default())
                .map_err(kafka_err)?;
        let stop = Arc::new(AtomicBool::new(false));
        let relay = Relay {
            producer,
            topic: settings.events_topic.clone(),
            journal,
            metrics,
            stop: stop.clone(),
        };
        let thread = std::thread::Builder::new()
            .name("events-relay".into())
            .spawn(move || relay.run())
            .map_err(kafka_err)?;
        Ok(EventsRelay {
            stop,
            thread: Mutex::new(Some(thread)),
        })
    }

    /// Publishes what is committed by now (for at most [`FINAL_PASS_MAX`]), saves the
    /// cursor and stops. Call after the processors have flushed, before the journal
    /// closes.
    pub fn stop(&self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.lock().ok().and_then(|mut t| t.take()) {
            let _ = t.join();
        }
    }
}

struct Relay {
    producer: BaseProducer<PageAcks>,
    topic: String,
    journal: Arc<dyn Outbox>,
    metrics: Arc<Metrics>,
    stop: Arc<AtomicBool>,
}

impl Relay {
    fn run(self) {
        let mut cursor = loop {
            match self.journal.relay_cursor(OutboxReader::Events) {
                Ok(c) => break c.unwrap_or(0),
                Err(e) if self.stop.load(Ordering::Acquire) => {
                    tracing::warn!(error = %e, "relay stopped before reading its cursor");
                    return;
                }
                Err(e) => {
                    tracing::warn!(error = %e, "relay cannot read its cursor; retrying");
                    std::thread::sleep(RETRY_PAUSE);
                }
            }
        };
        tracing::info!(cursor, topic = %self.topic, "outbox relay started");
        let mut final_pass_from = None;
        loop {
            let stopping = self.stop.load(Ordering::Acquire);
            if stopping {
                let since = *final_pass_from.get_or_insert_with(std::time::Instant::now);
                if since.elapsed() > FINAL_PASS_MAX {
                    tracing::warn!(cursor, "relay stopping with events left for the next start");
                    break;
                }
            }
            let page = match self.journal.relay_read(cursor, RELAY_PAGE_MAX) {
                Ok(p) => p,
                Err(e) => {
                    tracing::warn!(error = %e, cursor, "relay cannot read the journal; retrying");
                    if stopping {
                        break;
                    }
                    std::thread::sleep(RETRY_PAUSE);
                    continue;
                }
            };
            if page.next == cursor {
                if stopping {
                    break; // everything committed is published
                }
                std::thread::sleep(RELAY_IDLE_POLL);
                continue;
            }
            if let Err(e) = self.publish(&page.events) {
                tracing::warn!(error = %e, cursor, "relay cannot publish a page; sending it again");
                if stopping {
                    break;
                }
                std::thread::sleep(RETRY_PAUSE);
                continue;
            }
            self.metrics.events_relayed.inc_by(page.events.len() as u64);
            // Saved after the broker has the page: a crash before this sends the page
            // again (at least once), never skips it.
            if let Err(e) = self.journal.relay_save(OutboxReader::Events, page.next) {
                tracing::warn!(error = %e, "relay cannot save its cursor; a restart sends these events again");
            }
            cursor = page.next;
        }
        tracing::info!(cursor, "outbox relay stopped");
    }

    /// Sends `events` in order and waits for the broker to acknowledge every one.
    fn publish(&self, events: &[Event]) -> Result<(), StoreError> {
        let acks = self.producer.context();
        acks.failed.store(0, Ordering::Relaxed);
        let mut key = String::new();
        for event in events {
            let payload = serde_json::to_vec(event).map_err(kafka_err)?;
            key.clear();
            key.push_str(&event.shop);
            key.push(':');
            key.push_str(&event.item);
            let mut record = BaseRecord::to(&self.topic).key(&key).payload(&payload);
            loop {
                match self.producer.send(record) {
                    Ok(()) => break,
                    Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), r)) => {
                        // The local queue is full: serve acknowledgements, then retry.
                        self.producer.poll(Duration::from_millis(10));
                        record = r;
                    }
                    Err((e, _)) => return Err(kafka_err(e)),
                }
            }
            self.producer.poll(Duration::ZERO);
        }
        self.producer.flush(PAGE_ACK_TIMEOUT).map_err(kafka_err)?;
        match acks.failed.load(Ordering::Relaxed) {
            0 => Ok(()),
            n => Err(kafka_err(format!(
                "{n} events of the page were not acknowledged"
            ))),
        }
    }
}

/// Events read from the events topic, each partition from its beginning, for a follower.
/// A thread polls the consumer and hands events on through a bounded channel (it waits
/// while the channel is full); it stops when the receiver is dropped.
pub struct EventsTopic {
    rx: tokio::sync::mpsc::Receiver<Event>,
}

/// Events waiting between the consumer's thread and the reader of [`EventsTopic`].
const TOPIC_CHANNEL_MAX: usize = 10_000;

impl EventsTopic {
    /// Reads every partition of `topic` from its beginning, with no consumer group (so
    /// nothing is committed and any number of followers read independently). Only the
    /// events `keep` accepts are handed on; a message that is not an event is logged
    /// and skipped (a follower fills the gap it leaves from the events route).
    pub fn open(
        brokers: &str,
        topic: &str,
        keep: impl Fn(&Event) -> bool + Send + 'static,
    ) -> Result<EventsTopic, StoreError> {
        EventsTopic::open_with(&KafkaSecurity::default(), brokers, topic, keep)
    }

    /// [`EventsTopic::open`] with TLS and credentials.
    pub fn open_with(
        security: &KafkaSecurity,
        brokers: &str,
        topic: &str,
        keep: impl Fn(&Event) -> bool + Send + 'static,
    ) -> Result<EventsTopic, StoreError> {
        use rdkafka::consumer::{BaseConsumer, Consumer};
        use rdkafka::message::Message;
        use rdkafka::{Offset, TopicPartitionList};

        let consumer: BaseConsumer = security
            .client_config(brokers)
            // librdkafka wants a group id even for assigned partitions; nothing is
            // committed under it.
            .set("group.id", "nrtxn-follow")
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false")
            .set("fetch.wait.max.ms", "10")
            .create()
            .map_err(kafka_err)?;
        let metadata = consumer
            .fetch_metadata(Some(topic), Duration::from_secs(10))
            .map_err(kafka_err)?;
        let partitions: Vec<i32> = metadata
            .topics()
            .iter()
            .filter(|t| t.name() == topic && t.error().is_none())
            .flat_map(|t| t.partitions().iter().map(|p| p.id()))
            .collect();
        if partitions.is_empty() {
            return Err(kafka_err(format!(
                "topic {topic} has no partitions (is it the events topic of an `nrtxn serve` \
                 with --kafka-brokers?)"
            )));
        }
        let mut assignment = TopicPartitionList::new();
        for p in partitions {
            assignment
                .add_partition_offset(topic, p, Offset::Beginning)
                .map_err(kafka_err)?;
        }
        consumer.assign(&assignment).map_err(kafka_err)?;
        let (tx, rx) = tokio::sync::mpsc::channel(TOPIC_CHANNEL_MAX);
        std::thread::Builder::new()
            .name("events-topic".into())
            .spawn(move || loop {
                if tx.is_closed() {
                    return;
                }
                let Some(msg) = consumer.poll(Duration::from_millis(100)) else {
                    continue;
                };
                let msg = match msg {
                    Ok(m) => m,
                    Err(e) => {
                        tracing::warn!(error = %e, "events topic");
                        continue;
                    }
                };
                let event = match serde_json::from_slice::<Event>(msg.payload().unwrap_or(&[])) {
                    Ok(e) => e,
                    Err(e) => {
                        tracing::warn!(
                            error = %e,
                            partition = msg.partition(),
                            offset = msg.offset(),
                            "skipping a message of the events topic that is not an event"
                        );
                        continue;
                    }
                };
                if keep(&event) && tx.blocking_send(event).is_err() {
                    return;
                }
            })
            .map_err(kafka_err)?;
        Ok(EventsTopic { rx })
    }

    /// The next event, waiting for one.
    pub async fn next(&mut self) -> Option<Event> {
        self.rx.recv().await
    }

    /// The next event if one is ready now.
    pub fn try_next(&mut self) -> Option<Event> {
        self.rx.try_recv().ok()
    }
}

/// The push stream's feed with several nodes: the events topic, which every node's relay
/// writes (see `docs/decisions/event-stream.md`). A cursor is `k` and the next offset of
/// every partition, in partition order, joined by `-` (`k12-0-7-3`): an item's events
/// are in one partition in seq order, so a reader that starts at these offsets misses
/// none of the events after the cursor's event and repeats none before it.
pub struct TopicFeed {
    pub security: KafkaSecurity,
    pub brokers: String,
    pub topic: String,
}

/// Items whose last seq a topic reader remembers, to drop a page the relay published
/// twice (after a crash or a failed send): about 200 bytes each, so 20 MB per stream at
/// most; past it the memory is cleared, and a duplicate of an item not seen since may
/// pass (its `seq` tells it from a new event).
const TOPIC_ITEMS_SEEN_MAX: usize = 100_000;

impl nrtxn_actors::EventFeed for TopicFeed {
    fn open(
        &self,
        shop: Arc<str>,
        after: Option<&str>,
    ) -> Result<(Box<dyn nrtxn_actors::FeedReader>, String), nrtxn_actors::FeedError> {
        use nrtxn_actors::FeedError;
        use rdkafka::consumer::{BaseConsumer, Consumer};
        use rdkafka::{Offset, TopicPartitionList};

        let from: Option<Vec<i64>> = match after {
            None => None,
            Some(c) => Some(
                c.strip_prefix('k')
                    .map(|rest| rest.split('-').map(|o| o.parse::<i64>()).collect())
                    .and_then(Result::ok)
                    .filter(|v: &Vec<i64>| !v.is_empty() && v.iter().all(|o| *o >= 0))
                    .ok_or_else(|| FeedError::BadCursor(c.to_string()))?,
            ),
        };
        let consumer: BaseConsumer = self
            .security
            .client_config(&self.brokers)
            .set("group.id", "nrtxn-stream")
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false")
            .set("fetch.wait.max.ms", "10")
            .create()
            .map_err(kafka_err)?;
        let metadata = consumer
            .fetch_metadata(Some(&self.topic), Duration::from_secs(10))
            .map_err(kafka_err)?;
        let mut partitions: Vec<i32> = metadata
            .topics()
            .iter()
            .filter(|t| t.name() == self.topic && t.error().is_none())
            .flat_map(|t| t.partitions().iter().map(|p| p.id()))
            .collect();
        partitions.sort_unstable();
        if partitions.is_empty() {
            return Err(kafka_err(format!("events topic {} has no partitions", self.topic)).into());
        }
        // Each partition's next offset: the cursor's, or the end now (a partition the
        // cursor does not know, added since, from its beginning).
        let mut next = Vec::with_capacity(partitions.len());
        for &p in &partitions {
            let at = match &from {
                Some(v) => v.get(p as usize).copied().unwrap_or(0),
                None => {
                    consumer
                        .fetch_watermarks(&self.topic, p, Duration::from_secs(10))
                        .map_err(kafka_err)?
                        .1
                }
            };
            next.push(at);
        }
        let mut assignment = TopicPartitionList::new();
        for (&p, &at) in partitions.iter().zip(&next) {
            assignment
                .add_partition_offset(&self.topic, p, Offset::Offset(at))
                .map_err(kafka_err)?;
        }
        consumer.assign(&assignment).map_err(kafka_err)?;
        let reader = TopicReader {
            consumer,
            shop,
            next,
            seen: std::collections::HashMap::new(),
        };
        let start = reader.cursor();
        Ok((Box::new(reader), start))
    }
}

struct TopicReader {
    consumer: rdkafka::consumer::BaseConsumer,
    shop: Arc<str>,
    /// Next offset of each partition, by partition id.
    next: Vec<i64>,
    /// Last seq passed on, by item.
    seen: std::collections::HashMap<Arc<str>, u64>,
}

impl TopicReader {
    fn cursor(&self) -> String {
        let mut c = String::from("k");
        for (i, o) in self.next.iter().enumerate() {
            if i > 0 {
                c.push('-');
            }
            c.push_str(&o.to_string());
        }
        c
    }
}

impl nrtxn_actors::FeedReader for TopicReader {
    fn next(&mut self, wait: Duration) -> Result<Vec<(String, Event)>, StoreError> {
        use rdkafka::message::Message;

        let mut out = Vec::new();
        let mut poll_for = wait;
        // Whatever is ready, up to a page, then hand it on.
        while out.len() < RELAY_PAGE_MAX {
            let Some(msg) = self.consumer.poll(poll_for) else {
                break;
            };
            poll_for = Duration::ZERO;
            let msg = msg.map_err(kafka_err)?;
            let p = msg.partition() as usize;
            if p >= self.next.len() {
                self.next.resize(p + 1, 0);
            }
            self.next[p] = msg.offset() + 1;
            let Ok(event) = serde_json::from_slice::<Event>(msg.payload().unwrap_or(&[])) else {
                continue;
            };
            if event.shop != self.shop {
                continue;
            }
            if self.seen.get(&event.item).is_some_and(|s| *s >= event.seq) {
                continue; // published twice by the relay (at least once)
            }
            if self.seen.len() >= TOPIC_ITEMS_SEEN_MAX {
                self.seen.clear();
            }
            self.seen.insert(event.item.clone(), event.seq);
            out.push((self.cursor(), event));
        }
        Ok(out)
    }
}
