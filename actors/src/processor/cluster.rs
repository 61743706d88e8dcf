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
        drop_stale(&mut self.partition_epochs, works)
    }
}

/// [`Processor::drop_stale`] with `newest` the newest epoch seen of each partition. The
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
