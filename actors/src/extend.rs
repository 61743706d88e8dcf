//! Reservation control on a caller's request: a pending hold, or a held order and its
//! lines, given longer (`now + ttl_ms`, within a hold's 7-day life). The extension is
//! the request check-backs already make ([`Op::Extend`]): journaled as the item's next
//! entry, and the new expiry armed on its processor's wheel. The HTTP layer decodes the
//! call and answers with what this returns.

use std::sync::Arc;
use std::time::Instant;

use crate::checkback::CheckAction;
use crate::engine::{Engine, EngineError};
use crate::orders::{extended_until, extension, OrderView};
use crate::types::{is_order_item, now_ms, HoldStatus, HoldView, Status, HOLD_TTL_MAX_MS};
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
        let Some(h) = self
            .read_by(deadline, hold_id, "extended", self.hold(shop, hold_id))
            .await?
        else {
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
        let made_at = match self.read_by(deadline, hold_id, "extended", polled).await? {
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
            _ => match self
                .read_by(deadline, hold_id, "extended", self.hold(shop, hold_id))
                .await
            {
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
        let Some(outcome) = self.order_record(shop, order_id).await? else {
            return Ok(Extended::Unknown);
        };
        // Held, with every line held: not while its lines are being reserved, or past
        // its expiry while its shop is asked.
        let view = self.view_of(shop, order_id, &outcome).await?;
        let record = self
            .holds_of(shop, vec![order_id.clone()])
            .await?
            .pop()
            .flatten();
        let now = now_ms();
        let until = extended_until(now, ttl_ms, outcome.completed_at);
        let why = match &record {
            Some(r) if r.status == HoldStatus::Held && view.status == "held" => {
                if now >= r.expires_at {
                    Some(format!("order {order_id} is past its expiry"))
                } else {
                    (until <= now)
                        .then(|| format!("order {order_id} is past its {HOLD_TTL_MAX_MS} ms life"))
                }
            }
            _ => Some(format!("order {order_id} is {}, not held", view.status)),
        };
        let record = match (why, record) {
            (None, Some(record)) => record,
            // Not extended: the view read above is how it stands.
            (why, _) => {
                let why = why.unwrap_or_else(|| format!("order {order_id} is not held"));
                return Ok(Extended::NotPending(view, why));
            }
        };
        self.act_on_order(
            shop,
            order_id,
            record,
            &outcome,
            CheckAction::Extend { ttl_ms },
        )
        .await?;
        let view = self.view_of(shop, order_id, &outcome).await?;
        Ok(if view.status == "held" {
            Extended::Done(view)
        } else {
            let why = format!("order {order_id} is {}, not held", view.status);
            Extended::NotPending(view, why)
        })
    }
}
