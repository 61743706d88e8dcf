//! The index against the real log: records written by the `LogWriter`, bodies by the
//! codec, segments sealed by the writer's own rolls.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use nrtxn_actors::types::{Entry, Op};

use super::*;
use crate::codec;
use crate::record::{Chain, HEADER_LEN};
use crate::segment::{self, LogWriter};

const AT_MS: i64 = 1_700_000_000_000;

/// A log and its index, written as the journal's writer would.
struct Fixture {
    dir: tempfile::TempDir,
    log: LogWriter,
    index: Index,
    /// Each item's last seq, by (shop, item).
    seqs: HashMap<(String, String), u64>,
    keys_made: usize,
    /// Everything written, in log order.
    written: Vec<Entry>,
}

fn entry(shop: &str, item: &str, key: Option<&str>, seq: u64) -> Entry {
    let mut e = Entry::decided(shop.into(), item.into(), Op::Decrement, 1, AT_MS, AT_MS);
    e.request_key = key.map(Arc::from);
    e.seq = Some(seq);
    e.prev_seq = Some(seq - 1);
    e
}

impl Fixture {
    fn new(segment_bytes: u64) -> Fixture {
        let dir = tempfile::tempdir().unwrap();
        let lock = segment::lock(dir.path()).unwrap();
        let end = segment::scan(dir.path(), Chain::default(), None, |_| Ok(())).unwrap();
        let log = LogWriter::open(dir.path(), &end, 0, segment_bytes, lock).unwrap();
        let index = Index::open(dir.path()).unwrap();
        Fixture {
            dir,
            log,
            index,
            seqs: HashMap::new(),
            keys_made: 0,
            written: Vec::new(),
        }
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }

    /// The next event of `item` in shop `shop`, with a fresh key.
    fn next(&mut self, shop: &str, item: &str) -> Entry {
        let seq = self.seqs.entry((shop.into(), item.into())).or_insert(0);
        *seq += 1;
        self.keys_made += 1;
        entry(
            shop,
            item,
            Some(&format!("key-{:06}", self.keys_made)),
            *seq,
        )
    }

    /// `records` records of `per` entries each, the items taken in turn.
    fn make(&mut self, records: usize, per: usize, items: &[(&str, &str)]) -> Vec<Vec<Entry>> {
        let mut k = 0;
        (0..records)
            .map(|_| {
                (0..per)
                    .map(|_| {
                        k += 1;
                        let (shop, item) = items[k % items.len()];
                        self.next(shop, item)
                    })
                    .collect()
            })
            .collect()
    }

    /// Appends the records, syncs, then hands them to the index: the writer's group.
    fn group(&mut self, records: &[Vec<Entry>]) {
        let mut at = Vec::new();
        let mut body = Vec::new();
        for entries in records {
            body.clear();
            codec::encode(entries, AT_MS, &mut body);
            self.log.append(KIND_ENTRIES, AT_MS, &body).unwrap();
            let (first_lsn, end) = self.log.segment_end();
            at.push((first_lsn, end - (HEADER_LEN + body.len()) as u64, end));
            self.written.extend(entries.iter().cloned());
        }
        self.log.sync().unwrap();
        let done: Vec<Written<'_>> = records
            .iter()
            .zip(&at)
            .map(|(entries, (first_lsn, offset, end))| Written {
                first_lsn: *first_lsn,
                offset: *offset,
                end: *end,
                entries,
            })
            .collect();
        if self.index.add_synced(&done).unwrap() {
            self.index.write_frozen().unwrap();
        }
    }

    fn reopen(&mut self) {
        self.index = Index::open(self.dir.path()).unwrap();
    }

    fn idx_of(&self, first_lsn: u64) -> PathBuf {
        self.path().join(format!("{first_lsn:020}.idx"))
    }

    /// Every key written is found, as the entry written.
    fn all_keys_found(&self) {
        for e in &self.written {
            let key = e.request_key.as_deref().unwrap();
            let got = self.index.lookup(&e.shop, key).unwrap();
            let got = got.unwrap_or_else(|| panic!("{key} not found"));
            assert_eq!((got.request_key.as_deref(), got.seq), (Some(key), e.seq));
        }
    }

