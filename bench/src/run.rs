//! `nrtxn-bench run`: load items, drive one scenario, check correctness, report.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context};
use bytes::Bytes;
use clap::{Args, ValueEnum};
use hyper::Method;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, Mutex};

use crate::check::{CheckReport, HoldFinal, ItemBooks, Observed};
use crate::client::{Answer, Conn, Failure, Target};
use crate::stats::{Counts, Latencies, Schedule, REJECTED_STATUSES};
use crate::zipf::{ItemDist, Rng};

/// Most items one load call carries: nrtxn's `PUT .../items` takes up to 10,000.
const LOAD_CHUNK: usize = 10_000;
/// Most entries of one batch call: nrtxn's batch route takes up to 1,000.
const BATCH_MAX: usize = 1_000;
/// Samples resubmitted to prove a repeat answers the recorded outcome; they are
/// sequential requests, so a few hundred at most keep the check short.
const RESUBMIT_MAX: usize = 200;
/// How long a hold made by the mixed scenario lives: far beyond the run, so that
/// only the confirm or cancel ends it and the books know its state.
const HOLD_TTL_MS: u64 = 600_000;
/// Answer kinds that are a successful decision.
const OK_KINDS: [&str; 4] = ["ok", "held", "confirmed", "released"];
/// Fewest and most lines of an order of the orders scenario: issue 15 asks for 2 to 5.
const ORDER_LINES_MIN: usize = 2;
const ORDER_LINES_MAX: usize = 5;
/// Statuses of an order refused as a whole: nothing of it is reserved once answered.
const ORDER_REFUSALS: [&str; 3] = ["insufficient_stock", "unknown_item", "buyer_limit"];

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Scenario {
    /// One item with stock S and many more decrements than S: the flash sale.
    Hot,
    /// One item with stock far beyond what a run can sell (default 10^9): every
    /// decision is a sale, so the whole path of a sale is measured, not the refusal's.
    HotSales,
    /// Decrements over `--items` items, Zipf (default) or uniform.
    Spread,
    /// Decrements with 10% increments and 10% holds, each hold then confirmed or
    /// cancelled (half each).
    Mixed,
    /// respond=false: each request answered 202 once durable, then polled until decided.
    FireAndForget,
    /// The batch route, `--batch-size` decrements per call.
    Batch,
    /// Orders of several lines (issue 15). One job is one order and its ending, two
    /// calls: `POST .../orders` of 2 to 5 lines (how many: uniform), each a distinct
    /// item drawn Zipf (or `--uniform`) over `--items` (a repeated draw is drawn again)
    /// with qty 1 and a TTL far beyond the run; then, if the order is held, `POST
    /// .../orders/{id}/confirm` or `/cancel` (half each). Both calls are timed, as
    /// mixed's hold and ending. Throughput is orders answered per second (held or
    /// refused: jobs/s); `lines_per_s` counts their lines.
    Orders,
}

impl Scenario {
    pub fn name(self) -> &'static str {
        match self {
            Scenario::Hot => "hot",
            Scenario::HotSales => "hot-sales",
            Scenario::Spread => "spread",
            Scenario::Mixed => "mixed",
            Scenario::FireAndForget => "fire-and-forget",
            Scenario::Batch => "batch",
            Scenario::Orders => "orders",
        }
    }
}

#[derive(Args, Debug, Clone)]
pub struct RunArgs {
    /// Base URL of the server under test (nrtxn or a peer), e.g. http://127.0.0.1:8080.
    #[arg(long)]
    pub target: String,
    /// Name recorded with the results: nrtxn, redis-lua, postgres-row, ceiling.
    #[arg(long)]
    pub system: String,
    #[arg(long, value_enum)]
    pub scenario: Scenario,
    /// Connections; in the closed loop each waits for its answer before the next request,
    /// in the open loop they bound the requests in flight.
    #[arg(long, default_value_t = 64)]
    pub connections: usize,
    /// Open loop at this many jobs per second (latency from the intended send time);
    /// closed loop when absent.
    #[arg(long)]
    pub rate: Option<f64>,
    /// Seconds of load.
    #[arg(long, default_value_t = 10.0)]
    pub duration: f64,
    /// Stock loaded per item; default 10,000 for `hot` (far below the decrements sent),
    /// 10^9 for `hot-sales` (far beyond them) and 1,000,000 for the others.
    #[arg(long)]
    pub stock: Option<i64>,
    /// Items of every scenario but `hot` and `hot-sales` (which have one).
    #[arg(long, default_value_t = 10_000)]
    pub items: usize,
    /// Zipf exponent of the item choice.
    #[arg(long, default_value_t = 1.0)]
    pub zipf: f64,
    /// Uniform item choice instead of Zipf.
    #[arg(long)]
    pub uniform: bool,
    /// Process whose peak resident memory (VmHWM) is reported.
    #[arg(long)]
    pub server_pid: Option<u32>,
    /// Also write the result to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Entries per call of the batch scenario (1 to 1,000).
    #[arg(long, default_value_t = 1_000)]
    pub batch_size: usize,
    /// The batch scenario's entries are fire-and-forget (`respond: false`: each call is
    /// answered once its entries are accepted), as a caller loading work in bulk sends
    /// them; the repeated-burst case of the fault campaign uses it.
    #[arg(long)]
    pub batch_fire_and_forget: bool,
    /// Open loop: jobs due but waiting for a free connection, at most; beyond it a job
    /// is counted as `dropped_by_client` instead of queued.
    #[arg(long, default_value_t = 10_000)]
    pub backlog: usize,
    /// Per-request timeout (ms); a request past it counts as `error_timeout`.
    #[arg(long, default_value_t = 10_000)]
    pub timeout_ms: u64,
    /// How long the polls after the run may take (s) before the rest stay unresolved.
    #[arg(long, default_value_t = 60)]
    pub poll_timeout_s: u64,
    /// Decided keys kept to poll (and partly resubmit) after the run.
    #[arg(long, default_value_t = 1_000)]
    pub sample_keys: usize,
    /// Keys tracked for polling (fire-and-forget's accepted keys and requests with an
    /// unknown outcome); beyond it they only widen the check's range.
    #[arg(long, default_value_t = 5_000_000)]
    pub keys_max: usize,
    /// Skip the correctness check (for `ceiling`, which keeps no state).
    #[arg(long)]
    pub no_check: bool,
    /// Shop to use; default a new one per run, so runs against one server never meet.
    #[arg(long)]
    pub shop: Option<String>,
    /// The server's durability settings, recorded with the result.
    #[arg(long)]
    pub durability: Option<String>,
}

