//! Two nodes sharing one Kafka group and one MongoDB database (the test servers
//! `scripts/test.sh` starts on loopback).

use super::*;

/// Flags of node `node` of the two-node group of `test`: one topic, group and database
/// per test, shared by the two nodes.
pub fn node_flags(test: &str, node: u32) -> Option<Vec<String>> {
    let mut flags = kafka_flags(test)?;
    flags.extend([
        "--mongo-uri".to_string(),
        mongo_uri(test)?,
        "--node-id".to_string(),
        node.to_string(),
        "--shards".to_string(),
        "4".to_string(),
        // The takeover waits for the group to notice the dead node (10 s).
        "--reply-timeout-ms".to_string(),
        "20000".to_string(),
    ]);
    Some(flags)
}

/// Sets flag `name`'s value in `flags` (it must be there).
pub fn set_flag(flags: &mut [String], name: &str, value: &str) {
    let at = flags
        .iter()
        .position(|f| f == name)
        .unwrap_or_else(|| panic!("no {name} among {flags:?}"));
    flags[at + 1] = value.to_string();
}

pub struct Nodes {
    /// Each node's folder (its data dir and log), kept for a restart.
    pub dirs: [tempfile::TempDir; 2],
    pub nodes: [Server; 2],
    pub mongo: String,
}

/// Starts node 0, then node 1, and waits until both hold partitions.
pub async fn start_two(test: &str) -> Option<Nodes> {
    start_two_env(test, &[]).await
}

/// [`start_two`], node 1 with the environment `env1` (faults to inject).
pub async fn start_two_env(test: &str, env1: &[(&str, &str)]) -> Option<Nodes> {
    start_two_with(test, env1, |_| {}).await
}

/// [`start_two_env`], each node's flags changed by `edit` first.
pub async fn start_two_with(
    test: &str,
    env1: &[(&str, &str)],
    edit: impl Fn(&mut Vec<String>),
) -> Option<Nodes> {
    let mut flags: Vec<Vec<String>> = vec![node_flags(test, 0)?, node_flags(test, 1)?];
    flags.iter_mut().for_each(&edit);
    let dirs = [tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap()];
    let c = client();
    let start = |i: usize| {
        let f: Vec<&str> = flags[i].iter().map(String::as_str).collect();
        Server::start_env(dirs[i].path(), &f, if i == 1 { env1 } else { &[] })
    };
    let started = std::time::Instant::now();
    let n0 = start(0);
    wait_ready(&c, &n0).await;
    let n1 = start(1);
    wait_ready(&c, &n1).await;
    // Node 1's join took partitions from node 0 in a rebalance.
    wait_ready(&c, &n0).await;
    eprintln!(
        "both nodes ready after {} ms",
        started.elapsed().as_millis()
    );
    Some(Nodes {
        dirs,
        nodes: [n0, n1],
        mongo: mongo_uri(test)?,
    })
}
