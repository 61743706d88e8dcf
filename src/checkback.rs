//! The shops' check-backs over HTTP (issue 15): the adapter of
//! [`nrtxn_actors::checkback`].
//!
//! - Settings are kept beside the access keys: `{data_dir}/checks.sqlite` on the
//!   embedded default, the collection `shop_checks` with MongoDB (shared by every node).
//!   Each node reads them all again every [`RELOAD_INTERVAL`], and keeps them in memory,
//!   where a processor asks whether a shop has one.
//! - A shop's signing secret is kept as it is (it must sign every call); it is shown once,
//!   by the settings call that makes it.
//! - A call is `POST check_url` with the JSON body of [`CheckCall`] and the header
//!   `X-Nrtxn-Signature: t=<unix ms>,v1=<hex HMAC-SHA256 of "{t}.{body}", keyed by the
//!   secret>`: the time is signed with the body, so a receiver can refuse a replay.
//!   Calls go through [`crate::outbound`] (no inside address, https only, no redirect,
//!   answers up to 64 KiB, bounded in flight per shop and per node: a call waits its
//!   turn before its attempts start).
//!   Failures (an error status, an answer that is not one of the actions, no answer
//!   within `check_timeout_ms`) are tried again with a backoff, up to `check_retries`
//!   times; the whole check ends within `check_timeout_ms × (check_retries + 1)` plus
//!   2 s. Then the shop's `check_default` applies, and the case is kept as a dead letter
//!   (the latest [`DEAD_LETTERS_PER_SHOP`] per shop, in this node's memory) and counted,
//!   with a short reason that holds neither the answer nor the URL.
//! - The calls run on a small runtime of their own, never on a processor or an HTTP
//!   worker.

use std::collections::{HashMap, VecDeque};
use std::path::Path;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use anyhow::Context;
use futures::TryStreamExt;
use hmac::{Hmac, KeyInit, Mac};
use mongodb::bson::{doc, Document};
use nrtxn_actors::checkback::{
    CheckAction, CheckBack, CheckCall, CheckFuture, CheckSettings, DeadLetter,
};
use nrtxn_actors::{now_ms, Metrics, HOLD_TTL_MAX_MS};
use rusqlite::{params, Connection, OptionalExtension};
use sha2::Sha256;

use crate::outbound::{Outbound, OutboundPolicy};

/// How often every node reads the shops' settings again.
pub const RELOAD_INTERVAL: Duration = Duration::from_secs(2);
/// Dead letters kept per shop (the latest).
pub const DEAD_LETTERS_PER_SHOP: usize = 100;
/// Shops whose dead letters are kept; past it a new shop's are only counted.
const DEAD_LETTER_SHOPS_MAX: usize = 10_000;
/// Slack of a whole check beyond its attempts' timeouts (the issue's 2 s): the backoffs
/// between attempts come out of it.
const CHECK_SLACK: Duration = Duration::from_secs(2);
/// Longest backoff between two attempts.
const BACKOFF_MAX: Duration = Duration::from_millis(500);
/// The embedded store's file in the data dir.
pub const CHECKS_FILE: &str = "checks.sqlite";
/// Prefix of a signing secret.
const SECRET_PREFIX: &str = "nrtxn_chk_";

/// A shop's settings and secret.
#[derive(Clone, Debug)]
struct ShopCheck {
    settings: CheckSettings,
    secret: String,
}

enum Store {
    Sqlite(Mutex<Connection>),
    Mongo(mongodb::Collection<Document>),
}

