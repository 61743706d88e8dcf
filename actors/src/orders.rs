//! Orders: several lines reserved all or none, and ended together
//! (`docs/decisions/orders.md`).
//!
//! An order is driven by its coordinator, [`Engine::place_order`], through the same
//! requests as everything else, so it works wherever requests do (one node or several
//! sharing Kafka and MongoDB):
//! 1. Its record: an [`Op::Order`] entry on one of the shop's order items
//!    ([`order_item`]), a pending record of the order's lines until it ends. Its key is
//!    the `order_id`, so orders share the key space of holds and transactions. It goes
//!    in one call with the first attempt at the lines (2.); lines taken by a call whose
//!    record is not a new order's are released, and a line left without its record by
//!    a stop is released by its timer or the check at the start.
//! 2. Its lines are held as holds with the nrtxn-own key [`line_key`]: all at once,
//!    none waiting, and under contention one after the other in item order (`reserve`).
//!    A line is *tentative* until its order is held: a line of another order that finds
//!    too little stock, but enough with the tentative lines counted back, waits (or, in
//!    an order's first attempt, is answered [`Status::Tentative`]), rather than being
//!    refused. An order waits only for orders ahead of it on an item in item order,
//!    which never wait for it: no deadlock.
//! 3. Every line held: they are made firm ([`Op::Firm`]) and the order is answered
//!    `held`. A line refused for real: the record ends (`release`, with the failing
//!    line), every line held so far is released, and only then is the order answered.
//!
//! An order's confirm, cancel and expiry end the record first, then each of its lines
//! with the same ending ([`Engine::end_order`]): on a journal that writes appends in
//! order, as soon as the record's ending is handed to it, so that both wait for one
//! sync ([`crate::types::EarlySignal`]); else once it is durable. A processor reports
//! an order's record past its expiry, a line past its order's expiry plus
//! [`crate::processor::LINE_GRACE_MS`], and every record or line read back from the
//! journal at a start or a takeover
//! ([`OrderNudge`]): the order expires, a record whose lines are not all held is
//! released, and an ended order's lines follow its ending. Each step has its own key, so
//! each is safe to repeat.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::checkback::{CheckAction, CheckBack, CheckCall, CheckKind, Resolution};
use crate::engine::{Engine, EngineError};
use crate::hold_end::CallBy;
use crate::ports::StoreError;
use crate::processor::{Nudge, OrderNudge};
use crate::reply::Reply;
pub use crate::settling::{CHECKS_SETTLING_MAX, CHECKS_SETTLING_PER_SHOP};
use crate::types::{
    hold_end_key, line_key, now_ms, order_item, order_of_line, retry_line_key, EarlySignal,
    HoldStatus, HoldView, Millis, Op, Outcome, Request, Status, HOLD_TTL_MAX_MS,
};
use crate::work_manager::PollResult;

mod reserve;

/// Most lines one order may have.
pub const ORDER_LINES_MAX: usize = 100;
/// Longest wait between two asks of a line told to wait for other orders.
const LINE_WAIT_MAX: Duration = Duration::from_millis(20);
/// Prefix of the reason of a record ended because a line was refused.
const FAILED_PREFIX: &str = "failed_line ";

pub use crate::types::OrderLine;

/// An order as its caller asks for it.
#[derive(Debug, Clone)]
pub struct NewOrder {
    pub order_id: Arc<str>,
    pub lines: Vec<OrderLine>,
    pub ttl_ms: i64,
    pub buyer: Option<Arc<str>>,
}

/// A line as the API shows it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct LineView {
    pub item: Arc<str>,
    pub qty: i64,
    /// The line's item's seq of its latest step (held, then ended); `None` while it is
    /// not held.
    pub seq: Option<u64>,
    /// `held`, `confirmed`, `released`, `expired`, or `not_held`.
    pub status: &'static str,
}

/// An order as the API shows it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct OrderView {
    pub order_id: Arc<str>,
    /// `held`, `reserving`, `confirmed`, `cancelled`, `expired`, `released` (by nrtxn,
    /// with a reason), or the first failing line's status (`insufficient_stock`,
    /// `unknown_item`, `buyer_limit`, ...).
    pub status: String,
    pub lines: Vec<LineView>,
    pub expires_at: Option<Millis>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub failed_line: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// What placing an order led to.
#[derive(Debug)]
pub enum Placed {
    /// The order's answer (held, or refused with its failing line).
    Answer(OrderView),
    /// `order_id` was first used by something else: what differs, and its outcome.
    Reused(String, Arc<Outcome>),
}

/// Who ends an order, which says how its ending stands and how long it may take.
#[derive(Clone, Copy)]
pub(crate) enum Ender {
    /// A caller, answered by the deadline of its call (one reply timeout for it all).
    Caller(Instant),
    /// The shop's check-back or an operator: a confirm stands past the order's expiry.
    Check,
    /// nrtxn itself (an expiry, a release): each step within a reply timeout of its own.
    Own,
}

/// An order's holds as one read found them: its record's, and each line's.
pub(crate) struct OrderHolds {
    pub record: Option<HoldView>,
    pub lines: Vec<Option<HoldView>>,
}

/// The lines an order's ending ends, beside its record's.
pub(crate) enum Lines<'a> {
    /// Those known to be held (the coordinator's own).
    Known(&'a [(usize, HoldView)]),
    /// Those held, read once the record has ended.
    Read,
    /// Those held of the first `n`, read while the record's ending is decided (the
    /// caller read the record). A line held after the read (its order still being
    /// reserved) is ended by its own timer, through the order, as one held after a
    /// read that follows the ending would be.
    ReadAlongside(usize),
}

/// What came first of an ending's record: its durable outcome, or word that it was
/// handed to a journal that writes in order.
enum First {
    Durable(Result<Arc<Outcome>, EngineError>),
    Told(Arc<Outcome>),
}

