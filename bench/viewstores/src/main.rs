//! viewbench: derived-view store candidates for nrtxn.
//! Usage: viewbench <sqlite|fjall|redb|segidx|sqlite-sorted|fjall-ingest> <hot|spread|soldout>
//!        <entries> <store_dir> [seed]
//!        viewbench reopen <candidate> <store_dir>
//! Prints one line of `key=value` results on stdout.
//!
//! The first three store every outcome and event row in the store (the 2026-11 study).
//! The last three append the entries to a simulated log (`seglog`), whose writes are timed
//! apart and subtracted, and index positions in it (`segidx`, `bulk`).
//! Environment: `VB_SEGMENT_MB` (log segment size, default 64), `VB_RUN_ENTRIES` (sorted
//! run size of the bulk candidates, default 65,536).

mod bulk;
mod filter;
mod segidx;
mod seglog;
mod tail;

use rand::{Rng, SeedableRng, rngs::StdRng};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

const BATCH: usize = 4096;
const SHOPS: u32 = 4;
const CACHE_BYTES: u64 = 64 << 20;
const N_HIT: usize = 100_000;
const N_MISS: usize = 100_000;
const N_RANGE: usize = 1_000;
const REDB_DURABLE_EVERY: usize = 64; // batches between Durability::Immediate commits

// ---------------------------------------------------------------- data

struct Entries {
    // flat buffers + offsets
    okey: Vec<u8>,
    okey_off: Vec<u32>,
    oval: Vec<u8>,
    oval_off: Vec<u32>,
    shop: Vec<u32>,
    item: Vec<u32>,
    seq: Vec<u64>,
}

impl Entries {
    fn len(&self) -> usize {
        self.seq.len()
    }
    fn okey(&self, i: usize) -> &[u8] {
        &self.okey[self.okey_off[i] as usize..self.okey_off[i + 1] as usize]
    }
    /// request_key without the 4-byte shop prefix
    fn rkey(&self, i: usize) -> &[u8] {
        &self.okey(i)[4..]
    }
    fn oval(&self, i: usize) -> &[u8] {
        &self.oval[self.oval_off[i] as usize..self.oval_off[i + 1] as usize]
    }
    fn ekey(&self, i: usize) -> [u8; 16] {
        ekey(self.shop[i], self.item[i], self.seq[i])
    }
    /// pointer into the log: (segment u32, offset u64)
    fn eval(&self, i: usize) -> [u8; 12] {
        let seg = (self.seq[i] / 1_000_000) as u32;
        let off = (self.seq[i] % 1_000_000) * 96;
        let mut v = [0u8; 12];
        v[..4].copy_from_slice(&seg.to_be_bytes());
        v[4..].copy_from_slice(&off.to_be_bytes());
        v
    }
}

fn ekey(shop: u32, item: u32, seq: u64) -> [u8; 16] {
    let mut k = [0u8; 16];
    k[..4].copy_from_slice(&shop.to_be_bytes());
    k[4..8].copy_from_slice(&item.to_be_bytes());
    k[8..].copy_from_slice(&seq.to_be_bytes());
    k
}

const ALNUM: &[u8] = b"0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ-";

fn random_rkey(rng: &mut StdRng, out: &mut Vec<u8>) {
    let len = rng.gen_range(16..=24);
    for _ in 0..len {
        out.push(ALNUM[rng.gen_range(0..ALNUM.len())]);
    }
}

