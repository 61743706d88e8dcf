//! Parsing and validation of request bodies and path segments. Each check names the
//! field and the reason, so a caller can fix the request from the error alone.

use std::sync::Arc;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use actix_web::body::{EitherBody, MessageBody};
use actix_web::dev::{ServiceRequest, ServiceResponse};
use actix_web::middleware::Next;
use actix_web::{web, HttpRequest, ResponseError};
use futures_util::StreamExt;
use nrtxn_actors::{now_ms, Op, Request, NAME_LEN_MAX, QTY_MAX, REMARKS_LEN_MAX};
use serde_json::{Map, Value};

use crate::error::ApiError;

/// Longest request key: a derived `{seller}:{item}:{req_time}` of three longest names.
pub const KEY_LEN_MAX: usize = 3 * NAME_LEN_MAX + 2;

/// How request bodies are read: every handler that takes a body reads it through
/// [`json_object`] with these bounds, kept in the app's data.
#[derive(Debug)]
pub struct BodyLimits {
    /// A body must arrive whole within this long of the handler starting to read it:
    /// headers have their own timeout in actix-web, bodies have none, and a body that
    /// never completes would hold its buffer (up to 4 MiB) for ever.
    pub read_timeout: Duration,
    /// Bytes of request bodies held at once, in all; a body that would pass it is
    /// refused with 429 before it is buffered.
    pub held_bytes_max: usize,
    /// Bytes of bodies held now.
    held_bytes: AtomicUsize,
}

impl BodyLimits {
    pub fn new(read_timeout: Duration, held_bytes_max: usize) -> BodyLimits {
        BodyLimits {
            read_timeout,
            held_bytes_max,
            held_bytes: AtomicUsize::new(0),
        }
    }

    /// Bytes of bodies held now.
    pub fn held_bytes(&self) -> usize {
        self.held_bytes.load(Ordering::Relaxed)
    }
}

/// Bytes of the body budget taken by one body being read; given back when dropped.
struct Held<'a> {
    limits: &'a BodyLimits,
    bytes: usize,
}

impl Held<'_> {
    fn grow(&mut self, n: usize) -> Result<(), ApiError> {
        let prev = self.limits.held_bytes.fetch_add(n, Ordering::AcqRel);
        self.bytes += n;
        if prev + n > self.limits.held_bytes_max {
            return Err(ApiError::Overloaded(format!(
                "body: the server holds {} bytes of request bodies, its limit; retry later",
                self.limits.held_bytes_max
            )));
        }
        Ok(())
    }
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        self.limits
            .held_bytes
            .fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

/// Reads a body of at most `limit` bytes and parses it as a JSON object. The body must
/// be declared `application/json` (so a browser's cross-site form post is refused), be
/// valid JSON with no key repeated in any object, and arrive within the read timeout.
pub async fn json_object(
    req: &HttpRequest,
    mut payload: web::Payload,
    limit: usize,
) -> Result<Map<String, Value>, ApiError> {
    check_content_type(req)?;
    let limits = req
        .app_data::<web::Data<BodyLimits>>()
        .map(|d| d.clone().into_inner())
        .unwrap_or_else(|| Arc::new(BodyLimits::new(Duration::from_secs(10), usize::MAX)));
    let mut held = Held {
        limits: &limits,
        bytes: 0,
    };
    let mut body = web::BytesMut::new();
    let read = async {
        while let Some(chunk) = payload.next().await {
            let chunk = chunk.map_err(|e| ApiError::invalid(format!("body: {e}")))?;
            if body.len() + chunk.len() > limit {
                return Err(ApiError::invalid(format!(
                    "body: larger than the limit of {limit} bytes"
                )));
            }
            held.grow(chunk.len())?;
            body.extend_from_slice(&chunk);
        }
        Ok(())
    };
    match tokio::time::timeout(limits.read_timeout, read).await {
        Ok(result) => result?,
        Err(_) => {
            return Err(ApiError::BodyTimeout(format!(
                "body: not received whole within {} ms",
                limits.read_timeout.as_millis()
            )))
        }
    }
    let parsed = decode_object(&body);
    drop(body);
    drop(held);
    parsed
}

/// A body's bytes as a JSON object, or a 400 that says why (`body: ...`): malformed or
/// not UTF-8, a key repeated in an object, nested deeper than serde_json's limit of
/// 128, or not an object.
pub fn decode_object(body: &[u8]) -> Result<Map<String, Value>, ApiError> {
    match serde_json::from_slice::<Strict>(body) {
        Ok(Strict(Value::Object(map))) => Ok(map),
        Ok(_) => Err(ApiError::invalid("body: must be a JSON object")),
        Err(e) => Err(ApiError::invalid(format!("body: malformed JSON: {e}"))),
    }
}

