//! What a Raft member answers its callers, and the one failure that stops it.

use std::time::Duration;

/// Why a proposal, membership change or read index was not carried out. Every variant but
/// `FailedPrecondition` is worth retrying (elsewhere, or later).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RaftError {
    /// This member does not lead; `leader` is the member that does, when one is known.
    #[error("not the leader{}", .leader.map(|l| format!("; member {l} leads")).unwrap_or_default())]
    NotLeader { leader: Option<u64> },
    /// The member stopped (shutdown, removal or a storage failure).
    #[error("raft member stopped")]
    Stopped,
    /// Not committed in time: no quorum, or an election. The outcome is unknown.
    #[error("{what} not committed within {} ms (no leader or no quorum?); the outcome is unknown", .after.as_millis())]
    Timeout { what: &'static str, after: Duration },
    /// A membership change that cannot be made now (and may never be).
    #[error("{0}")]
    FailedPrecondition(String),
}

/// A storage failure. The member stops rather than diverge or acknowledge what is not durable.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct Fatal(pub String);

impl Fatal {
    pub fn new(what: impl std::fmt::Display) -> Self {
        Self(what.to_string())
    }

    /// Whether the write failed for want of space (ENOSPC, which RocksDB passes on as text
    /// only): worth trying again once space is freed, not a reason to stop the member.
    pub fn is_no_space(&self) -> bool {
        self.0.contains("No space left on device") || self.0.contains("os error 28")
    }
}

impl From<raft::Error> for Fatal {
    fn from(e: raft::Error) -> Self {
        Self(format!("raft: {e}"))
    }
}

impl From<rocksdb::Error> for Fatal {
    fn from(e: rocksdb::Error) -> Self {
        Self(format!("rocksdb: {e}"))
    }
}

impl From<protobuf::ProtobufError> for Fatal {
    fn from(e: protobuf::ProtobufError) -> Self {
        Self(format!("encoding: {e}"))
    }
}
