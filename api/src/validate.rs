//! Parsing and validation of request bodies and path segments. Each check names the
//! field and the reason, so a caller can fix the request from the error alone.

use std::sync::Arc;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use actix_web::dev::ServiceRequest;
use actix_web::{web, HttpRequest, HttpResponse, ResponseError};
use futures_util::StreamExt;
use nrtxn_actors::{now_ms, Op, Request, BATCH_TXNS_MAX, NAME_LEN_MAX, QTY_MAX, REMARKS_LEN_MAX};
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
struct Held {
    limits: Arc<BodyLimits>,
    bytes: usize,
}

impl Held {
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

impl Drop for Held {
    fn drop(&mut self) {
        self.limits
            .held_bytes
            .fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

/// A request body read whole, holding its share of the bodies' budget until dropped.
pub struct Body {
    pub bytes: web::BytesMut,
    _held: Held,
}

/// Reads a body of at most `limit` bytes and parses it as a JSON object. The body must
/// be declared `application/json` (so a browser's cross-site form post is refused), be
/// valid JSON with no key repeated in any object, and arrive within the read timeout.
pub async fn json_object(
    req: &HttpRequest,
    payload: web::Payload,
    limit: usize,
) -> Result<Map<String, Value>, ApiError> {
    let body = json_body(req, payload, limit).await?;
    decode_object(&body.bytes)
}

/// Reads a body declared `application/json` of at most `limit` bytes, within the read
/// timeout, without parsing it ([`json_object`] parses it).
pub async fn json_body(
    req: &HttpRequest,
    mut payload: web::Payload,
    limit: usize,
) -> Result<Body, ApiError> {
    check_content_type(req)?;
    let limits = req
        .app_data::<web::Data<BodyLimits>>()
        .map(|d| d.clone().into_inner())
        .unwrap_or_else(|| Arc::new(BodyLimits::new(Duration::from_secs(10), usize::MAX)));
    let read_timeout = limits.read_timeout;
    let mut held = Held { limits, bytes: 0 };
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
    match tokio::time::timeout(read_timeout, read).await {
        Ok(result) => result?,
        Err(_) => {
            return Err(ApiError::BodyTimeout(format!(
                "body: not received whole within {} ms",
                read_timeout.as_millis()
            )))
        }
    }
    Ok(Body {
        bytes: body,
        _held: held,
    })
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
    let essence = value.map_or("", |v| v.split(';').next().unwrap_or("").trim());
    if essence.eq_ignore_ascii_case("application/json") {
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

/// A path whose %-escapes do not decode to UTF-8 is refused (`400`, the answer returned
/// here): the router would decode them to U+FFFD, so two distinct names would become one
/// shop or item.
pub fn undecodable_path(req: &ServiceRequest) -> Option<HttpResponse> {
    percent_decoded_utf8(req.uri().path())
        .err()
        .map(|e| e.error_response())
}

/// Checks that `path` percent-decodes to valid UTF-8.
fn percent_decoded_utf8(path: &str) -> Result<(), ApiError> {
    // Without an escape the path is the `&str` it already is: no copy to decode.
    if !path.contains('%') {
        return Ok(());
    }
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

/// `field` is formatted only into an error: a valid name costs no allocation.
fn check_name(s: &str, field: &dyn std::fmt::Display, max: usize) -> Result<(), ApiError> {
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
    check_name(s, &field, max)?;
    Ok(s.into())
}

/// A field of a body as its JSON type let it be read: what a field's rule checks. The
/// typed decoder ([`typed_txn`]) yields only `Absent` and `Is`; a body read through its
/// JSON value may also yield `Wrong`, which the field's rule turns into its own 400.
#[derive(Clone, Copy)]
pub enum Got<'a, T> {
    /// Left out, or `null`.
    Absent,
    Is(T),
    /// Of another type: its kind (`a string`, `an array`...), and the number itself
    /// when it is one.
    Wrong(&'static str, Option<&'a serde_json::Number>),
}

impl<'a, T> Got<'a, T> {
    fn of(v: Option<&'a Value>, typed: impl FnOnce(&'a Value) -> Option<T>) -> Self {
        match v {
            None | Some(Value::Null) => Got::Absent,
            Some(v) => match typed(v) {
                Some(t) => Got::Is(t),
                None => Got::Wrong(
                    kind(v),
                    match v {
                        Value::Number(n) => Some(n),
                        _ => None,
                    },
                ),
            },
        }
    }

    fn present(self) -> bool {
        !matches!(self, Got::Absent)
    }
}

impl<'a, T> From<Option<T>> for Got<'a, T> {
    /// A field the typed decoder read: there or not.
    fn from(o: Option<T>) -> Self {
        o.map_or(Got::Absent, Got::Is)
    }
}

impl<'a> Got<'a, &'a str> {
    /// A string field of `obj`.
    pub fn text(obj: &'a Map<String, Value>, field: &str) -> Self {
        Got::of(obj.get(field), Value::as_str)
    }
}

impl<'a> Got<'a, i64> {
    /// An integer field of `obj`.
    pub fn int(obj: &'a Map<String, Value>, field: &str) -> Self {
        Got::of(obj.get(field), Value::as_i64)
    }
}

/// A name (seller, item, request id...): a string of 1 to 128 bytes.
pub(crate) fn name_rule(
    got: Got<&str>,
    field: &str,
    prefix: &str,
) -> Result<Option<Arc<str>>, ApiError> {
    match got {
        Got::Absent => Ok(None),
        Got::Is(s) => {
            check_name(s, &format_args!("{prefix}{field}"), NAME_LEN_MAX)?;
            Ok(Some(s.into()))
        }
        Got::Wrong(..) => Err(ApiError::invalid(format!(
            "{prefix}{field}: must be a string"
        ))),
    }
}

/// A name field of `obj` (seller, item, request id...): a string of 1 to 128 bytes.
pub fn name(
    obj: &Map<String, Value>,
    field: &str,
    prefix: &str,
) -> Result<Option<Arc<str>>, ApiError> {
    name_rule(Got::text(obj, field), field, prefix)
}

pub(crate) fn required(
    name: Option<Arc<str>>,
    field: &str,
    prefix: &str,
) -> Result<Arc<str>, ApiError> {
    name.ok_or_else(|| ApiError::invalid(format!("{prefix}{field}: required")))
}

pub fn required_name(
    obj: &Map<String, Value>,
    field: &str,
    prefix: &str,
) -> Result<Arc<str>, ApiError> {
    required(name(obj, field, prefix)?, field, prefix)
}

/// An integer within `min..=max`; fractions, strings and out-of-range numbers are
/// refused with the reason.
pub(crate) fn integer_rule(
    got: Got<i64>,
    field: &str,
    prefix: &str,
    min: i64,
    max: i64,
) -> Result<i64, ApiError> {
    // The field's name with its prefix: only an error spells it out.
    let f = format_args!("{prefix}{field}");
    match got {
        Got::Absent => Err(ApiError::invalid(format!("{f}: required"))),
        Got::Is(v) if v < min => Err(ApiError::invalid(format!(
            "{f}: must be at least {min}, got {v}"
        ))),
        Got::Is(v) if v > max => Err(ApiError::invalid(format!(
            "{f}: must be at most {max}, got {v}"
        ))),
        Got::Is(v) => Ok(v),
        Got::Wrong(_, Some(n)) if n.is_u64() => Err(ApiError::invalid(format!(
            "{f}: must be at most {max}, got {n}"
        ))),
        Got::Wrong(_, Some(n)) => Err(ApiError::invalid(format!(
            "{f}: must be an integer, got {n}"
        ))),
        Got::Wrong(kind, None) => Err(ApiError::invalid(format!(
            "{f}: must be an integer, got {kind}"
        ))),
    }
}

/// An integer field of `obj` within `min..=max`; fractions, strings and out-of-range
/// numbers are refused with the reason.
pub fn integer(
    obj: &Map<String, Value>,
    field: &str,
    prefix: &str,
    min: i64,
    max: i64,
) -> Result<i64, ApiError> {
    integer_rule(Got::int(obj, field), field, prefix, min, max)
}

pub(crate) fn kind(v: &Value) -> &'static str {
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
pub(crate) fn request_id_rule(got: Got<&str>, prefix: &str) -> Result<Option<Arc<str>>, ApiError> {
    let id = name_rule(got, "request_id", prefix)?;
    if id.as_deref().is_some_and(|id| id.starts_with('~')) {
        return Err(ApiError::invalid(format!(
            "{prefix}request_id: must not start with '~' (reserved)"
        )));
    }
    Ok(id)
}

/// A caller's `request_id` in `obj` (`request_id_rule`).
pub fn request_id(obj: &Map<String, Value>, prefix: &str) -> Result<Option<Arc<str>>, ApiError> {
    request_id_rule(Got::text(obj, "request_id"), prefix)
}

/// A transaction's `req_time`, as sent: text, or an integer (kept as its digits).
#[derive(Clone, Copy)]
pub enum ReqTime<'a> {
    Text(&'a str),
    Int(i128),
}

/// A transaction body's fields as their types let them be read, in the order their
/// rules are checked ([`txn_rules`]).
#[derive(Clone, Copy)]
pub struct TxnFields<'a> {
    seller: Got<'a, &'a str>,
    item: Got<'a, &'a str>,
    buyer: Got<'a, &'a str>,
    qty: Got<'a, i64>,
    op: Got<'a, &'a str>,
    respond: Got<'a, bool>,
    req_time: Got<'a, ReqTime<'a>>,
    request_id: Got<'a, &'a str>,
    remarks: Got<'a, &'a str>,
    return_of: Got<'a, &'a str>,
    min_qty: Got<'a, i64>,
}

impl<'a> TxnFields<'a> {
    /// The fields of a transaction's JSON object.
    fn of(obj: &'a Map<String, Value>) -> Self {
        TxnFields {
            seller: Got::text(obj, "seller"),
            item: Got::text(obj, "item"),
            buyer: Got::text(obj, "buyer"),
            qty: Got::int(obj, "qty"),
            op: Got::text(obj, "op"),
            respond: Got::of(obj.get("respond"), |v| match v {
                Value::Bool(b) => Some(*b),
                Value::Number(n) => match n.as_u64() {
                    Some(1) => Some(true),
                    Some(0) => Some(false),
                    _ => None,
                },
                _ => None,
            }),
            req_time: Got::of(obj.get("req_time"), |v| match v {
                Value::String(s) => Some(ReqTime::Text(s)),
                Value::Number(n) => n
                    .as_i64()
                    .map(i128::from)
                    .or(n.as_u64().map(i128::from))
                    .map(ReqTime::Int),
                _ => None,
            }),
            request_id: Got::text(obj, "request_id"),
            remarks: Got::text(obj, "remarks"),
            return_of: Got::text(obj, "return_of"),
            min_qty: Got::int(obj, "min_qty"),
        }
    }

