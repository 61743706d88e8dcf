//! Retiring a durable batch: the items' durable states, the loads' replies, and the
//! outcomes fanned out to the WorkManagers that hold the reply handles (this node's,
//! one message per shop) and to other nodes through the shared log's hook.

use super::items::ItemKey;
use super::*;
use crate::types::KeyHash;

/// Outcomes of one batch on their way: to this node's WorkManagers by shop, to other
/// nodes by node id.
#[derive(Default)]
struct Routes {
    by_shop: HashMap<Arc<str>, Vec<Arc<Outcome>>, KeyHash>,
    remote: HashMap<u32, Vec<Arc<Outcome>>>,
}

impl Routes {
    fn route(&mut self, origin: Option<u32>, outcome: Arc<Outcome>, hooks: Option<&LogHooks>) {
        match (origin, hooks) {
            (Some(node), Some(h)) if node != h.node_id => {
                self.remote.entry(node).or_default().push(outcome)
            }
            _ => self
                .by_shop
                .entry(outcome.shop.clone())
                .or_default()
                .push(outcome),
        }
    }
}

impl Processor {
    /// Retires batch `id` once the journal answered it: what it wrote is answered; the
    /// entries of `fenced` partitions (see [`StoreError::Fenced`]) are not, and their
    /// items leave memory, to be read again from the journal if the partition comes
    /// back.
    pub(super) fn journaled(&mut self, id: u64, entries: Vec<Entry>, fenced: &[(i32, u64)]) {
        let Some(mut batch) = self.pipeline.retire(id) else {
            tracing::error!(
                shard = self.shard,
                "journaled batch without a batch in flight"
            );
            return;
        };
        debug_assert_eq!(batch.weight, entries.len());
        let is_fenced =
            |pos: &Option<LogPos>| pos.is_some_and(|p| fenced.contains(&(p.partition, p.epoch)));
        let (entries, dropped, refused_at) = if fenced.is_empty() {
            (entries, HashSet::new(), Vec::new())
        } else {
            unfence(&mut batch, entries, &is_fenced)
        };
        if let Some(cluster) = &mut self.cluster {
            for key in &batch.keys {
                cluster.retired(key);
            }
        }
        for key in &batch.ended {
            self.holds.retire_ended(key);
        }
        for (key, pos) in &batch.returns {
            self.returns.retired(key, is_fenced(pos));
        }
        for (shop, item, state) in batch.states {
            self.items.set_journaled(&shop, &item, state);
        }
        for (reply, views) in batch.loads {
            let _ = reply.send(views);
        }
        if let Some(hooks) = self.cluster.as_ref().map(ClusterScreen::hooks) {
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
        self.answer(&entries, batch.repeats);
        for (shop, item) in dropped {
            self.items.drop_fenced(&shop, &item);
        }
    }

    /// Outcomes to the WorkManagers that hold the reply handles: this node's, one
    /// message per shop, and other nodes' through the log's hook.
    fn answer(&self, entries: &[Entry], repeats: Vec<Repeat>) {
        let hooks = self.cluster.as_ref().map(ClusterScreen::hooks);
        let metrics = &self.ports.metrics;
        let mut routes = Routes::default();
        let mut counts = [0u64; Status::ALL.len()];
        let mut decided = Vec::with_capacity(entries.len());
        for entry in entries {
            if let Some(outcome) = entry.outcome() {
                counts[status_index(outcome.status)] += 1;
                let outcome = Arc::new(outcome);
                decided.push(outcome.clone());
                routes.route(entry.origin, outcome, hooks);
            }
        }
        metrics.shops.record_all(&decided);
        let answered = repeats.iter().filter(|r| r.outcome.is_some()).count();
        if answered > 0 {
            metrics.repeats.inc_by(answered as u64);
        }
        for r in repeats {
            if let Some(outcome) = r.outcome {
                routes.route(r.origin, outcome, hooks);
            }
        }
        if let Some(h) = hooks {
            for (node, outcomes) in routes.remote {
                (h.remote)(node, outcomes);
            }
        }
        for (i, n) in counts.iter().enumerate() {
            if *n > 0 {
                metrics
                    .decisions
                    .with_label_values(&[Status::ALL[i].as_str()])
                    .inc_by(*n);
            }
        }
        for (shop, outcomes) in routes.by_shop {
            match self.ports.registry.get(&shop) {
                Some(wm) => wm.addr.do_send(Decided::new(outcomes)),
                // The shop's WorkManager passivated (it had nothing in flight, so nobody
                // waits for these) or was dropped at shutdown: they are durable and can
                // be polled.
                None => tracing::debug!(%shop, "no WorkManager for decided outcomes"),
            }
        }
    }
}

/// Takes out of a batch what the journal refused (entries of fenced partitions, and
/// what rode along with them): the entries kept, the items to drop from memory, and the
/// log positions refused.
fn unfence(
    batch: &mut BatchInFlight,
    entries: Vec<Entry>,
    is_fenced: &dyn Fn(&Option<LogPos>) -> bool,
) -> (Vec<Entry>, HashSet<ItemKey>, Vec<LogPos>) {
    let (kept, refused): (Vec<Entry>, Vec<Entry>) =
        entries.into_iter().partition(|e| !is_fenced(&e.log_pos));
    let mut refused_at: Vec<LogPos> = refused.iter().filter_map(|e| e.log_pos).collect();
    refused_at.extend(
        batch
            .repeats
            .iter()
            .filter(|r| is_fenced(&r.pos))
            .filter_map(|r| r.pos),
    );
    let dropped: HashSet<ItemKey> = refused.into_iter().map(|e| (e.shop, e.item)).collect();
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
    (kept, dropped, refused_at)
}

pub(super) fn status_index(s: Status) -> usize {
    Status::ALL.iter().position(|x| *x == s).unwrap_or(0)
}
