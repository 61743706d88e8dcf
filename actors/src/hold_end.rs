//! Ending a hold on a caller's request (confirm or cancel): where the hold is found,
//! the ending request built and decided. The HTTP layer only decodes the call and
//! answers with what this returns; expiries end holds through the processors' wheel,
//! and an order's lines end with their order (`orders.rs`).
//!
//! Each ending of a hold (confirm, cancel, expiry) is a request under one key,
//! [`hold_end_key`], so a hold ends once: a second confirm is answered with the first,
//! and a confirm after a cancel or an expiry with that ending.

use std::future::Future;
use std::sync::Arc;
use std::time::Instant;

use crate::engine::{Engine, EngineError};
use crate::reply::Reply;
use crate::types::{hold_end_key, now_ms, Millis, Op, Outcome, Request, Status};
use crate::work_manager::PollResult;

/// What asking to end a hold came to.
#[derive(Debug)]
pub enum HoldEnd {
    /// No hold of that id in the shop.
    Unknown,
    /// One of an order's lines (`~` ids): it ends with its order.
    OrderLine,
    /// Not decided within the reply timeout: the caller polls the hold.
    Pending,
    /// Decided: `outcome` is the ending that holds for the hold, this one or the one
    /// before it (`outcome.op` tells which).
    Decided {
        item: Arc<str>,
        qty: i64,
        expires_at: Millis,
        outcome: Arc<Outcome>,
    },
}

/// A caller's call about a hold or an order, under one reply timeout: when it ends, and
/// what a read past it says.
#[derive(Clone, Copy)]
pub(crate) struct CallBy<'a> {
    pub deadline: Instant,
    /// `hold` or `order`, and its id.
    pub kind: &'static str,
    pub id: &'a str,
    /// What nothing was, past the deadline: `ended`, `extended`.
    pub changed: &'static str,
}

impl<'a> CallBy<'a> {
    pub fn hold(deadline: Instant, id: &'a str, changed: &'static str) -> Self {
        CallBy {
            deadline,
            kind: "hold",
            id,
            changed,
        }
    }

    pub fn order(deadline: Instant, id: &'a str, changed: &'static str) -> Self {
        CallBy {
            deadline,
            kind: "order",
            id,
            changed,
        }
    }
}

impl Engine {
    /// Ends hold `hold_id` of `shop` by `op` ([`Op::Confirm`] or [`Op::Release`]).
    pub async fn end_hold(
        &self,
        shop: &Arc<str>,
        hold_id: &Arc<str>,
        op: Op,
    ) -> Result<HoldEnd, EngineError> {
        assert!(
            matches!(op, Op::Confirm | Op::Release),
            "a caller ends a hold by confirm or release, not {op:?}"
        );
        if hold_id.starts_with('~') {
            return Ok(HoldEnd::OrderLine);
        }
        self.end_any_hold(shop, hold_id, op, false).await
    }

    /// Ends hold `hold_id` (one of nrtxn's own, a transfer's, too) by `op`; `firm`: the
    /// ending stands past the hold's expiry, as a check-back's does.
    pub(crate) async fn end_any_hold(
        &self,
        shop: &Arc<str>,
        hold_id: &Arc<str>,
        op: Op,
        firm: bool,
    ) -> Result<HoldEnd, EngineError> {
        // One reply timeout for the whole call: the read that finds the hold and the
        // ending's decision share it.
        let deadline = Instant::now() + self.reply_timeout();
        // The hold's item routes the request to its processor. A hold is answered to
        // its maker only once durable, so the journal has every hold a caller can know.
        let found = self
            .read_by(
                CallBy::hold(deadline, hold_id, "ended"),
                self.hold_of(shop, hold_id),
            )
            .await?;
        let Some((item, qty, expires_at)) = found else {
            return Ok(HoldEnd::Unknown);
        };
        let req = Request {
            hold_id: Some(hold_id.clone()),
            by_check: firm,
            ..Request::new(
                shop.clone(),
                item.clone(),
                hold_end_key(hold_id),
                op,
                qty,
                now_ms(),
            )
        };
        let answers = self.submit_by(shop, vec![(req, true)], deadline).await?;
        let outcome = match answers.replies.into_iter().next() {
            Some(Reply::Repeat(o) | Reply::Decided(o)) => o,
            _ => return Ok(HoldEnd::Pending),
        };
        if outcome.status == Status::UnknownHold {
            return Ok(HoldEnd::Unknown);
        }
        // What ends a hold is one of its endings, for this hold.
        debug_assert!(
            matches!(outcome.op, Op::Confirm | Op::Release | Op::Expire),
            "a hold's ending key holds {:?}",
            outcome.op
        );
        Ok(HoldEnd::Decided {
            item,
            qty,
            // The expiry the hold had when it ended, which an extension may have moved
            // since it was made (endings journaled before it was kept say none).
            expires_at: outcome.expires_at.unwrap_or(expires_at),
            outcome,
        })
    }

    /// `read`, a step of caller's call `by` (about a hold or an order) whose one reply
    /// timeout ends at its deadline: past it, [`EngineError::NotReadInTime`] (a `503`)
    /// saying that nothing was changed (ended, extended).
    pub(crate) async fn read_by<T>(
        &self,
        by: CallBy<'_>,
        read: impl Future<Output = Result<T, EngineError>>,
    ) -> Result<T, EngineError> {
        let not_read = || {
            EngineError::NotReadInTime(format!(
                "{} {}: not read within the reply timeout ({} ms); nothing was {}",
                by.kind,
                by.id,
                self.reply_timeout().as_millis(),
                by.changed
            ))
        };
        match tokio::time::timeout_at(by.deadline.into(), read).await {
            Ok(Ok(read)) => Ok(read),
            // The read's own bound (a reply timeout from when it began) may end in the
            // same tick as the call's: said as the call's, which names what it asked.
            Ok(Err(EngineError::NotReadInTime(_))) | Err(_) => Err(not_read()),
            Ok(Err(e)) => Err(e),
        }
    }

    /// The item, quantity and expiry of hold `hold_id`, which route its ending; `None`
    /// when there is no such hold. From the outcome that made the hold when the shop's
    /// WorkManager still has it in memory (a recent hold's, the common case: no journal
    /// read, which on the embedded journal waits for the views' next commit, up to
    /// 20 ms), else from the journal.
    async fn hold_of(
        &self,
        shop: &Arc<str>,
        hold_id: &Arc<str>,
    ) -> Result<Option<(Arc<str>, i64, Millis)>, EngineError> {
        if let PollResult::Decided(o) = self.poll(shop, hold_id.clone()).await? {
            if o.op != Op::Hold || o.status != Status::Ok {
                // The key made something else, or a hold that was refused: no hold.
                return Ok(None);
            }
            if let Some(expires_at) = o.expires_at {
                return Ok(Some((o.item.clone(), o.taken_or_qty(), expires_at)));
            }
        }
        Ok(self
            .hold(shop, hold_id)
            .await?
            .map(|h| (h.item, h.qty, h.expires_at)))
    }
}
