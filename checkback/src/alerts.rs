//! Stock alerts to the shops: a reader of the journal's outbox ([`Outbox`]) that sends
//! each stock crossing (`sold_out`, `low_stock`, `back_in_stock` events, which the
//! processors journal: `nrtxn_actors::apply::crossing`) to its shop's `notify_url`,
//! when the shop asked for that kind.
//!
//! - **Durable and in order.** The reader follows the outbox from a cursor of its own,
//!   kept in the journal's store ([`OutboxReader::Alerts`]), and hands each alert to its
//!   shop's lane, which sends them one at a time in the order read. The cursor saved is
//!   the start of the oldest page with an alert not yet delivered (or failed for good):
//!   a crash sends the alerts from there again, at least once, in seq order per item,
//!   and a receiver drops a repeat by `seq` (the alert's own place in the item's
//!   sequence).
//! - **Retried, then kept.** An alert is tried [`ATTEMPTS`] times with growing waits,
//!   each attempt within [`ATTEMPT_TIMEOUT`]; then it failed for good and is kept among
//!   the shop's latest [`crate::FAILED_ALERTS_PER_SHOP`] (`GET .../notifications`).
//! - **One shop cannot hold the others up.** Each shop's lane runs on its own, so a
//!   slow or failing endpoint delays only its shop's alerts. A shop whose alert failed
//!   for good is not called for [`DOWN_FOR`]: its alerts meanwhile are kept as failed at
//!   once (attempts 0), so its lane keeps up. At most [`OUTSTANDING_MAX`] alerts wait
//!   for their lanes; past that the reader waits before it reads on.
//! - The calls are signed and guarded as the check-backs' are (`crate::outbound`), on
//!   their runtime; the reader itself is one thread.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use nrtxn_actors::checkback::{Alert, FailedAlert};
use nrtxn_actors::{now_ms, Event, Op, Outbox, OutboxReader, RelayPage};

use crate::{HttpCheckBack, Inner, Kept};

/// Journal entries read per page.
pub const PAGE_MAX: usize = 2_000;
/// Pause after a page that was not full of alerts, unless the journal is more than a
/// page ahead: the most an alert waits before it is read. Reading back to back instead
/// cost a busy node a journal read per few decisions (0.3 µs of CPU per decision on
/// `hot-sales`, 3 µs per order, measured with `scripts/thread-cost.sh` at stop 37).
pub const IDLE_POLL: Duration = Duration::from_millis(50);
/// Longest the saved cursor lags the journal read past when no alert was done
/// meanwhile (one done is saved at the next page): a busy node does not write the cursor
/// at every page.
pub const SAVE_EVERY: Duration = Duration::from_secs(1);
/// Attempts of one alert.
pub const ATTEMPTS: u32 = 5;
/// Longest one attempt may take (connecting, sending, reading the answer).
pub const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(2);
/// How long a shop whose alert failed for good gets a single attempt per alert.
pub const DOWN_FOR: Duration = Duration::from_secs(30);
/// Most alerts read and not yet delivered (or failed for good): past it the reader
/// waits for the lanes before it reads on.
pub const OUTSTANDING_MAX: usize = 10_000;
/// Pause after a failed read or save of the outbox.
const RETRY_PAUSE: Duration = Duration::from_millis(500);

/// The wait before attempt `attempt` (from 1): 0.2 s, 1 s, 3 s, 6 s.
fn wait_before(attempt: u32) -> Duration {
    const WAITS_MS: [u64; 4] = [200, 1_000, 3_000, 6_000];
    Duration::from_millis(WAITS_MS[(attempt as usize - 1).min(WAITS_MS.len() - 1)])
}

/// The ops of the stock crossings: the only events the reader reads.
const ALERT_OPS: [Op; 3] = [Op::SoldOut, Op::LowStock, Op::BackInStock];

/// The alert an event is, when it is a stock crossing.
pub fn alert_of(e: &Event) -> Option<Alert> {
    e.kind.is_alert().then(|| Alert {
        shop: e.shop.clone(),
        kind: e.kind.as_str().to_string(),
        item: Some(e.item.clone()),
        stock: Some(e.stock_after),
        reserved: Some(e.reserved_after),
        seq: Some(e.seq),
        id: None,
        applied: None,
        at: e.at,
    })
}

