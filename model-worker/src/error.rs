//! Model worker errors and their gRPC codes.

use tonic::{Code, Status};

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("model {name}: cannot load {path}: {reason}")]
    Load {
        name: String,
        path: String,
        reason: String,
    },
    #[error("unknown model {0:?}")]
    UnknownModel(String),
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    #[error("queue of model {0} is full")]
    Overloaded(String),
    /// The work queued ahead would outlast the caller's deadline: refused up front rather
    /// than computed for nobody (`retry_after_ms`: when enough of it should be done).
    #[error(
        "model {model}: {wait_ms} ms of queued work ahead, over 3/4 of the request's deadline \
         of {deadline_ms} ms"
    )]
    Backlog {
        model: String,
        wait_ms: u64,
        deadline_ms: u64,
        retry_after_ms: u64,
    },
    #[error("inference failed: {0}")]
    Inference(String),
    /// A remote generation server could not be reached or failed.
    #[error("remote model server unavailable: {0}")]
    Unavailable(String),
}

impl From<candle_core::Error> for ModelError {
    fn from(e: candle_core::Error) -> Self {
        ModelError::Inference(e.to_string())
    }
}

impl From<ModelError> for Status {
    fn from(e: ModelError) -> Self {
        let code = match &e {
            ModelError::Load { .. } | ModelError::Inference(_) => Code::Internal,
            ModelError::UnknownModel(_) => Code::NotFound,
            ModelError::InvalidArgument(_) => Code::InvalidArgument,
            ModelError::Overloaded(_) | ModelError::Backlog { .. } => Code::ResourceExhausted,
            ModelError::Unavailable(_) => Code::Unavailable,
        };
        let retry = match (&e, code) {
            (ModelError::Backlog { retry_after_ms, .. }, _) => Some(*retry_after_ms),
            (_, Code::ResourceExhausted) => Some(50),
            (_, Code::Unavailable) => Some(1000),
            _ => None,
        };
        let mut s = Status::new(code, e.to_string());
        if let Some(ms) = retry {
            s.metadata_mut()
                .insert("retry-after-ms", tonic::metadata::MetadataValue::from(ms));
        }
        s
    }
}
