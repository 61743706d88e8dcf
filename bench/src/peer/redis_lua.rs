//! The Redis peer: what most flash-sale code does. One EVALSHA per request runs, inside
//! Redis and atomically, the conditional DECRBY of the item's stock and the SET NX of the
//! request key with its outcome; a repeated key gets that recorded outcome back.
//!
//! Durability is Redis's: `scripts/bench.sh` starts it with `appendonly no` and no RDB
//! saves, so an acknowledged sale is lost if Redis stops. That is the common setting
//! for this design, and the reason its figures are not comparable on durability.

use anyhow::Context;
use redis::aio::MultiplexedConnection;

use super::{now_ms, Decision, Outcome, Txn};

/// KEYS[1]: the item's stock, KEYS[2]: the request key.
/// ARGV: qty, op, completed_at (ms), item.
/// Returns `N|record` for a new decision or `R|record` for a repeated key, where the
/// record is `status|stock_before|stock_after|op|qty|completed_at|item` (item last: it
/// may contain `|`). Numbers are formatted with %d: Lua's default `tostring` would
/// print large stock in exponent notation.
const DECIDE_LUA: &str = r#"
local rec = redis.call('GET', KEYS[2])
if rec then return 'R|' .. rec end
local qty = tonumber(ARGV[1])
local stock = redis.call('GET', KEYS[1])
local out
if not stock then
  out = 'unknown_item||'
else
  local before = tonumber(stock)
  if ARGV[2] == 'increment' then
    if before + qty > 1000000000000000 then
      out = 'limit_exceeded|' .. string.format('%d', before) .. '|' .. string.format('%d', before)
    else
      local after = redis.call('INCRBY', KEYS[1], qty)
      out = 'ok|' .. string.format('%d', before) .. '|' .. string.format('%d', after)
    end
  elseif before >= qty then
    local after = redis.call('DECRBY', KEYS[1], qty)
    out = 'ok|' .. string.format('%d', before) .. '|' .. string.format('%d', after)
  else
    out = 'insufficient_stock|' .. string.format('%d', before) .. '|' .. string.format('%d', before)
  end
end
out = out .. '|' .. ARGV[2] .. '|' .. ARGV[1] .. '|' .. ARGV[3] .. '|' .. ARGV[4]
redis.call('SET', KEYS[2], out, 'NX')
return 'N|' .. out
"#;

pub struct RedisLua {
    /// One multiplexed connection: redis-rs pipelines every concurrent request on it,
    /// which is how a Redis client reaches its throughput (Redis runs commands on one
    /// thread anyway, so more sockets would add no parallelism).
    conn: MultiplexedConnection,
    sha: String,
}

fn stock_key(shop: &str, item: &str) -> String {
    // '/' cannot occur in a shop or item name, so the key is unambiguous.
    format!("st:{shop}/{item}")
}

fn request_key(shop: &str, key: &str) -> String {
    format!("rq:{shop}/{key}")
}

fn opt_i64(s: &str) -> Option<i64> {
    s.parse().ok()
}

/// Parses a record written by [`DECIDE_LUA`].
fn parse_record(shop: &str, key: &str, rec: &str) -> anyhow::Result<Outcome> {
    let f: Vec<&str> = rec.splitn(7, '|').collect();
    if f.len() != 7 {
        anyhow::bail!("malformed record of {key}: {rec:?}");
    }
    let qty = f[4]
        .parse()
        .with_context(|| format!("record of {key}: qty {:?}", f[4]))?;
    let completed_at = f[5].parse().unwrap_or(0);
    let before = opt_i64(f[1]);
    let reason = match f[0] {
        "insufficient_stock" => before.map(|b| format!("requested {qty}, available {b}")),
        "unknown_item" => Some(format!("no item {} in shop {shop}", f[6])),
        _ => None,
    };
    Ok(Outcome {
        shop: shop.to_string(),
        request_key: key.to_string(),
        status: f[0].to_string(),
        reason,
        item: f[6].to_string(),
        op: f[3].to_string(),
        qty,
        stock_before: before,
        stock_after: opt_i64(f[2]),
        seq: None,
        prev_seq: None,
        submitted_at: completed_at,
        completed_at,
    })
}

