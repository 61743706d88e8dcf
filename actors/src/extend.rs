//! Reservation control on a caller's request: a pending hold, or a held order and its
//! lines, given longer (`now + ttl_ms`, within a hold's 7-day life). The extension is
//! the request check-backs already make ([`Op::Extend`]): journaled as the item's next
//! entry, and the new expiry armed on its processor's wheel. The HTTP layer decodes the
//! call and answers with what this returns.

use std::sync::Arc;
use std::time::Instant;

use crate::engine::{Engine, EngineError};
use crate::hold_end::CallBy;
use crate::orders::{extended_until, extension, line_outcome, OrderHolds, OrderView};
use crate::reply::Reply;
use crate::types::{
    is_order_item, now_ms, HoldStatus, HoldView, Millis, Outcome, Status, HOLD_TTL_MAX_MS,
};
use crate::work_manager::PollResult;

/// What asking to extend a hold or an order came to.
#[derive(Debug)]
pub enum Extended<V> {
    /// No such hold or order in the shop (or one of an order's lines: it is extended
    /// with its order).
    Unknown,
    /// Extended: as it now stands.
    Done(V),
    /// Not pending (ended, or past its 7-day life): as it stands, unchanged.
    NotPending(V, String),
}

impl<V> Extended<V> {
    /// The same answer about `f` of what it carries.
    pub fn map<W>(self, f: impl FnOnce(V) -> W) -> Extended<W> {
        match self {
            Extended::Unknown => Extended::Unknown,
            Extended::Done(v) => Extended::Done(f(v)),
            Extended::NotPending(v, why) => Extended::NotPending(f(v), why),
        }
    }
}

impl Engine {
    /// Gives pending hold `hold_id` of `shop` a new expiry, `now + ttl_ms` (within its
    /// 7-day life).
    pub async fn extend_hold(
        &self,
        shop: &Arc<str>,
        hold_id: &Arc<str>,
        ttl_ms: i64,
    ) -> Result<Extended<HoldView>, EngineError> {
        if hold_id.starts_with('~') {
            return Ok(Extended::Unknown);
        }
        // One reply timeout for the whole call, as a hold's ending has: the reads that
        // find the hold and the extension's decision share it.
        let deadline = Instant::now() + self.reply_timeout();
        let by = CallBy::hold(deadline, hold_id, "extended");
        let Some(h) = self.read_by(by, self.hold(shop, hold_id)).await? else {
            return Ok(Extended::Unknown);
        };
        // An order's record is kept as a hold under the order's id: it is extended with
        // its lines, as an order.
        if is_order_item(&h.item) {
            return Ok(Extended::Unknown);
        }
        if h.status != HoldStatus::Held {
            let why = format!("hold {hold_id} is {}, not held", h.status.as_str());
            return Ok(Extended::NotPending(h, why));
        }
        let polled = self.poll(shop, hold_id.clone());
        let made_at = match self.read_by(by, polled).await? {
            PollResult::Decided(o) => o.completed_at,
            _ => h.expires_at,
        };
        let now = now_ms();
        let until = extended_until(now, ttl_ms, made_at);
        if until <= now {
            let why = format!("hold {hold_id} is past its {HOLD_TTL_MAX_MS} ms life");
            return Ok(Extended::NotPending(h, why));
        }
        // A caller's extension, unlike a check-back's, does not outlast the expiry.
        let mut ext = extension(shop, &h, now, until);
        ext.by_check = false;
        let o = self.decide_one_by(shop, ext, deadline).await?;
        match (o.status, o.expires_at) {
            (Status::Ok, Some(expires_at)) => Ok(Extended::Done(HoldView {
                expires_at,
                seq: o.seq.unwrap_or(h.seq),
                ..h
            })),
            // It ended between the read and the extension, or is past its expiry (which
            // a caller's extension does not undo): as it now stands, or, if it cannot be
            // read again in time, as it was read, with why.
            _ => match self.read_by(by, self.hold(shop, hold_id)).await {
                Err(e) => {
                    let why = format!("hold {hold_id} was not extended ({e}), as last read");
                    Ok(Extended::NotPending(h, why))
                }
                Ok(now) => Self::as_it_stands(hold_id, now),
            },
        }
    }

    /// A hold read again after an extension that did not take: why it is not pending.
    fn as_it_stands(
        hold_id: &str,
        now: Option<HoldView>,
    ) -> Result<Extended<HoldView>, EngineError> {
        match now {
            Some(h) if h.status == HoldStatus::Held => {
                let why = format!("hold {hold_id} is past its expiry");
                Ok(Extended::NotPending(h, why))
            }
            Some(h) => {
                let why = format!("hold {hold_id} is {}, not held", h.status.as_str());
                Ok(Extended::NotPending(h, why))
            }
            None => Ok(Extended::Unknown),
        }
    }

