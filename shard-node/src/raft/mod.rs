//! Replication: every shard replica is a member of one Raft group (tikv `raft`, `RawNode`).
//!
//! - `log`: the group's Raft log, hard state and conf state in the node's RocksDB, behind
//!   raft-rs' `Storage` trait; it also cuts snapshots of the state machine.
//! - `group`: one thread per replica drives its `RawNode`: ticks, steps incoming messages,
//!   takes proposals, and handles every `Ready` in the order raft-rs requires (send leader
//!   messages, install a snapshot, apply committed entries, persist entries and hard state,
//!   send the rest, advance).
//! - `transport`: one long-lived gRPC stream per peer node carrying batched messages of every
//!   group, reconnect with backoff, unreachable reports; snapshots go on their own stream.
//! - `snapshot`: snapshot files (the shard's RocksDB records), checked by size and CRC32.

pub mod group;
pub mod log;
pub mod snapshot;
pub mod transport;

use std::time::Duration;

/// Raft timing and log limits of a node's groups.
#[derive(Debug, Clone)]
pub struct RaftOptions {
    pub tick: Duration,
    pub election_ticks: usize,
    pub heartbeat_ticks: usize,
    /// Compact a group's log once it holds this many entries, keeping the newest half.
    pub log_gc_threshold: u64,
}

/// Leader hint carried by NotLeader errors: (node id, address).
pub type LeaderHint = Option<(u64, String)>;

pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}
