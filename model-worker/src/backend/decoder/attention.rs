//! Causal attention of a forward's rows over their sequences' KV caches, on the CPU.
//!
//! A decode step has one row per sequence: each (row, KV head) is a task that reads the
//! cached keys and values once for the query heads sharing them (`AttendGroup`). A prompt
//! has many rows of one sequence at consecutive positions: there each block of
//! `PROMPT_BLOCK` rows and KV head is a task of two matrix products (queries x keys, then
//! softmax weights x values, by the gemm crate's kernels), which reuse every loaded key and
//! value across the block's rows instead of streaming the cache once per row. With one task
//! per row, attention took about a sixth of a 512-token prompt on 2 cores, and its share
//! grows with the prompt.

use rayon::prelude::*;

use super::{Dims, Row};
use crate::backend::gemm::{Rhs, product};
use crate::backend::simd::{exp_fast, lane_dot, vectorized};

/// Rows of one sequence attended together by matrix products.
const PROMPT_BLOCK: usize = 32;
/// Shortest run of a sequence's rows that goes through the products; shorter runs (decode
/// steps, a draft of a few tokens) attend row by row.
const PROMPT_FROM_ROWS: usize = 4;

/// One layer's cache of one sequence: position-major rows of `kv_heads * head_dim`.
#[derive(Clone, Copy)]
pub(super) struct Cached<'a> {
    pub keys: &'a [f32],
    pub values: &'a [f32],
}

/// Attention output (`rows x hidden`) of the queries `q` (`rows x hidden`, after RoPE) of
/// `rows` at `positions`, each over the first `position + 1` entries of its sequence's
/// cache (`cache[row.seq]`, which already holds this forward's keys and values).
pub(super) fn attention(
    d: Dims,
    rows: &[Row],
    positions: &[usize],
    cache: &[Cached<'_>],
    q: &[f32],
) -> Vec<f32> {
    let group = d.heads / d.kv_heads;
    let width = group * d.head_dim;
    let scale = 1.0 / (d.head_dim as f32).sqrt();
    // Blocks of consecutive rows of one sequence: (first row, rows).
    let mut blocks = Vec::new();
    let mut i = 0;
    while i < rows.len() {
        let mut end = i + 1;
        while end < rows.len() && end - i < PROMPT_BLOCK && rows[end].seq == rows[i].seq {
            end += 1;
        }
        if end - i >= PROMPT_FROM_ROWS {
            blocks.push((i, end - i));
        } else {
            blocks.extend((i..end).map(|r| (r, 1)));
        }
        i = end;
    }
    let tasks: Vec<(usize, usize, usize)> = blocks
        .iter()
        .flat_map(|&(first, n)| (0..d.kv_heads).map(move |kv| (first, n, kv)))
        .collect();
    let parts: Vec<Vec<f32>> = tasks
        .par_iter()
        .map(|&(first, n, kv)| {
            let c = cache[rows[first].seq];
            let head = Head {
                head_dim: d.head_dim,
                stride: d.kv_width(),
                offset: kv * d.head_dim,
                scale,
            };
            let queries = |r: usize| &q[r * d.hidden + kv * width..][..width];
            if n == 1 {
                let mut out = vec![0f32; width];
                vectorized(AttendGroup {
                    out: &mut out,
                    q: queries(first),
                    cache: c,
                    head,
                    span: positions[first] + 1,
                });
                out
            } else {
                let q: Vec<f32> = (first..first + n).flat_map(queries).copied().collect();
                block(&q, n, group, c, head, &positions[first..first + n])
            }
        })
        .collect();
    let mut out = vec![0f32; rows.len() * d.hidden];
    for (&(first, _, kv), part) in tasks.iter().zip(&parts) {
        for (r, src) in part.chunks_exact(width).enumerate() {
            out[(first + r) * d.hidden + kv * width..][..width].copy_from_slice(src);
        }
    }
    out
}

/// Where one KV head lives in a cache row, and the score scale.
#[derive(Clone, Copy)]
struct Head {
    head_dim: usize,
    /// Floats per cached position (every KV head).
    stride: usize,
    /// This KV head within a position.
    offset: usize,
    scale: f32,
}

impl Head {
    /// The head's `span` cached keys or values gathered into `span x head_dim`.
    fn gather(&self, cache: &[f32], span: usize) -> Vec<f32> {
        (0..span)
            .flat_map(|p| &cache[p * self.stride + self.offset..][..self.head_dim])
            .copied()
            .collect()
    }
}

/// `n` consecutive rows (at `positions`) of one sequence against one KV head: `q` holds
/// each row's `group` query heads (`n * group x head_dim`); returns their context rows in
/// the same layout. Scores past a row's own position are masked before the softmax.
fn block(
    q: &[f32],
    n: usize,
    group: usize,
    cache: Cached<'_>,
    head: Head,
    positions: &[usize],
) -> Vec<f32> {
    let d = head.head_dim;
    let span = positions[n - 1] + 1;
    let keys = head.gather(cache.keys, span);
    let values = head.gather(cache.values, span);
    let m = n * group;
    let mut scores = vec![0f32; m * span];
    product(q, &keys, Rhs::NByK, &mut scores, span, m, d, span);
    for (j, row) in scores.chunks_exact_mut(span).enumerate() {
        softmax_prefix(row, positions[j / group] + 1, head.scale);
    }
    let mut out = vec![0f32; m * d];
    product(&scores, &values, Rhs::KByN, &mut out, d, m, span, d);
    out
}

/// `row[..len]` scaled and softmaxed in place, `row[len..]` zeroed (masked positions).
fn softmax_prefix(row: &mut [f32], len: usize, scale: f32) {
    let (live, masked) = row.split_at_mut(len);
    masked.fill(0.0);
    let max = live.iter().copied().fold(f32::NEG_INFINITY, f32::max) * scale;
    let mut sum = 0.0;
    for s in live.iter_mut() {
        *s = exp_fast(*s * scale - max);
        sum += *s;
    }
    let inv = 1.0 / sum;
    live.iter_mut().for_each(|s| *s *= inv);
}

/// One (row, KV head) of a decode step for `simd::vectorized`: the query heads that share
/// the KV head (Qwen2.5 0.5B: 7 of 14) against the sequence's first `span` cached keys,
/// softmax, and the weighted sums of the values into `out`, on the CPU's vector unit. Each
/// cached key and value is read once for the whole group rather than once per query head
/// (a 600-token prompt's first token came 0.5-1 s sooner; decode steps within noise). As
/// plain x86-64 the key dots ran as scalar chains: 7% of a decode step at a 180-token span,
/// and attention grows with the span while the weight pass does not.
struct AttendGroup<'a> {
    /// `group x head_dim` context rows.
    out: &'a mut [f32],
    /// `group x head_dim` queries.
    q: &'a [f32],
    cache: Cached<'a>,
    head: Head,
    span: usize,
}

