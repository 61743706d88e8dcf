//! Domain types shared by the actors, the ports and their adapters.

use std::sync::Arc;

use serde::{Deserialize, Serialize};

/// The hash of the maps looked up per decision by names and keys callers choose
/// (request keys, shops, items): randomly keyed per map, as std's SipHash is, so a
/// caller cannot pick names that collide, and several times faster on short keys. With
/// std's, hashing was about 10% of the engine benchmark's samples (`cargo bench --bench
/// engine`, stop 38).
pub type KeyHash = ahash::RandomState;

/// Milliseconds since the Unix epoch. Every timestamp nrtxn stores or returns uses it.
pub type Millis = i64;

/// Largest `qty` a single request may carry. Large enough for any real order, small
/// enough that no sum of a batch can overflow an `i64`.
pub const QTY_MAX: i64 = 1_000_000_000;
/// Largest absolute stock an item may be loaded with or grow to through returns.
pub const STOCK_MAX: i64 = 1_000_000_000_000_000;
/// Longest shop, item, seller, buyer, request id or `req_time`, in bytes.
pub const NAME_LEN_MAX: usize = 128;
/// Longest `remarks`, in bytes.
pub const REMARKS_LEN_MAX: usize = 1024;
/// Most items one load call may set.
pub const LOAD_ITEMS_MAX: usize = 10_000;
/// Most entries one batch call may carry.
pub const BATCH_TXNS_MAX: usize = 1_000;
/// Longest a hold may last before it expires: a week covers any payment flow, and a
/// bound keeps the timing wheel's horizon and the pending holds finite.
pub const HOLD_TTL_MAX_MS: i64 = 7 * 24 * 3600 * 1000;
/// Most events one read of an item's event stream returns.
pub const EVENTS_LIMIT_MAX: usize = 1_000;
/// Most items one page of a shop's item list returns.
pub const ITEMS_LIMIT_MAX: usize = 1_000;
/// Items whose name starts with this are nrtxn's own records kept as pseudo-items (an
/// order's record, say), not a shop's stock: the item list leaves them out.
pub const INTERNAL_ITEM_PREFIX: char = '~';
/// The greatest name below every name after the internal ones: names are UTF-8 without
/// control characters, so every `~` name sorts below U+007F (a control character, never
/// a name) and every name after them (first byte 0x80 or more) above it. A list that
/// meets an internal name goes on after this bound.
pub const INTERNAL_ITEMS_END: &str = "\u{7f}";
/// Prefix of the request key under which a hold's one ending (confirm, cancel or
/// expiry) is journaled: a hold ends once, so the at-most-once rule on keys is what
/// makes a second confirm answer the first, and a confirm after an expiry answer the
/// expiry. Callers' keys may not start with `~`.
pub const HOLD_END_PREFIX: &str = "~end:";

/// The request key of the ending of hold `hold_id`.
pub fn hold_end_key(hold_id: &str) -> Arc<str> {
    key_of(HOLD_END_PREFIX, hold_id, None)
}

/// `prefix` then `id`, then `:` and `n` when given: the internal keys, built without
/// the formatting machinery, which was 3% of the engine threads' time on `orders` (each
/// line's key is built a few times per order; `docs/decisions/orders.md`).
fn key_of(prefix: &str, id: &str, n: Option<usize>) -> Arc<str> {
    let mut key = String::with_capacity(prefix.len() + id.len() + 21);
    key.push_str(prefix);
    key.push_str(id);
    if let Some(n) = n {
        key.push(':');
        push_digits(&mut key, n);
    }
    Arc::from(key)
}

