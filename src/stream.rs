//! The push stream's feed on a node that writes its journal alone (the embedded default,
//! or MongoDB without Kafka): the journal's own commit order ([`Outbox::relay_read`]),
//! the order the outbox relay reads. See `docs/decisions/event-stream.md`.
//!
//! A cursor is `j{position}.{n}`: the first `n` events committed after journal position
//! `position` (of every shop) were passed. The journal's order after a position never
//! changes, so a reader that starts there and skips `n` events is exactly where the
//! cursor was taken. `n` is at most one page ([`PAGE_EVENTS_MAX`]): the position moves on
//! once a page is passed.

use std::sync::Arc;
use std::time::{Duration, Instant};

use nrtxn_actors::{Event, EventFeed, FeedError, FeedReader, Outbox, StoreError};

/// Events read from the journal at once by one stream.
pub const PAGE_EVENTS_MAX: usize = 1_000;
/// Pause between reads that found nothing new: the most an event waits before a stream
/// sees it, at idle (the relay polls every 5 ms; a stream per client costs more, so
/// less often).
const IDLE_POLL: Duration = Duration::from_millis(20);

pub struct JournalFeed {
    pub journal: Arc<dyn Outbox>,
}

impl EventFeed for JournalFeed {
    fn open(
        &self,
        shop: Arc<str>,
        after: Option<&str>,
    ) -> Result<(Box<dyn FeedReader>, String), FeedError> {
        let (position, skip) = match after {
            None => (self.journal.relay_end()?, 0),
            Some(c) => parse(c).ok_or_else(|| FeedError::BadCursor(c.to_string()))?,
        };
        let reader = JournalReader {
            journal: self.journal.clone(),
            shop,
            position,
            skip,
        };
        Ok((Box::new(reader), cursor(position, skip)))
    }
}

fn cursor(position: u64, passed: usize) -> String {
    format!("j{position}.{passed}")
}

fn parse(c: &str) -> Option<(u64, usize)> {
    let (p, n) = c.strip_prefix('j')?.split_once('.')?;
    let n: usize = n.parse().ok()?;
    (n <= PAGE_EVENTS_MAX).then_some(())?;
    Some((p.parse().ok()?, n))
}

struct JournalReader {
    journal: Arc<dyn Outbox>,
    shop: Arc<str>,
    position: u64,
    /// Events after `position` already passed.
    skip: usize,
}

