use std::io::Write;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use clap::{Args, Parser, Subcommand};
use nrtxn::config::{Command, KeyStoreArgs, LogFormat, ServeArgs};
use nrtxn::keys::{generate, KeyStore, Revoked};
use nrtxn_actors::EVENTS_LIMIT_MAX;
use nrtxn_client::follow::{FollowError, Follower, HttpBackfill};
use nrtxn_kafka::EventsTopic;
use tracing_subscriber::EnvFilter;

/// jemalloc, for SQLite's and librdkafka's `malloc` too: every request allocates its
/// JSON, its `Arc<str>`s and its journal entry, and glibc's allocator was about a sixth of
/// the server's CPU on the batch route; mimalloc, used before, kept most of what an
/// overload burst had taken (docs/decisions/allocator.md).
#[global_allocator]
static GLOBAL: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// jemalloc's options, read once at its start: its background threads return pages left
/// unused for a second (`dirty_decay_ms`) straight to the system (`muzzy_decay_ms: 0`),
/// so memory a burst took comes back once the burst is over, even on an idle server.
/// `MALLOC_CONF` in the environment overrides them.
#[allow(non_upper_case_globals)]
#[export_name = "malloc_conf"]
pub static malloc_conf: &[u8; 60] =
    b"background_thread:true,dirty_decay_ms:1000,muzzy_decay_ms:0\0";

/// The binary's commands: the server's (declared with its configuration in
/// `nrtxn::config`) and the clients' (declared here, beside the code that runs them).
#[derive(Parser, Debug)]
#[command(
    name = "nrtxn",
    version,
    about = "Near-realtime inventory transactions"
)]
struct Cli {
    #[command(subcommand)]
    command: MainCommand,
}

#[derive(Subcommand, Debug)]
#[allow(
    clippy::large_enum_variant,
    reason = "parsed once at start: its size costs nothing"
)]
enum MainCommand {
    #[command(flatten)]
    Server(Command),
    /// Print events as JSON lines, gapless and in seq order per item, following new ones
    /// as they come: a shop's (or one item's) from the events topic with
    /// `--kafka-brokers`, else one item's by polling the server's events route.
    Follow(FollowArgs),
    /// A shop's items on a running server: load a CSV file, list, read one.
    Items {
        #[command(flatten)]
        conn: nrtxn_client::Conn,
        #[command(subcommand)]
        command: nrtxn_client::ItemsCommand,
    },
    /// Transactions on a running server: submit one, read one's outcome by its key.
    Txn {
        #[command(flatten)]
        conn: nrtxn_client::Conn,
        #[command(subcommand)]
        command: nrtxn_client::TxnCommand,
    },
    /// An item's live stock in the terminal, from the shop's event stream (needs an
    /// operator key of the shop, or admin, when keys are on).
    Watch(nrtxn_client::WatchArgs),
    /// Manage access keys, in the store `serve` reads with the same --data-dir or
    /// --mongo-uri (works while servers run; they pick changes up within 5 s).
    Keys(KeysArgs),
    /// Copy an embedded data dir into a new folder, while the server runs: the copy holds
    /// everything acknowledged before the backup began, checked as a start checks it.
    Backup {
        /// The data dir of the running (or stopped) server.
        #[arg(long, env = "NRTXN_DATA_DIR", default_value = "./data")]
        data_dir: std::path::PathBuf,
        /// A new folder (it must not exist, or be empty).
        #[arg(long)]
        to: std::path::PathBuf,
    },
    /// Make a backup the data dir of a server again: copies it into a new, empty data dir.
    Restore {
        /// The folder `nrtxn backup --to` wrote.
        #[arg(long)]
        from: std::path::PathBuf,
        /// The new data dir (it must not exist, or be empty).
        #[arg(long, env = "NRTXN_DATA_DIR")]
        data_dir: std::path::PathBuf,
        /// Where the access keys come from: `none` (the default: the restored server has
        /// no key until one is created), `backup` (the backup's keys, printed; a key
        /// revoked after the backup was taken is active again) or the path of a data dir
        /// whose keys to copy as they are now (the one being replaced).
        #[arg(long, default_value = "none")]
        keys_from: nrtxn::backup::KeysFrom,
    },
}

