//! The encoder's non-GEMM work on the CPU as fused, row-parallel candle ops.
//!
//! candle runs element-wise and broadcast ops (bias add, residual add, GELU, the head
//! split/merge copies) on one thread, and a batched attention matmul as one small GEMM per
//! (sequence, head), each dispatched to the whole thread pool. With the GEMMs themselves
//! parallel, those parts decide how the encoder scales with cores. Here each is one pass
//! over rows on the rayon pool: bias + activation, bias + residual + LayerNorm, and
//! attention straight from the fused QKV projection with one task per (sequence, head).

use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Result, Shape};
use candle_transformers::models::bert::HiddenAct;
use rayon::prelude::*;

/// Rows per rayon task for the row-wise ops: enough work per task to amortise scheduling.
const ROWS_PER_TASK: usize = 8;

fn contiguous<'a>(s: &'a CpuStorage, l: &Layout, what: &str) -> Result<&'a [f32]> {
    let Some((start, end)) = l.contiguous_offsets() else {
        candle_core::bail!("{what} needs a contiguous tensor");
    };
    Ok(&s.as_slice::<f32>()?[start..end])
}

fn rows_cols(l: &Layout, cols: usize, what: &str) -> Result<usize> {
    let n = l.shape().elem_count();
    if cols == 0 || !n.is_multiple_of(cols) || l.shape().dims().last() != Some(&cols) {
        candle_core::bail!("{what}: last dimension is not {cols}");
    }
    Ok(n / cols)
}

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

/// `x + bias` per row, then the activation (GELU with erf, GELU with tanh, or ReLU).
pub(crate) struct BiasAct<'a> {
    pub bias: &'a [f32],
    pub act: HiddenAct,
}

impl CustomOp1 for BiasAct<'_> {
    fn name(&self) -> &'static str {
        "bias-act"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let x = contiguous(s, l, self.name())?;
        let cols = self.bias.len();
        rows_cols(l, cols, self.name())?;
        let mut out = vec![0f32; x.len()];
        out.par_chunks_mut(cols * ROWS_PER_TASK)
            .zip(x.par_chunks(cols * ROWS_PER_TASK))
            .for_each(|(o, x)| {
                for (o, x) in o.chunks_mut(cols).zip(x.chunks(cols)) {
                    for ((o, &x), &b) in o.iter_mut().zip(x).zip(self.bias) {
                        let v = x + b;
                        *o = match self.act {
                            HiddenAct::Gelu => {
                                0.5 * v * (1.0 + erf_fast(v * std::f32::consts::FRAC_1_SQRT_2))
                            }
                            HiddenAct::GeluApproximate => {
                                let inner = 0.797_884_6 * (v + 0.044_715 * v * v * v);
                                0.5 * v * (1.0 + inner.tanh())
                            }
                            HiddenAct::Relu => v.max(0.0),
                        };
                    }
                }
            });
        Ok((CpuStorage::F32(out), l.shape().clone()))
    }
}

/// `LayerNorm(x + bias + residual) * gamma + beta` per row: the end of each BERT sub-layer.
pub(crate) struct BiasResidualNorm<'a> {
    pub bias: &'a [f32],
    pub gamma: &'a [f32],
    pub beta: &'a [f32],
    pub eps: f32,
}

impl CustomOp2 for BiasResidualNorm<'_> {
    fn name(&self) -> &'static str {
        "bias-residual-layer-norm"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let x = contiguous(s1, l1, self.name())?;
        let res = contiguous(s2, l2, self.name())?;
        let cols = self.bias.len();
        rows_cols(l1, cols, self.name())?;
        if l1.shape() != l2.shape() || self.gamma.len() != cols || self.beta.len() != cols {
            candle_core::bail!("{}: mismatched shapes", self.name());
        }
        let mut out = vec![0f32; x.len()];
        out.par_chunks_mut(cols * ROWS_PER_TASK)
            .zip(x.par_chunks(cols * ROWS_PER_TASK))
            .zip(res.par_chunks(cols * ROWS_PER_TASK))
            .for_each(|((o, x), r)| {
                for ((o, x), r) in o.chunks_mut(cols).zip(x.chunks(cols)).zip(r.chunks(cols)) {
                    let mut sum = 0f32;
                    for (((o, &x), &r), &b) in o.iter_mut().zip(x).zip(r).zip(self.bias) {
                        *o = x + r + b;
                        sum += *o;
                    }
                    let mean = sum / cols as f32;
                    let var = o.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / cols as f32;
                    let inv = 1.0 / (var + self.eps).sqrt();
                    for ((o, &g), &b) in o.iter_mut().zip(self.gamma).zip(self.beta) {
                        *o = (*o - mean) * inv * g + b;
                    }
                }
            });
        Ok((CpuStorage::F32(out), l1.shape().clone()))
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
}

/// Dot product with eight independent accumulators, so the loop vectorises.
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    let tail: f32 = ra.iter().zip(rb).map(|(x, y)| x * y).sum();
    acc.iter().sum::<f32>() + tail
}

