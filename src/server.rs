//! Wiring of `nrtxn serve`: the store, the engine, the HTTP front, and the orderly stop.

use std::net::{SocketAddr, ToSocketAddrs};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use actix_web::middleware::{from_fn, Condition};
use actix_web::{web, App, HttpServer};
use anyhow::{bail, Context};
use nrtxn_actors::{
    EngineBuilder, Journal, JournalWriters, Leases, Lifecycle, Metrics, RequestLog, Topology,
};
use nrtxn_api::auth::{Gate, KeySet, OpenWhenNoKey, ShopRateLimiter};
use nrtxn_api::validate::BodyLimits;
use nrtxn_api::{configure, AppState};

use crate::config::{EdgeSettings, Settings};
use crate::keys::{KeyReloader, KeyReloaderStarting};
use nrtxn_embedded::journal::LogJournal;
use nrtxn_embedded::request_log::{EmbeddedLog, RequestStore};
use nrtxn_embedded::views::SqliteStore;
use nrtxn_kafka::{EventsRelay, KafkaLog};
use nrtxn_mongo::redact_uri;
use nrtxn_mongo::MongoJournal;

/// The addresses `listen` names, resolved once: the server binds exactly these, so what
/// protected mode checked is what is bound (a name resolved twice could answer another
/// address the second time). A name that does not resolve is an error naming the option.
fn resolve(option: &str, listen: &str) -> anyhow::Result<Vec<SocketAddr>> {
    let addrs: Vec<SocketAddr> = listen
        .to_socket_addrs()
        .with_context(|| format!("{option}: cannot resolve {listen}"))?
        .collect();
    if addrs.is_empty() {
        bail!("{option}: {listen} names no address");
    }
    Ok(addrs)
}

/// Whether every address is a loopback one (what protected mode allows to serve without
/// keys).
fn all_loopback(addrs: &[SocketAddr]) -> bool {
    addrs.iter().all(|a| a.ip().is_loopback())
}

/// `/metrics` on `--metrics-listen` needs no key, so it follows protected mode: on an
/// address other machines can reach, only with `--insecure-no-auth`.
fn check_metrics_listen(addrs: &[SocketAddr], edge: &EdgeSettings) -> anyhow::Result<()> {
    if all_loopback(addrs) || edge.insecure_no_auth {
        return Ok(());
    }
    bail!(
        "metrics_listen: {addrs:?} is not a loopback address, and /metrics there needs no \
         key: anyone who reaches it reads every shop's figures. Listen on a loopback address \
         (a scraper on this machine or behind a proxy), or pass --insecure-no-auth to allow it"
    )
}

/// Protected mode, as in Redis: with no unrevoked key, serve without authentication only
/// on a loopback address (or with `--insecure-no-auth`); once a key has been seen, keys
/// are checked until the process stops, whatever is revoked. Says at start which it is.
fn open_when_no_key(
    listen: &str,
    loopback: bool,
    edge: &EdgeSettings,
    keys: &KeySet,
) -> anyhow::Result<OpenWhenNoKey> {
    let open = if loopback || edge.insecure_no_auth {
        OpenWhenNoKey::UntilAKeyIsSeen
    } else {
        OpenWhenNoKey::Never
    };
    if !keys.is_empty() {
        tracing::info!(
            keys = keys.len(),
            "access keys: every route of a shop and /metrics need one"
        );
    } else if loopback {
        tracing::warn!(
            "protected mode: no access key in the store, so serving without authentication, \
             which is allowed only because {listen} is a loopback address; create a key with \
             `nrtxn keys create` to require keys"
        );
    } else if edge.insecure_no_auth {
        tracing::warn!(
            "--insecure-no-auth: no access key in the store; serving without authentication \
             on {listen}, reachable from other machines"
        );
    } else {
        bail!(
            "protected mode: no access key in the store and {listen} is not a loopback \
             address, so anyone who reaches it could change any shop's stock. Create a key \
             with `nrtxn keys create --role admin` (same --data-dir or --mongo-uri), or pass \
             --insecure-no-auth to serve without authentication"
        );
    }
    Ok(open)
}

