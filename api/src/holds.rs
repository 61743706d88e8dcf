//! `POST /v1/shops/{shop}/holds`, `POST .../holds/{hold_id}/confirm`,
//! `POST .../holds/{hold_id}/cancel`, `POST .../holds/{hold_id}/extend`,
//! `GET .../holds/{hold_id}`.
//!
//! A hold's id is the `request_id` that made it. The engine ends holds
//! (`nrtxn_actors::hold_end`): these routes decode the call and answer with what it
//! returns (409 and the hold's state for a hold already ended another way).

use std::sync::Arc;

use actix_web::{web, HttpRequest, HttpResponse};
use nrtxn_actors::extend::Extended;
use nrtxn_actors::{
    hold_end_key, now_ms, HoldEnd, HoldStatus, HoldView, Op, Outcome, Reply, Request, Status,
    HOLD_TTL_MAX_MS, QTY_MAX,
};
use serde_json::{json, Map, Value};

use crate::error::ApiError;
use crate::validate::{
    integer, integer_rule, json_body, json_object, min_qty_rule, name_rule, path_segment,
    request_id_rule, two_way, wire, Got, TwoWayBody,
};
use crate::AppState;

/// Largest body of a hold: four short fields.
pub const HOLD_BODY_MAX: usize = 4 * 1024;

/// A hold as the routes answer it.
#[derive(serde::Serialize)]
struct HoldBody<'a> {
    hold_id: &'a str,
    status: &'a str,
    item: &'a str,
    qty: i64,
    /// What the hold took: `qty`, less for a partial fill (`min_qty`), 0 when refused.
    #[serde(skip_serializing_if = "Option::is_none")]
    qty_taken: Option<i64>,
    expires_at: Option<i64>,
    seq: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    reason: Option<&'a str>,
    /// The buyer the hold was made for (listings only).
    #[serde(skip_serializing_if = "Option::is_none")]
    buyer: Option<&'a str>,
}

/// Submits one request that waits for its outcome; 504 if none comes in time.
async fn decide(state: &AppState, shop: &Arc<str>, req: Request) -> Result<Arc<Outcome>, ApiError> {
    let key = req.key.clone();
    let answers = state.engine.submit(shop, vec![(req, true)]).await?;
    match answers.replies.into_iter().next() {
        Some(Reply::Repeat(o) | Reply::Decided(o)) => Ok(o),
        _ => Err(ApiError::Timeout(format!(
            "request_key: {key} is still pending"
        ))),
    }
}

/// A hold body's fields as their types let them be read, in the order their rules are
/// checked ([`hold_rules`]), typed from the bytes or read from the JSON value
/// ([`TwoWayBody`]).
struct HoldFields<'a> {
    item: Got<'a, &'a str>,
    qty: Got<'a, i64>,
    ttl_ms: Got<'a, i64>,
    min_qty: Got<'a, i64>,
    request_id: Got<'a, &'a str>,
    seller: Got<'a, &'a str>,
    buyer: Got<'a, &'a str>,
}

/// A hold body as it is on the wire, decoded straight into typed, borrowed fields (as
/// a transaction's is, `validate::typed_txn`); what it cannot type is read through the
/// body's JSON value instead, whose errors name the field.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct HoldWire<'a> {
    #[serde(borrow)]
    item: Option<&'a str>,
    qty: Option<i64>,
    ttl_ms: Option<i64>,
    min_qty: Option<i64>,
    #[serde(borrow)]
    request_id: Option<&'a str>,
    #[serde(borrow)]
    seller: Option<&'a str>,
    #[serde(borrow)]
    buyer: Option<&'a str>,
}

