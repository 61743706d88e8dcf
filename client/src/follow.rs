//! Following items' event streams: [`Follower`] turns an unreliable stream of events
//! (duplicates, lost messages) into a gapless, ordered, complete stream per item.
//!
//! Every change of an item is one event with `seq` and `prev_seq = seq - 1`, so two
//! numbers are enough to tell a duplicate (`seq` already emitted) from the next event
//! (`prev_seq` is the last one emitted) from a gap (`prev_seq` beyond it). A gap is filled
//! from a [`Backfill`] source (the item's events route: [`HttpBackfill`]) before the event
//! that revealed it is emitted; an unfillable gap is an error, never a silent skip.
//!
//! The follower does not know where the events come from: `nrtxn follow` feeds it what it
//! reads from the events topic (at least once, in order per item) with
//! `--kafka-brokers`, or from polls of the events route without.

use std::collections::HashMap;
use std::error::Error as StdError;
use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use nrtxn_actors::{Event, EVENTS_LIMIT_MAX};
use serde::Deserialize;

/// Any error, boxed: what a [`Backfill`] or an emit callback may fail with, kept as the
/// `source` of a [`FollowError`] so the whole chain reaches the operator.
pub type BoxError = Box<dyn StdError + Send + Sync + 'static>;

/// Items a [`Follower`] tracks unless told otherwise. Each costs its map entry, its two
/// names (up to 128 bytes each) and a `u64`: about 100 to 400 bytes, so the default caps
/// the follower's memory at a few hundred MB even with the longest names.
pub const ITEMS_TRACKED_MAX_DEFAULT: usize = 1_000_000;

/// Most events the follower asks a [`Backfill`] for at once: the events route's own
/// limit, so one page is one request.
pub const FILL_PAGE_EVENTS_MAX: usize = EVENTS_LIMIT_MAX;

/// Where a [`Follower`] fetches the events a gap hides.
///
/// The returned future is `Send` so a follower can live in a spawned task (a topic
/// consumer); an implementation may simply write `async fn events(...)`.
pub trait Backfill {
    /// What a fetch fails with (network, status, decoding...).
    type Error: StdError + Send + Sync + 'static;

    /// Up to `limit` events of `shop`/`item` with `seq > after_seq`, in seq order. Fewer,
    /// or none, only when the source has no more: the follower asks again after a short
    /// page, and takes an empty one to mean the missing events cannot be had.
    fn events(
        &mut self,
        shop: &str,
        item: &str,
        after_seq: u64,
        limit: usize,
    ) -> impl Future<Output = Result<Vec<Event>, Self::Error>> + Send;
}

/// What a [`Follower`] has done, for a summary (`nrtxn follow` prints it on stderr).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FollowStats {
    /// Events handed to the emit callback, those that came through the stream and those
    /// fetched to fill gaps.
    pub events_emitted: u64,
    /// Events dropped because their `seq` was already emitted (at-least-once delivery).
    pub duplicates_dropped: u64,
    /// Gaps found (an event whose `prev_seq` was beyond the last emitted) and filled.
    pub gaps_filled: u64,
    /// Events fetched from the backfill and emitted to fill those gaps.
    pub events_filled: u64,
}

/// Why a [`Follower`] could not take an event. Its state is left as it was after the last
/// event it emitted, so the caller may retry the same event (a backfill that failed on
/// the network) or give up.
#[derive(Debug)]
#[non_exhaustive]
pub enum FollowError {
    /// An event whose numbers break the stream's rule (`seq >= 1`, `prev_seq = seq - 1`):
    /// nothing can be concluded from it about duplicates or gaps.
    Malformed {
        shop: Arc<str>,
        item: Arc<str>,
        seq: u64,
        prev_seq: u64,
    },
    /// A new item beyond the follower's bound on tracked items.
    TooManyItems {
        shop: Arc<str>,
        item: Arc<str>,
        items_max: usize,
    },
    /// The backfill failed while filling a gap.
    Backfill {
        shop: Arc<str>,
        item: Arc<str>,
        after_seq: u64,
        source: BoxError,
    },
    /// The backfill has no events after `after_seq`, though the gap runs to `last_seq`.
    GapNotFilled {
        shop: Arc<str>,
        item: Arc<str>,
        /// The gap as found: events `first_seq..=last_seq` were missing.
        first_seq: u64,
        last_seq: u64,
        /// The last seq emitted when the backfill ran dry.
        after_seq: u64,
    },
    /// The backfill answered an event that does not continue the sequence (another item,
    /// or not the next seq): a broken source, not a gap to skip.
    Discontinuous {
        shop: Arc<str>,
        item: Arc<str>,
        expected_seq: u64,
        got_shop: Arc<str>,
        got_item: Arc<str>,
        got_seq: u64,
        got_prev_seq: u64,
    },
    /// The emit callback failed (stdout closed, a downstream write...).
    Emit { source: BoxError },
}