fn gen_entries(mix: &str, n: usize, rng: &mut StdRng) -> Entries {
    let mut e = Entries {
        okey: Vec::with_capacity(n * 28),
        okey_off: Vec::with_capacity(n + 1),
        oval: Vec::with_capacity(n * 64),
        oval_off: Vec::with_capacity(n + 1),
        shop: Vec::with_capacity(n),
        item: Vec::with_capacity(n),
        seq: Vec::with_capacity(n),
    };
    e.okey_off.push(0);
    e.oval_off.push(0);
    let n_items: u32 = if mix == "spread" { 10_000 } else { 1 };
    let mut stock: Vec<i64> = vec![1_000_000; n_items as usize];
    let t0: u64 = 1_780_000_000_000_000; // µs
    for i in 0..n {
        let seq = i as u64 + 1;
        let (shop, item) = if mix == "spread" {
            let it = rng.gen_range(0..n_items);
            (it % SHOPS, it)
        } else {
            (0, 0)
        };
        e.okey.extend_from_slice(&shop.to_be_bytes());
        random_rkey(rng, &mut e.okey);
        e.okey_off.push(e.okey.len() as u32);
        // outcome value
        let refused = mix == "soldout" && rng.gen_range(0..100) < 98;
        let qty: i32 = rng.gen_range(1..5);
        let before = stock[item as usize];
        let (op, status, after) = if refused {
            (1u8, 2u8, before)
        } else {
            let op = rng.gen_range(0..2u8);
            let after = if op == 0 {
                before - qty as i64
            } else {
                before + qty as i64
            };
            (op, 0u8, after)
        };
        stock[item as usize] = after;
        let name = format!("item-{item:05}");
        let v = &mut e.oval;
        v.push(name.len() as u8);
        v.extend_from_slice(name.as_bytes());
        v.push(op);
        v.push(status);
        v.extend_from_slice(&qty.to_le_bytes());
        v.extend_from_slice(&before.to_le_bytes());
        v.extend_from_slice(&after.to_le_bytes());
        v.extend_from_slice(&seq.to_le_bytes());
        let ts = t0 + i as u64 * 7 + rng.gen_range(0..5);
        v.extend_from_slice(&ts.to_le_bytes());
        v.extend_from_slice(&(ts + rng.gen_range(50..500)).to_le_bytes());
        e.oval_off.push(e.oval.len() as u32);
        e.shop.push(shop);
        e.item.push(item);
        e.seq.push(seq);
    }
    e
}

// ---------------------------------------------------------------- store trait

trait Store {
    fn write_batch(&mut self, e: &Entries, range: std::ops::Range<usize>, batch_no: usize);
    /// finish writing (final durable commit etc.), then wait for background work to settle
    fn finish_and_settle(&mut self);
    /// force compaction/checkpoint: returns description
    fn force(&mut self) -> &'static str;
    fn get_outcome(&self, shop: u32, rkey: &[u8], okey: &[u8]) -> Option<usize>;
    fn range_events(&self, shop: u32, item: u32, after: u64, limit: usize) -> usize;
    /// The range read with each event's entry read from the log; None where the store
    /// holds the rows themselves.
    fn range_fetch(&self, _shop: u32, _item: u32, _after: u64, _limit: usize) -> Option<usize> {
        None
    }
    /// Thread CPU spent writing the simulated log, not the derivation's cost.
    fn log_cpu_s(&self) -> f64 {
        0.0
    }
    /// Thread CPU spent sealing segments or writing sorted runs (part of the derivation).
    fn bulk_cpu_s(&self) -> f64 {
        0.0
    }
}

// ---------------------------------------------------------------- sqlite

struct Sqlite {
    conn: rusqlite::Connection,
}

impl Sqlite {
    fn open(dir: &Path) -> Self {
        std::fs::create_dir_all(dir).unwrap();
        let conn = rusqlite::Connection::open(dir.join("views.db")).unwrap();
        conn.execute_batch(&format!(
            "PRAGMA journal_mode=WAL; PRAGMA synchronous=OFF; PRAGMA cache_size=-{};
             CREATE TABLE IF NOT EXISTS outcomes(shop INTEGER NOT NULL, request_key BLOB NOT NULL, v BLOB NOT NULL,
                 PRIMARY KEY(shop, request_key)) WITHOUT ROWID;
             CREATE TABLE IF NOT EXISTS events(shop INTEGER NOT NULL, item INTEGER NOT NULL, seq INTEGER NOT NULL,
                 seg INTEGER NOT NULL, off INTEGER NOT NULL, PRIMARY KEY(shop, item, seq)) WITHOUT ROWID;",
            CACHE_BYTES / 1024
        ))
        .unwrap();
        Sqlite { conn }
    }
}

