//! Attention over the paged KV cache, by the shape of a forward's rows. Decode rows (one
//! per sequence) take a block per row and head (`attention`). Prompt rows come in runs of
//! consecutive positions of one sequence, and a block per row would read the sequence's
//! keys and values once for every row (O(span) loads per row): they go in tiles of up to
//! `TILE` rows per block (`attention_tiles`), each key and value row read once per tile.
//! Measured on an H100 (`gpubench --sections profile`, docs/bench/2026-11-26-gpu.json): a
//! 2,040-row prefill step spent 5.4 of its 8.6 ms of device time in attention before the
//! tiles, 2.3 of 5.7 with them.

use cudarc::driver::{CudaFunction, CudaSlice, LaunchConfig, PushKernelArg};

use super::{CudaLlama, Indexes, Layer, PAGE, Workspace, err};
use crate::backend::decoder::Dims;
use crate::error::ModelError;

/// Threads per block of the row-wise kernel: eight warps share a row's positions, sixteen
/// in a step of at most `FEW_ROWS` rows, where the blocks are few (measured on an H100,
/// `gpubench --sections profile`: 1 and 8 rows 1.52 -> 1.34 ms per step with 512 threads,
/// 64 rows 1.73 -> 1.79 ms).
pub(super) const ROW_THREADS: usize = 256;
const FEW_ROWS: usize = 32;
/// The most `set_row_threads` allows (the kernel's reductions hold 32 warps).
const MAX_ROW_THREADS: usize = 1024;
/// The most rows per tile (`set_prefill_tile`).
pub(super) const TILE: usize = 64;
/// Rows per tile in serving: smaller tiles make more blocks for the same rows (measured on
/// an H100, `gpubench --sections profile`: a 2,040-row prefill step 5.82 ms with tiles of
/// 64 rows, 5.34 with 32, 5.09 with 16).
pub(super) const SERVING_TILE: usize = 16;
/// Cache positions staged in shared memory at a time (`KT` in the kernel).
const KEYS: usize = 32;

/// Shared memory of the row-wise kernel with `threads` per block, in floats, for spans up to
/// `longest`: the query, the reduction, each warp's partial sums, the scores and the page
/// numbers.
pub(super) fn attention_shared(d: &Dims, longest: usize, threads: usize) -> usize {
    d.head_dim + 32 + (threads / 32) * d.head_dim + longest + longest.div_ceil(PAGE)
}

/// A forward's rows split by kernel: `tiles` as `[first row, rows]` pairs (runs of 2 to
/// `tile` rows of one sequence at consecutive positions) for `attention_tiles`, and the
/// rows in no run (`singles`: a decode row beside prompt chunks) for the row-wise kernel,
/// where a tile block would stage a whole span's keys for one query.
#[derive(Debug, PartialEq)]
pub(super) struct Split {
    pub tiles: Vec<i32>,
    pub singles: Vec<i32>,
}

/// A `Split` on the device, with its counts: tiles and rows.
pub(super) struct DeviceSplit {
    pub tiles: (CudaSlice<i32>, usize),
    pub singles: Option<(CudaSlice<i32>, usize)>,
}

/// The rows' `Split`; `None` when no run holds more than one row (a decode step): the
/// row-wise kernel serves them all.
pub(super) fn tiles(seqs: &[usize], positions: &[usize], tile: usize) -> Option<Split> {
    let mut runs: Vec<(i32, i32)> = Vec::new();
    for (i, (&s, &p)) in seqs.iter().zip(positions).enumerate() {
        let extends = i > 0
            && seqs[i - 1] == s
            && positions[i - 1] + 1 == p
            && runs.last().is_some_and(|&(_, c)| (c as usize) < tile);
        match runs.last_mut() {
            Some((_, c)) if extends => *c += 1,
            _ => runs.push((i as i32, 1)),
        }
    }
    if runs.len() == seqs.len() {
        return None;
    }
    let (multi, single): (Vec<_>, Vec<_>) = runs.into_iter().partition(|&(_, c)| c > 1);
    Some(Split {
        tiles: multi.into_iter().flat_map(|(f, c)| [f, c]).collect(),
        singles: single.into_iter().map(|(f, _)| f).collect(),
    })
}

impl CudaLlama {
    /// Rows per prompt tile (1 to `TILE`; a benchmark's knob, `gpubench --sections
    /// profile`).
    pub fn set_prefill_tile(&mut self, rows: usize) -> Result<(), ModelError> {
        if !(1..=TILE).contains(&rows) {
            return Err(err(format!("{rows} rows per attention tile")));
        }
        self.prefill_tile = rows;
        Ok(())
    }

    /// Threads per block of the row-wise kernel for a step of `n` rows: `set_row_threads`'s
    /// choice, else `ROW_THREADS` (twice that for few rows).
    pub(super) fn row_threads_for(&self, n: usize) -> usize {
        match self.row_threads {
            Some(t) => t,
            None if n <= FEW_ROWS => 2 * ROW_THREADS,
            None => ROW_THREADS,
        }
    }

    /// Sets the row-wise kernel's threads per block (a multiple of 32 from 32 to 1,024;
    /// `None`: by step size; a benchmark's knob, `gpubench --sections profile`); captured
    /// decode graphs are dropped.
    pub fn set_row_threads(&mut self, threads: Option<usize>) -> Result<(), ModelError> {
        if let Some(t) = threads {
            if t % 32 != 0 || !(32..=MAX_ROW_THREADS).contains(&t) {
                return Err(err(format!("{t} threads per attention block")));
            }
            if self.graphs && !fits(&self.dims, t) {
                return Err(err(
                    "decode graphs need shared memory for the whole context",
                ));
            }
        }
        self.row_threads = threads;
        if let Some(w) = self
            .work
            .get_mut()
            .map_err(|_| err("workspace lock poisoned"))?
        {
            w.decode = None;
        }
        Ok(())
    }