    /// The seqs `events` gives for an item.
    fn seqs_of(&self, shop: &str, item: &str, from: u64, limit: usize) -> Vec<u64> {
        let ev = self.index.events(shop, item, from, limit).unwrap();
        assert!(ev.iter().all(|e| *e.shop == *shop && *e.item == *item));
        ev.iter().map(|e| e.seq.unwrap()).collect()
    }
}

const ITEMS: [(&str, &str); 3] = [("shop-a", "red"), ("shop-a", "blue"), ("shop-b", "red")];

#[test]
fn keys_and_events_round_trip_across_sealed_segments_the_tail_and_a_reopen() {
    let mut f = Fixture::new(4_096);
    for _ in 0..30 {
        let records = f.make(3, 4, &ITEMS);
        f.group(&records);
    }
    let sealed = f.index.sealed_segments();
    assert!(sealed.len() >= 4, "{} sealed segments", sealed.len());
    for _ in 0..2 {
        f.all_keys_found();
        assert!(f.index.lookup("shop-a", "never-sent").unwrap().is_none());
        // "shop-b" has no key-000001: the key was used in "shop-a".
        assert!(f.index.lookup("shop-b", "key-000001").unwrap().is_none());
        for (shop, item) in ITEMS {
            let n = f.seqs[&(shop.to_string(), item.to_string())];
            assert_eq!(
                f.seqs_of(shop, item, 1, 10_000),
                (1..=n).collect::<Vec<_>>()
            );
            assert_eq!(f.seqs_of(shop, item, 50, 40), (50..90).collect::<Vec<_>>());
            assert!(f.seqs_of(shop, item, n + 1, 10).is_empty());
        }
        f.reopen();
        assert_eq!(f.index.rebuilt_at_open(), 0);
        assert_eq!(f.index.sealed_segments(), sealed);
    }
}

#[test]
fn an_index_spanning_many_blocks_finds_every_key_and_any_stretch_of_a_long_run() {
    let mut f = Fixture::new(256 * 1024);
    // One hot item: its run spans item blocks; its keys span key blocks.
    for _ in 0..100 {
        let records = f.make(4, 10, &[("shop-a", "hot"), ("shop-a", "cold")]);
        f.group(&records);
    }
    let mut fill = Vec::new();
    while f.index.sealed_segments().is_empty() {
        fill = f.make(1, 50, &[("shop-a", "hot")]);
        f.group(&fill);
    }
    let first = f.index.sealed_segments()[0];
    let sealed = SealedIndex::open(&f.idx_of(first), {
        std::fs::metadata(f.path().join(format!("{first:020}.log")))
            .unwrap()
            .len()
    })
    .unwrap();
    assert!(sealed.keys() > 3 * 255, "{} keys", sealed.keys());
    f.all_keys_found();
    assert_eq!(
        f.seqs_of("shop-a", "hot", 1_000, 1_500),
        (1_000..2_500).collect::<Vec<_>>()
    );
    assert_eq!(f.seqs_of("shop-a", "hot", 254, 3), vec![254, 255, 256]);
    let last = fill[0].last().unwrap().seq.unwrap();
    assert_eq!(
        f.seqs_of("shop-a", "hot", last - 2, 10),
        vec![last - 2, last - 1, last]
    );
}

#[test]
fn the_tail_reads_only_records_below_the_durable_mark() {
    let mut f = Fixture::new(1 << 20);
    let records = f.make(2, 3, &ITEMS);
    f.group(&records);
    // A record written into the tail but not yet marked durable (its sync not done).
    let unsynced = vec![f.next("shop-a", "red"), f.next("shop-a", "red")];
    let mut body = Vec::new();
    codec::encode(&unsynced, AT_MS, &mut body);
    f.log.append(KIND_ENTRIES, AT_MS, &body).unwrap();
    let (_, end) = f.log.segment_end();
    let offset = end - (HEADER_LEN + body.len()) as u64;
    f.index
        .write_group(|tail| tail.add_record(offset, &unsynced));
    let key = unsynced[1].request_key.clone().unwrap();
    let red_seqs = f.seqs_of("shop-a", "red", 1, 100);
    assert!(f.index.lookup("shop-a", &key).unwrap().is_none());
    assert!(!red_seqs.contains(&unsynced[0].seq.unwrap()));
    assert_eq!(red_seqs.len(), 2, "the two durable events of red");
    f.log.sync().unwrap();
    f.index.write_group(|tail| tail.mark_durable(end));
    assert_eq!(
        f.index.lookup("shop-a", &key).unwrap().and_then(|e| e.seq),
        unsynced[1].seq
    );
    assert_eq!(f.seqs_of("shop-a", "red", 1, 100), vec![1, 2, 3, 4]);
}

