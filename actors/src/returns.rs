//! Returns: an increment that names the sale it gives back (`return_of`, the
//! sale's request key). A seller's increment must be one (the API refuses a seller's
//! free increment with 403); an operator's may be.
//!
//! The item's processor decides a return, as the single writer of the item, against
//! what the journal holds of the sale ([`SaleRecord`]: what it sold, and the units
//! returned against it so far) read on demand, off its thread, like an item that left
//! memory ([`crate::ports::ItemReads::sales`]). It keeps in memory only the sales with a
//! return in a batch not yet durable (so two returns of one sale in flight see each
//! other), which is bounded by the batches in flight; no per-sale state outlives them.
//! A return is refused ([`crate::types::Status::ReturnRefused`], journaled like any
//! refusal, nothing changes) when the sale is unknown or not yet durable (a return in
//! the same drain as its sale: returns go first in the mailbox), is not an `ok` sale of
//! the same item, is older than the return window, or has fewer units left than asked.
//!
//! The units returned are journaled with the return (`return_of` on an `ok` increment),
//! so every journal rebuilds "units returned against sale K" from its entries, across
//! restarts and nodes; a sale stays returnable for the return window, also after its key
//! leaves the embedded journal's dedup window.

use std::sync::Arc;

use crate::types::{Millis, Op, Status};

/// How long a sale stays returnable by default: 30 days.
pub const RETURN_WINDOW_MS_DEFAULT: i64 = 30 * 86_400_000;

/// What the journal holds of the request key a return names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SaleRecord {
    /// The item the keyed request was about.
    pub item: Arc<str>,
    pub op: Op,
    pub status: Status,
    /// Units it sold (a sale's `qty`).
    pub sold: i64,
    /// When it was decided (ms since the epoch).
    pub decided_at: Millis,
    /// Units returned against it so far, as durable (0 to `sold`).
    pub returned: i64,
}

impl SaleRecord {
    /// Units of the sale that may still be returned.
    pub fn returnable(&self) -> i64 {
        self.sold - self.returned
    }

    /// Why `qty` of `item` cannot be returned against this record (the one of key
    /// `sale`) at `now`, with sales returnable for `window_ms`; `None` if they can.
    pub fn refusal(
        &self,
        sale: &str,
        item: &str,
        qty: i64,
        now: Millis,
        window_ms: i64,
    ) -> Option<String> {
        if self.op != Op::Decrement {
            return Some(format!(
                "request {sale} is {} {}, not a sale: only a sale can be returned",
                article(self.op.as_str()),
                self.op.as_str()
            ));
        }
        if self.status != Status::Ok {
            return Some(format!(
                "sale {sale} was not made (it was {}): nothing to return",
                self.status.as_str()
            ));
        }
        if *self.item != *item {
            return Some(format!("sale {sale} sold item {}, not {item}", self.item));
        }
        let age_ms = now.saturating_sub(self.decided_at);
        if age_ms > window_ms {
            return Some(format!(
                "sale {sale} was made {} days ago, past the return window of {} days",
                age_ms / 86_400_000,
                window_ms / 86_400_000
            ));
        }
        if qty > self.returnable() {
            return Some(format!(
                "sale {sale} sold {} and {} were returned already: {} left to return, {qty} asked",
                self.sold,
                self.returned,
                self.returnable()
            ));
        }
        None
    }
}

/// Why a return of a key the journal has no record of is refused.
pub fn unknown_sale(sale: &str) -> String {
    format!(
        "no sale {sale} is decided in this shop (unknown, not yet decided, or past the \
         return window)"
    )
}

fn article(word: &str) -> &'static str {
    if word.starts_with(['a', 'e', 'i', 'o', 'u']) {
        "an"
    } else {
        "a"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sale(sold: i64, returned: i64) -> SaleRecord {
        SaleRecord {
            item: "i".into(),
            op: Op::Decrement,
            status: Status::Ok,
            sold,
            decided_at: 1_000,
            returned,
        }
    }

    #[test]
    fn a_return_takes_at_most_what_the_sale_sold_less_what_came_back() {
        let w = RETURN_WINDOW_MS_DEFAULT;
        assert_eq!(sale(5, 0).refusal("k", "i", 5, 2_000, w), None);
        assert_eq!(sale(5, 3).refusal("k", "i", 2, 2_000, w), None);
        let why = sale(5, 3).refusal("k", "i", 3, 2_000, w).unwrap();
        assert!(why.contains("2 left to return, 3 asked"), "{why}");
        let why = sale(5, 0).refusal("k", "j", 1, 2_000, w).unwrap();
        assert!(why.contains("not j"), "{why}");
        let why = sale(5, 0).refusal("k", "i", 1, 1_000 + w + 1, w).unwrap();
        assert!(why.contains("past the return window of 30 days"), "{why}");
        assert_eq!(sale(5, 0).refusal("k", "i", 1, 1_000 + w, w), None);
        let refused = SaleRecord {
            status: Status::InsufficientStock,
            ..sale(5, 0)
        };
        assert!(refused
            .refusal("k", "i", 1, 2_000, w)
            .unwrap()
            .contains("insufficient_stock"));
        let increment = SaleRecord {
            op: Op::Increment,
            ..sale(5, 0)
        };
        assert!(increment
            .refusal("k", "i", 1, 2_000, w)
            .unwrap()
            .contains("an increment, not a sale"));
    }
}
