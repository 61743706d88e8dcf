//! A shop's check-back before one of its holds or orders expires: the port
//! the engine asks through. The adapter (the server's, over HTTP with a signed body)
//! keeps the shops' settings, calls the shop, retries, and falls back to the shop's
//! default; the engine turns its answer into a confirm, an expiry or an extension,
//! journaled like any other decision. Nothing here runs on a processor.
//!
//! A check the shop does not answer is a dead letter, kept in the adapter's store (so
//! every node sees it, and it survives a restart). With the default `ask` nothing is
//! applied: the hold stays pending (reported `checking`) until an operator resolves its
//! dead letter, or the 7-day life of a hold ends it.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::types::Millis;
use crate::types::OrderLine;

/// What a check-back is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CheckKind {
    Hold,
    Order,
}

/// The call to a shop's `check_url`. Field names are the body's.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CheckCall {
    pub shop: Arc<str>,
    pub kind: CheckKind,
    pub id: Arc<str>,
    pub lines: Vec<OrderLine>,
    pub expires_at: Millis,
    /// When the 7-day life of the hold (or order) ends: no attempt of a retry schedule
    /// is made past it. Not sent to the shop.
    #[serde(skip)]
    pub life_ends_at: Millis,
    /// An operator's retry of a dead letter: one round of quick retries, not the
    /// schedule, and no default applied when unanswered (the hold keeps its state).
    /// Not sent to the shop.
    #[serde(skip)]
    pub retry: bool,
}

/// What a shop answered (or its default, when it did not answer in time).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CheckAction {
    /// Paid: sold.
    Confirm,
    /// Expires as without a check-back.
    Release,
    /// Waits this much longer (within the 7-day life of a hold).
    Extend { ttl_ms: i64 },
    /// Unanswered, and nothing is applied: the shop's default is `ask` (an operator
    /// resolves its dead letter), or an operator's retry found no answer.
    Ask,
}

impl CheckAction {
    /// The action's name, as the shop's answer and a dead letter's resolution have it.
    pub fn name(self) -> &'static str {
        match self {
            CheckAction::Confirm => "confirm",
            CheckAction::Release => "release",
            CheckAction::Extend { .. } => "extend",
            CheckAction::Ask => "ask",
        }
    }
}

/// The boxed future of a port call.
pub type CheckFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

/// A shop's check-back settings. Field names are the API's.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckSettings {
    pub check_url: String,
    pub check_timeout_ms: u64,
    pub check_retries: u32,
    /// `release`, `confirm` or `ask`: what applies when the shop does not answer.
    pub check_default: String,
    /// The waits before each attempt after the first, when set: the shop is asked
    /// `1 + len` times over minutes to hours, each attempt within `check_timeout_ms`,
    /// and `check_retries` does not apply. Empty: `check_retries` quick retries.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub check_retry_schedule_ms: Vec<u64>,
}

/// A shop's stock alerts: where they are sent, and which kinds
/// ([`ALERT_KINDS`]). Field names are the API's.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NotifySettings {
    pub notify_url: String,
    pub notify_events: Vec<String>,
}

/// The kinds of alert a shop may ask for: the three stock crossings of its items'
/// events, and a check-back that became a dead letter.
pub const ALERT_KINDS: [&str; 4] = ["sold_out", "low_stock", "back_in_stock", "dead_letter"];

/// Everything a shop has set: a check-back and alerts, each optional.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct ShopSettings {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub check: Option<CheckSettings>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub notify: Option<NotifySettings>,
}

impl ShopSettings {
    /// Whether the shop has nothing set (its settings, and its secret, are removed).
    pub fn is_empty(&self) -> bool {
        self.check.is_none() && self.notify.is_none()
    }

    /// Whether the shop asked for alerts of `kind`.
    pub fn wants(&self, kind: &str) -> Option<&str> {
        self.notify
            .as_ref()
            .filter(|n| n.notify_events.iter().any(|k| k == kind))
            .map(|n| n.notify_url.as_str())
    }
}