impl Store for Sqlite {
    fn write_batch(&mut self, e: &Entries, range: std::ops::Range<usize>, _b: usize) {
        let tx = self.conn.transaction().unwrap();
        {
            let mut so = tx
                .prepare_cached("INSERT INTO outcomes(shop, request_key, v) VALUES (?1, ?2, ?3)")
                .unwrap();
            let mut se = tx
                .prepare_cached("INSERT INTO events(shop, item, seq, seg, off) VALUES (?1, ?2, ?3, ?4, ?5)")
                .unwrap();
            for i in range {
                so.execute(rusqlite::params![e.shop[i], e.rkey(i), e.oval(i)]).unwrap();
                let seg = (e.seq[i] / 1_000_000) as i64;
                let off = ((e.seq[i] % 1_000_000) * 96) as i64;
                se.execute(rusqlite::params![e.shop[i], e.item[i], e.seq[i] as i64, seg, off])
                    .unwrap();
            }
        }
        tx.commit().unwrap();
    }
    fn finish_and_settle(&mut self) {}
    fn force(&mut self) -> &'static str {
        self.conn.execute_batch("PRAGMA wal_checkpoint(TRUNCATE);").unwrap();
        "wal_checkpoint(TRUNCATE)"
    }
    fn get_outcome(&self, shop: u32, rkey: &[u8], _okey: &[u8]) -> Option<usize> {
        let mut st = self
            .conn
            .prepare_cached("SELECT v FROM outcomes WHERE shop=?1 AND request_key=?2")
            .unwrap();
        let mut rows = st.query(rusqlite::params![shop, rkey]).unwrap();
        rows.next()
            .unwrap()
            .map(|r| r.get_ref(0).unwrap().as_blob().unwrap().len())
    }
    fn range_events(&self, shop: u32, item: u32, after: u64, limit: usize) -> usize {
        let mut st = self
            .conn
            .prepare_cached(
                "SELECT seq, seg, off FROM events WHERE shop=?1 AND item=?2 AND seq>?3 ORDER BY seq LIMIT ?4",
            )
            .unwrap();
        let mut rows = st
            .query(rusqlite::params![shop, item, after as i64, limit as i64])
            .unwrap();
        let mut n = 0;
        let mut acc = 0i64;
        while let Some(r) = rows.next().unwrap() {
            acc = acc.wrapping_add(r.get::<_, i64>(0).unwrap() ^ r.get::<_, i64>(2).unwrap());
            n += 1;
        }
        std::hint::black_box(acc);
        n
    }
}

// ---------------------------------------------------------------- fjall

struct Fjall {
    db: fjall::Database,
    outcomes: fjall::Keyspace,
    events: fjall::Keyspace,
}

