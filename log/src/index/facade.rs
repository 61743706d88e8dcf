//! The index of a whole log: its sealed segments' indexes in lsn order and the tail of
//! the segment being written, behind one lock, so that a reader sees the sealed list
//! and the tail as of one moment (a seal moves entries from one to the other).
//!
//! What the embedded journal calls:
//! - **Its writer**, per group: after the group's sync, [`Index::add_synced`] once
//!   with each entries record (its segment, offset and end), before anyone is answered.
//!   When the log moved to a new segment within the group, the old segment's records
//!   go first, then its tail is frozen ([`Index::freeze`]), then the new segment's.
//! - **Its index thread**: [`Index::write_frozen`] after a freeze, off the writer.
//! - **Its retirement**: [`Index::retire`] for each segment deleted.
//! - **Its maintenance**, every few seconds: [`Index::refresh_sealed_keys`], which keeps
//!   one filter over the sealed segments' keys ([`SealedKeys`]).
//! - **Its readers**: [`Index::lookup`] (polls, repeats, holds' ends) and
//!   [`Index::events`] (an item's events); both take the lock only to copy what they
//!   need, then read index blocks and log records without it.
//! - **Its start**: [`Index::open`] after the log's own start (scan, torn tail cut).

use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard};

use nrtxn_actors::types::Entry;

use super::format::SegmentSeal;
use super::keys::SealedKeys;
use super::segfile::{first_lsn_of, read_segment, write_index};
use super::{idx_path, item_hash, key_hash, keys, rebuild, IndexError, Pos, SealedIndex};
use super::{SegmentFile, Tail};
use crate::seal::{self, FOOTER_LEN};
use crate::segment;

/// The most events one [`Index::events`] call returns: a caller pages with `from_seq`.
/// At about 100 B of log read per event, 10,000 events are about 1 MB of reads.
pub const EVENTS_MAX: usize = 10_000;

/// An entries record the log wrote: its segment, where it starts and ends there, and
/// its entries (as encoded into its body).
#[derive(Debug, Clone, Copy)]
pub struct Written<'a> {
    pub first_lsn: u64,
    pub offset: u64,
    pub end: u64,
    pub entries: &'a [Entry],
}

/// A sealed segment: its index and the file its positions are read from.
struct Sealed {
    index: SealedIndex,
    segment: Arc<SegmentFile>,
}

/// A sealed segment whose index file is not written yet: its tail, frozen and still
/// read, so that no key is missed between the seal and the index's open.
struct Frozen {
    tail: Tail,
    segment: Arc<SegmentFile>,
    seal: SegmentSeal,
}

struct State {
    /// Oldest first. Replaced whole at a seal or retirement (rare), so that a reader
    /// copies one `Arc` and reads the sealed indexes without the lock.
    sealed: Arc<Vec<Arc<Sealed>>>,
    /// Sealed segments whose index is being written, or failed to be: oldest first,
    /// after every sealed one. Each is written at the next seal if its first try failed.
    frozen: Vec<Arc<Frozen>>,
    /// The segment being written.
    tail: Tail,
    tail_file: Arc<SegmentFile>,
    /// The filter over the sealed segments' keys, once built.
    keys: Option<Covered>,
}

/// What [`Index::refresh_sealed_keys`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refreshed {
    /// The filter covered every sealed segment already (or there is none).
    Unchanged,
    /// Built from scratch, with the keys of every sealed segment.
    Built { keys: u64 },
    /// Extended with the keys of the segments sealed since.
    Extended { keys: u64 },
}

/// The filter over the sealed segments' keys and the segments it covers: every one
/// whose last lsn is at most `through`.
#[derive(Clone)]
struct Covered {
    filter: Arc<SealedKeys>,
    through: u64,
}

impl State {
    /// Whether key hash `h` may be in the log: in a tail (the live one or one frozen
    /// while its segment is sealed), or in the sealed segments' filters.
    fn may_contain(&self, h: u64) -> bool {
        self.tail.has_key(h)
            || self.frozen.iter().any(|f| f.tail.has_key(h))
            || self.sealed_may_contain(h)
    }

