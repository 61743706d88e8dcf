//! Dead letters an operator acts on: a check-back the shop did not answer is
//! a dead letter in the adapter's store ([`crate::checkback`]); an operator asks the
//! shop again ([`Engine::retry_dead_letter`]) or ends the hold or order as they decide
//! ([`Engine::resolve_dead_letter`]).
//!
//! Both act on a hold (or order) only while it is pending at the expiry its letter is
//! about, and not while a check of it is under way: they take the same per-hold slot
//! as the engine's checks ([`Engine::settling`]), so a hold is asked once at a time.
//! Its ending is a request under the hold's ending key like any other, so the hold
//! ends once whoever comes first.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::checkback::{CheckAction, CheckBack, CheckCall, CheckKind, DeadLetter, Resolution};
use crate::engine::{Engine, EngineError};
use crate::orders::OrderLine;
use crate::ports::StoreError;
use crate::types::{
    hold_end_key, now_ms, HoldStatus, HoldView, Millis, Op, Outcome, Request, Status,
    HOLD_TTL_MAX_MS,
};
use crate::work_manager::PollResult;

/// What an operator asks of an open dead letter's hold or order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LetterAction {
    /// Sold (an order: every line).
    Confirm,
    /// Its units go back (`released`).
    Release,
}

/// What an operator's act on a dead letter led to.
#[derive(Debug)]
pub enum Acted {
    /// No dead letter of that id in the shop (or no check-backs on this server).
    Unknown,
    /// Nothing was done, and why: the hold or order already ended (and how), the letter
    /// was resolved already, or a check of it is under way. With the letter.
    Refused(String, DeadLetter),
    /// Done: the letter as it stands after, and the hold's or order's status.
    Done { letter: DeadLetter, status: String },
}

/// How long an act waits for the per-hold slot: the engine's look at a waiting hold's
/// letter (every 5 s) holds it for a moment; a check under way holds it for its whole
/// schedule, and the act is refused.
const SLOT_WAIT: Duration = Duration::from_secs(2);
const SLOT_POLL: Duration = Duration::from_millis(20);
/// The reason of an order released by an operator (shown as the order's `reason`).
const RELEASED_BY_OPERATOR: &str = "released by an operator, resolving its dead letter";

/// The per-hold slot, given back when dropped.
struct Slot<'a> {
    engine: &'a Engine,
    key: (Arc<str>, Arc<str>),
}

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        self.engine.settling().done(&self.key);
    }
}

/// A dead letter's hold or order, pending.
enum Pending {
    Hold {
        h: HoldView,
        made_at: Millis,
    },
    Order {
        record: HoldView,
        outcome: Arc<Outcome>,
    },
}

fn kind_name(kind: CheckKind) -> &'static str {
    match kind {
        CheckKind::Hold => "hold",
        CheckKind::Order => "order",
    }
}

fn store_error(e: String) -> EngineError {
    EngineError::Store(StoreError::Storage(e))
}

impl Engine {
    /// Whether a pending hold (or order) that expires at `expires_at` is `checking`: past
    /// it, its shop being asked (or an operator deciding).
    pub fn checking(&self, shop: &str, expires_at: Millis) -> bool {
        now_ms() >= expires_at && self.checkback().is_some_and(|c| c.enabled(shop))
    }

