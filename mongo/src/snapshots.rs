//! The snapshots (`items`): each item's state, moved forward by the writer at most every
//! second, off the answer path, and by recovery; and per node the last batch they hold
//! (`meta`, `snapshot:{node}`).

use std::collections::HashMap;
use std::sync::Arc;

use mongodb::bson::{doc, Document};
use mongodb::Database;
use nrtxn_actors::{ItemState, StoreError};

use crate::collections::update_now;
use crate::documents::storage;

/// Moves the snapshots of `states` forward and records that `node`'s batches up to
/// `batch` are in them.
pub(crate) async fn write_snapshots(
    db: &Database,
    states: HashMap<(Arc<str>, Arc<str>), ItemState>,
    node: u32,
    batch: i64,
) -> Result<(), StoreError> {
    // Each only ever moves a snapshot forward: with several nodes, one that owned the
    // item before may write an older state after a newer one, and then the upsert's
    // insert hits the unique index on shop and item, which is fine.
    let updates: Vec<Document> = states
        .into_iter()
        .map(|((shop, item), s)| {
            doc! {
                "q": { "shop": &*shop, "item": &*item, "seq": { "$lt": s.seq as i64 } },
                "u": { "$set": {
                    "stock": s.stock, "reserved": s.reserved, "seq": s.seq as i64,
                    "opens_at": s.opens_at, "closes_at": s.closes_at,
                    "low_stock_at": s.low_stock_at,
                } },
                "upsert": true,
            }
        })
        .collect();
    update_now(db, "items", updates).await?;
    db.collection::<Document>("meta")
        .update_one(
            doc! { "_id": snapshot_mark(node) },
            doc! { "$max": { "batch": batch } },
        )
        .upsert(true)
        .await
        .map_err(storage)?;
    Ok(())
}

/// The `meta` document recording how far node `node`'s batches are in the snapshots.
pub(crate) fn snapshot_mark(node: u32) -> String {
    format!("snapshot:{node}")
}
