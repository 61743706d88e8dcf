//! The client commands of `nrtxn` that talk to a running server over HTTP: `items load`,
//! `items list`, `items get`, `txn submit`, `txn get` and `watch`. Every message an
//! operator may meet (server down, key refused, malformed CSV) says what went wrong and
//! what to do; stdout carries only what a script reads.

use std::fmt::Write as _;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{anyhow, bail, Context};
use clap::{Args, Subcommand};
use reqwest::{Method, StatusCode};
use serde_json::{json, Value};

/// Where the server is and which key to call it with: every client command takes these.
#[derive(Args, Debug, Clone)]
pub struct Conn {
    /// Base URL of an `nrtxn serve`.
    #[arg(
        long,
        global = true,
        env = "NRTXN_URL",
        default_value = "http://127.0.0.1:8080"
    )]
    pub url: String,
    /// The shop to work on (required).
    #[arg(long, global = true, env = "NRTXN_SHOP")]
    pub shop: Option<String>,
    /// Access key (a key of the shop with the role the command needs, or admin): prefer
    /// the environment variable to the flag, which the process list shows.
    #[arg(
        long = "key",
        id = "access_key",
        global = true,
        env = "NRTXN_KEY",
        hide_env_values = true
    )]
    pub access_key: Option<nrtxn_actors::Secret>,
    /// Bound on each HTTP request (connect and answer), in ms (1 to 600000); `watch`'s
    /// stream is bounded only while it connects.
    #[arg(long, global = true, default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(1..=600_000))]
    pub request_timeout_ms: u64,
}

#[derive(Subcommand, Debug)]
pub enum ItemsCommand {
    /// Load items from a CSV file (columns `item,stock`, optionally `per_buyer_max`, with
    /// a header line), in batches, with a progress bar on a terminal. Resumable: every
    /// batch carries a request id made of `--run`, its line range and its content, so
    /// running the same command again after an interruption (or after fixing refused
    /// lines) loads only what was not loaded; a batch already applied is answered from
    /// its record and changes nothing. Exits non-zero if any line was malformed or
    /// refused.
    Load {
        /// The CSV file.
        file: PathBuf,
        /// Lines per batch (one call each), 1 to 10000.
        #[arg(long, default_value_t = 1_000, value_parser = clap::value_parser!(u64).range(1..=10_000))]
        batch: u64,
        /// Name of this load, part of every batch's request id: the same run loaded
        /// again is a no-op; a new name loads the file again as a new load [default:
        /// the file's name].
        #[arg(long)]
        run: Option<String>,
    },
    /// Print the shop's items, one a line: item, stock, reserved, seq (tab-separated,
    /// after a header), in name order, every page.
    List {
        /// Start after this item.
        #[arg(long)]
        after: Option<String>,
        /// Print JSON lines (one item each) instead of the table.
        #[arg(long)]
        json: bool,
    },
    /// Print one item's state as JSON.
    Get {
        /// The item.
        item: String,
    },
}

#[derive(Subcommand, Debug)]
pub enum TxnCommand {
    /// Submit one transaction and print its outcome as JSON (exit 1 unless it is `ok`,
    /// or accepted with `--no-wait`).
    Submit {
        /// The item.
        #[arg(long)]
        item: String,
        /// How many units.
        #[arg(long)]
        qty: i64,
        /// decrement (a sale) or increment (a return).
        #[arg(long, default_value = "decrement", value_parser = ["decrement", "increment"])]
        op: String,
        /// The seller making it.
        #[arg(long, default_value = "cli")]
        seller: String,
        /// The buyer (needed on items with a per-buyer limit).
        #[arg(long)]
        buyer: Option<String>,
        /// With `--op increment`: the request key of the sale this returns (a seller
        /// key's increment must name one).
        #[arg(long)]
        return_of: Option<String>,
        /// The request's id (its key): give the same to retry safely [default: a new
        /// random one, printed in the outcome].
        #[arg(long)]
        request_id: Option<String>,
        /// Fire and forget: answered 202 once the request is durable; poll it with
        /// `txn get`.
        #[arg(long)]
        no_wait: bool,
    },
    /// Print a request's outcome by its key as JSON (exit 1 while it is pending).
    Get {
        /// The request key.
        key: String,
    },
}

/// What a call to the server came to: its status and its JSON body.
struct Answer {
    status: StatusCode,
    body: Value,
}

/// An HTTP client for one server and one shop.
pub struct Client {
    http: reqwest::Client,
    /// `conn.shop`, checked present.
    shop: String,
    conn: Conn,
}

