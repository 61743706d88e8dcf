//! The access key store, and the reloader that keeps a running server's keys current.
//!
//! - Embedded: `{data_dir}/keys.sqlite`, a file of its own (not the journal's) in WAL
//!   mode, so `nrtxn keys` can write it while a server on the same data dir reads it,
//!   without waiting for the journal writer.
//! - With `--mongo-uri`: the collection `keys` of the journal's database, one document per
//!   key with the key id as `_id` (so MongoDB's unique `_id` index is the unique index on
//!   the id), shared by every node.
//!
//! A record holds the SHA-256 of the secret, never the secret: the secret is printed once
//! by `nrtxn keys create` and exists nowhere else.

use nrtxn_mongo::{mongo_database, redact_uri};
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use futures::TryStreamExt;
use mongodb::bson::{doc, Bson, Document};
use nrtxn_actors::{now_ms, Millis, NAME_LEN_MAX};
use nrtxn_api::auth::{secret_sha256, AccessKey, Gate, KeySet, Role, SECRET_PREFIX};
use rusqlite::{params, Connection, OptionalExtension};

/// How often a server reads the unrevoked keys again: a revocation or a new key takes
/// effect on every node within this plus one read (the promise is 5 s).
pub const KEYS_RELOAD_INTERVAL: Duration = Duration::from_secs(2);

/// Name of the embedded store's file in the data dir.
pub const KEYS_FILE: &str = "keys.sqlite";

/// Bytes of a key id (printed as 16 hex digits): enough that ids drawn at random never
/// collide in practice, short enough to read in a list.
const ID_BYTES: usize = 8;
/// Random bytes of a secret: 256 bits from the OS CSPRNG.
const SECRET_RANDOM_BYTES: usize = 32;

/// A key as stored.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyRecord {
    pub key: AccessKey,
    pub created_at: Millis,
    pub revoked_at: Option<Millis>,
}

/// A key just made: its record, and its secret, which is not stored anywhere.
pub struct NewKey {
    pub secret: String,
    pub record: KeyRecord,
}

/// Makes a key: a random id and secret, the record with the secret's hash. `shop` must be
/// `None` exactly for an admin.
pub fn generate(name: Option<&str>, shop: Option<&str>, role: Role) -> anyhow::Result<NewKey> {
    match (role, shop) {
        (Role::Admin, Some(_)) => {
            bail!("--shop: an admin key is for every shop; leave --shop out")
        }
        (Role::Seller | Role::Operator, None) => {
            bail!("--shop: required for a {role} key (it is for one shop)")
        }
        _ => {}
    }
    if let Some(shop) = shop {
        check_name("--shop", shop)?;
    }
    let name = match name {
        Some(n) => {
            check_name("--name", n)?;
            n.to_string()
        }
        None => match shop {
            Some(shop) => format!("{shop}-{role}"),
            None => role.to_string(),
        },
    };
    let mut id = [0u8; ID_BYTES];
    let mut random = [0u8; SECRET_RANDOM_BYTES];
    getrandom::fill(&mut id)
        .and_then(|()| getrandom::fill(&mut random))
        .map_err(|e| anyhow::anyhow!("cannot read the OS random number generator: {e}"))?;
    let id = hex::encode(id);
    let secret = format!("{SECRET_PREFIX}{id}_{}", hex::encode(random));
    // What the key is written as is what the access check reads: its id from the secret.
    assert_eq!(
        nrtxn_api::auth::secret_id(&secret),
        Some(id.as_str()),
        "a generated secret must name its key's id"
    );
    Ok(NewKey {
        record: KeyRecord {
            key: AccessKey {
                secret_sha256: secret_sha256(&secret),
                id,
                name,
                shop: shop.map(str::to_string),
                role,
            },
            created_at: now_ms(),
            revoked_at: None,
        },
        secret,
    })
}

/// Names and shops: 1 to 128 bytes, no `/` (a shop is a path segment) and no control
/// characters (`keys list` is tab-separated, one key a line).
fn check_name(flag: &str, s: &str) -> anyhow::Result<()> {
    if s.is_empty() || s.len() > NAME_LEN_MAX {
        bail!("{flag}: must be 1 to {NAME_LEN_MAX} bytes");
    }
    if s.chars().any(|c| c == '/' || c.is_control()) {
        bail!("{flag}: must not contain '/' or control characters");
    }
    Ok(())
}

