//! One journal transaction's statements: the documents, the holds they change and the
//! fence, and what to make of a transaction refused for duplicates or a moved lease.

use std::collections::HashMap;
use std::time::Duration;

use futures::TryStreamExt;
use mongodb::bson::{doc, Bson, Document};
use mongodb::{ClientSession, Database};
use nrtxn_actors::{Entry, StoreError};

use crate::collections::{find_all, journal, leases, update_all};
use crate::documents::{hold_updates, storage};

/// The fence of a write: per partition its entries were read from, the epoch they were
/// read under, and the highest offset among them (recorded in the lease, as how far the
/// request log is applied).
pub(crate) type Fences = HashMap<i32, (u64, i64)>;

/// How one journal transaction ended, short of an error.
pub(crate) enum Txn {
    Committed,
    /// Refused: these partitions' leases are no longer at the epochs written under.
    Stale(Vec<(i32, u64)>),
    /// Refused: these documents (by index) are in the journal already, exactly so (a
    /// retried commit that had committed after all).
    Written(Vec<usize>),
}

/// An error of a transaction: one worth retrying (a lost connection, a write
/// conflict, a primary stepping down), or one that no retry mends.
pub(crate) enum TxnError {
    Retry(mongodb::error::Error),
    Fatal(StoreError),
}

impl From<mongodb::error::Error> for TxnError {
    fn from(e: mongodb::error::Error) -> TxnError {
        TxnError::Retry(e)
    }
}

/// The journal documents that say the same decision as `mine` (same item, seq, key,
/// status and quantity): duplicates of a write that had committed.
fn same_decision(mine: &Document, theirs: &Document) -> bool {
    ["shop", "item", "seq", "request_key", "status", "qty"]
        .iter()
        .all(|f| mine.get(f) == theirs.get(f))
}

/// The filter finding the journal document that holds `doc`'s place: its key, or for
/// a load (no key) its item and seq.
fn place_of(doc: &Document) -> Document {
    match doc.get("request_key") {
        Some(Bson::String(key)) => doc! { "shop": doc.get("shop"), "request_key": key },
        _ => doc! { "shop": doc.get("shop"), "item": doc.get("item"), "seq": doc.get("seq") },
    }
}

/// The statements of a batch: in `session`'s transaction, or (no fences) on their
/// own, the insert unordered so that a duplicate does not stop the others.
pub(crate) async fn transaction_body(
    db: &Database,
    mut session: Option<&mut ClientSession>,
    docs: &[Document],
    live: &[usize],
    kept: &[&Entry],
    fences: &Fences,
    hold: Option<Duration>,
) -> Result<Txn, TxnError> {
    if !live.is_empty() {
        let coll = journal(db);
        let insert = coll.insert_many(live.iter().map(|&i| &docs[i]));
        let inserted = match session.as_deref_mut() {
            Some(s) => insert.session(s).await?,
            None => insert.ordered(false).await?,
        };
        // Every document of an acknowledged insert is in: the batch is answered on it.
        assert_eq!(
            inserted.inserted_ids.len(),
            live.len(),
            "the journal acknowledged an insert of {} documents with {} inserted",
            live.len(),
            inserted.inserted_ids.len()
        );
    }
    let holds = hold_updates(kept.iter().copied());
    if !holds.is_empty() {
        update_all(db, "holds", holds, session.as_deref_mut()).await?;
    }
    if let Some(hold) = hold {
        tokio::time::sleep(hold).await;
    }
    if !fences.is_empty() {
        let updates: Vec<Document> = fences
            .iter()
            .map(|(p, (epoch, offset))| {
                doc! {
                    "q": { "_id": p, "epoch": *epoch as i64 },
                    "u": { "$max": { "offset": offset } },
                }
            })
            .collect();
        let matched = update_all(db, "leases", updates, session).await?;
        if matched < fences.len() as u64 {
            return Ok(Txn::Stale(Vec::new()));
        }
    }
    Ok(Txn::Committed)
}

/// After a transaction refused for duplicates: which of the `live` documents are in
/// the journal already, exactly so. A different decision in a document's place is
/// fatal: two writers decided the same item or key.
pub(crate) async fn already_written(
    db: &Database,
    docs: &[Document],
    live: &[usize],
) -> Result<Txn, TxnError> {
    let mut found = Vec::new();
    for chunk in live.chunks(500) {
        let filter = doc! { "$or": chunk.iter().map(|&i| place_of(&docs[i])).collect::<Vec<_>>() };
        let theirs = find_all(journal(db), filter)
            .await
            .map_err(|e| TxnError::Retry(mongodb::error::Error::custom(e.to_string())))?;
        for &i in chunk {
            let mine = &docs[i];
            let place = place_of(mine);
            let Some(t) = theirs
                .iter()
                .find(|t| place.iter().all(|(k, v)| t.get(k) == Some(v)))
            else {
                continue;
            };
            if !same_decision(mine, t) {
                return Err(TxnError::Fatal(storage(format!(
                    "conflicting journal entry: {mine} against {t}"
                ))));
            }
            found.push(i);
        }
    }
    if found.is_empty() {
        return Err(TxnError::Retry(mongodb::error::Error::custom(
            "duplicate key, but no document holds it",
        )));
    }
    Ok(Txn::Written(found))
}

/// Of `fences`, the `(partition, epoch)` whose lease is at another epoch now.
pub(crate) async fn stale_fences(
    db: &Database,
    fences: &Fences,
) -> Result<Vec<(i32, u64)>, TxnError> {
    if fences.is_empty() {
        return Ok(Vec::new());
    }
    let parts: Vec<i32> = fences.keys().copied().collect();
    let current: HashMap<i32, i64> = leases(db)
        .find(doc! { "_id": { "$in": parts } })
        .await?
        .try_collect::<Vec<Document>>()
        .await?
        .iter()
        .filter_map(|d| Some((d.get_i32("_id").ok()?, d.get_i64("epoch").ok()?)))
        .collect();
    Ok(fences
        .iter()
        .filter(|(p, (epoch, _))| current.get(p) != Some(&(*epoch as i64)))
        .map(|(p, (epoch, _))| (*p, *epoch))
        .collect())
}
