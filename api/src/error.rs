//! Error bodies. Every error the API gives is JSON with an `error` code and a `detail`
//! that names the field and the reason.

use actix_web::http::StatusCode;
use actix_web::{HttpResponse, ResponseError};
use nrtxn_actors::{EngineError, StoreError};
use serde_json::json;

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// 400: the request is malformed; `detail` says which field and why.
    #[error("{0}")]
    Invalid(String),
    /// 403 `forbidden`: the caller's key may not make this request (a seller's
    /// increment that is not a return); `detail` says why.
    #[error("{0}")]
    Forbidden(String),
    /// 404.
    #[error("{0}")]
    NotFound(String),
    /// 409: the request contradicts the state it found (a hold that already ended
    /// otherwise); the body carries that state beside the error.
    #[error("{0}")]
    Conflict(String, serde_json::Value),
    /// 409 `key_reused`: the request key was first used by a different request, whose
    /// outcome is given as `original`; nothing was applied.
    #[error("{0}")]
    KeyReused(String, serde_json::Value),
    /// 429 with `Retry-After`: a bounded queue is full; nothing was applied.
    #[error("{0}")]
    Overloaded(String),
    /// 429 `rate_limited` with `Retry-After` (whole seconds, the second field): the
    /// shop's token bucket has too few tokens for the work of this call.
    #[error("{0}")]
    RateLimited(String, u64),
    /// 503 with `Retry-After`: shutting down or the store failed; nothing was applied.
    #[error("{0}")]
    Unavailable(String),
    /// 503 `disk_full` with `Retry-After`: the server's disk has no room for new writes
    /// (or for the views a read waits for); nothing was applied.
    #[error("{0}")]
    DiskFull(String),
    /// 504: no answer within the reply timeout; the change may still be applied.
    #[error("{0}")]
    Timeout(String),
    /// 408: the request's body did not arrive whole within the read timeout.
    #[error("{0}")]
    BodyTimeout(String),
    /// 415: a body that is not declared `application/json`.
    #[error("{0}")]
    UnsupportedMediaType(String),
}

impl ApiError {
    pub fn invalid(detail: impl Into<String>) -> ApiError {
        ApiError::Invalid(detail.into())
    }

    /// 503 for a store that failed: the store's own message (a file path, an SQL error)
    /// goes to the log, not to the caller.
    pub fn store(e: impl std::fmt::Display) -> ApiError {
        tracing::error!(error = %e, "store error answered with 503");
        ApiError::Unavailable("the store is unavailable; retry later".into())
    }

    /// 409 for an ending (`Op::Confirm` or a cancel) of something that already ended
    /// otherwise: `"{field}: {what} {id} is {status}, it cannot be confirmed"`, with
    /// its state `body` beside the error.
    pub fn ending_conflict(
        field: &str,
        what: &str,
        id: &str,
        status: &str,
        op: nrtxn_actors::Op,
        body: serde_json::Value,
    ) -> ApiError {
        let asked = if op == nrtxn_actors::Op::Confirm {
            "confirmed"
        } else {
            "cancelled"
        };
        ApiError::Conflict(
            format!("{field}: {what} {id} is {status}, it cannot be {asked}"),
            body,
        )
    }

    /// 409 `key_reused` when `req` differs from the request that first used its key
    /// (whose outcome is `first`); `key_field` names where the key came from
    /// (`request_id`, or `request_key` for one derived from seller, item and req_time).
    pub fn reused(
        req: &nrtxn_actors::Request,
        first: &nrtxn_actors::Outcome,
        key_field: &str,
    ) -> Option<ApiError> {
        let diff = req.reuse_conflict(first)?;
        Some(ApiError::KeyReused(
            format!(
                "{key_field}: {} was first used with {diff}",
                first.request_key
            ),
            serde_json::to_value(first).unwrap_or(serde_json::Value::Null),
        ))
    }
}

