//! The OpenAPI 3 contract, `GET /openapi.json`, generated from the route table
//! ([`crate::ROUTES`]): every route's path, method, parameters and role come from it; the
//! bodies' schemas are written here, one per operation. `GET /docs` is a page of the
//! operations, embedded in the binary (no CDN), rendered from the same document.

use std::sync::OnceLock;

use actix_web::HttpResponse;
use serde_json::{json, Map, Value};

use crate::auth::{Role, SHOP_ROUTES};
use crate::error::ApiError;
use crate::ROUTES;

/// The document, made once.
pub fn document() -> &'static Value {
    static DOC: OnceLock<Value> = OnceLock::new();
    DOC.get_or_init(build)
}

/// Refuses a request body with a field its schema in the contract does not name, at any
/// depth (a load's entry, a batch's transaction), with a `400` that names the field by its
/// path and the fields the body takes. Why the contract: it is what clients (the CLI, the
/// dashboard, generated clients) are written against, so the server and the contract
/// cannot drift apart. A misspelt guard must not be ignored without a word:
/// `{"item":"x","stock":100,"if_sq":1}` would otherwise load 100 unguarded.
pub fn known_fields(schema: &str, body: &Map<String, Value>) -> Result<(), ApiError> {
    let schemas = &document()["components"]["schemas"];
    let Some((mut path, takes)) = unknown_in_object(schemas, &schemas[schema], body) else {
        return Ok(());
    };
    // Built only for the answer: a batch of 1,000 entries walks without allocating.
    path.reverse();
    let mut named = String::new();
    for step in &path {
        match step {
            Step::Field(f) if named.is_empty() => named.push_str(f),
            Step::Field(f) => {
                named.push('.');
                named.push_str(f);
            }
            Step::Index(i) => named.push_str(&format!("[{i}]")),
        }
    }
    Err(ApiError::invalid(format!(
        "{named}: unknown field ({} takes {})",
        if path.len() == 1 {
            "the body"
        } else {
            "this entry"
        },
        takes.join(", ")
    )))
}

/// A step of the path to an unknown field, innermost first as the walk unwinds.
enum Step<'a> {
    Field(&'a str),
    Index(usize),
}

/// An unknown field of `body` (the path to it, and the fields its object takes), if any.
type Unknown<'a> = Option<(Vec<Step<'a>>, Vec<&'a str>)>;

fn unknown_in_object<'a>(
    schemas: &'a Value,
    schema: &'a Value,
    body: &'a Map<String, Value>,
) -> Unknown<'a> {
    let properties = schema["properties"].as_object()?;
    let closed = schema["additionalProperties"] == Value::Bool(false);
    for (field, value) in body {
        match properties.get(field) {
            Some(inner) => {
                if let Some((mut path, takes)) = unknown_in_value(schemas, inner, value) {
                    path.push(Step::Field(field));
                    return Some((path, takes));
                }
            }
            None if closed => {
                let takes = properties.keys().map(String::as_str).collect();
                return Some((vec![Step::Field(field)], takes));
            }
            None => {}
        }
    }
    None
}

fn unknown_in_value<'a>(schemas: &'a Value, schema: &'a Value, value: &'a Value) -> Unknown<'a> {
    // A `$ref` names a schema of `components`.
    let schema = match schema["$ref"].as_str().and_then(|r| r.rsplit('/').next()) {
        Some(name) => &schemas[name],
        None => schema,
    };
    match value {
        Value::Object(m) => unknown_in_object(schemas, schema, m),
        Value::Array(items) => {
            let each = schema.get("items")?;
            items.iter().enumerate().find_map(|(i, v)| {
                let (mut path, takes) = unknown_in_value(schemas, each, v)?;
                path.push(Step::Index(i));
                Some((path, takes))
            })
        }
        _ => None,
    }
}

pub async fn serve_json() -> HttpResponse {
    HttpResponse::Ok()
        .insert_header((actix_web::http::header::X_CONTENT_TYPE_OPTIONS, "nosniff"))
        .json(document())
}

