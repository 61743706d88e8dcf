//! A hierarchical timing wheel: the timers behind hold expiry.
//!
//! Each processor shard owns one [`TimingWheel`]. It inserts a timer for every pending
//! hold (deadline in ms since the Unix epoch), cancels it when the hold is confirmed or
//! cancelled, and calls [`TimingWheel::advance`] from a timer, sleeping until
//! [`TimingWheel::next_deadline_hint`] when it has nothing else to do.
//!
//! # Why a hierarchical wheel
//!
//! A heap costs O(log n) per insert and per cancel, and cancelling in the middle of it
//! needs a position index. A single flat wheel has O(1) insert and cancel but either
//! covers a short horizon or spends work on every empty tick. The hierarchical wheel
//! (Varghese and Lauck; Kafka's `TimingWheel` for delayed operations, the Linux and
//! tokio timers) keeps O(1) insert and cancel and makes the cost of `advance`
//! independent of both the number of pending timers and the number of elapsed ticks:
//!
//! - Time is counted in ticks of `tick_ms`; a deadline is rounded *up* to its tick, so a
//!   timer never fires before its deadline.
//! - Level `k` has 64 buckets, each covering `64^k` ticks. A timer goes to the level of
//!   the highest 6-bit digit in which its tick differs from the wheel's current tick,
//!   into the bucket named by its own digit at that level. So every timer of level `k`
//!   is later than every timer of level `k - 1`, and inside a level the buckets are in
//!   time order with nothing to wrap around.
//! - Each level keeps a `u64` occupancy bitmap. The next event is the first set bit of
//!   the lowest non-empty level (`trailing_zeros`), so a span of empty ticks, however
//!   long, is skipped in one step.
//! - When time reaches the start of a bucket at level `k > 0`, the bucket is cascaded:
//!   each of its timers is placed again relative to the new time, which puts it on a
//!   lower level (or fires it, if its tick is the bucket's first). A timer therefore
//!   moves at most once per level it starts above level 0.
//! - 11 levels cover the whole `u64` tick space (`6 * 11 >= 64`), so there is no
//!   overflow list to rescan: a timer 500 years out sits on a high level and cascades
//!   down like any other. Levels cost nothing to a timer that does not need them: a
//!   timer less than `64^k` ticks away moves at most `k` times whatever level it starts
//!   on (after its first cascade the time is aligned, so it drops below level `k`). One
//!   10 minutes away at a 1 ms tick (< 64^4 ticks) moves at most four times, usually
//!   three.
//!
//! Timers live in a slab (`Vec` of nodes plus a free list) and each bucket is an
//! intrusive doubly-linked list of `u32` node indices, so an insert allocates nothing
//! once the slab has grown to the peak number of timers, and a cancel unlinks its node
//! in O(1) wherever the timer has cascaded to. A node for `T = u64` is 40 bytes; the
//! bucket arrays are a fixed 5.7 KB per wheel.
//!
//! # Costs
//!
//! | operation | cost |
//! | --- | --- |
//! | `insert` | O(1), no allocation once the slab is warm |
//! | `cancel` | O(1) |
//! | `advance` | O(levels) per non-empty bucket reached, plus O(1) per timer fired or cascaded; never O(pending) or O(elapsed ticks) |
//! | `next_deadline_hint` | O(levels) |
//!
//! A timer is cascaded at most 10 times over its life, and at most `k` times if its
//! deadline was under `64^k` ticks away, so the work of `advance` amortised per timer is
//! O(k): O(4) for holds of up to 4.6 hours at a 1 ms tick.
//!
//! # Guarantees
//!
//! - **Never early.** `advance(now_ms)` expires only timers with `deadline_ms <= now_ms`.
//! - **Exact to the tick.** A timer whose deadline was after the wheel's time when it was
//!   inserted expires at the first `advance` whose `now_ms` reaches its deadline rounded
//!   up to a multiple of `tick_ms`; so at most `tick_ms - 1` ms later than the first
//!   advance whose `now_ms >= deadline_ms`, and exactly then with the default 1 ms tick.
//!   A timer whose deadline was at or before the wheel's time when it was inserted
//!   expires at the first `advance` whose `now_ms >= deadline_ms` (normally the next).
//!   `advance(u64::MAX)` expires everything.
//! - **Order within one advance.** Timers already due when inserted come first, in
//!   insertion order; then the rest in non-decreasing order of their tick
//!   (`ceil(deadline_ms / tick_ms)`), and timers of the same tick in insertion order.
//!   With a 1 ms tick the whole batch is sorted by deadline, apart from the timers that
//!   were already due when inserted.
//! - **Time never goes back.** An `advance` with a smaller `now_ms` than the wheel's
//!   time does not move the wheel; it can still expire already-due timers whose
//!   deadline is `<= now_ms`, so the never-early rule holds for every call.

use std::fmt;
use std::mem;

/// Bits of a tick that one level resolves: 64 buckets a level, so one `u64` bitmap says
/// which are occupied.
const SLOT_BITS: u32 = 6;
/// Buckets per level.
const SLOTS: usize = 1 << SLOT_BITS;
/// Levels needed so that the top one covers every `u64` tick: `ceil(64 / 6)`.
const LEVELS: usize = 64_usize.div_ceil(SLOT_BITS as usize);
/// The "no node" link. `u32` links halve the list overhead of `usize` ones, and bound
/// the slab to [`TIMERS_MAX`] nodes.
const NIL: u32 = u32::MAX;
/// [`Node::level`] of a node on the free list.
const LEVEL_FREE: u8 = u8::MAX;
/// [`Node::level`] of a node on the due list: its deadline had passed when inserted.
const LEVEL_DUE: u8 = LEVELS as u8;