impl Client {
    /// The client of `conn`, with `timeout` on each request (`None`: the streams').
    pub fn new(conn: &Conn, timeout: Option<Duration>) -> anyhow::Result<Client> {
        let connect = Duration::from_millis(conn.request_timeout_ms);
        let mut builder = reqwest::Client::builder().connect_timeout(connect);
        if let Some(t) = timeout {
            builder = builder.timeout(t);
        }
        if let Some(key) = &conn.access_key {
            let mut value =
                reqwest::header::HeaderValue::from_str(&format!("Bearer {}", key.expose()))
                    .map_err(|_| anyhow!("--key: not a valid header value"))?;
            value.set_sensitive(true);
            let mut headers = reqwest::header::HeaderMap::new();
            headers.insert(reqwest::header::AUTHORIZATION, value);
            builder = builder.default_headers(headers);
        }
        let Some(shop) = conn.shop.clone() else {
            bail!("--shop (or NRTXN_SHOP): which shop to work on");
        };
        Ok(Client {
            http: builder.build().context("cannot build the HTTP client")?,
            shop,
            conn: conn.clone(),
        })
    }

    /// `{url}/v1/shops/{shop}/{rest}`, the shop and every segment of `rest` escaped.
    fn url(&self, segments: &[&str]) -> String {
        let mut url = format!(
            "{}/v1/shops/{}",
            self.conn.url.trim_end_matches('/'),
            escape(&self.shop)
        );
        for s in segments {
            url.push('/');
            url.push_str(&escape(s));
        }
        url
    }

    /// Sends a request; a network failure or a refused key becomes an error that says
    /// what to do, any other answer is returned.
    async fn call(
        &self,
        method: Method,
        url: &str,
        body: Option<&Value>,
    ) -> anyhow::Result<Answer> {
        let mut req = self.http.request(method, url);
        if let Some(b) = body {
            req = req.json(b);
        }
        let res = req.send().await.map_err(|e| self.unreachable(e))?;
        let status = res.status();
        let text = res.text().await.map_err(|e| self.unreachable(e))?;
        let body = serde_json::from_str(&text).unwrap_or(Value::String(text));
        self.refused(status, &body)?;
        Ok(Answer { status, body })
    }

    /// The error for a request that got no answer.
    fn unreachable(&self, e: reqwest::Error) -> anyhow::Error {
        // The innermost cause says it best ("Connection refused (os error 111)").
        let mut inner: Option<&dyn std::error::Error> = std::error::Error::source(&e);
        while let Some(next) = inner.and_then(|i| i.source()) {
            inner = Some(next);
        }
        let cause = inner.map(|s| format!(" ({s})")).unwrap_or_default();
        if e.is_connect() {
            anyhow!(
                "cannot reach the server at {}{cause}: is `nrtxn serve` running there? \
                 (--url, NRTXN_URL)",
                self.conn.url
            )
        } else if e.is_timeout() {
            anyhow!(
                "the server at {} did not answer within {} ms (--request-timeout-ms)",
                self.conn.url,
                self.conn.request_timeout_ms
            )
        } else {
            anyhow!("calling the server at {}: {e}{cause}", self.conn.url)
        }
    }

    /// An error for a 401 or 403, saying what to do about it.
    fn refused(&self, status: StatusCode, body: &Value) -> anyhow::Result<()> {
        let detail = detail(body);
        match status {
            StatusCode::UNAUTHORIZED if self.conn.access_key.is_none() => {
                bail!("the server needs an access key ({detail}): pass one with --key or NRTXN_KEY")
            }
            StatusCode::UNAUTHORIZED => bail!(
                "the server refused the access key ({detail}): check --key or NRTXN_KEY \
                 (revoked, mistyped, or made for another store?)"
            ),
            StatusCode::FORBIDDEN => bail!(
                "the access key may not do this in shop {} ({detail})",
                self.shop
            ),
            _ => Ok(()),
        }
    }
}

/// The `detail` of an error body, or the body itself.
fn detail(body: &Value) -> String {
    match body.get("detail").and_then(Value::as_str) {
        Some(d) => d.to_string(),
        None => match body {
            Value::String(s) => s.clone(),
            other => other.to_string(),
        },
    }
}

/// Percent-encodes a path segment (everything but unreserved characters).
fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(b as char);
        } else {
            let _ = write!(out, "%{b:02X}");
        }
    }
    out
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the runtime")
}

