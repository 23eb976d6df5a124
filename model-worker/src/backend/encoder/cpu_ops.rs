//! The encoder's non-GEMM work on the CPU: fused, row-parallel passes over packed rows.
//!
//! candle runs element-wise and broadcast ops (bias add, residual add, GELU, the head
//! split/merge copies) on one thread, and a batched attention matmul as one small GEMM per
//! (sequence, head), each dispatched to the whole thread pool. With the GEMMs themselves
//! parallel (`gemm`), those parts decide how the encoder scales with cores. Here each is
//! one pass over rows on the rayon pool, in place on the caller's buffers: bias +
//! activation, bias + residual + LayerNorm, and attention straight from the fused QKV
//! projection with one task per (sequence, head).

use candle_core::Result;
use candle_transformers::models::bert::HiddenAct;
use rayon::prelude::*;

use crate::backend::gemm::matmul;
use crate::backend::simd::{exp_fast, silu, vectorized};

/// Rows per rayon task for the row-wise ops: enough work per task to amortise scheduling.
const ROWS_PER_TASK: usize = 8;

/// erf(x) as the rational minimax approximation x·P(x²)/Q(x²) on [-4, 4] (the form Eigen
/// and XLA use for f32; |error| < 1e-6 against the exact function, see the test). Unlike the
/// libm call behind candle's `gelu_erf` it has no branches, so the loop over a slice
/// vectorises.
#[inline(always)]
pub(crate) fn erf_fast(x: f32) -> f32 {
    const A: [f32; 7] = [
        -2.726_142_3e-10,
        2.770_681_4e-8,
        -2.101_024e-6,
        -5.692_506_4e-5,
        -7.349_906_3e-4,
        -2.9546e-3,
        -1.609_603_3e-2,
    ];
    const B: [f32; 5] = [
        -1.456_607_2e-5,
        -2.133_740_6e-4,
        -1.682_827e-3,
        -7.373_329_2e-3,
        -1.426_474e-2,
    ];
    let x = x.clamp(-4.0, 4.0);
    let x2 = x * x;
    let mut p = A[0];
    for a in &A[1..] {
        p = p * x2 + a;
    }
    let mut q = B[0];
    for b in &B[1..] {
        q = q * x2 + b;
    }
    x * p / q
}

/// `x += bias` per row of `x` (rows of `bias.len()` values), then the activation (GELU
/// with erf, GELU with tanh, or ReLU), in place. The activation is chosen once, outside the
/// loop, so each loop is branch-free and vectorises.
pub(crate) fn bias_act(x: &mut [f32], bias: &[f32], act: HiddenAct) {
    match act {
        HiddenAct::Gelu => rows_map(x, bias, |v| {
            0.5 * v * (1.0 + erf_fast(v * std::f32::consts::FRAC_1_SQRT_2))
        }),
        HiddenAct::GeluApproximate => rows_map(x, bias, |v| {
            let inner = 0.797_884_6 * (v + 0.044_715 * v * v * v);
            0.5 * v * (1.0 + inner.tanh())
        }),
        HiddenAct::Relu => rows_map(x, bias, |v| v.max(0.0)),
    }
}

/// `x = f(x + bias)` per row, row-parallel.
fn rows_map(x: &mut [f32], bias: &[f32], f: impl Fn(f32) -> f32 + Sync) {
    let cols = bias.len();
    x.par_chunks_mut(cols * ROWS_PER_TASK)
        .for_each(|rows| vectorized(RowsMap { rows, bias, f: &f }));
}

/// One task's rows of `rows_map`.
struct RowsMap<'a, F> {
    rows: &'a mut [f32],
    bias: &'a [f32],
    f: &'a F,
}

impl<F: Fn(f32) -> f32> pulp::WithSimd for RowsMap<'_, F> {
    type Output = ();

    #[inline(always)]
    fn with_simd<S: pulp::Simd>(self, _: S) {
        for row in self.rows.chunks_exact_mut(self.bias.len()) {
            for (x, &b) in row.iter_mut().zip(self.bias) {
                *x = (self.f)(*x + b);
            }
        }
    }
}

