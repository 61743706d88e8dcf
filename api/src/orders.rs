//! `POST /v1/shops/{shop}/orders`, `POST .../orders/{order_id}/confirm`,
//! `POST .../orders/{order_id}/cancel`, `GET .../orders/{order_id}`.
//!
//! An order reserves all its lines or none, and its endings end every line together
//! ([`nrtxn_actors::orders`]). Its `order_id` is its key, in the key space of holds and
//! transactions: a key first used by either is 409 `key_reused` here.

use std::collections::HashMap;
use std::sync::Arc;

use actix_web::{web, HttpRequest, HttpResponse};
use nrtxn_actors::orders::{Ended, NewOrder, OrderLine, Placed, ORDER_LINES_MAX};
use nrtxn_actors::{EngineError, Op, HOLD_TTL_MAX_MS, QTY_MAX};
use serde_json::Value;

use crate::error::ApiError;
use crate::validate::{integer, json_object, name, path_segment, required_name};
use crate::AppState;

/// Largest body of an order: 100 lines of two short fields, and the order's own.
pub const ORDER_BODY_MAX: usize = 64 * 1024;

/// The order's lines, validated: 1 to [`ORDER_LINES_MAX`] objects of `item` and `qty`,
/// items distinct.
fn lines(body: &serde_json::Map<String, Value>) -> Result<Vec<OrderLine>, ApiError> {
    let Some(Value::Array(raw)) = body.get("lines") else {
        return Err(ApiError::invalid(
            "lines: required, an array of {\"item\", \"qty\"}",
        ));
    };
    if raw.is_empty() || raw.len() > ORDER_LINES_MAX {
        return Err(ApiError::invalid(format!(
            "lines: {} lines; an order has 1 to {ORDER_LINES_MAX}",
            raw.len()
        )));
    }
    let mut seen: HashMap<Arc<str>, usize> = HashMap::with_capacity(raw.len());
    let mut out = Vec::with_capacity(raw.len());
    for (i, line) in raw.iter().enumerate() {
        let at = format!("lines[{i}].");
        let Value::Object(obj) = line else {
            return Err(ApiError::invalid(format!(
                "lines[{i}]: must be a JSON object"
            )));
        };
        let item = required_name(obj, "item", &at)?;
        let qty = integer(obj, "qty", &at, 1, QTY_MAX)?;
        if let Some(first) = seen.insert(item.clone(), i) {
            return Err(ApiError::invalid(format!(
                "lines[{i}].item: {item} is already line {first}; an order names each item once"
            )));
        }
        out.push(OrderLine { item, qty });
    }
    Ok(out)
}

pub async fn post_order(
    state: web::Data<AppState>,
    path: web::Path<String>,
    http: HttpRequest,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    let shop = path_segment(&path, "shop")?;
    let body = json_object(&http, payload, ORDER_BODY_MAX).await?;
    crate::openapi::known_fields("OrderRequest", &body)?;
    let order_id = name(&body, "order_id", "")?.ok_or_else(|| {
        ApiError::invalid("order_id: required (it makes the order idempotent and is its id)")
    })?;
    crate::trace::record_key(&order_id);
    if order_id.starts_with('~') {
        return Err(ApiError::invalid(
            "order_id: must not start with '~' (reserved)",
        ));
    }
    let lines = lines(&body)?;
    crate::auth::charge_work(&http, &shop, lines.len())?;
    let ttl_ms = integer(&body, "ttl_ms", "", 1, HOLD_TTL_MAX_MS)?;
    let buyer = name(&body, "buyer", "")?;
    let order = NewOrder {
        order_id,
        lines,
        ttl_ms,
        buyer,
    };
    // The order is driven to its end on its own task: a caller that goes away mid-way
    // leaves no line held.
    let engine = state.engine.clone();
    let placed = actix_web::rt::spawn(async move { engine.place_order(&shop, order).await })
        .await
        .map_err(|_| ApiError::from(EngineError::ShuttingDown))?;
    match placed {
        Ok(Placed::Answer(view)) => Ok(HttpResponse::Ok().json(view)),
        Ok(Placed::Reused(diff, first)) => Err(ApiError::KeyReused(
            format!("order_id: {} was first used with {diff}", first.request_key),
            serde_json::to_value(&*first).unwrap_or(Value::Null),
        )),
        Err(EngineError::Timeout) => Err(ApiError::Timeout(
            "order_id: the order is still being reserved; GET it, or send it again with \
             the same order_id"
                .into(),
        )),
        Err(e) => Err(e.into()),
    }
}

