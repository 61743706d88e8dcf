//! One tracing span per HTTP request, so that every log line written while the request
//! is served names it: its method, its route pattern, and the shop, item and request key
//! the route or the body names. With `nrtxn serve --log-format json` they are the
//! `span` object of each line.
//!
//! The span's target is [`TARGET`] at level INFO, the server's default level, so that
//! the lines of a request carry it whatever else is logged. The access line (one per
//! answer, with its status and time) is DEBUG on the same target: off unless asked for
//! (`RUST_LOG=info,nrtxn::http=debug`), since at the rates nrtxn serves a line per
//! request would be most of its work.

use std::time::Instant;

use actix_web::body::MessageBody;
use actix_web::dev::{ServiceRequest, ServiceResponse};
use actix_web::http::StatusCode;
use actix_web::middleware::Next;
use tracing::field::Empty;

use crate::validate::percent_decoded;

/// The target of the request spans and of the access lines.
pub const TARGET: &str = "nrtxn::http";

/// The path parameters that name a request key: the route's own key for its request
/// (`GET .../txns/{request_key}`, a hold's or an order's id, a load's `request_id`).
const KEY_PARAMS: [&str; 4] = ["request_key", "request_id", "hold_id", "order_id"];

/// The request's span, before routing: its method only ([`record_route`] adds the
/// rest once the router has matched the request).
pub fn request_span(req: &ServiceRequest) -> tracing::Span {
    // The route and the path's names are recorded once the router has matched the
    // request ([`record_route`]): found here, before routing, the pattern cost a second
    // match of the path against every route, about 4% of the process's CPU under
    // `bench.sh`'s hot load with the span on (INFO, the default), and 5.5% with it off
    // until it was skipped then. So the lines of the screens before routing (the
    // access check, the path check) carry the method only.
    tracing::info_span!(
        target: TARGET,
        "request",
        method = %req.method(),
        route = Empty,
        shop = Empty,
        item = Empty,
        request_key = Empty,
    )
}

/// Whether the request spans are on (the log's filter lets `nrtxn::http` INFO through),
/// asked once when the routes are built: without them [`record_route`] has nothing to
/// record, and is left out of the chain.
pub fn spans_enabled() -> bool {
    !tracing::info_span!(target: TARGET, "request").is_disabled()
}

/// The access line of an answer (DEBUG: off unless asked for), in the request's span.
pub fn answered(span: &tracing::Span, status: StatusCode, started: Instant) {
    span.in_scope(|| {
        tracing::debug!(
            target: TARGET,
            status = status.as_u16(),
            elapsed_us = started.elapsed().as_micros() as u64,
            "answered"
        );
    });
}

/// Middleware of each route's resource (`traced` in `lib.rs`): records the matched
/// route's pattern and the shop, item and key it names on the request's span, before the
/// handler runs. After routing, actix reads the pattern off the matched resource.
pub async fn record_route(
    req: ServiceRequest,
    next: Next<impl MessageBody>,
) -> Result<ServiceResponse<impl MessageBody>, actix_web::Error> {
    let span = tracing::Span::current();
    if !span.is_disabled() {
        if let Some(route) = req.match_pattern() {
            span.record("route", route.as_str());
            record_path_params(&span, &route, req.path());
        }
    }
    next.call(req).await
}

/// Records `unmatched` as the route of a request no route has (never the path itself:
/// its names are the caller's).
pub fn record_unmatched() {
    tracing::Span::current().record("route", "unmatched");
}

/// Records the request key a body names (a transaction's, a hold's, an order's, a
/// load's) on the request's span, once the handler has read it.
pub fn record_key(key: &str) {
    tracing::Span::current().record("request_key", key);
}

/// Records the shop, item and key segments of `path`, matched segment by segment
/// against the route `pattern` (every parameter of nrtxn's routes is a whole segment).
fn record_path_params(span: &tracing::Span, pattern: &str, path: &str) {
    for (param, segment) in pattern.split('/').zip(path.split('/')) {
        let Some(param) = param.strip_prefix('{').and_then(|p| p.strip_suffix('}')) else {
            continue;
        };
        let field = match param {
            "shop" | "item" => param,
            p if KEY_PARAMS.contains(&p) => "request_key",
            _ => continue,
        };
        let decoded = percent_decoded(segment);
        span.record(field, &*String::from_utf8_lossy(&decoded));
    }
}
