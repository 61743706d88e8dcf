//! The journal's collections, and the commands that read or update many of their
//! documents at once.

use std::future::IntoFuture;
use std::sync::Arc;

use futures::TryStreamExt;
use mongodb::bson::{doc, Bson, Document};
use mongodb::error::ErrorKind;
use mongodb::{ClientSession, Collection, Cursor, Database};
use nrtxn_actors::ledger::{self, BuyerLedger};
use nrtxn_actors::StoreError;

use crate::documents::{from_doc, storage};

/// Statements per `update` command (the server's limit is 100,000).
const UPDATES_PER_COMMAND: usize = 10_000;

pub(crate) fn journal(db: &Database) -> Collection<Document> {
    db.collection("journal")
}

pub(crate) fn items(db: &Database) -> Collection<Document> {
    db.collection("items")
}

pub(crate) fn holds(db: &Database) -> Collection<Document> {
    db.collection("holds")
}

/// A partition's lease document: `{_id: partition, epoch, node, offset}`.
pub(crate) fn leases(db: &Database) -> Collection<Document> {
    db.collection("leases")
}

/// Reads all documents of `filter` in `coll`.
pub(crate) async fn find_all(
    coll: Collection<Document>,
    filter: Document,
) -> Result<Vec<Document>, StoreError> {
    collect(coll.find(filter)).await
}

/// Every document a query (a `find` with its sort, projection or limit, or an
/// `aggregate`) answers.
pub(crate) async fn collect(
    query: impl IntoFuture<Output = mongodb::error::Result<Cursor<Document>>>,
) -> Result<Vec<Document>, StoreError> {
    query
        .await
        .map_err(storage)?
        .try_collect()
        .await
        .map_err(storage)
}

/// Each item's per-buyer ledger, folded from its entries that can change it (loads that
/// set a limit, and entries with a buyer), in seq order through the index on shop, item
/// and seq. Costs a read of those entries: done when an item comes into memory.
pub(crate) async fn fold_ledgers(
    db: &Database,
    items: &[(Arc<str>, Arc<str>)],
) -> Result<Vec<Option<BuyerLedger>>, StoreError> {
    let mut out = Vec::with_capacity(items.len());
    for (shop, item) in items {
        let filter = doc! {
            "shop": &**shop,
            "item": &**item,
            "seq": { "$type": "number" },
            "$or": [
                { "per_buyer_max": { "$exists": true } },
                { "buyer": { "$type": "string" } },
            ],
        };
        let docs = collect(
            journal(db)
                .find(filter)
                .sort(doc! { "shop": 1, "item": 1, "seq": 1 }),
        )
        .await?;
        let entries = docs
            .into_iter()
            .map(from_doc)
            .collect::<Result<Vec<_>, _>>()?;
        out.push(ledger::fold(&entries));
    }
    Ok(out)
}

/// Runs `updates` (statements of the `update` command) in as few commands as possible:
/// one round trip instead of one per document (13 ms each on the test server). Outside
/// a transaction (`session` `None`) with the database's write concern; inside one, the
/// commit's. A statement that fails only because its upsert hit a unique index (code
/// 11000) is not an error: callers use a filter that does not match when the stored
/// document is already newer. Returns how many documents the statements matched.
pub(crate) async fn update_all(
    db: &Database,
    collection: &str,
    updates: Vec<Document>,
    mut session: Option<&mut ClientSession>,
) -> Result<u64, mongodb::error::Error> {
    let mut matched = 0;
    for chunk in updates.chunks(UPDATES_PER_COMMAND) {
        let mut cmd = doc! { "update": collection, "updates": chunk.to_vec(), "ordered": false };
        let reply = match session.as_deref_mut() {
            Some(s) => db.run_command(cmd).session(s).await?,
            None => {
                if let Some(wc) = db.write_concern() {
                    let wc = mongodb::bson::to_document(wc)
                        .map_err(|e| mongodb::error::Error::custom(e.to_string()))?;
                    cmd.insert("writeConcern", wc);
                }
                db.run_command(cmd).await?
            }
        };
        if let Ok(wc) = reply.get_document("writeConcernError") {
            return Err(mongodb::error::Error::custom(format!(
                "{collection}: write concern: {wc}"
            )));
        }
        if let Ok(errors) = reply.get_array("writeErrors") {
            for e in errors {
                let code = e.as_document().and_then(|d| d.get_i32("code").ok());
                if code != Some(11000) {
                    return Err(mongodb::error::Error::custom(format!("{collection}: {e}")));
                }
            }
        }
        matched += match reply.get("n") {
            Some(Bson::Int32(n)) => *n as u64,
            Some(Bson::Int64(n)) => *n as u64,
            _ => 0,
        };
    }
    Ok(matched)
}

/// [`update_all`] outside a transaction, its error a [`StoreError`].
pub(crate) async fn update_now(
    db: &Database,
    collection: &str,
    updates: Vec<Document>,
) -> Result<(), StoreError> {
    update_all(db, collection, updates, None)
        .await
        .map(drop)
        .map_err(storage)
}

/// Whether `e` is a unique index's refusal (code 11000).
pub fn is_duplicate(e: &mongodb::error::Error) -> bool {
    match e.kind.as_ref() {
        ErrorKind::InsertMany(f) => f.write_errors.iter().flatten().any(|w| w.code == 11000),
        ErrorKind::Write(mongodb::error::WriteFailure::WriteError(w)) => w.code == 11000,
        ErrorKind::Command(c) => c.code == 11000,
        _ => false,
    }
}
