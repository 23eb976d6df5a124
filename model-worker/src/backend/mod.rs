//! Inference backends behind synchronous traits, run on their own threads.

pub mod bert;
mod cpu_ops;
pub mod cuda;
pub mod cuda_half;
pub mod decoder;
pub mod device;
pub mod llama;
pub mod llama_batch;
pub mod llama_cuda;
pub mod llama_engine;
pub mod skinny;
pub mod transformer;

/// One tokenised input: token ids (with special tokens), segment ids, and whether the text
/// was cut to the model's maximum sequence length.
#[derive(Debug, Clone, Default)]
pub struct Seq {
    pub ids: Vec<u32>,
    pub type_ids: Vec<u32>,
    pub truncated: bool,
}

/// An encoder-only model: one output vector per sequence (a sentence embedding, a score, or
/// flattened token vectors, depending on its head).
pub trait Encoder: Send {
    /// Runs one padded batch; outputs are in the order of `batch`.
    fn forward(&mut self, batch: &[&Seq]) -> Result<Vec<Vec<f32>>, crate::error::ModelError>;
}
