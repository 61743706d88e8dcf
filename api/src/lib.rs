//! nrtxn's HTTP front: routes, validation, error bodies and the metrics endpoint.
//! One file per route group; the engine behind it is [`nrtxn_actors::Engine`].
// The OpenAPI document is one `json!` literal per group of schemas, deeper than the
// macro's default recursion allows.
#![recursion_limit = "256"]

use std::sync::Arc;

use actix_web::{web, HttpResponse};
use nrtxn_actors::Engine;
use serde_json::json;

pub mod auth;
pub mod dashboard;
pub mod error;
pub mod events;
pub mod front;
pub mod health;
pub mod holds;
pub mod host;
pub mod items;
pub mod openapi;
pub mod orders;
pub mod settings;
pub mod stats;
pub mod stream;
pub mod trace;
pub mod transfers;
pub mod txns;
pub mod validate;

pub use error::ApiError;

/// `res` with `body` as its JSON. As actix-web's `HttpResponseBuilder::json`, but the
/// body is written into a buffer the size of a typical answer (an outcome is about 400
/// bytes; `serde_json::to_string` starts at 128 and grows twice) and the content type is
/// a static header value: the routes every call takes answer through this.
pub fn json_response(
    mut res: actix_web::HttpResponseBuilder,
    body: &impl serde::Serialize,
) -> HttpResponse {
    let mut bytes = Vec::with_capacity(512);
    match serde_json::to_writer(&mut bytes, body) {
        Ok(()) => res
            .insert_header((
                actix_web::http::header::CONTENT_TYPE,
                actix_web::http::header::HeaderValue::from_static("application/json"),
            ))
            .body(bytes),
        Err(e) => HttpResponse::from_error(actix_web::error::JsonPayloadError::Serialize(e)),
    }
}

/// What every handler shares.
pub struct AppState {
    pub engine: Arc<Engine>,
    /// Where `GET .../events/stream` reads the shops' events (`None`: no stream here).
    pub feed: Option<Arc<dyn nrtxn_actors::EventFeed>>,
    /// Most streams one shop keeps open on this node ([`stream::STREAMS_PER_SHOP_MAX`]
    /// by default).
    pub streams_per_shop_max: usize,
}

/// The prefix of a shop's routes. They are matched under one scope: the router then
/// matches the shop's segment once and the rest of the path mostly by plain comparison,
/// where a flat list matched each route's whole pattern by a regular expression in turn
/// (3% of the server's CPU on `hot-sales`, docs/decisions/request-path.md).
const SHOP_SCOPE: &str = "/v1/shops/{shop}";

/// The routes nearly every call takes, as (method, path) of [`ROUTES`], registered first:
/// the router tries a scope's routes in the order they were registered, and matches each
/// one with a `{name}` segment by a regular expression, so an order's confirm, last but
/// a few in the contract's order, was tried against a dozen patterns first (5% of the
/// HTTP threads' CPU on `orders`). No two routes of one method match one path, so the
/// order changes nothing but the time a match takes.
pub const HOT_ROUTES: &[(&str, &str)] = &[
    ("post", "/v1/shops/{shop}/txns"),
    ("post", "/v1/shops/{shop}/holds"),
    ("post", "/v1/shops/{shop}/holds/{hold_id}/confirm"),
    ("post", "/v1/shops/{shop}/holds/{hold_id}/cancel"),
    ("post", "/v1/shops/{shop}/orders"),
    ("post", "/v1/shops/{shop}/orders/{order_id}/confirm"),
    ("post", "/v1/shops/{shop}/orders/{order_id}/cancel"),
    ("post", "/v1/shops/{shop}/txns/batch"),
    ("get", "/v1/shops/{shop}/txns/{request_key}"),
];

/// Where a route comes in the router's order: its place in [`HOT_ROUTES`], else after
/// them all.
fn hot_rank(method: &str, path: &str) -> usize {
    HOT_ROUTES
        .iter()
        .position(|&(m, p)| m == method && p == path)
        .unwrap_or(HOT_ROUTES.len())
}

