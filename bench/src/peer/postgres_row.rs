//! The PostgreSQL peer: what a relational design does. One transaction per request:
//! a conditional `UPDATE items SET stock = stock - $q WHERE ... AND stock >= $q` (the row
//! lock serializes sales of one item), and an insert of the request key with its outcome
//! (`ON CONFLICT DO NOTHING`: a repeated key rolls back and answers the recorded one).
//!
//! Holds: a `reserved` column beside `stock` and a `holds` table keyed by (shop,
//! hold_id). A hold is one transaction: the insert of its row claims the id (a repeated
//! id rolls back and answers the recorded hold), then the conditional `UPDATE items SET
//! stock = stock - $q, reserved = reserved + $q ... AND stock >= $q` (a refusal is
//! recorded in the row instead). A confirm or cancel is one transaction: `UPDATE holds
//! ... WHERE state = 'held'` (to `expired` if past `expires_at`), then the item's
//! counters. Expiry is lazy: each call first looks for holds of its shop past their
//! expiry (one indexed query) and, if there are some, releases up to [`RELEASE_MAX`] of
//! them in a transaction of its own. Every transaction that changes a hold locks its row
//! before its item's (the release locks items in name order), so they cannot deadlock.
//!
//! Durability: `scripts/bench.sh` runs PostgreSQL with `fsync=on` and
//! `synchronous_commit=on`, so each COMMIT waits for its WAL flush (group commit
//! merges concurrent flushes), as nrtxn's journal does.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use anyhow::Context;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_postgres::{Client, NoTls, Row, Statement};

use super::{now_ms, Decision, Hold, HoldEnd, HoldReq, Outcome, Txn, RELEASE_MAX, STOCK_MAX};

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS items (
    shop text NOT NULL,
    item text NOT NULL,
    stock bigint NOT NULL CHECK (stock >= 0),
    reserved bigint NOT NULL DEFAULT 0 CHECK (reserved >= 0),
    PRIMARY KEY (shop, item)
);
ALTER TABLE items ADD COLUMN IF NOT EXISTS reserved bigint NOT NULL DEFAULT 0 CHECK (reserved >= 0);
CREATE TABLE IF NOT EXISTS requests (
    shop text NOT NULL,
    request_key text NOT NULL,
    item text NOT NULL,
    op text NOT NULL,
    qty bigint NOT NULL,
    status text NOT NULL,
    stock_before bigint,
    stock_after bigint,
    submitted_at bigint NOT NULL,
    completed_at bigint NOT NULL,
    PRIMARY KEY (shop, request_key)
);
CREATE TABLE IF NOT EXISTS holds (
    shop text NOT NULL,
    hold_id text NOT NULL,
    item text NOT NULL,
    qty bigint NOT NULL,
    ttl_ms bigint NOT NULL,
    -- held, confirmed, released, expired; or the refusal: insufficient_stock, unknown_item
    state text NOT NULL,
    expires_at bigint,
    stock_before bigint,
    created_at bigint NOT NULL,
    ended_at bigint,
    PRIMARY KEY (shop, hold_id)
);
CREATE INDEX IF NOT EXISTS holds_due ON holds (shop, expires_at) WHERE state = 'held';";

/// One connection with its prepared statements (prepared once: parsing and planning
/// per request would measure the SQL parser, not the design).
struct PgConn {
    client: Client,
    decrement: Statement,
    increment: Statement,
    stock: Statement,
    record: Statement,
    recorded: Statement,
    any_due: Statement,
    expire_due: Statement,
    give_back: Statement,
    sell_reserved: Statement,
    claim_hold: Statement,
    reserve: Statement,
    refuse_hold: Statement,
    read_hold: Statement,
    end_hold: Statement,
}

async fn connect(url: &str) -> anyhow::Result<Client> {
    let (client, connection) = tokio_postgres::connect(url, NoTls)
        .await
        .with_context(|| format!("--pg-url: cannot connect with {url:?}"))?;
    tokio::spawn(async move {
        // Ends when the client is dropped or the server closes; the next use of a
        // closed client fails and the pool opens a new one.
        let _ = connection.await;
    });
    Ok(client)
}

