//! The correctness check's arithmetic: what each item's stock must be, given what the
//! server answered, and how a read-back compares with it.
//!
//! The client keeps its own books from the answers it got: per item, the quantity
//! loaded, the sum of `ok` decrements and increments, and the holds and order lines by
//! their final state (a line is booked as a hold of its item: held, sold or released).
//! After the run it reads every item back. A server that oversold, lost an acknowledged
//! change or applied a request twice shows up as a difference between the two.

use std::sync::atomic::{AtomicI64, Ordering};

use serde::Serialize;

/// How a hold ended, as far as the client knows at the end of the run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HoldFinal {
    /// Still reserved: counts in `reserved`, not in `stock`.
    Held,
    /// Sold: left `stock` when held, and `reserved` when confirmed.
    Confirmed,
    /// Cancelled or expired: its quantity went back to `stock`.
    Released,
}

/// Per-item books, shared by all workers. Atomics rather than per-worker copies: with
/// 10,000 items and 64 workers, copies would cost tens of MB, and one relaxed add per
/// answer is noise next to an HTTP round trip.
#[derive(Debug, Default)]
pub struct ItemBooks {
    pub loaded: AtomicI64,
    pub ok_decrements: AtomicI64,
    pub ok_increments: AtomicI64,
    pub held: AtomicI64,
    pub confirmed: AtomicI64,
    /// Quantity of requests whose outcome is unknown (transport error, 504, never
    /// decided) that would lower `stock` if they were applied.
    pub unresolved_down: AtomicI64,
    /// Same, for requests that would raise it.
    pub unresolved_up: AtomicI64,
    /// Quantity of holds and order lines whose state is unknown that would still be
    /// reserved if they were made and not ended: the allowed `reserved` widens by it.
    pub unresolved_reserved: AtomicI64,
}

impl ItemBooks {
    pub fn add_hold(&self, end: HoldFinal, qty: i64) {
        match end {
            HoldFinal::Held => {
                self.held.fetch_add(qty, Ordering::Relaxed);
            }
            HoldFinal::Confirmed => {
                self.confirmed.fetch_add(qty, Ordering::Relaxed);
            }
            HoldFinal::Released => {}
        }
    }

    pub fn tally(&self) -> Tally {
        let get = |a: &AtomicI64| a.load(Ordering::Relaxed);
        Tally {
            loaded: get(&self.loaded),
            ok_decrements: get(&self.ok_decrements),
            ok_increments: get(&self.ok_increments),
            held: get(&self.held),
            confirmed: get(&self.confirmed),
            unresolved_down: get(&self.unresolved_down),
            unresolved_up: get(&self.unresolved_up),
            unresolved_reserved: get(&self.unresolved_reserved),
        }
    }
}

/// A snapshot of one item's books, for the arithmetic.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Tally {
    pub loaded: i64,
    pub ok_decrements: i64,
    pub ok_increments: i64,
    pub held: i64,
    pub confirmed: i64,
    pub unresolved_down: i64,
    pub unresolved_up: i64,
    pub unresolved_reserved: i64,
}

/// What an item read back shows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Observed {
    pub stock: i64,
    pub reserved: i64,
}

/// The verdict on one item.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ItemVerdict {
    /// Stock or reserved outside what the answers allow.
    pub mismatch: bool,
    /// The server shows negative stock or reserved.
    pub negative: bool,
    /// Units sold beyond what existed: by the server's figures or by the client's books.
    pub oversold_units: i64,
}

impl Tally {
    /// Available stock the answers imply: loaded − Σ ok decrements + Σ ok increments −
    /// what holds took (still held, or confirmed). Released holds gave theirs back.
    pub fn expected_stock(&self) -> i64 {
        self.loaded - self.ok_decrements + self.ok_increments - self.held - self.confirmed
    }

    /// Reserved stock the answers imply: the holds (and order lines) still held.
    pub fn expected_reserved(&self) -> i64 {
        self.held
    }

    /// Units sold by the answers: ok decrements less ok increments, plus confirmed
    /// holds and order lines. Compared, summed over the items, with what the read-back
    /// shows gone: loaded − stock − reserved.
    pub fn sold(&self) -> i64 {
        self.ok_decrements - self.ok_increments + self.confirmed
    }

