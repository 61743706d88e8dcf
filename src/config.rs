//! Configuration: one typed struct, set from flags, then environment variables, then a
//! TOML file (`--config`), then defaults, in that order of precedence, and checked at
//! start with a message that names the option.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use clap::{Args, Subcommand};
use nrtxn_actors::EngineConfig;
use serde::Deserialize;

/// The server's commands; the binary's parser (`src/main.rs`) flattens them beside the
/// clients' (`follow`).
#[derive(Subcommand, Debug)]
pub enum Command {
    /// Run the server (embedded journal and request log in --data-dir).
    Serve(ServeArgs),
}

/// Options of `nrtxn serve`. Each may also come from `NRTXN_<NAME>` or the TOML file
/// (keys as below, with underscores).
#[derive(Args, Debug, Default, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServeArgs {
    /// TOML file with any of the options below.
    #[arg(long, env = "NRTXN_CONFIG")]
    #[serde(skip)]
    pub config: Option<PathBuf>,
    /// Address to listen on [default: 127.0.0.1:8080]. Port 0 picks a free one.
    #[arg(long, env = "NRTXN_LISTEN")]
    pub listen: Option<String>,
    /// Folder of the embedded journal (created if missing) [default: ./data].
    #[arg(long, env = "NRTXN_DATA_DIR")]
    pub data_dir: Option<PathBuf>,
    /// MongoDB URI of the journal (a replica set); the embedded journal when absent.
    #[arg(long, env = "NRTXN_MONGO_URI")]
    pub mongo_uri: Option<String>,
    /// Kafka brokers (`host:port,...`) of the request log; the embedded log when absent.
    #[arg(long, env = "NRTXN_KAFKA_BROKERS")]
    pub kafka_brokers: Option<String>,
    /// This node's id [default: 0].
    #[arg(long, env = "NRTXN_NODE_ID")]
    pub node_id: Option<u32>,
    /// Requests topic [default: nrtxn.requests].
    #[arg(long, env = "NRTXN_KAFKA_REQUESTS_TOPIC")]
    pub kafka_requests_topic: Option<String>,
    /// Partitions of the requests topic when nrtxn creates it [default: 8].
    #[arg(long, env = "NRTXN_KAFKA_PARTITIONS")]
    pub kafka_partitions: Option<i32>,
    /// Replication factor of the topics when nrtxn creates them [default: 1].
    #[arg(long, env = "NRTXN_KAFKA_REPLICATION")]
    pub kafka_replication: Option<i32>,
    /// Consumers in the reader pool [default: 2].
    #[arg(long, env = "NRTXN_KAFKA_READERS")]
    pub kafka_readers: Option<usize>,
    /// Consumer group of the reader pool [default: nrtxn].
    #[arg(long, env = "NRTXN_KAFKA_GROUP")]
    pub kafka_group: Option<String>,
    /// Longest the broker holds a reader's fetch open when it has nothing new, in ms
    /// (`fetch.wait.max.ms`): an idle partition delays a request up to this long. Raise
    /// it for a broker whose fetches take longer (tansu on S3 storage) [default: 5].
    #[arg(long, env = "NRTXN_KAFKA_FETCH_WAIT_MS")]
    pub kafka_fetch_wait_ms: Option<u64>,
    /// Responses topic: outcomes travel back to the node that accepted the request
    /// [default: nrtxn.responses].
    #[arg(long, env = "NRTXN_KAFKA_RESPONSES_TOPIC")]
    pub kafka_responses_topic: Option<String>,
    /// Partitions of the responses topic when nrtxn creates it, one per node: node ids
    /// run from 0 to this minus one [default: 16].
    #[arg(long, env = "NRTXN_KAFKA_RESPONSE_PARTITIONS")]
    pub kafka_response_partitions: Option<i32>,
    /// Events topic: the outbox relay publishes every committed event there, keyed
    /// `{shop}:{item}` [default: nrtxn.events].
    #[arg(long, env = "NRTXN_KAFKA_EVENTS_TOPIC")]
    pub kafka_events_topic: Option<String>,
    /// Processor shards items are hashed to [default: one per two engine threads
    /// (`arbiters`), at least one, on the embedded journal; 8 with Kafka or MongoDB].
    #[arg(long, env = "NRTXN_SHARDS")]
    pub shards: Option<usize>,
    /// Threads the shards and WorkManagers run on [default: number of cores].
    #[arg(long, env = "NRTXN_ARBITERS")]
    pub arbiters: Option<usize>,
    /// HTTP worker threads of their own; unset (the default), the API is served on the
    /// engine's threads (`arbiters`), beside the shards, with no thread crossed per call.
    #[arg(long, env = "NRTXN_HTTP_WORKERS")]
    pub http_workers: Option<usize>,
    /// Keep each engine thread on a core of its own when the cores the server may use
    /// are exactly one per engine thread (`arbiters`); turn it off when other busy
    /// processes, another node among them, share those cores [default: true].
    #[arg(long, env = "NRTXN_PIN_THREADS", action = clap::ArgAction::Set)]
    pub pin_threads: Option<bool>,
    /// Most entries a shard applies and journals as one batch [default: 4096].
    #[arg(long, env = "NRTXN_BATCH_MAX")]
    pub batch_max: Option<usize>,
    /// A request older than this when its shard reaches it is `expired` [default: 30000].
    #[arg(long, env = "NRTXN_REQUEST_TTL_MS")]
    pub request_ttl_ms: Option<i64>,
    /// How long a respond=true caller waits before a 504 `pending` [default: 5000].
    #[arg(long, env = "NRTXN_REPLY_TIMEOUT_MS")]
    pub reply_timeout_ms: Option<u64>,
    /// Admitted, undecided requests in all; beyond it 429 [default: 200000].
    #[arg(long, env = "NRTXN_INFLIGHT_MAX")]
    pub inflight_max: Option<usize>,
    /// Undecided requests of one shop; beyond it 429 [default: 100000].
    #[arg(long, env = "NRTXN_SHOP_PENDING_MAX")]
    pub shop_pending_max: Option<usize>,
    /// Outcomes kept in memory per shop for repeats and polls [default: 10000].
    #[arg(long, env = "NRTXN_OUTCOME_CACHE_PER_SHOP")]
    pub outcome_cache_per_shop: Option<usize>,
    /// Outcomes kept in memory in all, over every shop [default: 200000].
    #[arg(long, env = "NRTXN_OUTCOME_CACHE_TOTAL")]
    pub outcome_cache_total: Option<usize>,
    /// Shops in memory at once; beyond it idle ones passivate to make room, and 429 only
    /// when none is idle [default: 10000].
    #[arg(long, env = "NRTXN_SHOPS_MAX")]
    pub shops_max: Option<usize>,
    /// A shop with nothing in flight for this long leaves memory (its WorkManager
    /// passivates) until its next request [default: 60000].
    #[arg(long, env = "NRTXN_SHOP_IDLE_MS")]
    pub shop_idle_ms: Option<u64>,
    /// Most pending holds one processor shard keeps; beyond it a hold is refused
    /// (limit_exceeded) [default: 1000000].
    #[arg(long, env = "NRTXN_HOLDS_MAX")]
    pub holds_max: Option<usize>,
    /// Items kept in memory, over every shard; beyond it idle ones (no pending hold, no
    /// write in flight) leave memory and are read back from the journal when next
    /// asked for [default: 2000000].
    #[arg(long, env = "NRTXN_ITEMS_MAX")]
    pub items_max: Option<usize>,
    /// A request body must arrive whole within this long, else 408 [default: 10000].
    #[arg(long, env = "NRTXN_BODY_TIMEOUT_MS")]
    pub body_timeout_ms: Option<u64>,
    /// Bytes of request bodies held at once, in all; beyond it 429 [default: 268435456].
    #[arg(long, env = "NRTXN_BODY_BYTES_MAX")]
    pub body_bytes_max: Option<usize>,
    /// Open client connections, in all; beyond it new ones wait to be accepted
    /// [default: 10000].
    #[arg(long, env = "NRTXN_CONNECTIONS_MAX")]
    pub connections_max: Option<usize>,
    /// How long the embedded journal remembers a request key (and keeps its entry for
    /// polls and events), in seconds; a key used again after it is a new request
    /// [default: 604800, seven days].
    #[arg(long, env = "NRTXN_KEY_WINDOW_SECS")]
    pub key_window_secs: Option<u64>,
    /// How long a sale stays returnable, in days: a seller's return (an increment naming
    /// `return_of`) of an older sale is refused, also after its key's window
    /// [default: 30].
    #[arg(long, env = "NRTXN_RETURN_WINDOW_DAYS")]
    pub return_window_days: Option<u64>,
    /// Size of one segment of the embedded journal's log, in MiB [default: 64].
    #[arg(long, env = "NRTXN_JOURNAL_SEGMENT_MB")]
    pub journal_segment_mb: Option<u64>,
    /// Free space, in MiB, the server leaves on the data dir's disk, whatever it writes:
    /// below it plus an eighth of it new writes are refused (503 disk_full), below it
    /// plus 1 MiB a start is refused, saying what to do; 0 turns the floor off
    /// [default: 64].
    #[arg(long, env = "NRTXN_DISK_FREE_MIN_MB")]
    pub disk_free_min_mb: Option<u64>,
    /// Serve without access keys on a non-loopback address while the key store has no
    /// unrevoked key (protected mode refuses to start there otherwise). Keys, once
    /// created, are always checked.
    #[arg(long, env = "NRTXN_INSECURE_NO_AUTH")]
    #[serde(default)]
    pub insecure_no_auth: bool,
    /// Also serve `/metrics`, without a key, on this address (plain HTTP; keep it on a
    /// private network). On the main address `/metrics` needs an admin key.
    #[arg(long, env = "NRTXN_METRICS_LISTEN")]
    pub metrics_listen: Option<String>,
    /// PEM file of the server's certificate chain: serve HTTPS (with --tls-key).
    #[arg(long, env = "NRTXN_TLS_CERT")]
    pub tls_cert: Option<PathBuf>,
    /// PEM file of the certificate's private key (with --tls-cert).
    #[arg(long, env = "NRTXN_TLS_KEY")]
    pub tls_key: Option<PathBuf>,
    /// Requests per second one shop may make (a token bucket per shop); beyond it 429
    /// with Retry-After. A batch call counts as one request [default: no limit].
    #[arg(long, env = "NRTXN_SHOP_RATE")]
    pub shop_rate: Option<f64>,
    /// Requests a shop may make at once above its rate (the bucket's size)
    /// [default: the rate, at least 1].
    #[arg(long, env = "NRTXN_SHOP_BURST")]
    pub shop_burst: Option<u32>,
    // One shop cannot starve the others: its share of a shard's pending holds
    // and of the node's push streams.
    /// Most pending holds of one shop on one processor shard; beyond it that shop's hold
    /// is refused (limit_exceeded) while other shops still hold [default: 250000, a
    /// quarter of the default --holds-max].
    #[arg(long, env = "NRTXN_HOLDS_PER_SHOP_MAX")]
    pub holds_per_shop_max: Option<usize>,
    /// Most push streams (`events/stream`) one shop keeps open on this node, of the
    /// node's 64; beyond it 503 with Retry-After [default: 16].
    #[arg(long, env = "NRTXN_STREAMS_PER_SHOP_MAX")]
    pub streams_per_shop_max: Option<usize>,
    /// Kafka `security.protocol`: plaintext, ssl, sasl_plaintext or sasl_ssl
    /// [default: plaintext].
    #[arg(long, env = "NRTXN_KAFKA_SECURITY_PROTOCOL")]
    pub kafka_security_protocol: Option<String>,
    /// Kafka SASL mechanism: PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512.
    #[arg(long, env = "NRTXN_KAFKA_SASL_MECHANISM")]
    pub kafka_sasl_mechanism: Option<String>,
    /// Kafka SASL user name.
    #[arg(long, env = "NRTXN_KAFKA_SASL_USERNAME")]
    pub kafka_sasl_username: Option<String>,
    /// Kafka SASL password; prefer the environment variable to the flag, which other
    /// users of the machine can read in the process list.
    #[arg(long, env = "NRTXN_KAFKA_SASL_PASSWORD", hide_env_values = true)]
    pub kafka_sasl_password: Option<nrtxn_kafka::Secret>,
    /// PEM file of the CA that signed the Kafka brokers' certificates [default: the
    /// system's CAs].
    #[arg(long, env = "NRTXN_KAFKA_SSL_CA")]
    pub kafka_ssl_ca: Option<PathBuf>,
    /// Format of the log lines on stderr: `text`, for people, or `json`, one object a
    /// line whose `span` names the HTTP request it was written for (method, route,
    /// shop, item, request key) [default: text]. `RUST_LOG` chooses what is logged.
    #[arg(long, env = "NRTXN_LOG_FORMAT", value_enum)]
    pub log_format: Option<LogFormat>,
    /// A network (CIDR, like 10.0.0.0/8 or fd00::/8) shops' check-backs may reach although
    /// it is inside (loopback, private, link-local...), which they never do otherwise.
    /// Repeatable; comma-separated in the environment variable [default: none].
    #[arg(long, env = "NRTXN_CHECK_ALLOW_NET", value_delimiter = ',')]
    pub check_allow_net: Option<Vec<String>>,
    /// Allow shops' check-backs to plain `http://` URLs (`https://` only otherwise).
    #[arg(long, env = "NRTXN_CHECK_ALLOW_HTTP")]
    #[serde(default)]
    pub check_allow_http: bool,
}

