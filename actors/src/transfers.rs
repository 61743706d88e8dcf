//! Transfers: `qty` of available stock moved from one item of a shop to another, both
//! sides or neither, whatever shards (or, with Kafka, nodes) own the two items.
//!
//! 1. **Hold** `qty` on `from`, keyed `~xfer:{id}` ([`transfer_hold_key`]): refused as a
//!    hold is when `from` lacks the stock (nothing moved), or reserved. Its `reason`
//!    names `to` and the operator's reason. Not bound by a sale window or a buyer's
//!    limit: an operator's change.
//! 2. **Credit** `to`, keyed `~xfer-in:{id}` ([`transfer_credit_key`]): an increment.
//! 3. **End the hold** by the credit's outcome: confirmed (the units leave `from`) when
//!    the credit was applied, released (they go back) when it was refused. The ending
//!    stands past the hold's expiry.
//!
//! Every step is keyed, so each is decided once however often it is asked, and
//! [`Engine::settle_transfer`] (steps 2 and 3) may run any number of times. While the
//! transfer is under way its units are reserved on `from`: never available on both
//! items, never on neither. A transfer whose caller stopped (a crash, a timeout) is
//! finished by its hold's timer: a transfer's hold is never expired, its due timer asks
//! the engine to settle it ([`crate::processor::Nudge::TransferDue`]) until it ends,
//! also after a restart or on the node that owns `from` now.

use std::sync::Arc;

use serde::Serialize;

use crate::engine::{Engine, EngineError};
use crate::hold_end::HoldEnd;
use crate::types::{
    now_ms, transfer_credit_key, transfer_hold_key, transfer_of, HoldStatus, Millis, Op, Outcome,
    Request, Status,
};
use crate::work_manager::PollResult;

/// How long a transfer's hold waits for its caller before its timer settles it.
pub const TRANSFER_HOLD_MS: i64 = 30_000;

/// A transfer as its calls answer it. Field names are the API's.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TransferView {
    pub request_id: Arc<str>,
    pub from: Arc<str>,
    /// `null` for a transfer refused at its source, read back: the refusal records
    /// `from` and `qty` only.
    pub to: Option<Arc<str>>,
    pub qty: i64,
    /// `ok` (moved), `pending` (under way), or why nothing moved: the hold's refusal
    /// (`insufficient_stock`, `unknown_item`, ...) or the credit's.
    pub status: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Each side's last entry in its item's sequence.
    pub from_seq: Option<u64>,
    pub to_seq: Option<u64>,
    pub requested_at: Millis,
}

/// What a transfer's hold records beside its quantity (its `reason`, as JSON).
#[derive(serde::Serialize, serde::Deserialize)]
struct Terms {
    to: Arc<str>,
    reason: Option<String>,
}

/// What a transfer call found.
#[derive(Debug)]
pub enum Transferred {
    /// The transfer as it stands.
    Done(TransferView),
    /// `request_id` was first used by another transfer: what differs, and it.
    Reused(String, TransferView),
}

impl Engine {
    /// Moves `qty` of `from`'s available stock to `to`, once per `id`.
    pub async fn transfer(
        &self,
        shop: &Arc<str>,
        id: &Arc<str>,
        (from, to, qty): (Arc<str>, Arc<str>, i64),
        reason: Option<String>,
    ) -> Result<Transferred, EngineError> {
        let terms = Terms {
            to: to.clone(),
            reason,
        };
        let hold = Request {
            ttl_ms: TRANSFER_HOLD_MS,
            reason: Some(serde_json::to_string(&terms).unwrap_or_default().into()),
            ..Request::new(
                shop.clone(),
                from.clone(),
                transfer_hold_key(id),
                Op::Hold,
                qty,
                now_ms(),
            )
        };
        let held = self.decide_one(shop, hold).await?;
        // A refused hold records no `to`: it is this call's.
        let first_to = match held.status {
            Status::Ok => terms_of(&held).to,
            _ => to.clone(),
        };
        if (&held.item, &first_to, held.qty) != (&from, &to, qty) {
            let view = self
                .transfer_view(shop, id)
                .await?
                .ok_or(EngineError::Timeout)?;
            let why = format!(
                "{} from {} to {first_to}, not {qty} from {from} to {to}",
                held.qty, held.item,
            );
            return Ok(Transferred::Reused(why, view));
        }
        if held.status == Status::Ok {
            self.settle_transfer(shop, &transfer_hold_key(id)).await?;
        }
        let mut view = self
            .transfer_view(shop, id)
            .await?
            .ok_or(EngineError::Timeout)?;
        view.to.get_or_insert(to);
        Ok(Transferred::Done(view))
    }