/// Most timers one wheel holds at once: every `u32` index but the one kept for "no node".
/// A processor shard bounds its pending holds far below this (4 × 10^9 timers would be
/// 160 GiB of nodes).
pub const TIMERS_MAX: usize = NIL as usize;

/// A handle to one inserted timer, returned by [`TimingWheel::insert`] and with each
/// expired timer.
///
/// The slab index says where the timer lives; the generation says which occupant of
/// that slot it was, so a handle kept after its timer fired or was cancelled is rejected
/// even once the slot holds another timer. Generations wrap after 2^32 reuses of one
/// slot; a handle that old could then alias, which a hold's lifetime rules out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TimerId {
    index: u32,
    generation: u32,
}

/// One slab entry: a pending timer, or a free slot waiting for reuse.
struct Node<T> {
    /// Kept exact (not as a tick) because timers that were already due when inserted are
    /// released by `deadline_ms <= now_ms`, and a cascade recomputes the tick from it.
    deadline_ms: u64,
    /// `None` only while the node is free.
    value: Option<T>,
    /// Previous node in the same bucket, or [`NIL`].
    prev: u32,
    /// Next node in the same bucket, or in the free list while free, or [`NIL`].
    next: u32,
    /// Bumped each time the node is freed, so stale [`TimerId`]s no longer match.
    generation: u32,
    /// Which list holds the node: a level `0..LEVELS`, [`LEVEL_DUE`] or [`LEVEL_FREE`].
    /// Stored, with `slot`, so `cancel` finds the bucket in O(1) after any cascade.
    level: u8,
    /// The bucket within `level`.
    slot: u8,
}

/// Ends of one intrusive list; the links themselves are in the nodes.
#[derive(Clone, Copy)]
struct List {
    head: u32,
    /// Kept so appending is O(1) and a bucket stays in insertion order.
    tail: u32,
}

impl List {
    const EMPTY: List = List {
        head: NIL,
        tail: NIL,
    };

    fn is_empty(&self) -> bool {
        self.head == NIL
    }
}

/// One level of the wheel.
#[derive(Clone, Copy)]
struct Level {
    /// Bit `s` set iff `slots[s]` is non-empty: finding the next event is one
    /// `trailing_zeros`, not a walk over 64 buckets.
    occupied: u64,
    slots: [List; SLOTS],
}

impl Level {
    const EMPTY: Level = Level {
        occupied: 0,
        slots: [List::EMPTY; SLOTS],
    };
}

/// A hierarchical timing wheel carrying a `T` per timer. See the [module docs](self) for
/// the design, the costs and the guarantees.
pub struct TimingWheel<T> {
    /// Resolution: deadlines are rounded up to a multiple of it.
    tick_ms: u64,
    /// The largest `now_ms` given to `new` or `advance`: the wheel's time.
    now_ms: u64,
    /// `now_ms / tick_ms`, the last tick whose timers have all been expired; every timer
    /// on a level has a tick after it. Buckets are placed relative to it.
    elapsed_tick: u64,
    /// Boxed so the wheel itself stays a few words when moved into an actor.
    levels: Box<[Level; LEVELS]>,
    /// Timers whose deadline was `<= now_ms` when inserted; released by the next
    /// `advance` that reaches their deadline. Kept apart from level 0, whose buckets hold
    /// only ticks after `elapsed_tick`.
    due: List,
    /// A lower bound of the deadlines on `due` (exact unless a due timer was cancelled),
    /// so `next_deadline_hint` need not walk the list.
    due_deadline_min_ms: u64,
    nodes: Vec<Node<T>>,
    /// Head of the free list threaded through `Node::next`.
    free_head: u32,
    /// Pending timers: nodes not on the free list.
    len: usize,
}

impl<T> TimingWheel<T> {
    /// An empty wheel whose time is `now_ms`, expiring timers to the nearest `tick_ms`
    /// (rounded up, never early).
    ///
    /// # Panics
    ///
    /// If `tick_ms` is 0: the tick is configuration, checked when the service starts.
    pub fn new(tick_ms: u64, now_ms: u64) -> Self {
        Self::with_capacity(tick_ms, now_ms, 0)
    }

    /// As [`new`](Self::new), with room for `timers_capacity` timers before the slab
    /// grows, so the first inserts up to that count allocate nothing either.
    ///
    /// # Panics
    ///
    /// If `tick_ms` is 0.
    pub fn with_capacity(tick_ms: u64, now_ms: u64, timers_capacity: usize) -> Self {
        assert!(tick_ms > 0, "timing wheel tick_ms must be at least 1");
        TimingWheel {
            tick_ms,
            now_ms,
            elapsed_tick: now_ms / tick_ms,
            levels: Box::new([Level::EMPTY; LEVELS]),
            due: List::EMPTY,
            due_deadline_min_ms: u64::MAX,
            nodes: Vec::with_capacity(timers_capacity.min(TIMERS_MAX)),
            free_head: NIL,
            len: 0,
        }
    }

    /// The resolution this wheel was built with.
    pub fn tick_ms(&self) -> u64 {
        self.tick_ms
    }

    /// The wheel's time: the largest `now_ms` it has been given.
    pub fn now_ms(&self) -> u64 {
        self.now_ms
    }

