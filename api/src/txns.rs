//! `POST /v1/shops/{shop}/txns`, `POST .../txns/batch`, `GET .../txns/{request_key}`.

use std::sync::Arc;

use actix_web::{web, HttpMessage, HttpRequest, HttpResponse, ResponseError};
use nrtxn_actors::{
    now_ms, Op, Outcome, PollResult, Reply, Request, StoreError, BATCH_TXNS_MAX, QTY_MAX,
};
use serde_json::{json, Value};

use crate::error::ApiError;
use crate::validate::{
    array, decode_object, integer, json_body, path_segment, request_id, required_name, txn,
    txn_rules, typed_batch, typed_txn, TxnFields,
};
use crate::AppState;

/// Largest body of a single transaction.
pub const TXN_BODY_MAX: usize = 16 * 1024;
/// Largest body of a batch: 1,000 entries of up to about 2 KiB each.
pub const BATCH_BODY_MAX: usize = 2 * 1024 * 1024;

/// What one submitted request ends as, before it becomes JSON.
enum Answer {
    Outcome(Arc<Outcome>),
    Accepted(Arc<str>),
    Pending(Arc<str>),
    /// Its key was first used by a different request ([`ApiError::KeyReused`]).
    Reused(Arc<str>, ApiError),
}

/// An answer as JSON: the outcome itself, or a key with its status. Serialized as is
/// (not through `serde_json::Value`) so fields keep the outcome's documented order.
#[derive(serde::Serialize)]
#[serde(untagged)]
enum AnswerBody<'a> {
    Outcome(&'a Outcome),
    Status {
        request_key: &'a str,
        status: &'static str,
    },
    /// A batch entry refused on its own (its key was reused).
    Error {
        request_key: &'a str,
        error: &'static str,
        detail: &'a str,
        original: &'a Value,
    },
}

impl Answer {
    fn body(&self) -> AnswerBody<'_> {
        match self {
            Answer::Outcome(o) => AnswerBody::Outcome(o),
            Answer::Accepted(k) => AnswerBody::Status {
                request_key: k,
                status: "accepted",
            },
            Answer::Pending(k) => AnswerBody::Status {
                request_key: k,
                status: "pending",
            },
            Answer::Reused(k, ApiError::KeyReused(detail, original)) => AnswerBody::Error {
                request_key: k,
                error: "key_reused",
                detail,
                original,
            },
            Answer::Reused(k, _) => AnswerBody::Status {
                request_key: k,
                status: "error",
            },
        }
    }

    fn response(&self) -> HttpResponse {
        let res = match self {
            Answer::Outcome(_) => HttpResponse::Ok(),
            Answer::Accepted(_) => HttpResponse::Accepted(),
            Answer::Pending(_) => HttpResponse::GatewayTimeout(),
            Answer::Reused(_, e) => return e.error_response(),
        };
        crate::json_response(res, &self.body())
    }
}

/// Where a transaction's key came from: its `request_id`, or (without one) seller, item
/// and `req_time`. Named in a `key_reused` error.
fn key_field(body: &Value) -> &'static str {
    match body.get("request_id") {
        None | Some(Value::Null) => "request_key",
        Some(_) => "request_id",
    }
}

