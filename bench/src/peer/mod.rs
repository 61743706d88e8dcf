//! `nrtxn-bench peer`: reference services behind nrtxn's routes and JSON shapes, so that
//! a benchmark compares inventory engines, not HTTP stacks.
//!
//! One actix-web front (the framework nrtxn uses) with one [`Backend`] behind it:
//! - `redis-lua`: one EVALSHA per request (conditional DECRBY + SET NX of the key);
//! - `postgres-row`: one SQL transaction per request (conditional UPDATE + key insert);
//! - `ceiling`: parses and answers without state: the HTTP limit of the machine.
//!
//! What the peers leave out, on purpose: holds (501, and the mixed scenario then skips
//! them), the event stream, admission bounds. Fire-and-forget (`respond=false`) is
//! decided before its 202: with one round trip per request there is nothing to gain by
//! deferring it, and it is what such a design would do.

mod postgres_row;
mod redis_lua;

use std::time::{SystemTime, UNIX_EPOCH};

use actix_web::{web, App, HttpResponse, HttpServer};
use anyhow::Context;
use clap::{Args, ValueEnum};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use postgres_row::PgRow;
use redis_lua::RedisLua;

/// Most entries of a batch, as nrtxn.
const BATCH_TXNS_MAX: usize = 1_000;
/// Most items of a load, as nrtxn.
const LOAD_ITEMS_MAX: usize = 10_000;
/// Largest request body: a load of 10,000 items, as nrtxn's 4 MiB.
const BODY_MAX: usize = 4 * 1024 * 1024;
/// Quantity bound, as nrtxn.
const QTY_MAX: i64 = 1_000_000_000;
/// Stock bound, as nrtxn.
pub const STOCK_MAX: i64 = 1_000_000_000_000_000;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Kind {
    RedisLua,
    PostgresRow,
    Ceiling,
}

#[derive(Args, Debug, Clone)]
pub struct PeerArgs {
    #[arg(long, value_enum)]
    pub kind: Kind,
    /// Address to listen on; port 0 picks a free one (printed on stdout).
    #[arg(long, default_value = "127.0.0.1:0")]
    pub listen: String,
    #[arg(long, default_value = "redis://127.0.0.1:6379/")]
    pub redis_url: String,
    /// libpq-style connection string of the PostgreSQL peer.
    #[arg(
        long,
        default_value = "host=127.0.0.1 port=5432 user=postgres dbname=postgres"
    )]
    pub pg_url: String,
    /// Connections of the PostgreSQL pool: requests beyond them wait for one.
    #[arg(long, default_value_t = 16)]
    pub pg_connections: usize,
    /// HTTP worker threads; default the number of cores, as nrtxn.
    #[arg(long)]
    pub workers: Option<usize>,
}

/// A decision, in nrtxn's outcome shape (`seq` is null: the peers keep no sequence).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Outcome {
    pub shop: String,
    pub request_key: String,
    pub status: String,
    pub reason: Option<String>,
    pub item: String,
    pub op: String,
    pub qty: i64,
    pub stock_before: Option<i64>,
    pub stock_after: Option<i64>,
    pub seq: Option<u64>,
    pub prev_seq: Option<u64>,
    pub submitted_at: i64,
    pub completed_at: i64,
}

/// A decision and whether it was recorded before this request (a repeated key).
#[derive(Debug, Clone)]
pub struct Decision {
    pub outcome: Outcome,
    /// The key already had an outcome: it is answered as is, with 200, and nothing moved.
    pub repeat: bool,
}

/// A validated transaction.
#[derive(Debug, Clone)]
pub struct Txn {
    pub item: String,
    pub qty: i64,
    pub increment: bool,
    pub key: String,
    pub respond: bool,
    pub submitted_at: i64,
}