    /// Where the transaction's key comes from, named in a `key_reused` error.
    pub fn key_field(&self) -> &'static str {
        match self.request_id.present() {
            true => "request_id",
            false => "request_key",
        }
    }
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
    txn_rules(shop, TxnFields::of(obj), prefix)
}

/// The rules of a transaction's fields, checked in order: the request and whether the
/// caller waits (`respond`). The one place they are written, whichever way the body
/// was decoded.
pub fn txn_rules(
    shop: &Arc<str>,
    f: TxnFields<'_>,
    prefix: &str,
) -> Result<(Request, bool), ApiError> {
    let seller = required(name_rule(f.seller, "seller", prefix)?, "seller", prefix)?;
    let item = required(name_rule(f.item, "item", prefix)?, "item", prefix)?;
    let buyer = name_rule(f.buyer, "buyer", prefix)?;
    let qty = integer_rule(f.qty, "qty", prefix, 1, QTY_MAX)?;
    let op = match f.op {
        Got::Absent | Got::Is("decrement") => Op::Decrement,
        Got::Is("increment") => Op::Increment,
        _ => {
            return Err(ApiError::invalid(format!(
                "{prefix}op: must be \"decrement\" or \"increment\""
            )))
        }
    };
    let respond = match f.respond {
        Got::Absent => true,
        Got::Is(b) => b,
        Got::Wrong(..) => {
            return Err(ApiError::invalid(format!(
                "{prefix}respond: must be true, false, 1 or 0"
            )))
        }
    };
    let req_time: Option<String> = match f.req_time {
        Got::Absent => None,
        Got::Is(ReqTime::Text(s)) => {
            check_name(s, &format_args!("{prefix}req_time"), NAME_LEN_MAX)?;
            Some(s.to_owned())
        }
        Got::Is(ReqTime::Int(n)) => Some(n.to_string()),
        Got::Wrong(..) => {
            return Err(ApiError::invalid(format!(
                "{prefix}req_time: must be a string or an integer"
            )))
        }
    };
    let request_id = request_id_rule(f.request_id, prefix)?;
    let remarks = match f.remarks {
        Got::Absent => None,
        Got::Is(s) if s.len() <= REMARKS_LEN_MAX => Some(s.into()),
        Got::Is(_) => {
            return Err(ApiError::invalid(format!(
                "{prefix}remarks: longer than {REMARKS_LEN_MAX} bytes"
            )))
        }
        Got::Wrong(..) => {
            return Err(ApiError::invalid(format!(
                "{prefix}remarks: must be a string"
            )))
        }
    };
    let return_of = match f.return_of {
        Got::Absent => None,
        Got::Is(k) => {
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
            Some(Arc::<str>::from(k))
        }
        Got::Wrong(..) => {
            return Err(ApiError::invalid(format!(
                "{prefix}return_of: must be a string, the request key of the sale returned"
            )))
        }
    };
    let min_qty = min_qty_rule(f.min_qty, prefix, op, qty)?;
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
pub(crate) fn min_qty_rule(
    got: Got<i64>,
    prefix: &str,
    op: Op,
    qty: i64,
) -> Result<Option<i64>, ApiError> {
    match got {
        Got::Absent => Ok(None),
        _ if !matches!(op, Op::Decrement | Op::Hold) => Err(ApiError::invalid(format!(
            "{prefix}min_qty: only a decrement or a hold may take part of its qty, not an {}",
            op.as_str()
        ))),
        got => integer_rule(got, "min_qty", prefix, 1, qty).map(Some),
    }
}

/// A transaction body as it is on the wire, decoded straight into typed, borrowed
/// fields: no JSON value, no copy of a string. Refuses what it cannot type (an unknown
/// or repeated field, a field of another type, a string with escapes), and then the
/// body is read through its JSON value, whose errors name the field.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct TxnWire<'a> {
    #[serde(borrow)]
    seller: Option<&'a str>,
    #[serde(borrow)]
    item: Option<&'a str>,
    #[serde(borrow)]
    buyer: Option<&'a str>,
    qty: Option<i64>,
    #[serde(borrow)]
    op: Option<&'a str>,
    respond: Option<RespondWire>,
    #[serde(borrow)]
    req_time: Option<ReqTimeWire<'a>>,
    #[serde(borrow)]
    request_id: Option<&'a str>,
    #[serde(borrow)]
    remarks: Option<&'a str>,
    #[serde(borrow)]
    return_of: Option<&'a str>,
    min_qty: Option<i64>,
}

/// `respond` on the wire: a boolean, or 1 or 0.
struct RespondWire(bool);

impl<'de> serde::Deserialize<'de> for RespondWire {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = RespondWire;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("true, false, 1 or 0")
            }
            fn visit_bool<E>(self, b: bool) -> Result<RespondWire, E> {
                Ok(RespondWire(b))
            }
            fn visit_u64<E: serde::de::Error>(self, n: u64) -> Result<RespondWire, E> {
                match n {
                    0 | 1 => Ok(RespondWire(n == 1)),
                    _ => Err(E::custom("not 0 or 1")),
                }
            }
        }
        d.deserialize_any(V)
    }
}

