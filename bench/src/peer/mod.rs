//! `nrtxn-bench peer`: reference services behind nrtxn's routes and JSON shapes, so that
//! a benchmark compares inventory engines, not HTTP stacks.
//!
//! One actix-web front (the framework nrtxn uses) with one [`Backend`] behind it:
//! - `redis-lua`: one EVALSHA per request (conditional DECRBY + SET NX of the key; for
//!   holds, per-item `reserved` counters, a hash per hold and a sorted set of expiries);
//! - `postgres-row`: one SQL transaction per request (conditional UPDATE + key insert;
//!   for holds, a `reserved` column and a `holds` table);
//! - `ceiling`: parses and answers without state: the HTTP limit of the machine.
//!
//! Holds have nrtxn's routes, bodies and statuses (`held`, `confirmed`, `released`,
//! `expired`; a refusal is `insufficient_stock` or `unknown_item`; ending a hold that
//! already ended otherwise is a `409` with its state). Their expiry is lazy, as such
//! designs do it: each call first releases up to [`RELEASE_MAX`] holds of its shop past
//! `expires_at`, and a confirm, cancel or read of a hold past it finds it `expired`.
//! A hold's id is its own key space, apart from transactions' request keys.
//!
//! Orders (issue 15) have nrtxn's routes, bodies and statuses in `redis-lua` (one script
//! reserves every line or none, atomically; confirm, cancel and expiry end every line
//! together) and `ceiling`. `postgres-row` answers them `501`: `bench/README.md` says
//! why. An order's id is a key space of its own too, and the peers keep no per-buyer
//! limit (`buyer` is accepted and ignored).
//!
//! What the peers leave out, on purpose: the event stream, admission bounds, the
//! `key_reused` check (a repeated key answers its first outcome, whatever its body).
//! Fire-and-forget (`respond=false`) is decided before its 202: with one round trip per
//! request there is nothing to gain by deferring it, and it is what such a design would do.

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
/// Longest `ttl_ms` of a hold, as nrtxn: a week.
const HOLD_TTL_MAX_MS: i64 = 7 * 24 * 3600 * 1000;
/// Most holds past their expiry that one call releases before its own work: a bound on
/// what a call may cost, whatever expired meanwhile. The rest go with the next calls.
pub const RELEASE_MAX: usize = 16;
/// The states of a hold that was made; any other recorded status is its refusal.
const HOLD_STATES: [&str; 4] = ["held", "confirmed", "released", "expired"];
/// Most lines of an order, as nrtxn.
const ORDER_LINES_MAX: usize = 100;

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

/// A validated hold request (`POST .../holds`); its `request_id` is the hold's id.
#[derive(Debug, Clone)]
pub struct HoldReq {
    pub hold_id: String,
    pub item: String,
    pub qty: i64,
    pub ttl_ms: i64,
}

/// How a caller ends a hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HoldEnd {
    Confirm,
    Cancel,
}

impl HoldEnd {
    /// The state this ending leaves a held hold in.
    pub fn state(self) -> &'static str {
        match self {
            HoldEnd::Confirm => "confirmed",
            HoldEnd::Cancel => "released",
        }
    }

    fn verb(self) -> &'static str {
        match self {
            HoldEnd::Confirm => "confirmed",
            HoldEnd::Cancel => "cancelled",
        }
    }
}

/// A hold as a backend records it: `status` is its state (`held`, `confirmed`,
/// `released`, `expired`) or, for a hold refused when asked for, the refusal
/// (`insufficient_stock`, `unknown_item`, nothing held, no `expires_at`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hold {
    pub hold_id: String,
    pub status: String,
    pub item: String,
    pub qty: i64,
    pub expires_at: Option<i64>,
    /// The available stock when a hold was refused for want of it.
    pub stock_before: Option<i64>,
}

impl Hold {
    /// Whether the request made a hold (whatever became of it since).
    pub fn was_held(&self) -> bool {
        HOLD_STATES.contains(&self.status.as_str())
    }

