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
    /// Processor shards items are hashed to [default: 8].
    #[arg(long, env = "NRTXN_SHARDS")]
    pub shards: Option<usize>,
    /// Threads the shards and WorkManagers run on [default: number of cores].
    #[arg(long, env = "NRTXN_ARBITERS")]
    pub arbiters: Option<usize>,
    /// HTTP worker threads [default: number of cores].
    #[arg(long, env = "NRTXN_HTTP_WORKERS")]
    pub http_workers: Option<usize>,
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
}

/// Defaults of the HTTP front's bounds (the engine's are [`EngineConfig::default`]).
pub const BODY_TIMEOUT_MS_DEFAULT: u64 = 10_000;
/// 64 bodies of the largest kind (a 4 MiB load) at once.
pub const BODY_BYTES_MAX_DEFAULT: usize = 256 * 1024 * 1024;
pub const CONNECTIONS_MAX_DEFAULT: usize = 10_000;

/// The resolved, checked configuration of `serve`.
#[derive(Debug, Clone)]
pub struct Settings {
    pub listen: String,
    pub data_dir: PathBuf,
    pub mongo_uri: Option<String>,
    pub kafka: Option<nrtxn_kafka::KafkaSettings>,
    pub http_workers: usize,
    pub body_timeout_ms: u64,
    pub body_bytes_max: usize,
    pub connections_max: usize,
    pub engine: EngineConfig,
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
        let d = EngineConfig::default();
        macro_rules! pick {
            ($f:ident, $default:expr) => {
                self.$f.clone().or(file.$f.clone()).unwrap_or($default)
            };
        }
        let engine = EngineConfig {
            shards: in_range("shards", pick!(shards, d.shards), 1, 4096)?,
            arbiters: in_range("arbiters", pick!(arbiters, cores), 1, 256)?,
            batch_max: in_range("batch_max", pick!(batch_max, d.batch_max), 1, 65_536)?,
            request_ttl_ms: in_range(
                "request_ttl_ms",
                pick!(request_ttl_ms, d.request_ttl_ms),
                1,
                86_400_000,
            )?,
            reply_timeout_ms: in_range(
                "reply_timeout_ms",
                pick!(reply_timeout_ms, d.reply_timeout_ms),
                1,
                600_000,
            )?,
            inflight_max: in_range(
                "inflight_max",
                pick!(inflight_max, d.inflight_max),
                1,
                100_000_000,
            )?,
            shop_pending_max: in_range(
                "shop_pending_max",
                pick!(shop_pending_max, d.shop_pending_max),
                1,
                100_000_000,
            )?,
            outcome_cache_per_shop: in_range(
                "outcome_cache_per_shop",
                pick!(outcome_cache_per_shop, d.outcome_cache_per_shop),
                0,
                100_000_000,
            )?,
            outcome_cache_total: in_range(
                "outcome_cache_total",
                pick!(outcome_cache_total, d.outcome_cache_total),
                0,
                100_000_000,
            )?,
            shops_max: in_range("shops_max", pick!(shops_max, d.shops_max), 1, 1_000_000)?,
            shop_idle_ms: in_range(
                "shop_idle_ms",
                pick!(shop_idle_ms, d.shop_idle_ms),
                100,
                86_400_000,
            )?,
            holds_max: in_range("holds_max", pick!(holds_max, d.holds_max), 1, 100_000_000)?,
        };
        Ok(Settings {
            listen: pick!(listen, "127.0.0.1:8080".to_string()),
            data_dir: pick!(data_dir, PathBuf::from("./data")),
            mongo_uri: self.mongo_uri.clone().or(file.mongo_uri.clone()),
            kafka: match self.kafka_brokers.clone().or(file.kafka_brokers.clone()) {
                None => None,
                Some(brokers) => Some(nrtxn_kafka::KafkaSettings {
                    brokers,
                    node_id: pick!(node_id, 0),
                    requests_topic: pick!(kafka_requests_topic, "nrtxn.requests".to_string()),
                    partitions: in_range(
                        "kafka_partitions",
                        pick!(kafka_partitions, 8),
                        1,
                        10_000,
                    )?,
                    replication: in_range("kafka_replication", pick!(kafka_replication, 1), 1, 16)?,
                    readers: in_range("kafka_readers", pick!(kafka_readers, 2), 1, 64)?,
                    group: pick!(kafka_group, "nrtxn".to_string()),
                    undecided_max: engine.inflight_max,
                    responses_topic: pick!(kafka_responses_topic, "nrtxn.responses".to_string()),
                    response_partitions: {
                        let n = in_range(
                            "kafka_response_partitions",
                            pick!(kafka_response_partitions, 16),
                            1,
                            10_000,
                        )?;
                        let node = pick!(node_id, 0);
                        if i64::from(node) >= i64::from(n) {
                            bail!(
                                "node_id: {node} is not below kafka_response_partitions ({n}): \
                                 the responses topic has one partition per node id"
                            );
                        }
                        n
                    },
                    events_topic: pick!(kafka_events_topic, "nrtxn.events".to_string()),
                }),
            },
            http_workers: in_range("http_workers", pick!(http_workers, cores), 1, 256)?,
            body_timeout_ms: in_range(
                "body_timeout_ms",
                pick!(body_timeout_ms, BODY_TIMEOUT_MS_DEFAULT),
                1,
                600_000,
            )?,
            body_bytes_max: in_range(
                "body_bytes_max",
                pick!(body_bytes_max, BODY_BYTES_MAX_DEFAULT),
                4 * 1024 * 1024,
                16 * 1024 * 1024 * 1024,
            )?,
            connections_max: in_range(
                "connections_max",
                pick!(connections_max, CONNECTIONS_MAX_DEFAULT),
                1,
                1_000_000,
            )?,
            engine,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_win_over_the_file_and_the_file_over_defaults() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("nrtxn.toml");
        std::fs::write(
            &path,
            "shards = 3\nbatch_max = 100\nlisten = \"127.0.0.1:9\"\n",
        )
        .unwrap();
        let args = ServeArgs {
            config: Some(path),
            batch_max: Some(7),
            ..ServeArgs::default()
        };
        let s = args.resolve().unwrap();
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