/// The running reader; [`Alerts::stop`] ends it.
pub struct Alerts {
    stop: Arc<AtomicBool>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl Alerts {
    /// Stops the reader: an alert in its attempts is left for the next start (its page's
    /// cursor was not saved). Call before the journal closes.
    pub fn stop(&self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.lock().ok().and_then(|mut t| t.take()) {
            let _ = t.join();
        }
    }
}

impl HttpCheckBack {
    /// Starts sending the stock alerts `outbox` holds, from the cursor it saved (from
    /// its end the first time: no crossing is older than the alerts).
    pub fn start_alerts(&self, outbox: Arc<dyn Outbox>) -> anyhow::Result<Alerts> {
        let stop = Arc::new(AtomicBool::new(false));
        let reader = Reader {
            outbox,
            inner: self.inner.clone(),
            runtime: self.runtime.clone(),
            stop: stop.clone(),
        };
        let thread = std::thread::Builder::new()
            .name("nrtxn-alerts".into())
            .spawn(move || reader.run())?;
        Ok(Alerts {
            stop,
            thread: Mutex::new(Some(thread)),
        })
    }
}

struct Reader {
    outbox: Arc<dyn Outbox>,
    inner: Arc<Inner>,
    runtime: tokio::runtime::Handle,
    stop: Arc<AtomicBool>,
}

impl Reader {
    fn stopped(&self) -> bool {
        self.stop.load(Ordering::Acquire)
    }

    /// The saved cursor; the outbox's end, saved, when there is none.
    fn cursor(&self) -> Option<u64> {
        while !self.stopped() {
            let found = self
                .outbox
                .relay_cursor(OutboxReader::Alerts)
                .and_then(|c| match c {
                    Some(c) => Ok(c),
                    None => {
                        let end = self.outbox.relay_end()?;
                        self.outbox.relay_save(OutboxReader::Alerts, end)?;
                        Ok(end)
                    }
                });
            match found {
                Ok(c) => return Some(c),
                Err(e) => {
                    tracing::warn!(error = %e, "stock alerts: cursor not read; trying again");
                    std::thread::sleep(RETRY_PAUSE);
                }
            }
        }
        None
    }

    fn run(self) {
        let Some(mut saved) = self.cursor() else {
            return;
        };
        let outstanding = Arc::new(Mutex::new(Outstanding::default()));
        let mut lanes: HashMap<Arc<str>, tokio::sync::mpsc::UnboundedSender<(u64, Alert)>> =
            HashMap::new();
        let mut read_at = saved;
        let mut saved_at = Instant::now();
        while !self.stopped() {
            // Bounded: a page more is read only while few alerts wait for their lanes.
            let waiting = outstanding.lock().map(|o| o.alerts).unwrap_or(0);
            let page = match waiting < OUTSTANDING_MAX {
                true => self.outbox.relay_read_kinds(read_at, PAGE_MAX, &ALERT_OPS),
                false => Ok(RelayPage {
                    events: Vec::new(),
                    next: read_at,
                }),
            };
            let page = match page {
                Ok(p) => p,
                Err(e) => {
                    tracing::warn!(error = %e, "stock alerts: outbox not read; trying again");
                    std::thread::sleep(RETRY_PAUSE);
                    continue;
                }
            };
            let due: Vec<Alert> = page.events.iter().filter_map(alert_of).collect();
            if let Ok(mut o) = outstanding.lock() {
                o.read(read_at, page.next, due.len());
            }
            for alert in due {
                let lane = lanes
                    .entry(alert.shop.clone())
                    .or_insert_with(|| self.lane(outstanding.clone()));
                // A lane's receiver lives as long as the runtime: a send fails only at
                // the process's end, and the alert is sent again after the restart.
                let _ = lane.send((read_at, alert));
            }
            // Read on at once while a page was full of alerts or passed a page of the
            // journal or more (the reader is behind); else wait: at the rate the journal
            // grows, a read per `IDLE_POLL` keeps up. Judged by the page, not by asking
            // the journal's end: on the embedded journal that waits for its views, and a
            // read waiting at every poll would end their linger early.
            let more = page.events.len() >= PAGE_MAX
                || page.next.saturating_sub(read_at) >= PAGE_MAX as u64;
            read_at = page.next;
            let done = outstanding
                .lock()
                .map(|mut o| std::mem::take(&mut o.done_unsaved))
                .unwrap_or(false);
            if done || saved_at.elapsed() >= SAVE_EVERY {
                saved = self.save(&outstanding, saved);
                saved_at = Instant::now();
            }
            if !more {
                std::thread::sleep(IDLE_POLL);
            }
        }
        self.save(&outstanding, saved);
    }

