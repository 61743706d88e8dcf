//! Prometheus metrics of the engine and the HTTP front.

use prometheus::{
    exponential_buckets, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGaugeVec, Opts,
    Registry, TextEncoder,
};

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
    /// Decisions by status.
    pub decisions: IntCounterVec,
    /// Requests that reached a processor with a key that already had an outcome (a
    /// shared log: sent by two nodes, or delivered again after a crash or a rebalance).
    pub repeats: IntCounter,
    /// Journal batches a journal shared by several nodes refused, whole or in part,
    /// because their partition's write lease had passed to another node (a stale
    /// writer, fenced).
    pub journal_fenced: IntCounter,
    /// Events the outbox relay published to the events topic (a page sent again after a
    /// failure counts again).
    pub events_relayed: IntCounter,
    /// How much of each memory bound is in use, read when metrics are scraped: `shops`
    /// (WorkManagers in memory, of `shops_max`), `outcomes_cached` (of
    /// `outcome_cache_total`), `body_bytes` (request bodies held, of `body_bytes_max`).
    pub bound_used: IntGaugeVec,
}

impl Metrics {
    pub fn new() -> Metrics {
        let registry = Registry::new();
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
        let journal_fenced = IntCounter::new(
            "nrtxn_journal_fenced_total",
            "Journal batches refused because their partition's lease passed to another node",
        )
        .expect("static metric definition");
        let events_relayed = IntCounter::new(
            "nrtxn_events_relayed_total",
            "Events the outbox relay published to the events topic",
        )
        .expect("static metric definition");
        for c in [
            Box::new(http_requests.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(queue_depth.clone()),
            Box::new(batch_entries.clone()),
            Box::new(journal_txn_entries.clone()),
            Box::new(journal_write_seconds.clone()),
            Box::new(decisions.clone()),
            Box::new(repeats.clone()),
            Box::new(journal_fenced.clone()),
            Box::new(events_relayed.clone()),
            Box::new(bound_used.clone()),
        ] {
            registry.register(c).expect("metric names are unique");
        }
        Metrics {
            registry,
            http_requests,
            queue_depth,
            batch_entries,
            journal_txn_entries,
            journal_write_seconds,
            decisions,
            repeats,
            journal_fenced,
            events_relayed,
            bound_used,
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
