//! The Redis peer: what most flash-sale code does. One EVALSHA per request runs, inside
//! Redis and atomically, the conditional DECRBY of the item's stock and the SET NX of the
//! request key with its outcome; a repeated key gets that recorded outcome back.
//!
//! Holds, as Redis users write them: a script per operation over the item's stock
//! counter, a `reserved` counter beside it, a hash per hold (its id is the request key:
//! a repeated id answers the recorded hold) and a sorted set of the shop's pending holds
//! by `expires_at`. Every script (transactions, holds, item reads) starts by releasing
//! up to [`RELEASE_MAX`] due holds of the sorted set; a confirm, cancel or read of a
//! hold past its expiry expires it there and then.
//!
//! Orders: one script reserves every line or none, atomically (Redis runs a script
//! alone, so no other call sees half an order and no two orders can deadlock); a hash
//! per order (`state exp failed lines at`) and the order in the same sorted set of
//! expiries, as `~{order_id}` (a hold id never starts with '~'). Confirm, cancel and
//! expiry end every line in one script.
//!
//! Durability is Redis's: `scripts/bench.sh` starts it with `appendonly no` and no RDB
//! saves, so an acknowledged sale is lost if Redis stops. That is the common setting
//! for this design, and the reason its figures are not comparable on durability.
//!
//! The scripts build the keys of a due hold's item from the shop's name, so they run on a
//! single Redis, not a cluster (where every key a script touches must be passed in KEYS).

use anyhow::Context;
use redis::aio::MultiplexedConnection;

#[cfg(test)]
use super::RELEASE_MAX;
use super::{now_ms, Decision, Hold, HoldEnd, HoldReq, Order, OrderReq, Outcome, Txn};