    /// Compares a read-back with the books. Unresolved requests widen the allowed range
    /// for `stock` by what they could have moved, since the client cannot know whether
    /// they were applied; with none, the check is exact.
    pub fn verify(&self, seen: Observed) -> ItemVerdict {
        let expected = self.expected_stock();
        let low = expected - self.unresolved_down;
        let high = expected + self.unresolved_up;
        let reserved = self.expected_reserved();
        let mismatch = seen.stock < low
            || seen.stock > high
            || seen.reserved < reserved
            || seen.reserved > reserved + self.unresolved_reserved;
        let negative = seen.stock < 0 || seen.reserved < 0;
        let oversold_units = 0i64.max(-expected).max(-seen.stock).max(-seen.reserved);
        ItemVerdict {
            mismatch,
            negative,
            oversold_units,
        }
    }
}

/// The run's correctness check, as reported in the result JSON.
#[derive(Debug, Clone, Default, Serialize)]
pub struct CheckReport {
    /// `passed`, `failed`, or `skipped` (ceiling keeps no state).
    pub verdict: String,
    pub items_checked: u64,
    pub stock_mismatches: u64,
    pub negative_items: u64,
    pub oversold_units: i64,
    /// Keys whose outcome was polled and compared with the answer the run got.
    pub keys_polled: u64,
    /// Keys resubmitted: the answer must be the recorded outcome, and nothing moves.
    pub keys_resubmitted: u64,
    /// Polls or resubmissions whose status differs from the answer first given.
    pub key_mismatches: u64,
    /// Requests still without a known outcome after polling (they widen the range).
    pub unresolved_requests: u64,
    /// Units sold according to the answers, over every item read back (for orders: the
    /// confirmed lines).
    pub units_sold_by_answers: i64,
    /// Units gone according to the read-back, over every item: loaded − stock − reserved.
    /// Equal to `units_sold_by_answers` when every outcome is known.
    pub units_sold_read_back: i64,
    /// The first few differences, for a reader to start from.
    pub notes: Vec<String>,
}

impl CheckReport {
    /// Most notes kept: enough to see a pattern, bounded whatever the failure count.
    pub const NOTES_MAX: usize = 10;

    pub fn note(&mut self, text: String) {
        if self.notes.len() < Self::NOTES_MAX {
            self.notes.push(text);
        }
    }

    pub fn add_item(&mut self, item: &str, tally: &Tally, seen: Observed) {
        let v = tally.verify(seen);
        self.items_checked += 1;
        self.units_sold_by_answers += tally.sold();
        self.units_sold_read_back += tally.loaded - seen.stock - seen.reserved;
        self.oversold_units += v.oversold_units;
        if v.negative {
            self.negative_items += 1;
        }
        if v.mismatch {
            self.stock_mismatches += 1;
            self.note(format!(
                "{item}: read stock {} reserved {}, answers imply stock {} (−{}/+{} unresolved) reserved {} (+{} unresolved)",
                seen.stock,
                seen.reserved,
                tally.expected_stock(),
                tally.unresolved_down,
                tally.unresolved_up,
                tally.expected_reserved(),
                tally.unresolved_reserved
            ));
        }
    }

