//! Prometheus metrics of the engine and the HTTP front.

use prometheus::{
    exponential_buckets, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec,
    IntGauge, IntGaugeVec, Opts, Registry, TextEncoder,
};

/// The help text of `nrtxn_stage_seconds`, a sentence per stage label: `/metrics` is
/// where a reader meets the labels, so their meaning is said there.
const STAGE_HELP: &str = "Time of a request in each stage on its way through a node. \
stage=produce: the request log's append until the Kafka broker acknowledged the message, \
per request (Kafka only). \
stage=consume: from the message's broker timestamp (CreateTime, stamped by the producer \
when the message is made, so it overlaps produce) until a reader handed it to its \
processor shard, per request, ms resolution, clock skew clamped to 0 (Kafka only). \
stage=screen: the journal reads a batch waits for before it is applied (keys a shared log \
may have delivered before, items out of memory), per batch that needed reads. \
stage=reply: from the processor (or the responses reader) sending a shop's outcomes to its \
WorkManager until the WorkManager set each waiting caller's reply, per request answered. \
stage=total: from the WorkManager taking a call until it set a waiting caller's reply with \
its outcome, per request answered with a decision (not those answered pending at their \
deadline). \
The journal's own stage is nrtxn_journal_write_seconds (per journal transaction).";

/// The labelled children of `nrtxn_stage_seconds`, looked up once: an observation on the
/// request path is then a few atomic adds, with no label lookup and no allocation.
#[derive(Clone)]
pub struct Stages {
    /// Kafka: an append until the broker acknowledged it (`kafka/src/lib.rs`, delivery).
    pub produce: Histogram,
    /// Kafka: the message's timestamp until a reader handed it to its shard.
    pub consume: Histogram,
    /// A batch's journal reads before it is applied (`processor/reads.rs`).
    pub screen: Histogram,
    /// Outcomes sent to a WorkManager until its callers' replies are set.
    pub reply: Histogram,
    /// The WorkManager taking a call until it set a caller's reply with its outcome.
    pub total: Histogram,
}

/// One registry for the process; cheap to share behind an `Arc`.
pub struct Metrics {
    registry: Registry,
    /// Requests answered, by route pattern and HTTP status.
    pub http_requests: IntCounterVec,
    /// Depth of each bounded queue: `inflight` (admitted, undecided requests) and one
    /// `shard_N` per processor mailbox.
    pub queue_depth: IntGaugeVec,
    /// Entries per processor batch (one journal append each).
    pub batch_entries: Histogram,
    /// Entries per journal transaction (batches of several shards commit together).
    pub journal_txn_entries: Histogram,
    /// Time of one durable journal transaction, from begin to durable commit.
    pub journal_write_seconds: Histogram,
    /// Entries per commit of a SQLite store beside the journal, by `store`: `views` (the
    /// embedded journal's views, derived from its log) or `requests` (the request log
    /// beside MongoDB). Apart from the journal's own figures, so that those count each
    /// entry once, in the group commit that made it durable.
    pub sqlite_commit_entries: HistogramVec,
    /// Time of one such commit, by `store`.
    pub sqlite_commit_seconds: HistogramVec,
    /// Decisions by status.
    pub decisions: IntCounterVec,
    /// Requests that reached a processor with a key that already had an outcome (a
    /// shared log: sent by two nodes, or delivered again after a crash or a rebalance).
    pub repeats: IntCounter,
    /// Journal batches a journal shared by several nodes refused, whole or in part,
    /// because their partition's write lease had passed to another node (a stale
    /// writer, fenced).
    pub journal_fenced: IntCounter,
    /// Kept segments of the embedded log that the full read after a start found damaged
    /// (a start checks them by their footer alone; see `log/src/seal.rs`).
    pub journal_damaged_segments: IntGauge,
    /// Check-backs asked of shops, by what came of them (`confirm`, `release`,
    /// `extend`, `default`: no answer, so the shop's default applied).
    pub checks: IntCounterVec,
    /// Check-backs that found no answer after their attempts (listed as dead letters).
    pub check_dead_letters: IntCounter,
    /// Events the outbox relay published to the events topic (a page sent again after a
    /// failure counts again).
    pub events_relayed: IntCounter,
    /// Alerts sent to shops' `notify_url`, by what came of them (`sent`, `failed`: for
    /// good, after every attempt).
    pub alerts: IntCounterVec,
    /// How much of each memory bound is in use, read when metrics are scraped: `shops`
    /// (WorkManagers in memory, of `shops_max`), `outcomes_cached` (of
    /// `outcome_cache_total`), `body_bytes` (request bodies held, of `body_bytes_max`).
    pub bound_used: IntGaugeVec,
    /// The process's memory by part (`allocated`, `resident`, `sqlite`), filled each
    /// second by the binary, which owns the allocator (`src/memory.rs`).
    pub memory: IntGaugeVec,
    /// Where a request's time goes: `nrtxn_stage_seconds{stage}` (see [`STAGE_HELP`]),
    /// its children looked up once. The Kafka request log gets a clone (`produce`,
    /// `consume`).
    pub stage: Stages,
    /// Per-shop live figures for the dashboard (not exported to Prometheus: a label per
    /// shop would be unbounded).
    pub shops: crate::shop_stats::ShopStats,
}