    /// False: no sealed segment has this key hash. The filter over them where it covers
    /// them; each newer segment's own filter for the rest.
    fn sealed_may_contain(&self, h: u64) -> bool {
        let through = self.keys.as_ref().map_or(0, |k| k.through);
        self.keys.as_ref().is_some_and(|k| k.filter.may_contain(h))
            || self
                .sealed
                .iter()
                .rev()
                .take_while(|x| x.index.last_lsn() > through)
                .any(|x| x.index.may_contain(h))
    }
}

/// What a reader copies under the lock.
struct Snapshot {
    sealed: Arc<Vec<Arc<Sealed>>>,
    frozen: Vec<Arc<Frozen>>,
    tail_file: Arc<SegmentFile>,
}

/// The index of the log in one directory.
pub struct Index {
    dir: PathBuf,
    /// A `std` lock, not an async one: it is held for memory work only (a group's
    /// inserts, a copy of positions), never across I/O.
    state: RwLock<State>,
    /// Indexes found bad or missing by [`Index::open`] and rebuilt.
    rebuilt_at_open: usize,
}

impl Index {
    fn read(&self) -> RwLockReadGuard<'_, State> {
        self.state
            .read()
            .expect("the index's writer panicked while it held the lock")
    }

    fn write(&self) -> RwLockWriteGuard<'_, State> {
        self.state
            .write()
            .expect("the index's writer panicked while it held the lock")
    }

    /// Opens the index of the log in `dir`: every sealed segment's `.idx` (a bad or
    /// missing one rebuilt from its segment), and the newest segment, unless sealed,
    /// read back into the tail. To be called after the log's start checks, which cut
    /// a torn tail: the tail takes the newest segment's records up to the first that
    /// does not check.
    pub fn open(dir: &Path) -> Result<Index, IndexError> {
        let segs = segment::segments(dir).map_err(IndexError::io(dir))?;
        remove_leftovers(dir, &segs)?;
        let (mut sealed, mut tail, mut rebuilt) = (Vec::new(), None, 0);
        for (i, (first, path)) in segs.iter().enumerate() {
            if i + 1 == segs.len() && seal_of(path, *first)?.is_none() {
                tail = Some(read_segment(path, false)?.tail);
                break;
            }
            let (index, was_rebuilt) = open_or_rebuild(path, *first)?;
            rebuilt += usize::from(was_rebuilt);
            let segment = Arc::new(SegmentFile::new(path.clone(), *first));
            sealed.push(Arc::new(Sealed { index, segment }));
        }
        let tail =
            tail.unwrap_or_else(|| Tail::new(sealed.last().map_or(1, |s| s.index.last_lsn() + 1)));
        let tail_file = Arc::new(segment_file(dir, tail.first_lsn()));
        Ok(Index {
            dir: dir.to_path_buf(),
            state: RwLock::new(State {
                sealed: Arc::new(sealed),
                frozen: Vec::new(),
                tail,
                tail_file,
                keys: None,
            }),
            rebuilt_at_open: rebuilt,
        })
    }

    /// How many indexes [`Index::open`] found bad or missing and rebuilt.
    pub fn rebuilt_at_open(&self) -> usize {
        self.rebuilt_at_open
    }

    /// The first lsns of the segments with an index file, oldest first.
    pub fn sealed_segments(&self) -> Vec<u64> {
        self.read()
            .sealed
            .iter()
            .map(|s| s.index.first_lsn())
            .collect()
    }

    /// The first lsn of the segment the tail indexes.
    pub fn tail_first_lsn(&self) -> u64 {
        self.read().tail.first_lsn()
    }

    /// Hands the index a group's records after their sync, in log order: each run of
    /// records of one segment is added and marked durable under one lock, and a segment
    /// the log left within the group (or before it) is frozen first ([`Index::freeze`]).
    /// What the journal's writer calls once per group. Returns whether a segment was
    /// frozen: its index file is written by [`Index::write_frozen`], which the caller
    /// runs off its own thread (sorting and writing a segment's index takes tens of
    /// milliseconds, which no group should wait for).
    pub fn add_synced(&self, records: &[Written<'_>]) -> Result<bool, IndexError> {
        let mut froze = false;
        let mut rest = records;
        while let Some(first) = rest.first() {
            let n = rest
                .iter()
                .take_while(|r| r.first_lsn == first.first_lsn)
                .count();
            let (run, after) = rest.split_at(n);
            while self.tail_first_lsn() != first.first_lsn {
                let sealing = self.tail_first_lsn();
                // Segments are sealed in order: the log never goes back to one.
                assert!(
                    sealing < first.first_lsn,
                    "a record of segment {} after segment {sealing} was indexed",
                    first.first_lsn
                );
                self.freeze(sealing, &self.dir.join(segment_name(sealing)))?;
                froze = true;
            }
            self.write_group(|tail| {
                for r in run {
                    tail.add_record(r.offset, r.entries);
                }
                tail.mark_durable(run[n - 1].end);
            });
            rest = after;
        }
        Ok(froze)
    }

    /// Runs `f` on the tail under the lock, once per group: the writer adds the group's
    /// records and marks them durable in one go, so readers wait for one lock per group.
    pub fn write_group<R>(&self, f: impl FnOnce(&mut Tail) -> R) -> R {
        f(&mut self.write().tail)
    }

    fn snapshot(&self) -> (Snapshot, RwLockReadGuard<'_, State>) {
        let s = self.read();
        let snap = Snapshot {
            sealed: s.sealed.clone(),
            frozen: s.frozen.clone(),
            tail_file: s.tail_file.clone(),
        };
        (snap, s)
    }

    /// False: no entry of the log has this shop and request key. True: one may have
    /// (the tails' keys and the sealed segments' filters, all in memory; a key not yet
    /// durable counts). What a request's at-most-once check asks first.
    pub fn may_contain(&self, shop: &str, key: &str) -> bool {
        let h = key_hash(shop, key);
        self.read().may_contain(h)
    }

    /// Whether any of `keys` of `shop` may be in the log ([`Index::may_contain`]): a
    /// call's keys hashed first, then looked up under one read of the lock (on the
    /// engine benchmark's calls of 1,000 keys, 1.06 times the decrements a second of a
    /// lookup each).
    pub fn may_contain_any(&self, shop: &str, keys: &[&str]) -> bool {
        if let [key] = keys {
            return self.may_contain(shop, key);
        }
        let hashes: Vec<u64> = keys.iter().map(|k| key_hash(shop, k)).collect();
        let s = self.read();
        hashes.iter().any(|&h| s.may_contain(h))
    }

    /// Builds the filter over the sealed segments' keys, or extends it to the segments
    /// sealed since, reading their index files' key blocks; builds it again, sized for
    /// twice the keys kept, once it has no room for them (retired segments' keys stay in
    /// it until then) or is more than four times too large. Off the request path: the
    /// journal's maintenance thread, one caller at a time. What it did.
    pub fn refresh_sealed_keys(&self) -> Result<Refreshed, IndexError> {
        let (sealed, covered) = {
            let s = self.read();
            (s.sealed.clone(), s.keys.clone())
        };
        let Some(newest) = sealed.last().map(|x| x.index.last_lsn()) else {
            return Ok(Refreshed::Unchanged);
        };
        let kept: u64 = sealed.iter().map(|x| x.index.keys()).sum();
        let after = |through: u64| sealed.iter().filter(move |x| x.index.first_lsn() > through);
        let reused = covered.filter(|c| {
            let adding: u64 = after(c.through).map(|x| x.index.keys()).sum();
            c.filter.has_room(adding) && c.filter.capacity() <= 4 * kept.max(keys::CAPACITY_MIN)
        });
        let Covered { filter, through } = match reused {
            Some(c) if c.through >= newest => return Ok(Refreshed::Unchanged),
            Some(c) => c,
            None => Covered {
                filter: Arc::new(SealedKeys::with_capacity(2 * kept)),
                through: 0,
            },
        };
        let mut keys = 0;
        for x in after(through) {
            x.index.for_each_key(|h| filter.insert(h))?;
            keys += x.index.keys();
        }
        let done = if through == 0 {
            Refreshed::Built { keys }
        } else {
            Refreshed::Extended { keys }
        };
        // Covered from now on: every key of theirs is in.
        self.write().keys = Some(Covered {
            filter,
            through: newest,
        });
        Ok(done)
    }

    /// The newest entry with this shop and request key whose record is durable: the
    /// tail first, then the sealed segments newest to oldest. Every hit is read from
    /// the log and compared, so a hash shared with another key costs a read only.
    pub fn lookup(&self, shop: &str, key: &str) -> Result<Option<Entry>, IndexError> {
        let h = key_hash(shop, key);
        let ours = |e: &Entry| *e.shop == *shop && e.request_key.as_deref() == Some(key);
        let (snap, tail_hits) = {
            let (snap, s) = self.snapshot();
            let hits = s.tail.key_positions(h);
            (snap, hits)
        };
        if let Some(e) = newest_confirmed(&snap.tail_file, &tail_hits, ours)? {
            return Ok(Some(e));
        }
        for f in snap.frozen.iter().rev() {
            if let Some(e) = newest_confirmed(&f.segment, &f.tail.key_positions(h), ours)? {
                return Ok(Some(e));
            }
        }
        for s in snap.sealed.iter().rev() {
            if !s.index.may_contain(h) {
                continue;
            }
            if let Some(e) = newest_confirmed(&s.segment, &s.index.key_positions(h)?, ours)? {
                return Ok(Some(e));
            }
        }
        Ok(None)
    }

    /// The item's durable events from `from_seq` on, in seq order across segments, at
    /// most `limit` (and [`EVENTS_MAX`]). Each seq follows the one before it: a gap is
    /// an error, never a short answer. The first may come after `from_seq` when the
    /// segments before it were retired; the caller knows its retention.
    pub fn events(
        &self,
        shop: &str,
        item: &str,
        from_seq: u64,
        limit: usize,
    ) -> Result<Vec<Entry>, IndexError> {
        let ih = item_hash(shop, item);
        let limit = limit.min(EVENTS_MAX);
        let mut out = Events::new(shop, item, from_seq, limit);
        let (snap, tail_first, tail_events) = {
            let (snap, s) = self.snapshot();
            // The tail's first `limit` events are copied under the lock: all an answer
            // wants unless another item shares the hash (then more are asked for below).
            let ev = s.tail.item_events(ih, from_seq, limit);
            (snap, s.tail.first_lsn(), ev)
        };
        for s in snap.sealed.iter() {
            let seg = &s.segment;
            out.take(seg, |from, want| s.index.item_events(ih, from, want))?;
        }
        for f in &snap.frozen {
            out.take(&f.segment, |from, want| {
                Ok(f.tail.item_events(ih, from, want))
            })?;
        }
        let copied = tail_events.len();
        out.take(&snap.tail_file, |from, want| {
            let at = tail_events.partition_point(|(s, _)| *s < from);
            if copied < limit || at + want <= copied {
                return Ok(tail_events[at..].iter().take(want).copied().collect());
            }
            self.segment_events(tail_first, ih, from, want)
        })?;
        Ok(out.list)
    }
}

