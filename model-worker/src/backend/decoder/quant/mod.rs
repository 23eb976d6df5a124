//! GGUF weights kept quantized on the CPU, multiplied as llama.cpp does: each activation row is
//! rounded to 8-bit integers in blocks of 32 (one f32 scale per block, and the block's sum
//! for the formats with an offset), and every weight block is unpacked in registers to 32
//! small integers and dotted with the activations in integer arithmetic (AVX2 `maddubs`),
//! one float multiply-add per block. Weights stay at their file size in memory (a Q4_K_M
//! Qwen2.5 0.5B: 491 MB instead of 2 GB of f32), and a decode step, which reads every weight
//! once, moves a quarter of the bytes.
//!
//! Formats: Q4_0, Q4_1, Q5_0, Q8_0 (blocks of 32) and Q4_K, Q6_K (super-blocks of 256 with
//! 6- and 8-bit sub-block scales), what Q4_K_M files hold. `blocks` decodes them (the
//! reference the kernels are tested against, and embedding rows); `avx2` multiplies
//! (`avx512` two sub-blocks per instruction where the CPU has AVX-512 VNNI).
//! Anything else, or a CPU without AVX2, stays with candle's `QMatMul`.

/// The driver of every integer kernel module (`$feat` its target features): activation rows
/// tile by tile (`Q8Rows::tiles`), each through the module's `tile_rows::<R>`, with one
/// buffer for a weight row's offsets.
macro_rules! rows_over_tiles {
    ($feat:literal) => {
        /// # Safety
        /// The target features; `w` whole rows of `format` over `a.k` values.
        #[target_feature(enable = $feat)]
        pub unsafe fn rows(
            format: Format,
            w: &[u8],
            row_bytes: usize,
            a: &Q8Rows,
            out: &mut [f32],
        ) {
            let mut offs = vec![0f32; 2 * a.blocks_per_row()];
            for (r0, tile) in a.tiles() {
                let t = (format, w, row_bytes, a, r0);
                // SAFETY: as for this function; rows r0..r0 + tile exist in `a`.
                unsafe {
                    match tile {
                        8 => tile_rows::<8>(t, out, &mut offs),
                        4 => tile_rows::<4>(t, out, &mut offs),
                        3 => tile_rows::<3>(t, out, &mut offs),
                        2 => tile_rows::<2>(t, out, &mut offs),
                        _ => tile_rows::<1>(t, out, &mut offs),
                    }
                }
            }
        }

        /// What a tile's product reads: format, weight rows, bytes per row, activations, first
        /// activation row.
        type Job<'a> = (Format, &'a [u8], usize, &'a Q8Rows, usize);
    };
}

mod avx2;
mod avx512;
pub mod blocks;

use candle_core::quantized::{GgmlDType, QTensor};
use rayon::prelude::*;

use crate::backend::gemm::{self, Rhs};

pub use blocks::Format;

/// Weight rows per rayon task: a task's rows and one tile of activations stay in L1/L2.
const BLOCK: usize = 16;

/// Rows of activations from which a product goes through `matmul_dense`.
pub const DENSE_FROM_ROWS: usize = 32;

/// A weight matrix of `n` rows of `k`, as the GGUF file stores it (row-major blocks).
pub struct QMatrix {
    pub format: Format,
    pub n: usize,
    pub k: usize,
    data: Vec<u8>,
    row_bytes: usize,
}

impl QMatrix {
    /// The matrix behind `t` (shape `(n, k)`), when its format is one of ours; None leaves
    /// it to candle.
    pub fn from_qtensor(t: &QTensor) -> Option<Self> {
        let format = Format::of(t.dtype())?;
        let (n, k) = t.shape().dims2().ok()?;
        let data = t.data().ok()?.into_owned();
        Self::new(format, n, k, data)
    }

    /// Checks the byte count against the shape.
    pub fn new(format: Format, n: usize, k: usize, data: Vec<u8>) -> Option<Self> {
        if n == 0 || k == 0 || !k.is_multiple_of(format.block_elems()) {
            return None;
        }
        let row_bytes = k / format.block_elems() * format.block_bytes();
        (data.len() == n * row_bytes).then_some(Self {
            format,
            n,
            k,
            data,
            row_bytes,
        })
    }

    /// Whether this CPU runs the kernels.
    pub fn supported() -> bool {
        avx2::supported()
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.data.len()
    }

    fn row(&self, i: usize) -> &[u8] {
        &self.data[i * self.row_bytes..(i + 1) * self.row_bytes]
    }

    /// Row `i` decoded to f32 (an embedding lookup).
    pub fn dequantize_row(&self, i: usize, out: &mut [f32]) {
        blocks::dequantize(self.format, self.row(i), out);
    }