impl Store {
    async fn load_all(&self) -> anyhow::Result<Vec<(String, ShopCheck)>> {
        let rows: Vec<(String, String, String)> = match self {
            Store::Sqlite(conn) => {
                let conn = conn
                    .lock()
                    .map_err(|_| anyhow::anyhow!("checks store poisoned"))?;
                let mut stmt =
                    conn.prepare_cached("SELECT shop, settings, secret FROM shop_checks")?;
                let rows = stmt
                    .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))?
                    .collect::<Result<Vec<_>, _>>()?;
                rows
            }
            Store::Mongo(c) => {
                let docs: Vec<Document> = c.find(doc! {}).await?.try_collect().await?;
                docs.iter()
                    .map(|d| {
                        Ok((
                            d.get_str("_id")?.to_string(),
                            d.get_str("settings")?.to_string(),
                            d.get_str("secret")?.to_string(),
                        ))
                    })
                    .collect::<anyhow::Result<Vec<_>>>()?
            }
        };
        rows.into_iter()
            .map(|(shop, settings, secret)| {
                let settings = serde_json::from_str(&settings)
                    .with_context(|| format!("shop_checks: the settings of {shop} are damaged"))?;
                Ok((shop, ShopCheck { settings, secret }))
            })
            .collect()
    }

    async fn secret_of(&self, shop: &str) -> anyhow::Result<Option<String>> {
        Ok(match self {
            Store::Sqlite(conn) => {
                let conn = conn
                    .lock()
                    .map_err(|_| anyhow::anyhow!("checks store poisoned"))?;
                conn.query_row(
                    "SELECT secret FROM shop_checks WHERE shop = ?1",
                    [shop],
                    |r| r.get(0),
                )
                .optional()?
            }
            Store::Mongo(c) => c
                .find_one(doc! { "_id": shop })
                .await?
                .and_then(|d| d.get_str("secret").ok().map(str::to_string)),
        })
    }

    async fn put(&self, shop: &str, check: Option<&ShopCheck>) -> anyhow::Result<()> {
        match (self, check) {
            (Store::Sqlite(conn), Some(c)) => {
                let conn = conn
                    .lock()
                    .map_err(|_| anyhow::anyhow!("checks store poisoned"))?;
                conn.execute(
                    "INSERT INTO shop_checks (shop, settings, secret) VALUES (?1, ?2, ?3)
                     ON CONFLICT (shop) DO UPDATE SET settings = ?2, secret = ?3",
                    params![shop, serde_json::to_string(&c.settings)?, c.secret],
                )?;
            }
            (Store::Sqlite(conn), None) => {
                let conn = conn
                    .lock()
                    .map_err(|_| anyhow::anyhow!("checks store poisoned"))?;
                conn.execute("DELETE FROM shop_checks WHERE shop = ?1", [shop])?;
            }
            (Store::Mongo(coll), Some(c)) => {
                coll.replace_one(
                    doc! { "_id": shop },
                    doc! {
                        "_id": shop,
                        "settings": serde_json::to_string(&c.settings)?,
                        "secret": &c.secret,
                    },
                )
                .upsert(true)
                .await?;
            }
            (Store::Mongo(coll), None) => {
                coll.delete_one(doc! { "_id": shop }).await?;
            }
        }
        Ok(())
    }
}

struct Inner {
    store: Store,
    shops: RwLock<HashMap<String, Arc<ShopCheck>>>,
    dead: Mutex<HashMap<String, VecDeque<DeadLetter>>>,
    outbound: Outbound,
    metrics: Arc<Metrics>,
}

/// The check-back adapter: see the module's documentation.
pub struct HttpCheckBack {
    inner: Arc<Inner>,
    runtime: tokio::runtime::Handle,
}

impl HttpCheckBack {
    /// Opens the settings store `serve` uses with these options, reads every shop's
    /// settings, and starts the runtime that calls the shops and reloads the settings.
    pub fn start(
        data_dir: &Path,
        mongo_uri: Option<&str>,
        metrics: Arc<Metrics>,
        policy: OutboundPolicy,
    ) -> anyhow::Result<HttpCheckBack> {
        let (data_dir, mongo_uri) = (data_dir.to_path_buf(), mongo_uri.map(str::to_string));
        let (tx, rx) = std::sync::mpsc::channel();
        // The runtime lives on a thread of its own for the life of the process (it
        // cannot be started from the server's, which is already in one).
        std::thread::Builder::new()
            .name("nrtxn-checks".into())
            .spawn(move || {
                let runtime = match tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(1)
                    .thread_name("nrtxn-checks")
                    .enable_all()
                    .build()
                {
                    Ok(r) => r,
                    Err(e) => {
                        let _ = tx.send(Err(anyhow::anyhow!(
                            "check-backs: cannot start their runtime: {e}"
                        )));
                        return;
                    }
                };
                let opened = runtime.block_on(open(data_dir, mongo_uri, metrics, policy));
                let ok = opened.is_ok();
                let _ = tx.send(opened.map(|inner| (inner, runtime.handle().clone())));
                if ok {
                    runtime.block_on(std::future::pending::<()>());
                }
            })
            .context("check-backs: cannot start their thread")?;
        let (inner, runtime) = rx
            .recv()
            .context("check-backs: their thread stopped while starting")??;
        let reloading = inner.clone();
        runtime.spawn(async move {
            loop {
                tokio::time::sleep(RELOAD_INTERVAL).await;
                if let Err(e) = reloading.reload().await {
                    tracing::warn!(error = %e, "check-back settings not read again; the last ones stand");
                }
            }
        });
        Ok(HttpCheckBack { inner, runtime })
    }

