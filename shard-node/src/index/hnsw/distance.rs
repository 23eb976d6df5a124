//! Cosine on unit vectors, i.e. a dot product: the exact score of every dense hit (the graph
//! walks int8 codes, `sq8`, and its candidates are rescored with this) and of brute-force
//! filtered searches. It is written for the CPU it runs on: AVX2 with FMA where the CPU has
//! them (checked once at run time, so one binary still runs on any x86-64, as the Docker
//! images and the GPU machine need), a plain loop in eight independent lanes elsewhere (which
//! the compiler turns into SSE2 or NEON).

use hnsw_rs::anndists::dist::Distance;

/// Cosine distance for unit vectors, `1 - a·b`, clamped at 0, for hnsw_rs graphs over f32
/// vectors (the benches' references). (hnsw_rs's `DistDot` asserts `1 - a·b >= 0`, which
/// rounding breaks for near-duplicates and would abort the node.)
#[derive(Default, Clone, Copy)]
pub struct UnitCosine;

impl Distance<f32> for UnitCosine {
    fn eval(&self, a: &[f32], b: &[f32]) -> f32 {
        (1.0 - dot(a, b)).max(0.0)
    }
}

/// Dot product of two equally long vectors (extra elements of the longer one are ignored).
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            // SAFETY: the CPU has AVX2 and FMA, checked just above.
            #[allow(unsafe_code)]
            return unsafe { avx2::dot(a, b) };
        }
    }
    dot_portable(a, b)
}

/// Dot product in 8 independent lanes so the compiler vectorises it on any target.
pub fn dot_portable(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for (x, y) in ra.iter().zip(rb) {
        s += x * y;
    }
    s
}

/// Scales `v` to unit length; returns false for a zero or non-finite vector.
pub fn normalize(v: &mut [f32]) -> bool {
    let n = dot(v, v).sqrt();
    if !n.is_finite() || n == 0.0 {
        return false;
    }
    v.iter_mut().for_each(|x| *x /= n);
    true
}

/// The one unsafe corner of the shard node: intrinsics need `unsafe`, and the loads are
/// bounds-checked by the loop conditions instead of per element.
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
mod avx2 {
    use std::arch::x86_64::*;

    /// Four 8-lane accumulators (32 floats a step) hide the FMA latency; MiniLM's 384
    /// dimensions are 12 steps and no tail.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot(a: &[f32], b: &[f32]) -> f32 {
        let n = a.len().min(b.len());
        let (pa, pb) = (a.as_ptr(), b.as_ptr());
        let mut i = 0;
        // SAFETY: every load reads 8 floats at offset i + k * 8 < n of both slices.
        unsafe {
            let mut acc = [_mm256_setzero_ps(); 4];
            while i + 32 <= n {
                for (k, a) in acc.iter_mut().enumerate() {
                    let x = _mm256_loadu_ps(pa.add(i + k * 8));
                    let y = _mm256_loadu_ps(pb.add(i + k * 8));
                    *a = _mm256_fmadd_ps(x, y, *a);
                }
                i += 32;
            }
            while i + 8 <= n {
                let x = _mm256_loadu_ps(pa.add(i));
                let y = _mm256_loadu_ps(pb.add(i));
                acc[0] = _mm256_fmadd_ps(x, y, acc[0]);
                i += 8;
            }
            let s = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
            // Horizontal sum of the 8 lanes.
            let lo = _mm256_castps256_ps128(s);
            let hi = _mm256_extractf128_ps(s, 1);
            let q = _mm_add_ps(lo, hi);
            let q = _mm_add_ps(q, _mm_movehl_ps(q, q));
            let q = _mm_add_ss(q, _mm_shuffle_ps(q, q, 1));
            let mut sum = _mm_cvtss_f32(q);
            while i < n {
                sum += *pa.add(i) * *pb.add(i);
                i += 1;
            }
            sum
        }
    }
}

/// An f32 ordered by `total_cmp`, for top-k heaps of scores.
#[derive(Clone, Copy, PartialEq)]
pub struct OrdF32(pub f32);

impl Eq for OrdF32 {}

impl PartialOrd for OrdF32 {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for OrdF32 {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.0.total_cmp(&other.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vec_of(seed: u32, n: usize) -> Vec<f32> {
        (0..n)
            .map(|i| {
                ((i as u32).wrapping_mul(2654435761).wrapping_add(seed) % 1000) as f32 / 500.0 - 1.0
            })
            .collect()
    }

    #[test]
    fn every_length_matches_the_portable_loop() {
        for n in [0, 1, 7, 8, 9, 31, 32, 33, 63, 64, 100, 384, 385, 768, 1031] {
            let (a, b) = (vec_of(1, n), vec_of(2, n));
            let exact: f64 = a.iter().zip(&b).map(|(x, y)| *x as f64 * *y as f64).sum();
            for got in [dot(&a, &b), dot_portable(&a, &b)] {
                assert!(
                    (got as f64 - exact).abs() < 1e-3 * (1.0 + exact.abs()),
                    "n={n}: {got} vs {exact}"
                );
            }
        }
    }

    #[test]
    fn identical_vectors_do_not_abort() {
        let mut v = vec_of(1, 8);
        assert!(normalize(&mut v));
        let d = UnitCosine.eval(&v, &v);
        assert!((0.0..1e-6).contains(&d), "{d}");
        // A dot product rounding above 1 would make 1 - dot negative: clamped, not asserted.
        let w: Vec<f32> = v.iter().map(|x| x * 1.0001).collect();
        assert_eq!(UnitCosine.eval(&v, &w), 0.0);
    }

    #[test]
    fn zero_and_non_finite_vectors_are_refused() {
        assert!(!normalize(&mut [0.0; 4]));
        assert!(!normalize(&mut [f32::NAN, 1.0]));
    }
}
