//! A llama-architecture decoder (SmolLM2's GGUF) that runs one forward over the rows of many
//! sequences at once, each at its own position with its own KV cache.
//!
//! candle's `quantized_llama` keeps one KV cache inside the model and one position per call,
//! so concurrent streams each ran their own forward: every decode step read all the weights
//! once per stream and paid candle's per-op overhead per stream. Here the seven weight
//! matrices of a layer are applied to all rows in one matmul (candle's `QMatMul`, so weights
//! are held exactly as before: dequantized to f16/f32 or quantized), and the per-row parts
//! (RMSNorm, RoPE, SiLU gate: `rows`; attention over the row's own cache) run over
//! contiguous buffers, split by rows over the thread pool. A prompt is the same thing: many
//! rows of one sequence.

use super::attention::{Cached, attention};
use super::rows::{Rotary, add, rms_norm, silu_mul};
use super::weights::{Embedding, Group, Matrix};
use super::{Dims, Row, positions};
use crate::error::ModelError;

pub(super) struct Layer {
    /// q, k, v.
    pub(super) qkv: Group,
    pub(super) wo: Matrix,
    /// gate, up.
    pub(super) gate_up: Group,
    pub(super) down: Matrix,
    pub(super) attn_norm: Vec<f32>,
    pub(super) ffn_norm: Vec<f32>,
    /// Biases of q, k and v (qwen2), added after the projection.
    pub(super) qkv_bias: Option<[Vec<f32>; 3]>,
}

/// The weights, shared by every sequence.
pub struct LlamaModel {
    pub dims: Dims,
    pub(super) embed: Embedding,
    pub(super) layers: Vec<Layer>,
    pub(super) norm: Vec<f32>,
    pub(super) output: Matrix,
    /// cos / sin of position x frequency, `context` x `head_dim / 2`.
    pub(super) cos: Vec<f32>,
    pub(super) sin: Vec<f32>,
    /// RoPE over the two halves of each head (NeoX, qwen2) instead of adjacent pairs (GGUF
    /// llama, whose q/k weights are permuted for it).
    pub(super) neox: bool,
}

/// One sequence's keys and values: per layer, position-major rows of `kv_heads * head_dim`.
#[derive(Default)]
pub struct KvCache {
    pub(super) k: Vec<Vec<f32>>,
    pub(super) v: Vec<Vec<f32>>,
    pub(super) len: usize,
}

impl KvCache {
    /// Positions cached so far (the next row's position).
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// A copy of the first `n` positions (all of them if there are fewer): the keys and
    /// values of a position depend only on the tokens up to it, so they are those of any
    /// sequence that begins with the same `n` tokens.
    pub fn head(&self, n: usize) -> KvCache {
        let n = n.min(self.len);
        let cut = |layers: &[Vec<f32>]| -> Vec<Vec<f32>> {
            layers
                .iter()
                .map(|l| l[..l.len() / self.len.max(1) * n].to_vec())
                .collect()
        };
        KvCache {
            k: cut(&self.k),
            v: cut(&self.v),
            len: n,
        }
    }

    /// Bytes the keys and values take (allocated capacity).
    pub fn bytes(&self) -> usize {
        self.k
            .iter()
            .chain(&self.v)
            .map(|l| l.capacity() * std::mem::size_of::<f32>())
            .sum()
    }

    /// Gives back the capacity beyond the cached positions (a cache kept after its stream
    /// ends no longer grows).
    pub fn shrink(&mut self) {
        self.k
            .iter_mut()
            .chain(&mut self.v)
            .for_each(Vec::shrink_to_fit);
    }
}

pub(super) fn infer(e: candle_core::Error) -> ModelError {
    ModelError::Inference(e.to_string())
}

impl LlamaModel {
    /// Whether the weights stay quantized (`dequantize = "none"`): products then round the
    /// activations to 8 bits (candle's Q8_1 dot products).
    pub fn quantized(&self) -> bool {
        self.output.quantized()
    }

