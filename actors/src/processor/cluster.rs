//! Cluster screening, with a log and journal that several nodes share: dropping work
//! read under an old partition epoch, checking keys against the journal, and reading
//! items back when their partition moved. Nothing here runs on the embedded default.

use super::*;

impl Processor {
    /// Before a batch from a shared log is applied: drops requests read under an older
    /// assignment of their partition, reads back from a shared journal the items whose
    /// partition came to this node since they were last read, and looks up in the
    /// journal every key not applied here in a batch still in flight (through the
    /// journal's key filter, which knows every key of the partitions this node reads:
    /// see [`crate::ports::Sharing::learn_partition`]). Returns the requests to apply and the outcomes
    /// found.
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

    #[allow(clippy::type_complexity)]
    pub(super) fn screen(
        &mut self,
        works: Vec<Work>,
    ) -> (Vec<Work>, HashMap<(Arc<str>, Arc<str>), Arc<Outcome>>) {
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
        if self.journal.shared() {
            self.reload(&kept);
        }
        self.learn(&kept);
        let mut asked: HashMap<Arc<str>, Vec<Arc<str>>> = HashMap::new();
        for work in &kept {
            if let Work::Txn(req) = work {
                if !self
                    .undurable
                    .contains_key(&(req.shop.clone(), req.key.clone()))
                {
                    asked
                        .entry(req.shop.clone())
                        .or_default()
                        .push(req.key.clone());
                }
            }
        }
        let mut found = HashMap::new();
        for (shop, keys) in asked {
            let refs: Vec<&str> = keys.iter().map(|k| &**k).collect();
            let outcomes = retry_read(self.shard, || self.journal.outcomes(&shop, &refs));
            for (key, outcome) in keys.iter().zip(outcomes) {
                if let Some(o) = outcome {
                    found.insert((shop.clone(), key.clone()), Arc::new(o));
                }
            }
        }
        (kept, found)
    }

    /// Has the journal learn the keys of partitions seen under a new epoch, so that its
    /// key lookups are exact for them (from the lowest offset of each in this batch).
    pub(super) fn learn(&mut self, works: &[Work]) {
        let mut from: HashMap<i32, (u64, i64)> = HashMap::new();
        for work in works {
            let Work::Txn(req) = work else { continue };
            let Some(pos) = req.log_pos else { continue };
            if self.learned.get(&pos.partition) == Some(&req.epoch()) {
                continue;
            }
            let f = from
                .entry(pos.partition)
                .or_insert((req.epoch(), pos.offset));
            f.1 = f.1.min(pos.offset);
        }
        for (partition, (epoch, offset)) in from {
            retry_read(self.shard, || {
                self.journal.learn_partition(partition, offset)
            });
            self.learned.insert(partition, epoch);
        }
    }

    /// Reads back from the shared journal the items of `works` not read under their
    /// request's epoch: another node may have changed them while it owned the partition.
    pub(super) fn reload(&mut self, works: &[Work]) {
        let mut stale: Vec<(Arc<str>, Arc<str>)> = Vec::new();
        let mut epochs: HashMap<(Arc<str>, Arc<str>), u64> = HashMap::new();
        for work in works {
            let Work::Txn(req) = work else { continue };
            if req.log_pos.is_none() {
                continue;
            }
            let current = self
                .items
                .get(&req.shop)
                .and_then(|m| m.get(&req.item))
                .map(|s| s.epoch);
            if current != Some(req.epoch()) {
                let key = (req.shop.clone(), req.item.clone());
                if epochs.insert(key.clone(), req.epoch()).is_none() {
                    stale.push(key);
                }
            }
        }
        if stale.is_empty() {
            return;
        }
        let states = retry_read(self.shard, || self.journal.item_states(&stale));
        // The holds of these items as the journal has them replace any armed here: the
        // node that owned them meanwhile may have made, confirmed or expired some.
        let holds = retry_read(self.shard, || self.journal.pending_holds(&stale));
        let moved: std::collections::HashSet<&(Arc<str>, Arc<str>)> = stale.iter().collect();
        let gone: Vec<(Arc<str>, Arc<str>)> = self
            .holds
            .iter()
            .filter(|((shop, _), h)| moved.contains(&(shop.clone(), h.item.clone())))
            .map(|(k, _)| k.clone())
            .collect();
        for key in gone {
            if let Some(h) = self.holds.remove(&key) {
                self.wheel.cancel(h.timer);
            }
        }
        for h in holds {
            self.arm_hold(h.shop, h.hold_id, h.item, h.qty, h.expires_at);
        }
        for ((shop, item), state) in stale.into_iter().zip(states) {
            let epoch = epochs[&(shop.clone(), item.clone())];
            let shop_items = self.items.entry(shop.clone()).or_default();
            match (shop_items.get_mut(&item), state) {
                (Some(slot), Some(st)) => {
                    // Ahead of the journal only by this node's own batches in flight.
                    if st.seq >= slot.live.seq {
                        slot.live = st;
                        slot.durable = st;
                    }
                    slot.epoch = epoch;
                }
                (Some(slot), None) => slot.epoch = epoch,
                (None, Some(st)) => {
                    shop_items.insert(item, Slot::read(st, epoch));
                    self.resident += 1;
                    self.resident_gauge.inc();
                }
                (None, None) => {
                    // An unknown item: no empty map left behind for its shop.
                    if shop_items.is_empty() {
                        self.items.remove(&shop);
                    }
                }
            }
        }
    }
}