fn print_json(v: &Value) -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    writeln!(out, "{v}").context("stdout")
}

/// `nrtxn items ...`.
pub fn items(conn: &Conn, command: ItemsCommand) -> anyhow::Result<()> {
    let client = Client::new(conn, Some(Duration::from_millis(conn.request_timeout_ms)))?;
    runtime()?.block_on(async move {
        match command {
            ItemsCommand::Load { file, batch, run } => {
                load_csv(&client, &file, batch as usize, run).await
            }
            ItemsCommand::List { after, json } => list(&client, after, json).await,
            ItemsCommand::Get { item } => {
                let a = client
                    .call(Method::GET, &client.url(&["items", &item]), None)
                    .await?;
                if a.status != StatusCode::OK {
                    bail!("items get {item}: {} {}", a.status, detail(&a.body));
                }
                print_json(&a.body)
            }
        }
    })
}

async fn list(client: &Client, mut after: Option<String>, as_json: bool) -> anyhow::Result<()> {
    let mut out = std::io::BufWriter::new(std::io::stdout().lock());
    let mut header = !as_json;
    loop {
        let mut url = format!("{}?limit=1000", client.url(&["items"]));
        if let Some(a) = &after {
            url.push_str("&after=");
            url.push_str(&escape(a));
        }
        let a = client.call(Method::GET, &url, None).await?;
        if a.status != StatusCode::OK {
            bail!("items list: {} {}", a.status, detail(&a.body));
        }
        if std::mem::take(&mut header) {
            writeln!(out, "item\tstock\treserved\tseq").context("stdout")?;
        }
        for it in a.body["items"].as_array().into_iter().flatten() {
            if as_json {
                writeln!(out, "{it}")
            } else {
                writeln!(
                    out,
                    "{}\t{}\t{}\t{}",
                    it["item"].as_str().unwrap_or_default(),
                    it["stock"],
                    it["reserved"],
                    it["seq"]
                )
            }
            .context("stdout")?;
        }
        match a.body["next"].as_str() {
            Some(next) => after = Some(next.to_string()),
            None => break,
        }
    }
    out.flush().context("stdout")
}

/// One data line of a load file.
#[derive(Debug, Clone, PartialEq)]
struct Line {
    /// 1-based line number in the file.
    number: usize,
    item: String,
    stock: i64,
    per_buyer_max: Option<i64>,
}

/// A load file's records, RFC 4180 (the `csv` crate): commas separate, a field in double
/// quotes may hold commas, doubled quotes (`""`) and line breaks; spaces around a field
/// are trimmed; blank lines are skipped. A record with another number of fields than the
/// header is read as it is and reported by [`parse_line`], not fatal to the file.
fn csv_reader<R: std::io::Read>(from: R) -> csv::Reader<R> {
    csv::ReaderBuilder::new()
        .has_headers(false)
        .flexible(true)
        .trim(csv::Trim::All)
        .from_reader(from)
}

/// The line (1-based) a record starts on, from its byte offset: the `csv` crate's own
/// line count skips blank lines and counts a record's line breaks inside quotes once.
/// Reads the file a second time alongside the records, forward only.
struct LineOf<R> {
    from: std::io::BufReader<R>,
    at: u64,
    line: usize,
}

impl<R: std::io::Read> LineOf<R> {
    fn new(from: R) -> Self {
        LineOf {
            from: std::io::BufReader::new(from),
            at: 0,
            line: 1,
        }
    }

    /// The line of the record the reader placed at `offset`, at or past the last one
    /// asked for. The reader places a record where the one before it ended, before its
    /// line break and any blank lines: those are skipped here too.
    fn line(&mut self, offset: u64) -> std::io::Result<usize> {
        use std::io::BufRead;
        assert!(offset >= self.at, "records are read forward");
        loop {
            let buf = self.from.fill_buf()?;
            let take = if self.at < offset {
                buf.len().min((offset - self.at) as usize)
            } else {
                buf.iter()
                    .take_while(|b| **b == b'\r' || **b == b'\n')
                    .count()
            };
            if take == 0 {
                return Ok(self.line);
            }
            self.line += buf[..take].iter().filter(|b| **b == b'\n').count();
            self.from.consume(take);
            self.at += take as u64;
        }
    }
}

/// One record's fields as text.
fn fields(record: &csv::ByteRecord) -> Result<Vec<String>, String> {
    record
        .iter()
        .enumerate()
        .map(|(i, f)| {
            String::from_utf8(f.to_vec()).map_err(|_| format!("field {} is not UTF-8", i + 1))
        })
        .collect()
}