pub async fn confirm_order(
    state: web::Data<AppState>,
    path: web::Path<(String, String)>,
) -> Result<HttpResponse, ApiError> {
    end_order(state, path, Op::Confirm).await
}

pub async fn cancel_order(
    state: web::Data<AppState>,
    path: web::Path<(String, String)>,
) -> Result<HttpResponse, ApiError> {
    end_order(state, path, Op::Release).await
}

async fn end_order(
    state: web::Data<AppState>,
    path: web::Path<(String, String)>,
    op: Op,
) -> Result<HttpResponse, ApiError> {
    let (shop, order_id) = path.into_inner();
    let shop = path_segment(&shop, "shop")?;
    let order_id = path_segment(&order_id, "order_id")?;
    let engine = state.engine.clone();
    let (s, id) = (shop.clone(), order_id.clone());
    let ended = actix_web::rt::spawn(async move { engine.end_order(&s, &id, op).await })
        .await
        .map_err(|_| ApiError::from(EngineError::ShuttingDown))?;
    let (view, ended_by) = match ended {
        Ok(Ended::Order { view, op }) => (view, op),
        Ok(Ended::Unknown) => {
            return Err(ApiError::NotFound(format!(
                "order_id: no order {order_id} in shop {shop}"
            )))
        }
        Err(EngineError::Timeout) => {
            return Err(ApiError::Timeout(format!(
                "order_id: the ending of {order_id} is still on its way; GET the order"
            )))
        }
        Err(e) => return Err(e.into()),
    };
    if ended_by == op {
        // This ending, or the same ending asked for again.
        return Ok(HttpResponse::Ok().json(view));
    }
    Err(ApiError::ending_conflict(
        "order_id",
        "order",
        &order_id,
        &view.status,
        op,
        serde_json::to_value(&view).unwrap_or(Value::Null),
    ))
}

/// `POST .../orders/{order_id}/extend` `{"ttl_ms"}`: the held order, its record and
/// every line with their new expiry; 409 with its state when it is no longer held, 404
/// for no order.
pub async fn extend_order(
    state: web::Data<AppState>,
    path: web::Path<(String, String)>,
    http: HttpRequest,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    let (shop, order_id) = path.into_inner();
    let shop = path_segment(&shop, "shop")?;
    let order_id = path_segment(&order_id, "order_id")?;
    let ttl_ms = crate::holds::extension_ttl(&http, payload).await?;
    let engine = state.engine.clone();
    let (s, id) = (shop.clone(), order_id.clone());
    // Spawned, as an ending is: its several writes finish even if the caller goes.
    let extended = actix_web::rt::spawn(async move { engine.extend_order(&s, &id, ttl_ms).await })
        .await
        .map_err(|_| ApiError::from(EngineError::ShuttingDown))??;
    let unknown = format!("order_id: no order {order_id} in shop {shop}");
    crate::holds::extension_answer(extended, "order_id", unknown)
}

/// Most orders a listing answers at once: each is read with its lines.
pub const ORDERS_LIMIT_MAX: usize = 100;

/// `GET /v1/shops/{shop}/orders?buyer=&state=&after=&limit=`: the shop's orders as
/// `GET .../orders/{order_id}` shows them, in order id order, paged (`next` is the
/// `after` of the next page, `null` at the end).
pub async fn list_orders(
    state: web::Data<AppState>,
    path: web::Path<String>,
    query: web::Query<Vec<(String, String)>>,
) -> Result<HttpResponse, ApiError> {
    let shop = path_segment(&path, "shop")?;
    let l = crate::holds::listing(query.into_inner(), true, ORDERS_LIMIT_MAX)?;
    let (records, next) = state
        .engine
        .hold_page(&shop, l.query, l.after, l.limit)
        .await?;
    let mut orders = Vec::with_capacity(records.len());
    for record in &records {
        if let Some(view) = state.engine.order(&shop, &record.hold_id).await? {
            if l.state.as_deref().is_none_or(|s| s == view.status) {
                orders.push(view);
            }
        }
    }
    Ok(HttpResponse::Ok().json(serde_json::json!({ "orders": orders, "next": next })))
}

pub async fn get_order(
    state: web::Data<AppState>,
    path: web::Path<(String, String)>,
) -> Result<HttpResponse, ApiError> {
    let (shop, order_id) = path.into_inner();
    let shop = path_segment(&shop, "shop")?;
    let order_id = path_segment(&order_id, "order_id")?;
    match state.engine.order(&shop, &order_id).await? {
        Some(view) => Ok(HttpResponse::Ok().json(view)),
        None => Err(ApiError::NotFound(format!(
            "order_id: no order {order_id} in shop {shop}"
        ))),
    }
}
