//! Timing wheel benchmark: the hold-expiry load of one processor shard, exaggerated.
//!
//! `cargo bench -p nrtxn-actors --bench wheel -- [timers]` (default 1,000,000) inserts
//! that many timers with deadlines spread uniformly over the next 10 minutes at a 1 ms
//! tick, cancels a random half (holds confirmed or cancelled), then advances through the
//! whole span in 1 ms steps, as the processor's timer would. A second round reuses the
//! warm slab and advances in 10 ms steps. It prints rates and memory per timer as plain
//! lines; a run is a few seconds at the default size.

use std::hint::black_box;
use std::process::ExitCode;
use std::time::Instant;

use nrtxn_actors::wheel::{TimerId, TimingWheel, TIMERS_MAX};

/// 2023-11-14 in ms since the epoch: deadlines at realistic magnitudes.
const START_MS: u64 = 1_700_000_000_000;
/// Hold deadlines fall within this far ahead.
const SPAN_MS: u64 = 10 * 60 * 1_000;
const TIMERS_DEFAULT: usize = 1_000_000;
/// Keeps a mistyped count from exhausting the machine: 50 M timers are 2 GB of nodes.
const TIMERS_BENCH_MAX: usize = 50_000_000;

/// SplitMix64: a fixed seed, so every run measures the same deadlines and the same half.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform enough in `0..bound` for a benchmark (modulo bias below 2^-40 here).
    fn below(&mut self, bound: u64) -> u64 {
        self.next() % bound
    }
}

fn rate_per_s(count: usize, seconds: f64) -> String {
    format!("{:.1} M/s", count as f64 / seconds / 1e6)
}

fn insert_all(wheel: &mut TimingWheel<u64>, deadlines_ms: &[u64]) -> (Vec<TimerId>, f64) {
    let started = Instant::now();
    let ids: Vec<TimerId> = deadlines_ms
        .iter()
        .zip(0u64..)
        .map(|(&deadline_ms, value)| wheel.insert(deadline_ms, value))
        .collect();
    (ids, started.elapsed().as_secs_f64())
}

/// Cancels the timers at `order[..count]`; returns how many were pending and the time.
fn cancel_some(wheel: &mut TimingWheel<u64>, ids: &[TimerId], order: &[usize]) -> (usize, f64) {
    let started = Instant::now();
    let cancelled = order
        .iter()
        .filter(|&&i| black_box(wheel.cancel(ids[i])).is_some())
        .count();
    (cancelled, started.elapsed().as_secs_f64())
}

/// Advances from `from_ms` to `to_ms` in `step_ms` steps; returns expiries, calls, time.
fn expire_through(
    wheel: &mut TimingWheel<u64>,
    from_ms: u64,
    to_ms: u64,
    step_ms: u64,
) -> (usize, usize, f64) {
    let mut expired = Vec::with_capacity(4_096);
    let mut expired_count = 0;
    let mut calls = 0;
    let started = Instant::now();
    let mut now_ms = from_ms;
    while now_ms < to_ms {
        now_ms = (now_ms + step_ms).min(to_ms);
        expired.clear();
        wheel.advance(now_ms, &mut expired);
        expired_count += expired.len();
        calls += 1;
    }
    black_box(&expired);
    (expired_count, calls, started.elapsed().as_secs_f64())
}

