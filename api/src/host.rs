//! The open mode stays on its machine: while a loopback server serves without keys, it
//! answers only requests whose `Host` names a loopback address or `localhost`.
//!
//! Why: a server on 127.0.0.1 without keys trusts whoever can reach it, and a web page on
//! another site can reach it through DNS rebinding: the page's own name is made to
//! resolve to 127.0.0.1, and the browser then sends the page's requests, with the page's
//! name in `Host`, to this server, as same-origin requests whose answers it may read. A
//! browser always sends the name it resolved, so refusing every other `Host` closes that
//! door. A request with no `Host` at all (HTTP/1.0) cannot come from a browser and passes.
//! Once keys are checked, the key is the guard and any `Host` passes (a reverse proxy may
//! forward its own name).

use std::net::{IpAddr, Ipv6Addr};

use actix_web::body::{EitherBody, MessageBody};
use actix_web::dev::{ServiceRequest, ServiceResponse};
use actix_web::http::{header, StatusCode};
use actix_web::middleware::Next;
use actix_web::{web, HttpResponse};
use serde_json::json;

use crate::auth::Gate;

/// Whether `host` (a `Host` header's value: a name or address, with or without a port)
/// names this machine: `localhost`, a name under `.localhost` (RFC 6761: resolved to
/// loopback by the resolver itself), or a loopback address, IPv4 or IPv6 (also
/// IPv4-mapped).
pub fn names_loopback(host: &str) -> bool {
    let host = host.trim();
    let name = if let Some(rest) = host.strip_prefix('[') {
        // `[v6]` or `[v6]:port`.
        let Some((v6, after)) = rest.split_once(']') else {
            return false;
        };
        if !(after.is_empty() || after.starts_with(':')) {
            return false;
        }
        return v6.parse::<Ipv6Addr>().is_ok_and(|a| {
            a.is_loopback() || a.to_ipv4_mapped().is_some_and(|v4| v4.is_loopback())
        });
    } else {
        match host.rsplit_once(':') {
            Some((name, port)) if port.bytes().all(|b| b.is_ascii_digit()) => name,
            Some(_) => return false,
            None => host,
        }
    };
    let name = name.strip_suffix('.').unwrap_or(name).as_bytes();
    let suffix = b".localhost";
    if name.eq_ignore_ascii_case(b"localhost")
        || (name.len() > suffix.len()
            && name[name.len() - suffix.len()..].eq_ignore_ascii_case(suffix))
    {
        return true;
    }
    let Ok(name) = std::str::from_utf8(name) else {
        return false;
    };
    name.parse::<IpAddr>().is_ok_and(|a| a.is_loopback())
}

/// Middleware for a server bound to loopback addresses only (the `--metrics-listen`
/// server's; the API's runs [`misdirected`] in [`crate::front`]).
pub async fn loopback_host_only(
    req: ServiceRequest,
    next: Next<impl MessageBody>,
) -> Result<ServiceResponse<EitherBody<impl MessageBody>>, actix_web::Error> {
    match misdirected(&req) {
        None => Ok(next.call(req).await?.map_into_left_body()),
        Some(refusal) => Ok(req.into_response(refusal).map_into_right_body()),
    }
}

/// For a server bound to loopback addresses only: while the [`Gate`] does not check keys
/// (or there is none), a request whose `Host` does not name loopback is refused with
/// `421`, the answer returned here.
pub fn misdirected(req: &ServiceRequest) -> Option<HttpResponse> {
    // Without a gate (the `--metrics-listen` server) nothing needs a key: always open.
    let open = req
        .app_data::<web::Data<Gate>>()
        .is_none_or(|g| !g.enforcing());
    // HTTP/2 carries the name in the URI's authority rather than a `Host` header. Read
    // without a copy: this runs on every request of an open server.
    let refused = open
        && match req.headers().get(header::HOST) {
            Some(h) => !h.to_str().is_ok_and(names_loopback),
            None => req
                .uri()
                .authority()
                .is_some_and(|a| !names_loopback(a.as_str())),
        };
    if !refused {
        return None;
    }
    let host = req
        .headers()
        .get(header::HOST)
        .map(|h| String::from_utf8_lossy(h.as_bytes()).into_owned())
        .or_else(|| req.uri().authority().map(|a| a.to_string()))
        .unwrap_or_default();
    Some(
        HttpResponse::build(StatusCode::MISDIRECTED_REQUEST).json(json!({
            "error": "misdirected",
            "detail": format!(
                "this server runs without access keys on a loopback address and answers only \
                 requests for localhost or a loopback address, not for {:?} (a web page elsewhere \
                 must not reach it through DNS rebinding); create a key with `nrtxn keys create` \
                 to serve other names",
                host.chars().take(100).collect::<String>()
            ),
        })),
    )
}

#[cfg(test)]
mod tests {
    use super::names_loopback;

    #[test]
    fn loopback_names_and_addresses_pass_any_other_name_does_not() {
        for host in [
            "localhost",
            "LOCALHOST:8080",
            "localhost.",
            "app.localhost:1",
            "127.0.0.1",
            "127.8.9.10:8080",
            "[::1]",
            "[::1]:8080",
            "[::ffff:127.0.0.1]:80",
        ] {
            assert!(names_loopback(host), "{host}");
        }
        for host in [
            "evil.example",
            "evil.example:8080",
            "localhost.evil.example",
            "127.0.0.1.nip.io",
            "10.0.0.1:80",
            "0.0.0.0",
            "[::]:80",
            "[::1]x",
            "[fe80::1]",
            "localhost:80:80",
            "",
        ] {
            assert!(!names_loopback(host), "{host}");
        }
    }
}
