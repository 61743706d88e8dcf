//! The reads by request key and by item answered from the log itself, through its index
//! (`nrtxn_log::index`, `docs/decisions/derived-views.md`), instead of the views' journal
//! table: a key's outcome (polls, repeats), an item's events, and the sale a return
//! names. The table keeps its rows (for the outbox relay, recovery and retention) but no
//! index by key or by item, so a decision costs the views an append, not three B-tree
//! inserts.
//!
//! The log's writer adds each group's entries to the index after their sync and before
//! anyone is answered, so a read here never waits for the views: a key answered before
//! the read began is found. A key is forgotten once its entry is older than the key
//! window, as the views' prune forgets it.

use std::sync::Arc;

use nrtxn_actors::returns::SaleRecord;
use nrtxn_actors::{
    hold_end_key, now_ms, Entry, Event, HoldStatus, HoldView, Op, Outcome, Status, StoreError,
};
use nrtxn_log::index::{Index, IndexError};

/// The log's index and the windows its reads keep.
pub(crate) struct LogReads {
    pub(crate) index: Arc<Index>,
    /// A key's entry older than this (ms) is forgotten, as the views' prune forgets it.
    pub(crate) key_window_ms: i64,
    /// An ok sale older than this (ms) can no longer be returned.
    pub(crate) return_window_ms: i64,
}

/// An error of the log's index as the journal's.
pub(crate) fn index_error(e: IndexError) -> StoreError {
    StoreError::Storage(e.to_string())
}

impl LogReads {
    /// `read` through the index; a block of a sealed index found damaged is rebuilt from
    /// its segment and the read tried once more (the log is the record, the index only
    /// leads to it). A damaged log record is refused, never served.
    fn read<T>(&self, read: impl Fn(&Index) -> Result<T, IndexError>) -> Result<T, StoreError> {
        match read(&self.index) {
            Err(IndexError::Block {
                file,
                block,
                detail,
            }) => {
                let first = file
                    .file_stem()
                    .and_then(|s| s.to_str())
                    .and_then(|s| s.parse::<u64>().ok());
                tracing::error!(
                    file = %file.display(),
                    block,
                    detail,
                    "journal: a block of a segment's index is damaged; rebuilding the index from its segment"
                );
                let Some(first) = first else {
                    return Err(StoreError::Storage(format!(
                        "segment index {} is damaged and not named for its segment",
                        file.display()
                    )));
                };
                self.index.rebuild(first).map_err(index_error)?;
                read(&self.index).map_err(index_error)
            }
            other => other.map_err(index_error),
        }
    }

    /// The newest durable entry under `key`, if it was decided within `window_ms`
    /// (`None`: whenever, while the log holds it).
    fn keyed(
        &self,
        shop: &str,
        key: &str,
        window_ms: Option<i64>,
    ) -> Result<Option<Entry>, StoreError> {
        let since = window_ms.map_or(i64::MIN, |w| now_ms() - w);
        Ok(self
            .read(|index| index.lookup(shop, key))?
            .filter(|e| e.completed_at >= since))
    }

    /// The outcomes of `keys`, `None` for a key never decided (or forgotten);
    /// `may_contain` skips the keys the key filter never saw.
    pub(crate) fn outcomes(
        &self,
        shop: &str,
        keys: &[&str],
        may_contain: impl Fn(&str) -> bool,
    ) -> Result<Vec<Option<Outcome>>, StoreError> {
        keys.iter()
            .map(|key| {
                if !may_contain(key) {
                    return Ok(None);
                }
                Ok(self
                    .keyed(shop, key, Some(self.key_window_ms))?
                    .and_then(|e| e.outcome()))
            })
            .collect()
    }

    /// The item's events after seq `after`, at most `limit`, gapless.
    pub(crate) fn events(
        &self,
        shop: &str,
        item: &str,
        after: u64,
        limit: usize,
    ) -> Result<Vec<Event>, StoreError> {
        Ok(self
            .read(|index| index.events(shop, item, after + 1, limit))?
            .iter()
            .filter_map(Entry::event)
            .collect())
    }

    /// What the log holds of the request `key` names as a sale, while it may still be
    /// returned (its returned units are the views' to add).
    pub(crate) fn sale(&self, shop: &str, key: &str) -> Result<Option<SaleRecord>, StoreError> {
        Ok(self
            .keyed(shop, key, Some(self.return_window_ms))?
            .map(|e| SaleRecord {
                item: e.item.clone(),
                op: e.op,
                status: e.status,
                sold: e.qty,
                decided_at: e.completed_at,
                returned: 0,
            }))
    }

    /// Hold `hold_id` as it ended: its making (the entry under its id) and its ending (the
    /// entry under [`hold_end_key`]), both ok, whenever made, while the log holds them
    /// (a hold lives at most as long as the default key window). `None` if either is
    /// not in the log (a pending hold is the views' own row). Its expiry is the one its
    /// ending says it had (an extension moves it), or for an ending journaled before
    /// endings said it, the making's.
    pub(crate) fn ended_hold(
        &self,
        shop: &str,
        hold_id: &str,
    ) -> Result<Option<HoldView>, StoreError> {
        let made = self.keyed(shop, hold_id, None)?.filter(|m| {
            m.status == Status::Ok
                && HoldStatus::after(m.op) == Some(HoldStatus::Held)
                && m.hold_id.as_deref() == Some(hold_id)
        });
        let Some(made) = made else {
            return Ok(None);
        };
        let ended = self
            .keyed(shop, &hold_end_key(hold_id), None)?
            .filter(|e| e.status == Status::Ok)
            .and_then(|e| HoldStatus::after(e.op).map(|status| (e, status)));
        Ok(ended.map(|(end, status)| HoldView {
            hold_id: hold_id.into(),
            status,
            shop: made.shop.clone(),
            item: made.item.clone(),
            qty: made.qty,
            // Its ending says the expiry it had then (an extension moves it).
            expires_at: end.expires_at.or(made.expires_at).unwrap_or_default(),
            seq: end.seq.or(made.seq).unwrap_or_default(),
            buyer: made.buyer.clone(),
        }))
    }

    /// When the ok sale under `key` was decided, if the log still holds it.
    pub(crate) fn sale_decided_at(&self, shop: &str, key: &str) -> Result<Option<i64>, StoreError> {
        Ok(self
            .sale(shop, key)?
            .filter(|s| s.op == Op::Decrement && s.status == Status::Ok)
            .map(|s| s.decided_at))
    }
}
