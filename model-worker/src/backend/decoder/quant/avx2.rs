//! The integer products of quantized weight rows with 8-bit activation rows.
//!
//! Per 32-value sub-block the weights are unpacked in registers to 32 unsigned bytes `w`
//! (their zero point, like Q4_1's and Q4_K's minimum, moved into a per-16-values offset), with
//! a float scale per 16 values (one for most formats, two for Q6_K). Each activation row adds
//! `scale * d_a * sum(w * a)` to its float accumulator: one `vpdpbusd` with AVX-VNNI, else
//! `maddubs` (pairwise sums) and `madd` with ones, giving 8 lane sums (lanes 0..4 = values
//! 0..16). The offsets of a weight row are kept and dotted at the end with each activation
//! row's half-block sums (`Q8Rows::sums`), 8 at a time. Activation rows go in tiles of up to
//! 8, each unpacked weight block serving the whole tile; a task's weight rows (16) stay in L1
//! across tiles. Q8_0 without VNNI stays signed (`maddubs` of |w| and sign(a, w): shifted to
//! unsigned its pair sums would saturate 16 bits).

// `std::arch` intrinsics behind runtime feature detection; each unsafe block says why its
// loads stay in bounds.
#![allow(unsafe_code)]

use super::Q8Rows;
use super::blocks::{self, Format};

/// True when this CPU runs the kernels (AVX2, FMA and F16C, as the skinny f16 kernel).
pub fn supported() -> bool {
    super::super::skinny::supported()
}

/// True when the kernels can use AVX-VNNI's byte dot product as well.
fn vnni() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        supported() && std::arch::is_x86_feature_detected!("avxvnni")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Instruction sets of the kernels, narrowest first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Isa {
    Scalar,
    Avx2,
    Vnni,
    Avx512,
}

/// The widest kernel to use: the CPU's best, or narrower with `RAGCLUSTER_CPU_KERNEL`
/// (`scalar`, `avx2`, `avx-vnni`, `avx-512`), so one machine measures the kernels other CPUs
/// run (`cpudecodebench`). Read once.
fn widest() -> Isa {
    static WIDEST: std::sync::OnceLock<Isa> = std::sync::OnceLock::new();
    *WIDEST.get_or_init(|| match std::env::var("RAGCLUSTER_CPU_KERNEL").as_deref() {
        Ok("scalar") => Isa::Scalar,
        Ok("avx2") => Isa::Avx2,
        Ok("avx-vnni") => Isa::Vnni,
        _ => Isa::Avx512,
    })
}

/// For each weight row i of `w` (rows of `row_bytes`) and activation row r of `a`:
/// `out[i * a.m + r] = dot(row i, a row r)`.
pub fn rows(format: Format, w: &[u8], row_bytes: usize, a: &Q8Rows, out: &mut [f32]) {
    debug_assert_eq!(w.len() / row_bytes * a.m, out.len());
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY (all): the features checked; every row of `w` holds k / block_elems blocks
        // of `format` (QMatrix::new checked the sizes) and `a` rows of k values.
        let most = widest();
        if most >= Isa::Avx512 && super::avx512::supported() && super::avx512::fits(a.k) {
            unsafe { super::avx512::rows(format, w, row_bytes, a, out) };
            return;
        }
        if most >= Isa::Vnni && vnni() {
            unsafe { vnni::rows(format, w, row_bytes, a, out) };
            return;
        }
        if most >= Isa::Avx2 && supported() {
            unsafe { plain::rows(format, w, row_bytes, a, out) };
            return;
        }
    }
    scalar(format, w, row_bytes, a, out);
}

/// The same products from decoded weights (CPUs without AVX2, and the tests' reference).
pub fn scalar(format: Format, w: &[u8], row_bytes: usize, a: &Q8Rows, out: &mut [f32]) {
    let mut dense = vec![0f32; a.k];
    let bpr = a.blocks_per_row();
    for (i, row) in w.chunks_exact(row_bytes).enumerate() {
        blocks::dequantize(format, row, &mut dense);
        for r in 0..a.m {
            let mut sum = 0f32;
            for b in 0..bpr {
                let (q, d) = a.block(r, b);
                let dot: f32 = q
                    .iter()
                    .zip(&dense[b * 32..b * 32 + 32])
                    .map(|(q, w)| f32::from(*q) * w)
                    .sum();
                sum += dot * d;
            }
            out[i * a.m + r] = sum;
        }
    }
}