impl fmt::Display for FollowError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FollowError::Malformed {
                shop,
                item,
                seq,
                prev_seq,
            } => write!(
                f,
                "{shop}/{item}: malformed event seq {seq} prev_seq {prev_seq} \
                 (expected seq >= 1 and prev_seq = seq - 1)"
            ),
            FollowError::TooManyItems {
                shop,
                item,
                items_max,
            } => write!(
                f,
                "{shop}/{item}: the follower already tracks {items_max} items, its bound"
            ),
            FollowError::Backfill {
                shop,
                item,
                after_seq,
                ..
            } => write!(f, "{shop}/{item}: backfill of events after seq {after_seq}"),
            FollowError::GapNotFilled {
                shop,
                item,
                first_seq,
                last_seq,
                after_seq,
            } => write!(
                f,
                "{shop}/{item}: events {first_seq}..={last_seq} are missing and the backfill \
                 has none after seq {after_seq}"
            ),
            FollowError::Discontinuous {
                shop,
                item,
                expected_seq,
                got_shop,
                got_item,
                got_seq,
                got_prev_seq,
            } => write!(
                f,
                "{shop}/{item}: the backfill answered {got_shop}/{got_item} seq {got_seq} \
                 prev_seq {got_prev_seq} where seq {expected_seq} was due"
            ),
            FollowError::Emit { .. } => write!(f, "emitting an event"),
        }
    }
}

impl StdError for FollowError {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        match self {
            FollowError::Backfill { source, .. } | FollowError::Emit { source } => {
                Some(source.as_ref())
            }
            _ => None,
        }
    }
}

/// Turns an unreliable stream of events into a gapless, ordered, complete stream per
/// (shop, item), filling gaps from a [`Backfill`].
///
/// Memory is one entry per item seen (its last emitted seq), bounded by `items_max`
/// ([`ITEMS_TRACKED_MAX_DEFAULT`]); a fill holds one page of at most
/// [`FILL_PAGE_EVENTS_MAX`] events at a time, however long the gap, because events are
/// handed to the emit callback as they come.
///
/// What it cannot see: a lost *last* message of an item reveals itself only when the
/// item's next event arrives; a consumer that must be complete at the tail asks the
/// events route on idle (as `nrtxn follow`'s polling does). And a duplicate is told by
/// its `seq` alone: its content is not compared with what was emitted.
pub struct Follower<B> {
    /// Where gaps are filled from.
    backfill: B,
    /// Last seq emitted, by shop then item: nested maps so that a lookup borrows the
    /// event's names (`&str`) instead of building a key. An absent item is at 0 (nothing
    /// emitted yet) unless [`Follower::start_at`] said otherwise.
    last_seq: HashMap<Arc<str>, HashMap<Arc<str>, u64>>,
    /// Entries in `last_seq`, all shops together.
    items_tracked: usize,
    /// Bound on `items_tracked`. Reaching it is an error rather than an eviction: a
    /// forgotten item would restart at 0 and its whole history would be emitted again.
    items_max: usize,
    stats: FollowStats,
}

impl<B: Backfill> Follower<B> {
    /// A follower that starts every item at seq 0 (emits each item's whole history) and
    /// tracks up to [`ITEMS_TRACKED_MAX_DEFAULT`] items.
    pub fn new(backfill: B) -> Self {
        Follower {
            backfill,
            last_seq: HashMap::new(),
            items_tracked: 0,
            items_max: ITEMS_TRACKED_MAX_DEFAULT,
            stats: FollowStats::default(),
        }
    }

    /// Sets the bound on tracked items (at least 1).
    pub fn with_items_max(mut self, items_max: usize) -> Self {
        self.items_max = items_max.max(1);
        self
    }