/// The TLS configuration from PEM files: rustls with the ring provider (the one mongodb
/// already brings in).
fn tls_config(cert: &Path, key: &Path) -> anyhow::Result<rustls::ServerConfig> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let chain = CertificateDer::pem_file_iter(cert)
        .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
        .with_context(|| {
            format!(
                "tls_cert: cannot read a PEM certificate chain from {}",
                cert.display()
            )
        })?;
    if chain.is_empty() {
        bail!("tls_cert: no certificate in {}", cert.display());
    }
    let private = PrivateKeyDer::from_pem_file(key).with_context(|| {
        format!(
            "tls_key: cannot read a PEM private key from {}",
            key.display()
        )
    })?;
    rustls::ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .context("tls: no protocol version")?
        .with_no_client_auth()
        .with_single_cert(chain, private)
        .with_context(|| {
            format!(
                "tls_key: {} does not fit the certificate of {}",
                key.display(),
                cert.display()
            )
        })
}

/// What the HTTP front needs, checked before any recovery: a server that may not start
/// (no key off loopback, an address that does not resolve, an unreadable certificate)
/// says so before it spends one.
struct Front {
    gate: Arc<Gate>,
    listen_addrs: Vec<SocketAddr>,
    /// Every listen address is a loopback one.
    loopback: bool,
    metrics_addrs: Option<Vec<SocketAddr>>,
    tls: Option<rustls::ServerConfig>,
}

impl Front {
    /// The front, and the reloader of its keys (run once serving starts).
    fn check(settings: &Settings) -> anyhow::Result<(Front, KeyReloaderStarting)> {
        let (keys, reloader) =
            KeyReloader::start(&settings.data_dir, settings.mongo_uri.as_deref())
                .context("cannot read the access keys")?;
        let listen_addrs = resolve("listen", &settings.listen)?;
        let loopback = all_loopback(&listen_addrs);
        let open = open_when_no_key(&settings.listen, loopback, &settings.edge, &keys)?;
        let metrics_addrs = match &settings.edge.metrics_listen {
            Some(addr) => {
                let addrs = resolve("metrics_listen", addr)?;
                check_metrics_listen(&addrs, &settings.edge)?;
                Some(addrs)
            }
            None => None,
        };
        let tls = match &settings.edge.tls {
            Some((cert, key)) => Some(tls_config(cert, key)?),
            None => None,
        };
        let limiter = settings
            .edge
            .shop_rate
            .map(|(rate_per_s, burst)| ShopRateLimiter::new(rate_per_s, burst));
        let front = Front {
            gate: Arc::new(Gate::new(keys, open, limiter)),
            listen_addrs,
            loopback,
            metrics_addrs,
            tls,
        };
        Ok((front, reloader))
    }
}

/// The journal and where the request log keeps fire-and-forget requests: the data dir
/// always holds the latter, in the embedded journal's log, or beside a MongoDB journal
/// in SQLite (the side store).
struct Storage {
    journal: Arc<dyn Journal>,
    log_store: Arc<dyn RequestStore>,
    side_store: Option<Arc<SqliteStore>>,
    leases: Option<Arc<dyn Leases>>,
}

impl Storage {
    fn open(
        settings: &Settings,
        metrics: &Arc<Metrics>,
        space: &Arc<nrtxn_log::space::Space>,
    ) -> anyhow::Result<Storage> {
        let cannot_open = || format!("data_dir: cannot open {}", settings.data_dir.display());
        let Some(uri) = &settings.mongo_uri else {
            let journal = LogJournal::open_in(
                &settings.data_dir,
                metrics.clone(),
                settings.retention,
                space.clone(),
            )
            .with_context(cannot_open)?;
            return Ok(Storage {
                journal: journal.clone(),
                log_store: journal,
                side_store: None,
                leases: None,
            });
        };
        let journal = MongoJournal::open(
            uri,
            settings.kafka.as_ref().map_or(0, |k| k.node_id),
            settings.engine.shards * nrtxn_actors::processor::BATCHES_IN_FLIGHT_MAX,
            metrics.clone(),
        )
        .with_context(|| format!("mongo_uri: cannot use {}", redact_uri(uri)))?;
        let store =
            SqliteStore::open_request_store(&settings.data_dir, metrics.clone(), space.clone())
                .with_context(cannot_open)?;
        Ok(Storage {
            journal: journal.clone(),
            log_store: store.clone(),
            side_store: Some(store),
            leases: Some(journal),
        })
    }
}