/// A body must say it is JSON: `application/json`, with parameters (`; charset=utf-8`)
/// allowed. Browsers send cross-site "simple" requests only as forms or text, so this
/// also keeps a page on another site from posting to nrtxn with a user's cookies or
/// network position.
fn check_content_type(req: &HttpRequest) -> Result<(), ApiError> {
    let value = req
        .headers()
        .get(actix_web::http::header::CONTENT_TYPE)
        .map(|v| v.to_str().unwrap_or("(not text)"));
    let essence = value
        .map(|v| {
            v.split(';')
                .next()
                .unwrap_or("")
                .trim()
                .to_ascii_lowercase()
        })
        .unwrap_or_default();
    if essence == "application/json" {
        // JSON is UTF-8 (RFC 8259): a body declared in another charset would be read
        // as something its sender did not write.
        let charset = value.and_then(|v| {
            v.split(';').skip(1).find_map(|p| {
                let (k, v) = p.split_once('=')?;
                k.trim()
                    .eq_ignore_ascii_case("charset")
                    .then(|| v.trim().trim_matches('"').to_ascii_lowercase())
            })
        });
        return match charset.as_deref() {
            None | Some("utf-8") | Some("utf8") => Ok(()),
            Some(other) => Err(ApiError::UnsupportedMediaType(format!(
                "content-type: charset {other} is not supported: a JSON body is UTF-8"
            ))),
        };
    }
    Err(ApiError::UnsupportedMediaType(format!(
        "content-type: must be application/json, got {}",
        value.unwrap_or("none")
    )))
}

/// A JSON value parsed with every object's keys checked for repeats: serde_json keeps
/// the last of two equal keys, so `{"qty":1,"qty":9}` would be read as 9 without a word.
struct Strict(Value);

impl<'de> serde::Deserialize<'de> for Strict {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Strict, D::Error> {
        d.deserialize_any(StrictVisitor).map(Strict)
    }
}

struct StrictVisitor;

impl<'de> serde::de::Visitor<'de> for StrictVisitor {
    type Value = Value;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a JSON value")
    }
    fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }
    fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
        Ok(Value::from(v))
    }
    fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
        Ok(Value::from(v))
    }
    fn visit_f64<E>(self, v: f64) -> Result<Value, E> {
        Ok(serde_json::Number::from_f64(v).map_or(Value::Null, Value::Number))
    }
    fn visit_str<E>(self, v: &str) -> Result<Value, E> {
        Ok(Value::String(v.to_owned()))
    }
    fn visit_string<E>(self, v: String) -> Result<Value, E> {
        Ok(Value::String(v))
    }
    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_none<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(4096));
        while let Some(Strict(v)) = seq.next_element()? {
            out.push(v);
        }
        Ok(Value::Array(out))
    }
    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut out = Map::new();
        while let Some(key) = map.next_key::<String>()? {
            let Strict(v) = map.next_value()?;
            if out.contains_key(&key) {
                return Err(serde::de::Error::custom(format!(
                    "key {key:?} appears more than once in an object"
                )));
            }
            out.insert(key, v);
        }
        Ok(Value::Object(out))
    }
}

/// Middleware: refuses a path whose %-escapes do not decode to UTF-8. The router would
/// decode them to U+FFFD, so two distinct names would become one shop or item.
pub async fn utf8_paths(
    req: ServiceRequest,
    next: Next<impl MessageBody + 'static>,
) -> Result<ServiceResponse<EitherBody<impl MessageBody>>, actix_web::Error> {
    if let Err(e) = percent_decoded_utf8(req.uri().path()) {
        let res = e.error_response();
        return Ok(req.into_response(res).map_into_right_body());
    }
    Ok(next.call(req).await?.map_into_left_body())
}

/// Checks that `path` percent-decodes to valid UTF-8.
fn percent_decoded_utf8(path: &str) -> Result<(), ApiError> {
    std::str::from_utf8(&percent_decoded(path))
        .map(|_| ())
        .map_err(|_| ApiError::invalid("path: a %-escaped name does not decode to UTF-8"))
}

