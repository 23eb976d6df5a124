//! The state machine a Raft group replicates: the coordinators' catalog, or a shard replica's
//! chunk store and indexes.

use raft::eraftpb::{ConfState, HardState, SnapshotMetadata};

use crate::error::Fatal;

/// Why no snapshot can be cut right now.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    /// Ask again later (raft-rs retries).
    #[error("snapshot temporarily unavailable")]
    NotYet,
    #[error(transparent)]
    Fatal(#[from] Fatal),
}

/// Called on the member's own thread only, one entry at a time, in log order. Methods take
/// `&self` because readers (searches, status) share the machine with the Raft thread.
///
/// Durability contract: `apply` and `apply_empty` make the entry's effect and the applied index
/// durable together (one atomic write), and a conf state handed to `apply_empty` is persisted
/// in that same write, so a crash never re-applies an entry nor loses a membership change.
pub trait StateMachine: Send + Sync + 'static {
    /// What the proposer of an entry is told once it is applied.
    type Response: Send + 'static;

    /// Index of the last applied entry, as durable.
    fn applied_index(&self) -> u64;

    /// The index whose effects reads see. Equals `applied_index` unless the machine makes
    /// entries visible after they are durable (a shard's indexes catch up off the Raft thread).
    fn visible_index(&self) -> u64 {
        self.applied_index()
    }

    /// Applies a normal entry carrying `data`.
    fn apply(&self, index: u64, term: u64, data: &[u8]) -> Result<Self::Response, Fatal>;

    /// Moves the applied index over an entry without a command: a new leader's empty entry, or
    /// a membership change with the conf state it results in.
    fn apply_empty(&self, index: u64, term: u64, conf: Option<&ConfState>) -> Result<(), Fatal>;

    /// The snapshot `data` of the state as of `applied_index` (= `index`, whose log term is
    /// `term`), for member `to`.
    fn snapshot(&self, index: u64, term: u64, to: u64) -> Result<Vec<u8>, SnapshotError>;

    /// Replaces the state with a leader's snapshot, atomically with the log's reset to it
    /// (`meta` index and term, its conf state, the hard state `hs`).
    fn restore(&self, meta: &SnapshotMetadata, data: &[u8], hs: &HardState) -> Result<(), Fatal>;
}