/// With Kafka, its producer and the processors' hooks, made before the shards start, so
/// every shard knows from its first tick that its requests and its holds' expiries go
/// through a log several nodes share; the readers start once the shards run.
fn topology(
    settings: &Settings,
    stages: nrtxn_actors::metrics::Stages,
) -> anyhow::Result<(Option<nrtxn_kafka::PreparedKafka>, Topology)> {
    let Some(k) = settings.kafka.clone() else {
        return Ok((None, Topology::Alone));
    };
    let prepared =
        KafkaLog::prepare(k, stages).context("kafka_brokers: cannot start the request log")?;
    // MongoDB is one journal every node writes; the embedded one is this node's.
    let writers = match settings.mongo_uri {
        Some(_) => JournalWriters::AllNodes,
        None => JournalWriters::ThisNode,
    };
    let topology = Topology::shared(prepared.hooks(), writers);
    Ok((Some(prepared), topology))
}

/// Runs until SIGINT or SIGTERM, then stops accepting, lets the requests in flight be
/// answered, flushes every shard's batches to the journal and closes it. Call inside an
/// actix system.
pub async fn run(settings: Settings) -> anyhow::Result<()> {
    // Room on the disk first: even reading the access keys writes (SQLite's WAL).
    nrtxn_log::space::check_at_start(&settings.data_dir, settings.disk_free_min_bytes)?;
    let (front, reloader) = Front::check(&settings)?;
    let metrics = Arc::new(Metrics::new());
    crate::memory::start_gauges(&metrics);
    // The floor holds from the first write on, recovery's included (`crate::space`).
    let space = nrtxn_log::space::Space::new(&settings.data_dir, settings.disk_free_min_bytes);
    let Storage {
        journal,
        log_store,
        side_store,
        leases,
    } = Storage::open(&settings, &metrics, &space)?;
    let journal_is_store = side_store.is_none();
    let outbox = journal.clone();
    // Shops' check-backs before an expiry: their settings, and the calls to the shops.
    // Given to the engine as it is built, before any hold it recovers can come due.
    let checks = Arc::new(nrtxn_checkback::HttpCheckBack::start(
        &settings.data_dir,
        settings.mongo_uri.as_deref(),
        metrics.clone(),
        settings.outbound.clone(),
        space.clone(),
    )?);
    let (kafka, topology) = topology(&settings, metrics.stage.clone())?;
    let mut log_error = None;
    let engine = EngineBuilder::new(settings.engine.clone(), journal, metrics)
        .topology(topology)
        .checkback(checks.clone())
        .start(|dispatcher, _recovered| match kafka {
            None => Arc::new(EmbeddedLog::new(log_store, dispatcher, journal_is_store))
                as Arc<dyn RequestLog>,
            Some(prepared) => match prepared.start(dispatcher.clone(), leases) {
                Ok(log) => log,
                Err(e) => {
                    // Reported below, after the engine is built; nothing reaches it.
                    log_error = Some(e);
                    Arc::new(EmbeddedLog::new(log_store, dispatcher, journal_is_store))
                }
            },
        })
        .context("recovery failed")?;
    // From here on every exit, the error paths' too, goes through `stop_node` below:
    // the engine is drained and shut down however serving ends.
    let mut running = Running::default();
    let served = match log_error {
        Some(e) => Err(e).context("kafka_brokers: cannot start the request log"),
        None => {
            let node = (&engine, &*checks);
            serve(&settings, (front, reloader), node, outbox, &mut running).await
        }
    };
    stop_node(&engine, running, &space, side_store).await;
    checks.close();
    served
}

