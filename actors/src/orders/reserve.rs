//! An order's lines reserved (`docs/decisions/orders.md`).
//!
//! 1. **All at once.** Every line is sent in one call with the order's record
//!    ([`first_attempt`], `Engine::record_and_lines`), each marked never to wait
//!    ([`Request::no_wait`]): the record and the lines of all shards are decided in
//!    parallel, in one round of group commits. Every line held: the order is held. A line refused for real
//!    (its stock is short even with other orders' tentative lines counted back): the
//!    order is refused. Neither waits for anything, so this round adds no edge to the
//!    waits-for graph.
//! 2. **Contention.** A line told it would have to wait for other orders' tentative
//!    lines ([`Status::Tentative`]) is not decided: the order goes on one line after the
//!    other in item order from the first such line, waiting as before. The lines before
//!    it in item order stay held (the sequential protocol would hold them too); the ones
//!    after it that were held are released first, so that the order never holds a line
//!    past the one it waits on, and are held again later under a key of their own
//!    ([`retry_line_key`]), since a key is decided once. An order waits only for orders
//!    ahead of it on an item, which never wait for it: no deadlock, and no line is
//!    refused for stock another order holds tentatively.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{
    firm_requests, held_view, line_hold, line_keys_both, not_held, Lines, OrderLine, OrderView,
    Placed, Reserving, FAILED_PREFIX, LINE_WAIT_MAX,
};
use crate::engine::{Engine, EngineError};
use crate::reply::Reply;
use crate::types::{
    line_key, now_ms, retry_line_key, HoldStatus, HoldView, Op, Outcome, Request, Status,
};

/// How the first, parallel attempt at an order's lines ended.
enum AtOnce {
    /// Every line held, with its item's seq.
    Held(Vec<Option<u64>>),
    /// Line `i` (the first refused in item order) was refused: status and reason.
    Refused(usize, Status, String),
    /// Line `i` (the first in item order) would have to wait for other orders.
    Contended(usize),
}

/// Where a line stands after the first attempt.
enum Line {
    Held(Option<u64>),
    Tentative,
    Refused(Status, String),
}

impl Engine {
    /// Holds the lines of an order whose record is made, from the replies to its first
    /// attempt (every line at once, sent with the record: [`first_attempt`]); under
    /// contention, one after the other in item order (see the module's documentation).
    /// `None`: a call asked again, which goes on one line after the other. A line
    /// refused releases the order before it is answered.
    pub(super) async fn reserve_lines(
        &self,
        r: &Reserving<'_>,
        lines: Vec<OrderLine>,
        first: Option<Vec<Reply>>,
    ) -> Result<Placed, EngineError> {
        let repeat = first.is_none();
        let (shop, order_id) = (r.shop, r.order_id);
        let mut order_of: Vec<usize> = (0..lines.len()).collect();
        order_of.sort_by(|a, b| lines[*a].item.cmp(&lines[*b].item));
        let mut seqs: Vec<Option<u64>> = vec![None; lines.len()];
        let mut held: Vec<(usize, HoldView)> = Vec::with_capacity(lines.len());
        // A call asked again may find the lines of an attempt it did not finish: it goes
        // on one line after the other, each under the key it was last held with.
        let (keys, from) = if let Some(replies) = first {
            let mut keys: Vec<Arc<str>> = (0..lines.len()).map(|i| line_key(order_id, i)).collect();
            let (at_once, taken) = self.at_once(r, &lines, &keys, &order_of, replies).await?;
            match at_once {
                AtOnce::Held(all) => {
                    seqs = all;
                    held = taken;
                    (keys, lines.len())
                }
                AtOnce::Refused(i, status, reason) => {
                    return self.refuse(r, &lines, taken, i, status, reason).await;
                }
                AtOnce::Contended(first) => {
                    let at = order_of.iter().position(|i| *i == first).unwrap_or(0);
                    held = self.contended(r, &order_of[..at], taken, &mut keys).await?;
                    for (i, h) in &held {
                        seqs[*i] = Some(h.seq);
                    }
                    (keys, at)
                }
            }
        } else {
            (self.line_keys_now(shop, order_id, lines.len()).await?, 0)
        };
        for &i in &order_of[from..] {
            let line = &lines[i];
            match self.hold_line(r, &keys[i], line, &held).await? {
                Ok(seq) => {
                    seqs[i] = seq;
                    held.push((i, line_hold(shop, keys[i].clone(), line, r.expires_at)));
                }
                Err((status, reason)) => {
                    return self.refuse(r, &lines, held, i, status, reason).await;
                }
            }
        }
        self.send_internal(firm_requests(shop, &held));
        if repeat || now_ms() >= r.expires_at {
            // The record may have ended meanwhile (expired, or released by a check at a
            // restart): the order is answered as it stands.
            if let Some(view) = self.order_unless_reserving(shop, order_id).await? {
                return Ok(Placed::Answer(view));
            }
        }
        Ok(Placed::Answer(held_view(
            order_id.clone(),
            &lines,
            seqs,
            r.expires_at,
        )))
    }