impl FeedReader for JournalReader {
    fn next(&mut self, wait: Duration) -> Result<Vec<(String, Event)>, StoreError> {
        let until = Instant::now() + wait;
        loop {
            let page = self.journal.relay_read(self.position, PAGE_EVENTS_MAX)?;
            let mut out = Vec::new();
            for (i, event) in page.events.into_iter().enumerate().skip(self.skip) {
                if event.shop == self.shop {
                    out.push((cursor(self.position, i + 1), event));
                }
            }
            let moved = page.next != self.position;
            if moved {
                // The whole page is passed: the next one starts after it. The last
                // event's cursor (`position.n`) and `next.0` name the same place.
                self.position = page.next;
                self.skip = 0;
            }
            if !out.is_empty() || Instant::now() >= until {
                return Ok(out);
            }
            if !moved {
                std::thread::sleep(IDLE_POLL);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cursors_read_back_and_others_are_refused() {
        assert_eq!(parse(&cursor(42, 7)), Some((42, 7)));
        assert_eq!(parse("j0.0"), Some((0, 0)));
        for bad in ["", "j", "j1", "k1.2", "j1.x", "j-1.0", "j1.1001"] {
            assert_eq!(parse(bad), None, "{bad}");
        }
    }
}

// ---- cursors a shop can neither read nor forge ---------------------------------------

/// Bytes of a sealed cursor's tag: 128 bits of HMAC-SHA256, which is also the nonce of
/// its encryption (a synthetic IV, as in SIV: equal cursors of one shop seal the same).
const TAG_BYTES: usize = 16;
/// Prefix of a sealed cursor: tells it from the feeds' own (`j…`, `k…`), which are no
/// longer taken from a caller.
const SEALED_PREFIX: &str = "c";
/// A feed's cursor is padded to a multiple of this many bytes before it is sealed, so
/// that a sealed cursor's length does not tell how many digits its position has.
const PAD_BYTES: usize = 32;
/// Name of the embedded store's file of the cursor key, in the data dir.
pub const CURSOR_KEY_FILE: &str = "stream-cursor.key";
/// `_id` of the cursor key's document in the MongoDB collection [`SECRETS_COLLECTION`].
const CURSOR_KEY_ID: &str = "stream_cursor";
/// The collection of server secrets every node shares, with a MongoDB journal.
const SECRETS_COLLECTION: &str = "secrets";

/// The key that seals the stream's cursors. A feed's own cursor is a position in the
/// node's journal (`j{position}.{n}`, every shop's events counted) or the events topic's
/// offsets (`k…`): handed out as they are, they would tell a shop how much the other
/// shops sell, and a shop could make up one. Sealed, a cursor is the feed's cursor
/// encrypted and authenticated together with its shop: opaque, and refused when it was
/// not handed to this shop by a server with the same key.
#[derive(Clone)]
pub struct CursorKey([u8; 32]);

impl CursorKey {
    pub fn new(secret: [u8; 32]) -> CursorKey {
        CursorKey(secret)
    }

    fn mac(&self, domain: &[u8]) -> hmac::Hmac<sha2::Sha256> {
        use hmac::{KeyInit, Mac};
        let mut mac = <hmac::Hmac<sha2::Sha256> as KeyInit>::new_from_slice(&self.0)
            .expect("HMAC takes a key of any length");
        mac.update(domain);
        mac
    }

    /// The tag of `inner` for `shop` (the shop's length first, so that no other pair of
    /// shop and cursor has the same input).
    fn tag(&self, shop: &str, inner: &[u8]) -> [u8; TAG_BYTES] {
        use hmac::Mac;
        let mut mac = self.mac(b"nrtxn stream cursor tag\0");
        mac.update(&(shop.len() as u64).to_be_bytes());
        mac.update(shop.as_bytes());
        mac.update(inner);
        let full = mac.finalize().into_bytes();
        let mut tag = [0u8; TAG_BYTES];
        tag.copy_from_slice(&full[..TAG_BYTES]);
        tag
    }

    /// XORs `data` with the key stream of `tag`: HMAC-SHA256 in counter mode.
    fn xor_stream(&self, tag: &[u8; TAG_BYTES], data: &mut [u8]) {
        use hmac::Mac;
        for (block, chunk) in data.chunks_mut(32).enumerate() {
            let mut mac = self.mac(b"nrtxn stream cursor stream\0");
            mac.update(tag);
            mac.update(&(block as u64).to_be_bytes());
            let pad = mac.finalize().into_bytes();
            for (b, p) in chunk.iter_mut().zip(pad.iter()) {
                *b ^= p;
            }
        }
    }

    /// The cursor handed to `shop` for the feed's cursor `inner`.
    pub fn seal(&self, shop: &str, inner: &str) -> String {
        // Padded with NULs, which no feed's cursor holds.
        assert!(
            !inner.contains('\0'),
            "a feed's cursor holds a NUL: {inner:?}"
        );
        let mut body = inner.as_bytes().to_vec();
        body.resize(body.len().div_ceil(PAD_BYTES).max(1) * PAD_BYTES, 0);
        let tag = self.tag(shop, &body);
        self.xor_stream(&tag, &mut body);
        let mut out = String::with_capacity(SEALED_PREFIX.len() + 2 * (TAG_BYTES + body.len()));
        out.push_str(SEALED_PREFIX);
        out.push_str(&hex::encode(tag));
        out.push_str(&hex::encode(body));
        debug_assert_eq!(
            self.open(shop, &out).as_deref(),
            Some(inner),
            "a sealed cursor opens to what was sealed"
        );
        out
    }

    /// The feed's cursor inside `sealed`, if it was sealed for `shop` with this key.
    pub fn open(&self, shop: &str, sealed: &str) -> Option<String> {
        let bytes = hex::decode(sealed.strip_prefix(SEALED_PREFIX)?).ok()?;
        if bytes.len() <= TAG_BYTES {
            return None;
        }
        let (tag, body) = bytes.split_at(TAG_BYTES);
        let tag: [u8; TAG_BYTES] = tag.try_into().ok()?;
        let mut inner = body.to_vec();
        self.xor_stream(&tag, &mut inner);
        // Compared in constant time: how long a refusal takes says nothing of how much
        // of a forged tag was right.
        let want = self.tag(shop, &inner);
        let same = want
            .iter()
            .zip(tag.iter())
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0;
        if !same {
            return None;
        }
        while inner.last() == Some(&0) {
            inner.pop();
        }
        String::from_utf8(inner).ok()
    }

    /// The key every node of this deployment shares, made at the first start: with a
    /// MongoDB journal, a document of the `secrets` collection (nodes on one database
    /// take each other's cursors: a stream resumes on another node); else the file
    /// [`CURSOR_KEY_FILE`] in the data dir, readable by its owner only.
    pub async fn load_or_make(
        data_dir: &std::path::Path,
        mongo_uri: Option<&str>,
    ) -> anyhow::Result<CursorKey> {
        let mut fresh = [0u8; 32];
        getrandom::fill(&mut fresh)
            .map_err(|e| anyhow::anyhow!("cannot read the OS random number generator: {e}"))?;
        let hex_key = match mongo_uri {
            Some(uri) => key_in_mongo(uri, &fresh).await?,
            None => key_in_file(data_dir, &fresh)?,
        };
        let bytes = hex::decode(hex_key.trim()).ok().filter(|b| b.len() == 32);
        let Some(bytes) = bytes else {
            anyhow::bail!("the stream's cursor key is not 64 hex digits; remove it to make a new one (open streams' cursors are then refused)");
        };
        let mut key = [0u8; 32];
        key.copy_from_slice(&bytes);
        Ok(CursorKey(key))
    }
}

/// The cursor key kept in MongoDB, shared by every node: whoever inserts first made it
/// (`fresh`), the others read it.
async fn key_in_mongo(uri: &str, fresh: &[u8; 32]) -> anyhow::Result<String> {
    use anyhow::Context;
    use mongodb::bson::{doc, Document};
    let shown = nrtxn_mongo::redact_uri(uri);
    let secrets = nrtxn_mongo::mongo_database(uri)
        .await?
        .collection::<Document>(SECRETS_COLLECTION);
    if let Err(e) = secrets
        .insert_one(doc! { "_id": CURSOR_KEY_ID, "key": hex::encode(fresh) })
        .await
    {
        if !nrtxn_mongo::is_duplicate(&e) {
            return Err(e).with_context(|| {
                format!("mongo_uri: cannot write the stream's cursor key to {shown}")
            });
        }
    }
    let found = secrets
        .find_one(doc! { "_id": CURSOR_KEY_ID })
        .await
        .with_context(|| format!("mongo_uri: cannot read the stream's cursor key from {shown}"))?;
    found
        .and_then(|d| d.get_str("key").ok().map(str::to_string))
        .with_context(|| format!("mongo_uri: no stream cursor key in {shown}"))
}

/// The cursor key in the data dir (mode 0600): made from `fresh` and synced if there is
/// none, else read.
fn key_in_file(data_dir: &std::path::Path, fresh: &[u8; 32]) -> anyhow::Result<String> {
    use anyhow::Context;
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let path = data_dir.join(CURSOR_KEY_FILE);
    std::fs::create_dir_all(data_dir)
        .with_context(|| format!("data_dir: cannot create {}", data_dir.display()))?;
    match std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&path)
    {
        Ok(mut f) => {
            f.write_all(hex::encode(fresh).as_bytes())
                .and_then(|()| f.sync_all())
                .with_context(|| format!("data_dir: cannot write {}", path.display()))?;
            Ok(hex::encode(fresh))
        }
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => std::fs::read_to_string(&path)
            .with_context(|| format!("data_dir: cannot read {}", path.display())),
        Err(e) => Err(e).with_context(|| format!("data_dir: cannot create {}", path.display())),
    }
}

/// A feed whose cursors are sealed ([`CursorKey`]): what the push stream serves.
pub struct SealedFeed {
    pub inner: Arc<dyn EventFeed>,
    pub key: CursorKey,
}

impl EventFeed for SealedFeed {
    fn open(
        &self,
        shop: Arc<str>,
        after: Option<&str>,
    ) -> Result<(Box<dyn FeedReader>, String), FeedError> {
        let inner_after = match after {
            None => None,
            Some(c) => Some(
                self.key
                    .open(&shop, c)
                    .ok_or_else(|| FeedError::BadCursor(c.to_string()))?,
            ),
        };
        let (reader, start) = self.inner.open(shop.clone(), inner_after.as_deref())?;
        let start = self.key.seal(&shop, &start);
        let reader = SealedReader {
            inner: reader,
            key: self.key.clone(),
            shop,
        };
        Ok((Box::new(reader), start))
    }
}

struct SealedReader {
    inner: Box<dyn FeedReader>,
    key: CursorKey,
    shop: Arc<str>,
}

impl FeedReader for SealedReader {
    fn next(&mut self, wait: Duration) -> Result<Vec<(String, Event)>, StoreError> {
        let events = self.inner.next(wait)?;
        Ok(events
            .into_iter()
            .map(|(c, e)| (self.key.seal(&self.shop, &c), e))
            .collect())
    }
}

#[cfg(test)]
mod sealed_tests {
    use super::*;

    #[test]
    fn a_sealed_cursor_opens_only_for_its_shop_and_key_and_hides_its_position() {
        let key = CursorKey::new([7; 32]);
        let sealed = key.seal("acme", "j123456.7");
        assert!(sealed.starts_with('c'));
        assert!(!sealed.contains("123456"), "{sealed}");
        assert_eq!(
            key.seal("acme", "j1.0").len(),
            sealed.len(),
            "the length does not tell the position's digits"
        );
        assert_eq!(key.open("acme", &sealed).as_deref(), Some("j123456.7"));
        assert_eq!(key.open("other", &sealed), None, "another shop's");
        assert_eq!(
            CursorKey::new([8; 32]).open("acme", &sealed),
            None,
            "another key's"
        );
        // One bit changed anywhere: refused.
        for i in 1..sealed.len() {
            let mut forged = sealed.clone().into_bytes();
            forged[i] = if forged[i] == b'0' { b'1' } else { b'0' };
            let forged = String::from_utf8(forged).unwrap();
            assert_eq!(key.open("acme", &forged), None, "{forged}");
        }
        for bad in ["", "c", "cxyz", "j1.0", "k1-2", &sealed[..sealed.len() - 2]] {
            assert_eq!(key.open("acme", bad), None, "{bad}");
        }
        // Longer than one block of the key stream.
        let long = format!(
            "k{}",
            (0..40).map(|i| i.to_string()).collect::<Vec<_>>().join("-")
        );
        assert_eq!(key.open("acme", &key.seal("acme", &long)), Some(long));
    }
}
