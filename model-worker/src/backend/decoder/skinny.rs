//! Products of a few activation rows with a large weight matrix: the shape of every decode
//! step (one row per stream), where a general GEMM spends its time packing the weights.
//!
//! `y (m x n) = x (m x k) . w^T` with `w` row-major `(n, k)` as GGUF stores it. Each weight
//! row is read from memory once per call and multiplied against all `m` activation rows,
//! which stay in L1; tasks over blocks of weight rows run on the rayon pool. The kernel uses
//! AVX2 + FMA (f32 weights) or F16C (f16 weights, converted in registers, so half the bytes
//! cross the memory bus), chosen at run time; without them callers keep candle's matmul.

// The kernels are `std::arch` intrinsics behind runtime feature detection; each unsafe
// block says why its loads stay in bounds.
#![allow(unsafe_code)]

use rayon::prelude::*;

/// Rows of `x` up to which the kernel beats a packed GEMM (prefill chunks go to candle).
pub const MAX_ROWS: usize = 16;

/// Weight rows per rayon task.
const BLOCK: usize = 64;

/// Weights the kernel reads.
#[derive(Clone, Copy)]
pub enum Weights<'a> {
    F32(&'a [f32]),
    F16(&'a [half::f16]),
}

/// True when this CPU runs the kernels (AVX2, FMA and F16C).
pub fn supported() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma")
            && std::arch::is_x86_feature_detected!("f16c")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// `x (m x k) . w^T` for `w` of `n` rows of `k`; `None` when the kernel does not apply
/// (unsupported CPU, too many rows, or `k` not a multiple of 8) and the caller should use
/// its general matmul.
pub fn matmul(w: Weights, n: usize, k: usize, x: &[f32], m: usize) -> Option<Vec<f32>> {
    let len = match w {
        Weights::F32(w) => w.len(),
        Weights::F16(w) => w.len(),
    };
    if m == 0 || m > MAX_ROWS || !k.is_multiple_of(8) || len != n * k || x.len() != m * k {
        return None;
    }
    if !supported() {
        return None;
    }
    // Each task fills its block's columns for every row, transposed (n-major) so the block
    // is one contiguous slice; the transpose back is one pass over m x n floats.
    let mut yt = vec![0f32; n * m];
    yt.par_chunks_mut(BLOCK * m)
        .enumerate()
        .for_each(|(b, out)| {
            let first = b * BLOCK;
            for (j, o) in out.chunks_exact_mut(m).enumerate() {
                let row = first + j;
                #[cfg(target_arch = "x86_64")]
                // SAFETY: `supported()` checked AVX2, FMA and F16C; the row slice has k
                // elements (len == n * k, row < n) and x has m rows of k, k a multiple of 8.
                unsafe {
                    match w {
                        Weights::F32(w) => x86::row_f32(&w[row * k..(row + 1) * k], x, k, o),
                        Weights::F16(w) => x86::row_f16(&w[row * k..(row + 1) * k], x, k, o),
                    }
                }
            }
        });
    let mut y = vec![0f32; m * n];
    for (col, vals) in yt.chunks_exact(m).enumerate() {
        for (r, v) in vals.iter().enumerate() {
            y[r * n + col] = *v;
        }
    }
    Some(y)
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn hsum(v: __m256) -> f32 {
        let lo = _mm256_castps256_ps128(v);
        let hi = _mm256_extractf128_ps(v, 1);
        let s = _mm_add_ps(lo, hi);
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
        _mm_cvtss_f32(s)
    }

    /// Bytes ahead of the weight being read that the first pass prefetches: the weight
    /// stream is the memory traffic of a decode step, and with several rows per weight the
    /// loop issues too few loads per byte for the out-of-order window alone to keep enough
    /// cache misses in flight (8 rows ran at half the bandwidth of one before this).
    const PREFETCH_BYTES: usize = 1024;

    /// One pass of `$rows` (a literal) activation rows from row `$r`: each 8-lane weight
    /// vector feeds `$rows` FMAs into as many register accumulators (the loops over rows
    /// have constant bounds, so they unroll with no per-row checks). `$load` gives the 8
    /// weights at column `$c` as f32 lanes; `$pf` runs once per column step (the prefetch).
    macro_rules! dot_pass {
        ($rows:literal, $x:ident, $k:ident, $r:expr, $out:ident, |$c:ident| $load:expr, $pf:expr) => {{
            let r = $r;
            let mut acc = [_mm256_setzero_ps(); $rows];
            let mut $c = 0;
            while $c < $k {
                $pf;
                let wv = $load;
                for (j, a) in acc.iter_mut().enumerate() {
                    // SAFETY: row r + j < m and c + 8 <= k, so the 8 floats are in x.
                    let xv = unsafe { _mm256_loadu_ps($x.as_ptr().add((r + j) * $k + $c)) };
                    *a = _mm256_fmadd_ps(wv, xv, *a);
                }
                $c += 8;
            }
            for (j, a) in acc.iter().enumerate() {
                $out[r + j] = hsum(*a);
            }
        }};
    }

    /// out[r] = dot(w, x[r]) for every row r of x (m = out.len() rows of k): passes of 8,
    /// 4, then 3/2/1 rows; the first pass streams the weights from memory (prefetching
    /// `PREFETCH_BYTES` ahead, `$line` elements per cache line), later ones find them in L1.
    macro_rules! dot_rows {
        ($w:ident, $x:ident, $k:ident, $out:ident, $line:expr, |$c:ident| $load:expr) => {{
            let m = $out.len();
            let base = $w.as_ptr().cast::<i8>();
            let size = std::mem::size_of_val(&$w[0]);
            let mut r = 0;
            while r < m {
                let first = r == 0;
                let pf = |c: usize| {
                    if first && c % $line == 0 {
                        // A hint only: past the row it reads the next row of the matrix,
                        // past the matrix nothing (prefetches do not fault).
                        let at = base.wrapping_add(c * size + PREFETCH_BYTES);
                        _mm_prefetch::<_MM_HINT_T0>(at);
                    }
                };
                let rows = match m - r {
                    n if n >= 8 => {
                        dot_pass!(8, $x, $k, r, $out, |$c| $load, pf($c));
                        8
                    }
                    n if n >= 4 => {
                        dot_pass!(4, $x, $k, r, $out, |$c| $load, pf($c));
                        4
                    }
                    3 => {
                        dot_pass!(3, $x, $k, r, $out, |$c| $load, pf($c));
                        3
                    }
                    2 => {
                        dot_pass!(2, $x, $k, r, $out, |$c| $load, pf($c));
                        2
                    }
                    _ => {
                        dot_pass!(1, $x, $k, r, $out, |$c| $load, pf($c));
                        1
                    }
                };
                r += rows;
            }
        }};
    }

    /// # Safety
    /// AVX2 and FMA must be available; `w.len() == k`, `x.len() == out.len() * k`, `k % 8 == 0`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn row_f32(w: &[f32], x: &[f32], k: usize, out: &mut [f32]) {
        // SAFETY: c + 8 <= k == w.len() for every c the loop passes.
        dot_rows!(w, x, k, out, 16, |c| unsafe {
            _mm256_loadu_ps(w.as_ptr().add(c))
        })
    }

    /// # Safety
    /// AVX2, FMA and F16C must be available; as `row_f32` otherwise.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn row_f16(w: &[half::f16], x: &[f32], k: usize, out: &mut [f32]) {
        // SAFETY: 8 halves (16 bytes) at c, c + 8 <= k == w.len().
        dot_rows!(w, x, k, out, 32, |c| unsafe {
            _mm256_cvtph_ps(_mm_loadu_si128(w.as_ptr().add(c).cast::<__m128i>()))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::simd::worst_difference;

    fn reference(w: &[f32], n: usize, k: usize, x: &[f32], m: usize) -> Vec<f32> {
        let mut y = vec![0f32; m * n];
        for r in 0..m {
            for c in 0..n {
                y[r * n + c] = (0..k).map(|i| x[r * k + i] * w[c * k + i]).sum();
            }
        }
        y
    }

    #[test]
    fn matches_a_plain_product_in_f32_and_f16() {
        if !supported() {
            ragcluster_common::skip::skipped(
                ragcluster_common::skip::SkipReason::NoCpuFeature,
                "decoder::skinny::matches_a_plain_product_in_f32_and_f16",
                "this CPU lacks AVX2/FMA/F16C",
            );
            return;
        }
        let (n, k) = (203usize, 96usize);
        let w: Vec<f32> = (0..n * k)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 64.0)
            .collect();
        let wh: Vec<half::f16> = w.iter().map(|&v| half::f16::from_f32(v)).collect();
        let w_rounded: Vec<f32> = wh.iter().map(|v| v.to_f32()).collect();
        for m in [1usize, 2, 3, 4, 7, 8, 9, 12, 15, 16] {
            let x: Vec<f32> = (0..m * k)
                .map(|i| ((i * 13 % 29) as f32 - 14.0) / 8.0)
                .collect();
            let want = reference(&w, n, k, &x, m);
            let got = matmul(Weights::F32(&w), n, k, &x, m).expect("kernel applies");
            let worst = worst_difference(&want, &got);
            assert!(worst < 1e-3, "f32, {m} rows: {worst}");
            let want = reference(&w_rounded, n, k, &x, m);
            let got = matmul(Weights::F16(&wh), n, k, &x, m).expect("kernel applies");
            let worst = worst_difference(&want, &got);
            assert!(worst < 1e-3, "f16, {m} rows: {worst}");
        }
        assert!(matmul(Weights::F32(&w), n, k, &vec![0.0; 17 * k], 17).is_none());
    }
}