/// Appends `n` in decimal.
fn push_digits(s: &mut String, mut n: usize) {
    let mut digits = [0u8; 20];
    let mut at = digits.len();
    loop {
        at -= 1;
        digits[at] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    s.extend(digits[at..].iter().map(|&d| char::from(d)));
}

/// Prefix of the items that keep a shop's order records ([`order_item`]).
pub const ORDER_ITEM_PREFIX: &str = "~orders/";
/// Order items per shop: an order's record goes to one of them by a hash of its id, so
/// a shop's orders spread over shards while its order items stay few.
pub const ORDER_ITEMS: usize = 16;
/// Prefix of the hold id of an order's line: `~line:{order_id}:{index}`.
pub const LINE_PREFIX: &str = "~line:";
/// Prefix of a transfer's hold on its `from` item ([`crate::transfers`]): `~xfer:{id}`.
pub const TRANSFER_PREFIX: &str = "~xfer:";
/// Prefix of a transfer's credit of its `to` item: `~xfer-in:{id}`. Another prefix, not
/// a suffix: an id may hold any character a key may, so no suffix tells the two apart.
pub const TRANSFER_CREDIT_PREFIX: &str = "~xfer-in:";

/// The hold id (and request key) of transfer `id`'s hold on its `from` item.
pub fn transfer_hold_key(id: &str) -> Arc<str> {
    key_of(TRANSFER_PREFIX, id, None)
}

/// The request key of transfer `id`'s credit of its `to` item.
pub fn transfer_credit_key(id: &str) -> Arc<str> {
    key_of(TRANSFER_CREDIT_PREFIX, id, None)
}

/// The transfer a key or hold id belongs to, if it is one of a transfer's.
pub fn transfer_of(key: &str) -> Option<&str> {
    key.strip_prefix(TRANSFER_PREFIX)
        .or_else(|| key.strip_prefix(TRANSFER_CREDIT_PREFIX))
}

/// The shard of an item among `shards`: a fixed hash of shop and item, so one item always
/// has one writer for the life of the process (also which of the order items keeps an
/// order's record).
pub fn shard_of(shop: &str, item: &str, shards: usize) -> usize {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    shop.hash(&mut h);
    item.hash(&mut h);
    (h.finish() % shards.max(1) as u64) as usize
}

/// The item that keeps the record of order `order_id` of `shop`.
pub fn order_item(shop: &str, order_id: &str) -> Arc<str> {
    let mut item = String::with_capacity(ORDER_ITEM_PREFIX.len() + 2);
    item.push_str(ORDER_ITEM_PREFIX);
    push_digits(&mut item, shard_of(shop, order_id, ORDER_ITEMS));
    Arc::from(item)
}

/// Whether `item` keeps order records rather than stock.
pub fn is_order_item(item: &str) -> bool {
    item.starts_with(ORDER_ITEM_PREFIX)
}

/// The hold id (and request key) of line `index` of order `order_id`.
pub fn line_key(order_id: &str, index: usize) -> Arc<str> {
    key_of(LINE_PREFIX, order_id, Some(index))
}

/// Added to a line's index in its key when the line is held a second time: its first
/// hold (under [`line_key`]) was released when the order's parallel attempt met
/// contention, and a key is decided once (see `crate::orders`).
pub const LINE_RETRY: usize = 1 << 20;

/// The hold id of line `index` of order `order_id` held a second time ([`LINE_RETRY`]).
pub fn retry_line_key(order_id: &str, index: usize) -> Arc<str> {
    line_key(order_id, LINE_RETRY + index)
}

/// The order a hold id belongs to and its line index, if it is an order's line.
pub fn order_of_line(hold_id: &str) -> Option<(&str, usize)> {
    let rest = hold_id.strip_prefix(LINE_PREFIX)?;
    let (order_id, index) = rest.rsplit_once(':')?;
    Some((order_id, index.parse().ok()?))
}

/// The wall clock in [`Millis`].
pub fn now_ms() -> Millis {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as Millis)
        .unwrap_or(0)
}

/// What a change does to an item.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[serde(rename_all = "snake_case")]
pub enum Op {
    /// A sale: takes `qty` from the available stock, only if that much is available.
    Decrement,
    /// A return: gives `qty` back. Applied ahead of waiting decrements.
    Increment,
    /// An operator's load: sets the available stock to `qty`, creating the item.
    Load,
    /// A hold: moves `qty` from the available stock to `reserved`, only if that much is
    /// available, until it is confirmed, cancelled or expires.
    Hold,
    /// A hold confirmed: its reserved quantity is sold.
    Confirm,
    /// A hold cancelled: its reserved quantity returns to the stock.
    Release,
    /// A hold that reached `expires_at` unconfirmed: its quantity returns to the stock.
    Expire,
    /// An operator's relative change with a reason (`restock`, `damage`, ...): adds
    /// `qty`, which may be negative, never taking the stock below 0.
    Adjust,
    /// An order's record ([`crate::orders`]): journaled on the shop's order item
    /// [`order_item`] before any line is held, as a hold of that item whose `qty` is the
    /// number of lines; its endings are the order's. Changes no stock.
    Order,
    /// An order's line hold made firm: the order it belongs to is held, so the line no
    /// longer counts as tentative on its item. Never journaled.
    Firm,
    /// A pending hold (or order record or line) given longer, as a shop's check-back
    /// answered ([`crate::checkback`]): its new `expires_at` is `submitted_at + ttl_ms`.
    /// Changes no stock.
    Extend,
    /// The item's available stock reached 0 with the entry before: a stock alert
    /// ([`crate::apply::crossing`]), journaled by the processor right after the change
    /// that crossed, with the next seq. Changes no stock; answers no request.
    SoldOut,
    /// The item's available stock fell from above its `low_stock_at` to at or below it
    /// (and not to 0, which is [`Op::SoldOut`]). A stock alert, as `SoldOut`.
    LowStock,
    /// The item's available stock rose from 0. A stock alert, as `SoldOut`.
    BackInStock,
    /// An operator released every pending hold of the item (and cancelled every held
    /// order with a line on it) under this entry's key ([`crate::release`]): journaled
    /// once they are, with their counts (`qty` the holds, `reason` both, as JSON).
    /// Changes no stock.
    ReleaseHolds,
}