/// What [`serve`] started that [`stop_node`] stops, whatever the way out.
#[derive(Default)]
struct Running {
    relay: Option<EventsRelay>,
    alerts: Option<nrtxn_checkback::alerts::Alerts>,
    metrics_server: Option<actix_web::dev::ServerHandle>,
}

/// Serves HTTP on a built engine until SIGINT or SIGTERM: the outbox relay (with Kafka),
/// the stock alerts, the push stream's feed, `/metrics` on its own address if asked,
/// then the API.
async fn serve(
    settings: &Settings,
    (front, reloader): (Front, KeyReloaderStarting),
    (engine, checks): (&Arc<nrtxn_actors::Engine>, &nrtxn_checkback::HttpCheckBack),
    outbox: Arc<dyn Journal>,
    running: &mut Running,
) -> anyhow::Result<()> {
    // With Kafka, every committed event is also published to the events topic.
    if let Some(k) = &settings.kafka {
        running.relay = Some(
            EventsRelay::start(k, outbox.clone(), engine.metrics().clone())
                .context("kafka_events_topic: cannot start the outbox relay")?,
        );
    }
    // The stock crossings this node journals, to the shops that asked for them.
    running.alerts = Some(
        checks
            .start_alerts(outbox.clone())
            .context("cannot start the stock alerts")?,
    );
    let state = web::Data::new(AppState {
        engine: engine.clone(),
        feed: Some(event_feed(settings, outbox).await?),
        streams_per_shop_max: settings.edge.streams_per_shop_max,
    });
    let _reloader = reloader.run(front.gate.clone());
    // Bound before the main address is announced, so that once a caller reads that line
    // this one is there too.
    if let Some(addrs) = &front.metrics_addrs {
        running.metrics_server = Some(serve_metrics(addrs, &state)?);
    }
    serve_api(settings, front, state).await
}

/// The push stream's feed: the events topic with several nodes (each node's relay
/// writes its own events there), else this node's journal in commit order; its cursors
/// sealed, opaque and bound to their shop (see `CursorKey`).
async fn event_feed(
    settings: &Settings,
    journal: Arc<dyn Journal>,
) -> anyhow::Result<Arc<dyn nrtxn_actors::EventFeed>> {
    let feed: Arc<dyn nrtxn_actors::EventFeed> = match &settings.kafka {
        Some(k) => Arc::new(nrtxn_kafka::TopicFeed {
            security: k.security.clone(),
            brokers: k.brokers.clone(),
            topic: k.events_topic.clone(),
        }),
        None => Arc::new(crate::stream::JournalFeed { journal }),
    };
    let key =
        crate::stream::CursorKey::load_or_make(&settings.data_dir, settings.mongo_uri.as_deref())
            .await?;
    Ok(Arc::new(crate::stream::SealedFeed { inner: feed, key }))
}

/// `/metrics` without a key, on an address of its own (a scraper on a private network).
/// Keyless here always: on loopback, only for names of this machine (see
/// `nrtxn_api::host`); the guard reads no gate, so it counts as open.
fn serve_metrics(
    addrs: &[SocketAddr],
    state: &web::Data<AppState>,
) -> anyhow::Result<actix_web::dev::ServerHandle> {
    let state = state.clone();
    let on_loopback = all_loopback(addrs);
    let server = HttpServer::new(move || {
        App::new()
            .app_data(state.clone())
            .wrap(Condition::new(
                on_loopback,
                from_fn(nrtxn_api::host::loopback_host_only),
            ))
            .route("/metrics", web::get().to(nrtxn_api::health::metrics))
    })
    .workers(1)
    .disable_signals()
    .bind(addrs)
    .with_context(|| format!("metrics_listen: cannot bind {addrs:?}"))?;
    for addr in server.addrs() {
        println!("nrtxn metrics on http://{addr}/metrics");
    }
    let server = server.run();
    let handle = server.handle();
    actix_web::rt::spawn(server);
    Ok(handle)
}