/// How the server writes its log lines.
#[derive(clap::ValueEnum, Debug, Default, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// tracing-subscriber's text lines, for a terminal.
    #[default]
    Text,
    /// One JSON object a line, for a log collector: `timestamp`, `level`, `target`, the
    /// event's fields (`message` among them) at the top, and `span`, the innermost span's
    /// name and fields.
    Json,
}

/// The defaults of the server's options that are not the engine's (those are
/// [`EngineConfig::default`]): one place for the code, the help and the README.
pub mod defaults {
    pub const LISTEN: &str = "127.0.0.1:8080";
    pub const DATA_DIR: &str = "./data";
    pub const NODE_ID: u32 = 0;
    pub const KAFKA_REQUESTS_TOPIC: &str = "nrtxn.requests";
    pub const KAFKA_PARTITIONS: i32 = 8;
    pub const KAFKA_REPLICATION: i32 = 1;
    pub const KAFKA_READERS: usize = 2;
    pub const KAFKA_GROUP: &str = "nrtxn";
    pub const KAFKA_FETCH_WAIT_MS: u64 = 5;
    pub const KAFKA_RESPONSES_TOPIC: &str = "nrtxn.responses";
    pub const KAFKA_RESPONSE_PARTITIONS: i32 = 16;
    pub const KAFKA_EVENTS_TOPIC: &str = "nrtxn.events";
    /// Highest `--shop-rate`: beyond it a limit is no limit on this machine.
    pub const SHOP_RATE_MAX: f64 = 1_000_000.0;
    pub const BODY_TIMEOUT_MS: u64 = 10_000;
    /// 64 bodies of the largest kind (a 4 MiB load) at once.
    pub const BODY_BYTES_MAX: usize = 256 * 1024 * 1024;
    pub const CONNECTIONS_MAX: usize = 10_000;
    /// Seven days, as idempotency windows go (Stripe keeps keys 24 hours).
    pub const KEY_WINDOW_SECS: u64 = 7 * 86_400;
    /// A month, as return policies go.
    pub const RETURN_WINDOW_DAYS: u64 = 30;
    pub const JOURNAL_SEGMENT_MB: u64 = 64;
    pub const DISK_FREE_MIN_MB: u64 = nrtxn_log::space::FREE_MIN_MB_DEFAULT;
}