impl PgConn {
    async fn open(url: &str) -> anyhow::Result<PgConn> {
        let client = connect(url).await?;
        let decrement = client
            .prepare("UPDATE items SET stock = stock - $3 WHERE shop = $1 AND item = $2 AND stock >= $3 RETURNING stock")
            .await?;
        let increment = client
            .prepare(&format!(
                "UPDATE items SET stock = stock + $3 WHERE shop = $1 AND item = $2 AND stock + $3 <= {STOCK_MAX} RETURNING stock"
            ))
            .await?;
        let stock = client
            .prepare("SELECT stock, reserved FROM items WHERE shop = $1 AND item = $2")
            .await?;
        let record = client
            .prepare(
                "INSERT INTO requests (shop, request_key, item, op, qty, status, stock_before, stock_after, \
                 submitted_at, completed_at) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10) ON CONFLICT DO NOTHING",
            )
            .await?;
        let recorded = client
            .prepare(
                "SELECT item, op, qty, status, stock_before, stock_after, submitted_at, completed_at \
                 FROM requests WHERE shop = $1 AND request_key = $2",
            )
            .await?;
        let any_due = client
            .prepare(
                "SELECT EXISTS (SELECT 1 FROM holds WHERE shop = $1 AND state = 'held' AND expires_at <= $2)",
            )
            .await?;
        // SKIP LOCKED: a hold another call is ending or releasing is left to it. The
        // selection is a MATERIALIZED CTE, run once: as an `IN (subquery)` the planner may
        // rescan it per row, and each rescan skips the rows just updated and takes the
        // next ones, releasing past the bound.
        let expire_due = client
            .prepare(&format!(
                "WITH due AS MATERIALIZED (SELECT hold_id FROM holds WHERE shop = $1 AND state = 'held' \
                 AND expires_at <= $2 ORDER BY expires_at LIMIT {RELEASE_MAX} FOR UPDATE SKIP LOCKED) \
                 UPDATE holds h SET state = 'expired', ended_at = $2 FROM due \
                 WHERE h.shop = $1 AND h.hold_id = due.hold_id AND h.state = 'held' RETURNING h.item, h.qty"
            ))
            .await?;
        let give_back = client
            .prepare("UPDATE items SET stock = stock + $3, reserved = reserved - $3 WHERE shop = $1 AND item = $2")
            .await?;
        let sell_reserved = client
            .prepare("UPDATE items SET reserved = reserved - $3 WHERE shop = $1 AND item = $2")
            .await?;
        let claim_hold = client
            .prepare(
                "INSERT INTO holds (shop, hold_id, item, qty, ttl_ms, state, expires_at, created_at) \
                 VALUES ($1, $2, $3, $4, $5, 'held', $6, $7) ON CONFLICT DO NOTHING",
            )
            .await?;
        let reserve = client
            .prepare(
                "UPDATE items SET stock = stock - $3, reserved = reserved + $3 \
                 WHERE shop = $1 AND item = $2 AND stock >= $3 RETURNING stock",
            )
            .await?;
        let refuse_hold = client
            .prepare(
                "UPDATE holds SET state = $3, expires_at = NULL, stock_before = $4 WHERE shop = $1 AND hold_id = $2",
            )
            .await?;
        let read_hold = client
            .prepare(
                "SELECT state, item, qty, expires_at, stock_before FROM holds WHERE shop = $1 AND hold_id = $2",
            )
            .await?;
        let end_hold = client
            .prepare(
                "UPDATE holds SET state = CASE WHEN expires_at <= $3 THEN 'expired' ELSE $4::text END, \
                 ended_at = $3 WHERE shop = $1 AND hold_id = $2 AND state = 'held' \
                 RETURNING state, item, qty, expires_at, stock_before",
            )
            .await?;
        Ok(PgConn {
            client,
            decrement,
            increment,
            stock,
            record,
            recorded,
            any_due,
            expire_due,
            give_back,
            sell_reserved,
            claim_hold,
            reserve,
            refuse_hold,
            read_hold,
            end_hold,
        })
    }

