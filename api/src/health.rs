//! `GET /healthz`, `GET /readyz`, `GET /metrics`.

use actix_web::{web, HttpResponse};
use serde_json::json;

use crate::validate::BodyLimits;
use crate::AppState;

/// The process is up and answering.
pub async fn healthz() -> HttpResponse {
    HttpResponse::Ok().json(json!({ "status": "ok" }))
}

/// Ready to take requests: recovered, its request log reading, and not shutting down.
pub async fn readyz(state: web::Data<AppState>) -> HttpResponse {
    if state.engine.is_closing() {
        HttpResponse::ServiceUnavailable().json(json!({ "status": "shutting_down" }))
    } else if !state.engine.is_ready() {
        HttpResponse::ServiceUnavailable().json(json!({ "status": "starting" }))
    } else {
        HttpResponse::Ok().json(json!({ "status": "ready" }))
    }
}

pub async fn metrics(
    state: web::Data<AppState>,
    bodies: Option<web::Data<BodyLimits>>,
) -> HttpResponse {
    state.engine.publish_bounds();
    if let Some(bodies) = bodies {
        state
            .engine
            .metrics()
            .bound_used
            .with_label_values(&["body_bytes"])
            .set(bodies.held_bytes() as i64);
    }
    HttpResponse::Ok()
        .content_type("text/plain; version=0.0.4")
        .body(state.engine.metrics().render())
}
