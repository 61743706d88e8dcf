//! The processor's apply step: the one place where an item's stock changes, and so the
//! rule that prevents overselling.
//!
//! Pure functions over an item's state. The processor calls them in mailbox order, one
//! request at a time, on the only copy of the item's state it owns; everything else
//! (queues, journal, replies) is plumbing around this file.

use std::sync::Arc;

use crate::types::{
    bound, is_order_item, Entry, ItemState, LoadTerms, Millis, Op, Request, Status, STOCK_MAX,
};

/// Decides `req` against the item's current state (`None`: the item is unknown) and
/// returns the journal entry that records the decision. On `ok` the state is updated in
/// place and its sequence advanced; every decision about a known item, accepted or not,
/// takes the next sequence number, so an item's journal is gapless.
pub fn apply(
    state: Option<&mut ItemState>,
    req: &Request,
    now: Millis,
    request_ttl_ms: i64,
) -> Entry {
    apply_within(state, req, now, request_ttl_ms, req.qty)
}

/// [`apply`], where a partial fill ([`Request::min_qty`]) takes at most `cap` (what a
/// buyer's limit leaves them, at least the request's `min_qty`).
pub fn apply_within(
    state: Option<&mut ItemState>,
    req: &Request,
    now: Millis,
    request_ttl_ms: i64,
    cap: i64,
) -> Entry {
    debug_assert!(
        !matches!(req.op, Op::Load | Op::Order | Op::Firm | Op::Extend) && !req.op.ends_hold(),
        "loads and hold endings have their own steps"
    );
    let mut entry = Entry::of_request(req, now);
    // Expiry first: a request that waited too long is not applied, whatever the item.
    let age_ms = now.saturating_sub(req.submitted_at);
    let expired = age_ms > request_ttl_ms;
    let Some(state) = state else {
        if expired {
            entry.status = Status::Expired;
            entry.reason = Some(format!(
                "waited {age_ms} ms, longer than the request TTL of {request_ttl_ms} ms"
            ));
        } else {
            entry.status = Status::UnknownItem;
            entry.reason = Some(format!("item {} is not loaded in this shop", req.item));
        }
        return entry;
    };
    let before = *state;
    let mut after = before;
    after.seq = before.seq + 1;
    if expired {
        entry.status = Status::Expired;
        entry.reason = Some(format!(
            "waited {age_ms} ms, longer than the request TTL of {request_ttl_ms} ms"
        ));
    } else {
        match req.op {
            Op::Decrement => decrement(req, cap, before, &mut after, &mut entry),
            Op::Increment => increment(req, before, &mut after, &mut entry),
            Op::Hold => hold(req, cap, now, before, &mut after, &mut entry),
            Op::Adjust => adjust(req, before, &mut after, &mut entry),
            Op::Load
            | Op::Confirm
            | Op::Release
            | Op::Expire
            | Op::Order
            | Op::Firm
            | Op::Extend
            | Op::SoldOut
            | Op::LowStock
            | Op::BackInStock
            | Op::ReleaseHolds => {
                unreachable!("checked above")
            }
        }
    }
    // Invariants 1 and 5, asserted before the entry can reach the journal.
    assert!(
        after.stock >= 0,
        "oversell: {} -> {}",
        before.stock,
        after.stock
    );
    *state = after;
    fill_states(&mut entry, before, after);
    assert_follows(before, &entry);
    entry
}

/// What a sale or hold takes of `available`: all of its `qty` if there is that much;
/// with `min_qty`, as much as there is (and `cap` allows) down to `min_qty`. `None`:
/// refused, and `entry` says why. A partial take is the entry's `qty`, and what was
/// asked its `qty_asked`.
#[inline]
fn taking(req: &Request, cap: i64, available: i64, entry: &mut Entry) -> Option<i64> {
    let take = match req.min_qty {
        None => (req.qty <= available).then_some(req.qty),
        Some(min) => Some(req.qty.min(available).min(cap)).filter(|n| *n >= min),
    };
    match take {
        Some(n) if n < req.qty => {
            entry.qty = n;
            entry.qty_asked = Some(req.qty);
        }
        Some(_) => {}
        None => {
            entry.status = Status::InsufficientStock;
            entry.reason = Some(match req.min_qty {
                None => format!("requested {}, available {available}", req.qty),
                Some(min) => format!(
                    "requested {} (at least {min}), available {available}",
                    req.qty
                ),
            });
        }
    }
    take
}