/// `req_time` on the wire: a string without escapes, or an integer.
struct ReqTimeWire<'a>(ReqTime<'a>);

impl<'de: 'a, 'a> serde::Deserialize<'de> for ReqTimeWire<'a> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> serde::de::Visitor<'de> for V<'a> {
            type Value = ReqTimeWire<'a>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a string or an integer")
            }
            fn visit_borrowed_str<E>(self, s: &'de str) -> Result<ReqTimeWire<'a>, E> {
                Ok(ReqTimeWire(ReqTime::Text(s)))
            }
            fn visit_i64<E>(self, n: i64) -> Result<ReqTimeWire<'a>, E> {
                Ok(ReqTimeWire(ReqTime::Int(n.into())))
            }
            fn visit_u64<E>(self, n: u64) -> Result<ReqTimeWire<'a>, E> {
                Ok(ReqTimeWire(ReqTime::Int(n.into())))
            }
        }
        d.deserialize_any(V(std::marker::PhantomData))
    }
}

/// A struct decoded from a JSON object only. serde's derived structs also take an
/// array of their fields in order (`["s","i",null,2,...]`), which the JSON value's
/// reading refuses as "must be a JSON object": decoded through this, such a body is
/// not typed, and the value's reading says why.
pub(crate) struct MapOnly<T>(pub(crate) T);