    /// Releases up to [`RELEASE_MAX`] holds of the shop past their expiry, in a
    /// transaction of its own (so that it locks no item before the caller's own work),
    /// items in name order. Nothing due, the usual case, costs one indexed query.
    async fn release_due(&mut self, shop: &str, now: i64) -> anyhow::Result<()> {
        let due: bool = self
            .client
            .query_one(&self.any_due, &[&shop, &now])
            .await?
            .get(0);
        if !due {
            return Ok(());
        }
        let tx = self.client.transaction().await?;
        let mut per_item: BTreeMap<String, i64> = BTreeMap::new();
        for row in tx.query(&self.expire_due, &[&shop, &now]).await? {
            *per_item.entry(row.get(0)).or_default() += row.get::<_, i64>(1);
        }
        for (item, qty) in &per_item {
            tx.execute(&self.give_back, &[&shop, item, qty]).await?;
        }
        tx.commit().await?;
        Ok(())
    }

    async fn read_hold(&self, shop: &str, hold_id: &str) -> anyhow::Result<Option<Hold>> {
        let row = self
            .client
            .query_opt(&self.read_hold, &[&shop, &hold_id])
            .await?;
        Ok(row.map(|r| hold_of(hold_id, &r)))
    }

    /// One transaction: the hold's row claims its id, then the conditional reservation
    /// (or the refusal, recorded in the row); a repeated id answers the recorded hold.
    async fn hold(&mut self, shop: &str, req: &HoldReq) -> anyhow::Result<Hold> {
        let now = now_ms();
        self.release_due(shop, now).await?;
        let expires_at = now.saturating_add(req.ttl_ms);
        let tx = self.client.transaction().await?;
        let claimed = tx
            .execute(
                &self.claim_hold,
                &[
                    &shop,
                    &req.hold_id,
                    &req.item,
                    &req.qty,
                    &req.ttl_ms,
                    &expires_at,
                    &now,
                ],
            )
            .await?;
        if claimed == 0 {
            tx.rollback().await?;
            return self
                .read_hold(shop, &req.hold_id)
                .await?
                .with_context(|| format!("hold {} conflicted but cannot be read", req.hold_id));
        }
        let mut hold = Hold {
            hold_id: req.hold_id.clone(),
            status: "held".into(),
            item: req.item.clone(),
            qty: req.qty,
            expires_at: Some(expires_at),
            stock_before: None,
        };
        if tx
            .query_opt(&self.reserve, &[&shop, &req.item, &req.qty])
            .await?
            .is_none()
        {
            let before: Option<i64> = tx
                .query_opt(&self.stock, &[&shop, &req.item])
                .await?
                .map(|r| r.get(0));
            let status = if before.is_some() {
                "insufficient_stock"
            } else {
                "unknown_item"
            };
            tx.execute(&self.refuse_hold, &[&shop, &req.hold_id, &status, &before])
                .await?;
            hold.status = status.into();
            hold.expires_at = None;
            hold.stock_before = before;
        }
        tx.commit().await?;
        Ok(hold)
    }

    /// Ends a held hold as asked (expired instead if past its expiry), or only reads it
    /// (expiring it if due). `None` for no hold, or a refused one.
    async fn settle(
        &mut self,
        shop: &str,
        hold_id: &str,
        end: Option<HoldEnd>,
    ) -> anyhow::Result<Option<Hold>> {
        let now = now_ms();
        self.release_due(shop, now).await?;
        let Some(hold) = self.read_hold(shop, hold_id).await? else {
            return Ok(None);
        };
        if !hold.was_held() {
            return Ok(None);
        }
        if hold.status != "held" {
            // Ended already: the route compares its state with the ending asked for.
            return Ok(Some(hold));
        }
        let due = hold.expires_at.is_some_and(|e| e <= now);
        let target = match end {
            Some(end) => end.state(),
            None if due => "expired",
            None => return Ok(Some(hold)),
        };
        let tx = self.client.transaction().await?;
        let Some(row) = tx
            .query_opt(&self.end_hold, &[&shop, &hold_id, &now, &target])
            .await?
        else {
            // Ended by another call since the read: answer it as that call left it.
            tx.rollback().await?;
            return self.read_hold(shop, hold_id).await;
        };
        let hold = hold_of(hold_id, &row);
        let stmt = if hold.status == "confirmed" {
            &self.sell_reserved
        } else {
            &self.give_back
        };
        tx.execute(stmt, &[&shop, &hold.item, &hold.qty]).await?;
        tx.commit().await?;
        Ok(Some(hold))
    }