impl Txn {
    pub fn op(&self) -> &'static str {
        if self.increment {
            "increment"
        } else {
            "decrement"
        }
    }

    /// The outcome of this transaction with the given status and stock figures.
    pub fn outcome(
        &self,
        shop: &str,
        status: &str,
        before: Option<i64>,
        after: Option<i64>,
    ) -> Outcome {
        let reason = match status {
            "insufficient_stock" => {
                before.map(|b| format!("requested {}, available {b}", self.qty))
            }
            "unknown_item" => Some(format!("no item {} in shop {shop}", self.item)),
            _ => None,
        };
        Outcome {
            shop: shop.to_string(),
            request_key: self.key.clone(),
            status: status.to_string(),
            reason,
            item: self.item.clone(),
            op: self.op().to_string(),
            qty: self.qty,
            stock_before: before,
            stock_after: after,
            seq: None,
            prev_seq: None,
            submitted_at: self.submitted_at,
            completed_at: now_ms(),
        }
    }
}

pub fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

/// The engine behind the routes.
pub enum Backend {
    Redis(RedisLua),
    Postgres(PgRow),
    Ceiling,
}

/// 400 with nrtxn's error shape: the field and why.
struct Invalid(String);

fn invalid(detail: impl Into<String>) -> Invalid {
    Invalid(detail.into())
}

impl Invalid {
    fn response(&self) -> HttpResponse {
        HttpResponse::BadRequest().json(json!({ "error": "invalid_request", "detail": self.0 }))
    }
}

fn unavailable(e: anyhow::Error) -> HttpResponse {
    HttpResponse::ServiceUnavailable()
        .insert_header(("Retry-After", "1"))
        .json(json!({ "error": "unavailable", "detail": format!("{e:#}") }))
}

fn name(v: &Value, field: &str, prefix: &str, max: usize) -> Result<Option<String>, Invalid> {
    match v.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => {
            if s.is_empty() || s.len() > max {
                return Err(invalid(format!(
                    "{prefix}{field}: must be 1 to {max} bytes"
                )));
            }
            if s.chars().any(|c| c == '/' || c.is_control()) {
                return Err(invalid(format!(
                    "{prefix}{field}: may not contain '/' or control characters"
                )));
            }
            Ok(Some(s.clone()))
        }
        Some(_) => Err(invalid(format!("{prefix}{field}: must be a string"))),
    }
}

fn segment(s: &str, field: &str) -> Result<String, Invalid> {
    name(&json!({ field: s }), field, "", 128)?.ok_or_else(|| invalid(format!("{field}: required")))
}

/// Validates one transaction as nrtxn does, for the fields the peers use.
fn txn(v: &Value, prefix: &str) -> Result<Txn, Invalid> {
    if !v.is_object() {
        return Err(invalid(format!("{prefix}: must be a JSON object")));
    }
    let seller = name(v, "seller", prefix, 128)?
        .ok_or_else(|| invalid(format!("{prefix}seller: required")))?;
    let item =
        name(v, "item", prefix, 128)?.ok_or_else(|| invalid(format!("{prefix}item: required")))?;
    let qty = match v.get("qty") {
        Some(Value::Number(n)) => n
            .as_i64()
            .filter(|q| (1..=QTY_MAX).contains(q))
            .ok_or_else(|| {
                invalid(format!(
                    "{prefix}qty: must be an integer from 1 to {QTY_MAX}, got {n}"
                ))
            })?,
        Some(_) => return Err(invalid(format!("{prefix}qty: must be an integer"))),
        None => return Err(invalid(format!("{prefix}qty: required"))),
    };
    let increment = match v.get("op").and_then(Value::as_str) {
        None if v.get("op").is_none_or(Value::is_null) => false,
        Some("decrement") => false,
        Some("increment") => true,
        _ => {
            return Err(invalid(format!(
                "{prefix}op: must be \"decrement\" or \"increment\""
            )))
        }
    };
    let respond = match v.get("respond") {
        None | Some(Value::Null) => true,
        Some(Value::Bool(b)) => *b,
        Some(Value::Number(n)) if n.as_u64() == Some(1) => true,
        Some(Value::Number(n)) if n.as_u64() == Some(0) => false,
        Some(_) => {
            return Err(invalid(format!(
                "{prefix}respond: must be true, false, 1 or 0"
            )))
        }
    };
    let key = match name(v, "request_id", prefix, 128)? {
        Some(k) => k,
        None => {
            let t = match v.get("req_time") {
                Some(Value::String(s)) if !s.is_empty() => s.clone(),
                Some(Value::Number(n)) => n.to_string(),
                _ => {
                    return Err(invalid(format!(
                        "{prefix}req_time: required (string or integer) unless request_id is given"
                    )))
                }
            };
            format!("{seller}:{item}:{t}")
        }
    };
    Ok(Txn {
        item,
        qty,
        increment,
        key,
        respond,
        submitted_at: now_ms(),
    })
}

