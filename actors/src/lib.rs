//! nrtxn's core: domain types, the processor's apply step, the WorkManager and Processor
//! actors, the priority mailbox, and the ports (`Journal`, `RequestLog`) that adapters
//! implement. It knows nothing of HTTP, Kafka, MongoDB or SQLite.
//!
//! Where is the rule that prevents overselling? [`apply`].

pub mod apply;
pub mod checkback;
pub mod dead_letters;
pub mod engine;
pub mod extend;
pub mod fatal;
pub mod hold_end;
pub mod ledger;
pub mod mailbox;
pub mod metrics;
pub mod orders;
pub mod ports;
pub mod processor;
pub mod recent;
pub mod release;
pub mod reply;
pub mod returns;
pub mod secret;
pub mod settling;
pub mod shop_stats;
pub mod shrink;
pub mod topology;
pub mod transfers;
pub mod types;
pub mod verify;
pub mod wheel;
pub mod work_manager;

pub use engine::{Dispatcher, Engine, EngineBuilder, EngineConfig, EngineError};
pub use hold_end::HoldEnd;
pub use metrics::Metrics;
pub use ports::{
    AppendDone, EventFeed, FeedError, FeedReader, HoldPage, HoldQuery, ItemPage, ItemReads,
    Journal, JournalWrite, JournaledHook, Leases, Lifecycle, LogAck, LogHooks, Outbox,
    OutboxReader, Outcomes, Recovered, RelayPage, RemoteReplies, RequestLog, ShardJournal, Sharing,
    StoreError,
};
pub use reply::{Answers, Reply};
pub use secret::Secret;
pub use topology::{JournalWriters, Topology};
pub use types::*;
pub use work_manager::PollResult;
