//! `GET /v1/shops/{shop}/items/{item}/events?after=SEQ&limit=N`: an item's sequenced
//! event stream, read from the journal. A follower asks from the last `seq` it has and
//! fills any gap it sees from here.

use actix_web::{web, HttpResponse};
use nrtxn_actors::EVENTS_LIMIT_MAX;
use serde_json::{json, Map, Value};

use crate::error::ApiError;
use crate::validate::{integer, path_segment};
use crate::AppState;

/// Events per page when `limit` is not given.
const EVENTS_LIMIT_DEFAULT: i64 = 100;

pub async fn get_events(
    state: web::Data<AppState>,
    path: web::Path<(String, String)>,
    query: web::Query<Vec<(String, String)>>,
) -> Result<HttpResponse, ApiError> {
    let (shop, item) = path.into_inner();
    let shop = path_segment(&shop, "shop")?;
    let item = path_segment(&item, "item")?;
    let mut params = Map::new();
    for (k, v) in query.into_inner() {
        match k.as_str() {
            "after" | "limit" => {
                let n = v.parse::<i64>().map_err(|_| {
                    ApiError::invalid(format!("{k}: must be an integer, got {v:?}"))
                })?;
                params.insert(k, Value::from(n));
            }
            other => {
                return Err(ApiError::invalid(format!(
                    "{other}: unknown parameter (after, limit)"
                )))
            }
        }
    }
    let after = match params.get("after") {
        None => 0,
        Some(_) => integer(&params, "after", "", 0, i64::MAX)?,
    };
    let limit = match params.get("limit") {
        None => EVENTS_LIMIT_DEFAULT,
        Some(_) => integer(&params, "limit", "", 1, EVENTS_LIMIT_MAX as i64)?,
    };
    let events = state
        .engine
        .events(&shop, &item, after as u64, limit as usize)
        .await?;
    Ok(HttpResponse::Ok().json(json!({ "events": events })))
}