fn parse_body(body: &[u8]) -> Result<Value, Invalid> {
    let v: Value =
        serde_json::from_slice(body).map_err(|e| invalid(format!("body: not valid JSON: {e}")))?;
    if !v.is_object() {
        return Err(invalid("body: must be a JSON object"));
    }
    Ok(v)
}

impl Backend {
    async fn load(&self, shop: &str, items: &[(String, i64)]) -> anyhow::Result<()> {
        match self {
            Backend::Redis(r) => r.load(shop, items).await,
            Backend::Postgres(p) => p.load(shop, items).await,
            Backend::Ceiling => Ok(()),
        }
    }

    async fn item(&self, shop: &str, item: &str) -> anyhow::Result<Option<i64>> {
        match self {
            Backend::Redis(r) => r.item(shop, item).await,
            Backend::Postgres(p) => p.item(shop, item).await,
            Backend::Ceiling => Ok(Some(0)),
        }
    }

    async fn decide(&self, shop: &str, txns: &[Txn]) -> anyhow::Result<Vec<Decision>> {
        match self {
            Backend::Redis(r) => r.decide(shop, txns).await,
            Backend::Postgres(p) => p.decide(shop, txns).await,
            Backend::Ceiling => Ok(txns
                .iter()
                .map(|t| Decision {
                    outcome: t.outcome(shop, "ok", Some(STOCK_MAX), Some(STOCK_MAX - t.qty)),
                    repeat: false,
                })
                .collect()),
        }
    }

    async fn poll(&self, shop: &str, key: &str) -> anyhow::Result<Option<Outcome>> {
        match self {
            Backend::Redis(r) => r.poll(shop, key).await,
            Backend::Postgres(p) => p.poll(shop, key).await,
            // Stateless: every key reads as decided at once. completed_at 0 says "no
            // time known", so the load generator counts it decided when it was answered.
            Backend::Ceiling => Ok(Some(Outcome {
                shop: shop.to_string(),
                request_key: key.to_string(),
                status: "ok".into(),
                reason: None,
                item: String::new(),
                op: "decrement".into(),
                qty: 1,
                stock_before: None,
                stock_after: None,
                seq: None,
                prev_seq: None,
                submitted_at: 0,
                completed_at: 0,
            })),
        }
    }
}

fn answer(t: &Txn, d: &Decision) -> Value {
    if t.respond || d.repeat {
        serde_json::to_value(&d.outcome).unwrap_or(Value::Null)
    } else {
        json!({ "request_key": t.key, "status": "accepted" })
    }
}

/// The body's array `field`, of 1 to `max` entries.
fn array_field<'a>(v: &'a Value, field: &str, max: usize) -> Result<&'a Vec<Value>, Invalid> {
    let entries = v
        .get(field)
        .and_then(Value::as_array)
        .ok_or_else(|| invalid(format!("{field}: required, an array")))?;
    if entries.is_empty() || entries.len() > max {
        return Err(invalid(format!(
            "{field}: 1 to {max} entries, got {}",
            entries.len()
        )));
    }
    Ok(entries)
}

