//! Every call nrtxn makes on a shop's behalf (today its check-back, issue 25) goes
//! through here, so that a shop's settings cannot make this node reach inside its own
//! network, read without bound, or wait on one shop for every other.
//!
//! - Addresses: a call is never made to a loopback, private, shared (CGNAT), link-local,
//!   unique-local, multicast, broadcast, documentation, reserved or unspecified address,
//!   IPv4 or IPv6 (IPv4-mapped and other forms that embed an IPv4 address are judged by
//!   it), unless the server's operator allowed its network (`--check-allow-net`). The
//!   check is made on the addresses a name resolves to, by the client's own resolver,
//!   so what is checked is what is connected to (a name that resolves inside, now or
//!   later, is refused too); a URL whose host is an address is checked before the call.
//! - `https` only, unless the operator allowed plain `http` (`--check-allow-http`).
//! - No redirect is followed, no proxy is used (the proxy, not the shop, would be what is
//!   checked), and an answer is read up to [`ANSWER_BYTES_MAX`]: past it the connection
//!   is dropped and the call has failed.
//! - Failures are short, fixed reasons ([`CallError`]): a status, a kind of error; never
//!   the answer's body, never the URL.
//! - Calls in flight are bounded per shop ([`IN_FLIGHT_PER_SHOP`]) and per node
//!   ([`IN_FLIGHT_PER_NODE`]): past them a call waits its turn, first come first served.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Longest answer read, in bytes.
pub const ANSWER_BYTES_MAX: usize = 64 * 1024;
/// Calls of one shop in flight at once on a node.
pub const IN_FLIGHT_PER_SHOP: usize = 4;
/// Calls in flight at once on a node, over every shop.
pub const IN_FLIGHT_PER_NODE: usize = 64;
/// Longest reason kept for a failed call, in bytes.
pub const REASON_BYTES_MAX: usize = 200;

/// A network, `address/prefix`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Net {
    addr: IpAddr,
    prefix: u8,
}

impl Net {
    /// Parses `10.0.0.0/8`, `fd00::/8`, or a bare address (a network of one).
    pub fn parse(s: &str) -> Result<Net, String> {
        let s = s.trim();
        let (addr, prefix) = match s.split_once('/') {
            Some((a, p)) => (a, Some(p)),
            None => (s, None),
        };
        let addr: IpAddr = addr
            .parse()
            .map_err(|_| format!("{s:?} is not a CIDR network (like 10.0.0.0/8 or fd00::/8)"))?;
        let bits = if addr.is_ipv4() { 32 } else { 128 };
        let prefix = match prefix {
            None => bits,
            Some(p) => match p.parse::<u8>() {
                Ok(p) if p <= bits => p,
                _ => return Err(format!("{s:?}: the prefix must be from 0 to {bits}")),
            },
        };
        Ok(Net { addr, prefix })
    }

    pub fn contains(&self, ip: IpAddr) -> bool {
        match (self.addr, ip) {
            (IpAddr::V4(net), IpAddr::V4(ip)) => {
                let mask = u32::MAX
                    .checked_shl(32 - u32::from(self.prefix))
                    .unwrap_or(0);
                u32::from(net) & mask == u32::from(ip) & mask
            }
            (IpAddr::V6(net), IpAddr::V6(ip)) => {
                let mask = u128::MAX
                    .checked_shl(128 - u32::from(self.prefix))
                    .unwrap_or(0);
                u128::from(net) & mask == u128::from(ip) & mask
            }
            _ => false,
        }
    }
}

impl std::fmt::Display for Net {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
}

/// Whether an IPv4 address is one a shop's call must not reach by default.
fn inside_v4(ip: Ipv4Addr) -> bool {
    let [a, b, c, _] = ip.octets();
    ip.is_unspecified()
        || a == 0 // "this network"
        || ip.is_loopback()
        || ip.is_private()
        || (a == 100 && (64..128).contains(&b)) // shared address space (CGNAT)
        || ip.is_link_local()
        || (a == 192 && b == 0 && c == 0) // IETF protocol assignments
        || ip.is_documentation()
        || (a == 198 && (b == 18 || b == 19)) // benchmarking
        || ip.is_multicast()
        || a >= 240 // reserved, and the broadcast address
}