    /// Resumes `shop`/`item` after `after_seq`: events up to it count as already emitted
    /// (a consumer restarting from its checkpoint).
    pub fn start_at(&mut self, shop: &str, item: &str, after_seq: u64) -> Result<(), FollowError> {
        let (shop, item): (Arc<str>, Arc<str>) = (shop.into(), item.into());
        self.check_room(&shop, &item)?;
        self.set_last_seq(&shop, &item, after_seq);
        Ok(())
    }

    /// The last seq emitted for `shop`/`item` (or its start), 0 when never seen.
    pub fn last_seq(&self, shop: &str, item: &str) -> u64 {
        self.last_seq
            .get(shop)
            .and_then(|items| items.get(item))
            .copied()
            .unwrap_or(0)
    }

    /// Items tracked, all shops together.
    pub fn items_tracked(&self) -> usize {
        self.items_tracked
    }

    pub fn stats(&self) -> FollowStats {
        self.stats
    }

    /// Takes one event of the stream: drops it if it is a duplicate; else fills the gap
    /// before it, if any, from the backfill, and emits the filled events then this one,
    /// in seq order, through `emit`. An event is counted as emitted only once `emit`
    /// returned `Ok`, so after an error the same event may be pushed again.
    pub async fn push<F, E>(&mut self, event: Event, mut emit: F) -> Result<(), FollowError>
    where
        F: FnMut(Event) -> Result<(), E>,
        E: Into<BoxError>,
    {
        if event.seq == 0 || event.prev_seq.checked_add(1) != Some(event.seq) {
            return Err(FollowError::Malformed {
                shop: event.shop.clone(),
                item: event.item.clone(),
                seq: event.seq,
                prev_seq: event.prev_seq,
            });
        }
        let last = self.last_seq(&event.shop, &event.item);
        if event.seq <= last {
            self.stats.duplicates_dropped += 1;
            return Ok(());
        }
        // From here `prev_seq >= last`: the next event, or one after a gap.
        self.check_room(&event.shop, &event.item)?;
        if event.prev_seq > last {
            self.fill(&event.shop, &event.item, last, event.prev_seq, &mut emit)
                .await?;
            self.stats.gaps_filled += 1;
        }
        // What is emitted per item is gapless: after the fill, this event follows the
        // last one emitted.
        debug_assert_eq!(
            self.last_seq(&event.shop, &event.item),
            event.prev_seq,
            "item {}/{}: event {} emitted after a fill that ended elsewhere",
            event.shop,
            event.item,
            event.seq
        );
        let (shop, item, seq) = (event.shop.clone(), event.item.clone(), event.seq);
        emit(event).map_err(|e| FollowError::Emit { source: e.into() })?;
        self.set_last_seq(&shop, &item, seq);
        self.stats.events_emitted += 1;
        Ok(())
    }

    /// [`Follower::push`] into a vector. The vector grows by the gap's length, so a
    /// caller that may meet long gaps (a follower started far behind) should emit through
    /// `push` instead.
    pub async fn push_into(
        &mut self,
        event: Event,
        out: &mut Vec<Event>,
    ) -> Result<(), FollowError> {
        self.push(event, |e| {
            out.push(e);
            Ok::<(), std::convert::Infallible>(())
        })
        .await
    }

    /// Emits the events `last+1..=target` from the backfill, page by page, checking that
    /// each continues the sequence. Every page makes progress or ends the fill, so it
    /// asks at most `target - last` times.
    async fn fill<F, E>(
        &mut self,
        shop: &Arc<str>,
        item: &Arc<str>,
        last: u64,
        target: u64,
        emit: &mut F,
    ) -> Result<(), FollowError>
    where
        F: FnMut(Event) -> Result<(), E>,
        E: Into<BoxError>,
    {
        let first_seq = last + 1;
        let mut last = last;
        while last < target {
            let want = usize::try_from(target - last)
                .unwrap_or(usize::MAX)
                .min(FILL_PAGE_EVENTS_MAX);
            let page = self
                .backfill
                .events(shop, item, last, want)
                .await
                .map_err(|e| FollowError::Backfill {
                    shop: shop.clone(),
                    item: item.clone(),
                    after_seq: last,
                    source: Box::new(e),
                })?;
            if page.is_empty() {
                return Err(FollowError::GapNotFilled {
                    shop: shop.clone(),
                    item: item.clone(),
                    first_seq,
                    last_seq: target,
                    after_seq: last,
                });
            }
            for fetched in page {
                if fetched.seq > target {
                    // More than asked for: the rest is the stream's to deliver.
                    break;
                }
                if fetched.shop != *shop
                    || fetched.item != *item
                    || fetched.seq != last + 1
                    || fetched.prev_seq != last
                {
                    return Err(FollowError::Discontinuous {
                        shop: shop.clone(),
                        item: item.clone(),
                        expected_seq: last + 1,
                        got_shop: fetched.shop,
                        got_item: fetched.item,
                        got_seq: fetched.seq,
                        got_prev_seq: fetched.prev_seq,
                    });
                }
                let seq = fetched.seq;
                emit(fetched).map_err(|e| FollowError::Emit { source: e.into() })?;
                last = seq;
                self.set_last_seq(shop, item, seq);
                self.stats.events_emitted += 1;
                self.stats.events_filled += 1;
            }
        }
        Ok(())
    }