async fn put_items(
    be: web::Data<Backend>,
    path: web::Path<String>,
    body: web::Bytes,
) -> HttpResponse {
    let parsed = (|| -> Result<_, Invalid> {
        let shop = segment(&path, "shop")?;
        let v = parse_body(&body)?;
        let entries = array_field(&v, "items", LOAD_ITEMS_MAX)?;
        let mut items = Vec::with_capacity(entries.len());
        for (i, e) in entries.iter().enumerate() {
            let prefix = format!("items[{i}].");
            let item = name(e, "item", &prefix, 128)?
                .ok_or_else(|| invalid(format!("{prefix}item: required")))?;
            let stock = e
                .get("stock")
                .and_then(Value::as_i64)
                .filter(|s| (0..=STOCK_MAX).contains(s))
                .ok_or_else(|| {
                    invalid(format!("{prefix}stock: an integer from 0 to {STOCK_MAX}"))
                })?;
            items.push((item, stock));
        }
        Ok((shop, items))
    })();
    let (shop, items) = match parsed {
        Ok(p) => p,
        Err(e) => return e.response(),
    };
    match be.load(&shop, &items).await {
        Ok(()) => HttpResponse::Ok().json(json!({
            "items": items.iter().map(|(item, stock)| json!({
                "shop": shop, "item": item, "stock": stock, "reserved": 0, "seq": null
            })).collect::<Vec<_>>()
        })),
        Err(e) => unavailable(e),
    }
}

async fn get_item(be: web::Data<Backend>, path: web::Path<(String, String)>) -> HttpResponse {
    let (shop, item) = path.into_inner();
    let (shop, item) = match (segment(&shop, "shop"), segment(&item, "item")) {
        (Ok(s), Ok(i)) => (s, i),
        (Err(e), _) | (_, Err(e)) => return e.response(),
    };
    match be.item(&shop, &item).await {
        Ok(Some(stock)) => HttpResponse::Ok().json(json!({
            "shop": shop, "item": item, "stock": stock, "reserved": 0, "seq": null
        })),
        Ok(None) => HttpResponse::NotFound().json(json!({
            "error": "not_found", "detail": format!("item: no item {item} in shop {shop}")
        })),
        Err(e) => unavailable(e),
    }
}

async fn post_txn(
    be: web::Data<Backend>,
    path: web::Path<String>,
    body: web::Bytes,
) -> HttpResponse {
    let (shop, t) =
        match segment(&path, "shop").and_then(|s| Ok((s, txn(&parse_body(&body)?, "")?))) {
            Ok(p) => p,
            Err(e) => return e.response(),
        };
    match be.decide(&shop, std::slice::from_ref(&t)).await {
        Ok(decisions) => match decisions.first() {
            // A repeated key answers its recorded outcome with 200, as nrtxn.
            Some(d) if t.respond || d.repeat => HttpResponse::Ok().json(&d.outcome),
            Some(d) => HttpResponse::Accepted().json(answer(&t, d)),
            None => unavailable(anyhow::anyhow!("the backend returned no outcome")),
        },
        Err(e) => unavailable(e),
    }
}

async fn post_batch(
    be: web::Data<Backend>,
    path: web::Path<String>,
    body: web::Bytes,
) -> HttpResponse {
    let parsed = (|| -> Result<_, Invalid> {
        let shop = segment(&path, "shop")?;
        let v = parse_body(&body)?;
        let entries = array_field(&v, "txns", BATCH_TXNS_MAX)?;
        let txns = entries
            .iter()
            .enumerate()
            .map(|(i, e)| txn(e, &format!("txns[{i}].")))
            .collect::<Result<Vec<_>, _>>()?;
        Ok((shop, txns))
    })();
    let (shop, txns) = match parsed {
        Ok(p) => p,
        Err(e) => return e.response(),
    };
    match be.decide(&shop, &txns).await {
        Ok(decisions) => HttpResponse::Ok().json(json!({
            "results": txns.iter().zip(&decisions).map(|(t, d)| answer(t, d)).collect::<Vec<_>>()
        })),
        Err(e) => unavailable(e),
    }
}

async fn get_txn(be: web::Data<Backend>, path: web::Path<(String, String)>) -> HttpResponse {
    let (shop, key) = path.into_inner();
    let (shop, key) = match (segment(&shop, "shop"), segment(&key, "request_key")) {
        (Ok(s), Ok(k)) => (s, k),
        (Err(e), _) | (_, Err(e)) => return e.response(),
    };
    match be.poll(&shop, &key).await {
        Ok(Some(o)) => HttpResponse::Ok().json(o),
        Ok(None) => HttpResponse::NotFound().json(json!({
            "error": "not_found", "detail": format!("request_key: no request {key} in shop {shop}")
        })),
        Err(e) => unavailable(e),
    }
}