impl RunArgs {
    fn validate(&self) -> anyhow::Result<()> {
        if self.connections == 0 || self.connections > 10_000 {
            bail!(
                "--connections: must be 1 to 10,000, got {}",
                self.connections
            );
        }
        if let Some(r) = self.rate {
            if !(r.is_finite() && r > 0.0 && r <= 10_000_000.0) {
                bail!("--rate: must be a positive number of jobs/s up to 10,000,000, got {r}");
            }
        }
        if !(self.duration.is_finite() && self.duration > 0.0 && self.duration <= 86_400.0) {
            bail!(
                "--duration: must be 0 to 86,400 seconds, got {}",
                self.duration
            );
        }
        if let Some(s) = self.stock {
            if !(0..=1_000_000_000_000_000).contains(&s) {
                bail!("--stock: must be 0 to 10^15 (nrtxn's bound), got {s}");
            }
        }
        if self.items == 0 || self.items > 1_000_000 {
            bail!("--items: must be 1 to 1,000,000, got {}", self.items);
        }
        if self.scenario == Scenario::Orders && self.items < ORDER_LINES_MAX {
            bail!(
                "--items: orders need at least {ORDER_LINES_MAX} items (that many distinct lines), got {}",
                self.items
            );
        }
        if self.batch_size == 0 || self.batch_size > BATCH_MAX {
            bail!(
                "--batch-size: must be 1 to {BATCH_MAX}, got {}",
                self.batch_size
            );
        }
        if self.backlog == 0 {
            bail!("--backlog: must be at least 1");
        }
        if self.timeout_ms == 0 {
            bail!("--timeout-ms: must be at least 1");
        }
        if self.system.is_empty() {
            bail!("--system: must not be empty");
        }
        if let Some(shop) = &self.shop {
            if shop.is_empty() || shop.len() > 128 || !shop.chars().all(url_safe) {
                bail!("--shop: 1 to 128 of [A-Za-z0-9._~-], got {shop:?}");
            }
        }
        Ok(())
    }
}

fn url_safe(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '-' | '.' | '_' | '~')
}

/// The result of one run: one line of JSON, and one entry of `latest.json`'s `runs`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RunResult {
    pub system: String,
    pub scenario: String,
    /// `closed` or `open`.
    pub mode: String,
    pub connections: usize,
    pub rate: Option<f64>,
    pub duration_s: f64,
    pub items: usize,
    pub distribution: String,
    pub stock: i64,
    pub batch_size: Option<usize>,
    /// Decisions per second: outcomes answered (respond=true), decided (fire-and-forget,
    /// until the last decision), batch entries decided (batch); orders answered (held or
    /// refused) per second for `orders`.
    pub throughput_rps: f64,
    /// `orders` only: lines of the orders answered, per second.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lines_per_s: Option<f64>,
    /// HTTP answers of any kind per second (429s and 202s included).
    pub answered_rps: f64,
    pub p50_ms: f64,
    pub p90_ms: f64,
    pub p99_ms: f64,
    pub p999_ms: f64,
    pub max_ms: f64,
    pub mean_ms: f64,
    pub ok: u64,
    pub rejected: u64,
    pub overloaded: u64,
    pub errors: u64,
    pub dropped_by_client: u64,
    pub counts: std::collections::BTreeMap<String, u64>,
    /// Units sold beyond what existed; null when the check was skipped.
    pub oversold: Option<i64>,
    pub peak_rss_mb: Option<f64>,
    /// nrtxn only: journal entries per group commit (one `fdatasync` each on the embedded
    /// journal) during the run, from the server's `/metrics`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub entries_per_sync: Option<f64>,
    pub durability: Option<String>,
    pub check: serde_json::Value,
    pub notes: Vec<String>,
}

/// What a request does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Op {
    Decrement,
    Increment,
    Hold,
}

impl Op {
    fn as_str(self) -> &'static str {
        match self {
            Op::Decrement => "decrement",
            Op::Increment => "increment",
            Op::Hold => "hold",
        }
    }
}

/// A request whose outcome is to be found by polling its key.
#[derive(Debug, Clone)]
struct Tracked {
    key: String,
    item: u32,
    op: Op,
    qty: i64,
}

/// An order of the orders scenario: its id and its lines' items, in the order sent
/// (each line qty 1), enough to send it again byte for byte.
#[derive(Debug, Clone)]
struct TrackedOrder {
    key: String,
    items: Vec<u32>,
}

/// A decided request kept for the key checks: its answer, to compare with a poll.
#[derive(Debug, Clone)]
struct Sample {
    tracked: Tracked,
    status: String,
}

/// What the run shares between workers.
struct Shared {
    scenario: Scenario,
    shop: String,
    tag: String,
    item_names: Vec<String>,
    dist: ItemDist,
    books: Vec<ItemBooks>,
    batch_size: usize,
    /// Batch entries with `respond: false`.
    batch_fire_and_forget: bool,
    /// The server answered 501 to a hold: it does not implement holds, and the mixed
    /// scenario then goes on with decrements and increments only.
    holds_unsupported: AtomicBool,
    /// HTTP answers so far, for the progress bar.
    answers: AtomicU64,
    keys_per_worker: usize,
    samples_per_worker: usize,
}

/// One worker's results, merged at the end so workers never share a lock.
#[derive(Default)]
struct WorkerOut {
    lat: Latencies,
    counts: Counts,
    accepted: Vec<Tracked>,
    unresolved: Vec<Tracked>,
    unresolved_holds: Vec<Tracked>,
    samples: Vec<Sample>,
    seen_samples: u64,
    /// Keys past `--keys-max`: not polled, they widen the check's range instead.
    untracked: u64,
    /// Orders whose placing or ending has no known answer: read back after the run.
    unresolved_orders: Vec<TrackedOrder>,
    /// A reservoir of orders with their last known status, for the key checks.
    order_samples: Vec<(TrackedOrder, String)>,
    seen_order_samples: u64,
    /// Orders answered held, and refused; the lines of both.
    orders_held: u64,
    orders_refused: u64,
    order_lines: u64,
}

#[derive(Deserialize)]
struct OutcomeBody {
    status: String,
    #[serde(default)]
    completed_at: Option<i64>,
}

#[derive(Deserialize)]
struct BatchBody {
    results: Vec<OutcomeBody>,
}

#[derive(Deserialize)]
struct ItemBody {
    stock: i64,
    #[serde(default)]
    reserved: i64,
}

/// How one answer to a transaction reads.
enum TxnAnswer {
    /// An outcome: `ok` or a refusal.
    Decided(String, Option<i64>),
    /// 202: durable, decided later.
    Accepted,
    /// The outcome is unknown: 504 pending, 5xx, transport failure, unreadable body.
    Unknown(String),
    /// Refused before deciding (429, 4xx): nothing was applied.
    Refused(String),
}

fn read_outcome(body: &[u8]) -> Option<OutcomeBody> {
    serde_json::from_slice(body).ok()
}

fn classify(res: &Result<Answer, Failure>) -> TxnAnswer {
    match res {
        Err(f) => TxnAnswer::Unknown(f.kind().to_string()),
        Ok(a) => match a.status {
            200 => match read_outcome(&a.body) {
                Some(o) if o.status == "pending" => TxnAnswer::Unknown("pending".into()),
                Some(o) if o.status == "accepted" => TxnAnswer::Accepted,
                Some(o) => TxnAnswer::Decided(o.status, o.completed_at),
                None => TxnAnswer::Unknown("error_body".into()),
            },
            202 => TxnAnswer::Accepted,
            429 => TxnAnswer::Refused("http_429".into()),
            s @ 400..=499 => TxnAnswer::Refused(format!("http_{s}")),
            s => TxnAnswer::Unknown(format!("http_{s}")),
        },
    }
}

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

