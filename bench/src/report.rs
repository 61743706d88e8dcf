//! `nrtxn-bench report`: gathers run results into `latest.json` and renders them as a
//! Markdown page and an SVG chart.
//!
//! The chart is written by hand rather than with a plotting crate: two panels of grouped
//! bars on log axes are a few hundred lines of SVG, and this way no font or native
//! library is needed (SVG text uses the viewer's fonts).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use clap::Args;
use serde::{Deserialize, Serialize};

use crate::run::RunResult;

#[derive(Args, Debug, Clone)]
pub struct ReportArgs {
    /// The results file: written from `--runs` when given, else read.
    #[arg(long)]
    pub results: PathBuf,
    /// A folder of run results (`nrtxn-bench run --json`), gathered into `--results`
    /// with this machine's description.
    #[arg(long)]
    pub runs: Option<PathBuf>,
    #[arg(long)]
    pub markdown: Option<PathBuf>,
    #[arg(long)]
    pub svg: Option<PathBuf>,
    /// A text file of the exact commands that produced the runs, quoted in the page.
    #[arg(long)]
    pub commands: Option<PathBuf>,
    /// How the results were taken (e.g. "scripts/bench.sh --quick"), for the page.
    #[arg(long)]
    pub invocation: Option<String>,
}

/// The machine the runs were taken on.
#[derive(Debug, Clone, Serialize, Deserialize, Default)]
pub struct Machine {
    pub cores: usize,
    pub cpu: String,
    pub mem_mb: u64,
    pub kernel: String,
    /// UTC date of the report, YYYY-MM-DD.
    pub date: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Results {
    pub machine: Machine,
    #[serde(default)]
    pub invocation: Option<String>,
    pub runs: Vec<RunResult>,
}

/// Systems and scenarios in the order a reader expects, whatever order runs came in.
const SYSTEM_ORDER: [&str; 4] = ["nrtxn", "redis-lua", "postgres-row", "ceiling"];
const SCENARIO_ORDER: [&str; 7] = [
    "hot",
    // Right after hot: issue 15 asks for orders/s beside hot's decisions/s.
    "orders",
    "hot-sales",
    "spread",
    "mixed",
    "fire-and-forget",
    "batch",
];
const COLORS: [&str; 6] = [
    "#1f77b4", "#d62728", "#2ca02c", "#7f7f7f", "#9467bd", "#ff7f0e",
];

fn rank(order: &[&str], name: &str) -> usize {
    order.iter().position(|n| *n == name).unwrap_or(order.len())
}

pub fn machine() -> Machine {
    let read = |p: &str| std::fs::read_to_string(p).unwrap_or_default();
    let cpu = read("/proc/cpuinfo")
        .lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split(':').nth(1))
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|| "unknown".into());
    let mem_mb = read("/proc/meminfo")
        .lines()
        .find(|l| l.starts_with("MemTotal:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|kb| kb.parse::<u64>().ok())
        .map(|kb| kb / 1024)
        .unwrap_or(0);
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    Machine {
        cores: std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(0),
        cpu,
        mem_mb,
        kernel: read("/proc/sys/kernel/osrelease").trim().to_string(),
        date: civil_date(secs.div_euclid(86_400)),
    }
}

/// Days since 1970-01-01 to `YYYY-MM-DD` (Howard Hinnant's civil_from_days).
fn civil_date(days: i64) -> String {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02}")
}