/// The bytes `s` names once its `%XX` escapes are decoded (a `%` without two hex digits
/// after it stays as it is, as actix-web's router leaves it).
pub fn percent_decoded(s: &str) -> Vec<u8> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = |b: u8| (b as char).to_digit(16);
        match (
            bytes[i],
            bytes.get(i + 1).copied().and_then(hex),
            bytes.get(i + 2).copied().and_then(hex),
        ) {
            (b'%', Some(hi), Some(lo)) => {
                out.push((hi * 16 + lo) as u8);
                i += 3;
            }
            (b, _, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    out
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
    let return_of = match obj.get("return_of") {
        None | Some(Value::Null) => None,
        Some(Value::String(k)) => {
            let field = format!("{prefix}return_of");
            check_name(k, &field, KEY_LEN_MAX)?;
            if k.starts_with('~') {
                return Err(ApiError::invalid(format!(
                    "{field}: must be the request key of a sale, which never starts with '~'"
                )));
            }
            if op != Op::Increment {
                return Err(ApiError::invalid(format!(
                    "{field}: only an increment (a return) names the sale it returns, \
                     not a decrement"
                )));
            }
            Some(Arc::<str>::from(k.as_str()))
        }
        Some(_) => {
            return Err(ApiError::invalid(format!(
                "{prefix}return_of: must be a string, the request key of the sale returned"
            )))
        }
    };
    let min_qty = min_qty(obj, prefix, op, qty)?;
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
            return_of,
            min_qty,
            ..Request::new(shop.clone(), item, key, op, qty, now_ms())
        },
        respond,
    ))
}

/// A sale's or hold's `min_qty` (a partial fill, `1 ≤ min_qty ≤ qty`), if it has one.
pub fn min_qty(
    obj: &Map<String, Value>,
    prefix: &str,
    op: Op,
    qty: i64,
) -> Result<Option<i64>, ApiError> {
    match obj.get("min_qty") {
        None | Some(Value::Null) => Ok(None),
        Some(_) if !matches!(op, Op::Decrement | Op::Hold) => Err(ApiError::invalid(format!(
            "{prefix}min_qty: only a decrement or a hold may take part of its qty, not an {}",
            op.as_str()
        ))),
        Some(_) => integer(obj, "min_qty", prefix, 1, qty).map(Some),
    }
}