/// `GET /docs`: a page of the operations of `/openapi.json`, grouped by path, with their
/// role and bodies' schemas. Its script and style are files of their own so that the
/// page runs under the dashboard's Content-Security-Policy (no inline script).
pub async fn serve_docs() -> HttpResponse {
    crate::dashboard::asset("text/html; charset=utf-8", DOCS_PAGE)
}

pub async fn serve_docs_script() -> HttpResponse {
    crate::dashboard::asset("text/javascript; charset=utf-8", DOCS_SCRIPT)
}

pub async fn serve_docs_style() -> HttpResponse {
    crate::dashboard::asset("text/css; charset=utf-8", DOCS_STYLE)
}

const DOCS_PAGE: &str = include_str!("../assets/docs.html");
const DOCS_SCRIPT: &str = include_str!("../assets/docs.js");
const DOCS_STYLE: &str = include_str!("../assets/docs.css");

/// The role a route needs, as the access-key gate reads [`SHOP_ROUTES`].
fn role_of(method: &str, path: &str) -> &'static str {
    match path {
        "/healthz" | "/readyz" => return "open",
        "/metrics" => return "admin",
        "/v1/whoami" => return "any key",
        _ => {}
    }
    let rest = path.strip_prefix("/v1/shops/{shop}/").unwrap_or(path);
    let m = method.to_ascii_uppercase();
    let role = SHOP_ROUTES.iter().find_map(|(rm, rp, role)| {
        let same = *rm == m
            && rp.split('/').count() == rest.split('/').count()
            && rp
                .split('/')
                .zip(rest.split('/'))
                .all(|(a, b)| a == b || (a.starts_with('{') && b.starts_with('{')));
        same.then_some(*role)
    });
    match role.unwrap_or(Role::Operator) {
        Role::Seller => "seller",
        Role::Operator => "operator",
        Role::Admin => "admin",
    }
}

/// A name (shop, item, key...): 1 to 128 bytes, no `/` and no control character. The
/// schema says at most 32 characters, which 128 bytes always hold (a character is at
/// most 4 bytes of UTF-8): whatever the schema admits, the server takes.
fn name_schema() -> Value {
    json!({ "type": "string", "minLength": 1, "maxLength": 32,
            "pattern": "^[^/\\u0000-\\u001f\\u007f-\\u009f]+$",
            "description": "1 to 128 bytes of UTF-8, without '/' or control characters" })
}

/// A caller's key (`request_id`, `order_id`): a name that does not start with `~`
/// (nrtxn's own keys do).
fn key_schema() -> Value {
    json!({ "type": "string", "minLength": 1, "maxLength": 32,
            "pattern": "^[^~/\\u0000-\\u001f\\u007f-\\u009f][^/\\u0000-\\u001f\\u007f-\\u009f]*$",
            "description": "1 to 128 bytes of UTF-8, without '/' or control characters, not starting with '~'" })
}

/// A load's sale window bound: ms since the epoch, or `null` to clear it.
fn window_bound() -> Value {
    json!({ "type": "integer", "minimum": 1, "maximum": 253_402_300_799_999i64, "nullable": true,
            "description": "ms since the epoch; null clears the bound, leaving it out keeps it" })
}

fn schema_ref(name: &str) -> Value {
    json!({ "$ref": format!("#/components/schemas/{name}") })
}

fn body(name: &str) -> Value {
    json!({ "required": true, "content": { "application/json": { "schema": schema_ref(name) } } })
}

fn answer(description: &str, schema: Value) -> Value {
    json!({ "description": description, "content": { "application/json": { "schema": schema } } })
}

