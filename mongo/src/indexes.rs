//! The indexes the journal's reads and its guarantees rest on, created at start if
//! missing: the unique ones make a retried batch unable to insert twice.

use mongodb::bson::{doc, Document};
use mongodb::options::IndexOptions;
use mongodb::{Database, IndexModel};
use nrtxn_actors::StoreError;

use crate::collections::{holds, items, journal};
use crate::documents::storage;

pub(crate) async fn create_indexes(db: &Database) -> Result<(), StoreError> {
    journal(db)
        .create_indexes(journal_indexes())
        .await
        .map_err(storage)?;
    holds(db)
        .create_indexes(holds_indexes())
        .await
        .map_err(storage)?;
    items(db)
        .create_index(
            IndexModel::builder()
                .keys(doc! { "shop": 1, "item": 1 })
                .options(unique("shop_item_unique", None))
                .build(),
        )
        .await
        .map_err(storage)?;
    Ok(())
}

/// A unique index named `name`, over the documents `partial` matches (all without one).
fn unique(name: &str, partial: Option<Document>) -> IndexOptions {
    IndexOptions::builder()
        .name(name.to_string())
        .unique(true)
        .partial_filter_expression(partial)
        .build()
}

/// A plain index named `name`, over the documents `partial` matches (all without one).
fn named(name: &str, partial: Option<Document>) -> IndexOptions {
    IndexOptions::builder()
        .name(name.to_string())
        .partial_filter_expression(partial)
        .build()
}

/// The `journal`'s: every document is covered by one of the two unique ones (by key, or
/// by item and seq), so a retried batch can never insert twice.
fn journal_indexes() -> Vec<IndexModel> {
    vec![
        IndexModel::builder()
            .keys(doc! { "shop": 1, "request_key": 1 })
            .options(unique(
                "shop_request_key_unique",
                Some(doc! { "request_key": { "$type": "string" } }),
            ))
            .build(),
        IndexModel::builder()
            .keys(doc! { "shop": 1, "item": 1, "seq": 1 })
            .options(unique(
                "shop_item_seq_unique",
                Some(doc! { "seq": { "$type": "number" } }),
            ))
            .build(),
        IndexModel::builder().keys(doc! { "batch": 1 }).build(),
        // Each node's outbox relay reads its own batches in order.
        IndexModel::builder()
            .keys(doc! { "node": 1, "batch": 1 })
            .build(),
        // A return's sale: the units returned against it are summed through this
        // one ([`nrtxn_actors::returns`]); only returns have the field.
        IndexModel::builder()
            .keys(doc! { "shop": 1, "return_of": 1 })
            .options(named(
                "shop_return_of",
                Some(doc! { "return_of": { "$type": "string" } }),
            ))
            .build(),
        // A node taking a log partition over learns the keys journaled for it.
        IndexModel::builder()
            .keys(doc! { "partition": 1, "offset": 1 })
            .options(named("partition_offset", None))
            .build(),
    ]
}

/// The `holds`': one document per hold, and a node taking an item over finds its
/// pending holds.
fn holds_indexes() -> Vec<IndexModel> {
    vec![
        IndexModel::builder()
            .keys(doc! { "shop": 1, "hold_id": 1 })
            .options(unique("shop_hold_id_unique", None))
            .build(),
        // A node taking an item over re-arms its pending holds through this one.
        IndexModel::builder()
            .keys(doc! { "shop": 1, "item": 1, "status": 1 })
            .build(),
    ]
}
