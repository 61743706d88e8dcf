//! Per-shop live figures, for the dashboard (`GET /v1/shops/{shop}/stats`): the
//! decisions of the last [`WINDOW_S`] seconds, second by second, by status and with their
//! latency, and the shop's last refused requests.
//!
//! They are recorded where decisions are counted (the processors' fan-out, beside
//! `nrtxn_decisions_total`), so with several nodes each node has the figures of the
//! decisions its own processors made. Prometheus has the node-wide series; these are
//! per shop, which Prometheus labels would make unbounded.
//!
//! Bounded: at most [`SHOPS_TRACKED_MAX`] shops, each a fixed ring of seconds (120 slots
//! of 128 bytes, 15.4 KB) and [`REFUSED_KEPT`] refused requests (at most about 0.5 KB
//! each), so about 26 MB in all at the bound (`docs/reliability.md`). A new shop past the
//! bound takes the place of the shop whose last decision is oldest.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex};

use dashmap::DashMap;
use serde::Serialize;

use crate::types::{KeyHash, Millis, Op, Outcome, Status};

/// Seconds of history kept per shop.
pub const WINDOW_S: usize = 120;
/// Shops with figures at once, at most.
pub const SHOPS_TRACKED_MAX: usize = 1_024;
/// Refused requests kept per shop, the latest.
pub const REFUSED_KEPT: usize = 20;
/// Seconds the rates of [`StatsView::rates_per_s`] are taken over: recent enough to move
/// while a sale runs, long enough not to jump with every batch.
pub const RATE_S: usize = 10;

/// Upper bounds (ms) of the latency buckets; one more bucket holds the rest. About ×1.6
/// apart, so a p99 read off them is within that factor of the true one.
const LATENCY_BOUNDS_MS: [i64; 19] = [
    1, 2, 3, 5, 8, 12, 20, 30, 50, 80, 120, 200, 300, 500, 800, 1_200, 2_000, 3_000, 5_000,
];
const LATENCY_BUCKETS: usize = LATENCY_BOUNDS_MS.len() + 1;
const STATUSES: usize = Status::ALL.len();

/// One second of a shop's decisions.
#[derive(Clone, Copy)]
struct Second {
    /// Which second this slot holds now (s since the epoch); a slot of an older second
    /// counts as empty.
    at_s: i64,
    by_status: [u32; STATUSES],
    latency: [u32; LATENCY_BUCKETS],
}

const EMPTY_SECOND: Second = Second {
    at_s: i64::MIN,
    by_status: [0; STATUSES],
    latency: [0; LATENCY_BUCKETS],
};

/// A refused request, as the dashboard lists it.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Refused {
    pub at: Millis,
    pub item: Arc<str>,
    pub request_key: Arc<str>,
    pub op: Op,
    pub qty: i64,
    pub status: Status,
    pub reason: Option<String>,
}

/// A shop's figures: a ring of seconds and its last refused requests.
struct Window {
    seconds: Box<[Second; WINDOW_S]>,
    refused: VecDeque<Refused>,
    /// The second of the shop's last decision: which shop gives way at the bound.
    last_s: i64,
}

impl Window {
    fn new() -> Window {
        Window {
            seconds: Box::new([EMPTY_SECOND; WINDOW_S]),
            refused: VecDeque::with_capacity(REFUSED_KEPT),
            last_s: i64::MIN,
        }
    }

    fn record(&mut self, o: &Outcome) {
        let at_s = o.completed_at.div_euclid(1000);
        let slot = &mut self.seconds[at_s.rem_euclid(WINDOW_S as i64) as usize];
        if slot.at_s != at_s {
            if slot.at_s > at_s {
                // A decision older than the window (a clock step back): not shown.
                return;
            }
            *slot = Second {
                at_s,
                ..EMPTY_SECOND
            };
        }
        let status = Status::ALL.iter().position(|s| *s == o.status).unwrap_or(0);
        slot.by_status[status] += 1;
        let ms = (o.completed_at - o.submitted_at).max(0);
        let bucket = LATENCY_BOUNDS_MS.partition_point(|b| *b < ms);
        slot.latency[bucket] += 1;
        self.last_s = self.last_s.max(at_s);
        if o.status != Status::Ok {
            if self.refused.len() == REFUSED_KEPT {
                self.refused.pop_front();
            }
            self.refused.push_back(Refused {
                at: o.completed_at,
                item: o.item.clone(),
                request_key: o.request_key.clone(),
                op: o.op,
                qty: o.qty,
                status: o.status,
                reason: o.reason.clone(),
            });
        }
    }