/// Submits requests of one shop and waits, until the reply timeout at the latest, for
/// what each caller is owed: the outcome (respond=true), or durability (respond=false).
/// An outcome recorded for a different request under the same key (`key_fields` says
/// where each key came from) is answered as `key_reused`, never as this request's.
async fn submit(
    state: &AppState,
    shop: &Arc<str>,
    reqs: Vec<(Request, bool)>,
    key_fields: &[&'static str],
) -> Result<Vec<Answer>, ApiError> {
    let meta: Vec<(Request, bool)> = reqs.to_vec();
    let answers = state.engine.submit(shop, reqs).await?;
    // Durability of this call's fire-and-forget requests comes first: a 202 is a promise.
    // The call is answered once the request log has told it (or at its deadline).
    let durable = match answers.durable {
        Ok(durable) => durable,
        Err(StoreError::Closed) => return Err(ApiError::Unavailable("request log closed".into())),
        Err(e) => return Err(ApiError::store(e)),
    };
    let mut out = Vec::with_capacity(meta.len());
    for (((req, respond), reply), field) in meta
        .into_iter()
        .zip(answers.replies)
        .zip(key_fields.iter().copied())
    {
        let key = req.key.clone();
        let decided = |o: Arc<Outcome>, answer: Answer| match ApiError::reused(&req, &o, field) {
            Some(e) => Answer::Reused(key.clone(), e),
            None => answer,
        };
        out.push(match reply {
            Reply::Repeat(o) => decided(o.clone(), Answer::Outcome(o)),
            Reply::Decided(o) if respond => decided(o.clone(), Answer::Outcome(o)),
            Reply::Decided(o) => decided(o, Answer::Accepted(key.clone())),
            Reply::Accepted if durable => Answer::Accepted(key),
            Reply::Accepted | Reply::Pending => Answer::Pending(key),
        });
    }
    Ok(out)
}

/// A seller key may not create stock: its increment must be a return, naming the sale
/// it gives back (`return_of`), which the item's processor then checks
/// ([`nrtxn_actors::returns`]). Operator and admin keys, and the keyless mode, keep
/// free increments. `at` locates the request in a batch (`txns[3]`). Costs a
/// decrement nothing.
fn seller_may(http: &HttpRequest, req: &Request, at: &str) -> Result<(), ApiError> {
    if req.op != Op::Increment || req.return_of.is_some() {
        return Ok(());
    }
    if !http.extensions().contains::<crate::auth::SellerKey>() {
        return Ok(());
    }
    Err(ApiError::Forbidden(format!(
        "{at}return_of: required: a seller key may increment stock only to return a sale, \
         naming it with \"return_of\": REQUEST_KEY of an ok decrement of this item; \
         stock is added by an operator (PUT .../items or POST .../items/adjust)"
    )))
}

pub async fn post_txn(
    state: web::Data<AppState>,
    path: web::Path<String>,
    http: HttpRequest,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    let shop = path_segment(&path, "shop")?;
    let body = json_body(&http, payload, TXN_BODY_MAX).await?;
    // Typed straight from the bytes; a body that cannot be is read as a JSON value,
    // whose errors name the field. One set of rules decides either way.
    let (req, key_field) = match typed_txn(&body.bytes) {
        Some(fields) => (txn_rules(&shop, fields, "")?, fields.key_field()),
        None => {
            let obj = decode_object(&body.bytes)?;
            crate::openapi::known_fields("Txn", &obj)?;
            let obj = Value::Object(obj);
            (txn(&shop, &obj, "")?, key_field(&obj))
        }
    };
    drop(body);
    seller_may(&http, &req.0, "")?;
    crate::trace::record_key(&req.0.key);
    let answers = submit(&state, &shop, vec![req], &[key_field]).await?;
    Ok(answers
        .first()
        .map(Answer::response)
        .unwrap_or_else(|| HttpResponse::InternalServerError().finish()))
}

pub async fn post_batch(
    state: web::Data<AppState>,
    path: web::Path<String>,
    http: HttpRequest,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    let shop = path_segment(&path, "shop")?;
    let body = json_body(&http, payload, BATCH_BODY_MAX).await?;
    // Typed straight from the bytes as a single transaction is ([`post_txn`]); a body
    // that cannot be is read as a JSON value, whose errors name the entry and field.
    let (reqs, fields) = match typed_batch(&body.bytes, BATCH_TXNS_MAX) {
        Some(entries) => {
            crate::auth::charge_work(&http, &shop, entries.len())?;
            let mut reqs = Vec::with_capacity(entries.len());
            for (i, f) in entries.iter().enumerate() {
                let prefix = format!("txns[{i}].");
                let req = txn_rules(&shop, *f, &prefix)?;
                seller_may(&http, &req.0, &prefix)?;
                reqs.push(req);
            }
            (reqs, entries.iter().map(TxnFields::key_field).collect())
        }
        None => entries(&http, &shop, &body.bytes, "txns", batch_txn, key_field)?,
    };
    drop(body);
    answer_entries(&state, &shop, reqs, &fields).await
}

/// Validates one entry of a batch and checks that its caller may make it
/// ([`seller_may`]): a seller's free increment fails the whole batch, like a bad entry.
fn batch_txn(
    http: &HttpRequest,
    shop: &Arc<str>,
    v: &Value,
    prefix: &str,
) -> Result<(Request, bool), ApiError> {
    let req = txn(shop, v, prefix)?;
    seller_may(http, &req.0, prefix)?;
    Ok(req)
}

/// Validates one entry of a call's array: the call (whose key may matter), its shop,
/// value and place (`txns[3].`); the request and whether its caller waits for the
/// outcome.
type ParseEntry = fn(&HttpRequest, &Arc<str>, &Value, &str) -> Result<(Request, bool), ApiError>;

/// A call's requests, each with whether its caller waits, and where each one's key came
/// from.
type Entries = (Vec<(Request, bool)>, Vec<&'static str>);

/// The entries of a call whose body is an array `field` of them, each a request: every
/// entry is validated (by `parse`, given its shop, value and place) before any is
/// submitted, so a bad entry fails the whole call. The requests, with whether each
/// caller waits, and where each entry's key came from (`key_field`), for a
/// `key_reused` answer.
fn entries(
    http: &HttpRequest,
    shop: &Arc<str>,
    bytes: &[u8],
    field: &str,
    parse: ParseEntry,
    key_field: fn(&Value) -> &'static str,
) -> Result<Entries, ApiError> {
    let body = decode_object(bytes)?;
    // The two bodies of entries: a batch of transactions, a list of adjustments.
    crate::openapi::known_fields(
        if field == "txns" {
            "Batch"
        } else {
            "Adjustments"
        },
        &body,
    )?;
    let entries = array(&body, field, BATCH_TXNS_MAX)?;
    crate::auth::charge_work(http, shop, entries.len())?;
    let reqs = entries
        .iter()
        .enumerate()
        .map(|(i, v)| parse(http, shop, v, &format!("{field}[{i}].")))
        .collect::<Result<Vec<_>, _>>()?;
    Ok((reqs, entries.iter().map(key_field).collect()))
}

/// Submits a call's entries together and answers each in order, as `{"results":[...]}`.
async fn answer_entries(
    state: &AppState,
    shop: &Arc<str>,
    reqs: Vec<(Request, bool)>,
    fields: &[&'static str],
) -> Result<HttpResponse, ApiError> {
    let answers = submit(state, shop, reqs, fields).await?;
    #[derive(serde::Serialize)]
    struct EntriesBody<'a> {
        results: Vec<AnswerBody<'a>>,
    }
    Ok(HttpResponse::Ok().json(EntriesBody {
        results: answers.iter().map(Answer::body).collect(),
    }))
}

/// Longest reason code of an adjustment, in bytes.
pub const ADJUST_REASON_LEN_MAX: usize = 64;
/// The reason codes every shop has; a shop may use codes of its own as well.
pub const ADJUST_REASONS: [&str; 4] = ["restock", "damage", "correction", "transfer"];

/// An operator's reason code (`None`: left out or `null`): 1 to
/// [`ADJUST_REASON_LEN_MAX`] lowercase letters, digits, `_` or `-`.
pub(crate) fn reason_code<'a>(
    obj: &'a serde_json::Map<String, Value>,
    prefix: &str,
) -> Result<Option<&'a str>, ApiError> {
    match obj.get("reason") {
        Some(Value::String(r))
            if !r.is_empty()
                && r.len() <= ADJUST_REASON_LEN_MAX
                && r.bytes().all(|b| {
                    b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-'
                }) =>
        {
            Ok(Some(r.as_str()))
        }
        None | Some(Value::Null) => Ok(None),
        Some(_) => Err(ApiError::invalid(format!(
            "{prefix}reason: must be a code of 1 to {ADJUST_REASON_LEN_MAX} lowercase \
             letters, digits, '_' or '-' (one of {}, or the shop's own)",
            ADJUST_REASONS.join(", ")
        ))),
    }
}

