//! A shop's check-back before one of its holds or orders expires (issue 15): the port
//! the engine asks through. The adapter (the server's, over HTTP with a signed body)
//! keeps the shops' settings, calls the shop, retries, and falls back to the shop's
//! default; the engine turns its answer into a confirm, an expiry or an extension,
//! journaled like any other decision. Nothing here runs on a processor.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::orders::OrderLine;
use crate::types::Millis;

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
}

/// The boxed future of a port call.
pub type CheckFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

/// A shop's check-back settings. Field names are the API's.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckSettings {
    pub check_url: String,
    pub check_timeout_ms: u64,
    pub check_retries: u32,
    /// `release` or `confirm`: what applies when the shop does not answer.
    pub check_default: String,
}

/// A check-back that found no answer: the default applied.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeadLetter {
    pub kind: CheckKind,
    pub id: Arc<str>,
    /// The default that applied: `release` or `confirm`.
    pub applied: String,
    /// The last failure (a timeout, a status, an answer that could not be read).
    pub error: String,
    pub attempts: u32,
    pub at: Millis,
}

/// The check-back adapter.
pub trait CheckBack: Send + Sync + 'static {
    /// Whether `shop` has a check-back set: from memory, called on a processor's thread.
    fn enabled(&self, shop: &str) -> bool;
    /// Calls the shop (retrying as its settings say) and resolves to what to do; never
    /// fails: past its attempts the shop's default applies, and the case is kept as a
    /// dead letter.
    fn ask(&self, call: CheckCall) -> CheckFuture<CheckAction>;
    /// The shop's settings, `None` if it has none.
    fn settings(&self, shop: &str) -> CheckFuture<Result<Option<CheckSettings>, String>>;
    /// Sets (or with `None` removes) the shop's settings. The shop's signing secret is
    /// made when the shop first gets a `check_url`, or again with `rotate`, and is then
    /// returned (the only time it is shown).
    fn set_settings(
        &self,
        shop: &str,
        settings: Option<CheckSettings>,
        rotate: bool,
    ) -> CheckFuture<Result<Option<String>, String>>;
    /// Whether `url` may be a shop's `check_url` under the server operator's rules (no
    /// inside address, https unless allowed); the reason names no field.
    fn check_url(&self, url: &str) -> Result<(), String>;
    /// The shop's latest dead letters, oldest first.
    fn dead_letters(&self, shop: &str) -> Vec<DeadLetter>;
}