    /// Refuses a new item beyond `items_max`; a tracked one always has room.
    fn check_room(&self, shop: &str, item: &str) -> Result<(), FollowError> {
        let tracked = self
            .last_seq
            .get(shop)
            .is_some_and(|items| items.contains_key(item));
        if !tracked && self.items_tracked >= self.items_max {
            return Err(FollowError::TooManyItems {
                shop: shop.into(),
                item: item.into(),
                items_max: self.items_max,
            });
        }
        Ok(())
    }

    fn set_last_seq(&mut self, shop: &Arc<str>, item: &Arc<str>, seq: u64) {
        // An `Arc` clone per event (a counter increment) keeps this simple.
        let items = self.last_seq.entry(shop.clone()).or_default();
        match items.get_mut(&**item) {
            Some(last) => *last = seq,
            None => {
                items.insert(item.clone(), seq);
                self.items_tracked += 1;
                // The bound is kept on this count: it must be the items the maps hold.
                debug_assert_eq!(
                    self.items_tracked,
                    self.last_seq.values().map(HashMap::len).sum::<usize>(),
                    "the count of tracked items strayed from the items tracked"
                );
            }
        }
    }
}

/// Largest response body [`HttpBackfill`] reads: a full page is at most 1,000 events of
/// well under 1 KB each (names are at most 128 bytes), so this is several times a real
/// page and only stops a runaway or wrong server.
pub const PAGE_BODY_BYTES_MAX: usize = 8 * 1024 * 1024;

/// Longest part of an error response's body kept in the error message.
const ERROR_BODY_BYTES_MAX: usize = 512;

/// The items' events route of an `nrtxn serve` as a [`Backfill`] (and as the source of
/// `nrtxn follow`'s polling). Cloning shares the connection pool.
#[derive(Clone, Debug)]
pub struct HttpBackfill {
    client: reqwest::Client,
    /// The server's base URL (`http://host:port`, possibly with a path prefix).
    base_url: reqwest::Url,
}

/// Why [`HttpBackfill`] could not read a page. Each names the URL it was reading.
#[derive(Debug)]
#[non_exhaustive]
pub enum HttpBackfillError {
    /// The base URL is not an http(s) URL that paths can be appended to.
    InvalidUrl { url: String, reason: String },
    /// The HTTP client could not be built (TLS backend, resolver...).
    Client(reqwest::Error),
    /// No answer: the server is unreachable, refused, timed out or cut the connection.
    Request { url: String, source: reqwest::Error },
    /// An answer other than 200.
    Status {
        url: String,
        status: u16,
        body: String,
    },
    /// A body larger than [`PAGE_BODY_BYTES_MAX`].
    BodyTooLarge { url: String, bytes_max: usize },
    /// A body that is not `{"events":[...]}`.
    Decode {
        url: String,
        source: serde_json::Error,
    },
}

impl fmt::Display for HttpBackfillError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HttpBackfillError::InvalidUrl { url, reason } => {
                write!(f, "invalid server URL {url:?}: {reason}")
            }
            HttpBackfillError::Client(_) => write!(f, "cannot build the HTTP client"),
            HttpBackfillError::Request { url, .. } => write!(f, "GET {url}: no answer"),
            HttpBackfillError::Status { url, status, body } => {
                write!(f, "GET {url}: HTTP {status}: {body}")
            }
            HttpBackfillError::BodyTooLarge { url, bytes_max } => {
                write!(f, "GET {url}: body larger than {bytes_max} bytes")
            }
            HttpBackfillError::Decode { url, .. } => {
                write!(f, "GET {url}: not an events page")
            }
        }
    }
}