    async fn recorded(&self, shop: &str, key: &str) -> anyhow::Result<Option<Outcome>> {
        let row = self
            .client
            .query_opt(&self.recorded, &[&shop, &key])
            .await?;
        Ok(row.map(|r| {
            let qty: i64 = r.get(2);
            let status: String = r.get(3);
            let before: Option<i64> = r.get(4);
            let item: String = r.get(0);
            let reason = match status.as_str() {
                "insufficient_stock" => before.map(|b| format!("requested {qty}, available {b}")),
                "unknown_item" => Some(format!("no item {item} in shop {shop}")),
                _ => None,
            };
            Outcome {
                shop: shop.to_string(),
                request_key: key.to_string(),
                status,
                reason,
                item,
                op: r.get(1),
                qty,
                stock_before: before,
                stock_after: r.get(5),
                seq: None,
                prev_seq: None,
                submitted_at: r.get(6),
                completed_at: r.get(7),
            }
        }))
    }

    /// One transaction: conditional update, then the key's insert; commit, or roll back
    /// and answer the recorded outcome if the key was already there.
    async fn decide(&mut self, shop: &str, t: &Txn) -> anyhow::Result<Decision> {
        let tx = self.client.transaction().await?;
        let stmt = if t.increment {
            &self.increment
        } else {
            &self.decrement
        };
        let (status, before, after) = match tx.query_opt(stmt, &[&shop, &t.item, &t.qty]).await? {
            Some(row) => {
                let after: i64 = row.get(0);
                let before = if t.increment {
                    after - t.qty
                } else {
                    after + t.qty
                };
                ("ok", Some(before), Some(after))
            }
            None => match tx.query_opt(&self.stock, &[&shop, &t.item]).await? {
                Some(row) => {
                    let s: i64 = row.get(0);
                    let status = if t.increment {
                        "limit_exceeded"
                    } else {
                        "insufficient_stock"
                    };
                    (status, Some(s), Some(s))
                }
                None => ("unknown_item", None, None),
            },
        };
        let outcome = t.outcome(shop, status, before, after);
        let inserted = tx
            .execute(
                &self.record,
                &[
                    &shop,
                    &t.key,
                    &t.item,
                    &t.op(),
                    &t.qty,
                    &status,
                    &before,
                    &after,
                    &outcome.submitted_at,
                    &outcome.completed_at,
                ],
            )
            .await?;
        if inserted == 0 {
            tx.rollback().await?;
            let recorded = self
                .recorded(shop, &t.key)
                .await?
                .with_context(|| format!("request key {} conflicted but cannot be read", t.key))?;
            return Ok(Decision {
                outcome: recorded,
                repeat: true,
            });
        }
        tx.commit().await?;
        Ok(Decision {
            outcome: Outcome {
                completed_at: now_ms(),
                ..outcome
            },
            repeat: false,
        })
    }
}

/// A hold from a row of `state, item, qty, expires_at, stock_before`.
fn hold_of(hold_id: &str, r: &Row) -> Hold {
    Hold {
        hold_id: hold_id.to_string(),
        status: r.get(0),
        item: r.get(1),
        qty: r.get(2),
        expires_at: r.get(3),
        stock_before: r.get(4),
    }
}

/// A fixed set of connections. A request takes one for its whole transaction (a
/// transaction cannot share its connection); the semaphore bounds the waiters' use
/// and the `Vec` holds the idle ones.
pub struct PgRow {
    url: String,
    idle: Arc<Mutex<Vec<PgConn>>>,
    permits: Arc<Semaphore>,
}

/// A connection taken from the pool; it goes back when dropped, unless it broke.
struct Taken {
    conn: Option<PgConn>,
    idle: Arc<Mutex<Vec<PgConn>>>,
    _permit: OwnedSemaphorePermit,
}

impl Drop for Taken {
    fn drop(&mut self) {
        if let Some(c) = self.conn.take() {
            if !c.client.is_closed() {
                if let Ok(mut idle) = self.idle.lock() {
                    idle.push(c);
                }
            }
        }
    }
}