impl Op {
    /// Every op, in a fixed order (the journal log's codes are positions in it).
    pub const ALL: [Op; 15] = [
        Op::Decrement,
        Op::Increment,
        Op::Load,
        Op::Hold,
        Op::Confirm,
        Op::Release,
        Op::Expire,
        Op::Adjust,
        Op::Order,
        Op::Firm,
        Op::Extend,
        Op::SoldOut,
        Op::LowStock,
        Op::BackInStock,
        Op::ReleaseHolds,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Op::Decrement => "decrement",
            Op::Increment => "increment",
            Op::Load => "load",
            Op::Hold => "hold",
            Op::Confirm => "confirm",
            Op::Release => "release",
            Op::Expire => "expire",
            Op::Adjust => "adjust",
            Op::Order => "order",
            Op::Firm => "firm",
            Op::Extend => "extend",
            Op::SoldOut => "sold_out",
            Op::LowStock => "low_stock",
            Op::BackInStock => "back_in_stock",
            Op::ReleaseHolds => "release_holds",
        }
    }

    /// Whether this op is a stock alert: an entry the processor journals after a change
    /// that crossed one of the item's levels, not a request's.
    pub fn is_alert(self) -> bool {
        matches!(self, Op::SoldOut | Op::LowStock | Op::BackInStock)
    }

    /// Whether this op ends a hold (and so names one in [`Request::hold_id`]).
    pub fn ends_hold(self) -> bool {
        matches!(self, Op::Confirm | Op::Release | Op::Expire)
    }

    pub fn parse(s: &str) -> Option<Op> {
        match s {
            "decrement" => Some(Op::Decrement),
            "increment" => Some(Op::Increment),
            "load" => Some(Op::Load),
            "hold" => Some(Op::Hold),
            "confirm" => Some(Op::Confirm),
            "release" => Some(Op::Release),
            "expire" => Some(Op::Expire),
            "adjust" => Some(Op::Adjust),
            "order" => Some(Op::Order),
            "firm" => Some(Op::Firm),
            "extend" => Some(Op::Extend),
            "sold_out" => Some(Op::SoldOut),
            "low_stock" => Some(Op::LowStock),
            "back_in_stock" => Some(Op::BackInStock),
            "release_holds" => Some(Op::ReleaseHolds),
            _ => None,
        }
    }
}

/// The decision about one request.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    Ok,
    InsufficientStock,
    UnknownItem,
    Expired,
    /// A return that would push stock past [`STOCK_MAX`]. Not reachable with loads and
    /// quantities inside their limits short of billions of returns, but an outcome
    /// rather than an overflow all the same.
    LimitExceeded,
    /// A confirm or cancel of a hold that does not exist.
    UnknownHold,
    /// A conditional load (`if_seq`) of an item whose seq is no longer the one given:
    /// nothing changed, nothing was journaled.
    SeqMoved,
    /// A sale or hold that would take its buyer past the item's `per_buyer_max`, or
    /// that names no buyer on an item with one ([`crate::ledger`]).
    BuyerLimit,
    /// An order's line that finds too little stock available, but enough once the
    /// lines of orders still being reserved are counted back: it waits for them rather
    /// than being refused ([`crate::orders`]). Never journaled, never a caller's answer.
    Tentative,
    /// A return (an increment naming `return_of`) refused: the sale it names is unknown,
    /// not yet decided, not an `ok` sale of this item, past the return window, or has
    /// fewer units left to return than asked ([`crate::returns`]). Nothing changes.
    ReturnRefused,
    /// A sale or hold decided before its item's sale window opens (`opens_at`).
    NotOpen,
    /// A sale or hold decided at or after its item's sale window closes (`closes_at`).
    Closed,
}

impl Status {
    /// Every status, in a fixed order (the journal log's codes are positions in it).
    pub const ALL: [Status; 12] = [
        Status::Ok,
        Status::InsufficientStock,
        Status::UnknownItem,
        Status::Expired,
        Status::LimitExceeded,
        Status::UnknownHold,
        Status::SeqMoved,
        Status::BuyerLimit,
        Status::Tentative,
        Status::ReturnRefused,
        Status::NotOpen,
        Status::Closed,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Status::Ok => "ok",
            Status::InsufficientStock => "insufficient_stock",
            Status::UnknownItem => "unknown_item",
            Status::Expired => "expired",
            Status::LimitExceeded => "limit_exceeded",
            Status::UnknownHold => "unknown_hold",
            Status::SeqMoved => "seq_moved",
            Status::BuyerLimit => "buyer_limit",
            Status::Tentative => "tentative",
            Status::ReturnRefused => "return_refused",
            Status::NotOpen => "not_open",
            Status::Closed => "closed",
        }
    }

    pub fn parse(s: &str) -> Option<Status> {
        match s {
            "ok" => Some(Status::Ok),
            "insufficient_stock" => Some(Status::InsufficientStock),
            "unknown_item" => Some(Status::UnknownItem),
            "expired" => Some(Status::Expired),
            "limit_exceeded" => Some(Status::LimitExceeded),
            "unknown_hold" => Some(Status::UnknownHold),
            "seq_moved" => Some(Status::SeqMoved),
            "buyer_limit" => Some(Status::BuyerLimit),
            "tentative" => Some(Status::Tentative),
            "return_refused" => Some(Status::ReturnRefused),
            "not_open" => Some(Status::NotOpen),
            "closed" => Some(Status::Closed),
            _ => None,
        }
    }
}

/// Where a request sits in the request log (a Kafka partition and offset), so that its
/// journal entry records how far the log has been applied, and the epoch under which
/// this node read it.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
pub struct LogPos {
    pub partition: i32,
    pub offset: i64,
    /// The partition's assignment epoch when the request was read: it changes each time
    /// a node is (re)assigned the partition. An item whose state was read under an older
    /// epoch is read again from the journal before it is applied, and a journal shared by
    /// several nodes refuses entries whose epoch is no longer the partition's lease
    /// ([`crate::ports::Leases`]). 0: no leases (a journal only this node writes).
    #[serde(default)]
    pub epoch: u64,
}

