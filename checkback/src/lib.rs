//! The shops' check-backs over HTTP: the adapter of [`nrtxn_actors::checkback`], and
//! the guarded client every call to a shop's URL goes through ([`outbound`]).
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
//!   Calls go through [`outbound`] (no inside address, https only, no redirect,
//!   answers up to 64 KiB, bounded in flight per shop and per node: a call waits its
//!   turn before its attempts start).
//!   Failures (an error status, an answer that is not one of the actions, no answer
//!   within `check_timeout_ms`) are tried again with a backoff, up to `check_retries`
//!   times; the whole check ends within `check_timeout_ms × (check_retries + 1)` plus
//!   2 s. With a `check_retry_schedule_ms` the shop is asked again after each of its
//!   waits instead (minutes to hours), within the 7-day life of the hold. Then the
//!   shop's `check_default` applies (`ask`: none, an operator decides), and the case is
//!   kept as a dead letter and counted, with a short reason that holds neither the
//!   answer nor the URL.
//! - Dead letters are kept beside the settings (the table `dead_letters` of
//!   `checks.sqlite`, the collection `check_dead_letters` with MongoDB): one per hold or
//!   order, the latest [`DEAD_LETTERS_PER_SHOP`] per shop (older ones are dropped when a
//!   new one is written), read from the store on every call, so every node sees them and
//!   they survive a restart.
//! - The calls run on a small runtime of their own, never on a processor or an HTTP
//!   worker.

pub mod alerts;
pub mod outbound;

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use anyhow::Context;
use futures::TryStreamExt;
use hmac::{Hmac, KeyInit, Mac};
use mongodb::bson::{doc, Document};
use nrtxn_actors::checkback::{
    Alert, CheckAction, CheckBack, CheckCall, CheckFuture, CheckSettings, DeadLetter, FailedAlert,
    Resolution, ShopSettings,
};
use nrtxn_actors::{now_ms, Metrics, HOLD_TTL_MAX_MS};
use rusqlite::{params, Connection, OptionalExtension};
use sha2::Sha256;

use crate::outbound::{Outbound, OutboundPolicy};
use nrtxn_log::space::{Claim, Space};

/// How often every node reads the shops' settings again.
pub const RELOAD_INTERVAL: Duration = Duration::from_secs(2);
/// Dead letters kept per shop (the latest; older ones are dropped when one is written).
pub const DEAD_LETTERS_PER_SHOP: usize = 100;
/// Alerts that failed for good kept per shop (the latest, as dead letters).
pub const FAILED_ALERTS_PER_SHOP: usize = 100;
/// Slack of a whole check beyond its attempts' timeouts (the issue's 2 s): the backoffs
/// between attempts come out of it.
const CHECK_SLACK: Duration = Duration::from_secs(2);
/// Longest backoff between two attempts.
const BACKOFF_MAX: Duration = Duration::from_millis(500);
/// The embedded store's file in the data dir.
pub const CHECKS_FILE: &str = "checks.sqlite";
/// Prefix of a signing secret.
const SECRET_PREFIX: &str = "nrtxn_chk_";
/// The error of a call whose runtime is gone (the process is stopping).
const RUNTIME_STOPPED: &str = "the check-backs' runtime stopped";

/// A shop's settings and secret.
#[derive(Clone, Debug)]
struct ShopCheck {
    settings: ShopSettings,
    secret: String,
}

/// A shop's settings as the store keeps them: [`ShopSettings`], or (written by a
/// version before alerts) its check-back's alone.
fn stored_settings(json: &str) -> serde_json::Result<ShopSettings> {
    let v: serde_json::Value = serde_json::from_str(json)?;
    if v.get("check_url").is_some() {
        return Ok(ShopSettings {
            check: Some(serde_json::from_value(v)?),
            notify: None,
        });
    }
    serde_json::from_value(v)
}

/// A shop's settings as the store writes them: a check-back alone in the shape of the
/// versions before alerts (which a node not yet upgraded reads), else [`ShopSettings`].
fn stored_json(settings: &ShopSettings) -> serde_json::Result<String> {
    match settings {
        ShopSettings {
            check: Some(check),
            notify: None,
        } => serde_json::to_string(check),
        all => serde_json::to_string(all),
    }
}

