//! Inference backends behind synchronous traits, run on their own threads: `encoder`
//! (BERT-family embeddings, token vectors and cross-encoder scores), `decoder` (llama GGUF
//! generation with continuous batching), and what both share: `device` (where a model runs),
//! `cuda` (the GPU runtime, kernels' common code) and `simd` (vectorised CPU helpers). The
//! encoders' input, packed token sequences, is defined here.

pub mod cuda;
pub mod decoder;
pub mod device;
pub mod encoder;
mod gemm;
mod simd;

/// One tokenised input: token ids (with special tokens), segment ids, and whether the text
/// was cut to the model's maximum sequence length.
#[derive(Debug, Clone, Default)]
pub struct Seq {
    pub ids: Vec<u32>,
    pub type_ids: Vec<u32>,
    pub truncated: bool,
}

/// A batch of sequences packed back to back, as the encoders run it (no padding).
pub(crate) struct Packed {
    pub ids: Vec<u32>,
    /// Segment ids; 0 for a sequence that has none.
    pub types: Vec<u32>,
    /// Position of each token within its own sequence.
    pub positions: Vec<u32>,
    /// Row offsets of the sequences: `n + 1`, from 0 to the token count.
    pub offsets: Vec<usize>,
}

impl Packed {
    pub fn new(batch: &[&Seq]) -> Self {
        let rows: usize = batch.iter().map(|s| s.ids.len()).sum();
        let mut p = Packed {
            ids: Vec::with_capacity(rows),
            types: Vec::with_capacity(rows),
            positions: Vec::with_capacity(rows),
            offsets: Vec::with_capacity(batch.len() + 1),
        };
        p.offsets.push(0);
        for s in batch {
            p.ids.extend_from_slice(&s.ids);
            if s.type_ids.len() == s.ids.len() {
                p.types.extend_from_slice(&s.type_ids);
            } else {
                p.types.extend(std::iter::repeat_n(0u32, s.ids.len()));
            }
            p.positions.extend(0..s.ids.len() as u32);
            p.offsets.push(p.ids.len());
        }
        p
    }

    /// Packed rows of `width` values laid out as `(n, longest, width)`, zeros past each
    /// sequence's end.
    pub fn unpack(&self, rows: &[f32], longest: usize, width: usize) -> Vec<f32> {
        let n = self.offsets.len().saturating_sub(1);
        let mut padded = vec![0f32; n * longest * width];
        for (i, w) in self.offsets.windows(2).enumerate() {
            padded[i * longest * width..][..(w[1] - w[0]) * width]
                .copy_from_slice(&rows[w[0] * width..w[1] * width]);
        }
        padded
    }
}

/// An encoder-only model: one output vector per sequence (a sentence embedding, a score, or
/// flattened token vectors, depending on its head).
pub trait Encoder: Send {
    /// Runs one padded batch; outputs are in the order of `batch`.
    fn forward(&mut self, batch: &[&Seq]) -> Result<Vec<Vec<f32>>, crate::error::ModelError>;
}