/// Declares every route once: [`ROUTES`] (what the OpenAPI document, [`openapi`], is
/// generated from) and [`configure`] (what the server serves) come from the same lines,
/// so the contract cannot leave a route out.
macro_rules! routes {
    ($( $method:ident $path:literal => $handler:path, $id:literal, $summary:literal; )*) => {
        /// Every route: (method, path, operation id, summary), in the contract's order (the
        /// router tries [`HOT_ROUTES`] first, then these).
        pub const ROUTES: &[(&str, &str, &str, &str)] = &[
            $( (stringify!($method), $path, $id, $summary), )*
        ];

        /// Registers every route; a shop's under one scope (see `SHOP_SCOPE`).
        pub fn configure(cfg: &mut web::ServiceConfig) {
            // Whether the request spans are on, asked once for all the routes.
            let spans = trace::spans_enabled();
            let traced = |path, method, route| traced(path, method, route, spans);
            let mut shop = web::scope(SHOP_SCOPE);
            let mut routes: Vec<(&'static str, &'static str, actix_web::Route)> =
                vec![$( (stringify!($method), $path, web::$method().to($handler)), )*];
            // Stable: the rest keep the contract's order.
            routes.sort_by_key(|(method, path, _)| hot_rank(method, path));
            for (method, path, route) in routes {
                match path.strip_prefix(SHOP_SCOPE) {
                    Some(rest) => shop = shop.service(traced(rest, method, route)),
                    None => {
                        cfg.service(traced(path, method, route));
                    }
                }
            }
            cfg.service(shop);
            cfg.service(traced("/openapi.json", "get", web::get().to(openapi::serve_json)))
                .service(traced("/docs", "get", web::get().to(openapi::serve_docs)))
                .service(traced("/docs.js", "get", web::get().to(openapi::serve_docs_script)))
                .service(traced("/docs.css", "get", web::get().to(openapi::serve_docs_style)))
                .service(traced("/", "get", web::get().to(dashboard::page)))
                .service(traced("/dashboard.js", "get", web::get().to(dashboard::script)))
                .service(traced("/dashboard.css", "get", web::get().to(dashboard::style)))
                .default_service(web::to(not_found));
        }
    };
}

routes! {
    get "/healthz" => health::healthz, "healthz", "Liveness: 200 while the process runs";
    get "/readyz" => health::readyz, "readyz", "Readiness: 200 once the node can take requests";
    get "/metrics" => health::metrics, "metrics", "Prometheus metrics (admin)";
    get "/v1/whoami" => auth::whoami, "whoami", "The access key a request carries: its shop and role (any key)";
    put "/v1/shops/{shop}/items" => items::put_items, "loadItems", "Load items: set their stock (operators)";
    get "/v1/shops/{shop}/items" => items::list_items, "listItems", "List a shop's items, page by page";
    post "/v1/shops/{shop}/items/adjust" => txns::post_adjust, "adjustItems", "Relative stock adjustments with a reason (operators)";
    get "/v1/shops/{shop}/items/{item}" => items::get_item, "getItem", "An item's durable state";
    get "/v1/shops/{shop}/loads/{request_id}" => items::get_load, "getLoad", "The outcome of a load call by its request_id";
    post "/v1/shops/{shop}/txns" => txns::post_txn, "submitTxn", "Submit a decrement or increment";
    post "/v1/shops/{shop}/txns/batch" => txns::post_batch, "submitBatch", "Submit up to 1,000 transactions";
    get "/v1/shops/{shop}/txns/{request_key}" => txns::get_txn, "getTxn", "Poll a request by its key";
    get "/v1/shops/{shop}/items/{item}/events" => events::get_events, "getEvents", "An item's events in seq order (operators)";
    get "/v1/shops/{shop}/events/stream" => stream::get_stream, "streamEvents", "The shop's events as server-sent events (operators)";
    post "/v1/shops/{shop}/holds" => holds::post_hold, "placeHold", "Reserve stock until confirmed, cancelled or expired";
    post "/v1/shops/{shop}/items/{item}/release-holds" => items::release_holds, "releaseHolds", "Release every pending hold of an item and cancel its held orders, once per request_id (operators)";
    post "/v1/shops/{shop}/transfers" => transfers::post_transfer, "transfer", "Move stock from one item to another, both sides or neither, once per request_id (operators)";
    get "/v1/shops/{shop}/transfers/{request_id}" => transfers::get_transfer, "getTransfer", "A transfer as it stands (operators)";
    get "/v1/shops/{shop}/holds" => holds::list_holds, "listHolds", "The shop's holds, by item, buyer and state, paged";
    get "/v1/shops/{shop}/holds/{hold_id}" => holds::get_hold, "getHold", "A hold's state";
    post "/v1/shops/{shop}/holds/{hold_id}/confirm" => holds::confirm_hold, "confirmHold", "Sell a held quantity";
    post "/v1/shops/{shop}/holds/{hold_id}/cancel" => holds::cancel_hold, "cancelHold", "Release a held quantity";
    post "/v1/shops/{shop}/holds/{hold_id}/extend" => holds::extend_hold, "extendHold", "Give a pending hold a new expiry, now + ttl_ms";
    post "/v1/shops/{shop}/orders" => orders::post_order, "placeOrder", "Reserve every line of an order, or none";
    get "/v1/shops/{shop}/orders" => orders::list_orders, "listOrders", "The shop's orders, by buyer and state, paged";
    get "/v1/shops/{shop}/orders/{order_id}" => orders::get_order, "getOrder", "An order's state and lines";
    post "/v1/shops/{shop}/orders/{order_id}/confirm" => orders::confirm_order, "confirmOrder", "Sell every line of an order";
    post "/v1/shops/{shop}/orders/{order_id}/cancel" => orders::cancel_order, "cancelOrder", "Release every line of an order";
    post "/v1/shops/{shop}/orders/{order_id}/extend" => orders::extend_order, "extendOrder", "Give a held order and its lines a new expiry, now + ttl_ms";
    put "/v1/shops/{shop}/settings" => settings::put_settings, "putSettings", "Set the shop's check-back and stock alerts; a field left out keeps its value (operators)";
    get "/v1/shops/{shop}/settings" => settings::get_settings, "getSettings", "The shop's check-back and alert settings (operators)";
    get "/v1/shops/{shop}/notifications" => settings::get_notifications, "getNotifications", "The shop's latest alerts that failed for good (operators)";
    get "/v1/shops/{shop}/dead-letters" => settings::get_dead_letters, "getDeadLetters", "Check-backs that found no answer (operators)";
    post "/v1/shops/{shop}/dead-letters/{id}/retry" => settings::retry_dead_letter, "retryDeadLetter", "Ask the shop again now about a dead letter's hold or order (operators)";
    post "/v1/shops/{shop}/dead-letters/{id}/resolve" => settings::resolve_dead_letter, "resolveDeadLetter", "End a dead letter's hold or order: confirm or release (operators)";
    get "/v1/shops/{shop}/stats" => stats::get_stats, "getStats", "This node's live figures of the shop: decisions/s, p99, statuses, last refused (operators)";
}