/// What the store keeps a bounded list of, per shop: the latest ones, each under an id
/// (written again under its id, it replaces itself).
#[derive(Clone, Copy, Debug)]
enum Kept {
    /// Check-backs unanswered ([`DeadLetter`]), one per hold or order.
    DeadLetters,
    /// Alerts that failed for good ([`FailedAlert`]), one per alert.
    FailedAlerts,
}

impl Kept {
    /// The SQLite table, and the MongoDB collection beside `shop_checks`.
    fn table(self) -> &'static str {
        match self {
            Kept::DeadLetters => "dead_letters",
            Kept::FailedAlerts => "failed_alerts",
        }
    }

    fn collection(self) -> &'static str {
        match self {
            Kept::DeadLetters => "check_dead_letters",
            Kept::FailedAlerts => "failed_alerts",
        }
    }

    /// The column (and document field) of a record's JSON.
    fn column(self) -> &'static str {
        match self {
            Kept::DeadLetters => "letter",
            Kept::FailedAlerts => "record",
        }
    }

    fn per_shop(self) -> usize {
        match self {
            Kept::DeadLetters => DEAD_LETTERS_PER_SHOP,
            Kept::FailedAlerts => FAILED_ALERTS_PER_SHOP,
        }
    }
}

enum Store {
    /// The file in the data dir, whose writes keep the disk's floor ([`sqlite_room`]).
    Sqlite(Mutex<Connection>, Arc<Space>),
    Mongo(mongodb::Collection<Document>),
}