/// Rounds the 32 values of `src` to `q` as `Q8Rows` holds them (the largest magnitude maps to
/// 127, ties to even) and returns the scale and the two 16-value sums. On AVX2 eight values an
/// instruction: as a plain loop at baseline x86-64 each value was a libm `rintf` call, a
/// tenth of a prompt's time.
pub fn quantize_block(src: &[f32; 32], q: &mut [i8; 32]) -> (f32, [i32; 2]) {
    #[cfg(target_arch = "x86_64")]
    if supported() && widest() >= Isa::Avx2 {
        // SAFETY: AVX2 checked; 32 values in, 32 bytes out.
        return unsafe { shared::quantize_block(src, q) };
    }
    quantize_block_scalar(src, q)
}

/// `quantize_block` one value at a time (CPUs without AVX2, and the tests' reference).
pub fn quantize_block_scalar(src: &[f32; 32], q: &mut [i8; 32]) -> (f32, [i32; 2]) {
    let amax = src.iter().fold(0f32, |a, v| a.max(v.abs()));
    let d = amax / 127.0;
    let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
    let mut sum = [0i32; 2];
    for (j, (q, v)) in q.iter_mut().zip(src).enumerate() {
        *q = (v * inv).round_ties_even() as i8;
        sum[j / 16] += i32::from(*q);
    }
    (d, sum)
}

/// Helpers of every kernel (AVX2, FMA and F16C: inlined into the AVX-VNNI and AVX-512 ones).
#[cfg(target_arch = "x86_64")]
pub(super) mod shared {
    use std::arch::x86_64::*;