/// An order's body: its lines in the order drawn, qty 1 each, no buyer.
fn order_json(item_names: &[String], order: &TrackedOrder) -> String {
    let mut body = format!(r#"{{"order_id":"{}","lines":["#, order.key);
    for (i, item) in order.items.iter().enumerate() {
        if i > 0 {
            body.push(',');
        }
        body.push_str(&format!(
            r#"{{"item":"{}","qty":1}}"#,
            item_names[*item as usize]
        ));
    }
    body.push_str(&format!(r#"],"ttl_ms":{HOLD_TTL_MS}}}"#));
    body
}

/// How an order's status reads for the books: `None` while it is still being reserved
/// (or for a status this client does not know). A refused order reserved nothing, which
/// the books count as a released line.
fn order_final(status: &str) -> Option<HoldFinal> {
    match status {
        "held" => Some(HoldFinal::Held),
        "confirmed" => Some(HoldFinal::Confirmed),
        "cancelled" | "expired" | "released" => Some(HoldFinal::Released),
        s if ORDER_REFUSALS.contains(&s) => Some(HoldFinal::Released),
        _ => None,
    }
}

fn txn_json(item: &str, op: Op, qty: i64, key: &str, respond: bool) -> String {
    format!(
        r#"{{"seller":"bench","item":"{item}","qty":{qty},"op":"{}","request_id":"{key}","respond":{respond}}}"#,
        op.as_str()
    )
}

struct Worker {
    id: usize,
    shared: Arc<Shared>,
    conn: Conn,
    rng: Rng,
    next_key: u64,
    out: WorkerOut,
}

impl Worker {
    fn key(&mut self) -> String {
        self.next_key += 1;
        format!("{}-{}-{}", self.shared.tag, self.id, self.next_key)
    }

    fn pick(&mut self) -> (Op, usize) {
        let s = &self.shared;
        match s.scenario {
            Scenario::Hot | Scenario::HotSales => (Op::Decrement, 0),
            Scenario::Mixed => {
                let item = s.dist.sample(&mut self.rng);
                let r = self.rng.next_f64();
                if r < 0.10 {
                    (Op::Increment, item)
                } else if r < 0.20 && !s.holds_unsupported.load(Ordering::Relaxed) {
                    (Op::Hold, item)
                } else {
                    (Op::Decrement, item)
                }
            }
            _ => (Op::Decrement, s.dist.sample(&mut self.rng)),
        }
    }

    fn track(&mut self, list: fn(&mut WorkerOut) -> &mut Vec<Tracked>, t: Tracked) {
        let cap = self.shared.keys_per_worker;
        let books = &self.shared.books[t.item as usize];
        let v = list(&mut self.out);
        if v.len() < cap {
            v.push(t);
        } else {
            self.out.untracked += 1;
            let field = if t.op == Op::Increment {
                &books.unresolved_up
            } else {
                &books.unresolved_down
            };
            field.fetch_add(t.qty, Ordering::Relaxed);
        }
    }

    fn sample(&mut self, t: Tracked, status: &str) {
        // Reservoir sampling: every decided key has the same chance to be checked.
        self.out.seen_samples += 1;
        let cap = self.shared.samples_per_worker;
        if self.out.samples.len() < cap {
            self.out.samples.push(Sample {
                tracked: t,
                status: status.to_string(),
            });
        } else {
            let j = self.rng.below(self.out.seen_samples) as usize;
            if j < cap {
                self.out.samples[j] = Sample {
                    tracked: t,
                    status: status.to_string(),
                };
            }
        }
    }

    async fn send(
        &mut self,
        method: Method,
        path: &str,
        body: Option<String>,
    ) -> Result<Answer, Failure> {
        let res = self.conn.send(method, path, body.map(Bytes::from)).await;
        self.shared.answers.fetch_add(1, Ordering::Relaxed);
        res
    }

    /// Confirms or cancels (half each) the hold or order `id` (`kind`: `holds` or
    /// `orders`), timed: the answer, and its outcome when it is one (200, or 409 for an
    /// ending already made).
    async fn end_at_random(
        &mut self,
        shop: &str,
        kind: &str,
        id: &str,
    ) -> (Result<Answer, Failure>, Option<OutcomeBody>) {
        let ending = if self.rng.chance(0.5) {
            "confirm"
        } else {
            "cancel"
        };
        let path = format!("/v1/shops/{shop}/{kind}/{id}/{ending}");
        let sent = Instant::now();
        let res = self.send(Method::POST, &path, None).await;
        self.out.lat.record_from_intended(sent, Instant::now());
        let outcome = match &res {
            Ok(a) if a.status == 200 || a.status == 409 => read_outcome(&a.body),
            _ => None,
        };
        (res, outcome)
    }

    /// Books one transaction's answer.
    fn book_txn(&mut self, t: Tracked, answer: TxnAnswer) {
        match answer {
            TxnAnswer::Decided(status, _) => {
                self.out.counts.add(&status, 1);
                if status == "ok" {
                    let b = &self.shared.books[t.item as usize];
                    match t.op {
                        Op::Increment => b.ok_increments.fetch_add(t.qty, Ordering::Relaxed),
                        _ => b.ok_decrements.fetch_add(t.qty, Ordering::Relaxed),
                    };
                }
                self.sample(t, &status);
            }
            TxnAnswer::Accepted => {
                self.out.counts.add("accepted", 1);
                self.track(|o| &mut o.accepted, t);
            }
            TxnAnswer::Unknown(kind) => {
                self.out.counts.add(&kind, 1);
                self.track(|o| &mut o.unresolved, t);
            }
            TxnAnswer::Refused(kind) => self.out.counts.add(&kind, 1),
        }
    }

    /// One job; the latency of its first call is measured from `start` (the send in the
    /// closed loop, the intended time in the open loop).
    async fn job(&mut self, start: Instant) {
        let shop = self.shared.shop.clone();
        match self.shared.scenario {
            Scenario::Batch => self.batch_job(&shop, start).await,
            Scenario::Orders => self.order_job(&shop, start).await,
            _ => {
                let (op, item) = self.pick();
                let key = self.key();
                let t = Tracked {
                    key,
                    item: item as u32,
                    op,
                    qty: 1,
                };
                if op == Op::Hold {
                    return self.hold_job(&shop, t, start).await;
                }
                let respond = self.shared.scenario != Scenario::FireAndForget;
                let body = txn_json(&self.shared.item_names[item], op, 1, &t.key, respond);
                let res = self
                    .send(Method::POST, &format!("/v1/shops/{shop}/txns"), Some(body))
                    .await;
                self.out.lat.record_from_intended(start, Instant::now());
                let answer = classify(&res);
                self.book_txn(t, answer);
            }
        }
    }

    async fn batch_job(&mut self, shop: &str, start: Instant) {
        let n = self.shared.batch_size;
        let mut entries = Vec::with_capacity(n);
        let mut body = String::with_capacity(n * 100 + 16);
        body.push_str(r#"{"txns":["#);
        for i in 0..n {
            let (op, item) = self.pick();
            let key = self.key();
            if i > 0 {
                body.push(',');
            }
            let respond = !self.shared.batch_fire_and_forget;
            body.push_str(&txn_json(
                &self.shared.item_names[item],
                op,
                1,
                &key,
                respond,
            ));
            entries.push(Tracked {
                key,
                item: item as u32,
                op,
                qty: 1,
            });
        }
        body.push_str("]}");
        let res = self
            .send(
                Method::POST,
                &format!("/v1/shops/{shop}/txns/batch"),
                Some(body),
            )
            .await;
        self.out.lat.record_from_intended(start, Instant::now());
        let parsed = match &res {
            Ok(a) if a.status == 200 => serde_json::from_slice::<BatchBody>(&a.body)
                .ok()
                .filter(|b| b.results.len() == entries.len()),
            _ => None,
        };
        match parsed {
            Some(b) => {
                for (t, o) in entries.into_iter().zip(b.results) {
                    let answer = match o.status.as_str() {
                        "pending" => TxnAnswer::Unknown("pending".into()),
                        "accepted" => TxnAnswer::Accepted,
                        _ => TxnAnswer::Decided(o.status, o.completed_at),
                    };
                    self.book_txn(t, answer);
                }
            }
            None => {
                // The whole call failed: every entry shares its fate.
                let answer = match &res {
                    Ok(a) if a.status == 200 => TxnAnswer::Unknown("error_body".into()),
                    _ => classify(&res),
                };
                for t in entries {
                    let a = match &answer {
                        TxnAnswer::Unknown(k) => TxnAnswer::Unknown(k.clone()),
                        TxnAnswer::Refused(k) => TxnAnswer::Refused(k.clone()),
                        TxnAnswer::Accepted => TxnAnswer::Accepted,
                        TxnAnswer::Decided(s, c) => TxnAnswer::Decided(s.clone(), *c),
                    };
                    self.book_txn(t, a);
                }
            }
        }
    }

    async fn hold_job(&mut self, shop: &str, t: Tracked, start: Instant) {
        let body = format!(
            r#"{{"item":"{}","qty":{},"ttl_ms":{HOLD_TTL_MS},"request_id":"{}"}}"#,
            self.shared.item_names[t.item as usize], t.qty, t.key
        );
        let res = self
            .send(Method::POST, &format!("/v1/shops/{shop}/holds"), Some(body))
            .await;
        self.out.lat.record_from_intended(start, Instant::now());
        let status = match &res {
            Ok(a) if a.status == 200 => read_outcome(&a.body).map(|o| o.status),
            Ok(a) if a.status == 501 => {
                self.shared.holds_unsupported.store(true, Ordering::Relaxed);
                self.out.counts.add("hold_http_501", 1);
                return;
            }
            Ok(a) if (400..500).contains(&a.status) => {
                self.out.counts.add(&format!("http_{}", a.status), 1);
                return;
            }
            _ => None,
        };
        match status.as_deref() {
            Some("held") => self.out.counts.add("held", 1),
            Some(refused) if REJECTED_STATUSES.contains(&refused) => {
                self.out.counts.add(refused, 1);
                return;
            }
            _ => {
                self.out.counts.add(&failure_kind(&res), 1);
                self.track(|o| &mut o.unresolved_holds, t);
                return;
            }
        }
        // Half the holds are confirmed (sold), half cancelled (stock returns).
        let (res, ended) = self.end_at_random(shop, "holds", &t.key).await;
        let end = ended.and_then(|o| hold_final(&o.status));
        match end {
            Some(end) => {
                self.out.counts.add(
                    match end {
                        HoldFinal::Confirmed => "confirmed",
                        HoldFinal::Released => "released",
                        HoldFinal::Held => "held_still",
                    },
                    1,
                );
                self.shared.books[t.item as usize].add_hold(end, t.qty);
            }
            None => {
                self.out.counts.add(&failure_kind(&res), 1);
                self.track(|o| &mut o.unresolved_holds, t);
            }
        }
    }
}

impl Worker {
    /// 2 to 5 distinct items, as [`Scenario::Orders`] says.
    fn order_items(&mut self) -> Vec<u32> {
        let span = (ORDER_LINES_MAX - ORDER_LINES_MIN + 1) as u64;
        let n = ORDER_LINES_MIN + self.rng.below(span) as usize;
        let mut items = Vec::with_capacity(n);
        // Ends: `--items` is at least ORDER_LINES_MAX (validated), and every item has a
        // non-zero chance.
        while items.len() < n {
            let i = self.shared.dist.sample(&mut self.rng) as u32;
            if !items.contains(&i) {
                items.push(i);
            }
        }
        items
    }

    fn track_order(&mut self, order: TrackedOrder) {
        if self.out.unresolved_orders.len() < self.shared.keys_per_worker {
            self.out.unresolved_orders.push(order);
        } else {
            self.out.untracked += 1;
            widen_order(&self.shared, &order);
        }
    }

    fn sample_order(&mut self, order: TrackedOrder, status: &str) {
        // Reservoir sampling, as `sample`.
        self.out.seen_order_samples += 1;
        let cap = self.shared.samples_per_worker;
        if self.out.order_samples.len() < cap {
            self.out.order_samples.push((order, status.to_string()));
        } else {
            let j = self.rng.below(self.out.seen_order_samples) as usize;
            if j < cap {
                self.out.order_samples[j] = (order, status.to_string());
            }
        }
    }

    async fn order_job(&mut self, shop: &str, start: Instant) {
        let order = TrackedOrder {
            key: self.key(),
            items: self.order_items(),
        };
        let lines = order.items.len() as u64;
        let body = order_json(&self.shared.item_names, &order);
        let res = self
            .send(
                Method::POST,
                &format!("/v1/shops/{shop}/orders"),
                Some(body),
            )
            .await;
        self.out.lat.record_from_intended(start, Instant::now());
        let status = match &res {
            Ok(a) if a.status == 200 => read_outcome(&a.body).map(|o| o.status),
            Ok(a) if (400..500).contains(&a.status) => {
                // Refused before anything was reserved (a 4xx decides nothing).
                self.out.counts.add(&format!("http_{}", a.status), 1);
                return;
            }
            _ => None,
        };
        match status.as_deref() {
            Some("held") => {
                self.out.counts.add("held", 1);
                self.out.orders_held += 1;
                self.out.order_lines += lines;
            }
            Some(refused) if ORDER_REFUSALS.contains(&refused) => {
                self.out.counts.add(refused, 1);
                self.out.orders_refused += 1;
                self.out.order_lines += lines;
                self.sample_order(order, refused);
                return;
            }
            _ => {
                // 504 (still being reserved), 5xx, transport failure: read back later.
                let kind = match (&res, status.as_deref()) {
                    (_, Some(s)) => format!("order_{s}"),
                    (Err(f), None) => f.kind().to_string(),
                    (Ok(a), None) => format!("http_{}", a.status),
                };
                self.out.counts.add(&kind, 1);
                self.track_order(order);
                return;
            }
        }
        // Half the orders are confirmed (every line sold), half cancelled.
        let (res, ended) = self.end_at_random(shop, "orders", &order.key).await;
        let ended = ended.and_then(|o| order_final(&o.status).map(|end| (end, o.status)));
        match ended {
            Some((end, status)) => {
                let kind = if end == HoldFinal::Held {
                    "held_still"
                } else {
                    status.as_str()
                };
                self.out.counts.add(kind, 1);
                for item in &order.items {
                    self.shared.books[*item as usize].add_hold(end, 1);
                }
                self.sample_order(order, &status);
            }
            None => {
                self.out.counts.add(&failure_kind(&res), 1);
                self.track_order(order);
            }
        }
    }
}

/// An order whose state stays unknown: each line may have been sold or held, or not
/// made; the allowed stock and reserved widen by one unit per line.
fn widen_order(shared: &Shared, order: &TrackedOrder) {
    for item in &order.items {
        let b = &shared.books[*item as usize];
        b.unresolved_down.fetch_add(1, Ordering::Relaxed);
        b.unresolved_reserved.fetch_add(1, Ordering::Relaxed);
    }
}

fn hold_final(status: &str) -> Option<HoldFinal> {
    match status {
        "held" => Some(HoldFinal::Held),
        "confirmed" => Some(HoldFinal::Confirmed),
        "released" | "expired" => Some(HoldFinal::Released),
        _ => None,
    }
}

fn peak_rss_mb(pid: u32) -> anyhow::Result<f64> {
    let path = format!("/proc/{pid}/status");
    let text = std::fs::read_to_string(&path)
        .with_context(|| format!("--server-pid: cannot read {path} (is process {pid} running?)"))?;
    let line = text
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .with_context(|| format!("--server-pid: {path} has no VmHWM line"))?;
    let kb: f64 = line
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .with_context(|| format!("--server-pid: cannot read the figure in {line:?}"))?;
    Ok(kb / 1024.0)
}

fn progress_bar(len: u64, template: &str) -> ProgressBar {
    let pb = ProgressBar::with_draw_target(Some(len), ProgressDrawTarget::stderr());
    if let Ok(style) = ProgressStyle::with_template(template) {
        pb.set_style(style.progress_chars("=> "));
    }
    pb
}

/// The server's journal entries and group commits so far (`nrtxn_journal_txn_entries`'s
/// sum and count on `/metrics`); `None` from a server without them (the peers).
async fn journal_groups(target: &Target, timeout: Duration) -> Option<(f64, f64)> {
    let answer = Conn::new(target.clone(), timeout)
        .send(Method::GET, "/metrics", None)
        .await
        .ok()
        .filter(|a| a.status == 200)?;
    let text = std::str::from_utf8(&answer.body).ok()?;
    let figure = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.trim().parse::<f64>().ok())
    };
    Some((
        figure("nrtxn_journal_txn_entries_sum ")?,
        figure("nrtxn_journal_txn_entries_count ")?,
    ))
}

/// Runs one scenario against `--target` and returns its result.
pub async fn run(args: RunArgs) -> anyhow::Result<RunResult> {
    args.validate()?;
    if let Some(pid) = args.server_pid {
        peak_rss_mb(pid)?;
    }
    let target = Target::parse(&args.target).await?;
    let timeout = Duration::from_millis(args.timeout_ms);
    let tag = format!("{:x}{:x}", now_ms(), std::process::id());
    let shop = args
        .shop
        .clone()
        .unwrap_or_else(|| format!("bench-{}-{tag}", args.scenario.name()));
    let one_item = matches!(args.scenario, Scenario::Hot | Scenario::HotSales);
    let (item_names, dist, distribution) = if one_item {
        (
            vec!["hot".to_string()],
            ItemDist::uniform(1).map_err(anyhow::Error::msg)?,
            "one item".to_string(),
        )
    } else {
        let names = (0..args.items).map(|i| format!("i{i}")).collect();
        if args.uniform {
            (
                names,
                ItemDist::uniform(args.items).map_err(anyhow::Error::msg)?,
                "uniform".to_string(),
            )
        } else {
            (
                names,
                ItemDist::zipf(args.items, args.zipf).map_err(anyhow::Error::msg)?,
                format!("zipf {}", args.zipf),
            )
        }
    };
    let stock = args.stock.unwrap_or(match args.scenario {
        Scenario::Hot => 10_000,
        Scenario::HotSales => 1_000_000_000,
        _ => 1_000_000,
    });
    let shared = Arc::new(Shared {
        scenario: args.scenario,
        shop: shop.clone(),
        tag,
        books: (0..item_names.len())
            .map(|_| ItemBooks::default())
            .collect(),
        item_names,
        dist,
        batch_size: args.batch_size,
        batch_fire_and_forget: args.batch_fire_and_forget,
        holds_unsupported: AtomicBool::new(false),
        answers: AtomicU64::new(0),
        keys_per_worker: (args.keys_max / args.connections).max(1),
        samples_per_worker: args.sample_keys.div_ceil(args.connections),
    });

    load_items(&shared, &target, timeout, stock).await?;

    let groups_before = journal_groups(&target, timeout).await;
    let (outs, elapsed, dropped, started_ms, ended_ms) =
        drive(&shared, &args, &target, timeout).await;
    let entries_per_sync = match (groups_before, journal_groups(&target, timeout).await) {
        (Some((e0, g0)), Some((e1, g1))) if g1 > g0 => {
            Some(((e1 - e0) / (g1 - g0) * 10.0).round() / 10.0)
        }
        _ => None,
    };
    let mut lat = Latencies::new();
    let mut counts = Counts::default();
    let mut accepted = Vec::new();
    let mut unresolved = Vec::new();
    let mut unresolved_holds = Vec::new();
    let mut samples = Vec::new();
    let mut untracked = 0;
    let mut unresolved_orders = Vec::new();
    let mut order_samples = Vec::new();
    let (mut orders_held, mut orders_refused, mut order_lines) = (0u64, 0u64, 0u64);
    for o in outs {
        unresolved_orders.extend(o.unresolved_orders);
        order_samples.extend(o.order_samples);
        orders_held += o.orders_held;
        orders_refused += o.orders_refused;
        order_lines += o.order_lines;
        lat.merge(&o.lat);
        counts.merge(&o.counts);
        accepted.extend(o.accepted);
        unresolved.extend(o.unresolved);
        unresolved_holds.extend(o.unresolved_holds);
        samples.extend(o.samples);
        untracked += o.untracked;
    }
    let answers = shared.answers.load(Ordering::Relaxed);
    let mut check = CheckReport::default();
    let mut notes = Vec::new();
    if shared.holds_unsupported.load(Ordering::Relaxed) {
        notes.push(
            "the server answered 501 to holds: mixed ran with decrements and increments only"
                .into(),
        );
    }
    if untracked > 0 {
        notes.push(format!(
            "{untracked} keys past --keys-max were not polled; they widen the check's range"
        ));
    }
    if dropped > 0 {
        notes.push(format!(
            "{dropped} jobs were due while --backlog was full: dropped by the client, not sent"
        ));
    }

    let poll_deadline = Instant::now() + Duration::from_secs(args.poll_timeout_s);
    let conns = args.connections.min(64);
    // Fire-and-forget: every accepted key is polled until decided.
    let mut decided_count = 0u64;
    let mut last_decided_ms = ended_ms;
    if !accepted.is_empty() {
        let polled = poll_keys(
            &shared,
            &target,
            timeout,
            conns,
            accepted,
            poll_deadline,
            "deciding",
        )
        .await;
        check.keys_polled += polled.decided.len() as u64;
        for (t, o) in polled.decided {
            decided_count += 1;
            if let Some(c) = o.completed_at {
                last_decided_ms = last_decided_ms.max(c);
            }
            counts.add(&o.status, 1);
            book_outcome(&shared, &t, &o.status);
        }
        for t in &polled.missing {
            check.key_mismatches += 1;
            check.note(format!(
                "key {} was accepted (202) but the server does not know it",
                t.key
            ));
        }
        counts.add("undecided", polled.pending.len() as u64);
        widen(&shared, &polled.pending);
        check.unresolved_requests += polled.pending.len() as u64;
    }
    // Requests without a known outcome: the poll tells whether they were applied.
    if !unresolved.is_empty() {
        let polled = poll_keys(
            &shared,
            &target,
            timeout,
            conns,
            unresolved,
            poll_deadline,
            "resolving",
        )
        .await;
        for (t, o) in polled.decided {
            book_outcome(&shared, &t, &o.status);
        }
        widen(&shared, &polled.pending);
        check.unresolved_requests += polled.pending.len() as u64;
    }
    let mut conn = Conn::new(target.clone(), timeout);
    for t in unresolved_holds {
        let res = conn
            .send(
                Method::GET,
                &format!("/v1/shops/{shop}/holds/{}", t.key),
                None,
            )
            .await;
        match &res {
            Ok(a) if a.status == 200 => {
                match read_outcome(&a.body).and_then(|o| hold_final(&o.status)) {
                    Some(end) => shared.books[t.item as usize].add_hold(end, t.qty),
                    None => widen_hold(&shared, &t),
                }
            }
            Ok(a) if a.status == 404 => {}
            _ => {
                widen_hold(&shared, &t);
                check.unresolved_requests += 1;
            }
        }
    }

    resolve_orders(
        &shared,
        &mut conn,
        unresolved_orders,
        poll_deadline,
        &mut check,
    )
    .await;

    if !args.no_check {
        key_checks(&shared, &mut conn, &samples, &mut check).await;
        order_checks(&shared, &mut conn, &order_samples, &mut check).await;
        read_back(&shared, &target, timeout, conns, &mut check).await?;
        check.unresolved_requests += untracked;
        check.finish();
    } else {
        check.verdict = "skipped".into();
    }

    let (ok, rejected) = if args.scenario == Scenario::Orders {
        // One decision per order: its placing (the ending is counted under its status
        // but is not a second order).
        (orders_held, orders_refused)
    } else {
        (
            OK_KINDS.iter().map(|k| counts.get(k)).sum(),
            REJECTED_STATUSES.iter().map(|k| counts.get(k)).sum(),
        )
    };
    let errors: u64 = counts
        .0
        .iter()
        .filter(|(k, _)| k.starts_with("error_") || k.starts_with("http_5"))
        .map(|(_, v)| *v)
        .sum();
    if args.scenario == Scenario::HotSales && rejected > 0 && !args.no_check {
        // The scenario measures the path of a sale: a refusal means the stock ran out,
        // and the figure is not what it claims to be.
        check.verdict = "failed".into();
        check.notes.push(format!(
            "hot-sales: {rejected} decisions were refusals; load more --stock"
        ));
    }
    let secs = elapsed.as_secs_f64().max(1e-9);
    let throughput_rps = if args.scenario == Scenario::FireAndForget {
        let span_ms = (last_decided_ms - started_ms).max(1) as f64;
        decided_count as f64 / (span_ms / 1000.0)
    } else {
        (ok + rejected) as f64 / secs
    };
    let peak_rss_mb = match args.server_pid {
        Some(pid) => Some(peak_rss_mb(pid)?),
        None => None,
    };
    let oversold = (!args.no_check).then_some(check.oversold_units);
    if check.verdict == "failed" {
        notes.push("the correctness check failed: see check.notes".into());
    }
    let r2 = |v: f64| (v * 100.0).round() / 100.0;
    Ok(RunResult {
        system: args.system.clone(),
        scenario: args.scenario.name().to_string(),
        mode: if args.rate.is_some() {
            "open"
        } else {
            "closed"
        }
        .to_string(),
        connections: args.connections,
        rate: args.rate,
        duration_s: r2(secs),
        items: shared.item_names.len(),
        distribution,
        stock,
        batch_size: (args.scenario == Scenario::Batch).then_some(args.batch_size),
        throughput_rps: throughput_rps.round(),
        lines_per_s: (args.scenario == Scenario::Orders)
            .then(|| (order_lines as f64 / secs).round()),
        answered_rps: (answers as f64 / secs).round(),
        p50_ms: r2(lat.quantile_ms(0.5)),
        p90_ms: r2(lat.quantile_ms(0.9)),
        p99_ms: r2(lat.quantile_ms(0.99)),
        p999_ms: r2(lat.quantile_ms(0.999)),
        max_ms: r2(lat.max_ms()),
        mean_ms: r2(lat.mean_ms()),
        ok,
        rejected,
        overloaded: counts.get("http_429"),
        errors,
        dropped_by_client: dropped,
        counts: counts.0,
        oversold,
        peak_rss_mb: peak_rss_mb.map(|m| (m * 10.0).round() / 10.0),
        entries_per_sync,
        durability: args.durability.clone(),
        check: serde_json::to_value(&check).unwrap_or(serde_json::Value::Null),
        notes,
    })
}

fn book_outcome(shared: &Shared, t: &Tracked, status: &str) {
    if status != "ok" {
        return;
    }
    let b = &shared.books[t.item as usize];
    match t.op {
        Op::Increment => b.ok_increments.fetch_add(t.qty, Ordering::Relaxed),
        _ => b.ok_decrements.fetch_add(t.qty, Ordering::Relaxed),
    };
}

/// Requests whose outcome stays unknown widen the allowed stock range by their quantity.
fn widen(shared: &Shared, ts: &[Tracked]) {
    for t in ts {
        let b = &shared.books[t.item as usize];
        match t.op {
            Op::Increment => b.unresolved_up.fetch_add(t.qty, Ordering::Relaxed),
            _ => b.unresolved_down.fetch_add(t.qty, Ordering::Relaxed),
        };
    }
}

/// A hold whose state stays unknown may have taken its quantity from the stock and
/// may still reserve it.
fn widen_hold(shared: &Shared, t: &Tracked) {
    widen(shared, std::slice::from_ref(t));
    shared.books[t.item as usize]
        .unresolved_reserved
        .fetch_add(t.qty, Ordering::Relaxed);
}

/// Reads back each order whose answer was lost (`GET .../orders/{id}`), again every
/// 50 ms while it is still being reserved, until `deadline`; books its lines by the
/// state found. A 404 is an order never recorded: nothing of it was reserved.
async fn resolve_orders(
    shared: &Shared,
    conn: &mut Conn,
    orders: Vec<TrackedOrder>,
    deadline: Instant,
    check: &mut CheckReport,
) {
    let shop = &shared.shop;
    for order in orders {
        let path = format!("/v1/shops/{shop}/orders/{}", order.key);
        let end = loop {
            let res = conn.send(Method::GET, &path, None).await;
            let found = match &res {
                Ok(a) if a.status == 200 => read_outcome(&a.body).map(|o| order_final(&o.status)),
                Ok(a) if a.status == 404 => Some(Some(HoldFinal::Released)),
                _ => None,
            };
            match found {
                Some(Some(end)) => break Some(end),
                // Still being reserved, or no answer: ask again while there is time.
                _ if Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(50)).await
                }
                _ => break None,
            }
        };
        match end {
            Some(end) => {
                for item in &order.items {
                    shared.books[*item as usize].add_hold(end, 1);
                }
            }
            None => {
                widen_order(shared, &order);
                check.unresolved_requests += 1;
            }
        }
    }
}