impl Index {
    /// The events of item hash `ih` in the segment `first_lsn`, wherever it is now:
    /// still the tail, frozen, or sealed since a reader's snapshot.
    fn segment_events(
        &self,
        first_lsn: u64,
        ih: u64,
        from: u64,
        want: usize,
    ) -> Result<Vec<(u64, Pos)>, IndexError> {
        let sealed = {
            let s = self.read();
            if s.tail.first_lsn() == first_lsn {
                return Ok(s.tail.item_events(ih, from, want));
            }
            if let Some(f) = s.frozen.iter().find(|f| f.seal.first_lsn == first_lsn) {
                return Ok(f.tail.item_events(ih, from, want));
            }
            s.sealed
                .iter()
                .find(|x| x.index.first_lsn() == first_lsn)
                .cloned()
        };
        match sealed {
            Some(x) => x.index.item_events(ih, from, want),
            None => Err(IndexError::bad(
                &self.dir.join(segment_name(first_lsn)),
                "the segment was retired while its events were read",
            )),
        }
    }

    /// Seals the tail's segment, `first_lsn` at `segment_path` (the log wrote its seal
    /// footer and synced it): the tail is frozen, still read, and a new one starts for
    /// the next segment; [`Index::write_frozen`] writes its index file later, off the
    /// writer's thread, and opens it.
    ///
    /// An error reading the segment's footer leaves the tail as it was (the writer must
    /// not add the next segment's records to it: stopping is the honest move). An error
    /// writing the index file leaves the frozen tail readable, so no answer changes; the
    /// next write tries again.
    pub fn freeze(&self, first_lsn: u64, segment_path: &Path) -> Result<(), IndexError> {
        let sealing = seal_of(segment_path, first_lsn)?.ok_or_else(|| IndexError::Log {
            file: segment_path.to_path_buf(),
            offset: 0,
            detail: "sealed without a good footer at its end".into(),
        })?;
        {
            let mut s = self.write();
            // The writer seals the segment it has been adding: another one means its
            // idea of the segments and the index's differ.
            assert_eq!(
                s.tail.first_lsn(),
                first_lsn,
                "the index's tail is segment {}, but segment {first_lsn} was sealed",
                s.tail.first_lsn()
            );
            let records_end = sealing.len - FOOTER_LEN as u64;
            assert!(
                s.tail.last_offset().is_none_or(|o| o < records_end),
                "segment {first_lsn}: the tail holds a record past the segment's end"
            );
            let next = sealing.last_lsn + 1;
            let next_file = Arc::new(segment_file(&self.dir, next));
            // Sized like the segment it follows: a table that grows from small rehashes
            // every key it holds at each doubling, on the writer's thread.
            let following = Tail::sized_like(next, &s.tail);
            let mut tail = std::mem::replace(&mut s.tail, following);
            // The seal synced the segment: all of it is durable.
            tail.mark_durable(records_end);
            let segment = std::mem::replace(&mut s.tail_file, next_file);
            let frozen = Frozen {
                tail,
                segment,
                seal: sealing,
            };
            s.frozen.push(Arc::new(frozen));
        }
        Ok(())
    }