    /// nrtxn's body of a hold in its current state (`GET`, confirm, cancel).
    fn body(&self) -> HoldBody<'_> {
        HoldBody {
            hold_id: &self.hold_id,
            status: &self.status,
            item: &self.item,
            qty: self.qty,
            expires_at: self.expires_at,
            seq: None,
            reason: None,
        }
    }

    /// nrtxn's answer to `POST .../holds`: the request's outcome, `held` or the refusal
    /// with its reason, the same for a repeated key whatever became of the hold since.
    fn outcome_body(&self, shop: &str) -> HoldBody<'_> {
        let reason = match self.status.as_str() {
            "insufficient_stock" => self
                .stock_before
                .map(|b| format!("requested {}, available {b}", self.qty)),
            "unknown_item" => Some(format!("no item {} in shop {shop}", self.item)),
            _ => None,
        };
        let held = self.was_held();
        HoldBody {
            hold_id: &self.hold_id,
            status: if held { "held" } else { &self.status },
            item: &self.item,
            qty: self.qty,
            expires_at: self.expires_at.filter(|_| held),
            seq: None,
            reason,
        }
    }
}

/// A validated order (`POST .../orders`): its lines' items are distinct.
#[derive(Debug, Clone)]
pub struct OrderReq {
    pub order_id: String,
    pub lines: Vec<(String, i64)>,
    pub ttl_ms: i64,
}

impl HoldEnd {
    /// The state this ending leaves a held order in (nrtxn's words for orders).
    pub fn order_state(self) -> &'static str {
        match self {
            HoldEnd::Confirm => "confirmed",
            HoldEnd::Cancel => "cancelled",
        }
    }
}

/// An order as a backend records it: `status` is its state (`held`, `confirmed`,
/// `cancelled`, `expired`) or, for an order refused when placed, the first failing
/// line's status with `failed_line` (nothing reserved, no `expires_at`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Order {
    pub order_id: String,
    pub status: String,
    pub lines: Vec<(String, i64)>,
    pub expires_at: Option<i64>,
    pub failed_line: Option<usize>,
}

impl Order {
    /// nrtxn's body of an order (`POST .../orders`, confirm, cancel, `GET`): a placing
    /// asked again answers the order as it stands, as nrtxn does.
    fn body(&self) -> Value {
        let line_status = match self.status.as_str() {
            "held" | "confirmed" | "expired" => self.status.as_str(),
            "cancelled" => "released",
            _ => "not_held",
        };
        let mut body = json!({
            "order_id": self.order_id,
            "status": self.status,
            "lines": self.lines.iter().map(|(item, qty)| json!({
                "item": item, "qty": qty, "seq": null, "status": line_status
            })).collect::<Vec<_>>(),
            "expires_at": self.expires_at,
        });
        if let (Some(i), Value::Object(m)) = (self.failed_line, &mut body) {
            m.insert("failed_line".into(), json!(i));
        }
        body
    }
}

/// A hold as nrtxn's routes answer it (its fields in nrtxn's order).
#[derive(Serialize)]
struct HoldBody<'a> {
    hold_id: &'a str,
    status: &'a str,
    item: &'a str,
    qty: i64,
    expires_at: Option<i64>,
    seq: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    reason: Option<String>,
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

/// An integer field from `min` to `max`, with nrtxn's messages.
fn bounded(v: &Value, field: &str, min: i64, max: i64) -> Result<i64, Invalid> {
    match v.get(field) {
        None | Some(Value::Null) => Err(invalid(format!("{field}: required"))),
        Some(Value::Number(n)) => match n.as_i64() {
            Some(x) if x < min => Err(invalid(format!("{field}: must be at least {min}, got {x}"))),
            Some(x) if x > max => Err(invalid(format!("{field}: must be at most {max}, got {x}"))),
            Some(x) => Ok(x),
            None if n.is_u64() => Err(invalid(format!("{field}: must be at most {max}, got {n}"))),
            None => Err(invalid(format!("{field}: must be an integer, got {n}"))),
        },
        Some(_) => Err(invalid(format!("{field}: must be an integer"))),
    }
}