impl PgRow {
    pub async fn connect(url: &str, size: usize) -> anyhow::Result<PgRow> {
        // The tables first: the pool's connections prepare statements on them.
        connect(url)
            .await?
            .batch_execute(SCHEMA)
            .await
            .context("creating the peer's tables")?;
        let mut conns = Vec::with_capacity(size);
        for _ in 0..size {
            conns.push(PgConn::open(url).await?);
        }
        Ok(PgRow {
            url: url.to_string(),
            idle: Arc::new(Mutex::new(conns)),
            permits: Arc::new(Semaphore::new(size)),
        })
    }

    async fn take(&self) -> anyhow::Result<Taken> {
        let permit = self
            .permits
            .clone()
            .acquire_owned()
            .await
            .context("the connection pool is closed")?;
        let idle = self.idle.lock().ok().and_then(|mut v| v.pop());
        // A permit without an idle connection means one broke: open its replacement.
        let conn = match idle {
            Some(c) => c,
            None => PgConn::open(&self.url).await?,
        };
        Ok(Taken {
            conn: Some(conn),
            idle: self.idle.clone(),
            _permit: permit,
        })
    }

    /// Sets the items' stock; their reserved parts (pending holds) stay, and are
    /// answered in order.
    pub async fn load(&self, shop: &str, items: &[(String, i64)]) -> anyhow::Result<Vec<i64>> {
        let taken = self.take().await?;
        let c = taken
            .conn
            .as_ref()
            .context("pool slot without a connection")?;
        let names: Vec<&str> = items.iter().map(|(i, _)| i.as_str()).collect();
        let stocks: Vec<i64> = items.iter().map(|(_, s)| *s).collect();
        let rows = c
            .client
            .query(
                "INSERT INTO items (shop, item, stock) SELECT $1, unnest($2::text[]), unnest($3::int8[]) \
                 ON CONFLICT (shop, item) DO UPDATE SET stock = EXCLUDED.stock RETURNING item, reserved",
                &[&shop, &names, &stocks],
            )
            .await
            .context("loading items")?;
        let reserved: std::collections::HashMap<String, i64> =
            rows.iter().map(|r| (r.get(0), r.get(1))).collect();
        Ok(items
            .iter()
            .map(|(i, _)| reserved.get(i).copied().unwrap_or(0))
            .collect())
    }

    /// An item's stock and reserved part, after releasing due holds of its shop.
    pub async fn item(&self, shop: &str, item: &str) -> anyhow::Result<Option<(i64, i64)>> {
        let mut taken = self.take().await?;
        let c = taken
            .conn
            .as_mut()
            .context("pool slot without a connection")?;
        c.release_due(shop, now_ms()).await?;
        let row = c.client.query_opt(&c.stock, &[&shop, &item]).await?;
        Ok(row.map(|r| (r.get(0), r.get(1))))
    }

    pub async fn hold(&self, shop: &str, req: &HoldReq) -> anyhow::Result<Hold> {
        let mut taken = self.take().await?;
        let c = taken
            .conn
            .as_mut()
            .context("pool slot without a connection")?;
        c.hold(shop, req).await
    }

    pub async fn settle(
        &self,
        shop: &str,
        hold_id: &str,
        end: Option<HoldEnd>,
    ) -> anyhow::Result<Option<Hold>> {
        let mut taken = self.take().await?;
        let c = taken
            .conn
            .as_mut()
            .context("pool slot without a connection")?;
        c.settle(shop, hold_id, end).await
    }

    /// Each transaction of a batch is its own SQL transaction, in order, on one
    /// connection: "one transaction per request" holds for batches too.
    pub async fn decide(&self, shop: &str, txns: &[Txn]) -> anyhow::Result<Vec<Decision>> {
        let mut taken = self.take().await?;
        let c = taken
            .conn
            .as_mut()
            .context("pool slot without a connection")?;
        c.release_due(shop, now_ms()).await?;
        let mut out = Vec::with_capacity(txns.len());
        for t in txns {
            out.push(c.decide(shop, t).await?);
        }
        Ok(out)
    }

    pub async fn poll(&self, shop: &str, key: &str) -> anyhow::Result<Option<Outcome>> {
        let taken = self.take().await?;
        let c = taken
            .conn
            .as_ref()
            .context("pool slot without a connection")?;
        c.recorded(shop, key).await
    }
}