/// A validated stock change on its way to the item's processor.
///
/// Serializable because the request log may have to keep it durably (a fire-and-forget
/// request survives a crash in the embedded store, or travels through Kafka).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct Request {
    pub shop: Arc<str>,
    pub item: Arc<str>,
    /// `request_id` when the caller gave one, else `{seller}:{item}:{req_time}`.
    pub key: Arc<str>,
    pub op: Op,
    pub qty: i64,
    /// Stamped by the front on arrival; the request TTL counts from here.
    pub submitted_at: Millis,
    pub seller: Option<Arc<str>>,
    pub buyer: Option<Arc<str>>,
    pub remarks: Option<Arc<str>>,
    /// The hold a confirm, cancel or expiry ends (its key is then
    /// [`hold_end_key`]`(hold_id)`); a hold's own id is its request key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hold_id: Option<Arc<str>>,
    /// How long a hold lasts from its decision, in ms (holds only; 0 otherwise).
    #[serde(default)]
    pub ttl_ms: i64,
    /// Loads only: apply only if the item's seq is still this (an unknown item's is 0),
    /// else answer [`Status::SeqMoved`] and change nothing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub if_seq: Option<u64>,
    /// An adjustment's reason code from the operator, or an order record's lines (as
    /// JSON, written by the engine); kept as the entry's `reason`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<Arc<str>>,
    /// Loads only: the item's new per-buyer limit (0 lifts it; `None` leaves it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub per_buyer_max: Option<i64>,
    /// A hold's ending decided by its shop's check-back ([`crate::checkback`]): it
    /// stands even though the hold is past its `expires_at` (a caller's confirm that
    /// late is an expiry).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub by_check: bool,
    /// Increments only: the request key of the sale (an `ok` decrement of the same item)
    /// this increment returns. The processor checks it against what the journal holds of
    /// that sale ([`crate::returns`]); a seller's increment must carry it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub return_of: Option<Arc<str>>,
    /// Loads only: the item's sale window's new bounds (ms since the epoch; 0 clears a
    /// bound, `None` leaves it), see [`ItemState::opens_at`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub opens_at: Option<Millis>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub closes_at: Option<Millis>,
    /// Loads only: the item's new low-stock level (0 clears it, `None` leaves it), see
    /// [`ItemState::low_stock_at`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub low_stock_at: Option<i64>,
    /// Sales and holds only: take as much of `qty` as is available, down to this many
    /// (a partial fill), instead of all of `qty` or nothing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_qty: Option<i64>,
    /// Order lines only: a line that would wait for other orders' tentative lines is
    /// answered [`Status::Tentative`] at once instead (the first, parallel attempt of an
    /// order's reserving, which never waits: see `crate::orders`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub no_wait: bool,
    /// True when the request log holds this request durably (fire-and-forget), so its
    /// record there is retired in the same write that journals its outcome.
    #[serde(default)]
    pub logged: bool,
    /// Set by a log reader when the request came through a partitioned log.
    #[serde(skip)]
    pub log_pos: Option<LogPos>,
    /// The node whose WorkManager holds the reply handle, set by a log reader when
    /// several nodes share the log; `None` is this node.
    #[serde(skip)]
    pub origin: Option<u32>,
    /// Told the outcome before it is durable, once it is handed to a journal that
    /// writes appends in order ([`EarlySignal`]); not part of the request's content.
    #[serde(skip)]
    pub early: EarlySignal,
}

/// Where a processor tells a request's outcome as soon as it has handed the outcome to
/// a journal that writes every append after those handed to it before
/// ([`crate::ports::JournalWrite::appends_in_order`]): not durable yet, but whatever
/// the caller sends on hearing it is written after it, so no crash keeps what follows
/// and loses the outcome. An order's ending uses it to end its lines without waiting
/// for the record's sync (`crate::orders`). A request that is not decided that way (a
/// repeat, a refusal that writes nothing, a journal that does not keep the order)
/// drops it unsent, and its caller waits for the durable outcome as usual.
///
/// Not part of the request's content: it is neither serialized nor compared.
#[derive(Clone, Default)]
pub struct EarlySignal(Option<Arc<std::sync::Mutex<Option<EarlySender>>>>);

pub(crate) type EarlySender = tokio::sync::oneshot::Sender<Arc<Outcome>>;

impl EarlySignal {
    /// A signal and where its outcome arrives.
    pub fn channel() -> (EarlySignal, tokio::sync::oneshot::Receiver<Arc<Outcome>>) {
        let (tx, rx) = tokio::sync::oneshot::channel();
        (
            EarlySignal(Some(Arc::new(std::sync::Mutex::new(Some(tx))))),
            rx,
        )
    }

    /// The sender, taken out: whoever takes it first tells the outcome or, dropping
    /// it, that none will come early.
    pub(crate) fn take(&self) -> Option<EarlySender> {
        self.0.as_ref()?.lock().ok()?.take()
    }
}

impl std::fmt::Debug for EarlySignal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() {
            "EarlySignal(set)"
        } else {
            "EarlySignal(none)"
        })
    }
}

impl PartialEq for EarlySignal {
    /// Requests compare by content, which the signal is not.
    fn eq(&self, _: &EarlySignal) -> bool {
        true
    }
}