/// Where the access keys are: the options `serve` and `keys` share.
#[derive(Args, Debug, Clone)]
pub struct KeyStoreArgs {
    /// TOML file of `serve` (only data_dir and mongo_uri are read from it).
    #[arg(long, env = "NRTXN_CONFIG")]
    pub config: Option<PathBuf>,
    /// Data dir of the server: its keys are in keys.sqlite there [default: ./data].
    #[arg(long, env = "NRTXN_DATA_DIR")]
    pub data_dir: Option<PathBuf>,
    /// MongoDB URI of the server's journal: its keys are in the collection `keys` there.
    #[arg(long, env = "NRTXN_MONGO_URI")]
    pub mongo_uri: Option<String>,
}

impl KeyStoreArgs {
    /// The data dir and MongoDB URI: flags and environment over the file over defaults.
    pub fn resolve(&self) -> anyhow::Result<(PathBuf, Option<String>)> {
        let file = match &self.config {
            Some(p) => read_file(p)?,
            None => ServeArgs::default(),
        };
        Ok((
            self.data_dir
                .clone()
                .or(file.data_dir)
                .unwrap_or_else(|| PathBuf::from(defaults::DATA_DIR)),
            self.mongo_uri.clone().or(file.mongo_uri),
        ))
    }
}

/// Access control and TLS of the HTTP front.
#[derive(Debug, Clone)]
pub struct EdgeSettings {
    /// See [`ServeArgs::insecure_no_auth`].
    pub insecure_no_auth: bool,
    pub metrics_listen: Option<String>,
    /// Certificate chain and key files.
    pub tls: Option<(PathBuf, PathBuf)>,
    /// Requests per second and burst of each shop's bucket; `None`: no limit.
    pub shop_rate: Option<(f64, u32)>,
    /// See [`ServeArgs::streams_per_shop_max`].
    pub streams_per_shop_max: usize,
}