impl StdError for HttpBackfillError {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        match self {
            HttpBackfillError::Client(e) | HttpBackfillError::Request { source: e, .. } => Some(e),
            HttpBackfillError::Decode { source, .. } => Some(source),
            _ => None,
        }
    }
}

#[derive(Deserialize)]
struct EventsPage {
    events: Vec<Event>,
}

impl HttpBackfill {
    /// A backfill against the server at `base_url` (`http://127.0.0.1:8080`), each
    /// request bounded by `request_timeout` (connecting by at most the same).
    pub fn new(base_url: &str, request_timeout: Duration) -> Result<Self, HttpBackfillError> {
        let client = reqwest::Client::builder()
            .timeout(request_timeout)
            .connect_timeout(request_timeout)
            .build()
            .map_err(HttpBackfillError::Client)?;
        Self::with_client(client, base_url)
    }

    /// A backfill that shares `client` (its pool and timeouts).
    pub fn with_client(client: reqwest::Client, base_url: &str) -> Result<Self, HttpBackfillError> {
        let invalid = |reason: &str| HttpBackfillError::InvalidUrl {
            url: base_url.to_string(),
            reason: reason.to_string(),
        };
        let parsed = reqwest::Url::parse(base_url)
            .map_err(|e| invalid(&format!("{e} (expected http://host:port)")))?;
        if !matches!(parsed.scheme(), "http" | "https") || parsed.cannot_be_a_base() {
            return Err(invalid("expected http://host:port"));
        }
        Ok(HttpBackfill {
            client,
            base_url: parsed,
        })
    }

    /// The URL of one page: names are percent-encoded as path segments, and `limit` is
    /// kept within the route's 1..=1000.
    pub fn events_url(&self, shop: &str, item: &str, after_seq: u64, limit: usize) -> reqwest::Url {
        let mut url = self.base_url.clone();
        if let Ok(mut path) = url.path_segments_mut() {
            path.pop_if_empty()
                .extend(["v1", "shops", shop, "items", item, "events"]);
        }
        url.query_pairs_mut()
            .clear()
            .append_pair("after", &after_seq.to_string())
            .append_pair("limit", &limit.clamp(1, EVENTS_LIMIT_MAX).to_string());
        url
    }

    /// One page, as [`Backfill::events`] describes.
    pub async fn page(
        &self,
        shop: &str,
        item: &str,
        after_seq: u64,
        limit: usize,
    ) -> Result<Vec<Event>, HttpBackfillError> {
        let url = self.events_url(shop, item, after_seq, limit);
        let request_error = |e: reqwest::Error| HttpBackfillError::Request {
            url: url.to_string(),
            // The URL is already in our message.
            source: e.without_url(),
        };
        let mut res = self
            .client
            .get(url.clone())
            .send()
            .await
            .map_err(request_error)?;
        let status = res.status().as_u16();
        let bytes_max = if status == 200 {
            PAGE_BODY_BYTES_MAX
        } else {
            ERROR_BODY_BYTES_MAX
        };
        let mut body = Vec::new();
        while let Some(chunk) = res.chunk().await.map_err(request_error)? {
            if body.len() + chunk.len() > bytes_max {
                if status == 200 {
                    return Err(HttpBackfillError::BodyTooLarge {
                        url: url.to_string(),
                        bytes_max,
                    });
                }
                // An error's body is only a hint: its start is enough.
                body.extend_from_slice(&chunk[..bytes_max - body.len()]);
                break;
            }
            body.extend_from_slice(&chunk);
        }
        if status != 200 {
            return Err(HttpBackfillError::Status {
                url: url.to_string(),
                status,
                body: String::from_utf8_lossy(&body).into_owned(),
            });
        }
        let page: EventsPage =
            serde_json::from_slice(&body).map_err(|source| HttpBackfillError::Decode {
                url: url.to_string(),
                source,
            })?;
        Ok(page.events)
    }
}

impl Backfill for HttpBackfill {
    type Error = HttpBackfillError;

