//! What an entry must say, computed apart from the apply step: the processor asserts it
//! before an entry can reach the journal, and every journal adapter checks it again for
//! every entry it reads back at recovery ([`Verifier`]). The two sides share this file,
//! not the apply step's code, so a fault in either is caught by the other.

use std::collections::HashMap;
use std::sync::Arc;

use crate::types::{is_order_item, Entry, ItemState, Op, Status};

/// The item's state after an entry of `op` and `qty` decided `status` on `before`, by the
/// rules of each op (see [`crate::apply`]), computed from scratch.
pub fn expected_after(op: Op, status: Status, qty: i64, before: ItemState) -> ItemState {
    let (stock, reserved) = (before.stock, before.reserved);
    let (stock, reserved) = match (status, op) {
        // An order's record counts in its order item's `reserved` until it ends.
        (Status::Ok, Op::Order) => (stock, reserved + 1),
        (Status::Ok, Op::Decrement) => (stock - qty, reserved),
        (Status::Ok, Op::Increment | Op::Adjust) => (stock + qty, reserved),
        (Status::Ok, Op::Load) => (qty, reserved),
        (Status::Ok, Op::Hold) => (stock - qty, reserved + qty),
        (Status::Ok, Op::Confirm) => (stock, reserved - qty),
        (Status::Ok, Op::Release | Op::Expire) => (stock + qty, reserved - qty),
        // A refusal, or a stock alert, changes nothing but the seq.
        _ => (stock, reserved),
    };
    // The window and the low-stock level move with loads only ([`check_entry`] takes a
    // load's own).
    ItemState {
        stock,
        reserved,
        seq: before.seq + 1,
        ..before
    }
}

/// Checks an entry against the item's state before it; `Err` says what does not follow.
pub fn check_entry(before: ItemState, e: &Entry) -> Result<ItemState, String> {
    let after = e
        .state_after()
        .ok_or_else(|| "an entry of a known item without its state".to_string())?;
    let expected = if is_order_item(&e.item) && e.op.ends_hold() && e.status == Status::Ok {
        // The ending of an order's record: one record fewer, no stock.
        ItemState {
            reserved: before.reserved - 1,
            seq: before.seq + 1,
            ..before
        }
    } else if e.op == Op::Load && e.status == Status::Ok {
        // A load sets the window and the low-stock level it says.
        ItemState {
            opens_at: after.opens_at,
            closes_at: after.closes_at,
            low_stock_at: after.low_stock_at,
            ..expected_after(e.op, e.status, e.qty, before)
        }
    } else {
        expected_after(e.op, e.status, e.qty, before)
    };
    if e.prev_seq != Some(before.seq) || after.seq != before.seq + 1 {
        return Err(format!(
            "seq {} (prev {:?}) does not follow seq {}",
            after.seq, e.prev_seq, before.seq
        ));
    }
    if e.stock_before != Some(before.stock) {
        return Err(format!(
            "seq {}: stock_before {:?}, but the entry before left {}",
            after.seq, e.stock_before, before.stock
        ));
    }
    if after != expected {
        return Err(format!(
            "seq {}: {} of {} ({}) leaves {}, not {}",
            after.seq,
            e.op.as_str(),
            e.qty,
            e.status.as_str(),
            terms_of(&after),
            terms_of(&expected),
        ));
    }
    if after.stock < 0 || after.reserved < 0 {
        return Err(format!(
            "seq {}: stock {} reserved {} below zero",
            after.seq, after.stock, after.reserved
        ));
    }
    Ok(after)
}

/// A state's numbers, as a check's refusal names them.
fn terms_of(s: &ItemState) -> String {
    format!(
        "stock {} reserved {} window {}..{} low_stock_at {}",
        s.stock, s.reserved, s.opens_at, s.closes_at, s.low_stock_at
    )
}

type ItemKey = (Arc<str>, Arc<str>);

/// Rebuilds items from a snapshot and the journal entries after it, checking each entry
/// ([`check_entry`]) in each item's seq order. Entries the snapshot already covers are
/// passed over, but only before the item's first entry past it: a seq that comes again
/// later is a duplicate.
#[derive(Default)]
pub struct Verifier {
    items: HashMap<ItemKey, (ItemState, bool)>,
    checked: u64,
}