    fn view(&self, now_ms: Millis) -> StatsView {
        // The current second is still filling: the series ends at the last whole one.
        let last_s = now_ms.div_euclid(1000) - 1;
        let from_s = last_s - WINDOW_S as i64 + 1;
        let mut decisions = Vec::with_capacity(WINDOW_S);
        let mut p99_ms = Vec::with_capacity(WINDOW_S);
        let mut totals = [0u64; STATUSES];
        let mut recent = [0u64; STATUSES];
        let mut latency = [0u64; LATENCY_BUCKETS];
        for s in from_s..=last_s {
            let slot = &self.seconds[s.rem_euclid(WINDOW_S as i64) as usize];
            if slot.at_s != s {
                decisions.push(0);
                p99_ms.push(None);
                continue;
            }
            decisions.push(slot.by_status.iter().map(|n| u64::from(*n)).sum());
            p99_ms.push(p99(slot.latency.iter().map(|n| u64::from(*n))));
            for (i, n) in slot.by_status.iter().enumerate() {
                totals[i] += u64::from(*n);
                if s > last_s - RATE_S as i64 {
                    recent[i] += u64::from(*n);
                }
            }
            for (i, n) in slot.latency.iter().enumerate() {
                latency[i] += u64::from(*n);
            }
        }
        let by_status = |counts: &[u64; STATUSES], per: f64| {
            Status::ALL
                .iter()
                .zip(counts)
                .filter(|(_, n)| **n > 0)
                .map(|(s, n)| (s.as_str(), *n as f64 / per))
                .collect()
        };
        StatsView {
            window_s: WINDOW_S,
            from_ms: from_s * 1000,
            decisions,
            p99_ms,
            p99_ms_window: p99(latency.iter().copied()),
            totals: by_status(&totals, 1.0),
            rates_per_s: by_status(&recent, RATE_S as f64),
            refused: self.refused.iter().rev().cloned().collect(),
        }
    }
}

/// The 99th percentile of a latency histogram, as its bucket's upper bound (the last
/// bucket's lower bound, for decisions slower than every bound); `None` when empty.
fn p99(counts: impl Iterator<Item = u64> + Clone) -> Option<i64> {
    let total: u64 = counts.clone().sum();
    if total == 0 {
        return None;
    }
    // The smallest bucket at or under which at least 99% of the decisions fall.
    let rank = total - total / 100;
    let mut seen = 0;
    for (i, n) in counts.enumerate() {
        seen += n;
        if seen >= rank {
            return Some(LATENCY_BOUNDS_MS[i.min(LATENCY_BOUNDS_MS.len() - 1)]);
        }
    }
    LATENCY_BOUNDS_MS.last().copied()
}

/// A shop's figures as `GET .../stats` answers them.
#[derive(Debug, Serialize)]
pub struct StatsView {
    /// Seconds in the series.
    pub window_s: usize,
    /// The start of the series' first second (ms since the epoch); one value a second
    /// from there, the last one the last whole second.
    pub from_ms: Millis,
    /// Decisions in each second.
    pub decisions: Vec<u64>,
    /// Each second's p99 decision time (submitted to decided), ms; `null` without
    /// decisions. Read off buckets about ×1.6 apart.
    pub p99_ms: Vec<Option<i64>>,
    /// The p99 over the whole window.
    pub p99_ms_window: Option<i64>,
    /// Decisions in the window by status.
    pub totals: BTreeMap<&'static str, f64>,
    /// Decisions per second by status over the last [`RATE_S`] seconds.
    pub rates_per_s: BTreeMap<&'static str, f64>,
    /// The latest refused requests, newest first.
    pub refused: Vec<Refused>,
}

/// Every tracked shop's figures.
#[derive(Default)]
pub struct ShopStats {
    /// A `std::sync::Mutex` per shop: held for a few adds by the processor that decided
    /// and for a copy by a dashboard's read, never across an await.
    shops: DashMap<Arc<str>, Mutex<Window>, KeyHash>,
}

