//! The one Raft integration of ragcluster, on raft-rs (tikv `raft`). The coordinators' catalog
//! and every shard replica are groups of this core; they differ only in their `StateMachine`
//! and their `Dialer`.
//!
//! - `node`: a member (`RaftNode`): the ready loop in raft-rs' documented order, proposal
//!   waiters, read index, membership changes (ConfChangeV2, one at a time, quorum-checked),
//!   log compaction, status on a watch channel.
//! - `driver`: a member on its own thread (`Member`), the async API callers use.
//! - `mailbox`: what a member's mailbox carries.
//! - `transport`: per-peer connections with batching, backoff and unreachable reports; routing
//!   of incoming messages to groups; the `raft_isolate` failpoint.
//! - `storage`: the `LogStore` trait, over RocksDB (`RocksLog`) or memory (`MemLog`).
//! - `machine`: the `StateMachine` trait and its durability contract.
//!
//! This crate knows nothing of gRPC, shards or collections; it must not depend on any
//! ragcluster crate.

pub mod driver;
pub mod error;
pub mod machine;
pub mod mailbox;
pub mod node;
mod options;
mod read_ctx;
pub mod status;
pub mod storage;
pub mod transport;

pub use driver::{Member, conf_change};
pub use error::{Fatal, RaftError};
pub use machine::{SnapshotError, StateMachine};
pub use mailbox::{Msg, mailbox};
pub use node::RaftNode;
pub use options::Options;
pub use raft::eraftpb;
pub use status::{Role, Status};
pub use storage::mem::{MemDisk, MemLog};
pub use storage::rocks::{Keys, RocksLog};
pub use storage::{LogStore, Persisted};
pub use transport::{Delivery, Dialer, Envelope, GroupId, Outbox, Refuse, Transport};

/// The counters a process's Raft groups record under `prefix` ("raft", "catalog"), as (name,
/// help), so the process can register them at start.
pub fn counter_families(prefix: &str) -> Vec<(String, &'static str)> {
    [
        (
            "leader_changes_total",
            "leader changes seen by this process's groups",
        ),
        (
            "snapshots_applied_total",
            "snapshots applied to a state machine",
        ),
        ("log_compactions_total", "Raft log compactions"),
        (
            "messages_dropped_total",
            "Raft messages dropped (peer unreachable or queue full)",
        ),
        (
            "messages_invalid_total",
            "Raft messages that could not be decoded or routed",
        ),
        (
            "messages_refused_total",
            "incoming Raft messages turned away (log entries, snapshots and leadership while \
             the disk is full)",
        ),
        (
            "writes_stalled_total",
            "log or state-machine writes that failed for want of space and waited for it",
        ),
        (
            "stale_heartbeats_total",
            "heartbeats committing past the log of a member created by this process, meant for \
             an earlier replica on this node and dropped",
        ),
    ]
    .into_iter()
    .map(|(n, h)| (format!("{prefix}_{n}"), h))
    .collect()
}

/// Milliseconds since the Unix epoch (the proposal clock written into log entries).
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}
