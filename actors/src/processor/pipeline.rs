//! The way work goes through a shard: its priority mailbox, the batch waiting for
//! journal reads, work parked while a partition's new epoch waits for the old one's
//! batches, the batches in flight to the journal (and one the journal had no room for),
//! and who waits for all of it to be durable.
//!
//! A part of its own because its bounds tie these together: at most
//! [`BATCHES_IN_FLIGHT_MAX`] batches in flight, retired in the order they were sent;
//! nothing new drained while a batch is held back, parked or reading.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use prometheus::IntGauge;
use tokio::sync::oneshot;

use crate::mailbox::{PriorityMailbox, Work};
use crate::types::{Entry, ItemState, ItemView, LogPos, Outcome, Status};

use super::items::ItemKey;
use super::{SaleKey, BATCHES_IN_FLIGHT_MAX};

/// A request whose key already has an outcome: it is answered with that outcome, once
/// the batches before it are durable, and applied no more.
pub(super) struct Repeat {
    pub(super) origin: Option<u32>,
    /// `None`: nobody is answered, only the log position is reported journaled.
    pub(super) outcome: Option<Arc<Outcome>>,
    pub(super) pos: Option<LogPos>,
}

/// Where a load chunk's item states go, in the caller's order (index, state).
pub(super) type LoadReply = oneshot::Sender<LoadViews>;
/// A load chunk's items: (index, state, `Ok` or `SeqMoved`).
pub(super) type LoadViews = Vec<(usize, ItemView, Status)>;

/// What a batch leaves to do once it is durable.
pub(super) struct BatchInFlight {
    /// This shard's number for the batch: the journal answers each append with it, so a
    /// failed append retires its own bookkeeping, not another batch's.
    pub(super) id: u64,
    /// State of each item the batch touched, as of the end of the batch.
    pub(super) states: Vec<(Arc<str>, Arc<str>, ItemState)>,
    pub(super) loads: Vec<(LoadReply, LoadViews)>,
    pub(super) weight: usize,
    pub(super) repeats: Vec<Repeat>,
    /// Keys of this batch in the cluster screen's unjournaled outcomes (a shared log only).
    pub(super) keys: Vec<ItemKey>,
    /// Holds this batch ended, in the hold book's endings.
    pub(super) ended: Vec<ItemKey>,
    /// Sales (by shop and key) with an `ok` return in this batch, once per return, in
    /// the returns in flight, with the return's log position (a fenced one was not
    /// written).
    pub(super) returns: Vec<(SaleKey, Option<LogPos>)>,
}

pub(super) struct Pipeline {
    mailbox: PriorityMailbox,
    /// Batches sent to the journal and not yet answered, oldest first; at most
    /// [`BATCHES_IN_FLIGHT_MAX`].
    in_flight: VecDeque<BatchInFlight>,
    /// The id the next batch gets.
    next_batch_id: u64,
    drain_scheduled: bool,
    /// Where the journal puts a batch back when its queue has no room
    /// ([`crate::ports::StoreError::Full`], reported before `append` returns).
    bounced: Arc<Mutex<Option<Vec<Entry>>>>,
    /// A batch the journal had no room for, sent again before any batch after it, so
    /// the journal keeps each item's entries in sequence order. Nothing new is sent
    /// while it waits: that is the back-pressure.
    held_back: Option<(u64, Vec<Entry>)>,
    /// Work taken from the mailbox that carries a partition's new epoch while batches
    /// are in flight: it waits until they are all durable or fenced, so that the items
    /// read again under the new epoch are read with nothing of the old one pending.
    parked: Option<Vec<Work>>,
    /// A batch waiting for journal reads made off the actor's thread (see `reads`):
    /// nothing after it is drained until it is applied, and no item leaves memory
    /// meanwhile.
    reading: Option<Vec<Work>>,
    /// Who waits for everything queued so far to be durable ([`super::Flush`]).
    flush_waiters: Vec<oneshot::Sender<()>>,
    /// This shard's `nrtxn_queue_depth`.
    depth_gauge: IntGauge,
}

impl Pipeline {
    pub(super) fn new(depth_gauge: IntGauge) -> Pipeline {
        Pipeline {
            mailbox: PriorityMailbox::default(),
            in_flight: VecDeque::new(),
            next_batch_id: 0,
            drain_scheduled: false,
            bounced: Arc::default(),
            held_back: None,
            parked: None,
            reading: None,
            flush_waiters: Vec::new(),
            depth_gauge,
        }
    }

    pub(super) fn push(&mut self, work: Work) {
        self.mailbox.push(work);
    }

    /// Whether a drain should be scheduled now: there is work it can take and room to
    /// send it. If so, it counts as scheduled until [`Pipeline::drain_started`].
    pub(super) fn wants_drain(&mut self) -> bool {
        let wants = !self.drain_scheduled
            && self.can_send()
            && (!self.mailbox.is_empty() || (self.parked.is_some() && self.in_flight.is_empty()));
        if wants {
            self.drain_scheduled = true;
        }
        wants
    }

