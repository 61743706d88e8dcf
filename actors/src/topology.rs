//! How a node shares its work with other nodes, chosen when the engine is built, before
//! any shard starts. The core reads it and nothing else: no flag is set, and no hook
//! attached, once the shards run.
//!
//! The choice used to be made late: a shared log attached its hooks while it was made,
//! after the shards had started and armed the holds they recovered. A shard that woke in
//! between did not know whether a shared log would come, and the fault campaign saw a
//! restarted node decide an overdue expiry of another node's item there (a write that
//! came through no log, so no lease fenced it). Built first, the shards know from their
//! first tick.

use std::sync::Arc;

use crate::ports::LogHooks;

/// Where requests come from, and who else writes the journal.
#[derive(Clone, Default)]
pub enum Topology {
    /// This node's own request log (the embedded one): every request it reads is its
    /// own, and it owns every item, whatever journal is beside it.
    #[default]
    Alone,
    /// A request log several nodes read (Kafka), partitioned by item: the processors
    /// check every key against the journal, drop what was read under an old partition
    /// epoch, and send outcomes and their own requests through the log's hooks.
    Shared(Arc<SharedLog>),
}

/// A log several nodes read, as the processors see it.
pub struct SharedLog {
    /// What the log is told and asked to carry ([`LogHooks`]).
    pub hooks: LogHooks,
    /// Who writes the journal beside it.
    pub journal: JournalWriters,
}

/// Who writes the journal beside a log several nodes read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum JournalWriters {
    /// Each node its own (the embedded journal).
    ThisNode,
    /// Every node one journal (MongoDB): then an item is read back from it when its
    /// partition comes (back) to this node, and a hold's expiry goes through the log to
    /// the item's owner rather than being decided here.
    AllNodes,
}

impl Topology {
    /// A log several nodes read, with its hooks.
    pub fn shared(hooks: LogHooks, journal: JournalWriters) -> Topology {
        Topology::Shared(Arc::new(SharedLog { hooks, journal }))
    }

    /// Whether requests come through a log several nodes read: then an outcome may be
    /// decided on another node, and its reply lost with that node.
    pub fn is_shared(&self) -> bool {
        self.log().is_some()
    }

    /// The shared log, if there is one.
    pub fn log(&self) -> Option<&Arc<SharedLog>> {
        match self {
            Topology::Alone => None,
            Topology::Shared(log) => Some(log),
        }
    }

    /// Whether other nodes write the same journal through a shared log.
    pub fn shares_journal(&self) -> bool {
        self.log()
            .is_some_and(|l| l.journal == JournalWriters::AllNodes)
    }
}