/// What ending an order (confirm, cancel) found.
#[derive(Debug)]
pub enum Ended {
    /// No such order.
    Unknown,
    /// The order as it stands after the request: ended by it, or by an earlier ending
    /// (`op` says which ending it has).
    Order { view: OrderView, op: Op },
}

/// The record's `reason`: the order's lines, as JSON.
fn lines_json(lines: &[OrderLine]) -> String {
    serde_json::to_string(lines).unwrap_or_default()
}

pub(crate) fn lines_of(record: &Outcome) -> Vec<OrderLine> {
    record
        .reason
        .as_deref()
        .and_then(|r| serde_json::from_str(r).ok())
        .unwrap_or_default()
}

impl Engine {
    /// Submits one request that waits for its outcome; `Timeout` if none comes in time.
    pub(crate) async fn decide_one(
        &self,
        shop: &Arc<str>,
        req: Request,
    ) -> Result<Arc<Outcome>, EngineError> {
        let deadline = std::time::Instant::now() + self.reply_timeout();
        self.decide_one_by(shop, req, deadline).await
    }

    /// [`Engine::decide_one`], answered by `deadline` (of a call that read before it).
    pub(crate) async fn decide_one_by(
        &self,
        shop: &Arc<str>,
        req: Request,
        deadline: std::time::Instant,
    ) -> Result<Arc<Outcome>, EngineError> {
        let answers = self.submit_by(shop, vec![(req, true)], deadline).await?;
        match answers.replies.into_iter().next() {
            Some(Reply::Repeat(o) | Reply::Decided(o)) => Ok(o),
            _ => Err(EngineError::Timeout),
        }
    }

    /// Reserves every line of `order` or none: see the module's documentation.
    pub async fn place_order(
        &self,
        shop: &Arc<str>,
        order: NewOrder,
    ) -> Result<Placed, EngineError> {
        let NewOrder {
            order_id,
            lines,
            ttl_ms,
            buyer,
        } = order;
        let started = now_ms();
        let record_req = record_request(shop, &order_id, &lines, ttl_ms, &buyer, started);
        let probe = Reserving {
            shop,
            order_id: &order_id,
            buyer: &buyer,
            expires_at: started.saturating_add(ttl_ms),
            give_up: Instant::now() + self.reply_timeout(),
        };
        let (record, replies) = self
            .record_and_lines(&probe, record_req.clone(), &lines)
            .await?;
        let repeat = record.submitted_at != started;
        let reused = record_req.reuse_conflict(&record);
        if reused.is_some() || record.status != Status::Ok || repeat {
            // A repeat of an order still being reserved keeps the lines it took: its
            // first call, if it still runs, finds them held under the same keys.
            let reserving = repeat && reused.is_none() && record.status == Status::Ok;
            if !reserving
                || self
                    .order_unless_reserving(shop, &order_id)
                    .await?
                    .is_some()
            {
                let taken = reserve::newly_held(&probe, &lines, &replies);
                let why = "released: the order was not placed by this call";
                self.end_holds(shop, taken, Op::Release, Some(why)).await?;
            }
        }
        if let Some(diff) = reused {
            return Ok(Placed::Reused(diff, record));
        }
        let expires_at = record.expires_at;
        if record.status != Status::Ok {
            return Ok(Placed::Answer(OrderView {
                order_id,
                status: record.status.as_str().to_string(),
                lines: not_held(&lines),
                expires_at,
                failed_line: None,
                reason: record.reason.clone(),
            }));
        }
        let r = Reserving {
            expires_at: expires_at.unwrap_or(probe.expires_at),
            ..probe
        };
        if repeat {
            // Asked again: an order that ended, or whose lines are all held, is answered
            // as it stands; one still being reserved (its first call died) goes on. Read
            // again, not taken from the check above: the release there may have turned a
            // `held` order (held only by lines this call took) back into `reserving`.
            if let Some(view) = self.order_unless_reserving(shop, &order_id).await? {
                return Ok(Placed::Answer(view));
            }
            return self.reserve_lines(&r, lines, None).await;
        }
        self.reserve_lines(&r, lines, Some(replies)).await
    }

    /// The order's record and the first attempt at every line (`reserve`), in one call:
    /// both rounds of group commits at once. The record's outcome, and a reply per line.
    /// No record (yet) is an error with nothing to end: the record, if it comes, expires
    /// with its lines, and a line with no record is released by its own timer
    /// ([`Engine::release_orphan`]).
    async fn record_and_lines(
        &self,
        probe: &Reserving<'_>,
        record_req: Request,
        lines: &[OrderLine],
    ) -> Result<(Arc<Outcome>, Vec<Reply>), EngineError> {
        let mut reqs = vec![(record_req, true)];
        reqs.extend(reserve::first_attempt(probe, lines));
        let answers = tokio::time::timeout_at(probe.give_up.into(), self.submit(probe.shop, reqs))
            .await
            .unwrap_or(Err(EngineError::Timeout));
        let mut replies = answers?.replies;
        debug_assert_eq!(replies.len(), lines.len() + 1, "a reply per request");
        match replies.remove(0) {
            Reply::Repeat(o) | Reply::Decided(o) => Ok((o, replies)),
            _ => Err(EngineError::Timeout),
        }
    }

    /// Order `order_id` as it stands, unless it is still being reserved.
    async fn order_unless_reserving(
        &self,
        shop: &Arc<str>,
        order_id: &Arc<str>,
    ) -> Result<Option<OrderView>, EngineError> {
        Ok(self
            .order(shop, order_id)
            .await?
            .filter(|view| view.status != "reserving"))
    }

