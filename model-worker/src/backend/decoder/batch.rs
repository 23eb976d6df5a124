//! A llama-architecture decoder (SmolLM2's GGUF) that runs one forward over the rows of many
//! sequences at once, each at its own position with its own KV cache.
//!
//! candle's `quantized_llama` keeps one KV cache inside the model and one position per call,
//! so concurrent streams each ran their own forward: every decode step read all the weights
//! once per stream and paid candle's per-op overhead per stream. Here the seven weight
//! matrices of a layer are applied to all rows in one matmul (candle's `QMatMul`, so weights
//! are held exactly as before: dequantized to f16/f32 or quantized), and the per-row parts
//! (RMSNorm, RoPE, attention over the row's own cache, SiLU gate) are plain loops over
//! contiguous buffers. A prompt is the same thing: many rows of one sequence.

use rayon::prelude::*;

use super::weights::{Embedding, Group, Matrix};
use super::{Dims, Row, positions};
use crate::backend::simd::{exp_fast, lane_dot, vectorized};
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
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
    len: usize,
}

impl KvCache {
    /// Positions cached so far (the next row's position).
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
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
                    m.chunks_exact_mut(b.len()).for_each(|r| add(r, b));
                }
            }
            for (i, &pos) in positions.iter().enumerate() {
                self.rope(&mut q[i * d.hidden..(i + 1) * d.hidden], pos);
                self.rope(&mut k[i * d.kv_width()..(i + 1) * d.kv_width()], pos);
            }
            for (i, r) in rows.iter().enumerate() {
                let c = &mut caches[r.seq];
                c.k[l].extend_from_slice(&k[i * d.kv_width()..(i + 1) * d.kv_width()]);
                c.v[l].extend_from_slice(&v[i * d.kv_width()..(i + 1) * d.kv_width()]);
            }
            let attn = self.attention(rows, &positions, caches, l, &q);
            let o = layer.wo.apply(&attn, n, d.hidden)?;
            add(&mut x, &o);
            let h = rms_norm(&x, &layer.ffn_norm, d.eps);
            let [g, u]: [Vec<f32>; 2] = layer
                .gate_up
                .apply(&h, n, d.hidden)?
                .try_into()
                .map_err(|_| ModelError::Inference("gate/up projection".into()))?;
            let a: Vec<f32> = g
                .iter()
                .zip(&u)
                .map(|(g, u)| g / (1.0 + (-g).exp()) * u)
                .collect();
            let down = layer.down.apply(&a, n, a.len() / n)?;
            add(&mut x, &down);
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

    /// Rotates every head in `x` by the angles of `pos`: adjacent pairs (GGUF llama weights
    /// are permuted for this interleaved form) or, with `neox`, element i with i + half.
    fn rope(&self, x: &mut [f32], pos: usize) {
        let half = self.dims.head_dim / 2;
        let (cos, sin) = (
            &self.cos[pos * half..(pos + 1) * half],
            &self.sin[pos * half..(pos + 1) * half],
        );
        // Which two elements of a head rotate together at frequency i.
        let (stride, apart) = if self.neox { (1, half) } else { (2, 1) };
        for head in x.chunks_exact_mut(self.dims.head_dim) {
            for i in 0..half {
                let (ia, ib) = (stride * i, stride * i + apart);
                let (a, b) = (head[ia], head[ib]);
                head[ia] = a * cos[i] - b * sin[i];
                head[ib] = a * sin[i] + b * cos[i];
            }
        }
    }

    /// Causal attention of every row over its own sequence's cache up to its position, one
    /// task per (row, head).
    fn attention(
        &self,
        rows: &[Row],
        positions: &[usize],
        caches: &[&mut KvCache],
        layer: usize,
        q: &[f32],
    ) -> Vec<f32> {
        let d = self.dims;
        let group = d.heads / d.kv_heads;
        let scale = 1.0 / (d.head_dim as f32).sqrt();
        let mut out = vec![0f32; rows.len() * d.hidden];
        // The query heads sharing a KV head are consecutive, in `q` and in `out`.
        let width = group * d.head_dim;
        out.par_chunks_mut(width)
            .enumerate()
            .for_each(|(task, out)| {
                let (i, kv) = (task / d.kv_heads, task % d.kv_heads);
                let cache = &caches[rows[i].seq];
                vectorized(AttendGroup {
                    out,
                    q: &q[i * d.hidden + kv * width..][..width],
                    keys: &cache.k[layer],
                    values: &cache.v[layer],
                    head_dim: d.head_dim,
                    stride: d.kv_width(),
                    offset: kv * d.head_dim,
                    span: positions[i] + 1,
                    scale,
                })
            });
        out
    }
}

/// One (row, KV head) of `LlamaModel::attention` for `simd::vectorized`: the query heads
/// that share the KV head (SmolLM2: 3 of 9) against the sequence's first `span` cached keys,
/// softmax, and the weighted sums of the values into `out`, on the CPU's vector unit. Each
/// cached key and value is read once for the whole group rather than once per query head
/// (a 600-token prompt's first token came 0.5-1 s sooner; decode steps within noise). As
/// plain x86-64 the key dots ran as scalar chains: 7% of a decode step at a 180-token span,
/// and attention grows with the span while the weight pass does not.
struct AttendGroup<'a> {
    /// `group x head_dim` context rows.
    out: &'a mut [f32],
    /// `group x head_dim` queries.
    q: &'a [f32],
    keys: &'a [f32],
    values: &'a [f32],
    head_dim: usize,
    /// Floats per cached position (every KV head).
    stride: usize,
    /// This KV head within a position.
    offset: usize,
    span: usize,
    scale: f32,
}

impl pulp::WithSimd for AttendGroup<'_> {
    type Output = ();

    #[inline(always)]
    fn with_simd<S: pulp::Simd>(self, _: S) {
        let (d, span) = (self.head_dim, self.span);
        let at = |p: usize| p * self.stride + self.offset;
        // scores[g * span + p]: query head g against position p.
        let mut scores = vec![0f32; self.q.len() / d * span];
        for p in 0..span {
            let key = &self.keys[at(p)..][..d];
            for (g, q) in self.q.chunks_exact(d).enumerate() {
                scores[g * span + p] = lane_dot(q, key) * self.scale;
            }
        }
        let mut sums = Vec::with_capacity(self.q.len() / d);
        for row in scores.chunks_exact_mut(span) {
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut sum = 0.0;
            for s in row.iter_mut() {
                *s = exp_fast(*s - max);
                sum += *s;
            }
            sums.push(sum);
        }
        for p in 0..span {
            let value = &self.values[at(p)..][..d];
            for (g, out) in self.out.chunks_exact_mut(d).enumerate() {
                let w = scores[g * span + p] / sums[g];
                for (o, v) in out.iter_mut().zip(value) {
                    *o += w * v;
                }
            }
        }
    }
}

fn rms_norm(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let mut out = Vec::with_capacity(x.len());
    for row in x.chunks_exact(w.len()) {
        let ms = row.iter().map(|v| v * v).sum::<f32>() / w.len() as f32;
        let r = 1.0 / (ms + eps).sqrt();
        out.extend(row.iter().zip(w).map(|(v, w)| v * r * w));
    }
    out
}

fn add(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}
