//! The body of an entries record: a batch of journal entries, packed.
//!
//! Integers are LEB128 varints (signed ones zigzagged), times are deltas, and an entry
//! names its shop and item only when they differ from the entry before it, so a batch on
//! one hot item spends a byte on them. A refusal's standard reason is rebuilt, not
//! stored. Each entry ends with its request's fingerprint (see [`fingerprint`]).
//!
//! An entry is: a flags varint (`F_SHOP` ...), the op and status in one byte, `qty`,
//! then each field its flag announces, in flag order, then the fingerprint (8 bytes).

use std::sync::Arc;

use nrtxn_actors::types::{Entry, LogPos, Millis, Op, Status};
use xxhash_rust::xxh3::Xxh3;

const F_SHOP: u32 = 1 << 0;
const F_ITEM: u32 = 1 << 1;
const F_KEY: u32 = 1 << 2;
const F_SEQ: u32 = 1 << 3;
const F_STOCK_BEFORE: u32 = 1 << 4;
const F_STOCK_AFTER: u32 = 1 << 5;
const F_RESERVED: u32 = 1 << 6;
const F_REASON_STANDARD: u32 = 1 << 7;
const F_REASON: u32 = 1 << 8;
const F_SELLER: u32 = 1 << 9;
const F_BUYER: u32 = 1 << 10;
const F_REMARKS: u32 = 1 << 11;
const F_HOLD_ID: u32 = 1 << 12;
const F_EXPIRES: u32 = 1 << 13;
const F_TTL: u32 = 1 << 14;
const F_LOGGED: u32 = 1 << 15;
const F_LOG_POS: u32 = 1 << 16;
/// `prev_seq` is not `seq - 1` (or one of them is missing): it is written out.
const F_PREV_SEQ: u32 = 1 << 17;
/// A load's `per_buyer_max` follows.
const F_PER_BUYER: u32 = 1 << 18;
/// A return's sale (`return_of`, its request key) follows.
const F_RETURN_OF: u32 = 1 << 19;
/// A partial fill's `qty_asked` follows (its `qty` is what it took).
const F_QTY_ASKED: u32 = 1 << 20;
/// The item's sale window bounds follow, each on its own flag.
const F_OPENS_AT: u32 = 1 << 21;
const F_CLOSES_AT: u32 = 1 << 22;
/// The item's low-stock level follows.
const F_LOW_STOCK_AT: u32 = 1 << 23;
const F_ALL: u32 = (1 << 24) - 1;

/// What identifies a request apart from its key: its kind and op, item, quantity and (a
/// hold's) TTL. Two uses of one key with different fingerprints are two requests: the
/// second is refused as a reused key.
pub fn fingerprint(op: Op, item: &str, qty: i64, ttl_ms: Option<i64>) -> u64 {
    let mut h = Xxh3::new();
    h.update(&[op_code(op)]);
    h.update(&(item.len() as u64).to_le_bytes());
    h.update(item.as_bytes());
    h.update(&qty.to_le_bytes());
    h.update(&ttl_ms.unwrap_or(-1).to_le_bytes());
    h.digest()
}

fn op_code(op: Op) -> u8 {
    Op::ALL
        .iter()
        .position(|o| *o == op)
        .expect("every op is listed") as u8
}

fn status_code(s: Status) -> u8 {
    Status::ALL
        .iter()
        .position(|x| *x == s)
        .expect("every status is listed") as u8
}

/// The reason `apply` gives a sale or hold refused for want of stock.
fn standard_reason(qty: i64, available: i64) -> String {
    format!("requested {qty}, available {available}")
}