impl Request {
    /// A request with no caller details, hold fields or log position: the fields every
    /// request has, for callers to add the rest with struct update syntax.
    pub fn new(
        shop: Arc<str>,
        item: Arc<str>,
        key: Arc<str>,
        op: Op,
        qty: i64,
        submitted_at: Millis,
    ) -> Request {
        Request {
            shop,
            item,
            key,
            op,
            qty,
            submitted_at,
            seller: None,
            buyer: None,
            remarks: None,
            hold_id: None,
            ttl_ms: 0,
            if_seq: None,
            reason: None,
            per_buyer_max: None,
            by_check: false,
            return_of: None,
            min_qty: None,
            opens_at: None,
            closes_at: None,
            low_stock_at: None,
            no_wait: false,
            logged: false,
            log_pos: None,
            origin: None,
            early: EarlySignal::default(),
        }
    }

    /// The assignment epoch of the partition the request was read from (see
    /// [`LogPos::epoch`]); 0 when it did not come through a partitioned log.
    pub fn epoch(&self) -> u64 {
        self.log_pos.map_or(0, |p| p.epoch)
    }

    /// Why this request cannot be a repeat of the one that first used its key, whose
    /// outcome is `first`: a different kind or op, item, quantity or (holds) TTL. `None`
    /// when it is an exact repeat, which is answered with `first`. The endings of holds
    /// are not compared: their keys are nrtxn's own, and a confirm answered with an
    /// expiry is the hold's rule, not a reused key.
    pub fn reuse_conflict(&self, first: &Outcome) -> Option<String> {
        if self.op.ends_hold() || first.op.ends_hold() {
            return None;
        }
        if self.op != first.op {
            return Some(format!(
                "op {}, not {}",
                first.op.as_str(),
                self.op.as_str()
            ));
        }
        if self.op == Op::Order && self.reason.as_deref() != first.reason.as_deref() {
            return Some("other lines".to_string());
        }
        if self.item != first.item {
            return Some(format!("item {}, not {}", first.item, self.item));
        }
        if self.qty != first.qty {
            let what = match self.op {
                Op::Load => "stock",
                Op::Adjust => "delta",
                _ => "qty",
            };
            return Some(format!("{what} {}, not {}", first.qty, self.qty));
        }
        match first.ttl_ms {
            Some(ttl) if matches!(self.op, Op::Hold | Op::Order) && ttl != self.ttl_ms => {
                Some(format!("ttl_ms {ttl}, not {}", self.ttl_ms))
            }
            _ => None,
        }
    }
}

/// The durable state of one item.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct ItemState {
    /// Available stock: never negative.
    pub stock: i64,
    /// Stock set aside by holds (always 0 until holds exist).
    pub reserved: i64,
    /// Sequence number of the item's last journal entry; 0 before the first.
    pub seq: u64,
    /// The sale window (ms since the epoch, 0: no bound): a sale or hold is served from
    /// `opens_at` on and before `closes_at`, else refused [`Status::NotOpen`] or
    /// [`Status::Closed`]. Set by loads; returns and operators' changes ignore it.
    #[serde(default)]
    pub opens_at: Millis,
    #[serde(default)]
    pub closes_at: Millis,
    /// The level at or below which the available stock is low (0: none): a change that
    /// takes it there from above is followed by an [`Op::LowStock`] alert. Set by loads.
    #[serde(default)]
    pub low_stock_at: i64,
}

impl ItemState {
    /// The state with the terms a load sets changed as it asks (`None`: kept, 0:
    /// cleared).
    pub fn with_terms(self, change: LoadTerms) -> ItemState {
        ItemState {
            opens_at: change.opens_at.unwrap_or(self.opens_at),
            closes_at: change.closes_at.unwrap_or(self.closes_at),
            low_stock_at: change.low_stock_at.unwrap_or(self.low_stock_at),
            ..self
        }
    }

    /// Why a sale or hold decided at `now` is outside the item's window, if it is.
    pub fn outside_window(&self, now: Millis) -> Option<(Status, String)> {
        if self.opens_at > 0 && now < self.opens_at {
            return Some((
                Status::NotOpen,
                format!("the sale opens at {} (ms since the epoch)", self.opens_at),
            ));
        }
        if self.closes_at > 0 && now >= self.closes_at {
            return Some((
                Status::Closed,
                format!("the sale closed at {} (ms since the epoch)", self.closes_at),
            ));
        }
        None
    }
}

/// What a load does to its item's terms besides the stock: the sale window's bounds (ms
/// since the epoch) and the low-stock level, each set, cleared (0), or left as it is
/// (`None`).
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct LoadTerms {
    pub opens_at: Option<Millis>,
    pub closes_at: Option<Millis>,
    pub low_stock_at: Option<i64>,
}

impl LoadTerms {
    /// Leaves the terms as they are.
    pub const KEEP: LoadTerms = LoadTerms {
        opens_at: None,
        closes_at: None,
        low_stock_at: None,
    };
}

/// A window bound as the API shows it: `None` (JSON `null`) when unset.
pub fn bound(at: Millis) -> Option<Millis> {
    (at > 0).then_some(at)
}

/// An item as the API shows it.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct ItemView {
    pub shop: Arc<str>,
    pub item: Arc<str>,
    pub stock: i64,
    pub reserved: i64,
    pub seq: u64,
    /// The sale window's bounds, `null` when unset ([`ItemState::opens_at`]).
    #[serde(default)]
    pub opens_at: Option<Millis>,
    #[serde(default)]
    pub closes_at: Option<Millis>,
    /// The low-stock level, `null` when unset ([`ItemState::low_stock_at`]).
    #[serde(default)]
    pub low_stock_at: Option<i64>,
}