/// A sale: the quantity leaves the stock, if the stock has it.
#[inline]
fn decrement(req: &Request, cap: i64, before: ItemState, after: &mut ItemState, entry: &mut Entry) {
    if let Some(n) = taking(req, cap, before.stock, entry) {
        after.stock = before.stock - n;
    }
}

/// A delivery: the quantity joins the stock, up to [`STOCK_MAX`].
#[inline]
fn increment(req: &Request, before: ItemState, after: &mut ItemState, entry: &mut Entry) {
    match before.stock.checked_add(req.qty) {
        Some(stock) if stock <= STOCK_MAX => after.stock = stock,
        _ => {
            entry.status = Status::LimitExceeded;
            entry.reason = Some(format!(
                "stock {} + {} would pass the limit {STOCK_MAX}",
                before.stock, req.qty
            ));
        }
    }
}

/// Like a sale, but the quantity is set aside rather than gone: it stays the item's
/// until the hold is confirmed, or comes back when it is not.
#[inline]
fn hold(
    req: &Request,
    cap: i64,
    now: Millis,
    before: ItemState,
    after: &mut ItemState,
    entry: &mut Entry,
) {
    if let Some(n) = taking(req, cap, before.stock, entry) {
        after.stock = before.stock - n;
        after.reserved = before.reserved + n;
        entry.hold_id = Some(req.key.clone());
        entry.expires_at = Some(now.saturating_add(req.ttl_ms));
    }
}

/// A correction either way, with its reason: the stock stays within `0..=STOCK_MAX`.
#[inline]
fn adjust(req: &Request, before: ItemState, after: &mut ItemState, entry: &mut Entry) {
    match before.stock.checked_add(req.qty) {
        Some(stock) if (0..=STOCK_MAX).contains(&stock) => after.stock = stock,
        Some(stock) if stock < 0 => {
            entry.status = Status::InsufficientStock;
            entry.reason = Some(format!(
                "adjustment {} ({}) would take the stock {} below 0",
                req.qty,
                req.reason.as_deref().unwrap_or("no reason"),
                before.stock
            ));
        }
        _ => {
            entry.status = Status::LimitExceeded;
            entry.reason = Some(format!(
                "stock {} + {} would pass the limit {STOCK_MAX}",
                before.stock, req.qty
            ));
        }
    }
}

/// Refuses `req` on a known item without changing its stock, for a reason found outside
/// the item's state (a bound of the processor's): still the item's next entry.
pub fn reject(
    state: &mut ItemState,
    req: &Request,
    now: Millis,
    status: Status,
    reason: String,
) -> Entry {
    let before = *state;
    let after = ItemState {
        seq: before.seq + 1,
        ..before
    };
    *state = after;
    let mut entry = Entry {
        status,
        reason: Some(reason),
        ..Entry::of_request(req, now)
    };
    fill_states(&mut entry, before, after);
    assert_follows(before, &entry);
    entry
}