/// The resolved, checked configuration of `serve`.
#[derive(Debug, Clone)]
pub struct Settings {
    pub listen: String,
    pub data_dir: PathBuf,
    pub mongo_uri: Option<String>,
    pub kafka: Option<nrtxn_kafka::KafkaSettings>,
    /// `None`: the API on the engine's threads (`crate::front`); `Some(n)`: on n
    /// threads of actix-web's own.
    pub http_workers: Option<usize>,
    pub body_timeout_ms: u64,
    pub body_bytes_max: usize,
    pub connections_max: usize,
    /// What the embedded journal keeps on disk, and for how long.
    pub retention: nrtxn_embedded::journal::Retention,
    /// See [`ServeArgs::disk_free_min_mb`].
    pub disk_free_min_bytes: u64,
    pub engine: EngineConfig,
    pub edge: EdgeSettings,
    pub log_format: LogFormat,
    /// What the shops' check-backs (every call made on a shop's behalf) may reach.
    pub outbound: nrtxn_checkback::outbound::OutboundPolicy,
}

fn read_file(path: &Path) -> anyhow::Result<ServeArgs> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("config: cannot read {}", path.display()))?;
    toml::from_str(&text).with_context(|| format!("config: {} is not valid", path.display()))
}

fn in_range<T: PartialOrd + std::fmt::Display + Copy>(
    name: &str,
    v: T,
    min: T,
    max: T,
) -> anyhow::Result<T> {
    if v < min || v > max {
        bail!("{name}: must be between {min} and {max}, got {v}");
    }
    Ok(v)
}

