//! The session each node's journal writer runs its transactions in, recorded in `meta`
//! (`writer:{node}`) so that whoever comes after the node can end a transaction it left
//! open.

use mongodb::bson::{doc, Document};
use mongodb::Database;
use nrtxn_actors::StoreError;

use crate::documents::storage;

/// transactions in: `{_id: "writer:{node}", lsid}`.
pub(crate) fn writer_mark(node: u32) -> String {
    format!("writer:{node}")
}

/// Ends the session node `node`'s writer recorded, and so aborts any transaction it
/// left open (a process killed or stalled in the middle of one): its uncommitted
/// documents would otherwise hold their keys until the server's transaction lifetime
/// (60 s) runs out. A live writer whose session is ended retries in a new one. Ending
/// it may fail (the user lacks the right): that is logged, not fatal.
pub(crate) async fn end_writer_session(db: &Database, node: u32) -> Result<(), StoreError> {
    let mark = db
        .collection::<Document>("meta")
        .find_one(doc! { "_id": writer_mark(node) })
        .await
        .map_err(storage)?;
    if let Some(lsid) = mark.as_ref().and_then(|d| d.get_document("lsid").ok()) {
        let ended = db
            .client()
            .database("admin")
            .run_command(doc! { "killSessions": [lsid.clone()] })
            .await;
        match ended {
            Ok(_) => tracing::info!(node, "ended the journal session node {node} left"),
            // Not fatal: the fence holds without it; only a transaction left open keeps
            // its keys until the server's transaction lifetime ends it.
            Err(e) => tracing::warn!(
                node,
                error = %e,
                "could not end the journal session node {node} left (the user needs killAnySession); a transaction it left open holds its keys until it times out"
            ),
        }
    }
    Ok(())
}