impl RedisLua {
    pub async fn connect(url: &str) -> anyhow::Result<RedisLua> {
        let client = redis::Client::open(url)
            .with_context(|| format!("--redis-url: invalid URL {url:?}"))?;
        let mut conn = client
            .get_multiplexed_async_connection()
            .await
            .with_context(|| format!("--redis-url: cannot connect to {url}"))?;
        let script = redis::Script::new(DECIDE_LUA);
        let sha = script
            .prepare_invoke()
            .load_async(&mut conn)
            .await
            .context("SCRIPT LOAD of the decide script failed")?;
        Ok(RedisLua { conn, sha })
    }

    pub async fn load(&self, shop: &str, items: &[(String, i64)]) -> anyhow::Result<()> {
        let mut cmd = redis::cmd("MSET");
        for (item, stock) in items {
            cmd.arg(stock_key(shop, item)).arg(*stock);
        }
        let mut conn = self.conn.clone();
        cmd.query_async::<()>(&mut conn)
            .await
            .context("MSET of the loaded stock")
    }

    pub async fn item(&self, shop: &str, item: &str) -> anyhow::Result<Option<i64>> {
        let mut conn = self.conn.clone();
        redis::cmd("GET")
            .arg(stock_key(shop, item))
            .query_async::<Option<i64>>(&mut conn)
            .await
            .context("GET of an item's stock")
    }

    /// One EVALSHA per transaction; a batch sends them as one pipeline (one round trip,
    /// still one script run per request, in order).
    pub async fn decide(&self, shop: &str, txns: &[Txn]) -> anyhow::Result<Vec<Decision>> {
        let now = now_ms();
        let mut pipe = redis::pipe();
        for t in txns {
            pipe.cmd("EVALSHA")
                .arg(&self.sha)
                .arg(2)
                .arg(stock_key(shop, &t.item))
                .arg(request_key(shop, &t.key))
                .arg(t.qty)
                .arg(t.op())
                .arg(now)
                .arg(&t.item);
        }
        let mut conn = self.conn.clone();
        let replies: Vec<String> = pipe
            .query_async(&mut conn)
            .await
            .context("EVALSHA of the decide script")?;
        txns.iter()
            .zip(replies)
            .map(|(t, reply)| {
                let (repeat, rec) = match reply.split_once('|') {
                    Some(("R", rec)) => (true, rec),
                    Some(("N", rec)) => (false, rec),
                    _ => anyhow::bail!("unexpected reply of the decide script: {reply:?}"),
                };
                let mut outcome = parse_record(shop, &t.key, rec)?;
                if !repeat {
                    outcome.submitted_at = t.submitted_at;
                }
                Ok(Decision { outcome, repeat })
            })
            .collect()
    }

    pub async fn poll(&self, shop: &str, key: &str) -> anyhow::Result<Option<Outcome>> {
        let mut conn = self.conn.clone();
        let rec: Option<String> = redis::cmd("GET")
            .arg(request_key(shop, key))
            .query_async(&mut conn)
            .await
            .context("GET of a request key")?;
        rec.map(|r| parse_record(shop, key, &r)).transpose()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_parse_back_into_outcomes() {
        let o = parse_record("s", "k", "ok|10|9|decrement|1|1700|it|em").unwrap();
        assert_eq!(
            (o.status.as_str(), o.stock_before, o.stock_after),
            ("ok", Some(10), Some(9))
        );
        assert_eq!(o.item, "it|em");
        let o = parse_record("s", "k", "unknown_item|||decrement|1|1700|x").unwrap();
        assert_eq!((o.stock_before, o.stock_after), (None, None));
        assert!(parse_record("s", "k", "ok|1").is_err());
    }
}