impl ItemView {
    /// Item `item` of `shop` in state `st`.
    pub fn of(shop: Arc<str>, item: Arc<str>, st: ItemState) -> ItemView {
        ItemView {
            shop,
            item,
            stock: st.stock,
            reserved: st.reserved,
            seq: st.seq,
            opens_at: bound(st.opens_at),
            closes_at: bound(st.closes_at),
            low_stock_at: bound(st.low_stock_at),
        }
    }
}

/// One journal entry: a decided request, or an item load. The journal is the record of
/// every decision; an outcome is read back from it by request key.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct Entry {
    pub shop: Arc<str>,
    pub item: Arc<str>,
    /// `None` for loads, which are answered to the operator and not polled by key.
    pub request_key: Option<Arc<str>>,
    pub op: Op,
    pub qty: i64,
    pub status: Status,
    pub reason: Option<String>,
    /// `None` when the item is unknown (and so has no state and no sequence).
    pub stock_before: Option<i64>,
    pub stock_after: Option<i64>,
    pub reserved_after: Option<i64>,
    pub seq: Option<u64>,
    pub prev_seq: Option<u64>,
    pub submitted_at: Millis,
    pub completed_at: Millis,
    pub seller: Option<Arc<str>>,
    pub buyer: Option<Arc<str>>,
    pub remarks: Option<Arc<str>>,
    /// The hold this entry creates (its request key) or ends.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hold_id: Option<Arc<str>>,
    /// When the hold this entry creates expires (ms since the epoch).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_at: Option<Millis>,
    /// A hold request's `ttl_ms`, held or refused: part of what the request key was
    /// first used with (see [`Request::reuse_conflict`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttl_ms: Option<i64>,
    /// Loads only: the per-buyer limit the load set (0: lifted); `None` left it as it
    /// was ([`crate::ledger`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub per_buyer_max: Option<i64>,
    /// A return's sale (its request key): an `ok` entry with it adds `qty` to the units
    /// returned against that sale, which the journal keeps ([`crate::returns`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub return_of: Option<Arc<str>>,
    /// The item's sale window after the entry ([`ItemState::opens_at`]), each bound only
    /// when set: every entry of an item with a window carries it, so that states made
    /// from entries keep it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub opens_at: Option<Millis>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub closes_at: Option<Millis>,
    /// The item's low-stock level after the entry, only when set (as the window).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub low_stock_at: Option<i64>,
    /// A partial fill ([`Request::min_qty`]): the `qty` the request asked for, when the
    /// entry's `qty`, what it took, is less. Every reader of the stock's movement reads
    /// `qty`; the caller is shown both ([`Outcome::qty_taken`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub qty_asked: Option<i64>,
    /// Mirrors [`Request::logged`]: the adapter retires the request log's record.
    #[serde(skip)]
    pub logged: bool,
    /// Mirrors [`Request::log_pos`]: stored as `partition` and `offset`.
    #[serde(flatten, default, skip_serializing_if = "Option::is_none")]
    pub log_pos: Option<LogPos>,
    /// Mirrors [`Request::origin`]: where the outcome is answered. Not stored.
    #[serde(skip)]
    pub origin: Option<u32>,
}

impl Entry {
    /// An `ok` entry with no state, key or caller details yet: the apply step fills in
    /// what its decision found.
    pub fn decided(
        shop: Arc<str>,
        item: Arc<str>,
        op: Op,
        qty: i64,
        submitted_at: Millis,
        completed_at: Millis,
    ) -> Entry {
        Entry {
            shop,
            item,
            request_key: None,
            op,
            qty,
            status: Status::Ok,
            reason: None,
            stock_before: None,
            stock_after: None,
            reserved_after: None,
            seq: None,
            prev_seq: None,
            submitted_at,
            completed_at,
            seller: None,
            buyer: None,
            remarks: None,
            hold_id: None,
            expires_at: None,
            ttl_ms: None,
            per_buyer_max: None,
            return_of: None,
            opens_at: None,
            closes_at: None,
            low_stock_at: None,
            qty_asked: None,
            logged: false,
            log_pos: None,
            origin: None,
        }
    }

    /// An `ok` entry answering `req`, carrying its key, caller details and log position;
    /// the apply step fills in the states its decision found.
    pub fn of_request(req: &Request, now: Millis) -> Entry {
        Entry {
            request_key: Some(req.key.clone()),
            seller: req.seller.clone(),
            buyer: req.buyer.clone(),
            remarks: req.remarks.clone(),
            hold_id: req.hold_id.clone(),
            ttl_ms: matches!(req.op, Op::Hold | Op::Order).then_some(req.ttl_ms),
            reason: req.reason.as_deref().map(str::to_owned),
            return_of: req.return_of.clone(),
            logged: req.logged,
            log_pos: req.log_pos,
            origin: req.origin,
            ..Entry::decided(
                req.shop.clone(),
                req.item.clone(),
                req.op,
                req.qty,
                req.submitted_at,
                now,
            )
        }
    }