    /// The first attempt met contention: of the lines it `taken`, those in `before` (the
    /// lines ahead of the first contended one in item order) stay held and are given
    /// back; the others are released before any wait, so that no line past the one
    /// waited on stays held, and get their second key in `keys`, to be held again.
    async fn contended(
        &self,
        r: &Reserving<'_>,
        before: &[usize],
        taken: Vec<(usize, HoldView)>,
        keys: &mut [Arc<str>],
    ) -> Result<Vec<(usize, HoldView)>, EngineError> {
        let (kept, after): (Vec<_>, Vec<_>) =
            taken.into_iter().partition(|(i, _)| before.contains(i));
        let why = "released to be held again in item order (contention)";
        let again: Vec<HoldView> = after.iter().map(|(_, h)| h.clone()).collect();
        if let Err(e) = self.end_holds(r.shop, again, Op::Release, Some(why)).await {
            let all: Vec<(usize, HoldView)> = kept.into_iter().chain(after).collect();
            return Err(self.give_up(r, &all, e).await);
        }
        for (i, _) in &after {
            keys[*i] = retry_line_key(r.order_id, *i);
        }
        Ok(kept)
    }

    /// How the first attempt ended, from its `replies` (one per line). Also the lines
    /// it held (by index, with their holds), whatever it ended as.
    async fn at_once(
        &self,
        r: &Reserving<'_>,
        lines: &[OrderLine],
        keys: &[Arc<str>],
        order_of: &[usize],
        replies: Vec<Reply>,
    ) -> Result<(AtOnce, Vec<(usize, HoldView)>), EngineError> {
        debug_assert_eq!(replies.len(), lines.len(), "one reply per line");
        let mut states = Vec::with_capacity(lines.len());
        for reply in replies {
            states.push(match reply {
                Reply::Repeat(o) | Reply::Decided(o) => line_state(&o),
                // Still undecided at the call's deadline: given up as a line is.
                _ => return Err(self.give_up(r, &[], EngineError::Timeout).await),
            });
        }
        let taken: Vec<(usize, HoldView)> = states
            .iter()
            .enumerate()
            .filter_map(|(i, s)| match s {
                Line::Held(seq) => {
                    let mut h = line_hold(r.shop, keys[i].clone(), &lines[i], r.expires_at);
                    h.seq = seq.unwrap_or_default();
                    Some((i, h))
                }
                _ => None,
            })
            .collect();
        let refused = order_of.iter().find_map(|&i| match &states[i] {
            Line::Refused(status, reason) => Some(AtOnce::Refused(i, *status, reason.clone())),
            _ => None,
        });
        let contended = order_of
            .iter()
            .find(|&&i| matches!(states[i], Line::Tentative))
            .map(|&i| AtOnce::Contended(i));
        let all = states.iter().map(|s| match s {
            Line::Held(seq) => *seq,
            _ => None,
        });
        let outcome = refused
            .or(contended)
            .unwrap_or_else(|| AtOnce::Held(all.collect()));
        Ok((outcome, taken))
    }

    /// A line refused for real: the order's record ends (with the failing line), then
    /// every line `held` is released, and only then is the order answered.
    async fn refuse(
        &self,
        r: &Reserving<'_>,
        lines: &[OrderLine],
        held: Vec<(usize, HoldView)>,
        i: usize,
        status: Status,
        reason: String,
    ) -> Result<Placed, EngineError> {
        let why = format!("{FAILED_PREFIX}{i}: {}: {reason}", status.as_str());
        self.end_order_lines(
            r.shop,
            r.order_id,
            Op::Release,
            Some(why),
            Lines::Known(&held),
        )
        .await?;
        Ok(Placed::Answer(OrderView {
            order_id: r.order_id.clone(),
            status: status.as_str().to_string(),
            lines: not_held(lines),
            expires_at: Some(r.expires_at),
            failed_line: Some(i),
            reason: Some(reason),
        }))
    }

    /// Nothing to answer the caller with (`e`): the order is released so that no line
    /// stays held (`held`: the lines known held, else they are read; a line whose hold
    /// was still on its way is released by its own timer, through the order), and `e`
    /// is given back.
    async fn give_up(
        &self,
        r: &Reserving<'_>,
        held: &[(usize, HoldView)],
        e: EngineError,
    ) -> EngineError {
        let why = format!("reserving the lines failed: {e}");
        let known = if held.is_empty() {
            Lines::Read
        } else {
            Lines::Known(held)
        };
        let _ = self
            .end_order_lines(r.shop, r.order_id, Op::Release, Some(why), known)
            .await;
        e
    }