    /// `x (m x k) . self^T`, row-major `m x n`: from `DENSE_FROM_ROWS` rows (a prompt) by
    /// `matmul_dense`, else with `x` quantized here (see `matmul_q8` to share one
    /// quantization between matrices of the same input).
    pub fn matmul(&self, x: &[f32], m: usize) -> candle_core::Result<Vec<f32>> {
        if m >= DENSE_FROM_ROWS {
            return self.matmul_dense(x, m);
        }
        Ok(self.matmul_q8(&Q8Rows::quantize(x, m, self.k)))
    }

    /// The product for many rows: the weights decoded to f32 a slice of rows at a time (about
    /// 4 MB, in parallel) and multiplied by the gemm crate's packed kernels (`backend::gemm`),
    /// each slice's outputs written straight into their columns of the result. Decoding costs
    /// once per weight whatever `m` is, and a GEMM reuses each loaded weight across many rows,
    /// which the block-by-block integer kernels, at about 4 cycles per 32 weights and row, do
    /// not (on 2 cores: prompts 2x faster this way). Memory stays the file's plus one slice.
    pub fn matmul_dense(&self, x: &[f32], m: usize) -> candle_core::Result<Vec<f32>> {
        let (n, k) = (self.n, self.k);
        if x.len() != m * k {
            candle_core::bail!("activations of {} values for {m} rows of {k}", x.len());
        }
        let chunk = ((1 << 20) / k).clamp(16, n);
        let mut y = vec![0f32; m * n];
        let mut w = vec![0f32; chunk * k];
        for c0 in (0..n).step_by(chunk) {
            let rows = chunk.min(n - c0);
            let w = &mut w[..rows * k];
            w.par_chunks_mut(k)
                .enumerate()
                .for_each(|(i, out)| self.dequantize_row(c0 + i, out));
            gemm::product(x, w, Rhs::NByK, &mut y[c0..], n, m, k, rows);
        }
        Ok(y)
    }

    /// The product with activations already quantized.
    pub fn matmul_q8(&self, a: &Q8Rows) -> Vec<f32> {
        assert_eq!(a.k, self.k, "activation width");
        let m = a.m;
        // No rows (a prompt chunk of which no logits are wanted): nothing to split.
        if m == 0 {
            return Vec::new();
        }
        // Each task fills its rows' outputs for every activation row, n-major so a task
        // writes one contiguous slice; transposed back at the end.
        let mut yt = vec![0f32; self.n * m];
        yt.par_chunks_mut(BLOCK * m)
            .enumerate()
            .for_each(|(task, out)| {
                let first = task * BLOCK;
                let rows = out.len() / m;
                let w = &self.data[first * self.row_bytes..(first + rows) * self.row_bytes];
                avx2::rows(self.format, w, self.row_bytes, a, out);
            });
        if m == 1 {
            return yt;
        }
        transpose(&yt, self.n, m)
    }
}

/// `src` (`n` rows of `m`) transposed to `m` rows of `n`, in parallel by bands of 16
/// output rows: each band reads `src` one 64-byte line per row.
fn transpose(src: &[f32], n: usize, m: usize) -> Vec<f32> {
    const BAND: usize = 16;
    let mut y = vec![0f32; m * n];
    let band = |(b, out): (usize, &mut [f32])| {
        let r0 = b * BAND;
        let rows = out.len() / n;
        for (j, col) in src.chunks_exact(m).enumerate() {
            for (r, v) in col[r0..r0 + rows].iter().enumerate() {
                out[r * n + j] = *v;
            }
        }
    };
    if m <= BAND {
        band((0, &mut y));
    } else {
        y.par_chunks_mut(BAND * n).enumerate().for_each(band);
    }
    y
}

/// Activation rows rounded to i8 in blocks of 32, each block with its scale `d`, and per half
/// block (16 values) `d` times their sum: what a weight's offset multiplies (the kernels take
/// weights as unsigned bytes, their zero point moved into that offset).
///
/// Laid out for the kernels, which take rows in tiles (`tiles`: 8 rows, then 4, then the
/// rest) and walk the blocks of a weight row once per tile: within a tile, each pair of
/// blocks holds the tile's rows one after the other (64 bytes of values, 16 scales `d`
/// and 2 scales per row), so a tile is read through one pointer with constant offsets and a
/// pair of blocks is one 512-bit load. An odd last block is padded.
pub struct Q8Rows {
    pub m: usize,
    pub k: usize,
    /// Per tile starting at row r0: `r0 * row_qs` on, pair p of row i at
    /// `p * 64 * tile + i * 64`.
    pub qs: Vec<i8>,
    /// Each block's scale, at its place in `qs` divided by 32.
    pub d: Vec<f32>,
    /// Row-major: per row, `2 * blocks` half-block sums times `d`.
    pub sums: Vec<f32>,
}

/// Rows per tile at most.
pub const TILE: usize = 8;

