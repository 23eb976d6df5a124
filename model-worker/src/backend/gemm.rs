//! Row-major f32 matrix products for the CPU encoder and the quantized decoder's prompts,
//! split across the rayon pool here.
//!
//! candle hands a product to the gemm crate's own threading, which forks and joins the pool
//! once per depth block of the product and has every thread pack the weight; on 16 cores
//! that held the encoder to 3.9x its 2-core rate. Here a product is cut up front into one
//! block of rows x columns per thread, and each block runs the gemm crate's kernel on one
//! thread: one fork-join per product, and each thread packs only the weight columns it uses.
//! Output goes into a caller's buffer, so the encoder reuses its activations across forwards
//! instead of faulting in fresh pages for every product, and the decoder writes a slice of
//! weight rows' outputs straight into its place in the whole product.

// The gemm crate's entry point takes raw pointers and strides; `block` is the one call.
#![allow(unsafe_code)]

use gemm::Parallelism;
use rayon::prelude::*;

/// Fewest rows per block: below this a block's packing outweighs its arithmetic.
const MIN_ROWS: usize = 16;
/// Fewest columns per block when rows are plentiful (whole weight panels per thread).
const MIN_COLS: usize = 256;
/// Fewest columns per block when a product has too few rows to give every thread some.
const MIN_COLS_FEW_ROWS: usize = 64;
/// Column edges fall on this multiple (one AVX-512 register of f32).
const COL_ALIGN: usize = 16;
/// Products under this many multiply-adds run on the calling thread: a fork-join costs more.
const SERIAL_WORK: usize = 1 << 20;

/// How the right-hand factor `b` of a product is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Rhs {
    /// `(k, n)` row-major: the encoder's weights, laid out for it at load.
    KByN,
    /// `(n, k)` row-major, i.e. `b` transposed: a GGUF weight matrix's own rows.
    NByK,
}

/// `out (m, n) = a (m, k) · b (k, n)`, all row-major and contiguous.
///
/// Panics if a slice's length does not match its shape: callers size them from the same
/// dimensions, so a mismatch is a bug, not input.
pub(crate) fn matmul(a: &[f32], b: &[f32], out: &mut [f32], m: usize, k: usize, n: usize) {
    product(a, b, Rhs::KByN, out, n, m, k, n);
}

/// `out[i * ld + j] = (a · b)[i][j]` for `a (m, k)` row-major and `b` stored as `rhs` says:
/// `out` may be a column band of a wider row-major matrix (`ld` its width), the elements
/// outside the band untouched.
///
/// Panics if a slice is too short for its shape or `ld < n` (a caller's bug, not input).
#[allow(clippy::too_many_arguments)]
pub(crate) fn product(
    a: &[f32],
    b: &[f32],
    rhs: Rhs,
    out: &mut [f32],
    ld: usize,
    m: usize,
    k: usize,
    n: usize,
) {
    assert!(
        a.len() == m * k && b.len() == k * n && ld >= n,
        "matmul: slices do not match ({m}, {k}) x ({k}, {n})"
    );
    if m == 0 || n == 0 {
        return;
    }
    assert!(out.len() >= (m - 1) * ld + n, "matmul: output too short");
    if k == 0 {
        out.chunks_mut(ld).for_each(|row| row[..n].fill(0.0));
        return;
    }
    let threads = if m * k * n < SERIAL_WORK {
        1
    } else {
        rayon::current_num_threads()
    };
    let (row_parts, col_parts) = split(m, n, threads);
    let dst = Dst(out.as_mut_ptr());
    let shape = Shape { rhs, k, n, ld };
    let run = |task: usize| {
        let (rows, cols) = (
            edges(m, row_parts, task / col_parts, 1),
            edges(n, col_parts, task % col_parts, COL_ALIGN),
        );
        // SAFETY: `a` and `b` hold (m, k) and (k, n) and `out` reaches row m - 1's column
        // n - 1 at stride `ld` (asserted above), the block lies inside them (`edges` stays
        // within 0..=m and 0..=n), and the blocks of different tasks cover disjoint rows x
        // columns of `out`, so no two threads write the same element and nothing else reads
        // `out` until every task has returned.
        unsafe { block(a, b, dst.get(), rows, cols, shape) }
    };
    if row_parts * col_parts == 1 {
        run(0);
    } else {
        (0..row_parts * col_parts).into_par_iter().for_each(run);
    }
}

/// What `block` needs of a product's layout.
#[derive(Clone, Copy)]
struct Shape {
    rhs: Rhs,
    k: usize,
    n: usize,
    /// Output row stride.
    ld: usize,
}

/// `out`'s base pointer, shared by the tasks that write its disjoint blocks.
#[derive(Clone, Copy)]
struct Dst(*mut f32);

// SAFETY: each task writes only its own block of the buffer (see `matmul`).
unsafe impl Send for Dst {}
unsafe impl Sync for Dst {}

impl Dst {
    /// A method (not the field) so closures capture the whole `Send` wrapper.
    fn get(self) -> *mut f32 {
        self.0
    }
}

/// Rows x columns of blocks for `threads`: as many column parts as divide `threads` while
/// each keeps `MIN_COLS` columns (so a weight panel is packed by few threads), the rest in
/// rows; with too few rows for that, the spare threads go to narrower column parts.
fn split(m: usize, n: usize, threads: usize) -> (usize, usize) {
    if threads <= 1 {
        return (1, 1);
    }
    let cols = (1..=threads)
        .rev()
        .find(|&d| threads.is_multiple_of(d) && n / d >= MIN_COLS)
        .unwrap_or(1);
    let rows = (threads / cols).min(m.div_ceil(MIN_ROWS)).max(1);
    let cols = if rows * cols < threads {
        (threads / rows).min(n / MIN_COLS_FEW_ROWS).max(cols)
    } else {
        cols
    };
    (rows, cols)
}

