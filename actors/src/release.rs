//! An operator's release of an item's reservations (`POST .../items/{item}/release-holds`):
//! every pending hold of the item is released, and every order with a line on it that
//! is still held is cancelled as a whole, each by the same ending a caller's cancel
//! takes (so each is at most once, and one ended meanwhile keeps its ending). Then a
//! marker entry of the item ([`Op::ReleaseHolds`]) is journaled under the call's key
//! with the counts: a repeat of the key is answered with it and releases nothing more.
//!
//! A release interrupted by a crash before its marker is done again by the retry, for
//! the holds still pending: its counts are then the retry's. Holds made while the
//! release runs may be left pending (the listing is read once, at the start).

use std::collections::HashSet;
use std::sync::Arc;

use crate::engine::{Engine, EngineError};
use crate::orders::Ended;
use crate::types::{
    hold_end_key, now_ms, order_of_line, HoldStatus, HoldView, Op, Outcome, Request, Status,
};
use crate::work_manager::PollResult;
use crate::{HoldQuery, Reply};

/// Holds read per page of the item's pending holds.
const PAGE: usize = 1_000;

/// What a release of an item's holds did: the marker's outcome, with its counts.
#[derive(Debug)]
pub struct Released {
    pub outcome: Arc<Outcome>,
    pub holds: i64,
    pub orders: i64,
}

impl Released {
    fn of(outcome: Arc<Outcome>) -> Released {
        let counts: serde_json::Value = outcome
            .reason
            .as_deref()
            .and_then(|r| serde_json::from_str(r).ok())
            .unwrap_or_default();
        let count = |k: &str| counts[k].as_i64().unwrap_or(0);
        Released {
            holds: count("holds"),
            orders: count("orders"),
            outcome,
        }
    }
}

impl Engine {
    /// Releases `item`'s pending holds and cancels its held orders, once per `key`.
    pub async fn release_holds(
        &self,
        shop: &Arc<str>,
        item: &Arc<str>,
        key: Arc<str>,
    ) -> Result<Released, EngineError> {
        if let PollResult::Decided(o) = self.poll(shop, key.clone()).await? {
            return Ok(Released::of(o));
        }
        let (mut released, mut cancelled) = (0, 0);
        // Page by page: what a page ends leaves the listing, so the next page starts
        // after the last id read. An order is cancelled once, at its first line.
        let (mut after, mut orders_seen) = (None, HashSet::new());
        loop {
            let query = HoldQuery {
                item: Some(item.clone()),
                status: Some(HoldStatus::Held),
                ..HoldQuery::default()
            };
            let (page, next) = self.hold_page(shop, query, after, PAGE).await?;
            // The plain holds of the page in one call; a transfer's (`~`) is its own.
            let plain: Vec<_> = page
                .iter()
                .filter(|h| !h.hold_id.starts_with('~'))
                .collect();
            released += self.release_all(shop, &plain).await?;
            for h in &page {
                let Some((order, _)) = order_of_line(&h.hold_id) else {
                    continue;
                };
                if orders_seen.insert(order.to_string()) {
                    let order_id: Arc<str> = order.into();
                    if let Ended::Order { op, .. } =
                        self.end_order(shop, &order_id, Op::Release).await?
                    {
                        cancelled += i64::from(op == Op::Release);
                    }
                }
            }
            match next {
                Some(n) => after = Some(n),
                None => break,
            }
        }
        let counts = serde_json::json!({ "holds": released, "orders": cancelled });
        let marker = Request {
            reason: Some(counts.to_string().into()),
            ..Request::new(
                shop.clone(),
                item.clone(),
                key,
                Op::ReleaseHolds,
                released,
                now_ms(),
            )
        };
        Ok(Released::of(self.decide_one(shop, marker).await?))
    }

    /// Releases `holds` (plain holds of one item), each by the ending a caller's cancel
    /// takes, in one call: how many this or an earlier release ended (one that ended
    /// otherwise meanwhile keeps its ending).
    async fn release_all(&self, shop: &Arc<str>, holds: &[&HoldView]) -> Result<i64, EngineError> {
        if holds.is_empty() {
            return Ok(0);
        }
        let now = now_ms();
        let reqs = holds
            .iter()
            .map(|h| {
                let req = Request {
                    hold_id: Some(h.hold_id.clone()),
                    ..Request::new(
                        shop.clone(),
                        h.item.clone(),
                        hold_end_key(&h.hold_id),
                        Op::Release,
                        h.qty,
                        now,
                    )
                };
                (req, true)
            })
            .collect();
        let answers = self.submit(shop, reqs).await?;
        let mut released = 0;
        for reply in answers.replies {
            match reply {
                Reply::Decided(o) | Reply::Repeat(o) => {
                    released += i64::from(o.op == Op::Release && o.status == Status::Ok);
                }
                // Undecided in time: the release is not done; a retry finishes it.
                _ => return Err(EngineError::Timeout),
            }
        }
        Ok(released)
    }
}