    /// The sum of the 8 lanes.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub fn hsum(v: __m256) -> f32 {
        let lo = _mm256_castps256_ps128(v);
        let s = _mm_add_ps(lo, _mm256_extractf128_ps(v, 1));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)))
    }

    /// Bytes ahead of the block being read that the loops prefetch: a decode step streams
    /// every weight once, and without it the first load of each block waits on memory
    /// (decode 17 -> 27 tokens/s on the AVX-512 kernels).
    const PREFETCH_BYTES: usize = 1024;

    /// A hint only: past the row it reads the next row, past the matrix nothing (prefetches
    /// do not fault).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub fn prefetch(p: *const u8) {
        _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(PREFETCH_BYTES).cast());
    }

    /// The little-endian f16 at `b[at..at + 2]` (a block's scale), converted by F16C from a
    /// general register. Written as intrinsics, LLVM put the half into the vector register
    /// with a `vpinsrw` that merged into whatever that register last held (the previous
    /// block's scale): a chain from block to block of about 10 cycles, which halved decode
    /// speed on AMD Zen 3. Converting in integer registers instead (bits moved, times 2^112)
    /// broke the chain but cost ~10 instructions a block; this is three.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub fn f16(b: &[u8], at: usize) -> f32 {
        let h = u32::from(u16::from_le_bytes([b[at], b[at + 1]]));
        let out: __m128;
        // SAFETY: register to register only (F16C is among this function's features);
        // `vmovd` from a general register zeroes the rest of the vector register, so the
        // conversion depends on nothing but `h`.
        unsafe {
            std::arch::asm!(
                "vmovd {v}, {h:e}",
                "vcvtph2ps {v}, {v}",
                h = in(reg) h,
                v = out(xmm_reg) out,
                options(pure, nomem, nostack, preserves_flags),
            );
        }
        _mm_cvtss_f32(out)
    }

    /// `super::quantize_block` on AVX2: `cvtps_epi32` rounds to nearest even (the MXCSR
    /// default), as `round_ties_even` does.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub fn quantize_block(src: &[f32; 32], q: &mut [i8; 32]) -> (f32, [i32; 2]) {
        // SAFETY: 32 floats in `src`, 32 bytes in `q`.
        let v: [__m256; 4] =
            std::array::from_fn(|i| unsafe { _mm256_loadu_ps(src.as_ptr().add(8 * i)) });
        let sign = _mm256_set1_ps(-0.0);
        let m = v.iter().fold(_mm256_setzero_ps(), |m, v| {
            _mm256_max_ps(m, _mm256_andnot_ps(sign, *v))
        });
        let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        let amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
        let d = amax / 127.0;
        let inv = _mm256_set1_ps(if d > 0.0 { 1.0 / d } else { 0.0 });
        let i = v.map(|v| _mm256_cvtps_epi32(_mm256_mul_ps(v, inv)));
        let hsum_i = |x: __m256i| {
            let s = _mm_add_epi32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1));
            let s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
            _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 1)))
        };
        let sum = [
            hsum_i(_mm256_add_epi32(i[0], i[1])),
            hsum_i(_mm256_add_epi32(i[2], i[3])),
        ];
        // Packing works within 128-bit lanes: the permute puts the values back in order.
        let b = _mm256_packs_epi16(
            _mm256_packs_epi32(i[0], i[1]),
            _mm256_packs_epi32(i[2], i[3]),
        );
        let b = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        // SAFETY: 32 bytes in `q`.
        unsafe { _mm256_storeu_si256(q.as_mut_ptr().cast(), b) };
        (d, sum)
    }

    /// 16 bytes of nibbles as 32 bytes: low nibbles first, then high ones.
    ///
    /// # Safety
    /// `p` points at 16 readable bytes.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn nibbles(p: *const u8) -> __m256i {
        // SAFETY: the caller passes 16 readable bytes.
        let x = unsafe { _mm_loadu_si128(p.cast()) };
        let m = _mm_set1_epi8(0xF);
        _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(x, 4), m), _mm_and_si128(x, m))
    }
}

/// The byte dot of one sub-block: 8 lane sums of `w` (unsigned) times `a` (signed).
#[cfg(target_arch = "x86_64")]
mod dots {
    use std::arch::x86_64::*;

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub fn plain(w: __m256i, a: __m256i) -> __m256i {
        _mm256_madd_epi16(_mm256_maddubs_epi16(w, a), _mm256_set1_epi16(1))
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avxvnni")]
    pub fn vnni(w: __m256i, a: __m256i) -> __m256i {
        _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), w, a)
    }
}