/// Where each column is, from the header line.
struct Columns {
    item: usize,
    stock: usize,
    per_buyer_max: Option<usize>,
    count: usize,
}

fn columns(header: &[String]) -> Result<Columns, String> {
    let names: Vec<&str> = header
        .iter()
        .enumerate()
        .map(|(i, n)| {
            if i == 0 {
                n.trim_start_matches('\u{feff}')
            } else {
                n.as_str()
            }
        })
        .collect();
    let find = |n: &str| names.iter().position(|c| c.eq_ignore_ascii_case(n));
    let (Some(item), Some(stock)) = (find("item"), find("stock")) else {
        return Err(format!(
            "the header must name the columns item and stock (and optionally \
             per_buyer_max), found {names:?}"
        ));
    };
    if let Some(other) = names
        .iter()
        .find(|c| !["item", "stock", "per_buyer_max"].contains(&c.to_ascii_lowercase().as_str()))
    {
        return Err(format!(
            "unknown column {other:?} (item, stock, per_buyer_max)"
        ));
    }
    Ok(Columns {
        item,
        stock,
        per_buyer_max: find("per_buyer_max"),
        count: names.len(),
    })
}

fn parse_line(cols: &Columns, number: usize, fields: &[String]) -> Result<Line, String> {
    if fields.len() != cols.count {
        return Err(format!(
            "{} fields, the header has {}",
            fields.len(),
            cols.count
        ));
    }
    let item = fields[cols.item].clone();
    if item.is_empty() {
        return Err("item is empty".into());
    }
    let stock = fields[cols.stock]
        .parse::<i64>()
        .ok()
        .filter(|s| *s >= 0)
        .ok_or_else(|| format!("stock {:?} is not a whole number >= 0", fields[cols.stock]))?;
    let per_buyer_max = match cols.per_buyer_max.map(|i| fields[i].as_str()) {
        None | Some("") => None,
        Some(v) => Some(
            v.parse::<i64>()
                .ok()
                .filter(|n| *n >= 0)
                .ok_or_else(|| format!("per_buyer_max {v:?} is not a whole number >= 0"))?,
        ),
    };
    Ok(Line {
        number,
        item,
        stock,
        per_buyer_max,
    })
}

/// What a load came to, line by line.
#[derive(Default)]
struct LoadReport {
    loaded: usize,
    /// `(line, why)` of every line not loaded: malformed, or refused by the server.
    refused: Vec<(usize, String)>,
}

/// `items load`: reads the file once to check its header and count its records (the
/// progress bar's total), then streams it in batches of `batch` records, each batch's
/// request id made of its first and last record's lines and its content, so that fixing
/// one record changes only its batch's id.
async fn load_csv(
    client: &Client,
    file: &Path,
    batch: usize,
    run: Option<String>,
) -> anyhow::Result<()> {
    let cannot_read = cannot_read(file);
    let run = run.unwrap_or_else(|| {
        file.file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "load".into())
    });
    let (cols, total) = header_and_count(file)?;
    let bar = load_bar(total)?;
    let mut report = LoadReport::default();
    let mut records = open_csv(file)?.into_byte_records().skip(1);
    let mut line_of = LineOf::new(std::fs::File::open(file).with_context(cannot_read)?);
    loop {
        // One batch: the next `batch` records, malformed ones reported by line.
        let mut entries = Vec::with_capacity(batch);
        let (mut first, mut last, mut seen) = (0, 0, 0);
        for record in records.by_ref().take(batch) {
            let record = record.with_context(cannot_read)?;
            let at = record.position().map_or(0, |p| p.byte());
            let line = line_of.line(at).with_context(cannot_read)?;
            if seen == 0 {
                first = line;
            }
            (last, seen) = (line, seen + 1);
            if record.len() == 1 && record[0].is_empty() {
                // A line of spaces only.
                continue;
            }
            match fields(&record).and_then(|f| parse_line(&cols, line, &f)) {
                Ok(line) => entries.push(line),
                Err(why) => {
                    bar.suspend(|| eprintln!("{}:{line}: {why}", file.display()));
                    report.refused.push((line, why));
                }
            }
        }
        if seen == 0 {
            break;
        }
        // The batch's request id names its lines: every entry sent under it is one of them.
        assert!(
            entries.iter().all(|l| (first..=last).contains(&l.number)),
            "items load: a batch of lines {first}-{last} holds a line outside them"
        );
        load_batch(client, &run, first, last, entries, &mut report, &bar, file).await?;
        bar.inc(seen as u64);
    }
    bar.finish_and_clear();
    summarize_load(&report, file, total)
}

