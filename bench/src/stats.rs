//! Latency histograms, answer counts and the open-loop arrival schedule.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;

/// Highest latency the histogram tracks: a minute, far above any reply timeout; a
/// larger one is clamped to it rather than lost, so it still counts in the tail.
pub const LATENCY_MAX_US: u64 = 60_000_000;

/// Latencies of one worker (merged at the end), in microseconds with 3 significant
/// digits: 0.1% precision at any magnitude, in a fixed ~200 KiB whatever the run length.
pub struct Latencies {
    hist: Histogram<u64>,
}

impl Default for Latencies {
    fn default() -> Self {
        Latencies::new()
    }
}

impl Latencies {
    pub fn new() -> Latencies {
        Latencies {
            // Bounds 1..=LATENCY_MAX_US with 3 digits are valid by construction.
            hist: Histogram::new_with_bounds(1, LATENCY_MAX_US, 3)
                .expect("static histogram bounds are valid"),
        }
    }

    pub fn record(&mut self, latency: Duration) {
        let us = (latency.as_micros() as u64).clamp(1, LATENCY_MAX_US);
        // Cannot fail: the value is clamped into the histogram's range.
        let _ = self.hist.record(us);
    }

    /// Open loop: the latency a caller saw is from when the request was *meant* to be
    /// sent, not from when a free connection sent it. A stalled server thus shows up as
    /// the queueing delay of every request scheduled during the stall (coordinated
    /// omission corrected), not as one slow request.
    pub fn record_from_intended(&mut self, intended: Instant, done: Instant) {
        self.record(done.saturating_duration_since(intended));
    }

    pub fn merge(&mut self, other: &Latencies) {
        // Same bounds on both sides, so adding cannot fail.
        let _ = self.hist.add(&other.hist);
    }

    pub fn count(&self) -> u64 {
        self.hist.len()
    }

    /// The latency at `q` (0..=1) in milliseconds; 0 when nothing was recorded.
    pub fn quantile_ms(&self, q: f64) -> f64 {
        if self.hist.is_empty() {
            return 0.0;
        }
        self.hist.value_at_quantile(q) as f64 / 1000.0
    }

    pub fn max_ms(&self) -> f64 {
        self.hist.max() as f64 / 1000.0
    }

    pub fn mean_ms(&self) -> f64 {
        self.hist.mean() / 1000.0
    }
}

/// Answers by kind: `ok`, `insufficient_stock`, `accepted`, `http_429`, `error_io`, ...
/// A `BTreeMap` keeps the JSON output in a stable order.
#[derive(Debug, Default, Clone)]
pub struct Counts(pub BTreeMap<String, u64>);

impl Counts {
    pub fn add(&mut self, kind: &str, n: u64) {
        if let Some(c) = self.0.get_mut(kind) {
            *c += n;
        } else {
            self.0.insert(kind.to_string(), n);
        }
    }

    pub fn get(&self, kind: &str) -> u64 {
        self.0.get(kind).copied().unwrap_or(0)
    }

    pub fn merge(&mut self, other: &Counts) {
        for (k, v) in &other.0 {
            self.add(k, *v);
        }
    }
}

/// Outcome statuses that are decisions refusing the change (the request got its one
/// outcome; nothing moved). `429` is not among them: it is a refusal to *decide*.
pub const REJECTED_STATUSES: [&str; 4] = [
    "insufficient_stock",
    "unknown_item",
    "expired",
    "limit_exceeded",
];

/// Open-loop arrivals: request `i` is due at `start + i / rate`, whatever happened to
/// the requests before it. The dispatcher asks which are due and hands them on; a slow
/// server therefore cannot slow the arrivals down, which is the whole point.
#[derive(Debug, Clone)]
pub struct Schedule {
    start: Instant,
    interval: Duration,
    next: u64,
}

impl Schedule {
    /// `rate_per_s` must be positive and finite (checked by the caller with a flag name).
    pub fn new(start: Instant, rate_per_s: f64) -> Schedule {
        Schedule {
            start,
            interval: Duration::from_secs_f64(1.0 / rate_per_s),
            next: 0,
        }
    }

    /// When the next request is due.
    pub fn next_due(&self) -> Instant {
        self.start + self.interval.mul_f64(self.next as f64)
    }

