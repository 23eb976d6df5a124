//! Inference backends behind one synchronous trait, run on their own threads.

pub mod cpu;
pub mod llama;

/// A sentence embedding model.
pub trait Embedder: Send {
    fn dimension(&self) -> usize;
    fn max_sequence_length(&self) -> usize;
    /// Embeds texts (any order of lengths); returns one L2-normalised vector per text and the
    /// number of tokens processed.
    fn embed(
        &mut self,
        texts: &[String],
    ) -> Result<(Vec<Vec<f32>>, usize), crate::error::ModelError>;
}