/// An operation's request body (schema name) and its 200 answer's schema.
fn bodies(id: &str) -> (Option<&'static str>, Value) {
    let r = schema_ref;
    match id {
        "healthz" | "readyz" => (None, r("Health")),
        "metrics" => (None, json!({ "type": "string" })),
        // Its 200 is text: see `build`.
        "loadItems" => (Some("Load"), r("LoadAnswer")),
        "listItems" => (None, r("ItemPage")),
        "adjustItems" => (Some("Adjustments"), r("Results")),
        "getItem" => (None, r("Item")),
        "getLoad" => (None, r("LoadAnswer")),
        "submitTxn" => (Some("Txn"), r("Outcome")),
        "submitBatch" => (Some("Batch"), r("Results")),
        "getTxn" => (None, r("Outcome")),
        "getEvents" => (None, r("Events")),
        "streamEvents" => (
            None,
            json!({ "type": "string", "description": "text/event-stream" }),
        ),
        "placeHold" => (Some("HoldRequest"), r("Hold")),
        "getHold" | "confirmHold" | "cancelHold" => (None, r("Hold")),
        "extendHold" => (Some("Extend"), r("Hold")),
        "extendOrder" => (Some("Extend"), r("Order")),
        "placeOrder" => (Some("OrderRequest"), r("Order")),
        "getOrder" | "confirmOrder" | "cancelOrder" => (None, r("Order")),
        "putSettings" => (Some("Settings"), r("SettingsAnswer")),
        "getSettings" => (None, r("SettingsAnswer")),
        "listHolds" => (None, r("HoldPage")),
        "transfer" => (Some("Transfer"), r("TransferAnswer")),
        "getTransfer" => (None, r("TransferAnswer")),
        "releaseHolds" => (Some("ReleaseHolds"), r("Released")),
        "listOrders" => (None, r("OrderPage")),
        "getDeadLetters" => (None, r("DeadLetters")),
        "getNotifications" => (None, r("Notifications")),
        "retryDeadLetter" => (None, r("DeadLetterAnswer")),
        "resolveDeadLetter" => (Some("Resolve"), r("DeadLetterAnswer")),
        "getStats" => (None, r("Stats")),
        "whoami" => (None, r("Whoami")),
        _ => (None, json!({ "type": "object" })),
    }
}

/// Query parameters of the operations that take some.
fn query(id: &str) -> Vec<Value> {
    let q = |name: &str, schema: Value, what: &str| json!({ "name": name, "in": "query", "required": false, "schema": schema, "description": what });
    match id {
        "listItems" => vec![
            q(
                "after",
                json!({ "type": "string", "maxLength": 32,
                        "pattern": "^[^/\\u0000-\\u001f\\u007f-\\u009f]*$" }),
                "the item to list after (the last one of the page before); empty or absent: from the first",
            ),
            q(
                "limit",
                json!({"type": "integer", "minimum": 1, "maximum": 1000, "default": 100}),
                "items per page",
            ),
        ],
        "getEvents" => vec![
            q(
                "after",
                json!({"type": "integer", "minimum": 0, "default": 0}),
                "the seq to read after",
            ),
            q(
                "limit",
                json!({"type": "integer", "minimum": 1, "maximum": 1000}),
                "events per page",
            ),
        ],
        "listHolds" | "listOrders" => {
            let name = json!({ "type": "string", "maxLength": 128 });
            let mut params = vec![
                q("buyer", name.clone(), "only this buyer's"),
                q(
                    "state",
                    json!({ "type": "string", "enum": ["held", "confirmed", "released", "expired", "checking"] }),
                    "only those in this state",
                ),
                q("after", name.clone(), "the id to list after (the `next` of the page before)"),
                q(
                    "limit",
                    json!({"type": "integer", "minimum": 1,
                           "maximum": if id == "listHolds" { 1000 } else { 100 }, "default": 100}),
                    "per page",
                ),
            ];
            if id == "listHolds" {
                params.insert(0, q("item", name, "only this item's"));
            }
            params
        }
        "streamEvents" => vec![q(
            "after",
            json!({"type": "string"}),
            "a cursor (an event's id) to resume after; Last-Event-ID does the same",
        )],
        _ => Vec::new(),
    }
}