impl Q8Rows {
    /// Quantizes `x` (`m` rows of `k`, `k` a multiple of 32): per block, the largest
    /// magnitude maps to 127.
    pub fn quantize(x: &[f32], m: usize, k: usize) -> Self {
        assert!(
            k.is_multiple_of(32) && x.len() == m * k,
            "activation shape {m} x {k}"
        );
        let bpr = k / 32;
        let pairs = bpr.div_ceil(2);
        let mut out = Self {
            m,
            k,
            qs: vec![0; m * pairs * 64],
            d: vec![0.0; m * pairs * 2],
            sums: vec![0.0; 2 * bpr * m],
        };
        // Each tile's rows own one stretch of `qs`, `d` and `sums`: tiles are quantized in
        // parallel (a prompt's rows), a decode step's one tile on the calling thread.
        let row_qs = out.row_qs();
        let tiles: Vec<(usize, usize)> = out.tiles().collect();
        let mut jobs = Vec::new();
        let (mut qs, mut ds, mut sums) = (&mut out.qs[..], &mut out.d[..], &mut out.sums[..]);
        for (r0, tile) in tiles {
            let (q, q_rest) = std::mem::take(&mut qs).split_at_mut(tile * row_qs);
            let (d, d_rest) = std::mem::take(&mut ds).split_at_mut(tile * row_qs / 32);
            let (s, s_rest) = std::mem::take(&mut sums).split_at_mut(2 * bpr * tile);
            (qs, ds, sums) = (q_rest, d_rest, s_rest);
            jobs.push((&x[r0 * k..(r0 + tile) * k], tile, q, d, s));
        }
        let quantize =
            |(x, tile, qs, d, sums): (&[f32], usize, &mut [i8], &mut [f32], &mut [f32])| {
                for (i, row) in x.chunks_exact(k).enumerate() {
                    for (b, src) in row.as_chunks::<32>().0.iter().enumerate() {
                        let at = Self::place_in_tile(tile, i, b);
                        let q = (&mut qs[at..at + 32]).try_into().expect("32 values");
                        let (scale, sum) = avx2::quantize_block(src, q);
                        d[at / 32] = scale;
                        let s = 2 * (i * bpr + b);
                        sums[s] = scale * sum[0] as f32;
                        sums[s + 1] = scale * sum[1] as f32;
                    }
                }
            };
        if jobs.len() == 1 {
            jobs.into_iter().for_each(quantize);
        } else {
            jobs.into_par_iter().for_each(quantize);
        }
        out
    }

    /// The tiles: (first row, rows), 8 rows while there are, then 4, then the rest.
    pub fn tiles(&self) -> impl Iterator<Item = (usize, usize)> + use<> {
        let m = self.m;
        let mut r0 = 0;
        std::iter::from_fn(move || {
            let tile = match m.checked_sub(r0)? {
                0 => return None,
                n if n >= TILE => TILE,
                n if n >= 4 => 4,
                n => n,
            };
            r0 += tile;
            Some((r0 - tile, tile))
        })
    }

    /// Bytes per row in `qs` (whole pairs of blocks).
    pub fn row_qs(&self) -> usize {
        self.k.div_ceil(64) * 64
    }

    /// Where block `b` of row `i` of the tile (r0, tile) starts in `qs`.
    fn place(&self, r0: usize, tile: usize, i: usize, b: usize) -> usize {
        r0 * self.row_qs() + Self::place_in_tile(tile, i, b)
    }

    /// Where block `b` of row `i` of a tile of `tile` rows starts from the tile's start.
    fn place_in_tile(tile: usize, i: usize, b: usize) -> usize {
        (b / 2) * 64 * tile + i * 64 + (b % 2) * 32
    }

    /// Row `r`'s block `b`: its values and scale (the scalar path and the tests).
    pub fn block(&self, r: usize, b: usize) -> (&[i8], f32) {
        let (r0, tile) = self.tiles().find(|(r0, t)| r < r0 + t).unwrap_or((r, 1));
        let at = self.place(r0, tile, r - r0, b);
        (&self.qs[at..at + 32], self.d[at / 32])
    }

    /// Where the tile of `R` rows from `r0` starts, as the SIMD kernels walk it: each row's
    /// first half-block sum in `sums`, and the tile's values and scales.
    pub(super) fn tile_start<const R: usize>(
        &self,
        r0: usize,
    ) -> ([usize; R], *const i8, *const f32) {
        let bpr = self.blocks_per_row();
        (
            std::array::from_fn(|r| 2 * (r0 + r) * bpr),
            self.qs[r0 * self.row_qs()..].as_ptr(),
            self.d[r0 * self.row_qs() / 32..].as_ptr(),
        )
    }

    /// Blocks of 32 per row.
    fn blocks_per_row(&self) -> usize {
        self.k / 32
    }
}

impl Format {
    /// Our format for a GGML type.
    pub fn of(t: GgmlDType) -> Option<Self> {
        Some(match t {
            GgmlDType::Q4_0 => Format::Q4_0,
            GgmlDType::Q4_1 => Format::Q4_1,
            GgmlDType::Q5_0 => Format::Q5_0,
            GgmlDType::Q8_0 => Format::Q8_0,
            GgmlDType::Q4K => Format::Q4K,
            GgmlDType::Q6K => Format::Q6K,
            _ => return None,
        })
    }
}

#[cfg(test)]
mod tests;
