//! `flash-open` (issue 29): the opening of a flash sale on nrtxn's sale windows. A few
//! items are loaded with `opens_at` a few seconds ahead; callers hammer them with sales
//! from before the opening until after it. Reported: the refusals before the opening
//! (`not_open`) and their p99, the time from `opens_at` to the first sale and to the
//! last item sold out (by the server's decision times), and the p99 of the sales
//! answered in the first second. Checked: no sale decided before `opens_at`, none past
//! an item's stock. nrtxn only: the peers have no windows.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use bytes::Bytes;
use clap::Args;
use hyper::Method;
use serde::Serialize;

use crate::client::{Conn, Target};
use crate::stats::Latencies;

#[derive(Args, Debug)]
pub struct FlashOpenArgs {
    /// The nrtxn server, `http://HOST:PORT`.
    #[arg(long)]
    target: String,
    /// Closed-loop callers (keep-alive connections), each selling one unit at a time.
    #[arg(long, default_value_t = 64)]
    connections: usize,
    /// Items on sale, the callers spread over them.
    #[arg(long, default_value_t = 3)]
    items: usize,
    /// Stock of each item.
    #[arg(long, default_value_t = 20_000)]
    stock: i64,
    /// The sale opens this long after the load.
    #[arg(long, default_value_t = 3_000)]
    opens_in_ms: i64,
    /// The callers stop this long after the opening.
    #[arg(long, default_value_t = 5)]
    after_s: u64,
    #[arg(long, default_value_t = 10_000)]
    timeout_ms: u64,
    /// Writes the result (one JSON line) here too.
    #[arg(long)]
    json: Option<std::path::PathBuf>,
    /// Writes the result as a Markdown section here.
    #[arg(long)]
    markdown: Option<std::path::PathBuf>,
}

/// What the opening came to.
#[derive(Serialize, Debug)]
pub struct FlashOpenResult {
    pub items: usize,
    pub stock_per_item: i64,
    pub connections: usize,
    pub opens_in_ms: i64,
    /// How long the callers went on after the opening.
    pub after_s: u64,
    /// `not_open` answers, and the p99 of their latency.
    pub refused_before: u64,
    pub refused_before_p99_ms: f64,
    /// From `opens_at` to the first sale's decision, and to the last item's last unit.
    pub first_sale_after_ms: Option<i64>,
    pub sold_out_after_ms: Option<i64>,
    /// Sales decided in the first second after `opens_at`, and the p99 of their latency.
    pub sales_first_second: u64,
    pub sales_first_second_p99_ms: f64,
    pub sales: u64,
    pub sold_out_refusals: u64,
    pub other_answers: u64,
    /// Sales decided before `opens_at` or past an item's stock: must be 0.
    pub violations: u64,
}