/// One adjustment of `POST .../items/adjust`, validated: a keyed request that adds
/// `delta` (negative takes stock away) for the reason given.
fn adjustment(
    _: &HttpRequest,
    shop: &Arc<str>,
    v: &Value,
    prefix: &str,
) -> Result<(Request, bool), ApiError> {
    let Value::Object(obj) = v else {
        return Err(ApiError::invalid(format!(
            "{}: must be a JSON object",
            prefix.trim_end_matches('.')
        )));
    };
    let item = required_name(obj, "item", prefix)?;
    let delta = integer(obj, "delta", prefix, -QTY_MAX, QTY_MAX)?;
    if delta == 0 {
        return Err(ApiError::invalid(format!(
            "{prefix}delta: must not be 0 (an adjustment changes the stock)"
        )));
    }
    let Some(reason) = reason_code(obj, prefix)? else {
        return Err(ApiError::invalid(format!(
            "{prefix}reason: required: one of {} or a code of the shop's own",
            ADJUST_REASONS.join(", ")
        )));
    };
    let Some(key) = request_id(obj, prefix)? else {
        return Err(ApiError::invalid(format!(
            "{prefix}request_id: required (an adjustment is applied at most once)"
        )));
    };
    Ok((
        Request {
            reason: Some(reason.into()),
            ..Request::new(shop.clone(), item, key, Op::Adjust, delta, now_ms())
        },
        true,
    ))
}

