//! Returns of sales in batches not yet durable: what a later return of the same sale is
//! decided against, since the journal does not have those returns yet
//! ([`crate::returns`]).

use std::collections::HashMap;
use std::sync::Arc;

use crate::returns::SaleRecord;
use crate::types::{Millis, Request};

use super::SaleKey;

/// A sale with returns in batches not yet durable.
struct Returning {
    /// The sale as the journal had it, with this node's returns applied since.
    record: SaleRecord,
    /// Returns of it in batches in flight.
    in_flight: usize,
}

pub(super) struct Returns {
    /// Sales (by shop and key) with an `ok` return in a batch not yet durable. An entry
    /// leaves when its last such batch is durable (or fenced), so this holds at most one
    /// entry per return in flight ([`super::BATCHES_IN_FLIGHT_MAX`] × `batch_max`);
    /// sales are read from the journal otherwise.
    returning: HashMap<SaleKey, Returning>,
    /// How long a sale stays returnable ([`super::ShardShared::return_window_ms`]).
    window_ms: i64,
}

impl Returns {
    pub(super) fn new(window_ms: i64) -> Returns {
        Returns {
            returning: HashMap::new(),
            window_ms,
        }
    }

    /// Whether a sale has returns in flight (then it is not read from the journal).
    pub(super) fn in_flight(&self, key: &SaleKey) -> bool {
        self.returning.contains_key(key)
    }

    /// Why return `req` of sale `sale` is refused, `None` if it may go ahead (to the
    /// apply step, which may still refuse it as expired or past the stock limit).
    /// `read`: the sales read from the journal for this batch. An expired return is left
    /// to the apply step, to be answered `expired` like any request that waited too
    /// long.
    pub(super) fn refusal(
        &self,
        req: &Request,
        sale: &Arc<str>,
        now: Millis,
        ttl_ms: i64,
        read: &HashMap<SaleKey, Option<SaleRecord>>,
    ) -> Option<String> {
        if now.saturating_sub(req.submitted_at) > ttl_ms {
            return None;
        }
        let key = (req.shop.clone(), sale.clone());
        let record = match self.returning.get(&key) {
            Some(r) => Some(&r.record),
            // Read for this batch; a sale the journal does not have (or that was not
            // read) is refused, never taken on trust.
            None => read.get(&key).and_then(Option::as_ref),
        };
        match record {
            Some(r) => r.refusal(sale, &req.item, req.qty, now, self.window_ms),
            None => Some(crate::returns::unknown_sale(sale)),
        }
    }

    /// Counts an `ok` return of `qty` against sale `sale`, in memory until the batch that
    /// journals it is durable.
    pub(super) fn returned(
        &mut self,
        shop: &Arc<str>,
        sale: &Arc<str>,
        qty: i64,
        read: &HashMap<SaleKey, Option<SaleRecord>>,
    ) {
        let key = (shop.clone(), sale.clone());
        let entry = match self.returning.entry(key) {
            std::collections::hash_map::Entry::Occupied(o) => o.into_mut(),
            std::collections::hash_map::Entry::Vacant(v) => {
                let Some(Some(record)) = read.get(v.key()).cloned() else {
                    // `refusal` found the record in one of the two places.
                    unreachable!("an ok return of a sale neither read nor in flight");
                };
                v.insert(Returning {
                    record,
                    in_flight: 0,
                })
            }
        };
        entry.record.returned += qty;
        entry.in_flight += 1;
        // The rule this module exists for: never more back than was sold.
        assert!(
            entry.record.returned <= entry.record.sold,
            "return past the sale: {} returned of {} sold (sale {sale})",
            entry.record.returned,
            entry.record.sold
        );
    }

    /// A return of `key` in a batch the journal answered: written, or `fenced` (not
    /// written: its sale is read again from the journal by the next return here, since
    /// its item's partition is another node's now and every batch of it in flight is
    /// fenced too).
    pub(super) fn retired(&mut self, key: &SaleKey, fenced: bool) {
        let last = fenced
            || self.returning.get_mut(key).is_some_and(|r| {
                assert!(r.in_flight > 0, "a return retired twice (sale {})", key.1);
                r.in_flight -= 1;
                r.in_flight == 0
            });
        if last {
            self.returning.remove(key);
        }
    }
}