/// Start and end of part `i` of `parts` over `0..len`, inner edges rounded down to `align`.
fn edges(len: usize, parts: usize, i: usize, align: usize) -> (usize, usize) {
    let edge = |j: usize| {
        if j >= parts {
            len
        } else {
            (len * j / parts) / align * align
        }
    };
    (edge(i), edge(i + 1))
}

/// One block of `out = a · b` on the calling thread: rows `rows.0..rows.1` and columns
/// `cols.0..cols.1` of the (m, n) output.
///
/// # Safety
/// `a` must hold (m, k) row-major and `b` (k, n) as `shape.rhs` says; `out` must point at
/// m rows of stride `shape.ld` that no other thread touches inside this block; `rows` and
/// `cols` must lie within `0..=m` and `0..=n`.
unsafe fn block(
    a: &[f32],
    b: &[f32],
    out: *mut f32,
    rows: (usize, usize),
    cols: (usize, usize),
    shape: Shape,
) {
    let Shape { rhs, k, n, ld } = shape;
    let (h, w) = (rows.1 - rows.0, cols.1 - cols.0);
    if h == 0 || w == 0 {
        return;
    }
    // Element (p, j) of b: row stride and column stride of its storage.
    let (b_at, b_rs, b_cs) = match rhs {
        Rhs::KByN => (cols.0, n as isize, 1),
        Rhs::NByK => (cols.0 * k, 1, k as isize),
    };
    // SAFETY: the offsets stay inside the buffers (caller's contract); the strides describe
    // the layouts above. dst = 0 · dst + 1 · (a · b), dst not read.
    unsafe {
        gemm::gemm(
            h,
            w,
            k,
            out.add(rows.0 * ld + cols.0),
            1,
            ld as isize,
            false,
            a.as_ptr().add(rows.0 * k),
            1,
            k as isize,
            b.as_ptr().add(b_at),
            b_cs,
            b_rs,
            0.0,
            1.0,
            false,
            false,
            false,
            Parallelism::None,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::simd::worst_difference;

    fn naive(a: &[f32], b: &[f32], m: usize, k: usize, n: usize) -> Vec<f32> {
        let mut out = vec![0f32; m * n];
        for i in 0..m {
            for j in 0..n {
                out[i * n + j] = (0..k).map(|p| a[i * k + p] * b[p * n + j]).sum();
            }
        }
        out
    }

    #[test]
    fn every_split_matches_the_naive_product() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(6)
            .build()
            .unwrap();
        for &(m, k, n) in &[
            (1, 3, 5),
            (7, 384, 40),
            (100, 64, 1152),
            (333, 96, 300),
            (40, 200, 1536),
            (5, 0, 4),
        ] {
            let a: Vec<f32> = (0..m * k)
                .map(|i| ((i * 7) % 13) as f32 * 0.1 - 0.6)
                .collect();
            let b: Vec<f32> = (0..k * n)
                .map(|i| ((i * 5) % 11) as f32 * 0.1 - 0.5)
                .collect();
            let want = naive(&a, &b, m, k, n);
            let mut got = vec![f32::NAN; m * n];
            pool.install(|| matmul(&a, &b, &mut got, m, k, n));
            let worst = worst_difference(&want, &got);
            assert!(worst < 1e-3, "({m}, {k}, {n}): {worst}");
        }
    }

    #[test]
    fn transposed_weights_fill_a_band_of_a_wider_output() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(4)
            .build()
            .unwrap();
        for &(m, k, n) in &[(3, 7, 5), (64, 96, 600), (40, 32, 33)] {
            let a: Vec<f32> = (0..m * k)
                .map(|i| ((i * 7) % 13) as f32 * 0.1 - 0.6)
                .collect();
            // b stored (n, k): its transpose is the (k, n) factor.
            let bt: Vec<f32> = (0..n * k)
                .map(|i| ((i * 5) % 11) as f32 * 0.1 - 0.5)
                .collect();
            let b: Vec<f32> = (0..k * n).map(|i| bt[(i % n) * k + i / n]).collect();
            let want = naive(&a, &b, m, k, n);
            // The band is columns 2..2 + n of an (m, n + 5) matrix.
            let ld = n + 5;
            let mut got = vec![f32::NAN; m * ld];
            pool.install(|| product(&a, &bt, Rhs::NByK, &mut got[2..], ld, m, k, n));
            for i in 0..m {
                let row = &got[i * ld..(i + 1) * ld];
                assert!(row[..2].iter().chain(&row[2 + n..]).all(|v| v.is_nan()));
                for j in 0..n {
                    let d = (row[2 + j] - want[i * n + j]).abs();
                    assert!(d < 1e-3, "({m}, {k}, {n}) [{i}][{j}]: {d}");
                }
            }
        }
    }

    #[test]
    fn splits_cover_the_threads_and_respect_the_minimums() {
        assert_eq!(split(2112, 384, 16), (16, 1));
        assert_eq!(split(2112, 1152, 16), (4, 4));
        assert_eq!(split(2112, 1536, 16), (4, 4));
        assert_eq!(split(10, 1152, 16), (1, 16));
        assert_eq!(split(10, 384, 16), (1, 6));
        assert_eq!(split(2112, 384, 1), (1, 1));
        // Edges tile the range exactly, on the alignment.
        let e: Vec<_> = (0..6).map(|i| edges(384, 6, i, COL_ALIGN)).collect();
        assert_eq!(e.first().unwrap().0, 0);
        assert_eq!(e.last().unwrap().1, 384);
        assert!(
            e.windows(2)
                .all(|w| w[0].1 == w[1].0 && w[0].1 % COL_ALIGN == 0)
        );
    }
}