/// One alert sent to a shop's `notify_url`, signed as a check-back is. Field names are
/// the body's: a stock crossing has the item's numbers after it (`seq` is the alert's
/// own, in the item's sequence, so a receiver drops a repeat by it); a dead letter's
/// names its hold or order and the default that applied.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Alert {
    pub shop: Arc<str>,
    /// `sold_out`, `low_stock`, `back_in_stock` or `dead_letter`.
    pub kind: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub item: Option<Arc<str>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stock: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reserved: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seq: Option<u64>,
    /// A dead letter's hold or order id, and the default that applied.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<Arc<str>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub applied: Option<String>,
    pub at: Millis,
}

/// An alert whose delivery failed for good: every attempt failed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FailedAlert {
    pub alert: Alert,
    /// The last attempt's failure (a timeout, a status), naming neither answer nor URL.
    pub error: String,
    pub attempts: u32,
    /// When the last attempt failed.
    pub at: Millis,
}

/// A check-back that found no answer. One per hold (or order): its `id` is theirs, and
/// an operator's retry that finds no answer either updates it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeadLetter {
    /// The hold's or the order's id (they share a shop's key space).
    pub id: Arc<str>,
    pub kind: CheckKind,
    /// The default that applied: `release`, `confirm`, or `ask` (nothing: an operator
    /// decides).
    pub applied: String,
    /// The last failure (a timeout, a status, an answer that could not be read).
    pub error: String,
    /// Attempts made, an operator's retries' included.
    pub attempts: u32,
    /// When the last attempt failed.
    pub at: Millis,
    /// The hold's (or order's) `expires_at` the shop was asked about.
    #[serde(default)]
    pub expires_at: Millis,
    /// How it was resolved, once it was (`null` while open).
    #[serde(default)]
    pub resolved: Option<Resolution>,
}

/// How and when a dead letter was resolved.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Resolution {
    /// `confirm`, `release` or `extend`.
    pub action: String,
    /// `operator` (resolve), `retry` (the shop answered an operator's retry), or
    /// `life_end` (the 7-day life of the hold ended it as `release` would).
    pub by: String,
    pub at: Millis,
}

/// The check-back adapter.
pub trait CheckBack: Send + Sync + 'static {
    /// Whether `shop` has a check-back set: from memory, called on a processor's thread.
    fn enabled(&self, shop: &str) -> bool;
    /// Calls the shop (retrying as its settings say) and resolves to what to do; never
    /// fails: past its attempts the shop's default applies (`Ask` for `ask`, and for an
    /// operator's retry), and the case is kept as a dead letter.
    fn ask(&self, call: CheckCall) -> CheckFuture<CheckAction>;
    /// The shop's settings (empty if it has none).
    fn settings(&self, shop: &str) -> CheckFuture<Result<ShopSettings, String>>;
    /// Sets the shop's settings; empty ones remove them, and its secret. The shop's
    /// signing secret is made when the shop first gets a `check_url` or a `notify_url`,
    /// or again with `rotate`, and is then returned (the only time it is shown).
    fn set_settings(
        &self,
        shop: &str,
        settings: ShopSettings,
        rotate: bool,
    ) -> CheckFuture<Result<Option<String>, String>>;
    /// The shop's latest alerts that failed for good, oldest first.
    fn failed_alerts(&self, shop: &str) -> CheckFuture<Result<Vec<FailedAlert>, String>>;
    /// Whether `url` may be a shop's `check_url` under the server operator's rules (no
    /// inside address, https unless allowed); the reason names no field.
    fn check_url(&self, url: &str) -> Result<(), String>;
    /// The shop's latest dead letters, oldest first.
    fn dead_letters(&self, shop: &str) -> CheckFuture<Result<Vec<DeadLetter>, String>>;
    /// The dead letter of hold (or order) `id`, `None` if it has none.
    fn dead_letter(&self, shop: &str, id: &str) -> CheckFuture<Result<Option<DeadLetter>, String>>;
    /// Records how dead letter `id` was resolved, unless it already was; the letter as it
    /// stands after (`None`: there is none).
    fn resolve(
        &self,
        shop: &str,
        id: &str,
        resolution: Resolution,
    ) -> CheckFuture<Result<Option<DeadLetter>, String>>;
}
