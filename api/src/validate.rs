//! Parsing and validation of request bodies and path segments. Each check names the
//! field and the reason, so a caller can fix the request from the error alone.

use std::sync::Arc;

use actix_web::web;
use futures_util::StreamExt;
use nrtxn_actors::{now_ms, Op, Request, NAME_LEN_MAX, QTY_MAX, REMARKS_LEN_MAX};
use serde_json::{Map, Value};

use crate::error::ApiError;

/// Longest request key: a derived `{seller}:{item}:{req_time}` of three longest names.
pub const KEY_LEN_MAX: usize = 3 * NAME_LEN_MAX + 2;

/// Reads a body of at most `limit` bytes and parses it as a JSON object.
pub async fn json_object(
    mut payload: web::Payload,
    limit: usize,
) -> Result<Map<String, Value>, ApiError> {
    let mut body = web::BytesMut::new();
    while let Some(chunk) = payload.next().await {
        let chunk = chunk.map_err(|e| ApiError::invalid(format!("body: {e}")))?;
        if body.len() + chunk.len() > limit {
            return Err(ApiError::invalid(format!(
                "body: larger than the limit of {limit} bytes"
            )));
        }
        body.extend_from_slice(&chunk);
    }
    match serde_json::from_slice::<Value>(&body) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(_) => Err(ApiError::invalid("body: must be a JSON object")),
        Err(e) => Err(ApiError::invalid(format!("body: malformed JSON: {e}"))),
    }
}

fn check_name(s: &str, field: &str, max: usize) -> Result<(), ApiError> {
    if s.is_empty() {
        return Err(ApiError::invalid(format!("{field}: must not be empty")));
    }
    if s.len() > max {
        return Err(ApiError::invalid(format!(
            "{field}: longer than {max} bytes"
        )));
    }
    if s.chars().any(|c| c == '/' || c.is_control()) {
        return Err(ApiError::invalid(format!(
            "{field}: must not contain '/' or control characters"
        )));
    }
    Ok(())
}

/// A shop, item or key taken from the URL path.
pub fn path_segment(s: &str, field: &str) -> Result<Arc<str>, ApiError> {
    let max = if field == "request_key" {
        KEY_LEN_MAX
    } else {
        NAME_LEN_MAX
    };
    check_name(s, field, max)?;
    Ok(s.into())
}

/// A name field (seller, item, request id...): a string of 1 to 128 bytes.
pub fn name(
    obj: &Map<String, Value>,
    field: &str,
    prefix: &str,
) -> Result<Option<Arc<str>>, ApiError> {
    match obj.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => {
            check_name(s, &format!("{prefix}{field}"), NAME_LEN_MAX)?;
            Ok(Some(s.as_str().into()))
        }
        Some(_) => Err(ApiError::invalid(format!(
            "{prefix}{field}: must be a string"
        ))),
    }
}

pub fn required_name(
    obj: &Map<String, Value>,
    field: &str,
    prefix: &str,
) -> Result<Arc<str>, ApiError> {
    name(obj, field, prefix)?.ok_or_else(|| ApiError::invalid(format!("{prefix}{field}: required")))
}

/// An integer field within `min..=max`; fractions, strings and out-of-range numbers are
/// refused with the reason.
pub fn integer(
    obj: &Map<String, Value>,
    field: &str,
    prefix: &str,
    min: i64,
    max: i64,
) -> Result<i64, ApiError> {
    let f = format!("{prefix}{field}");
    match obj.get(field) {
        None | Some(Value::Null) => Err(ApiError::invalid(format!("{f}: required"))),
        Some(Value::Number(n)) => {
            if let Some(v) = n.as_i64() {
                if v < min {
                    Err(ApiError::invalid(format!(
                        "{f}: must be at least {min}, got {v}"
                    )))
                } else if v > max {
                    Err(ApiError::invalid(format!(
                        "{f}: must be at most {max}, got {v}"
                    )))
                } else {
                    Ok(v)
                }
            } else if n.is_u64() {
                Err(ApiError::invalid(format!(
                    "{f}: must be at most {max}, got {n}"
                )))
            } else {
                Err(ApiError::invalid(format!(
                    "{f}: must be an integer, got {n}"
                )))
            }
        }
        Some(other) => Err(ApiError::invalid(format!(
            "{f}: must be an integer, got {}",
            kind(other)
        ))),
    }
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// The entries of an array field, between 1 and `max` of them.
pub fn array<'a>(
    obj: &'a Map<String, Value>,
    field: &str,
    max: usize,
) -> Result<&'a Vec<Value>, ApiError> {
    match obj.get(field) {
        Some(Value::Array(a)) if a.is_empty() => {
            Err(ApiError::invalid(format!("{field}: must not be empty")))
        }
        Some(Value::Array(a)) if a.len() > max => Err(ApiError::invalid(format!(
            "{field}: at most {max} entries, got {}",
            a.len()
        ))),
        Some(Value::Array(a)) => Ok(a),
        None | Some(Value::Null) => Err(ApiError::invalid(format!("{field}: required"))),
        Some(other) => Err(ApiError::invalid(format!(
            "{field}: must be an array, got {}",
            kind(other)
        ))),
    }
}

/// A caller's `request_id`: a name that does not start with `~`, which marks the keys
/// nrtxn makes itself (loads, the endings of holds).
pub fn request_id(obj: &Map<String, Value>, prefix: &str) -> Result<Option<Arc<str>>, ApiError> {
    let id = name(obj, "request_id", prefix)?;
    if id.as_deref().is_some_and(|id| id.starts_with('~')) {
        return Err(ApiError::invalid(format!(
            "{prefix}request_id: must not start with '~' (reserved)"
        )));
    }
    Ok(id)
}