/// Writes a log of several sealed segments whose first one has a single key block, so
/// that any key of it reads block 0.
fn sealed_log() -> (Fixture, u64) {
    let mut f = Fixture::new(4_096);
    for _ in 0..20 {
        let records = f.make(3, 4, &ITEMS);
        f.group(&records);
    }
    let first = f.index.sealed_segments()[0];
    (f, first)
}

/// The answers an index gives for every key and item of the fixture.
fn answers(f: &Fixture) -> (Vec<Option<u64>>, Vec<Vec<u64>>) {
    let keys = f
        .written
        .iter()
        .map(|e| {
            let got = f.index.lookup(&e.shop, e.request_key.as_deref().unwrap());
            got.unwrap().and_then(|e| e.seq)
        })
        .collect();
    let events = ITEMS
        .iter()
        .map(|(s, i)| f.seqs_of(s, i, 1, 10_000))
        .collect();
    (keys, events)
}

fn flip(path: &Path, at: u64) {
    let mut b = std::fs::read(path).unwrap();
    b[at as usize] ^= 0x20;
    std::fs::write(path, b).unwrap();
}

#[test]
fn a_flipped_byte_in_a_block_refuses_the_read_naming_file_and_block_until_rebuilt() {
    let (mut f, first) = sealed_log();
    let before = answers(&f);
    let idx = f.idx_of(first);
    let e = f.written[0].clone();
    // A key block: the lookup of a key of that segment reads block 0.
    flip(&idx, 100);
    f.reopen();
    assert_eq!(
        f.index.rebuilt_at_open(),
        0,
        "blocks are checked when read, not at open"
    );
    let err = f
        .index
        .lookup(&e.shop, e.request_key.as_deref().unwrap())
        .unwrap_err();
    assert!(matches!(err, IndexError::Block { block: 0, .. }), "{err}");
    assert!(
        err.to_string().contains(&idx.display().to_string()),
        "{err}"
    );
    f.index.rebuild(first).unwrap();
    assert_eq!(answers(&f), before);
    // An item block (the block after the one key block): an item's events refused.
    flip(&idx, format::BLOCK_BYTES as u64 + 40);
    f.reopen();
    let err = f.index.events(&e.shop, &e.item, 1, 100).unwrap_err();
    assert!(matches!(err, IndexError::Block { block: 1, .. }), "{err}");
    f.index.rebuild(first).unwrap();
    assert_eq!(answers(&f), before);
}

#[test]
fn a_damaged_footer_a_damaged_filter_and_a_missing_index_are_rebuilt_at_open() {
    let (mut f, _) = sealed_log();
    let before = answers(&f);
    let sealed = f.index.sealed_segments();
    let (a, b, c) = (
        f.idx_of(sealed[0]),
        f.idx_of(sealed[1]),
        f.idx_of(sealed[2]),
    );
    let len = |p: &Path| std::fs::metadata(p).unwrap().len();
    flip(&a, len(&a) - 30);
    let footer = std::fs::read(&b).unwrap();
    let footer = format::Footer::decode(&footer[footer.len() - format::FOOTER_BYTES..]);
    flip(&b, format::Layout::of(&footer.unwrap()).filter_at + 3);
    std::fs::remove_file(&c).unwrap();
    for p in [&a, &b] {
        let seg_len = len(&p.with_extension("log"));
        assert!(matches!(
            SealedIndex::open(p, seg_len),
            Err(IndexError::Bad { .. })
        ));
    }
    f.reopen();
    assert_eq!(f.index.rebuilt_at_open(), 3);
    assert_eq!(answers(&f), before);
    for p in [&a, &b, &c] {
        SealedIndex::open(p, len(&p.with_extension("log"))).unwrap();
    }
    f.reopen();
    assert_eq!(f.index.rebuilt_at_open(), 0);
}

