//! `PUT /v1/shops/{shop}/settings`, `GET /v1/shops/{shop}/settings`,
//! `GET /v1/shops/{shop}/dead-letters`, `POST .../dead-letters/{id}/retry`,
//! `POST .../dead-letters/{id}/resolve` and `GET .../notifications`: a shop's check-back
//! before its holds and orders expire ([`nrtxn_actors::checkback`]), the checks it did
//! not answer ([`nrtxn_actors::dead_letters`]), and its stock alerts
//! (`nrtxn_checkback::alerts`). Operators only.

use actix_web::{web, HttpRequest, HttpResponse};
use nrtxn_actors::checkback::{
    CheckBack, CheckSettings, DeadLetter, NotifySettings, ShopSettings, ALERT_KINDS,
};
use nrtxn_actors::dead_letters::{Acted, LetterAction};
use nrtxn_actors::HOLD_TTL_MAX_MS;
use serde_json::{json, Map, Value};

use crate::error::ApiError;
use crate::validate::{integer, json_object, path_segment};
use crate::AppState;

/// Largest body of a settings call.
pub const SETTINGS_BODY_MAX: usize = 8 * 1024;
/// Longest `check_url`, in bytes.
pub const CHECK_URL_LEN_MAX: usize = 2_048;
/// Defaults of a check-back's settings.
pub const CHECK_TIMEOUT_MS_DEFAULT: i64 = 2_000;
pub const CHECK_RETRIES_DEFAULT: i64 = 3;
/// Most waits of a retry schedule.
pub const CHECK_RETRY_SCHEDULE_LEN_MAX: usize = 20;
/// Largest body of a dead letter's resolve call: one short field.
pub const RESOLVE_BODY_MAX: usize = 1024;

fn checkback(state: &AppState) -> Result<std::sync::Arc<dyn CheckBack>, ApiError> {
    state
        .engine
        .checkback()
        .ok_or_else(|| ApiError::Unavailable("check-backs are not available on this server".into()))
}

/// The fields of a check-back besides its URL.
const CHECK_FIELDS: [&str; 4] = [
    "check_timeout_ms",
    "check_retries",
    "check_default",
    "check_retry_schedule_ms",
];

/// A shop's settings once `body` is applied to what it has (`now`): a field left out
/// keeps its value, `null` sets a field's default, and `check_url: null` removes the
/// check-back, `notify_url: null` the alerts.
fn merged(now: ShopSettings, body: &Map<String, Value>) -> Result<ShopSettings, ApiError> {
    Ok(ShopSettings {
        check: check_of(now.check, body)?,
        notify: notify_of(now.notify, body)?,
    })
}

/// `field`'s URL: an `http://` or `https://` URL of at most [`CHECK_URL_LEN_MAX`] bytes.
fn url_of(field: &str, url: &str) -> Result<String, ApiError> {
    if url.len() > CHECK_URL_LEN_MAX {
        return Err(ApiError::invalid(format!(
            "{field}: longer than {CHECK_URL_LEN_MAX} bytes"
        )));
    }
    let scheme_ok = url.starts_with("http://") || url.starts_with("https://");
    let host_ok = url
        .split_once("://")
        .is_some_and(|(_, rest)| !rest.is_empty() && !rest.starts_with('/'));
    if !scheme_ok || !host_ok || url.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(ApiError::invalid(format!(
            "{field}: {url:?} is not an http:// or https:// URL"
        )));
    }
    Ok(url.to_string())
}

