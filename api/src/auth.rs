//! Access control at the edge: access keys scoped to a shop and a role, checked before a
//! request's body is read and before anything reaches an actor, and a per-shop token
//! bucket.
//!
//! A key's secret is `nrtxn_{id}_{random}`. The server keeps, per key id, only the
//! SHA-256 of the whole secret ([`AccessKey::secret_sha256`]); a presented secret is
//! looked up by its id and its hash compared in constant time. The id is not secret (it
//! is what `nrtxn keys list` prints), so the lookup may take more or less time by id.
//!
//! What a route needs is [`SHOP_ROUTES`]: one line per route of a shop. A route of a shop
//! that is not listed needs an operator; a route outside the shops other than the health
//! checks needs an admin.

use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Instant;

use actix_web::dev::{ResourceDef, ServiceRequest};
use actix_web::http::header::{self, HeaderValue};
use actix_web::http::{Method, StatusCode};
use actix_web::{web, HttpMessage, HttpResponse};
use serde_json::json;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

/// What a key may do. Ordered: each role may do what the roles below it may.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Role {
    /// Sells: transactions, batches, polls, holds, item reads, for its own shop.
    Seller,
    /// Runs a shop: a seller's routes plus loads, events and every other route of it.
    Operator,
    /// Everything, every shop, and `/metrics`.
    Admin,
}

impl Role {
    /// "a seller", "an operator", "an admin": for messages.
    pub fn with_article(self) -> &'static str {
        match self {
            Role::Seller => "a seller",
            Role::Operator => "an operator",
            Role::Admin => "an admin",
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Role::Seller => "seller",
            Role::Operator => "operator",
            Role::Admin => "admin",
        }
    }
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for Role {
    type Err = String;
    fn from_str(s: &str) -> Result<Role, String> {
        match s {
            "seller" => Ok(Role::Seller),
            "operator" => Ok(Role::Operator),
            "admin" => Ok(Role::Admin),
            other => Err(format!(
                "unknown role {other:?}: expected seller, operator or admin"
            )),
        }
    }
}

/// The role each route of a shop needs, as `(method, path after /v1/shops/{shop}/, role)`;
/// a `{name}` segment matches any one non-empty segment, as in the router. A new route
/// of a shop gets its role here, in one line; one not listed needs an operator.
pub const SHOP_ROUTES: &[(&str, &str, Role)] = &[
    ("POST", "txns", Role::Seller),
    ("POST", "txns/batch", Role::Seller),
    ("GET", "txns/{request_key}", Role::Seller),
    ("POST", "holds", Role::Seller),
    ("GET", "holds", Role::Seller),
    ("GET", "holds/{hold_id}", Role::Seller),
    ("POST", "holds/{hold_id}/confirm", Role::Seller),
    ("POST", "holds/{hold_id}/cancel", Role::Seller),
    ("POST", "holds/{hold_id}/extend", Role::Seller),
    ("POST", "orders", Role::Seller),
    ("GET", "orders", Role::Seller),
    ("GET", "orders/{order_id}", Role::Seller),
    ("POST", "orders/{order_id}/confirm", Role::Seller),
    ("POST", "orders/{order_id}/cancel", Role::Seller),
    ("POST", "orders/{order_id}/extend", Role::Seller),
    ("GET", "items/{item}", Role::Seller),
    ("GET", "items", Role::Seller),
    ("PUT", "items", Role::Operator),
    ("GET", "items/{item}/events", Role::Operator),
    ("GET", "events/stream", Role::Operator),
];

/// Routes anyone may call, whatever the keys: a load balancer's and an orchestrator's
/// probes carry no key.
/// The dashboard's page and assets are open too: they hold no data, and the page asks
/// for a key when the server wants one.
pub const OPEN_PATHS: &[&str] = &[
    "/healthz",
    "/readyz",
    "/openapi.json",
    "/docs",
    "/docs.js",
    "/docs.css",
    "/",
    "/dashboard.js",
    "/dashboard.css",
];

/// The route that tells a key's holder what the key is: any valid key may call it.
pub const WHOAMI_PATH: &str = "/v1/whoami";

/// The prefix of every route of a shop; `{shop}` is decoded by the same deserializer the
/// routes' `web::Path` uses, so a key is checked against the shop the handler will see.
const SHOP_PREFIX: &str = "/v1/shops/{shop}";

/// Prefix of every secret: tells an nrtxn key from another token at a glance (and to
/// secret scanners).
pub const SECRET_PREFIX: &str = "nrtxn_";

