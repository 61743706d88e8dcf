//! `PUT /v1/shops/{shop}/items` (operators load stock), `GET .../items` (a page of the
//! shop's items) and `GET .../items/{item}`.

use std::collections::HashSet;
use std::sync::Arc;

use actix_web::{web, HttpRequest, HttpResponse};
use nrtxn_actors::engine::{load_view, LoadEntry};
use nrtxn_actors::{
    EngineError, ItemView, LoadTerms, Status, ITEMS_LIMIT_MAX, LOAD_ITEMS_MAX, QTY_MAX, STOCK_MAX,
};
use serde_json::{json, Value};

use crate::error::ApiError;
use crate::validate::{array, integer, json_object, path_segment, request_id, required_name};
use crate::AppState;

/// Largest body of a load: 10,000 items of up to about 300 bytes each.
pub const LOAD_BODY_MAX: usize = 4 * 1024 * 1024;

pub async fn put_items(
    state: web::Data<AppState>,
    path: web::Path<String>,
    http: HttpRequest,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    let shop = path_segment(&path, "shop")?;
    let body = json_object(&http, payload, LOAD_BODY_MAX).await?;
    crate::openapi::known_fields("Load", &body)?;
    let entries = array(&body, "items", LOAD_ITEMS_MAX)?;
    crate::auth::charge_work(&http, &shop, entries.len())?;
    let mut seen: HashSet<Arc<str>> = HashSet::with_capacity(entries.len());
    let mut items = Vec::with_capacity(entries.len());
    for (i, v) in entries.iter().enumerate() {
        let prefix = format!("items[{i}].");
        let Value::Object(obj) = v else {
            return Err(ApiError::invalid(format!(
                "items[{i}]: must be a JSON object"
            )));
        };
        let item = required_name(obj, "item", &prefix)?;
        let stock = integer(obj, "stock", &prefix, 0, STOCK_MAX)?;
        // A conditional load: only if the item is still at this seq (0: not loaded yet).
        let if_seq = match obj.get("if_seq") {
            None | Some(Value::Null) => None,
            Some(_) => Some(integer(obj, "if_seq", &prefix, 0, i64::MAX)? as u64),
        };
        // A per-buyer limit: at most this many units per buyer (0 lifts the limit).
        let per_buyer_max = match obj.get("per_buyer_max") {
            None | Some(Value::Null) => None,
            Some(_) => Some(integer(obj, "per_buyer_max", &prefix, 0, QTY_MAX)?),
        };
        let terms = terms_of(obj, &prefix)?;
        if !seen.insert(item.clone()) {
            return Err(ApiError::invalid(format!(
                "items[{i}].item: {item} appears more than once"
            )));
        }
        items.push(LoadEntry {
            item,
            stock,
            if_seq,
            per_buyer_max,
            terms,
        });
    }
    let Some(id) = request_id(&body, "")? else {
        let loaded = state.engine.load_entries(&shop, items).await?;
        let views: Vec<Value> = loaded.iter().map(|(v, s)| load_answer(v, *s)).collect();
        return Ok(HttpResponse::Ok().json(json!({ "items": views })));
    };
    crate::trace::record_key(&id);
    // With a request_id the load is done at most once: a retry is answered with what the
    // first did (stock sold since is not reset), and a 504 can be polled.
    let decided = match state.engine.load_once(&shop, &id, items).await {
        Err(EngineError::Timeout) => {
            return Ok(HttpResponse::GatewayTimeout()
                .json(json!({ "request_id": &*id, "status": "pending" })))
        }
        other => other?,
    };
    let views: Vec<Value> = decided
        .iter()
        .map(|(_, o)| load_answer(&load_view(&shop, o), o.status))
        .collect();
    for (i, (req, outcome)) in decided.iter().enumerate() {
        if let Some(diff) = req.reuse_conflict(outcome) {
            return Err(ApiError::KeyReused(
                format!("request_id: {id} was first used with items[{i}] {diff}"),
                json!({ "items": views }),
            ));
        }
    }
    Ok(HttpResponse::Ok().json(json!({ "request_id": &*id, "items": views })))
}

/// Latest sale window bound a load may set: the last millisecond of the year 9999.
const WINDOW_BOUND_MAX: i64 = 253_402_300_799_999;

/// What a load entry sets of its item's terms: each of `opens_at`, `closes_at` and
/// `low_stock_at` left out keeps it (`None`), `null` clears it (`Some(0)`), else sets it.
fn terms_of(obj: &serde_json::Map<String, Value>, prefix: &str) -> Result<LoadTerms, ApiError> {
    let set = |field: &str, max: i64| match obj.get(field) {
        None => Ok(None),
        Some(Value::Null) => Ok(Some(0)),
        Some(_) => integer(obj, field, prefix, 1, max).map(Some),
    };
    let terms = LoadTerms {
        opens_at: set("opens_at", WINDOW_BOUND_MAX)?,
        closes_at: set("closes_at", WINDOW_BOUND_MAX)?,
        low_stock_at: set("low_stock_at", STOCK_MAX)?,
    };
    if let (Some(opens), Some(closes)) = (terms.opens_at, terms.closes_at) {
        if opens > 0 && closes > 0 && closes <= opens {
            return Err(ApiError::invalid(format!(
                "{prefix}closes_at: must be after opens_at ({opens}), got {closes}"
            )));
        }
    }
    Ok(terms)
}

