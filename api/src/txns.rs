//! `POST /v1/shops/{shop}/txns`, `POST .../txns/batch`, `GET .../txns/{request_key}`.

use std::sync::Arc;
use std::time::Duration;

use actix_web::{web, HttpResponse};
use nrtxn_actors::{Admission, Outcome, PollResult, Request, BATCH_TXNS_MAX};
use serde_json::{json, Value};
use tokio::time::Instant;

use crate::error::ApiError;
use crate::validate::{array, json_object, path_segment, txn};
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
        }
    }

    fn response(&self) -> HttpResponse {
        let mut res = match self {
            Answer::Outcome(_) => HttpResponse::Ok(),
            Answer::Accepted(_) => HttpResponse::Accepted(),
            Answer::Pending(_) => HttpResponse::GatewayTimeout(),
        };
        res.json(self.body())
    }
}

/// Submits requests of one shop and waits, until `deadline` at the latest, for what each
/// caller is owed: the outcome (respond=true), or durability (respond=false).
async fn submit(
    state: &AppState,
    shop: &Arc<str>,
    reqs: Vec<(Request, bool)>,
) -> Result<Vec<Answer>, ApiError> {
    let deadline = Instant::now() + Duration::from_millis(state.engine.config().reply_timeout_ms);
    let meta: Vec<(Arc<str>, bool)> = reqs
        .iter()
        .map(|(r, respond)| (r.key.clone(), *respond))
        .collect();
    let admitted = state.engine.submit(shop, reqs).await?;
    // Durability of this call's fire-and-forget requests comes first: a 202 is a promise.
    let durable = match admitted.durable {
        None => true,
        Some(rx) => match tokio::time::timeout_at(deadline, rx).await {
            Ok(Ok(Ok(()))) => true,
            Ok(Ok(Err(e))) => return Err(ApiError::Unavailable(e.to_string())),
            Ok(Err(_)) => return Err(ApiError::Unavailable("request log closed".into())),
            Err(_) => false,
        },
    };
    let mut answers = Vec::with_capacity(meta.len());
    for ((key, respond), admission) in meta.into_iter().zip(admitted.admissions) {
        answers.push(match admission {
            Admission::Decided(o) => Answer::Outcome(o),
            Admission::Accepted if durable => Answer::Accepted(key),
            Admission::Accepted => Answer::Pending(key),
            Admission::Wait(rx) => match tokio::time::timeout_at(deadline, rx).await {
                Ok(Ok(o)) if respond => Answer::Outcome(o),
                Ok(Ok(_)) => Answer::Accepted(key),
                Ok(Err(_)) | Err(_) => Answer::Pending(key),
            },
        });
    }
    Ok(answers)
}

pub async fn post_txn(
    state: web::Data<AppState>,
    path: web::Path<String>,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    let shop = path_segment(&path, "shop")?;
    let body = Value::Object(json_object(payload, TXN_BODY_MAX).await?);
    let req = txn(&shop, &body, "")?;
    let answers = submit(&state, &shop, vec![req]).await?;
    Ok(answers
        .first()
        .map(Answer::response)
        .unwrap_or_else(|| HttpResponse::InternalServerError().finish()))
}

pub async fn post_batch(
    state: web::Data<AppState>,
    path: web::Path<String>,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    let shop = path_segment(&path, "shop")?;
    let body = json_object(payload, BATCH_BODY_MAX).await?;
    let entries = array(&body, "txns", BATCH_TXNS_MAX)?;
    // Every entry is validated before any is submitted: a bad entry fails the whole call.
    let reqs = entries
        .iter()
        .enumerate()
        .map(|(i, v)| txn(&shop, v, &format!("txns[{i}].")))
        .collect::<Result<Vec<_>, _>>()?;
    let answers = submit(&state, &shop, reqs).await?;
    #[derive(serde::Serialize)]
    struct BatchBody<'a> {
        results: Vec<AnswerBody<'a>>,
    }
    Ok(HttpResponse::Ok().json(BatchBody {
        results: answers.iter().map(Answer::body).collect(),
    }))
}

pub async fn get_txn(
    state: web::Data<AppState>,
    path: web::Path<(String, String)>,
) -> Result<HttpResponse, ApiError> {
    let (shop, key) = path.into_inner();
    let shop = path_segment(&shop, "shop")?;
    let key = path_segment(&key, "request_key")?;
    match state.engine.poll(&shop, key.clone()).await? {
        PollResult::Decided(o) => Ok(HttpResponse::Ok().json(&*o)),
        PollResult::Pending => {
            Ok(HttpResponse::Accepted().json(json!({ "request_key": &*key, "status": "pending" })))
        }
        PollResult::Unknown => Err(ApiError::NotFound(format!(
            "request_key: no request {key} in shop {shop}"
        ))),
    }
}