    /// Asks the shop again now about dead letter `id`'s hold or order (one round of
    /// quick retries): its answer applies, and resolves the letter (`by: retry`);
    /// unanswered, the letter counts the attempts and the hold keeps its state.
    pub async fn retry_dead_letter(
        &self,
        shop: &Arc<str>,
        id: &Arc<str>,
    ) -> Result<Acted, EngineError> {
        let (c, letter, pending, _slot) = match self.open_letter(shop, id).await? {
            Ok(found) => found,
            Err(acted) => return Ok(acted),
        };
        if !c.enabled(shop) {
            // Nobody to ask (and the adapter would answer `release` for a shop without
            // settings): an operator resolves it instead.
            return Ok(Acted::Refused(
                format!("shop {shop} has no check-back set: resolve the dead letter instead"),
                letter,
            ));
        }
        let (lines, expires_at, made_at) = match &pending {
            Pending::Hold { h, made_at } => (
                vec![OrderLine {
                    item: h.item.clone(),
                    qty: h.qty,
                }],
                h.expires_at,
                *made_at,
            ),
            Pending::Order { record, outcome } => (
                crate::orders::lines_of(outcome),
                record.expires_at,
                outcome.completed_at,
            ),
        };
        let action = c
            .ask(CheckCall {
                shop: shop.clone(),
                kind: letter.kind,
                id: id.clone(),
                lines,
                expires_at,
                life_ends_at: made_at.saturating_add(HOLD_TTL_MAX_MS),
                retry: true,
            })
            .await;
        if action != CheckAction::Ask {
            match pending {
                Pending::Hold { h, made_at } => {
                    self.act_on_hold(shop, &h, made_at, action).await?;
                }
                Pending::Order { record, outcome } => {
                    self.act_on_order(shop, id, record, &outcome, action)
                        .await?;
                }
            }
            let resolution = Resolution {
                action: action.name().to_string(),
                by: "retry".to_string(),
                at: now_ms(),
            };
            c.resolve(shop, id, resolution).await.map_err(store_error)?;
        }
        let letter = c
            .dead_letter(shop, id)
            .await
            .map_err(store_error)?
            .unwrap_or(letter);
        let status = self.status_of(shop, letter.kind, id).await?;
        Ok(Acted::Done { letter, status })
    }

    /// Ends dead letter `id`'s hold or order as an operator decided, and resolves the
    /// letter (`by: operator`). A confirm stands past the expiry, as a shop's does.
    pub async fn resolve_dead_letter(
        &self,
        shop: &Arc<str>,
        id: &Arc<str>,
        action: LetterAction,
    ) -> Result<Acted, EngineError> {
        let (c, letter, pending, _slot) = match self.open_letter(shop, id).await? {
            Ok(found) => found,
            Err(acted) => return Ok(acted),
        };
        let op = match action {
            LetterAction::Confirm => Op::Confirm,
            LetterAction::Release => Op::Release,
        };
        let ending = match pending {
            Pending::Hold { h, .. } => {
                let req = Request {
                    hold_id: Some(id.clone()),
                    by_check: true,
                    ..Request::new(
                        shop.clone(),
                        h.item.clone(),
                        hold_end_key(id),
                        op,
                        h.qty,
                        now_ms(),
                    )
                };
                self.decide_one(shop, req).await?
            }
            Pending::Order { .. } => {
                let reason = (op == Op::Release).then(|| RELEASED_BY_OPERATOR.to_string());
                let (lines, ender) = (crate::orders::Lines::Read, crate::orders::Ender::Check);
                let ended = self.end_order_lines_with(shop, id, op, reason, lines, ender);
                ended.await?.0
            }
        };
        if ending.status != Status::Ok || ending.op != op {
            // Ended otherwise between the look and the ending (a caller's cancel, say).
            let status = self.status_of(shop, letter.kind, id).await?;
            return Ok(Acted::Refused(
                format!(
                    "{} {id} ended otherwise meanwhile: it is {status}",
                    kind_name(letter.kind)
                ),
                letter,
            ));
        }
        let resolution = Resolution {
            action: match action {
                LetterAction::Confirm => "confirm",
                LetterAction::Release => "release",
            }
            .to_string(),
            by: "operator".to_string(),
            at: now_ms(),
        };
        let letter = c
            .resolve(shop, id, resolution)
            .await
            .map_err(store_error)?
            .unwrap_or(letter);
        let status = self.status_of(shop, letter.kind, id).await?;
        Ok(Acted::Done { letter, status })
    }