/// One answer: its status, decision time (server's ms) and item, and its latency.
struct Seen {
    status: String,
    completed_at: i64,
    item: usize,
    latency: Duration,
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

pub async fn flash_open(args: FlashOpenArgs) -> anyhow::Result<()> {
    if args.items == 0 || args.connections == 0 || args.stock < 1 {
        bail!("--items, --connections and --stock must be at least 1");
    }
    let target = Target::parse(&args.target).await?;
    let timeout = Duration::from_millis(args.timeout_ms);
    let shop = format!("flash-open-{}", now_ms());
    let opens_at = now_ms() + args.opens_in_ms;
    let items: Vec<serde_json::Value> = (0..args.items)
        .map(|i| serde_json::json!({"item": format!("drop-{i}"), "stock": args.stock, "opens_at": opens_at}))
        .collect();
    let mut conn = Conn::new(target.clone(), timeout);
    let body = serde_json::to_vec(&serde_json::json!({ "items": items }))?;
    let loaded = conn
        .send(
            Method::PUT,
            &format!("/v1/shops/{shop}/items"),
            Some(Bytes::from(body)),
        )
        .await
        .map_err(|f| anyhow::anyhow!("the load failed: {}", f.kind()))?;
    if loaded.status != 200 {
        bail!(
            "the load answered {}: {}",
            loaded.status,
            String::from_utf8_lossy(&loaded.body)
        );
    }
    let stop_at = opens_at + args.after_s as i64 * 1000;
    let shop = Arc::new(shop);
    let mut tasks = Vec::with_capacity(args.connections);
    for c in 0..args.connections {
        let (target, shop) = (target.clone(), shop.clone());
        let item = c % args.items;
        tasks.push(tokio::spawn(async move {
            let mut conn = Conn::new(target, timeout);
            let path = format!("/v1/shops/{shop}/txns");
            let mut seen = Vec::new();
            let mut n = 0u64;
            while now_ms() < stop_at {
                n += 1;
                let body = format!(
                    r#"{{"seller":"c{c}","item":"drop-{item}","qty":1,"request_id":"c{c}-{n}"}}"#
                );
                let t0 = Instant::now();
                let answer = conn
                    .send(Method::POST, &path, Some(Bytes::from(body)))
                    .await;
                let latency = t0.elapsed();
                let (status, completed_at) = match answer {
                    Ok(a) if a.status == 200 => {
                        let v: serde_json::Value =
                            serde_json::from_slice(&a.body).unwrap_or_default();
                        (
                            v["status"].as_str().unwrap_or("unreadable").to_string(),
                            v["completed_at"].as_i64().unwrap_or(0),
                        )
                    }
                    Ok(a) => (format!("http_{}", a.status), 0),
                    Err(f) => (f.kind().to_string(), 0),
                };
                seen.push(Seen {
                    status,
                    completed_at,
                    item,
                    latency,
                });
            }
            seen
        }));
    }
    let mut seen = Vec::new();
    for t in tasks {
        seen.extend(t.await.context("a caller panicked")?);
    }
    let result = summarize(&args, opens_at, &seen);
    let line = serde_json::to_string(&result)?;
    println!("{line}");
    eprintln!(
        "nrtxn-bench flash-open: {} refused before the opening (p99 {} ms); first sale {:?} ms after opens_at, all sold out {:?} ms after; {} sales in the first second (p99 {} ms); violations {}",
        result.refused_before,
        result.refused_before_p99_ms,
        result.first_sale_after_ms,
        result.sold_out_after_ms,
        result.sales_first_second,
        result.sales_first_second_p99_ms,
        result.violations
    );
    if let Some(path) = &args.json {
        std::fs::write(path, format!("{line}\n"))
            .with_context(|| format!("--json: cannot write {}", path.display()))?;
    }
    if let Some(path) = &args.markdown {
        std::fs::write(path, markdown(&result))
            .with_context(|| format!("--markdown: cannot write {}", path.display()))?;
    }
    if result.violations > 0 {
        bail!(
            "{} sales before the opening or past the stock",
            result.violations
        );
    }
    Ok(())
}

fn summarize(args: &FlashOpenArgs, opens_at: i64, seen: &[Seen]) -> FlashOpenResult {
    let (mut before, mut first_second) = (Latencies::new(), Latencies::new());
    let mut sold = vec![0i64; args.items];
    let mut last_sale = vec![None::<i64>; args.items];
    let (mut first_sale, mut sales, mut sold_out, mut other, mut violations) =
        (None::<i64>, 0, 0, 0, 0);
    for s in seen {
        match s.status.as_str() {
            "not_open" => before.record(s.latency),
            "ok" => {
                sales += 1;
                sold[s.item] += 1;
                if s.completed_at < opens_at {
                    violations += 1;
                }
                if s.completed_at < opens_at + 1000 {
                    first_second.record(s.latency);
                }
                first_sale = Some(first_sale.map_or(s.completed_at, |f| f.min(s.completed_at)));
                let last = &mut last_sale[s.item];
                *last = Some(last.map_or(s.completed_at, |l| l.max(s.completed_at)));
            }
            "insufficient_stock" => sold_out += 1,
            _ => other += 1,
        }
    }
    violations += sold.iter().filter(|n| **n > args.stock).count() as u64;
    let all_sold = sold.iter().all(|n| *n == args.stock);
    FlashOpenResult {
        items: args.items,
        stock_per_item: args.stock,
        connections: args.connections,
        opens_in_ms: args.opens_in_ms,
        after_s: args.after_s,
        refused_before: before.count(),
        refused_before_p99_ms: before.quantile_ms(0.99),
        first_sale_after_ms: first_sale.map(|f| f - opens_at),
        sold_out_after_ms: all_sold
            .then(|| last_sale.iter().flatten().max().map(|l| l - opens_at))
            .flatten(),
        sales_first_second: first_second.count(),
        sales_first_second_p99_ms: first_second.quantile_ms(0.99),
        sales,
        sold_out_refusals: sold_out,
        other_answers: other,
        violations,
    }
}

fn markdown(r: &FlashOpenResult) -> String {
    let ms = |v: Option<i64>| v.map_or("not reached".to_string(), |v| format!("{v} ms"));
    format!(
        "\n## flash-open (nrtxn only)\n\n\
         {} items of {} units, loaded with `opens_at` {} ms ahead; {} callers sell one unit \
         at a time from the load until {} s after the opening (`nrtxn-bench flash-open`).\n\n\
         | measure | value |\n|---|---|\n\
         | refusals before the opening (`not_open`) | {} (p99 {} ms) |\n\
         | from `opens_at` to the first sale (server decision time) | {} |\n\
         | from `opens_at` to the last item sold out | {} |\n\
         | sales answered in the first second, p99 | {} ({} ms) |\n\
         | sales / refused sold out / other answers | {} / {} / {} |\n\
         | sales before the opening or past the stock | {} |\n",
        r.items,
        r.stock_per_item,
        r.opens_in_ms,
        r.connections,
        r.after_s,
        r.refused_before,
        r.refused_before_p99_ms,
        ms(r.first_sale_after_ms),
        ms(r.sold_out_after_ms),
        r.sales_first_second,
        r.sales_first_second_p99_ms,
        r.sales,
        r.sold_out_refusals,
        r.other_answers,
        r.violations
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seen(status: &str, completed_at: i64, item: usize) -> Seen {
        Seen {
            status: status.into(),
            completed_at,
            item,
            latency: Duration::from_millis(2),
        }
    }

    fn args(items: usize, stock: i64) -> FlashOpenArgs {
        FlashOpenArgs {
            target: String::new(),
            connections: 2,
            items,
            stock,
            opens_in_ms: 3_000,
            after_s: 5,
            timeout_ms: 1_000,
            json: None,
            markdown: None,
        }
    }

    #[test]
    fn the_opening_is_timed_by_the_servers_decisions_and_early_sales_are_violations() {
        let at = 1_000_000;
        let answers = [
            seen("not_open", at - 5, 0),
            seen("ok", at + 2, 0),
            seen("ok", at + 1_500, 1),
            seen("ok", at + 40, 0),
            seen("insufficient_stock", at + 50, 0),
            seen("ok", at + 1_600, 1),
        ];
        let r = summarize(&args(2, 2), at, &answers);
        assert_eq!((r.refused_before, r.sales, r.sold_out_refusals), (1, 4, 1));
        assert_eq!(r.first_sale_after_ms, Some(2));
        assert_eq!(r.sold_out_after_ms, Some(1_600), "both items sold out");
        assert_eq!((r.sales_first_second, r.violations), (2, 0));
        // A sale decided before the opening, or one past an item's stock, is counted.
        let early = [
            seen("ok", at - 1, 0),
            seen("ok", at + 1, 0),
            seen("ok", at + 2, 0),
        ];
        let r = summarize(&args(1, 2), at, &early);
        assert_eq!(r.violations, 2);
        // Not all sold: no sold-out time.
        let r = summarize(&args(1, 5), at, &answers[..2]);
        assert_eq!(r.sold_out_after_ms, None);
    }
}