/// 26600 → "26.6k", 1234567 → "1.23M", 12.345 → "12.3".
pub fn compact(v: f64) -> String {
    let a = v.abs();
    if a >= 1e6 {
        format!("{:.2}M", v / 1e6)
    } else if a >= 1e4 {
        format!("{:.1}k", v / 1e3)
    } else if a >= 1e3 {
        format!("{:.2}k", v / 1e3)
    } else if a >= 100.0 {
        format!("{v:.0}")
    } else if a >= 10.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

fn thousands(v: u64) -> String {
    let s = v.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

fn sorted_runs(runs: &[RunResult]) -> Vec<&RunResult> {
    let mut v: Vec<&RunResult> = runs.iter().collect();
    v.sort_by_key(|r| {
        (
            rank(&SCENARIO_ORDER, &r.scenario),
            r.mode.clone(),
            rank(&SYSTEM_ORDER, &r.system),
        )
    });
    v
}

fn check_cell(r: &RunResult) -> String {
    let verdict = r
        .check
        .get("verdict")
        .and_then(|v| v.as_str())
        .unwrap_or("?");
    match verdict {
        "passed" => "passed".into(),
        "skipped" => "n/a (no state)".into(),
        other => format!("**{other}**"),
    }
}

fn run_label(r: &RunResult) -> String {
    let mut s = r.scenario.clone();
    if r.scenario == "spread" || r.scenario == "mixed" {
        write!(s, " ({})", r.distribution).ok();
    }
    if r.scenario == "orders" {
        write!(s, " ({}, 2 to 5 lines; orders/s)", r.distribution).ok();
    }
    if let Some(rate) = r.rate {
        write!(s, ", open loop {}/s", compact(rate)).ok();
    }
    s
}

/// The results as a Markdown page.
pub fn markdown(res: &Results, svg_link: Option<&str>, commands: Option<&str>) -> String {
    let mut md = String::new();
    let m = &res.machine;
    md.push_str("# Benchmarks\n\n");
    md.push_str(
        "nrtxn against what users would pick instead, on one machine in one run: every system behind \
         the same HTTP routes and JSON shapes (the peers are `nrtxn-bench peer`, actix-web like nrtxn), \
         driven by the same load generator (`nrtxn-bench run`), which shares the machine with them.\n\n",
    );
    let _ = writeln!(
        md,
        "Machine: {} cores ({}), {} MB memory, Linux {}; taken {}{}.\n",
        m.cores,
        m.cpu,
        thousands(m.mem_mb),
        m.kernel,
        m.date,
        res.invocation
            .as_deref()
            .map(|i| format!(" by `{i}`"))
            .unwrap_or_default()
    );
    md.push_str("## Durability of each system\n\n| system | durability |\n|---|---|\n");
    let mut systems: Vec<&str> = res.runs.iter().map(|r| r.system.as_str()).collect();
    systems.sort_by_key(|s| (rank(&SYSTEM_ORDER, s), s.to_string()));
    systems.dedup();
    for s in &systems {
        let d = res
            .runs
            .iter()
            .find(|r| r.system == *s && r.durability.is_some())
            .and_then(|r| r.durability.clone())
            .unwrap_or_else(|| "not stated".into());
        let _ = writeln!(md, "| {s} | {d} |");
    }
    md.push_str(
        "\n## Results\n\nThroughput is decisions per second: outcomes answered (respond=true), decided \
         (fire-and-forget, up to the last decision), or batch entries decided (batch); for orders it is \
         orders answered (held or refused) per second. Latency is per HTTP \
         call (a batch call carries all its entries); in an open-loop run it is measured from the intended \
         send time. `429` are refusals to decide (a full queue), errors are transport failures and 5xx. \
         Oversold is units sold beyond the stock, from the answers and from reading every item back; the \
         check also compares each item's stock with loaded − Σ ok decrements + Σ ok increments and \
         polls and resubmits a sample of keys. Peak RSS is the HTTP server process's (for the peers, not \
         Redis's or PostgreSQL's own). Entries/sync is nrtxn's journal entries per group commit \
         (one durable write each on the embedded journal) during the run.\n\n",
    );
    md.push_str(
        "| scenario | system | conns | throughput/s | p50 ms | p90 ms | p99 ms | p99.9 ms | ok | rejected | 429 | errors | oversold | check | peak RSS MB | entries/sync |\n",
    );
    md.push_str("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|\n");
    for r in sorted_runs(&res.runs) {
        let _ = writeln!(
            md,
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            run_label(r),
            r.system,
            r.connections,
            thousands(r.throughput_rps.max(0.0) as u64),
            compact(r.p50_ms),
            compact(r.p90_ms),
            compact(r.p99_ms),
            compact(r.p999_ms),
            thousands(r.ok),
            thousands(r.rejected),
            thousands(r.overloaded),
            thousands(r.errors),
            r.oversold
                .map(|o| o.to_string())
                .unwrap_or_else(|| "n/a".into()),
            check_cell(r),
            r.peak_rss_mb
                .map(|m| format!("{m:.0}"))
                .unwrap_or_else(|| "n/a".into()),
            r.entries_per_sync
                .map(|e| format!("{e:.1}"))
                .unwrap_or_else(|| "".into()),
        );
    }
    let orders = orders_lines(&res.runs);
    if !orders.is_empty() {
        md.push_str(
            "\n## Orders next to hot\n\nFrom the same run. An order is 2 to 5 distinct \
             lines of qty 1 (Zipf items), reserved all or none, then confirmed or cancelled (half \
             each); its p50 and p99 are per call (the placing and the ending). Hot is one \
             decision per call on one item.\n\n\
             | system | hot decisions/s | orders/s | lines/s | orders p50 ms | orders p99 ms | lines/s ÷ hot decisions/s |\n\
             |---|---:|---:|---:|---:|---:|---:|\n",
        );
        for line in orders {
            let _ = writeln!(md, "{line}");
        }
    }
    if let Some(link) = svg_link {
        let _ = writeln!(
            md,
            "\n![throughput and p99 per system and scenario]({link})\n"
        );
    }
    let targets = target_lines(&res.runs);
    if !targets.is_empty() {
        md.push_str("\n## Against the targets of the request path\n\n");
        for t in targets {
            let _ = writeln!(md, "- {t}");
        }
        md.push_str(
            "\nWhat bounds the missed targets (a profile of the server), the 10-minute \
             memory run and the steps taken: the manual's section \"Against the systems \
             users would pick instead\" (`src/performance.md`).\n",
        );
    }
    let noted: Vec<&RunResult> = sorted_runs(&res.runs)
        .into_iter()
        .filter(|r| !r.notes.is_empty())
        .collect();
    if !noted.is_empty() {
        md.push_str("\n## Notes from the runs\n\n");
        for r in noted {
            for n in &r.notes {
                let _ = writeln!(md, "- {} / {}: {n}", r.system, run_label(r));
            }
        }
    }
    if let Some(c) = commands {
        md.push_str("\n## Exact commands\n\n```sh\n");
        md.push_str(c.trim_end());
        md.push_str("\n```\n");
    }
    md
}

/// One table row per system that ran `orders` (closed loop), beside its own hot run.
fn orders_lines(runs: &[RunResult]) -> Vec<String> {
    let mut systems: Vec<&str> = runs
        .iter()
        .filter(|r| r.scenario == "orders" && r.mode == "closed")
        .map(|r| r.system.as_str())
        .collect();
    systems.sort_by_key(|s| (rank(&SYSTEM_ORDER, s), s.to_string()));
    systems.dedup();
    let mut out = Vec::new();
    for system in systems {
        let Some(o) = find(runs, system, "orders") else {
            continue;
        };
        let hot = find(runs, system, "hot").map(|h| h.throughput_rps);
        let lines = o.lines_per_s.unwrap_or(0.0);
        let cell = |v: Option<f64>| v.map_or("n/a".to_string(), |v| thousands(v.max(0.0) as u64));
        out.push(format!(
            "| {system} | {} | {} | {} | {} | {} | {} |",
            cell(hot),
            cell(Some(o.throughput_rps)),
            cell(o.lines_per_s),
            compact(o.p50_ms),
            compact(o.p99_ms),
            hot.filter(|h| *h > 0.0)
                .map_or("n/a".to_string(), |h| format!("{:.2}", lines / h)),
        ));
    }
    out
}

fn find<'a>(runs: &'a [RunResult], system: &str, scenario: &str) -> Option<&'a RunResult> {
    runs.iter().find(|r| {
        r.system == system
            && r.scenario == scenario
            && r.mode == "closed"
            // Of spread's two runs, the Zipf one: the skew a flash sale has.
            && (scenario != "spread" || r.distribution.starts_with("zipf"))
    })
}