impl Store {
    /// Ends the SQLite file's WAL at a clean stop: its frames copied into the file and
    /// the file back in rollback mode, so that a stopped server leaves no `-wal` or
    /// `-shm` beside it (the next start sets WAL again). The connection stays usable.
    fn close(&self) {
        if let Store::Sqlite(conn, _) = self {
            let conn = conn.lock().unwrap_or_else(|e| e.into_inner());
            let closed = conn
                .query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |_| Ok(()))
                .and_then(|()| conn.query_row("PRAGMA journal_mode = DELETE", [], |_| Ok(())));
            if let Err(e) = closed {
                tracing::warn!(error = %e, "checks.sqlite: its WAL could not be ended at the stop");
            }
        }
    }

    async fn load_all(&self) -> anyhow::Result<Vec<(String, ShopCheck)>> {
        let rows: Vec<(String, String, String)> = match self {
            Store::Sqlite(conn, _) => {
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
                let settings = stored_settings(&settings)
                    .with_context(|| format!("shop_checks: the settings of {shop} are damaged"))?;
                Ok((shop, ShopCheck { settings, secret }))
            })
            .collect()
    }

    async fn secret_of(&self, shop: &str) -> anyhow::Result<Option<String>> {
        Ok(match self {
            Store::Sqlite(conn, _) => {
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
            (Store::Sqlite(conn, space), Some(c)) => {
                let settings = stored_json(&c.settings)?;
                let _room = sqlite_room(space, settings.len() + c.secret.len(), 1)?;
                let conn = conn
                    .lock()
                    .map_err(|_| anyhow::anyhow!("checks store poisoned"))?;
                conn.execute(
                    "INSERT INTO shop_checks (shop, settings, secret) VALUES (?1, ?2, ?3)
                     ON CONFLICT (shop) DO UPDATE SET settings = ?2, secret = ?3",
                    params![shop, settings, c.secret],
                )?;
            }
            (Store::Sqlite(conn, space), None) => {
                let _room = sqlite_room(space, 0, 1)?;
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
                        "settings": stored_json(&c.settings)?,
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

    /// Writes record `json` of `shop` under `id` (replacing the one of the same id),
    /// then drops the shop's oldest beyond what `kind` keeps.
    async fn put_kept(
        &self,
        kind: Kept,
        shop: &str,
        id: &str,
        at: i64,
        json: String,
    ) -> anyhow::Result<()> {
        let (table, column, keep) = (kind.table(), kind.column(), kind.per_shop() as i64);
        match self {
            Store::Sqlite(conn, space) => {
                // The record and its index entry, and the oldest one's it may drop.
                let _room = sqlite_room(space, json.len(), 4)?;
                let conn = conn
                    .lock()
                    .map_err(|_| anyhow::anyhow!("checks store poisoned"))?;
                conn.execute(
                    &format!(
                        "INSERT INTO {table} (shop, id, at, {column}) VALUES (?1, ?2, ?3, ?4)
                         ON CONFLICT (shop, id) DO UPDATE SET at = ?3, {column} = ?4"
                    ),
                    params![shop, id, at, json],
                )?;
                conn.execute(
                    &format!(
                        "DELETE FROM {table} WHERE shop = ?1 AND id IN (
                             SELECT id FROM {table} WHERE shop = ?1
                             ORDER BY at DESC, id DESC LIMIT -1 OFFSET ?2)"
                    ),
                    params![shop, keep],
                )?;
            }
            Store::Mongo(c) => {
                let kept = kept_of(c, kind);
                kept.replace_one(
                    doc! { "_id": kept_id(shop, id) },
                    doc! { "_id": kept_id(shop, id), "shop": shop, "at": at, column: json },
                )
                .upsert(true)
                .await?;
                let older: Vec<Document> = kept
                    .find(doc! { "shop": shop })
                    .sort(doc! { "at": -1, "_id": -1 })
                    .skip(keep as u64)
                    .projection(doc! { "_id": 1 })
                    .await?
                    .try_collect()
                    .await?;
                if !older.is_empty() {
                    let ids: Vec<mongodb::bson::Bson> = older
                        .into_iter()
                        .filter_map(|d| d.get("_id").cloned())
                        .collect();
                    kept.delete_many(doc! { "_id": { "$in": ids } }).await?;
                }
            }
        }
        Ok(())
    }

    /// The records `kind` keeps of `shop`, oldest first; only `id`'s when it is given.
    async fn kept<T: serde::de::DeserializeOwned>(
        &self,
        kind: Kept,
        shop: &str,
        id: Option<&str>,
    ) -> anyhow::Result<Vec<T>> {
        let (table, column) = (kind.table(), kind.column());
        let rows: Vec<String> = match self {
            Store::Sqlite(conn, _) => {
                let conn = conn
                    .lock()
                    .map_err(|_| anyhow::anyhow!("checks store poisoned"))?;
                let mut stmt = conn.prepare_cached(&format!(
                    "SELECT {column} FROM {table} WHERE shop = ?1 AND (?2 IS NULL OR id = ?2)
                     ORDER BY at, id"
                ))?;
                let rows = stmt
                    .query_map(params![shop, id], |r| r.get(0))?
                    .collect::<Result<Vec<_>, _>>()?;
                rows
            }
            Store::Mongo(c) => {
                let filter = match id {
                    Some(id) => doc! { "_id": kept_id(shop, id) },
                    None => doc! { "shop": shop },
                };
                let docs: Vec<Document> = kept_of(c, kind)
                    .find(filter)
                    .sort(doc! { "at": 1, "_id": 1 })
                    .await?
                    .try_collect()
                    .await?;
                docs.iter()
                    .map(|d| Ok(d.get_str(column)?.to_string()))
                    .collect::<anyhow::Result<Vec<_>>>()?
            }
        };
        rows.iter()
            .map(|r| {
                serde_json::from_str(r)
                    .with_context(|| format!("{table}: a record of {shop} is damaged"))
            })
            .collect()
    }

    /// Writes dead letter `letter` of `shop` (replacing the one of the same id).
    async fn put_dead(&self, shop: &str, letter: &DeadLetter) -> anyhow::Result<()> {
        let json = serde_json::to_string(letter)?;
        self.put_kept(Kept::DeadLetters, shop, &letter.id, letter.at, json)
            .await
    }

    /// The dead letters of `shop`, oldest first; only `id`'s when it is given.
    async fn dead(&self, shop: &str, id: Option<&str>) -> anyhow::Result<Vec<DeadLetter>> {
        self.kept(Kept::DeadLetters, shop, id).await
    }

    /// Dead letter `id` of `shop`, `None` if it has none.
    async fn dead_one(&self, shop: &str, id: &str) -> anyhow::Result<Option<DeadLetter>> {
        Ok(self.dead(shop, Some(id)).await?.pop())
    }
}

/// The collection of what `kind` keeps, in the database of `checks` (`shop_checks`).
fn kept_of(checks: &mongodb::Collection<Document>, kind: Kept) -> mongodb::Collection<Document> {
    checks
        .client()
        .database(&checks.namespace().db)
        .collection(kind.collection())
}

/// A kept record's `_id`: names have no `/`, so the shop's and the id's part are plain.
fn kept_id(shop: &str, id: &str) -> String {
    format!("{shop}/{id}")
}

struct Inner {
    store: Store,
    shops: RwLock<HashMap<String, Arc<ShopCheck>>>,
    outbound: Outbound,
    metrics: Arc<Metrics>,
    /// Shops whose last alert failed for good, until when they get one attempt per
    /// alert ([`alerts::DOWN_FOR`]).
    down: Mutex<HashMap<Arc<str>, Instant>>,
}

/// The check-back adapter: see the module's documentation.
pub struct HttpCheckBack {
    inner: Arc<Inner>,
    runtime: tokio::runtime::Handle,
}

impl HttpCheckBack {
    /// At a clean stop, once the engine is shut down: the settings file is left whole,
    /// with no WAL beside it.
    pub fn close(&self) {
        self.inner.store.close();
    }

    /// Opens the settings store `serve` uses with these options, reads every shop's
    /// settings, and starts the runtime that calls the shops and reloads the settings.
    pub fn start(
        data_dir: &Path,
        mongo_uri: Option<&str>,
        metrics: Arc<Metrics>,
        policy: OutboundPolicy,
        space: Arc<Space>,
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
                let opened = runtime.block_on(open(data_dir, mongo_uri, metrics, policy, space));
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

/// Room on the data dir's disk for one write of `checks.sqlite` (see `crate::space`):
/// `rows` rows of at most `bytes` bytes together, each a leaf page and the pages it
/// overflows into, the pages above them a split may change, and what SQLite's own
/// checkpoint, which a commit runs once the WAL holds 64 frames, may add to the file (it
/// copies those frames and this write's). Without room the write fails, saying so: a
/// shop's settings are refused, a dead letter is written at the engine's next look.
fn sqlite_room(space: &Arc<Space>, bytes: usize, rows: u64) -> anyhow::Result<Claim> {
    let pages = 4 + 2 * rows + (bytes as u64).div_ceil(4_000);
    let bytes = pages * (4_096 + 24) + 64 * 1024 + (64 + pages) * 4_096;
    space.room_for(bytes).map_err(|e| {
        anyhow::anyhow!(
            "the data dir's disk has no room above its floor (--disk-free-min-mb) for \
             {CHECKS_FILE}: {e}"
        )
    })
}

/// Opens the settings store and reads every shop's settings.
async fn open(
    data_dir: std::path::PathBuf,
    mongo_uri: Option<String>,
    metrics: Arc<Metrics>,
    policy: OutboundPolicy,
    space: Arc<Space>,
) -> anyhow::Result<Arc<Inner>> {
    let store = match mongo_uri {
        Some(uri) => {
            let checks = nrtxn_mongo::mongo_database(&uri)
                .await
                .context("cannot open the check-back settings")?
                .collection("shop_checks");
            // Dead letters and failed alerts are read by shop, oldest first, and trimmed
            // newest first.
            for kind in [Kept::DeadLetters, Kept::FailedAlerts] {
                kept_of(&checks, kind)
                    .create_index(
                        mongodb::IndexModel::builder()
                            .keys(doc! { "shop": 1, "at": 1 })
                            .build(),
                    )
                    .await
                    .with_context(|| format!("mongo_uri: cannot index {}", kind.collection()))?;
            }
            Store::Mongo(checks)
        }
        None => {
            let path = data_dir.join(CHECKS_FILE);
            // It holds the shops' signing secrets: owner-only.
            nrtxn_log::secret_file::prepare(&path)
                .with_context(|| format!("data_dir: cannot create {}", path.display()))?;
            let conn = Connection::open(&path)
                .with_context(|| format!("data_dir: cannot open {}", path.display()))?;
            conn.execute_batch(
                "PRAGMA journal_mode = WAL;
                 CREATE TABLE IF NOT EXISTS shop_checks (
                     shop     TEXT PRIMARY KEY,
                     settings TEXT NOT NULL,
                     secret   TEXT NOT NULL
                 );
                 CREATE TABLE IF NOT EXISTS dead_letters (
                     shop   TEXT NOT NULL,
                     id     TEXT NOT NULL,
                     at     INTEGER NOT NULL,
                     letter TEXT NOT NULL,
                     PRIMARY KEY (shop, id)
                 );
                 CREATE INDEX IF NOT EXISTS dead_letters_at ON dead_letters (shop, at);
                 CREATE TABLE IF NOT EXISTS failed_alerts (
                     shop   TEXT NOT NULL,
                     id     TEXT NOT NULL,
                     at     INTEGER NOT NULL,
                     record TEXT NOT NULL,
                     PRIMARY KEY (shop, id)
                 );
                 CREATE INDEX IF NOT EXISTS failed_alerts_at ON failed_alerts (shop, at);
                 PRAGMA wal_autocheckpoint = 64;",
            )
            .with_context(|| format!("data_dir: cannot set up {}", path.display()))?;
            Store::Sqlite(Mutex::new(conn), space)
        }
    };
    let outbound = Outbound::new(policy).context("check-backs")?;
    let inner = Arc::new(Inner {
        store,
        shops: RwLock::new(HashMap::new()),
        outbound,
        metrics,
        down: Mutex::new(HashMap::new()),
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

    async fn ask(self: Arc<Self>, call: CheckCall) -> CheckAction {
        // Waits for a turn before the attempts and their time budget start, and
        // before the settings are read (they may change meanwhile): a shop's
        // check-backs, and the node's, are bounded in flight.
        let mut turn = Some(self.turn(&call.shop).await);
        let Some(check) = self.shop(&call.shop) else {
            return CheckAction::Release;
        };
        let Some(s) = &check.settings.check else {
            return CheckAction::Release;
        };
        let default = default_of(s, &call);
        let body = serde_json::to_vec(&call).unwrap_or_default();
        let per = Duration::from_millis(s.check_timeout_ms);
        let schedule = schedule_of(s, &call);
        let attempts = attempts_of(s, schedule);
        let started = Instant::now();
        let whole = per * attempts + CHECK_SLACK + schedule_total(schedule);
        let mut error = String::new();
        let mut tried = 0;
        for attempt in 0..attempts {
            if attempt > 0 {
                let backoff = wait_before(schedule, attempt);
                if started.elapsed() + backoff + per > whole || past_life(&call, backoff) {
                    break;
                }
                if !schedule.is_empty() {
                    // A schedule's waits last minutes to hours: the turn is given back
                    // for them, or a few slow shops' holds would keep every turn.
                    turn = None;
                }
                tokio::time::sleep(backoff).await;
            }
            if turn.is_none() {
                turn = Some(self.turn(&call.shop).await);
            }
            tried += 1;
            let answer = self.post_signed(&s.check_url, &check.secret, &body, per);
            match answer.await.and_then(|b| parse_answer(&b)) {
                Ok(action) => {
                    let result = match action {
                        CheckAction::Confirm => "confirm",
                        CheckAction::Release => "release",
                        CheckAction::Extend { .. } => "extend",
                        CheckAction::Ask => "ask",
                    };
                    self.metrics.checks.with_label_values(&[result]).inc();
                    return action;
                }
                Err(e) => error = e,
            }
        }
        // A shop's default applies only once the shop was asked, and never more often
        // than its settings allow.
        assert!(
            (1..=attempts).contains(&tried),
            "check-back {} of shop {}: {tried} attempts made of {attempts}",
            call.id,
            call.shop
        );
        tracing::warn!(shop = %call.shop, id = %call.id, error = %error, default = %s.check_default, "check-back unanswered; the shop's default applies");
        self.metrics.checks.with_label_values(&["default"]).inc();
        let letter = self.dead_letter(&call, s, error, tried).await;
        if let (Some(letter), Some(url)) = (letter, check.settings.wants("dead_letter")) {
            // Sent on its own: the default applies now, whatever the alert's fate.
            let alert = Alert {
                shop: call.shop.clone(),
                kind: "dead_letter".into(),
                item: None,
                stock: None,
                reserved: None,
                seq: None,
                id: Some(letter.id),
                applied: Some(letter.applied),
                at: letter.at,
            };
            let (inner, url, secret) = (self.clone(), url.to_string(), check.secret.clone());
            tokio::spawn(async move { inner.deliver(&url, &secret, alert).await });
        }
        default
    }

    /// One signed call: `body` posted to `url` within `per`, signed with `secret`; the
    /// answer's body, or why not.
    async fn post_signed(
        &self,
        url: &str,
        secret: &str,
        body: &[u8],
        per: Duration,
    ) -> Result<Vec<u8>, String> {
        // Signed again at each attempt, with its own time.
        let signature = signature_header(secret, now_ms(), body);
        debug_assert!(
            signature_holds(secret, &signature, body),
            "a call's signature does not cover the body it is sent with"
        );
        self.outbound
            .post_bounded(
                url,
                &[
                    ("content-type", "application/json"),
                    ("x-nrtxn-signature", &signature),
                ],
                body.to_vec(),
                per,
            )
            .await
            .map_err(|e| e.into_reason())
    }

    /// A turn to call `shop` (waiting for it, counted in `checks_waiting`), counted in
    /// `checks_in_flight` while it is held.
    async fn turn(&self, shop: &str) -> (crate::outbound::Turn, OnDrop<impl FnMut()>) {
        let used = |bound: &str| self.metrics.bound_used.with_label_values(&[bound]);
        let waiting = used("checks_waiting");
        waiting.inc();
        let turn = self.outbound.turn(shop).await;
        waiting.dec();
        let in_flight = used("checks_in_flight");
        in_flight.inc();
        (turn, OnDrop(move || in_flight.dec()))
    }

    /// Keeps unanswered check `call` as its hold's dead letter (`tried` attempts, the
    /// last failing with `error`). An operator's retry adds to the letter it retried,
    /// whose default stands; a check of the engine's makes it anew, and returns it.
    async fn dead_letter(
        &self,
        call: &CheckCall,
        s: &CheckSettings,
        error: String,
        tried: u32,
    ) -> Option<DeadLetter> {
        let before = if call.retry {
            match self.store.dead_one(&call.shop, &call.id).await {
                Ok(found) => found,
                Err(e) => {
                    tracing::error!(shop = %call.shop, id = %call.id, error = %e, "dead letter not read; the retry's attempts are counted alone");
                    None
                }
            }
        } else {
            self.metrics.check_dead_letters.inc();
            None
        };
        let letter = DeadLetter {
            id: call.id.clone(),
            kind: call.kind,
            applied: match &before {
                Some(b) => b.applied.clone(),
                // A retry of a letter dropped meanwhile: the hold waits as it did.
                None if call.retry => "ask".to_string(),
                None => s.check_default.clone(),
            },
            error,
            attempts: before.map_or(0, |b| b.attempts).saturating_add(tried),
            at: now_ms(),
            expires_at: call.expires_at,
            resolved: None,
        };
        if let Err(e) = self.store.put_dead(&call.shop, &letter).await {
            // With `ask` the hold stays pending without a letter, and is asked again at
            // the engine's next look (5 s): the letter is written then.
            tracing::error!(shop = %call.shop, id = %call.id, error = %e, "dead letter not written");
            return None;
        }
        (!call.retry).then_some(letter)
    }
}

/// What applies when `call` is not answered: the shop's default; nothing (`Ask`) for
/// `ask` and for an operator's retry.
fn default_of(s: &CheckSettings, call: &CheckCall) -> CheckAction {
    match s.check_default.as_str() {
        _ if call.retry => CheckAction::Ask,
        "confirm" => CheckAction::Confirm,
        "ask" => CheckAction::Ask,
        _ => CheckAction::Release,
    }
}

/// The waits of `call`'s retry schedule: the shop's, or none (quick retries) for an
/// operator's retry, which asks now.
fn schedule_of<'a>(s: &'a CheckSettings, call: &CheckCall) -> &'a [u64] {
    if call.retry {
        &[]
    } else {
        &s.check_retry_schedule_ms
    }
}

/// Attempts of a check: one, then one after each wait of the schedule, or
/// `check_retries` quick retries without one.
fn attempts_of(s: &CheckSettings, schedule: &[u64]) -> u32 {
    if schedule.is_empty() {
        s.check_retries + 1
    } else {
        (schedule.len() as u32).saturating_add(1)
    }
}

fn schedule_total(schedule: &[u64]) -> Duration {
    Duration::from_millis(schedule.iter().fold(0u64, |a, b| a.saturating_add(*b)))
}

/// The wait before attempt `attempt` (from 1): the schedule's, or a short backoff.
fn wait_before(schedule: &[u64], attempt: u32) -> Duration {
    match schedule.get(attempt as usize - 1) {
        Some(ms) => Duration::from_millis(*ms),
        None => (Duration::from_millis(100) * 2u32.saturating_pow(attempt - 1)).min(BACKOFF_MAX),
    }
}

/// Whether an attempt after waiting `wait` would come past the 7-day life of the hold:
/// then no more attempts are made.
fn past_life(call: &CheckCall, wait: Duration) -> bool {
    let wait_ms = i64::try_from(wait.as_millis()).unwrap_or(i64::MAX);
    call.life_ends_at > 0 && now_ms().saturating_add(wait_ms) >= call.life_ends_at
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

/// Whether `header` signs `body` with `secret`, read back from the header's text as a
/// receiver reads it: apart from the code that wrote it.
fn signature_holds(secret: &str, header: &str, body: &[u8]) -> bool {
    let Some((t_ms, v1)) = header.strip_prefix("t=").and_then(|h| h.split_once(",v1=")) else {
        return false;
    };
    let Ok(mac) = hex::decode(v1) else {
        return false;
    };
    let mut m =
        <Hmac<Sha256> as KeyInit>::new_from_slice(secret.as_bytes()).expect("HMAC takes any key");
    m.update(t_ms.as_bytes());
    m.update(b".");
    m.update(body);
    m.verify_slice(&mac).is_ok()
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
            .map(|s| s.get(shop).is_some_and(|c| c.settings.check.is_some()))
            .unwrap_or(false)
    }

    fn ask(&self, call: CheckCall) -> CheckFuture<CheckAction> {
        let inner = self.inner.clone();
        let asked = self.on_runtime(inner.ask(call));
        Box::pin(async move { asked.await.unwrap_or(CheckAction::Release) })
    }

    fn settings(&self, shop: &str) -> CheckFuture<Result<ShopSettings, String>> {
        let found = self
            .inner
            .shop(shop)
            .map(|c| c.settings.clone())
            .unwrap_or_default();
        Box::pin(async move { Ok(found) })
    }

    fn set_settings(
        &self,
        shop: &str,
        settings: ShopSettings,
        rotate: bool,
    ) -> CheckFuture<Result<Option<String>, String>> {
        let (inner, shop) = (self.inner.clone(), shop.to_string());
        let done = self.on_runtime(async move {
            let result: anyhow::Result<Option<String>> = async {
                if settings.is_empty() {
                    inner.store.put(&shop, None).await?;
                    if let Ok(mut shops) = inner.shops.write() {
                        shops.remove(&shop);
                    }
                    return Ok(None);
                }
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

    fn dead_letters(&self, shop: &str) -> CheckFuture<Result<Vec<DeadLetter>, String>> {
        let (inner, shop) = (self.inner.clone(), shop.to_string());
        let found = self.on_runtime(async move {
            inner
                .store
                .dead(&shop, None)
                .await
                .map_err(|e| format!("{e:#}"))
        });
        Box::pin(async move { found.await.unwrap_or_else(|| Err(RUNTIME_STOPPED.into())) })
    }

    fn failed_alerts(&self, shop: &str) -> CheckFuture<Result<Vec<FailedAlert>, String>> {
        let (inner, shop) = (self.inner.clone(), shop.to_string());
        let found = self.on_runtime(async move {
            inner
                .store
                .kept(Kept::FailedAlerts, &shop, None)
                .await
                .map_err(|e| format!("{e:#}"))
        });
        Box::pin(async move { found.await.unwrap_or_else(|| Err(RUNTIME_STOPPED.into())) })
    }

    fn dead_letter(&self, shop: &str, id: &str) -> CheckFuture<Result<Option<DeadLetter>, String>> {
        let (inner, shop, id) = (self.inner.clone(), shop.to_string(), id.to_string());
        let found = self.on_runtime(async move {
            inner
                .store
                .dead_one(&shop, &id)
                .await
                .map_err(|e| format!("{e:#}"))
        });
        Box::pin(async move { found.await.unwrap_or_else(|| Err(RUNTIME_STOPPED.into())) })
    }

    fn resolve(
        &self,
        shop: &str,
        id: &str,
        resolution: Resolution,
    ) -> CheckFuture<Result<Option<DeadLetter>, String>> {
        let (inner, shop, id) = (self.inner.clone(), shop.to_string(), id.to_string());
        let done = self.on_runtime(async move {
            let result: anyhow::Result<Option<DeadLetter>> = async {
                let Some(mut letter) = inner.store.dead_one(&shop, &id).await? else {
                    return Ok(None);
                };
                if letter.resolved.is_none() {
                    letter.resolved = Some(resolution);
                    inner.store.put_dead(&shop, &letter).await?;
                }
                Ok(Some(letter))
            }
            .await;
            result.map_err(|e| format!("{e:#}"))
        });
        Box::pin(async move { done.await.unwrap_or_else(|| Err(RUNTIME_STOPPED.into())) })
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

    fn letter(id: &str, at: i64) -> DeadLetter {
        DeadLetter {
            id: id.into(),
            kind: nrtxn_actors::checkback::CheckKind::Hold,
            applied: "ask".into(),
            error: "503".into(),
            attempts: 1,
            at,
            expires_at: at - 1,
            resolved: None,
        }
    }

    /// A shop keeps its latest 100 letters: older ones are dropped as new ones come,
    /// another shop's are not touched, and a letter written again replaces its own.
    #[tokio::test]
    async fn dead_letters_are_bounded_per_shop_and_kept_in_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let conn = Connection::open(dir.path().join(CHECKS_FILE)).unwrap();
        conn.execute_batch(
            "CREATE TABLE dead_letters (shop TEXT NOT NULL, id TEXT NOT NULL,
                 at INTEGER NOT NULL, letter TEXT NOT NULL, PRIMARY KEY (shop, id));",
        )
        .unwrap();
        let store = Store::Sqlite(Mutex::new(conn), Space::new(dir.path(), 0));
        store.put_dead("other", &letter("o", 1)).await.unwrap();
        for i in 0..(DEAD_LETTERS_PER_SHOP as i64 + 5) {
            store
                .put_dead("s", &letter(&format!("h{i}"), 1_000 + i))
                .await
                .unwrap();
        }
        let kept = store.dead("s", None).await.unwrap();
        assert_eq!(kept.len(), DEAD_LETTERS_PER_SHOP);
        assert_eq!(&*kept[0].id, "h5", "the 5 oldest dropped");
        assert_eq!(&*kept[DEAD_LETTERS_PER_SHOP - 1].id, "h104");
        assert_eq!(store.dead("other", None).await.unwrap().len(), 1);
        let mut again = letter("h5", 5_000);
        again.attempts = 7;
        store.put_dead("s", &again).await.unwrap();
        let kept = store.dead("s", None).await.unwrap();
        assert_eq!(kept.len(), DEAD_LETTERS_PER_SHOP);
        assert_eq!(kept.last(), Some(&again), "newest now");
        assert_eq!(store.dead_one("s", "h5").await.unwrap(), Some(again));
        assert_eq!(store.dead_one("s", "h0").await.unwrap(), None);
    }

    #[test]
    fn a_schedule_sets_the_attempts_and_their_waits() {
        let mut s = CheckSettings {
            check_url: "http://x/c".into(),
            check_timeout_ms: 100,
            check_retries: 3,
            check_default: "ask".into(),
            check_retry_schedule_ms: vec![1_000, 60_000, 300_000],
        };
        let mut call = CheckCall {
            shop: "s".into(),
            kind: nrtxn_actors::checkback::CheckKind::Hold,
            id: "h".into(),
            lines: Vec::new(),
            expires_at: 0,
            life_ends_at: i64::MAX,
            retry: false,
        };
        let schedule = schedule_of(&s, &call);
        assert_eq!(attempts_of(&s, schedule), 4);
        assert_eq!(wait_before(schedule, 2), Duration::from_secs(60));
        assert_eq!(schedule_total(schedule), Duration::from_millis(361_000));
        assert_eq!(default_of(&s, &call), CheckAction::Ask);
        // Near the end of the hold's life, no attempt past it.
        call.life_ends_at = now_ms() + 30_000;
        assert!(past_life(&call, Duration::from_secs(60)));
        assert!(!past_life(&call, Duration::from_secs(1)));
        // An operator's retry: quick retries now, and no default.
        call.retry = true;
        s.check_default = "release".into();
        let quick = schedule_of(&s, &call);
        assert_eq!(attempts_of(&s, quick), 4);
        assert_eq!(wait_before(quick, 1), Duration::from_millis(100));
        assert_eq!(default_of(&s, &call), CheckAction::Ask);
        // The body the shop gets is unchanged.
        let body: serde_json::Value = serde_json::to_value(&call).unwrap();
        assert!(body.get("retry").is_none() && body.get("life_ends_at").is_none());
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
