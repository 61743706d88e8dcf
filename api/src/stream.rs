//! `GET /v1/shops/{shop}/events/stream`: the shop's events as server-sent events, live
//! (see `docs/decisions/event-stream.md`).
//!
//! Each stream has a reader thread of its own that reads the node's [`EventFeed`] and
//! puts events into a channel of [`STREAM_BUFFER_EVENTS`]; the response takes them out
//! as the client reads. A client that reads nothing for [`SLOW_CLIENT_GRACE`] while the
//! channel is full is dropped: it gets what the channel holds, then a final `dropped`
//! event naming the cursor to resume from, and the stream ends. So a stream holds at most
//! its channel and the socket's buffers, and at most [`STREAMS_MAX`] streams are open.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use actix_web::http::header;
use actix_web::web::Bytes;
use actix_web::{web, HttpRequest, HttpResponse};
use nrtxn_actors::{Event, FeedError};
use serde_json::json;
use tokio::sync::mpsc;

use crate::error::ApiError;
use crate::validate::path_segment;
use crate::AppState;

/// Most streams open at once on a node: each has a reader thread and, with Kafka, a
/// consumer of its own. One more is answered 503 with `Retry-After`.
pub const STREAMS_MAX: usize = 64;
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

/// What the reader thread hands the response.
enum Msg {
    Event(String, Event),
}

/// Set by the reader thread when it stops for a reason the client should hear.
#[derive(Default)]
struct Ending {
    /// `(event name, data)` of the final message.
    last: Mutex<Option<(&'static str, serde_json::Value)>>,
}

struct Slot;

impl Drop for Slot {
    fn drop(&mut self) {
        OPEN.fetch_sub(1, Ordering::AcqRel);
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
                loop {
                    if tx.is_closed() {
                        return; // the client went away
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
        (rx, ending, Some(Bytes::from(ready)), false, slot),
        |(mut rx, ending, first, done, slot)| async move {
            if let Some(b) = first {
                return Some((
                    Ok::<_, actix_web::Error>(b),
                    (rx, ending, None, false, slot),
                ));
            }
            if done {
                return None;
            }
            let next = tokio::time::timeout(KEEP_ALIVE, rx.recv()).await;
            let bytes = match next {
                Err(_) => Bytes::from_static(b": keep-alive\n\n"),
                Ok(Some(Msg::Event(id, event))) => {
                    let data = serde_json::to_string(&event).unwrap_or_default();
                    Bytes::from(format!("id: {id}\ndata: {data}\n\n"))
                }
                Ok(None) => {
                    let last = ending.last.lock().unwrap_or_else(|p| p.into_inner()).take();
                    let (name, data) = last?;
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