    /// Runs `f` on the check-backs' runtime.
    fn on_runtime<T: Send + 'static>(
        &self,
        f: impl std::future::Future<Output = T> + Send + 'static,
    ) -> CheckFuture<Option<T>> {
        let joined = self.runtime.spawn(f);
        Box::pin(async move { joined.await.ok() })
    }
}

/// Opens the settings store and reads every shop's settings.
async fn open(
    data_dir: std::path::PathBuf,
    mongo_uri: Option<String>,
    metrics: Arc<Metrics>,
    policy: OutboundPolicy,
) -> anyhow::Result<Arc<Inner>> {
    let store = match mongo_uri {
        Some(uri) => {
            let client = mongodb::Client::with_uri_str(&uri)
                .await
                .context("mongo_uri: cannot open the check-back settings")?;
            let db = client
                .default_database()
                .unwrap_or_else(|| client.database("nrtxn"));
            Store::Mongo(db.collection("shop_checks"))
        }
        None => {
            let path = data_dir.join(CHECKS_FILE);
            // It holds the shops' signing secrets: owner-only.
            crate::secret_file::prepare(&path)
                .with_context(|| format!("data_dir: cannot create {}", path.display()))?;
            let conn = Connection::open(&path)
                .with_context(|| format!("data_dir: cannot open {}", path.display()))?;
            conn.execute_batch(
                "PRAGMA journal_mode = WAL;
                 CREATE TABLE IF NOT EXISTS shop_checks (
                     shop     TEXT PRIMARY KEY,
                     settings TEXT NOT NULL,
                     secret   TEXT NOT NULL
                 );",
            )
            .with_context(|| format!("data_dir: cannot set up {}", path.display()))?;
            Store::Sqlite(Mutex::new(conn))
        }
    };
    let outbound = Outbound::new(policy).context("check-backs")?;
    let inner = Arc::new(Inner {
        store,
        shops: RwLock::new(HashMap::new()),
        dead: Mutex::new(HashMap::new()),
        outbound,
        metrics,
    });
    inner.reload().await?;
    Ok(inner)
}

impl Inner {
    async fn reload(&self) -> anyhow::Result<()> {
        let all = self.store.load_all().await?;
        let fresh: HashMap<String, Arc<ShopCheck>> =
            all.into_iter().map(|(s, c)| (s, Arc::new(c))).collect();
        if let Ok(mut shops) = self.shops.write() {
            *shops = fresh;
        }
        Ok(())
    }

    fn shop(&self, shop: &str) -> Option<Arc<ShopCheck>> {
        self.shops.read().ok()?.get(shop).cloned()
    }