/// One route as a resource of its own, guarded by its method as `cfg.route` would, whose
/// request span gets the route and the path's names once the router has matched it
/// ([`trace::record_route`]) when `spans` are on.
fn traced(
    path: &'static str,
    method: &str,
    route: actix_web::Route,
    spans: bool,
) -> impl actix_web::dev::HttpServiceFactory {
    let method: actix_web::http::Method = method
        .to_ascii_uppercase()
        .parse()
        .expect("the routes' methods are HTTP methods");
    web::resource(path)
        .guard(actix_web::guard::Method(method))
        .wrap(actix_web::middleware::Condition::new(
            spans,
            actix_web::middleware::from_fn(trace::record_route),
        ))
        .route(route)
}

/// No route for this method and path: `405` with the methods the path has, when it
/// has some, else `404`.
async fn not_found(req: actix_web::HttpRequest) -> HttpResponse {
    trace::record_unmatched();
    let path = req.path();
    // The most literal patterns the path matches (`/items/adjust`, not `/items/{item}`).
    let matching: Vec<(usize, &str)> = ROUTES
        .iter()
        .filter_map(|(method, pattern, _, _)| Some((path_matches(pattern, path)?, *method)))
        .collect();
    let best = matching.iter().map(|(n, _)| *n).max().unwrap_or(0);
    let allowed: Vec<&str> = matching
        .iter()
        .filter(|(n, _)| *n == best)
        .map(|(_, m)| *m)
        .collect();
    if allowed.is_empty() {
        return HttpResponse::NotFound()
            .json(json!({ "error": "not_found", "detail": "no such route" }));
    }
    let allow = allowed
        .iter()
        .map(|m| m.to_ascii_uppercase())
        .collect::<Vec<_>>()
        .join(", ");
    HttpResponse::MethodNotAllowed()
        .insert_header(("Allow", allow.clone()))
        .json(json!({
            "error": "method_not_allowed",
            "detail": format!("{} {path}: this path takes {allow}", req.method()),
        }))
}

/// Whether `path` is one of `pattern`'s (each `{name}` one non-empty segment): the number
/// of its literal segments when it is.
fn path_matches(pattern: &str, path: &str) -> Option<usize> {
    let (p, q): (Vec<&str>, Vec<&str>) = (pattern.split('/').collect(), path.split('/').collect());
    let fits = p.len() == q.len()
        && p.iter()
            .zip(&q)
            .all(|(a, b)| a == b || (a.starts_with('{') && !b.is_empty()));
    fits.then(|| p.iter().filter(|a| !a.starts_with('{')).count())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whether one path can match both patterns: as many segments, each the same or a
    /// `{name}` on either side.
    fn overlap(a: &str, b: &str) -> bool {
        let (a, b): (Vec<&str>, Vec<&str>) = (a.split('/').collect(), b.split('/').collect());
        a.len() == b.len()
            && a.iter()
                .zip(&b)
                .all(|(x, y)| x == y || x.starts_with('{') || y.starts_with('{'))
    }

    #[test]
    fn the_hot_routes_are_routes_and_no_path_matches_two_routes_of_one_method() {
        for (method, path) in HOT_ROUTES {
            assert!(
                ROUTES.iter().any(|(m, p, _, _)| m == method && p == path),
                "{method} {path} is in HOT_ROUTES but not a route"
            );
        }
        for (i, (m1, p1, _, _)) in ROUTES.iter().enumerate() {
            for (m2, p2, _, _) in &ROUTES[i + 1..] {
                assert!(
                    m1 != m2 || !overlap(p1, p2),
                    "{m1} {p1} and {p2}: one path matches both, so the router's order decides"
                );
            }
        }
    }
}
