//! The API served on the engine's own threads (its arbiters, one per core by default).
//!
//! A connection is handed to the arbiters in turn, and its requests are read, checked
//! and routed on that thread, beside its shards and WorkManagers: a call for an item
//! whose shard lives there crosses no thread until it reaches the log, and the answer
//! none on its way back. With actix-web's own workers (`http_workers` set, see
//! `server.rs`), every call crossed to an arbiter and back, at the price of a wake-up
//! each way (`docs/decisions/request-path.md`, "The API on the engine's threads").
//!
//! What actix-web's server did is kept: at most `connections_max` connections (past it,
//! accepting waits until one closes), TLS when configured, and on SIGINT or SIGTERM no
//! more connections, each open one closed after the call it is serving, and at most the
//! grace for them to finish.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use actix_rt::ArbiterHandle;
use actix_service::{map_config, IntoServiceFactory, Service, ServiceFactory, ServiceFactoryExt};
use actix_web::dev::{AppConfig, ServiceRequest, ServiceResponse};
use actix_web::App;
use anyhow::Context;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch, OwnedSemaphorePermit, Semaphore};

/// Connections waiting for their arbiter to take them in: the accept loop hands each
/// one over within a permit of `connections_max`, so this is bounded by it.
type Lane = mpsc::UnboundedSender<(std::net::TcpStream, OwnedSemaphorePermit)>;

/// The service factory an actix-web `App` of this API builds.
pub(crate) trait AppFactory<B>:
    ServiceFactory<
        ServiceRequest,
        Config = (),
        Response = ServiceResponse<B>,
        Error = actix_web::Error,
        InitError = (),
    > + 'static
{
}

impl<T, B> AppFactory<B> for T where
    T: ServiceFactory<
            ServiceRequest,
            Config = (),
            Response = ServiceResponse<B>,
            Error = actix_web::Error,
            InitError = (),
        > + 'static
{
}

/// How the API is served on the arbiters.
pub(crate) struct Options {
    pub(crate) tls: Option<rustls::ServerConfig>,
    pub(crate) connections_max: usize,
    /// How long open connections get to finish their calls once a stop is asked for.
    pub(crate) grace: Duration,
}

/// Binds every address (as actix-web does: address reuse, a backlog of 1,024).
pub(crate) fn bind(addrs: &[std::net::SocketAddr]) -> anyhow::Result<Vec<TcpListener>> {
    addrs
        .iter()
        .map(|addr| {
            let socket = match addr {
                std::net::SocketAddr::V4(_) => tokio::net::TcpSocket::new_v4(),
                std::net::SocketAddr::V6(_) => tokio::net::TcpSocket::new_v6(),
            }?;
            socket.set_reuseaddr(true)?;
            socket.bind(*addr)?;
            socket.listen(1024)
        })
        .collect::<std::io::Result<_>>()
        .with_context(|| format!("listen: cannot bind {addrs:?}"))
}

/// Serves `make_app` on `arbiters` from `listeners` until SIGINT or SIGTERM, then lets
/// open connections finish within the grace.
pub(crate) async fn serve<F, A, B>(
    listeners: Vec<TcpListener>,
    arbiters: &[ArbiterHandle],
    make_app: F,
    opts: Options,
) -> anyhow::Result<()>
where
    F: Fn() -> App<A> + Clone + Send + 'static,
    A: AppFactory<B>,
    B: actix_web::body::MessageBody + 'static,
{
    let (stop_tx, stop) = watch::channel(false);
    let lanes: Vec<Lane> = arbiters
        .iter()
        .map(|arbiter| {
            let (tx, rx) = mpsc::unbounded_channel();
            let (make_app, tls, stop) = (make_app.clone(), opts.tls.clone(), stop.clone());
            arbiter.spawn_fn(move || {
                actix_rt::spawn(lane(make_app, tls, stop, rx));
            });
            tx
        })
        .collect();
    let lanes = Arc::new(lanes);
    let permits = Arc::new(Semaphore::new(opts.connections_max));
    let next = Arc::new(AtomicUsize::new(0));
    let accepting: Vec<_> = listeners
        .into_iter()
        .map(|l| {
            let (lanes, permits, next) = (lanes.clone(), permits.clone(), next.clone());
            actix_rt::spawn(accept(l, lanes, permits, next))
        })
        .collect();
    let signal = crate::stop_signal().await?;
    tracing::info!(
        signal,
        "stop asked for: no more connections; open ones close after their call"
    );
    accepting.iter().for_each(|a| a.abort());
    let _ = stop_tx.send(true);
    let all = u32::try_from(opts.connections_max).unwrap_or(u32::MAX);
    if tokio::time::timeout(opts.grace, permits.acquire_many(all))
        .await
        .is_err()
    {
        tracing::warn!(grace = ?opts.grace, "connections still open past the grace; closing them");
    }
    Ok(())
}

