//! The per-row steps of a decoder forward between its matrix products (RMSNorm, the SiLU
//! gate, residual adds, rotary positions), split over the thread pool by rows and run on the
//! widest vector unit. As plain loops on the calling thread they left the second core idle
//! for a fifth of a 512-token prompt (libm's `exp` in the gate alone: 117k calls per token).
//! A decode step's few rows stay on the calling thread: handing them to the pool costs more
//! than they do.

use rayon::prelude::*;

use crate::backend::simd::{silu, vectorized};

/// Values per task: enough that a task outweighs the pool's hand-off.
const VALUES_PER_TASK: usize = 16 * 1024;

/// Rows of `width` per task.
fn rows_per_task(width: usize) -> usize {
    VALUES_PER_TASK.div_ceil(width.max(1))
}

/// Runs `f` over matching chunks of `out` and `x` (rows of `width` and `x_width`), in
/// parallel when there is more than one task's worth.
fn over_rows<F>(out: &mut [f32], width: usize, x: &[f32], x_width: usize, f: F)
where
    F: Fn(&mut [f32], &[f32]) + Sync,
{
    let per = rows_per_task(width.max(x_width));
    if out.len() <= per * width {
        f(out, x);
        return;
    }
    out.par_chunks_mut(per * width)
        .zip(x.par_chunks(per * x_width))
        .for_each(|(o, x)| f(o, x));
}

/// RMSNorm of each row of `x` (rows of `w.len()`), times `w`.
pub(super) fn rms_norm(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let mut out = vec![0f32; x.len()];
    over_rows(&mut out, w.len(), x, w.len(), |out, x| {
        vectorized(RmsNormRows { out, x, w, eps })
    });
    out
}

/// `silu(g) * u`, element-wise.
pub(super) fn silu_mul(g: &[f32], u: &[f32], width: usize) -> Vec<f32> {
    let mut out = u.to_vec();
    over_rows(&mut out, width, g, width, |out, g| {
        vectorized(SiluMul { out, g })
    });
    out
}

/// `x += y`, element-wise.
pub(super) fn add(x: &mut [f32], y: &[f32], width: usize) {
    over_rows(x, width, y, width, |x, y| vectorized(Add { x, y }));
}

/// Rotates every head of row i of `x` (rows of `width`) by the angles of `positions[i]`:
/// adjacent pairs (GGUF llama weights are permuted for this interleaved form) or, with
/// `neox`, element j with j + half. `cos` / `sin` are position-major tables of `half`.
pub(super) struct Rotary<'a> {
    pub cos: &'a [f32],
    pub sin: &'a [f32],
    pub head_dim: usize,
    pub neox: bool,
}

impl Rotary<'_> {
    pub(super) fn apply(&self, x: &mut [f32], width: usize, positions: &[usize]) {
        let rotate = |row: &mut [f32], pos: usize| self.row(row, pos);
        let per = rows_per_task(width);
        if positions.len() <= per {
            x.chunks_exact_mut(width)
                .zip(positions)
                .for_each(|(row, &p)| rotate(row, p));
            return;
        }
        x.par_chunks_mut(width)
            .zip(positions)
            .with_min_len(per)
            .for_each(|(row, &p)| rotate(row, p));
    }

    fn row(&self, x: &mut [f32], pos: usize) {
        let half = self.head_dim / 2;
        let (cos, sin) = (
            &self.cos[pos * half..(pos + 1) * half],
            &self.sin[pos * half..(pos + 1) * half],
        );
        // Which two elements of a head rotate together at frequency i.
        let (stride, apart) = if self.neox { (1, half) } else { (2, 1) };
        for head in x.chunks_exact_mut(self.head_dim) {
            for i in 0..half {
                let (ia, ib) = (stride * i, stride * i + apart);
                let (a, b) = (head[ia], head[ib]);
                head[ia] = a * cos[i] - b * sin[i];
                head[ib] = a * sin[i] + b * cos[i];
            }
        }
    }
}