/// The context of an `items load` read error.
fn cannot_read(file: &Path) -> impl Fn() -> String + Copy + '_ {
    move || format!("items load: cannot read {}", file.display())
}

/// `file` opened as CSV, its header a record like the others.
fn open_csv(file: &Path) -> anyhow::Result<csv::Reader<std::fs::File>> {
    Ok(csv_reader(
        std::fs::File::open(file).with_context(cannot_read(file))?,
    ))
}

/// `items load`'s first pass: the header's columns and the number of records, without
/// keeping them.
fn header_and_count(file: &Path) -> anyhow::Result<(Columns, u64)> {
    let cannot_read = cannot_read(file);
    let mut records = open_csv(file)?.into_byte_records();
    let header = match records.next() {
        Some(h) => h.with_context(cannot_read)?,
        None => bail!(
            "items load: {} is empty (expected a header item,stock)",
            file.display()
        ),
    };
    let cols = fields(&header)
        .and_then(|h| columns(&h))
        .map_err(|e| anyhow!("{}:1: {e}", file.display()))?;
    let mut total = 0u64;
    for r in records {
        r.with_context(cannot_read)?;
        total += 1;
    }
    Ok((cols, total))
}

/// The progress bar of a load of `total` records.
fn load_bar(total: u64) -> anyhow::Result<indicatif::ProgressBar> {
    let bar = indicatif::ProgressBar::new(total);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{spinner} [{elapsed_precise}] {bar:40} {pos}/{len} records ({per_sec}, eta {eta}) {msg}",
        )
        .map_err(|e| anyhow!("progress bar: {e}"))?,
    );
    Ok(bar)
}

/// The last line of `items load`: what was loaded and refused; an error if any record
/// was refused.
fn summarize_load(report: &LoadReport, file: &Path, total: u64) -> anyhow::Result<()> {
    let refused = report.refused.len();
    eprintln!(
        "nrtxn items load: {} items loaded from {} ({} records), {refused} records refused{}",
        report.loaded,
        file.display(),
        total,
        if refused > 0 {
            "; fix them and run the same command again (records already loaded are not loaded twice)"
        } else {
            ""
        }
    );
    if refused > 0 {
        bail!(
            "items load: {refused} records of {} refused",
            file.display()
        );
    }
    Ok(())
}

/// Sends one batch (lines `first..=last`) with its request id; an entry the server
/// refuses (its `items[i]` named in a 400) is reported by line and the rest sent again
/// without it, under the new content's id.
#[allow(
    clippy::too_many_arguments,
    reason = "one call site, all of it the batch's"
)]
async fn load_batch(
    client: &Client,
    run: &str,
    first: usize,
    last: usize,
    mut entries: Vec<Line>,
    report: &mut LoadReport,
    bar: &indicatif::ProgressBar,
    file: &Path,
) -> anyhow::Result<()> {
    let url = client.url(&["items"]);
    while !entries.is_empty() {
        let mut digest = xxhash_rust::xxh3::Xxh3::new();
        let items: Vec<Value> = entries
            .iter()
            .map(|l| {
                digest.update(l.item.as_bytes());
                digest.update(&[0]);
                digest.update(&l.stock.to_le_bytes());
                digest.update(&l.per_buyer_max.unwrap_or(-1).to_le_bytes());
                let mut v = json!({ "item": l.item, "stock": l.stock });
                if let Some(m) = l.per_buyer_max {
                    v["per_buyer_max"] = json!(m);
                }
                v
            })
            .collect();
        // At most 128 bytes: the run's name cut to fit, then the batch's place and content.
        let tail = format!(":{first}-{last}:{:016x}", digest.digest());
        let mut head: String = run
            .chars()
            .filter(|c| !c.is_control() && *c != '/')
            .collect();
        while head.len() + tail.len() + 4 > nrtxn_actors::NAME_LEN_MAX {
            head.pop();
        }
        let id = format!("csv:{head}{tail}");
        let body = json!({ "items": items, "request_id": id });
        let a = client.call(Method::PUT, &url, Some(&body)).await?;
        match a.status {
            StatusCode::OK => {
                report.loaded += entries.len();
                return Ok(());
            }
            StatusCode::BAD_REQUEST | StatusCode::CONFLICT => {
                let why = detail(&a.body);
                let Some(i) = entry_index(&why).filter(|i| *i < entries.len()) else {
                    bail!(
                        "items load: the server refused lines {first}-{last} ({}): {why}",
                        a.status
                    );
                };
                let line = entries.remove(i);
                bar.suspend(|| eprintln!("{}:{}: refused: {why}", file.display(), line.number));
                report.refused.push((line.number, why));
            }
            status => bail!(
                "items load: lines {first}-{last} of {} not loaded: {status} {}; run the \
                 same command again to resume",
                file.display(),
                detail(&a.body)
            ),
        }
    }
    Ok(())
}