/// What revoking an id found.
#[derive(Debug, PartialEq, Eq)]
pub enum Revoked {
    Now,
    Already(Millis),
    Unknown,
}

/// The store of access keys. Its methods are async for MongoDB; the SQLite ones block
/// briefly (one small statement), so they are called only where blocking is fine: the
/// CLI and the reloader's own thread, never an HTTP worker or an actor.
pub enum KeyStore {
    Sqlite(Connection),
    Mongo(mongodb::Collection<Document>),
}

impl KeyStore {
    /// Opens the store `serve` would use with these options, creating it if missing.
    /// Call inside the tokio runtime the store will be used on (MongoDB's client keeps
    /// its background tasks there).
    pub async fn open(data_dir: &Path, mongo_uri: Option<&str>) -> anyhow::Result<KeyStore> {
        KeyStore::open_with(data_dir, mongo_uri, true).await
    }

    /// Opens the store as [`KeyStore::open`] does, but with `create` false an embedded
    /// store that does not exist is an error and nothing is created: `nrtxn keys list`
    /// or `revoke` on a mistyped `--data-dir` must say so, not answer with an empty list
    /// (nor leave a new folder behind).
    pub async fn open_with(
        data_dir: &Path,
        mongo_uri: Option<&str>,
        create: bool,
    ) -> anyhow::Result<KeyStore> {
        match mongo_uri {
            Some(uri) => {
                let shown = redact_uri(uri);
                let keys = mongo_database(uri).await?.collection::<Document>("keys");
                // Touch the server now, so a wrong URI fails here with its name rather
                // than at the first reload.
                keys.count_documents(doc! { "_id": "" })
                    .await
                    .with_context(|| format!("mongo_uri: cannot read the keys of {shown}"))?;
                Ok(KeyStore::Mongo(keys))
            }
            None => {
                let path = data_dir.join(KEYS_FILE);
                if !create && !path.exists() {
                    let why = if data_dir.exists() {
                        format!("it holds no {KEYS_FILE}: no server or key was ever made there")
                    } else {
                        "it does not exist".to_string()
                    };
                    anyhow::bail!(
                        "data_dir: no key store in {} ({why}); is --data-dir (or NRTXN_DATA_DIR) right?",
                        data_dir.display()
                    );
                }
                std::fs::create_dir_all(data_dir)
                    .with_context(|| format!("data_dir: cannot create {}", data_dir.display()))?;
                nrtxn_log::secret_file::prepare(&path)
                    .with_context(|| format!("data_dir: cannot create {}", path.display()))?;
                let conn = open_sqlite(&path)
                    .with_context(|| format!("data_dir: cannot open {}", path.display()))?;
                Ok(KeyStore::Sqlite(conn))
            }
        }
    }

    pub async fn insert(&self, record: &KeyRecord) -> anyhow::Result<()> {
        let k = &record.key;
        match self {
            KeyStore::Sqlite(conn) => {
                conn.execute(
                    "INSERT INTO keys (id, name, shop, role, secret_sha256, created_at, revoked_at)
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
                    params![
                        k.id,
                        k.name,
                        k.shop,
                        k.role.as_str(),
                        hex::encode(k.secret_sha256),
                        record.created_at,
                        record.revoked_at
                    ],
                )
                .context("keys.sqlite: cannot insert the key")?;
            }
            KeyStore::Mongo(keys) => {
                keys.insert_one(doc! {
                    "_id": &k.id,
                    "name": &k.name,
                    "shop": k.shop.as_deref().map_or(Bson::Null, |s| Bson::String(s.into())),
                    "role": k.role.as_str(),
                    "secret_sha256": hex::encode(k.secret_sha256),
                    "created_at": record.created_at,
                    "revoked_at": record.revoked_at.map_or(Bson::Null, Bson::Int64),
                })
                .await
                .context("mongo: cannot insert the key")?;
            }
        }
        Ok(())
    }

