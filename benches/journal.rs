//! Criterion benchmark of one durable journal batch write on the embedded journal
//! (`LogJournal`: each batch is a record of the log, made durable by one `fdatasync`
//! before it is answered; its views are written after): `cargo bench --bench journal`.
//!
//! `journal/append_batch/N`: a processor batch of N decisions on one hot item (each with
//! a new request key, as the key filter sees them), from `append` until its done
//! callback reports it durable. Throughput is in decisions, so criterion prints
//! decisions/s; the difference between 1 and 1,000 is what batching buys.

use std::sync::mpsc;
use std::sync::Arc;

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use nrtxn_actors::apply::apply;
use nrtxn_actors::{Entry, ItemState, JournalWrite, Lifecycle, Metrics, Op, Request};
use nrtxn_embedded::journal::{LogJournal, Retention};

const NOW_MS: i64 = 1_700_000_000_000;

fn bench_append(c: &mut Criterion) {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = LogJournal::open(dir.path(), Arc::new(Metrics::new()), Retention::default())
        .expect("journal");
    let (shop, item): (Arc<str>, Arc<str>) = ("bench".into(), "hot".into());
    let mut state = ItemState {
        stock: i64::MAX / 2,
        reserved: 0,
        seq: 0,
        ..ItemState::default()
    };
    let mut next_key = 0u64;
    let mut group = c.benchmark_group("journal");
    group.sample_size(30);
    for n in [1usize, 100, 1_000] {
        group.throughput(Throughput::Elements(n as u64));
        group.bench_function(format!("append_batch/{n}"), |b| {
            b.iter_batched(
                || {
                    (0..n)
                        .map(|_| {
                            next_key += 1;
                            let req = Request::new(
                                shop.clone(),
                                item.clone(),
                                format!("seller-1:hot:{next_key}").into(),
                                Op::Decrement,
                                1,
                                NOW_MS,
                            );
                            apply(Some(&mut state), &req, NOW_MS, 30_000)
                        })
                        .collect::<Vec<Entry>>()
                },
                |entries| {
                    let (tx, rx) = mpsc::channel();
                    store.append(
                        entries,
                        Box::new(move |_, result| {
                            let _ = tx.send(result);
                        }),
                    );
                    rx.recv().expect("append answered").expect("durable");
                },
                BatchSize::PerIteration,
            )
        });
    }
    group.finish();
    store.close();
}

criterion_group!(benches, bench_append);
criterion_main!(benches);