impl ShopStats {
    /// Records a batch's decisions: one lookup and one lock per run of the same shop (a
    /// hot item's batch is one run), not per decision. Order records (`~` items) are
    /// the engine's own and are not counted; their lines are, as the holds they are.
    pub fn record_all<O: std::ops::Deref<Target = Outcome>>(&self, outcomes: &[O]) {
        for run in outcomes.chunk_by(|a, b| a.shop == b.shop) {
            let mut counted = run.iter().filter(|o| !o.item.starts_with('~')).peekable();
            let Some(first) = counted.peek() else {
                continue;
            };
            let shop = first.shop.clone();
            let mut added = false;
            // A shop seen before (nearly every run) takes a read lock of its part of the
            // map; a new one the write lock of its entry.
            {
                let w = match self.shops.get(&shop) {
                    Some(w) => w,
                    None => self
                        .shops
                        .entry(shop.clone())
                        .or_insert_with(|| {
                            added = true;
                            Mutex::new(Window::new())
                        })
                        .downgrade(),
                };
                let mut w = w.lock().unwrap_or_else(|e| e.into_inner());
                counted.for_each(|o| w.record(o));
            }
            // Only a new shop can take the count past the bound: counting (which locks
            // every part of the map) is paid once per new shop, not per run. After the
            // insert, not before it: processors record on several threads, and a check
            // before would let two new shops at once both pass it.
            while added && self.shops.len() > SHOPS_TRACKED_MAX {
                if !self.make_room(&shop) {
                    break;
                }
            }
        }
    }

    /// Records one decision ([`ShopStats::record_all`]).
    pub fn record(&self, o: &Outcome) {
        self.record_all(&[o]);
    }

    /// Drops the shop whose last decision is oldest, `keep` aside (a scan of at most
    /// [`SHOPS_TRACKED_MAX`] and a few more, paid once per new shop past the bound);
    /// false if there was none to drop.
    fn make_room(&self, keep: &Arc<str>) -> bool {
        let oldest = self
            .shops
            .iter()
            .filter(|e| e.key() != keep)
            .min_by_key(|e| e.value().lock().unwrap_or_else(|e| e.into_inner()).last_s)
            .map(|e| e.key().clone());
        match oldest {
            Some(shop) => {
                self.shops.remove(&shop);
                true
            }
            None => false,
        }
    }

    /// The shop's figures now; a shop with none here gets an empty series.
    pub fn view(&self, shop: &str, now_ms: Millis) -> StatsView {
        match self.shops.get(shop) {
            Some(w) => w.lock().unwrap_or_else(|e| e.into_inner()).view(now_ms),
            None => Window::new().view(now_ms),
        }
    }