/// Each order has one state: a read of a sampled order answers the status the run last
/// got for it, and placing it again (the same body) answers the order as it stands,
/// moving nothing (the read-back after it proves that).
async fn order_checks(
    shared: &Shared,
    conn: &mut Conn,
    samples: &[(TrackedOrder, String)],
    check: &mut CheckReport,
) {
    let shop = &shared.shop;
    for (i, (order, status)) in samples.iter().enumerate() {
        let res = conn
            .send(
                Method::GET,
                &format!("/v1/shops/{shop}/orders/{}", order.key),
                None,
            )
            .await;
        check.keys_polled += 1;
        let polled = match &res {
            Ok(a) if a.status == 200 => read_outcome(&a.body).map(|o| o.status),
            _ => None,
        };
        if polled.as_deref() != Some(status.as_str()) {
            check.key_mismatches += 1;
            check.note(format!(
                "order {}: answered {status}, a read gives {}",
                order.key,
                describe(&res)
            ));
        }
        if i < RESUBMIT_MAX {
            let body = order_json(&shared.item_names, order);
            let res = conn
                .send(
                    Method::POST,
                    &format!("/v1/shops/{shop}/orders"),
                    Some(Bytes::from(body)),
                )
                .await;
            check.keys_resubmitted += 1;
            let again = match &res {
                Ok(a) if a.status == 200 => read_outcome(&a.body).map(|o| o.status),
                _ => None,
            };
            if again.as_deref() != Some(status.as_str()) {
                check.key_mismatches += 1;
                check.note(format!(
                    "order {}: answered {status}, placing it again gives {}",
                    order.key,
                    describe(&res)
                ));
            }
        }
    }
}