impl TwoWayBody for HoldWire<'_> {
    type Fields<'a> = HoldFields<'a>;
    const SCHEMA: &'static str = "HoldRequest";

    fn typed(bytes: &[u8]) -> Option<HoldFields<'_>> {
        let w: HoldWire = wire(bytes)?;
        Some(HoldFields {
            item: w.item.into(),
            qty: w.qty.into(),
            ttl_ms: w.ttl_ms.into(),
            min_qty: w.min_qty.into(),
            request_id: w.request_id.into(),
            seller: w.seller.into(),
            buyer: w.buyer.into(),
        })
    }

    fn of(obj: &Map<String, Value>) -> HoldFields<'_> {
        HoldFields {
            item: Got::text(obj, "item"),
            qty: Got::int(obj, "qty"),
            ttl_ms: Got::int(obj, "ttl_ms"),
            min_qty: Got::int(obj, "min_qty"),
            request_id: Got::text(obj, "request_id"),
            seller: Got::text(obj, "seller"),
            buyer: Got::text(obj, "buyer"),
        }
    }
}

/// The rules of a hold's fields, checked in order: the hold's request. The one place
/// they are written, whichever way the body was decoded.
fn hold_rules(shop: &Arc<str>, f: HoldFields<'_>) -> Result<Request, ApiError> {
    let item = name_rule(f.item, "item", "")?.ok_or_else(|| ApiError::invalid("item: required"))?;
    let qty = integer_rule(f.qty, "qty", "", 1, QTY_MAX)?;
    let ttl_ms = integer_rule(f.ttl_ms, "ttl_ms", "", 1, HOLD_TTL_MAX_MS)?;
    let min_qty = min_qty_rule(f.min_qty, "", Op::Hold, qty)?;
    let key = request_id_rule(f.request_id, "")?.ok_or_else(|| {
        ApiError::invalid("request_id: required (it makes the hold idempotent and is its id)")
    })?;
    crate::trace::record_key(&key);
    let seller = name_rule(f.seller, "seller", "")?;
    let buyer = name_rule(f.buyer, "buyer", "")?;
    Ok(Request {
        seller,
        buyer,
        ttl_ms,
        min_qty,
        ..Request::new(shop.clone(), item, key, Op::Hold, qty, now_ms())
    })
}

pub async fn post_hold(
    state: web::Data<AppState>,
    path: web::Path<String>,
    http: HttpRequest,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    let shop = path_segment(&path, "shop")?;
    let body = json_body(&http, payload, HOLD_BODY_MAX).await?;
    let req = two_way::<HoldWire, _>(&body.bytes, |fields| hold_rules(&shop, fields))?;
    drop(body);
    let key = req.key.clone();
    let o = decide(&state, &shop, req.clone()).await?;
    if let Some(e) = ApiError::reused(&req, &o, "request_id") {
        return Err(e);
    }
    let (hold_id, status) = match o.status {
        Status::Ok => (&*key, HoldStatus::Held.as_str()),
        other => (&*key, other.as_str()),
    };
    Ok(crate::json_response(
        HttpResponse::Ok(),
        &HoldBody {
            hold_id,
            status,
            item: &o.item,
            qty: o.qty,
            qty_taken: o.qty_taken,
            expires_at: o.expires_at,
            seq: o.seq,
            reason: o.reason.as_deref(),
            buyer: None,
        },
    ))
}

pub async fn confirm_hold(
    state: web::Data<AppState>,
    path: web::Path<(String, String)>,
) -> Result<HttpResponse, ApiError> {
    end_hold(state, path, Op::Confirm).await
}

pub async fn cancel_hold(
    state: web::Data<AppState>,
    path: web::Path<(String, String)>,
) -> Result<HttpResponse, ApiError> {
    end_hold(state, path, Op::Release).await
}