    /// The item's state after this entry, when the item exists.
    pub fn state_after(&self) -> Option<ItemState> {
        Some(ItemState {
            stock: self.stock_after?,
            reserved: self.reserved_after?,
            seq: self.seq?,
            opens_at: self.opens_at.unwrap_or(0),
            closes_at: self.closes_at.unwrap_or(0),
            low_stock_at: self.low_stock_at.unwrap_or(0),
        })
    }

    /// What the request asked for: `qty`, or more for a partial fill.
    pub fn asked(&self) -> i64 {
        self.qty_asked.unwrap_or(self.qty)
    }

    /// What a sale or hold took of the stock (`None` for other ops): its `qty` when `ok`
    /// (less than asked for a partial fill), else 0.
    pub fn taken(&self) -> Option<i64> {
        matches!(self.op, Op::Decrement | Op::Hold).then_some(if self.status == Status::Ok {
            self.qty
        } else {
            0
        })
    }

    /// The caller-facing outcome, for entries that answer a request key.
    pub fn outcome(&self) -> Option<Outcome> {
        Some(Outcome {
            shop: self.shop.clone(),
            request_key: self.request_key.clone()?,
            status: self.status,
            reason: self.reason.clone(),
            item: self.item.clone(),
            op: self.op,
            qty: self.asked(),
            qty_taken: self.taken(),
            stock_before: self.stock_before,
            stock_after: self.stock_after,
            seq: self.seq,
            prev_seq: self.prev_seq,
            submitted_at: self.submitted_at,
            completed_at: self.completed_at,
            hold_id: self.hold_id.clone(),
            expires_at: self.expires_at,
            ttl_ms: self.ttl_ms,
            reserved_after: load_only(self.op, self.reserved_after),
            seller: self.seller.clone(),
            buyer: self.buyer.clone(),
            requested_at: self.submitted_at,
            opens_at: self.opens_at,
            closes_at: self.closes_at,
            low_stock_at: self.low_stock_at,
        })
    }

    /// The entry as an event of its item's stream (`None` for an unknown item's
    /// decision, which has no sequence).
    pub fn event(&self) -> Option<Event> {
        Some(Event {
            shop: self.shop.clone(),
            item: self.item.clone(),
            seq: self.seq?,
            prev_seq: self.prev_seq?,
            kind: self.op,
            status: self.status,
            request_key: self.request_key.clone(),
            qty: self.asked(),
            qty_taken: self.taken(),
            stock_after: self.stock_after?,
            reserved_after: self.reserved_after?,
            at: self.completed_at,
            hold_id: self.hold_id.clone(),
            reason: self.reason.clone().filter(|_| self.op == Op::Adjust),
            order_id: order_id_of(
                &self.item,
                self.hold_id.as_deref(),
                self.request_key.as_deref(),
            ),
            transfer_id: self
                .hold_id
                .as_deref()
                .or(self.request_key.as_deref())
                .and_then(transfer_of)
                .map(Into::into),
            seller: self.seller.clone(),
            buyer: self.buyer.clone(),
            requested_at: self.submitted_at,
            opens_at: self.opens_at,
            closes_at: self.closes_at,
            low_stock_at: self.low_stock_at,
        })
    }
}

/// The order an entry of `item` about hold `hold_id`, under `request_key`, belongs to:
/// an order's line (held, refused or ended), or its record on an order item.
pub fn order_id_of(
    item: &str,
    hold_id: Option<&str>,
    request_key: Option<&str>,
) -> Option<Arc<str>> {
    if let (true, Some(id)) = (is_order_item(item), hold_id) {
        return Some(id.into());
    }
    // A line's hold names it; a line refused has no hold, but its key is the line's.
    hold_id
        .and_then(order_of_line)
        .or_else(|| request_key.and_then(order_of_line))
        .map(|(order, _)| order.into())
}

/// One change of an item, as its sequenced event stream shows it: every journal entry of
/// a known item is one, accepted or not, so `seq` is gapless and `prev_seq = seq - 1`.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct Event {
    pub shop: Arc<str>,
    pub item: Arc<str>,
    pub seq: u64,
    pub prev_seq: u64,
    /// What the change was (`decrement`, `increment`, `load`, `hold`, `confirm`,
    /// `release`, `expire`, `adjust`).
    pub kind: Op,
    /// Its decision: a rejected request is still an event (it took a sequence number).
    pub status: Status,
    pub request_key: Option<Arc<str>>,
    /// What the request asked for.
    pub qty: i64,
    /// Sales and holds only: what they took (`qty`, less for a partial fill, 0 when
    /// refused).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub qty_taken: Option<i64>,
    pub stock_after: i64,
    pub reserved_after: i64,
    /// When it was decided (ms since the epoch).
    pub at: Millis,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hold_id: Option<Arc<str>>,
    /// Adjustments only: the operator's reason code (`restock`, `damage`, ...).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// The order this change belongs to: the hold or ending of one of its lines.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub order_id: Option<Arc<str>>,
    /// The transfer this change is a side of: its hold, credit or ending.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transfer_id: Option<Arc<str>>,
    /// The seller and the buyer the change's request named, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seller: Option<Arc<str>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub buyer: Option<Arc<str>>,
    /// When nrtxn accepted the change's request (ms since the epoch); `at` is when it
    /// was decided.
    #[serde(default)]
    pub requested_at: Millis,
    /// The item's sale window after the change, each bound only when set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub opens_at: Option<Millis>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub closes_at: Option<Millis>,
    /// The item's low-stock level after the change, only when set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub low_stock_at: Option<i64>,
}