fn build() -> Value {
    let mut paths = Map::new();
    for (method, path, id, summary) in ROUTES {
        let params: Vec<Value> = path
            .split('/')
            .filter_map(|seg| seg.strip_prefix('{')?.strip_suffix('}'))
            .map(|name| {
                json!({ "name": name, "in": "path", "required": true, "schema": name_schema() })
            })
            .chain(query(id))
            .collect();
        let (request, ok) = bodies(id);
        let role = role_of(method, path);
        let mut op = json!({
            "operationId": id,
            "summary": summary,
            "x-nrtxn-role": role,
            "parameters": params,
            "responses": {
                "200": answer("the answer", ok),
                "400": answer("malformed: `detail` names the field and why", schema_ref("Error")),
                "404": answer("no such shop object", schema_ref("Error")),
                "409": answer("a key first used otherwise, or an ending that conflicts", schema_ref("Error")),
                "401": answer("no access key, or one not known (when the server has keys)", schema_ref("Error")),
                "403": answer("the key may not use this route or shop", schema_ref("Error")),
                "405": answer("the path exists, not with this method", schema_ref("Error")),
                "408": answer("the body did not arrive in time", schema_ref("Error")),
                "413": answer("the body is larger than the route takes", schema_ref("Error")),
                "415": answer("a body that is not application/json", schema_ref("Error")),
                "429": answer("a bounded queue is full, or the shop's token bucket (a token per \
                    call, per batch entry, order line or loaded item) is empty; retry after \
                    Retry-After", schema_ref("Error")),
                "503": answer("shutting down, the store unavailable, the disk full, or (a \
                    stream) the node's or the shop's share of streams all open", schema_ref("Error")),
            },
        });
        if id == &"submitTxn" || id == &"submitBatch" {
            op["responses"]["202"] = answer(
                "fire-and-forget (respond=false): accepted, durable; poll the key",
                schema_ref("Accepted"),
            );
            op["responses"]["504"] = answer(
                "undecided at the reply timeout; poll the key",
                schema_ref("Error"),
            );
            op["responses"]["403"] = answer(
                "the key may not use this route or shop, or a seller key's increment names no \
                 return_of (a seller may add stock only by returning a sale)",
                schema_ref("Error"),
            );
        }
        if let Some(req) = request {
            op["requestBody"] = body(req);
        }
        match *id {
            "metrics" => {
                op["responses"]["200"] = json!({ "description": "Prometheus text exposition",
                    "content": { "text/plain": { "schema": { "type": "string" } } } });
            }
            "streamEvents" => {
                op["responses"]["200"] = json!({ "description": "server-sent events",
                    "content": { "text/event-stream": { "schema": { "type": "string" } } } });
            }
            _ => {}
        }
        if role == "open" {
            op["security"] = json!([]);
        }
        paths
            .entry(path.to_string())
            .or_insert_with(|| json!({}))
            .as_object_mut()
            .expect("a path item is an object")
            .insert(method.to_string(), op);
    }
    let mut all_schemas = schemas();
    if let Value::Object(m) = &mut all_schemas {
        m.extend(dashboard_schemas());
        m.extend(check_schemas());
    }
    json!({
        "openapi": "3.0.3",
        "info": {
            "title": "nrtxn",
            "version": env!("CARGO_PKG_VERSION"),
            "description": "Near-realtime inventory transactions: stock decrements and returns, holds, orders reserved all or none, never oversold, each request applied at most once.",
        },
        "servers": [{ "url": "/" }],
        "security": [{ "accessKey": [] }],
        "paths": paths,
        "components": {
            "securitySchemes": {
                "accessKey": { "type": "http", "scheme": "bearer", "description": "an access key: `Authorization: Bearer nrtxn_...` (see the manual, docs/src/security.md, Access keys)" }
            },
            "schemas": all_schemas,
        },
    })
}

