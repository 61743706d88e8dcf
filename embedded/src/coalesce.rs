//! The rows of holds and fire-and-forget requests one views transaction makes, kept
//! until it ends, so that a row made and changed (or made and deleted) within one
//! transaction is written once, or not at all.
//!
//! Most holds end soon after they are made: an order's lines a few milliseconds after
//! it is placed, a checkout's hold when it pays. Most fire-and-forget requests are
//! decided a few milliseconds after they are accepted. The views commit every 20 ms, so
//! the making and the end often meet in one transaction: a hold then costs one insert
//! of its final row instead of an insert, an update, and the pending holds' index entry
//! made and deleted; a request decided in the transaction that accepted it costs
//! nothing. What the transaction commits is the same rows either way.

use std::collections::HashMap;
use std::sync::Arc;

use nrtxn_actors::{Entry, HoldStatus, Request};

/// A hold made in the running transaction, as it stands now.
pub(crate) struct HoldRow {
    pub(crate) shop: Arc<str>,
    pub(crate) hold_id: Arc<str>,
    pub(crate) item: Arc<str>,
    pub(crate) qty: i64,
    pub(crate) expires_at: Option<i64>,
    pub(crate) status: HoldStatus,
    pub(crate) seq: Option<u64>,
    pub(crate) buyer: Option<Arc<str>>,
}

/// What a step of a hold made before this transaction still asks of its row.
pub(crate) enum Earlier {
    Ended(HoldStatus),
    /// An order's line ended: its row goes (the line is read from the log, and listed
    /// with its order).
    Gone,
    Extended,
}

type Key = (Arc<str>, Arc<str>);

/// The rows made in the running transaction, in the order they were made.
#[derive(Default)]
pub(crate) struct Pending {
    holds: Vec<Option<HoldRow>>,
    hold_at: HashMap<Key, usize>,
    /// Accepted requests; `None` once decided in this transaction. Their bodies are
    /// encoded only for the rows written.
    requests: Vec<Option<Request>>,
    request_at: HashMap<Key, usize>,
}

/// Two rows under one key within a transaction: the store's unique key refuses it, and so
/// does this, so the transaction fails as it would have.
fn twice(what: &str, shop: &str, key: &str) -> rusqlite::Error {
    rusqlite::Error::ToSqlConversionFailure(
        format!("{what} {key:?} of shop {shop:?} made twice in one transaction").into(),
    )
}

impl Pending {
    pub(crate) fn new() -> Pending {
        Pending::default()
    }

    /// A hold made by `e` (an ok hold with its id).
    pub(crate) fn hold_made(
        &mut self,
        e: &Entry,
        hold_id: &Arc<str>,
    ) -> Result<(), rusqlite::Error> {
        let key = (e.shop.clone(), hold_id.clone());
        if self.hold_at.contains_key(&key) {
            return Err(twice("hold", &e.shop, hold_id));
        }
        self.hold_at.insert(key, self.holds.len());
        self.holds.push(Some(HoldRow {
            shop: e.shop.clone(),
            hold_id: hold_id.clone(),
            item: e.item.clone(),
            qty: e.qty,
            expires_at: e.expires_at,
            status: HoldStatus::Held,
            seq: e.seq,
            buyer: e.buyer.clone(),
        }));
        Ok(())
    }

    /// A hold ended (`Ended`) or extended by `e`: applied to its row if the hold was made
    /// in this transaction (`None`), else what its row in the store still needs.
    pub(crate) fn hold_changed(
        &mut self,
        e: &Entry,
        hold_id: &Arc<str>,
        ended: Option<HoldStatus>,
    ) -> Option<Earlier> {
        let key = (e.shop.clone(), hold_id.clone());
        // An ended line keeps no row: an order's lines are many, and its record is the
        // order's row.
        let line_ended = ended.is_some() && hold_id.starts_with(nrtxn_actors::LINE_PREFIX);
        let Some(&i) = self.hold_at.get(&key) else {
            return Some(match ended {
                Some(_) if line_ended => Earlier::Gone,
                Some(status) => Earlier::Ended(status),
                None => Earlier::Extended,
            });
        };
        if line_ended {
            self.hold_at.remove(&key);
            self.holds[i] = None;
            return None;
        }
        // A line ended (and dropped) in this transaction left `hold_at` with it.
        let row = self.holds[i].as_mut()?;
        match ended {
            Some(status) => row.status = status,
            None => row.expires_at = e.expires_at,
        }
        row.seq = e.seq;
        None
    }

    /// A fire-and-forget request accepted.
    pub(crate) fn accepted(&mut self, r: &Request) -> Result<(), rusqlite::Error> {
        let key = (r.shop.clone(), r.key.clone());
        if self.request_at.contains_key(&key) {
            return Err(twice("request", &r.shop, &r.key));
        }
        self.request_at.insert(key, self.requests.len());
        self.requests.push(Some(r.clone()));
        Ok(())
    }

