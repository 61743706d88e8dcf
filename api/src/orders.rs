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
use serde_json::{Map, Value};

use crate::error::ApiError;
use crate::validate::{
    integer_rule, json_body, name_rule, path_segment, required, two_way, wire, Got, MapOnly,
    TwoWayBody,
};
use crate::AppState;

/// Largest body of an order: 100 lines of two short fields, and the order's own.
pub const ORDER_BODY_MAX: usize = 64 * 1024;

/// An order body's fields as their types let them be read, in the order their rules
/// are checked ([`order_rules`]): decoded from the bytes or read from
/// the body's JSON value ([`TwoWayBody`]).
struct OrderFields<'a> {
    order_id: Got<'a, &'a str>,
    /// `None`: absent, or not an array; a line `None`: not an object.
    lines: Option<Vec<Option<LineFields<'a>>>>,
    ttl_ms: Got<'a, i64>,
    buyer: Got<'a, &'a str>,
}

/// A line's `item` and `qty`.
type LineFields<'a> = (Got<'a, &'a str>, Got<'a, i64>);

/// An order body as it is on the wire, decoded straight into typed, borrowed fields (as
/// a transaction's is, `validate::typed_txn`). What it cannot type (an unknown or
/// repeated field, a field of another type, a string with escapes, a line that is not
/// an object) is read through the body's JSON value instead, whose errors name the field.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct OrderWire<'a> {
    #[serde(borrow)]
    order_id: Option<&'a str>,
    #[serde(borrow)]
    lines: Option<Vec<MapOnly<LineWire<'a>>>>,
    ttl_ms: Option<i64>,
    #[serde(borrow)]
    buyer: Option<&'a str>,
}

/// A line of [`OrderWire`].
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct LineWire<'a> {
    #[serde(borrow)]
    item: Option<&'a str>,
    qty: Option<i64>,
}

impl TwoWayBody for OrderWire<'_> {
    type Fields<'a> = OrderFields<'a>;
    const SCHEMA: &'static str = "OrderRequest";

    fn typed(bytes: &[u8]) -> Option<OrderFields<'_>> {
        let w: OrderWire = wire(bytes)?;
        Some(OrderFields {
            order_id: w.order_id.into(),
            lines: w.lines.map(|lines| {
                lines
                    .into_iter()
                    .map(|MapOnly(l)| Some((l.item.into(), l.qty.into())))
                    .collect()
            }),
            ttl_ms: w.ttl_ms.into(),
            buyer: w.buyer.into(),
        })
    }

    fn of(obj: &Map<String, Value>) -> OrderFields<'_> {
        let lines = match obj.get("lines") {
            Some(Value::Array(raw)) => Some(
                raw.iter()
                    .map(|line| match line {
                        Value::Object(o) => Some((Got::text(o, "item"), Got::int(o, "qty"))),
                        _ => None,
                    })
                    .collect(),
            ),
            _ => None,
        };
        OrderFields {
            order_id: Got::text(obj, "order_id"),
            lines,
            ttl_ms: Got::int(obj, "ttl_ms"),
            buyer: Got::text(obj, "buyer"),
        }
    }
}

/// The rules of an order's fields, checked in order; the one place they are written,
/// whichever way the body was decoded.
fn order_rules(f: OrderFields<'_>) -> Result<NewOrder, ApiError> {
    let order_id = name_rule(f.order_id, "order_id", "")?.ok_or_else(|| {
        ApiError::invalid("order_id: required (it makes the order idempotent and is its id)")
    })?;
    crate::trace::record_key(&order_id);
    if order_id.starts_with('~') {
        return Err(ApiError::invalid(
            "order_id: must not start with '~' (reserved)",
        ));
    }
    let lines = lines_rule(f.lines)?;
    let ttl_ms = integer_rule(f.ttl_ms, "ttl_ms", "", 1, HOLD_TTL_MAX_MS)?;
    let buyer = name_rule(f.buyer, "buyer", "")?;
    Ok(NewOrder {
        order_id,
        lines,
        ttl_ms,
        buyer,
    })
}