/// What a caller is told about a request. Field names are the HTTP API's.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct Outcome {
    pub shop: Arc<str>,
    pub request_key: Arc<str>,
    pub status: Status,
    pub reason: Option<String>,
    pub item: Arc<str>,
    pub op: Op,
    /// What the request asked for.
    pub qty: i64,
    /// Sales and holds only: what they took of the stock (`qty`, less for a partial fill
    /// with `min_qty`, 0 when refused).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub qty_taken: Option<i64>,
    pub stock_before: Option<i64>,
    pub stock_after: Option<i64>,
    pub seq: Option<u64>,
    pub prev_seq: Option<u64>,
    pub submitted_at: Millis,
    pub completed_at: Millis,
    /// Holds only: the hold created or ended, and when a created one expires.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hold_id: Option<Arc<str>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_at: Option<Millis>,
    /// Holds only: the `ttl_ms` the hold was asked for (held or refused).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttl_ms: Option<i64>,
    /// Loads only: the item's `reserved` after the load (held stock stays held), so a
    /// load answered through the log can show the item whole.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reserved_after: Option<i64>,
    /// Who asked: the seller and the buyer the request named (left out when it named
    /// none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seller: Option<Arc<str>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub buyer: Option<Arc<str>>,
    /// When nrtxn accepted the request (ms since the epoch): the instant `submitted_at`
    /// names too, under the name the design's response gives it, beside `completed_at`.
    #[serde(default)]
    pub requested_at: Millis,
    /// The item's sale window, each bound only when set (a `not_open` or `closed`
    /// answer says it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub opens_at: Option<Millis>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub closes_at: Option<Millis>,
    /// The item's low-stock level after the change, only when set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub low_stock_at: Option<i64>,
}

impl Outcome {
    /// What a sale or hold took (`qty_taken`), else its `qty`: a hold's quantity held.
    pub fn taken_or_qty(&self) -> i64 {
        self.qty_taken.unwrap_or(self.qty)
    }
}

/// An outcome's `reserved_after`: kept for loads only.
pub fn load_only(op: Op, reserved_after: Option<i64>) -> Option<i64> {
    reserved_after.filter(|_| op == Op::Load)
}

/// Where a hold stands.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum HoldStatus {
    Held,
    Confirmed,
    Released,
    Expired,
}

impl HoldStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            HoldStatus::Held => "held",
            HoldStatus::Confirmed => "confirmed",
            HoldStatus::Released => "released",
            HoldStatus::Expired => "expired",
        }
    }

    pub fn parse(s: &str) -> Option<HoldStatus> {
        match s {
            "held" => Some(HoldStatus::Held),
            "confirmed" => Some(HoldStatus::Confirmed),
            "released" => Some(HoldStatus::Released),
            "expired" => Some(HoldStatus::Expired),
            _ => None,
        }
    }

    /// The state an `ok` entry of `op` leaves its hold in.
    pub fn after(op: Op) -> Option<HoldStatus> {
        match op {
            Op::Hold | Op::Order => Some(HoldStatus::Held),
            Op::Confirm => Some(HoldStatus::Confirmed),
            Op::Release => Some(HoldStatus::Released),
            Op::Expire => Some(HoldStatus::Expired),
            _ => None,
        }
    }
}

/// A hold as the journal's store keeps it and the API shows it. Field names are the
/// HTTP API's.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct HoldView {
    pub hold_id: Arc<str>,
    pub status: HoldStatus,
    pub shop: Arc<str>,
    pub item: Arc<str>,
    pub qty: i64,
    pub expires_at: Millis,
    /// The item's sequence number of the hold's latest transition.
    pub seq: u64,
    /// The buyer the hold was made for, if it named one (its units count against an
    /// item's per-buyer limit until it ends).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub buyer: Option<Arc<str>>,
}

/// One line of an order: an item and how many of it.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct OrderLine {
    pub item: Arc<str>,
    pub qty: i64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn internal_keys_are_their_prefix_id_and_index() {
        assert_eq!(&*line_key("o-1", 0), "~line:o-1:0");
        assert_eq!(&*line_key("o:2", 1_234_567), "~line:o:2:1234567");
        assert_eq!(
            &*retry_line_key("o", 3),
            format!("~line:o:{}", LINE_RETRY + 3)
        );
        assert_eq!(
            &*line_key("ü", usize::MAX),
            format!("~line:ü:{}", usize::MAX)
        );
        assert_eq!(&*hold_end_key("h1"), "~end:h1");
        assert_eq!(&*transfer_hold_key("t"), "~xfer:t");
        assert_eq!(&*transfer_credit_key("t"), "~xfer-in:t");
        for (id, index) in [("a", 0), ("a:b", 9), ("x", 10), ("", 1 << 20)] {
            assert_eq!(order_of_line(&line_key(id, index)), Some((id, index)));
        }
    }

    #[test]
    fn an_order_keeps_its_record_on_one_of_the_shops_order_items() {
        let item = order_item("shop", "order-7");
        let bucket = shard_of("shop", "order-7", ORDER_ITEMS);
        assert_eq!(&*item, format!("{ORDER_ITEM_PREFIX}{bucket}"));
        assert!(is_order_item(&item));
        assert_eq!(
            item,
            order_item("shop", "order-7"),
            "the same item every time"
        );
    }
}