/// The kernels, once per instruction set: `$feat` the target features, `$dot` the byte dot,
/// `$signed_q8` whether Q8_0 stays signed (no VNNI).
macro_rules! kernels {
    ($name:ident, $feat:literal, $dot:ident, $signed_q8:literal) => {
        #[cfg(target_arch = "x86_64")]
        mod $name {
            use std::arch::x86_64::*;

            use super::super::Q8Rows;
            use super::super::blocks::{Format, scale_min_k4};
            use super::dots::$dot as dot;
            use super::shared::{f16, hsum, nibbles, prefetch};

            rows_over_tiles!($feat);

            #[target_feature(enable = $feat)]
            unsafe fn tile_rows<const R: usize>(job: Job<'_>, out: &mut [f32], offs: &mut [f32]) {
                let (format, w, row_bytes, a, r0) = job;
                let t = Tile::<R>::new(a, r0);
                for (i, row) in w.chunks_exact(row_bytes).enumerate() {
                    // SAFETY: `row` holds k / block_elems whole blocks; the tile's rows exist.
                    let (acc, offsets) = unsafe {
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
                    out[base..base + R].copy_from_slice(&t.finish(&acc, offs, offsets));
                }
            }

            /// Each R-row dot of one weight row: the formats below fill `acc` per sub-block
            /// (`block`), `offs` per half block, and say whether there are offsets. The
            /// accumulators are locals of each format's loop (registers, not memory).
            #[derive(Clone, Copy)]
            struct Tile<'a, const R: usize> {
                a: &'a Q8Rows,
                /// Each row's first half-block sum in `a.sums`.
                first: [usize; R],
                /// The tile's values and scales (`Q8Rows` layout).
                qs: *const i8,
                d: *const f32,
            }

            impl<'a, const R: usize> Tile<'a, R> {
                #[inline]
                #[target_feature(enable = $feat)]
                fn new(a: &'a Q8Rows, r0: usize) -> Self {
                    let (first, qs, d) = a.tile_start(r0);
                    Self { a, first, qs, d }
                }

                /// Adds sub-block `blk` (32 values, `w` unsigned, or signed with `SIGNED`)
                /// with `scale` per lane group.
                #[inline]
                #[target_feature(enable = $feat)]
                unsafe fn block<const SIGNED: bool>(
                    self,
                    acc: &mut [__m256; R],
                    blk: usize,
                    w: __m256i,
                    scale: __m256,
                ) {
                    let aw = if SIGNED { _mm256_sign_epi8(w, w) } else { w };
                    for (r, acc) in acc.iter_mut().enumerate() {
                        let at = (blk / 2) * 64 * R + r * 64 + (blk % 2) * 32;
                        // SAFETY: block blk of tile row r (< R): 32 values and a scale within
                        // the tile's part of `qs` and `d` (`Q8Rows` layout).
                        let (qa, d) = unsafe {
                            (
                                _mm256_loadu_si256(self.qs.add(at).cast()),
                                _mm256_broadcast_ss(&*self.d.add(at / 32)),
                            )
                        };
                        let qa = if SIGNED { _mm256_sign_epi8(qa, w) } else { qa };
                        let p = _mm256_cvtepi32_ps(dot(aw, qa));
                        *acc = _mm256_fmadd_ps(p, _mm256_mul_ps(scale, d), *acc);
                    }
                }

                /// Each row's sum, plus (`offsets`) the row's offsets times its half sums.
                #[inline]
                #[target_feature(enable = $feat)]
                fn finish(self, acc: &[__m256; R], offs: &[f32], offsets: bool) -> [f32; R] {
                    let n = offs.len();
                    let mut v = [_mm256_setzero_ps(); R];
                    if offsets {
                        let mut j = 0;
                        while j + 8 <= n {
                            // SAFETY: j + 8 <= n; each row's sums hold n from 2 first[r].
                            unsafe {
                                let o = _mm256_loadu_ps(offs.as_ptr().add(j));
                                for (r, v) in v.iter_mut().enumerate() {
                                    let s = self.a.sums.as_ptr().add(self.first[r] + j);
                                    *v = _mm256_fmadd_ps(o, _mm256_loadu_ps(s), *v);
                                }
                            }
                            j += 8;
                        }
                        for (r, v) in v.iter_mut().enumerate() {
                            let sums = &self.a.sums[self.first[r]..self.first[r] + n];
                            let rest: f32 = (j..n).map(|j| offs[j] * sums[j]).sum();
                            *v =
                                _mm256_add_ps(*v, _mm256_setr_ps(rest, 0., 0., 0., 0., 0., 0., 0.));
                        }
                    }
                    std::array::from_fn(|r| hsum(_mm256_add_ps(acc[r], v[r])))
                }

                /// Returns the accumulators and whether the row has offsets (as all these).
                #[inline]
                #[target_feature(enable = $feat)]
                unsafe fn q8_0(self, row: &[u8], offs: &mut [f32]) -> ([__m256; R], bool) {
                    let mut acc = [_mm256_setzero_ps(); R];
                    // Zipped with the offsets' pairs, so their stores need no bounds checks.
                    let pairs = offs.as_chunks_mut::<2>().0;
                    for ((blk, b), o) in row.as_chunks::<34>().0.iter().enumerate().zip(pairs) {
                        prefetch(b.as_ptr());
                        let d = f16(b, 0);
                        // SAFETY: a block is 34 bytes: the f16 scale, then 32 values.
                        let w = unsafe { _mm256_loadu_si256(b.as_ptr().add(2).cast()) };
                        // SAFETY (both): as `block` needs.
                        if $signed_q8 {
                            unsafe { self.block::<true>(&mut acc, blk, w, _mm256_set1_ps(d)) };
                        } else {
                            let u = _mm256_xor_si256(w, _mm256_set1_epi8(-128));
                            *o = [-128.0 * d; 2];
                            unsafe { self.block::<false>(&mut acc, blk, u, _mm256_set1_ps(d)) };
                        }
                    }
                    (acc, !$signed_q8)
                }

                /// Q4_0, Q4_1, Q5_0 (`N` bytes per block): nibbles (values 0..16 low, 16..32
                /// high), Q5_0's fifth bits.
                #[inline]
                #[target_feature(enable = $feat)]
                unsafe fn small<const N: usize>(
                    self,
                    format: Format,
                    row: &[u8],
                    offs: &mut [f32],
                ) -> ([__m256; R], bool) {
                    let mut acc = [_mm256_setzero_ps(); R];
                    let pairs = offs.as_chunks_mut::<2>().0;
                    for ((blk, b), o) in row.as_chunks::<N>().0.iter().enumerate().zip(pairs) {
                        prefetch(b.as_ptr());
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
                        *o = [off; 2];
                        // SAFETY: as `block` needs.
                        unsafe { self.block::<false>(&mut acc, blk, w, _mm256_set1_ps(d)) };
                    }
                    (acc, true)
                }

                #[inline]
                #[target_feature(enable = $feat)]
                unsafe fn q4k(self, row: &[u8], offs: &mut [f32]) -> ([__m256; R], bool) {
                    let mut acc = [_mm256_setzero_ps(); R];
                    let mask = _mm256_set1_epi8(0xF);
                    let supers = offs.as_chunks_mut::<16>().0;
                    for ((sb, b), o) in row.as_chunks::<144>().0.iter().enumerate().zip(supers) {
                        prefetch(b.as_ptr());
                        prefetch(b.as_ptr().wrapping_add(64));
                        let (d, dmin) = (f16(b, 0), f16(b, 2));
                        let scales = &b[4..16];
                        for pair in 0..4 {
                            // SAFETY: 32 bytes of nibbles per pair of sub-blocks, at 16 + 32 pair.
                            let q = unsafe {
                                _mm256_loadu_si256(b.as_ptr().add(16 + 32 * pair).cast())
                            };
                            let lo = _mm256_and_si256(q, mask);
                            let hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), mask);
                            for (j, w) in [(2 * pair, lo), (2 * pair + 1, hi)] {
                                let (sc, m) = scale_min_k4(j, scales);
                                let scale = _mm256_set1_ps(d * f32::from(sc));
                                let blk = 8 * sb + j;
                                o[2 * j] = -dmin * f32::from(m);
                                o[2 * j + 1] = -dmin * f32::from(m);
                                // SAFETY: as `block` needs.
                                unsafe { self.block::<false>(&mut acc, blk, w, scale) };
                            }
                        }
                    }
                    (acc, true)
                }

                #[inline]
                #[target_feature(enable = $feat)]
                unsafe fn q6k(self, row: &[u8], offs: &mut [f32]) -> ([__m256; R], bool) {
                    let mut acc = [_mm256_setzero_ps(); R];
                    let (m4, m3) = (_mm256_set1_epi8(0xF), _mm256_set1_epi8(3));
                    let supers = offs.as_chunks_mut::<16>().0;
                    for ((sb, b), o) in row.as_chunks::<210>().0.iter().enumerate().zip(supers) {
                        prefetch(b.as_ptr());
                        prefetch(b.as_ptr().wrapping_add(64));
                        prefetch(b.as_ptr().wrapping_add(128));
                        let d = f16(b, 208);
                        let sc = &b[192..208];
                        for s in 0..8 {
                            let (n, t) = (s / 4, s % 4);
                            // SAFETY: ql is b[0..128], qh b[128..192]: 32 bytes at
                            // 64 n + 32 (t & 1) and at 128 + 32 n.
                            let (ql, qh) = unsafe {
                                (
                                    _mm256_loadu_si256(
                                        b.as_ptr().add(64 * n + 32 * (t & 1)).cast(),
                                    ),
                                    _mm256_loadu_si256(b.as_ptr().add(128 + 32 * n).cast()),
                                )
                            };
                            let lo = if t < 2 {
                                _mm256_and_si256(ql, m4)
                            } else {
                                _mm256_and_si256(_mm256_srli_epi16(ql, 4), m4)
                            };
                            let shift = _mm_cvtsi32_si128(2 * t as i32);
                            let hb = _mm256_and_si256(_mm256_srl_epi16(qh, shift), m3);
                            let w = _mm256_or_si256(lo, _mm256_slli_epi16(hb, 4));
                            let sa = d * f32::from(sc[8 * n + 2 * t] as i8);
                            let sb2 = d * f32::from(sc[8 * n + 2 * t + 1] as i8);
                            let scale = _mm256_setr_ps(sa, sa, sa, sa, sb2, sb2, sb2, sb2);
                            let blk = 8 * sb + s;
                            o[2 * s] = -32.0 * sa;
                            o[2 * s + 1] = -32.0 * sb2;
                            // SAFETY: as `block` needs.
                            unsafe { self.block::<false>(&mut acc, blk, w, scale) };
                        }
                    }
                    (acc, true)
                }
            }

            /// The 32 bits of `x` as 32 bytes, 0xFF where the bit is set (byte i = bit i).
            #[inline]
            #[target_feature(enable = $feat)]
            fn bits(x: u32) -> __m256i {
                // Byte i takes byte i / 8 of x, then keeps only bit i % 8.
                let v = _mm256_set1_epi32(x as i32);
                let spread = _mm256_shuffle_epi8(
                    v,
                    _mm256_setr_epi64x(
                        0,
                        0x0101_0101_0101_0101,
                        0x0202_0202_0202_0202,
                        0x0303_0303_0303_0303,
                    ),
                );
                let bit = _mm256_set1_epi64x(0x8040_2010_0804_0201_u64 as i64);
                _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit)
            }
        }
    };
}

