//! What the journal's documents hold: an entry as a `journal` document and back (its
//! fingerprint checked on every read), a `holds` document as a hold, and the `holds`
//! updates a run of entries makes.

use std::collections::HashMap;
use std::sync::Arc;

use mongodb::bson::{doc, Document};
use nrtxn_actors::{Entry, HoldStatus, HoldView, StoreError};

pub(crate) fn storage(e: impl std::fmt::Display) -> StoreError {
    StoreError::Storage(e.to_string())
}

pub(crate) fn to_doc(entry: &Entry, batch: i64, node: u32) -> Result<Document, StoreError> {
    let mut doc = mongodb::bson::to_document(entry).map_err(storage)?;
    doc.insert("batch", batch);
    doc.insert("node", node as i64);
    doc.insert("fingerprint", fingerprint_of(entry));
    Ok(doc)
}

/// The entry's request fingerprint (kind, item, quantity, TTL), as the embedded journal
/// keeps it: stored in each document and checked when it is read, so a document altered
/// in those fields is refused, not served.
fn fingerprint_of(e: &Entry) -> i64 {
    nrtxn_log::codec::fingerprint(e.op, &e.item, e.qty, e.ttl_ms) as i64
}

pub(crate) fn from_doc(doc: Document) -> Result<Entry, StoreError> {
    let stored = doc.get_i64("fingerprint").ok();
    let id = doc.get("_id").cloned();
    let entry: Entry = mongodb::bson::from_document(doc).map_err(storage)?;
    // Documents written before fingerprints were kept have none.
    if stored.is_some_and(|f| f != fingerprint_of(&entry)) {
        return Err(storage(format!(
            "journal document {} (shop {}, item {}, seq {:?}) does not match its fingerprint: \
             it was altered; restore the journal from a backup",
            id.map_or_else(|| "?".to_string(), |i| i.to_string()),
            entry.shop,
            entry.item,
            entry.seq
        )));
    }
    Ok(entry)
}

pub(crate) fn hold_from_doc(d: &Document) -> Result<HoldView, StoreError> {
    let status = d.get_str("status").map_err(storage)?;
    Ok(HoldView {
        hold_id: d.get_str("hold_id").map_err(storage)?.into(),
        status: HoldStatus::parse(status)
            .ok_or_else(|| storage(format!("hold status {status}")))?,
        shop: d.get_str("shop").map_err(storage)?.into(),
        item: d.get_str("item").map_err(storage)?.into(),
        qty: d.get_i64("qty").map_err(storage)?,
        expires_at: d.get_i64("expires_at").map_err(storage)?,
        seq: d.get_i64("seq").map_err(storage)? as u64,
        buyer: d.get_str("buyer").ok().map(Into::into),
    })
}

/// The `holds` updates of a run of entries: each hold's last state in it, one statement
/// per hold (an unordered command would not keep two statements of one hold in order).
/// Like snapshots, a hold document only moves forward (`seq` filter).
pub(crate) fn hold_updates<'a>(entries: impl Iterator<Item = &'a Entry>) -> Vec<Document> {
    let mut set: HashMap<(Arc<str>, Arc<str>), Document> = HashMap::new();
    for e in entries {
        if let (nrtxn_actors::Status::Ok, nrtxn_actors::Op::Extend, Some(id), Some(seq)) =
            (e.status, e.op, &e.hold_id, e.seq)
        {
            // A pending hold given a new expiry (a check-back's answer).
            let d = set.entry((e.shop.clone(), id.clone())).or_default();
            d.insert("expires_at", e.expires_at.unwrap_or(0));
            d.insert("seq", seq as i64);
            continue;
        }
        let (nrtxn_actors::Status::Ok, Some(status), Some(id), Some(seq)) =
            (e.status, HoldStatus::after(e.op), &e.hold_id, e.seq)
        else {
            continue;
        };
        let d = set.entry((e.shop.clone(), id.clone())).or_default();
        if status == HoldStatus::Held {
            d.insert("item", &*e.item);
            d.insert("qty", e.qty);
            d.insert("expires_at", e.expires_at.unwrap_or(0));
            if let Some(buyer) = &e.buyer {
                d.insert("buyer", &**buyer);
            }
        }
        d.insert("status", status.as_str());
        d.insert("seq", seq as i64);
    }
    set.into_iter()
        .map(|((shop, hold_id), d)| {
            let seq = d.get_i64("seq").unwrap_or(0);
            doc! {
                "q": { "shop": &*shop, "hold_id": &*hold_id, "seq": { "$lt": seq } },
                "u": { "$set": d },
                "upsert": true,
            }
        })
        .collect()
}