/// Issue 13's targets, as measured ratios of one run: met or missed, and by how much.
/// Throughput ratios are nrtxn's over the peer's (higher is better), the p99 ratio
/// nrtxn's over redis-lua's (lower is better). The CPU and context-switch targets are
/// measured by `scripts/path-cost.sh`, not here.
fn target_lines(runs: &[RunResult]) -> Vec<String> {
    let mut out = Vec::new();
    let throughput = [
        ("hot", "redis-lua", 1.0),
        ("hot-sales", "redis-lua", 1.0),
        ("hot", "ceiling", 0.6),
        ("spread", "redis-lua", 1.0),
        ("mixed", "redis-lua", 1.0),
        ("fire-and-forget", "redis-lua", 1.0),
        ("batch", "redis-lua", 1.0),
        ("batch", "ceiling", 0.7),
    ];
    for (scenario, peer, want) in throughput {
        let (Some(n), Some(p)) = (find(runs, "nrtxn", scenario), find(runs, peer, scenario)) else {
            continue;
        };
        if p.throughput_rps <= 0.0 {
            continue;
        }
        let ratio = n.throughput_rps / p.throughput_rps;
        let verdict = if ratio >= want {
            "met".to_string()
        } else {
            format!("missed by {:.0}%", (1.0 - ratio / want) * 100.0)
        };
        out.push(format!(
            "{scenario} throughput, nrtxn / {peer}: {ratio:.2}× (target ≥ {want}×): {verdict}"
        ));
    }
    if let (Some(n), Some(r)) = (find(runs, "nrtxn", "hot"), find(runs, "redis-lua", "hot")) {
        if r.p99_ms > 0.0 {
            let ratio = n.p99_ms / r.p99_ms;
            let verdict = if ratio <= 1.5 {
                "met".to_string()
            } else {
                format!("missed: {ratio:.1}×")
            };
            out.push(format!(
                "hot p99, nrtxn {} ms / redis-lua {} ms: {ratio:.2}× (target ≤ 1.5×): {verdict}",
                compact(n.p99_ms),
                compact(r.p99_ms)
            ));
        }
    }
    out
}