impl<'de, T: serde::Deserialize<'de>> serde::Deserialize<'de> for MapOnly<T> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<T>(std::marker::PhantomData<T>);
        impl<'de, T: serde::Deserialize<'de>> serde::de::Visitor<'de> for V<T> {
            type Value = MapOnly<T>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                map: A,
            ) -> Result<Self::Value, A::Error> {
                T::deserialize(serde::de::value::MapAccessDeserializer::new(map)).map(MapOnly)
            }
        }
        d.deserialize_map(V(std::marker::PhantomData))
    }
}

/// A body typed as `W` from the bytes of a JSON object (never from an array of its
/// fields, see [`MapOnly`]), or `None` when it cannot be.
pub(crate) fn wire<'a, W: serde::Deserialize<'a>>(bytes: &'a [u8]) -> Option<W> {
    serde_json::from_slice::<MapOnly<W>>(bytes)
        .ok()
        .map(|w| w.0)
}

/// A body whose fields are read two ways: typed straight from its bytes when they can be,
/// else through its JSON value, whose errors name the field. Its rules take the fields
/// either way.
pub(crate) trait TwoWayBody {
    /// The fields, borrowed from the bytes or from the JSON value.
    type Fields<'a>;
    /// The body's schema in the contract, which names unknown fields.
    const SCHEMA: &'static str;
    /// The fields typed straight from `bytes`, or `None` when they cannot be.
    fn typed(bytes: &[u8]) -> Option<Self::Fields<'_>>;
    /// The fields of the body's JSON object.
    fn of(obj: &Map<String, Value>) -> Self::Fields<'_>;
}