/// SwiGLU over rows of `[up | gate]` (`2 * cols` values each, the fused up and gate
/// projections): `out = up * silu(gate)`, rows of `cols`, row-parallel.
pub(crate) fn swiglu(up_gate: &[f32], out: &mut [f32], cols: usize) {
    out.par_chunks_mut(cols * ROWS_PER_TASK)
        .zip(up_gate.par_chunks(2 * cols * ROWS_PER_TASK))
        .for_each(|(out, up_gate)| vectorized(SwiGluRows { out, up_gate, cols }));
}

/// One task's rows of `swiglu`.
struct SwiGluRows<'a> {
    out: &'a mut [f32],
    up_gate: &'a [f32],
    cols: usize,
}

impl pulp::WithSimd for SwiGluRows<'_> {
    type Output = ();

    #[inline(always)]
    fn with_simd<S: pulp::Simd>(self, _: S) {
        for (o, ug) in self
            .out
            .chunks_exact_mut(self.cols)
            .zip(self.up_gate.chunks_exact(2 * self.cols))
        {
            let (up, gate) = ug.split_at(self.cols);
            for ((o, &u), &g) in o.iter_mut().zip(up).zip(gate) {
                *o = u * silu(g);
            }
        }
    }
}

/// Rotary position embedding as GPT-NeoX (and nomic-bert) apply it: the two halves of a
/// head, `(x1, x2)`, turn by `pos * base^(-2i/d)` as `(x1 cos - x2 sin, x2 cos + x1 sin)`.
/// The angles are tabled once for every position the model takes.
pub(crate) struct Rope {
    cos: Vec<f32>,
    sin: Vec<f32>,
    half: usize,
}

impl Rope {
    pub(crate) fn new(head_dim: usize, positions: usize, base: f32) -> Self {
        let half = head_dim / 2;
        let (mut cos, mut sin) = (
            Vec::with_capacity(positions * half),
            Vec::with_capacity(positions * half),
        );
        for p in 0..positions {
            for i in 0..half {
                let freq = f64::from(base).powf(-2.0 * i as f64 / head_dim as f64);
                let angle = p as f64 * freq;
                cos.push(angle.cos() as f32);
                sin.push(angle.sin() as f32);
            }
        }
        Self { cos, sin, half }
    }

    /// How many positions the table covers.
    pub(crate) fn positions(&self) -> usize {
        self.cos.len() / self.half.max(1)
    }

    /// Turns one head's vector `x` (`2 * half` values) to position `pos`, in place.
    #[inline(always)]
    fn rotate(&self, x: &mut [f32], pos: usize) {
        let (cos, sin) = (
            &self.cos[pos * self.half..][..self.half],
            &self.sin[pos * self.half..][..self.half],
        );
        let (x1, x2) = x.split_at_mut(self.half);
        for (((a, b), &c), &s) in x1.iter_mut().zip(x2.iter_mut()).zip(cos).zip(sin) {
            let (u, v) = (*a, *b);
            *a = u * c - v * s;
            *b = v * c + u * s;
        }
    }
}

