//! The processor's priority mailbox: two FIFO lanes, drained high lane first.
//!
//! Returns (increments), loads and the endings of holds (confirm, cancel, expiry) wait
//! in the high lane: stock that comes back must be
//! available to the decrements queued behind it, and an operator's load sets the stock
//! those decrements are judged against. Within a lane, arrival order is kept, so one
//! seller's decrements on an item are applied in the order they arrived.

use std::collections::VecDeque;
use std::sync::Arc;

use tokio::sync::oneshot;

use crate::types::{ItemView, LoadTerms, Op, Request, Status};

/// One item of a load call, bound for the shard that owns the item.
#[derive(Debug)]
pub struct LoadItem {
    pub item: Arc<str>,
    pub stock: i64,
    /// Apply only if the item's seq is still this (see [`Request::if_seq`]).
    pub if_seq: Option<u64>,
    /// The item's new per-buyer limit (see [`Request::per_buyer_max`]).
    pub per_buyer_max: Option<i64>,
    /// What the load does to the item's sale window and low-stock level.
    pub terms: LoadTerms,
    /// Position in the caller's list, so the answer keeps the caller's order.
    pub index: usize,
}

/// The part of one load call that falls on one shard. It is applied and journaled as a
/// unit (at most [`crate::types::LOAD_ITEMS_MAX`] entries), then answered.
#[derive(Debug)]
pub struct LoadChunk {
    pub shop: Arc<str>,
    pub items: Vec<LoadItem>,
    /// Each item's state after the chunk, with `Ok` or, for a conditional load whose
    /// item moved, [`Status::SeqMoved`] (the state it has).
    pub reply: oneshot::Sender<Vec<(usize, ItemView, Status)>>,
}

/// What waits in a shard's mailbox.
// Nearly every work is a request, and the mailbox's queues hold them by value: boxing
// the request would add an allocation per request to spare the rare loads' bytes.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub enum Work {
    Txn(Request),
    Load(LoadChunk),
}

impl Work {
    /// How many journal entries this work becomes; the unit of every bound.
    pub fn weight(&self) -> usize {
        match self {
            Work::Txn(_) => 1,
            Work::Load(chunk) => chunk.items.len(),
        }
    }
}

/// Two lanes. Bounded by the admission control in front of it (the WorkManagers' count
/// of requests in flight), not here: by the time work reaches a shard it was accepted
/// and must not be dropped.
#[derive(Debug, Default)]
pub struct PriorityMailbox {
    high: VecDeque<Work>,
    low: VecDeque<Work>,
    weight: usize,
}

impl PriorityMailbox {
    pub fn push(&mut self, work: Work) {
        self.weight += work.weight();
        let high = match &work {
            // Holds take stock like sales; endings of holds give it back (or sell what is
            // already set aside), and go first like returns, as do an operator's
            // adjustments, which say what the stock really is.
            Work::Txn(r) => !matches!(r.op, Op::Decrement | Op::Hold),
            Work::Load(_) => true,
        };
        if high {
            self.high.push_back(work);
        } else {
            self.low.push_back(work);
        }
    }

    /// Total weight waiting.
    pub fn len(&self) -> usize {
        self.weight
    }

    pub fn is_empty(&self) -> bool {
        self.weight == 0
    }