async fn load_items(
    shared: &Shared,
    target: &Target,
    timeout: Duration,
    stock: i64,
) -> anyhow::Result<()> {
    let mut conn = Conn::new(target.clone(), timeout.max(Duration::from_secs(60)));
    for (chunk_no, chunk) in shared.item_names.chunks(LOAD_CHUNK).enumerate() {
        let items: Vec<serde_json::Value> = chunk
            .iter()
            .map(|i| serde_json::json!({ "item": i, "stock": stock }))
            .collect();
        let body = serde_json::to_vec(&serde_json::json!({ "items": items }))?;
        let path = format!("/v1/shops/{}/items", shared.shop);
        let res = conn.send(Method::PUT, &path, Some(Bytes::from(body))).await;
        match res {
            Ok(a) if a.status == 200 => {}
            Ok(a) => bail!(
                "loading items into {}{path} (call {chunk_no}): HTTP {}: {}",
                target.authority,
                a.status,
                String::from_utf8_lossy(&a.body[..a.body.len().min(300)])
            ),
            Err(f) => bail!(
                "loading items into --target {} failed ({}): is the server running there?",
                target.authority,
                f.kind()
            ),
        }
    }
    for b in &shared.books {
        b.loaded.store(stock, Ordering::Relaxed);
    }
    Ok(())
}