/// A key as the server keeps it: never its secret, only the secret's SHA-256.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AccessKey {
    /// Short random id, the middle part of the secret; what `keys list` and logs show.
    pub id: String,
    pub name: String,
    /// The one shop the key is for; `None` for an admin key (every shop).
    pub shop: Option<String>,
    pub role: Role,
    /// SHA-256 of the whole secret.
    pub secret_sha256: [u8; 32],
}

/// Marks a request made with a seller key, for the routes whose rules depend on it (a
/// seller's increment must be a return: [`crate::txns`]). Put in the request's
/// extensions by the access check; a zero-sized value, so marking costs no allocation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SellerKey;

/// SHA-256 of a secret, as stored.
pub fn secret_sha256(secret: &str) -> [u8; 32] {
    Sha256::digest(secret.as_bytes()).into()
}

/// The id part of a secret `nrtxn_{id}_{random}`, or `None` if it is not one.
pub fn secret_id(secret: &str) -> Option<&str> {
    let rest = secret.strip_prefix(SECRET_PREFIX)?;
    let (id, random) = rest.split_once('_')?;
    (!id.is_empty() && !random.is_empty()).then_some(id)
}

/// The unrevoked keys, by id: what requests are checked against. Replaced whole on each
/// reload, never changed in place.
#[derive(Debug, Default)]
pub struct KeySet {
    by_id: HashMap<String, AccessKey>,
}

impl KeySet {
    pub fn new(keys: impl IntoIterator<Item = AccessKey>) -> KeySet {
        KeySet {
            by_id: keys.into_iter().map(|k| (k.id.clone(), k)).collect(),
        }
    }

    pub fn len(&self) -> usize {
        self.by_id.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_id.is_empty()
    }

    /// Whether `key` is one of the set, as it was (a key revoked, or revoked and made
    /// again under its id, is not).
    pub fn holds(&self, key: &AccessKey) -> bool {
        self.by_id
            .get(&key.id)
            .is_some_and(|k| k.secret_sha256 == key.secret_sha256)
    }

    /// The key whose secret this is, if it is one of the set. The hash is compared in
    /// constant time, so the time taken does not tell how much of a guess was right.
    pub fn verify(&self, secret: &str) -> Option<&AccessKey> {
        let key = self.by_id.get(secret_id(secret)?)?;
        let presented = secret_sha256(secret);
        bool::from(presented.ct_eq(&key.secret_sha256)).then_some(key)
    }
}

/// A per-shop token bucket: `rate_per_s` tokens a second up to `burst`; a request takes
/// one. The buckets live in a bounded map: a full bucket behaves as an absent one, so
/// full buckets are dropped when room is needed, and past the bound the fullest bucket
/// goes (its shop gets a fresh, full bucket: the limit errs towards letting a shop in,
/// never towards locking a shop out because other shops filled the map).
pub struct ShopRateLimiter {
    rate_per_s: f64,
    burst: f64,
    /// Shards of the map, so that two HTTP workers rarely wait on one lock; a
    /// `std::sync::Mutex` because it is held for a map lookup, never across an await.
    shards: Box<[Mutex<Buckets>]>,
    hasher: RandomState,
}

/// Most shops with a bucket at once: about 250 bytes each with the longest names, so at
/// most about 16 MB.
pub const SHOP_BUCKETS_MAX: usize = 65_536;
const BUCKET_SHARDS: usize = 16;
const BUCKETS_PER_SHARD_MAX: usize = SHOP_BUCKETS_MAX / BUCKET_SHARDS;

/// One shard of the buckets, by shop.
type Buckets = HashMap<Box<str>, Bucket>;

#[derive(Clone, Copy, Debug)]
struct Bucket {
    tokens: f64,
    at: Instant,
}

impl Bucket {
    fn refilled(self, now: Instant, rate_per_s: f64, burst: f64) -> f64 {
        let elapsed_s = now.saturating_duration_since(self.at).as_secs_f64();
        (self.tokens + elapsed_s * rate_per_s).min(burst)
    }
}

impl ShopRateLimiter {
    /// `rate_per_s` > 0 and `burst` ≥ 1 (checked by the configuration).
    pub fn new(rate_per_s: f64, burst: u32) -> ShopRateLimiter {
        ShopRateLimiter {
            rate_per_s,
            burst: f64::from(burst.max(1)),
            shards: (0..BUCKET_SHARDS)
                .map(|_| Mutex::new(HashMap::new()))
                .collect(),
            hasher: RandomState::new(),
        }
    }