    /// Whether a frozen tail waits for its index file.
    pub fn has_frozen(&self) -> bool {
        !self.read().frozen.is_empty()
    }

    /// Writes the index files of the frozen tails, oldest first, and moves each to the
    /// sealed list once open. One caller at a time (the journal's index thread).
    pub fn write_frozen(&self) -> Result<(), IndexError> {
        loop {
            let Some(f) = self.read().frozen.first().cloned() else {
                return Ok(());
            };
            let index = write_index(f.segment.path(), &f.tail, f.seal)?;
            let mut s = self.write();
            if !s.frozen.first().is_some_and(|x| Arc::ptr_eq(x, &f)) {
                // Retired while its index was written: the file goes with it.
                drop(s);
                return std::fs::remove_file(index.path()).map_err(IndexError::io(index.path()));
            }
            let mut sealed = (*s.sealed).clone();
            sealed.push(Arc::new(Sealed {
                index,
                segment: f.segment.clone(),
            }));
            s.sealed = Arc::new(sealed);
            s.frozen.remove(0);
        }
    }

    /// Drops the index of the segment `first_lsn`, whose segment was deleted, and
    /// deletes its file. A segment not indexed is no error (a retirement retried).
    pub fn retire(&self, first_lsn: u64) -> Result<(), IndexError> {
        let gone = {
            let mut s = self.write();
            assert_ne!(
                s.tail.first_lsn(),
                first_lsn,
                "the segment being written cannot be retired"
            );
            s.frozen.retain(|f| f.seal.first_lsn != first_lsn);
            let mut sealed = (*s.sealed).clone();
            let at = sealed.iter().position(|x| x.index.first_lsn() == first_lsn);
            let gone = at.map(|i| sealed.remove(i));
            s.sealed = Arc::new(sealed);
            gone
        };
        let path = match &gone {
            Some(x) => x.index.path().to_path_buf(),
            None => idx_path(&self.dir.join(segment_name(first_lsn))),
        };
        match std::fs::remove_file(&path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(IndexError::io(&path)(e)),
            _ => Ok(()),
        }
    }