/// The check-back after `body`: `None` when it has none.
fn check_of(
    now: Option<CheckSettings>,
    body: &Map<String, Value>,
) -> Result<Option<CheckSettings>, ApiError> {
    let mut check = match (body.get("check_url"), now) {
        (Some(Value::Null), _) => return Ok(None),
        (Some(Value::String(u)), now) => CheckSettings {
            check_url: url_of("check_url", u)?,
            ..now.unwrap_or_else(check_defaults)
        },
        (Some(_), _) => return Err(ApiError::invalid("check_url: must be a string or null")),
        (None, Some(now)) => now,
        (None, None) => {
            return match CHECK_FIELDS.iter().find(|f| body.contains_key(**f)) {
                Some(f) => Err(ApiError::invalid(format!(
                    "check_url: required with {f} (the shop has no check-back)"
                ))),
                None => Ok(None),
            }
        }
    };
    let defaults = check_defaults();
    match body.get("check_timeout_ms") {
        None => {}
        Some(Value::Null) => check.check_timeout_ms = defaults.check_timeout_ms,
        Some(_) => {
            check.check_timeout_ms = integer(body, "check_timeout_ms", "", 100, 60_000)? as u64
        }
    }
    match body.get("check_retries") {
        None => {}
        Some(Value::Null) => check.check_retries = defaults.check_retries,
        Some(_) => check.check_retries = integer(body, "check_retries", "", 0, 10)? as u32,
    }
    match body.get("check_default") {
        None => {}
        Some(Value::Null) => check.check_default = defaults.check_default,
        Some(Value::String(d)) if d == "release" || d == "confirm" || d == "ask" => {
            check.check_default = d.clone()
        }
        Some(_) => {
            return Err(ApiError::invalid(
                "check_default: must be \"release\", \"confirm\" or \"ask\"",
            ))
        }
    }
    if body.contains_key("check_retry_schedule_ms") {
        check.check_retry_schedule_ms = schedule_of(body)?;
    }
    Ok(Some(check))
}

/// A new check-back's settings before its body's fields apply.
fn check_defaults() -> CheckSettings {
    CheckSettings {
        check_url: String::new(),
        check_timeout_ms: CHECK_TIMEOUT_MS_DEFAULT as u64,
        check_retries: CHECK_RETRIES_DEFAULT as u32,
        check_default: "release".to_string(),
        check_retry_schedule_ms: Vec::new(),
    }
}

/// The alerts after `body`: `None` when the shop has none.
fn notify_of(
    now: Option<NotifySettings>,
    body: &Map<String, Value>,
) -> Result<Option<NotifySettings>, ApiError> {
    let mut notify = match (body.get("notify_url"), now) {
        (Some(Value::Null), _) => return Ok(None),
        (Some(Value::String(u)), now) => NotifySettings {
            notify_url: url_of("notify_url", u)?,
            notify_events: now.map_or_else(all_kinds, |n| n.notify_events),
        },
        (Some(_), _) => return Err(ApiError::invalid("notify_url: must be a string or null")),
        (None, Some(now)) => now,
        (None, None) if body.contains_key("notify_events") => {
            return Err(ApiError::invalid(
                "notify_url: required with notify_events (the shop has no alerts)",
            ))
        }
        (None, None) => return Ok(None),
    };
    match body.get("notify_events") {
        None => {}
        Some(Value::Null) => notify.notify_events = all_kinds(),
        Some(Value::Array(kinds)) => notify.notify_events = kinds_of(kinds)?,
        Some(_) => {
            return Err(ApiError::invalid(format!(
                "notify_events: must be an array of {ALERT_KINDS:?}"
            )))
        }
    }
    Ok(Some(notify))
}

fn all_kinds() -> Vec<String> {
    ALERT_KINDS.iter().map(|k| k.to_string()).collect()
}

/// `notify_events`: at least one kind of [`ALERT_KINDS`], each once.
fn kinds_of(kinds: &[Value]) -> Result<Vec<String>, ApiError> {
    let mut out: Vec<String> = Vec::with_capacity(kinds.len());
    for (i, k) in kinds.iter().enumerate() {
        match k.as_str().filter(|k| ALERT_KINDS.contains(k)) {
            Some(k) if !out.iter().any(|o| o == k) => out.push(k.to_string()),
            Some(k) => {
                return Err(ApiError::invalid(format!(
                    "notify_events[{i}]: {k} appears more than once"
                )))
            }
            None => {
                return Err(ApiError::invalid(format!(
                    "notify_events[{i}]: must be one of {ALERT_KINDS:?}, got {k}"
                )))
            }
        }
    }
    if out.is_empty() {
        return Err(ApiError::invalid(format!(
            "notify_events: at least one of {ALERT_KINDS:?} (or notify_url null to remove the alerts)"
        )));
    }
    Ok(out)
}