    /// Confirms (`Op::Confirm`) or cancels (`Op::Release`) an order: its record first,
    /// then every line with the ending the record has.
    pub async fn end_order(
        &self,
        shop: &Arc<str>,
        order_id: &Arc<str>,
        op: Op,
    ) -> Result<Ended, EngineError> {
        // One reply timeout for the whole call, as a hold's ending has: the read of the
        // record, its ending and its lines' endings share it (on a journal that does not
        // tell a decision early, the lines' endings wait for the record's).
        let deadline = Instant::now() + self.reply_timeout();
        let by = CallBy::order(deadline, order_id, "ended");
        let Some(record) = self.read_by(by, self.order_record(shop, order_id)).await? else {
            return Ok(Ended::Unknown);
        };
        let n = usize::try_from(record.qty).unwrap_or(0);
        let lines = Lines::ReadAlongside(n);
        let (o, ended) = self
            .end_order_lines_with(shop, order_id, op, None, lines, Ender::Caller(deadline))
            .await?;
        if o.status == Status::UnknownHold {
            return Ok(Ended::Unknown);
        }
        // The order as this call left it, from the outcomes it got: no store read.
        let mut view = OrderView {
            order_id: order_id.clone(),
            status: String::new(),
            lines: lines_of(&record)
                .into_iter()
                .enumerate()
                .map(|(i, l)| {
                    let end = line_outcome(order_id, i, &ended);
                    LineView {
                        item: l.item,
                        qty: l.qty,
                        seq: end.and_then(|e| e.seq),
                        status: end
                            .and_then(|e| HoldStatus::after(e.op))
                            .map_or("not_held", HoldStatus::as_str),
                    }
                })
                .collect(),
            expires_at: record.expires_at,
            failed_line: None,
            reason: None,
        };
        view.status = match o.op {
            Op::Confirm => "confirmed".into(),
            Op::Expire => "expired".into(),
            _ => released_status(&mut view, o.reason.clone()),
        };
        Ok(Ended::Order { view, op: o.op })
    }

    /// Ends the record of `order_id` with `op` (or finds the ending it already has), then
    /// each of its lines still held with that ending: those `lines` says.
    async fn end_order_lines(
        &self,
        shop: &Arc<str>,
        order_id: &Arc<str>,
        op: Op,
        reason: Option<String>,
        lines: Lines<'_>,
    ) -> Result<Arc<Outcome>, EngineError> {
        Ok(self
            .end_order_lines_with(shop, order_id, op, reason, lines, Ender::Own)
            .await?
            .0)
    }

    /// [`Engine::end_order_lines`] by `ender`, with the outcomes of the lines' endings.
    pub(crate) async fn end_order_lines_with(
        &self,
        shop: &Arc<str>,
        order_id: &Arc<str>,
        op: Op,
        reason: Option<String>,
        lines: Lines<'_>,
        ender: Ender,
    ) -> Result<(Arc<Outcome>, Vec<Arc<Outcome>>), EngineError> {
        let deadline = match ender {
            Ender::Caller(deadline) => Some(deadline),
            Ender::Check | Ender::Own => None,
        };
        let (early, told) = EarlySignal::channel();
        let req = Request {
            hold_id: Some(order_id.clone()),
            by_check: matches!(ender, Ender::Check),
            reason: reason.map(Into::into),
            early,
            ..Request::new(
                shop.clone(),
                order_item(shop, order_id),
                hold_end_key(order_id),
                op,
                0,
                now_ms(),
            )
        };
        let record_by = deadline.unwrap_or_else(|| Instant::now() + self.reply_timeout());
        let durable = self.decide_one_by(shop, req, record_by);
        tokio::pin!(durable);
        let first = async {
            tokio::select! {
                biased;
                o = &mut durable => First::Durable(o),
                // Handed to a journal that writes in order: the lines' endings, sent now,
                // are written after the record's, so they wait for one sync, not two.
                Ok(o) = told => First::Told(o),
            }
        };
        let ahead = self.lines_ahead(shop, order_id, lines, deadline);
        // A failed read counts only if the lines are to be ended (`end_lines_of`).
        let (first, pending) = tokio::join!(first, ahead);
        match first {
            First::Durable(o) => {
                let o = o?;
                let ended = self
                    .end_lines_of(shop, order_id, &o, pending, deadline)
                    .await?;
                Ok((o, ended))
            }
            First::Told(o) => {
                let lines = self.end_lines_of(shop, order_id, &o, pending, deadline);
                let (durable, ended) = tokio::join!(durable, lines);
                Ok((durable?, ended?))
            }
        }
    }

    /// The lines of `order_id` an ending will end, as `lines` says, read (if they are to
    /// be) beside the record's ending; `None` to read them once it ended. Past
    /// `deadline`, a timeout: left to the lines' own timers, which ask the order.
    async fn lines_ahead(
        &self,
        shop: &Arc<str>,
        order_id: &Arc<str>,
        lines: Lines<'_>,
        deadline: Option<Instant>,
    ) -> Option<Result<Vec<HoldView>, EngineError>> {
        match lines {
            Lines::Known(known) => Some(Ok(known.iter().map(|(_, h)| h.clone()).collect())),
            Lines::ReadAlongside(n) => {
                let read = self.lines_held(shop, order_id, n);
                Some(match deadline {
                    Some(d) => tokio::time::timeout_at(d.into(), read)
                        .await
                        .unwrap_or(Err(EngineError::Timeout)),
                    None => read.await,
                })
            }
            Lines::Read => None,
        }
    }

    /// Ends each line of `order_id` still held with the ending its record got (`o`),
    /// if it ended: `pending` (read or known already), or those read now; answered by
    /// the call's `deadline`, if it has one, else within a reply timeout of its own.
    async fn end_lines_of(
        &self,
        shop: &Arc<str>,
        order_id: &Arc<str>,
        o: &Outcome,
        pending: Option<Result<Vec<HoldView>, EngineError>>,
        deadline: Option<Instant>,
    ) -> Result<Vec<Arc<Outcome>>, EngineError> {
        if o.status != Status::Ok || !o.op.ends_hold() {
            return Ok(Vec::new());
        }
        let pending: Vec<HoldView> = match pending {
            Some(pending) => pending?,
            None => {
                self.lines_held(shop, order_id, o.qty.max(0) as usize)
                    .await?
            }
        };
        let deadline = deadline.unwrap_or_else(|| Instant::now() + self.reply_timeout());
        self.end_holds_by(shop, pending, o.op, None, deadline).await
    }