    /// Takes a token of `shop`'s bucket, or says in how many whole seconds (at least 1)
    /// one will be there.
    pub fn take(&self, shop: &str, now: Instant) -> Result<(), u64> {
        let shard = &self.shards[(self.hasher.hash_one(shop) as usize) % BUCKET_SHARDS];
        // A poisoned lock only means another thread panicked mid-update of a float: the
        // map is still a valid map, so go on with it.
        let mut map = shard.lock().unwrap_or_else(|e| e.into_inner());
        let (rate, burst) = (self.rate_per_s, self.burst);
        if let Some(bucket) = map.get_mut(shop) {
            let tokens = bucket.refilled(now, rate, burst);
            return if tokens >= 1.0 {
                *bucket = Bucket {
                    tokens: tokens - 1.0,
                    at: now,
                };
                Ok(())
            } else {
                *bucket = Bucket { tokens, at: now };
                Err((((1.0 - tokens) / rate).ceil() as u64).max(1))
            };
        }
        if map.len() >= BUCKETS_PER_SHARD_MAX {
            map.retain(|_, b| b.refilled(now, rate, burst) < burst);
            if map.len() >= BUCKETS_PER_SHARD_MAX {
                let fullest = map
                    .iter()
                    .max_by(|a, b| {
                        let (ta, tb) = (
                            a.1.refilled(now, rate, burst),
                            b.1.refilled(now, rate, burst),
                        );
                        ta.total_cmp(&tb)
                    })
                    .map(|(k, _)| k.clone());
                if let Some(k) = fullest {
                    map.remove(&k);
                }
            }
        }
        map.insert(
            shop.into(),
            Bucket {
                tokens: burst - 1.0,
                at: now,
            },
        );
        Ok(())
    }

    /// Takes `more` tokens of `shop`'s bucket (capped so that, with the one the call's
    /// access check took, it is at most the bucket's size), or none and says in how
    /// many whole seconds (at least 1) there will be enough. A shop without a bucket has
    /// a full one.
    pub fn take_more(&self, shop: &str, more: usize, now: Instant) -> Result<(), u64> {
        let (rate, burst) = (self.rate_per_s, self.burst);
        let want = (more as f64).min(burst - 1.0);
        if want <= 0.0 {
            return Ok(());
        }
        let shard = &self.shards[(self.hasher.hash_one(shop) as usize) % BUCKET_SHARDS];
        let mut map = shard.lock().unwrap_or_else(|e| e.into_inner());
        let Some(bucket) = map.get_mut(shop) else {
            // Dropped since the access check made it, to make room in a full map: a
            // full bucket behaves as an absent one, and the limit errs towards letting
            // a shop in (see above).
            return Ok(());
        };
        let tokens = bucket.refilled(now, rate, burst);
        if tokens >= want {
            *bucket = Bucket {
                tokens: tokens - want,
                at: now,
            };
            Ok(())
        } else {
            *bucket = Bucket { tokens, at: now };
            Err((((want - tokens) / rate).ceil() as u64).max(1))
        }
    }

    /// Shops with a bucket now (for tests of the bound).
    pub fn buckets(&self) -> usize {
        self.shards
            .iter()
            .map(|s| s.lock().unwrap_or_else(|e| e.into_inner()).len())
            .sum()
    }
}

/// What a call costs in tokens of its shop's bucket, beyond the one every call takes:
/// one token per unit of work, a unit being what one sale is (a batch's entry, an
/// order's line, a load's item), at most the bucket's size. Called by the routes whose
/// body carries many units, once the body is read and counted; a single sale pays
/// nothing here.
pub fn charge_work(
    http: &actix_web::HttpRequest,
    shop: &str,
    units: usize,
) -> Result<(), crate::error::ApiError> {
    let Some(gate) = http.app_data::<web::Data<Gate>>() else {
        return Ok(());
    };
    gate.charge(shop, units).map_err(|retry_after_s| {
        crate::error::ApiError::RateLimited(
            format!(
                "shop {shop} is over its request rate: this call's {units} entries cost a \
                 token each (up to the bucket's size); retry in {retry_after_s} s"
            ),
            retry_after_s,
        )
    })
}

/// When requests go through without a key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OpenWhenNoKey {
    /// Never: every route but the health checks needs a key, even with no key in the
    /// store (a non-loopback server whose keys were all revoked must not fall open).
    Never,
    /// Until the first key is seen (protected mode on a loopback address, or
    /// `--insecure-no-auth`, with an empty store at start).
    UntilAKeyIsSeen,
}