    /// Every key, oldest first; the revoked ones too when `revoked` is true.
    pub async fn list(&self, revoked: bool) -> anyhow::Result<Vec<KeyRecord>> {
        match self {
            KeyStore::Sqlite(conn) => {
                let sql = if revoked {
                    "SELECT id, name, shop, role, secret_sha256, created_at, revoked_at FROM keys
                     ORDER BY created_at, id"
                } else {
                    "SELECT id, name, shop, role, secret_sha256, created_at, revoked_at FROM keys
                     WHERE revoked_at IS NULL ORDER BY created_at, id"
                };
                let mut stmt = conn.prepare_cached(sql).context("keys.sqlite")?;
                let rows = stmt
                    .query_map([], |row| {
                        Ok(StoredKey {
                            id: row.get(0)?,
                            name: row.get(1)?,
                            shop: row.get(2)?,
                            role: row.get(3)?,
                            secret_sha256: row.get(4)?,
                            created_at: row.get(5)?,
                            revoked_at: row.get(6)?,
                        })
                    })
                    .context("keys.sqlite: cannot read the keys")?;
                rows.map(|r| {
                    r.context("keys.sqlite: cannot read a key")
                        .and_then(StoredKey::record)
                })
                .collect()
            }
            KeyStore::Mongo(keys) => {
                let filter = if revoked {
                    doc! {}
                } else {
                    doc! { "revoked_at": Bson::Null }
                };
                let docs: Vec<Document> = keys
                    .find(filter)
                    .sort(doc! { "created_at": 1, "_id": 1 })
                    .await
                    .context("mongo: cannot read the keys")?
                    .try_collect()
                    .await
                    .context("mongo: cannot read the keys")?;
                docs.iter().map(StoredKey::from_doc).collect()
            }
        }
    }

    /// The unrevoked keys, as a server checks them.
    pub async fn active(&self) -> anyhow::Result<KeySet> {
        let keys = self.list(false).await?;
        // What the store answers is what the gate lets in: a revoked key here would be
        // accepted again until the next reload.
        assert!(
            keys.iter().all(|r| r.revoked_at.is_none()),
            "the key store listed a revoked key as active"
        );
        Ok(KeySet::new(keys.into_iter().map(|r| r.key)))
    }

    /// Marks `id` revoked at `now`; a revoked key stays listed with `--all`.
    pub async fn revoke(&self, id: &str, now: Millis) -> anyhow::Result<Revoked> {
        match self {
            KeyStore::Sqlite(conn) => {
                let revoked_at: Option<Option<Millis>> = conn
                    .query_row("SELECT revoked_at FROM keys WHERE id = ?1", [id], |r| {
                        r.get(0)
                    })
                    .optional()
                    .context("keys.sqlite: cannot read the key")?;
                match revoked_at {
                    None => Ok(Revoked::Unknown),
                    Some(Some(at)) => Ok(Revoked::Already(at)),
                    Some(None) => {
                        conn.execute(
                            "UPDATE keys SET revoked_at = ?2 WHERE id = ?1 AND revoked_at IS NULL",
                            params![id, now],
                        )
                        .context("keys.sqlite: cannot revoke the key")?;
                        Ok(Revoked::Now)
                    }
                }
            }
            KeyStore::Mongo(keys) => {
                let updated = keys
                    .update_one(
                        doc! { "_id": id, "revoked_at": Bson::Null },
                        doc! { "$set": { "revoked_at": now } },
                    )
                    .await
                    .context("mongo: cannot revoke the key")?;
                if updated.matched_count == 1 {
                    return Ok(Revoked::Now);
                }
                match keys
                    .find_one(doc! { "_id": id })
                    .await
                    .context("mongo: cannot read the key")?
                {
                    None => Ok(Revoked::Unknown),
                    Some(d) => Ok(Revoked::Already(d.get_i64("revoked_at").unwrap_or(0))),
                }
            }
        }
    }
}

fn open_sqlite(path: &PathBuf) -> Result<Connection, rusqlite::Error> {
    let conn = Connection::open(path)?;
    // The CLI and a running server (or several CLIs) may write at once: wait for the
    // other's short transaction rather than fail.
    conn.busy_timeout(Duration::from_secs(5))?;
    // WAL: the server's reloads read while `nrtxn keys` writes, neither waiting.
    conn.pragma_update(None, "journal_mode", "WAL")?;
    // A key created or revoked is on disk when the command returns.
    conn.pragma_update(None, "synchronous", "FULL")?;
    conn.execute_batch(
        "CREATE TABLE IF NOT EXISTS keys (
            id TEXT PRIMARY KEY,
            name TEXT NOT NULL,
            shop TEXT,
            role TEXT NOT NULL CHECK (role IN ('seller', 'operator', 'admin')),
            secret_sha256 TEXT NOT NULL,
            created_at INTEGER NOT NULL,
            revoked_at INTEGER
        );",
    )?;
    Ok(conn)
}