    /// Pending timers.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Heap memory the wheel holds: the slab's capacity (nodes of freed timers are kept
    /// for reuse) plus the bucket arrays. For a metric, and for the benchmark's bytes
    /// per timer.
    pub fn heap_bytes(&self) -> usize {
        self.nodes.capacity() * mem::size_of::<Node<T>>() + mem::size_of::<[Level; LEVELS]>()
    }

    /// Schedules `value` to expire at `deadline_ms`, in O(1). A deadline at or before the
    /// wheel's time expires on the next [`advance`](Self::advance).
    ///
    /// # Panics
    ///
    /// If [`TIMERS_MAX`] timers are already pending.
    pub fn insert(&mut self, deadline_ms: u64, value: T) -> TimerId {
        let index = self.alloc(deadline_ms, value);
        if deadline_ms <= self.now_ms {
            self.due_deadline_min_ms = self.due_deadline_min_ms.min(deadline_ms);
            push_back(&mut self.nodes, &mut self.due, index);
            self.nodes[index as usize].level = LEVEL_DUE;
        } else {
            let tick = self.tick_of(deadline_ms);
            self.place(index, tick);
        }
        self.len += 1;
        TimerId {
            index,
            generation: self.nodes[index as usize].generation,
        }
    }

    /// Removes a pending timer and gives its value back, in O(1) wherever it has
    /// cascaded to. `None` if `id` is unknown, already expired or already cancelled.
    pub fn cancel(&mut self, id: TimerId) -> Option<T> {
        let node = self.nodes.get(id.index as usize)?;
        if node.generation != id.generation || node.level == LEVEL_FREE {
            return None;
        }
        let (level, slot) = (node.level, node.slot as usize);
        if level == LEVEL_DUE {
            unlink(&mut self.nodes, &mut self.due, id.index);
        } else {
            let level = &mut self.levels[level as usize];
            unlink(&mut self.nodes, &mut level.slots[slot], id.index);
            if level.slots[slot].is_empty() {
                level.occupied &= !(1 << slot);
            }
        }
        self.len -= 1;
        Some(self.release(id.index))
    }

    /// Moves the wheel's time forward to `now_ms` and appends to `expired` every timer
    /// that is due by then (see the module's guarantees: never early, late by less than a
    /// tick, ordered by tick). A `now_ms` before the wheel's time does not move it.
    ///
    /// Appends at most [`len`](Self::len) entries; `expired` is not cleared, so one
    /// buffer can be reused across calls.
    pub fn advance(&mut self, now_ms: u64, expired: &mut Vec<(TimerId, T)>) {
        if !self.due.is_empty() {
            self.expire_due(now_ms, expired);
        }
        if now_ms <= self.now_ms {
            return;
        }
        self.now_ms = now_ms;
        // `u64::MAX` is the one time whose tick must round up: a deadline in the last,
        // partial tick could otherwise never be reached.
        let tick_target = if now_ms == u64::MAX {
            self.tick_of(now_ms)
        } else {
            now_ms / self.tick_ms
        };
        while let Some((level, slot, tick_start)) = self.next_bucket() {
            if tick_start > tick_target {
                break;
            }
            // Entering the bucket's span: everything in it either fires now (its tick is
            // the span's first) or moves to a lower level relative to the new time.
            self.elapsed_tick = tick_start;
            let bucket = mem::replace(&mut self.levels[level].slots[slot], List::EMPTY);
            self.levels[level].occupied &= !(1 << slot);
            let mut cursor = bucket.head;
            while cursor != NIL {
                let node = &self.nodes[cursor as usize];
                let next = node.next;
                let tick = self.tick_of(node.deadline_ms);
                debug_assert!(tick >= tick_start, "a timer was left behind by a cascade");
                if tick == tick_start {
                    let id = TimerId {
                        index: cursor,
                        generation: node.generation,
                    };
                    self.len -= 1;
                    expired.push((id, self.release(cursor)));
                } else {
                    self.place(cursor, tick);
                }
                cursor = next;
            }
        }
        self.elapsed_tick = tick_target;
    }