fn put_uvar(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn put_ivar(out: &mut Vec<u8>, v: i64) {
    put_uvar(out, ((v << 1) ^ (v >> 63)) as u64);
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    put_uvar(out, s.len() as u64);
    out.extend_from_slice(s.as_bytes());
}

/// Appends `entries` to `out` as one record body; `at_ms` is the record's time (the
/// entries' times are written relative to it).
pub fn encode(entries: &[Entry], at_ms: Millis, out: &mut Vec<u8>) {
    let start = out.len();
    put_uvar(out, entries.len() as u64);
    let mut prev: Option<(&Arc<str>, &Arc<str>)> = None;
    for e in entries {
        let left = Implied::of(e, prev);
        put_uvar(out, u64::from(flags(e, left)));
        out.push(op_code(e.op) | (status_code(e.status) << 4));
        put_ivar(out, e.qty);
        put_state(out, e, left);
        put_times(out, e, at_ms);
        put_tail(out, e, left);
        prev = Some((&e.shop, &e.item));
    }
    // What recovery will read back is what was written: the decoder is this format's
    // other half, and a field one side forgets shows here, not at the next start.
    debug_assert!(
        decode(&out[start..], at_ms).is_ok_and(|back| back.len() == entries.len()
            && back.iter().zip(entries).all(|(b, e)| same_place(b, e))),
        "a record body does not decode to the {} entries it was encoded from",
        entries.len()
    );
}

/// Whether `a` and `b` say the same decision in the same place: what [`encode`] checks
/// its body reads back as.
fn same_place(a: &Entry, b: &Entry) -> bool {
    (&a.shop, &a.item, &a.request_key, a.seq, a.prev_seq)
        == (&b.shop, &b.item, &b.request_key, b.seq, b.prev_seq)
        && (a.op, a.status, a.qty, a.stock_after, a.reserved_after)
            == (b.op, b.status, b.qty, b.stock_after, b.reserved_after)
        && [a.qty_asked, a.opens_at, a.closes_at, a.low_stock_at]
            == [b.qty_asked, b.opens_at, b.closes_at, b.low_stock_at]
}

/// What an entry leaves out because a reader can tell it: the shop and item of the
/// entry before, the reason `apply` gives for want of stock, a seq's previous one.
#[derive(Clone, Copy)]
struct Implied {
    shop_new: bool,
    item_new: bool,
    standard: bool,
    prev_implied: bool,
}

impl Implied {
    #[inline]
    fn of(e: &Entry, prev: Option<(&Arc<str>, &Arc<str>)>) -> Implied {
        let standard = match (&e.reason, e.stock_before) {
            (Some(r), Some(available)) => *r == standard_reason(e.qty, available),
            _ => false,
        };
        let prev_implied = match (e.seq, e.prev_seq) {
            (Some(s), Some(p)) => s >= 1 && p == s - 1,
            (None, None) => true,
            _ => false,
        };
        Implied {
            shop_new: prev.is_none_or(|(s, _)| **s != *e.shop),
            item_new: prev.is_none_or(|(_, i)| **i != *e.item),
            standard,
            prev_implied,
        }
    }
}

/// The entry's flags: which of its fields follow.
#[inline]
fn flags(e: &Entry, left: Implied) -> u32 {
    let mut flags = 0u32;
    for (on, f) in [
        (left.shop_new, F_SHOP),
        (left.item_new, F_ITEM),
        (e.request_key.is_some(), F_KEY),
        (e.seq.is_some(), F_SEQ),
        (e.stock_before.is_some(), F_STOCK_BEFORE),
        (e.stock_after.is_some(), F_STOCK_AFTER),
        (e.reserved_after.is_some(), F_RESERVED),
        (left.standard, F_REASON_STANDARD),
        (e.reason.is_some() && !left.standard, F_REASON),
        (e.seller.is_some(), F_SELLER),
        (e.buyer.is_some(), F_BUYER),
        (e.remarks.is_some(), F_REMARKS),
        (e.hold_id.is_some(), F_HOLD_ID),
        (e.expires_at.is_some(), F_EXPIRES),
        (e.ttl_ms.is_some(), F_TTL),
        (e.logged, F_LOGGED),
        (e.log_pos.is_some(), F_LOG_POS),
        (!left.prev_implied, F_PREV_SEQ),
        (e.per_buyer_max.is_some(), F_PER_BUYER),
        (e.return_of.is_some(), F_RETURN_OF),
        (e.qty_asked.is_some(), F_QTY_ASKED),
        (e.opens_at.is_some(), F_OPENS_AT),
        (e.closes_at.is_some(), F_CLOSES_AT),
        (e.low_stock_at.is_some(), F_LOW_STOCK_AT),
    ] {
        if on {
            flags |= f;
        }
    }
    flags
}

/// The names, the item's state and the reason, each only if its flag is set.
#[inline]
fn put_state(out: &mut Vec<u8>, e: &Entry, left: Implied) {
    if left.shop_new {
        put_str(out, &e.shop);
    }
    if left.item_new {
        put_str(out, &e.item);
    }
    if let Some(k) = &e.request_key {
        put_str(out, k);
    }
    if let Some(seq) = e.seq {
        put_uvar(out, seq);
    }
    if let Some(b) = e.stock_before {
        put_ivar(out, b);
    }
    if let Some(a) = e.stock_after {
        put_ivar(out, a - e.stock_before.unwrap_or(0));
    }
    if let Some(r) = e.reserved_after {
        put_ivar(out, r);
    }
    if let (Some(r), false) = (&e.reason, left.standard) {
        put_str(out, r);
    }
    for s in [&e.seller, &e.buyer, &e.remarks, &e.hold_id]
        .into_iter()
        .flatten()
    {
        put_str(out, s);
    }
}

/// The entry's times, relative to the record's `at_ms` and to each other.
#[inline]
fn put_times(out: &mut Vec<u8>, e: &Entry, at_ms: Millis) {
    put_ivar(out, e.completed_at - at_ms);
    put_ivar(out, e.completed_at - e.submitted_at);
    if let Some(x) = e.expires_at {
        put_ivar(out, x - e.completed_at);
    }
    if let Some(t) = e.ttl_ms {
        put_ivar(out, t);
    }
}

/// The rarer fields, each only if its flag is set, then the request's fingerprint.
#[inline]
fn put_tail(out: &mut Vec<u8>, e: &Entry, left: Implied) {
    if let Some(p) = e.log_pos {
        put_ivar(out, i64::from(p.partition));
        put_ivar(out, p.offset);
    }
    if !left.prev_implied {
        put_uvar(out, e.prev_seq.map_or(0, |p| p + 1));
    }
    if let Some(n) = e.per_buyer_max {
        put_ivar(out, n);
    }
    if let Some(sale) = &e.return_of {
        put_str(out, sale);
    }
    for n in [e.qty_asked, e.opens_at, e.closes_at, e.low_stock_at]
        .into_iter()
        .flatten()
    {
        put_ivar(out, n);
    }
    out.extend_from_slice(&fingerprint(e.op, &e.item, e.qty, e.ttl_ms).to_le_bytes());
}

struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

impl Reader<'_> {
    fn byte(&mut self) -> Result<u8, String> {
        let v = *self.b.get(self.at).ok_or("entry runs past the record")?;
        self.at += 1;
        Ok(v)
    }

    fn uvar(&mut self) -> Result<u64, String> {
        let mut v = 0u64;
        for shift in (0..64).step_by(7) {
            let b = self.byte()?;
            v |= u64::from(b & 0x7f) << shift;
            if b < 0x80 {
                return Ok(v);
            }
        }
        Err("varint longer than 64 bits".into())
    }

    fn ivar(&mut self) -> Result<i64, String> {
        let v = self.uvar()?;
        Ok(((v >> 1) as i64) ^ -((v & 1) as i64))
    }

    fn bytes(&mut self, n: usize) -> Result<&[u8], String> {
        let end = self.at.checked_add(n).filter(|e| *e <= self.b.len());
        let end = end.ok_or("entry runs past the record")?;
        let s = &self.b[self.at..end];
        self.at = end;
        Ok(s)
    }

    fn str(&mut self) -> Result<Arc<str>, String> {
        let n = self.uvar()? as usize;
        let s = std::str::from_utf8(self.bytes(n)?).map_err(|_| "a name is not UTF-8")?;
        Ok(Arc::from(s))
    }
}

