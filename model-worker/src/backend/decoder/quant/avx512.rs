//! The AVX-512 form of `avx2`'s kernels: two consecutive 32-value sub-blocks per 512-bit
//! register, so each instruction of the inner loop (`vpdpbusd`, the conversion, the two float
//! operations) serves 64 weights instead of 32. The layout and the offsets are `avx2`'s; rows
//! with an odd number of sub-blocks stay with `avx2`.

// `std::arch` intrinsics behind runtime feature detection; each unsafe block says why its
// loads stay in bounds.
#![allow(unsafe_code)]

use super::Q8Rows;
use super::blocks::Format;

/// True when this CPU runs these kernels (AVX-512 F, BW, DQ, VL and VNNI, and F16C).
pub fn supported() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::is_x86_feature_detected as has;
        has!("avx512f")
            && has!("avx512bw")
            && has!("avx512dq")
            && has!("avx512vl")
            && has!("avx512vnni")
            && has!("f16c")
            && has!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Whether a row of `k` values fits (an even number of sub-blocks).
pub fn fits(k: usize) -> bool {
    k.is_multiple_of(64)
}

/// As `avx2::rows`.
///
/// # Safety
/// `supported()`, `fits(a.k)`, and `w` whole rows of `format` over `a.k` values.
#[cfg(target_arch = "x86_64")]
pub unsafe fn rows(format: Format, w: &[u8], row_bytes: usize, a: &Q8Rows, out: &mut [f32]) {
    // SAFETY: the caller's conditions.
    unsafe { x86::rows(format, w, row_bytes, a, out) }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::super::Q8Rows;
    use super::super::avx2::shared::{f16, nibbles, prefetch};
    use super::super::blocks::{Format, scale_min_k4};

    rows_over_tiles!("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,f16c,fma");

    #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,f16c,fma")]
    unsafe fn tile_rows<const R: usize>(job: Job<'_>, out: &mut [f32], offs: &mut [f32]) {
        let (format, w, row_bytes, a, r0) = job;
        let t = Tile::<R>::new(a, r0);
        for (i, row) in w.chunks_exact(row_bytes).enumerate() {
            // SAFETY: `row` holds k / block_elems whole blocks, an even number of sub-blocks.
            let acc = unsafe {
                match format {
                    Format::Q8_0 => t.q8_0(row, offs),
                    Format::Q4_0 => t.small::<18>(format, row, offs),
                    Format::Q4_1 => t.small::<20>(format, row, offs),
                    Format::Q5_0 => t.small::<22>(format, row, offs),
                    Format::Q4K => t.q4k(row, offs),
                    Format::Q6K => t.q6k(row, offs),
                }
            };
            let base = i * a.m + r0;
            out[base..base + R].copy_from_slice(&t.finish(&acc, offs));
        }
    }

    #[derive(Clone, Copy)]
    struct Tile<'a, const R: usize> {
        a: &'a Q8Rows,
        /// Each row's first half-block sum in `a.sums`.
        first: [usize; R],
        /// The tile's values and scales (`Q8Rows` layout).
        qs: *const i8,
        d: *const f32,
    }

    /// Two 256-bit halves as one register.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,f16c,fma")]
    fn join(lo: __m256i, hi: __m256i) -> __m512i {
        _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1)
    }

    /// Scale `x` for the first sub-block's 8 lanes, `y` for the second's.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,f16c,fma")]
    fn halves(x: f32, y: f32) -> __m512 {
        _mm512_insertf32x8(_mm512_set1_ps(x), _mm256_set1_ps(y), 1)
    }

    impl<'a, const R: usize> Tile<'a, R> {
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,f16c,fma")]
        fn new(a: &'a Q8Rows, r0: usize) -> Self {
            let (first, qs, d) = a.tile_start(r0);
            Self { a, first, qs, d }
        }

        /// Adds sub-blocks `blk` and `blk + 1` (`w` unsigned) with `scale` per lane group.
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,f16c,fma")]
        unsafe fn pair(&self, acc: &mut [__m512; R], blk: usize, w: __m512i, scale: __m512) {
            let spread = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
            for (r, acc) in acc.iter_mut().enumerate() {
                let at = (blk / 2) * 64 * R + r * 64;
                // SAFETY: blocks blk, blk + 1 of tile row r (< R): 64 values and 2 scales
                // within the tile's part of `qs` and `d` (`Q8Rows` layout).
                let (qa, d) = unsafe {
                    (
                        _mm512_loadu_si512(self.qs.add(at).cast()),
                        _mm_castpd_ps(_mm_load_sd(self.d.add(at / 32).cast())),
                    )
                };
                // Lanes 0..8 take the first block's scale, 8..16 the second's.
                let d = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(d));
                let p = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), w, qa));
                *acc = _mm512_fmadd_ps(p, _mm512_mul_ps(scale, d), *acc);
            }
        }

        /// Each row's sum plus its offsets times its half sums.
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,f16c,fma")]
        fn finish(&self, acc: &[__m512; R], offs: &[f32]) -> [f32; R] {
            let n = offs.len();
            let mut v = [_mm512_setzero_ps(); R];
            let mut j = 0;
            while j + 16 <= n {
                // SAFETY: j + 16 <= n; each row's sums hold n from 2 first[r].
                unsafe {
                    let o = _mm512_loadu_ps(offs.as_ptr().add(j));
                    for (r, v) in v.iter_mut().enumerate() {
                        let s = self.a.sums.as_ptr().add(self.first[r] + j);
                        *v = _mm512_fmadd_ps(o, _mm512_loadu_ps(s), *v);
                    }
                }
                j += 16;
            }
            std::array::from_fn(|r| {
                let sums = &self.a.sums[self.first[r]..self.first[r] + n];
                let rest: f32 = (j..n).map(|j| offs[j] * sums[j]).sum();
                _mm512_reduce_add_ps(_mm512_add_ps(acc[r], v[r])) + rest
            })
        }

        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,f16c,fma")]
        unsafe fn q8_0(&self, row: &[u8], offs: &mut [f32]) -> [__m512; R] {
            let mut acc = [_mm512_setzero_ps(); R];
            let flip = _mm256_set1_epi8(-128);
            for (p, b) in row.as_chunks::<68>().0.iter().enumerate() {
                prefetch(b.as_ptr());
                let (d0, d1) = (f16(b, 0), f16(b, 34));
                // SAFETY: two 34-byte blocks: values at 2 and 36.
                let (w0, w1) = unsafe {
                    (
                        _mm256_loadu_si256(b.as_ptr().add(2).cast()),
                        _mm256_loadu_si256(b.as_ptr().add(36).cast()),
                    )
                };
                let w = join(_mm256_xor_si256(w0, flip), _mm256_xor_si256(w1, flip));
                offs[4 * p..4 * p + 4].copy_from_slice(&[
                    -128.0 * d0,
                    -128.0 * d0,
                    -128.0 * d1,
                    -128.0 * d1,
                ]);
                // SAFETY: as `pair` needs.
                unsafe { self.pair(&mut acc, 2 * p, w, halves(d0, d1)) };
            }
            acc
        }

        /// Q4_0, Q4_1, Q5_0 (`N` bytes per block), two blocks at a time.
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,f16c,fma")]
        unsafe fn small<const N: usize>(
            &self,
            format: Format,
            row: &[u8],
            offs: &mut [f32],
        ) -> [__m512; R] {
            let mut acc = [_mm512_setzero_ps(); R];
            let (blocks, _) = row.as_chunks::<N>();
            for (p, two) in blocks.chunks_exact(2).enumerate() {
                prefetch(two[0].as_ptr());
                let mut ws = [_mm256_setzero_si256(); 2];
                let mut ds = [0f32; 2];
                for (h, b) in two.iter().enumerate() {
                    let d = f16(b, 0);
                    // SAFETY: the last 16 bytes of each block are its nibbles.
                    let nib = unsafe { nibbles(b.as_ptr().add(N - 16)) };
                    let (w, off) = match format {
                        Format::Q4_0 => (nib, -8.0 * d),
                        Format::Q4_1 => (nib, f16(b, 2)),
                        _ => {
                            let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
                            let high = _mm256_and_si256(bits(qh), _mm256_set1_epi8(0x10));
                            (_mm256_or_si256(nib, high), -16.0 * d)
                        }
                    };
                    ws[h] = w;
                    ds[h] = d;
                    offs[4 * p + 2 * h] = off;
                    offs[4 * p + 2 * h + 1] = off;
                }
                // SAFETY: as `pair` needs.
                unsafe { self.pair(&mut acc, 2 * p, join(ws[0], ws[1]), halves(ds[0], ds[1])) };
            }
            acc
        }

        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,f16c,fma")]
        unsafe fn q4k(&self, row: &[u8], offs: &mut [f32]) -> [__m512; R] {
            let mut acc = [_mm512_setzero_ps(); R];
            let mask = _mm512_set1_epi8(0xF);
            for (sb, b) in row.as_chunks::<144>().0.iter().enumerate() {
                prefetch(b.as_ptr());
                prefetch(b.as_ptr().wrapping_add(64));
                let (d, dmin) = (f16(b, 0), f16(b, 2));
                let scales = &b[4..16];
                for pair in 0..4 {
                    // SAFETY: 32 bytes of nibbles per pair of sub-blocks, at 16 + 32 pair.
                    let q = unsafe { _mm256_loadu_si256(b.as_ptr().add(16 + 32 * pair).cast()) };
                    let w = _mm512_and_si512(join(q, _mm256_srli_epi16(q, 4)), mask);
                    let (s0, m0) = scale_min_k4(2 * pair, scales);
                    let (s1, m1) = scale_min_k4(2 * pair + 1, scales);
                    let blk = 8 * sb + 2 * pair;
                    let (o0, o1) = (-dmin * f32::from(m0), -dmin * f32::from(m1));
                    offs[2 * blk..2 * blk + 4].copy_from_slice(&[o0, o0, o1, o1]);
                    let scale = halves(d * f32::from(s0), d * f32::from(s1));
                    // SAFETY: as `pair` needs.
                    unsafe { self.pair(&mut acc, blk, w, scale) };
                }
            }
            acc
        }

        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,f16c,fma")]
        unsafe fn q6k(&self, row: &[u8], offs: &mut [f32]) -> [__m512; R] {
            let mut acc = [_mm512_setzero_ps(); R];
            let (m4, m3) = (_mm256_set1_epi8(0xF), _mm256_set1_epi8(3));
            for (sb, b) in row.as_chunks::<210>().0.iter().enumerate() {
                prefetch(b.as_ptr());
                prefetch(b.as_ptr().wrapping_add(64));
                prefetch(b.as_ptr().wrapping_add(128));
                let d = f16(b, 208);
                let sc = &b[192..208];
                // Sub-blocks s and s + 1 (t even): same nibble half, ql 0 / 32, qh shifts
                // 2t / 2t + 2.
                for s in (0..8).step_by(2) {
                    let (n, t) = (s / 4, s % 4);
                    // SAFETY: ql is b[0..128] (64 n .. 64 n + 64), qh b[128..192].
                    let (l0, l1, qh) = unsafe {
                        (
                            _mm256_loadu_si256(b.as_ptr().add(64 * n).cast()),
                            _mm256_loadu_si256(b.as_ptr().add(64 * n + 32).cast()),
                            _mm256_loadu_si256(b.as_ptr().add(128 + 32 * n).cast()),
                        )
                    };
                    let lo = |l: __m256i| {
                        if t < 2 {
                            _mm256_and_si256(l, m4)
                        } else {
                            _mm256_and_si256(_mm256_srli_epi16(l, 4), m4)
                        }
                    };
                    let hb = |shift: i32| {
                        let h = _mm256_srl_epi16(qh, _mm_cvtsi32_si128(shift));
                        _mm256_slli_epi16(_mm256_and_si256(h, m3), 4)
                    };
                    let w0 = _mm256_or_si256(lo(l0), hb(2 * t as i32));
                    let w1 = _mm256_or_si256(lo(l1), hb(2 * t as i32 + 2));
                    let k = |i: usize| d * f32::from(sc[8 * n + 2 * t + i] as i8);
                    let (a, bb, c, e) = (k(0), k(1), k(2), k(3));
                    let scale = _mm512_setr_ps(a, a, a, a, bb, bb, bb, bb, c, c, c, c, e, e, e, e);
                    let blk = 8 * sb + s;
                    offs[2 * blk..2 * blk + 4].copy_from_slice(&[
                        -32.0 * a,
                        -32.0 * bb,
                        -32.0 * c,
                        -32.0 * e,
                    ]);
                    // SAFETY: as `pair` needs.
                    unsafe { self.pair(&mut acc, blk, join(w0, w1), scale) };
                }
            }
            acc
        }
    }

    /// The 32 bits of `x` as 32 bytes, 0xFF where the bit is set (byte i = bit i).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,f16c,fma")]
    fn bits(x: u32) -> __m256i {
        _mm256_movm_epi8(x)
    }
}