/// Decodes the call, has the engine end the hold ([`Engine::end_hold`]), and answers
/// with the hold as it now is: 200 for this ending (or the same asked again), 409 with
/// the hold's state for another ending, 404 for no hold, 504 while undecided.
///
/// [`Engine::end_hold`]: nrtxn_actors::engine::Engine::end_hold
async fn end_hold(
    state: web::Data<AppState>,
    path: web::Path<(String, String)>,
    op: Op,
) -> Result<HttpResponse, ApiError> {
    let (shop, hold_id) = path.into_inner();
    let shop = path_segment(&shop, "shop")?;
    let hold_id = path_segment(&hold_id, "hold_id")?;
    let (item, qty, expires_at, o) = match state.engine.end_hold(&shop, &hold_id, op).await? {
        HoldEnd::Decided {
            item,
            qty,
            expires_at,
            outcome,
        } => (item, qty, expires_at, outcome),
        HoldEnd::OrderLine => {
            return Err(ApiError::NotFound(format!(
                "hold_id: no hold {hold_id} in shop {shop} (an order's line ends with its \
                 order: /v1/shops/{shop}/orders/{{order_id}}/confirm or /cancel)"
            )))
        }
        HoldEnd::Unknown => {
            return Err(ApiError::NotFound(format!(
                "hold_id: no hold {hold_id} in shop {shop}"
            )))
        }
        HoldEnd::Pending => {
            return Err(ApiError::Timeout(format!(
                "request_key: {} is still pending",
                hold_end_key(&hold_id)
            )))
        }
    };
    let status = HoldStatus::after(o.op).unwrap_or(HoldStatus::Held);
    let body = HoldBody {
        hold_id: &hold_id,
        status: status.as_str(),
        item: &item,
        qty,
        qty_taken: None,
        expires_at: Some(expires_at),
        seq: o.seq,
        reason: None,
        buyer: None,
    };
    if o.op == op {
        // This ending, or the same ending asked for again.
        return Ok(crate::json_response(HttpResponse::Ok(), &body));
    }
    Err(ApiError::ending_conflict(
        "hold_id",
        "hold",
        &hold_id,
        status.as_str(),
        op,
        serde_json::to_value(&body).unwrap_or(Value::Null),
    ))
}

/// Most bytes of an extension's body (`{"ttl_ms": ...}`).
const EXTEND_BODY_MAX: usize = 256;

/// `POST .../holds/{hold_id}/extend` `{"ttl_ms"}`: the pending hold with its new
/// expiry; 409 with its state when it is no longer pending, 404 for no hold.
pub async fn extend_hold(
    state: web::Data<AppState>,
    path: web::Path<(String, String)>,
    http: HttpRequest,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    let (shop, hold_id) = path.into_inner();
    let shop = path_segment(&shop, "shop")?;
    let hold_id = path_segment(&hold_id, "hold_id")?;
    let ttl_ms = extension_ttl(&http, payload).await?;
    let unknown = format!(
        "hold_id: no hold {hold_id} in shop {shop} (an order's line is extended with its \
         order: /v1/shops/{shop}/orders/{{order_id}}/extend)"
    );
    let extended = state.engine.extend_hold(&shop, &hold_id, ttl_ms).await?;
    let extended = extended.map(|h| serde_json::to_value(view(&h)).unwrap_or(Value::Null));
    extension_answer(extended, "hold_id", unknown)
}

/// The answer to an extension: 200 with what was extended, 409 with it as it stands
/// when it is no longer pending (`field` names what the path gave), 404 (`unknown`).
pub(crate) fn extension_answer<V: serde::Serialize>(
    extended: Extended<V>,
    field: &str,
    unknown: String,
) -> Result<HttpResponse, ApiError> {
    match extended {
        Extended::Done(v) => Ok(HttpResponse::Ok().json(v)),
        Extended::NotPending(v, why) => Err(ApiError::Conflict(
            format!("{field}: {why}, it cannot be extended"),
            serde_json::to_value(&v).unwrap_or(Value::Null),
        )),
        Extended::Unknown => Err(ApiError::NotFound(unknown)),
    }
}

/// A hold as it stands, as the routes answer it.
fn view(h: &HoldView) -> HoldBody<'_> {
    HoldBody {
        hold_id: &h.hold_id,
        status: h.status.as_str(),
        item: &h.item,
        qty: h.qty,
        qty_taken: None,
        expires_at: Some(h.expires_at),
        seq: Some(h.seq),
        reason: None,
        buyer: None,
    }
}

/// Most holds (and orders) a listing answers at once.
pub const HOLDS_LIMIT_MAX: usize = 1_000;
/// Holds a listing answers when it names no `limit`.
pub const HOLDS_LIMIT_DEFAULT: usize = 100;