    pub(super) fn drain_started(&mut self) {
        self.drain_scheduled = false;
    }

    /// Whether a new batch may be made and sent: none is held back or reading, and
    /// fewer than [`BATCHES_IN_FLIGHT_MAX`] are in flight.
    pub(super) fn can_send(&self) -> bool {
        self.reading.is_none()
            && self.held_back.is_none()
            && self.in_flight.len() < BATCHES_IN_FLIGHT_MAX
    }

    /// The next batch's work: the parked work once nothing is in flight, else up to
    /// `weight_max` from the mailbox. `None` when there is none to take now.
    pub(super) fn next_works(&mut self, weight_max: usize) -> Option<Vec<Work>> {
        match self.parked.take() {
            Some(works) if self.in_flight.is_empty() => Some(works),
            Some(works) => {
                self.parked = Some(works);
                None
            }
            None if self.mailbox.is_empty() => None,
            None => Some(self.mailbox.drain(weight_max)),
        }
    }

    pub(super) fn in_flight_empty(&self) -> bool {
        self.in_flight.is_empty()
    }

    /// Parks work of a partition's new epoch until the batches in flight are retired.
    pub(super) fn park(&mut self, works: Vec<Work>) {
        debug_assert!(self.reading.is_none(), "parked while a batch reads");
        debug_assert!(
            !self.in_flight.is_empty(),
            "parked with nothing to wait for"
        );
        self.parked = Some(works);
    }

    pub(super) fn publish_depth(&self) {
        self.depth_gauge.set(self.mailbox.len() as i64);
    }

    pub(super) fn reading(&self) -> bool {
        self.reading.is_some()
    }

    /// A batch waits for journal reads.
    pub(super) fn start_reading(&mut self, works: Vec<Work>) {
        debug_assert!(self.parked.is_none(), "a batch reads while work is parked");
        let before = self.reading.replace(works);
        assert!(before.is_none(), "two batches waiting for reads");
    }

    pub(super) fn take_reading(&mut self) -> Option<Vec<Work>> {
        self.reading.take()
    }

    /// The id the next batch sent will get.
    pub(super) fn next_id(&self) -> u64 {
        self.next_batch_id
    }

    /// Numbers a batch and puts it in flight; its id.
    pub(super) fn send(&mut self, mut batch: BatchInFlight) -> u64 {
        batch.id = self.next_batch_id;
        self.next_batch_id += 1;
        // `can_send` was true when the batch was drained, and only retiring changed
        // `in_flight` since.
        assert!(
            self.in_flight.len() < BATCHES_IN_FLIGHT_MAX,
            "a batch sent with {} in flight",
            self.in_flight.len()
        );
        let id = batch.id;
        self.in_flight.push_back(batch);
        id
    }

    /// The newest batch in flight, which a batch of repeats only rides along with.
    pub(super) fn last_mut(&mut self) -> Option<&mut BatchInFlight> {
        self.in_flight.back_mut()
    }

    /// Takes out the oldest batch in flight, which the journal answered as `id`.
    pub(super) fn retire(&mut self, id: u64) -> Option<BatchInFlight> {
        let batch = self.in_flight.pop_front()?;
        // The journal completes one shard's appends in the order they were sent.
        assert_eq!(batch.id, id, "journal appends completed out of order");
        Some(batch)
    }

    /// Forgets batch `id`, which the closed journal did not write (shutdown).
    pub(super) fn drop_closed(&mut self, id: u64) {
        self.in_flight.retain(|b| b.id != id);
    }

    /// Where the journal puts back a batch it has no room for.
    pub(super) fn bounced(&self) -> Arc<Mutex<Option<Vec<Entry>>>> {
        self.bounced.clone()
    }

    /// The batch the journal just put back, if it did.
    pub(super) fn take_bounced(&self) -> Option<Vec<Entry>> {
        self.bounced.lock().ok().and_then(|mut slot| slot.take())
    }

    /// Holds back batch `id`, which the journal had no room for: the newest in flight.
    pub(super) fn hold_back(&mut self, id: u64, entries: Vec<Entry>) {
        assert_eq!(
            self.in_flight.back().map(|b| b.id),
            Some(id),
            "a batch held back that is not the newest in flight"
        );
        self.held_back = Some((id, entries));
    }

    /// Whether a batch waits to be sent again (the journal had no room for it).
    pub(super) fn holding_back(&self) -> bool {
        self.held_back.is_some()
    }

    pub(super) fn take_held_back(&mut self) -> Option<(u64, Vec<Entry>)> {
        self.held_back.take()
    }

    pub(super) fn add_flush_waiter(&mut self, waiter: oneshot::Sender<()>) {
        self.flush_waiters.push(waiter);
    }

    /// Answers those waiting for a flush once nothing is queued, parked, reading or in
    /// flight.
    pub(super) fn notify_flushed(&mut self) {
        if self.mailbox.is_empty()
            && self.in_flight.is_empty()
            && self.parked.is_none()
            && self.reading.is_none()
        {
            for w in self.flush_waiters.drain(..) {
                let _ = w.send(());
            }
        }
    }
}