    async fn events(
        &mut self,
        shop: &str,
        item: &str,
        after_seq: u64,
        limit: usize,
    ) -> Result<Vec<Event>, HttpBackfillError> {
        self.page(shop, item, after_seq, limit).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nrtxn_actors::{Op, Status};

    fn ev(shop: &str, item: &str, seq: u64) -> Event {
        Event {
            shop: shop.into(),
            item: item.into(),
            seq,
            prev_seq: seq - 1,
            kind: if seq == 1 { Op::Load } else { Op::Decrement },
            status: Status::Ok,
            request_key: Some(format!("k-{item}-{seq}").into()),
            qty: 1,
            qty_taken: None,
            stock_after: 1_000 - seq as i64,
            reserved_after: 0,
            at: 1_700_000_000_000 + seq as i64,
            hold_id: None,
            reason: None,
            order_id: None,
            transfer_id: None,
            seller: None,
            buyer: None,
            requested_at: 1_700_000_000_000 + seq as i64,
            opens_at: None,
            closes_at: None,
            low_stock_at: None,
        }
    }

    /// The true history of some items, served page by page, at most `page_cap` events a
    /// page whatever the limit (to make fills take several pages).
    struct MemoryBackfill {
        truth: HashMap<(String, String), Vec<Event>>,
        page_cap: usize,
        calls: usize,
    }

    impl MemoryBackfill {
        fn new(items: &[(&str, &str, u64)], page_cap: usize) -> Self {
            let truth = items
                .iter()
                .map(|&(shop, item, n)| {
                    let events = (1..=n).map(|seq| ev(shop, item, seq)).collect();
                    ((shop.to_string(), item.to_string()), events)
                })
                .collect();
            MemoryBackfill {
                truth,
                page_cap,
                calls: 0,
            }
        }

        fn truth(&self, shop: &str, item: &str) -> Vec<Event> {
            self.truth[&(shop.to_string(), item.to_string())].clone()
        }
    }

    impl Backfill for MemoryBackfill {
        type Error = std::convert::Infallible;

        async fn events(
            &mut self,
            shop: &str,
            item: &str,
            after_seq: u64,
            limit: usize,
        ) -> Result<Vec<Event>, Self::Error> {
            self.calls += 1;
            let all = self
                .truth
                .get(&(shop.to_string(), item.to_string()))
                .map(Vec::as_slice)
                .unwrap_or(&[]);
            Ok(all
                .iter()
                .filter(|e| e.seq > after_seq)
                .take(limit.min(self.page_cap))
                .cloned()
                .collect())
        }
    }

    async fn feed(follower: &mut Follower<MemoryBackfill>, stream: Vec<Event>) -> Vec<Event> {
        let mut out = Vec::new();
        for e in stream {
            follower.push_into(e, &mut out).await.unwrap();
        }
        out
    }

    fn of(out: &[Event], item: &str) -> Vec<Event> {
        out.iter().filter(|e| &*e.item == item).cloned().collect()
    }

    #[tokio::test]
    async fn duplicates_are_dropped_without_asking_the_backfill() {
        let mut f = Follower::new(MemoryBackfill::new(&[("s", "a", 3)], 1000));
        let stream = [1, 1, 2, 1, 2, 3, 3].map(|seq| ev("s", "a", seq)).to_vec();
        let out = feed(&mut f, stream).await;
        assert_eq!(out, f.backfill.truth("s", "a"));
        assert_eq!(
            f.stats(),
            FollowStats {
                events_emitted: 3,
                duplicates_dropped: 4,
                gaps_filled: 0,
                events_filled: 0
            }
        );
        assert_eq!(f.backfill.calls, 0);
    }

    #[tokio::test]
    async fn a_dropped_message_is_filled_from_the_backfill_before_the_next_is_emitted() {
        let mut f = Follower::new(MemoryBackfill::new(&[("s", "a", 3)], 1000));
        let out = feed(&mut f, vec![ev("s", "a", 1), ev("s", "a", 3)]).await;
        assert_eq!(out, f.backfill.truth("s", "a"));
        assert_eq!((f.stats().gaps_filled, f.stats().events_filled), (1, 1));
        assert_eq!(f.last_seq("s", "a"), 3);
    }

    #[tokio::test]
    async fn a_long_gap_is_filled_page_by_page_and_a_late_start_skips_nothing_after_it() {
        // Three events a page: the gap 3..=9 takes three pages.
        let mut f = Follower::new(MemoryBackfill::new(&[("s", "a", 12)], 3));
        f.start_at("s", "a", 2).unwrap();
        let out = feed(&mut f, vec![ev("s", "a", 1), ev("s", "a", 10)]).await;
        assert_eq!(out, f.backfill.truth("s", "a")[2..10].to_vec());
        assert_eq!(f.backfill.calls, 3);
        assert_eq!(f.stats().duplicates_dropped, 1, "seq 1 is before the start");
    }

    #[tokio::test]
    async fn gaps_and_duplicates_interleaved_over_two_items_give_each_item_its_history() {
        let mut f = Follower::new(MemoryBackfill::new(&[("s", "a", 10), ("s", "b", 10)], 2));
        let stream = [
            ("a", 1),
            ("b", 1),
            ("a", 1), // duplicate
            ("a", 3), // gap: 2
            ("b", 2),
            ("b", 5), // gap: 3, 4
            ("a", 3), // duplicate
            ("b", 4), // duplicate, late
            ("a", 4),
            ("a", 7), // gap: 5, 6
            ("b", 6),
            ("a", 2),  // duplicate, late
            ("b", 10), // gap: 7..=9 (two pages)
            ("a", 10), // gap: 8, 9
            ("b", 10), // duplicate
        ]
        .map(|(item, seq)| ev("s", item, seq))
        .to_vec();
        let out = feed(&mut f, stream).await;
        assert_eq!(of(&out, "a"), f.backfill.truth("s", "a"));
        assert_eq!(of(&out, "b"), f.backfill.truth("s", "b"));
        assert_eq!(
            f.stats(),
            FollowStats {
                events_emitted: 20,
                duplicates_dropped: 5,
                gaps_filled: 5,
                events_filled: 10
            }
        );
        assert_eq!(f.items_tracked(), 2);
    }

    #[tokio::test]
    async fn a_gap_the_backfill_cannot_fill_is_an_error_naming_the_item_and_the_range() {
        // The source knows 1..=3 only; the stream shows 6.
        let mut f = Follower::new(MemoryBackfill::new(&[("s", "a", 3)], 1000));
        let mut out = Vec::new();
        f.push_into(ev("s", "a", 1), &mut out).await.unwrap();
        let err = f.push_into(ev("s", "a", 6), &mut out).await.unwrap_err();
        assert!(
            matches!(
                err,
                FollowError::GapNotFilled {
                    first_seq: 2,
                    last_seq: 5,
                    after_seq: 3,
                    ..
                }
            ),
            "{err:?}"
        );
        let msg = err.to_string();
        assert!(msg.contains("s/a") && msg.contains("2..=5"), "{msg}");
        // What could be filled was emitted; 6 was not, so nothing after the hole leaks.
        assert_eq!(out, f.backfill.truth("s", "a"));
        assert_eq!(f.last_seq("s", "a"), 3);
    }

    #[tokio::test]
    async fn a_backfill_answering_out_of_sequence_is_an_error_not_a_skip() {
        struct Skipping;
        impl Backfill for Skipping {
            type Error = std::convert::Infallible;
            async fn events(
                &mut self,
                shop: &str,
                item: &str,
                _after_seq: u64,
                _limit: usize,
            ) -> Result<Vec<Event>, Self::Error> {
                Ok(vec![ev(shop, item, 3)])
            }
        }
        let mut f = Follower::new(Skipping);
        let mut out = Vec::new();
        f.push_into(ev("s", "a", 1), &mut out).await.unwrap();
        let err = f.push_into(ev("s", "a", 4), &mut out).await.unwrap_err();
        assert!(
            matches!(
                err,
                FollowError::Discontinuous {
                    expected_seq: 2,
                    got_seq: 3,
                    ..
                }
            ),
            "{err:?}"
        );
        assert_eq!(out.len(), 1);
    }

    #[tokio::test]
    async fn malformed_events_and_items_beyond_the_bound_are_refused() {
        let mut f = Follower::new(MemoryBackfill::new(&[], 1000)).with_items_max(2);
        let mut out = Vec::new();
        let mut bad = ev("s", "a", 5);
        bad.prev_seq = 3;
        let err = f.push_into(bad, &mut out).await.unwrap_err();
        assert!(matches!(err, FollowError::Malformed { .. }), "{err:?}");
        f.push_into(ev("s", "a", 1), &mut out).await.unwrap();
        f.push_into(ev("t", "a", 1), &mut out).await.unwrap();
        let err = f.push_into(ev("s", "b", 1), &mut out).await.unwrap_err();
        assert!(
            matches!(err, FollowError::TooManyItems { items_max: 2, .. }),
            "{err:?}"
        );
        // Tracked items go on.
        f.push_into(ev("s", "a", 2), &mut out).await.unwrap();
        assert_eq!(out.len(), 3);
    }

    #[tokio::test]
    async fn an_emit_error_leaves_the_event_to_be_pushed_again() {
        let mut f = Follower::new(MemoryBackfill::new(&[("s", "a", 2)], 1000));
        let err = f
            .push(ev("s", "a", 1), |_| Err(std::io::Error::other("closed")))
            .await
            .unwrap_err();
        assert!(matches!(err, FollowError::Emit { .. }), "{err:?}");
        assert_eq!(f.last_seq("s", "a"), 0);
        let out = feed(&mut f, vec![ev("s", "a", 1), ev("s", "a", 2)]).await;
        assert_eq!(out, f.backfill.truth("s", "a"));
    }

    /// xorshift64: reproducible randomness without a crate.
    struct XorShift(u64);

    impl XorShift {
        fn next(&mut self) -> u64 {
            let mut x = self.0;
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            self.0 = x;
            x
        }

        /// True with probability `percent`/100.
        fn chance(&mut self, percent: u64) -> bool {
            self.next() % 100 < percent
        }

        fn below(&mut self, n: usize) -> usize {
            (self.next() % n as u64) as usize
        }
    }

    #[tokio::test]
    async fn a_lossy_duplicating_stream_comes_out_exactly_as_the_true_sequence() {
        const ITEMS: [&str; 3] = ["x", "y", "z"];
        const EVENTS_PER_ITEM: u64 = 500;
        for seed in 1..=20u64 {
            let mut rng = XorShift(0x9E37_79B9_7F4A_7C15 ^ seed);
            let truth: Vec<_> = ITEMS.map(|i| ("s", i, EVENTS_PER_ITEM)).to_vec();
            // Small pages so that long gaps take several.
            let mut f = Follower::new(MemoryBackfill::new(&truth, 7));
            // Interleave the items at random, each in its own order (as a topic keeps
            // an item's messages in order); per message: ~20% lost, ~20% delivered twice,
            // and ~2% of the time a redelivery of the last few (a consumer re-reading
            // from an older offset). An item's last message is never lost: nothing in a
            // stream can reveal a loss at its very end.
            let mut next = [1u64; 3];
            let mut stream = Vec::new();
            let (mut lost, mut doubled) = (0, 0);
            while next.iter().any(|&n| n <= EVENTS_PER_ITEM) {
                let i = rng.below(3);
                if next[i] > EVENTS_PER_ITEM {
                    continue;
                }
                let seq = next[i];
                next[i] += 1;
                let e = ev("s", ITEMS[i], seq);
                if seq < EVENTS_PER_ITEM && rng.chance(20) {
                    lost += 1;
                } else if rng.chance(25) {
                    doubled += 1;
                    stream.push(e.clone());
                    stream.push(e);
                } else {
                    stream.push(e);
                }
                if rng.chance(2) {
                    let back = 1 + rng.below(10) as u64;
                    for old in seq.saturating_sub(back).max(1)..=seq {
                        stream.push(ev("s", ITEMS[i], old));
                    }
                }
            }
            assert!(lost > 200 && doubled > 200, "seed {seed}: {lost} {doubled}");
            let out = feed(&mut f, stream).await;
            for item in ITEMS {
                assert!(
                    of(&out, item) == f.backfill.truth("s", item),
                    "seed {seed}: item {item} differs from its true sequence"
                );
            }
            let stats = f.stats();
            assert_eq!(stats.events_emitted, 3 * EVENTS_PER_ITEM, "seed {seed}");
            // A lost message redelivered by a replay before its gap showed is not filled.
            assert!(
                stats.events_filled > 0 && stats.events_filled <= lost,
                "seed {seed}"
            );
            assert!(stats.duplicates_dropped >= doubled, "seed {seed}");
        }
    }

    #[test]
    fn event_urls_encode_names_and_keep_the_limit_in_range() {
        let b = HttpBackfill::new("http://127.0.0.1:8080/", Duration::from_secs(1)).unwrap();
        assert_eq!(
            b.events_url("my shop", "a?b#c", 7, 5000).as_str(),
            "http://127.0.0.1:8080/v1/shops/my%20shop/items/a%3Fb%23c/events?after=7&limit=1000"
        );
        let err = HttpBackfill::new("127.0.0.1:8080", Duration::from_secs(1)).unwrap_err();
        assert!(err.to_string().contains("127.0.0.1:8080"), "{err}");
    }
}