/// Sum of `f(v)` over `row` with sixteen independent accumulators: a float sum in one chain
/// cannot be reordered by the compiler, so it would run one add per cycle of latency.
#[inline(always)]
fn lane_sum(row: &[f32], f: impl Fn(f32) -> f32) -> f32 {
    let mut acc = [0f32; 16];
    let chunks = row.chunks_exact(16);
    let tail: f32 = chunks.remainder().iter().map(|&v| f(v)).sum();
    for c in chunks {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a += f(v);
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// Columns per register block of `block_product` (one AVX-512 register of f32).
const LANES: usize = 16;
/// Rows per register block of `block_product`.
const BLOCK_ROWS: usize = 4;

/// `out (m, n) = a (m, k) · b (k, n)` for `m` a multiple of `BLOCK_ROWS` and `n` of `LANES`,
/// in blocks of 4 x 16 accumulators held in registers across the whole `k` loop: the shape
/// of attention's two products (a few dozen rows, `k` = head size or key count), where a
/// general GEMM spends more on packing than on arithmetic.
#[inline(always)]
fn block_product(a: &[f32], b: &[f32], out: &mut [f32], m: usize, k: usize, n: usize) {
    for (i0, block) in a[..m * k].chunks_exact(BLOCK_ROWS * k).enumerate() {
        let (a0, rest) = block.split_at(k);
        let (a1, rest) = rest.split_at(k);
        let (a2, a3) = rest.split_at(k);
        for j0 in (0..n).step_by(LANES) {
            let (mut c0, mut c1, mut c2, mut c3) =
                ([0f32; LANES], [0f32; LANES], [0f32; LANES], [0f32; LANES]);
            for ((((&x0, &x1), &x2), &x3), bv) in
                a0.iter().zip(a1).zip(a2).zip(a3).zip(b.chunks_exact(n))
            {
                let bv: [f32; LANES] = bv[j0..j0 + LANES].try_into().expect("16 lanes");
                for l in 0..LANES {
                    c0[l] += x0 * bv[l];
                    c1[l] += x1 * bv[l];
                    c2[l] += x2 * bv[l];
                    c3[l] += x3 * bv[l];
                }
            }
            for (r, acc) in [c0, c1, c2, c3].iter().enumerate() {
                out[(i0 * BLOCK_ROWS + r) * n + j0..][..LANES].copy_from_slice(acc);
            }
        }
    }
}

/// Largest value of `row` (NEG_INFINITY when empty), over sixteen lanes so it vectorises
/// (`f32::max`'s NaN rule keeps a plain fold scalar; scores are never NaN).
#[inline(always)]
fn lane_max(row: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; 16];
    let chunks = row.chunks_exact(16);
    let tail = chunks
        .remainder()
        .iter()
        .fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    for c in chunks {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a = if v > *a { v } else { *a };
        }
    }
    acc.iter().fold(tail, |m, &v| m.max(v))
}

/// LayerNorm parameters (`gamma`, `beta` and `eps` of one norm).
pub(crate) struct NormParams<'a> {
    pub gamma: &'a [f32],
    pub beta: &'a [f32],
    pub eps: f32,
}

impl NormParams<'_> {
    /// Normalises one row in place: `(x - mean) / sqrt(var + eps) * gamma + beta`.
    #[inline(always)]
    fn apply(&self, row: &mut [f32]) {
        let cols = row.len() as f32;
        let mean = lane_sum(row, |v| v) / cols;
        let var = lane_sum(row, |v| (v - mean) * (v - mean)) / cols;
        let inv = 1.0 / (var + self.eps).sqrt();
        for ((o, &g), &b) in row.iter_mut().zip(self.gamma).zip(self.beta) {
            *o = (*o - mean) * inv * g + b;
        }
    }
}

/// `x = LayerNorm(x + bias + residual)` per row, in place: the end of each BERT sub-layer.
/// `x` and `residual` are rows of `bias.len()` values.
pub(crate) fn bias_residual_norm(x: &mut [f32], residual: &[f32], bias: &[f32], norm: &NormParams) {
    let cols = bias.len();
    x.par_chunks_mut(cols * ROWS_PER_TASK)
        .zip(residual.par_chunks(cols * ROWS_PER_TASK))
        .for_each(|(x, residual)| {
            vectorized(ResidualNormRows {
                x,
                residual,
                bias,
                norm,
            })
        });
}

/// One task's rows of `bias_residual_norm`.
struct ResidualNormRows<'a, 'n> {
    x: &'a mut [f32],
    residual: &'a [f32],
    bias: &'a [f32],
    norm: &'a NormParams<'n>,
}

impl pulp::WithSimd for ResidualNormRows<'_, '_> {
    type Output = ();

