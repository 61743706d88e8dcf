//! Wiring of `nrtxn serve`: the store, the engine, the HTTP front, and the orderly stop.

use std::sync::Arc;
use std::time::Duration;

use actix_web::middleware::from_fn;
use actix_web::{web, App, HttpServer};
use anyhow::Context;
use nrtxn_actors::{Engine, Journal, Metrics, RequestLog};
use nrtxn_api::validate::{utf8_paths, BodyLimits};
use nrtxn_api::{configure, count_requests, AppState};

use crate::config::Settings;
use crate::embedded_log::EmbeddedLog;
use crate::mongo::MongoJournal;
use crate::sqlite::SqliteStore;
use nrtxn_kafka::{EventsRelay, KafkaLog};

/// Runs until SIGINT or SIGTERM, then stops accepting, lets the requests in flight be
/// answered, flushes every shard's batches to the journal and closes it. Call inside an
/// actix system.
pub async fn run(settings: Settings) -> anyhow::Result<()> {
    let metrics = Arc::new(Metrics::new());
    // The embedded store always holds the request log's durable part (fire-and-forget
    // requests), and the journal too unless MongoDB is configured.
    let store = SqliteStore::open(&settings.data_dir, metrics.clone())
        .with_context(|| format!("data_dir: cannot open {}", settings.data_dir.display()))?;
    let journal: Arc<dyn Journal> = match &settings.mongo_uri {
        Some(uri) => MongoJournal::open(
            uri,
            settings.kafka.as_ref().map_or(0, |k| k.node_id),
            settings.engine.shards * nrtxn_actors::processor::BATCHES_IN_FLIGHT_MAX,
            metrics.clone(),
        )
        .with_context(|| format!("mongo_uri: cannot use {uri}"))?,
        None => store.clone(),
    };
    let journal_is_store = settings.mongo_uri.is_none();
    let outbox = journal.clone();
    let log_store = store.clone();
    let kafka = settings.kafka.clone();
    let mut log_error = None;
    let engine = Engine::start(
        settings.engine.clone(),
        journal,
        |dispatcher, _recovered| match kafka {
            None => Arc::new(EmbeddedLog::new(log_store, dispatcher, journal_is_store))
                as Arc<dyn RequestLog>,
            Some(k) => {
                match KafkaLog::start(k, dispatcher.clone()) {
                    Ok(log) => log,
                    Err(e) => {
                        // Reported below, after the engine is built; nothing reaches it.
                        log_error = Some(e);
                        Arc::new(EmbeddedLog::new(log_store, dispatcher, journal_is_store))
                    }
                }
            }
        },
        metrics,
    )
    .context("recovery failed")?;
    if let Some(e) = log_error {
        engine.shutdown().await;
        return Err(e).context("kafka_brokers: cannot start the request log");
    }
    // With Kafka, every committed event is also published to the events topic.
    let relay = match &settings.kafka {
        None => None,
        Some(k) => match EventsRelay::start(k, outbox, engine.metrics().clone()) {
            Ok(r) => Some(r),
            Err(e) => {
                engine.shutdown().await;
                return Err(e).context("kafka_events_topic: cannot start the outbox relay");
            }
        },
    };
    let state = web::Data::new(AppState {
        engine: engine.clone(),
    });
    // Callers waiting for an outcome get it or their 504 within the reply timeout; the
    // server waits that long (plus a margin) for them before it closes connections.
    let grace_secs = settings.engine.reply_timeout_ms.div_ceil(1000) + 1;
    let body_limits = web::Data::new(BodyLimits::new(
        Duration::from_millis(settings.body_timeout_ms),
        settings.body_bytes_max,
    ));
    let server = HttpServer::new(move || {
        App::new()
            .app_data(state.clone())
            .app_data(body_limits.clone())
            .wrap(from_fn(utf8_paths))
            .wrap(from_fn(count_requests))
            .configure(configure)
    })
    .workers(settings.http_workers)
    // actix-web's bound is per worker.
    .max_connections(settings.connections_max.div_ceil(settings.http_workers))
    .shutdown_timeout(grace_secs)
    .bind(&settings.listen)
    .with_context(|| format!("listen: cannot bind {}", settings.listen))?;
    for addr in server.addrs() {
        // Tests and scripts read the bound port from this line.
        println!("nrtxn listening on http://{addr}");
    }
    tracing::info!(data_dir = %settings.data_dir.display(), "serving");
    server.run().await.context("http server")?;
    tracing::info!("stopped accepting; flushing shards to the journal");
    engine.drain().await;
    if let Some(relay) = relay {
        relay.stop();
    }
    engine.shutdown().await;
    if !journal_is_store {
        store.close();
    }
    tracing::info!("shutdown complete");
    Ok(())
}