/// Validates a hold request as nrtxn does: `item`, `qty`, `ttl_ms` and `request_id`
/// required (the id makes the hold idempotent), `seller` optional.
fn hold_request(v: &Value) -> Result<HoldReq, Invalid> {
    let item = name(v, "item", "", 128)?.ok_or_else(|| invalid("item: required"))?;
    let qty = bounded(v, "qty", 1, QTY_MAX)?;
    let ttl_ms = bounded(v, "ttl_ms", 1, HOLD_TTL_MAX_MS)?;
    let hold_id = name(v, "request_id", "", 128)?.ok_or_else(|| {
        invalid("request_id: required (it makes the hold idempotent and is its id)")
    })?;
    if hold_id.starts_with('~') {
        return Err(invalid("request_id: must not start with '~' (reserved)"));
    }
    name(v, "seller", "", 128)?;
    Ok(HoldReq {
        hold_id,
        item,
        qty,
        ttl_ms,
    })
}

/// Validates an order as nrtxn does: `order_id` required (not starting with '~'), 1 to
/// [`ORDER_LINES_MAX`] lines of `item` and `qty`, items distinct, `ttl_ms` required,
/// `buyer` optional.
fn order_request(v: &Value) -> Result<OrderReq, Invalid> {
    let order_id = name(v, "order_id", "", 128)?.ok_or_else(|| {
        invalid("order_id: required (it makes the order idempotent and is its id)")
    })?;
    if order_id.starts_with('~') {
        return Err(invalid("order_id: must not start with '~' (reserved)"));
    }
    let raw = array_field(v, "lines", ORDER_LINES_MAX)?;
    let mut lines: Vec<(String, i64)> = Vec::with_capacity(raw.len());
    for (i, line) in raw.iter().enumerate() {
        let at = format!("lines[{i}].");
        if !line.is_object() {
            return Err(invalid(format!("lines[{i}]: must be a JSON object")));
        }
        let item =
            name(line, "item", &at, 128)?.ok_or_else(|| invalid(format!("{at}item: required")))?;
        let qty = bounded(line, "qty", 1, QTY_MAX).map_err(|e| invalid(format!("{at}{}", e.0)))?;
        if let Some(first) = lines.iter().position(|(it, _)| *it == item) {
            return Err(invalid(format!(
                "lines[{i}].item: {item} is already line {first}; an order names each item once"
            )));
        }
        lines.push((item, qty));
    }
    let ttl_ms = bounded(v, "ttl_ms", 1, HOLD_TTL_MAX_MS)?;
    name(v, "buyer", "", 128)?;
    Ok(OrderReq {
        order_id,
        lines,
        ttl_ms,
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
    /// Sets the items' stock; answers each one's reserved part (pending holds stay).
    async fn load(&self, shop: &str, items: &[(String, i64)]) -> anyhow::Result<Vec<i64>> {
        match self {
            Backend::Redis(r) => r.load(shop, items).await,
            Backend::Postgres(p) => p.load(shop, items).await,
            Backend::Ceiling => Ok(vec![0; items.len()]),
        }
    }

    /// An item's available stock and its reserved part.
    async fn item(&self, shop: &str, item: &str) -> anyhow::Result<Option<(i64, i64)>> {
        match self {
            Backend::Redis(r) => r.item(shop, item).await,
            Backend::Postgres(p) => p.item(shop, item).await,
            Backend::Ceiling => Ok(Some((0, 0))),
        }
    }

    /// Makes a hold, or answers the hold recorded under its id (a repeated key).
    async fn hold(&self, shop: &str, req: &HoldReq) -> anyhow::Result<Hold> {
        match self {
            Backend::Redis(r) => r.hold(shop, req).await,
            Backend::Postgres(p) => p.hold(shop, req).await,
            Backend::Ceiling => Ok(Hold {
                hold_id: req.hold_id.clone(),
                status: "held".into(),
                item: req.item.clone(),
                qty: req.qty,
                expires_at: Some(now_ms() + req.ttl_ms),
                stock_before: None,
            }),
        }
    }

    /// Ends a held hold as `end` asks (or only reads it, with `None`), expiring it first
    /// if it is past `expires_at`; answers the hold as it then stands, `None` for no
    /// hold (never made, or refused).
    async fn settle(
        &self,
        shop: &str,
        hold_id: &str,
        end: Option<HoldEnd>,
    ) -> anyhow::Result<Option<Hold>> {
        match self {
            Backend::Redis(r) => r.settle(shop, hold_id, end).await,
            Backend::Postgres(p) => p.settle(shop, hold_id, end).await,
            // Stateless: every hold reads as held, and every ending as done.
            Backend::Ceiling => Ok(Some(Hold {
                hold_id: hold_id.to_string(),
                status: end.map_or("held", HoldEnd::state).into(),
                item: String::new(),
                qty: 0,
                expires_at: None,
                stock_before: None,
            })),
        }
    }

    /// Places an order, or answers the order recorded under its id as it stands.
    /// `Ok(None)`: this backend does not implement orders.
    async fn order(&self, shop: &str, req: &OrderReq) -> anyhow::Result<Option<Order>> {
        match self {
            Backend::Redis(r) => r.order(shop, req).await.map(Some),
            Backend::Postgres(_) => Ok(None),
            Backend::Ceiling => Ok(Some(Order {
                order_id: req.order_id.clone(),
                status: "held".into(),
                lines: req.lines.clone(),
                expires_at: Some(now_ms() + req.ttl_ms),
                failed_line: None,
            })),
        }
    }

    /// Ends a held order as `end` asks (or only reads it, with `None`), expiring it
    /// first if it is past `expires_at`. `Ok(None)`: no such order; `Err` of
    /// [`NotImplemented`] for a backend without orders.
    async fn settle_order(
        &self,
        shop: &str,
        order_id: &str,
        end: Option<HoldEnd>,
    ) -> anyhow::Result<Option<Order>> {
        match self {
            Backend::Redis(r) => r.settle_order(shop, order_id, end).await,
            Backend::Postgres(_) => Err(NotImplemented.into()),
            // Stateless: every order reads as held, and every ending as done.
            Backend::Ceiling => Ok(Some(Order {
                order_id: order_id.to_string(),
                status: end.map_or("held", HoldEnd::order_state).into(),
                lines: Vec::new(),
                expires_at: None,
                failed_line: None,
            })),
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
        Ok(reserved) => HttpResponse::Ok().json(json!({
            "items": items.iter().zip(reserved).map(|((item, stock), reserved)| json!({
                "shop": shop, "item": item, "stock": stock, "reserved": reserved, "seq": null
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
        Ok(Some((stock, reserved))) => HttpResponse::Ok().json(json!({
            "shop": shop, "item": item, "stock": stock, "reserved": reserved, "seq": null
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

fn no_hold(shop: &str, hold_id: &str) -> HttpResponse {
    HttpResponse::NotFound().json(json!({
        "error": "not_found", "detail": format!("hold_id: no hold {hold_id} in shop {shop}")
    }))
}

async fn post_hold(
    be: web::Data<Backend>,
    path: web::Path<String>,
    body: web::Bytes,
) -> HttpResponse {
    let (shop, req) =
        match segment(&path, "shop").and_then(|s| Ok((s, hold_request(&parse_body(&body)?)?))) {
            Ok(p) => p,
            Err(e) => return e.response(),
        };
    match be.hold(&shop, &req).await {
        Ok(h) => HttpResponse::Ok().json(h.outcome_body(&shop)),
        Err(e) => unavailable(e),
    }
}

/// The answer to a confirm or cancel: the hold if it now stands as `end` leaves it (also
/// when an earlier call ended it so), else `Err` with its state, `error` and `detail`
/// (nrtxn's `409`).
fn end_answer(h: &Hold, end: HoldEnd) -> Result<HoldBody<'_>, Value> {
    if h.status == end.state() {
        return Ok(h.body());
    }
    let mut body = serde_json::to_value(h.body()).unwrap_or(Value::Null);
    if let Value::Object(m) = &mut body {
        m.insert("error".into(), json!("conflict"));
        m.insert(
            "detail".into(),
            json!(format!(
                "hold_id: hold {} is {}, it cannot be {}",
                h.hold_id,
                h.status,
                end.verb()
            )),
        );
    }
    Err(body)
}

async fn settle_hold(
    be: web::Data<Backend>,
    path: web::Path<(String, String)>,
    end: Option<HoldEnd>,
) -> HttpResponse {
    let (shop, hold_id) = path.into_inner();
    let (shop, hold_id) = match (segment(&shop, "shop"), segment(&hold_id, "hold_id")) {
        (Ok(s), Ok(h)) => (s, h),
        (Err(e), _) | (_, Err(e)) => return e.response(),
    };
    match (be.settle(&shop, &hold_id, end).await, end) {
        (Ok(Some(h)), Some(end)) => match end_answer(&h, end) {
            Ok(body) => HttpResponse::Ok().json(body),
            Err(body) => HttpResponse::Conflict().json(body),
        },
        (Ok(Some(h)), None) => HttpResponse::Ok().json(h.body()),
        (Ok(None), _) => no_hold(&shop, &hold_id),
        (Err(e), _) => unavailable(e),
    }
}

async fn get_hold(be: web::Data<Backend>, path: web::Path<(String, String)>) -> HttpResponse {
    settle_hold(be, path, None).await
}

async fn confirm_hold(be: web::Data<Backend>, path: web::Path<(String, String)>) -> HttpResponse {
    settle_hold(be, path, Some(HoldEnd::Confirm)).await
}

async fn cancel_hold(be: web::Data<Backend>, path: web::Path<(String, String)>) -> HttpResponse {
    settle_hold(be, path, Some(HoldEnd::Cancel)).await
}

/// A backend without orders (postgres-row): answered `501`, which tells the load
/// generator, rather than a `503` it would retry.
#[derive(Debug)]
struct NotImplemented;

impl std::fmt::Display for NotImplemented {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("this peer does not implement orders (bench/README.md says why)")
    }
}

impl std::error::Error for NotImplemented {}

fn not_implemented() -> HttpResponse {
    HttpResponse::NotImplemented()
        .json(json!({ "error": "not_implemented", "detail": NotImplemented.to_string() }))
}

async fn post_order(
    be: web::Data<Backend>,
    path: web::Path<String>,
    body: web::Bytes,
) -> HttpResponse {
    let (shop, req) =
        match segment(&path, "shop").and_then(|s| Ok((s, order_request(&parse_body(&body)?)?))) {
            Ok(p) => p,
            Err(e) => return e.response(),
        };
    match be.order(&shop, &req).await {
        Ok(Some(o)) => HttpResponse::Ok().json(o.body()),
        Ok(None) => not_implemented(),
        Err(e) => unavailable(e),
    }
}

/// Confirm, cancel or read of an order, with the answers of holds: the same ending
/// again is a 200, another one a 409 with the order's state.
async fn settle_order(
    be: web::Data<Backend>,
    path: web::Path<(String, String)>,
    end: Option<HoldEnd>,
) -> HttpResponse {
    let (shop, order_id) = path.into_inner();
    let (shop, order_id) = match (segment(&shop, "shop"), segment(&order_id, "order_id")) {
        (Ok(s), Ok(o)) => (s, o),
        (Err(e), _) | (_, Err(e)) => return e.response(),
    };
    match be.settle_order(&shop, &order_id, end).await {
        Ok(Some(o)) => match end {
            Some(end) if o.status != end.order_state() => {
                let mut body = o.body();
                if let Value::Object(m) = &mut body {
                    m.insert("error".into(), json!("conflict"));
                    m.insert(
                        "detail".into(),
                        json!(format!(
                            "order_id: order {order_id} is {}, it cannot be {}",
                            o.status,
                            end.verb()
                        )),
                    );
                }
                HttpResponse::Conflict().json(body)
            }
            _ => HttpResponse::Ok().json(o.body()),
        },
        Ok(None) => HttpResponse::NotFound().json(json!({
            "error": "not_found", "detail": format!("order_id: no order {order_id} in shop {shop}")
        })),
        Err(e) if e.is::<NotImplemented>() => not_implemented(),
        Err(e) => unavailable(e),
    }
}

async fn get_order(be: web::Data<Backend>, path: web::Path<(String, String)>) -> HttpResponse {
    settle_order(be, path, None).await
}

async fn confirm_order(be: web::Data<Backend>, path: web::Path<(String, String)>) -> HttpResponse {
    settle_order(be, path, Some(HoldEnd::Confirm)).await
}

async fn cancel_order(be: web::Data<Backend>, path: web::Path<(String, String)>) -> HttpResponse {
    settle_order(be, path, Some(HoldEnd::Cancel)).await
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
            .route("/v1/shops/{shop}/holds", web::post().to(post_hold))
            .route("/v1/shops/{shop}/holds/{hold_id}", web::get().to(get_hold))
            .route(
                "/v1/shops/{shop}/holds/{hold_id}/confirm",
                web::post().to(confirm_hold),
            )
            .route(
                "/v1/shops/{shop}/holds/{hold_id}/cancel",
                web::post().to(cancel_hold),
            )
            .route("/v1/shops/{shop}/orders", web::post().to(post_order))
            .route(
                "/v1/shops/{shop}/orders/{order_id}",
                web::get().to(get_order),
            )
            .route(
                "/v1/shops/{shop}/orders/{order_id}/confirm",
                web::post().to(confirm_order),
            )
            .route(
                "/v1/shops/{shop}/orders/{order_id}/cancel",
                web::post().to(cancel_order),
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

    #[test]
    fn hold_validation_names_the_field() {
        let e = |v: Value| hold_request(&v).err().map(|e| e.0).unwrap_or_default();
        let ok = json!({"item":"a","qty":2,"ttl_ms":1000,"request_id":"h"});
        let h = hold_request(&ok).ok().unwrap();
        assert_eq!(
            (h.hold_id.as_str(), h.item.as_str(), h.qty, h.ttl_ms),
            ("h", "a", 2, 1000)
        );
        assert!(e(json!({"item":"a","qty":2,"ttl_ms":1000})).starts_with("request_id: required"));
        assert!(
            e(json!({"item":"a","qty":2,"ttl_ms":1000,"request_id":"~h"}))
                .starts_with("request_id: must not start with '~'")
        );
        assert_eq!(
            e(json!({"item":"a","qty":2,"ttl_ms":0,"request_id":"h"})),
            "ttl_ms: must be at least 1, got 0"
        );
        assert!(
            e(json!({"item":"a","qty":2,"ttl_ms":HOLD_TTL_MAX_MS + 1,"request_id":"h"}))
                .starts_with("ttl_ms: must be at most")
        );
        assert!(e(json!({"item":"a","ttl_ms":1,"request_id":"h"})).starts_with("qty: required"));
        assert!(e(json!({"qty":1,"ttl_ms":1,"request_id":"h"})).starts_with("item: required"));
    }

    #[test]
    fn order_validation_names_the_field() {
        let e = |v: Value| order_request(&v).err().map(|e| e.0).unwrap_or_default();
        let ok = json!({"order_id":"o","lines":[{"item":"a","qty":1},{"item":"b","qty":2}],"ttl_ms":1000});
        let o = order_request(&ok).ok().unwrap();
        assert_eq!(o.lines, [("a".to_string(), 1), ("b".to_string(), 2)]);
        assert!(
            e(json!({"lines":[{"item":"a","qty":1}],"ttl_ms":1})).starts_with("order_id: required")
        );
        assert!(e(json!({"order_id":"o","lines":[],"ttl_ms":1})).starts_with("lines: 1 to 100"));
        assert_eq!(
            e(
                json!({"order_id":"o","lines":[{"item":"a","qty":1},{"item":"a","qty":1}],"ttl_ms":1})
            ),
            "lines[1].item: a is already line 0; an order names each item once"
        );
        assert!(
            e(json!({"order_id":"o","lines":[{"item":"a","qty":0}],"ttl_ms":1}))
                .starts_with("lines[0].qty: must be at least 1")
        );
        assert!(e(json!({"order_id":"o","lines":[{"item":"a","qty":1}]}))
            .starts_with("ttl_ms: required"));
    }

    #[test]
    fn order_bodies_have_nrtxn_fields() {
        let o = Order {
            order_id: "o".into(),
            status: "insufficient_stock".into(),
            lines: vec![("a".into(), 1), ("b".into(), 1)],
            expires_at: None,
            failed_line: Some(1),
        };
        let b = o.body();
        assert_eq!(b["failed_line"], 1);
        assert_eq!(b["lines"][1]["status"], "not_held");
        let b = Order {
            status: "cancelled".into(),
            failed_line: None,
            ..o
        }
        .body();
        assert!(b.get("failed_line").is_none());
        assert_eq!(
            (b["status"].as_str(), b["lines"][0]["status"].as_str()),
            (Some("cancelled"), Some("released"))
        );
    }

    fn hold(status: &str) -> Hold {
        Hold {
            hold_id: "h1".into(),
            status: status.into(),
            item: "sku".into(),
            qty: 3,
            expires_at: Some(1700),
            stock_before: None,
        }
    }

    #[test]
    fn hold_bodies_have_nrtxn_fields() {
        let keys = |v: &Value| {
            let mut k: Vec<String> = v.as_object().unwrap().keys().cloned().collect();
            k.sort();
            k
        };
        let fields = ["expires_at", "hold_id", "item", "qty", "seq", "status"];
        let v = |b: HoldBody| serde_json::to_value(b).unwrap();
        assert_eq!(keys(&v(hold("held").body())), fields);
        assert_eq!(v(hold("expired").body())["status"], "expired");
        // nrtxn's order of fields, for a reader comparing answers side by side.
        assert!(serde_json::to_string(&hold("held").body())
            .unwrap()
            .starts_with(r#"{"hold_id":"h1","status":"held","item":"sku","qty":3,"#));
        // A repeated hold answers its outcome, held, whatever became of it since.
        let o = v(hold("confirmed").outcome_body("s"));
        assert_eq!(keys(&o), fields);
        assert_eq!(
            (o["status"].as_str(), o["expires_at"].as_i64()),
            (Some("held"), Some(1700))
        );
        let refused = Hold {
            expires_at: None,
            stock_before: Some(2),
            ..hold("insufficient_stock")
        };
        let o = v(refused.outcome_body("s"));
        assert_eq!(o["reason"], "requested 3, available 2");
        assert!(o["expires_at"].is_null() && o["seq"].is_null());
        let o = v(hold("unknown_item").outcome_body("s"));
        assert_eq!(o["reason"], "no item sku in shop s");
    }

    #[test]
    fn an_ending_is_answered_again_and_a_different_one_conflicts() {
        assert_eq!(
            end_answer(&hold("confirmed"), HoldEnd::Confirm)
                .ok()
                .unwrap()
                .status,
            "confirmed"
        );
        assert_eq!(
            end_answer(&hold("released"), HoldEnd::Cancel)
                .ok()
                .unwrap()
                .status,
            "released"
        );
        let c = end_answer(&hold("expired"), HoldEnd::Confirm)
            .err()
            .unwrap();
        assert_eq!(
            (c["status"].as_str(), c["error"].as_str()),
            (Some("expired"), Some("conflict"))
        );
        assert_eq!(
            c["detail"],
            "hold_id: hold h1 is expired, it cannot be confirmed"
        );
        let c = end_answer(&hold("confirmed"), HoldEnd::Cancel)
            .err()
            .unwrap();
        assert_eq!(
            c["detail"],
            "hold_id: hold h1 is confirmed, it cannot be cancelled"
        );
        assert_eq!(
            (c["qty"].as_i64(), c["item"].as_str()),
            (Some(3), Some("sku"))
        );
    }
}