    /// Shops with figures now.
    pub fn tracked(&self) -> usize {
        self.shops.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn outcome(shop: &str, status: Status, submitted_at: Millis, completed_at: Millis) -> Outcome {
        Outcome {
            shop: shop.into(),
            request_key: format!("k-{completed_at}").into(),
            status,
            reason: (status != Status::Ok).then(|| "why".to_string()),
            item: "sku".into(),
            op: Op::Decrement,
            qty: 1,
            qty_taken: Some(1),
            stock_before: None,
            stock_after: None,
            seq: None,
            prev_seq: None,
            submitted_at,
            completed_at,
            hold_id: None,
            expires_at: None,
            ttl_ms: None,
            reserved_after: None,
            seller: None,
            buyer: None,
            opens_at: None,
            closes_at: None,
            low_stock_at: None,
            requested_at: submitted_at,
        }
    }

    #[test]
    fn seconds_count_decisions_by_status_with_their_p99_and_refusals_newest_first() {
        let stats = ShopStats::default();
        let t0 = 1_700_000_000_000;
        // 100 decisions in second t0: 98 taking 1 ms, 2 taking 100 ms (so p99 is in
        // the 120 ms bucket); 3 refused in second t0+1.
        for i in 0..100 {
            let took = if i < 98 { 1 } else { 100 };
            stats.record(&outcome("acme", Status::Ok, t0 + i - took, t0 + i));
        }
        for i in 0..3 {
            stats.record(&outcome(
                "acme",
                Status::InsufficientStock,
                t0 + 1000 + i,
                t0 + 1000 + i,
            ));
        }
        let v = stats.view("acme", t0 + 2_500);
        assert_eq!(v.decisions.len(), WINDOW_S);
        assert_eq!(v.from_ms, t0 + 2_000 - WINDOW_S as i64 * 1000);
        assert_eq!(&v.decisions[WINDOW_S - 2..], &[100, 3]);
        assert_eq!(v.decisions[..WINDOW_S - 2].iter().sum::<u64>(), 0);
        assert_eq!(v.p99_ms[WINDOW_S - 2], Some(120));
        assert_eq!(v.p99_ms[WINDOW_S - 1], Some(1));
        assert_eq!(v.p99_ms[0], None);
        assert_eq!(v.totals["ok"], 100.0);
        assert_eq!(v.totals["insufficient_stock"], 3.0);
        assert_eq!(v.rates_per_s["ok"], 10.0);
        let keys: Vec<&str> = v.refused.iter().map(|r| &*r.request_key).collect();
        assert_eq!(
            keys,
            [
                format!("k-{}", t0 + 1002),
                format!("k-{}", t0 + 1001),
                format!("k-{}", t0 + 1000)
            ]
        );
        // Other shops see nothing of it, and order records are not counted.
        assert!(stats.view("other", t0 + 2_500).totals.is_empty());
        let mut record = outcome("acme", Status::Ok, t0, t0 + 1_500);
        record.item = "~orders/3".into();
        stats.record(&record);
        assert_eq!(stats.view("acme", t0 + 2_500).decisions[WINDOW_S - 1], 3);
    }

    #[test]
    fn a_second_leaves_the_window_and_only_the_latest_refusals_are_kept() {
        let stats = ShopStats::default();
        let t0 = 1_700_000_000_000;
        for i in 0..(REFUSED_KEPT as i64 + 5) {
            stats.record(&outcome("acme", Status::Expired, t0 + i, t0 + i));
        }
        // The series ends at the last whole second: at t0 + WINDOW_S s it starts at t0.
        let v = stats.view("acme", t0 + WINDOW_S as i64 * 1000);
        assert_eq!(
            v.decisions[0],
            REFUSED_KEPT as u64 + 5,
            "still in the window"
        );
        let v = stats.view("acme", t0 + 1_000 + WINDOW_S as i64 * 1000);
        assert_eq!(v.decisions.iter().sum::<u64>(), 0, "out of the window");
        assert_eq!(v.refused.len(), REFUSED_KEPT);
        assert_eq!(
            &*v.refused[0].request_key,
            format!("k-{}", t0 + REFUSED_KEPT as i64 + 4)
        );
        // A second's slot reused by a later second starts from zero.
        stats.record(&outcome(
            "acme",
            Status::Ok,
            t0,
            t0 + WINDOW_S as i64 * 1000,
        ));
        let v = stats.view("acme", t0 + 1_000 + WINDOW_S as i64 * 1000);
        assert_eq!(v.decisions[WINDOW_S - 1], 1);
    }

    #[test]
    fn past_the_bound_the_shop_idle_longest_gives_way() {
        let stats = ShopStats::default();
        let t0 = 1_700_000_000_000;
        for i in 0..SHOPS_TRACKED_MAX as i64 {
            stats.record(&outcome(
                &format!("s{i}"),
                Status::Ok,
                t0 + i,
                t0 + i * 1000,
            ));
        }
        assert_eq!(stats.tracked(), SHOPS_TRACKED_MAX);
        // What docs/reliability.md counts a shop's seconds at.
        assert_eq!(std::mem::size_of::<Second>(), 136);
        stats.record(&outcome("new", Status::Ok, t0, t0 + 1_000_000_000));
        assert_eq!(stats.tracked(), SHOPS_TRACKED_MAX);
        assert!(stats.shops.get("s0").is_none(), "the oldest went");
        assert!(stats.shops.get("s1").is_some());
        assert!(stats.shops.get("new").is_some());
    }

    /// Processors on several threads record new shops at once (as a flood of new shops
    /// does): the bound holds once they are done, however their checks and inserts
    /// interleave. Before, each thread checked the bound and then inserted, so two new
    /// shops at once could both pass it and the map grew by one with every such race (the
    /// issue's "RSS grows with the number of distinct shops ever seen").
    #[test]
    fn shops_recorded_from_many_threads_at_once_stay_within_the_bound() {
        let stats = Arc::new(ShopStats::default());
        let t0 = 1_700_000_000_000;
        let threads: Vec<_> = (0..8)
            .map(|t| {
                let stats = stats.clone();
                std::thread::spawn(move || {
                    for i in 0..2 * SHOPS_TRACKED_MAX as i64 {
                        let at = t0 + i * 1000;
                        stats.record(&outcome(&format!("t{t}-{i}"), Status::Ok, at, at));
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().expect("a recording thread panicked");
        }
        assert!(
            stats.tracked() <= SHOPS_TRACKED_MAX,
            "{} shops tracked, bound {SHOPS_TRACKED_MAX}",
            stats.tracked()
        );
        // The newest shops stay: each thread's last one is tracked.
        for t in 0..8 {
            let last = format!("t{t}-{}", 2 * SHOPS_TRACKED_MAX - 1);
            assert!(stats.shops.get(last.as_str()).is_some(), "{last} went");
        }
    }
}