    /// Attention of the forward's `n` rows for one layer, into `w.att`: prompt runs in
    /// tiles and the other rows row-wise (`Split`), or every row row-wise.
    pub(super) fn attention(
        &self,
        layer: &Layer,
        ix: &Indexes,
        w: &mut Workspace,
        n: usize,
    ) -> Result<(), ModelError> {
        let Some(split) = &ix.tiles else {
            return self.attention_rows(layer, ix, w, None, n);
        };
        let d = self.dims;
        let cfg = LaunchConfig {
            grid_dim: (split.tiles.1 as u32, d.heads as u32, 1),
            block_dim: ((self.prefill_tile * d.head_dim / 16) as u32, 1, 1),
            shared_mem_bytes: (2 * KEYS * (d.head_dim + d.head_dim / 16) * 4) as u32,
        };
        let k = &self.k.attention_tiles;
        // SAFETY: every position up to a row's own has a page in its table (`indexes` took
        // them) and was stored by rope_store in this or an earlier forward. One block per
        // (tile, head); a tile's rows are consecutive positions of one sequence, at most
        // `prefill_tile` of them (`tiles`), with d / 16 threads each; shared memory for KT
        // keys and values.
        unsafe { self.launch_attention(k, layer, ix, w, Some(&split.tiles.0), cfg) }?;
        match &split.singles {
            Some((only, count)) => self.attention_rows(layer, ix, w, Some(only), *count),
            None => Ok(()),
        }
    }

    /// The row-wise kernel over `n` rows: those listed in `only`, or the first `n`.
    fn attention_rows(
        &self,
        layer: &Layer,
        ix: &Indexes,
        w: &mut Workspace,
        only: Option<&CudaSlice<i32>>,
        n: usize,
    ) -> Result<(), ModelError> {
        let d = self.dims;
        let threads = self.row_threads_for(n);
        let cfg = LaunchConfig {
            grid_dim: ((n * d.heads) as u32, 1, 1),
            block_dim: (threads as u32, 1, 1),
            shared_mem_bytes: (attention_shared(&d, ix.longest, threads) * 4) as u32,
        };
        // SAFETY: as in `attention`; one block per (row, head) over the listed rows (indexes
        // below the forward's row count) or the first n; shared memory holds q, the
        // reduction, the longest span and its pages.
        unsafe { self.launch_attention(&self.k.attention, layer, ix, w, only, cfg) }
    }

    /// Launches either attention kernel: both take the output, the q/k/v rows, the layer's
    /// caches, the forward's positions and page tables, one index array (`index`, else
    /// null) and the head sizes.
    ///
    /// # Safety
    /// `cfg` must suit `kernel` over the forward's rows and `index` (see the callers).
    unsafe fn launch_attention(
        &self,
        kernel: &CudaFunction,
        layer: &Layer,
        ix: &Indexes,
        w: &mut Workspace,
        index: Option<&CudaSlice<i32>>,
        cfg: LaunchConfig,
    ) -> Result<(), ModelError> {
        let d = self.dims;
        let (heads, kvh, hd) = (d.heads as i32, d.kv_heads as i32, d.head_dim as i32);
        let scale = 1.0 / (d.head_dim as f32).sqrt();
        let null = 0u64;
        let mut l = self.stream.launch_builder(kernel);
        l.arg(&mut w.att)
            .arg(&w.qkv)
            .arg(&layer.k_cache)
            .arg(&layer.v_cache)
            .arg(&ix.pos)
            .arg(&ix.tstart)
            .arg(&ix.tables);
        match index {
            Some(i) => l.arg(i),
            None => l.arg(&null),
        };
        l.arg(&heads).arg(&kvh).arg(&hd).arg(&scale);
        // SAFETY: the caller's.
        unsafe { l.launch(cfg) }.map_err(err)?;
        Ok(())
    }
}

/// Whether a graph's attention (shared memory for the whole context) fits the 48 KB a
/// kernel gets without opting in.
pub(super) fn fits(d: &Dims, threads: usize) -> bool {
    attention_shared(d, d.context, threads) * 4 <= 48 * 1024
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiles_follow_runs_of_one_sequence() {
        // A decode step: one row per sequence, no tiles.
        assert_eq!(tiles(&[0, 1, 2], &[7, 3, 9], TILE), None);
        // Two decode rows, then a 70-row prompt chunk of sequence 2 from position 5, then
        // a 3-row chunk of sequence 3.
        let mut seqs = vec![0, 1];
        let mut pos = vec![40, 12];
        seqs.extend(std::iter::repeat_n(2, 70));
        pos.extend(5..75);
        seqs.extend([3, 3, 3]);
        pos.extend(0..3);
        let t = tiles(&seqs, &pos, TILE).unwrap();
        assert_eq!(t.tiles, vec![2, 64, 66, 6, 72, 3]);
        assert_eq!(t.singles, vec![0, 1]);
        let t = tiles(&seqs, &pos, 32).unwrap();
        assert_eq!(t.tiles, vec![2, 32, 34, 32, 66, 6, 72, 3]);
        // A break in positions starts a new run; a run of one row goes row-wise.
        let t = tiles(&[0, 0, 0], &[0, 1, 5], TILE).unwrap();
        assert_eq!((t.tiles, t.singles), (vec![0, 2], vec![2]));
    }
}