/// The `i` of an error detail `items[i]...`.
fn entry_index(detail: &str) -> Option<usize> {
    let rest = detail.split("items[").nth(1)?;
    rest.split(']').next()?.parse().ok()
}

/// `nrtxn txn ...`.
pub fn txn(conn: &Conn, command: TxnCommand) -> anyhow::Result<()> {
    let client = Client::new(conn, Some(Duration::from_millis(conn.request_timeout_ms)))?;
    runtime()?.block_on(async move {
        match command {
            TxnCommand::Submit {
                item,
                qty,
                op,
                seller,
                buyer,
                return_of,
                request_id,
                no_wait,
            } => {
                let request_id = match request_id {
                    Some(id) => id,
                    None => {
                        let mut bytes = [0u8; 8];
                        getrandom::fill(&mut bytes)
                            .map_err(|e| anyhow!("no random request id: {e}"))?;
                        format!("cli-{}", hex::encode(bytes))
                    }
                };
                let mut body = json!({
                    "seller": seller, "item": item, "qty": qty, "op": op,
                    "request_id": request_id, "respond": !no_wait,
                });
                if let Some(b) = buyer {
                    body["buyer"] = json!(b);
                }
                if let Some(sale) = return_of {
                    body["return_of"] = json!(sale);
                }
                let a = client
                    .call(Method::POST, &client.url(&["txns"]), Some(&body))
                    .await?;
                print_json(&a.body)?;
                match (a.status, a.body["status"].as_str()) {
                    (StatusCode::OK, Some("ok")) | (StatusCode::ACCEPTED, _) => Ok(()),
                    (StatusCode::OK, Some(s)) => bail!("txn submit: {s}"),
                    (status, _) => bail!("txn submit: {status} {}", detail(&a.body)),
                }
            }
            TxnCommand::Get { key } => {
                let a = client
                    .call(Method::GET, &client.url(&["txns", &key]), None)
                    .await?;
                match a.status {
                    StatusCode::OK => print_json(&a.body),
                    StatusCode::ACCEPTED => {
                        print_json(&a.body)?;
                        bail!("txn get {key}: still pending")
                    }
                    status => bail!("txn get {key}: {status} {}", detail(&a.body)),
                }
            }
        }
    })
}

/// Options of `nrtxn watch`.
#[derive(Args, Debug)]
pub struct WatchArgs {
    #[command(flatten)]
    pub conn: Conn,
    /// The item to watch.
    #[arg(long)]
    pub item: String,
    /// Stop after this many changes [default: until interrupted].
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    pub max_events: Option<u64>,
}