/// What `rules` decide of a body read as [`TwoWayBody`] says: one set of rules, whichever
/// way the body was read.
pub(crate) fn two_way<B: TwoWayBody, T>(
    bytes: &[u8],
    rules: impl for<'a> FnOnce(B::Fields<'a>) -> Result<T, ApiError>,
) -> Result<T, ApiError> {
    match B::typed(bytes) {
        Some(fields) => rules(fields),
        None => {
            let obj = decode_object(bytes)?;
            crate::openapi::known_fields(B::SCHEMA, &obj)?;
            rules(B::of(&obj))
        }
    }
}

/// A transaction body's fields decoded straight from its bytes (`TxnWire`), or `None`
/// when they cannot be: then [`decode_object`] and [`txn`] read it, and say why.
pub fn typed_txn(bytes: &[u8]) -> Option<TxnFields<'_>> {
    wire::<TxnWire>(bytes).map(TxnWire::fields)
}

/// A batch body (`{"txns":[...]}`) on the wire: its entries as [`TxnWire`]s.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct BatchWire<'a> {
    #[serde(borrow)]
    txns: Option<EntriesWire<'a>>,
}

/// A batch's entries on the wire, each an object: at most [`BATCH_TXNS_MAX`] are
/// decoded (one more is refused at once, not after the rest of a 2 MiB body of tiny
/// entries was decoded too).
struct EntriesWire<'a>(Vec<TxnWire<'a>>);

