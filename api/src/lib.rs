//! nrtxn's HTTP front: routes, validation, error bodies and the metrics endpoint.
//! One file per route group; the engine behind it is [`nrtxn_actors::Engine`].

use std::sync::Arc;

use actix_web::body::MessageBody;
use actix_web::dev::{ServiceRequest, ServiceResponse};
use actix_web::middleware::Next;
use actix_web::{web, HttpResponse};
use nrtxn_actors::Engine;
use serde_json::json;

pub mod auth;
pub mod error;
pub mod events;
pub mod health;
pub mod holds;
pub mod items;
pub mod orders;
pub mod settings;
pub mod stream;
pub mod trace;
pub mod txns;
pub mod validate;

pub use error::ApiError;

/// What every handler shares.
pub struct AppState {
    pub engine: Arc<Engine>,
    /// Where `GET .../events/stream` reads the shops' events (`None`: no stream here).
    pub feed: Option<Arc<dyn nrtxn_actors::EventFeed>>,
}

/// Registers every route.
pub fn configure(cfg: &mut web::ServiceConfig) {
    cfg.route("/healthz", web::get().to(health::healthz))
        .route("/readyz", web::get().to(health::readyz))
        .route("/metrics", web::get().to(health::metrics))
        .route("/v1/shops/{shop}/items", web::put().to(items::put_items))
        .route("/v1/shops/{shop}/items", web::get().to(items::list_items))
        .route(
            "/v1/shops/{shop}/items/adjust",
            web::post().to(txns::post_adjust),
        )
        .route(
            "/v1/shops/{shop}/items/{item}",
            web::get().to(items::get_item),
        )
        .route(
            "/v1/shops/{shop}/loads/{request_id}",
            web::get().to(items::get_load),
        )
        .route("/v1/shops/{shop}/txns", web::post().to(txns::post_txn))
        .route(
            "/v1/shops/{shop}/txns/batch",
            web::post().to(txns::post_batch),
        )
        .route(
            "/v1/shops/{shop}/txns/{request_key}",
            web::get().to(txns::get_txn),
        )
        .route(
            "/v1/shops/{shop}/items/{item}/events",
            web::get().to(events::get_events),
        )
        .route(
            "/v1/shops/{shop}/events/stream",
            web::get().to(stream::get_stream),
        )
        .route("/v1/shops/{shop}/holds", web::post().to(holds::post_hold))
        .route(
            "/v1/shops/{shop}/holds/{hold_id}",
            web::get().to(holds::get_hold),
        )
        .route(
            "/v1/shops/{shop}/holds/{hold_id}/confirm",
            web::post().to(holds::confirm_hold),
        )
        .route(
            "/v1/shops/{shop}/holds/{hold_id}/cancel",
            web::post().to(holds::cancel_hold),
        )
        .route(
            "/v1/shops/{shop}/orders",
            web::post().to(orders::post_order),
        )
        .route(
            "/v1/shops/{shop}/orders/{order_id}",
            web::get().to(orders::get_order),
        )
        .route(
            "/v1/shops/{shop}/orders/{order_id}/confirm",
            web::post().to(orders::confirm_order),
        )
        .route(
            "/v1/shops/{shop}/orders/{order_id}/cancel",
            web::post().to(orders::cancel_order),
        )
        .route(
            "/v1/shops/{shop}/settings",
            web::put().to(settings::put_settings),
        )
        .route(
            "/v1/shops/{shop}/settings",
            web::get().to(settings::get_settings),
        )
        .route(
            "/v1/shops/{shop}/dead-letters",
            web::get().to(settings::get_dead_letters),
        )
        .default_service(web::to(not_found));
}

async fn not_found() -> HttpResponse {
    HttpResponse::NotFound().json(json!({ "error": "not_found", "detail": "no such route" }))
}

/// Middleware: counts every answer by route pattern and status.
pub async fn count_requests(
    req: ServiceRequest,
    next: Next<impl MessageBody>,
) -> Result<ServiceResponse<impl MessageBody>, actix_web::Error> {
    let state = req.app_data::<web::Data<AppState>>().cloned();
    let res = next.call(req).await?;
    if let Some(state) = state {
        let route = res
            .request()
            .match_pattern()
            .unwrap_or_else(|| "unmatched".into());
        state
            .engine
            .metrics()
            .http_requests
            .with_label_values(&[route.as_str(), res.status().as_str()])
            .inc();
    }
    Ok(res)
}