/// `POST /v1/shops/{shop}/items/adjust` (operators): relative changes of stock with a
/// reason, each sequenced and journaled like any change, applied at most once by its
/// `request_id`, and never taking the stock below 0 (refused `insufficient_stock`).
/// Answers each adjustment's outcome in order, like a batch.
pub async fn post_adjust(
    state: web::Data<AppState>,
    path: web::Path<String>,
    http: HttpRequest,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    let shop = path_segment(&path, "shop")?;
    let body = json_body(&http, payload, BATCH_BODY_MAX).await?;
    let (reqs, fields) = entries(&http, &shop, &body.bytes, "adjustments", adjustment, |_| {
        "request_id"
    })?;
    drop(body);
    answer_entries(&state, &shop, reqs, &fields).await
}

pub async fn get_txn(
    state: web::Data<AppState>,
    path: web::Path<(String, String)>,
) -> Result<HttpResponse, ApiError> {
    let (shop, key) = path.into_inner();
    let shop = path_segment(&shop, "shop")?;
    let key = path_segment(&key, "request_key")?;
    match state.engine.poll(&shop, key.clone()).await? {
        PollResult::Decided(o) => Ok(crate::json_response(HttpResponse::Ok(), &*o)),
        PollResult::Pending => {
            Ok(HttpResponse::Accepted().json(json!({ "request_key": &*key, "status": "pending" })))
        }
        // With several nodes, a request taken by another node is in flight there, not
        // here, until it is decided: this node cannot tell it from one never sent.
        PollResult::Unknown if state.engine.shares_journal() => Err(ApiError::NotFound(format!(
            "request_key: no request {key} in shop {shop} is decided, and none is in flight \
             on this node; one accepted by another node is found here once it is decided"
        ))),
        PollResult::Unknown => Err(ApiError::NotFound(format!(
            "request_key: no request {key} in shop {shop}"
        ))),
    }
}