/// A setting as the flags and environment give it, else the file, else `$default`.
macro_rules! pick {
    ($args:ident, $file:ident, $f:ident, $default:expr) => {
        $args.$f.clone().or($file.$f.clone()).unwrap_or($default)
    };
}

/// A numeric setting picked as by [`pick!`], refused outside `$min..=$max` with the
/// setting's name.
macro_rules! bound {
    ($args:ident, $file:ident, $f:ident, $default:expr, $min:expr, $max:expr) => {
        in_range(
            stringify!($f),
            pick!($args, $file, $f, $default),
            $min,
            $max,
        )
    };
}

impl ServeArgs {
    /// Flags and environment (already merged by clap) over the file over the defaults.
    pub fn resolve(self) -> anyhow::Result<Settings> {
        let file = match &self.config {
            Some(p) => read_file(p)?,
            None => ServeArgs::default(),
        };
        let cores = std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(2);
        let engine = self.engine(&file, cores)?;
        let s = &self;
        Ok(Settings {
            listen: pick!(s, file, listen, defaults::LISTEN.to_string()),
            data_dir: pick!(s, file, data_dir, PathBuf::from(defaults::DATA_DIR)),
            mongo_uri: self.mongo_uri.clone().or(file.mongo_uri.clone()),
            kafka: self.kafka(&file, engine.inflight_max)?,
            http_workers: (s.http_workers.or(file.http_workers))
                .map(|n| in_range("http_workers", n, 1, 256))
                .transpose()?,
            body_timeout_ms: bound!(
                s,
                file,
                body_timeout_ms,
                defaults::BODY_TIMEOUT_MS,
                1,
                600_000
            )?,
            body_bytes_max: bound!(
                s,
                file,
                body_bytes_max,
                defaults::BODY_BYTES_MAX,
                4 * 1024 * 1024,
                16 * 1024 * 1024 * 1024
            )?,
            connections_max: bound!(
                s,
                file,
                connections_max,
                defaults::CONNECTIONS_MAX,
                1,
                1_000_000
            )?,
            retention: self.retention(&file, engine.return_window_ms)?,
            disk_free_min_bytes: bound!(
                s,
                file,
                disk_free_min_mb,
                defaults::DISK_FREE_MIN_MB,
                0,
                1 << 20
            )? * 1024
                * 1024,
            engine,
            edge: self.edge(&file)?,
            log_format: pick!(s, file, log_format, LogFormat::default()),
            outbound: self.outbound(&file)?,
        })
    }

    /// How many shards there are unless set. The embedded journal is one log with one
    /// group commit for every shard, so more shards add no write in parallel: they only
    /// cut the requests of a moment into more, smaller batches, each its own hand-off
    /// to the log and back. One shard per two engine threads keeps the threads that
    /// read and answer the calls ahead of the one that decides (measured on two cores:
    /// one shard against 8, `docs/decisions/shards.md`). With Kafka or MongoDB each
    /// shard's batches are writes of their own over the network, which more shards keep
    /// in flight at once: 8, as before.
    fn shards_default(&self, file: &ServeArgs, arbiters: usize, networked_shards: usize) -> usize {
        let networked = [
            &self.kafka_brokers,
            &file.kafka_brokers,
            &self.mongo_uri,
            &file.mongo_uri,
        ]
        .iter()
        .any(|s| s.is_some());
        if networked {
            networked_shards
        } else {
            (arbiters / 2).max(1)
        }
    }

