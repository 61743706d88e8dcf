//! The cluster screen, with a log and journal that several nodes share: dropping work
//! read under an old partition epoch, holding back work of a partition's new epoch
//! while batches of the old one are in flight, and the outcomes of keys applied here
//! but not yet durable (a repeat of one is found here, not in the journal). The reads
//! this needs (keys checked against the journal, items read back when their partition
//! moved) are planned and made in `reads`. Nothing here runs on the embedded default.

use std::collections::HashMap;
use std::sync::Arc;

use crate::mailbox::Work;
use crate::ports::LogHooks;
use crate::topology::SharedLog;
use crate::types::{Outcome, Request};

/// A request key by shop and key.
type KeyOfShop = (Arc<str>, Arc<str>);

pub(super) struct ClusterScreen {
    /// The shared log, and whether the journal is shared too.
    log: Arc<SharedLog>,
    /// Outcomes of keys applied but not yet durable, by shop and key: a repeat of one of
    /// them is found here, since the journal does not hold it yet (bounded by the
    /// batches in flight).
    unjournaled: HashMap<KeyOfShop, Arc<Outcome>>,
    /// The newest assignment epoch seen per partition; a request read under an older one
    /// was read before its partition moved, and is dropped (the log delivers it again
    /// to the partition's owner).
    partition_epochs: HashMap<i32, u64>,
    /// Per partition, the epoch under which this shard last had the journal learn the
    /// partition's keys ([`crate::ports::Sharing::learn_partition`]).
    learned: HashMap<i32, u64>,
}

impl ClusterScreen {
    pub(super) fn new(log: Arc<SharedLog>) -> ClusterScreen {
        ClusterScreen {
            log,
            unjournaled: HashMap::new(),
            partition_epochs: HashMap::new(),
            learned: HashMap::new(),
        }
    }

    pub(super) fn hooks(&self) -> &LogHooks {
        &self.log.hooks
    }

    /// Whether other nodes write the journal too: an item is read back when its
    /// partition comes (back), and a hold's expiry goes through the log.
    pub(super) fn journal_shared(&self) -> bool {
        self.log.journal == crate::topology::JournalWriters::AllNodes
    }

    /// Whether `works` carry a partition's epoch newer than the one this shard last
    /// saw: the partition was assigned again (a lease taken again, with leases).
    pub(super) fn epoch_moves(&self, works: &[Work]) -> bool {
        works.iter().any(|w| match w {
            Work::Txn(req) => req.log_pos.is_some_and(|pos| {
                self.partition_epochs
                    .get(&pos.partition)
                    .is_some_and(|seen| pos.epoch > *seen)
            }),
            _ => false,
        })
    }

    /// Drops the requests read under an older assignment of their partition than the
    /// newest this shard has seen: they were read before the partition moved, and the
    /// log delivers them again to the partition's owner.
    pub(super) fn drop_stale(&mut self, works: Vec<Work>) -> Vec<Work> {
        drop_stale(&mut self.partition_epochs, works)
    }

    /// The outcome of a key applied here in a batch not yet durable.
    pub(super) fn unjournaled(&self, key: &KeyOfShop) -> Option<&Arc<Outcome>> {
        self.unjournaled.get(key)
    }

    /// A key applied in a batch about to be sent.
    pub(super) fn applied(&mut self, key: KeyOfShop, outcome: Arc<Outcome>) {
        let before = self.unjournaled.insert(key, outcome);
        // A key already here is answered as a repeat, never applied again.
        debug_assert!(before.is_none(), "a key applied twice while in flight");
    }

    /// The batch that applied `key` is durable (or fenced): the journal answers for it.
    pub(super) fn retired(&mut self, key: &KeyOfShop) {
        let found = self.unjournaled.remove(key);
        debug_assert!(found.is_some(), "a key retired that was not in flight");
    }

    /// The epoch under which the journal last learned a partition's keys here.
    pub(super) fn learned(&self, partition: i32) -> Option<u64> {
        self.learned.get(&partition).copied()
    }

    pub(super) fn learn(&mut self, partition: i32, epoch: u64) {
        self.learned.insert(partition, epoch);
    }
}

/// [`ClusterScreen::drop_stale`] with `newest` the newest epoch seen of each partition. The
/// newest is taken over the whole batch first: a partition taken from this node and
/// given back to it before its messages drained (a revocation that waited out
/// `DRAIN_TIMEOUT` on a slow journal) has each of those messages twice in the mailbox,
/// once per epoch, and both copies may come out in one batch. Kept together, the old
/// copy would be applied (and its entry fenced: the lease moved on) while the new copy
/// rode along as its repeat, counted as journaled: the request would be neither decided
/// nor read again.
fn drop_stale(newest: &mut HashMap<i32, u64>, works: Vec<Work>) -> Vec<Work> {
    for work in &works {
        if let Work::Txn(Request {
            log_pos: Some(pos), ..
        }) = work
        {
            let seen = newest.entry(pos.partition).or_insert(0);
            *seen = (*seen).max(pos.epoch);
        }
    }
    works
        .into_iter()
        .filter(|work| match work {
            Work::Txn(
                req @ Request {
                    log_pos: Some(pos), ..
                },
            ) => {
                let stale = pos.epoch < newest[&pos.partition];
                if stale {
                    tracing::debug!(
                        partition = pos.partition,
                        offset = pos.offset,
                        key = %req.key,
                        "request read before its partition moved; dropped"
                    );
                }
                !stale
            }
            _ => true,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::{LogPos, Op};

    fn read(key: &str, partition: i32, offset: i64, epoch: u64) -> Work {
        let mut req = Request::new(
            "shop".into(),
            "item".into(),
            key.into(),
            Op::Decrement,
            1,
            0,
        );
        req.log_pos = Some(LogPos {
            partition,
            offset,
            epoch,
        });
        Work::Txn(req)
    }

    fn keys_and_epochs(works: &[Work]) -> Vec<(String, u64)> {
        works
            .iter()
            .map(|w| match w {
                Work::Txn(r) => (r.key.to_string(), r.epoch()),
                Work::Load(_) => ("load".into(), 0),
            })
            .collect()
    }

    #[test]
    fn two_copies_of_a_message_in_one_batch_keep_only_the_newer_assignments() {
        let mut newest = HashMap::new();
        // Read under epoch 1, the partition revoked undrained and given back (epoch 2):
        // the same messages again, behind the first copies, in the same batch.
        let batch = vec![
            read("a", 0, 10, 1),
            read("b", 0, 11, 1),
            read("x", 1, 5, 1),
            read("a", 0, 10, 2),
            read("b", 0, 11, 2),
        ];
        let kept = drop_stale(&mut newest, batch);
        assert_eq!(
            keys_and_epochs(&kept),
            [("x".into(), 1), ("a".into(), 2), ("b".into(), 2)]
        );
        // And a later batch still carrying epoch 1 of partition 0 is dropped whole.
        let kept = drop_stale(&mut newest, vec![read("c", 0, 12, 1), read("y", 1, 6, 1)]);
        assert_eq!(keys_and_epochs(&kept), [("y".into(), 1)]);
    }
}