    /// Takes work up to `weight_max` entries, high lane first. A single load chunk
    /// heavier than the bound is taken alone, so the mailbox always makes progress.
    pub fn drain(&mut self, weight_max: usize) -> Vec<Work> {
        let mut out = Vec::new();
        let mut taken = 0;
        for lane in [&mut self.high, &mut self.low] {
            while let Some(front) = lane.front() {
                let w = front.weight();
                if taken > 0 && taken + w > weight_max {
                    break;
                }
                taken += w;
                out.extend(lane.pop_front());
                if taken >= weight_max {
                    break;
                }
            }
            if taken >= weight_max {
                break;
            }
        }
        self.weight -= taken;
        // Once per batch: a lane that held a burst's backlog gives its room back as it
        // drains (bounded by admission while full, not after; see `crate::shrink`).
        crate::shrink::queue(&mut self.high);
        crate::shrink::queue(&mut self.low);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::apply::{apply, apply_load};
    use crate::types::Status;
    use std::collections::HashMap;

    fn txn(key: &str, op: Op, qty: i64) -> Work {
        Work::Txn(Request::new("s".into(), "i".into(), key.into(), op, qty, 0))
    }

    fn keys(works: &[Work]) -> Vec<String> {
        works
            .iter()
            .map(|w| match w {
                Work::Txn(r) => r.key.to_string(),
                Work::Load(_) => "load".into(),
            })
            .collect()
    }

    #[test]
    fn increments_are_drained_before_waiting_decrements() {
        let mut mb = PriorityMailbox::default();
        mb.push(txn("d1", Op::Decrement, 1));
        mb.push(txn("d2", Op::Decrement, 1));
        mb.push(txn("i1", Op::Increment, 1));
        mb.push(txn("d3", Op::Decrement, 1));
        mb.push(txn("i2", Op::Increment, 1));
        assert_eq!(mb.len(), 5);
        assert_eq!(keys(&mb.drain(100)), ["i1", "i2", "d1", "d2", "d3"]);
        assert!(mb.is_empty());
    }

    #[test]
    fn returned_stock_serves_the_decrements_queued_before_it() {
        // Stock 0, a decrement waiting, then a return arrives: the return goes first,
        // so the decrement succeeds instead of failing on stock that was coming back.
        let mut items = HashMap::new();
        let item: Arc<str> = "i".into();
        apply_load(
            items.entry(item.clone()).or_default(),
            &"s".into(),
            &item,
            0,
            crate::types::LoadTerms::KEEP,
            0,
        );
        let mut mb = PriorityMailbox::default();
        mb.push(txn("sale", Op::Decrement, 2));
        mb.push(txn("return", Op::Increment, 2));
        let statuses: Vec<Status> = mb
            .drain(10)
            .into_iter()
            .map(|w| match w {
                Work::Txn(r) => apply(items.get_mut(&item), &r, 0, 1_000).status,
                Work::Load(_) => unreachable!(),
            })
            .collect();
        assert_eq!(statuses, [Status::Ok, Status::Ok]);
        assert_eq!(items[&item].stock, 0);
    }

    #[test]
    fn drain_respects_the_batch_bound_and_keeps_fifo_within_a_lane() {
        let mut mb = PriorityMailbox::default();
        for n in 0..10 {
            mb.push(txn(&format!("d{n}"), Op::Decrement, 1));
        }
        assert_eq!(keys(&mb.drain(4)), ["d0", "d1", "d2", "d3"]);
        assert_eq!(keys(&mb.drain(4)), ["d4", "d5", "d6", "d7"]);
        assert_eq!(keys(&mb.drain(4)), ["d8", "d9"]);
        assert!(mb.drain(4).is_empty());
    }

    #[test]
    fn a_load_heavier_than_the_bound_is_taken_alone() {
        let mut mb = PriorityMailbox::default();
        let (tx, _rx) = oneshot::channel();
        let items = (0..5)
            .map(|index| LoadItem {
                item: format!("i{index}").into(),
                stock: 1,
                if_seq: None,
                per_buyer_max: None,
                terms: LoadTerms::KEEP,
                index,
            })
            .collect();
        mb.push(txn("d0", Op::Decrement, 1));
        mb.push(Work::Load(LoadChunk {
            shop: "s".into(),
            items,
            reply: tx,
        }));
        assert_eq!(mb.len(), 6);
        assert_eq!(keys(&mb.drain(3)), ["load"]);
        assert_eq!(keys(&mb.drain(3)), ["d0"]);
        assert!(mb.is_empty());
    }
}
