//! Errors of the shard node and their gRPC status codes (the one `From<ShardError> for Status`).

use prost::Message as _;
use ragcluster_proto::v1::{NotLeader, ShardErrorDetail};
use tonic::{Code, Status};

pub type Result<T, E = ShardError> = std::result::Result<T, E>;

/// Leader hint carried by NotLeader errors: (node id, address).
pub type LeaderHint = Option<(u64, String)>;

#[derive(Debug, thiserror::Error)]
pub enum ShardError {
    #[error("shard {0} does not exist on this node")]
    UnknownShard(String),
    #[error("shard {shard} already exists with dimension {existing}, requested {requested}")]
    ShardConflict {
        shard: String,
        existing: u32,
        requested: u32,
    },
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    #[error("storage error: {0}")]
    Storage(#[from] rocksdb::Error),
    #[error("bm25 index error: {0}")]
    Bm25(#[from] tantivy::TantivyError),
    #[error("corrupt record: {0}")]
    Corrupt(String),
    #[error("io error: {0}")]
    Io(#[from] std::io::Error),
    #[error("internal task failed: {0}")]
    Join(String),
    #[error("not the shard leader{}", .0.as_ref().map(|(id, a)| format!("; leader is node {id} at {a}")).unwrap_or_default())]
    NotLeader(LeaderHint),
    #[error("unavailable: {0}")]
    Unavailable(String),
    #[error("failed precondition: {0}")]
    FailedPrecondition(String),
    /// A disk is full: this node's, or too many of the group's replicas' to commit.
    #[error("disk full: {0}")]
    DiskFull(String),
}

impl From<ShardError> for Status {
    fn from(e: ShardError) -> Self {
        let code = match &e {
            ShardError::UnknownShard(_) => Code::NotFound,
            ShardError::ShardConflict { .. } => Code::FailedPrecondition,
            ShardError::InvalidArgument(_) => Code::InvalidArgument,
            // Storage failures leave the write unacknowledged; the client may retry.
            ShardError::Storage(_) | ShardError::Io(_) | ShardError::Join(_) => Code::Unavailable,
            ShardError::Bm25(_) | ShardError::Corrupt(_) => Code::Internal,
            ShardError::NotLeader(_) | ShardError::Unavailable(_) => Code::Unavailable,
            ShardError::FailedPrecondition(_) => Code::FailedPrecondition,
            ShardError::DiskFull(_) => Code::ResourceExhausted,
        };
        // Callers act on the detail (the leader to follow, when to retry), never the message.
        let detail = match &e {
            ShardError::NotLeader(hint) => Some(ShardErrorDetail {
                not_leader: Some(NotLeader {
                    leader_id: hint.as_ref().map_or(0, |h| h.0),
                    leader_address: hint.as_ref().map(|h| h.1.clone()).unwrap_or_default(),
                }),
                retry_after_ms: if hint.is_some() { 0 } else { 200 },
                disk_full: false,
            }),
            ShardError::Unavailable(_) => Some(ShardErrorDetail {
                not_leader: None,
                retry_after_ms: 200,
                disk_full: false,
            }),
            // Leadership moves within an election timeout or two when other replicas can write.
            ShardError::DiskFull(_) => Some(ShardErrorDetail {
                not_leader: None,
                retry_after_ms: 1000,
                disk_full: true,
            }),
            _ => None,
        };
        match detail {
            Some(d) => Status::with_details(code, e.to_string(), d.encode_to_vec().into()),
            None => Status::new(code, e.to_string()),
        }
    }
}