/// One item of a load's answer: its state, and `status` `ok`, or `seq_moved` when the
/// entry's `if_seq` no longer held (the item unchanged, at the state shown).
fn load_answer(view: &ItemView, status: Status) -> Value {
    let mut v = json!(view);
    v["status"] = json!(status.as_str());
    v
}

/// `GET /v1/shops/{shop}/loads/{request_id}`: a load made with a `request_id`, as far as
/// it is decided: `200` with its items when none is in flight, `202` (`pending`, with the
/// items decided so far) while one is, `404` when none of it is known.
pub async fn get_load(
    state: web::Data<AppState>,
    path: web::Path<(String, String)>,
) -> Result<HttpResponse, ApiError> {
    let (shop, id) = path.into_inner();
    let shop = path_segment(&shop, "shop")?;
    let id = path_segment(&id, "request_id")?;
    let (decided, pending) = state.engine.poll_load(&shop, &id).await?;
    if decided.is_empty() && !pending {
        return Err(ApiError::NotFound(format!(
            "request_id: no load {id} in shop {shop}"
        )));
    }
    let views: Vec<Value> = decided
        .iter()
        .map(|o| load_answer(&load_view(&shop, o), o.status))
        .collect();
    let body = json!({
        "request_id": &*id,
        "status": if pending { "pending" } else { "done" },
        "items": views,
    });
    Ok(if pending {
        HttpResponse::Accepted().json(body)
    } else {
        HttpResponse::Ok().json(body)
    })
}

/// Items per page when `limit` is not given.
const ITEMS_LIMIT_DEFAULT: usize = 100;

/// `GET /v1/shops/{shop}/items?after=ITEM&limit=N`: the shop's items as durable, in name
/// order (bytewise), `limit` (1 to [`ITEMS_LIMIT_MAX`], default 100) after `after`, and
/// `next`, the `after` of the next page (`null` on the last). Internal pseudo-items
/// (names starting with `~`) are not listed.
pub async fn list_items(
    state: web::Data<AppState>,
    path: web::Path<String>,
    query: web::Query<Vec<(String, String)>>,
) -> Result<HttpResponse, ApiError> {
    let shop = path_segment(&path, "shop")?;
    let (mut after, mut limit) = (None, ITEMS_LIMIT_DEFAULT);
    for (k, v) in query.into_inner() {
        match k.as_str() {
            // `?after=` (empty): from the first item, as without it.
            "after" if v.is_empty() => after = None,
            "after" => after = Some(path_segment(&v, "after")?),
            "limit" => limit = crate::validate::limit_param(&v, ITEMS_LIMIT_MAX)?,
            other => {
                return Err(ApiError::invalid(format!(
                    "{other}: unknown parameter (after, limit)"
                )))
            }
        }
    }
    let (items, next) = state.engine.items(&shop, after, limit).await?;
    Ok(HttpResponse::Ok().json(json!({ "items": items, "next": next })))
}

pub async fn get_item(
    state: web::Data<AppState>,
    path: web::Path<(String, String)>,
) -> Result<HttpResponse, ApiError> {
    let (shop, item) = path.into_inner();
    let shop = path_segment(&shop, "shop")?;
    let item = path_segment(&item, "item")?;
    match state.engine.item(&shop, &item).await? {
        Some(view) => Ok(HttpResponse::Ok().json(view)),
        None => Err(ApiError::NotFound(format!(
            "item: no item {item} in shop {shop}"
        ))),
    }
}

/// Largest body of a release of an item's holds: its `request_id`.
pub const RELEASE_BODY_MAX: usize = 1024;

/// `POST /v1/shops/{shop}/items/{item}/release-holds` with `{"request_id"}`: releases
/// every pending hold of the item and cancels every held order with a line on it
/// ([`nrtxn_actors::release`]), at most once per `request_id`; answers the counts.
pub async fn release_holds(
    state: web::Data<AppState>,
    path: web::Path<(String, String)>,
    http: HttpRequest,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    let (shop, item) = path.into_inner();
    let shop = path_segment(&shop, "shop")?;
    let item = path_segment(&item, "item")?;
    let body = json_object(&http, payload, RELEASE_BODY_MAX).await?;
    crate::openapi::known_fields("ReleaseHolds", &body)?;
    let Some(id) = request_id(&body, "")? else {
        return Err(ApiError::invalid(
            "request_id: required (a release is done at most once per request_id)",
        ));
    };
    crate::trace::record_key(&id);
    let done = match state.engine.release_holds(&shop, &item, id.clone()).await {
        Err(EngineError::Timeout) => {
            return Ok(HttpResponse::GatewayTimeout()
                .json(json!({ "request_id": &*id, "status": "pending" })))
        }
        other => other?,
    };
    let o = &done.outcome;
    if o.op != nrtxn_actors::Op::ReleaseHolds {
        return Err(ApiError::KeyReused(
            format!(
                "request_id: {id} was first used by a {} of item {}",
                o.op.as_str(),
                o.item
            ),
            json!(o),
        ));
    }
    Ok(HttpResponse::Ok().json(json!({
        "request_id": &*id,
        "item": &*o.item,
        "status": o.status.as_str(),
        "holds_released": done.holds,
        "orders_cancelled": done.orders,
        "seq": o.seq,
        "completed_at": o.completed_at,
    })))
}
