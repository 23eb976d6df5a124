//! One-bit codes of the flat copy's points, for filtered searches that score thousands of
//! candidates (`planner::shortlist`). Scoring 10k filter matches by int8 code reads 388 bytes
//! of each (3.9 MB, out of cache at 100k points); their sign bits are 48 bytes each and all of
//! them fit in cache (4.8 MB at 100k), so the one-bit estimate picks a shortlist that the int8
//! codes, then the f32 vectors, rescore.
//!
//! A point's code is its vector's offset from the collection's centre (the mean vector:
//! sentence embeddings share a large common component, which would otherwise set most signs
//! alike), one sign bit per component, and the offset's mean absolute component `a`: the least
//! squares fit of the offset by `a * sign`. A query's estimate against it is
//! `a * sum(q_i * sign_i)`, the dot product with the offset (the query's product with the
//! centre is the same for every point, so it is left out of the ranking). The query side is
//! quantised to 4 bits per component, split into 4 bit planes, so the sum is 5 popcounts per
//! 64 components, as RaBitQ and Weaviate's BQ compute it.

use rayon::prelude::*;

use super::{prefetch_lines, sq8};

/// The bit planes of a query's 4-bit components.
const PLANES: usize = 4;
/// How many candidates ahead a scan starts loading (`planner::AHEAD` for the int8 scan).
const AHEAD: usize = super::planner::AHEAD;

/// Sign bits and scales of every slot of a flat copy.
pub(super) struct Signs {
    /// u64 words per slot.
    words: usize,
    /// Components per vector.
    dim: usize,
    /// Slot i's signs of (vector - centre), bit j of component 64w + j in word w;
    /// `bits[i * words..(i + 1) * words]`.
    bits: Vec<u64>,
    /// Slot i's mean |vector - centre| component (0 for a slot without a code).
    scale: Vec<f32>,
}

/// A query as the estimate reads it: component i is `lo + step * u_i`, u_i in 0..16, bit p of
/// every u_i in `planes[p * words..]`.
pub(super) struct Query {
    planes: Vec<u64>,
    lo: f32,
    step: f32,
    /// The sum of the quantised components.
    sum: f32,
}

impl Signs {
    /// The codes of slots whose int8 code (`sq8`) is `codes[i * stride..]`, where `present`.
    pub(super) fn build(codes: &[i8], stride: usize, present: &[bool]) -> Self {
        let dim = stride.saturating_sub(sq8::HEADER);
        let words = dim.div_ceil(64);
        let code = |i: usize| &codes[i * stride..(i + 1) * stride];
        let n = present.iter().filter(|p| **p).count().max(1) as f32;
        let centre: Vec<f32> = present
            .par_iter()
            .enumerate()
            .filter(|(_, p)| **p)
            .fold(
                || vec![0f32; dim],
                |mut acc, (i, _)| {
                    for (a, x) in acc.iter_mut().zip(sq8::decode(code(i))) {
                        *a += x;
                    }
                    acc
                },
            )
            .reduce(
                || vec![0f32; dim],
                |mut a, b| {
                    a.iter_mut().zip(b).for_each(|(x, y)| *x += y);
                    a
                },
            )
            .into_iter()
            .map(|s| s / n)
            .collect();
        let mut bits = vec![0u64; present.len() * words];
        let mut scale = vec![0f32; present.len()];
        if words > 0 {
            bits.par_chunks_mut(words)
                .zip(scale.par_iter_mut())
                .enumerate()
                .filter(|(i, _)| present[*i])
                .for_each(|(i, (w, a))| {
                    let mut abs = 0f32;
                    for (j, (x, c)) in sq8::decode(code(i)).into_iter().zip(&centre).enumerate() {
                        let d = x - c;
                        abs += d.abs();
                        if d > 0.0 {
                            w[j / 64] |= 1 << (j % 64);
                        }
                    }
                    *a = abs / dim.max(1) as f32;
                });
        }
        Self {
            words,
            dim,
            bits,
            scale,
        }
    }

    /// The query's planes (`q` has the codes' dimension; extra components are ignored).
    pub(super) fn query(&self, q: &[f32]) -> Query {
        let q = &q[..q.len().min(self.dim)];
        let (lo, hi) = q
            .iter()
            .fold((f32::MAX, f32::MIN), |(l, h), &x| (l.min(x), h.max(x)));
        // An empty or constant query (nothing above lo) has one level: every u_i is 0.
        let (lo, step) = match hi.partial_cmp(&lo) {
            Some(std::cmp::Ordering::Greater) => (lo, (hi - lo) / 15.0),
            _ => (lo.min(0.0), 0.0),
        };
        let mut planes = vec![0u64; PLANES * self.words];
        let mut total = 0u32;
        for (j, &x) in q.iter().enumerate() {
            let u = if step > 0.0 {
                // x >= lo: adding a half then truncating rounds (and is cheaper than round).
                (((x - lo) / step + 0.5) as u32).min(15)
            } else {
                0
            };
            total += u;
            for (p, plane) in planes.chunks_mut(self.words.max(1)).enumerate() {
                if u >> p & 1 == 1 {
                    plane[j / 64] |= 1 << (j % 64);
                }
            }
        }
        Query {
            planes,
            lo,
            step,
            sum: lo * q.len() as f32 + step * total as f32,
        }
    }