impl<'de: 'a, 'a> serde::Deserialize<'de> for EntriesWire<'a> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> serde::de::Visitor<'de> for V<'a> {
            type Value = EntriesWire<'a>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("an array of transactions")
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<Self::Value, A::Error> {
                let mut out = Vec::new();
                while let Some(MapOnly(t)) = seq.next_element::<MapOnly<TxnWire<'a>>>()? {
                    if out.len() == BATCH_TXNS_MAX {
                        return Err(serde::de::Error::custom("too many entries"));
                    }
                    out.push(t);
                }
                Ok(EntriesWire(out))
            }
        }
        d.deserialize_seq(V(std::marker::PhantomData))
    }
}

/// A batch body's entries decoded straight from its bytes, when there are 1 to
/// `entries_max` of them and each can be typed as [`typed_txn`] types a transaction;
/// else `None`, and the body is read as a JSON value, whose errors say why.
pub fn typed_batch(bytes: &[u8], entries_max: usize) -> Option<Vec<TxnFields<'_>>> {
    let txns = serde_json::from_slice::<MapOnly<BatchWire>>(bytes)
        .ok()?
        .0
        .txns?
        .0;
    if txns.is_empty() || txns.len() > entries_max {
        return None;
    }
    Some(txns.into_iter().map(TxnWire::fields).collect())
}

