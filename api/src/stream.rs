//! `GET /v1/shops/{shop}/events/stream`: the shop's events as server-sent events, live
//! (see `docs/decisions/event-stream.md`).
//!
//! Each stream has a reader thread of its own that reads the node's [`EventFeed`](nrtxn_actors::EventFeed) and
//! puts events into a channel of [`STREAM_BUFFER_EVENTS`]; the response takes them out
//! as the client reads. A client that reads nothing for [`SLOW_CLIENT_GRACE`] while the
//! channel is full is dropped: it gets what the channel holds, then a final `dropped`
//! event naming the cursor to resume from, and the stream ends. So a stream holds at most
//! its channel and the socket's buffers, and at most [`STREAMS_MAX`] streams are open,
//! at most `streams_per_shop_max` of them one shop's ([`STREAMS_PER_SHOP_MAX`] by
//! default), so one shop cannot take every stream of the node.
//!
//! A stream opened with a key ends, with a final `dropped` event (`reason:
//! "key_revoked"`), within [`KEY_CHECK_INTERVAL`] of the node's keys no longer holding
//! that key: the keys are read again every 2 s, so within 5 s of its revocation, as for
//! every other request.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use actix_web::http::header;
use actix_web::web::Bytes;
use actix_web::{web, HttpRequest, HttpResponse};
use nrtxn_actors::{Event, FeedError};
use serde_json::json;
use tokio::sync::mpsc;

use crate::auth::{AccessKey, Gate};
use crate::error::ApiError;
use crate::validate::path_segment;
use crate::AppState;

/// Most streams open at once on a node: each has a reader thread and, with Kafka, a
/// consumer of its own. One more is answered 503 with `Retry-After`.
pub const STREAMS_MAX: usize = 64;
/// Default of the streams one shop may hold open on a node (`--streams-per-shop-max`): a
/// quarter of [`STREAMS_MAX`], room for a shop's dashboards and watchers, while four
/// shops at their share still cannot fill the node.
pub const STREAMS_PER_SHOP_MAX: usize = 16;
/// How often a stream's reader checks that the key it was opened with is still one of
/// the node's keys. With the keys read every 2 s, a revoked key's stream ends within
/// about 3.5 s, inside the 5 s every other request is promised.
pub const KEY_CHECK_INTERVAL: Duration = Duration::from_millis(1_000);
/// Events waiting for one slow client, at most (about 300 bytes each: 300 KB a stream).
pub const STREAM_BUFFER_EVENTS: usize = 1_024;
/// How long a client may leave a full buffer unread before it is dropped.
pub const SLOW_CLIENT_GRACE: Duration = Duration::from_secs(5);
/// A comment line this often, so that proxies keep an idle stream open, and a client
/// that went away without a FIN (its machine gone) is noticed when the write fails. (One
/// that closed its connection is noticed at once: the server ends a connection at the
/// client's EOF, `src/server.rs`.)
const KEEP_ALIVE: Duration = Duration::from_secs(15);
/// How long one read of the feed waits for new events before the reader checks that
/// its client is still there.
const FEED_WAIT: Duration = Duration::from_millis(200);
/// Longest cursor taken (a topic's has one offset per partition).
const CURSOR_LEN_MAX: usize = 4_096;

/// The streams open now, against [`STREAMS_MAX`].
static OPEN: AtomicUsize = AtomicUsize::new(0);
/// The streams open now per shop, against the shop's share; a shop with none has no
/// entry. Taken once per stream opened or closed, never per event.
static OPEN_PER_SHOP: Mutex<Option<HashMap<Arc<str>, usize>>> = Mutex::new(None);

/// What the reader thread hands the response.
enum Msg {
    Event(String, Event),
}