/// `nrtxn watch --item I`: the item's state now, then a line per change of it as the
/// shop's event stream brings it. A dropped stream (the server restarting, this client
/// too slow) is resumed from the last event's id, so no change is missed.
pub fn watch(args: WatchArgs) -> anyhow::Result<()> {
    let client = Client::new(&args.conn, None)?;
    let timed = Client::new(
        &args.conn,
        Some(Duration::from_millis(args.conn.request_timeout_ms)),
    )?;
    runtime()?.block_on(async move {
        let item = args.item.as_str();
        let mut out = std::io::stdout();
        let mut cursor: Option<String> = None;
        let mut printed = 0u64;
        let mut last_seq = 0u64;
        let max = args.max_events.unwrap_or(u64::MAX);
        let mut first = true;
        loop {
            let res = open_events(&client, &args.conn, cursor.as_deref()).await?;
            if first {
                // The state now, read once the stream is open: nothing is missed between.
                first = false;
                if let Some(seq) = print_item_now(&timed, item, &mut out).await? {
                    last_seq = seq;
                }
            }
            let mut stream = SseReader::new(res);
            while let Some(msg) = stream.next().await? {
                if let Some(id) = msg.id {
                    cursor = Some(id);
                }
                match msg.event.as_deref() {
                    Some("dropped") => {
                        eprintln!(
                            "nrtxn watch: the server dropped the stream ({}); resuming",
                            msg.data
                        );
                        break;
                    }
                    None | Some("message") => {}
                    Some(_) => continue,
                }
                let Ok(e) = serde_json::from_str::<Value>(&msg.data) else {
                    continue;
                };
                let seq = e["seq"].as_u64().unwrap_or(0);
                if e["item"] != item || seq <= last_seq {
                    continue;
                }
                last_seq = seq;
                print_change(&mut out, item, seq, &e)?;
                printed += 1;
                if printed >= max {
                    return Ok(());
                }
            }
            // The stream ended (the server stopped, or dropped a slow reader): resume.
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    })
}

/// The shop's event stream opened, from just after `cursor` (the last event's id).
async fn open_events(
    client: &Client,
    conn: &Conn,
    cursor: Option<&str>,
) -> anyhow::Result<reqwest::Response> {
    let mut req = client
        .http
        .get(client.url(&["events", "stream"]))
        .header(reqwest::header::ACCEPT, "text/event-stream");
    if let Some(c) = cursor {
        req = req.header("Last-Event-ID", c);
    }
    let connect = Duration::from_millis(conn.request_timeout_ms);
    let res = match tokio::time::timeout(connect, req.send()).await {
        Ok(r) => r.map_err(|e| client.unreachable(e))?,
        Err(_) => bail!(
            "the server at {} did not answer within {} ms (--request-timeout-ms)",
            conn.url,
            conn.request_timeout_ms
        ),
    };
    let status = res.status();
    if status != StatusCode::OK {
        let text = res.text().await.unwrap_or_default();
        let body = serde_json::from_str(&text).unwrap_or(Value::String(text));
        client.refused(status, &body)?;
        bail!("watch: {status} {}", detail(&body));
    }
    Ok(res)
}

/// Prints `item`'s state now; its seq, or `None` when it is not loaded yet.
async fn print_item_now(
    timed: &Client,
    item: &str,
    out: &mut impl Write,
) -> anyhow::Result<Option<u64>> {
    let a = timed
        .call(Method::GET, &timed.url(&["items", item]), None)
        .await?;
    let mut seq = None;
    match a.status {
        StatusCode::OK => {
            let last_seq = a.body["seq"].as_u64().unwrap_or(0);
            seq = Some(last_seq);
            writeln!(
                out,
                "{item}: stock {} reserved {} (seq {last_seq})",
                a.body["stock"], a.body["reserved"]
            )
        }
        StatusCode::NOT_FOUND => writeln!(out, "{item}: not loaded yet"),
        s => bail!("watch: reading {item}: {s} {}", detail(&a.body)),
    }
    .context("stdout")?;
    Ok(seq)
}

/// Prints change `e` (seq `seq`) of `item`, at once.
fn print_change(out: &mut impl Write, item: &str, seq: u64, e: &Value) -> anyhow::Result<()> {
    // A partial fill took less than it asked for: both are shown.
    let qty = match (e["qty_taken"].as_i64(), e["qty"].as_i64(), &e["status"]) {
        (Some(taken), Some(asked), status) if taken < asked && status == "ok" => {
            format!("{taken} of {asked}")
        }
        _ => e["qty"].to_string(),
    };
    writeln!(
        out,
        "{item}: stock {} reserved {} (seq {seq}: {} {qty} {})",
        e["stock_after"],
        e["reserved_after"],
        e["kind"].as_str().unwrap_or("?"),
        e["status"].as_str().unwrap_or("?"),
    )
    .context("stdout")?;
    out.flush().context("stdout")
}

/// One server-sent event.
#[derive(Debug, Default)]
pub struct SseMessage {
    pub id: Option<String>,
    pub event: Option<String>,
    pub data: String,
}

/// Reads server-sent events from a response, chunk by chunk; a line longer than
/// [`SSE_LINE_MAX`] is an error rather than a buffer without bound.
pub struct SseReader {
    res: reqwest::Response,
    buf: Vec<u8>,
}

/// Longest line of an event stream this reader takes (an event is about 300 bytes).
pub const SSE_LINE_MAX: usize = 1024 * 1024;

impl SseReader {
    pub fn new(res: reqwest::Response) -> SseReader {
        SseReader {
            res,
            buf: Vec::new(),
        }
    }

    /// The next event, `None` at the end of the stream.
    pub async fn next(&mut self) -> anyhow::Result<Option<SseMessage>> {
        let mut msg = SseMessage::default();
        let mut fields = 0;
        loop {
            let Some(line) = self.line().await? else {
                return Ok(None);
            };
            if line.is_empty() {
                if fields > 0 {
                    return Ok(Some(msg));
                }
                continue;
            }
            if line.starts_with(':') {
                continue; // a comment: keep-alive
            }
            let (name, value) = line.split_once(':').unwrap_or((line.as_str(), ""));
            let value = value.strip_prefix(' ').unwrap_or(value);
            fields += 1;
            match name {
                "id" => msg.id = Some(value.to_string()),
                "event" => msg.event = Some(value.to_string()),
                "data" => {
                    if !msg.data.is_empty() {
                        msg.data.push('\n');
                    }
                    msg.data.push_str(value);
                }
                _ => {}
            }
        }
    }

    async fn line(&mut self) -> anyhow::Result<Option<String>> {
        loop {
            if let Some(at) = self.buf.iter().position(|b| *b == b'\n') {
                let mut line: Vec<u8> = self.buf.drain(..=at).collect();
                line.pop();
                if line.last() == Some(&b'\r') {
                    line.pop();
                }
                return Ok(Some(String::from_utf8_lossy(&line).into_owned()));
            }
            if self.buf.len() > SSE_LINE_MAX {
                bail!("the event stream sent a line longer than {SSE_LINE_MAX} bytes");
            }
            match self.res.chunk().await.context("reading the event stream")? {
                Some(chunk) => self.buf.extend_from_slice(&chunk),
                None => return Ok(None),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every record of `text` as fields, with the line each starts on.
    fn records(text: &str) -> Vec<(usize, Vec<String>)> {
        let mut line_of = LineOf::new(text.as_bytes());
        csv_reader(text.as_bytes())
            .into_byte_records()
            .map(|r| {
                let r = r.unwrap();
                let line = line_of.line(r.position().unwrap().byte()).unwrap();
                (line, fields(&r).unwrap())
            })
            .collect()
    }

    #[test]
    fn csv_fields_split_on_commas_and_keep_quoted_ones_whole_across_lines() {
        assert_eq!(
            records("a,1,2"),
            [(1, vec!["a".into(), "1".into(), "2".into()])]
        );
        assert_eq!(records(" a , 1 "), [(1, vec!["a".into(), "1".into()])]);
        assert_eq!(
            records(r#""a, ""big"" one",3"#),
            [(1, vec![r#"a, "big" one"#.into(), "3".into()])]
        );
        assert_eq!(records("a,"), [(1, vec!["a".into(), "".into()])]);
        // A quoted field may span lines; the next record starts on the line after it,
        // and blank lines are skipped.
        assert_eq!(
            records("\"two\nlines\",1\r\n\nb,2\n"),
            [
                (1, vec!["two\nlines".into(), "1".into()]),
                (4, vec!["b".into(), "2".into()])
            ]
        );
        assert_eq!(records("a,1\r\n\r\nb,2")[1].0, 3);
        let bad = csv_reader(&b"\xff,1"[..])
            .into_byte_records()
            .next()
            .unwrap()
            .unwrap();
        assert_eq!(fields(&bad).unwrap_err(), "field 1 is not UTF-8");
    }

    #[test]
    fn a_line_with_a_bad_stock_or_the_wrong_field_count_is_malformed() {
        let cols = columns(&records("item,stock,per_buyer_max")[0].1).unwrap();
        let f = |t: &str| records(t).remove(0).1;
        assert_eq!(
            parse_line(&cols, 2, &f("sku,5,")).unwrap(),
            Line {
                number: 2,
                item: "sku".into(),
                stock: 5,
                per_buyer_max: None
            }
        );
        assert_eq!(
            parse_line(&cols, 3, &f("sku,5,2")).unwrap().per_buyer_max,
            Some(2)
        );
        assert!(parse_line(&cols, 4, &f("sku,-5,"))
            .unwrap_err()
            .contains("stock"));
        assert!(parse_line(&cols, 5, &f("sku,five,"))
            .unwrap_err()
            .contains("stock"));
        assert!(parse_line(&cols, 6, &f("sku,5"))
            .unwrap_err()
            .contains("fields"));
        assert!(parse_line(&cols, 7, &f(",5,"))
            .unwrap_err()
            .contains("item"));
        assert!(columns(&f("name,stock")).is_err());
        assert!(columns(&f("item,stock,colour")).is_err());
        assert!(columns(&f("\u{feff}item,stock")).is_ok());
        assert_eq!(
            entry_index("items[12].item: longer than 128 bytes"),
            Some(12)
        );
    }
}
