//! The one middleware every request of the API passes through, before and after the
//! router: its span, the screens that may refuse it before routing, and its count.
//!
//! One layer rather than one per concern: each `from_fn` layer boxes its future and the
//! service behind it, and every poll of a request (one per wake-up while it waits for its
//! outcome) walks through all of them. Merged, they cost 3.5 to 7% less of the server's
//! CPU per decision on `hot-sales` at the default log level, and nothing measurable with
//! the request spans off (`docs/decisions/request-path.md` has the figures).

use std::time::Instant;

use actix_web::body::{EitherBody, MessageBody};
use actix_web::dev::{ServiceRequest, ServiceResponse};
use actix_web::middleware::Next;
use actix_web::{web, HttpResponse};
use tracing::Instrument;

use crate::{auth, host, trace, validate, AppState};

/// Serves `req` inside its span ([`trace::request_span`]): refused by the first
/// screen that refuses it, else passed on to the router; either answer is counted by
/// route pattern and status, and written as the access line. `loopback`: the server
/// listens on loopback addresses only, so an open server checks the `Host` of each
/// request ([`host::misdirected`]).
pub async fn serve(
    req: ServiceRequest,
    next: Next<impl MessageBody + 'static>,
    loopback: bool,
) -> Result<ServiceResponse<EitherBody<impl MessageBody>>, actix_web::Error> {
    let span = trace::request_span(&req);
    let started = Instant::now();
    let state = req.app_data::<web::Data<AppState>>().cloned();
    let res = async move {
        match screen(&req, loopback) {
            Some(refusal) => Ok(req.into_response(refusal).map_into_right_body()),
            None => Ok(next.call(req).await?.map_into_left_body()),
        }
    }
    .instrument(span.clone())
    .await;
    if let Ok(res) = &res {
        if let Some(state) = state {
            count(&state, res);
        }
        trace::answered(&span, res.status(), started);
    }
    res
}

/// The refusal of the first screen that refuses `req`, in this order: a path whose
/// escapes do not decode to UTF-8 (the access check reads the shop's name from it), a
/// `Host` other than this machine's on an open loopback server, then the access key and
/// its rate.
fn screen(req: &ServiceRequest, loopback: bool) -> Option<HttpResponse> {
    validate::undecodable_path(req)
        .or_else(|| loopback.then(|| host::misdirected(req)).flatten())
        .or_else(|| auth::refused(req))
}

/// Counts an answer by route pattern (`unmatched` for none) and status.
fn count<B>(state: &AppState, res: &ServiceResponse<B>) {
    let route = res
        .request()
        .match_pattern()
        .unwrap_or_else(|| "unmatched".into());
    state
        .engine
        .metrics()
        .http_requests
        .with_label_values(&[route.as_str(), res.status().as_str()])
        .inc();
}
