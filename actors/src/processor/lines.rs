//! Order lines a shard holds for orders not yet held, and the lines that wait for them.
//!
//! A line that finds too little stock, but enough once the lines of other orders still
//! being reserved are counted back, waits here until one of those is decided (made
//! firm or ended), rather than being refused for stock that may come back a moment
//! later. A part of its own because the count of waiting lines is a bound
//! ([`WAITING_LINES_MAX`]) every line in or out must keep true.

use std::collections::HashMap;

use crate::types::{Millis, Request};

use super::items::ItemKey;
use super::WAITING_LINES_MAX;

#[derive(Default)]
pub(super) struct OrderLines {
    /// Per item, the quantity held by lines of orders not yet held: a line that finds
    /// too little stock but enough with these counted back waits ([`Status::Tentative`]
    /// past the bound). An item with none has no entry.
    ///
    /// [`Status::Tentative`]: crate::types::Status::Tentative
    tentative: HashMap<ItemKey, i64>,
    /// Order lines waiting for the tentative lines of their item to be decided, by item:
    /// given back when a tentative line of the item becomes firm or ends, or when they
    /// have waited the request TTL.
    waiting: HashMap<ItemKey, Vec<Request>>,
    /// Lines in `waiting`; at most [`WAITING_LINES_MAX`].
    waiting_count: usize,
    /// Whether a sweep of lines waiting past the request TTL is armed.
    sweep_armed: bool,
}

impl OrderLines {
    /// The quantity tentative lines hold of an item.
    pub(super) fn tentative(&self, key: &ItemKey) -> i64 {
        self.tentative.get(key).copied().unwrap_or(0)
    }

    /// A line of `qty` of an item was held for an order not yet held.
    pub(super) fn held(&mut self, key: ItemKey, qty: i64) {
        *self.tentative.entry(key).or_default() += qty;
    }

    /// Puts a line in to wait, unless [`WAITING_LINES_MAX`] already wait.
    pub(super) fn wait(&mut self, req: &Request) -> bool {
        if self.waiting_count >= WAITING_LINES_MAX {
            return false;
        }
        self.waiting
            .entry((req.shop.clone(), req.item.clone()))
            .or_default()
            .push(req.clone());
        self.waiting_count += 1;
        self.assert_counted();
        true
    }

    /// `qty` of the item's tentative lines are decided (firm, or ended): the lines
    /// waiting on the item are given back, to be decided again.
    pub(super) fn done(&mut self, key: &ItemKey, qty: i64) -> Vec<Request> {
        if let Some(n) = self.tentative.get_mut(key) {
            *n -= qty;
            // Each line's quantity is counted once when held tentative and taken out
            // once (made firm or ended): below zero, a line was taken out twice.
            debug_assert!(*n >= 0, "tentative quantity of {key:?} below zero: {n}");
            if *n <= 0 {
                self.tentative.remove(key);
            }
        }
        let lines = self.waiting.remove(key).unwrap_or_default();
        self.waiting_count -= lines.len();
        self.assert_counted();
        lines
    }

    /// Takes out the waiting lines older than `ttl_ms` at `now`, which are then decided
    /// (`expired`, if nothing moved meanwhile).
    pub(super) fn sweep(&mut self, now: Millis, ttl_ms: i64) -> Vec<Request> {
        self.sweep_armed = false;
        let mut back = Vec::new();
        for lines in self.waiting.values_mut() {
            let (old, keep): (Vec<Request>, Vec<Request>) = std::mem::take(lines)
                .into_iter()
                .partition(|r| now.saturating_sub(r.submitted_at) > ttl_ms);
            *lines = keep;
            back.extend(old);
        }
        self.waiting.retain(|_, lines| !lines.is_empty());
        self.waiting_count -= back.len();
        self.assert_counted();
        back
    }

    /// Whether a sweep should be armed now (lines wait, and none is armed); if so, it
    /// counts as armed.
    pub(super) fn arm_sweep(&mut self) -> bool {
        if self.sweep_armed || self.waiting_count == 0 {
            return false;
        }
        self.sweep_armed = true;
        true
    }

    /// Asserts that the count is the lines waiting (the bound is checked against it).
    fn assert_counted(&self) {
        debug_assert_eq!(
            self.waiting.values().map(Vec::len).sum::<usize>(),
            self.waiting_count,
            "waiting lines"
        );
    }
}