    /// Holds one line under `key`, waiting while its item's stock is tentative, until
    /// the reserving gives up: its item's seq, or why it was refused. On an error the
    /// order is released (`held`: the lines held so far) and the error returned.
    async fn hold_line(
        &self,
        r: &Reserving<'_>,
        key: &Arc<str>,
        line: &OrderLine,
        held: &[(usize, HoldView)],
    ) -> Result<Result<Option<u64>, (Status, String)>, EngineError> {
        let mut wait = Duration::from_millis(1);
        loop {
            let req = line_request(r, key, line);
            // The whole reserving is bounded by the reply timeout, so that a node
            // checking orders it reads back knows when a coordinator has given up.
            let decided = tokio::time::timeout_at(r.give_up.into(), self.decide_one(r.shop, req))
                .await
                .unwrap_or(Err(EngineError::Timeout));
            let o = match decided {
                Ok(o) => o,
                Err(e) => return Err(self.give_up(r, held, e).await),
            };
            match o.status {
                Status::Ok => return Ok(Ok(o.seq)),
                Status::Tentative if Instant::now() < r.give_up => {
                    tokio::time::sleep(wait).await;
                    wait = (wait * 2).min(LINE_WAIT_MAX);
                }
                Status::Tentative => {
                    return Ok(Err((
                        Status::InsufficientStock,
                        format!(
                            "{} (still so after waiting {} ms for them)",
                            o.reason.as_deref().unwrap_or("too little stock"),
                            self.reply_timeout().as_millis()
                        ),
                    )))
                }
                status => return Ok(Err((status, o.reason.clone().unwrap_or_default()))),
            }
        }
    }

    /// The key each of an order's `n` lines was last held under (or is to be held
    /// under): the second one where the first was held and released by a contended
    /// first attempt.
    async fn line_keys_now(
        &self,
        shop: &Arc<str>,
        order_id: &Arc<str>,
        n: usize,
    ) -> Result<Vec<Arc<str>>, EngineError> {
        let holds = self.line_holds_both(shop, order_id, n).await?;
        Ok(holds
            .into_iter()
            .enumerate()
            .map(|(i, (first, retry))| {
                let released = first.is_some_and(|h| h.status != HoldStatus::Held);
                if retry.is_some() || released {
                    retry_line_key(order_id, i)
                } else {
                    line_key(order_id, i)
                }
            })
            .collect())
    }

    /// The holds of an order's first `n` lines under their first key and under their
    /// second ([`retry_line_key`]), in line order.
    pub(super) async fn line_holds_both(
        &self,
        shop: &Arc<str>,
        order_id: &Arc<str>,
        n: usize,
    ) -> Result<Vec<(Option<HoldView>, Option<HoldView>)>, EngineError> {
        let mut firsts = self.holds_of(shop, line_keys_both(order_id, n)).await?;
        let retries = firsts.split_off(n);
        Ok(firsts.into_iter().zip(retries).collect())
    }
}

/// The first attempt's requests: every line under its first key, none waiting.
pub(super) fn first_attempt(r: &Reserving<'_>, lines: &[OrderLine]) -> Vec<(Request, bool)> {
    lines
        .iter()
        .enumerate()
        .map(|(i, line)| {
            let req = Request {
                no_wait: true,
                ..line_request(r, &line_key(r.order_id, i), line)
            };
            (req, true)
        })
        .collect()
}

/// The lines a first attempt's `replies` held that this call decided (not repeats of
/// an earlier call's): what to release when the call's record says the order is not
/// this call's to reserve.
pub(super) fn newly_held(
    r: &Reserving<'_>,
    lines: &[OrderLine],
    replies: &[Reply],
) -> Vec<HoldView> {
    lines
        .iter()
        .zip(replies)
        .enumerate()
        .filter_map(|(i, (line, reply))| match reply {
            Reply::Decided(o) if o.status == Status::Ok && o.op == Op::Hold => {
                let mut h = line_hold(r.shop, line_key(r.order_id, i), line, r.expires_at);
                h.seq = o.seq.unwrap_or_default();
                Some(h)
            }
            _ => None,
        })
        .collect()
}

/// A line's hold request under `key`, lasting until the order's expiry.
fn line_request(r: &Reserving<'_>, key: &Arc<str>, line: &OrderLine) -> Request {
    let now = now_ms();
    Request {
        ttl_ms: (r.expires_at - now).max(1),
        buyer: r.buyer.clone(),
        ..Request::new(
            r.shop.clone(),
            line.item.clone(),
            key.clone(),
            Op::Hold,
            line.qty,
            now,
        )
    }
}

fn line_state(o: &Outcome) -> Line {
    match o.status {
        Status::Ok => Line::Held(o.seq),
        Status::Tentative => Line::Tentative,
        status => Line::Refused(status, o.reason.clone().unwrap_or_default()),
    }
}