/// A power of ten as an axis label: 1, 10, 100, 1k, 10k, 100k, 1M, ... (0.1 below 1).
fn tick_label(decade: i32) -> String {
    match decade {
        d if d < 0 => format!("{}", 10f64.powi(d)),
        d if d < 3 => format!("{}", 10i64.pow(d as u32)),
        d if d < 6 => format!("{}k", 10i64.pow(d as u32 - 3)),
        d => format!("{}M", 10f64.powi(d - 6)),
    }
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// Powers of ten spanning `[lo, hi]` (both > 0): the log axis's range and ticks.
fn decades(lo: f64, hi: f64) -> (i32, i32) {
    let a = lo.max(1e-3).log10().floor() as i32;
    let b = (hi.max(lo * 10.0)).log10().ceil() as i32;
    (a, b.max(a + 1))
}

/// One panel of grouped bars (scenarios × systems) on a log axis.
#[allow(clippy::too_many_arguments)]
fn panel(
    svg: &mut String,
    top: f64,
    height: f64,
    title: &str,
    groups: &[String],
    systems: &[String],
    value: &dyn Fn(&str, &str) -> Option<f64>,
    unit: &str,
) {
    let (left, width) = (70.0, 860.0);
    let values: Vec<f64> = groups
        .iter()
        .flat_map(|g| systems.iter().filter_map(move |s| value(g, s)))
        .filter(|v| *v > 0.0)
        .collect();
    let lo = values.iter().cloned().fold(f64::INFINITY, f64::min);
    let hi = values.iter().cloned().fold(0.0, f64::max);
    let (d0, d1) = if values.is_empty() {
        (0, 1)
    } else {
        decades(lo, hi)
    };
    let y = |v: f64| {
        let f = (v.max(10f64.powi(d0)).log10() - d0 as f64) / (d1 - d0) as f64;
        top + height - f * height
    };
    let _ = writeln!(
        svg,
        r#"<text x="{left}" y="{:.1}" font-size="14" font-weight="bold">{}</text>"#,
        top - 10.0,
        escape(title)
    );
    for d in d0..=d1 {
        let v = 10f64.powi(d);
        let yy = y(v);
        let _ = writeln!(
            svg,
            r##"<line x1="{left}" x2="{:.1}" y1="{yy:.1}" y2="{yy:.1}" stroke="#ddd"/><text x="{:.1}" y="{:.1}" font-size="10" text-anchor="end">{}{}</text>"##,
            left + width,
            left - 6.0,
            yy + 3.0,
            tick_label(d),
            escape(unit)
        );
    }
    let group_w = width / groups.len().max(1) as f64;
    let bar_w = group_w * 0.8 / systems.len().max(1) as f64;
    for (gi, g) in groups.iter().enumerate() {
        let gx = left + gi as f64 * group_w;
        for (si, s) in systems.iter().enumerate() {
            let Some(v) = value(g, s).filter(|v| *v > 0.0) else {
                continue;
            };
            let x = gx + group_w * 0.1 + si as f64 * bar_w;
            let yy = y(v);
            let _ = writeln!(
                svg,
                r#"<rect x="{x:.1}" y="{yy:.1}" width="{:.1}" height="{:.1}" fill="{}"><title>{} {}: {}</title></rect><text x="{:.1}" y="{:.1}" font-size="9" text-anchor="middle">{}</text>"#,
                bar_w * 0.9,
                (top + height - yy).max(0.0),
                COLORS[si % COLORS.len()],
                escape(s),
                escape(g),
                compact(v),
                x + bar_w * 0.45,
                yy - 3.0,
                compact(v)
            );
        }
        let _ = writeln!(
            svg,
            r#"<text x="{:.1}" y="{:.1}" font-size="11" text-anchor="middle">{}</text>"#,
            gx + group_w / 2.0,
            top + height + 16.0,
            escape(g)
        );
    }
    let _ = writeln!(
        svg,
        r##"<line x1="{left}" x2="{:.1}" y1="{:.1}" y2="{:.1}" stroke="#333"/>"##,
        left + width,
        top + height,
        top + height
    );
}

/// Throughput and p99 per system and scenario (closed-loop runs), as an SVG document.
pub fn svg(res: &Results) -> String {
    let closed: Vec<&RunResult> = res.runs.iter().filter(|r| r.mode == "closed").collect();
    // One group per scenario variant (`spread (zipf 1)` and `spread (uniform)` apart).
    let mut ranked: Vec<(usize, String)> = closed
        .iter()
        .map(|r| (rank(&SCENARIO_ORDER, &r.scenario), run_label(r)))
        .collect();
    ranked.sort();
    ranked.dedup();
    let groups: Vec<String> = ranked.into_iter().map(|(_, g)| g).collect();
    let mut systems: Vec<String> = closed.iter().map(|r| r.system.clone()).collect();
    systems.sort_by_key(|s| (rank(&SYSTEM_ORDER, s), s.clone()));
    systems.dedup();
    let by: BTreeMap<(String, String), &RunResult> = closed
        .iter()
        .map(|r| ((run_label(r), r.system.clone()), *r))
        .collect();
    let get = |g: &str, s: &str| by.get(&(g.to_string(), s.to_string())).copied();
    let mut svg = String::new();
    let _ = writeln!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="960" height="720" viewBox="0 0 960 720" font-family="sans-serif">"#
    );
    svg.push_str("<rect width=\"960\" height=\"720\" fill=\"white\"/>\n");
    for (i, s) in systems.iter().enumerate() {
        let x = 70.0 + i as f64 * 150.0;
        let _ = writeln!(
            svg,
            r#"<rect x="{x}" y="14" width="12" height="12" fill="{}"/><text x="{}" y="24" font-size="12">{}</text>"#,
            COLORS[i % COLORS.len()],
            x + 16.0,
            escape(s)
        );
    }
    panel(
        &mut svg,
        70.0,
        250.0,
        "Throughput, decisions/s (log scale)",
        &groups,
        &systems,
        &|g, s| get(g, s).map(|r| r.throughput_rps),
        "",
    );
    panel(
        &mut svg,
        400.0,
        250.0,
        "p99 latency, ms per HTTP call (log scale)",
        &groups,
        &systems,
        &|g, s| get(g, s).map(|r| r.p99_ms),
        "",
    );
    let _ = writeln!(
        svg,
        r#"<text x="70" y="705" font-size="10">{} cores, {}; {}</text>"#,
        res.machine.cores,
        escape(&res.machine.cpu),
        escape(&res.machine.date)
    );
    svg.push_str("</svg>\n");
    svg
}

