//! The engine's threads kept one to a core.
//!
//! Each arbiter serves its share of the connections and runs the WorkManagers and
//! processors placed on it; the thread of the shards is the busiest. Left to the
//! scheduler on two cores, the two arbiters, the log's writer and a client on the same
//! machine move between the cores, and the busiest arbiter often waits behind another
//! thread while a core is free. Kept one to a core, single requests were decided 1.03
//! to 1.12 times as fast on two cores, orders and batches alike
//! (`docs/decisions/thread-placement.md`).
//!
//! Only when the cores the process may use are exactly one per arbiter: on a machine
//! shared with other work, or with more cores than arbiters, the scheduler places them.
//! Two servers on one host both keep their arbiters on the same cores: turn it off there
//! (`pin_threads = false`).

use actix::prelude::ArbiterHandle;
use rustix::thread::{sched_getaffinity, sched_setaffinity, CpuSet};

/// The cores the calling thread may run on, in order, if they are exactly one for each
/// of `arbiters` (two at least).
fn one_core_each(arbiters: usize) -> Option<Vec<usize>> {
    let allowed = sched_getaffinity(None).ok()?;
    let cores: Vec<usize> = (0..CpuSet::MAX_CPU)
        .filter(|&c| allowed.is_set(c))
        .collect();
    (arbiters >= 2 && cores.len() == arbiters).then_some(cores)
}

/// Keeps each arbiter on a core of its own, in order, when the cores allowed are one per
/// arbiter; returns the cores, if it did. A core that cannot be set is logged and the
/// arbiter left where it was.
pub(super) fn pin_arbiters(arbiters: &[ArbiterHandle]) -> Option<Vec<usize>> {
    let cores = one_core_each(arbiters.len())?;
    for (i, (arbiter, &core)) in arbiters.iter().zip(&cores).enumerate() {
        arbiter.spawn_fn(move || {
            let mut set = CpuSet::new();
            set.set(core);
            if let Err(e) = sched_setaffinity(None, &set) {
                tracing::warn!(arbiter = i, core, error = %e, "cannot keep the engine thread on its core");
            }
        });
    }
    Some(cores)
}