    #[inline(always)]
    fn with_simd<S: pulp::Simd>(self, _: S) {
        let cols = self.bias.len();
        for (row, r) in self
            .x
            .chunks_exact_mut(cols)
            .zip(self.residual.chunks_exact(cols))
        {
            for ((o, &r), &b) in row.iter_mut().zip(r).zip(self.bias) {
                *o += r + b;
            }
            self.norm.apply(row);
        }
    }
}

/// The embedding sum and its LayerNorm: row `r` of `out` becomes
/// `LayerNorm(word[ids[r]] + kind[types[r]] + position[positions[r]])` (BERT), or the same
/// without the position table (rotary models). Ids must be in range of their tables (the
/// caller checks).
pub(crate) fn embed(out: &mut [f32], tables: &[&[f32]], indices: &[&[u32]], norm: &NormParams) {
    let cols = norm.gamma.len();
    out.par_chunks_mut(cols * ROWS_PER_TASK)
        .enumerate()
        .for_each(|(task, rows)| {
            vectorized(EmbedRows {
                rows,
                first: task * ROWS_PER_TASK,
                tables,
                indices,
                norm,
            })
        });
}

/// One task's rows of `embed`, the first of them being row `first` of the batch.
struct EmbedRows<'a, 'n> {
    rows: &'a mut [f32],
    first: usize,
    tables: &'a [&'a [f32]],
    indices: &'a [&'a [u32]],
    norm: &'a NormParams<'n>,
}

impl pulp::WithSimd for EmbedRows<'_, '_> {
    type Output = ();

    #[inline(always)]
    fn with_simd<S: pulp::Simd>(self, _: S) {
        let cols = self.norm.gamma.len();
        for (i, row) in self.rows.chunks_exact_mut(cols).enumerate() {
            let r = self.first + i;
            row.fill(0.0);
            for (table, index) in self.tables.iter().zip(self.indices.iter()) {
                let at = index[r] as usize * cols;
                for (o, &v) in row.iter_mut().zip(&table[at..at + cols]) {
                    *o += v;
                }
            }
            self.norm.apply(row);
        }
    }
}

/// Multi-head self-attention over packed sequences, read straight from the fused projection
/// `(rows, 3h)` (Q, K, V without their bias; Q already scaled by 1/sqrt(d)), giving the
/// merged context `(rows, h)`. Sequence `s` is rows `offsets[s]..offsets[s + 1]`: there is no
/// padding, so every row is a real token and attends to its own sequence only.
pub(crate) struct Attention<'a> {
    /// The fused Q/K/V bias, `3h`.
    pub bias: &'a [f32],
    /// Row offsets of the sequences, `n + 1` of them, from 0 to the row count.
    pub offsets: &'a [usize],
    pub heads: usize,
    pub head_dim: usize,
    /// Rotary positions for Q and K (nomic-bert); BERT adds a position table up front instead.
    pub rope: Option<&'a Rope>,
}

/// One (sequence, head) of `Attention`, for `vectorized`.
struct HeadJob<'a, 'b> {
    attention: &'b Attention<'a>,
    qkv: &'b [f32],
    seq: usize,
    head: usize,
}

impl pulp::WithSimd for HeadJob<'_, '_> {
    type Output = Vec<f32>;

    #[inline(always)]
    fn with_simd<S: pulp::Simd>(self, _: S) -> Vec<f32> {
        self.attention.head_scores(self.qkv, self.seq, self.head)
    }
}