impl Attention<'_> {
    /// One (sequence, head): `(len, d)` context rows.
    fn head(&self, qkv: &[f32], seq: usize, head: usize) -> Vec<f32> {
        let d = self.head_dim;
        let h = self.heads * d;
        let width = 3 * h;
        let rows = &qkv[self.offsets[seq] * width..self.offsets[seq + 1] * width];
        let len = rows.len() / width;
        // This head's keys and values, bias added, packed.
        let mut keys = Vec::with_capacity(len * d);
        let mut values = Vec::with_capacity(len * d);
        let (qb, kb, vb) = (
            &self.bias[head * d..][..d],
            &self.bias[h + head * d..][..d],
            &self.bias[2 * h + head * d..][..d],
        );
        for row in rows.chunks_exact(width) {
            keys.extend(row[h + head * d..][..d].iter().zip(kb).map(|(x, b)| x + b));
            values.extend(
                row[2 * h + head * d..][..d]
                    .iter()
                    .zip(vb)
                    .map(|(x, b)| x + b),
            );
        }
        let mut out = vec![0f32; len * d];
        let mut q = vec![0f32; d];
        let mut p = vec![0f32; len];
        for (row, o) in rows.chunks_exact(width).zip(out.chunks_exact_mut(d)) {
            for ((q, &x), &b) in q.iter_mut().zip(&row[head * d..][..d]).zip(qb) {
                *q = x + b;
            }
            let mut max = f32::NEG_INFINITY;
            for (p, k) in p.iter_mut().zip(keys.chunks_exact(d)) {
                *p = dot(&q, k);
                max = max.max(*p);
            }
            let mut sum = 0f32;
            for p in p.iter_mut() {
                *p = (*p - max).exp();
                sum += *p;
            }
            for (&p, v) in p.iter().zip(values.chunks_exact(d)) {
                let w = p / sum;
                for (o, &v) in o.iter_mut().zip(v) {
                    *o += w * v;
                }
            }
        }
        out
    }
}

impl CustomOp1 for Attention<'_> {
    fn name(&self) -> &'static str {
        "fused-attention"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let qkv = contiguous(s, l, self.name())?;
        let (heads, d) = (self.heads, self.head_dim);
        let h = heads * d;
        let rows = rows_cols(l, 3 * h, self.name())?;
        let n = self.offsets.len().saturating_sub(1);
        let ordered = self.offsets.windows(2).all(|w| w[0] <= w[1]);
        if self.offsets.first() != Some(&0)
            || self.offsets.last() != Some(&rows)
            || !ordered
            || self.bias.len() != 3 * h
        {
            candle_core::bail!(
                "{}: offsets or bias do not match {rows} rows of {h}",
                self.name()
            );
        }
        let parts: Vec<Vec<f32>> = (0..n * heads)
            .into_par_iter()
            .map(|job| self.head(qkv, job / heads, job % heads))
            .collect();
        let mut ctx = vec![0f32; rows * h];
        // Each sequence's rows are one contiguous block of the output.
        let mut blocks = Vec::with_capacity(n);
        let mut rest = &mut ctx[..];
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
        Ok((CpuStorage::F32(ctx), Shape::from((rows, h))))
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
        let ours = x
            .apply_op1_no_bwd(&BiasAct {
                bias: &b,
                act: HiddenAct::Gelu,
            })
            .unwrap();
        let want = x.broadcast_add(&bias).unwrap().gelu_erf().unwrap();
        assert!(worst(&ours, &want) < 2e-6);

        let res = x.sin().unwrap();
        let gamma = ramp(16, 0.05, &dev).cos().unwrap();
        let beta = ramp(16, 0.02, &dev);
        let (g, be) = (
            gamma.to_vec1::<f32>().unwrap(),
            beta.to_vec1::<f32>().unwrap(),
        );
        let ours = x
            .apply_op2_no_bwd(
                &res,
                &BiasResidualNorm {
                    bias: &b,
                    gamma: &g,
                    beta: &be,
                    eps: 1e-12,
                },
            )
            .unwrap();
        let sum = (x.broadcast_add(&bias).unwrap() + &res).unwrap();
        let want = candle_nn::ops::layer_norm(&sum, &gamma, &beta, 1e-12).unwrap();
        let w = worst(&ours, &want);
        // candle computes the variance in one pass (E[x²] - mean²): f32 noise of ~1e-5.
        assert!(w < 5e-5, "layer norm: {w}");
    }

    #[test]
    fn attention_matches_masked_softmax_over_candle_matmuls() {
        let dev = Device::Cpu;
        let (n, s, heads, d) = (3usize, 7usize, 2usize, 12usize);
        let h = heads * d;
        // A padded batch (the reference) and the same sequences packed (ours).
        let qkv = ramp(n * s * 3 * h, 0.0021, &dev)
            .sin()
            .unwrap()
            .reshape((n * s, 3 * h))
            .unwrap();
        let bias = ramp(3 * h, 0.01, &dev);
        let lens = [7usize, 4, 1];
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
        let offsets = [0usize, 7, 11, 12];
        let b = bias.to_vec1::<f32>().unwrap();
        let ours = packed
            .apply_op1_no_bwd(&Attention {
                bias: &b,
                offsets: &offsets,
                heads,
                head_dim: d,
            })
            .unwrap();
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
        let (q, k, v) = (split(0), split(1), split(2));
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
        };
        assert!(
            packed.apply_op1_no_bwd(&bad).is_err(),
            "offsets must cover the rows"
        );
    }
}