    pub fn finish(&mut self) {
        let failed = self.stock_mismatches > 0
            || self.negative_items > 0
            || self.oversold_units > 0
            || self.key_mismatches > 0;
        self.verdict = if failed { "failed" } else { "passed" }.to_string();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tally(loaded: i64, dec: i64, inc: i64) -> Tally {
        Tally {
            loaded,
            ok_decrements: dec,
            ok_increments: inc,
            ..Tally::default()
        }
    }

    #[test]
    fn stock_is_loaded_minus_ok_decrements_plus_ok_increments() {
        let t = tally(1000, 300, 20);
        assert_eq!(t.expected_stock(), 720);
        let v = t.verify(Observed {
            stock: 720,
            reserved: 0,
        });
        assert_eq!(v, ItemVerdict::default());
    }

    #[test]
    fn a_lost_or_doubled_decrement_is_a_mismatch() {
        let t = tally(1000, 300, 0);
        assert!(
            t.verify(Observed {
                stock: 701,
                reserved: 0
            })
            .mismatch
        );
        assert!(
            t.verify(Observed {
                stock: 699,
                reserved: 0
            })
            .mismatch
        );
    }

    #[test]
    fn holds_take_stock_until_released() {
        let books = ItemBooks::default();
        books.loaded.store(100, Ordering::Relaxed);
        books.add_hold(HoldFinal::Held, 5);
        books.add_hold(HoldFinal::Confirmed, 7);
        books.add_hold(HoldFinal::Released, 11);
        let t = books.tally();
        assert_eq!(t.expected_stock(), 88);
        assert_eq!(t.expected_reserved(), 5);
        assert!(
            !t.verify(Observed {
                stock: 88,
                reserved: 5
            })
            .mismatch
        );
        assert!(
            t.verify(Observed {
                stock: 88,
                reserved: 0
            })
            .mismatch
        );
    }

    #[test]
    fn more_ok_decrements_than_stock_is_oversold_even_if_the_server_hides_it() {
        let t = tally(10, 12, 0);
        let v = t.verify(Observed {
            stock: 0,
            reserved: 0,
        });
        assert_eq!(v.oversold_units, 2);
        assert!(v.mismatch);
    }

    #[test]
    fn negative_stock_read_back_is_oversold() {
        let t = tally(10, 10, 0);
        let v = t.verify(Observed {
            stock: -3,
            reserved: 0,
        });
        assert!(v.negative);
        assert_eq!(v.oversold_units, 3);
    }

    #[test]
    fn unresolved_requests_widen_the_range_by_their_quantity() {
        let t = Tally {
            unresolved_down: 4,
            unresolved_up: 1,
            ..tally(100, 10, 0)
        };
        for stock in 86..=91 {
            assert!(
                !t.verify(Observed { stock, reserved: 0 }).mismatch,
                "{stock}"
            );
        }
        assert!(
            t.verify(Observed {
                stock: 85,
                reserved: 0
            })
            .mismatch
        );
        assert!(
            t.verify(Observed {
                stock: 92,
                reserved: 0
            })
            .mismatch
        );
    }

    #[test]
    fn a_line_of_an_unknown_order_may_be_reserved_but_nothing_more() {
        // Two order lines of this item ended unknown: each may have been held (stock
        // down, reserved up), sold (stock down) or never made.
        let t = Tally {
            held: 1,
            unresolved_down: 2,
            unresolved_reserved: 2,
            ..tally(100, 0, 0)
        };
        for (stock, reserved) in [(99, 1), (98, 2), (97, 3), (97, 1)] {
            assert!(
                !t.verify(Observed { stock, reserved }).mismatch,
                "{stock}/{reserved}"
            );
        }
        assert!(
            t.verify(Observed {
                stock: 99,
                reserved: 0
            })
            .mismatch,
            "the known held line must stay reserved"
        );
        assert!(
            t.verify(Observed {
                stock: 97,
                reserved: 4
            })
            .mismatch
        );
    }

    #[test]
    fn units_sold_by_answers_and_by_read_back_are_summed_over_items() {
        let books = ItemBooks::default();
        books.loaded.store(100, Ordering::Relaxed);
        books.add_hold(HoldFinal::Confirmed, 3);
        books.add_hold(HoldFinal::Held, 2);
        let mut r = CheckReport::default();
        r.add_item(
            "a",
            &books.tally(),
            Observed {
                stock: 95,
                reserved: 2,
            },
        );
        r.add_item(
            "b",
            &tally(10, 4, 1),
            Observed {
                stock: 7,
                reserved: 0,
            },
        );
        r.finish();
        assert_eq!(r.verdict, "passed");
        assert_eq!((r.units_sold_by_answers, r.units_sold_read_back), (6, 6));
    }

    #[test]
    fn report_fails_on_any_mismatch_and_bounds_its_notes() {
        let mut r = CheckReport::default();
        for i in 0..50 {
            r.add_item(
                &format!("i{i}"),
                &tally(5, 0, 0),
                Observed {
                    stock: 4,
                    reserved: 0,
                },
            );
        }
        r.finish();
        assert_eq!(r.verdict, "failed");
        assert_eq!(r.stock_mismatches, 50);
        assert_eq!(r.notes.len(), CheckReport::NOTES_MAX);

        let mut ok = CheckReport::default();
        ok.add_item(
            "a",
            &tally(5, 1, 0),
            Observed {
                stock: 4,
                reserved: 0,
            },
        );
        ok.finish();
        assert_eq!(ok.verdict, "passed");
    }
}