fn link_from(md: &Path, svg: &Path) -> String {
    let same_dir =
        md.parent().map(|p| p.canonicalize().ok()) == svg.parent().map(|p| p.canonicalize().ok());
    if same_dir {
        svg.file_name()
            .map(|f| f.to_string_lossy().into_owned())
            .unwrap_or_default()
    } else {
        svg.to_string_lossy().into_owned()
    }
}

pub fn report(args: ReportArgs) -> anyhow::Result<()> {
    let results = match &args.runs {
        Some(dir) => {
            let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
                .with_context(|| format!("--runs: cannot read the folder {}", dir.display()))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "json"))
                .collect();
            files.sort();
            let mut runs = Vec::new();
            for f in files {
                let text = std::fs::read_to_string(&f)
                    .with_context(|| format!("--runs: cannot read {}", f.display()))?;
                let run: RunResult = serde_json::from_str(&text)
                    .with_context(|| format!("--runs: {} is not a run result", f.display()))?;
                runs.push(run);
            }
            if runs.is_empty() {
                bail!("--runs: no run results (*.json) in {}", dir.display());
            }
            let results = Results {
                machine: machine(),
                invocation: args.invocation.clone(),
                runs,
            };
            if let Some(parent) = args.results.parent().filter(|p| !p.as_os_str().is_empty()) {
                std::fs::create_dir_all(parent)?;
            }
            std::fs::write(
                &args.results,
                serde_json::to_string_pretty(&results)? + "\n",
            )
            .with_context(|| format!("--results: cannot write {}", args.results.display()))?;
            results
        }
        None => {
            let text = std::fs::read_to_string(&args.results)
                .with_context(|| format!("--results: cannot read {}", args.results.display()))?;
            serde_json::from_str(&text).with_context(|| {
                format!(
                    "--results: {} is not a results file",
                    args.results.display()
                )
            })?
        }
    };
    if let Some(path) = &args.svg {
        std::fs::write(path, svg(&results))
            .with_context(|| format!("--svg: cannot write {}", path.display()))?;
    }
    if let Some(path) = &args.markdown {
        let commands = match &args.commands {
            Some(c) => Some(
                std::fs::read_to_string(c)
                    .with_context(|| format!("--commands: cannot read {}", c.display()))?,
            ),
            None => None,
        };
        let link = args.svg.as_deref().map(|s| link_from(path, s));
        std::fs::write(
            path,
            markdown(&results, link.as_deref(), commands.as_deref()),
        )
        .with_context(|| format!("--markdown: cannot write {}", path.display()))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(system: &str, scenario: &str, rps: f64, p99: f64) -> RunResult {
        RunResult {
            system: system.into(),
            scenario: scenario.into(),
            mode: "closed".into(),
            connections: 64,
            rate: None,
            duration_s: 5.0,
            items: 1,
            distribution: "one item".into(),
            stock: 10,
            batch_size: None,
            throughput_rps: rps,
            lines_per_s: None,
            answered_rps: rps,
            p50_ms: 1.0,
            p90_ms: 2.0,
            p99_ms: p99,
            p999_ms: 9.0,
            max_ms: 10.0,
            mean_ms: 2.0,
            ok: 10,
            rejected: 12_345,
            overloaded: 0,
            errors: 0,
            dropped_by_client: 0,
            counts: BTreeMap::new(),
            oversold: Some(0),
            peak_rss_mb: Some(42.0),
            entries_per_sync: None,
            durability: Some("fsync <on>".into()),
            check: serde_json::json!({"verdict": "passed"}),
            notes: vec![],
        }
    }

    fn results(runs: Vec<RunResult>) -> Results {
        Results {
            machine: Machine {
                cores: 2,
                cpu: "cpu".into(),
                mem_mb: 24_000,
                kernel: "6.1".into(),
                date: "2026-11-23".into(),
            },
            invocation: Some("scripts/bench.sh --quick".into()),
            runs,
        }
    }

    #[test]
    fn markdown_table_has_one_row_per_run_in_reading_order() {
        let mut ceiling = run("ceiling", "hot", 40_000.0, 3.0);
        ceiling.oversold = None;
        ceiling.check = serde_json::json!({"verdict": "skipped"});
        let res = results(vec![
            ceiling,
            run("nrtxn", "batch", 310_000.0, 50.0),
            run("nrtxn", "hot", 30_000.0, 5.0),
        ]);
        let md = markdown(&res, Some("benchmarks.svg"), Some("nrtxn-bench run --x\n"));
        let rows: Vec<&str> = md
            .lines()
            .filter(|l| l.starts_with("| hot") || l.starts_with("| batch"))
            .collect();
        assert_eq!(rows.len(), 3);
        assert!(
            rows[0].starts_with("| hot | nrtxn | 64 | 30,000 |"),
            "{}",
            rows[0]
        );
        assert!(
            rows[1].contains("| ceiling |") && rows[1].contains("| n/a | n/a (no state) |"),
            "{}",
            rows[1]
        );
        assert!(rows[2].starts_with("| batch | nrtxn |"));
        assert!(md.contains("| 12,345 |"));
        assert!(md.contains("![throughput and p99 per system and scenario](benchmarks.svg)"));
        assert!(md.contains("```sh\nnrtxn-bench run --x\n```"));
        // 30,000 of the ceiling's 40,000 on hot: 0.75 against 0.6.
        assert!(md.contains("hot throughput, nrtxn / ceiling: 0.75× (target ≥ 0.6×): met"));
        assert!(!md.contains("batch throughput"), "no peer ran batch");
    }

    #[test]
    fn missed_targets_say_by_how_much() {
        let redis = run("redis-lua", "hot", 20_000.0, 4.0);
        let nrtxn = run("nrtxn", "hot", 10_000.0, 12.0);
        let md = markdown(&results(vec![nrtxn, redis]), None, None);
        assert!(
            md.contains("hot throughput, nrtxn / redis-lua: 0.50× (target ≥ 1×): missed by 50%"),
            "{md}"
        );
        assert!(
            md.contains(
                "hot p99, nrtxn 12.0 ms / redis-lua 4.00 ms: 3.00× (target ≤ 1.5×): missed: 3.0×"
            ),
            "{md}"
        );
    }

    #[test]
    fn orders_are_shown_beside_hot_of_the_same_system() {
        let mut orders = run("nrtxn", "orders", 5_000.0, 20.0);
        orders.distribution = "zipf 1".into();
        orders.lines_per_s = Some(17_500.0);
        let res = results(vec![
            run("nrtxn", "spread", 20_000.0, 9.0),
            orders,
            run("nrtxn", "hot", 25_000.0, 7.0),
        ]);
        let md = markdown(&res, None, None);
        assert!(md.contains("## Orders next to hot"), "{md}");
        assert!(
            md.contains("| nrtxn | 25,000 | 5,000 | 17,500 | 1.00 | 20.0 | 0.70 |"),
            "{md}"
        );
        let rows: Vec<&str> = md.lines().filter(|l| l.starts_with("| ")).collect();
        let at = |p: &str| rows.iter().position(|l| l.starts_with(p)).unwrap();
        assert_eq!(
            at("| orders (zipf 1, 2 to 5 lines; orders/s) | nrtxn |"),
            at("| hot | nrtxn |") + 1
        );
        assert!(at("| spread") > at("| orders (zipf 1"));
        // No orders run, no section.
        let md = markdown(&results(vec![run("nrtxn", "hot", 1.0, 1.0)]), None, None);
        assert!(!md.contains("Orders next to hot"));
    }

    #[test]
    fn failed_check_is_bold_in_the_table() {
        let mut r = run("nrtxn", "hot", 1.0, 1.0);
        r.check = serde_json::json!({"verdict": "failed"});
        assert!(markdown(&results(vec![r]), None, None).contains("| **failed** |"));
    }

    #[test]
    fn svg_has_a_bar_per_run_and_panel_and_escapes_text() {
        let res = results(vec![
            run("nrtxn", "hot", 30_000.0, 5.0),
            run("redis-lua", "hot", 20_000.0, 8.0),
            run("a<b", "spread", 1_000.0, 80.0),
        ]);
        let s = svg(&res);
        assert!(s.starts_with("<svg") && s.trim_end().ends_with("</svg>"));
        // 3 runs × 2 panels bars, plus the legend's 3 swatches and the background.
        assert_eq!(s.matches("<rect").count(), 3 * 2 + 3 + 1);
        assert!(s.contains("a&lt;b") && !s.contains("a<b"));
    }

    #[test]
    fn compact_numbers_read_well() {
        assert_eq!(compact(26_661.5), "26.7k");
        assert_eq!(compact(1_234_567.0), "1.23M");
        assert_eq!(compact(1_500.0), "1.50k");
        assert_eq!(compact(12.345), "12.3");
        assert_eq!(compact(0.5), "0.50");
        assert_eq!(thousands(1_234_567), "1,234,567");
        assert_eq!(thousands(12), "12");
    }

    #[test]
    fn log_axis_spans_whole_decades() {
        assert_eq!(decades(1_234.0, 310_000.0), (3, 6));
        assert_eq!(decades(5.0, 5.0), (0, 2));
        let labels: Vec<String> = (-1..=7).map(tick_label).collect();
        assert_eq!(
            labels,
            ["0.1", "1", "10", "100", "1k", "10k", "100k", "1M", "10M"]
        );
    }

    #[test]
    fn civil_dates_are_right() {
        assert_eq!(civil_date(0), "1970-01-01");
        assert_eq!(civil_date(20_415), "2025-11-23");
        assert_eq!(civil_date(11_016), "2000-02-29");
    }
}