/// The schemas of the dashboard's routes (`getStats`, `whoami`): a second `json!`, the
/// first being at the macro's recursion limit.
fn dashboard_schemas() -> Map<String, Value> {
    let s = |t: &str| json!({ "type": t });
    let Value::Object(m) = json!({
        "Stats": { "type": "object", "description": "This node's figures of the shop's decisions, one value a second",
            "properties": {
            "window_s": s("integer"), "from_ms": s("integer"),
            "decisions": { "type": "array", "items": s("integer") },
            "p99_ms": { "type": "array", "items": { "type": "integer", "nullable": true } },
            "p99_ms_window": { "type": "integer", "nullable": true },
            "totals": { "type": "object", "additionalProperties": s("number") },
            "rates_per_s": { "type": "object", "additionalProperties": s("number") },
            "refused": { "type": "array", "items": { "type": "object", "properties": {
                "at": s("integer"), "item": s("string"), "request_key": s("string"), "op": s("string"),
                "qty": s("integer"), "status": s("string"), "reason": { "type": "string", "nullable": true } } } } } },
        "Whoami": { "type": "object", "properties": {
            "keys_required": s("boolean"),
            "key": { "type": "object", "nullable": true, "properties": {
                "id": s("string"), "name": s("string"), "shop": { "type": "string", "nullable": true },
                "role": s("string") } } } },
    }) else {
        unreachable!("a JSON object literal")
    };
    m
}

