//! Retiring a durable batch: the items' durable states, the loads' replies, and the
//! outcomes fanned out to the WorkManagers that hold the reply handles (this node's,
//! one message per shop) and to other nodes through the shared log's hook.

use super::*;

impl Processor {
    /// Retires batch `id` once the journal answered it: what it wrote is answered; the
    /// entries of `fenced` partitions (see [`StoreError::Fenced`]) are not, and their
    /// items leave memory, to be read again from the journal if the partition comes
    /// back.
    pub(super) fn durable(&mut self, id: u64, entries: Vec<Entry>, fenced: &[(i32, u64)]) {
        let Some(mut batch) = self.in_flight.pop_front() else {
            tracing::error!(
                shard = self.shard,
                "durable batch without a batch in flight"
            );
            return;
        };
        // The journal completes one shard's appends in the order they were sent.
        assert_eq!(batch.id, id, "journal appends completed out of order");
        debug_assert_eq!(batch.weight, entries.len());
        let is_fenced =
            |pos: &Option<LogPos>| pos.is_some_and(|p| fenced.contains(&(p.partition, p.epoch)));
        let mut dropped: HashSet<(Arc<str>, Arc<str>)> = HashSet::new();
        let mut refused_at: Vec<LogPos> = Vec::new();
        let entries: Vec<Entry> = if fenced.is_empty() {
            entries
        } else {
            let (kept, refused): (Vec<Entry>, Vec<Entry>) =
                entries.into_iter().partition(|e| !is_fenced(&e.log_pos));
            refused_at.extend(refused.iter().filter_map(|e| e.log_pos));
            refused_at.extend(
                batch
                    .repeats
                    .iter()
                    .filter(|r| is_fenced(&r.pos))
                    .filter_map(|r| r.pos),
            );
            dropped.extend(refused.into_iter().map(|e| (e.shop, e.item)));
            batch
                .states
                .retain(|(shop, item, _)| !dropped.contains(&(shop.clone(), item.clone())));
            // A load with a refused item is not answered: its caller sees it fail.
            batch.loads.retain(|(_, views)| {
                views
                    .iter()
                    .all(|(_, v, _)| !dropped.contains(&(v.shop.clone(), v.item.clone())))
            });
            batch.repeats.retain(|r| !is_fenced(&r.pos));
            kept
        };
        for key in &batch.keys {
            self.undurable.remove(key);
        }
        for key in &batch.ended {
            self.ended.remove(key);
        }
        for (key, pos) in &batch.returns {
            // A fenced return was not written: its sale is read again from the journal
            // by the next return here (its item's partition is another node's now, and
            // every batch of it in flight is fenced too).
            let last = is_fenced(pos)
                || self.returning.get_mut(key).is_some_and(|r| {
                    r.in_flight -= 1;
                    r.in_flight == 0
                });
            if last {
                self.returning.remove(key);
            }
        }
        for (shop, item, state) in batch.states {
            if let Some(slot) = self.items.get_mut(&shop).and_then(|m| m.get_mut(&item)) {
                // Paired with the apply step's assertion: what became durable is sane.
                assert!(state.stock >= 0 && state.seq >= slot.durable.seq);
                slot.durable = state;
            }
        }
        for (reply, views) in batch.loads {
            let _ = reply.send(views);
        }
        let hooks = self.hooks.get();
        if let Some(hooks) = hooks {
            let positions: Vec<_> = entries
                .iter()
                .filter_map(|e| e.log_pos)
                .chain(batch.repeats.iter().filter_map(|r| r.pos))
                .collect();
            if !positions.is_empty() {
                (hooks.journaled)(positions);
            }
            if !refused_at.is_empty() {
                (hooks.fenced)(refused_at);
            }
        }
        // Outcomes to the WorkManagers that hold the reply handles: this node's, one
        // message per shop, and other nodes' through the log's hook.
        let mut by_shop: HashMap<Arc<str>, Vec<Arc<Outcome>>> = HashMap::new();
        let mut remote: HashMap<u32, Vec<Arc<Outcome>>> = HashMap::new();
        let mut counts = [0u64; Status::ALL.len()];
        let mut route = |origin: Option<u32>, outcome: Arc<Outcome>| match (origin, hooks) {
            (Some(node), Some(h)) if node != h.node_id => {
                remote.entry(node).or_default().push(outcome)
            }
            _ => by_shop
                .entry(outcome.shop.clone())
                .or_default()
                .push(outcome),
        };
        let mut decided = Vec::with_capacity(entries.len());
        for entry in &entries {
            if let Some(outcome) = entry.outcome() {
                counts[status_index(outcome.status)] += 1;
                let outcome = Arc::new(outcome);
                decided.push(outcome.clone());
                route(entry.origin, outcome);
            }
        }
        self.metrics.shops.record_all(&decided);
        let answered = batch.repeats.iter().filter(|r| r.outcome.is_some()).count();
        if answered > 0 {
            self.metrics.repeats.inc_by(answered as u64);
        }
        for r in batch.repeats {
            if let Some(outcome) = r.outcome {
                route(r.origin, outcome);
            }
        }
        if let Some(h) = hooks {
            for (node, outcomes) in remote {
                (h.remote)(node, outcomes);
            }
        }
        for (i, n) in counts.iter().enumerate() {
            if *n > 0 {
                self.metrics
                    .decisions
                    .with_label_values(&[Status::ALL[i].as_str()])
                    .inc_by(*n);
            }
        }
        for (shop, outcomes) in by_shop {
            match self.registry.get(&shop) {
                Some(wm) => wm.addr.do_send(Decided::new(outcomes)),
                // The shop's WorkManager passivated (it had nothing in flight, so nobody
                // waits for these) or was dropped at shutdown: they are durable and can
                // be polled.
                None => tracing::debug!(%shop, "no WorkManager for decided outcomes"),
            }
        }
        for (shop, item) in dropped {
            if let Some(m) = self.items.get_mut(&shop) {
                if m.remove(&item).is_some() {
                    self.resident -= 1;
                    self.resident_gauge.dec();
                }
                if m.is_empty() {
                    self.items.remove(&shop);
                }
            }
            self.complete = false;
        }
    }

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

pub(super) fn status_index(s: Status) -> usize {
    Status::ALL.iter().position(|x| *x == s).unwrap_or(0)
}