/// The IPv4 address an IPv6 one stands for, in the forms that embed one: mapped
/// (`::ffff:a.b.c.d`), compatible (`::a.b.c.d`), NAT64 (`64:ff9b::/96`) and 6to4
/// (`2002::/16`).
fn embedded_v4(ip: Ipv6Addr) -> Option<Ipv4Addr> {
    let s = ip.segments();
    let o = ip.octets();
    if let Some(v4) = ip.to_ipv4_mapped() {
        return Some(v4);
    }
    if s[..6] == [0, 0, 0, 0, 0, 0] && !ip.is_unspecified() && !ip.is_loopback() {
        return Some(Ipv4Addr::new(o[12], o[13], o[14], o[15]));
    }
    if s[..6] == [0x64, 0xff9b, 0, 0, 0, 0] {
        return Some(Ipv4Addr::new(o[12], o[13], o[14], o[15]));
    }
    if s[0] == 0x2002 {
        return Some(Ipv4Addr::new(o[2], o[3], o[4], o[5]));
    }
    None
}

/// Whether an IPv6 address is one a shop's call must not reach by default.
fn inside_v6(ip: Ipv6Addr) -> bool {
    if let Some(v4) = embedded_v4(ip) {
        return inside_v4(v4);
    }
    let s = ip.segments();
    ip.is_unspecified()
        || ip.is_loopback()
        || ip.is_multicast()
        || (s[0] & 0xfe00) == 0xfc00 // unique local
        || (s[0] & 0xffc0) == 0xfe80 // link-local
        || (s[0] & 0xffc0) == 0xfec0 // site-local (deprecated)
        || (s[0] == 0x2001 && s[1] == 0x0db8) // documentation
        || (s[0] == 0x2001 && s[1] < 0x0200) // IETF protocol assignments (Teredo among them)
        || (s[0] == 0x0100 && s[1..4] == [0, 0, 0]) // discard
}

/// What the server's operator allows a shop's calls.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OutboundPolicy {
    /// Networks a call may reach although they are inside (`--check-allow-net`).
    pub allow_nets: Vec<Net>,
    /// Plain `http` is allowed (`--check-allow-http`).
    pub allow_http: bool,
}

impl OutboundPolicy {
    /// Whether a call may connect to `ip`.
    pub fn allows(&self, ip: IpAddr) -> bool {
        let allowed = |ip: IpAddr| self.allow_nets.iter().any(|n| n.contains(ip));
        match ip {
            IpAddr::V4(v4) => !inside_v4(v4) || allowed(ip),
            IpAddr::V6(v6) => {
                if allowed(ip) {
                    return true;
                }
                match embedded_v4(v6) {
                    // Judged, and allowed, as the IPv4 address it stands for.
                    Some(v4) => !inside_v4(v4) || allowed(IpAddr::V4(v4)),
                    None => !inside_v6(v6),
                }
            }
        }
    }

    /// Whether `url` may be a shop's call's address: `https` (or `http` if allowed), a
    /// host, and not a literal inside address (an IP, or `localhost`). A name is checked
    /// again, on what it resolves to, at each call. The reason names no field.
    pub fn check_url(&self, url: &str) -> Result<(), String> {
        let parsed =
            reqwest::Url::parse(url).map_err(|_| "not an http:// or https:// URL".to_string())?;
        match parsed.scheme() {
            "https" => {}
            "http" if self.allow_http => {}
            "http" => {
                return Err(
                    "must be an https:// URL (plain http is not allowed on this \
                            server: its operator may allow it with --check-allow-http)"
                        .into(),
                )
            }
            _ => return Err("not an http:// or https:// URL".into()),
        }
        let Some(host) = parsed.host_str() else {
            return Err("not an http:// or https:// URL".into());
        };
        let inside = match literal_ip(&parsed) {
            Some(ip) => !self.allows(ip),
            None => {
                let name = host.trim_end_matches('.').to_ascii_lowercase();
                // RFC 6761: `localhost` and its subdomains are the loopback addresses.
                (name == "localhost" || name.ends_with(".localhost"))
                    && !self.allows(IpAddr::V4(Ipv4Addr::LOCALHOST))
                    && !self.allows(IpAddr::V6(Ipv6Addr::LOCALHOST))
            }
        };
        if inside {
            return Err(
                "the host is an inside address (loopback, private, link-local, \
                        unique-local, multicast, reserved or unspecified): the server's \
                        operator may allow its network with --check-allow-net"
                    .into(),
            );
        }
        Ok(())
    }
}

/// The URL's host if it is an address (the URL parser has already turned the other
/// spellings of an IPv4 address, such as `2130706433` or `0x7f.1`, into this one).
fn literal_ip(url: &reqwest::Url) -> Option<IpAddr> {
    let host = url.host_str()?;
    let host = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    host.parse().ok()
}

/// Why a call failed: a short reason fit for a log line or a dead letter, which never
/// holds the answer's body or the URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CallError(String);