/// The functions every script starts with. Keys: `st:{shop}/{item}` the available
/// stock, `rs:{shop}/{item}` the reserved part, `hd:{shop}/{hold_id}` a hold's hash
/// (`state item qty ttl exp before at`), `hx:{shop}` the pending holds by expiry.
/// `od:{shop}/{order_id}` an order's hash, whose `lines` are `item\nqty\n...` (a name
/// has no control characters). `finish` ends a held hold: `confirmed` sells its
/// reserved quantity, `released` and `expired` give it back to the stock; `end_order`
/// does that for every line of a held order. `release_due` expires up to RELEASE_MAX
/// holds and orders whose `expires_at` is at or before `now`.
macro_rules! holds_lua {
    () => {
        r#"
local function finish(shop, hk, xkey, id, item, qty, state)
  local at = shop .. '/' .. item
  redis.call('DECRBY', 'rs:' .. at, qty)
  if state ~= 'confirmed' then redis.call('INCRBY', 'st:' .. at, qty) end
  redis.call('HSET', hk, 'state', state)
  redis.call('ZREM', xkey, id)
end
local function end_order(shop, ok, xkey, oid, state)
  local f = {}
  for s in string.gmatch(redis.call('HGET', ok, 'lines'), '[^\n]+') do f[#f + 1] = s end
  for i = 1, #f, 2 do
    local at = shop .. '/' .. f[i]
    redis.call('DECRBY', 'rs:' .. at, f[i + 1])
    if state ~= 'confirmed' then redis.call('INCRBY', 'st:' .. at, f[i + 1]) end
  end
  redis.call('HSET', ok, 'state', state)
  redis.call('ZREM', xkey, '~' .. oid)
end
local function release_due(xkey, shop, now)
  local due = redis.call('ZRANGEBYSCORE', xkey, '-inf', now, 'LIMIT', 0, 16)
  for _, id in ipairs(due) do
    if string.sub(id, 1, 1) == '~' then
      local oid = string.sub(id, 2)
      local ok = 'od:' .. shop .. '/' .. oid
      if redis.call('HGET', ok, 'state') == 'held' then
        end_order(shop, ok, xkey, oid, 'expired')
      else
        redis.call('ZREM', xkey, id)
      end
    else
      local hk = 'hd:' .. shop .. '/' .. id
      local h = redis.call('HMGET', hk, 'state', 'item', 'qty')
      if h[1] == 'held' then
        finish(shop, hk, xkey, id, h[2], h[3], 'expired')
      else
        redis.call('ZREM', xkey, id)
      end
    end
  end
end
"#
    };
}

/// KEYS[1]: the item's stock, KEYS[2]: the request key, KEYS[3]: the shop's expiries.
/// ARGV: qty, op, completed_at (ms), item, shop.
/// Returns `N|record` for a new decision or `R|record` for a repeated key, where the
/// record is `status|stock_before|stock_after|op|qty|completed_at|item` (item last: it
/// may contain `|`). Numbers are formatted with %d: Lua's default `tostring` would
/// print large stock in exponent notation.
const DECIDE_LUA: &str = concat!(
    holds_lua!(),
    r#"
release_due(KEYS[3], ARGV[5], ARGV[3])
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
"#
);

/// A hold. KEYS[1]: the shop's expiries, KEYS[2]: the item's stock, KEYS[3]: its
/// reserved part, KEYS[4]: the hold's hash. ARGV: now (ms), shop, qty, ttl_ms, item,
/// hold id. A hold id already recorded answers its hash as it stands (a repeat);
/// otherwise the hold is made if the available stock covers `qty`, or its refusal is
/// recorded under the id. Returns `{state, item, qty, expires_at, stock_before}`.
const HOLD_LUA: &str = concat!(
    holds_lua!(),
    r#"
release_due(KEYS[1], ARGV[2], ARGV[1])
local h = redis.call('HMGET', KEYS[4], 'state', 'item', 'qty', 'exp', 'before')
if h[1] then return {h[1], h[2], h[3], h[4] or '', h[5] or ''} end
local qty = tonumber(ARGV[3])
local stock = redis.call('GET', KEYS[2])
local state, exp, before = 'held', '', ''
if not stock then
  state = 'unknown_item'
else
  before = stock
  if tonumber(stock) >= qty then
    redis.call('DECRBY', KEYS[2], qty)
    redis.call('INCRBY', KEYS[3], qty)
    exp = string.format('%d', tonumber(ARGV[1]) + tonumber(ARGV[4]))
    redis.call('ZADD', KEYS[1], exp, ARGV[6])
  else
    state = 'insufficient_stock'
  end
end
redis.call('HSET', KEYS[4], 'state', state, 'item', ARGV[5], 'qty', ARGV[3], 'ttl', ARGV[4],
  'exp', exp, 'before', before, 'at', ARGV[1])
return {state, ARGV[5], ARGV[3], exp, before}
"#
);

/// Confirm, cancel or read of a hold. KEYS[1]: the shop's expiries, KEYS[2]: the hold's
/// hash. ARGV: now (ms), shop, hold id, the ending (`confirmed`, `released`, or empty to
/// read). A held hold past its expiry expires; one still held ends as asked. Returns
/// `{state, item, qty, expires_at}`, or an empty array for no hold (or a refused one).
const SETTLE_LUA: &str = concat!(
    holds_lua!(),
    r#"
release_due(KEYS[1], ARGV[2], ARGV[1])
local h = redis.call('HMGET', KEYS[2], 'state', 'item', 'qty', 'exp')
local made = {held = true, confirmed = true, released = true, expired = true}
if not h[1] or not made[h[1]] then return {} end
if h[1] == 'held' then
  local state = ARGV[4]
  if tonumber(h[4]) <= tonumber(ARGV[1]) then state = 'expired' end
  if state ~= '' then
    finish(ARGV[2], KEYS[2], KEYS[1], ARGV[3], h[2], h[3], state)
    h[1] = state
  end
end
return {h[1], h[2], h[3], h[4]}
"#
);

/// An order. KEYS[1]: the shop's expiries, KEYS[2]: the order's hash, then per line
/// (1-based `i`) KEYS[1 + 2i] its item's stock and KEYS[2 + 2i] its reserved part.
/// ARGV: now (ms), shop, ttl_ms, order id, the lines as stored (`item\nqty\n...`), then
/// each line's qty. An order id already recorded answers its hash as it stands (a
/// repeat). Otherwise every line is checked, in the order given; if all are covered,
/// all are reserved, else the first failing line's status is recorded with its index
/// and nothing moves. Returns `{state, expires_at, failed_line, lines}`.
const ORDER_LUA: &str = concat!(
    holds_lua!(),
    r#"
release_due(KEYS[1], ARGV[2], ARGV[1])
local h = redis.call('HMGET', KEYS[2], 'state', 'exp', 'failed', 'lines')
if h[1] then return {h[1], h[2] or '', h[3] or '', h[4] or ''} end
local n = (#KEYS - 2) / 2
local state, failed, exp = 'held', '', ''
for i = 1, n do
  local stock = redis.call('GET', KEYS[1 + 2 * i])
  if not stock then
    state = 'unknown_item'
  elseif tonumber(stock) < tonumber(ARGV[5 + i]) then
    state = 'insufficient_stock'
  end
  if state ~= 'held' then
    failed = string.format('%d', i - 1)
    break
  end
end
if state == 'held' then
  for i = 1, n do
    redis.call('DECRBY', KEYS[1 + 2 * i], ARGV[5 + i])
    redis.call('INCRBY', KEYS[2 + 2 * i], ARGV[5 + i])
  end
  exp = string.format('%d', tonumber(ARGV[1]) + tonumber(ARGV[3]))
  redis.call('ZADD', KEYS[1], exp, '~' .. ARGV[4])
end
redis.call('HSET', KEYS[2], 'state', state, 'exp', exp, 'failed', failed, 'lines', ARGV[5],
  'at', ARGV[1])
return {state, exp, failed, ARGV[5]}
"#
);

/// Confirm, cancel or read of an order. KEYS[1]: the shop's expiries, KEYS[2]: the
/// order's hash. ARGV: now (ms), shop, order id, the ending (`confirmed`, `cancelled`,
/// or empty to read). A held order past its expiry expires; one still held ends as
/// asked, every line together. Returns `{state, expires_at, failed_line, lines}`, or an
/// empty array for no order.
const SETTLE_ORDER_LUA: &str = concat!(
    holds_lua!(),
    r#"
release_due(KEYS[1], ARGV[2], ARGV[1])
local h = redis.call('HMGET', KEYS[2], 'state', 'exp', 'failed', 'lines')
if not h[1] then return {} end
if h[1] == 'held' then
  local state = ARGV[4]
  if tonumber(h[2]) <= tonumber(ARGV[1]) then state = 'expired' end
  if state ~= '' then
    end_order(ARGV[2], KEYS[2], KEYS[1], ARGV[3], state)
    h[1] = state
  end
end
return {h[1], h[2] or '', h[3] or '', h[4] or ''}
"#
);

/// An item read. KEYS[1]: the shop's expiries, KEYS[2]: the item's stock, KEYS[3]: its
/// reserved part. ARGV: now (ms), shop. Returns `{stock, reserved}` (nil if absent).
const ITEM_LUA: &str = concat!(
    holds_lua!(),
    r#"
release_due(KEYS[1], ARGV[2], ARGV[1])
return {redis.call('GET', KEYS[2]), redis.call('GET', KEYS[3])}
"#
);

pub struct RedisLua {
    /// One multiplexed connection: redis-rs pipelines every concurrent request on it,
    /// which is how a Redis client reaches its throughput (Redis runs commands on one
    /// thread anyway, so more sockets would add no parallelism).
    conn: MultiplexedConnection,
    /// SHA1s of the loaded scripts.
    decide_sha: String,
    hold_sha: String,
    settle_sha: String,
    item_sha: String,
    order_sha: String,
    settle_order_sha: String,
}

fn stock_key(shop: &str, item: &str) -> String {
    // '/' cannot occur in a shop or item name, so the key is unambiguous.
    format!("st:{shop}/{item}")
}

fn request_key(shop: &str, key: &str) -> String {
    format!("rq:{shop}/{key}")
}

fn reserved_key(shop: &str, item: &str) -> String {
    format!("rs:{shop}/{item}")
}

fn hold_key(shop: &str, hold_id: &str) -> String {
    format!("hd:{shop}/{hold_id}")
}

fn order_key(shop: &str, order_id: &str) -> String {
    format!("od:{shop}/{order_id}")
}

/// An order's lines as its hash keeps them: `item\nqty\n` per line.
fn encode_lines(lines: &[(String, i64)]) -> String {
    lines.iter().map(|(i, q)| format!("{i}\n{q}\n")).collect()
}

/// Parses an order answered by [`ORDER_LUA`] or [`SETTLE_ORDER_LUA`]:
/// `state, expires_at, failed_line, lines`.
fn parse_order(order_id: &str, f: &[String]) -> anyhow::Result<Order> {
    if f.len() != 4 {
        anyhow::bail!("malformed order {order_id}: {f:?}");
    }
    let parts: Vec<&str> = f[3].split_terminator('\n').collect();
    let mut lines = Vec::with_capacity(parts.len() / 2);
    for pair in parts.chunks(2) {
        let [item, qty] = pair else {
            anyhow::bail!("order {order_id}: malformed lines {:?}", f[3]);
        };
        let qty = qty
            .parse()
            .with_context(|| format!("order {order_id}: qty {qty:?}"))?;
        lines.push((item.to_string(), qty));
    }
    Ok(Order {
        order_id: order_id.to_string(),
        status: f[0].clone(),
        lines,
        expires_at: opt_i64(&f[1]),
        failed_line: f[2].parse().ok(),
    })
}

fn expiries_key(shop: &str) -> String {
    format!("hx:{shop}")
}

fn opt_i64(s: &str) -> Option<i64> {
    s.parse().ok()
}

/// Parses a hold answered by [`HOLD_LUA`] or [`SETTLE_LUA`]:
/// `state, item, qty, expires_at[, stock_before]`.
fn parse_hold(hold_id: &str, f: &[String]) -> anyhow::Result<Hold> {
    if f.len() < 4 {
        anyhow::bail!("malformed hold {hold_id}: {f:?}");
    }
    Ok(Hold {
        hold_id: hold_id.to_string(),
        status: f[0].clone(),
        item: f[1].clone(),
        qty: f[2]
            .parse()
            .with_context(|| format!("hold {hold_id}: qty {:?}", f[2]))?,
        expires_at: opt_i64(&f[3]),
        stock_before: f.get(4).and_then(|b| opt_i64(b)),
    })
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
        let mut shas = Vec::new();
        for (name, text) in [
            ("decide", DECIDE_LUA),
            ("hold", HOLD_LUA),
            ("settle", SETTLE_LUA),
            ("item", ITEM_LUA),
            ("order", ORDER_LUA),
            ("settle-order", SETTLE_ORDER_LUA),
        ] {
            let sha = redis::Script::new(text)
                .prepare_invoke()
                .load_async(&mut conn)
                .await
                .with_context(|| format!("SCRIPT LOAD of the {name} script failed"))?;
            shas.push(sha);
        }
        let [decide_sha, hold_sha, settle_sha, item_sha, order_sha, settle_order_sha] =
            <[String; 6]>::try_from(shas).map_err(|_| anyhow::anyhow!("six scripts, six SHA1s"))?;
        Ok(RedisLua {
            conn,
            decide_sha,
            hold_sha,
            settle_sha,
            item_sha,
            order_sha,
            settle_order_sha,
        })
    }

    /// Sets the stock of the items; their reserved parts (pending holds) stay, and are
    /// answered in order.
    pub async fn load(&self, shop: &str, items: &[(String, i64)]) -> anyhow::Result<Vec<i64>> {
        let mut pipe = redis::pipe();
        let mset = pipe.cmd("MSET");
        for (item, stock) in items {
            mset.arg(stock_key(shop, item)).arg(*stock);
        }
        pipe.ignore();
        let mget = pipe.cmd("MGET");
        for (item, _) in items {
            mget.arg(reserved_key(shop, item));
        }
        let mut conn = self.conn.clone();
        let (reserved,): (Vec<Option<i64>>,) = pipe
            .query_async(&mut conn)
            .await
            .context("MSET of the loaded stock")?;
        Ok(reserved
            .into_iter()
            .map(Option::unwrap_or_default)
            .collect())
    }

    pub async fn item(&self, shop: &str, item: &str) -> anyhow::Result<Option<(i64, i64)>> {
        let mut conn = self.conn.clone();
        let (stock, reserved): (Option<i64>, Option<i64>) = redis::cmd("EVALSHA")
            .arg(&self.item_sha)
            .arg(3)
            .arg(expiries_key(shop))
            .arg(stock_key(shop, item))
            .arg(reserved_key(shop, item))
            .arg(now_ms())
            .arg(shop)
            .query_async(&mut conn)
            .await
            .context("EVALSHA of the item script")?;
        Ok(stock.map(|s| (s, reserved.unwrap_or(0))))
    }

    pub async fn hold(&self, shop: &str, req: &HoldReq) -> anyhow::Result<Hold> {
        let mut conn = self.conn.clone();
        let reply: Vec<String> = redis::cmd("EVALSHA")
            .arg(&self.hold_sha)
            .arg(4)
            .arg(expiries_key(shop))
            .arg(stock_key(shop, &req.item))
            .arg(reserved_key(shop, &req.item))
            .arg(hold_key(shop, &req.hold_id))
            .arg(now_ms())
            .arg(shop)
            .arg(req.qty)
            .arg(req.ttl_ms)
            .arg(&req.item)
            .arg(&req.hold_id)
            .query_async(&mut conn)
            .await
            .context("EVALSHA of the hold script")?;
        parse_hold(&req.hold_id, &reply)
    }

    pub async fn settle(
        &self,
        shop: &str,
        hold_id: &str,
        end: Option<HoldEnd>,
    ) -> anyhow::Result<Option<Hold>> {
        let end = end.map_or("", HoldEnd::state);
        let record = hold_key(shop, hold_id);
        let reply = self
            .settle_script(&self.settle_sha, "settle", shop, record, hold_id, end)
            .await?;
        if reply.is_empty() {
            return Ok(None);
        }
        parse_hold(hold_id, &reply).map(Some)
    }

    /// Runs a settle script (`sha`, named `what` in errors) on one record, a hold's or an
    /// order's: its reply, empty when there is no such record.
    async fn settle_script(
        &self,
        sha: &str,
        what: &str,
        shop: &str,
        record: String,
        id: &str,
        end: &str,
    ) -> anyhow::Result<Vec<String>> {
        let mut conn = self.conn.clone();
        redis::cmd("EVALSHA")
            .arg(sha)
            .arg(2)
            .arg(expiries_key(shop))
            .arg(record)
            .arg(now_ms())
            .arg(shop)
            .arg(id)
            .arg(end)
            .query_async(&mut conn)
            .await
            .with_context(|| format!("EVALSHA of the {what} script"))
    }

    /// One EVALSHA per order, whatever its number of lines.
    pub async fn order(&self, shop: &str, req: &OrderReq) -> anyhow::Result<Order> {
        let mut cmd = redis::cmd("EVALSHA");
        cmd.arg(&self.order_sha)
            .arg(2 + 2 * req.lines.len())
            .arg(expiries_key(shop))
            .arg(order_key(shop, &req.order_id));
        for (item, _) in &req.lines {
            cmd.arg(stock_key(shop, item)).arg(reserved_key(shop, item));
        }
        cmd.arg(now_ms())
            .arg(shop)
            .arg(req.ttl_ms)
            .arg(&req.order_id)
            .arg(encode_lines(&req.lines));
        for (_, qty) in &req.lines {
            cmd.arg(*qty);
        }
        let mut conn = self.conn.clone();
        let reply: Vec<String> = cmd
            .query_async(&mut conn)
            .await
            .context("EVALSHA of the order script")?;
        parse_order(&req.order_id, &reply)
    }

    pub async fn settle_order(
        &self,
        shop: &str,
        order_id: &str,
        end: Option<HoldEnd>,
    ) -> anyhow::Result<Option<Order>> {
        let end = end.map_or("", HoldEnd::order_state);
        let record = order_key(shop, order_id);
        let reply = self
            .settle_script(
                &self.settle_order_sha,
                "settle-order",
                shop,
                record,
                order_id,
                end,
            )
            .await?;
        if reply.is_empty() {
            return Ok(None);
        }
        parse_order(order_id, &reply).map(Some)
    }

    /// One EVALSHA per transaction; a batch sends them as one pipeline (one round trip,
    /// still one script run per request, in order).
    pub async fn decide(&self, shop: &str, txns: &[Txn]) -> anyhow::Result<Vec<Decision>> {
        let now = now_ms();
        let mut pipe = redis::pipe();
        for t in txns {
            pipe.cmd("EVALSHA")
                .arg(&self.decide_sha)
                .arg(3)
                .arg(stock_key(shop, &t.item))
                .arg(request_key(shop, &t.key))
                .arg(expiries_key(shop))
                .arg(t.qty)
                .arg(t.op())
                .arg(now)
                .arg(&t.item)
                .arg(shop);
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

    #[test]
    fn holds_parse_back() {
        let f = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let h = parse_hold("h1", &f(&["held", "it|em", "3", "1700", "10"])).unwrap();
        assert_eq!(
            (h.status.as_str(), h.item.as_str(), h.qty, h.expires_at),
            ("held", "it|em", 3, Some(1700))
        );
        let h = parse_hold("h2", &f(&["insufficient_stock", "a", "5", "", "2"])).unwrap();
        assert_eq!(
            (h.expires_at, h.stock_before, h.was_held()),
            (None, Some(2), false)
        );
        let h = parse_hold("h3", &f(&["expired", "a", "5", "1700"])).unwrap();
        assert_eq!((h.stock_before, h.was_held()), (None, true));
        assert!(parse_hold("h4", &f(&["held", "a"])).is_err());
    }

    #[test]
    fn scripts_release_at_most_release_max_and_name_keys_as_rust_does() {
        for script in [
            DECIDE_LUA,
            HOLD_LUA,
            SETTLE_LUA,
            ITEM_LUA,
            ORDER_LUA,
            SETTLE_ORDER_LUA,
        ] {
            assert!(script.contains(&format!("'LIMIT', 0, {RELEASE_MAX})")));
            assert!(script.contains("release_due(KEYS["));
        }
        // The scripts build these keys of a due hold from the shop's name.
        assert_eq!(hold_key("s", "h"), "hd:s/h");
        assert_eq!(stock_key("s", "i"), "st:s/i");
        assert_eq!(reserved_key("s", "i"), "rs:s/i");
        assert_eq!(order_key("s", "o"), "od:s/o");
    }

    #[test]
    fn orders_parse_back_with_their_lines() {
        let f = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let lines = vec![("it|em".to_string(), 1), ("b".to_string(), 3)];
        let enc = encode_lines(&lines);
        let o = parse_order("o", &f(&["held", "1700", "", &enc])).unwrap();
        assert_eq!(
            (o.status.as_str(), o.expires_at, o.failed_line, &o.lines),
            ("held", Some(1700), None, &lines)
        );
        let o = parse_order("o", &f(&["insufficient_stock", "", "1", &enc])).unwrap();
        assert_eq!((o.expires_at, o.failed_line), (None, Some(1)));
        assert!(parse_order("o", &f(&["held", "1", "", "a\n"])).is_err());
    }
}