#[derive(Args, Debug)]
struct KeysArgs {
    #[command(subcommand)]
    command: KeysCommand,
}

#[derive(Subcommand, Debug)]
enum KeysCommand {
    /// Make a key and print its secret on stdout, alone on one line; the secret is not
    /// stored (only its SHA-256), so this is the only time it is shown.
    Create {
        /// The key's role: seller (transactions, holds, item reads), operator (a seller's
        /// routes plus loads and events) or admin (everything, every shop, /metrics).
        #[arg(long, value_parser = ["seller", "operator", "admin"])]
        role: String,
        /// The shop a seller or operator key is for (not for admin).
        #[arg(long)]
        shop: Option<String>,
        /// A name to tell keys apart [default: {shop}-{role}, or admin].
        #[arg(long)]
        name: Option<String>,
        #[command(flatten)]
        store: KeyStoreArgs,
    },
    /// List keys, one a line, tab-separated: id, name, shop (`*` for admin), role. Never
    /// prints a secret.
    List {
        /// Also list revoked keys, with a fifth column, `active` or `revoked`.
        #[arg(long)]
        all: bool,
        #[command(flatten)]
        store: KeyStoreArgs,
    },
    /// Revoke a key by its id: every server stops accepting it within 5 s.
    Revoke {
        /// The key's id (the first column of `keys list`).
        id: String,
        #[command(flatten)]
        store: KeyStoreArgs,
    },
}

/// Options of `nrtxn follow`.
#[derive(Args, Debug)]
struct FollowArgs {
    /// Base URL of an `nrtxn serve`.
    #[arg(long, default_value = "http://127.0.0.1:8080")]
    url: String,
    /// Shop of the item.
    #[arg(long)]
    shop: String,
    /// Item to follow. Required without `--kafka-brokers` (the events route serves one
    /// item at a time); with it, every item of the shop is followed when absent.
    #[arg(long)]
    item: Option<String>,
    /// Print the item's events after this seq (0: its whole history). To resume, pass
    /// the last seq printed. Needs `--item`.
    #[arg(long, default_value_t = 0, requires = "item")]
    after: u64,
    /// Read the events topic on these Kafka brokers (`host:port,...`), where the outbox
    /// relay of `nrtxn serve --kafka-brokers` publishes; gaps are filled from `--url`.
    #[arg(long)]
    kafka_brokers: Option<String>,
    /// The events topic.
    #[arg(long, default_value = "nrtxn.events", requires = "kafka_brokers")]
    kafka_events_topic: String,
    /// Wait between polls that found nothing new, in ms (1 to 60000; without
    /// `--kafka-brokers`).
    #[arg(long, default_value_t = 200, value_parser = clap::value_parser!(u64).range(1..=60_000))]
    poll_ms: u64,
    /// Stop after printing this many events [default: follow until interrupted].
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    max_events: Option<u64>,
    /// Bound on each HTTP request (connect and answer), in ms (1 to 600000).
    #[arg(long, default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(1..=600_000))]
    request_timeout_ms: u64,
    /// Access key for the server at `--url` (an operator key of the shop, or admin):
    /// prefer the environment variable to the flag, which the process list shows.
    #[arg(long, env = "NRTXN_API_KEY", hide_env_values = true)]
    api_key: Option<nrtxn_kafka::Secret>,
    /// PEM file of a CA to trust for an https `--url` besides the usual public ones (a
    /// self-signed server certificate).
    #[arg(long)]
    ca_cert: Option<std::path::PathBuf>,
    /// Kafka `security.protocol` of the events topic's reader (as for `serve`).
    #[arg(
        long,
        env = "NRTXN_KAFKA_SECURITY_PROTOCOL",
        requires = "kafka_brokers"
    )]
    kafka_security_protocol: Option<String>,
    /// Kafka SASL mechanism (as for `serve`).
    #[arg(long, env = "NRTXN_KAFKA_SASL_MECHANISM", requires = "kafka_brokers")]
    kafka_sasl_mechanism: Option<String>,
    /// Kafka SASL user name.
    #[arg(long, env = "NRTXN_KAFKA_SASL_USERNAME", requires = "kafka_brokers")]
    kafka_sasl_username: Option<String>,
    /// Kafka SASL password (prefer the environment variable).
    #[arg(long, env = "NRTXN_KAFKA_SASL_PASSWORD", hide_env_values = true)]
    kafka_sasl_password: Option<nrtxn_kafka::Secret>,
    /// PEM file of the CA of the Kafka brokers' certificates.
    #[arg(long, env = "NRTXN_KAFKA_SSL_CA", requires = "kafka_brokers")]
    kafka_ssl_ca: Option<std::path::PathBuf>,
}