    /// The engine's bounds.
    fn engine(&self, file: &ServeArgs, cores: usize) -> anyhow::Result<EngineConfig> {
        let d = EngineConfig::default();
        let s = self;
        let arbiters = bound!(s, file, arbiters, cores, 1, 256)?;
        Ok(EngineConfig {
            shards: bound!(
                s,
                file,
                shards,
                self.shards_default(file, arbiters, d.shards),
                1,
                4096
            )?,
            arbiters,
            batch_max: bound!(s, file, batch_max, d.batch_max, 1, 65_536)?,
            request_ttl_ms: bound!(s, file, request_ttl_ms, d.request_ttl_ms, 1, 86_400_000)?,
            reply_timeout_ms: bound!(s, file, reply_timeout_ms, d.reply_timeout_ms, 1, 600_000)?,
            inflight_max: bound!(s, file, inflight_max, d.inflight_max, 1, 100_000_000)?,
            shop_pending_max: bound!(
                s,
                file,
                shop_pending_max,
                d.shop_pending_max,
                1,
                100_000_000
            )?,
            outcome_cache_per_shop: bound!(
                s,
                file,
                outcome_cache_per_shop,
                d.outcome_cache_per_shop,
                0,
                100_000_000
            )?,
            outcome_cache_total: bound!(
                s,
                file,
                outcome_cache_total,
                d.outcome_cache_total,
                0,
                100_000_000
            )?,
            shops_max: bound!(s, file, shops_max, d.shops_max, 1, 1_000_000)?,
            shop_idle_ms: bound!(s, file, shop_idle_ms, d.shop_idle_ms, 100, 86_400_000)?,
            holds_max: bound!(s, file, holds_max, d.holds_max, 1, 100_000_000)?,
            holds_per_shop_max: bound!(
                s,
                file,
                holds_per_shop_max,
                d.holds_per_shop_max,
                1,
                100_000_000
            )?,
            items_max: bound!(s, file, items_max, d.items_max, 1, 1_000_000_000)?,
            return_window_ms: bound!(
                s,
                file,
                return_window_days,
                defaults::RETURN_WINDOW_DAYS,
                1,
                3_650
            )? as i64
                * 86_400_000,
            hold_expiry_copies: nrtxn_log::faults::expiry_copies().unwrap_or(d.hold_expiry_copies),
            pin_threads: pick!(s, file, pin_threads, true),
        })
    }

    /// Kafka's settings, when brokers are named (else the embedded request log).
    fn kafka(
        &self,
        file: &ServeArgs,
        inflight_max: usize,
    ) -> anyhow::Result<Option<nrtxn_kafka::KafkaSettings>> {
        let Some(brokers) = self.kafka_brokers.clone().or(file.kafka_brokers.clone()) else {
            return Ok(None);
        };
        use defaults::*;
        let s = self;
        let node = pick!(s, file, node_id, NODE_ID);
        let response_partitions = bound!(
            s,
            file,
            kafka_response_partitions,
            KAFKA_RESPONSE_PARTITIONS,
            1,
            10_000
        )?;
        if i64::from(node) >= i64::from(response_partitions) {
            bail!(
                "node_id: {node} is not below kafka_response_partitions ({response_partitions}): \
                 the responses topic has one partition per node id"
            );
        }
        Ok(Some(nrtxn_kafka::KafkaSettings {
            brokers,
            node_id: node,
            requests_topic: pick!(
                s,
                file,
                kafka_requests_topic,
                KAFKA_REQUESTS_TOPIC.to_string()
            ),
            partitions: bound!(s, file, kafka_partitions, KAFKA_PARTITIONS, 1, 10_000)?,
            replication: bound!(s, file, kafka_replication, KAFKA_REPLICATION, 1, 16)?,
            readers: bound!(s, file, kafka_readers, KAFKA_READERS, 1, 64)?,
            group: pick!(s, file, kafka_group, KAFKA_GROUP.to_string()),
            undecided_max: inflight_max,
            fetch_wait_ms: bound!(s, file, kafka_fetch_wait_ms, KAFKA_FETCH_WAIT_MS, 1, 60_000)?,
            responses_topic: pick!(
                s,
                file,
                kafka_responses_topic,
                KAFKA_RESPONSES_TOPIC.to_string()
            ),
            response_partitions,
            events_topic: pick!(s, file, kafka_events_topic, KAFKA_EVENTS_TOPIC.to_string()),
            security: self.kafka_security(file)?,
        }))
    }

    /// How long keys and sales are kept, and the log's segment size.
    fn retention(
        &self,
        file: &ServeArgs,
        return_window_ms: i64,
    ) -> anyhow::Result<nrtxn_embedded::journal::Retention> {
        let s = self;
        Ok(nrtxn_embedded::journal::Retention {
            key_window_ms: bound!(
                s,
                file,
                key_window_secs,
                defaults::KEY_WINDOW_SECS,
                1,
                10 * 365 * 86_400
            )? as i64
                * 1_000,
            segment_bytes: bound!(
                s,
                file,
                journal_segment_mb,
                defaults::JOURNAL_SEGMENT_MB,
                1,
                1_024
            )? * 1024
                * 1024,
            return_window_ms,
        })
    }

    /// Where check-backs and alerts may call.
    fn outbound(
        &self,
        file: &ServeArgs,
    ) -> anyhow::Result<nrtxn_checkback::outbound::OutboundPolicy> {
        let s = self;
        Ok(nrtxn_checkback::outbound::OutboundPolicy {
            allow_nets: pick!(s, file, check_allow_net, Vec::new())
                .iter()
                .filter(|n| !n.trim().is_empty())
                .map(|n| nrtxn_checkback::outbound::Net::parse(n))
                .collect::<Result<_, _>>()
                .map_err(|e| anyhow::anyhow!("check_allow_net: {e}"))?,
            allow_http: self.check_allow_http || file.check_allow_http,
        })
    }
}