/// What a listing of holds or orders asks: its filters, where it starts, how many, and
/// the state it keeps (`checking` and `held` are both pending in the store: told apart
/// by the shop's check-back, after the read).
pub(crate) struct Listing {
    pub query: nrtxn_actors::HoldQuery,
    pub after: Option<Arc<str>>,
    pub limit: usize,
    pub state: Option<String>,
}

/// The query of `GET .../holds` (`orders`: of `GET .../orders`, which takes no `item`):
/// every parameter checked, an unknown one refused by name.
pub(crate) fn listing(
    params: Vec<(String, String)>,
    orders: bool,
    limit_max: usize,
) -> Result<Listing, ApiError> {
    let mut l = Listing {
        query: nrtxn_actors::HoldQuery {
            orders,
            ..Default::default()
        },
        after: None,
        limit: HOLDS_LIMIT_DEFAULT.min(limit_max),
        state: None,
    };
    let known = if orders {
        "buyer, state, after, limit"
    } else {
        "item, buyer, state, after, limit"
    };
    for (k, v) in params {
        match k.as_str() {
            "item" if !orders => l.query.item = Some(path_segment(&v, "item")?),
            "buyer" => l.query.buyer = Some(path_segment(&v, "buyer")?),
            "after" if v.is_empty() => l.after = None,
            // Any id a page may end on (an order's line's is longer than a name).
            "after" if v.len() <= AFTER_LEN_MAX => l.after = Some(v.into()),
            "after" => {
                return Err(ApiError::invalid(format!(
                    "after: longer than {AFTER_LEN_MAX} bytes"
                )))
            }
            "state" => {
                l.query.status = Some(state_of(&v, orders)?);
                l.state = Some(v);
            }
            "limit" => l.limit = crate::validate::limit_param(&v, limit_max)?,
            other => {
                return Err(ApiError::invalid(format!(
                    "{other}: unknown parameter ({known})"
                )))
            }
        }
    }
    Ok(l)
}

/// Longest `after` of a listing: the longest id a hold may have.
const AFTER_LEN_MAX: usize = 512;

/// The status of the holds (an order's: of its record) a listing's `state` reads; an
/// order's `cancelled` and `released` are both a released record (told apart after),
/// and its `reserving` a pending one.
fn state_of(state: &str, orders: bool) -> Result<HoldStatus, ApiError> {
    match state {
        "checking" => Ok(HoldStatus::Held),
        "reserving" if orders => Ok(HoldStatus::Held),
        "cancelled" if orders => Ok(HoldStatus::Released),
        s => HoldStatus::parse(s).ok_or_else(|| {
            let also = if orders { ", cancelled, reserving" } else { "" };
            ApiError::invalid(format!(
                "state: must be held, confirmed, released, expired, checking{also}, got {state:?}"
            ))
        }),
    }
}

/// `GET /v1/shops/{shop}/holds?item=&buyer=&state=&after=&limit=`: the shop's holds, in
/// hold id order, paged (`next` is the `after` of the next page, `null` at the end).
/// Orders' lines are holds of their items and are listed; orders' records are not (see
/// `GET .../orders`).
pub async fn list_holds(
    state: web::Data<AppState>,
    path: web::Path<String>,
    query: web::Query<Vec<(String, String)>>,
) -> Result<HttpResponse, ApiError> {
    let shop = path_segment(&path, "shop")?;
    let l = listing(query.into_inner(), false, HOLDS_LIMIT_MAX)?;
    let (holds, next) = state
        .engine
        .hold_page(&shop, l.query, l.after, l.limit)
        .await?;
    let bodies: Vec<HoldBody<'_>> = holds
        .iter()
        .map(|h| {
            let mut body = view(h);
            body.buyer = h.buyer.as_deref();
            if h.status == HoldStatus::Held && state.engine.checking(&shop, h.expires_at) {
                body.status = "checking";
            }
            body
        })
        .filter(|b| l.state.as_deref().is_none_or(|s| s == b.status))
        .collect();
    Ok(HttpResponse::Ok().json(json!({ "holds": bodies, "next": next })))
}