impl Fjall {
    fn open(dir: &Path) -> Self {
        let db = fjall::Database::builder(dir).cache_size(CACHE_BYTES).open().unwrap();
        let outcomes = db.keyspace("outcomes", fjall::KeyspaceCreateOptions::default).unwrap();
        let events = db.keyspace("events", fjall::KeyspaceCreateOptions::default).unwrap();
        Fjall { db, outcomes, events }
    }
    fn wait_idle(&self) {
        loop {
            if self.db.outstanding_flushes() == 0 && self.db.active_compactions() == 0 {
                std::thread::sleep(Duration::from_millis(200));
                if self.db.outstanding_flushes() == 0 && self.db.active_compactions() == 0 {
                    return;
                }
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Store for Fjall {
    fn write_batch(&mut self, e: &Entries, range: std::ops::Range<usize>, _b: usize) {
        let mut b = self.db.batch();
        for i in range {
            b.insert(&self.outcomes, e.okey(i), e.oval(i));
            b.insert(&self.events, &e.ekey(i)[..], &e.eval(i)[..]);
        }
        b.commit().unwrap(); // default: journal buffer flushed to OS (write(2)) on commit, no fsync
    }
    fn finish_and_settle(&mut self) {
        self.wait_idle();
    }
    fn force(&mut self) -> &'static str {
        self.outcomes.rotate_memtable_and_wait().unwrap();
        self.events.rotate_memtable_and_wait().unwrap();
        self.wait_idle();
        "rotate_memtable_and_wait (flush memtables to tables) + wait for compactions"
    }
    fn get_outcome(&self, _shop: u32, _rkey: &[u8], okey: &[u8]) -> Option<usize> {
        self.outcomes.get(okey).unwrap().map(|v| v.len())
    }
    fn range_events(&self, shop: u32, item: u32, after: u64, limit: usize) -> usize {
        let lo = ekey(shop, item, after + 1);
        let hi = ekey(shop, item, u64::MAX);
        let mut n = 0;
        let mut acc = 0u64;
        for kv in self.events.range(&lo[..]..=&hi[..]).take(limit) {
            let (k, v) = kv.into_inner().unwrap();
            acc = acc.wrapping_add(k[15] as u64 ^ v[11] as u64);
            n += 1;
        }
        std::hint::black_box(acc);
        n
    }
}

// ---------------------------------------------------------------- redb

const R_OUT: redb::TableDefinition<&[u8], &[u8]> = redb::TableDefinition::new("outcomes");
const R_EV: redb::TableDefinition<&[u8], &[u8]> = redb::TableDefinition::new("events");

struct Redb {
    db: redb::Database,
    pending_nondurable: bool,
}

impl Redb {
    fn open(dir: &Path) -> Self {
        std::fs::create_dir_all(dir).unwrap();
        let db = redb::Builder::new()
            .set_cache_size(CACHE_BYTES as usize)
            .create(dir.join("views.redb"))
            .unwrap();
        Redb {
            db,
            pending_nondurable: false,
        }
    }
    fn commit_durable(&mut self) {
        let mut tx = self.db.begin_write().unwrap();
        tx.set_durability(redb::Durability::Immediate).unwrap();
        tx.commit().unwrap();
        self.pending_nondurable = false;
    }
}

impl Store for Redb {
    fn write_batch(&mut self, e: &Entries, range: std::ops::Range<usize>, b: usize) {
        let mut tx = self.db.begin_write().unwrap();
        let durable = (b + 1).is_multiple_of(REDB_DURABLE_EVERY);
        tx.set_durability(if durable {
            redb::Durability::Immediate
        } else {
            redb::Durability::None
        })
        .unwrap();
        {
            let mut to = tx.open_table(R_OUT).unwrap();
            let mut te = tx.open_table(R_EV).unwrap();
            for i in range {
                to.insert(e.okey(i), e.oval(i)).unwrap();
                te.insert(&e.ekey(i)[..], &e.eval(i)[..]).unwrap();
            }
        }
        tx.commit().unwrap();
        self.pending_nondurable = !durable;
    }
    fn finish_and_settle(&mut self) {
        if self.pending_nondurable {
            self.commit_durable();
        }
    }
    fn force(&mut self) -> &'static str {
        "none (redb has no background work; Database::compact not run)"
    }
    fn get_outcome(&self, _shop: u32, _rkey: &[u8], okey: &[u8]) -> Option<usize> {
        use redb::ReadableDatabase;
        let tx = self.db.begin_read().unwrap();
        let t = tx.open_table(R_OUT).unwrap();
        t.get(okey).unwrap().map(|v| v.value().len())
    }
    fn range_events(&self, shop: u32, item: u32, after: u64, limit: usize) -> usize {
        use redb::ReadableDatabase;
        let tx = self.db.begin_read().unwrap();
        let t = tx.open_table(R_EV).unwrap();
        let lo = ekey(shop, item, after + 1);
        let hi = ekey(shop, item, u64::MAX);
        let mut n = 0;
        let mut acc = 0u64;
        for kv in t.range(&lo[..]..=&hi[..]).unwrap().take(limit) {
            let (k, v) = kv.unwrap();
            acc = acc.wrapping_add(k.value()[15] as u64 ^ v.value()[11] as u64);
            n += 1;
        }
        std::hint::black_box(acc);
        n
    }
}

// ---------------------------------------------------------------- measurement helpers

fn rusage_secs(who: libc::c_int) -> f64 {
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(who, &mut ru) };
    let t = |tv: libc::timeval| tv.tv_sec as f64 + tv.tv_usec as f64 / 1e6;
    t(ru.ru_utime) + t(ru.ru_stime)
}

/// CPU of the whole process: the writer and every background thread of a store.
fn cpu_secs() -> f64 {
    rusage_secs(libc::RUSAGE_SELF)
}

/// CPU of the calling thread (`getrusage(RUSAGE_THREAD)`), for the writer's own share.
fn thread_rusage_secs() -> f64 {
    rusage_secs(libc::RUSAGE_THREAD)
}

/// CPU of the calling thread in nanoseconds (`CLOCK_THREAD_CPUTIME_ID`, the same kernel
/// counter as `RUSAGE_THREAD`, finer): cheap enough to time each batch's log write.
pub(crate) fn thread_cpu_s() -> f64 {
    let mut ts: libc::timespec = unsafe { std::mem::zeroed() };
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 / 1e9
}

/// Peak and current resident set of this process, from /proc (kB).
fn rss_kb() -> (u64, u64) {
    let s = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| {
        s.lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    (field("VmHWM:"), field("VmRSS:"))
}

fn segment_bytes() -> u64 {
    std::env::var("VB_SEGMENT_MB")
        .ok()
        .map(|v| v.parse::<u64>().unwrap())
        .unwrap_or(64)
        << 20
}

fn du_bytes(dir: &Path) -> u64 {
    // allocated bytes (like `du -s --block-size=1`)
    use std::os::unix::fs::MetadataExt;
    let mut total = 0;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for ent in std::fs::read_dir(&d).unwrap() {
            let ent = ent.unwrap();
            let md = ent.metadata().unwrap();
            if md.is_dir() {
                stack.push(ent.path());
            } else {
                total += md.blocks() * 512;
            }
        }
    }
    total
}

fn pct(v: &mut [u64], p: f64) -> u64 {
    v.sort_unstable();
    let idx = ((v.len() as f64 - 1.0) * p).round() as usize;
    v[idx]
}

/// A store for the write phase: the log-backed candidates start an empty log.
fn create_store(cand: &str, dir: &Path) -> Box<dyn Store> {
    match cand {
        "segidx" => Box::new(segidx::SegIdx::create(dir, segment_bytes())),
        "sqlite-sorted" | "fjall-ingest" => Box::new(bulk::Bulk::create(cand, dir, segment_bytes())),
        _ => open_store(cand, dir),
    }
}

fn open_store(cand: &str, dir: &Path) -> Box<dyn Store> {
    match cand {
        "sqlite" => Box::new(Sqlite::open(dir)),
        "fjall" => Box::new(Fjall::open(dir)),
        "redb" => Box::new(Redb::open(dir)),
        "segidx" => Box::new(segidx::SegIdx::open(dir, segment_bytes())),
        "sqlite-sorted" | "fjall-ingest" => Box::new(bulk::Bulk::open(cand, dir, segment_bytes())),
        _ => panic!("unknown candidate {cand}"),
    }
}

/// `viewbench reopen <cand> <store_dir>`: opens a store left by an earlier run and prints
/// how long that took (and, for segidx, how many indexes it rebuilt): a start at a size
/// too large to write twice, or after the indexes were deleted (a restore without them).
fn reopen_only(cand: &str, dir: &Path) {
    let t = Instant::now();
    let c = cpu_secs();
    let rebuilt = if cand == "segidx" {
        segidx::SegIdx::open(dir, segment_bytes()).rebuilt
    } else {
        drop(open_store(cand, dir));
        0
    };
    println!(
        "cand={cand} reopen_s={:.3} reopen_cpu_s={:.3} rebuilt={rebuilt}",
        t.elapsed().as_secs_f64(),
        cpu_secs() - c
    );
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args[1] == "reopen" {
        return reopen_only(&args[2], Path::new(&args[3]));
    }
    let cand = args[1].as_str();
    let mix = args[2].as_str();
    let n: usize = args[3].parse().unwrap();
    let dir = PathBuf::from(&args[4]);
    let seed: u64 = args.get(5).map(|s| s.parse().unwrap()).unwrap_or(42);
    let _ = std::fs::remove_dir_all(&dir);

    let mut rng = StdRng::seed_from_u64(seed);
    let e = gen_entries(mix, n, &mut rng);
    let key_bytes = e.okey.len() as f64 / n as f64;
    let val_bytes = e.oval.len() as f64 / n as f64;

    let (_, rss_gen_kb) = rss_kb();

    // ---- write phase
    let mut store = create_store(cand, &dir);
    let c0 = cpu_secs();
    let t0 = thread_rusage_secs();
    let w0 = Instant::now();
    let mut b = 0;
    let mut i = 0;
    while i < n {
        let j = (i + BATCH).min(n);
        store.write_batch(&e, i..j, b);
        b += 1;
        i = j;
    }
    let c1 = cpu_secs();
    let w1 = w0.elapsed().as_secs_f64();
    store.finish_and_settle();
    let c2 = cpu_secs();
    let w2 = w0.elapsed().as_secs_f64();
    let du_settled = du_bytes(&dir);
    let forced = store.force();
    let c3 = cpu_secs();
    let t3 = thread_rusage_secs();
    let w3 = w0.elapsed().as_secs_f64();
    let log_cpu = store.log_cpu_s();
    let bulk_cpu = store.bulk_cpu_s();
    let du_forced = du_bytes(&dir);
    let du_log = du_bytes_ext(&dir, "log");
    drop(store);
    let du_closed = du_bytes(&dir);

    // ---- read phase: reopen
    let o0 = Instant::now();
    let store = open_store(cand, &dir);
    let open_s = o0.elapsed().as_secs_f64();

    // hits
    let mut lat = Vec::with_capacity(N_HIT);
    let mut found = 0;
    for _ in 0..N_HIT {
        let k = rng.gen_range(0..n);
        let t = Instant::now();
        let r = store.get_outcome(e.shop[k], e.rkey(k), e.okey(k));
        lat.push(t.elapsed().as_nanos() as u64);
        if r.is_some() {
            found += 1;
        }
    }
    assert_eq!(found, N_HIT, "all hits must be found");
    let hit_p50 = pct(&mut lat, 0.5);
    let hit_p99 = pct(&mut lat, 0.99);
    // misses: fresh random keys with the same shape
    let mut lat = Vec::with_capacity(N_MISS);
    let mut miss_found = 0;
    let mut kb = Vec::with_capacity(32);
    for _ in 0..N_MISS {
        kb.clear();
        let shop = rng.gen_range(0..SHOPS);
        kb.extend_from_slice(&shop.to_be_bytes());
        random_rkey(&mut rng, &mut kb);
        let t = Instant::now();
        let r = store.get_outcome(shop, &kb[4..], &kb);
        lat.push(t.elapsed().as_nanos() as u64);
        if r.is_some() {
            miss_found += 1;
        }
    }
    let miss_p50 = pct(&mut lat, 0.5);
    let miss_p99 = pct(&mut lat, 0.99);
    // range reads: seq > after limit 1000 for one item
    let mut lat = Vec::with_capacity(N_RANGE);
    let mut rows = 0usize;
    for _ in 0..N_RANGE {
        let k = rng.gen_range(0..n);
        let (shop, item) = (e.shop[k], e.item[k]);
        // hot/soldout: random `after` with >=1000 following; spread: after=0 (whole item, ~n/10000 rows)
        let after = if mix == "spread" {
            0
        } else {
            rng.gen_range(0..(n as u64).saturating_sub(1000))
        };
        let t = Instant::now();
        rows += store.range_events(shop, item, after, 1000);
        lat.push(t.elapsed().as_nanos() as u64);
    }
    let rng_p50 = pct(&mut lat, 0.5);
    let rng_p99 = pct(&mut lat, 0.99);
    // the same range reads, each event's entry read from the log (log-backed candidates)
    let mut lat = Vec::with_capacity(N_RANGE);
    for _ in 0..N_RANGE {
        let k = rng.gen_range(0..n);
        let (shop, item) = (e.shop[k], e.item[k]);
        let after = if mix == "spread" {
            0
        } else {
            rng.gen_range(0..(n as u64).saturating_sub(1000))
        };
        let t = Instant::now();
        if store.range_fetch(shop, item, after, 1000).is_none() {
            break;
        }
        lat.push(t.elapsed().as_nanos() as u64);
    }
    let (fetch_p50, fetch_p99) = if lat.is_empty() {
        ("-".to_string(), "-".to_string())
    } else {
        (pct(&mut lat, 0.5).to_string(), pct(&mut lat, 0.99).to_string())
    };
    drop(store);
    let extra = if cand == "segidx" {
        segidx_faults(&dir, &e, &mut rng)
    } else {
        String::new()
    };
    let (hwm_kb, _) = rss_kb();

    println!(
        "cand={cand} mix={mix} n={n} seed={seed} key_b={key_bytes:.1} val_b={val_bytes:.1} \
         write_wall_s={w1:.3} write_cpu_s={:.3} cpu_us_per_entry={:.3} wall_us_per_entry={:.3} \
         settle_wall_s={:.3} cpu_us_per_entry_settled={:.3} \
         force_wall_s={:.3} cpu_us_per_entry_forced={:.3} \
         du_settled={du_settled} du_forced={du_forced} du_closed={du_closed} \
         b_per_entry_settled={:.1} b_per_entry_forced={:.1} b_per_entry_closed={:.1} \
         reopen_s={open_s:.3} hit_p50_ns={hit_p50} hit_p99_ns={hit_p99} miss_p50_ns={miss_p50} miss_p99_ns={miss_p99} miss_found={miss_found} \
         range_p50_ns={rng_p50} range_p99_ns={rng_p99} range_rows_avg={:.1} \
         range_fetch_p50_ns={fetch_p50} range_fetch_p99_ns={fetch_p99} \
         thr_cpu_us_per_entry_forced={:.3} log_cpu_us_per_entry={:.3} bulk_cpu_us_per_entry={:.3} \
         derive_cpu_us_per_entry_forced={:.3} derive_thr_us_per_entry_forced={:.3} \
         du_log={du_log} b_per_entry_index={:.1} rss_gen_kb={rss_gen_kb} hwm_kb={hwm_kb} {extra}forced_how=\"{forced}\"",
        c1 - c0,
        (c1 - c0) * 1e6 / n as f64,
        w1 * 1e6 / n as f64,
        w2 - w1,
        (c2 - c0) * 1e6 / n as f64,
        w3 - w2,
        (c3 - c0) * 1e6 / n as f64,
        du_settled as f64 / n as f64,
        du_forced as f64 / n as f64,
        du_closed as f64 / n as f64,
        rows as f64 / N_RANGE as f64,
        (t3 - t0) * 1e6 / n as f64,
        log_cpu * 1e6 / n as f64,
        bulk_cpu * 1e6 / n as f64,
        (c3 - c0 - log_cpu) * 1e6 / n as f64,
        (t3 - t0 - log_cpu) * 1e6 / n as f64,
        (du_forced - du_log) as f64 / n as f64,
    );
}

/// Allocated bytes of the files in `dir` (and below) whose extension is `ext`.
fn du_bytes_ext(dir: &Path, ext: &str) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let mut total = 0;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for ent in std::fs::read_dir(&d).unwrap() {
            let ent = ent.unwrap();
            let md = ent.metadata().unwrap();
            if md.is_dir() {
                stack.push(ent.path());
            } else if ent.path().extension().is_some_and(|x| x == ext) {
                total += md.blocks() * 512;
            }
        }
    }
    total
}