/// A transaction body, validated: the request and whether the caller waits (`respond`).
/// `prefix` locates the entry in a batch (`txns[3].`).
pub fn txn(shop: &Arc<str>, v: &Value, prefix: &str) -> Result<(Request, bool), ApiError> {
    let Value::Object(obj) = v else {
        let at = prefix.trim_end_matches('.');
        return Err(ApiError::invalid(format!(
            "{}: must be a JSON object",
            if at.is_empty() { "body" } else { at }
        )));
    };
    let seller = required_name(obj, "seller", prefix)?;
    let item = required_name(obj, "item", prefix)?;
    let buyer = name(obj, "buyer", prefix)?;
    let qty = integer(obj, "qty", prefix, 1, QTY_MAX)?;
    let op = match obj.get("op") {
        None | Some(Value::Null) => Op::Decrement,
        Some(Value::String(s)) if s == "decrement" => Op::Decrement,
        Some(Value::String(s)) if s == "increment" => Op::Increment,
        Some(_) => {
            return Err(ApiError::invalid(format!(
                "{prefix}op: must be \"decrement\" or \"increment\""
            )))
        }
    };
    let respond = match obj.get("respond") {
        None | Some(Value::Null) => true,
        Some(Value::Bool(b)) => *b,
        Some(Value::Number(n)) if n.as_u64() == Some(1) => true,
        Some(Value::Number(n)) if n.as_u64() == Some(0) => false,
        Some(_) => {
            return Err(ApiError::invalid(format!(
                "{prefix}respond: must be true, false, 1 or 0"
            )))
        }
    };
    let req_time: Option<String> = match obj.get("req_time") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => {
            check_name(s, &format!("{prefix}req_time"), NAME_LEN_MAX)?;
            Some(s.clone())
        }
        Some(Value::Number(n)) if n.is_i64() || n.is_u64() => Some(n.to_string()),
        Some(_) => {
            return Err(ApiError::invalid(format!(
                "{prefix}req_time: must be a string or an integer"
            )))
        }
    };
    let request_id = request_id(obj, prefix)?;
    let remarks = match obj.get("remarks") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) if s.len() <= REMARKS_LEN_MAX => Some(s.as_str().into()),
        Some(Value::String(_)) => {
            return Err(ApiError::invalid(format!(
                "{prefix}remarks: longer than {REMARKS_LEN_MAX} bytes"
            )))
        }
        Some(_) => {
            return Err(ApiError::invalid(format!(
                "{prefix}remarks: must be a string"
            )))
        }
    };
    let key: Arc<str> = match (request_id, req_time) {
        (Some(id), _) => id,
        (None, Some(t)) => format!("{seller}:{item}:{t}").into(),
        (None, None) => {
            return Err(ApiError::invalid(format!(
                "{prefix}req_time: required when request_id is absent (the request key is seller:item:req_time)"
            )))
        }
    };
    Ok((
        Request {
            seller: Some(seller),
            buyer,
            remarks,
            ..Request::new(shop.clone(), item, key, op, qty, now_ms())
        },
        respond,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse(v: Value) -> Result<(Request, bool), String> {
        txn(&"shop".into(), &v, "").map_err(|e| e.to_string())
    }

    #[test]
    fn natural_key_is_seller_item_req_time_and_request_id_replaces_it() {
        let (r, respond) =
            parse(json!({"seller": "s", "item": "i", "qty": 2, "req_time": 17})).unwrap();
        assert_eq!(
            (&*r.key, r.op, r.qty, respond),
            ("s:i:17", Op::Decrement, 2, true)
        );
        let (r, respond) = parse(
            json!({"seller": "s", "item": "i", "qty": 1, "req_time": "t",
            "request_id": "id-1", "op": "increment", "respond": 0}),
        )
        .unwrap();
        assert_eq!((&*r.key, r.op, respond), ("id-1", Op::Increment, false));
    }

    #[test]
    fn respond_accepts_booleans_and_one_or_zero_only() {
        for (v, expected) in [
            (json!(true), true),
            (json!(1), true),
            (json!(false), false),
            (json!(0), false),
        ] {
            let (_, respond) =
                parse(json!({"seller": "s", "item": "i", "qty": 1, "req_time": 1, "respond": v}))
                    .unwrap();
            assert_eq!(respond, expected);
        }
        let err =
            parse(json!({"seller": "s", "item": "i", "qty": 1, "req_time": 1, "respond": "true"}))
                .unwrap_err();
        assert!(err.starts_with("respond:"), "{err}");
    }

    #[test]
    fn batch_entries_are_named_by_their_position() {
        let err = txn(
            &"shop".into(),
            &json!({"seller": "s", "item": "i", "req_time": 1}),
            "txns[4].",
        )
        .unwrap_err()
        .to_string();
        assert_eq!(err, "txns[4].qty: required");
        let err = txn(&"shop".into(), &json!(5), "txns[2].")
            .unwrap_err()
            .to_string();
        assert_eq!(err, "txns[2]: must be a JSON object");
    }

    #[test]
    fn path_segments_allow_long_derived_keys_but_not_slashes() {
        let key = format!(
            "{}:{}:{}",
            "a".repeat(128),
            "b".repeat(128),
            "c".repeat(128)
        );
        assert!(path_segment(&key, "request_key").is_ok());
        assert!(path_segment(&key, "item").is_err());
        assert!(path_segment("a/b", "shop").is_err());
        assert!(path_segment("", "shop").is_err());
    }
}
