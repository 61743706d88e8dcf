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

use std::collections::BTreeSet;
use std::sync::Arc;

use crate::engine::{Engine, EngineError};
use crate::hold_end::HoldEnd;
use crate::orders::Ended;
use crate::types::{now_ms, order_of_line, HoldStatus, Op, Outcome, Request, Status};
use crate::work_manager::PollResult;
use crate::HoldQuery;

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
        let (holds, orders) = self.pending_of(shop, item).await?;
        let mut released = 0;
        for hold_id in &holds {
            if let HoldEnd::Decided { outcome, .. } =
                self.end_hold(shop, hold_id, Op::Release).await?
            {
                released += i64::from(outcome.op == Op::Release && outcome.status == Status::Ok);
            }
        }
        let mut cancelled = 0;
        for order_id in &orders {
            let order_id: Arc<str> = order_id.as_str().into();
            if let Ended::Order { op, .. } = self.end_order(shop, &order_id, Op::Release).await? {
                cancelled += i64::from(op == Op::Release);
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

    /// The item's pending holds (ids) and the orders (ids) of its pending lines.
    async fn pending_of(
        &self,
        shop: &Arc<str>,
        item: &Arc<str>,
    ) -> Result<(Vec<Arc<str>>, BTreeSet<String>), EngineError> {
        let (mut holds, mut orders, mut after) = (Vec::new(), BTreeSet::new(), None);
        loop {
            let query = HoldQuery {
                item: Some(item.clone()),
                status: Some(HoldStatus::Held),
                ..HoldQuery::default()
            };
            let (page, next) = self.hold_page(shop, query, after, PAGE).await?;
            for h in page {
                match order_of_line(&h.hold_id) {
                    Some((order, _)) => {
                        orders.insert(order.to_string());
                    }
                    None => holds.push(h.hold_id),
                }
            }
            match next {
                Some(n) => after = Some(n),
                None => return Ok((holds, orders)),
            }
        }
    }
}