impl pulp::WithSimd for AttendGroup<'_> {
    type Output = ();

    #[inline(always)]
    fn with_simd<S: pulp::Simd>(self, _: S) {
        let (h, span) = (self.head, self.span);
        let d = h.head_dim;
        let at = |p: usize| p * h.stride + h.offset;
        // scores[g * span + p]: query head g against position p.
        let mut scores = vec![0f32; self.q.len() / d * span];
        for p in 0..span {
            let key = &self.cache.keys[at(p)..][..d];
            for (g, q) in self.q.chunks_exact(d).enumerate() {
                scores[g * span + p] = lane_dot(q, key) * h.scale;
            }
        }
        let mut sums = Vec::with_capacity(self.q.len() / d);
        for row in scores.chunks_exact_mut(span) {
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut sum = 0.0;
            for s in row.iter_mut() {
                *s = exp_fast(*s - max);
                sum += *s;
            }
            sums.push(sum);
        }
        for p in 0..span {
            let value = &self.cache.values[at(p)..][..d];
            for (g, out) in self.out.chunks_exact_mut(d).enumerate() {
                let w = scores[g * span + p] / sums[g];
                for (o, v) in out.iter_mut().zip(value) {
                    *o += w * v;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::simd::worst_difference;

    /// A prompt of 70 rows (blocks of 32, 32 and 6) continuing a cache of 5 positions, beside
    /// a decode row of a second sequence, against the row-by-row path.
    #[test]
    fn prompt_blocks_match_row_by_row_attention() {
        let d = Dims {
            hidden: 8 * 16,
            heads: 8,
            kv_heads: 2,
            head_dim: 16,
            vocab: 10,
            eps: 1e-6,
            context: 128,
        };
        let wave = |n: usize, f: f32| -> Vec<f32> {
            (0..n).map(|i| ((i as f32) * f).sin() * 1.5).collect()
        };
        let (past, prompt) = (5, 70);
        let caches = [
            (
                wave((past + prompt) * d.kv_width(), 0.37),
                wave((past + prompt) * d.kv_width(), 0.11),
            ),
            (wave(9 * d.kv_width(), 0.23), wave(9 * d.kv_width(), 0.71)),
        ];
        let cache: Vec<Cached<'_>> = caches
            .iter()
            .map(|(k, v)| Cached { keys: k, values: v })
            .collect();
        let mut rows: Vec<Row> = (0..prompt).map(|_| Row { seq: 0, token: 0 }).collect();
        rows.push(Row { seq: 1, token: 0 });
        let mut positions: Vec<usize> = (past..past + prompt).collect();
        positions.push(8);
        let q = wave(rows.len() * d.hidden, 0.53);
        let got = attention(d, &rows, &positions, &cache, &q);
        // Row by row: every row alone is a run of one.
        let mut want = Vec::new();
        for (i, row) in rows.iter().enumerate() {
            let one = attention(
                d,
                &[*row],
                &positions[i..=i],
                &cache,
                &q[i * d.hidden..][..d.hidden],
            );
            want.extend(one);
        }
        let worst = worst_difference(&got, &want);
        assert!(worst < 1e-4, "worst difference {worst}");
    }
}