#[test]
fn an_index_built_for_another_length_of_its_segment_is_refused() {
    let (f, first) = sealed_log();
    let log = f.path().join(format!("{first:020}.log"));
    let len = std::fs::metadata(&log).unwrap().len();
    let err = SealedIndex::open(&f.idx_of(first), len + 1).err().unwrap();
    assert!(err.to_string().contains("built for a segment of"), "{err}");
}

/// Real XXH3-64 collisions cannot be found for a test, but the hash input (shop, a 0
/// byte, name) is the same for "a\0b" + "c" and "a" + "b\0c": names with a 0 byte make
/// two keys (or items) share a hash, which the server's names never do. The confirmation
/// against the log is then what tells them apart, in the tail and in a sealed index.
#[test]
fn a_key_or_item_sharing_a_hash_with_another_is_told_apart_by_the_entry_read() {
    assert_eq!(key_hash("a\0b", "c"), key_hash("a", "b\0c"));
    let mut f = Fixture::new(4_096);
    let twins = [("a\0b", "x"), ("a", "b\0x")];
    assert_eq!(
        item_hash(twins[0].0, twins[0].1),
        item_hash(twins[1].0, twins[1].1)
    );
    for round in 0..2 {
        for _ in 0..10 {
            let mut records = f.make(2, 5, &twins);
            let mut keyed = f.next("a\0b", "x");
            keyed.request_key = Some(Arc::from(format!("c{round}").as_str()));
            records.push(vec![keyed]);
            f.group(&records);
        }
        let key = format!("c{round}");
        let twin_key = format!("b\0c{round}");
        assert_eq!(key_hash("a\0b", &key), key_hash("a", &twin_key));
        assert!(f.index.lookup("a\0b", &key).unwrap().is_some());
        assert!(
            f.index.lookup("a", &twin_key).unwrap().is_none(),
            "round {round}"
        );
        for (shop, item) in twins {
            let n = f.seqs[&(shop.to_string(), item.to_string())];
            assert_eq!(
                f.seqs_of(shop, item, 1, 10_000),
                (1..=n).collect::<Vec<_>>()
            );
            assert_eq!(f.seqs_of(shop, item, 3, 4), vec![3, 4, 5, 6]);
        }
    }
    assert!(
        !f.index.sealed_segments().is_empty(),
        "the twins were sealed too"
    );
}

#[test]
fn a_gap_in_an_items_seqs_is_refused_not_served_short() {
    let mut f = Fixture::new(4_096);
    let mut records = f.make(3, 4, &[("shop-a", "red")]);
    // Seq 7 never written: the log goes from 6 to 8.
    for e in records.iter_mut().flatten() {
        if e.seq.unwrap() >= 7 {
            e.seq = Some(e.seq.unwrap() + 1);
            e.prev_seq = Some(e.seq.unwrap() - 1);
        }
    }
    f.group(&records);
    let err = f.index.events("shop-a", "red", 1, 100).unwrap_err();
    assert!(matches!(err, IndexError::Gap { .. }), "{err}");
    assert!(err.to_string().contains("seq 8 follows seq 6"), "{err}");
    assert_eq!(
        f.seqs_of("shop-a", "red", 1, 6),
        (1..=6).collect::<Vec<_>>()
    );
    assert_eq!(
        f.seqs_of("shop-a", "red", 8, 100),
        (8..=13).collect::<Vec<_>>()
    );
    // Across a seal: the next events (after 13) skip 14, in segments sealed since.
    f.seqs.insert(("shop-a".into(), "red".into()), 14);
    while f.index.sealed_segments().is_empty() {
        let records = f.make(3, 4, &[("shop-a", "red")]);
        f.group(&records);
    }
    let err = f.index.events("shop-a", "red", 10, 100).unwrap_err();
    assert!(err.to_string().contains("seq 15 follows seq 13"), "{err}");
}