type Drive = (Vec<WorkerOut>, Duration, u64, i64, i64);

/// Drives the scenario for `--duration`: closed loop (each connection sends when its
/// answer arrived) or open loop (a fixed arrival schedule; a bounded backlog).
async fn drive(shared: &Arc<Shared>, args: &RunArgs, target: &Target, timeout: Duration) -> Drive {
    let duration = Duration::from_secs_f64(args.duration);
    let pb = progress_bar(
        duration.as_millis() as u64,
        "{spinner} {prefix} [{bar:30}] {elapsed}/{duration} {msg}",
    );
    pb.set_prefix(format!("{} {}", args.system, args.scenario.name()));
    let start = Instant::now();
    let started_ms = now_ms();
    let deadline = start + duration;
    let dropped = Arc::new(AtomicU64::new(0));
    let ticker = {
        let pb = pb.clone();
        let shared = shared.clone();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_millis(250)).await;
                let el = start.elapsed();
                let n = shared.answers.load(Ordering::Relaxed);
                pb.set_position((el.as_millis() as u64).min(duration.as_millis() as u64));
                pb.set_message(format!("{n} answers, {:.0}/s", n as f64 / el.as_secs_f64()));
            }
        })
    };
    let mut handles = Vec::with_capacity(args.connections);
    let jobs = args.rate.map(|_| {
        let (tx, rx) = mpsc::channel::<Instant>(args.backlog);
        (tx, Arc::new(Mutex::new(rx)))
    });
    for id in 0..args.connections {
        let mut w = Worker {
            id,
            shared: shared.clone(),
            conn: Conn::new(target.clone(), timeout),
            rng: Rng::new(0x5EED ^ ((id as u64 + 1) << 20) ^ started_ms as u64),
            next_key: 0,
            out: WorkerOut::default(),
        };
        let rx = jobs.as_ref().map(|(_, rx)| rx.clone());
        handles.push(tokio::spawn(async move {
            match rx {
                None => {
                    while Instant::now() < deadline {
                        w.job(Instant::now()).await;
                    }
                }
                Some(rx) => loop {
                    // One worker waits on the queue at a time; the lock is held only
                    // for the receive, not for the request.
                    let intended = { rx.lock().await.recv().await };
                    match intended {
                        Some(at) => w.job(at).await,
                        None => break,
                    }
                },
            }
            w.out
        }));
    }
    if let (Some(rate), Some((tx, _))) = (args.rate, jobs) {
        let mut schedule = Schedule::new(start, rate);
        'outer: loop {
            let now = Instant::now();
            while let Some(at) = schedule.take_due(now) {
                if at >= deadline {
                    break 'outer;
                }
                if tx.try_send(at).is_err() {
                    dropped.fetch_add(1, Ordering::Relaxed);
                }
            }
            tokio::time::sleep_until(schedule.next_due().into()).await;
        }
        drop(tx);
    }
    let mut outs = Vec::with_capacity(handles.len());
    for h in handles {
        if let Ok(o) = h.await {
            outs.push(o);
        }
    }
    let elapsed = start.elapsed();
    ticker.abort();
    pb.finish_and_clear();
    (
        outs,
        elapsed,
        dropped.load(Ordering::Relaxed),
        started_ms,
        now_ms(),
    )
}

