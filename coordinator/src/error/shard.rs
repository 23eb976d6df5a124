//! What a shard call can fail with, typed from the status a shard node answers (its code and
//! the `ShardErrorDetail` in its details), never from its message.

use std::time::Duration;

use prost::Message as _;
use ragcluster_proto::v1::ShardErrorDetail;
use tonic::{Code, Status};

#[derive(Debug, Clone, thiserror::Error)]
pub enum ShardCallError {
    /// The replica does not lead its group; `leader` is (node id, address) when known.
    #[error("not the shard leader")]
    NotLeader { leader: Option<(u64, String)> },
    /// Unreachable, stopped, without quorum or overloaded: another replica or a later try may
    /// succeed.
    #[error("unavailable: {reason}")]
    Unavailable {
        reason: String,
        retry_after: Duration,
    },
    /// A full disk refused the write before anything was proposed: the leader's (its
    /// leaderships move to replicas with room) or too many of the group's voters'.
    #[error("{reason}")]
    DiskFull {
        reason: String,
        retry_after: Duration,
    },
    /// The call's deadline passed; a write's outcome is unknown.
    #[error("deadline exceeded")]
    Deadline,
    /// The node holds no replica of the shard (it moved away, or is not created yet): another
    /// replica may answer a read.
    #[error("{0}")]
    NotHere(String),
    /// Refused for what it asked (bad argument, unknown shard, failed precondition...):
    /// retrying cannot help.
    #[error("{}", .0.message())]
    Rejected(Status),
}

/// When a node gives no hint.
pub const DEFAULT_RETRY_AFTER: Duration = Duration::from_millis(200);

impl ShardCallError {
    pub fn from_status(s: Status) -> Self {
        let detail = ShardErrorDetail::decode(s.details()).unwrap_or_default();
        let retry_after = match detail.retry_after_ms {
            0 => DEFAULT_RETRY_AFTER,
            ms => Duration::from_millis(u64::from(ms)),
        };
        match s.code() {
            Code::ResourceExhausted if detail.disk_full => Self::DiskFull {
                reason: s.message().to_owned(),
                retry_after,
            },
            Code::Unavailable => match detail.not_leader {
                Some(nl) => Self::NotLeader {
                    leader: (nl.leader_id != 0).then_some((nl.leader_id, nl.leader_address)),
                },
                None => Self::Unavailable {
                    reason: s.message().to_owned(),
                    retry_after,
                },
            },
            // Transport failures surface as these (a reset stream, a dropped connection).
            Code::Unknown | Code::Cancelled | Code::ResourceExhausted => Self::Unavailable {
                reason: s.message().to_owned(),
                retry_after,
            },
            Code::DeadlineExceeded => Self::Deadline,
            Code::NotFound => Self::NotHere(s.message().to_owned()),
            _ => Self::Rejected(s),
        }
    }

    /// Whether another replica, or the same one later, may succeed.
    pub fn is_retryable(&self) -> bool {
        !matches!(self, Self::Rejected(_))
    }

    /// The code this error carries.
    pub fn code(&self) -> Code {
        match self {
            Self::NotLeader { .. } | Self::Unavailable { .. } => Code::Unavailable,
            Self::DiskFull { .. } => Code::ResourceExhausted,
            Self::Deadline => Code::DeadlineExceeded,
            Self::NotHere(_) => Code::NotFound,
            Self::Rejected(s) => s.code(),
        }
    }
}

impl From<Status> for ShardCallError {
    fn from(s: Status) -> Self {
        Self::from_status(s)
    }
}