impl Metrics {
    pub fn new() -> Metrics {
        let registry = Registry::new();
        let r = Registrar(&registry);
        let (http_requests, queue_depth, bound_used, memory) = front_metrics(&r);
        let (batch_entries, journal_txn_entries, journal_write_seconds) = batch_metrics(&r);
        let (sqlite_commit_entries, sqlite_commit_seconds) = sqlite_metrics(&r);
        let (journal_fenced, journal_damaged_segments) = journal_fault_metrics(&r);
        let (decisions, repeats, checks, check_dead_letters, events_relayed, alerts) =
            outcome_metrics(&r);
        let stage = Stages::registered(&r);
        Metrics {
            registry,
            http_requests,
            queue_depth,
            batch_entries,
            journal_txn_entries,
            journal_write_seconds,
            sqlite_commit_entries,
            sqlite_commit_seconds,
            decisions,
            repeats,
            journal_fenced,
            journal_damaged_segments,
            checks,
            check_dead_letters,
            events_relayed,
            alerts,
            bound_used,
            memory,
            stage,
            shops: Default::default(),
        }
    }
    /// The Prometheus text exposition of every metric.
    pub fn render(&self) -> String {
        TextEncoder::new()
            .encode_to_string(&self.registry.gather())
            .unwrap_or_else(|e| format!("# encoding failed: {e}\n"))
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

/// Registers each metric as it is made, so that a definition and its registration
/// cannot drift apart; every name is static, so a failure is a programming error.
struct Registrar<'a>(&'a Registry);

impl Registrar<'_> {
    fn add<C: prometheus::core::Collector + Clone + 'static>(&self, c: C) -> C {
        self.0
            .register(Box::new(c.clone()))
            .expect("metric names are unique");
        c
    }
}

/// The HTTP front's metrics and the process's bounds: requests by route, queue depths,
/// memory bounds in use, memory by part.
fn front_metrics(r: &Registrar<'_>) -> (IntCounterVec, IntGaugeVec, IntGaugeVec, IntGaugeVec) {
    let http_requests = IntCounterVec::new(
        Opts::new(
            "nrtxn_http_requests_total",
            "HTTP requests by route and status",
        ),
        &["route", "status"],
    )
    .expect("static metric definition");
    let queue_depth = IntGaugeVec::new(
        Opts::new("nrtxn_queue_depth", "Entries waiting in each bounded queue"),
        &["queue"],
    )
    .expect("static metric definition");
    let bound_used = IntGaugeVec::new(
        Opts::new(
            "nrtxn_bound_used",
            "Use of each memory bound (shops, outcomes_cached, body_bytes)",
        ),
        &["bound"],
    )
    .expect("static metric definition");
    let memory = IntGaugeVec::new(
        Opts::new(
            "nrtxn_memory_bytes",
            "Memory by part: allocated (live blocks), resident (the allocator's pages \
             in RAM), sqlite (SQLite's share of allocated)",
        ),
        &["part"],
    )
    .expect("static metric definition");
    (
        r.add(http_requests),
        r.add(queue_depth),
        r.add(bound_used),
        r.add(memory),
    )
}

/// The sizes of processor batches and journal transactions, and a transaction's time.
fn batch_metrics(r: &Registrar<'_>) -> (Histogram, Histogram, Histogram) {
    let sizes = exponential_buckets(1.0, 4.0, 9).expect("static buckets");
    let batch_entries = Histogram::with_opts(
        HistogramOpts::new("nrtxn_batch_entries", "Entries per processor batch")
            .buckets(sizes.clone()),
    )
    .expect("static metric definition");
    let journal_txn_entries = Histogram::with_opts(
        HistogramOpts::new(
            "nrtxn_journal_txn_entries",
            "Entries per durable journal transaction",
        )
        .buckets(sizes),
    )
    .expect("static metric definition");
    let journal_write_seconds = Histogram::with_opts(
        HistogramOpts::new(
            "nrtxn_journal_write_seconds",
            "Duration of one durable journal transaction",
        )
        .buckets(exponential_buckets(0.000_05, 2.0, 16).expect("static buckets")),
    )
    .expect("static metric definition");
    (
        r.add(batch_entries),
        r.add(journal_txn_entries),
        r.add(journal_write_seconds),
    )
}