    /// The estimated dot product of the query with slot `slot`'s offset from the centre
    /// (`f32::MIN` past the table).
    #[cfg(test)]
    fn estimate(&self, q: &Query, slot: usize) -> f32 {
        let mut out = Vec::new();
        self.estimates(q, &[slot as u32], &mut out);
        out.first().map_or(f32::MIN, |e| e.0)
    }

    /// (estimate, slot) for every slot of `ids` in the table, appended to `out`. Five
    /// popcounts per 64 components: with the POPCNT instruction where the CPU has it (checked
    /// at run time, as `sq8`'s kernels are; baseline x86-64 counts bits in ~15 instructions).
    pub(super) fn estimates(&self, q: &Query, ids: &[u32], out: &mut Vec<(f32, u32)>) {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("popcnt") {
            // SAFETY: the CPU has POPCNT, checked just above.
            #[allow(unsafe_code)]
            return unsafe { self.estimates_popcnt(q, ids, out) };
        }
        self.estimates_any(q, ids, out);
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "popcnt")]
    fn estimates_popcnt(&self, q: &Query, ids: &[u32], out: &mut Vec<(f32, u32)>) {
        self.estimates_any(q, ids, out);
    }

    #[inline(always)]
    fn estimates_any(&self, q: &Query, ids: &[u32], out: &mut Vec<(f32, u32)>) {
        let words = self.words;
        let planes: [&[u64]; PLANES] =
            std::array::from_fn(|p| &q.planes[p * words..(p + 1) * words]);
        for (i, &id) in ids.iter().enumerate() {
            // The candidates are scattered over the table: start loading a later one's bits
            // while this one is counted.
            if let Some(&ahead) = ids.get(i + AHEAD) {
                let a = ahead as usize;
                if let Some(b) = self.bits.get(a * words..(a + 1) * words) {
                    prefetch_lines(b, 1);
                }
            }
            let slot = id as usize;
            let Some(b) = self.bits.get(slot * words..(slot + 1) * words) else {
                continue;
            };
            let (mut ones, mut weighted) = (0u32, 0u32);
            for (w, &x) in b.iter().enumerate() {
                ones += x.count_ones();
                for (p, plane) in planes.iter().enumerate() {
                    weighted += (plane[w] & x).count_ones() << p;
                }
            }
            // sum over set bits of q_i, twice, less the sum over all: sum(q_i * sign_i).
            let on = q.lo * ones as f32 + q.step * weighted as f32;
            out.push((self.scale[slot] * (2.0 * on - q.sum), id));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::index::hnsw::distance::{dot, normalize};

    fn unit(seed: u64, dim: usize) -> Vec<f32> {
        // A shared component plus noise, as sentence embeddings look.
        let mut s = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let mut v: Vec<f32> = (0..dim)
            .map(|i| {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1);
                let noise = ((s >> 33) as f32 / (1u64 << 31) as f32) - 0.5;
                noise + if i % 3 == 0 { 0.4 } else { -0.1 }
            })
            .collect();
        normalize(&mut v);
        v
    }

    #[test]
    fn the_estimate_ranks_like_the_dot_product() {
        let dim = 100; // not a multiple of 64: the last word is partly padding
        let points: Vec<Vec<f32>> = (0..2000).map(|i| unit(i, dim)).collect();
        let stride = sq8::code_len(dim);
        let codes: Vec<i8> = points.iter().flat_map(|p| sq8::encode(p)).collect();
        let signs = Signs::build(&codes, stride, &vec![true; points.len()]);
        let mut agree = 0;
        for qi in 0..50 {
            let q = unit(10_000 + qi, dim);
            let bq = signs.query(&q);
            let best = |f: &dyn Fn(usize) -> f32| {
                let mut s: Vec<(f32, usize)> = (0..points.len()).map(|i| (f(i), i)).collect();
                s.sort_by(|a, b| b.0.total_cmp(&a.0));
                s.into_iter().map(|x| x.1).collect::<Vec<_>>()
            };
            let exact = best(&|i| dot(&q, &points[i]));
            let est = best(&|i| signs.estimate(&bq, i));
            // The true nearest point is within the estimate's best 5%.
            agree += usize::from(est[..100].contains(&exact[0]));
        }
        assert!(agree >= 48, "{agree} of 50");
    }

    #[test]
    fn a_slot_without_a_code_estimates_zero_and_one_past_the_table_last() {
        let dim = 64;
        let codes: Vec<i8> = [unit(1, dim), unit(2, dim)]
            .iter()
            .flat_map(|p| sq8::encode(p))
            .collect();
        let signs = Signs::build(&codes, sq8::code_len(dim), &[true, false]);
        let q = signs.query(&unit(3, dim));
        assert_eq!(signs.estimate(&q, 1), 0.0);
        assert_eq!(signs.estimate(&q, 7), f32::MIN);
    }
}