/// Set by the reader thread when it stops for a reason the client should hear.
#[derive(Default)]
struct Ending {
    /// `(event name, data)` of the final message.
    last: Mutex<Option<(&'static str, serde_json::Value)>>,
    /// Set when the stream must end at once, without the events its channel still holds
    /// (its key was revoked): the final message's `resume_after` is then the last event
    /// the client was sent, which the response adds.
    cut: std::sync::atomic::AtomicBool,
}

/// A stream's place in [`OPEN`]; given back when the stream ends.
struct Slot;

impl Drop for Slot {
    fn drop(&mut self) {
        OPEN.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A stream's place in its shop's share ([`OPEN_PER_SHOP`]); given back when it ends.
struct ShopSlot(Arc<str>);

impl ShopSlot {
    /// A place for one more stream of `shop`, if it has fewer than `max` open.
    fn take(shop: &Arc<str>, max: usize) -> Option<ShopSlot> {
        let mut open = OPEN_PER_SHOP.lock().unwrap_or_else(|p| p.into_inner());
        let n = open
            .get_or_insert_with(HashMap::new)
            .entry(shop.clone())
            .or_default();
        if *n >= max {
            return None;
        }
        *n += 1;
        Some(ShopSlot(shop.clone()))
    }
}

impl Drop for ShopSlot {
    fn drop(&mut self) {
        let mut open = OPEN_PER_SHOP.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(map) = open.as_mut() {
            if let Some(n) = map.get_mut(&self.0) {
                *n = n.saturating_sub(1);
                if *n == 0 {
                    map.remove(&self.0);
                }
            }
        }
    }
}

/// What the key a stream was opened with must still be, checked by its reader.
enum KeyWatch {
    /// Opened without keys checked: it ends once the node checks keys.
    Open(web::Data<Gate>),
    /// Opened with this key: it ends once the node's keys no longer hold it.
    Key(web::Data<Gate>, AccessKey),
    /// No access control wired (unit tests of handlers): nothing to watch.
    None,
}

impl KeyWatch {
    /// Why the stream must end now, if it must.
    fn ended(&self) -> Option<&'static str> {
        match self {
            KeyWatch::Open(gate) if gate.enforcing() => Some("key_required"),
            KeyWatch::Key(gate, key) if !gate.keys().holds(key) => Some("key_revoked"),
            _ => None,
        }
    }
}

pub async fn get_stream(
    state: web::Data<AppState>,
    path: web::Path<String>,
    query: web::Query<Vec<(String, String)>>,
    http: HttpRequest,
) -> Result<HttpResponse, ApiError> {
    let shop = path_segment(&path, "shop")?;
    let mut after: Option<(String, &'static str)> = None;
    for (k, v) in query.into_inner() {
        match k.as_str() {
            "after" => after = Some((v, "after")),
            other => {
                return Err(ApiError::invalid(format!(
                    "{other}: unknown parameter (after)"
                )))
            }
        }
    }
    // `?after=` wins over the header: a client that names a cursor means it.
    if after.is_none() {
        if let Some(v) = http.headers().get("last-event-id") {
            let v = v
                .to_str()
                .map_err(|_| ApiError::invalid("Last-Event-ID: not a cursor of this stream"))?;
            after = Some((v.to_string(), "Last-Event-ID"));
        }
    }
    if let Some((c, field)) = &after {
        if c.is_empty() || c.len() > CURSOR_LEN_MAX {
            return Err(ApiError::invalid(format!(
                "{field}: not a cursor of this stream"
            )));
        }
    }
    let Some(feed) = state.feed.clone() else {
        return Err(ApiError::Unavailable(
            "events/stream: this node has no event feed".into(),
        ));
    };
    if OPEN.fetch_add(1, Ordering::AcqRel) >= STREAMS_MAX {
        OPEN.fetch_sub(1, Ordering::AcqRel);
        return Ok(HttpResponse::ServiceUnavailable()
            .insert_header((header::RETRY_AFTER, "5"))
            .json(json!({
                "error": "overloaded",
                "detail": format!("{STREAMS_MAX} event streams are open on this node, its bound")
            })));
    }
    let slot = Slot;
    let Some(shop_slot) = ShopSlot::take(&shop, state.streams_per_shop_max) else {
        return Ok(HttpResponse::ServiceUnavailable()
            .insert_header((header::RETRY_AFTER, "5"))
            .json(json!({
                "error": "overloaded",
                "detail": format!(
                    "shop {shop} already has {} event streams open on this node, a shop's \
                     share of its {STREAMS_MAX}",
                    state.streams_per_shop_max
                )
            })));
    };
    let watch = match http.app_data::<web::Data<Gate>>() {
        None => KeyWatch::None,
        Some(gate) => match gate.key_of(http.headers().get(header::AUTHORIZATION)) {
            Some(key) => KeyWatch::Key(gate.clone(), key),
            None if gate.enforcing() => {
                // The access check let it through a moment ago: its key was revoked
                // since.
                return Err(ApiError::Unavailable(
                    "events/stream: the access key was revoked; retry with a valid one".into(),
                ));
            }
            None => KeyWatch::Open(gate.clone()),
        },
    };
    let field = after.as_ref().map(|(_, f)| *f);
    let cursor = after.as_ref().map(|(c, _)| c.clone());
    let shop2 = shop.clone();
    let opened = tokio::task::spawn_blocking(move || feed.open(shop2, cursor.as_deref()))
        .await
        .map_err(|_| ApiError::Unavailable("events/stream: shutting down".into()))?;
    let (mut reader, start) = match opened {
        Ok(r) => r,
        Err(FeedError::BadCursor(_)) => {
            return Err(ApiError::invalid(format!(
                "{}: not a cursor of this stream",
                field.unwrap_or("after")
            )))
        }
        Err(FeedError::Store(e)) => {
            return Err(ApiError::Unavailable(format!("events/stream: {e}")))
        }
    };
    let (tx, rx) = mpsc::channel::<Msg>(STREAM_BUFFER_EVENTS);
    let ending = Arc::new(Ending::default());
    {
        let (ending, shop, start_at) = (ending.clone(), shop.clone(), start.clone());
        let spawned = std::thread::Builder::new()
            .name("events-stream".into())
            .spawn(move || {
                let mut last = start_at;
                let mut checked_at = Instant::now();
                // Whether the stream's key still lets it go on, checked every
                // KEY_CHECK_INTERVAL; `Some(reason)` once it does not.
                let mut revoked = move || {
                    if checked_at.elapsed() < KEY_CHECK_INTERVAL {
                        return None;
                    }
                    checked_at = Instant::now();
                    watch.ended()
                };
                let end = |reason: &'static str| {
                    tracing::info!(%shop, reason, "event stream: ended, its key no longer valid");
                    *ending.last.lock().unwrap_or_else(|p| p.into_inner()) = Some((
                        "dropped",
                        json!({"reason": reason,
                               "detail": "the stream's access key is no longer valid"}),
                    ));
                    ending.cut.store(true, Ordering::Release);
                };
                loop {
                    if tx.is_closed() {
                        return; // the client went away
                    }
                    if let Some(reason) = revoked() {
                        end(reason);
                        return;
                    }
                    let events = match reader.next(FEED_WAIT) {
                        Ok(e) => e,
                        Err(e) => {
                            tracing::warn!(%shop, error = %e, "event stream: the feed failed");
                            *ending.last.lock().unwrap_or_else(|p| p.into_inner()) = Some((
                                "dropped",
                                json!({"reason": "feed_failed", "detail": e.to_string(),
                                       "resume_after": last}),
                            ));
                            return;
                        }
                    };
                    for (id, event) in events {
                        let mut msg = Msg::Event(id.clone(), event);
                        let full_since = Instant::now();
                        loop {
                            match tx.try_send(msg) {
                                Ok(()) => break,
                                Err(mpsc::error::TrySendError::Closed(_)) => return,
                                Err(mpsc::error::TrySendError::Full(m)) => {
                                    if let Some(reason) = revoked() {
                                        end(reason);
                                        return;
                                    }
                                    if full_since.elapsed() >= SLOW_CLIENT_GRACE {
                                        tracing::info!(%shop, "event stream: a slow client dropped");
                                        *ending.last.lock().unwrap_or_else(|p| p.into_inner()) =
                                            Some((
                                                "dropped",
                                                json!({
                                                    "reason": "slow_client",
                                                    "detail": format!(
                                                        "{STREAM_BUFFER_EVENTS} events waited \
                                                         unread for {} s",
                                                        SLOW_CLIENT_GRACE.as_secs()
                                                    ),
                                                    "resume_after": last,
                                                }),
                                            ));
                                        return;
                                    }
                                    msg = m;
                                    std::thread::sleep(Duration::from_millis(10));
                                }
                            }
                        }
                        last = id;
                    }
                }
            });
        if spawned.is_err() {
            return Err(ApiError::Unavailable(
                "events/stream: no thread for the stream".into(),
            ));
        }
    }
    // The first message fixes where the stream starts, as an id a client may resume
    // from even before any event came.
    let ready = format!(
        "retry: 1000\nid: {start}\nevent: ready\ndata: {}\n\n",
        json!({ "shop": &*shop, "cursor": start })
    );
    let body = futures_util::stream::unfold(
        (
            rx,
            ending,
            Some(Bytes::from(ready)),
            false,
            (slot, shop_slot, start),
        ),
        |(mut rx, ending, first, done, mut slot)| async move {
            if let Some(b) = first {
                return Some((
                    Ok::<_, actix_web::Error>(b),
                    (rx, ending, None, false, slot),
                ));
            }
            if done {
                return None;
            }
            if ending.cut.load(Ordering::Acquire) {
                // Nothing more of what the channel holds: the client resumes (with a
                // valid key) after the last event it was sent.
                let last = ending.last.lock().unwrap_or_else(|p| p.into_inner()).take();
                let (name, mut data) = last?;
                data["resume_after"] = json!(slot.2);
                return Some((
                    Ok(Bytes::from(format!("event: {name}\ndata: {data}\n\n"))),
                    (rx, ending, None, true, slot),
                ));
            }
            let next = tokio::time::timeout(KEEP_ALIVE, rx.recv()).await;
            let bytes = match next {
                Err(_) => Bytes::from_static(b": keep-alive\n\n"),
                Ok(Some(Msg::Event(id, event))) => {
                    let data = serde_json::to_string(&event).unwrap_or_default();
                    let bytes = Bytes::from(format!("id: {id}\ndata: {data}\n\n"));
                    slot.2 = id;
                    bytes
                }
                Ok(None) => {
                    let last = ending.last.lock().unwrap_or_else(|p| p.into_inner()).take();
                    let (name, mut data) = last?;
                    if ending.cut.load(Ordering::Acquire) {
                        data["resume_after"] = json!(slot.2);
                    }
                    return Some((
                        Ok(Bytes::from(format!("event: {name}\ndata: {data}\n\n"))),
                        (rx, ending, None, true, slot),
                    ));
                }
            };
            Some((Ok(bytes), (rx, ending, None, false, slot)))
        },
    );
    Ok(HttpResponse::Ok()
        .insert_header((header::CONTENT_TYPE, "text/event-stream"))
        .insert_header((header::CACHE_CONTROL, "no-cache"))
        .insert_header(("X-Accel-Buffering", "no"))
        .streaming(body))
}