    /// Rebuilds the index of the sealed segment `first_lsn` from the segment, as a
    /// reader does after [`IndexError::Block`], and uses it from now on.
    pub fn rebuild(&self, first_lsn: u64) -> Result<(), IndexError> {
        let old = self
            .read()
            .sealed
            .iter()
            .find(|x| x.index.first_lsn() == first_lsn)
            .cloned();
        let Some(old) = old else {
            return Err(IndexError::bad(
                &self.dir.join(segment_name(first_lsn)),
                "no sealed index of this segment to rebuild",
            ));
        };
        let index = rebuild(old.segment.path())?;
        let mut s = self.write();
        let mut sealed = (*s.sealed).clone();
        if let Some(x) = sealed.iter_mut().find(|x| x.index.first_lsn() == first_lsn) {
            *x = Arc::new(Sealed {
                index,
                segment: old.segment.clone(),
            });
        }
        s.sealed = Arc::new(sealed);
        Ok(())
    }
}

/// An `events` answer being gathered, segment after segment.
struct Events<'a> {
    shop: &'a str,
    item: &'a str,
    from_seq: u64,
    limit: usize,
    list: Vec<Entry>,
}

impl<'a> Events<'a> {
    fn new(shop: &'a str, item: &'a str, from_seq: u64, limit: usize) -> Events<'a> {
        Events {
            shop,
            item,
            from_seq,
            limit,
            list: Vec::new(),
        }
    }

    fn last_seq(&self) -> Option<u64> {
        self.list.last().and_then(|e| e.seq)
    }

    /// Adds the item's events of one segment, whose candidates (seq, position) from a
    /// seq on `candidates` gives. A candidate of another item (the same hash) is read
    /// and passed over, and more are asked for: a collision costs reads only.
    fn take(
        &mut self,
        seg: &SegmentFile,
        mut candidates: impl FnMut(u64, usize) -> Result<Vec<(u64, Pos)>, IndexError>,
    ) -> Result<(), IndexError> {
        let from = self.last_seq().map_or(self.from_seq, |s| s + 1);
        let mut want = self.limit - self.list.len();
        let mut cache: Option<(u64, Vec<Entry>)> = None;
        while want > 0 && self.list.len() < self.limit {
            let cands = candidates(from, want)?;
            for (seq, pos) in &cands {
                if self.list.len() == self.limit {
                    return Ok(());
                }
                if self.last_seq().is_some_and(|l| *seq <= l) {
                    continue; // taken on an earlier pass
                }
                let e = cached_entry(seg, &mut cache, *pos)?;
                if *e.shop != *self.shop || *e.item != *self.item {
                    continue;
                }
                self.push(seg, *seq, pos, e)?;
            }
            if cands.len() < want {
                return Ok(());
            }
            want = want.saturating_mul(2);
        }
        Ok(())
    }

    /// Adds one confirmed event, if it is the one the index says and follows the last.
    fn push(&mut self, seg: &SegmentFile, seq: u64, pos: &Pos, e: Entry) -> Result<(), IndexError> {
        if e.seq != Some(seq) {
            return Err(IndexError::Log {
                file: seg.path().to_path_buf(),
                offset: pos.offset,
                detail: format!(
                    "the index gives entry {} seq {seq}, the log seq {:?}",
                    pos.slot, e.seq
                ),
            });
        }
        if let Some(last) = self.last_seq() {
            if seq != last + 1 {
                return Err(IndexError::Gap {
                    shop: self.shop.to_string(),
                    item: self.item.to_string(),
                    detail: format!(
                        "seq {seq} follows seq {last} (in {} at byte {})",
                        seg.path().display(),
                        pos.offset
                    ),
                });
            }
        }
        self.list.push(e);
        Ok(())
    }
}