/// Ends a pending hold of `qty` on the item: `Confirm` sells the reserved quantity,
/// `Release` and `Expire` give it back to the stock. The caller (the processor, which
/// keeps the pending holds) has checked that the hold is pending and that `qty` is its
/// quantity; the request TTL does not apply, since the stock was taken when the hold
/// was made and an ending must never be lost to a queue's delay.
pub fn apply_hold_end(state: &mut ItemState, req: &Request, qty: i64, now: Millis) -> Entry {
    assert!(req.op.ends_hold(), "not a hold ending: {:?}", req.op);
    let before = *state;
    let mut after = before;
    after.seq = before.seq + 1;
    if is_order_item(&req.item) {
        // An order's record: its item counts pending records in `reserved`, and has no
        // stock to give back.
        after.reserved = before.reserved - 1;
    } else {
        after.reserved = before.reserved - qty;
        if req.op != Op::Confirm {
            after.stock = before.stock + qty;
        }
    }
    // Invariants 1 and 2: a hold never gives back more than it set aside.
    assert!(
        after.reserved >= 0 && after.stock >= 0,
        "hold ending below zero: {before:?} -> {after:?}"
    );
    *state = after;
    let mut entry = Entry {
        qty,
        ..Entry::of_request(req, now)
    };
    fill_states(&mut entry, before, after);
    assert_follows(before, &entry);
    entry
}

/// Records order `req.key` on its order item ([`crate::types::order_item`]): the next
/// entry of that item, a pending record of `req.qty` lines until the order ends, counted
/// in the item's `reserved`. No stock changes: the lines hold it, each on its own item.
pub fn apply_order(state: &mut ItemState, req: &Request, now: Millis) -> Entry {
    assert!(req.op == Op::Order && is_order_item(&req.item));
    let before = *state;
    let after = ItemState {
        reserved: before.reserved + 1,
        seq: before.seq + 1,
        ..before
    };
    *state = after;
    let mut entry = Entry::of_request(req, now);
    entry.hold_id = Some(req.key.clone());
    entry.expires_at = Some(now.saturating_add(req.ttl_ms));
    fill_states(&mut entry, before, after);
    assert_follows(before, &entry);
    entry
}

/// Gives pending hold `req.hold_id` (on this item) a new expiry,
/// `req.submitted_at + req.ttl_ms`: the item's next entry, no stock changes.
pub fn apply_extend(state: &mut ItemState, req: &Request, qty: i64, now: Millis) -> Entry {
    assert!(req.op == Op::Extend);
    let before = *state;
    let after = ItemState {
        seq: before.seq + 1,
        ..before
    };
    *state = after;
    let mut entry = Entry {
        qty,
        ..Entry::of_request(req, now)
    };
    entry.expires_at = Some(req.submitted_at.saturating_add(req.ttl_ms));
    fill_states(&mut entry, before, after);
    assert_follows(before, &entry);
    entry
}

/// An operator's marker on the item (the end of a release of its holds): the item's next
/// entry, answering `req`, no stock changes.
pub fn apply_mark(state: &mut ItemState, req: &Request, now: Millis) -> Entry {
    let before = *state;
    let after = ItemState {
        seq: before.seq + 1,
        ..before
    };
    *state = after;
    let mut entry = Entry::of_request(req, now);
    fill_states(&mut entry, before, after);
    assert_follows(before, &entry);
    entry
}

/// Sets an item's available stock to `stock` (creating the item if needed), as the next
/// entry of its sequence.
pub fn apply_load(
    state: &mut ItemState,
    shop: &Arc<str>,
    item: &Arc<str>,
    stock: i64,
    terms: LoadTerms,
    now: Millis,
) -> Entry {
    assert!((0..=STOCK_MAX).contains(&stock), "load outside limits");
    let before = *state;
    let after = ItemState {
        stock,
        seq: before.seq + 1,
        ..before.with_terms(terms)
    };
    *state = after;
    let mut entry = Entry::decided(shop.clone(), item.clone(), Op::Load, stock, now, now);
    fill_states(&mut entry, before, after);
    assert_follows(before, &entry);
    entry
}

/// Paired with recovery's [`crate::verify::Verifier`]: the entry follows from the state
/// before it by the rules of its op, computed apart from the step that made it.
fn assert_follows(before: ItemState, entry: &Entry) {
    if let Err(why) = crate::verify::check_entry(before, entry) {
        panic!("entry does not follow from the item's state: {why}");
    }
}