    /// A time before which no [`advance`](Self::advance) expires anything, so an idle
    /// actor can sleep until then; `None` when no timer is pending.
    ///
    /// It is at most the earliest time a pending timer expires (its deadline rounded up
    /// to the tick, or the deadline itself for a timer already due when inserted), so
    /// with a 1 ms tick it is at most the earliest deadline. It is exact when that timer
    /// is on level 0 (within 64 ticks of the wheel's time) or already due; otherwise it
    /// is the start of the higher-level bucket holding the timer, where the timer
    /// cascades down: an actor that sleeps until the hint wakes early at most once per
    /// level, and never spins, since the hint of a pending wheel timer is always after
    /// the wheel's time. A value at or before the wheel's time means "advance now".
    pub fn next_deadline_hint(&self) -> Option<u64> {
        let due = (!self.due.is_empty()).then_some(self.due_deadline_min_ms);
        let wheel = self
            .next_bucket()
            .map(|(_, _, tick_start)| tick_start.saturating_mul(self.tick_ms));
        match (due, wheel) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// The tick a deadline fires on: rounded up, so it is never before the deadline.
    fn tick_of(&self, deadline_ms: u64) -> u64 {
        deadline_ms.div_ceil(self.tick_ms)
    }

    /// The first non-empty bucket as `(level, slot, first tick of its span)`. Every timer
    /// on a level is later than every timer on the levels below, and within a level the
    /// occupied buckets are all after the current one, so the lowest set bit of the
    /// lowest non-empty level is the next event.
    fn next_bucket(&self) -> Option<(usize, usize, u64)> {
        for (level, lvl) in self.levels.iter().enumerate() {
            if lvl.occupied == 0 {
                continue;
            }
            let slot = lvl.occupied.trailing_zeros();
            let shift = level as u32 * SLOT_BITS;
            let span_bits = shift + SLOT_BITS;
            let above = if span_bits >= u64::BITS {
                0
            } else {
                self.elapsed_tick >> span_bits << span_bits
            };
            let tick_start = above | (u64::from(slot) << shift);
            debug_assert!(
                tick_start > self.elapsed_tick,
                "occupied bucket in the past"
            );
            return Some((level, slot as usize, tick_start));
        }
        None
    }

    /// Links a node into the bucket for `tick`, which must be after `elapsed_tick`.
    fn place(&mut self, index: u32, tick: u64) {
        debug_assert!(tick > self.elapsed_tick, "placing a timer in the past");
        // The highest differing 6-bit digit names the level; `| (SLOTS - 1)` makes a
        // difference inside the current 64 ticks level 0.
        let differing = (self.elapsed_tick ^ tick) | (SLOTS as u64 - 1);
        let level = (u64::BITS - 1 - differing.leading_zeros()) / SLOT_BITS;
        let slot = (tick >> (level * SLOT_BITS)) as usize & (SLOTS - 1);
        let lvl = &mut self.levels[level as usize];
        push_back(&mut self.nodes, &mut lvl.slots[slot], index);
        lvl.occupied |= 1 << slot;
        let node = &mut self.nodes[index as usize];
        node.level = level as u8;
        node.slot = slot as u8;
    }

    /// Releases the due-list timers with `deadline_ms <= now_ms`. Normally all of them;
    /// only an `advance` back in time leaves some.
    fn expire_due(&mut self, now_ms: u64, expired: &mut Vec<(TimerId, T)>) {
        let list = mem::replace(&mut self.due, List::EMPTY);
        let mut deadline_min_ms = u64::MAX;
        let mut cursor = list.head;
        while cursor != NIL {
            let node = &self.nodes[cursor as usize];
            let next = node.next;
            if node.deadline_ms <= now_ms {
                let id = TimerId {
                    index: cursor,
                    generation: node.generation,
                };
                self.len -= 1;
                expired.push((id, self.release(cursor)));
            } else {
                deadline_min_ms = deadline_min_ms.min(node.deadline_ms);
                push_back(&mut self.nodes, &mut self.due, cursor);
            }
            cursor = next;
        }
        self.due_deadline_min_ms = deadline_min_ms;
    }

    /// A node for a new timer: a freed one if any, so a warm wheel allocates nothing.
    fn alloc(&mut self, deadline_ms: u64, value: T) -> u32 {
        if self.free_head != NIL {
            let index = self.free_head;
            let node = &mut self.nodes[index as usize];
            self.free_head = node.next;
            node.deadline_ms = deadline_ms;
            node.value = Some(value);
            return index;
        }
        assert!(
            self.nodes.len() < TIMERS_MAX,
            "timing wheel full: {TIMERS_MAX} timers pending"
        );
        let index = self.nodes.len() as u32;
        self.nodes.push(Node {
            deadline_ms,
            value: Some(value),
            prev: NIL,
            next: NIL,
            generation: 0,
            level: LEVEL_FREE,
            slot: 0,
        });
        index
    }

    /// Returns an unlinked node to the free list and hands back its value.
    fn release(&mut self, index: u32) -> T {
        let node = &mut self.nodes[index as usize];
        node.generation = node.generation.wrapping_add(1);
        node.level = LEVEL_FREE;
        node.prev = NIL;
        node.next = self.free_head;
        self.free_head = index;
        node.value
            .take()
            .expect("invariant: a linked timer node holds its value")
    }
}

impl<T> fmt::Debug for TimingWheel<T> {
    /// A summary: the nodes themselves could be millions.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TimingWheel")
            .field("tick_ms", &self.tick_ms)
            .field("now_ms", &self.now_ms)
            .field("len", &self.len)
            .field("next_deadline_hint", &self.next_deadline_hint())
            .finish()
    }
}

/// Appends `index` to `list`.
fn push_back<T>(nodes: &mut [Node<T>], list: &mut List, index: u32) {
    let node = &mut nodes[index as usize];
    node.prev = list.tail;
    node.next = NIL;
    if list.tail == NIL {
        list.head = index;
    } else {
        nodes[list.tail as usize].next = index;
    }
    list.tail = index;
}

