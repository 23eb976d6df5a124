//! Scalar quantisation (int8) of unit vectors, the representation the HNSW graph is built and
//! walked on. A 384-d MiniLM vector is 1,536 bytes as f32 and 388 as a code, so every distance
//! an insert or a walk evaluates reads a quarter of the memory (6 cache lines instead of 24)
//! and multiplies bytes 32 at a time; hits are then rescored exactly with the f32 vectors, as
//! Qdrant and Lucene do with their quantised HNSW.
//!
//! A code is the vector scaled so its largest component maps to ±127, rounded, behind that
//! scale as 4 little-endian bytes: `[scale: f32 as 4 i8][dim i8]`. Per-vector scaling needs no
//! statistics of the collection (any model, any distribution, from the first point on) and
//! keeps the rounding error relative to the vector's own range: for MiniLM the error of a dot
//! product is about 7e-4 (one standard deviation), a tenth of the gap between neighbours that
//! the graph has to tell apart. Values stay within ±127 so the byte products summed in pairs
//! never saturate 16 bits (2 x 127 x 127 < 32,767).

use hnsw_rs::anndists::dist::Distance;

/// Bytes in front of a code's components: the scale.
pub const HEADER: usize = 4;

/// Code length for a vector of `dim` components.
pub const fn code_len(dim: usize) -> usize {
    HEADER + dim
}

/// The int8 code of `v` (see the module doc). A zero or non-finite vector codes as all zeros.
pub fn encode(v: &[f32]) -> Vec<i8> {
    let max = v.iter().fold(0f32, |m, x| m.max(x.abs()));
    let (scale, inv) = if max.is_finite() && max > 0.0 {
        (max / 127.0, 127.0 / max)
    } else {
        (0.0, 0.0)
    };
    let mut out = Vec::with_capacity(code_len(v.len()));
    out.extend(scale.to_le_bytes().map(|b| b as i8));
    out.extend(
        v.iter()
            .map(|x| (x * inv).round().clamp(-127.0, 127.0) as i8),
    );
    out
}

/// The vector a code stands for (up to rounding).
pub fn decode(code: &[i8]) -> Vec<f32> {
    let s = scale(code);
    code[HEADER..].iter().map(|&q| q as f32 * s).collect()
}

fn scale(code: &[i8]) -> f32 {
    match code.get(..HEADER) {
        Some(h) => f32::from_le_bytes([h[0] as u8, h[1] as u8, h[2] as u8, h[3] as u8]),
        None => 0.0,
    }
}

/// Approximate dot product of the vectors behind two codes of equal length.
#[inline]
pub fn dot(a: &[i8], b: &[i8]) -> f32 {
    if a.len() <= HEADER || b.len() <= HEADER {
        return 0.0;
    }
    scale(a) * scale(b) * dot_i8(&a[HEADER..], &b[HEADER..]) as f32
}

/// Cosine distance on codes of unit vectors, `1 - a·b` clamped at 0: the graph's distance.
#[derive(Default, Clone, Copy)]
pub struct Sq8Cosine;

impl Distance<i8> for Sq8Cosine {
    fn eval(&self, a: &[i8], b: &[i8]) -> f32 {
        (1.0 - dot(a, b)).max(0.0)
    }
}

/// Integer dot product of two int8 slices (extra elements of the longer one are ignored).
/// Values must lie in ±127, as codes do (the kernels negate and take absolute values).
///
/// The kernel is the widest the CPU has, checked at run time so one binary runs on any x86-64:
/// AVX-512 VNNI multiplies and sums 64 bytes in one instruction (`vpdpbusd`), AVX-VNNI 32,
/// plain AVX2 needs three instructions per 32 (`maddubs`, `madd`, `add`). Every distance a
/// graph insert or walk evaluates runs through here.
#[inline]
pub fn dot_i8(a: &[i8], b: &[i8]) -> i32 {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512vnni")
            && std::arch::is_x86_feature_detected!("avx512bw")
        {
            // SAFETY: the CPU has AVX-512 F/BW/VNNI (VNNI and BW imply F), checked just above.
            #[allow(unsafe_code)]
            return unsafe { vnni512::dot_i8(a, b) };
        }
        if std::arch::is_x86_feature_detected!("avxvnni") {
            // SAFETY: the CPU has AVX-VNNI (which implies AVX2), checked just above.
            #[allow(unsafe_code)]
            return unsafe { avx2::dot_i8_vnni(a, b) };
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2, checked just above.
            #[allow(unsafe_code)]
            return unsafe { avx2::dot_i8(a, b) };
        }
    }
    dot_i8_portable(a, b)
}

/// The same sum in independent lanes, for CPUs without AVX2.
pub fn dot_i8_portable(a: &[i8], b: &[i8]) -> i32 {
    let mut acc = [0i32; 16];
    let (ca, cb) = (a.chunks_exact(16), b.chunks_exact(16));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..16 {
            acc[i] += x[i] as i32 * y[i] as i32;
        }
    }
    let mut s: i32 = acc.iter().sum();
    for (x, y) in ra.iter().zip(rb) {
        s += *x as i32 * *y as i32;
    }
    s
}

