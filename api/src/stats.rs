//! `GET /v1/shops/{shop}/stats`: the shop's live figures for the dashboard (operators):
//! decisions per second and their p99 over the last two minutes, the rate of each
//! outcome status, and the last refused requests. They are this node's
//! ([`nrtxn_actors::shop_stats`]).

use actix_web::{web, HttpResponse};
use nrtxn_actors::now_ms;

use crate::error::ApiError;
use crate::validate::path_segment;
use crate::AppState;

pub async fn get_stats(
    state: web::Data<AppState>,
    path: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    let shop = path_segment(&path, "shop")?;
    let view = state.engine.metrics().shops.view(&shop, now_ms());
    Ok(HttpResponse::Ok().json(view))
}