/// The entries of a record body written by [`encode`], each checked against its
/// fingerprint. An error says what is wrong and at which entry.
pub fn decode(body: &[u8], at_ms: Millis) -> Result<Vec<Entry>, String> {
    let mut r = Reader { b: body, at: 0 };
    let n = r.uvar()? as usize;
    let mut out: Vec<Entry> = Vec::with_capacity(n.min(body.len()));
    for i in 0..n {
        let e = decode_one(&mut r, at_ms, out.last()).map_err(|e| format!("entry {i}: {e}"))?;
        out.push(e);
    }
    if r.at != body.len() {
        return Err(format!("{} bytes after the last entry", body.len() - r.at));
    }
    Ok(out)
}

fn decode_one(r: &mut Reader<'_>, at_ms: Millis, prev: Option<&Entry>) -> Result<Entry, String> {
    let flags = u32::try_from(r.uvar()?).map_err(|_| "flags out of range")?;
    if flags & !F_ALL != 0 {
        return Err(format!("unknown flags {flags:#x}"));
    }
    let has = |f: u32| flags & f != 0;
    let codes = r.byte()?;
    let op = *Op::ALL.get(usize::from(codes & 0x0f)).ok_or("unknown op")?;
    let status = *Status::ALL
        .get(usize::from(codes >> 4))
        .ok_or("unknown status")?;
    let qty = r.ivar()?;
    let (shop, item) = read_names(r, flags, prev)?;
    let request_key = has(F_KEY).then(|| r.str()).transpose()?;
    let seq = has(F_SEQ).then(|| r.uvar()).transpose()?;
    let stock_before = has(F_STOCK_BEFORE).then(|| r.ivar()).transpose()?;
    let stock_after = match has(F_STOCK_AFTER) {
        true => Some(r.ivar()? + stock_before.unwrap_or(0)),
        false => None,
    };
    let reserved_after = has(F_RESERVED).then(|| r.ivar()).transpose()?;
    let reason = read_reason(r, flags, qty, stock_before)?;
    let seller = has(F_SELLER).then(|| r.str()).transpose()?;
    let buyer = has(F_BUYER).then(|| r.str()).transpose()?;
    let remarks = has(F_REMARKS).then(|| r.str()).transpose()?;
    let hold_id = has(F_HOLD_ID).then(|| r.str()).transpose()?;
    let completed_at = at_ms + r.ivar()?;
    let submitted_at = completed_at - r.ivar()?;
    let expires_at = match has(F_EXPIRES) {
        true => Some(completed_at + r.ivar()?),
        false => None,
    };
    let ttl_ms = has(F_TTL).then(|| r.ivar()).transpose()?;
    let log_pos = has(F_LOG_POS).then(|| read_log_pos(r)).transpose()?;
    let prev_seq = if has(F_PREV_SEQ) {
        r.uvar()?.checked_sub(1)
    } else {
        seq.map(|s| s.saturating_sub(1))
    };
    let per_buyer_max = has(F_PER_BUYER).then(|| r.ivar()).transpose()?;
    let return_of = has(F_RETURN_OF).then(|| r.str()).transpose()?;
    let [qty_asked, opens_at, closes_at, low_stock_at] = read_later(r, flags)?;
    check_fingerprint(r, op, &item, qty, ttl_ms)?;
    Ok(Entry {
        request_key,
        reason,
        stock_before,
        stock_after,
        reserved_after,
        seq,
        prev_seq,
        seller,
        buyer,
        remarks,
        hold_id,
        expires_at,
        ttl_ms,
        per_buyer_max,
        return_of,
        qty_asked,
        opens_at,
        closes_at,
        low_stock_at,
        logged: has(F_LOGGED),
        log_pos,
        ..Entry::decided(shop, item, op, qty, submitted_at, completed_at)
    })
    .map(|mut e| {
        e.status = status;
        e
    })
}