    /// Ends each of `holds` with `op`, under its ending key, in one call: the endings'
    /// outcomes in order (a hold ended before answers with the ending it has). An
    /// answer missing is an error, left to the holds' own timers.
    pub(super) async fn end_holds(
        &self,
        shop: &Arc<str>,
        holds: Vec<HoldView>,
        op: Op,
        reason: Option<&str>,
    ) -> Result<Vec<Arc<Outcome>>, EngineError> {
        let deadline = Instant::now() + self.reply_timeout();
        self.end_holds_by(shop, holds, op, reason, deadline).await
    }

    /// [`Engine::end_holds`], answered by `deadline`.
    async fn end_holds_by(
        &self,
        shop: &Arc<str>,
        holds: Vec<HoldView>,
        op: Op,
        reason: Option<&str>,
        deadline: Instant,
    ) -> Result<Vec<Arc<Outcome>>, EngineError> {
        if holds.is_empty() {
            return Ok(Vec::new());
        }
        let now = now_ms();
        let reqs = holds
            .into_iter()
            .map(|h| {
                let req = Request {
                    hold_id: Some(h.hold_id.clone()),
                    buyer: h.buyer.clone(),
                    reason: reason.map(Into::into),
                    ..Request::new(
                        shop.clone(),
                        h.item,
                        hold_end_key(&h.hold_id),
                        op,
                        h.qty,
                        now,
                    )
                };
                (req, true)
            })
            .collect();
        let answers = self.submit_by(shop, reqs, deadline).await?;
        let mut ended = Vec::with_capacity(answers.replies.len());
        for r in answers.replies {
            match r {
                Reply::Repeat(e) | Reply::Decided(e) => ended.push(e),
                // Left to the lines' own timers, which ask the order again.
                _ => return Err(EngineError::Timeout),
            }
        }
        Ok(ended)
    }

    /// The lines of `order_id` (the first `n`) that were held: from the outcomes of their
    /// holds, which the shop's WorkManager keeps in memory while they are recent (no
    /// store read, which on the embedded journal waits for the views' next commit); from
    /// the store when one of them is not there. A line held and ended since is among
    /// them: its ending is answered with the one it has.
    async fn lines_held(
        &self,
        shop: &Arc<str>,
        order_id: &Arc<str>,
        n: usize,
    ) -> Result<Vec<HoldView>, EngineError> {
        // Each line's second key, then its first, all asked in one message.
        let keys: Vec<Arc<str>> = (0..n)
            .flat_map(|i| [retry_line_key(order_id, i), line_key(order_id, i)])
            .collect();
        let found = self.poll_many(shop, keys.clone()).await?;
        let mut held = Vec::with_capacity(n);
        for (pair, keys) in found.chunks(2).zip(keys.chunks(2)) {
            // A line held again has its second key decided: that hold is the line's.
            let (key, o) = match pair {
                [PollResult::Decided(o), _] if o.op == Op::Hold => (&keys[0], o),
                [PollResult::Unknown, PollResult::Decided(o)] if o.op == Op::Hold => (&keys[1], o),
                _ => {
                    // Not known here (or still on its way): the store says.
                    return Ok(self
                        .line_holds(shop, order_id, n)
                        .await?
                        .into_iter()
                        .flatten()
                        .filter(|h| h.status == HoldStatus::Held)
                        .collect());
                }
            };
            if o.status == Status::Ok {
                held.push(HoldView {
                    hold_id: key.clone(),
                    status: HoldStatus::Held,
                    shop: shop.clone(),
                    item: o.item.clone(),
                    qty: o.taken_or_qty(),
                    expires_at: o.expires_at.unwrap_or_default(),
                    seq: o.seq.unwrap_or_default(),
                    buyer: None,
                });
            }
        }
        Ok(held)
    }

    /// The holds of the first `n` lines of `order_id`, in line order: each line's
    /// second hold where it was held again ([`retry_line_key`]), else its first.
    async fn line_holds(
        &self,
        shop: &Arc<str>,
        order_id: &Arc<str>,
        n: usize,
    ) -> Result<Vec<Option<HoldView>>, EngineError> {
        let both = self.line_holds_both(shop, order_id, n).await?;
        Ok(both
            .into_iter()
            .map(|(first, retry)| retry.or(first))
            .collect())
    }

    /// The record of `order_id` (its `order` outcome), `None` if the key made no order.
    pub(crate) async fn order_record(
        &self,
        shop: &Arc<str>,
        order_id: &Arc<str>,
    ) -> Result<Option<Arc<Outcome>>, EngineError> {
        Ok(match self.poll(shop, order_id.clone()).await? {
            PollResult::Decided(o) if o.op == Op::Order && o.status == Status::Ok => Some(o),
            _ => None,
        })
    }

    /// Order `order_id` as it stands, `None` if there is none.
    pub async fn order(
        &self,
        shop: &Arc<str>,
        order_id: &Arc<str>,
    ) -> Result<Option<OrderView>, EngineError> {
        let Some(record) = self.order_record(shop, order_id).await? else {
            return Ok(None);
        };
        Ok(Some(self.view_of(shop, order_id, &record).await?))
    }

    pub(crate) async fn view_of(
        &self,
        shop: &Arc<str>,
        order_id: &Arc<str>,
        record: &Outcome,
    ) -> Result<OrderView, EngineError> {
        let holds = self.order_holds(shop, order_id, record).await?;
        self.view_from(shop, order_id, record, &holds).await
    }

