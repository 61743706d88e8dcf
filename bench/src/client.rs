//! One HTTP/1.1 keep-alive connection to the server under test.
//!
//! Why hyper's connection API rather than a pooled client (reqwest): "N connections"
//! must mean exactly N sockets, each carrying one request at a time, so the closed loop
//! is what it says and the open loop's in-flight bound is the number of connections.
//! A pool would open and close sockets behind our back and blur both.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{bail, Context};
use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::client::conn::http1;
use hyper::{header, Method, Request};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

/// Largest response body read: a load of 10,000 items answers ~1 MB; anything far
/// beyond that is a misbehaving server, not a reason to exhaust the client's memory.
pub const RESPONSE_BODY_MAX: usize = 16 * 1024 * 1024;

/// Where the server under test listens, from `--target`.
#[derive(Debug, Clone)]
pub struct Target {
    pub addr: SocketAddr,
    /// The `Host` header: the URL's authority as given.
    pub authority: String,
}

impl Target {
    /// Parses `http://HOST:PORT` (a trailing `/` is allowed). Only plain HTTP: the
    /// bench measures the engine behind the API, and TLS would measure the cipher.
    pub async fn parse(url: &str) -> anyhow::Result<Target> {
        let Some(rest) = url.strip_prefix("http://") else {
            bail!("--target: only http:// URLs are supported, got {url:?}");
        };
        let authority = rest.trim_end_matches('/');
        if authority.is_empty() || authority.contains('/') {
            bail!("--target: expected http://HOST:PORT with no path, got {url:?}");
        }
        let with_port = if authority.contains(':') {
            authority.to_string()
        } else {
            format!("{authority}:80")
        };
        let addr = tokio::net::lookup_host(&with_port)
            .await
            .with_context(|| format!("--target: cannot resolve {authority:?}"))?
            .next()
            .with_context(|| format!("--target: {authority:?} resolves to no address"))?;
        Ok(Target {
            addr,
            authority: authority.to_string(),
        })
    }
}

/// Why a request got no HTTP answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// Connect, write or read failed (the server closed or reset the connection).
    Io,
    /// No answer within `--timeout-ms`; the connection is dropped since an answer to
    /// this request could still arrive on it.
    Timeout,
}

impl Failure {
    pub fn kind(self) -> &'static str {
        match self {
            Failure::Io => "error_io",
            Failure::Timeout => "error_timeout",
        }
    }
}

/// An HTTP answer: status code and body.
pub struct Answer {
    pub status: u16,
    pub body: Bytes,
}

/// A connection that reconnects on the next request after a failure.
pub struct Conn {
    target: Target,
    sender: Option<http1::SendRequest<Full<Bytes>>>,
    timeout: Duration,
}

impl Conn {
    pub fn new(target: Target, timeout: Duration) -> Conn {
        Conn {
            target,
            sender: None,
            timeout,
        }
    }

    async fn connect(&mut self) -> Result<&mut http1::SendRequest<Full<Bytes>>, Failure> {
        if self.sender.as_ref().is_none_or(|s| s.is_closed()) {
            let stream = TcpStream::connect(self.target.addr)
                .await
                .map_err(|_| Failure::Io)?;
            // Requests are small and latency is what is measured: no Nagle delay.
            let _ = stream.set_nodelay(true);
            let (sender, conn) = http1::handshake(TokioIo::new(stream))
                .await
                .map_err(|_| Failure::Io)?;
            tokio::spawn(async move {
                // The connection task ends when the server closes or the sender drops.
                let _ = conn.await;
            });
            self.sender = Some(sender);
        }
        self.sender.as_mut().ok_or(Failure::Io)
    }

    /// Sends one request and reads the whole answer, within the timeout.
    pub async fn send(
        &mut self,
        method: Method,
        path: &str,
        body: Option<Bytes>,
    ) -> Result<Answer, Failure> {
        let timeout = self.timeout;
        let authority = self.target.authority.clone();
        let exchange = async {
            let sender = self.connect().await?;
            sender.ready().await.map_err(|_| Failure::Io)?;
            let mut builder = Request::builder()
                .method(method)
                .uri(path)
                .header(header::HOST, authority);
            if body.is_some() {
                builder = builder.header(header::CONTENT_TYPE, "application/json");
            }
            let req = builder
                .body(Full::new(body.unwrap_or_default()))
                .map_err(|_| Failure::Io)?;
            let res = sender.send_request(req).await.map_err(|_| Failure::Io)?;
            let status = res.status().as_u16();
            let body = Limited::new(res.into_body(), RESPONSE_BODY_MAX)
                .collect()
                .await
                .map_err(|_| Failure::Io)?
                .to_bytes();
            Ok(Answer { status, body })
        };
        match tokio::time::timeout(timeout, exchange).await {
            Ok(Ok(answer)) => Ok(answer),
            Ok(Err(f)) => {
                self.sender = None;
                Err(f)
            }
            Err(_) => {
                self.sender = None;
                Err(Failure::Timeout)
            }
        }
    }
}