    /// A request decided (or retired): true if it was accepted in this transaction (its
    /// row is then never written), false if its row must be deleted from the store.
    pub(crate) fn retired(&mut self, shop: &Arc<str>, key: &Arc<str>) -> bool {
        match self.request_at.remove(&(shop.clone(), key.clone())) {
            Some(i) => {
                self.requests[i] = None;
                true
            }
            None => false,
        }
    }

    /// The rows to write when the transaction ends: holds, then requests, each in the
    /// order made.
    pub(crate) fn take(&mut self) -> (Vec<HoldRow>, Vec<Request>) {
        self.hold_at.clear();
        self.request_at.clear();
        let requests = std::mem::take(&mut self.requests)
            .into_iter()
            .flatten()
            .collect();
        let holds = std::mem::take(&mut self.holds)
            .into_iter()
            .flatten()
            .collect();
        (holds, requests)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nrtxn_actors::{Op, Status};

    fn hold_entry(op: Op, seq: u64, expires_at: i64) -> Entry {
        let mut req = Request::new("shop".into(), "sku".into(), "h1".into(), op, 2, 1_000);
        req.hold_id = Some("h1".into());
        let mut e = Entry::of_request(&req, 1_000);
        e.status = Status::Ok;
        e.seq = Some(seq);
        e.expires_at = Some(expires_at);
        e
    }

    #[test]
    fn an_orders_line_keeps_no_row_once_ended() {
        let mut p = Pending::new();
        let line: Arc<str> = "~line:o1:0".into();
        p.hold_made(&hold_entry(Op::Hold, 5, 9_000), &line).unwrap();
        let ended = p.hold_changed(
            &hold_entry(Op::Confirm, 6, 9_000),
            &line,
            Some(HoldStatus::Confirmed),
        );
        assert!(ended.is_none());
        assert!(
            p.take().0.is_empty(),
            "made and ended in one transaction: no row"
        );
        let later = p.hold_changed(
            &hold_entry(Op::Release, 7, 9_000),
            &line,
            Some(HoldStatus::Released),
        );
        assert!(
            matches!(later, Some(Earlier::Gone)),
            "made before: its row goes"
        );
    }

    #[test]
    fn a_hold_made_and_ended_in_one_transaction_is_one_row_as_it_ended() {
        let mut p = Pending::default();
        let id: Arc<str> = "h1".into();
        p.hold_made(&hold_entry(Op::Hold, 5, 9_000), &id).unwrap();
        assert!(p
            .hold_changed(&hold_entry(Op::Extend, 6, 12_000), &id, None)
            .is_none());
        let ended = p.hold_changed(
            &hold_entry(Op::Confirm, 7, 12_000),
            &id,
            Some(HoldStatus::Confirmed),
        );
        assert!(ended.is_none());
        let (holds, requests) = p.take();
        assert!(requests.is_empty());
        assert_eq!(holds.len(), 1);
        let h = &holds[0];
        assert_eq!(
            (h.status, h.seq, h.expires_at, h.qty, &*h.item),
            (HoldStatus::Confirmed, Some(7), Some(12_000), 2, "sku")
        );
        // The next transaction starts empty: an ending there updates the stored row.
        let later = p.hold_changed(
            &hold_entry(Op::Release, 8, 12_000),
            &id,
            Some(HoldStatus::Released),
        );
        assert!(matches!(later, Some(Earlier::Ended(HoldStatus::Released))));
    }

    #[test]
    fn a_hold_or_request_made_twice_in_one_transaction_fails_it() {
        let mut p = Pending::default();
        let id: Arc<str> = "h1".into();
        p.hold_made(&hold_entry(Op::Hold, 5, 9_000), &id).unwrap();
        assert!(p.hold_made(&hold_entry(Op::Hold, 6, 9_000), &id).is_err());
        let r = Request::new("shop".into(), "sku".into(), "k".into(), Op::Decrement, 1, 0);
        p.accepted(&r).unwrap();
        assert!(p.accepted(&r).is_err());
    }

    #[test]
    fn a_request_decided_in_the_transaction_that_accepted_it_is_never_written() {
        let mut p = Pending::default();
        let req =
            |k: &str| Request::new("shop".into(), "sku".into(), k.into(), Op::Decrement, 1, 0);
        for k in ["a", "b", "c"] {
            p.accepted(&req(k)).unwrap();
        }
        assert!(p.retired(&"shop".into(), &"b".into()));
        // Accepted in an earlier transaction: its stored row must be deleted.
        assert!(!p.retired(&"shop".into(), &"z".into()));
        let (_, requests) = p.take();
        let keys: Vec<&str> = requests.iter().map(|r| &*r.key).collect();
        assert_eq!(keys, ["a", "c"], "the rest, in the order accepted");
    }
}