impl FollowArgs {
    fn kafka_security(&self) -> anyhow::Result<nrtxn_kafka::KafkaSecurity> {
        let security = nrtxn_kafka::KafkaSecurity {
            protocol: self
                .kafka_security_protocol
                .as_ref()
                .map(|p| p.to_ascii_lowercase()),
            sasl_mechanism: self
                .kafka_sasl_mechanism
                .as_ref()
                .map(|m| m.to_ascii_uppercase()),
            sasl_username: self.kafka_sasl_username.clone(),
            sasl_password: self.kafka_sasl_password.clone(),
            ssl_ca: self.kafka_ssl_ca.clone(),
        };
        security
            .check()
            .map_err(|e| anyhow::anyhow!("--{}", e.replace('_', "-")))?;
        Ok(security)
    }

    /// The HTTP client of the events route: the access key on every request (marked
    /// sensitive, so reqwest never prints it), and the extra CA if any.
    fn http_client(&self) -> anyhow::Result<reqwest::Client> {
        let timeout = Duration::from_millis(self.request_timeout_ms);
        let mut builder = reqwest::Client::builder()
            .timeout(timeout)
            .connect_timeout(timeout);
        if let Some(key) = &self.api_key {
            let mut value =
                reqwest::header::HeaderValue::from_str(&format!("Bearer {}", key.expose()))
                    .map_err(|_| anyhow::anyhow!("--api-key: not a valid header value"))?;
            value.set_sensitive(true);
            let mut headers = reqwest::header::HeaderMap::new();
            headers.insert(reqwest::header::AUTHORIZATION, value);
            builder = builder.default_headers(headers);
        }
        if let Some(path) = &self.ca_cert {
            let pem = std::fs::read(path)
                .with_context(|| format!("--ca-cert: cannot read {}", path.display()))?;
            let cert = reqwest::Certificate::from_pem(&pem).with_context(|| {
                format!("--ca-cert: {} is not a PEM certificate", path.display())
            })?;
            builder = builder.add_root_certificate(cert);
        }
        builder.build().context("cannot build the HTTP client")
    }
}