fn fill_states(entry: &mut Entry, before: ItemState, after: ItemState) {
    entry.stock_before = Some(before.stock);
    entry.stock_after = Some(after.stock);
    entry.reserved_after = Some(after.reserved);
    entry.seq = Some(after.seq);
    entry.prev_seq = Some(before.seq);
    entry.opens_at = bound(after.opens_at);
    entry.closes_at = bound(after.closes_at);
    entry.low_stock_at = bound(after.low_stock_at);
}

/// The stock alert an item's entry calls for, if its change crossed one of the item's
/// levels (the entry carries the item's `low_stock_at`): [`Op::SoldOut`] when the
/// available stock reached 0 from above, [`Op::BackInStock`] when it rose from 0,
/// [`Op::LowStock`] when it fell from above `low_stock_at` to at or below it (but not to
/// 0). The item's first load is no crossing, and neither is a refusal (it moves
/// nothing). Costs a few comparisons: every entry is asked.
#[inline]
pub fn crossing_of(cause: &Entry) -> Option<Op> {
    let (Some(before), Some(after)) = (cause.stock_before, cause.stock_after) else {
        return None;
    };
    if before == after
        || cause.status != Status::Ok
        || cause.op.is_alert()
        || cause.prev_seq == Some(0)
    {
        return None;
    }
    let low = cause.low_stock_at.unwrap_or(0);
    if before > 0 && after == 0 {
        Some(Op::SoldOut)
    } else if before == 0 && after > 0 {
        Some(Op::BackInStock)
    } else if low > 0 && before > low && after <= low {
        Some(Op::LowStock)
    } else {
        None
    }
}