    /// The holds of order `order_id` (made by `record`), in one read: its record's and
    /// each line's (its second hold where it was held again, else its first).
    pub(crate) async fn order_holds(
        &self,
        shop: &Arc<str>,
        order_id: &Arc<str>,
        record: &Outcome,
    ) -> Result<OrderHolds, EngineError> {
        let n = lines_of(record).len();
        let mut keys: Vec<Arc<str>> = vec![order_id.clone()];
        keys.extend(line_keys_both(order_id, n));
        let mut holds = self.holds_of(shop, keys).await?;
        let retries = holds.split_off(n + 1);
        let mut holds = holds.into_iter();
        let record = holds.next().flatten();
        let lines = holds
            .zip(retries)
            .map(|(first, retry)| retry.or(first))
            .collect();
        Ok(OrderHolds { record, lines })
    }

    /// Order `order_id` (made by `record`) as its `holds`, read already, show it.
    pub(crate) async fn view_from(
        &self,
        shop: &Arc<str>,
        order_id: &Arc<str>,
        record: &Outcome,
        holds: &OrderHolds,
    ) -> Result<OrderView, EngineError> {
        let lines = lines_of(record);
        let (record_hold, line_holds) = (&holds.record, &holds.lines);
        let state = record_hold.as_ref().map(|h| h.status);
        // Pending past its expiry while its shop is asked (or an operator decides).
        let checking = record_hold
            .as_ref()
            .is_some_and(|h| self.checking(shop, h.expires_at));
        let all_held = line_holds
            .iter()
            .all(|h| h.as_ref().is_some_and(|h| h.status == HoldStatus::Held));
        let mut view = OrderView {
            order_id: order_id.clone(),
            status: String::new(),
            lines: lines
                .iter()
                .zip(line_holds)
                .map(|(l, h)| LineView {
                    item: l.item.clone(),
                    qty: l.qty,
                    seq: h.as_ref().map(|h| h.seq),
                    status: h.as_ref().map_or("not_held", |h| h.status.as_str()),
                })
                .collect(),
            // The record's hold as it stands: an extension moved its expiry since.
            expires_at: record_hold
                .as_ref()
                .map(|h| h.expires_at)
                .or(record.expires_at),
            failed_line: None,
            reason: None,
        };
        view.status = match state {
            Some(HoldStatus::Held) if all_held && checking => "checking".into(),
            Some(HoldStatus::Held) if all_held => "held".into(),
            Some(HoldStatus::Held) | None => "reserving".into(),
            Some(HoldStatus::Confirmed) => "confirmed".into(),
            Some(HoldStatus::Expired) => "expired".into(),
            Some(HoldStatus::Released) => {
                let ending = match self.poll(shop, hold_end_key(order_id)).await? {
                    PollResult::Decided(o) => o.reason.clone(),
                    _ => None,
                };
                released_status(&mut view, ending)
            }
        };
        Ok(view)
    }

    /// The lines of an order that has no record are released. The record and the first
    /// attempt at the lines go in one call, so a stop between their writes can leave
    /// lines without their record; a line's timer (or the check at a start) finds them
    /// here, long after the call that placed them gave up. Every line of the order is
    /// looked for (by its first key: a line is held again only once its record is
    /// made), since one order is settled at a time and the other lines' nudges may have
    /// found it busy.
    async fn release_orphan(&self, nudge: &OrderNudge) -> Result<(), EngineError> {
        if order_of_line(&nudge.hold).is_none() {
            return Ok(());
        }
        let keys = (0..ORDER_LINES_MAX)
            .map(|i| line_key(&nudge.id, i))
            .collect();
        let held: Vec<HoldView> = self
            .holds_of(&nudge.shop, keys)
            .await?
            .into_iter()
            .flatten()
            .filter(|h| h.status == HoldStatus::Held)
            .collect();
        let why = "released: its order has no record (the call that placed it stopped \
                   before the record was written)";
        self.end_holds(&nudge.shop, held, Op::Release, Some(why))
            .await?;
        Ok(())
    }

    /// Acts on a processor's nudge, off its thread: one settling per order at a time.
    pub(crate) fn on_nudge(self: &Arc<Self>, nudge: OrderNudge) {
        let key = (nudge.shop.clone(), nudge.id.clone());
        let check = !matches!(nudge.why, Nudge::Recovered | Nudge::TransferDue)
            && self.checkback().is_some_and(|c| c.enabled(&nudge.shop));
        if !self.settling().take(&key, check) {
            return;
        }
        let engine = self.clone();
        actix::spawn(async move {
            if let Err(e) = engine.settle(&nudge).await {
                tracing::warn!(shop = %nudge.shop, id = %nudge.id, error = %e, "order not settled yet; its timers ask again");
            }
            engine.settling().done(&key);
        });
    }