/// Removes `index` from `list`, which holds it.
fn unlink<T>(nodes: &mut [Node<T>], list: &mut List, index: u32) {
    let node = &nodes[index as usize];
    let (prev, next) = (node.prev, node.next);
    if prev == NIL {
        list.head = next;
    } else {
        nodes[prev as usize].next = next;
    }
    if next == NIL {
        list.tail = prev;
    } else {
        nodes[next as usize].prev = prev;
    }
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, HashSet};

    use proptest::prelude::*;

    use super::*;

    /// 2023-11-14, so tests run at realistic epoch-millisecond magnitudes.
    const EPOCH_NOW_MS: u64 = 1_700_000_000_000;
    const YEAR_MS: u64 = 365 * 24 * 3_600 * 1_000;

    fn advance_values(wheel: &mut TimingWheel<u64>, now_ms: u64) -> Vec<u64> {
        let mut expired = Vec::new();
        wheel.advance(now_ms, &mut expired);
        expired.into_iter().map(|(_, value)| value).collect()
    }

    /// Asserts the one timer at `deadline_ms` is still pending one ms before and fires
    /// exactly at it.
    fn assert_fires_exactly_at(wheel: &mut TimingWheel<u64>, deadline_ms: u64, value: u64) {
        assert_eq!(
            advance_values(wheel, deadline_ms - 1),
            Vec::<u64>::new(),
            "fired before deadline {deadline_ms}"
        );
        assert_eq!(
            advance_values(wheel, deadline_ms),
            vec![value],
            "did not fire at deadline {deadline_ms}"
        );
        assert!(wheel.is_empty());
    }

    #[test]
    fn node_for_u64_payload_is_40_bytes() {
        assert_eq!(mem::size_of::<Node<u64>>(), 40);
        assert_eq!(mem::size_of::<TimerId>(), 8);
    }

    #[test]
    fn deadline_equal_to_now_fires_on_next_advance_without_time_moving() {
        let mut wheel = TimingWheel::new(1, EPOCH_NOW_MS);
        wheel.insert(EPOCH_NOW_MS, 7);
        assert_eq!(wheel.next_deadline_hint(), Some(EPOCH_NOW_MS));
        assert_eq!(advance_values(&mut wheel, EPOCH_NOW_MS), vec![7]);
        assert!(wheel.is_empty());
    }

    #[test]
    fn deadline_in_the_past_fires_on_next_advance() {
        let mut wheel = TimingWheel::new(1, EPOCH_NOW_MS);
        wheel.insert(EPOCH_NOW_MS - 5_000, 1);
        wheel.insert(0, 2);
        assert_eq!(advance_values(&mut wheel, EPOCH_NOW_MS + 1), vec![1, 2]);
    }

    #[test]
    fn deadline_one_tick_ahead_waits_for_it() {
        let mut wheel = TimingWheel::new(1, EPOCH_NOW_MS);
        wheel.insert(EPOCH_NOW_MS + 1, 1);
        assert_eq!(advance_values(&mut wheel, EPOCH_NOW_MS), Vec::<u64>::new());
        assert_eq!(advance_values(&mut wheel, EPOCH_NOW_MS + 1), vec![1]);
    }

    #[test]
    fn deadline_within_current_coarse_tick_rounds_up_never_early() {
        // Time 1005 is inside tick [1000, 1010): 1008 is in the future, so it rounds up
        // to 1010; 1003 has passed, so it is due at once.
        let mut wheel = TimingWheel::new(10, 1_005);
        wheel.insert(1_008, 8);
        wheel.insert(1_003, 3);
        assert_eq!(advance_values(&mut wheel, 1_005), vec![3]);
        assert_eq!(advance_values(&mut wheel, 1_008), Vec::<u64>::new());
        assert_eq!(advance_values(&mut wheel, 1_009), Vec::<u64>::new());
        assert_eq!(advance_values(&mut wheel, 1_010), vec![8]);
    }

    #[test]
    fn coarse_tick_fires_at_deadline_rounded_up_and_never_before() {
        for tick_ms in [2, 7, 10] {
            let start_ms = EPOCH_NOW_MS + 3;
            for offset_ms in 1..=(3 * tick_ms) {
                let deadline_ms = start_ms + offset_ms;
                let fire_ms = deadline_ms.div_ceil(tick_ms) * tick_ms;
                let mut wheel = TimingWheel::new(tick_ms, start_ms);
                wheel.insert(deadline_ms, 1);
                for now_ms in start_ms..fire_ms {
                    assert_eq!(
                        advance_values(&mut wheel, now_ms),
                        Vec::<u64>::new(),
                        "tick {tick_ms}: deadline {deadline_ms} fired at {now_ms}"
                    );
                }
                assert_eq!(wheel.next_deadline_hint(), Some(fire_ms));
                assert_eq!(advance_values(&mut wheel, fire_ms), vec![1]);
            }
        }
    }

    #[test]
    fn one_level_span_and_one_tick_either_side_fire_exactly() {
        let starts_ms = [
            0,
            1,
            63,
            64 * 64 - 1,
            12_345_678,
            (1 << 36) - 1,
            (1 << 60) - 1,
            EPOCH_NOW_MS,
        ];
        for start_ms in starts_ms {
            for level in 1..=7u32 {
                let span_ticks = 1u64 << (SLOT_BITS * level);
                // 1: from `2^(6k) - 1` the next tick crosses every level's boundary.
                for delta in [1, span_ticks - 1, span_ticks, span_ticks + 1] {
                    let mut wheel = TimingWheel::new(1, start_ms);
                    let deadline_ms = start_ms + delta;
                    wheel.insert(deadline_ms, delta);
                    assert_fires_exactly_at(&mut wheel, deadline_ms, delta);
                }
            }
        }
    }

    #[test]
    fn span_boundaries_in_one_wheel_fire_in_deadline_order() {
        let mut wheel = TimingWheel::new(1, EPOCH_NOW_MS);
        let mut deadlines_ms = Vec::new();
        for level in 1..=5u32 {
            let span_ticks = 1u64 << (SLOT_BITS * level);
            for delta in [span_ticks + 1, span_ticks, span_ticks - 1] {
                deadlines_ms.push(EPOCH_NOW_MS + delta);
                wheel.insert(EPOCH_NOW_MS + delta, EPOCH_NOW_MS + delta);
            }
        }
        deadlines_ms.sort_unstable();
        let mut fired = Vec::new();
        for &deadline_ms in &deadlines_ms {
            let mut expired = Vec::new();
            wheel.advance(deadline_ms - 1, &mut expired);
            assert!(expired.is_empty(), "fired before {deadline_ms}");
            fired.extend(advance_values(&mut wheel, deadline_ms));
        }
        assert_eq!(fired, deadlines_ms);
        assert!(wheel.is_empty());
    }

    #[test]
    fn far_future_beyond_six_levels_fires_exactly() {
        for delta_ms in [3 * YEAR_MS, 1 << 36, (1 << 36) + 1, 1 << 40, 500 * YEAR_MS] {
            let mut wheel = TimingWheel::new(1, EPOCH_NOW_MS);
            let deadline_ms = EPOCH_NOW_MS + delta_ms;
            wheel.insert(deadline_ms, 9);
            assert!(wheel.next_deadline_hint().is_some_and(|h| h <= deadline_ms));
            assert_fires_exactly_at(&mut wheel, deadline_ms, 9);
        }
    }

    #[test]
    fn largest_deadline_fires_at_largest_time_with_any_tick() {
        for tick_ms in [1, 10, 7] {
            let mut wheel = TimingWheel::new(tick_ms, EPOCH_NOW_MS);
            wheel.insert(u64::MAX, 1);
            wheel.insert(u64::MAX - 1, 2);
            assert_eq!(advance_values(&mut wheel, u64::MAX - 2), Vec::<u64>::new());
            let mut fired = advance_values(&mut wheel, u64::MAX);
            fired.sort_unstable();
            assert_eq!(fired, vec![1, 2]);
            // Past the end of time, every deadline is due.
            wheel.insert(u64::MAX, 3);
            assert_eq!(advance_values(&mut wheel, u64::MAX), vec![3]);
        }
    }

    #[test]
    fn cancel_before_cascade_returns_value_and_timer_never_fires() {
        let mut wheel = TimingWheel::new(1, EPOCH_NOW_MS);
        let id = wheel.insert(EPOCH_NOW_MS + 100_000, 5);
        assert_eq!(wheel.nodes[id.index as usize].level, 2);
        assert_eq!(wheel.cancel(id), Some(5));
        assert_eq!(wheel.cancel(id), None);
        assert!(wheel.is_empty());
        assert_eq!(wheel.next_deadline_hint(), None);
        assert_eq!(
            advance_values(&mut wheel, EPOCH_NOW_MS + 200_000),
            Vec::<u64>::new()
        );
    }

    #[test]
    fn cancel_after_cascade_to_level_zero_returns_value_and_timer_never_fires() {
        let mut wheel = TimingWheel::new(1, EPOCH_NOW_MS);
        let deadline_ms = EPOCH_NOW_MS + 100_000;
        let id = wheel.insert(deadline_ms, 5);
        let other = wheel.insert(deadline_ms, 6);
        assert_eq!(
            advance_values(&mut wheel, deadline_ms - 1),
            Vec::<u64>::new()
        );
        assert_eq!(wheel.nodes[id.index as usize].level, 0, "not cascaded");
        assert_eq!(wheel.next_deadline_hint(), Some(deadline_ms));
        assert_eq!(wheel.cancel(id), Some(5));
        assert_eq!(advance_values(&mut wheel, deadline_ms), vec![6]);
        assert_eq!(wheel.cancel(other), None, "expired timer cancelled");
    }

    #[test]
    fn cancel_of_already_due_timer_returns_value() {
        let mut wheel = TimingWheel::new(1, EPOCH_NOW_MS);
        let id = wheel.insert(EPOCH_NOW_MS - 1, 5);
        wheel.insert(EPOCH_NOW_MS - 2, 6);
        assert_eq!(wheel.cancel(id), Some(5));
        assert_eq!(advance_values(&mut wheel, EPOCH_NOW_MS), vec![6]);
    }

    #[test]
    fn stale_id_is_rejected_after_its_slot_is_reused() {
        let mut wheel = TimingWheel::new(1, EPOCH_NOW_MS);
        let first = wheel.insert(EPOCH_NOW_MS + 10, 1);
        assert_eq!(wheel.cancel(first), Some(1));
        let second = wheel.insert(EPOCH_NOW_MS + 10, 2);
        assert_eq!(first.index, second.index, "slot not reused");
        assert_ne!(first, second);
        assert_eq!(wheel.cancel(first), None);
        assert_eq!(wheel.len(), 1);
        // An id that expired is stale too, once its slot holds another timer.
        let mut expired = Vec::new();
        wheel.advance(EPOCH_NOW_MS + 10, &mut expired);
        assert_eq!(expired, vec![(second, 2)]);
        let third = wheel.insert(EPOCH_NOW_MS + 20, 3);
        assert_eq!(third.index, second.index);
        assert_eq!(wheel.cancel(second), None);
        assert_eq!(wheel.cancel(third), Some(3));
    }

    #[test]
    fn unknown_id_is_rejected() {
        let mut wheel: TimingWheel<u64> = TimingWheel::new(1, EPOCH_NOW_MS);
        let made_up = TimerId {
            index: 3,
            generation: 0,
        };
        assert_eq!(wheel.cancel(made_up), None);
    }

    #[test]
    fn advance_backwards_does_not_move_time() {
        let mut wheel = TimingWheel::new(1, 2_000);
        wheel.insert(2_500, 1);
        assert_eq!(advance_values(&mut wheel, 1_000), Vec::<u64>::new());
        assert_eq!(wheel.now_ms(), 2_000);
        // A timer inserted in the wheel's past waits for a `now` that reaches it.
        wheel.insert(1_500, 2);
        assert_eq!(advance_values(&mut wheel, 1_400), Vec::<u64>::new());
        assert_eq!(advance_values(&mut wheel, 1_500), vec![2]);
        assert_eq!(wheel.now_ms(), 2_000);
        assert_eq!(advance_values(&mut wheel, 2_499), Vec::<u64>::new());
        assert_eq!(advance_values(&mut wheel, 2_500), vec![1]);
    }

    #[test]
    fn idle_jump_of_a_year_fires_due_timers_and_keeps_later_ones() {
        let mut wheel = TimingWheel::new(1, EPOCH_NOW_MS);
        wheel.insert(EPOCH_NOW_MS + 1, 1);
        wheel.insert(EPOCH_NOW_MS + 200 * 24 * 3_600 * 1_000, 2);
        wheel.insert(EPOCH_NOW_MS + YEAR_MS, 3);
        wheel.insert(EPOCH_NOW_MS + YEAR_MS + 1, 4);
        wheel.insert(EPOCH_NOW_MS + 2 * YEAR_MS, 5);
        assert_eq!(
            advance_values(&mut wheel, EPOCH_NOW_MS + YEAR_MS),
            vec![1, 2, 3]
        );
        assert_eq!(wheel.len(), 2);
        // The wheel is consistent after the jump: near timers still fire exactly.
        wheel.insert(EPOCH_NOW_MS + YEAR_MS + 1, 6);
        assert_eq!(wheel.next_deadline_hint(), Some(EPOCH_NOW_MS + YEAR_MS + 1));
        assert_eq!(
            advance_values(&mut wheel, EPOCH_NOW_MS + YEAR_MS + 1),
            vec![4, 6]
        );
        assert_fires_exactly_at(&mut wheel, EPOCH_NOW_MS + 2 * YEAR_MS, 5);
    }

    #[test]
    fn one_advance_orders_by_deadline_then_insertion() {
        let mut wheel = TimingWheel::new(1, EPOCH_NOW_MS);
        for (delta_ms, value) in [(5_000, 50), (3, 30), (70_000, 70), (3, 31), (1, 10)] {
            wheel.insert(EPOCH_NOW_MS + delta_ms, value);
        }
        assert_eq!(
            advance_values(&mut wheel, EPOCH_NOW_MS + 100_000),
            vec![10, 30, 31, 50, 70]
        );
    }

    #[test]
    fn hint_is_exact_near_and_a_lower_bound_far() {
        let mut wheel = TimingWheel::new(1, EPOCH_NOW_MS);
        assert_eq!(wheel.next_deadline_hint(), None);
        let far_ms = EPOCH_NOW_MS + 600_000;
        wheel.insert(far_ms, 1);
        let hint_ms = wheel.next_deadline_hint().expect("pending timer");
        assert!(hint_ms > EPOCH_NOW_MS && hint_ms <= far_ms);
        wheel.insert(EPOCH_NOW_MS + 40, 2);
        assert_eq!(wheel.next_deadline_hint(), Some(EPOCH_NOW_MS + 40));
        wheel.insert(EPOCH_NOW_MS - 3, 3);
        assert_eq!(wheel.next_deadline_hint(), Some(EPOCH_NOW_MS - 3));
        // Sleeping until each hint reaches the far timer in at most a few wake-ups.
        let mut fired = Vec::new();
        let mut wakes = 0;
        while let Some(hint_ms) = wheel.next_deadline_hint() {
            wakes += 1;
            assert!(wakes <= 2 + LEVELS, "spinning on the hint");
            let now_ms = hint_ms.max(wheel.now_ms());
            fired.extend(advance_values(&mut wheel, now_ms));
        }
        assert_eq!(fired, vec![3, 2, 1]);
        assert_eq!(wheel.now_ms(), far_ms);
    }

    #[test]
    fn warm_wheel_reuses_nodes_without_growing() {
        let mut wheel = TimingWheel::new(1, EPOCH_NOW_MS);
        let ids: Vec<_> = (0..1_000)
            .map(|i| wheel.insert(EPOCH_NOW_MS + i, i))
            .collect();
        let capacity = wheel.nodes.capacity();
        for id in ids {
            assert!(wheel.cancel(id).is_some());
        }
        for i in 0..1_000 {
            wheel.insert(EPOCH_NOW_MS + 5 + i * 1_000, i);
        }
        assert_eq!(wheel.nodes.capacity(), capacity);
        assert_eq!(wheel.len(), 1_000);
    }

    /// What a random sequence does to the wheel and to the model.
    #[derive(Debug, Clone)]
    enum Step {
        /// A deadline `magnitude_ms` after (or, if `past`, before) the model's time.
        Insert { past: bool, magnitude_ms: u64 },
        /// Cancels the `pick`-th id ever issued (modulo), pending or not.
        Cancel { pick: usize },
        /// Moves to `magnitude_ms` after (or, if `back`, before) the model's time.
        Advance { back: bool, magnitude_ms: u64 },
    }

    /// Distances across every level: mostly within a few levels, sometimes years, now
    /// and then up to the end of `u64`.
    fn magnitude_ms() -> impl Strategy<Value = u64> {
        let bits = prop_oneof![
            8 => 0u32..=24,
            3 => 25u32..=45,
            1 => 46u32..=64,
        ];
        (bits, any::<u64>()).prop_map(|(bits, random)| match bits {
            0 => 0,
            _ => random >> (64 - bits),
        })
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            4 => (prop::bool::weighted(0.1), magnitude_ms())
                .prop_map(|(past, magnitude_ms)| Step::Insert { past, magnitude_ms }),
            2 => any::<usize>().prop_map(|pick| Step::Cancel { pick }),
            3 => (prop::bool::weighted(0.1), magnitude_ms())
                .prop_map(|(back, magnitude_ms)| Step::Advance { back, magnitude_ms }),
        ]
    }

    /// The specification, with no cleverness: a timer fires at the first advance whose
    /// `now` reaches its deadline rounded up to the tick, or, if it was already due when
    /// inserted, its deadline; `advance(u64::MAX)` fires everything.
    struct Model {
        tick_ms: u64,
        now_ms: u64,
        /// Pending timers by value (each value unique): id, deadline, due at insert.
        pending: BTreeMap<u64, (TimerId, u64, bool)>,
    }

    impl Model {
        /// The earliest `now` at which the timer fires, in u128 so rounding up the
        /// deadlines near `u64::MAX` cannot overflow.
        fn fire_ms(&self, deadline_ms: u64, due_at_insert: bool) -> u128 {
            if due_at_insert {
                u128::from(deadline_ms)
            } else {
                u128::from(deadline_ms.div_ceil(self.tick_ms)) * u128::from(self.tick_ms)
            }
        }

        fn fires_at(&self, now_ms: u64, deadline_ms: u64, due_at_insert: bool) -> bool {
            now_ms == u64::MAX || self.fire_ms(deadline_ms, due_at_insert) <= u128::from(now_ms)
        }
    }

    fn run_against_model(tick_ms: u64, start_ms: u64, steps: &[Step]) -> Result<(), TestCaseError> {
        let mut wheel = TimingWheel::new(tick_ms, start_ms);
        let mut model = Model {
            tick_ms,
            now_ms: start_ms,
            pending: BTreeMap::new(),
        };
        // Every timer ever inserted, by value: id, deadline, due at insert.
        let mut issued: Vec<(TimerId, u64, bool)> = Vec::new();
        let mut issued_ids = HashSet::new();
        let mut expired = Vec::new();
        for step in steps {
            match *step {
                Step::Insert { past, magnitude_ms } => {
                    let deadline_ms = if past {
                        model.now_ms.saturating_sub(magnitude_ms)
                    } else {
                        model.now_ms.saturating_add(magnitude_ms)
                    };
                    let value = issued.len() as u64;
                    let id = wheel.insert(deadline_ms, value);
                    prop_assert!(issued_ids.insert(id), "id {id:?} issued twice");
                    let due = deadline_ms <= model.now_ms;
                    model.pending.insert(value, (id, deadline_ms, due));
                    issued.push((id, deadline_ms, due));
                }
                Step::Cancel { pick } => {
                    if issued.is_empty() {
                        continue;
                    }
                    let value = pick % issued.len();
                    let (id, _, _) = issued[value];
                    let value = value as u64;
                    let expected = model.pending.remove(&value).map(|_| value);
                    prop_assert_eq!(wheel.cancel(id), expected);
                }
                Step::Advance { back, magnitude_ms } => {
                    let now_ms = if back {
                        model.now_ms.saturating_sub(magnitude_ms)
                    } else {
                        model.now_ms.saturating_add(magnitude_ms)
                    };
                    expired.clear();
                    wheel.advance(now_ms, &mut expired);
                    let mut want: Vec<u64> = model
                        .pending
                        .iter()
                        .filter(|(_, &(_, d, due))| model.fires_at(now_ms, d, due))
                        .map(|(&value, _)| value)
                        .collect();
                    for value in &want {
                        model.pending.remove(value);
                    }
                    model.now_ms = model.now_ms.max(now_ms);
                    let mut got: Vec<u64> = Vec::with_capacity(expired.len());
                    // Order: already-due timers first, then non-decreasing ticks.
                    let mut wheel_part = false;
                    let mut tick_last = 0;
                    for &(id, value) in &expired {
                        let (issued_id, deadline_ms, due) = issued[value as usize];
                        prop_assert_eq!(id, issued_id);
                        if due {
                            prop_assert!(!wheel_part, "already-due timer after a wheel timer");
                        } else {
                            let tick = deadline_ms.div_ceil(tick_ms);
                            prop_assert!(tick >= tick_last, "ticks out of order");
                            wheel_part = true;
                            tick_last = tick;
                        }
                        got.push(value);
                    }
                    got.sort_unstable();
                    want.sort_unstable();
                    prop_assert_eq!(got, want, "advance to {} from {}", now_ms, model.now_ms);
                }
            }
            prop_assert_eq!(wheel.len(), model.pending.len());
            let fire_min_ms = model
                .pending
                .values()
                .map(|&(_, d, due)| model.fire_ms(d, due))
                .min();
            match (wheel.next_deadline_hint(), fire_min_ms) {
                (None, None) => {}
                (Some(hint_ms), Some(fire_ms)) => {
                    prop_assert!(u128::from(hint_ms) <= fire_ms.min(u128::from(u64::MAX)));
                }
                (hint, fire) => prop_assert!(false, "hint {:?} for earliest {:?}", hint, fire),
            }
        }
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        #[test]
        fn wheel_matches_btreemap_model(
            tick_ms in prop_oneof![Just(1u64), Just(10u64), 1u64..=20],
            start_ms in 0u64..(1 << 42),
            steps in prop::collection::vec(step(), 1..300),
        ) {
            run_against_model(tick_ms, start_ms, &steps)?;
        }
    }
}