/// `check_retry_schedule_ms`: the waits before each attempt after the first, at most
/// [`CHECK_RETRY_SCHEDULE_LEN_MAX`] of at least 1 ms, together within the 7-day life of
/// a hold (a check cannot outlive its hold). Absent, `null` or `[]`: quick retries.
fn schedule_of(body: &Map<String, Value>) -> Result<Vec<u64>, ApiError> {
    const FIELD: &str = "check_retry_schedule_ms";
    let waits = match body.get(FIELD) {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Array(a)) => a,
        Some(_) => {
            return Err(ApiError::invalid(format!(
                "{FIELD}: must be an array of waits in milliseconds"
            )))
        }
    };
    if waits.len() > CHECK_RETRY_SCHEDULE_LEN_MAX {
        return Err(ApiError::invalid(format!(
            "{FIELD}: at most {CHECK_RETRY_SCHEDULE_LEN_MAX} waits, got {}",
            waits.len()
        )));
    }
    let mut total_ms: i64 = 0;
    let mut out = Vec::with_capacity(waits.len());
    for (i, w) in waits.iter().enumerate() {
        let ms = match w.as_i64() {
            Some(ms) if (1..=HOLD_TTL_MAX_MS).contains(&ms) => ms,
            _ => {
                return Err(ApiError::invalid(format!(
                    "{FIELD}[{i}]: must be an integer from 1 to {HOLD_TTL_MAX_MS}, got {w}"
                )))
            }
        };
        total_ms = total_ms.saturating_add(ms);
        out.push(ms as u64);
    }
    if total_ms > HOLD_TTL_MAX_MS {
        return Err(ApiError::invalid(format!(
            "{FIELD}: the waits add up to {total_ms} ms, past the 7-day life of a hold \
             ({HOLD_TTL_MAX_MS} ms)"
        )));
    }
    Ok(out)
}

fn body_of(shop: &str, settings: &ShopSettings) -> Value {
    let mut body = match &settings.check {
        Some(s) => json!({
            "shop": shop,
            "check_url": s.check_url,
            "check_timeout_ms": s.check_timeout_ms,
            "check_retries": s.check_retries,
            "check_default": s.check_default,
            "check_retry_schedule_ms": s.check_retry_schedule_ms,
        }),
        None => json!({ "shop": shop, "check_url": null }),
    };
    match &settings.notify {
        Some(n) => {
            body["notify_url"] = json!(n.notify_url);
            body["notify_events"] = json!(n.notify_events);
        }
        None => body["notify_url"] = Value::Null,
    }
    body
}

pub async fn put_settings(
    state: web::Data<AppState>,
    path: web::Path<String>,
    http: HttpRequest,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    let shop = path_segment(&path, "shop")?;
    let body = json_object(&http, payload, SETTINGS_BODY_MAX).await?;
    crate::openapi::known_fields("Settings", &body)?;
    let checks = checkback(&state)?;
    let now = checks.settings(&shop).await.map_err(ApiError::store)?;
    let settings = merged(now, &body)?;
    // The server operator's rules on where a shop's calls may go.
    let urls = [
        ("check_url", settings.check.as_ref().map(|c| &c.check_url)),
        (
            "notify_url",
            settings.notify.as_ref().map(|n| &n.notify_url),
        ),
    ];
    for (field, url) in urls {
        if let Some(url) = url {
            checks
                .check_url(url)
                .map_err(|e| ApiError::invalid(format!("{field}: {e}")))?;
        }
    }
    let rotate = match body.get("rotate_secret") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(ApiError::invalid("rotate_secret: must be true or false")),
    };
    let secret = checks
        .set_settings(&shop, settings.clone(), rotate)
        .await
        .map_err(ApiError::store)?;
    let mut answer = body_of(&shop, &settings);
    if let Some(secret) = secret {
        // Shown this once: nrtxn signs every check-back call with it.
        answer["check_secret"] = json!(secret);
    }
    Ok(HttpResponse::Ok().json(answer))
}