    /// Gives held order `order_id` of `shop` (its record and every line) a new expiry,
    /// `now + ttl_ms` (within its 7-day life).
    pub async fn extend_order(
        &self,
        shop: &Arc<str>,
        order_id: &Arc<str>,
        ttl_ms: i64,
    ) -> Result<Extended<OrderView>, EngineError> {
        // One reply timeout for the whole call, as a hold's extension has: the reads that
        // find the order and its lines, and the extensions' decisions, share it.
        let deadline = Instant::now() + self.reply_timeout();
        let by = CallBy::order(deadline, order_id, "extended");
        let Some(outcome) = self.read_by(by, self.order_record(shop, order_id)).await? else {
            return Ok(Extended::Unknown);
        };
        // Held, with every line held: not while its lines are being reserved, or past
        // its expiry while its shop is asked. One read of its holds shows it and names
        // what to extend.
        let holds = self
            .read_by(by, self.order_holds(shop, order_id, &outcome))
            .await?;
        let view = self
            .read_by(by, self.view_from(shop, order_id, &outcome, &holds))
            .await?;
        let now = now_ms();
        let until = extended_until(now, ttl_ms, outcome.completed_at);
        let OrderHolds { record, lines } = holds;
        let Some(record) = record.filter(|r| r.status == HoldStatus::Held) else {
            let why = format!("order {order_id} is {}, not held", view.status);
            return Ok(Extended::NotPending(view, why));
        };
        if let Some(why) = not_extendable(order_id, &view, &record, now, until) {
            return Ok(Extended::NotPending(view, why));
        }
        let n = lines.len();
        let holds = std::iter::once(record)
            .chain(lines.into_iter().flatten())
            .filter(|h| h.status == HoldStatus::Held);
        let reqs = holds
            .map(|h| (extension(shop, &h, now, until), true))
            .collect();
        let answers = self.submit_by(shop, reqs, deadline).await?;
        // An extension still undecided at the deadline: a `504`, as a hold's.
        let extended = answers
            .replies
            .into_iter()
            .map(|r| match r {
                Reply::Decided(o) | Reply::Repeat(o) => Ok(o),
                Reply::Accepted | Reply::Pending => Err(EngineError::Timeout),
            })
            .collect::<Result<Vec<Arc<Outcome>>, _>>()?;
        // Every line and the record extended: the order as this call left it, from the
        // outcomes it got, with no store read (the deadline may be spent).
        if extended.len() == n + 1 && extended.iter().all(|o| o.status == Status::Ok) {
            return Ok(Extended::Done(extended_view(
                view, order_id, until, &extended,
            )));
        }
        // The record or a line ended meanwhile (its ending ends the rest): how the order
        // now stands, if it can be read in time.
        let view = self.reread_by(shop, order_id, &outcome, deadline).await?;
        Ok(if view.status == "held" {
            Extended::Done(view)
        } else {
            let why = format!("order {order_id} is {}, not held", view.status);
            Extended::NotPending(view, why)
        })
    }

    /// Order `order_id` (made by `outcome`) read again after its extension, by the
    /// call's `deadline`.
    async fn reread_by(
        &self,
        shop: &Arc<str>,
        order_id: &Arc<str>,
        outcome: &Outcome,
        deadline: Instant,
    ) -> Result<OrderView, EngineError> {
        let read = self.view_of(shop, order_id, outcome);
        tokio::time::timeout_at(deadline.into(), read)
            .await
            .map_err(|_| {
                EngineError::NotReadInTime(format!(
                    "order {order_id}: an extension not taken by every line and its record, \
                     and the order not read again within the reply timeout ({} ms)",
                    self.reply_timeout().as_millis()
                ))
            })?
    }
}

/// Why held order `order_id` (as `view` and its `record` show it) cannot be extended from
/// `now` until `until`, if it cannot: its lines not all held, past its expiry, or past
/// its life.
fn not_extendable(
    order_id: &str,
    view: &OrderView,
    record: &HoldView,
    now: Millis,
    until: Millis,
) -> Option<String> {
    if view.status != "held" {
        Some(format!("order {order_id} is {}, not held", view.status))
    } else if now >= record.expires_at {
        Some(format!("order {order_id} is past its expiry"))
    } else {
        (until <= now).then(|| format!("order {order_id} is past its {HOLD_TTL_MAX_MS} ms life"))
    }
}

/// `view`, read before the extension, as the extension left it: the new expiry, and each
/// line's seq that of its extension (the item's latest step).
fn extended_view(
    mut view: OrderView,
    order_id: &str,
    until: Millis,
    extended: &[Arc<Outcome>],
) -> OrderView {
    for (i, line) in view.lines.iter_mut().enumerate() {
        if let Some(seq) = line_outcome(order_id, i, extended).and_then(|o| o.seq) {
            line.seq = Some(seq);
        }
    }
    view.expires_at = Some(until);
    view
}