    async fn settle(&self, nudge: &OrderNudge) -> Result<(), EngineError> {
        let (shop, order_id) = (&nudge.shop, &nudge.id);
        match nudge.why {
            Nudge::HoldDue => return self.check_hold(shop, order_id).await,
            Nudge::TransferDue => return self.settle_transfer(shop, order_id).await.map(|_| ()),
            Nudge::Due => return self.order_due(nudge).await,
            Nudge::Recovered => {}
        }
        if self.shares_journal() {
            // Another node may be reserving this order right now: its coordinator gives
            // up within the reply timeout of its start, so an order still unfinished
            // twice that after the nudge is one whose coordinator stopped.
            tokio::time::sleep(self.reply_timeout() * 2).await;
        }
        let Some(record) = self
            .holds_of(shop, vec![order_id.clone()])
            .await?
            .pop()
            .flatten()
        else {
            return self.release_orphan(nudge).await;
        };
        if record.status == HoldStatus::Held {
            let lines = self
                .line_holds(shop, order_id, record.qty.max(0) as usize)
                .await?;
            if lines
                .iter()
                .all(|h| h.as_ref().is_some_and(|h| h.status == HoldStatus::Held))
            {
                // Every line held: the order is held, and stays so until it ends.
                return Ok(());
            }
            let why = "released at recovery: the order's reserving stopped (a restart or \
                       a node's failure) before every line was held"
                .to_string();
            self.end_order_lines(shop, order_id, Op::Release, Some(why.clone()), Lines::Read)
                .await?;
            if self.shares_journal() {
                // A line the stopped coordinator sent may still be in the log, and be
                // held after this release (a node taking the partition over applies
                // it). Past the request TTL it can only be refused as expired: the
                // lines held by then are released once more.
                tokio::time::sleep(self.request_ttl() + Duration::from_secs(1)).await;
                self.end_order_lines(shop, order_id, Op::Release, Some(why), Lines::Read)
                    .await?;
            }
            return Ok(());
        }
        // Ended: asked again, the record answers with its ending, and the lines still
        // held follow it.
        self.end_order_lines(shop, order_id, Op::Expire, None, Lines::Read)
            .await?;
        Ok(())
    }

    /// An order's record, or one of its lines, is past its time: the order expires, or
    /// (a shop with a check-back) its shop decides; an ended order's lines follow its
    /// ending.
    async fn order_due(&self, nudge: &OrderNudge) -> Result<(), EngineError> {
        let (shop, order_id) = (&nudge.shop, &nudge.id);
        let checkback = self.checkback().filter(|c| c.enabled(shop));
        let Some(checkback) = checkback else {
            let o = self
                .end_order_lines(shop, order_id, Op::Expire, None, Lines::Read)
                .await?;
            if o.status == Status::UnknownHold {
                return self.release_orphan(nudge).await;
            }
            return Ok(());
        };
        let Some(record) = self
            .holds_of(shop, vec![order_id.clone()])
            .await?
            .pop()
            .flatten()
        else {
            return self.release_orphan(nudge).await;
        };
        if record.status != HoldStatus::Held {
            self.end_order_lines(shop, order_id, Op::Expire, None, Lines::Read)
                .await?;
            return Ok(());
        }
        if now_ms() < record.expires_at {
            // Extended meanwhile: its timer is armed again.
            return Ok(());
        }
        let Some(outcome) = self.order_record(shop, order_id).await? else {
            return Ok(());
        };
        let life_ends_at = outcome.completed_at.saturating_add(HOLD_TTL_MAX_MS);
        let standing = self
            .standing(&checkback, shop, order_id, record.expires_at, life_ends_at)
            .await?;
        let action = match standing {
            Standing::Wait => return Ok(()),
            Standing::Apply { action, .. } => action,
            Standing::Ask => {
                let call = CheckCall {
                    shop: shop.clone(),
                    kind: CheckKind::Order,
                    id: order_id.clone(),
                    lines: lines_of(&outcome),
                    expires_at: record.expires_at,
                    life_ends_at,
                    retry: false,
                };
                checkback.ask(call).await
            }
        };
        self.act_on_order(shop, order_id, record, &outcome, action)
            .await?;
        self.life_ended(&checkback, shop, order_id, &standing).await;
        Ok(())
    }

    /// Applies a check-back's `action` to pending order `order_id` (`record`: its
    /// record's hold, `outcome`: the record's outcome). `Ask` leaves it pending.
    pub(crate) async fn act_on_order(
        &self,
        shop: &Arc<str>,
        order_id: &Arc<str>,
        record: HoldView,
        outcome: &Outcome,
        action: CheckAction,
    ) -> Result<(), EngineError> {
        match action {
            CheckAction::Ask => {}
            CheckAction::Confirm => {
                let (confirm, lines) = (Op::Confirm, Lines::Read);
                self.end_order_lines_with(shop, order_id, confirm, None, lines, Ender::Check)
                    .await?;
            }
            CheckAction::Release => {
                self.end_order_lines(shop, order_id, Op::Expire, None, Lines::Read)
                    .await?;
            }
            CheckAction::Extend { ttl_ms } => {
                let now = now_ms();
                let until = extended_until(now, ttl_ms, outcome.completed_at);
                if until <= now {
                    self.end_order_lines(shop, order_id, Op::Expire, None, Lines::Read)
                        .await?;
                    return Ok(());
                }
                let mut holds = vec![record];
                holds.extend(
                    self.line_holds(shop, order_id, lines_of(outcome).len())
                        .await?
                        .into_iter()
                        .flatten()
                        .filter(|h| h.status == HoldStatus::Held),
                );
                let reqs = holds
                    .into_iter()
                    .map(|h| (extension(shop, &h, now, until), true))
                    .collect();
                self.submit(shop, reqs).await?;
            }
        }
        Ok(())
    }

    /// A hold of a shop with a check-back is past its expiry: the shop decides whether
    /// it is sold, expires, or waits longer; or, once it is a dead letter, an operator.
    async fn check_hold(&self, shop: &Arc<str>, hold_id: &Arc<str>) -> Result<(), EngineError> {
        let Some(h) = self
            .holds_of(shop, vec![hold_id.clone()])
            .await?
            .pop()
            .flatten()
        else {
            return Ok(());
        };
        if h.status != HoldStatus::Held || now_ms() < h.expires_at {
            return Ok(());
        }
        let made_at = match self.poll(shop, hold_id.clone()).await? {
            PollResult::Decided(o) => o.completed_at,
            _ => h.expires_at,
        };
        let life_ends_at = made_at.saturating_add(HOLD_TTL_MAX_MS);
        let Some(c) = self.checkback().filter(|c| c.enabled(shop)) else {
            // Switched off meanwhile: it expires as without one.
            self.act_on_hold(shop, &h, made_at, CheckAction::Release)
                .await?;
            return Ok(());
        };
        let standing = self
            .standing(&c, shop, hold_id, h.expires_at, life_ends_at)
            .await?;
        let action = match standing {
            Standing::Wait => return Ok(()),
            Standing::Apply { action, .. } => action,
            Standing::Ask => {
                c.ask(CheckCall {
                    shop: shop.clone(),
                    kind: CheckKind::Hold,
                    id: hold_id.clone(),
                    lines: vec![OrderLine {
                        item: h.item.clone(),
                        qty: h.qty,
                    }],
                    expires_at: h.expires_at,
                    life_ends_at,
                    retry: false,
                })
                .await
            }
        };
        self.act_on_hold(shop, &h, made_at, action).await?;
        self.life_ended(&c, shop, hold_id, &standing).await;
        Ok(())
    }

