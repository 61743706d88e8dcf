//! nrtxn's clients, which talk to a running server and hold no state of their own: the
//! command line's `items` (load a CSV file, list, get), `txn` (submit, get) and `watch`
//! commands ([`commands`], re-exported here), and [`follow::Follower`], which turns an
//! at-least-once stream of an item's events (the events topic, or polls of the events
//! route) into a gapless one in `seq` order, filling gaps from the server. The binary
//! (`nrtxn`) parses the command line and calls into this crate; nothing here knows of
//! the journal, the engine or the server's configuration.

pub mod commands;
pub mod follow;

pub use commands::{items, txn, watch, Conn, ItemsCommand, TxnCommand, WatchArgs};