impl ServeArgs {
    /// The Kafka clients' TLS and credentials, checked together.
    pub fn kafka_security(&self, file: &ServeArgs) -> anyhow::Result<nrtxn_kafka::KafkaSecurity> {
        macro_rules! pick {
            ($f:ident) => {
                self.$f.clone().or(file.$f.clone())
            };
        }
        let security = nrtxn_kafka::KafkaSecurity {
            protocol: pick!(kafka_security_protocol).map(|p| p.to_ascii_lowercase()),
            sasl_mechanism: pick!(kafka_sasl_mechanism).map(|m| m.to_ascii_uppercase()),
            sasl_username: pick!(kafka_sasl_username),
            sasl_password: pick!(kafka_sasl_password),
            ssl_ca: pick!(kafka_ssl_ca),
        };
        security.check().map_err(anyhow::Error::msg)?;
        Ok(security)
    }

    fn edge(&self, file: &ServeArgs) -> anyhow::Result<EdgeSettings> {
        macro_rules! pick {
            ($f:ident) => {
                self.$f.clone().or(file.$f.clone())
            };
        }
        let tls = match (pick!(tls_cert), pick!(tls_key)) {
            (Some(cert), Some(key)) => {
                for (name, path) in [("tls_cert", &cert), ("tls_key", &key)] {
                    if !path.is_file() {
                        bail!("{name}: {} is not a readable file", path.display());
                    }
                }
                Some((cert, key))
            }
            (None, None) => None,
            (Some(_), None) => bail!("tls_key: required with tls_cert (both or neither)"),
            (None, Some(_)) => bail!("tls_cert: required with tls_key (both or neither)"),
        };
        let shop_rate = match (pick!(shop_rate), pick!(shop_burst)) {
            (None, None) => None,
            (None, Some(_)) => bail!("shop_burst: needs shop_rate (the limit is off without it)"),
            (Some(rate), burst) => {
                if !(rate > 0.0 && rate <= defaults::SHOP_RATE_MAX) {
                    bail!(
                        "shop_rate: must be above 0 and at most {}, got {rate}",
                        defaults::SHOP_RATE_MAX
                    );
                }
                // The default burst is one second's worth of requests.
                let burst = burst.unwrap_or(rate.ceil() as u32);
                Some((rate, in_range("shop_burst", burst, 1, 10_000_000)?))
            }
        };
        Ok(EdgeSettings {
            insecure_no_auth: self.insecure_no_auth || file.insecure_no_auth,
            metrics_listen: pick!(metrics_listen),
            tls,
            shop_rate,
            streams_per_shop_max: in_range(
                "streams_per_shop_max",
                pick!(streams_per_shop_max).unwrap_or(nrtxn_api::stream::STREAMS_PER_SHOP_MAX),
                1,
                nrtxn_api::stream::STREAMS_MAX,
            )?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_default_to_one_per_two_engine_threads_on_the_embedded_journal_and_8_beside_a_network_store(
    ) {
        let shards = |args: ServeArgs| args.resolve().unwrap().engine.shards;
        let arbiters = |n| ServeArgs {
            arbiters: Some(n),
            ..ServeArgs::default()
        };
        assert_eq!(shards(arbiters(1)), 1);
        assert_eq!(shards(arbiters(2)), 1);
        assert_eq!(shards(arbiters(8)), 4);
        let mongo = ServeArgs {
            mongo_uri: Some("mongodb://127.0.0.1:1/x".into()),
            ..arbiters(2)
        };
        assert_eq!(shards(mongo), 8, "MongoDB");
        let kafka = ServeArgs {
            kafka_brokers: Some("127.0.0.1:1".into()),
            ..arbiters(2)
        };
        assert_eq!(shards(kafka), 8, "Kafka");
        let set = ServeArgs {
            shards: Some(5),
            ..arbiters(2)
        };
        assert_eq!(shards(set), 5, "a flag wins");
    }

    #[test]
    fn flags_win_over_the_file_and_the_file_over_defaults() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("nrtxn.toml");
        std::fs::write(
            &path,
            "shards = 3\nbatch_max = 100\nlisten = \"127.0.0.1:9\"\npin_threads = false\n",
        )
        .unwrap();
        let args = ServeArgs {
            config: Some(path),
            batch_max: Some(7),
            ..ServeArgs::default()
        };
        let s = args.resolve().unwrap();
        assert_eq!(s.log_format, LogFormat::Text, "the default");
        assert!(!s.engine.pin_threads, "from the file");
        assert!(
            ServeArgs::default().resolve().unwrap().engine.pin_threads,
            "on by default"
        );
        assert_eq!(s.engine.shards, 3);
        assert_eq!(s.engine.batch_max, 7);
        assert_eq!(s.listen, "127.0.0.1:9");
        assert_eq!(
            s.engine.request_ttl_ms,
            EngineConfig::default().request_ttl_ms
        );
    }

    #[test]
    fn out_of_range_option_is_refused_with_its_name() {
        let args = ServeArgs {
            shards: Some(0),
            ..ServeArgs::default()
        };
        let err = args.resolve().unwrap_err().to_string();
        assert!(err.starts_with("shards:"), "{err}");
        // A shop's share of the node's streams is at most all of them.
        let args = ServeArgs {
            streams_per_shop_max: Some(nrtxn_api::stream::STREAMS_MAX + 1),
            ..ServeArgs::default()
        };
        let err = args.resolve().unwrap_err().to_string();
        assert!(err.starts_with("streams_per_shop_max:"), "{err}");
        let s = ServeArgs::default().resolve().unwrap();
        assert_eq!(s.engine.holds_per_shop_max, s.engine.holds_max / 4);
        assert_eq!(
            s.edge.streams_per_shop_max,
            nrtxn_api::stream::STREAMS_MAX / 4
        );
    }

    #[test]
    fn access_tls_and_kafka_security_options_come_from_the_file_and_are_checked_together() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("nrtxn.toml");
        std::fs::write(
            &path,
            "insecure_no_auth = true\nshop_rate = 2.5\nkafka_brokers = \"k:9092\"\n\
             log_format = \"json\"\n\
             kafka_security_protocol = \"SASL_SSL\"\nkafka_sasl_mechanism = \"scram-sha-512\"\n\
             kafka_sasl_username = \"nrtxn\"\nkafka_sasl_password = \"pw\"\n",
        )
        .unwrap();
        let s = ServeArgs {
            config: Some(path.clone()),
            ..ServeArgs::default()
        }
        .resolve()
        .unwrap();
        assert!(s.edge.insecure_no_auth);
        assert_eq!(s.log_format, LogFormat::Json);
        assert_eq!(
            s.edge.shop_rate,
            Some((2.5, 3)),
            "the burst defaults to the rate"
        );
        let security = s.kafka.unwrap().security;
        assert_eq!(security.protocol.as_deref(), Some("sasl_ssl"));
        assert_eq!(security.sasl_mechanism.as_deref(), Some("SCRAM-SHA-512"));
        assert_eq!(
            security.sasl_password.map(|p| p.expose().to_string()),
            Some("pw".into())
        );

        let refused = |args: ServeArgs| format!("{:#}", args.resolve().unwrap_err());
        let cert = Some(path.clone());
        let err = refused(ServeArgs {
            tls_cert: cert,
            ..ServeArgs::default()
        });
        assert!(err.starts_with("tls_key:"), "{err}");
        let err = refused(ServeArgs {
            shop_burst: Some(3),
            ..ServeArgs::default()
        });
        assert!(err.starts_with("shop_burst:"), "{err}");
        let err = refused(ServeArgs {
            shop_rate: Some(0.0),
            ..ServeArgs::default()
        });
        assert!(err.starts_with("shop_rate:"), "{err}");
        let err = refused(ServeArgs {
            kafka_brokers: Some("k:9092".into()),
            kafka_security_protocol: Some("sasl_ssl".into()),
            ..ServeArgs::default()
        });
        assert!(err.starts_with("kafka_sasl_mechanism:"), "{err}");
    }

    #[test]
    fn check_back_networks_and_http_come_from_the_file_and_are_checked() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("nrtxn.toml");
        std::fs::write(
            &path,
            "check_allow_net = [\"10.0.0.0/8\", \"fd00::/8\"]\ncheck_allow_http = true\n",
        )
        .unwrap();
        let s = ServeArgs {
            config: Some(path),
            ..ServeArgs::default()
        }
        .resolve()
        .unwrap();
        assert!(s.outbound.allow_http);
        let nets: Vec<String> = s
            .outbound
            .allow_nets
            .iter()
            .map(|n| n.to_string())
            .collect();
        assert_eq!(nets, ["10.0.0.0/8", "fd00::/8"]);
        assert_eq!(
            ServeArgs::default().resolve().unwrap().outbound,
            nrtxn_checkback::outbound::OutboundPolicy::default(),
            "nothing inside, https only, by default"
        );
        let err = format!(
            "{:#}",
            ServeArgs {
                check_allow_net: Some(vec!["10.0.0.0/33".into()]),
                ..ServeArgs::default()
            }
            .resolve()
            .unwrap_err()
        );
        assert!(err.starts_with("check_allow_net:"), "{err}");
    }

    #[test]
    fn unknown_key_in_the_file_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("nrtxn.toml");
        std::fs::write(&path, "shardz = 3\n").unwrap();
        let args = ServeArgs {
            config: Some(path),
            ..ServeArgs::default()
        };
        let err = format!("{:#}", args.resolve().unwrap_err());
        assert!(err.contains("shardz"), "{err}");
    }
}