impl From<EngineError> for ApiError {
    fn from(e: EngineError) -> Self {
        match e {
            EngineError::Overloaded | EngineError::TooManyShops => {
                ApiError::Overloaded(e.to_string())
            }
            EngineError::ShuttingDown => ApiError::Unavailable(e.to_string()),
            EngineError::NotReadInTime(why) => {
                tracing::warn!(%why, "a read outlasted the reply timeout: answered 503");
                ApiError::Unavailable(why)
            }
            // Said once in the log when the disk fills, not once per refused call.
            EngineError::Store(StoreError::DiskFull) => ApiError::DiskFull(
                "the server's disk is full: writes are refused (and reads of the latest \
                 writes may be) until its operator frees space; nothing of this call was \
                 applied"
                    .into(),
            ),
            EngineError::Store(e) => ApiError::store(e),
            EngineError::Timeout => ApiError::Timeout(e.to_string()),
        }
    }
}

impl ResponseError for ApiError {
    fn status_code(&self) -> StatusCode {
        match self {
            ApiError::Invalid(_) => StatusCode::BAD_REQUEST,
            ApiError::Forbidden(_) => StatusCode::FORBIDDEN,
            ApiError::NotFound(_) => StatusCode::NOT_FOUND,
            ApiError::Conflict(..) | ApiError::KeyReused(..) => StatusCode::CONFLICT,
            ApiError::Overloaded(_) | ApiError::RateLimited(..) => StatusCode::TOO_MANY_REQUESTS,
            ApiError::Unavailable(_) | ApiError::DiskFull(_) => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::Timeout(_) => StatusCode::GATEWAY_TIMEOUT,
            ApiError::BodyTimeout(_) => StatusCode::REQUEST_TIMEOUT,
            ApiError::UnsupportedMediaType(_) => StatusCode::UNSUPPORTED_MEDIA_TYPE,
        }
    }

    fn error_response(&self) -> HttpResponse {
        if let ApiError::Conflict(detail, state) = self {
            let mut body = match state {
                serde_json::Value::Object(m) => m.clone(),
                _ => serde_json::Map::new(),
            };
            body.insert("error".into(), json!("conflict"));
            body.insert("detail".into(), json!(detail));
            return HttpResponse::Conflict().json(body);
        }
        if let ApiError::KeyReused(detail, original) = self {
            return HttpResponse::Conflict()
                .json(json!({ "error": "key_reused", "detail": detail, "original": original }));
        }
        let (code, detail) = match self {
            ApiError::Invalid(d) => ("invalid_request", d),
            ApiError::Forbidden(d) => ("forbidden", d),
            ApiError::NotFound(d) => ("not_found", d),
            ApiError::Conflict(d, _) => ("conflict", d),
            ApiError::KeyReused(d, _) => ("key_reused", d),
            ApiError::Overloaded(d) => ("overloaded", d),
            ApiError::RateLimited(d, _) => ("rate_limited", d),
            ApiError::Unavailable(d) => ("unavailable", d),
            ApiError::DiskFull(d) => ("disk_full", d),
            ApiError::Timeout(d) => ("timeout", d),
            ApiError::BodyTimeout(d) => ("body_timeout", d),
            ApiError::UnsupportedMediaType(d) => ("unsupported_media_type", d),
        };
        let mut res = HttpResponse::build(self.status_code());
        match self {
            ApiError::Overloaded(_) | ApiError::Unavailable(_) => {
                res.insert_header(("Retry-After", "1"));
            }
            // Room comes back only when someone frees it: sooner retries would only
            // be refused again.
            ApiError::DiskFull(_) => {
                res.insert_header(("Retry-After", "5"));
            }
            ApiError::RateLimited(_, retry_after_s) => {
                res.insert_header(("Retry-After", retry_after_s.to_string()));
            }
            _ => {}
        }
        res.json(json!({ "error": code, "detail": detail }))
    }
}