/// The order's lines, validated: 1 to [`ORDER_LINES_MAX`] objects of `item` and `qty`,
/// items distinct.
fn lines_rule(raw: Option<Vec<Option<LineFields<'_>>>>) -> Result<Vec<OrderLine>, ApiError> {
    let Some(raw) = raw else {
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
    for (i, line) in raw.into_iter().enumerate() {
        let at = format!("lines[{i}].");
        let Some((item, qty)) = line else {
            return Err(ApiError::invalid(format!(
                "lines[{i}]: must be a JSON object"
            )));
        };
        let item = required(name_rule(item, "item", &at)?, "item", &at)?;
        let qty = integer_rule(qty, "qty", &at, 1, QTY_MAX)?;
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
    let body = json_body(&http, payload, ORDER_BODY_MAX).await?;
    let order = two_way::<OrderWire, _>(&body.bytes, order_rules)?;
    drop(body);
    // Charged once the order is valid: a body refused costs the shop nothing.
    crate::auth::charge_work(&http, &shop, order.lines.len())?;
    // The order is driven to its end on its own task: a caller that goes away mid-way
    // leaves no line held.
    let engine = state.engine.clone();
    let placed = actix_web::rt::spawn(async move { engine.place_order(&shop, order).await })
        .await
        .map_err(|_| ApiError::from(EngineError::ShuttingDown))?;
    match placed {
        Ok(Placed::Answer(view)) => Ok(crate::json_response(HttpResponse::Ok(), &view)),
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
        return Ok(crate::json_response(HttpResponse::Ok(), &view));
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::validate::decode_object;
    use proptest::prelude::*;
    use serde_json::json;

    /// What the rules made of a body: the order, or the error's text.
    fn shown(r: Result<NewOrder, ApiError>) -> Result<String, String> {
        r.map(|o| format!("{:?}", (o.order_id, o.lines, o.ttl_ms, o.buyer)))
            .map_err(|e| e.to_string())
    }

    /// The body read through its JSON value, as a body the typed decoder refuses is.
    fn through_value(bytes: &[u8]) -> Result<String, String> {
        let obj = decode_object(bytes).map_err(|e| e.to_string())?;
        crate::openapi::known_fields("OrderRequest", &obj).map_err(|e| e.to_string())?;
        shown(order_rules(OrderWire::of(&obj)))
    }

    /// Any value a field of an order may be sent as, good or bad.
    fn field() -> impl Strategy<Value = Value> {
        prop_oneof![
            Just(Value::Null),
            Just(json!("a")),
            Just(json!("~reserved")),
            Just(json!("x".repeat(129))),
            Just(json!("")),
            Just(json!("esc\"aped")),
            Just(json!(0)),
            Just(json!(1)),
            Just(json!(2.5)),
            Just(json!(u64::MAX)),
            Just(json!(QTY_MAX + 1)),
            Just(json!([])),
            Just(json!({})),
        ]
    }

    /// A line: mostly a good one (an item of its own, or now and then one named twice,
    /// and a quantity in range), else any field's value in its place.
    fn line() -> impl Strategy<Value = (Option<Value>, Value)> {
        (
            prop_oneof![
                6 => Just(None),
                1 => Just(Some(json!("i0"))),
                2 => field().prop_map(Some),
            ],
            prop_oneof![6 => (1i64..100).prop_map(|q| json!(q)), 2 => field()],
        )
    }

    fn body() -> impl Strategy<Value = Value> {
        (
            prop_oneof![6 => Just(json!("o1")), 1 => field()],
            prop_oneof![
                8 => prop::collection::vec(line(), 0..5),
                1 => Just(vec![(Some(json!("i1")), json!(1)); 101]),
            ],
            prop_oneof![1 => Just(false), 1 => Just(true)],
            prop_oneof![6 => (1i64..1_000_000).prop_map(|t| json!(t)), 1 => field()],
            prop_oneof![2 => Just(None), 2 => Just(Some(json!("b"))), 1 => field().prop_map(Some)],
            prop_oneof![8 => Just(0u8), 1 => Just(1), 1 => Just(2)],
        )
            .prop_map(|(id, lines, lines_odd, ttl, buyer, extra)| {
                let lines: Vec<Value> = lines
                    .into_iter()
                    .enumerate()
                    .map(|(i, (item, qty))| {
                        let item = item.unwrap_or_else(|| json!(format!("i{}", i + 1)));
                        json!({"item": item, "qty": qty})
                    })
                    .collect();
                let lines = match (lines_odd, lines.len()) {
                    // Now and then the lines' field itself is something else.
                    (true, 0) => json!("lines"),
                    _ => Value::Array(lines),
                };
                let mut o = json!({"order_id": id, "lines": lines, "ttl_ms": ttl});
                if let Some(b) = buyer {
                    o["buyer"] = b;
                }
                match extra {
                    1 => o["note"] = json!("unknown"),
                    2 => {
                        if let Some(first) = o["lines"].get_mut(0) {
                            first["extra"] = json!(1);
                        }
                    }
                    _ => {}
                }
                o
            })
    }

    #[test]
    fn a_plain_order_is_typed_from_its_bytes() {
        let bytes = br#"{"order_id":"o1","lines":[{"item":"a","qty":2},{"item":"b","qty":1}],"ttl_ms":60000,"buyer":"u"}"#;
        let typed = OrderWire::typed(bytes).expect("a plain order is typed");
        let order = order_rules(typed).expect("valid");
        assert_eq!(&*order.order_id, "o1");
        assert_eq!(order.lines.len(), 2);
        assert_eq!((order.ttl_ms, order.buyer.as_deref()), (60_000, Some("u")));
        // What the typed decoder refuses, the value's reading names.
        for (body, error) in [
            (
                &br#"{"order_id":"o1","lines":[{"item":"a","qty":1,"x":1}],"ttl_ms":1}"#[..],
                "lines[0]",
            ),
            (
                br#"{"order_id":"o1","lines":[7],"ttl_ms":1}"#,
                "lines[0]: must be a JSON object",
            ),
            (
                br#"{"order_id":"o1","lines":[{"item":"a","qty":1.5}],"ttl_ms":1}"#,
                "lines[0].qty: must be an integer",
            ),
        ] {
            assert!(OrderWire::typed(body).is_none());
            let e = through_value(body).expect_err("refused");
            assert!(e.contains(error), "{e}");
        }
    }

    proptest! {
        #[test]
        fn an_order_typed_from_its_bytes_is_decided_as_its_json_value_is(body in body()) {
            let bytes = serde_json::to_vec(&body).unwrap_or_default();
            if let Some(fields) = OrderWire::typed(&bytes) {
                prop_assert_eq!(shown(order_rules(fields)), through_value(&bytes));
            }
        }
    }
}