impl CallError {
    fn new(reason: impl Into<String>) -> CallError {
        let mut reason: String = reason.into();
        if reason.len() > REASON_BYTES_MAX {
            let mut cut = REASON_BYTES_MAX;
            while !reason.is_char_boundary(cut) {
                cut -= 1;
            }
            reason.truncate(cut);
        }
        CallError(reason)
    }

    pub fn reason(&self) -> &str {
        &self.0
    }

    /// Into the reason.
    pub fn into_reason(self) -> String {
        self.0
    }
}

impl std::fmt::Display for CallError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// The resolver's refusal: every address the name resolved to is inside.
#[derive(Debug)]
struct AddressNotAllowed;

impl std::fmt::Display for AddressNotAllowed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("address not allowed")
    }
}

impl std::error::Error for AddressNotAllowed {}

/// Resolves a name, then keeps only the addresses the policy allows: the client connects
/// to nothing else.
struct GuardedResolver {
    policy: Arc<OutboundPolicy>,
}

impl reqwest::dns::Resolve for GuardedResolver {
    fn resolve(&self, name: reqwest::dns::Name) -> reqwest::dns::Resolving {
        let policy = self.policy.clone();
        let host = name.as_str().to_string();
        Box::pin(async move {
            let found = tokio::net::lookup_host((host.as_str(), 0)).await?;
            let allowed: Vec<SocketAddr> = found.filter(|a| policy.allows(a.ip())).collect();
            if allowed.is_empty() {
                return Err(Box::new(AddressNotAllowed) as Box<dyn std::error::Error + Send + Sync>);
            }
            Ok(Box::new(allowed.into_iter()) as reqwest::dns::Addrs)
        })
    }
}

/// A call's turn: its shop's permit and the node's, given back when dropped.
pub struct Turn {
    node: Option<OwnedSemaphorePermit>,
    shop: Option<OwnedSemaphorePermit>,
    shop_name: String,
    shops: Arc<Mutex<HashMap<String, Arc<Semaphore>>>>,
}

impl Drop for Turn {
    fn drop(&mut self) {
        self.node.take();
        let Some(permit) = self.shop.take() else {
            return;
        };
        // The shop's semaphore leaves the map once nobody holds or waits for it, so the
        // map holds only shops with calls in flight or waiting.
        if let Ok(mut shops) = self.shops.lock() {
            // A shop's calls are bounded only while all its turns share one semaphore:
            // the one in the map, which leaves it only once no turn holds it.
            assert!(
                shops
                    .get(&self.shop_name)
                    .is_some_and(|s| Arc::ptr_eq(s, permit.semaphore())),
                "a turn of shop {} holds a permit of a semaphore the map no longer has",
                self.shop_name
            );
            drop(permit);
            if shops
                .get(&self.shop_name)
                .is_some_and(|s| Arc::strong_count(s) == 1)
            {
                shops.remove(&self.shop_name);
            }
        }
    }
}

/// The guarded client: see the module's documentation.
pub struct Outbound {
    policy: Arc<OutboundPolicy>,
    client: reqwest::Client,
    node: Arc<Semaphore>,
    shops: Arc<Mutex<HashMap<String, Arc<Semaphore>>>>,
}

impl Outbound {
    pub fn new(policy: OutboundPolicy) -> anyhow::Result<Outbound> {
        let policy = Arc::new(policy);
        let client = reqwest::Client::builder()
            .dns_resolver(Arc::new(GuardedResolver {
                policy: policy.clone(),
            }))
            .redirect(reqwest::redirect::Policy::none())
            .no_proxy()
            .https_only(!policy.allow_http)
            .build()
            .context("outbound calls: cannot make the HTTP client")?;
        Ok(Outbound {
            policy,
            client,
            node: Arc::new(Semaphore::new(IN_FLIGHT_PER_NODE)),
            shops: Arc::default(),
        })
    }

    pub fn policy(&self) -> &OutboundPolicy {
        &self.policy
    }

    /// Waits for `shop`'s turn: first its own permit, then the node's (so a shop waiting
    /// on itself holds none of the node's).
    pub async fn turn(&self, shop: &str) -> Turn {
        let shop_sem = self.shops.lock().ok().map(|mut shops| {
            shops
                .entry(shop.to_string())
                .or_insert_with(|| Arc::new(Semaphore::new(IN_FLIGHT_PER_SHOP)))
                .clone()
        });
        let mut turn = Turn {
            node: None,
            shop: None,
            shop_name: shop.to_string(),
            shops: self.shops.clone(),
        };
        if let Some(sem) = shop_sem {
            turn.shop = sem.acquire_owned().await.ok();
        }
        turn.node = self.node.clone().acquire_owned().await.ok();
        // The node's semaphore is never closed: a turn without its permit would not
        // count against the node's bound.
        assert!(
            turn.node.is_some(),
            "the node's semaphore of calls in flight was closed"
        );
        turn
    }