struct RmsNormRows<'a> {
    out: &'a mut [f32],
    x: &'a [f32],
    w: &'a [f32],
    eps: f32,
}

impl pulp::WithSimd for RmsNormRows<'_> {
    type Output = ();

    #[inline(always)]
    fn with_simd<S: pulp::Simd>(self, _: S) {
        let n = self.w.len();
        for (out, row) in self.out.chunks_exact_mut(n).zip(self.x.chunks_exact(n)) {
            let ms = crate::backend::simd::lane_dot(row, row) / n as f32;
            let r = 1.0 / (ms + self.eps).sqrt();
            for ((o, v), w) in out.iter_mut().zip(row).zip(self.w) {
                *o = v * r * w;
            }
        }
    }
}

struct SiluMul<'a> {
    /// `u` in, the product out.
    out: &'a mut [f32],
    g: &'a [f32],
}

impl pulp::WithSimd for SiluMul<'_> {
    type Output = ();

    #[inline(always)]
    fn with_simd<S: pulp::Simd>(self, _: S) {
        for (o, g) in self.out.iter_mut().zip(self.g) {
            *o *= silu(*g);
        }
    }
}

struct Add<'a> {
    x: &'a mut [f32],
    y: &'a [f32],
}

impl pulp::WithSimd for Add<'_> {
    type Output = ();

    #[inline(always)]
    fn with_simd<S: pulp::Simd>(self, _: S) {
        for (a, b) in self.x.iter_mut().zip(self.y) {
            *a += b;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rows enough for several tasks, so the parallel split is what is checked.
    fn ramp(n: usize) -> Vec<f32> {
        (0..n)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.013)
            .collect()
    }

    #[test]
    fn rms_norm_matches_the_formula_over_many_rows() {
        let width = 96;
        let x = ramp(width * 700);
        let w: Vec<f32> = (0..width).map(|i| 0.5 + i as f32 * 0.01).collect();
        let got = rms_norm(&x, &w, 1e-6);
        for (row, out) in x.chunks_exact(width).zip(got.chunks_exact(width)) {
            let ms = row.iter().map(|v| v * v).sum::<f32>() / width as f32;
            let r = 1.0 / (ms + 1e-6).sqrt();
            for ((o, v), w) in out.iter().zip(row).zip(&w) {
                assert!((o - v * r * w).abs() < 1e-5);
            }
        }
    }

    #[test]
    fn silu_mul_and_add_match_scalar() {
        let width = 200;
        let (g, u) = (ramp(width * 300), ramp(width * 300 + 7)[7..].to_vec());
        let got = silu_mul(&g, &u, width);
        for ((o, g), u) in got.iter().zip(&g).zip(&u) {
            let want = g / (1.0 + (-g).exp()) * u;
            assert!((o - want).abs() < 1e-5, "{o} vs {want}");
        }
        let mut x = g.clone();
        add(&mut x, &u, width);
        for ((x, g), u) in x.iter().zip(&g).zip(&u) {
            assert_eq!(*x, g + u);
        }
    }

    #[test]
    fn rotary_in_parallel_matches_row_by_row() {
        let (head_dim, width, rows) = (8, 32, 900);
        let half = head_dim / 2;
        let angles: Vec<f32> = (0..rows * half).map(|i| i as f32 * 0.001).collect();
        let (cos, sin): (Vec<f32>, Vec<f32>) = angles.iter().map(|a| (a.cos(), a.sin())).unzip();
        let positions: Vec<usize> = (0..rows).rev().collect();
        for neox in [false, true] {
            let rot = Rotary {
                cos: &cos,
                sin: &sin,
                head_dim,
                neox,
            };
            let mut x = ramp(rows * width);
            let mut want = x.clone();
            rot.apply(&mut x, width, &positions);
            for (row, &p) in want.chunks_exact_mut(width).zip(&positions) {
                rot.row(row, p);
            }
            assert_eq!(x, want);
        }
    }
}