    async fn ask(&self, call: CheckCall) -> CheckAction {
        // Waits for a turn before the attempts and their time budget start, and
        // before the settings are read (they may change meanwhile): a shop's
        // check-backs, and the node's, are bounded in flight.
        let used = |bound: &str| self.metrics.bound_used.with_label_values(&[bound]);
        let waiting = used("checks_waiting");
        waiting.inc();
        let _turn = self.outbound.turn(&call.shop).await;
        waiting.dec();
        let in_flight = used("checks_in_flight");
        in_flight.inc();
        let _in_flight = OnDrop(move || in_flight.dec());
        let Some(check) = self.shop(&call.shop) else {
            return CheckAction::Release;
        };
        let s = &check.settings;
        let default = if s.check_default == "confirm" {
            CheckAction::Confirm
        } else {
            CheckAction::Release
        };
        let body = serde_json::to_vec(&call).unwrap_or_default();
        let per = Duration::from_millis(s.check_timeout_ms);
        let attempts = s.check_retries + 1;
        let started = Instant::now();
        let whole = per * attempts + CHECK_SLACK;
        let mut error = String::new();
        let mut tried = 0;
        for attempt in 0..attempts {
            if attempt > 0 {
                let backoff = (Duration::from_millis(100) * 2u32.saturating_pow(attempt - 1))
                    .min(BACKOFF_MAX);
                if started.elapsed() + backoff + per > whole {
                    break;
                }
                tokio::time::sleep(backoff).await;
            }
            tried += 1;
            // Signed again at each attempt, with its own time.
            let signature = signature_header(&check.secret, now_ms(), &body);
            let answer = match self
                .outbound
                .post_bounded(
                    &s.check_url,
                    &[
                        ("content-type", "application/json"),
                        ("x-nrtxn-signature", &signature),
                    ],
                    body.clone(),
                    per,
                )
                .await
            {
                Ok(b) => parse_answer(&b),
                Err(e) => Err(e.into_reason()),
            };
            match answer {
                Ok(action) => {
                    let result = match action {
                        CheckAction::Confirm => "confirm",
                        CheckAction::Release => "release",
                        CheckAction::Extend { .. } => "extend",
                    };
                    self.metrics.checks.with_label_values(&[result]).inc();
                    return action;
                }
                Err(e) => error = e,
            }
        }
        tracing::warn!(shop = %call.shop, id = %call.id, error = %error, default = %s.check_default, "check-back unanswered; the shop's default applies");
        self.metrics.checks.with_label_values(&["default"]).inc();
        self.metrics.check_dead_letters.inc();
        if let Ok(mut dead) = self.dead.lock() {
            if dead.len() < DEAD_LETTER_SHOPS_MAX || dead.contains_key(&*call.shop) {
                let list = dead.entry(call.shop.to_string()).or_default();
                if list.len() >= DEAD_LETTERS_PER_SHOP {
                    list.pop_front();
                }
                list.push_back(DeadLetter {
                    kind: call.kind,
                    id: call.id.clone(),
                    applied: s.check_default.clone(),
                    error,
                    attempts: tried,
                    at: now_ms(),
                });
            }
        }
        default
    }
}

/// Runs its closure when dropped: on every way out of a function.
struct OnDrop<F: FnMut()>(F);

impl<F: FnMut()> Drop for OnDrop<F> {
    fn drop(&mut self) {
        (self.0)();
    }
}

/// The `X-Nrtxn-Signature` header of a call sent at `t_ms`: `t=<t_ms>,v1=<hex
/// HMAC-SHA256 of "{t_ms}.{body}">`.
pub fn signature_header(secret: &str, t_ms: i64, body: &[u8]) -> String {
    let mut signed = format!("{t_ms}.").into_bytes();
    signed.extend_from_slice(body);
    format!("t={t_ms},v1={}", hex::encode(sign(secret, &signed)))
}

/// HMAC-SHA256 of `body` keyed by `secret`'s bytes.
pub fn sign(secret: &str, body: &[u8]) -> Vec<u8> {
    let mut mac =
        <Hmac<Sha256> as KeyInit>::new_from_slice(secret.as_bytes()).expect("HMAC takes any key");
    mac.update(body);
    mac.finalize().into_bytes().to_vec()
}

/// A shop's answer: `{"action":"confirm"}`, `{"action":"release"}` or
/// `{"action":"extend","ttl_ms":N}`. The reason of a refusal quotes nothing of the
/// answer (the operator reads it, and the answer may come from anywhere).
fn parse_answer(body: &[u8]) -> Result<CheckAction, String> {
    let v: serde_json::Value =
        serde_json::from_slice(body).map_err(|_| "answer not JSON".to_string())?;
    match v.get("action").and_then(|a| a.as_str()) {
        Some("confirm") => Ok(CheckAction::Confirm),
        Some("release") => Ok(CheckAction::Release),
        Some("extend") => match v.get("ttl_ms").and_then(|t| t.as_i64()) {
            Some(ttl_ms) if (1..=HOLD_TTL_MAX_MS).contains(&ttl_ms) => {
                Ok(CheckAction::Extend { ttl_ms })
            }
            _ => Err(format!(
                "answer extend without a ttl_ms from 1 to {HOLD_TTL_MAX_MS}"
            )),
        },
        _ => Err("answer without an action confirm, release or extend".to_string()),
    }
}