/// The API on `listen`, until SIGINT or SIGTERM.
async fn serve_api(
    settings: &Settings,
    front: Front,
    state: web::Data<AppState>,
) -> anyhow::Result<()> {
    // Callers waiting for an outcome get it or their 504 within the reply timeout; the
    // server waits that long (plus a margin) for them before it closes connections.
    let grace_secs = settings.engine.reply_timeout_ms.div_ceil(1000) + 1;
    let body_limits = web::Data::new(BodyLimits::new(
        Duration::from_millis(settings.body_timeout_ms),
        settings.body_bytes_max,
    ));
    let gate_data = web::Data::from(front.gate);
    let loopback = front.loopback;
    let arbiters = state.engine.arbiter_handles().to_vec();
    let make_app = move || {
        App::new()
            .app_data(state.clone())
            .app_data(body_limits.clone())
            .app_data(gate_data.clone())
            // The span, the screens before routing (the path's names, the Host of an
            // open loopback server, the key and its rate) and the count: one layer.
            .wrap(from_fn(move |req, next| {
                nrtxn_api::front::serve(req, next, loopback)
            }))
            .configure(configure)
    };
    let Some(workers) = settings.http_workers else {
        let listeners = crate::front::bind(&front.listen_addrs)?;
        let scheme = if front.tls.is_some() { "https" } else { "http" };
        for l in &listeners {
            // Tests and scripts read the bound port from this line.
            println!("nrtxn listening on {scheme}://{}", l.local_addr()?);
        }
        tracing::info!(data_dir = %settings.data_dir.display(), "serving");
        let opts = crate::front::Options {
            tls: front.tls,
            connections_max: settings.connections_max,
            grace: Duration::from_secs(grace_secs),
        };
        return crate::front::serve(listeners, &arbiters, make_app, opts).await;
    };
    let server = HttpServer::new(make_app)
        .workers(workers)
        // A client's EOF ends its connection at once. With half-closed connections allowed
        // (actix's default) a client that went away was noticed only when a write to it
        // failed: an idle event stream it closed kept its reader thread, its Kafka consumer
        // and one of the node's 64 stream slots until the next keep-alive comment (15 s), so a
        // client reconnecting in a loop ran the node out of streams (tests/stream.rs). HTTP
        // clients do not half-close a connection to wait for the answer.
        .h1_allow_half_closed(false)
        // actix-web's bound is per worker.
        .max_connections(settings.connections_max.div_ceil(workers))
        .shutdown_timeout(grace_secs);
    let (server, scheme) = match front.tls {
        Some(tls) => (
            server.bind_rustls_0_23(front.listen_addrs.as_slice(), tls),
            "https",
        ),
        None => (server.bind(front.listen_addrs.as_slice()), "http"),
    };
    let server = server.with_context(|| format!("listen: cannot bind {}", settings.listen))?;
    for addr in server.addrs() {
        // Tests and scripts read the bound port from this line.
        println!("nrtxn listening on {scheme}://{addr}");
    }
    tracing::info!(data_dir = %settings.data_dir.display(), "serving");
    server.run().await.context("http server")
}

/// Stops a node whose engine was built, on every path out of [`run`]: the metrics
/// address closes, writers waiting for room give up (with the disk full a flush could
/// wait for ever; what they held was never acknowledged), the shards flush to the
/// journal, the outbox relay and the stock alerts stop, then the engine and the side
/// store.
async fn stop_node(
    engine: &nrtxn_actors::Engine,
    running: Running,
    space: &nrtxn_log::space::Space,
    side_store: Option<Arc<SqliteStore>>,
) {
    let Running {
        relay,
        alerts,
        metrics_server,
    } = running;
    if let Some(handle) = metrics_server {
        handle.stop(true).await;
    }
    tracing::info!("stopped accepting; flushing shards to the journal");
    space.stop_waiting();
    engine.drain().await;
    if let Some(relay) = relay {
        relay.stop();
    }
    if let Some(alerts) = alerts {
        alerts.stop();
    }
    engine.shutdown().await;
    if let Some(store) = side_store {
        store.close();
    }
    tracing::info!("shutdown complete");
}
