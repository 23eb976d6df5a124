//! Encoder-only models (BERT family): sentence embeddings, token vectors for MaxSim, and
//! cross-encoder scores, all from one transformer stack that runs where the model is placed.
//!
//! `bert` is the model a worker loads (tokenisation, heads, placement); the stack itself has
//! three implementations computing one function from the same weights: `cpu` (packed rows,
//! GEMMs split across the cores by `gemm`, fused row-parallel `cpu_ops`), `cuda_f16` (tensor
//! cores, fused attention, CUDA graphs) and `cuda_f32` (cuBLAS SGEMMs, the reference the f16
//! path is checked against). The weight layout they share is read here. `nomic` reads a
//! nomic-bert GGUF (rotary, SwiGLU) into the CPU stack.

pub mod bert;
mod cpu;
mod cpu_ops;
pub(crate) mod cuda_f16;
pub(crate) mod cuda_f32;
pub mod nomic;

pub use bert::{BertEncoder, HeadKind};
pub use nomic::Prompts;

use candle_core::{Result, Tensor};
use candle_nn::VarBuilder;

/// The encoder's own weights: HF `BertFor*` checkpoints nest them under `bert.`.
pub(crate) fn encoder_root(vb: VarBuilder) -> VarBuilder {
    if vb.contains_tensor("bert.embeddings.word_embeddings.weight") {
        vb.pp("bert")
    } else {
        vb
    }
}

/// One layer's Q, K and V projections fused into a `(3h, h)` weight and `(3h)` bias, with
/// 1/sqrt(head_dim) folded into Q (scores are q.k / sqrt(d): scaled once at load).
pub(crate) fn fused_qkv(
    attention_self: &VarBuilder,
    h: usize,
    head_dim: usize,
) -> Result<(Tensor, Tensor)> {
    let scale = 1.0 / (head_dim as f64).sqrt();
    let get = |name: &str| -> Result<(Tensor, Tensor)> {
        let p = attention_self.pp(name);
        Ok((p.get((h, h), "weight")?, p.get(h, "bias")?))
    };
    let (qw, qb) = get("query")?;
    let (kw, kb) = get("key")?;
    let (vw, vb) = get("value")?;
    Ok((
        Tensor::cat(&[(qw * scale)?, kw, vw], 0)?,
        Tensor::cat(&[(qb * scale)?, kb, vb], 0)?,
    ))
}