    /// Saves the cursor of the alerts done, if it moved past `saved`; the cursor saved.
    fn save(&self, outstanding: &Mutex<Outstanding>, saved: u64) -> u64 {
        let upto = outstanding.lock().map(|o| o.upto()).unwrap_or(saved);
        if upto == saved {
            return saved;
        }
        match self.outbox.relay_save(OutboxReader::Alerts, upto) {
            Ok(()) => upto,
            // Sent again at worst: the receiver drops them by seq.
            Err(e) => {
                tracing::warn!(error = %e, "stock alerts: cursor not saved");
                saved
            }
        }
    }

    /// A shop's lane: its alerts, one at a time in the order read, each marked done in
    /// `outstanding` once delivered or failed for good.
    fn lane(
        &self,
        outstanding: Arc<Mutex<Outstanding>>,
    ) -> tokio::sync::mpsc::UnboundedSender<(u64, Alert)> {
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(u64, Alert)>();
        let (inner, stop) = (self.inner.clone(), self.stop.clone());
        self.runtime.spawn(async move {
            while let Some((page, alert)) = rx.recv().await {
                if stop.load(Ordering::Acquire) {
                    return;
                }
                // Read at each alert: the shop's settings may change meanwhile.
                if let Some(shop) = inner.shop(&alert.shop) {
                    if let Some(url) = shop.settings.wants(&alert.kind) {
                        tokio::select! {
                            () = inner.deliver(url, &shop.secret, alert) => {}
                            // Left for the next start: its page's cursor is not saved.
                            () = stopped(&stop) => return,
                        }
                    }
                }
                if let Ok(mut o) = outstanding.lock() {
                    o.done(page);
                }
            }
        });
        tx
    }
}

/// The pages read whose alerts are not all delivered (or failed for good) yet, by the
/// cursor each page was read from: the cursor saved is the oldest of them (its alerts
/// are sent again after a restart, the newer ones' too), or past every page read.
#[derive(Default)]
struct Outstanding {
    pages: std::collections::BTreeMap<u64, usize>,
    alerts: usize,
    /// The cursor after the last page read.
    read: u64,
    /// A page's alerts were all done since the cursor was last saved: it is saved at
    /// once, so a restart sends them again only if the crash came first.
    done_unsaved: bool,
}

impl Outstanding {
    /// A page read from `from` up to `next`, with `alerts` to deliver.
    fn read(&mut self, from: u64, next: u64, alerts: usize) {
        if alerts > 0 {
            *self.pages.entry(from).or_default() += alerts;
            self.alerts += alerts;
        }
        self.read = next;
    }

    /// One alert of the page read from `page` is done.
    fn done(&mut self, page: u64) {
        if let Some(n) = self.pages.get_mut(&page) {
            *n -= 1;
            self.alerts -= 1;
            if *n == 0 {
                self.pages.remove(&page);
                self.done_unsaved = true;
            }
        }
    }