/// Intrinsics need `unsafe`; the loads are bounds-checked by the loop conditions.
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
mod avx2 {
    use std::arch::x86_64::*;

    /// 32 bytes a step: |a| times b-with-a's-sign as unsigned x signed byte products summed
    /// in pairs (`maddubs`, exact for |values| <= 127), widened to 32 bits in pairs again.
    #[target_feature(enable = "avx2")]
    pub unsafe fn dot_i8(a: &[i8], b: &[i8]) -> i32 {
        // SAFETY: the caller's CPU has AVX2.
        unsafe {
            let ones = _mm256_set1_epi16(1);
            dot_by(a, b, |acc, x, y| {
                let p = _mm256_maddubs_epi16(_mm256_abs_epi8(x), _mm256_sign_epi8(y, x));
                _mm256_add_epi32(acc, _mm256_madd_epi16(p, ones))
            })
        }
    }

    /// The same products in one instruction (`vpdpbusd`, four summed into each 32-bit lane,
    /// no 16-bit step), for CPUs with AVX-VNNI but not AVX-512 (Intel since Alder Lake).
    #[target_feature(enable = "avx2,avxvnni")]
    pub unsafe fn dot_i8_vnni(a: &[i8], b: &[i8]) -> i32 {
        // SAFETY: the caller's CPU has AVX2 and AVX-VNNI.
        unsafe {
            dot_by(a, b, |acc, x, y| {
                _mm256_dpbusd_avx_epi32(acc, _mm256_abs_epi8(x), _mm256_sign_epi8(y, x))
            })
        }
    }

    /// The loop both kernels share: `step` adds the products of 32 bytes to an accumulator.
    /// Two accumulators; MiniLM's 384 components are 12 steps and no tail. Inlined into each
    /// kernel, so it is compiled with that kernel's features.
    #[inline(always)]
    unsafe fn dot_by(
        a: &[i8],
        b: &[i8],
        step: impl Fn(__m256i, __m256i, __m256i) -> __m256i,
    ) -> i32 {
        let n = a.len().min(b.len());
        let (pa, pb) = (a.as_ptr(), b.as_ptr());
        let mut i = 0;
        // SAFETY: every load reads 32 bytes at offset i < n - 31 of both slices.
        unsafe {
            let mut acc = [_mm256_setzero_si256(); 2];
            while i + 64 <= n {
                for (k, acc) in acc.iter_mut().enumerate() {
                    let x = _mm256_loadu_si256(pa.add(i + k * 32) as *const __m256i);
                    let y = _mm256_loadu_si256(pb.add(i + k * 32) as *const __m256i);
                    *acc = step(*acc, x, y);
                }
                i += 64;
            }
            if i + 32 <= n {
                let x = _mm256_loadu_si256(pa.add(i) as *const __m256i);
                let y = _mm256_loadu_si256(pb.add(i) as *const __m256i);
                acc[0] = step(acc[0], x, y);
                i += 32;
            }
            let s = _mm256_add_epi32(acc[0], acc[1]);
            let q = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
            let q = _mm_add_epi32(q, _mm_shuffle_epi32(q, 0b01_00_11_10));
            let q = _mm_add_epi32(q, _mm_shuffle_epi32(q, 0b10_11_00_01));
            let mut sum = _mm_cvtsi128_si32(q);
            while i < n {
                sum += *pa.add(i) as i32 * *pb.add(i) as i32;
                i += 1;
            }
            sum
        }
    }
}

/// `vpdpbusd` multiplies unsigned by signed bytes, so `a·b` is taken as `|a| · (b with a's
/// sign)`, four products summed into each 32-bit lane (no 16-bit step that could saturate).
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
mod vnni512 {
    use std::arch::x86_64::*;