    /// Steps 2 and 3 of transfer hold `hold_id`: credits `to` (once), then ends the hold
    /// as the credit's outcome says. Whether it ended.
    pub(crate) async fn settle_transfer(
        &self,
        shop: &Arc<str>,
        hold_id: &Arc<str>,
    ) -> Result<bool, EngineError> {
        let Some(id) = transfer_of(hold_id) else {
            return Ok(false);
        };
        let PollResult::Decided(held) = self.poll(shop, hold_id.clone()).await? else {
            return Ok(false);
        };
        if held.op != Op::Hold || held.status != Status::Ok {
            return Ok(false);
        }
        let to = terms_of(&held).to;
        let credit = Request {
            reason: Some("transfer".into()),
            ..Request::new(
                shop.clone(),
                to.clone(),
                transfer_credit_key(id),
                Op::Increment,
                held.qty,
                now_ms(),
            )
        };
        let credited = self.decide_one(shop, credit).await?;
        if (credited.op, &credited.item, credited.qty) != (Op::Increment, &to, held.qty) {
            // Its key holds another decision: never taken for the credit.
            tracing::error!(shop = %shop, transfer = %id, "a transfer's credit key holds another decision; the transfer is left pending");
            return Ok(false);
        }
        let ending = match credited.status {
            Status::Ok => Op::Confirm,
            _ => Op::Release,
        };
        let ended = self.end_any_hold(shop, hold_id, ending, true).await?;
        Ok(matches!(ended, HoldEnd::Decided { .. }))
    }

    /// Transfer `id` as it stands, `None` if there is none.
    pub async fn transfer_view(
        &self,
        shop: &Arc<str>,
        id: &Arc<str>,
    ) -> Result<Option<TransferView>, EngineError> {
        let hold_id = transfer_hold_key(id);
        let PollResult::Decided(held) = self.poll(shop, hold_id.clone()).await? else {
            return Ok(None);
        };
        let terms = terms_of(&held);
        let mut view = TransferView {
            request_id: id.clone(),
            from: held.item.clone(),
            to: (held.status == Status::Ok).then(|| terms.to.clone()),
            qty: held.qty,
            status: held.status.as_str().to_string(),
            reason: held.reason.clone().filter(|_| held.status != Status::Ok),
            from_seq: held.seq,
            to_seq: None,
            requested_at: held.submitted_at,
        };
        if held.status != Status::Ok {
            return Ok(Some(view));
        }
        view.reason = terms.reason;
        let credited = match self.poll(shop, transfer_credit_key(id)).await? {
            PollResult::Decided(o) => Some(o),
            _ => None,
        };
        view.to_seq = credited.as_ref().and_then(|o| o.seq);
        let hold = self.hold(shop, &hold_id).await?;
        view.from_seq = hold.as_ref().map(|h| h.seq).or(view.from_seq);
        view.status = match (hold.map(|h| h.status), &credited) {
            (Some(HoldStatus::Confirmed), _) => "ok".to_string(),
            (Some(HoldStatus::Held) | None, _) => "pending".to_string(),
            (Some(_), Some(c)) if c.status != Status::Ok => {
                view.reason = c.reason.clone().map(|r| format!("to: {r}"));
                c.status.as_str().to_string()
            }
            (Some(_), _) => "released".to_string(),
        };
        Ok(Some(view))
    }
}

/// The terms a transfer's hold records (empty for a key another request made).
fn terms_of(held: &Outcome) -> Terms {
    held.reason
        .as_deref()
        .and_then(|r| serde_json::from_str(r).ok())
        .unwrap_or(Terms {
            to: "".into(),
            reason: None,
        })
}