/// The entry at `pos`, decoding its record once for the events that share it.
fn cached_entry(
    seg: &SegmentFile,
    cache: &mut Option<(u64, Vec<Entry>)>,
    pos: Pos,
) -> Result<Entry, IndexError> {
    if cache.as_ref().is_none_or(|(at, _)| *at != pos.offset) {
        *cache = Some((pos.offset, seg.record(pos.offset)?));
    }
    let (_, entries) = cache.as_ref().expect("filled just above");
    entries
        .get(pos.slot as usize)
        .cloned()
        .ok_or_else(|| IndexError::Log {
            file: seg.path().to_path_buf(),
            offset: pos.offset,
            detail: format!(
                "the index names entry {} of a record of {} entries",
                pos.slot,
                entries.len()
            ),
        })
}

/// The newest of `positions` (in log order) whose entry `ours` accepts.
fn newest_confirmed(
    seg: &SegmentFile,
    positions: &[Pos],
    ours: impl Fn(&Entry) -> bool,
) -> Result<Option<Entry>, IndexError> {
    for pos in positions.iter().rev() {
        let e = seg.entry(*pos)?;
        if ours(&e) {
            return Ok(Some(e));
        }
    }
    Ok(None)
}

fn segment_name(first_lsn: u64) -> String {
    format!("{first_lsn:020}.log")
}

