//! Coordinator errors and their gRPC codes; the one place they become `tonic::Status`.

pub mod shard;

use tonic::{Code, Status};

pub use shard::ShardCallError;

pub type Result<T, E = CoordError> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum CoordError {
    #[error("{field}: {reason}")]
    InvalidArgument { field: String, reason: String },
    #[error("collection {0:?} does not exist")]
    UnknownCollection(String),
    #[error("collection {0:?} already exists")]
    CollectionExists(String),
    #[error("{field}: {reason}")]
    TooLarge { field: String, reason: String },
    #[error("{what} unavailable: {reason}")]
    Unavailable {
        what: String,
        reason: String,
        retry_after_ms: u64,
    },
    #[error("deadline exceeded waiting for {0}")]
    Deadline(String),
    #[error("catalog: {0}")]
    Catalog(String),
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("API key {0:?} does not exist")]
    UnknownApiKey(String),
    /// No credentials, or credentials that are unknown, expired or revoked.
    #[error("{0}")]
    Unauthenticated(String),
    /// Valid credentials without the role or collection scope the call needs.
    #[error("{0}")]
    PermissionDenied(String),
    /// Admission refused: too many requests in flight (for the process or for one key).
    #[error("overloaded: {reason}")]
    Overloaded { reason: String, retry_after_ms: u64 },
    /// A shard call failed (`what` names the shard for the client: no node addresses).
    #[error("{what}: {error}")]
    Shard { what: String, error: ShardCallError },
    #[error("{0}")]
    Upstream(Status),
}

impl CoordError {
    pub fn invalid(field: impl Into<String>, reason: impl Into<String>) -> Self {
        Self::InvalidArgument {
            field: field.into(),
            reason: reason.into(),
        }
    }

    /// Whether another replica may succeed where this call failed: anything but a request
    /// that is wrong everywhere.
    pub fn is_retryable(&self) -> bool {
        match self {
            Self::Unavailable { .. } | Self::Deadline(_) | Self::Overloaded { .. } => true,
            Self::Shard { error, .. } => error.is_retryable(),
            Self::Upstream(s) => !matches!(
                s.code(),
                Code::InvalidArgument
                    | Code::OutOfRange
                    | Code::PermissionDenied
                    | Code::Unauthenticated
            ),
            _ => false,
        }
    }

    /// Classifies an error from a shard node or the model worker.
    pub fn upstream(what: &str, s: Status) -> Self {
        match s.code() {
            Code::Unavailable | Code::Unknown | Code::Cancelled => Self::Unavailable {
                what: what.to_owned(),
                reason: s.message().to_owned(),
                retry_after_ms: 200,
            },
            Code::DeadlineExceeded => Self::Deadline(what.to_owned()),
            _ => Self::Upstream(Status::new(s.code(), format!("{what}: {}", s.message()))),
        }
    }
}

impl From<CoordError> for Status {
    fn from(e: CoordError) -> Self {
        let code = match &e {
            CoordError::InvalidArgument { .. } => Code::InvalidArgument,
            CoordError::UnknownCollection(_) | CoordError::UnknownApiKey(_) => Code::NotFound,
            CoordError::Unauthenticated(_) => Code::Unauthenticated,
            CoordError::PermissionDenied(_) => Code::PermissionDenied,
            CoordError::Overloaded { .. } => Code::ResourceExhausted,
            CoordError::CollectionExists(_) => Code::AlreadyExists,
            CoordError::TooLarge { .. } => Code::ResourceExhausted,
            CoordError::Unavailable { .. } => Code::Unavailable,
            CoordError::Deadline(_) => Code::DeadlineExceeded,
            CoordError::Catalog(_) | CoordError::Tokenizer(_) => Code::Internal,
            CoordError::Upstream(s) => return s.clone(),
            CoordError::Shard { error, .. } => error.code(),
        };
        let mut s = Status::new(code, e.to_string());
        let retry_after_ms = match &e {
            CoordError::Unavailable { retry_after_ms, .. }
            | CoordError::Overloaded { retry_after_ms, .. } => Some(*retry_after_ms),
            CoordError::Shard {
                error: ShardCallError::Unavailable { retry_after, .. },
                ..
            } => Some(retry_after.as_millis() as u64),
            CoordError::Shard {
                error: ShardCallError::NotLeader { .. },
                ..
            } => Some(shard::DEFAULT_RETRY_AFTER.as_millis() as u64),
            _ => None,
        };
        if let Some(ms) = retry_after_ms
            && let Ok(v) = ms.to_string().parse()
        {
            s.metadata_mut().insert("retry-after-ms", v);
        }
        s
    }
}