pub async fn get_settings(
    state: web::Data<AppState>,
    path: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    let shop = path_segment(&path, "shop")?;
    let settings = checkback(&state)?
        .settings(&shop)
        .await
        .map_err(ApiError::store)?;
    Ok(HttpResponse::Ok().json(body_of(&shop, &settings)))
}

pub async fn get_dead_letters(
    state: web::Data<AppState>,
    path: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    let shop = path_segment(&path, "shop")?;
    let dead = checkback(&state)?
        .dead_letters(&shop)
        .await
        .map_err(ApiError::store)?;
    Ok(HttpResponse::Ok().json(json!({ "shop": &*shop, "dead_letters": dead })))
}

/// `GET .../notifications`: the shop's latest alerts that failed for good, oldest
/// first.
pub async fn get_notifications(
    state: web::Data<AppState>,
    path: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    let shop = path_segment(&path, "shop")?;
    let failed = checkback(&state)?
        .failed_alerts(&shop)
        .await
        .map_err(ApiError::store)?;
    Ok(HttpResponse::Ok().json(json!({ "shop": &*shop, "notifications": failed })))
}

/// Asks the shop again now about a dead letter's hold or order: its answer applies.
pub async fn retry_dead_letter(
    state: web::Data<AppState>,
    path: web::Path<(String, String)>,
) -> Result<HttpResponse, ApiError> {
    let (shop, id) = path.into_inner();
    let (shop, id) = (path_segment(&shop, "shop")?, path_segment(&id, "id")?);
    checkback(&state)?;
    let acted = state.engine.retry_dead_letter(&shop, &id).await?;
    answer_of(&shop, &id, acted)
}

/// Ends a dead letter's hold or order as the operator says: `{"action": "confirm"}` or
/// `{"action": "release"}`.
pub async fn resolve_dead_letter(
    state: web::Data<AppState>,
    path: web::Path<(String, String)>,
    http: HttpRequest,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    let (shop, id) = path.into_inner();
    let (shop, id) = (path_segment(&shop, "shop")?, path_segment(&id, "id")?);
    let body = json_object(&http, payload, RESOLVE_BODY_MAX).await?;
    crate::openapi::known_fields("Resolve", &body)?;
    let action = match body.get("action").and_then(Value::as_str) {
        Some("confirm") => LetterAction::Confirm,
        Some("release") => LetterAction::Release,
        _ => {
            return Err(ApiError::invalid(
                "action: required, \"confirm\" or \"release\"",
            ))
        }
    };
    checkback(&state)?;
    let acted = state.engine.resolve_dead_letter(&shop, &id, action).await?;
    answer_of(&shop, &id, acted)
}

/// The answer of an act on a dead letter: the letter and its hold's or order's status;
/// `409` with the reason (and the letter) when nothing was done.
fn answer_of(shop: &str, id: &str, acted: Acted) -> Result<HttpResponse, ApiError> {
    let letter = |l: &DeadLetter| serde_json::to_value(l).unwrap_or(Value::Null);
    match acted {
        Acted::Unknown => Err(ApiError::NotFound(format!(
            "id: no dead letter {id} in shop {shop}"
        ))),
        Acted::Refused(why, l) => Err(ApiError::Conflict(
            format!("id: {why}"),
            json!({ "shop": shop, "dead_letter": letter(&l) }),
        )),
        Acted::Done { letter: l, status } => Ok(HttpResponse::Ok().json(json!({
            "shop": shop,
            "dead_letter": letter(&l),
            "status": status,
        }))),
    }
}
