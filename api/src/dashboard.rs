//! The dashboard at `/`: one page, its script and its style, embedded in the binary (no
//! CDN, no build step). It holds no data: it reads the API as any client would, with the
//! access key its user gives it (`GET /v1/whoami` tells it what the key may see).

use actix_web::http::header;
use actix_web::HttpResponse;

const PAGE: &str = include_str!("../assets/dashboard.html");
const SCRIPT: &str = include_str!("../assets/dashboard.js");
const STYLE: &str = include_str!("../assets/dashboard.css");

/// The page may run only its own script and style, and talk only to this server: a
/// key typed into it cannot be sent elsewhere by anything injected.
const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; \
connect-src 'self'; img-src 'self' data:; form-action 'none'; frame-ancestors 'none'";

/// An embedded file, served under [`CSP`] and `nosniff` (the dashboard's and `/docs`'s).
pub(crate) fn asset(content_type: &str, body: &'static str) -> HttpResponse {
    HttpResponse::Ok()
        .content_type(content_type)
        .insert_header((header::CONTENT_SECURITY_POLICY, CSP))
        .insert_header((header::X_CONTENT_TYPE_OPTIONS, "nosniff"))
        .insert_header((header::CACHE_CONTROL, "no-cache"))
        .body(body)
}

pub async fn page() -> HttpResponse {
    asset("text/html; charset=utf-8", PAGE)
}

pub async fn script() -> HttpResponse {
    asset("text/javascript; charset=utf-8", SCRIPT)
}

pub async fn style() -> HttpResponse {
    asset("text/css; charset=utf-8", STYLE)
}