/// The stock alert `cause` (an item's entry, just applied to `state`) calls for
/// ([`crossing_of`]), as the item's next entry: `state` moves to its seq.
pub fn crossing(state: &mut ItemState, cause: &Entry) -> Option<Entry> {
    let op = crossing_of(cause)?;
    let prior = *state;
    state.seq += 1;
    let at = cause.completed_at;
    let mut entry = Entry::decided(cause.shop.clone(), cause.item.clone(), op, 0, at, at);
    fill_states(&mut entry, prior, *state);
    assert_follows(prior, &entry);
    Some(entry)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    const TTL: i64 = 1_000;

    fn req(key: &str, op: Op, qty: i64, submitted_at: Millis) -> Request {
        Request::new("s".into(), "i".into(), key.into(), op, qty, submitted_at)
    }

    fn loaded(stock: i64) -> (HashMap<Arc<str>, ItemState>, Arc<str>) {
        let mut items = HashMap::new();
        let item: Arc<str> = "i".into();
        let state = items.entry(item.clone()).or_default();
        apply_load(state, &"s".into(), &item, stock, LoadTerms::KEEP, 0);
        (items, item)
    }

    #[test]
    fn decrement_within_stock_is_applied_and_sequenced() {
        let (mut items, item) = loaded(10);
        let e = apply(items.get_mut(&item), &req("k", Op::Decrement, 3, 0), 5, TTL);
        assert_eq!(e.status, Status::Ok);
        assert_eq!((e.stock_before, e.stock_after), (Some(10), Some(7)));
        assert_eq!((e.prev_seq, e.seq), (Some(1), Some(2)));
        assert_eq!(items[&item].stock, 7);
    }

    #[test]
    fn decrement_beyond_stock_is_rejected_not_partial() {
        let (mut items, item) = loaded(2);
        let e = apply(items.get_mut(&item), &req("k", Op::Decrement, 3, 0), 5, TTL);
        assert_eq!(e.status, Status::InsufficientStock);
        assert_eq!((e.stock_before, e.stock_after), (Some(2), Some(2)));
        assert_eq!(items[&item].stock, 2, "nothing taken");
        assert_eq!(e.seq, Some(2), "a rejection is still the item's next entry");
    }

    #[test]
    fn stock_never_goes_negative_and_is_conserved_over_random_requests() {
        let (mut items, item) = loaded(500);
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        let (mut ok_dec, mut ok_inc) = (0i64, 0i64);
        for n in 0..10_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let qty = (x % 7) as i64 + 1;
            let op = if x.is_multiple_of(5) {
                Op::Increment
            } else {
                Op::Decrement
            };
            let e = apply(
                items.get_mut(&item),
                &req(&n.to_string(), op, qty, 0),
                0,
                TTL,
            );
            assert!(e.stock_after.unwrap() >= 0);
            assert_eq!(e.seq.unwrap(), e.prev_seq.unwrap() + 1);
            if e.status == Status::Ok {
                match op {
                    Op::Decrement => ok_dec += qty,
                    _ => ok_inc += qty,
                }
            }
        }
        assert_eq!(items[&item].stock, 500 - ok_dec + ok_inc);
        assert_eq!(items[&item].seq, 10_001);
    }

    #[test]
    fn expired_request_is_not_applied_but_recorded() {
        let (mut items, item) = loaded(10);
        let e = apply(
            items.get_mut(&item),
            &req("k", Op::Decrement, 1, 0),
            TTL + 1,
            TTL,
        );
        assert_eq!(e.status, Status::Expired);
        assert_eq!(items[&item].stock, 10);
        assert_eq!(e.seq, Some(2));
        // Exactly at the TTL is still in time.
        let e = apply(
            items.get_mut(&item),
            &req("k2", Op::Decrement, 1, 0),
            TTL,
            TTL,
        );
        assert_eq!(e.status, Status::Ok);
    }

    #[test]
    fn unknown_item_is_an_outcome_without_sequence() {
        let e = apply(None, &req("k", Op::Decrement, 1, 0), 0, TTL);
        assert_eq!(e.status, Status::UnknownItem);
        assert_eq!((e.seq, e.stock_after), (None, None));
        assert_eq!(e.outcome().unwrap().request_key.as_ref(), "k");
    }

    #[test]
    fn increment_past_the_stock_limit_is_refused() {
        let (mut items, item) = loaded(STOCK_MAX);
        let e = apply(items.get_mut(&item), &req("k", Op::Increment, 1, 0), 0, TTL);
        assert_eq!(e.status, Status::LimitExceeded);
        assert_eq!(items[&item].stock, STOCK_MAX);
    }

    #[test]
    fn hold_moves_stock_to_reserved_and_its_endings_sell_or_return_it() {
        let (mut items, item) = loaded(10);
        let mut hold = req("h1", Op::Hold, 4, 0);
        hold.ttl_ms = 200;
        let e = apply(items.get_mut(&item), &hold, 5, TTL);
        assert_eq!(e.status, Status::Ok);
        assert_eq!(
            (e.hold_id.as_deref(), e.expires_at),
            (Some("h1"), Some(205))
        );
        let st = items[&item];
        assert_eq!((st.stock, st.reserved, st.seq), (6, 4, 2));
        let mut confirm = req("~end:h1", Op::Confirm, 0, 0);
        confirm.hold_id = Some("h1".into());
        let e = apply_hold_end(items.get_mut(&item).unwrap(), &confirm, 4, 6);
        assert_eq!(
            (e.qty, e.stock_after, e.reserved_after),
            (4, Some(6), Some(0))
        );
        assert_eq!((e.prev_seq, e.seq), (Some(2), Some(3)));
        let e = apply(items.get_mut(&item), &hold_of("h2", 6), 7, TTL);
        assert_eq!(e.status, Status::Ok);
        for (op, stock) in [(Op::Release, 3), (Op::Expire, 6)] {
            let mut end = req("~end:h2", op, 0, 0);
            end.hold_id = Some("h2".into());
            let e = apply_hold_end(items.get_mut(&item).unwrap(), &end, 3, 8);
            assert_eq!(e.stock_after, Some(stock), "{op:?} gives the quantity back");
        }
        // The stock never counted the reserved part: conservation holds throughout.
        assert_eq!(items[&item].stock + items[&item].reserved, 6);
    }

    fn hold_of(key: &str, qty: i64) -> Request {
        let mut r = req(key, Op::Hold, qty, 0);
        r.ttl_ms = 1_000;
        r
    }

    #[test]
    fn hold_beyond_stock_is_rejected_and_reserves_nothing() {
        let (mut items, item) = loaded(3);
        let e = apply(items.get_mut(&item), &hold_of("h", 4), 0, TTL);
        assert_eq!(e.status, Status::InsufficientStock);
        assert_eq!((items[&item].stock, items[&item].reserved), (3, 0));
        assert_eq!((e.hold_id, e.expires_at), (None, None));
    }

    #[test]
    fn load_sets_absolute_stock_as_next_sequence() {
        let (mut items, item) = loaded(10);
        apply(items.get_mut(&item), &req("k", Op::Decrement, 4, 0), 0, TTL);
        let e = apply_load(
            items.get_mut(&item).unwrap(),
            &"s".into(),
            &item,
            100,
            LoadTerms::KEEP,
            0,
        );
        assert_eq!((e.stock_before, e.stock_after), (Some(6), Some(100)));
        assert_eq!((e.prev_seq, e.seq), (Some(2), Some(3)));
        assert!(e.outcome().is_none(), "loads are not polled by key");
    }

    /// Applies `op` of `qty` to the item and returns the alert its change calls for,
    /// checking that the alert takes the next seq and moves nothing.
    fn alert_after(state: &mut ItemState, op: Op, qty: i64) -> Option<Op> {
        let e = apply(Some(state), &req("k", op, qty, 0), 0, TTL);
        let alert = crossing(state, &e)?;
        assert_eq!(
            (alert.prev_seq, alert.seq),
            (e.seq, Some(e.seq.unwrap() + 1))
        );
        assert_eq!(
            (alert.stock_before, alert.stock_after),
            (e.stock_after, e.stock_after)
        );
        assert_eq!(state.seq, alert.seq.unwrap());
        assert!(alert.outcome().is_none(), "an alert answers no request");
        Some(alert.op)
    }

    #[test]
    fn crossings_fire_once_each_when_the_stock_crosses_a_level() {
        let (mut items, item) = loaded(10);
        let first = Entry {
            prev_seq: Some(0),
            ..apply_load(
                &mut ItemState::default(),
                &"s".into(),
                &item,
                5,
                LoadTerms::KEEP,
                0,
            )
        };
        assert_eq!(
            crossing(&mut ItemState::default(), &first),
            None,
            "a first load"
        );
        let st = items.get_mut(&item).unwrap();
        let terms = LoadTerms {
            low_stock_at: Some(3),
            ..LoadTerms::KEEP
        };
        let load = apply_load(st, &"s".into(), &item, 10, terms, 0);
        assert_eq!((crossing(st, &load), st.low_stock_at), (None, 3));
        assert_eq!(alert_after(st, Op::Decrement, 6), None, "10 -> 4, above 3");
        assert_eq!(
            alert_after(st, Op::Decrement, 1),
            Some(Op::LowStock),
            "4 -> 3"
        );
        assert_eq!(alert_after(st, Op::Decrement, 1), None, "3 -> 2, still low");
        assert_eq!(
            alert_after(st, Op::Decrement, 5),
            None,
            "refused: nothing moved"
        );
        assert_eq!(
            alert_after(st, Op::Decrement, 2),
            Some(Op::SoldOut),
            "2 -> 0"
        );
        assert_eq!(
            alert_after(st, Op::Increment, 8),
            Some(Op::BackInStock),
            "0 -> 8"
        );
        assert_eq!(
            alert_after(st, Op::Decrement, 8),
            Some(Op::SoldOut),
            "8 -> 0 jumps past the level: one sold_out, no low_stock"
        );
    }
}