    /// Applies a check-back's `action` to pending hold `h` (made at `made_at`): the
    /// ending's outcome, `None` for `Ask` (it stays pending).
    pub(crate) async fn act_on_hold(
        &self,
        shop: &Arc<str>,
        h: &HoldView,
        made_at: Millis,
        action: CheckAction,
    ) -> Result<Option<Arc<Outcome>>, EngineError> {
        let hold_id = &h.hold_id;
        let now = now_ms();
        let req = match action {
            CheckAction::Ask => return Ok(None),
            CheckAction::Extend { ttl_ms } if extended_until(now, ttl_ms, made_at) > now => {
                extension(shop, h, now, extended_until(now, ttl_ms, made_at))
            }
            CheckAction::Confirm => Request {
                hold_id: Some(hold_id.clone()),
                by_check: true,
                ..Request::new(
                    shop.clone(),
                    h.item.clone(),
                    hold_end_key(hold_id),
                    Op::Confirm,
                    h.qty,
                    now,
                )
            },
            CheckAction::Release | CheckAction::Extend { .. } => Request {
                hold_id: Some(hold_id.clone()),
                ..Request::new(
                    shop.clone(),
                    h.item.clone(),
                    hold_end_key(hold_id),
                    Op::Expire,
                    h.qty,
                    now,
                )
            },
        };
        Ok(Some(self.decide_one(shop, req).await?))
    }

    /// What a due hold's (or order's) dead letter says before its shop is asked.
    async fn standing(
        &self,
        c: &Arc<dyn CheckBack>,
        shop: &Arc<str>,
        id: &Arc<str>,
        expires_at: Millis,
        life_ends_at: Millis,
    ) -> Result<Standing, EngineError> {
        if now_ms() >= life_ends_at {
            return Ok(Standing::Apply {
                action: CheckAction::Release,
                life_end: true,
            });
        }
        let letter = c
            .dead_letter(shop, id)
            .await
            .map_err(|e| EngineError::Store(StoreError::Storage(e)))?;
        Ok(match letter {
            // A letter of this expiry (not of an earlier one, or of an earlier hold of
            // the same id), still open: the check ran out and its default stands.
            Some(l) if l.resolved.is_none() && l.expires_at == expires_at => {
                match l.applied.as_str() {
                    "ask" => Standing::Wait,
                    // The default was applied but its ending did not land (the node
                    // stopped, say): applied again, without asking the shop again.
                    "confirm" => Standing::Apply {
                        action: CheckAction::Confirm,
                        life_end: false,
                    },
                    _ => Standing::Apply {
                        action: CheckAction::Release,
                        life_end: false,
                    },
                }
            }
            _ => Standing::Ask,
        })
    }

    /// Once the 7-day life of a hold (or order) ended it, its open dead letter says so.
    async fn life_ended(
        &self,
        c: &Arc<dyn CheckBack>,
        shop: &Arc<str>,
        id: &Arc<str>,
        standing: &Standing,
    ) {
        if !matches!(standing, Standing::Apply { life_end: true, .. }) {
            return;
        }
        let resolution = Resolution {
            action: CheckAction::Release.name().to_string(),
            by: "life_end".to_string(),
            at: now_ms(),
        };
        if let Err(e) = c.resolve(shop, id, resolution).await {
            tracing::warn!(%shop, %id, error = %e, "dead letter not marked resolved at the end of its hold's life");
        }
    }
}

/// What a due hold's (or order's) dead letter says before its shop is asked.
enum Standing {
    /// No open dead letter of this expiry: the shop is asked.
    Ask,
    /// An operator decides (an open dead letter whose default is `ask`): nothing now.
    Wait,
    /// Applied without asking: the default an open dead letter recorded, or a release
    /// at the end of the 7-day life of the hold (`life_end`).
    Apply { action: CheckAction, life_end: bool },
}

/// When a hold made at `made_at` expires if extended by `ttl_ms` from `now`: within the
/// 7-day life of a hold.
pub(crate) fn extended_until(now: Millis, ttl_ms: i64, made_at: Millis) -> Millis {
    now.saturating_add(ttl_ms.max(0))
        .min(made_at.saturating_add(HOLD_TTL_MAX_MS))
}

/// The outcome among `outcomes` that took line `i` of `order_id` a step (under its first
/// hold's key or its second's), if one did.
pub(crate) fn line_outcome<'a>(
    order_id: &str,
    i: usize,
    outcomes: &'a [Arc<Outcome>],
) -> Option<&'a Arc<Outcome>> {
    let keys = [line_key(order_id, i), retry_line_key(order_id, i)];
    outcomes
        .iter()
        .find(|o| o.status == Status::Ok && o.hold_id.as_ref().is_some_and(|id| keys.contains(id)))
}

/// The request extending pending hold `h` until `until` (its key names the new expiry, so
/// the same extension asked twice is one decision).
pub(crate) fn extension(shop: &Arc<str>, h: &HoldView, now: Millis, until: Millis) -> Request {
    Request {
        hold_id: Some(h.hold_id.clone()),
        ttl_ms: until - now,
        // What a check-back asks for stands past the expiry it was asked at (see
        // `Processor::extend_hold`); `extend.rs` clears it for a caller's extension.
        by_check: true,
        ..Request::new(
            shop.clone(),
            h.item.clone(),
            format!("~ext:{}:{until}", h.hold_id).into(),
            Op::Extend,
            h.qty,
            now,
        )
    }
}