fn segment_file(dir: &Path, first_lsn: u64) -> SegmentFile {
    SegmentFile::new(dir.join(segment_name(first_lsn)), first_lsn)
}

/// The seal of the segment at `path` (named for `first`) from its footer: `None` when
/// it has no good footer at its end (not sealed, or written before footers).
fn seal_of(path: &Path, first: u64) -> Result<Option<SegmentSeal>, IndexError> {
    use std::os::unix::fs::FileExt;
    let file = std::fs::File::open(path).map_err(IndexError::io(path))?;
    let len = file.metadata().map_err(IndexError::io(path))?.len();
    if len < FOOTER_LEN as u64 {
        return Ok(None);
    }
    let mut b = [0u8; FOOTER_LEN];
    file.read_exact_at(&mut b, len - FOOTER_LEN as u64)
        .map_err(IndexError::io(path))?;
    Ok(seal::Footer::decode(&b)
        .filter(|ft| ft.first_lsn == first && ft.len + FOOTER_LEN as u64 == len)
        .map(|ft| SegmentSeal {
            first_lsn: first,
            last_lsn: ft.last_lsn,
            len,
        }))
}

/// The index of the sealed segment at `path`, opened, or rebuilt when it is bad or
/// missing; whether it was rebuilt.
fn open_or_rebuild(path: &Path, first: u64) -> Result<(SealedIndex, bool), IndexError> {
    let len = std::fs::metadata(path).map_err(IndexError::io(path))?.len();
    let opened = SealedIndex::open(&idx_path(path), len).and_then(|x| {
        if x.first_lsn() == first {
            Ok(x)
        } else {
            Err(IndexError::bad(x.path(), "it indexes another segment"))
        }
    });
    match opened {
        Ok(x) => Ok((x, false)),
        Err(e) => {
            tracing::warn!(error = %e, "segment index: rebuilding");
            Ok((rebuild(path)?, true))
        }
    }
}

/// Deletes what a crash or a retirement may leave beside the segments: temporary index
/// files, indexes whose segment is gone, and an index of the newest segment if it is
/// not sealed (its tail is read from the segment).
fn remove_leftovers(dir: &Path, segs: &[(u64, PathBuf)]) -> Result<(), IndexError> {
    let newest = segs.last().map(|(_, p)| idx_path(p));
    for entry in std::fs::read_dir(dir).map_err(IndexError::io(dir))? {
        let path = entry.map_err(IndexError::io(dir))?.path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        let orphan = name.ends_with(".idx")
            && first_lsn_of(&path).is_ok()
            && !path.with_extension("log").exists();
        let newest_unsealed = Some(&path) == newest.as_ref()
            && segs
                .last()
                .is_some_and(|(f, p)| matches!(seal_of(p, *f), Ok(None)));
        if name.ends_with(".idx.tmp") || orphan || newest_unsealed {
            std::fs::remove_file(&path).map_err(IndexError::io(&path))?;
        }
    }
    Ok(())
}
