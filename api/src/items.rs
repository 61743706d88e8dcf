//! `PUT /v1/shops/{shop}/items` (operators load stock) and `GET .../items/{item}`.

use std::collections::HashSet;
use std::sync::Arc;

use actix_web::{web, HttpRequest, HttpResponse};
use nrtxn_actors::{LOAD_ITEMS_MAX, STOCK_MAX};
use serde_json::{json, Value};

use crate::error::ApiError;
use crate::validate::{array, integer, json_object, path_segment, required_name};
use crate::AppState;

/// Largest body of a load: 10,000 items of up to about 300 bytes each.
pub const LOAD_BODY_MAX: usize = 4 * 1024 * 1024;

pub async fn put_items(
    state: web::Data<AppState>,
    path: web::Path<String>,
    http: HttpRequest,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    let shop = path_segment(&path, "shop")?;
    let body = json_object(&http, payload, LOAD_BODY_MAX).await?;
    let entries = array(&body, "items", LOAD_ITEMS_MAX)?;
    let mut seen: HashSet<Arc<str>> = HashSet::with_capacity(entries.len());
    let mut items = Vec::with_capacity(entries.len());
    for (i, v) in entries.iter().enumerate() {
        let prefix = format!("items[{i}].");
        let Value::Object(obj) = v else {
            return Err(ApiError::invalid(format!(
                "items[{i}]: must be a JSON object"
            )));
        };
        let item = required_name(obj, "item", &prefix)?;
        let stock = integer(obj, "stock", &prefix, 0, STOCK_MAX)?;
        if !seen.insert(item.clone()) {
            return Err(ApiError::invalid(format!(
                "items[{i}].item: {item} appears more than once"
            )));
        }
        items.push((item, stock));
    }
    let views = state.engine.load(&shop, items).await?;
    Ok(HttpResponse::Ok().json(json!({ "items": views })))
}

pub async fn get_item(
    state: web::Data<AppState>,
    path: web::Path<(String, String)>,
) -> Result<HttpResponse, ApiError> {
    let (shop, item) = path.into_inner();
    let shop = path_segment(&shop, "shop")?;
    let item = path_segment(&item, "item")?;
    match state.engine.item(&shop, &item).await? {
        Some(view) => Ok(HttpResponse::Ok().json(view)),
        None => Err(ApiError::NotFound(format!(
            "item: no item {item} in shop {shop}"
        ))),
    }
}