/// The access check's state, shared by every HTTP worker: the keys (replaced whole by
/// the reloader), the policy, and the rate limiter.
pub struct Gate {
    /// Swapped by [`Gate::set_keys`]; readers clone the `Arc` and let go of the lock at
    /// once, so a reload never waits for a request and the other way round.
    keys: RwLock<Arc<KeySet>>,
    /// Whether keys are checked. Set for good once a key has been seen: revoking every
    /// key (say, a leaked one in a hurry) must lock callers out, not let everyone in,
    /// even on a loopback address, which a reverse proxy on the same machine may expose.
    enforcing: AtomicBool,
    limiter: Option<ShopRateLimiter>,
}

impl Gate {
    pub fn new(
        keys: KeySet,
        open_when_no_key: OpenWhenNoKey,
        limiter: Option<ShopRateLimiter>,
    ) -> Gate {
        Gate {
            enforcing: AtomicBool::new(
                open_when_no_key == OpenWhenNoKey::Never || !keys.is_empty(),
            ),
            keys: RwLock::new(Arc::new(keys)),
            limiter,
        }
    }

    pub fn keys(&self) -> Arc<KeySet> {
        self.keys.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Replaces the keys; says when the server starts checking keys, and when none is
    /// left to pass.
    pub fn set_keys(&self, keys: KeySet) {
        let keys = Arc::new(keys);
        let before = std::mem::replace(
            &mut *self.keys.write().unwrap_or_else(|e| e.into_inner()),
            keys.clone(),
        );
        if !keys.is_empty() && !self.enforcing.swap(true, Ordering::Relaxed) {
            tracing::info!(
                keys = keys.len(),
                "access keys found: from now on every route of a shop and /metrics need one"
            );
        }
        if keys.is_empty() && !before.is_empty() {
            tracing::warn!(
                "no unrevoked access key is left: every request that needs a key is refused \
                 until one is created with `nrtxn keys create`"
            );
        }
    }

    /// Whether requests need a key now.
    pub fn enforcing(&self) -> bool {
        self.enforcing.load(Ordering::Relaxed)
    }

    /// The key an `Authorization` header carries, if keys are checked and it is one of
    /// them: for a long-lived response (a push stream) that must end with its key.
    pub fn key_of(&self, authorization: Option<&HeaderValue>) -> Option<AccessKey> {
        if !self.enforcing() {
            return None;
        }
        authenticate(&self.keys(), authorization).ok().cloned()
    }

    /// Takes `units - 1` more tokens of `shop`'s bucket, for a call that does the work
    /// of `units` sales (a batch's entries, an order's lines, a load's items): the
    /// access check took one already. At most the bucket's size is asked, so that the
    /// largest call still passes a full bucket. Nothing is taken when there are too
    /// few; the answer says in how many seconds there will be enough.
    pub fn charge(&self, shop: &str, units: usize) -> Result<(), u64> {
        match &self.limiter {
            Some(limiter) if units > 1 => limiter.take_more(shop, units - 1, Instant::now()),
            _ => Ok(()),
        }
    }

    /// The decision for one request: what it needs, whose key it carries (returned, for
    /// `GET /v1/whoami`), whether that key is a seller's (returned, for the routes whose
    /// rules depend on it), whether the shop's bucket has a token.
    fn check(
        &self,
        method: &Method,
        path: &actix_web::dev::Path<actix_web::dev::Url>,
        authorization: Option<&HeaderValue>,
    ) -> Result<(Option<AccessKey>, bool), Refusal> {
        // The default (no key in the store, on loopback, no rate limit) pays nothing.
        if !self.enforcing() && self.limiter.is_none() {
            return Ok((None, false));
        }
        let need = need(method, path);
        if matches!(need, Need::Open) {
            return Ok((None, false));
        }
        let mut presented = None;
        let mut seller = false;
        if self.enforcing() {
            let keys = self.keys();
            let key = authenticate(&keys, authorization)?;
            authorize(key, &need)?;
            if matches!(need, Need::AnyKey) {
                presented = Some(key.clone());
            }
            seller = key.role == Role::Seller;
        }
        if let (Need::Shop { shop, .. }, Some(limiter)) = (&need, &self.limiter) {
            limiter
                .take(shop, Instant::now())
                .map_err(|retry_after_s| Refusal::RateLimited {
                    shop: shop.clone(),
                    retry_after_s,
                })?;
        }
        Ok((presented, seller))
    }
}

/// What a request needs.
#[derive(Debug, PartialEq, Eq)]
enum Need {
    /// Nothing (health checks).
    Open,
    /// A key for this shop with at least this role (or an admin key).
    Shop { shop: String, role: Role },
    /// An admin key (`/metrics`, and anything outside the shops).
    Admin,
    /// Any valid key ([`WHOAMI_PATH`]).
    AnyKey,
}

/// What `method` on `path` needs. `path` is the request's path as the router sees it.
fn need(method: &Method, path: &actix_web::dev::Path<actix_web::dev::Url>) -> Need {
    let full = path.as_str();
    if OPEN_PATHS.contains(&full) {
        return Need::Open;
    }
    if full == WHOAMI_PATH {
        return Need::AnyKey;
    }
    thread_local! {
        // A ResourceDef compiles a regex: once per HTTP worker, not per request.
        static SHOP: ResourceDef = ResourceDef::prefix(SHOP_PREFIX);
    }
    #[derive(serde::Deserialize)]
    struct ShopParam {
        shop: String,
    }
    let mut captured = path.clone();
    let shop = SHOP.with(|def| {
        def.capture_match_info(&mut captured)
            .then(|| captured.load::<ShopParam>().ok())
            .flatten()
    });
    let Some(ShopParam { shop }) = shop else {
        return Need::Admin;
    };
    // What follows `/v1/shops/{shop}` ("" or "/...").
    let rest = captured.unprocessed();
    let role = rest
        .strip_prefix('/')
        .and_then(|rest| {
            SHOP_ROUTES
                .iter()
                .find(|(m, pattern, _)| *m == method.as_str() && segments_match(pattern, rest))
        })
        .map_or(Role::Operator, |(_, _, role)| *role);
    Need::Shop { shop, role }
}

/// Whether `rest` (segments split by `/`) matches `pattern`, whose `{name}` segments
/// match any one non-empty segment.
fn segments_match(pattern: &str, rest: &str) -> bool {
    let mut p = pattern.split('/');
    let mut r = rest.split('/');
    loop {
        match (p.next(), r.next()) {
            (None, None) => return true,
            (Some(ps), Some(rs)) => {
                let placeholder = ps.starts_with('{') && ps.ends_with('}');
                if !(placeholder && !rs.is_empty() || ps == rs) {
                    return false;
                }
            }
            _ => return false,
        }
    }
}

/// The key a request carries, or why it is refused (401).
fn authenticate<'k>(
    keys: &'k KeySet,
    authorization: Option<&HeaderValue>,
) -> Result<&'k AccessKey, Refusal> {
    let Some(value) = authorization else {
        return Err(Refusal::Unauthorized(
            "no access key: send `Authorization: Bearer <key>`",
        ));
    };
    let malformed =
        Refusal::Unauthorized("malformed Authorization header: expected `Bearer <key>`");
    let value = value.to_str().map_err(|_| malformed.clone())?;
    let (scheme, secret) = value.split_once(' ').ok_or_else(|| malformed.clone())?;
    let secret = secret.trim_start_matches(' ');
    if !scheme.eq_ignore_ascii_case("bearer") || secret.is_empty() || secret.contains(' ') {
        return Err(malformed);
    }
    keys.verify(secret)
        .ok_or(Refusal::Unauthorized("unknown or revoked access key"))
}