fn main() -> ExitCode {
    // `cargo bench` passes `--bench`; the first bare argument is the timer count.
    let timers = match std::env::args().skip(1).find(|a| !a.starts_with('-')) {
        None => TIMERS_DEFAULT,
        Some(arg) => match arg.parse::<usize>() {
            Ok(n) if (2..=TIMERS_BENCH_MAX.min(TIMERS_MAX)).contains(&n) => n,
            _ => {
                eprintln!("usage: wheel [timers], timers in 2..={TIMERS_BENCH_MAX}");
                return ExitCode::from(2);
            }
        },
    };
    let mut rng = SplitMix64(0x6e72_7478_6e5f_7768);
    let deadlines_ms: Vec<u64> = (0..timers)
        .map(|_| START_MS + 1 + rng.below(SPAN_MS))
        .collect();
    // A random half, as a Fisher-Yates prefix.
    let mut order: Vec<usize> = (0..timers).collect();
    for i in (1..timers).rev() {
        order.swap(i, rng.below(i as u64 + 1) as usize);
    }
    let half = &order[..timers / 2];
    let end_ms = START_MS + SPAN_MS;

    println!("timers {timers}, deadlines uniform over {SPAN_MS} ms, tick_ms 1");

    // Round 1: a cold wheel, its slab growing by doubling as timers arrive.
    let mut wheel = TimingWheel::<u64>::new(1, START_MS);
    let (ids, insert_s) = insert_all(&mut wheel, &deadlines_ms);
    println!(
        "insert (cold slab): {timers} in {insert_s:.3} s = {}",
        rate_per_s(timers, insert_s)
    );
    let node_bytes = (TimingWheel::<u64>::with_capacity(1, 0, 1_024).heap_bytes()
        - TimingWheel::<u64>::new(1, 0).heap_bytes())
        / 1_024;
    let bucket_bytes = TimingWheel::<u64>::new(1, 0).heap_bytes();
    let heap_bytes = wheel.heap_bytes();
    println!(
        "memory: node {node_bytes} B (T = u64), buckets {bucket_bytes} B, heap {heap_bytes} B = {:.1} B/timer (slab capacity {} nodes)",
        heap_bytes as f64 / timers as f64,
        (heap_bytes - bucket_bytes) / node_bytes,
    );

    let (cancelled, cancel_s) = cancel_some(&mut wheel, &ids, half);
    assert_eq!(cancelled, half.len(), "every cancelled timer was pending");
    println!(
        "cancel (random half): {cancelled} in {cancel_s:.3} s = {}",
        rate_per_s(cancelled, cancel_s)
    );

    let pending = wheel.len();
    let (expired, calls, expire_s) = expire_through(&mut wheel, START_MS, end_ms, 1);
    assert_eq!(expired, pending, "every pending timer expired");
    assert!(wheel.is_empty());
    println!(
        "expire (1 ms steps): {expired} in {calls} advances, {expire_s:.3} s = {} expiries, {:.0} ns/advance",
        rate_per_s(expired, expire_s),
        expire_s * 1e9 / calls as f64,
    );

    // Round 2: the same wheel, its slab now warm, so inserts allocate nothing.
    let capacity_before = wheel.heap_bytes();
    let deadlines_ms: Vec<u64> = deadlines_ms.iter().map(|d| d + SPAN_MS).collect();
    let (ids, insert_s) = insert_all(&mut wheel, &deadlines_ms);
    assert_eq!(wheel.heap_bytes(), capacity_before, "warm slab grew");
    println!(
        "insert (warm slab): {timers} in {insert_s:.3} s = {}",
        rate_per_s(timers, insert_s)
    );
    let (cancelled, cancel_s) = cancel_some(&mut wheel, &ids, half);
    println!(
        "cancel (random half, warm): {cancelled} in {cancel_s:.3} s = {}",
        rate_per_s(cancelled, cancel_s)
    );
    let pending = wheel.len();
    let (expired, calls, expire_s) = expire_through(&mut wheel, end_ms, end_ms + SPAN_MS, 10);
    assert_eq!(expired, pending, "every pending timer expired");
    println!(
        "expire (10 ms steps): {expired} in {calls} advances, {expire_s:.3} s = {} expiries, {:.0} ns/advance",
        rate_per_s(expired, expire_s),
        expire_s * 1e9 / calls as f64,
    );

    // An idle shard: a handful of far timers, then one advance across a year.
    let year_ms = 365 * 24 * 3_600 * 1_000;
    let far_from_ms = end_ms + SPAN_MS;
    for i in 0..10 {
        wheel.insert(far_from_ms + (i + 1) * year_ms / 10, i);
    }
    let started = Instant::now();
    let (expired, calls, _) =
        expire_through(&mut wheel, far_from_ms, far_from_ms + year_ms, year_ms);
    let jump_s = started.elapsed().as_secs_f64();
    assert_eq!((expired, calls), (10, 1));
    println!(
        "idle jump: 1 advance over 1 year with 10 timers expired all 10 in {:.1} us",
        jump_s * 1e6
    );
    ExitCode::SUCCESS
}