/// A key as read back, before its fields are checked.
struct StoredKey {
    id: String,
    name: String,
    shop: Option<String>,
    role: String,
    secret_sha256: String,
    created_at: Millis,
    revoked_at: Option<Millis>,
}

impl StoredKey {
    fn from_doc(d: &Document) -> anyhow::Result<KeyRecord> {
        let text = |f: &str| {
            d.get_str(f)
                .map(str::to_string)
                .with_context(|| format!("mongo: key document {d} has no string {f}"))
        };
        StoredKey {
            id: text("_id")?,
            name: text("name")?,
            shop: d.get_str("shop").ok().map(str::to_string),
            role: text("role")?,
            secret_sha256: text("secret_sha256")?,
            created_at: d.get_i64("created_at").unwrap_or(0),
            revoked_at: d.get_i64("revoked_at").ok(),
        }
        .record()
    }

    /// Checks what was read: a record that does not parse is an error naming its id, not
    /// a key silently dropped (which could hide a revocation's failure to apply).
    fn record(self) -> anyhow::Result<KeyRecord> {
        let role: Role = self
            .role
            .parse()
            .map_err(|e| anyhow::anyhow!("key {}: {e}", self.id))?;
        let mut hash = [0u8; 32];
        hex::decode_to_slice(&self.secret_sha256, &mut hash)
            .with_context(|| format!("key {}: secret_sha256 is not 64 hex digits", self.id))?;
        if (role == Role::Admin) != self.shop.is_none() {
            bail!(
                "key {}: a {role} key {} a shop",
                self.id,
                if self.shop.is_some() { "has" } else { "lacks" }
            );
        }
        Ok(KeyRecord {
            key: AccessKey {
                id: self.id,
                name: self.name,
                shop: self.shop,
                role,
                secret_sha256: hash,
            },
            created_at: self.created_at,
            revoked_at: self.revoked_at,
        })
    }
}

/// Keeps a [`Gate`]'s keys current: reads the unrevoked keys every
/// [`KEYS_RELOAD_INTERVAL`] on a thread of its own (off the HTTP workers and the actors),
/// and keeps the last good set when a read fails. Stops when dropped.
pub struct KeyReloader {
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl KeyReloader {
    /// Opens the store, reads the keys once (an error here stops the start), and returns
    /// them with the reloader, which starts updating `gate` once [`KeyReloader::run`] is
    /// given one.
    pub fn start(
        data_dir: &Path,
        mongo_uri: Option<&str>,
    ) -> anyhow::Result<(KeySet, KeyReloaderStarting)> {
        let (first_tx, first_rx) = mpsc::channel::<anyhow::Result<KeySet>>();
        let (gate_tx, gate_rx) = tokio::sync::oneshot::channel::<Arc<Gate>>();
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let data_dir = data_dir.to_path_buf();
        let mongo_uri = mongo_uri.map(str::to_string);
        let thread = std::thread::Builder::new()
            .name("keys-reload".into())
            .spawn(move || {
                let rt = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(rt) => rt,
                    Err(e) => {
                        let _ = first_tx.send(Err(e).context("cannot start the keys' runtime"));
                        return;
                    }
                };
                rt.block_on(reload_loop(data_dir, mongo_uri, first_tx, gate_rx, stop_rx));
            })
            .context("cannot start the keys' reload thread")?;
        let first = first_rx
            .recv()
            .context("the keys' reload thread stopped before reading the keys")??;
        Ok((
            first,
            KeyReloaderStarting {
                reloader: KeyReloader {
                    stop: Some(stop_tx),
                    thread: Some(thread),
                },
                gate_tx,
            },
        ))
    }
}

/// A [`KeyReloader`] that has read the keys once and waits for the gate to keep current.
pub struct KeyReloaderStarting {
    reloader: KeyReloader,
    gate_tx: tokio::sync::oneshot::Sender<Arc<Gate>>,
}

impl KeyReloaderStarting {
    pub fn run(self, gate: Arc<Gate>) -> KeyReloader {
        // The thread waits for this or for the stop; if it is gone, there is nothing to
        // keep current.
        let _ = self.gate_tx.send(gate);
        self.reloader
    }
}