/// segidx's corruption and recovery paths, on the store just measured:
/// - the full check of every index block (what a start runs after it is ready);
/// - an index whose filter has a flipped byte: refused at open and rebuilt from its
///   segment (the time of that open, and that every sampled key is still found);
/// - a flipped byte in a key block: not seen at open (blocks are checked when read),
///   found by the full check.
fn segidx_faults(dir: &Path, e: &Entries, rng: &mut StdRng) -> String {
    let s = segidx::SegIdx::open(dir, segment_bytes());
    let t = Instant::now();
    s.check_all().unwrap();
    let check_all_s = t.elapsed().as_secs_f64();
    drop(s);
    let mut idx: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|d| d.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "idx"))
        .collect();
    idx.sort();
    let flip = |p: &Path, at: usize| {
        let mut b = std::fs::read(p).unwrap();
        b[at] ^= 0x40;
        std::fs::write(p, b).unwrap();
    };
    let len = std::fs::metadata(&idx[0]).unwrap().len() as usize;
    flip(&idx[0], len - 64 - 8 * 1024); // inside the directory, fence or filter
    let t = Instant::now();
    let s = segidx::SegIdx::open(dir, segment_bytes());
    let rebuild_open_s = t.elapsed().as_secs_f64();
    let rebuilt = s.rebuilt;
    let found = (0..10_000)
        .filter(|_| {
            let k = rng.gen_range(0..e.len());
            s.get_outcome(e.shop[k], e.rkey(k), e.okey(k)).is_some()
        })
        .count();
    assert_eq!(found, 10_000, "every key is found after the rebuild");
    drop(s);
    flip(idx.last().unwrap(), 100); // in the first key block
    let s = segidx::SegIdx::open(dir, segment_bytes());
    let block_refused = s.check_all().is_err();
    format!(
        "check_all_s={check_all_s:.3} rebuild_open_s={rebuild_open_s:.3} rebuilt={rebuilt} \
         block_flip_refused={block_refused} segments={} ",
        idx.len()
    )
}