impl<'a> TxnWire<'a> {
    fn fields(self) -> TxnFields<'a> {
        let w = self;
        TxnFields {
            seller: w.seller.into(),
            item: w.item.into(),
            buyer: w.buyer.into(),
            qty: w.qty.into(),
            op: w.op.into(),
            respond: w.respond.map(|r| r.0).into(),
            req_time: w.req_time.map(|r| r.0).into(),
            request_id: w.request_id.into(),
            remarks: w.remarks.into(),
            return_of: w.return_of.into(),
            min_qty: w.min_qty.into(),
        }
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
    fn a_plain_body_is_typed_and_one_it_cannot_type_is_left_to_its_json_value() {
        let typed = |b: &str| typed_txn(b.as_bytes()).is_some();
        assert!(typed(
            r#"{"seller":"s","item":"i","qty":2,"req_time":17,"respond":0,"buyer":null}"#
        ));
        for body in [
            r#"{"seller":"s","item":"i","qty":2,"req_time":17,"qyt":1}"#,
            r#"{"seller":"s","item":"i","qty":2,"qty":3,"req_time":17}"#,
            r#"{"seller":"s\u0041","item":"i","qty":2,"req_time":17}"#,
            r#"{"seller":"s","item":"i","qty":"2","req_time":17}"#,
            r#"{"seller":"s","item":"i","qty":2.5,"req_time":17}"#,
            r#"{"seller":"s","item":"i","qty":2,"req_time":17,"respond":2}"#,
            r#"[1]"#,
            r#"["s","i",null,2,null,null,"17",null,null,null,null]"#,
        ] {
            assert!(!typed(body), "{body}");
        }
        let one = r#"{"seller":"s","item":"i","qty":1,"req_time":"t"}"#;
        assert_eq!(
            typed_batch(format!(r#"{{"txns":[{one},{one}]}}"#).as_bytes(), 3).map(|b| b.len()),
            Some(2)
        );
        let as_array = r#"["s","i",null,1,null,null,"t",null,null,null,null]"#;
        let many = vec![one; BATCH_TXNS_MAX + 1].join(",");
        for batch in [
            format!(r#"[[{one}]]"#),
            format!(r#"{{"txns":[{as_array}]}}"#),
            format!(r#"{{"txns":[{many}]}}"#),
            r#"{"txns":[]}"#.to_string(),
        ] {
            assert!(
                typed_batch(batch.as_bytes(), BATCH_TXNS_MAX).is_none(),
                "{batch:.80}"
            );
        }
        let fields = typed_txn(br#"{"seller":"s","item":"i","qty":2,"req_time":17}"#).unwrap();
        let (r, respond) = txn_rules(&"shop".into(), fields, "").unwrap();
        assert_eq!((&*r.key, r.qty, respond), ("s:i:17", 2, true));
        assert_eq!(fields.key_field(), "request_key");
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

    /// The route's two ways to an answer agree: whenever the typed decoder takes a body,
    /// the rules give what reading it as a JSON value gives, the request or the error.
    fn same_either_way(bytes: &[u8]) -> Result<(), TestCaseError> {
        let Some(fields) = typed_txn(bytes) else {
            return Ok(());
        };
        let shop: Arc<str> = "shop".into();
        let obj = decode_object(bytes).map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert!(crate::openapi::known_fields("Txn", &obj).is_ok());
        let value = Value::Object(obj);
        let field = |v: &Value| match v.get("request_id") {
            None | Some(Value::Null) => "request_key",
            Some(_) => "request_id",
        };
        prop_assert_eq!(fields.key_field(), field(&value));
        let shown = |r: Result<(Request, bool), ApiError>| {
            r.map(|(q, respond)| {
                format!(
                    "{:?}",
                    (
                        q.shop,
                        q.item,
                        q.key,
                        q.op,
                        q.qty,
                        q.seller,
                        q.buyer,
                        q.remarks,
                        q.return_of,
                        q.min_qty,
                        respond
                    )
                )
            })
            .map_err(|e| e.to_string())
        };
        prop_assert_eq!(
            shown(txn_rules(&shop, fields, "")),
            shown(txn(&shop, &value, ""))
        );
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: cases(), ..ProptestConfig::default() })]

        #[test]
        fn a_body_typed_from_its_bytes_is_decided_as_its_json_value_is(
            body in prop_oneof![3 => txn_body(), 1 => value()]
        ) {
            same_either_way(&serde_json::to_vec(&body).unwrap_or_default())?;
        }

        #[test]
        fn a_batch_typed_from_its_bytes_is_decided_as_its_json_value_is(
            bodies in prop::collection::vec(txn_body(), 0..4)
        ) {
            let bytes = serde_json::to_vec(&json!({ "txns": bodies })).unwrap_or_default();
            let Some(typed) = typed_batch(&bytes, 3) else {
                return Ok(());
            };
            prop_assert!((1..=3).contains(&typed.len()));
            let obj = decode_object(&bytes).map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert!(crate::openapi::known_fields("Batch", &obj).is_ok());
            let entries = array(&obj, "txns", 3).map_err(|e| TestCaseError::fail(e.to_string()))?;
            let shop: Arc<str> = "shop".into();
            for (i, (fields, v)) in typed.iter().zip(entries).enumerate() {
                let prefix = format!("txns[{i}].");
                let shown = |r: Result<(Request, bool), ApiError>| {
                    r.map(|(q, respond)| format!("{:?}", (q.key, q.item, q.qty, q.op, respond)))
                        .map_err(|e| e.to_string())
                };
                prop_assert_eq!(
                    shown(txn_rules(&shop, *fields, &prefix)),
                    shown(txn(&shop, v, &prefix))
                );
            }
        }

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