    /// Dead letter `id`, open, with its pending hold or order and the per-hold slot;
    /// else what to answer.
    #[allow(clippy::type_complexity)]
    async fn open_letter(
        &self,
        shop: &Arc<str>,
        id: &Arc<str>,
    ) -> Result<Result<(Arc<dyn CheckBack>, DeadLetter, Pending, Slot<'_>), Acted>, EngineError>
    {
        let Some(c) = self.checkback() else {
            return Ok(Err(Acted::Unknown));
        };
        let Some(letter) = c.dead_letter(shop, id).await.map_err(store_error)? else {
            return Ok(Err(Acted::Unknown));
        };
        let what = kind_name(letter.kind);
        let Some(slot) = self.slot(shop, id).await else {
            return Ok(Err(Acted::Refused(
                format!("a check of {what} {id} is under way: ask again once it ends"),
                letter,
            )));
        };
        // Read again in the slot: an act that held it may have resolved it meanwhile.
        let Some(letter) = c.dead_letter(shop, id).await.map_err(store_error)? else {
            return Ok(Err(Acted::Unknown));
        };
        let found = self.holds_of(shop, vec![id.clone()]).await?.pop().flatten();
        let Some(h) = found else {
            return Ok(Err(Acted::Refused(
                format!("{what} {id} is no longer in shop {shop}"),
                letter,
            )));
        };
        if h.status != HoldStatus::Held {
            let status = self.status_of(shop, letter.kind, id).await?;
            return Ok(Err(Acted::Refused(
                format!("{what} {id} already ended: it is {status}"),
                letter,
            )));
        }
        if let Some(r) = &letter.resolved {
            return Ok(Err(Acted::Refused(
                format!(
                    "the dead letter of {what} {id} was resolved already ({} by {} at {})",
                    r.action, r.by, r.at
                ),
                letter,
            )));
        }
        if h.expires_at != letter.expires_at {
            return Ok(Err(Acted::Refused(
                format!(
                    "the dead letter is about {what} {id} expiring at {}; it expires at {} now",
                    letter.expires_at, h.expires_at
                ),
                letter,
            )));
        }
        let Some(pending) = self.pending(shop, id, letter.kind, h).await? else {
            return Ok(Err(Acted::Refused(
                format!("order {id} is no longer in shop {shop}"),
                letter,
            )));
        };
        Ok(Ok((c, letter, pending, slot)))
    }

    /// What dead letter `id` of `kind` waits on, its hold or order record `h` still
    /// held; `None`: an order whose outcome is no longer in the shop.
    async fn pending(
        &self,
        shop: &Arc<str>,
        id: &Arc<str>,
        kind: CheckKind,
        h: HoldView,
    ) -> Result<Option<Pending>, EngineError> {
        Ok(match kind {
            CheckKind::Hold => {
                let made_at = match self.poll(shop, id.clone()).await? {
                    PollResult::Decided(o) => o.completed_at,
                    _ => h.expires_at,
                };
                Some(Pending::Hold { h, made_at })
            }
            CheckKind::Order => self
                .order_record(shop, id)
                .await?
                .map(|outcome| Pending::Order { record: h, outcome }),
        })
    }

    /// Takes the per-hold slot of `id`, waiting up to [`SLOT_WAIT`] for it.
    async fn slot(&self, shop: &Arc<str>, id: &Arc<str>) -> Option<Slot<'_>> {
        let key = (shop.clone(), id.clone());
        let until = Instant::now() + SLOT_WAIT;
        loop {
            // An operator's retry or resolve: one per hold, outside the bound of checks due.
            if self.settling().take(&key, false) {
                return Some(Slot { engine: self, key });
            }
            if Instant::now() >= until {
                return None;
            }
            tokio::time::sleep(SLOT_POLL).await;
        }
    }

    /// A hold's or order's status as its GET answers it (`checking` included).
    async fn status_of(
        &self,
        shop: &Arc<str>,
        kind: CheckKind,
        id: &Arc<str>,
    ) -> Result<String, EngineError> {
        Ok(match kind {
            CheckKind::Hold => match self.hold(shop, id).await? {
                Some(h) if h.status == HoldStatus::Held && self.checking(shop, h.expires_at) => {
                    "checking".to_string()
                }
                Some(h) => h.status.as_str().to_string(),
                None => "unknown".to_string(),
            },
            CheckKind::Order => match self.order(shop, id).await? {
                Some(view) => view.status,
                None => "unknown".to_string(),
            },
        })
    }
}
