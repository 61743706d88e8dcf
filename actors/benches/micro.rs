//! Criterion micro-benchmarks of the processor's hot path, below the journal:
//! `cargo bench -p nrtxn-actors --bench micro`.
//!
//! - `apply/decrement_ok`: one accepted decrement on a hot item (the state is reused, as
//!   the processor reuses the item's only copy), entry built and returned.
//! - `apply/decrement_refused`: one refused decrement (stock exhausted): the flash sale's
//!   common case once the item sells out.
//! - `wheel/insert_cancel`: a hold armed and confirmed before it expires, on a wheel
//!   already holding 100,000 pending timers.
//! - `wheel/advance_1ms_100k_pending`: one 1 ms tick of a shard's wheel with 100,000
//!   pending timers spread over 10 minutes (about one due per 6 ticks, re-armed).

use std::hint::black_box;
use std::sync::Arc;

use criterion::{criterion_group, criterion_main, Criterion};
use nrtxn_actors::apply::apply;
use nrtxn_actors::wheel::TimingWheel;
use nrtxn_actors::{ItemState, Op, Request};

const NOW_MS: i64 = 1_700_000_000_000;
const TTL_MS: i64 = 30_000;

fn decrement(key: &str) -> Request {
    Request::new(
        Arc::from("flash"),
        Arc::from("hot"),
        Arc::from(key),
        Op::Decrement,
        1,
        NOW_MS,
    )
}

fn bench_apply(c: &mut Criterion) {
    let mut group = c.benchmark_group("apply");
    let req = decrement("seller-1:hot:1");
    let mut state = ItemState {
        stock: i64::MAX / 2,
        reserved: 0,
        seq: 1,
        ..ItemState::default()
    };
    group.bench_function("decrement_ok", |b| {
        b.iter(|| black_box(apply(Some(&mut state), black_box(&req), NOW_MS, TTL_MS)))
    });
    let mut sold_out = ItemState {
        stock: 0,
        reserved: 0,
        seq: 1,
        ..ItemState::default()
    };
    group.bench_function("decrement_refused", |b| {
        b.iter(|| black_box(apply(Some(&mut sold_out), black_box(&req), NOW_MS, TTL_MS)))
    });
    group.finish();
}

fn pending_wheel(n: u64) -> TimingWheel<u64> {
    let start = NOW_MS as u64;
    let mut wheel = TimingWheel::with_capacity(1, start, n as usize + 1);
    // Deadlines spread over the next 10 minutes, deterministic.
    for i in 0..n {
        let spread = i.wrapping_mul(0x9e37_79b9_7f4a_7c15) % 600_000;
        wheel.insert(start + 1 + spread, i);
    }
    wheel
}

fn bench_wheel(c: &mut Criterion) {
    let mut group = c.benchmark_group("wheel");
    let mut wheel = pending_wheel(100_000);
    let deadline = NOW_MS as u64 + 60_000;
    group.bench_function("insert_cancel", |b| {
        b.iter(|| {
            let id = wheel.insert(black_box(deadline), 7);
            black_box(wheel.cancel(id))
        })
    });
    let mut wheel = pending_wheel(100_000);
    let mut now = NOW_MS as u64;
    let mut expired = Vec::new();
    group.bench_function("advance_1ms_100k_pending", |b| {
        b.iter(|| {
            now += 1;
            wheel.advance(black_box(now), &mut expired);
            // One timer falls due every 6 ticks or so: re-armed 10 minutes ahead, so the
            // wheel keeps 100,000 pending however long criterion runs.
            for (_, v) in expired.drain(..) {
                wheel.insert(now + 600_000, v);
            }
        })
    });
    group.finish();
}

criterion_group!(benches, bench_apply, bench_wheel);
criterion_main!(benches);
