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
            ModelError::Overloaded(_) => Code::ResourceExhausted,
            ModelError::Unavailable(_) => Code::Unavailable,
        };
        let mut s = Status::new(code, e.to_string());
        let retry = match code {
            Code::ResourceExhausted => Some("50"),
            Code::Unavailable => Some("1000"),
            _ => None,
        };
        if let Some(ms) = retry {
            s.metadata_mut().insert(
                "retry-after-ms",
                tonic::metadata::MetadataValue::from_static(ms),
            );
        }
        s
    }
}