/// Logs to stderr, at `RUST_LOG`'s levels (info without it), in `format`. Set once, by
/// the command: `serve` reads its format from its configuration (flag, environment or
/// file), the clients write text. Colours only on a terminal, and not with `NO_COLOR`
/// set: a log written to a file or a pipe carries no escape sequences.
fn init_logging(format: LogFormat) {
    use std::io::IsTerminal;
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let colour = std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none();
    let fmt = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(colour)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => fmt.init(),
        // The event's fields at the top level and the innermost span as `span`: a log
        // collector finds `span.request_key` on every line of a request. (The request
        // span is the only one nrtxn opens, so the list of all spans adds nothing.)
        LogFormat::Json => fmt
            .json()
            .flatten_event(true)
            .with_current_span(true)
            .with_span_list(false)
            .init(),
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if !matches!(cli.command, MainCommand::Server(_)) {
        init_logging(LogFormat::Text);
    }
    let result = match cli.command {
        MainCommand::Server(Command::Serve(args)) => serve(args),
        MainCommand::Follow(args) => tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .context("cannot start the runtime")
            .and_then(|rt| rt.block_on(follow(args))),
        MainCommand::Items { conn, command } => nrtxn_client::items(&conn, command),
        MainCommand::Txn { conn, command } => nrtxn_client::txn(&conn, command),
        MainCommand::Watch(args) => nrtxn_client::watch(args),
        MainCommand::Keys(args) => tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .context("cannot start the runtime")
            .and_then(|rt| rt.block_on(keys(args.command))),
        MainCommand::Backup { data_dir, to } => {
            nrtxn::backup::backup(&data_dir, &to).map(|r| {
                eprintln!(
                    "nrtxn: backup of {} in {}: {} log segments ({} bytes) checked, {} records past the views' position",
                    data_dir.display(),
                    to.display(),
                    r.segments,
                    r.bytes,
                    r.records
                );
            })
        }
        MainCommand::Restore {
            from,
            data_dir,
            keys_from,
        } => nrtxn::backup::restore(&from, &data_dir, &keys_from).map(|report| {
            for (id, name, shop, role) in &report.keys {
                eprintln!("nrtxn: restored key {id} ({name}, shop {shop}, {role})");
            }
            if report.keys_left_out > 0 {
                eprintln!(
                    "nrtxn: the backup's {} active keys were not restored (a key revoked since \
                     the backup must not come back); create keys with `nrtxn keys create`, \
                     or restore again with --keys-from backup or --keys-from OLD_DATA_DIR",
                    report.keys_left_out
                );
            }
            if report.checks {
                eprintln!("nrtxn: the shops' check-back settings were restored");
            }
            eprintln!(
                "nrtxn: {} restored into {}; start the server on it",
                from.display(),
                data_dir.display()
            );
        }),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("nrtxn: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn serve(args: ServeArgs) -> anyhow::Result<()> {
    let settings = args.resolve()?;
    init_logging(settings.log_format);
    actix_web::rt::System::new().block_on(nrtxn::server::run(settings))
}

/// `nrtxn keys`: stdout carries only what a script reads (the secret, the list); every
/// message goes to stderr.
async fn keys(command: KeysCommand) -> anyhow::Result<()> {
    // Only `create` makes a store; `list` and `revoke` need one that exists.
    let open = |store: &KeyStoreArgs, create: bool| {
        let store = store.clone();
        async move {
            let (data_dir, mongo_uri) = store.resolve()?;
            KeyStore::open_with(&data_dir, mongo_uri.as_deref(), create).await
        }
    };
    let mut out = std::io::stdout().lock();
    match command {
        KeysCommand::Create {
            role,
            shop,
            name,
            store,
        } => {
            let role = role.parse().map_err(|e| anyhow::anyhow!("--role: {e}"))?;
            let key = generate(name.as_deref(), shop.as_deref(), role)?;
            let store = open(&store, true).await?;
            store.insert(&key.record).await?;
            let k = &key.record.key;
            eprintln!(
                "nrtxn keys: created {} key {} ({}){}; its secret is on stdout and is not \
                 stored anywhere: keep it now",
                k.role,
                k.id,
                k.name,
                k.shop
                    .as_deref()
                    .map_or(" for every shop".to_string(), |s| format!(" for shop {s}"))
            );
            writeln!(out, "{}", key.secret).context("stdout")?;
        }
        KeysCommand::List { all, store } => {
            let store = open(&store, false).await?;
            for r in store.list(all).await? {
                let k = &r.key;
                let shop = k.shop.as_deref().unwrap_or("*");
                if all {
                    let state = if r.revoked_at.is_some() {
                        "revoked"
                    } else {
                        "active"
                    };
                    writeln!(out, "{}\t{}\t{shop}\t{}\t{state}", k.id, k.name, k.role)
                } else {
                    writeln!(out, "{}\t{}\t{shop}\t{}", k.id, k.name, k.role)
                }
                .context("stdout")?;
            }
        }
        KeysCommand::Revoke { id, store } => {
            let store = open(&store, false).await?;
            match store.revoke(&id, nrtxn_actors::now_ms()).await? {
                Revoked::Now => {
                    eprintln!("nrtxn keys: revoked {id}; running servers refuse it within 5 s")
                }
                Revoked::Already(_) => eprintln!("nrtxn keys: {id} was already revoked"),
                Revoked::Unknown => anyhow::bail!("keys revoke: no key with id {id}"),
            }
        }
    }
    out.flush().context("stdout")
}

/// `nrtxn follow`: polls the item's events route from the last seq printed and feeds each
/// page through a [`Follower`] (so duplicates and gaps are handled as they will be for a
/// topic), printing what it emits. Stops after `--max-events`, on SIGINT or SIGTERM (with
/// a summary on stderr either way), or on an error.
async fn follow(args: FollowArgs) -> anyhow::Result<()> {
    let backfill = HttpBackfill::with_client(args.http_client()?, &args.url).context("--url")?;
    // The poller reads the same route the follower fills gaps from; clones share a pool.
    let source = match &args.kafka_brokers {
        Some(brokers) => {
            let (shop, item) = (args.shop.clone(), args.item.clone());
            let security = args.kafka_security()?;
            let topic =
                EventsTopic::open_with(&security, brokers, &args.kafka_events_topic, move |e| {
                    *e.shop == *shop && item.as_deref().is_none_or(|i| *e.item == *i)
                })
                .with_context(|| {
                    format!("--kafka-brokers: cannot read {}", args.kafka_events_topic)
                })?;
            Source::Topic(topic)
        }
        None => match &args.item {
            Some(item) => Source::Route(backfill.clone(), item.clone()),
            None => anyhow::bail!(
                "--item: needed without --kafka-brokers (the events route serves one item at \
                 a time; the events topic serves a whole shop)"
            ),
        },
    };
    let mut follower = Follower::new(backfill);
    if let Some(item) = &args.item {
        follower.start_at(&args.shop, item, args.after)?;
    }
    let mut run = FollowRun {
        out: std::io::BufWriter::new(std::io::stdout()),
        buffered: 0,
        printed: 0,
        last_buffered: None,
        last_printed: None,
        events_max: args.max_events.unwrap_or(u64::MAX),
    };
    let stopped_by = tokio::select! {
        result = run.follow(&args, source, &mut follower) => result.map(|()| None),
        signal = nrtxn::stop_signal() => signal.map(Some),
    };
    // Whatever stopped it, what was read reaches stdout, and the summary says where to
    // resume: after the last event known to have been written.
    let flushed = run.flush();
    let stats = follower.stats();
    let resume = match &run.last_printed {
        Some((item, seq)) if args.item.is_some() => {
            format!(" (last seq {seq}; resume with --after {seq})")
        }
        Some((item, seq)) => format!(" (last: {item} seq {seq})"),
        None => String::new(),
    };
    eprintln!(
        "nrtxn follow: {} events printed{resume}, {} duplicates dropped, {} gaps filled with \
         {} events{}",
        run.printed,
        stats.duplicates_dropped,
        stats.gaps_filled,
        stats.events_filled,
        match stopped_by {
            Ok(Some(signal)) => format!(", stopped by {signal}"),
            _ => String::new(),
        }
    );
    stopped_by?;
    match flushed {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        other => other.context("stdout"),
    }
}

/// Where `follow` reads events: the events topic, or the events route of one item.
enum Source {
    Topic(EventsTopic),
    Route(HttpBackfill, String),
}

/// What `follow` has printed so far: kept outside the reading future, so it is still
/// there for the summary when a signal cancels that future.
struct FollowRun {
    /// Flushed after each page: a reader sees each page whole and as soon as it is read.
    out: std::io::BufWriter<std::io::Stdout>,
    /// Events in `out`'s buffer, not yet known to be written.
    buffered: u64,
    last_buffered: Option<(String, u64)>,
    /// Events written to stdout (a flush succeeded after them): what the summary counts
    /// and the resume point, so a failed write is printed again rather than skipped.
    printed: u64,
    last_printed: Option<(String, u64)>,
    events_max: u64,
}

/// Most events taken from the topic before stdout is flushed.
const TOPIC_PAGE_MAX: usize = 1_000;

impl FollowRun {
    async fn follow(
        &mut self,
        args: &FollowArgs,
        source: Source,
        follower: &mut Follower<HttpBackfill>,
    ) -> anyhow::Result<()> {
        match source {
            Source::Route(route, item) => self.poll(args, &route, &item, follower).await,
            Source::Topic(mut topic) => {
                while self.left() > 0 {
                    let Some(first) = topic.next().await else {
                        anyhow::bail!("the events topic's reader stopped");
                    };
                    let mut page = vec![first];
                    while page.len() < TOPIC_PAGE_MAX {
                        match topic.try_next() {
                            Some(e) => page.push(e),
                            None => break,
                        }
                    }
                    if !self.print(page, follower).await? {
                        return Ok(());
                    }
                }
                Ok(())
            }
        }
    }

    fn left(&self) -> u64 {
        self.events_max - self.printed - self.buffered
    }

    async fn poll(
        &mut self,
        args: &FollowArgs,
        source: &HttpBackfill,
        item: &str,
        follower: &mut Follower<HttpBackfill>,
    ) -> anyhow::Result<()> {
        while self.left() > 0 {
            let after_seq = follower.last_seq(&args.shop, item);
            // Never read more than is left to print.
            let limit = self.left().min(EVENTS_LIMIT_MAX as u64) as usize;
            let page = source
                .page(&args.shop, item, after_seq, limit)
                .await
                .with_context(|| {
                    format!(
                        "cannot read the events of {}/{item} from {} (is `nrtxn serve` running \
                         there?)",
                        args.shop, args.url
                    )
                })?;
            if page.is_empty() {
                tokio::time::sleep(Duration::from_millis(args.poll_ms)).await;
                continue;
            }
            if !self.print(page, follower).await? {
                return Ok(());
            }
        }
        Ok(())
    }

    /// Feeds `page` through the follower, prints what it emits (up to `--max-events`) and
    /// flushes. `false`: stdout's reader went away (`| head`), a normal end.
    async fn print(
        &mut self,
        page: Vec<nrtxn_actors::Event>,
        follower: &mut Follower<HttpBackfill>,
    ) -> anyhow::Result<bool> {
        for event in page {
            let pushed = follower
                .push(event, |e| {
                    if self.left() == 0 {
                        return Ok(());
                    }
                    serde_json::to_writer(&mut self.out, &e)?;
                    self.out.write_all(b"\n")?;
                    self.buffered += 1;
                    self.last_buffered = Some((e.item.to_string(), e.seq));
                    Ok::<(), std::io::Error>(())
                })
                .await;
            match pushed {
                Err(e) if is_broken_pipe(&e) => return Ok(false),
                other => other?,
            }
        }
        match self.flush() {
            Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(false),
            other => other.context("stdout").map(|()| true),
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.out.flush()?;
        self.printed += self.buffered;
        self.buffered = 0;
        self.last_printed.clone_from(&self.last_buffered);
        Ok(())
    }
}

fn is_broken_pipe(e: &FollowError) -> bool {
    // The emit callback's errors are `io::Error`s (serde_json's convert into them, kind
    // kept).
    matches!(e, FollowError::Emit { source }
        if source.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe))
}