/// Takes connections in while there is room for them, each to the next arbiter.
async fn accept(
    listener: TcpListener,
    lanes: Arc<Vec<Lane>>,
    permits: Arc<Semaphore>,
    next: Arc<AtomicUsize>,
) {
    loop {
        let Ok(permit) = permits.clone().acquire_owned().await else {
            return;
        };
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream.into_std(),
            Err(e) => {
                // Out of file descriptors, most often: wait a little rather than spin.
                tracing::warn!(error = %e, "cannot accept a connection");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Ok(stream) = stream else { continue };
        let n = next.fetch_add(1, Ordering::Relaxed) % lanes.len();
        // A lane is gone only when its arbiter stopped: the connection closes with it.
        let _ = lanes[n].send((stream, permit));
    }
}

/// One arbiter's part: its own instance of the app, serving each connection handed to it.
async fn lane<F, A, B>(
    make_app: F,
    tls: Option<rustls::ServerConfig>,
    stop: watch::Receiver<bool>,
    rx: mpsc::UnboundedReceiver<(std::net::TcpStream, OwnedSemaphorePermit)>,
) where
    F: Fn() -> App<A>,
    A: AppFactory<B>,
    B: actix_web::body::MessageBody + 'static,
{
    // One service per kind of stream (its type names the stream), built the same way.
    macro_rules! http {
        () => {
            actix_http::HttpService::build()
                // As the other front: a client's EOF ends its connection (see server.rs).
                .h1_allow_half_closed(false)
                // actix-web's server's: a second for a client to close after the answer
                // that ends its connection.
                .client_disconnect_timeout(Duration::from_secs(1))
                .graceful_shutdown_signal(move || {
                    let mut stop = stop.clone();
                    async move {
                        let _ = stop.wait_for(|stopping| *stopping).await;
                    }
                })
                .finish(map_config(
                    make_app()
                        .into_factory()
                        .map_err(|e: actix_web::Error| e.error_response()),
                    |_| AppConfig::default(),
                ))
        };
    }
    match tls {
        Some(tls) => connections(http!().rustls_0_23(tls), rx).await,
        None => connections(http!().tcp(), rx).await,
    }
}

/// Serves every connection `rx` brings with a service of `factory`, each on a task of
/// its own holding its permit until it closes.
async fn connections<S>(
    factory: S,
    mut rx: mpsc::UnboundedReceiver<(std::net::TcpStream, OwnedSemaphorePermit)>,
) where
    S: ServiceFactory<TcpStream, Config = ()>,
    S::Service: 'static,
    S::InitError: std::fmt::Debug,
{
    let service = match factory.new_service(()).await {
        Ok(s) => std::rc::Rc::new(s),
        Err(e) => {
            tracing::error!(error = ?e, "the API cannot start on this thread");
            return;
        }
    };
    while let Some((stream, permit)) = rx.recv().await {
        let Ok(stream) = TcpStream::from_std(stream) else {
            continue;
        };
        let _ = stream.set_nodelay(true);
        let service = service.clone();
        actix_rt::spawn(async move {
            let _ = service.call(stream).await;
            drop(permit);
        });
    }
}