impl Attention<'_> {
    /// One (sequence, head): `(len, d)` context rows.
    fn head(&self, qkv: &[f32], seq: usize, head: usize) -> Vec<f32> {
        vectorized(HeadJob {
            attention: self,
            qkv,
            seq,
            head,
        })
    }

    /// One (sequence, head) as two small products, `S = Q K^T` and `O = softmax(S) V`, each
    /// in register blocks (`block_product`): row by row, the score and weighted-sum loops
    /// were bound by latency (a chain through memory per key) and took a third of a forward.
    /// Keys are padded to a multiple of `LANES` with zeros, and their scores to -inf.
    #[inline(always)]
    fn head_scores(&self, qkv: &[f32], seq: usize, head: usize) -> Vec<f32> {
        let d = self.head_dim;
        let h = self.heads * d;
        let width = 3 * h;
        let rows = &qkv[self.offsets[seq] * width..self.offsets[seq + 1] * width];
        let len = rows.len() / width;
        let (lp, mp) = (
            len.next_multiple_of(LANES),
            len.next_multiple_of(BLOCK_ROWS),
        );
        let (qb, kb, vb) = (
            &self.bias[head * d..][..d],
            &self.bias[h + head * d..][..d],
            &self.bias[2 * h + head * d..][..d],
        );
        // This head's queries (`mp x d`), keys transposed (`d x lp`) and values (`lp x d`),
        // bias added, zero rows and columns as padding.
        let mut queries = vec![0f32; mp * d];
        let mut keys_t = vec![0f32; d * lp];
        let mut values = vec![0f32; lp * d];
        let mut key = vec![0f32; d];
        for (j, row) in rows.chunks_exact(width).enumerate() {
            let add = |out: &mut [f32], at: usize, b: &[f32]| {
                for ((o, &x), &b) in out.iter_mut().zip(&row[at..at + d]).zip(b) {
                    *o = x + b;
                }
            };
            add(&mut queries[j * d..(j + 1) * d], head * d, qb);
            add(&mut values[j * d..(j + 1) * d], 2 * h + head * d, vb);
            add(&mut key, h + head * d, kb);
            if let Some(rope) = self.rope {
                // Row j of the sequence is position j (the 1/sqrt(d) in Q commutes with it).
                rope.rotate(&mut queries[j * d..(j + 1) * d], j);
                rope.rotate(&mut key, j);
            }
            for (c, &k) in key.iter().enumerate() {
                keys_t[c * lp + j] = k;
            }
        }
        let mut scores = vec![0f32; mp * lp];
        block_product(&queries, &keys_t, &mut scores, mp, d, lp);
        for row in scores.chunks_exact_mut(lp.max(1)).take(len) {
            row[len..].fill(f32::NEG_INFINITY);
            let max = lane_max(row);
            for p in row.iter_mut() {
                *p = exp_fast(*p - max);
            }
            let inv = 1.0 / lane_sum(row, |v| v);
            for p in row.iter_mut() {
                *p *= inv;
            }
        }
        let mut out = vec![0f32; mp * d];
        if d.is_multiple_of(LANES) {
            block_product(&scores, &values, &mut out, mp, lp, d);
        } else {
            matmul(&scores, &values, &mut out, mp, lp, d);
        }
        out.truncate(len * d);
        out
    }

    /// Writes the context of every sequence into `ctx` (`rows x h`) from `qkv`
    /// (`rows x 3h`).
    pub(crate) fn run(&self, qkv: &[f32], ctx: &mut [f32]) -> Result<()> {
        let (heads, d) = (self.heads, self.head_dim);
        let h = heads * d;
        let rows = qkv.len() / (3 * h).max(1);
        let n = self.offsets.len().saturating_sub(1);
        let ordered = self.offsets.windows(2).all(|w| w[0] <= w[1]);
        if h == 0
            || qkv.len() != rows * 3 * h
            || ctx.len() != rows * h
            || self.offsets.first() != Some(&0)
            || self.offsets.last() != Some(&rows)
            || !ordered
            || self.bias.len() != 3 * h
            || self.rope.is_some_and(|r| {
                2 * r.half != d || self.offsets.windows(2).any(|w| w[1] - w[0] > r.positions())
            })
        {
            candle_core::bail!("attention: offsets or bias do not match {rows} rows of {h}");
        }
        let parts: Vec<Vec<f32>> = (0..n * heads)
            .into_par_iter()
            .map(|job| self.head(qkv, job / heads, job % heads))
            .collect();
        // Each sequence's rows are one contiguous block of the output.
        let mut blocks = Vec::with_capacity(n);
        let mut rest = ctx;
        for w in self.offsets.windows(2) {
            let (block, tail) = rest.split_at_mut((w[1] - w[0]) * h);
            blocks.push(block);
            rest = tail;
        }
        blocks.into_par_iter().enumerate().for_each(|(seq, out)| {
            for (head, part) in parts[seq * heads..(seq + 1) * heads].iter().enumerate() {
                for (row, src) in out.chunks_mut(h).zip(part.chunks_exact(d)) {
                    row[head * d..(head + 1) * d].copy_from_slice(src);
                }
            }
        });
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device, Tensor};

    #[test]
    fn fast_erf_matches_the_exact_function() {
        let mut worst = 0f64;
        for i in -60_000..=60_000 {
            let x = i as f64 / 10_000.0;
            let want = candle_core::cpu::erf::erf_f64(x);
            worst = worst.max((f64::from(erf_fast(x as f32)) - want).abs());
        }
        assert!(worst < 1e-6, "max |erf error| {worst}");
    }

    fn ramp(n: usize, scale: f64, dev: &Device) -> Tensor {
        Tensor::arange(0u32, n as u32, dev)
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap()
            .affine(scale, -(n as f64) * scale / 2.0)
            .unwrap()
    }

    fn worst(a: &Tensor, b: &Tensor) -> f32 {
        (a - b)
            .unwrap()
            .abs()
            .unwrap()
            .flatten_all()
            .unwrap()
            .max(0)
            .unwrap()
            .to_scalar::<f32>()
            .unwrap()
    }

    #[test]
    fn bias_gelu_and_residual_norm_match_candle() {
        let dev = Device::Cpu;
        let x = ramp(37 * 16, 0.013, &dev).reshape((37, 16)).unwrap();
        let bias = ramp(16, 0.1, &dev);
        let b = bias.to_vec1::<f32>().unwrap();
        let mut data = x.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        bias_act(&mut data, &b, HiddenAct::Gelu);
        let ours = Tensor::from_vec(data, (37, 16), &dev).unwrap();
        let want = x.broadcast_add(&bias).unwrap().gelu_erf().unwrap();
        assert!(worst(&ours, &want) < 2e-6);

        let res = x.sin().unwrap();
        let gamma = ramp(16, 0.05, &dev).cos().unwrap();
        let beta = ramp(16, 0.02, &dev);
        let (g, be) = (
            gamma.to_vec1::<f32>().unwrap(),
            beta.to_vec1::<f32>().unwrap(),
        );
        let mut data = x.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let r = res.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let norm = NormParams {
            gamma: &g,
            beta: &be,
            eps: 1e-12,
        };
        bias_residual_norm(&mut data, &r, &b, &norm);
        let ours = Tensor::from_vec(data, (37, 16), &dev).unwrap();
        let sum = (x.broadcast_add(&bias).unwrap() + &res).unwrap();
        let want = candle_nn::ops::layer_norm(&sum, &gamma, &beta, 1e-12).unwrap();
        let w = worst(&ours, &want);
        // candle computes the variance in one pass (E[x²] - mean²): f32 noise of ~1e-5.
        assert!(w < 5e-5, "layer norm: {w}");
    }

    #[test]
    fn attention_matches_masked_softmax_over_candle_matmuls() {
        // A head size that the register blocks cover (16) and one they do not (12).
        for d in [12usize, 16] {
            attention_matches_for_head_size(d, false);
        }
    }

    #[test]
    fn rotary_attention_matches_candle_rope_then_softmax() {
        for d in [12usize, 16] {
            attention_matches_for_head_size(d, true);
        }
    }

    #[test]
    fn swiglu_matches_candle_silu() {
        let dev = Device::Cpu;
        let cols = 24;
        let x = ramp(13 * 2 * cols, 0.037, &dev)
            .reshape((13, 2 * cols))
            .unwrap();
        let mut out = vec![0f32; 13 * cols];
        swiglu(
            &x.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            &mut out,
            cols,
        );
        let ours = Tensor::from_vec(out, (13, cols), &dev).unwrap();
        let (up, gate) = (
            x.narrow(1, 0, cols).unwrap(),
            x.narrow(1, cols, cols).unwrap(),
        );
        let want = (up * candle_nn::ops::silu(&gate).unwrap()).unwrap();
        assert!(worst(&ours, &want) < 1e-5);
    }

    fn attention_matches_for_head_size(d: usize, rotary: bool) {
        let dev = Device::Cpu;
        let (n, s, heads) = (3usize, 19usize, 2usize);
        let h = heads * d;
        // A padded batch (the reference) and the same sequences packed (ours).
        let qkv = ramp(n * s * 3 * h, 0.0021, &dev)
            .sin()
            .unwrap()
            .reshape((n * s, 3 * h))
            .unwrap();
        let bias = ramp(3 * h, 0.01, &dev);
        let lens = [19usize, 4, 1];
        let mask: Vec<f32> = (0..n * s)
            .map(|i| if i % s < lens[i / s] { 1.0 } else { 0.0 })
            .collect();
        let packed = Tensor::cat(
            &lens
                .iter()
                .enumerate()
                .map(|(i, &len)| qkv.narrow(0, i * s, len).unwrap())
                .collect::<Vec<_>>(),
            0,
        )
        .unwrap();
        let offsets = [0usize, 19, 23, 24];
        let b = bias.to_vec1::<f32>().unwrap();
        let rope = Rope::new(d, s, 1000.0);
        let op = Attention {
            bias: &b,
            offsets: &offsets,
            heads,
            head_dim: d,
            rope: rotary.then_some(&rope),
        };
        let rows = offsets[3];
        let input = packed.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let mut ctx = vec![0f32; rows * h];
        op.run(&input, &mut ctx).unwrap();
        let ours = Tensor::from_vec(ctx, (rows, h), &dev).unwrap();
        // Reference: candle ops with an additive mask, as the encoder computed it before.
        let full = qkv.broadcast_add(&bias).unwrap();
        let split = |i: usize| {
            full.narrow(1, i * h, h)
                .unwrap()
                .reshape((n, s, heads, d))
                .unwrap()
                .transpose(1, 2)
                .unwrap()
                .contiguous()
                .unwrap()
        };
        let (mut q, mut k, v) = (split(0), split(1), split(2));
        if rotary {
            let table = |t: &[f32]| Tensor::from_slice(t, (s, d / 2), &dev).unwrap();
            let (cos, sin) = (table(&rope.cos), table(&rope.sin));
            q = candle_nn::rotary_emb::rope(&q, &cos, &sin).unwrap();
            k = candle_nn::rotary_emb::rope(&k, &cos, &sin).unwrap();
        }
        let m = Tensor::from_vec(mask.clone(), (n, 1, 1, s), &dev).unwrap();
        let add = ((m - 1.0).unwrap() * 1e4).unwrap();
        let scores = q
            .matmul(&k.t().unwrap())
            .unwrap()
            .broadcast_add(&add)
            .unwrap();
        let probs = candle_nn::ops::softmax_last_dim(&scores).unwrap();
        let want = probs
            .matmul(&v)
            .unwrap()
            .transpose(1, 2)
            .unwrap()
            .contiguous()
            .unwrap()
            .reshape((n, s, h))
            .unwrap();
        for (seq, &len) in lens.iter().enumerate() {
            let a = ours.narrow(0, offsets[seq], len).unwrap();
            let b = want.get(seq).unwrap().narrow(0, 0, len).unwrap();
            assert!(worst(&a, &b) < 1e-5, "sequence {seq}");
        }
        let bad = Attention {
            bias: &b,
            offsets: &[0, 5],
            heads,
            head_dim: d,
            rope: None,
        };
        let mut ctx = vec![0f32; rows * h];
        assert!(
            bad.run(&input, &mut ctx).is_err(),
            "offsets must cover the rows"
        );
    }
}