/// The fields added since the first version, each if its flag is set: a partial fill's
/// asked `qty`, the item's window bounds and its low-stock level.
#[inline]
fn read_later(r: &mut Reader<'_>, flags: u32) -> Result<[Option<i64>; 4], String> {
    let mut out = [None; 4];
    let later = [F_QTY_ASKED, F_OPENS_AT, F_CLOSES_AT, F_LOW_STOCK_AT];
    for (slot, flag) in out.iter_mut().zip(later) {
        if flags & flag != 0 {
            *slot = Some(r.ivar()?);
        }
    }
    Ok(out)
}

/// The entry's shop and item: written, or the entry before's.
#[inline]
fn read_names(
    r: &mut Reader<'_>,
    flags: u32,
    prev: Option<&Entry>,
) -> Result<(Arc<str>, Arc<str>), String> {
    let has = |f: u32| flags & f != 0;
    let shop = match (has(F_SHOP), prev) {
        (true, _) => r.str()?,
        (false, Some(p)) => p.shop.clone(),
        (false, None) => return Err("the first entry names no shop".into()),
    };
    let item = match (has(F_ITEM), prev) {
        (true, _) => r.str()?,
        (false, Some(p)) => p.item.clone(),
        (false, None) => return Err("the first entry names no item".into()),
    };
    Ok((shop, item))
}