    /// POSTs `body` to `url` with `headers`, within `timeout` (connecting, sending and
    /// reading the answer), and returns the answer's body if its status is a success
    /// and it is at most [`ANSWER_BYTES_MAX`] long.
    pub async fn post_bounded(
        &self,
        url: &str,
        headers: &[(&str, &str)],
        body: Vec<u8>,
        timeout: Duration,
    ) -> Result<Vec<u8>, CallError> {
        let parsed = reqwest::Url::parse(url).map_err(|_| CallError::new("not a URL"))?;
        // Checked again at each call: the operator's rules may have changed since the
        // settings were made.
        if parsed.scheme() == "http" && !self.policy.allow_http {
            return Err(CallError::new("plain http not allowed"));
        }
        // A host that is an address is never resolved: it is checked here.
        if literal_ip(&parsed).is_some_and(|ip| !self.policy.allows(ip)) {
            return Err(CallError::new(AddressNotAllowed.to_string()));
        }
        let mut request = self.client.post(parsed).timeout(timeout).body(body);
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        let mut res = request.send().await.map_err(|e| kind_of(&e, timeout))?;
        let status = res.status();
        if status.is_redirection() {
            return Err(CallError::new(format!(
                "redirect {} (not followed)",
                status.as_u16()
            )));
        }
        if !status.is_success() {
            return Err(CallError::new(format!("status {}", status.as_u16())));
        }
        if res
            .content_length()
            .is_some_and(|n| n > ANSWER_BYTES_MAX as u64)
        {
            return Err(too_large());
        }
        let mut answer = Vec::new();
        while let Some(chunk) = res.chunk().await.map_err(|e| kind_of(&e, timeout))? {
            if answer.len() + chunk.len() > ANSWER_BYTES_MAX {
                // Dropping `res` closes the connection rather than reading the rest.
                return Err(too_large());
            }
            answer.extend_from_slice(&chunk);
        }
        Ok(answer)
    }
}

fn too_large() -> CallError {
    CallError::new(format!("answer too large (over {ANSWER_BYTES_MAX} bytes)"))
}