#[test]
fn a_retired_segment_loses_its_index_and_its_keys() {
    let (mut f, first) = sealed_log();
    let e = f.written[0].clone();
    let key = e.request_key.as_deref().unwrap();
    assert!(f.index.lookup(&e.shop, key).unwrap().is_some());
    let idx = f.idx_of(first);
    f.log.retire_before(f.index.sealed_segments()[1]).unwrap();
    f.index.retire(first).unwrap();
    assert!(!idx.exists());
    assert!(f.index.lookup(&e.shop, key).unwrap().is_none());
    assert!(!f.index.sealed_segments().contains(&first));
    // The item's events now start later, and still without a gap.
    let seqs = f.seqs_of(&e.shop, &e.item, 1, 10_000);
    assert!(seqs[0] > 1 && seqs.windows(2).all(|w| w[1] == w[0] + 1));
    f.reopen();
    assert!(f.index.lookup(&e.shop, key).unwrap().is_none());
}

#[test]
fn a_newest_segment_not_sealed_is_read_back_into_the_tail_at_open() {
    let mut f = Fixture::new(1 << 20);
    let records = f.make(5, 4, &ITEMS);
    f.group(&records);
    assert!(f.index.sealed_segments().is_empty());
    f.reopen();
    assert_eq!(f.index.tail_first_lsn(), 1);
    f.all_keys_found();
    assert!(
        !f.idx_of(1).exists(),
        "the active segment has no index file"
    );
}

#[test]
fn one_filter_covers_the_sealed_segments_and_those_sealed_after_it_is_built() {
    let mut f = Fixture::new(4_096);
    let grow = |f: &mut Fixture, groups: usize| {
        for _ in 0..groups {
            let records = f.make(3, 4, &ITEMS);
            f.group(&records);
        }
    };
    grow(&mut f, 30);
    let sealed = f.index.sealed_segments().len();
    assert!(sealed >= 4, "{sealed} sealed segments");
    let built = f.index.refresh_sealed_keys().unwrap();
    let written = f.written.len() as u64;
    assert!(
        matches!(built, Refreshed::Built { keys } if keys > 0 && keys < written),
        "{built:?}: the sealed segments' keys, not the tail's"
    );
    assert_eq!(f.index.refresh_sealed_keys().unwrap(), Refreshed::Unchanged);
    let found_all = |f: &Fixture| {
        for e in &f.written {
            let key = e.request_key.as_deref().unwrap();
            assert!(f.index.may_contain(&e.shop, key), "{key} said new");
        }
        f.all_keys_found();
    };
    found_all(&f);
    // Sealed after the filter was built: each asked by its own filter until covered.
    grow(&mut f, 20);
    assert!(f.index.sealed_segments().len() > sealed);
    found_all(&f);
    let extended = f.index.refresh_sealed_keys().unwrap();
    assert!(
        matches!(extended, Refreshed::Extended { keys } if keys > 0),
        "{extended:?}"
    );
    found_all(&f);
    // Keys never sent are new (the filter is sized for a million keys: no false
    // positive is expected among a thousand).
    let said_old = (0..1_000)
        .filter(|i| f.index.may_contain("shop-a", &format!("never-{i}")))
        .count();
    assert_eq!(said_old, 0);
    // A call's keys asked together: new only if every one is.
    let never: Vec<String> = (0..1_000).map(|i| format!("never-{i}")).collect();
    let mut asked: Vec<&str> = never.iter().map(String::as_str).collect();
    assert!(!f.index.may_contain_any("shop-a", &asked));
    let old = f
        .written
        .iter()
        .find(|e| e.shop.as_ref() == "shop-a")
        .unwrap();
    asked.insert(500, old.request_key.as_deref().unwrap());
    assert!(
        f.index.may_contain_any("shop-a", &asked),
        "an old key among new ones"
    );
    assert!(!f.index.may_contain_any("elsewhere", &asked[500..501]));
    // A retired segment's keys may stay in the filter; the others are still found.
    let first = f.index.sealed_segments()[0];
    f.log.retire_before(f.index.sealed_segments()[1]).unwrap();
    f.index.retire(first).unwrap();
    let gone = f.written.iter().take_while(|e| {
        let key = e.request_key.as_deref().unwrap();
        f.index.lookup(&e.shop, key).unwrap().is_none()
    });
    let gone = gone.count();
    assert!(gone > 0, "the first segment's keys are gone from lookups");
    f.written.drain(..gone);
    found_all(&f);
}