/// A listing's `limit` query parameter: an integer from 1 to `max`, named in its error.
pub fn limit_param(v: &str, max: usize) -> Result<usize, ApiError> {
    let n = v
        .parse::<i64>()
        .map_err(|_| ApiError::invalid(format!("limit: must be an integer, got {v:?}")))?;
    let params = Map::from_iter([("limit".to_string(), Value::from(n))]);
    Ok(integer(&params, "limit", "", 1, max as i64)? as usize)
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
    fn return_of_names_a_sale_on_increments_only() {
        let base = json!({"seller": "s", "item": "i", "qty": 1, "request_id": "r-1",
            "op": "increment", "return_of": "s:i:17"});
        let (r, _) = parse(base.clone()).unwrap();
        assert_eq!(r.return_of.as_deref(), Some("s:i:17"));
        let mut sale = base.clone();
        sale["op"] = json!("decrement");
        assert!(parse(sale)
            .unwrap_err()
            .starts_with("return_of: only an increment"));
        let mut default_op = base.clone();
        default_op.as_object_mut().unwrap().remove("op");
        assert!(parse(default_op).unwrap_err().starts_with("return_of:"));
        for bad in [
            json!(""),
            json!("~end:h"),
            json!("a/b"),
            json!(7),
            json!("k".repeat(387)),
        ] {
            let mut v = base.clone();
            v["return_of"] = bad.clone();
            let e = parse(v).unwrap_err();
            assert!(e.starts_with("return_of:"), "{bad}: {e}");
        }
        let mut none = base;
        none["return_of"] = Value::Null;
        assert_eq!(parse(none).unwrap().0.return_of, None);
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

/// Request decoding and validation over arbitrary input (issue 14's fuzz target, run as
/// proptest cases: `PROPTEST_CASES` sets how many, 2,000 by default). Whatever the bytes,
/// the answer is a request within its bounds or a 400 whose detail names the field at
/// fault: never a panic, never another status.
#[cfg(test)]
mod fuzz {
    use super::*;
    use actix_web::ResponseError;
    use proptest::prelude::*;
    use serde_json::json;

    /// The fields a transaction body has, and the body itself.
    const FIELDS: [&str; 10] = [
        "body",
        "seller",
        "item",
        "buyer",
        "qty",
        "op",
        "respond",
        "req_time",
        "request_id",
        "remarks",
    ];

    fn cases() -> u32 {
        std::env::var("PROPTEST_CASES")
            .ok()
            .and_then(|c| c.parse().ok())
            .unwrap_or(2_000)
    }

    /// The error is a 400 whose detail starts with the name of a field and a colon.
    fn names_a_field(e: &ApiError) -> Result<(), TestCaseError> {
        prop_assert_eq!(e.status_code().as_u16(), 400, "{}", e);
        let detail = e.to_string();
        let field = detail.split(':').next().unwrap_or("");
        prop_assert!(FIELDS.contains(&field), "no field named: {}", detail);
        Ok(())
    }

    /// Any JSON value: leaves of every type (strings with control characters, NUL and
    /// astral characters, long ones; integers and floats at their extremes), nested
    /// up to 4 deep.
    fn value() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(Value::from),
            any::<u64>().prop_map(Value::from),
            any::<f64>()
                .prop_map(|f| serde_json::Number::from_f64(f).map_or(Value::Null, Value::Number)),
            prop_oneof![
                Just(0i64),
                Just(1),
                Just(-1),
                Just(QTY_MAX),
                Just(QTY_MAX + 1)
            ]
            .prop_map(Value::from),
            ".{0,40}".prop_map(Value::String),
            "[a-z0-9~:/%-]{0,300}".prop_map(Value::String),
        ];
        leaf.prop_recursive(4, 32, 6, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
                prop::collection::btree_map(".{0,8}", inner, 0..6)
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    /// A transaction body: each field present or not, with a plausible or an arbitrary
    /// value, and now and then a field no transaction has.
    fn txn_body() -> impl Strategy<Value = Value> {
        let plausible = |field: &'static str| -> BoxedStrategy<Value> {
            match field {
                "qty" => (-3i64..QTY_MAX + 3).prop_map(Value::from).boxed(),
                "op" => prop_oneof![Just("decrement"), Just("increment"), Just("hold"), Just("")]
                    .prop_map(Value::from)
                    .boxed(),
                "respond" => prop_oneof![Just(json!(true)), Just(json!(0)), Just(json!(2))].boxed(),
                _ => "[a-z0-9-]{0,12}".prop_map(Value::String).boxed(),
            }
        };
        let fields: Vec<BoxedStrategy<Option<(String, Value)>>> = FIELDS[1..]
            .iter()
            .map(|&f| {
                prop::option::weighted(
                    0.8,
                    prop_oneof![3 => plausible(f), 1 => value()]
                        .prop_map(move |v| (f.to_string(), v)),
                )
                .boxed()
            })
            .collect();
        (fields, prop::option::of((".{0,8}", value()))).prop_map(|(fields, extra)| {
            let mut obj: Map<String, Value> = fields.into_iter().flatten().collect();
            if let Some((k, v)) = extra {
                obj.entry(k).or_insert(v);
            }
            Value::Object(obj)
        })
    }

    fn check_txn(body: &Value) -> Result<(), TestCaseError> {
        match txn(&"shop".into(), body, "") {
            Ok((req, _)) => {
                prop_assert!((1..=QTY_MAX).contains(&req.qty), "qty {}", req.qty);
                prop_assert!(!req.key.is_empty() && req.key.len() <= KEY_LEN_MAX);
                prop_assert!(!req.item.is_empty() && req.item.len() <= NAME_LEN_MAX);
                prop_assert!(matches!(req.op, Op::Decrement | Op::Increment));
            }
            Err(e) => names_a_field(&e)?,
        }
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: cases(), ..ProptestConfig::default() })]

        #[test]
        fn any_bytes_decode_to_an_object_or_a_400_about_the_body(
            bytes in prop_oneof![
                prop::collection::vec(any::<u8>(), 0..600),
                // Near-JSON: a valid body with bytes cut, flipped or added.
                (txn_body(), any::<prop::sample::Index>(), any::<u8>()).prop_map(|(v, at, b)| {
                    let mut bytes = serde_json::to_vec(&v).unwrap_or_default();
                    if !bytes.is_empty() {
                        let i = at.index(bytes.len());
                        match b % 3 {
                            0 => bytes.truncate(i),
                            1 => bytes[i] = b,
                            _ => bytes.insert(i, b),
                        }
                    }
                    bytes
                }),
            ]
        ) {
            match decode_object(&bytes) {
                Ok(obj) => check_txn(&Value::Object(obj))?,
                Err(e) => {
                    prop_assert_eq!(e.status_code().as_u16(), 400);
                    prop_assert!(e.to_string().starts_with("body: "), "{}", e);
                }
            }
        }

        #[test]
        fn any_transaction_body_is_a_request_within_bounds_or_a_400_naming_its_field(
            body in prop_oneof![txn_body(), value()]
        ) {
            check_txn(&body)?;
            // The same through its bytes, as the route reads it.
            let bytes = serde_json::to_vec(&body).unwrap_or_default();
            match decode_object(&bytes) {
                Ok(obj) => check_txn(&Value::Object(obj))?,
                Err(e) => prop_assert!(e.to_string().starts_with("body: "), "{}", e),
            }
        }
    }

    #[test]
    fn deep_nesting_is_a_400_not_a_stack_overflow() {
        for depth in [129, 10_000, 1_000_000] {
            let body = format!("{{\"item\":{}{}}}", "[".repeat(depth), "]".repeat(depth));
            let e = decode_object(body.as_bytes()).expect_err("nested too deep");
            assert_eq!(e.status_code().as_u16(), 400);
            assert!(e.to_string().contains("recursion limit"), "{e}");
        }
    }
}
