//! `POST /v1/shops/{shop}/transfers` and `GET /v1/shops/{shop}/transfers/{request_id}`:
//! stock moved between two items of a shop, both sides or neither
//! ([`nrtxn_actors::transfers`]). Operators only.

use actix_web::{web, HttpRequest, HttpResponse};
use nrtxn_actors::transfers::{TransferView, Transferred};
use nrtxn_actors::{EngineError, QTY_MAX};
use serde_json::json;

use crate::error::ApiError;
use crate::validate::{integer, json_object, path_segment, request_id, required_name};
use crate::AppState;

/// Largest body of a transfer: a few short fields.
pub const TRANSFER_BODY_MAX: usize = 4 * 1024;

/// `{"request_id","from","to","qty","reason"}`: moves `qty` of `from`'s available stock
/// to `to`, at most once per `request_id`. `200` with `status` `ok`, or why nothing
/// moved (`insufficient_stock`, `unknown_item`, ...); `202` (`pending`) while under way.
pub async fn post_transfer(
    state: web::Data<AppState>,
    path: web::Path<String>,
    http: HttpRequest,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    let shop = path_segment(&path, "shop")?;
    let body = json_object(&http, payload, TRANSFER_BODY_MAX).await?;
    crate::openapi::known_fields("Transfer", &body)?;
    let Some(id) = request_id(&body, "")? else {
        return Err(ApiError::invalid(
            "request_id: required (a transfer is done at most once per request_id)",
        ));
    };
    let from = required_name(&body, "from", "")?;
    let to = required_name(&body, "to", "")?;
    if from == to {
        return Err(ApiError::invalid(format!(
            "to: must be another item than from ({from})"
        )));
    }
    let qty = integer(&body, "qty", "", 1, QTY_MAX)?;
    let reason = crate::txns::reason_code(&body, "")?.map(str::to_string);
    crate::trace::record_key(&id);
    let done = state
        .engine
        .transfer(&shop, &id, (from, to, qty), reason)
        .await;
    match done {
        Err(EngineError::Timeout) => {
            Ok(HttpResponse::Accepted().json(json!({ "request_id": &*id, "status": "pending" })))
        }
        Err(e) => Err(e.into()),
        Ok(Transferred::Reused(why, first)) => Err(ApiError::KeyReused(
            format!("request_id: {id} was first used by a transfer of {why}"),
            json!(first),
        )),
        Ok(Transferred::Done(view)) => Ok(answer(&view)),
    }
}

/// `GET .../transfers/{request_id}`: the transfer as it stands.
pub async fn get_transfer(
    state: web::Data<AppState>,
    path: web::Path<(String, String)>,
) -> Result<HttpResponse, ApiError> {
    let (shop, id) = path.into_inner();
    let shop = path_segment(&shop, "shop")?;
    let id = path_segment(&id, "request_id")?;
    match state.engine.transfer_view(&shop, &id).await? {
        Some(view) => Ok(answer(&view)),
        None => Err(ApiError::NotFound(format!(
            "request_id: no transfer {id} in shop {shop}"
        ))),
    }
}

fn answer(view: &TransferView) -> HttpResponse {
    match view.status.as_str() {
        "pending" => HttpResponse::Accepted().json(view),
        _ => HttpResponse::Ok().json(view),
    }
}