fn new_secret() -> anyhow::Result<String> {
    let mut random = [0u8; 32];
    getrandom::fill(&mut random).map_err(|e| anyhow::anyhow!("no random bytes: {e}"))?;
    Ok(format!("{SECRET_PREFIX}{}", hex::encode(random)))
}

impl CheckBack for HttpCheckBack {
    fn enabled(&self, shop: &str) -> bool {
        self.inner
            .shops
            .read()
            .map(|s| s.contains_key(shop))
            .unwrap_or(false)
    }

    fn ask(&self, call: CheckCall) -> CheckFuture<CheckAction> {
        let inner = self.inner.clone();
        let asked = self.on_runtime(async move { inner.ask(call).await });
        Box::pin(async move { asked.await.unwrap_or(CheckAction::Release) })
    }

    fn settings(&self, shop: &str) -> CheckFuture<Result<Option<CheckSettings>, String>> {
        let found = self.inner.shop(shop).map(|c| c.settings.clone());
        Box::pin(async move { Ok(found) })
    }

    fn set_settings(
        &self,
        shop: &str,
        settings: Option<CheckSettings>,
        rotate: bool,
    ) -> CheckFuture<Result<Option<String>, String>> {
        let (inner, shop) = (self.inner.clone(), shop.to_string());
        let done = self.on_runtime(async move {
            let result: anyhow::Result<Option<String>> = async {
                let Some(settings) = settings else {
                    inner.store.put(&shop, None).await?;
                    if let Ok(mut shops) = inner.shops.write() {
                        shops.remove(&shop);
                    }
                    return Ok(None);
                };
                let kept = if rotate {
                    None
                } else {
                    inner.store.secret_of(&shop).await?
                };
                let (secret, shown) = match kept {
                    Some(s) => (s, None),
                    None => {
                        let s = new_secret()?;
                        (s.clone(), Some(s))
                    }
                };
                let check = ShopCheck { settings, secret };
                inner.store.put(&shop, Some(&check)).await?;
                if let Ok(mut shops) = inner.shops.write() {
                    shops.insert(shop, Arc::new(check));
                }
                Ok(shown)
            }
            .await;
            result.map_err(|e| format!("{e:#}"))
        });
        Box::pin(async move {
            done.await
                .unwrap_or_else(|| Err("the check-backs' runtime stopped".to_string()))
        })
    }

    fn check_url(&self, url: &str) -> Result<(), String> {
        self.inner.outbound.policy().check_url(url)
    }

    fn dead_letters(&self, shop: &str) -> Vec<DeadLetter> {
        self.inner
            .dead
            .lock()
            .ok()
            .and_then(|d| d.get(shop).map(|l| l.iter().cloned().collect()))
            .unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_are_read_or_refused_with_the_reason() {
        assert_eq!(
            parse_answer(br#"{"action":"confirm"}"#),
            Ok(CheckAction::Confirm)
        );
        assert_eq!(
            parse_answer(br#"{"action":"extend","ttl_ms":5000}"#),
            Ok(CheckAction::Extend { ttl_ms: 5000 })
        );
        assert!(parse_answer(br#"{"action":"extend"}"#)
            .unwrap_err()
            .contains("ttl_ms"));
        assert!(parse_answer(br#"{"action":"maybe"}"#).is_err());
        assert!(parse_answer(b"ok").unwrap_err().contains("not JSON"));
        // Nothing of the answer is quoted.
        assert!(!parse_answer(br#"{"action":"maybe","x":"inside"}"#)
            .unwrap_err()
            .contains("inside"));
    }

    #[test]
    fn the_signature_covers_the_time_and_the_body() {
        let header = signature_header("s3cret", 1_700_000_000_000, br#"{"id":"h"}"#);
        let expected = hex::encode(sign("s3cret", br#"1700000000000.{"id":"h"}"#));
        assert_eq!(header, format!("t=1700000000000,v1={expected}"));
    }

    #[test]
    fn the_signature_is_rfc_4231_hmac_sha256() {
        // RFC 4231, test case 2.
        let mac = sign("Jefe", b"what do ya want for nothing?");
        assert_eq!(
            hex::encode(mac),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
    }
}