kernels!(plain, "avx2,fma,f16c", plain, true);
kernels!(vnni, "avx2,fma,f16c,avxvnni", vnni, false);

/// The kernels' conversion of the f16 in `b[0..2]`, where this CPU runs them.
#[cfg(test)]
pub fn block_scale(b: &[u8]) -> Option<f32> {
    #[cfg(target_arch = "x86_64")]
    if supported() {
        // SAFETY: AVX2, FMA and F16C checked.
        return Some(unsafe { shared::f16(b, 0) });
    }
    None
}

/// A way to compute `rows`.
#[cfg(test)]
pub type Kernel = fn(Format, &[u8], usize, &Q8Rows, &mut [f32]);

/// Every kernel this CPU runs, named (the tests check each against `scalar`).
#[cfg(test)]
pub fn kernels() -> Vec<(&'static str, Kernel)> {
    let mut v: Vec<(&'static str, Kernel)> = vec![("scalar", scalar)];
    #[cfg(target_arch = "x86_64")]
    {
        if supported() {
            // SAFETY: AVX2, FMA and F16C checked; callers pass whole rows (as `rows`).
            v.push(("avx2", |f, w, rb, a, o| unsafe {
                plain::rows(f, w, rb, a, o)
            }));
        }
        if vnni() {
            // SAFETY: as above, and AVX-VNNI checked.
            v.push(("avx-vnni", |f, w, rb, a, o| unsafe {
                vnni::rows(f, w, rb, a, o)
            }));
        }
        if super::avx512::supported() {
            // SAFETY: AVX-512 checked; the tests' rows have an even number of sub-blocks.
            v.push(("avx-512", |f, w, rb, a, o| unsafe {
                super::avx512::rows(f, w, rb, a, o)
            }));
        }
    }
    v
}
