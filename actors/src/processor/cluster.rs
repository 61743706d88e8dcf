//! Cluster screening, with a log and journal that several nodes share: dropping work
//! read under an old partition epoch, and holding back work of a partition's new epoch
//! while batches of the old one are in flight. The reads this needs (keys checked
//! against the journal, items read back when their partition moved) are planned and
//! made in `reads`. Nothing here runs on the embedded default.

use super::*;

impl Processor {
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
        let mut kept = Vec::with_capacity(works.len());
        for work in works {
            if let Work::Txn(req) = &work {
                if let Some(pos) = req.log_pos {
                    let newest = self.partition_epochs.entry(pos.partition).or_insert(0);
                    if req.epoch() < *newest {
                        tracing::debug!(
                            partition = pos.partition,
                            offset = pos.offset,
                            "request read before its partition moved; dropped"
                        );
                        continue;
                    }
                    *newest = req.epoch();
                }
            }
            kept.push(work);
        }
        kept
    }
}
