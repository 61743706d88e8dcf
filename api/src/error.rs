//! Error bodies. Every error the API gives is JSON with an `error` code and a `detail`
//! that names the field and the reason.

use actix_web::http::StatusCode;
use actix_web::{HttpResponse, ResponseError};
use nrtxn_actors::EngineError;
use serde_json::json;

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// 400: the request is malformed; `detail` says which field and why.
    #[error("{0}")]
    Invalid(String),
    /// 404.
    #[error("{0}")]
    NotFound(String),
    /// 409: the request contradicts the state it found (a hold that already ended
    /// otherwise); the body carries that state beside the error.
    #[error("{0}")]
    Conflict(String, serde_json::Value),
    /// 429 with `Retry-After`: a bounded queue is full; nothing was applied.
    #[error("{0}")]
    Overloaded(String),
    /// 503 with `Retry-After`: shutting down or the store failed; nothing was applied.
    #[error("{0}")]
    Unavailable(String),
    /// 504: no answer within the reply timeout; the change may still be applied.
    #[error("{0}")]
    Timeout(String),
}

impl ApiError {
    pub fn invalid(detail: impl Into<String>) -> ApiError {
        ApiError::Invalid(detail.into())
    }
}

impl From<EngineError> for ApiError {
    fn from(e: EngineError) -> Self {
        match e {
            EngineError::Overloaded | EngineError::TooManyShops => {
                ApiError::Overloaded(e.to_string())
            }
            EngineError::ShuttingDown | EngineError::Store(_) => {
                ApiError::Unavailable(e.to_string())
            }
            EngineError::Timeout => ApiError::Timeout(e.to_string()),
        }
    }
}

impl ResponseError for ApiError {
    fn status_code(&self) -> StatusCode {
        match self {
            ApiError::Invalid(_) => StatusCode::BAD_REQUEST,
            ApiError::NotFound(_) => StatusCode::NOT_FOUND,
            ApiError::Conflict(..) => StatusCode::CONFLICT,
            ApiError::Overloaded(_) => StatusCode::TOO_MANY_REQUESTS,
            ApiError::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::Timeout(_) => StatusCode::GATEWAY_TIMEOUT,
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
        let (code, detail) = match self {
            ApiError::Invalid(d) => ("invalid_request", d),
            ApiError::NotFound(d) => ("not_found", d),
            ApiError::Conflict(d, _) => ("conflict", d),
            ApiError::Overloaded(d) => ("overloaded", d),
            ApiError::Unavailable(d) => ("unavailable", d),
            ApiError::Timeout(d) => ("timeout", d),
        };
        let mut res = HttpResponse::build(self.status_code());
        if matches!(self, ApiError::Overloaded(_) | ApiError::Unavailable(_)) {
            res.insert_header(("Retry-After", "1"));
        }
        res.json(json!({ "error": code, "detail": detail }))
    }
}
