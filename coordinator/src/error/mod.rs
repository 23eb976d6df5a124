//! Coordinator errors and their gRPC codes; the one place they become `tonic::Status`.

pub mod shard;

use ragcluster_common::client::{RETRY_AFTER_MS, retry_after_ms};
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
    #[error("alias {0:?} does not exist")]
    UnknownAlias(String),
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
    #[error("node {0} is not a member of this cluster")]
    UnknownNode(u64),
    /// The cluster is not in a state that allows the change (e.g. removing a node that still
    /// holds replicas).
    #[error("{0}")]
    FailedPrecondition(String),
    /// No credentials, or credentials that are unknown, expired or revoked.
    #[error("{0}")]
    Unauthenticated(String),
    /// Valid credentials without the role or collection scope the call needs.
    #[error("{0}")]
    PermissionDenied(String),
    /// Admission refused: too many requests in flight (for the process or for one key), or
    /// a model worker's queue is full (its refusal and hint passed on to the client).
    #[error("overloaded: {reason}")]
    Overloaded { reason: String, retry_after_ms: u64 },
    /// A data directory's disk is full (the catalog's): the change was refused before
    /// anything was proposed.
    #[error("disk full: {0}")]
    DiskFull(String),
    /// A shard call failed (`what` names the shard for the client: no node addresses).
    #[error("{what}: {error}")]
    Shard { what: String, error: ShardCallError },
    #[error("{0}")]
    Upstream(Status),
    /// A write that some shards applied and others did not: `details` (the status details)
    /// say which documents were stored.
    #[error("{reason}")]
    Partial {
        code: Code,
        reason: String,
        retry_after_ms: u64,
        details: Vec<u8>,
    },
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
            // A full queue downstream: the client backs off by the hint (end-to-end
            // backpressure); without a hint it is a request too large, not load.
            Code::ResourceExhausted if retry_after_ms(&s).is_some() => Self::Overloaded {
                reason: format!("{what}: {}", s.message()),
                retry_after_ms: retry_after_ms(&s).unwrap_or(50),
            },
            _ => Self::Upstream(Status::new(s.code(), format!("{what}: {}", s.message()))),
        }
    }
}

impl CoordError {
    /// The gRPC code this error answers with.
    pub fn to_status_code(&self) -> Code {
        match self {
            CoordError::InvalidArgument { .. } => Code::InvalidArgument,
            CoordError::UnknownCollection(_)
            | CoordError::UnknownAlias(_)
            | CoordError::UnknownApiKey(_)
            | CoordError::UnknownNode(_) => Code::NotFound,
            CoordError::FailedPrecondition(_) => Code::FailedPrecondition,
            CoordError::Unauthenticated(_) => Code::Unauthenticated,
            CoordError::PermissionDenied(_) => Code::PermissionDenied,
            CoordError::Overloaded { .. } => Code::ResourceExhausted,
            CoordError::CollectionExists(_) => Code::AlreadyExists,
            CoordError::TooLarge { .. } | CoordError::DiskFull(_) => Code::ResourceExhausted,
            CoordError::Unavailable { .. } => Code::Unavailable,
            CoordError::Deadline(_) => Code::DeadlineExceeded,
            CoordError::Catalog(_) | CoordError::Tokenizer(_) => Code::Internal,
            CoordError::Upstream(s) => s.code(),
            CoordError::Shard { error, .. } => error.code(),
            CoordError::Partial { code, .. } => *code,
        }
    }

    /// The retry hint (`retry-after-ms`) of an error worth retrying later.
    pub fn retry_after_ms(&self) -> Option<u64> {
        match self {
            CoordError::DiskFull(_) => Some(1000),
            CoordError::Unavailable { retry_after_ms, .. }
            | CoordError::Overloaded { retry_after_ms, .. }
            | CoordError::Partial { retry_after_ms, .. } => Some(*retry_after_ms),
            CoordError::Shard {
                error:
                    ShardCallError::Unavailable { retry_after, .. }
                    | ShardCallError::DiskFull { retry_after, .. },
                ..
            } => Some(retry_after.as_millis() as u64),
            CoordError::Shard {
                error: ShardCallError::NotLeader { .. },
                ..
            } => Some(shard::DEFAULT_RETRY_AFTER.as_millis() as u64),
            _ => None,
        }
    }
}

/// A message for clients: node addresses (`http://host:port`, `1.2.3.4:5`) become "a node".
/// Errors of shard nodes and the model worker may name them; clients never dial those.
pub fn redact_addresses(msg: &str) -> String {
    let mut out = String::with_capacity(msg.len());
    for (i, word) in msg.split(' ').enumerate() {
        if i > 0 {
            out.push(' ');
        }
        let core = word.trim_end_matches([',', ')', ':', ';', '.', '"', '\'']);
        let bare = core.trim_start_matches(['(', '"', '\'']);
        let is_addr = bare.starts_with("http://")
            || bare.starts_with("https://")
            || bare.rsplit_once(':').is_some_and(|(host, port)| {
                !port.is_empty()
                    && port.bytes().all(|b| b.is_ascii_digit())
                    && host.parse::<std::net::IpAddr>().is_ok()
            });
        if is_addr && !bare.is_empty() {
            out.push_str(&word.replace(bare, "a node"));
        } else {
            out.push_str(word);
        }
    }
    out
}

impl From<CoordError> for Status {
    fn from(e: CoordError) -> Self {
        let code = e.to_status_code();
        let retry_after_ms = e.retry_after_ms();
        let mut s = match e {
            CoordError::Upstream(s) => Status::new(s.code(), redact_addresses(s.message())),
            CoordError::Partial {
                code,
                reason,
                details,
                ..
            } => Status::with_details(code, redact_addresses(&reason), details.into()),
            e => Status::new(code, redact_addresses(&e.to_string())),
        };
        if let Some(ms) = retry_after_ms
            && let Ok(v) = ms.to_string().parse()
        {
            s.metadata_mut().insert(RETRY_AFTER_MS, v);
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_queue_downstream_is_passed_on_with_its_hint() {
        let mut s = Status::resource_exhausted("queue of all-MiniLM-L6-v2 is full");
        s.metadata_mut()
            .insert("retry-after-ms", "75".parse().unwrap());
        let e = CoordError::upstream("model worker", s);
        assert_eq!(e.retry_after_ms(), Some(75));
        let out = Status::from(e);
        assert_eq!(out.code(), Code::ResourceExhausted);
        assert_eq!(out.metadata().get("retry-after-ms").unwrap(), "75");
        // Too large a request: no hint, not load; passed on as it is.
        let e = CoordError::upstream("model worker", Status::resource_exhausted("too long"));
        assert_eq!(e.retry_after_ms(), None);
        assert_eq!(e.to_status_code(), Code::ResourceExhausted);
    }

    #[test]
    fn client_messages_name_no_node_address() {
        assert_eq!(
            redact_addresses("shard 1 on http://127.0.0.1:4100: unavailable"),
            "shard 1 on a node: unavailable"
        );
        assert_eq!(
            redact_addresses("dial (10.0.0.7:50051) failed"),
            "dial (a node) failed"
        );
        assert_eq!(redact_addresses("ratio 1:2 at 12:30"), "ratio 1:2 at 12:30");
    }
}