    /// Takes the next request if it is due by `now`: its intended send time.
    pub fn take_due(&mut self, now: Instant) -> Option<Instant> {
        let due = self.next_due();
        if due <= now {
            self.next += 1;
            Some(due)
        } else {
            None
        }
    }

    #[cfg(test)]
    pub fn issued(&self) -> u64 {
        self.next
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_come_from_the_recorded_distribution() {
        let mut l = Latencies::new();
        for ms in 1..=1000u64 {
            l.record(Duration::from_millis(ms));
        }
        let close = |a: f64, b: f64| (a - b).abs() <= b * 0.002 + 0.001;
        assert!(close(l.quantile_ms(0.5), 500.0), "{}", l.quantile_ms(0.5));
        assert!(close(l.quantile_ms(0.9), 900.0), "{}", l.quantile_ms(0.9));
        assert!(close(l.quantile_ms(0.99), 990.0), "{}", l.quantile_ms(0.99));
        assert!(
            close(l.quantile_ms(0.999), 999.0),
            "{}",
            l.quantile_ms(0.999)
        );
        assert_eq!(l.count(), 1000);
    }

    #[test]
    fn empty_histogram_reports_zero_not_a_panic() {
        let l = Latencies::new();
        assert_eq!(l.quantile_ms(0.99), 0.0);
    }

    #[test]
    fn latency_beyond_the_range_is_clamped_and_still_counted() {
        let mut l = Latencies::new();
        l.record(Duration::from_secs(3600));
        l.record(Duration::ZERO);
        assert_eq!(l.count(), 2);
        assert!(l.max_ms() >= 59_000.0);
    }

    /// One connection, 1,000 requests/s scheduled, each served in 0.1 ms except one
    /// that stalls the server for 1 s. Measured from the send, only one request is slow
    /// (p99 looks fine); measured from the intended time, the ~1,000 requests that were
    /// due during the stall all waited, and p99 shows the stall.
    #[test]
    fn open_loop_latency_counts_the_queueing_behind_a_stall() {
        let t0 = Instant::now();
        let mut schedule = Schedule::new(t0, 1000.0);
        let mut corrected = Latencies::new();
        let mut naive = Latencies::new();
        let mut server_free = t0;
        let end = t0 + Duration::from_secs(10);
        while let Some(intended) = schedule.take_due(end) {
            let send = intended.max(server_free);
            let service = if schedule.issued() == 2000 {
                Duration::from_secs(1)
            } else {
                Duration::from_micros(100)
            };
            let done = send + service;
            server_free = done;
            corrected.record_from_intended(intended, done);
            naive.record(done - send);
        }
        assert_eq!(schedule.issued(), 10_001);
        assert!(
            naive.quantile_ms(0.99) < 1.0,
            "naive p99 {}",
            naive.quantile_ms(0.99)
        );
        assert!(
            corrected.quantile_ms(0.99) > 500.0,
            "corrected p99 {}",
            corrected.quantile_ms(0.99)
        );
        // Half the queue behind a 1 s stall waited more than 0.5 s: ~500 of 10,000 = 5%.
        assert!(corrected.quantile_ms(0.96) > 400.0);
    }

    #[test]
    fn schedule_issues_at_the_fixed_rate_regardless_of_when_asked() {
        let t0 = Instant::now();
        let mut s = Schedule::new(t0, 100.0);
        // Asked late, at 1 s: every request due by then comes out, each with its own time.
        let due: Vec<Instant> =
            std::iter::from_fn(|| s.take_due(t0 + Duration::from_secs(1))).collect();
        assert_eq!(due.len(), 101);
        assert_eq!(due[50] - t0, Duration::from_millis(500));
        assert!(s.take_due(t0 + Duration::from_secs(1)).is_none());
    }

    #[test]
    fn counts_merge_by_kind() {
        let mut a = Counts::default();
        a.add("ok", 2);
        let mut b = Counts::default();
        b.add("ok", 3);
        b.add("http_429", 1);
        a.merge(&b);
        assert_eq!(a.get("ok"), 5);
        assert_eq!(a.get("http_429"), 1);
        assert_eq!(a.get("missing"), 0);
    }
}