/// `GET /v1/whoami`: the key the request carries (its id, name, shop and role, never its
/// secret), so that a client such as the dashboard knows what it may show; or that the
/// server takes requests without keys.
/// The access check hands it the key only when keys are checked (`Gate::check`).
pub async fn whoami(key: Option<web::ReqData<AccessKey>>) -> HttpResponse {
    match key {
        Some(key) => HttpResponse::Ok().json(json!({
            "keys_required": true,
            "key": {
                "id": key.id,
                "name": key.name,
                "shop": key.shop,
                "role": key.role.as_str(),
            },
        })),
        None => HttpResponse::Ok().json(json!({ "keys_required": false, "key": null })),
    }
}

/// Whether `key` may do what a request needs (else 403, saying why).
fn authorize(key: &AccessKey, need: &Need) -> Result<(), Refusal> {
    if key.role == Role::Admin {
        return Ok(());
    }
    match need {
        Need::Open | Need::AnyKey => Ok(()),
        Need::Admin => Err(Refusal::Forbidden(format!(
            "this route needs an admin key; key {} is {} key",
            key.id,
            key.role.with_article()
        ))),
        Need::Shop { shop, role } => {
            if key.shop.as_deref() != Some(shop.as_str()) {
                return Err(Refusal::Forbidden(format!(
                    "key {} is for shop {}, not {shop}",
                    key.id,
                    key.shop.as_deref().unwrap_or("(none)")
                )));
            }
            if key.role < *role {
                return Err(Refusal::Forbidden(format!(
                    "this route needs {} key; key {} is {} key",
                    role.with_article(),
                    key.id,
                    key.role.with_article()
                )));
            }
            Ok(())
        }
    }
}

