//! The PostgreSQL peer: what a relational design does. One transaction per request:
//! a conditional `UPDATE items SET stock = stock - $q WHERE ... AND stock >= $q` (the row
//! lock serializes sales of one item), and an insert of the request key with its outcome
//! (`ON CONFLICT DO NOTHING`: a repeated key rolls back and answers the recorded one).
//!
//! Durability: `scripts/bench.sh` runs PostgreSQL with `fsync=on` and
//! `synchronous_commit=on`, so each COMMIT waits for its WAL flush (group commit
//! merges concurrent flushes), as nrtxn's journal does.

use std::sync::{Arc, Mutex};

use anyhow::Context;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_postgres::{Client, NoTls, Statement};

use super::{now_ms, Decision, Outcome, Txn, STOCK_MAX};

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS items (
    shop text NOT NULL,
    item text NOT NULL,
    stock bigint NOT NULL CHECK (stock >= 0),
    PRIMARY KEY (shop, item)
);
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
);";

/// One connection with its prepared statements (prepared once: parsing and planning
/// per request would measure the SQL parser, not the design).
struct PgConn {
    client: Client,
    decrement: Statement,
    increment: Statement,
    stock: Statement,
    record: Statement,
    recorded: Statement,
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
            .prepare("SELECT stock FROM items WHERE shop = $1 AND item = $2")
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
        Ok(PgConn {
            client,
            decrement,
            increment,
            stock,
            record,
            recorded,
        })
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

    pub async fn load(&self, shop: &str, items: &[(String, i64)]) -> anyhow::Result<()> {
        let taken = self.take().await?;
        let c = taken
            .conn
            .as_ref()
            .context("pool slot without a connection")?;
        let names: Vec<&str> = items.iter().map(|(i, _)| i.as_str()).collect();
        let stocks: Vec<i64> = items.iter().map(|(_, s)| *s).collect();
        c.client
            .execute(
                "INSERT INTO items (shop, item, stock) SELECT $1, unnest($2::text[]), unnest($3::int8[]) \
                 ON CONFLICT (shop, item) DO UPDATE SET stock = EXCLUDED.stock",
                &[&shop, &names, &stocks],
            )
            .await
            .context("loading items")?;
        Ok(())
    }

    pub async fn item(&self, shop: &str, item: &str) -> anyhow::Result<Option<i64>> {
        let taken = self.take().await?;
        let c = taken
            .conn
            .as_ref()
            .context("pool slot without a connection")?;
        let row = c.client.query_opt(&c.stock, &[&shop, &item]).await?;
        Ok(row.map(|r| r.get(0)))
    }

    /// Each transaction of a batch is its own SQL transaction, in order, on one
    /// connection: "one transaction per request" holds for batches too.
    pub async fn decide(&self, shop: &str, txns: &[Txn]) -> anyhow::Result<Vec<Decision>> {
        let mut taken = self.take().await?;
        let c = taken
            .conn
            .as_mut()
            .context("pool slot without a connection")?;
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