fn schemas() -> Value {
    let s = |t: &str| json!({ "type": t });
    let name = name_schema;
    let qty = || json!({ "type": "integer", "minimum": 1, "maximum": 1_000_000_000i64 });
    let ttl = || json!({ "type": "integer", "minimum": 1, "maximum": 604_800_000i64 });
    // `accepted` and `pending`: an entry of a batch taken fire-and-forget, or still
    // undecided at the reply timeout.
    let status = || {
        json!({ "type": "string", "enum": ["ok", "insufficient_stock", "unknown_item", "expired",
            "limit_exceeded", "unknown_hold", "seq_moved", "buyer_limit", "return_refused",
            "not_open", "closed", "accepted", "pending"],
            "description": "return_refused: a return (an increment with return_of) whose sale is \
                unknown or not yet decided, not an ok decrement of this item, past the return \
                window, or has fewer units left to return than asked; nothing changed, and \
                reason says which" })
    };
    json!({
        "Error": { "type": "object", "required": ["error", "detail"], "properties": {
            "error": s("string"), "detail": s("string"), "original": s("object") } },
        "Health": { "type": "object" },
        "Item": { "type": "object", "properties": {
            "shop": s("string"), "item": s("string"), "stock": s("integer"),
            "reserved": s("integer"), "seq": s("integer"),
            "opens_at": { "type": "integer", "nullable": true },
            "closes_at": { "type": "integer", "nullable": true },
            "low_stock_at": { "type": "integer", "nullable": true } } },
        "ItemPage": { "type": "object", "properties": {
            "items": { "type": "array", "items": schema_ref("Item") },
            "next": { "type": "string", "nullable": true } } },
        "Load": { "type": "object", "additionalProperties": false, "required": ["items"], "properties": {
            "request_id": key_schema(),
            "items": { "type": "array", "minItems": 1, "maxItems": 10000, "items": {
                "type": "object", "additionalProperties": false, "required": ["item", "stock"], "properties": {
                    "item": name(), "stock": { "type": "integer", "minimum": 0, "maximum": 1_000_000_000_000_000i64 },
                    "if_seq": { "type": "integer", "minimum": 0 },
                    "per_buyer_max": { "type": "integer", "minimum": 0 },
                    "opens_at": window_bound(), "closes_at": window_bound(),
                    "low_stock_at": { "type": "integer", "minimum": 1, "nullable": true,
                        "description": "a low_stock alert fires when the available stock falls from above it to at or below it; null clears it, left out keeps it" } } } } } },
        "LoadAnswer": { "type": "object", "properties": {
            "items": { "type": "array", "items": schema_ref("Item") } } },
        "Adjustments": { "type": "object", "additionalProperties": false, "required": ["adjustments"], "properties": {
            "adjustments": { "type": "array", "minItems": 1, "maxItems": 1000, "items": {
                "type": "object", "additionalProperties": false, "required": ["item", "delta", "reason", "request_id"], "properties": {
                    "item": name(), "request_id": key_schema(),
                    "reason": { "type": "string", "pattern": "^[a-z0-9_-]{1,64}$",
                                "description": "restock, damage, correction, transfer, or the shop's own code" },
                    "delta": { "type": "integer", "minimum": -1_000_000_000i64, "maximum": 1_000_000_000i64,
                               "not": { "enum": [0] } } } } } } },
        "Txn": { "type": "object", "additionalProperties": false, "required": ["seller", "item", "qty"], "properties": {
            "seller": name(), "item": name(), "qty": qty(), "buyer": name(), "min_qty": qty(),
            "op": { "type": "string", "enum": ["decrement", "increment"] },
            "return_of": { "type": "string", "minLength": 1, "maxLength": 386,
                "description": "Increments only (a decrement with it is a 400): the request key \
                    of the sale this increment returns, an ok decrement of the same item in \
                    the same shop, decided within the return window (default 30 days). A \
                    seller key's increment must name it (else 403); it may return at most what \
                    the sale sold less what was returned against it already, else the answer \
                    is 200 with status return_refused and a reason" },
            "request_id": key_schema(), "req_time": name(), "respond": s("boolean"),
            "remarks": { "type": "string", "maxLength": 256 } },
            "anyOf": [ { "required": ["request_id"] }, { "required": ["req_time"] } ] },
        "Batch": { "type": "object", "additionalProperties": false, "required": ["txns"], "properties": {
            "txns": { "type": "array", "minItems": 1, "maxItems": 1000, "items": schema_ref("Txn") } } },
        "Outcome": { "type": "object", "properties": {
            "shop": s("string"), "request_key": s("string"), "status": status(),
            "reason": { "type": "string", "nullable": true }, "item": s("string"), "op": s("string"),
            "qty": s("integer"), "qty_taken": s("integer"), "stock_before": { "type": "integer", "nullable": true },
            "stock_after": { "type": "integer", "nullable": true },
            "seq": { "type": "integer", "nullable": true }, "prev_seq": { "type": "integer", "nullable": true },
            "submitted_at": s("integer"), "completed_at": s("integer"),
            "requested_at": s("integer"), "seller": s("string"), "buyer": s("string"),
            "opens_at": s("integer"), "closes_at": s("integer") } },
        "Results": { "type": "object", "properties": {
            "results": { "type": "array", "items": schema_ref("Outcome") } } },
        "Accepted": { "type": "object", "properties": {
            "request_key": s("string"), "status": s("string") } },
        "Events": { "type": "object", "properties": { "events": { "type": "array", "items": {
            "type": "object", "properties": {
                "shop": s("string"), "item": s("string"), "seq": s("integer"), "prev_seq": s("integer"),
                "kind": { "type": "string", "description": "the change's op, or a stock alert journaled right after it: sold_out, low_stock, back_in_stock" },
                "status": s("string"), "request_key": { "type": "string", "nullable": true },
                "qty": s("integer"), "qty_taken": s("integer"), "stock_after": s("integer"), "reserved_after": s("integer"),
                "at": s("integer"), "hold_id": s("string"), "reason": s("string"), "order_id": s("string"),
                "requested_at": s("integer"), "seller": s("string"), "buyer": s("string"),
                "opens_at": s("integer"), "closes_at": s("integer"), "low_stock_at": s("integer") } } } } },
        "Transfer": { "type": "object", "additionalProperties": false, "required": ["request_id", "from", "to", "qty"], "properties": {
            "request_id": key_schema(), "from": name(), "to": name(), "qty": qty(),
            "reason": { "type": "string", "pattern": "^[a-z0-9_-]{1,64}$", "description": "the operator's reason code" } } },
        "TransferAnswer": { "type": "object", "properties": {
            "request_id": s("string"), "from": s("string"), "to": s("string"), "qty": s("integer"),
            "status": { "type": "string", "description": "ok (moved), pending (under way: 202), or why nothing moved: insufficient_stock, unknown_item, ..." },
            "reason": s("string"),
            "from_seq": { "type": "integer", "nullable": true }, "to_seq": { "type": "integer", "nullable": true },
            "requested_at": s("integer") } },
        "ReleaseHolds": { "type": "object", "additionalProperties": false, "required": ["request_id"], "properties": {
            "request_id": key_schema() } },
        "Released": { "type": "object", "properties": {
            "request_id": s("string"), "item": s("string"),
            "status": { "type": "string", "description": "ok, or unknown_item (nothing released)" },
            "holds_released": s("integer"), "orders_cancelled": s("integer"),
            "seq": { "type": "integer", "nullable": true, "description": "the release's own entry in the item's sequence" },
            "completed_at": s("integer") } },
        "Extend": { "type": "object", "additionalProperties": false, "required": ["ttl_ms"], "properties": {
            "ttl_ms": ttl() } },
        "HoldRequest": { "type": "object", "additionalProperties": false, "required": ["item", "qty", "ttl_ms", "request_id"], "properties": {
            "item": name(), "qty": qty(), "ttl_ms": ttl(), "request_id": key_schema(),
            "seller": name(), "buyer": name(), "min_qty": qty() } },
        "Hold": { "type": "object", "properties": {
            "hold_id": s("string"),
            "status": { "type": "string", "enum": ["held", "checking", "confirmed", "released", "expired",
                "insufficient_stock", "unknown_item", "buyer_limit", "limit_exceeded", "not_open", "closed"] },
            "item": s("string"), "qty": s("integer"), "qty_taken": s("integer"), "expires_at": { "type": "integer", "nullable": true },
            "seq": { "type": "integer", "nullable": true }, "reason": s("string"),
            "buyer": { "type": "string", "description": "listings only: the buyer the hold was made for" } } },
        "OrderRequest": { "type": "object", "additionalProperties": false, "required": ["order_id", "lines", "ttl_ms"], "properties": {
            "order_id": key_schema(), "ttl_ms": ttl(), "buyer": name(),
            "lines": { "type": "array", "minItems": 1, "maxItems": 100, "items": {
                "type": "object", "additionalProperties": false, "required": ["item", "qty"], "properties": { "item": name(), "qty": qty() } } } } },
        "Order": { "type": "object", "properties": {
            "order_id": s("string"), "status": s("string"),
            "lines": { "type": "array", "items": { "type": "object", "properties": {
                "item": s("string"), "qty": s("integer"), "seq": { "type": "integer", "nullable": true },
                "status": s("string") } } },
            "expires_at": { "type": "integer", "nullable": true },
            "failed_line": s("integer"), "reason": s("string") } },
    })
}