/// The kind of a client error, from a fixed list: reqwest's own text names the URL.
fn kind_of(e: &reqwest::Error, timeout: Duration) -> CallError {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(e);
    let mut io_kind = None;
    while let Some(err) = source {
        if err.is::<AddressNotAllowed>() {
            return CallError::new(AddressNotAllowed.to_string());
        }
        if let Some(io) = err.downcast_ref::<std::io::Error>() {
            io_kind.get_or_insert(io.kind());
        }
        source = err.source();
    }
    if e.is_timeout() || io_kind == Some(std::io::ErrorKind::TimedOut) {
        return CallError::new(format!(
            "timeout (no answer within {} ms)",
            timeout.as_millis()
        ));
    }
    CallError::new(match io_kind {
        Some(std::io::ErrorKind::ConnectionRefused) => "connect refused",
        Some(std::io::ErrorKind::ConnectionReset) => "connection reset",
        _ if e.is_connect() => "connect failed",
        _ if e.is_body() || e.is_decode() => "answer not read",
        _ => "request failed",
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn inside_addresses_are_refused_and_outside_ones_allowed() {
        let p = OutboundPolicy::default();
        for inside in [
            "127.0.0.1",
            "127.9.9.9",
            "0.0.0.0",
            "10.1.2.3",
            "172.16.0.1",
            "172.31.255.255",
            "192.168.1.1",
            "100.64.0.1",
            "100.127.255.255",
            "169.254.169.254",
            "192.0.2.1",
            "198.51.100.7",
            "203.0.113.9",
            "198.18.0.1",
            "224.0.0.1",
            "239.255.255.250",
            "240.0.0.1",
            "255.255.255.255",
            "::",
            "::1",
            "::ffff:127.0.0.1",
            "::ffff:169.254.169.254",
            "::ffff:10.0.0.1",
            "::127.0.0.1",
            "64:ff9b::a9fe:a9fe",
            "2002:7f00:1::",
            "fc00::1",
            "fd12:3456::1",
            "fe80::1",
            "ff02::1",
            "2001:db8::1",
            "2001::1",
        ] {
            assert!(!p.allows(ip(inside)), "{inside} must be refused");
        }
        for outside in [
            "8.8.8.8",
            "1.1.1.1",
            "100.63.255.255",
            "100.128.0.0",
            "172.32.0.1",
            "93.184.216.34",
            "2606:4700::1111",
            "2001:4860:4860::8888",
            "::ffff:8.8.8.8",
        ] {
            assert!(p.allows(ip(outside)), "{outside} must be allowed");
        }
    }

    #[test]
    fn allowed_networks_open_inside_addresses_also_in_mapped_forms() {
        let p = OutboundPolicy {
            allow_nets: vec![
                Net::parse("127.0.0.0/8").unwrap(),
                Net::parse("fd00::/8").unwrap(),
            ],
            allow_http: false,
        };
        assert!(p.allows(ip("127.0.0.1")));
        assert!(p.allows(ip("::ffff:127.0.0.1")));
        assert!(p.allows(ip("fd12::1")));
        assert!(!p.allows(ip("10.0.0.1")));
        assert!(!p.allows(ip("::1")));
        assert!(!p.allows(ip("fc00::1")));
    }

    #[test]
    fn networks_are_parsed_with_their_prefix_checked() {
        assert_eq!(Net::parse("10.0.0.0/8").unwrap().to_string(), "10.0.0.0/8");
        assert_eq!(Net::parse(" ::1 ").unwrap().to_string(), "::1/128");
        assert_eq!(Net::parse("0.0.0.0/0").unwrap().to_string(), "0.0.0.0/0");
        assert!(Net::parse("0.0.0.0/0").unwrap().contains(ip("8.8.8.8")));
        assert!(Net::parse("10.0.0.0/33").is_err());
        assert!(Net::parse("fd00::/129").is_err());
        assert!(Net::parse("10.0.0/8").is_err());
        assert!(Net::parse("example.com/8").is_err());
        assert!(Net::parse("10.0.0.0/x").is_err());
        let n = Net::parse("192.168.4.0/22").unwrap();
        assert!(n.contains(ip("192.168.7.255")));
        assert!(!n.contains(ip("192.168.8.0")));
        assert!(!n.contains(ip("::ffff:192.168.4.1")), "families do not mix");
    }

    #[test]
    fn urls_need_https_and_an_outside_host() {
        let strict = OutboundPolicy::default();
        assert!(strict.check_url("https://shop.example/check?x=1").is_ok());
        assert!(strict.check_url("https://8.8.8.8/c").is_ok());
        for refused in [
            "http://shop.example/check",
            "ftp://shop.example/",
            "https://127.0.0.1/c",
            "https://[::1]/c",
            "https://[::ffff:7f00:1]/c",
            "https://169.254.169.254/latest/meta-data",
            "https://2130706433/c",
            "https://0x7f.1/c",
            "https://localhost:8443/c",
            "https://LOCALHOST./c",
            "https://a.localhost/c",
            "https://10.0.0.1/c",
            "not a url",
        ] {
            assert!(strict.check_url(refused).is_err(), "{refused}");
        }
        let open = OutboundPolicy {
            allow_nets: vec![Net::parse("127.0.0.0/8").unwrap()],
            allow_http: true,
        };
        assert!(open.check_url("http://127.0.0.1:9/c").is_ok());
        assert!(open.check_url("http://localhost:9/c").is_ok());
        assert!(open.check_url("http://10.0.0.1/c").is_err());
    }

    #[tokio::test]
    async fn turns_are_bounded_per_shop_and_per_node_and_given_back() {
        let out = Outbound::new(OutboundPolicy::default()).unwrap();
        let wait = Duration::from_millis(50);
        let mut held = Vec::new();
        for _ in 0..IN_FLIGHT_PER_SHOP {
            held.push(out.turn("a").await);
        }
        assert!(
            tokio::time::timeout(wait, out.turn("a")).await.is_err(),
            "past the shop's bound a call waits"
        );
        for i in IN_FLIGHT_PER_SHOP..IN_FLIGHT_PER_NODE {
            held.push(out.turn(&format!("shop-{i}")).await);
        }
        assert!(
            tokio::time::timeout(wait, out.turn("b")).await.is_err(),
            "past the node's bound a call waits"
        );
        held.pop();
        let b = tokio::time::timeout(wait, out.turn("b")).await;
        assert!(b.is_ok(), "a turn given back is taken");
        drop(b);
        held.clear();
        assert!(
            out.shops.lock().unwrap().is_empty(),
            "idle shops leave the map"
        );
    }

    #[test]
    fn reasons_are_cut_to_their_bound() {
        let long = CallError::new("é".repeat(REASON_BYTES_MAX));
        assert!(long.reason().len() <= REASON_BYTES_MAX);
    }
}