    /// A fresh cache for one sequence.
    pub fn new_cache(&self) -> KvCache {
        KvCache {
            k: vec![Vec::new(); self.layers.len()],
            v: vec![Vec::new(); self.layers.len()],
            len: 0,
        }
    }

    /// Runs `rows` through the model. Each sequence's rows must be contiguous and continue its
    /// cache (its first row is at position `caches[seq].len()`). Returns the logits of the
    /// rows named in `want` (indexes into `rows`), in that order.
    pub fn forward(
        &self,
        rows: &[Row],
        caches: &mut [&mut KvCache],
        want: &[usize],
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        let d = self.dims;
        let lens: Vec<usize> = caches.iter().map(|c| c.len).collect();
        let positions = positions(rows, &lens, d.context)?;
        let n = rows.len();
        let mut x = Vec::with_capacity(n * d.hidden);
        for r in rows {
            let t = r.token as usize;
            if t >= d.vocab {
                return Err(ModelError::InvalidArgument(format!(
                    "token id {t} out of vocabulary"
                )));
            }
            self.embed.push_row(t, &mut x);
        }
        for (l, layer) in self.layers.iter().enumerate() {
            let h = rms_norm(&x, &layer.attn_norm, d.eps);
            let [mut q, mut k, mut v]: [Vec<f32>; 3] = layer
                .qkv
                .apply(&h, n, d.hidden)?
                .try_into()
                .map_err(|_| ModelError::Inference("q/k/v projection".into()))?;
            if let Some(b) = &layer.qkv_bias {
                for (m, b) in [&mut q, &mut k, &mut v].into_iter().zip(b) {
                    m.chunks_exact_mut(b.len()).for_each(|r| add(r, b, b.len()));
                }
            }
            let rotary = self.rotary();
            rotary.apply(&mut q, d.hidden, &positions);
            rotary.apply(&mut k, d.kv_width(), &positions);
            for (i, r) in rows.iter().enumerate() {
                let c = &mut caches[r.seq];
                c.k[l].extend_from_slice(&k[i * d.kv_width()..(i + 1) * d.kv_width()]);
                c.v[l].extend_from_slice(&v[i * d.kv_width()..(i + 1) * d.kv_width()]);
            }
            let cached: Vec<Cached<'_>> = caches
                .iter()
                .map(|c| Cached {
                    keys: &c.k[l],
                    values: &c.v[l],
                })
                .collect();
            let attn = attention(d, rows, &positions, &cached, &q);
            let o = layer.wo.apply(&attn, n, d.hidden)?;
            add(&mut x, &o, d.hidden);
            let h = rms_norm(&x, &layer.ffn_norm, d.eps);
            let [g, u]: [Vec<f32>; 2] = layer
                .gate_up
                .apply(&h, n, d.hidden)?
                .try_into()
                .map_err(|_| ModelError::Inference("gate/up projection".into()))?;
            let a = silu_mul(&g, &u, g.len() / n);
            let down = layer.down.apply(&a, n, a.len() / n)?;
            add(&mut x, &down, d.hidden);
        }
        for c in caches.iter_mut() {
            c.len = c.k.first().map_or(0, |k| k.len() / d.kv_width());
        }
        let mut last = Vec::with_capacity(want.len() * d.hidden);
        for &i in want {
            last.extend_from_slice(&x[i * d.hidden..(i + 1) * d.hidden]);
        }
        let last = rms_norm(&last, &self.norm, d.eps);
        let logits = self.output.apply(&last, want.len(), d.hidden)?;
        Ok(logits.chunks(d.vocab).map(<[f32]>::to_vec).collect())
    }

    /// The model's rotary positions over its tables.
    fn rotary(&self) -> Rotary<'_> {
        Rotary {
            cos: &self.cos,
            sin: &self.sin,
            head_dim: self.dims.head_dim,
            neox: self.neox,
        }
    }
}