/// The entry's reason: written, or the standard one made again from the quantity and
/// the stock before.
#[inline]
fn read_reason(
    r: &mut Reader<'_>,
    flags: u32,
    qty: i64,
    stock_before: Option<i64>,
) -> Result<Option<String>, String> {
    Ok(if flags & F_REASON_STANDARD != 0 {
        Some(standard_reason(
            qty,
            stock_before.ok_or("standard reason without stock")?,
        ))
    } else if flags & F_REASON != 0 {
        Some(r.str()?.to_string())
    } else {
        None
    })
}

/// Where the entry's request was in the request log.
#[inline]
fn read_log_pos(r: &mut Reader<'_>) -> Result<LogPos, String> {
    Ok(LogPos {
        partition: i32::try_from(r.ivar()?).map_err(|_| "partition out of range")?,
        offset: r.ivar()?,
        // Only a journal shared by several nodes fences by epoch: not kept here.
        epoch: 0,
    })
}

/// Reads the entry's fingerprint and checks it against the request it was decoded as.
#[inline]
fn check_fingerprint(
    r: &mut Reader<'_>,
    op: Op,
    item: &str,
    qty: i64,
    ttl_ms: Option<i64>,
) -> Result<(), String> {
    let fp = u64::from_le_bytes(r.bytes(8)?.try_into().expect("8 bytes"));
    if fp != fingerprint(op, item, qty, ttl_ms) {
        return Err(format!(
            "fingerprint does not match the request (item {item})"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sale(shop: &str, item: &str, key: &str, seq: u64, before: i64, qty: i64) -> Entry {
        Entry {
            request_key: Some(key.into()),
            stock_before: Some(before),
            stock_after: Some(before - qty),
            reserved_after: Some(0),
            seq: Some(seq),
            prev_seq: Some(seq - 1),
            seller: Some("seller-7".into()),
            ..Entry::decided(shop.into(), item.into(), Op::Decrement, qty, 1_000, 1_004)
        }
    }

    fn refusal(key: &str, seq: u64, qty: i64) -> Entry {
        Entry {
            status: Status::InsufficientStock,
            reason: Some(standard_reason(qty, 0)),
            stock_after: Some(0),
            ..sale("shop-1", "sku-hot", key, seq, 0, 0)
        }
        .with_qty(qty)
    }

    trait WithQty {
        fn with_qty(self, qty: i64) -> Self;
    }
    impl WithQty for Entry {
        fn with_qty(mut self, qty: i64) -> Entry {
            self.qty = qty;
            self
        }
    }

    fn same(a: &Entry, b: &Entry) -> bool {
        serde_json::to_value(a).unwrap() == serde_json::to_value(b).unwrap() && a.logged == b.logged
    }

    #[test]
    fn every_field_comes_back() {
        let mut hold = sale("s", "i", "h1", 2, 10, 3);
        hold.op = Op::Hold;
        hold.hold_id = Some("h1".into());
        hold.expires_at = Some(61_004);
        hold.ttl_ms = Some(60_000);
        hold.reserved_after = Some(3);
        hold.buyer = Some("b".into());
        hold.remarks = Some("gift ✓".into());
        let mut unknown = Entry::decided("s".into(), "nope".into(), Op::Decrement, 1, 5, 9);
        unknown.status = Status::UnknownItem;
        unknown.request_key = Some("k".into());
        unknown.reason = Some("item nope is not loaded in this shop".into());
        unknown.logged = true;
        unknown.log_pos = Some(LogPos {
            partition: 3,
            offset: 1 << 40,
            epoch: 0,
        });
        let mut load = sale("t", "i", "~load", 1, 0, -5);
        load.op = Op::Load;
        load.request_key = None;
        load.prev_seq = Some(0);
        load.per_buyer_max = Some(2);
        let odd = Entry {
            prev_seq: Some(7),
            ..sale("s", "i", "odd", 3, 1, 1)
        };
        // An adjustment: a negative quantity, and its reason code kept as it is.
        let mut adjust = sale("s", "i", "adj", 4, 10, 4);
        adjust.op = Op::Adjust;
        adjust.qty = -4;
        adjust.stock_after = Some(6);
        adjust.reason = Some("damage".into());
        // A return, and a return refused: the sale each names comes back.
        let mut ret = sale("s", "i", "ret", 2, 9, 5);
        ret.op = Op::Increment;
        ret.stock_after = Some(11);
        ret.return_of = Some("k1".into());
        let mut ret_refused = sale("s", "i", "ret2", 9, 11, 6);
        ret_refused.op = Op::Increment;
        ret_refused.status = Status::ReturnRefused;
        ret_refused.stock_after = Some(11);
        ret_refused.reason = Some("sale k1 sold 1 and 2 were returned already".into());
        ret_refused.return_of = Some("k1".into());
        // A partial fill: took 2 of the 5 asked.
        let mut partial = sale("s", "i", "part", 10, 2, 2);
        partial.qty_asked = Some(5);
        // An item with a sale window: its bounds come back.
        partial.opens_at = Some(1_795_000_000_000);
        partial.closes_at = Some(1_795_000_600_000);
        partial.low_stock_at = Some(25);
        // A stock alert: no key, the item's next seq, nothing moved.
        let alert = Entry {
            request_key: None,
            op: Op::LowStock,
            low_stock_at: Some(25),
            ..sale("s", "i", "-", 11, 2, 0)
        };
        let entries = vec![
            sale("s", "i", "k1", 1, 10, 1),
            partial,
            alert,
            ret,
            ret_refused,
            hold,
            unknown,
            load,
            refusal("r1", 9, 2),
            odd,
            adjust,
        ];
        let mut body = Vec::new();
        encode(&entries, 1_000, &mut body);
        let back = decode(&body, 1_000).unwrap();
        assert_eq!(back.len(), entries.len());
        for (a, b) in entries.iter().zip(&back) {
            assert!(same(a, b), "{a:?}\n{b:?}");
        }
    }

    #[test]
    fn a_refusal_is_small_and_a_sale_is_under_200_bytes() {
        let mut body = Vec::new();
        encode(
            &[sale(
                "shop-1",
                "sku-hot",
                "0b6f2c1e-3d4a-4c55-9a1b",
                41,
                7,
                1,
            )],
            0,
            &mut body,
        );
        let first = body.len();
        let mut body = Vec::new();
        let entries: Vec<Entry> = (0..100)
            .map(|i| refusal(&format!("0b6f2c1e-3d4a-4c55-{i:04}"), 100 + i, 1))
            .collect();
        encode(&entries, 1_004, &mut body);
        let per_refusal = body.len() / 100;
        eprintln!("a sale alone: {first} bytes; a refusal in a batch: {per_refusal} bytes");
        assert!(first < 200, "a sale took {first} bytes");
        assert!(per_refusal <= 64, "a refusal took {per_refusal} bytes");
    }

    #[test]
    fn a_changed_field_fails_its_fingerprint() {
        let mut body = Vec::new();
        encode(&[sale("s", "item", "k", 1, 5, 2)], 0, &mut body);
        // The qty byte (zigzag 2 = 4) right after the flags varint and op/status byte.
        let flags_len = 2;
        assert_eq!(body[1 + flags_len + 1], 4);
        body[1 + flags_len + 1] = 6;
        let err = decode(&body, 0).unwrap_err();
        assert!(err.contains("fingerprint"), "{err}");
    }
}