/// The schemas of the check-back's routes (settings, dead letters): a third `json!`, for
/// the same reason as [`dashboard_schemas`].
fn check_schemas() -> Map<String, Value> {
    let s = |t: &str| json!({ "type": t });
    let schedule = json!({ "type": "array", "maxItems": 20, "default": [],
        "items": { "type": "integer", "minimum": 1, "maximum": 604_800_000i64 },
        "description": "waits in ms before each attempt after the first (together at most 7 days, the life of a hold); \
            while it runs the hold stays pending past expires_at, `checking`. Empty: check_retries quick retries" });
    let Value::Object(m) = json!({
        "Settings": { "type": "object", "additionalProperties": false, "description": "every field optional: one left out keeps its value", "properties": {
            "check_url": { "type": "string", "nullable": true, "maxLength": 2048,
                           "pattern": "^https?://[^/\\s\\u0000-\\u001f\\u007f-\\u009f]+(/[^\\s\\u0000-\\u001f\\u007f-\\u009f]*)?$" },
            "check_timeout_ms": { "type": "integer", "minimum": 100, "maximum": 60000, "default": 2000 },
            "check_retries": { "type": "integer", "minimum": 0, "maximum": 10, "default": 3 },
            "check_retry_schedule_ms": schedule,
            "check_default": { "type": "string", "enum": ["release", "confirm", "ask"], "default": "release",
                "description": "what applies when the shop does not answer; ask: nothing, the hold stays checking until an operator resolves its dead letter (or its 7-day life ends it as release would)" },
            "notify_url": { "type": "string", "nullable": true, "maxLength": 2048,
                            "description": "where stock alerts are POSTed, signed as check-backs are; null removes the alerts" },
            "notify_events": { "type": "array", "minItems": 1, "uniqueItems": true,
                               "items": { "type": "string", "enum": ["sold_out", "low_stock", "back_in_stock", "dead_letter"] },
                               "description": "the kinds sent; all four when left out on the first notify_url" },
            "rotate_secret": s("boolean") } },
        "SettingsAnswer": { "type": "object", "properties": {
            "shop": s("string"), "check_url": { "type": "string", "nullable": true },
            "notify_url": { "type": "string", "nullable": true },
            "notify_events": { "type": "array", "items": s("string") },
            "check_timeout_ms": s("integer"), "check_retries": s("integer"),
            "check_retry_schedule_ms": { "type": "array", "items": s("integer") },
            "check_default": s("string"),
            "check_secret": { "type": "string", "description": "shown once, when made" } } },
        "DeadLetter": { "type": "object", "properties": {
            "id": { "type": "string", "description": "the hold's or the order's id" },
            "kind": { "type": "string", "enum": ["hold", "order"] },
            "applied": { "type": "string", "enum": ["release", "confirm", "ask"],
                         "description": "the default that applied; ask: none, an operator decides" },
            "error": s("string"), "attempts": s("integer"),
            "at": { "type": "integer", "description": "when the last attempt failed (ms since the epoch)" },
            "expires_at": { "type": "integer", "description": "the expiry the shop was asked about" },
            "resolved": { "type": "object", "nullable": true, "properties": {
                "action": { "type": "string", "enum": ["confirm", "release", "extend"] },
                "by": { "type": "string", "enum": ["operator", "retry", "life_end"] },
                "at": s("integer") } } } },
        "DeadLetters": { "type": "object", "properties": {
            "shop": s("string"),
            "dead_letters": { "type": "array", "maxItems": 100, "items": schema_ref("DeadLetter"),
                              "description": "the latest 100 of the shop, oldest first" } } },
        "Alert": { "type": "object", "properties": {
            "shop": s("string"),
            "kind": { "type": "string", "enum": ["sold_out", "low_stock", "back_in_stock", "dead_letter"] },
            "item": s("string"), "stock": s("integer"), "reserved": s("integer"),
            "seq": { "type": "integer", "description": "the alert's own place in the item's sequence: a receiver drops a repeat by it" },
            "id": { "type": "string", "description": "dead_letter: the hold's or order's id" },
            "applied": { "type": "string", "description": "dead_letter: the default that applied" },
            "at": s("integer") } },
        "Notifications": { "type": "object", "properties": {
            "shop": s("string"),
            "notifications": { "type": "array", "maxItems": 100, "description": "the latest 100 alerts of the shop that failed for good, oldest first",
                "items": { "type": "object", "properties": {
                    "alert": schema_ref("Alert"), "error": s("string"),
                    "attempts": s("integer"), "at": s("integer") } } } } },
        "HoldPage": { "type": "object", "properties": {
            "holds": { "type": "array", "items": schema_ref("Hold") },
            "next": { "type": "string", "nullable": true, "description": "the after of the next page; null at the end" } } },
        "OrderPage": { "type": "object", "properties": {
            "orders": { "type": "array", "items": schema_ref("Order") },
            "next": { "type": "string", "nullable": true, "description": "the after of the next page; null at the end" } } },
        "Resolve": { "type": "object", "additionalProperties": false, "required": ["action"], "properties": {
            "action": { "type": "string", "enum": ["confirm", "release"] } } },
        "DeadLetterAnswer": { "type": "object", "properties": {
            "shop": s("string"), "dead_letter": schema_ref("DeadLetter"),
            "status": { "type": "string", "description": "the hold's or order's status after (checking while still pending past its expiry)" } } },
    }) else {
        unreachable!("a JSON object literal")
    };
    m
}
