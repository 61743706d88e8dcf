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