/// The request that makes an order's record: a pending "hold" of one of the shop's
/// order items whose `qty` is the number of lines, its `reason` the lines (JSON).
fn record_request(
    shop: &Arc<str>,
    order_id: &Arc<str>,
    lines: &[OrderLine],
    ttl_ms: i64,
    buyer: &Option<Arc<str>>,
    started: Millis,
) -> Request {
    Request {
        ttl_ms,
        buyer: buyer.clone(),
        reason: Some(lines_json(lines).into()),
        ..Request::new(
            shop.clone(),
            order_item(shop, order_id),
            order_id.clone(),
            Op::Order,
            lines.len() as i64,
            started,
        )
    }
}

/// What every line of one order's reserving shares ([`Engine::place_order`]).
struct Reserving<'a> {
    shop: &'a Arc<str>,
    order_id: &'a Arc<str>,
    buyer: &'a Option<Arc<str>>,
    /// The order's expiry: each line's hold lasts until then.
    expires_at: Millis,
    /// When the reserving gives up: the reply timeout after it began.
    give_up: Instant,
}

/// Held: the lines are no longer tentative on their items.
fn firm_requests(shop: &Arc<str>, held: &[(usize, HoldView)]) -> Vec<Request> {
    held.iter()
        .map(|(_, h)| Request {
            hold_id: Some(h.hold_id.clone()),
            ..Request::new(
                shop.clone(),
                h.item.clone(),
                format!("~firm:{}", h.hold_id).into(),
                Op::Firm,
                h.qty,
                now_ms(),
            )
        })
        .collect()
}

/// An order whose every line is held, with each line's item seq.
fn held_view(
    order_id: Arc<str>,
    lines: &[OrderLine],
    seqs: Vec<Option<u64>>,
    expires_at: Millis,
) -> OrderView {
    OrderView {
        order_id,
        status: HoldStatus::Held.as_str().to_string(),
        lines: lines
            .iter()
            .zip(seqs)
            .map(|(l, seq)| LineView {
                item: l.item.clone(),
                qty: l.qty,
                seq,
                status: HoldStatus::Held.as_str(),
            })
            .collect(),
        expires_at: Some(expires_at),
        failed_line: None,
        reason: None,
    }
}

/// The keys of an order's first `n` lines: each line's first key, then each line's
/// second ([`retry_line_key`]), in line order.
fn line_keys_both(order_id: &str, n: usize) -> Vec<Arc<str>> {
    (0..n)
        .map(|i| line_key(order_id, i))
        .chain((0..n).map(|i| retry_line_key(order_id, i)))
        .collect()
}

/// The hold a line makes under `hold_id` (its key).
fn line_hold(shop: &Arc<str>, hold_id: Arc<str>, line: &OrderLine, expires_at: Millis) -> HoldView {
    HoldView {
        hold_id,
        status: HoldStatus::Held,
        shop: shop.clone(),
        item: line.item.clone(),
        qty: line.qty,
        expires_at,
        seq: 0,
        buyer: None,
    }
}

fn not_held(lines: &[OrderLine]) -> Vec<LineView> {
    lines
        .iter()
        .map(|l| LineView {
            item: l.item.clone(),
            qty: l.qty,
            seq: None,
            status: "not_held",
        })
        .collect()
}

/// The status of an order whose record was released, from the ending's reason: the
/// failing line's status (and `failed_line`, `reason` set), `released` by nrtxn (with
/// its reason), or `cancelled` by its caller.
fn released_status(view: &mut OrderView, ending_reason: Option<String>) -> String {
    match ending_reason.as_deref().and_then(parse_failure) {
        Some((line, status, reason)) => {
            view.failed_line = Some(line);
            view.reason = Some(reason);
            status
        }
        None if ending_reason.is_some() => {
            view.reason = ending_reason;
            "released".into()
        }
        None => "cancelled".into(),
    }
}

/// `failed_line {i}: {status}: {reason}` back into its parts.
fn parse_failure(reason: &str) -> Option<(usize, String, String)> {
    let rest = reason.strip_prefix(FAILED_PREFIX)?;
    let (line, rest) = rest.split_once(": ")?;
    let (status, why) = rest.split_once(": ").unwrap_or((rest, ""));
    Some((line.parse().ok()?, status.to_string(), why.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failure_reason_reads_back() {
        let r = format!("{FAILED_PREFIX}3: insufficient_stock: requested 2, available 1");
        assert_eq!(
            parse_failure(&r),
            Some((
                3,
                "insufficient_stock".to_string(),
                "requested 2, available 1".to_string()
            ))
        );
        assert_eq!(parse_failure("cancelled"), None);
    }

    #[test]
    fn lines_round_trip_through_the_record() {
        let lines = vec![
            OrderLine {
                item: "a".into(),
                qty: 2,
            },
            OrderLine {
                item: "b\"c".into(),
                qty: 1,
            },
        ];
        let record = Outcome {
            shop: "s".into(),
            request_key: "o".into(),
            status: Status::Ok,
            reason: Some(lines_json(&lines)),
            item: "~orders/1".into(),
            op: Op::Order,
            qty: 2,
            qty_taken: None,
            stock_before: None,
            stock_after: None,
            seq: None,
            prev_seq: None,
            submitted_at: 0,
            completed_at: 0,
            hold_id: None,
            expires_at: None,
            ttl_ms: None,
            reserved_after: None,
            seller: None,
            buyer: None,
            opens_at: None,
            closes_at: None,
            low_stock_at: None,
            requested_at: 0,
        };
        assert_eq!(lines_of(&record), lines);
    }
}