/// The `ttl_ms` of an extension's body (1 ms to a week).
pub(crate) async fn extension_ttl(
    http: &HttpRequest,
    payload: web::Payload,
) -> Result<i64, ApiError> {
    let body = json_object(http, payload, EXTEND_BODY_MAX).await?;
    crate::openapi::known_fields("Extend", &body)?;
    integer(&body, "ttl_ms", "", 1, HOLD_TTL_MAX_MS)
}

pub async fn get_hold(
    state: web::Data<AppState>,
    path: web::Path<(String, String)>,
) -> Result<HttpResponse, ApiError> {
    let (shop, hold_id) = path.into_inner();
    let shop = path_segment(&shop, "shop")?;
    let hold_id = path_segment(&hold_id, "hold_id")?;
    match state.engine.hold(&shop, &hold_id).await? {
        Some(h) => {
            let mut body = view(&h);
            // Pending past its expiry while its shop is asked (or an operator decides).
            if h.status == HoldStatus::Held && state.engine.checking(&shop, h.expires_at) {
                body.status = "checking";
            }
            Ok(HttpResponse::Ok().json(body))
        }
        None => Err(ApiError::NotFound(format!(
            "hold_id: no hold {hold_id} in shop {shop}"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::validate::decode_object;
    use proptest::prelude::*;

    /// What the rules made of a body: the request's fields, or the error's text.
    fn shown(r: Result<Request, ApiError>) -> Result<String, String> {
        r.map(|q| {
            format!(
                "{:?}",
                (q.item, q.qty, q.ttl_ms, q.min_qty, q.key, q.seller, q.buyer)
            )
        })
        .map_err(|e| e.to_string())
    }

    /// The body read through its JSON value, as a body the typed decoder refuses is.
    fn through_value(shop: &Arc<str>, bytes: &[u8]) -> Result<String, String> {
        let obj = decode_object(bytes).map_err(|e| e.to_string())?;
        crate::openapi::known_fields("HoldRequest", &obj).map_err(|e| e.to_string())?;
        shown(hold_rules(shop, HoldWire::of(&obj)))
    }

    /// A field's value: mostly one of its good ones, else anything a caller may send.
    fn field(good: Value) -> impl Strategy<Value = Option<Value>> {
        prop_oneof![
            6 => Just(Some(good)),
            1 => Just(None),
            1 => prop_oneof![
                Just(Value::Null),
                Just(json!("~reserved")),
                Just(json!("x".repeat(129))),
                Just(json!("")),
                Just(json!("esc\"aped")),
                Just(json!(0)),
                Just(json!(-1)),
                Just(json!(2.5)),
                Just(json!(u64::MAX)),
                Just(json!(QTY_MAX + 1)),
                Just(json!([])),
                Just(json!({})),
            ]
            .prop_map(Some),
        ]
    }

    fn body() -> impl Strategy<Value = Value> {
        (
            field(json!("item-1")),
            (1i64..20).prop_flat_map(|q| (Just(q), field(json!(q)), field(json!((q + 1) / 2)))),
            field(json!(60_000)),
            field(json!("h1")),
            field(json!("s")),
            field(json!("b")),
            prop_oneof![6 => Just(false), 1 => Just(true)],
        )
            .prop_map(|(item, (_, qty, min_qty), ttl, id, seller, buyer, extra)| {
                let mut o = serde_json::Map::new();
                for (k, v) in [
                    ("item", item),
                    ("qty", qty),
                    ("ttl_ms", ttl),
                    ("min_qty", min_qty),
                    ("request_id", id),
                    ("seller", seller),
                    ("buyer", buyer),
                ] {
                    if let Some(v) = v {
                        o.insert(k.into(), v);
                    }
                }
                if extra {
                    o.insert("note".into(), json!(1));
                }
                Value::Object(o)
            })
    }

    proptest! {
        #[test]
        fn a_hold_typed_from_its_bytes_is_decided_as_its_json_value_is(body in body()) {
            let shop: Arc<str> = "shop".into();
            let bytes = serde_json::to_vec(&body).unwrap_or_default();
            if let Some(fields) = HoldWire::typed(&bytes) {
                prop_assert_eq!(shown(hold_rules(&shop, fields)), through_value(&shop, &bytes));
            }
        }
    }
}