impl Drop for KeyReloader {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

async fn reload_loop(
    data_dir: PathBuf,
    mongo_uri: Option<String>,
    first_tx: mpsc::Sender<anyhow::Result<KeySet>>,
    gate_rx: tokio::sync::oneshot::Receiver<Arc<Gate>>,
    mut stop_rx: tokio::sync::oneshot::Receiver<()>,
) {
    let store = match KeyStore::open(&data_dir, mongo_uri.as_deref()).await {
        Ok(store) => store,
        Err(e) => {
            let _ = first_tx.send(Err(e));
            return;
        }
    };
    let first = store.active().await;
    let failed = first.is_err();
    let _ = first_tx.send(first);
    if failed {
        return;
    }
    let gate = tokio::select! {
        gate = gate_rx => match gate {
            Ok(gate) => gate,
            Err(_) => return,
        },
        _ = &mut stop_rx => return,
    };
    let mut failing = false;
    loop {
        tokio::select! {
            _ = tokio::time::sleep(KEYS_RELOAD_INTERVAL) => {}
            _ = &mut stop_rx => return,
        }
        match store.active().await {
            Ok(keys) => {
                if failing {
                    tracing::info!(keys = keys.len(), "access keys read again");
                    failing = false;
                }
                gate.set_keys(keys);
            }
            Err(e) => {
                // The last good set stays: a store that cannot be read for a while must
                // neither lock every caller out nor let revoked keys in for good; the
                // warning says revocations are not being picked up.
                if !failing {
                    tracing::warn!(
                        error = format!("{e:#}"),
                        "cannot read the access keys; keeping the last ones read until \
                         the store answers (revocations wait until then)"
                    );
                }
                failing = true;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_secrets_verify_and_only_their_hash_is_kept() {
        let k = generate(Some("till 1"), Some("acme"), Role::Seller).unwrap();
        assert!(k.secret.starts_with(&format!("nrtxn_{}_", k.record.key.id)));
        assert_eq!(k.record.key.id.len(), 16);
        assert_eq!(k.secret.len(), "nrtxn_".len() + 16 + 1 + 64);
        let set = KeySet::new([k.record.key.clone()]);
        assert_eq!(
            set.verify(&k.secret).map(|k| k.name.as_str()),
            Some("till 1")
        );
        let other = generate(None, None, Role::Admin).unwrap();
        assert_ne!(other.record.key.id, k.record.key.id);
        assert_eq!(other.record.key.name, "admin");
    }

    #[test]
    fn shop_goes_with_seller_and_operator_never_with_admin() {
        assert!(generate(None, Some("acme"), Role::Admin).is_err());
        assert!(generate(None, None, Role::Operator).is_err());
        assert!(generate(None, Some("a/b"), Role::Seller).is_err());
        assert!(generate(Some("a\tb"), Some("acme"), Role::Seller).is_err());
    }

    #[test]
    fn sqlite_store_lists_revokes_and_keeps_no_secret() {
        let dir = tempfile::tempdir().unwrap();
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        rt.block_on(async {
            let store = KeyStore::open(dir.path(), None).await.unwrap();
            let a = generate(None, Some("acme"), Role::Operator).unwrap();
            let b = generate(None, None, Role::Admin).unwrap();
            store.insert(&a.record).await.unwrap();
            store.insert(&b.record).await.unwrap();
            assert_eq!(store.active().await.unwrap().len(), 2);
            let id = &a.record.key.id;
            assert_eq!(store.revoke(id, 7).await.unwrap(), Revoked::Now);
            assert_eq!(store.revoke(id, 8).await.unwrap(), Revoked::Already(7));
            assert_eq!(store.revoke("nope", 8).await.unwrap(), Revoked::Unknown);
            let active = store.active().await.unwrap();
            assert!(active.verify(&a.secret).is_none());
            assert!(active.verify(&b.secret).is_some());
            let all = store.list(true).await.unwrap();
            assert_eq!(all.len(), 2);
            assert_eq!(
                all.iter().find(|r| &r.key.id == id).unwrap().revoked_at,
                Some(7)
            );
        });
    }

    #[test]
    fn uri_passwords_are_hidden() {
        assert_eq!(
            redact_uri("mongodb://nrtxn:s3cr@t@m1:27017,m2/nrtxn?tls=true"),
            "mongodb://nrtxn:***@m1:27017,m2/nrtxn?tls=true"
        );
        assert_eq!(
            redact_uri("mongodb://m1:27017/nrtxn"),
            "mongodb://m1:27017/nrtxn"
        );
    }
}