/// The commits of the SQLite stores beside the journal: entries and time, by store.
fn sqlite_metrics(r: &Registrar<'_>) -> (HistogramVec, HistogramVec) {
    let entries = HistogramVec::new(
        HistogramOpts::new(
            "nrtxn_sqlite_commit_entries",
            "Entries per commit of a SQLite store beside the journal (store=views: the \
             embedded journal's views, derived from its log; store=requests: the request \
             log beside MongoDB)",
        )
        .buckets(exponential_buckets(1.0, 4.0, 9).expect("static buckets")),
        &["store"],
    )
    .expect("static metric definition");
    let seconds = HistogramVec::new(
        HistogramOpts::new(
            "nrtxn_sqlite_commit_seconds",
            "Duration of one commit of a SQLite store beside the journal",
        )
        .buckets(exponential_buckets(0.000_05, 2.0, 16).expect("static buckets")),
        &["store"],
    )
    .expect("static metric definition");
    (r.add(entries), r.add(seconds))
}

/// What went wrong with the journal: batches fenced, segments found damaged.
fn journal_fault_metrics(r: &Registrar<'_>) -> (IntCounter, IntGauge) {
    let journal_fenced = IntCounter::new(
        "nrtxn_journal_fenced_total",
        "Journal batches refused because their partition's lease passed to another node",
    )
    .expect("static metric definition");
    let journal_damaged_segments = IntGauge::new(
        "nrtxn_journal_damaged_segments",
        "Older segments of the embedded log found damaged by the full read after the start",
    )
    .expect("static metric definition");
    (r.add(journal_fenced), r.add(journal_damaged_segments))
}

/// What came of requests and of what follows them: decisions, repeats, check-backs,
/// their dead letters, events relayed.
fn outcome_metrics(
    r: &Registrar<'_>,
) -> (
    IntCounterVec,
    IntCounter,
    IntCounterVec,
    IntCounter,
    IntCounter,
    IntCounterVec,
) {
    let decisions = IntCounterVec::new(
        Opts::new("nrtxn_decisions_total", "Decisions by status"),
        &["status"],
    )
    .expect("static metric definition");
    let repeats = IntCounter::new(
        "nrtxn_repeats_total",
        "Requests answered with their key's recorded outcome at the processor",
    )
    .expect("static metric definition");
    let checks = IntCounterVec::new(
        Opts::new(
            "nrtxn_checks_total",
            "Check-backs asked of shops before an expiry, by what came of them",
        ),
        &["result"],
    )
    .expect("static metric definition");
    let check_dead_letters = IntCounter::new(
        "nrtxn_check_dead_letters_total",
        "Check-backs with no answer after every attempt: the shop's default applied",
    )
    .expect("static metric definition");
    let events_relayed = IntCounter::new(
        "nrtxn_events_relayed_total",
        "Events the outbox relay published to the events topic",
    )
    .expect("static metric definition");
    let alerts = IntCounterVec::new(
        Opts::new(
            "nrtxn_alerts_total",
            "Alerts sent to shops' notify_url, by what came of them",
        ),
        &["result"],
    )
    .expect("static metric definition");
    (
        r.add(decisions),
        r.add(repeats),
        r.add(checks),
        r.add(check_dead_letters),
        r.add(events_relayed),
        r.add(alerts),
    )
}

impl Stages {
    /// `nrtxn_stage_seconds`, registered, and its children looked up once.
    fn registered(r: &Registrar<'_>) -> Stages {
        // 25 us to 3.3 s: a loopback hop at the bottom, a slow test database's
        // transaction at the top.
        let stage = HistogramVec::new(
            HistogramOpts::new("nrtxn_stage_seconds", STAGE_HELP)
                .buckets(exponential_buckets(0.000_025, 2.0, 18).expect("static buckets")),
            &["stage"],
        )
        .expect("static metric definition");
        let stage = r.add(stage);
        Stages {
            produce: stage.with_label_values(&["produce"]),
            consume: stage.with_label_values(&["consume"]),
            screen: stage.with_label_values(&["screen"]),
            reply: stage.with_label_values(&["reply"]),
            total: stage.with_label_values(&["total"]),
        }
    }
}