    /// The cursor every alert before which is done.
    fn upto(&self) -> u64 {
        self.pages.keys().next().copied().unwrap_or(self.read)
    }
}

/// Resolves once `stop` is set.
async fn stopped(stop: &AtomicBool) {
    while !stop.load(Ordering::Acquire) {
        tokio::time::sleep(IDLE_POLL).await;
    }
}

impl Inner {
    /// Sends one alert, retrying; past its attempts it failed for good, and is kept.
    pub(crate) async fn deliver(&self, url: &str, secret: &str, alert: Alert) {
        let body = serde_json::to_vec(&alert).unwrap_or_default();
        // A shop whose last alert failed for good is not called for a while: its
        // alerts are kept as failed at once, and the first after the pause tries again.
        let (attempts, mut error) = match self.shop_down(&alert.shop) {
            true => (
                0,
                format!(
                    "not tried: an alert of the shop failed for good less than {} s before",
                    DOWN_FOR.as_secs()
                ),
            ),
            false => (ATTEMPTS, String::new()),
        };
        for attempt in 0..attempts {
            if attempt > 0 {
                tokio::time::sleep(wait_before(attempt)).await;
            }
            let _turn = self.outbound.turn(&alert.shop).await;
            match self.post_signed(url, secret, &body, ATTEMPT_TIMEOUT).await {
                Ok(_) => {
                    self.metrics.alerts.with_label_values(&["sent"]).inc();
                    self.set_down(&alert.shop, None);
                    return;
                }
                Err(e) => error = e,
            }
        }
        self.metrics.alerts.with_label_values(&["failed"]).inc();
        tracing::warn!(shop = %alert.shop, kind = %alert.kind, error = %error, "stock alert failed for good");
        if attempts > 0 {
            // Skipped ones do not move the pause on: the first after it tries again.
            self.set_down(&alert.shop, Some(Instant::now() + DOWN_FOR));
        }
        let id = match (&alert.item, alert.seq, &alert.id) {
            (Some(item), Some(seq), _) => format!("{item}/{seq}"),
            (_, _, Some(id)) => format!("dead_letter/{id}"),
            _ => format!("{}/{}", alert.kind, alert.at),
        };
        let failed = FailedAlert {
            alert,
            error,
            attempts,
            at: now_ms(),
        };
        let kept = match serde_json::to_string(&failed) {
            Ok(json) => {
                let shop = failed.alert.shop.clone();
                self.store
                    .put_kept(Kept::FailedAlerts, &shop, &id, failed.at, json)
                    .await
            }
            Err(e) => Err(e.into()),
        };
        if let Err(e) = kept {
            tracing::error!(shop = %failed.alert.shop, error = %e, "failed alert not kept");
        }
    }

    fn shop_down(&self, shop: &str) -> bool {
        self.down
            .lock()
            .map(|d| d.get(shop).is_some_and(|until| *until > Instant::now()))
            .unwrap_or(false)
    }

    fn set_down(&self, shop: &Arc<str>, until: Option<Instant>) {
        if let Ok(mut d) = self.down.lock() {
            match until {
                Some(until) => {
                    d.insert(shop.clone(), until);
                }
                None => {
                    d.remove(shop);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nrtxn_actors::{Op, Status};

    #[test]
    fn only_crossings_are_alerts_and_they_carry_the_items_numbers() {
        let mut e = Event {
            shop: "s".into(),
            item: "i".into(),
            seq: 7,
            prev_seq: 6,
            kind: Op::Decrement,
            status: Status::Ok,
            request_key: Some("k".into()),
            qty: 2,
            qty_taken: Some(2),
            stock_after: 0,
            reserved_after: 1,
            at: 1_000,
            hold_id: None,
            reason: None,
            order_id: None,
            transfer_id: None,
            seller: None,
            buyer: None,
            requested_at: 999,
            opens_at: None,
            closes_at: None,
            low_stock_at: None,
        };
        assert_eq!(alert_of(&e), None);
        e.kind = Op::SoldOut;
        let alert = alert_of(&e).unwrap();
        let body = serde_json::to_value(&alert).unwrap();
        assert_eq!(
            body,
            serde_json::json!({"shop": "s", "kind": "sold_out", "item": "i", "stock": 0,
                               "reserved": 1, "seq": 7, "at": 1_000})
        );
        assert_eq!(wait_before(1), Duration::from_millis(200));
        assert_eq!(wait_before(9), Duration::from_secs(6));
    }
}