impl Verifier {
    pub fn new(snapshot: impl IntoIterator<Item = (Arc<str>, Arc<str>, ItemState)>) -> Verifier {
        Verifier {
            items: snapshot
                .into_iter()
                .map(|(shop, item, state)| ((shop, item), (state, false)))
                .collect(),
            checked: 0,
        }
    }

    /// Checks one entry read back; `Ok(true)` when it moved its item on. Entries with no
    /// item state (an unknown item's) are not an item's and pass.
    pub fn check(&mut self, e: &Entry) -> Result<bool, String> {
        let Some(seq) = e.seq else { return Ok(false) };
        let (state, moved) = self
            .items
            .entry((e.shop.clone(), e.item.clone()))
            .or_default();
        if seq <= state.seq && !*moved {
            return Ok(false);
        }
        let after =
            check_entry(*state, e).map_err(|why| format!("item {}/{}: {why}", e.shop, e.item))?;
        *state = after;
        *moved = true;
        self.checked += 1;
        Ok(true)
    }

    /// Entries that moved an item on.
    pub fn checked(&self) -> u64 {
        self.checked
    }

    /// The items' states, and whether each moved past the snapshot.
    pub fn into_items(self) -> impl Iterator<Item = (Arc<str>, Arc<str>, ItemState, bool)> {
        self.items
            .into_iter()
            .map(|((shop, item), (state, moved))| (shop, item, state, moved))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::apply::{apply, apply_hold_end, apply_load};
    use crate::types::{LoadTerms, Request};

    fn req(op: Op, qty: i64, key: &str) -> Request {
        Request::new("s".into(), "i".into(), key.into(), op, qty, 1_000)
    }

    #[test]
    fn what_the_apply_step_writes_the_verifier_accepts_and_a_changed_entry_it_refuses() {
        let mut state = ItemState::default();
        let mut entries = vec![apply_load(
            &mut state,
            &"s".into(),
            &"i".into(),
            5,
            LoadTerms::KEEP,
            1_000,
        )];
        for (op, qty, key) in [
            (Op::Decrement, 2, "a"),
            (Op::Decrement, 9, "b"),
            (Op::Increment, 1, "c"),
            (Op::Hold, 3, "h"),
        ] {
            entries.push(apply(Some(&mut state), &req(op, qty, key), 1_000, 30_000));
        }
        let mut end = req(Op::Release, 0, "~end:h");
        end.hold_id = Some("h".into());
        entries.push(apply_hold_end(&mut state, &end, 3, 1_001));
        let mut v = Verifier::default();
        for e in &entries {
            assert_eq!(v.check(e), Ok(true), "{e:?}");
        }
        assert_eq!(v.checked(), 6);
        let (_, _, last, _) = v.into_items().next().unwrap();
        assert_eq!(last, state);

        // A sale whose stock_after was changed, a seq that comes twice, a gap.
        let mut bad = entries.clone();
        bad[1].stock_after = Some(4);
        let mut twice = entries.clone();
        twice.insert(3, entries[2].clone());
        let mut gap = entries.clone();
        gap.remove(2);
        for (name, es) in [("changed", bad), ("twice", twice), ("gap", gap)] {
            let mut v = Verifier::default();
            let err = es.iter().map(|e| v.check(e)).find_map(Result::err);
            assert!(err.is_some(), "{name} passed");
        }
    }

    #[test]
    fn entries_a_snapshot_covers_are_passed_over() {
        let mut state = ItemState::default();
        let load = apply_load(
            &mut state,
            &"s".into(),
            &"i".into(),
            5,
            LoadTerms::KEEP,
            1_000,
        );
        let sale = apply(Some(&mut state), &req(Op::Decrement, 1, "a"), 1_000, 30_000);
        let snap = ItemState {
            stock: 5,
            reserved: 0,
            seq: 1,
            ..ItemState::default()
        };
        let mut v = Verifier::new([("s".into(), "i".into(), snap)]);
        assert_eq!(v.check(&load), Ok(false));
        assert_eq!(v.check(&sale), Ok(true));
        // The load again after the sale moved the item on: a duplicate.
        assert!(v.check(&load).is_err());
    }
}