    /// 64 bytes a step in two accumulators; the tail (less than 64 bytes) is one masked load,
    /// which reads nothing past the slices. MiniLM's 384 components are 6 steps.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub unsafe fn dot_i8(a: &[i8], b: &[i8]) -> i32 {
        let n = a.len().min(b.len());
        let (pa, pb) = (a.as_ptr(), b.as_ptr());
        let mut i = 0;
        // SAFETY: full loads read 64 bytes at offset i <= n - 64 of both slices; the masked
        // tail load touches only the n - i bytes its mask selects.
        unsafe {
            let zero = _mm512_setzero_si512();
            let step = |acc: __m512i, x: __m512i, y: __m512i| {
                let y = _mm512_mask_sub_epi8(y, _mm512_movepi8_mask(x), zero, y);
                _mm512_dpbusd_epi32(acc, _mm512_abs_epi8(x), y)
            };
            let mut acc = [zero; 2];
            while i + 128 <= n {
                for (k, acc) in acc.iter_mut().enumerate() {
                    let x = _mm512_loadu_si512(pa.add(i + k * 64) as *const _);
                    let y = _mm512_loadu_si512(pb.add(i + k * 64) as *const _);
                    *acc = step(*acc, x, y);
                }
                i += 128;
            }
            if i + 64 <= n {
                let x = _mm512_loadu_si512(pa.add(i) as *const _);
                let y = _mm512_loadu_si512(pb.add(i) as *const _);
                acc[0] = step(acc[0], x, y);
                i += 64;
            }
            if i < n {
                let m: __mmask64 = (1u64 << (n - i)) - 1;
                let x = _mm512_maskz_loadu_epi8(m, pa.add(i));
                let y = _mm512_maskz_loadu_epi8(m, pb.add(i));
                acc[1] = step(acc[1], x, y);
            }
            _mm512_reduce_add_epi32(_mm512_add_epi32(acc[0], acc[1]))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::index::hnsw::distance::{dot as dot_f32, normalize};

    fn unit(seed: u32, n: usize) -> Vec<f32> {
        let mut v: Vec<f32> = (0..n)
            .map(|i| {
                ((i as u32)
                    .wrapping_mul(2654435761)
                    .wrapping_add(seed * 40503)
                    % 1000) as f32
                    / 500.0
                    - 1.0
            })
            .collect();
        normalize(&mut v);
        v
    }

    type Kernel = fn(&[i8], &[i8]) -> i32;

    /// Every SIMD kernel this CPU can run, so each is checked and not only the one chosen.
    fn kernels() -> Vec<(&'static str, Kernel)> {
        #[allow(unused_mut)]
        let mut out: Vec<(&'static str, Kernel)> = Vec::new();
        #[cfg(target_arch = "x86_64")]
        #[allow(unsafe_code)]
        {
            use std::arch::is_x86_feature_detected as has;
            if has!("avx2") {
                // SAFETY (all three): only pushed when the CPU has the kernel's features.
                out.push(("avx2", |a, b| unsafe { avx2::dot_i8(a, b) }));
            }
            if has!("avxvnni") {
                out.push(("vnni256", |a, b| unsafe { avx2::dot_i8_vnni(a, b) }));
            }
            if has!("avx512vnni") && has!("avx512bw") {
                out.push(("vnni512", |a, b| unsafe { vnni512::dot_i8(a, b) }));
            }
        }
        out
    }

    #[test]
    fn the_simd_sum_is_the_portable_sum_at_every_length() {
        for n in [
            0, 1, 15, 16, 31, 32, 33, 63, 64, 65, 127, 128, 129, 191, 192, 384, 385, 1000,
        ] {
            let a: Vec<i8> = (0..n).map(|i| (i * 37 % 255 - 127) as i8).collect();
            let b: Vec<i8> = (0..n).map(|i| (i * 91 % 255 - 127) as i8).collect();
            let exact: i32 = a.iter().zip(&b).map(|(x, y)| *x as i32 * *y as i32).sum();
            assert_eq!(dot_i8(&a, &b), exact, "n={n}");
            assert_eq!(dot_i8_portable(&a, &b), exact, "n={n}");
            for (name, k) in kernels() {
                assert_eq!(k(&a, &b), exact, "{name} n={n}");
            }
        }
        for (name, k) in kernels() {
            assert_eq!(k(&[127; 384], &[-127; 384]), -127 * 127 * 384, "{name}");
            // Only the shorter slice's length counts, whatever lies past it.
            assert_eq!(k(&[1; 70], &[2; 200]), 140, "{name}");
        }
        // The extremes do not saturate the pairwise 16-bit sums.
        let a = vec![127i8; 384];
        let b = vec![-127i8; 384];
        assert_eq!(dot_i8(&a, &b), -127 * 127 * 384);
    }

    #[test]
    fn codes_keep_dot_products_within_a_thousandth() {
        let mut worst = 0f32;
        for s in 0..50 {
            let (a, b) = (unit(s, 384), unit(s + 1000, 384));
            let (ca, cb) = (encode(&a), encode(&b));
            assert_eq!(ca.len(), code_len(384));
            worst = worst.max((dot(&ca, &cb) - dot_f32(&a, &b)).abs());
            let back = decode(&ca);
            let err = a
                .iter()
                .zip(&back)
                .map(|(x, y)| (x - y).abs())
                .fold(0f32, f32::max);
            assert!(err <= scale(&ca) * 0.5 + 1e-7, "{err}");
        }
        assert!(worst < 2e-3, "{worst}");
        // A vector with itself is distance ~0, never negative.
        let c = encode(&unit(3, 384));
        assert!(Sq8Cosine.eval(&c, &c) < 2e-3);
    }

    #[test]
    fn zero_and_degenerate_codes_are_harmless() {
        let z = encode(&[0.0; 8]);
        assert_eq!(decode(&z), vec![0.0; 8]);
        assert_eq!(dot(&z, &encode(&unit(1, 8))), 0.0);
        assert_eq!(dot(&[], &[1, 2]), 0.0);
    }
}