struct Polled {
    decided: Vec<(Tracked, OutcomeBody)>,
    /// 404: the server does not know the key.
    missing: Vec<Tracked>,
    /// Still pending (or unreachable) at the deadline.
    pending: Vec<Tracked>,
}

/// Polls `GET .../txns/{key}` for every key, over `conns` connections, until each is
/// decided or unknown, or the deadline passes.
async fn poll_keys(
    shared: &Arc<Shared>,
    target: &Target,
    timeout: Duration,
    conns: usize,
    keys: Vec<Tracked>,
    deadline: Instant,
    what: &str,
) -> Polled {
    let total = keys.len() as u64;
    let pb = progress_bar(
        total,
        "{spinner} {prefix} [{bar:30}] {pos}/{len} keys {elapsed}",
    );
    pb.set_prefix(what.to_string());
    let mut chunks: Vec<Vec<Tracked>> = (0..conns).map(|_| Vec::new()).collect();
    for (i, k) in keys.into_iter().enumerate() {
        chunks[i % conns].push(k);
    }
    let mut handles = Vec::new();
    for mut chunk in chunks {
        let mut conn = Conn::new(target.clone(), timeout);
        let shop = shared.shop.clone();
        let pb = pb.clone();
        handles.push(tokio::spawn(async move {
            let mut out = Polled {
                decided: Vec::new(),
                missing: Vec::new(),
                pending: Vec::new(),
            };
            while !chunk.is_empty() {
                let mut again = Vec::new();
                for t in chunk {
                    if Instant::now() >= deadline {
                        again.push(t);
                        continue;
                    }
                    let res = conn
                        .send(
                            Method::GET,
                            &format!("/v1/shops/{shop}/txns/{}", t.key),
                            None,
                        )
                        .await;
                    match res {
                        Ok(a) if a.status == 200 => match read_outcome(&a.body) {
                            Some(o) => {
                                pb.inc(1);
                                out.decided.push((t, o));
                            }
                            None => again.push(t),
                        },
                        Ok(a) if a.status == 404 => {
                            pb.inc(1);
                            out.missing.push(t);
                        }
                        _ => again.push(t),
                    }
                }
                if Instant::now() >= deadline {
                    out.pending = again;
                    break;
                }
                if !again.is_empty() {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                chunk = again;
            }
            out
        }));
    }
    let mut all = Polled {
        decided: Vec::new(),
        missing: Vec::new(),
        pending: Vec::new(),
    };
    for h in handles {
        if let Ok(p) = h.await {
            all.decided.extend(p.decided);
            all.missing.extend(p.missing);
            all.pending.extend(p.pending);
        }
    }
    pb.finish_and_clear();
    all
}

/// Each key has one outcome: a poll of a decided key answers what the run was told,
/// and a resubmission answers the recorded outcome (the read-back after it then proves
/// it moved nothing).
async fn key_checks(shared: &Shared, conn: &mut Conn, samples: &[Sample], check: &mut CheckReport) {
    let shop = &shared.shop;
    for (i, s) in samples.iter().enumerate() {
        let res = conn
            .send(
                Method::GET,
                &format!("/v1/shops/{shop}/txns/{}", s.tracked.key),
                None,
            )
            .await;
        check.keys_polled += 1;
        let polled = match &res {
            Ok(a) if a.status == 200 => read_outcome(&a.body).map(|o| o.status),
            _ => None,
        };
        if polled.as_deref() != Some(s.status.as_str()) {
            check.key_mismatches += 1;
            check.note(format!(
                "key {}: answered {}, poll gives {}",
                s.tracked.key,
                s.status,
                describe(&res)
            ));
        }
        if i < RESUBMIT_MAX {
            let t = &s.tracked;
            let body = txn_json(
                &shared.item_names[t.item as usize],
                t.op,
                t.qty,
                &t.key,
                true,
            );
            let res = conn
                .send(
                    Method::POST,
                    &format!("/v1/shops/{shop}/txns"),
                    Some(Bytes::from(body)),
                )
                .await;
            check.keys_resubmitted += 1;
            let again = match &res {
                Ok(a) if a.status == 200 => read_outcome(&a.body).map(|o| o.status),
                _ => None,
            };
            if again.as_deref() != Some(s.status.as_str()) {
                check.key_mismatches += 1;
                check.note(format!(
                    "key {}: answered {}, resubmission gives {}",
                    t.key,
                    s.status,
                    describe(&res)
                ));
            }
        }
    }
}

/// How a call that decided nothing failed: its transport failure, or `http_{status}`.
fn failure_kind(res: &Result<Answer, Failure>) -> String {
    match res {
        Err(f) => f.kind().to_string(),
        Ok(a) => format!("http_{}", a.status),
    }
}

fn describe(res: &Result<Answer, Failure>) -> String {
    match res {
        Ok(a) => format!(
            "HTTP {} {}",
            a.status,
            String::from_utf8_lossy(&a.body[..a.body.len().min(200)])
        ),
        Err(f) => f.kind().to_string(),
    }
}

/// Reads every item back and compares it with the books.
async fn read_back(
    shared: &Arc<Shared>,
    target: &Target,
    timeout: Duration,
    conns: usize,
    check: &mut CheckReport,
) -> anyhow::Result<()> {
    let n = shared.item_names.len();
    let conns = conns.min(n).max(1);
    let mut handles = Vec::new();
    for c in 0..conns {
        let shared = shared.clone();
        let mut conn = Conn::new(target.clone(), timeout);
        handles.push(tokio::spawn(async move {
            let mut seen = Vec::new();
            for i in (c..n).step_by(conns) {
                let path = format!("/v1/shops/{}/items/{}", shared.shop, shared.item_names[i]);
                let res = conn.send(Method::GET, &path, None).await;
                let item = match &res {
                    Ok(a) if a.status == 200 => serde_json::from_slice::<ItemBody>(&a.body).ok(),
                    _ => None,
                };
                seen.push((i, item.ok_or_else(|| describe(&res))));
            }
            seen
        }));
    }
    for h in handles {
        let seen = h.await.context("an item reader task failed")?;
        for (i, item) in seen {
            let name = &shared.item_names[i];
            match item {
                Ok(b) => check.add_item(
                    name,
                    &shared.books[i].tally(),
                    Observed {
                        stock: b.stock,
                        reserved: b.reserved,
                    },
                ),
                Err(why) => {
                    check.stock_mismatches += 1;
                    check.note(format!("{name}: cannot read it back: {why}"));
                }
            }
        }
    }
    Ok(())
}
