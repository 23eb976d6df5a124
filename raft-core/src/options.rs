//! How a group member runs: its id, timing, log compaction and what it may assume of its
//! storage. Set by each owner of a group (the coordinators' catalog, every shard replica,
//! the simulation).

use std::time::Duration;

#[derive(Debug, Clone)]
pub struct Options {
    pub id: u64,
    pub tick: Duration,
    pub election_ticks: usize,
    pub heartbeat_ticks: usize,
    /// Compact the log once it holds this many entries, keeping the newest half. Members
    /// further behind catch up from a snapshot.
    pub log_gc_threshold: u64,
    /// Also drop applied entries eagerly (in steps of `log_gc_threshold / 64`, at least 16,
    /// or of `COMPACT_APPLIED_BYTES`), as far as every member has them: only for a state
    /// machine whose writes go through the same RocksDB WAL as the log, so that a recovered
    /// log deletion implies the applied state it relied on was recovered too (RocksDB
    /// recovers a prefix of its WAL).
    pub compact_applied: bool,
    /// Start an election at once (a fresh group's preferred leader, a lone member) instead of
    /// waiting out a timeout.
    pub campaign: bool,
    /// The member's storage was created empty by this process (a new group, a learner
    /// joining, a replica rebuilt from its peers), not opened from disk: all it acknowledged
    /// is still in its log. A heartbeat committing past the log's end was then meant for an
    /// earlier replica of the group on this node (the one a rebuild replaced, a dropped
    /// collection of the same name) and is still in flight: it is dropped, not taken for
    /// lost entries (`RaftNode::shows_lost_entries`).
    pub created: bool,
    /// A fixed election timeout in ticks instead of raft-rs' random one: the simulation needs
    /// every run of a seed to be the same.
    pub fixed_election_timeout: Option<usize>,
    /// Name in logs and metric labels ("catalog", "docs/0").
    pub name: String,
    /// Metric name prefix: counters are `<prefix>_leader_changes_total` and the like.
    pub metrics_prefix: &'static str,
}