async fn holds_not_implemented() -> HttpResponse {
    HttpResponse::NotImplemented().json(json!({
        "error": "not_implemented",
        "detail": "holds: this peer implements loads, transactions, batches and polls only"
    }))
}

async fn ok() -> HttpResponse {
    HttpResponse::Ok().json(json!({ "status": "ok" }))
}

async fn not_found() -> HttpResponse {
    HttpResponse::NotFound().json(json!({ "error": "not_found", "detail": "no such route" }))
}

/// Connects the backend, then serves until SIGINT/SIGTERM (actix's default handling).
pub async fn serve(args: PeerArgs) -> anyhow::Result<()> {
    let backend = match args.kind {
        Kind::RedisLua => Backend::Redis(RedisLua::connect(&args.redis_url).await?),
        Kind::PostgresRow => {
            if args.pg_connections == 0 || args.pg_connections > 1_000 {
                anyhow::bail!(
                    "--pg-connections: must be 1 to 1,000, got {}",
                    args.pg_connections
                );
            }
            Backend::Postgres(PgRow::connect(&args.pg_url, args.pg_connections).await?)
        }
        Kind::Ceiling => Backend::Ceiling,
    };
    let data = web::Data::new(backend);
    let workers = args.workers.unwrap_or_else(|| {
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(2)
    });
    if workers == 0 {
        anyhow::bail!("--workers: must be at least 1");
    }
    let server = HttpServer::new(move || {
        App::new()
            .app_data(data.clone())
            .app_data(web::PayloadConfig::new(BODY_MAX))
            .route("/healthz", web::get().to(ok))
            .route("/readyz", web::get().to(ok))
            .route("/v1/shops/{shop}/items", web::put().to(put_items))
            .route("/v1/shops/{shop}/items/{item}", web::get().to(get_item))
            .route("/v1/shops/{shop}/txns", web::post().to(post_txn))
            .route("/v1/shops/{shop}/txns/batch", web::post().to(post_batch))
            .route(
                "/v1/shops/{shop}/txns/{request_key}",
                web::get().to(get_txn),
            )
            .route(
                "/v1/shops/{shop}/holds",
                web::post().to(holds_not_implemented),
            )
            .route(
                "/v1/shops/{shop}/holds/{hold_id}",
                web::get().to(holds_not_implemented),
            )
            .route(
                "/v1/shops/{shop}/holds/{hold_id}/{end}",
                web::post().to(holds_not_implemented),
            )
            .default_service(web::to(not_found))
    })
    .workers(workers)
    .bind(&args.listen)
    .with_context(|| format!("--listen: cannot listen on {}", args.listen))?;
    for addr in server.addrs() {
        println!("nrtxn-bench peer listening on http://{addr}");
    }
    server.run().await.context("the HTTP server failed")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transaction_validation_names_the_field() {
        let e = |v: Value| txn(&v, "txns[2].").err().map(|e| e.0).unwrap_or_default();
        assert!(e(json!({"item":"a","qty":1,"request_id":"k"})).starts_with("txns[2].seller"));
        assert!(
            e(json!({"seller":"s","item":"a","qty":0,"request_id":"k"})).starts_with("txns[2].qty")
        );
        assert!(
            e(json!({"seller":"s","item":"a/b","qty":1,"request_id":"k"}))
                .starts_with("txns[2].item")
        );
        assert!(e(json!({"seller":"s","item":"a","qty":1})).starts_with("txns[2].req_time"));
        assert!(
            e(json!({"seller":"s","item":"a","qty":1,"request_id":"k","op":"x"}))
                .starts_with("txns[2].op")
        );
    }

    #[test]
    fn request_key_is_request_id_else_seller_item_time() {
        let t = txn(&json!({"seller":"s","item":"a","qty":2,"req_time":17}), "")
            .ok()
            .unwrap();
        assert_eq!(t.key, "s:a:17");
        assert!(t.respond && !t.increment);
        let t = txn(
            &json!({"seller":"s","item":"a","qty":2,"request_id":"k","respond":0,"op":"increment"}),
            "",
        )
        .ok()
        .unwrap();
        assert_eq!(t.key, "k");
        assert!(!t.respond && t.increment);
    }
}