/// Why a request is refused at the edge.
#[derive(Clone, Debug)]
enum Refusal {
    /// 401: no key, a malformed header, an unknown or revoked key.
    Unauthorized(&'static str),
    /// 403: another shop's key or too low a role.
    Forbidden(String),
    /// 429: the shop's bucket is empty.
    RateLimited { shop: String, retry_after_s: u64 },
    /// 500: the server was wired without a [`Gate`]; refused rather than served open.
    NoGate,
}

impl Refusal {
    fn response(&self) -> HttpResponse {
        match self {
            Refusal::Unauthorized(detail) => HttpResponse::build(StatusCode::UNAUTHORIZED)
                .insert_header((header::WWW_AUTHENTICATE, "Bearer"))
                .json(json!({ "error": "unauthorized", "detail": detail })),
            Refusal::Forbidden(detail) => HttpResponse::build(StatusCode::FORBIDDEN)
                .json(json!({ "error": "forbidden", "detail": detail })),
            Refusal::NoGate => HttpResponse::build(StatusCode::INTERNAL_SERVER_ERROR).json(json!({
                "error": "internal",
                "detail": "access control is not configured",
            })),
            Refusal::RateLimited {
                shop,
                retry_after_s,
            } => HttpResponse::build(StatusCode::TOO_MANY_REQUESTS)
                .insert_header((header::RETRY_AFTER, retry_after_s.to_string()))
                .json(json!({
                    "error": "rate_limited",
                    "detail": format!(
                        "shop {shop} is over its request rate; retry in {retry_after_s} s"
                    ),
                })),
        }
    }
}

/// The access check and the rate limit, before the body is read and before anything
/// reaches an actor ([`crate::front`]): the key's facts are put in the request's
/// extensions, or the refusal is returned. Needs a `web::Data<Gate>`; without one every
/// request but the health checks is refused (a wiring mistake must not serve open).
pub fn refused(req: &ServiceRequest) -> Option<HttpResponse> {
    let decision = match req.app_data::<web::Data<Gate>>() {
        Some(gate) => gate.check(
            req.method(),
            req.match_info(),
            req.headers().get(header::AUTHORIZATION),
        ),
        None if OPEN_PATHS.contains(&req.path()) => Ok((None, false)),
        None => Err(Refusal::NoGate),
    };
    let (key, seller) = match decision {
        Ok(admitted) => admitted,
        Err(refusal) => return Some(refusal.response()),
    };
    if key.is_some() || seller {
        let mut extensions = req.extensions_mut();
        if let Some(key) = key {
            extensions.insert(key);
        }
        if seller {
            extensions.insert(SellerKey);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use actix_web::dev::{Path, Url};

    fn path(p: &str) -> Path<Url> {
        Path::new(Url::new(p.parse().unwrap()))
    }

    fn need_of(method: Method, p: &str) -> Need {
        need(&method, &path(p))
    }

    fn shop(shop: &str, role: Role) -> Need {
        Need::Shop {
            shop: shop.into(),
            role,
        }
    }

    #[test]
    fn routes_get_the_role_of_their_line_and_unlisted_shop_routes_need_an_operator() {
        assert_eq!(need_of(Method::GET, "/healthz"), Need::Open);
        assert_eq!(need_of(Method::GET, "/readyz"), Need::Open);
        assert_eq!(need_of(Method::GET, "/metrics"), Need::Admin);
        assert_eq!(
            need_of(Method::GET, "/"),
            Need::Open,
            "the dashboard's page"
        );
        assert_eq!(need_of(Method::GET, "/v1/whoami"), Need::AnyKey);
        assert_eq!(need_of(Method::GET, "/v1/other"), Need::Admin);
        assert_eq!(
            need_of(Method::GET, "/v1/shops/acme/stats"),
            shop("acme", Role::Operator)
        );
        assert_eq!(
            need_of(Method::POST, "/v1/shops/acme/txns"),
            shop("acme", Role::Seller)
        );
        assert_eq!(
            need_of(Method::GET, "/v1/shops/acme/txns/k-1"),
            shop("acme", Role::Seller)
        );
        assert_eq!(
            need_of(Method::POST, "/v1/shops/acme/holds/h/cancel"),
            shop("acme", Role::Seller)
        );
        assert_eq!(
            need_of(Method::POST, "/v1/shops/acme/orders/o/confirm"),
            shop("acme", Role::Seller)
        );
        // A check-back's URL and its dead letters are an operator's.
        assert_eq!(
            need_of(Method::PUT, "/v1/shops/acme/settings"),
            shop("acme", Role::Operator)
        );
        assert_eq!(
            need_of(Method::GET, "/v1/shops/acme/dead-letters"),
            shop("acme", Role::Operator)
        );
        for act in ["retry", "resolve"] {
            assert_eq!(
                need_of(
                    Method::POST,
                    &format!("/v1/shops/acme/dead-letters/h/{act}")
                ),
                shop("acme", Role::Operator)
            );
        }
        assert_eq!(
            need_of(Method::GET, "/v1/shops/acme/items/sku"),
            shop("acme", Role::Seller)
        );
        assert_eq!(
            need_of(Method::PUT, "/v1/shops/acme/items"),
            shop("acme", Role::Operator)
        );
        assert_eq!(
            need_of(Method::GET, "/v1/shops/acme/items/sku/events"),
            shop("acme", Role::Operator)
        );
        assert_eq!(
            need_of(Method::POST, "/v1/shops/acme/items/adjust"),
            shop("acme", Role::Operator)
        );
        // Unlisted: another method, a new route, an empty placeholder, the bare prefix.
        for (m, p) in [
            (Method::DELETE, "/v1/shops/acme/txns"),
            (Method::GET, "/v1/shops/acme/settings"),
            (Method::GET, "/v1/shops/acme/items/"),
            (Method::GET, "/v1/shops/acme"),
        ] {
            assert_eq!(need_of(m, p), shop("acme", Role::Operator), "{p}");
        }
    }

    #[test]
    fn the_shop_is_percent_decoded_as_the_routes_decode_it() {
        assert_eq!(
            need_of(Method::POST, "/v1/shops/a%20b/txns"),
            shop("a b", Role::Seller)
        );
        assert_eq!(
            need_of(Method::POST, "/v1/shops/%61cme/t%78ns"),
            shop("acme", Role::Seller)
        );
        // An encoded slash stays inside the shop's segment, as for the router.
        assert_eq!(
            need_of(Method::POST, "/v1/shops/a%2Fb/txns"),
            shop("a/b", Role::Seller)
        );
    }

    fn key(id: &str, shop: Option<&str>, role: Role) -> (String, AccessKey) {
        let secret = format!("{SECRET_PREFIX}{id}_{}", "ab".repeat(32));
        let key = AccessKey {
            id: id.into(),
            name: "k".into(),
            shop: shop.map(Into::into),
            role,
            secret_sha256: secret_sha256(&secret),
        };
        (secret, key)
    }

    #[test]
    fn a_secret_verifies_only_whole_and_only_against_its_own_id() {
        let (secret, k) = key("0123456789abcdef", Some("acme"), Role::Seller);
        let set = KeySet::new([k.clone()]);
        assert_eq!(set.verify(&secret), Some(&k));
        assert_eq!(set.verify(&secret[..secret.len() - 1]), None);
        assert_eq!(set.verify(&format!("{secret}0")), None);
        assert_eq!(set.verify("nrtxn_0123456789abcdef_"), None);
        assert_eq!(set.verify("nrtxn_ffffffffffffffff_abab"), None);
        assert_eq!(set.verify("garbage"), None);
    }

    #[test]
    fn roles_and_shops_decide_403s() {
        let (_, seller) = key("s", Some("acme"), Role::Seller);
        let (_, operator) = key("o", Some("acme"), Role::Operator);
        let (_, admin) = key("a", None, Role::Admin);
        assert!(authorize(&seller, &shop("acme", Role::Seller)).is_ok());
        assert!(authorize(&seller, &shop("acme", Role::Operator)).is_err());
        assert!(authorize(&seller, &shop("other", Role::Seller)).is_err());
        assert!(authorize(&operator, &shop("acme", Role::Operator)).is_ok());
        assert!(authorize(&operator, &Need::Admin).is_err());
        assert!(authorize(&admin, &shop("any", Role::Operator)).is_ok());
        assert!(authorize(&admin, &Need::Admin).is_ok());
    }

    #[test]
    fn malformed_headers_are_told_from_unknown_keys() {
        let set = KeySet::default();
        for bad in [
            "",
            "Bearer",
            "Bearer ",
            "Basic abc",
            "Bearer a b",
            "nrtxn_x_y",
        ] {
            let v = HeaderValue::from_str(bad).unwrap();
            match authenticate(&set, Some(&v)) {
                Err(Refusal::Unauthorized(d)) => assert!(d.starts_with("malformed"), "{bad}: {d}"),
                other => panic!("{bad}: {other:?}"),
            }
        }
        let v = HeaderValue::from_static("bearer nrtxn_x_y");
        match authenticate(&set, Some(&v)) {
            Err(Refusal::Unauthorized(d)) => assert!(d.starts_with("unknown"), "{d}"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn once_a_key_is_seen_keys_are_checked_even_when_all_are_revoked() {
        let gate = Gate::new(KeySet::default(), OpenWhenNoKey::UntilAKeyIsSeen, None);
        assert!(!gate.enforcing(), "protected mode with no key serves open");
        let (_, k) = key("k", Some("acme"), Role::Seller);
        gate.set_keys(KeySet::new([k]));
        assert!(gate.enforcing());
        gate.set_keys(KeySet::default());
        assert!(
            gate.enforcing(),
            "revoking every key must not open the server"
        );
        let closed = Gate::new(KeySet::default(), OpenWhenNoKey::Never, None);
        assert!(closed.enforcing());
    }

    #[test]
    fn a_bucket_refills_at_its_rate_and_says_when_to_retry() {
        let limiter = ShopRateLimiter::new(2.0, 3);
        let t0 = Instant::now();
        for _ in 0..3 {
            assert_eq!(limiter.take("a", t0), Ok(()));
        }
        assert_eq!(limiter.take("a", t0), Err(1));
        assert_eq!(
            limiter.take("b", t0),
            Ok(()),
            "another shop has its own bucket"
        );
        let t1 = t0 + std::time::Duration::from_millis(500);
        assert_eq!(
            limiter.take("a", t1),
            Ok(()),
            "one token after 0.5 s at 2/s"
        );
        let slow = ShopRateLimiter::new(0.1, 1);
        assert_eq!(slow.take("a", t0), Ok(()));
        assert_eq!(slow.take("a", t0), Err(10));
    }

    #[test]
    fn work_takes_a_token_a_unit_up_to_the_bucket_and_nothing_when_short() {
        let limiter = ShopRateLimiter::new(1.0, 10);
        let t0 = Instant::now();
        // A call of 4 units: one token at the access check, three more for its work.
        assert_eq!(limiter.take("a", t0), Ok(()));
        assert_eq!(limiter.take_more("a", 3, t0), Ok(()));
        // Six left: a call of 8 is refused after its first token (five left, two short:
        // two seconds at 1/s), and takes no more.
        assert_eq!(limiter.take("a", t0), Ok(()));
        assert_eq!(limiter.take_more("a", 7, t0), Err(2));
        for _ in 0..5 {
            assert_eq!(
                limiter.take("a", t0),
                Ok(()),
                "the refused work took nothing"
            );
        }
        assert_eq!(limiter.take("a", t0), Err(1));
        // A call larger than the bucket costs the bucket: it passes a full one.
        assert_eq!(limiter.take("b", t0), Ok(()));
        assert_eq!(limiter.take_more("b", 1_000, t0), Ok(()));
        assert_eq!(limiter.take("b", t0), Err(1));
    }

    #[test]
    fn buckets_stay_within_their_bound() {
        let limiter = ShopRateLimiter::new(1.0, 1);
        let t0 = Instant::now();
        for i in 0..(SHOP_BUCKETS_MAX + 5_000) {
            assert_eq!(limiter.take(&format!("shop-{i}"), t0), Ok(()));
        }
        assert!(
            limiter.buckets() <= SHOP_BUCKETS_MAX,
            "{}",
            limiter.buckets()
        );
        // Once the first ones are full again they are dropped first.
        let later = t0 + std::time::Duration::from_secs(2);
        assert_eq!(limiter.take("new", later), Ok(()));
    }
}
