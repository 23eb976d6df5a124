//! The next token of a sampled stream, drawn from one row of logits with a temperature and
//! a nucleus (top-p) cut-off, in a few vectorised passes over the row.
//!
//! candle's `LogitsProcessor` (what the engine used) copies the row through tensors and, for
//! top-p, sorts the whole vocabulary (49,152 entries for SmolLM2): milliseconds per token,
//! when a GPU decoder steps 64 streams in a few milliseconds. The distribution here is the
//! same as `LogitsProcessor`'s: p_i ∝ exp(l_i / T); with top-p, the shortest run of the most
//! likely tokens (ties by token id) whose mass reaches p, then drawn in proportion to their
//! probabilities. Only candidates above a threshold are sorted: when the tokens whose weight
//! is at least t already hold p of the mass, the nucleus lies among them, since every token
//! below t comes after them in the sorted order.
//!
//! A draw is one uniform u from the stream's seeded generator; the token is where u times the
//! nucleus' mass falls walking the nucleus in token-id order. The CUDA decoder's `sample_rows`
//! kernel follows the same rule with the same u, so a seed gives the same text on either
//! device (up to the devices' logits differing in the last bits). The draws differ from
//! `LogitsProcessor`'s for the same seed (another walk order).

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::backend::simd::{exp_fast, vectorized};

/// One draw of a sampled row, as the decoder (host or device) takes it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Draw {
    /// 1 / temperature (> 0).
    pub inv_temperature: f32,
    /// Nucleus cut-off in (0, 1); 1 = none.
    pub top_p: f32,
    /// The uniform variate in [0, 1).
    pub u: f32,
}

/// Weights summed per block of the row, so a draw finds its block first and walks only it.
const BLOCK: usize = 256;
/// Nucleus candidate thresholds, relative to the largest weight (1), tried in turn. Below
/// 1e-6, at most 49,152 x 1e-6 < 0.05 of mass hides (out of at least 1), so for top-p up to
/// 0.95 the second always holds the nucleus; 0 takes every token.
const THRESHOLDS: [f32; 3] = [1e-3, 1e-6, 0.0];

/// A stream's sampler: its seeded generator and reusable buffers.
pub struct Sampler {
    rng: StdRng,
    inv_temperature: f32,
    /// 1 = no nucleus cut-off.
    top_p: f32,
    /// exp((l_i - max) / T) of the last row.
    weights: Vec<f32>,
    /// Sums of `weights` per `BLOCK`.
    blocks: Vec<f64>,
    /// Nucleus candidates (token ids).
    candidates: Vec<u32>,
    /// The last nucleus, in token-id order.
    nucleus: Vec<u32>,
}

impl Sampler {
    /// `temperature` > 0 and `top_p` in (0, 1] (1 turns the cut-off off), as the request
    /// validation admits them.
    pub fn new(seed: u64, temperature: f64, top_p: f64) -> Self {
        Self {
            rng: StdRng::seed_from_u64(seed),
            inv_temperature: (1.0 / temperature) as f32,
            top_p: if top_p > 0.0 && top_p < 1.0 {
                top_p as f32
            } else {
                1.0
            },
            weights: Vec::new(),
            blocks: Vec::new(),
            candidates: Vec::new(),
            nucleus: Vec::new(),
        }
    }

    /// A sampler without a generator of its own, for a draw made elsewhere (`pick`).
    pub fn for_draw(d: Draw) -> Self {
        let mut s = Self::new(0, 1.0, f64::from(d.top_p));
        s.inv_temperature = d.inv_temperature;
        s
    }

    /// The next draw: the stream's next uniform variate with its temperature and cut-off,
    /// for a decoder that picks the token itself (`pick` or the device kernel).
    pub fn draw(&mut self) -> Draw {
        Draw {
            inv_temperature: self.inv_temperature,
            top_p: self.top_p,
            // f32 has 24 bits; the variate stays below 1 after rounding.
            u: (self.rng.random::<f64>() as f32).min(1.0 - f32::EPSILON / 2.0),
        }
    }

    /// Draws the next token. A row without a finite largest logit or with no finite mass
    /// (NaN, infinities) falls back to the greedy pick, as an argmax would.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        let u = self.draw().u;
        self.pick(logits, u)
    }

    /// The token at variate `u` in [0, 1) (see the module doc); greedy for rows without a
    /// finite largest logit or finite mass.
    pub fn pick(&mut self, logits: &[f32], u: f32) -> u32 {
        self.weights.resize(logits.len(), 0.0);
        self.blocks.clear();
        let max = vectorized(Weigh {
            logits,
            scale: self.inv_temperature,
            weights: &mut self.weights,
            blocks: &mut self.blocks,
        });
        if !max.is_finite() {
            return greedy(logits);
        }
        let total: f64 = self.blocks.iter().sum();
        if !(total.is_finite() && total > 0.0) {
            return greedy(logits);
        }
        if self.top_p < 1.0 {
            self.draw_nucleus(total, f64::from(u))
        } else {
            self.draw_all(total, f64::from(u))
        }
    }

    /// A token in proportion to its weight over the whole row, walking token ids in order.
    fn draw_all(&mut self, total: f64, u: f64) -> u32 {
        let mut u = u * total;
        for (b, &sum) in self.blocks.iter().enumerate() {
            if u >= sum {
                u -= sum;
                continue;
            }
            let start = b * BLOCK;
            let block = &self.weights[start..(start + BLOCK).min(self.weights.len())];
            let mut acc = 0f64;
            for (i, &w) in block.iter().enumerate() {
                acc += f64::from(w);
                if u < acc {
                    return (start + i) as u32;
                }
            }
            // The block's sum (f32 lanes) and this walk (f64) can differ in the last bits:
            // the draw stays in its block, on its last token with any weight.
            return (start + block.iter().rposition(|&w| w > 0.0).unwrap_or(0)) as u32;
        }
        // Rounding left the draw past the last weight: the last token with any.
        self.weights.iter().rposition(|&w| w > 0.0).unwrap_or(0) as u32
    }

    /// A token of the nucleus in proportion to its weight, walking it in token-id order.
    fn draw_nucleus(&mut self, total: f64, u: f64) -> u32 {
        let target = f64::from(self.top_p) * total;
        let w = &self.weights;
        for t in THRESHOLDS {
            self.candidates.clear();
            let mut mass = 0f64;
            for (i, &x) in w.iter().enumerate() {
                if x >= t {
                    self.candidates.push(i as u32);
                    mass += f64::from(x);
                }
            }
            if mass >= target {
                break;
            }
        }
        // Most likely first, ties by token id: the order of a stable sort of all tokens.
        self.candidates.sort_unstable_by(|&a, &b| {
            w[b as usize]
                .total_cmp(&w[a as usize])
                .then_with(|| a.cmp(&b))
        });
        // Tokens join while the mass before them is short of p (the one that reaches p is in).
        let mut mass = 0f64;
        let mut n = 0;
        for &c in &self.candidates {
            if mass >= target {
                break;
            }
            mass += f64::from(w[c as usize]);
            n += 1;
        }
        self.nucleus.clear();
        self.nucleus.extend_from_slice(&self.candidates[..n.max(1)]);
        self.nucleus.sort_unstable();
        let u = u * mass;
        let mut acc = 0f64;
        for &c in &self.nucleus {
            acc += f64::from(w[c as usize]);
            if u < acc {
                return c;
            }
        }
        self.nucleus[self.nucleus.len() - 1]
    }
}

/// The tokens draw `d` may rightly give on logits that equal `logits` only to the last bits
/// (another device's, or another forward's): the host's pick at the draw, and with the
/// variate or the cut-off moved 1e-4 either way, since a draw that sits on a boundary may
/// land on either side of it. The load-time and test checks of the device's draws accept
/// any of them.
pub fn picks_near(logits: &[f32], d: Draw) -> [u32; 5] {
    const STEP: f32 = 1e-4;
    let pick = |u: f32, top_p: f32| Sampler::for_draw(Draw { top_p, ..d }).pick(logits, u);
    let below_one = 1.0 - f32::EPSILON / 2.0;
    [
        pick(d.u, d.top_p),
        pick((d.u - STEP).max(0.0), d.top_p),
        pick((d.u + STEP).min(below_one), d.top_p),
        pick(d.u, (d.top_p - STEP).max(STEP)),
        pick(d.u, (d.top_p + STEP).min(1.0)),
    ]
}

/// Fills a row's weights exp((l_i - max) * scale) and their sums per block, and returns the
/// largest logit (weights untouched when it is not finite). A named op for `vectorized`: as
/// a closure it was compiled apart for baseline x86-64 (scalar, `floorf` through libm: 330 µs
/// a row instead of ~30).
struct Weigh<'a> {
    logits: &'a [f32],
    scale: f32,
    weights: &'a mut [f32],
    blocks: &'a mut Vec<f64>,
}

impl pulp::WithSimd for Weigh<'_> {
    type Output = f32;

    #[inline(always)]
    fn with_simd<S: pulp::Simd>(self, _: S) -> f32 {
        let max = max_of(self.logits);
        if max.is_finite() {
            for (w, l) in self
                .weights
                .chunks_mut(BLOCK)
                .zip(self.logits.chunks(BLOCK))
            {
                self.blocks.push(f64::from(weigh(w, l, max, self.scale)));
            }
        }
        max
    }
}

/// log Σ exp(l_i) of a row, for `vectorized`.
struct LogSumExp<'a>(&'a [f32]);

impl pulp::WithSimd for LogSumExp<'_> {
    type Output = f32;

    #[inline(always)]
    fn with_simd<S: pulp::Simd>(self, _: S) -> f32 {
        let max = max_of(self.0);
        let mut lanes = [0f32; 8];
        let mut chunks = self.0.chunks_exact(8);
        for c in &mut chunks {
            for (acc, &x) in lanes.iter_mut().zip(c) {
                *acc += exp_fast(x - max);
            }
        }
        let mut sum: f32 = lanes.iter().sum();
        for &x in chunks.remainder() {
            sum += exp_fast(x - max);
        }
        max + sum.ln()
    }
}

/// The largest logit (NaN ignored), in eight lanes so the loop vectorises.
#[inline(always)]
fn max_of(l: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; 8];
    let mut chunks = l.chunks_exact(8);
    for c in &mut chunks {
        for (m, &x) in lanes.iter_mut().zip(c) {
            *m = m.max(x);
        }
    }
    let mut m = chunks
        .remainder()
        .iter()
        .fold(f32::NEG_INFINITY, |a, &b| a.max(b));
    for x in lanes {
        m = m.max(x);
    }
    m
}

/// Writes exp((l_i - max) * scale) into `w` and returns their sum: a plain map (which the
/// loop vectoriser takes whole), then the sum in eight lanes over the block, still in L1.
/// (One fused loop came out as 2- and 4-wide pieces.)
#[inline(always)]
fn weigh(w: &mut [f32], l: &[f32], max: f32, scale: f32) -> f32 {
    for (x, &y) in w.iter_mut().zip(l) {
        *x = weight(y, max, scale);
    }
    let mut lanes = [0f32; 8];
    let mut chunks = w.chunks_exact(8);
    for c in &mut chunks {
        for (acc, &x) in lanes.iter_mut().zip(c) {
            *acc += x;
        }
    }
    lanes.iter().sum::<f32>() + chunks.remainder().iter().sum::<f32>()
}

/// exp((l - max) * scale), 0 where it underflows f32 (so masked -inf logits weigh nothing;
/// `exp_fast` alone stops at e^-87).
#[inline(always)]
fn weight(l: f32, max: f32, scale: f32) -> f32 {
    let x = (l - max) * scale;
    let e = exp_fast(x);
    if x < -87.0 { 0.0 } else { e }
}

/// log softmax(logits)[token] at temperature 1 (the log-probability a response reports), in
/// two vectorised passes.
pub fn logprob(logits: &[f32], token: u32) -> f32 {
    logits[token as usize] - vectorized(LogSumExp(logits))
}

/// The greedy token: the first of the largest logits, exactly as candle's argmax (and so
/// `LogitsProcessor` without a temperature) picks it.
pub fn greedy(logits: &[f32]) -> u32 {
    let mut best = 0;
    let mut val = logits.first().copied().unwrap_or(f32::NEG_INFINITY);
    for (i, &v) in logits.iter().enumerate() {
        if val < v {
            best = i;
            val = v;
        }
    }
    best as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Logits shaped like a language model's: a few strong tokens over a long flat tail.
    fn row(n: usize, seed: u64) -> Vec<f32> {
        let mut r = StdRng::seed_from_u64(seed);
        (0..n)
            .map(|i| {
                let base = r.random::<f32>() * 8.0 - 4.0;
                if i % 997 == 3 { base + 12.0 } else { base }
            })
            .collect()
    }

    /// The nucleus as `LogitsProcessor` finds it: a stable sort of every token by
    /// probability, then the prefix whose running sum first reaches p.
    fn nucleus_by_full_sort(logits: &[f32], t: f32, p: f32) -> Vec<u32> {
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let w: Vec<f64> = logits
            .iter()
            .map(|&l| f64::from((l - max) / t).exp())
            .collect();
        let total: f64 = w.iter().sum();
        let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
        idx.sort_by(|&a, &b| w[b as usize].total_cmp(&w[a as usize]));
        let mut mass = 0.0;
        let mut out = Vec::new();
        for i in idx {
            if mass >= f64::from(p) * total {
                break;
            }
            mass += w[i as usize];
            out.push(i);
        }
        out
    }

    /// Draw frequencies against the exact probabilities (total variation distance).
    fn tv_distance(logits: &[f32], t: f32, p: f32, draws: usize) -> f64 {
        let allowed = if p < 1.0 {
            nucleus_by_full_sort(logits, t, p)
        } else {
            (0..logits.len() as u32).collect()
        };
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut want = vec![0f64; logits.len()];
        for &i in &allowed {
            want[i as usize] = f64::from((logits[i as usize] - max) / t).exp();
        }
        let z: f64 = want.iter().sum();
        let mut got = vec![0f64; logits.len()];
        let mut s = Sampler::new(7, f64::from(t), f64::from(p));
        for _ in 0..draws {
            got[s.sample(logits) as usize] += 1.0;
        }
        want.iter()
            .zip(&got)
            .map(|(w, g)| (w / z - g / draws as f64).abs())
            .sum::<f64>()
            / 2.0
    }

    #[test]
    fn draws_follow_the_tempered_distribution() {
        // 40 tokens, so 200k draws pin every frequency down to well under 1%.
        let logits: Vec<f32> = (0..40).map(|i| ((i * 37) % 11) as f32 * 0.4).collect();
        for (t, p) in [(1.0, 1.0), (0.5, 1.0), (1.7, 1.0), (0.7, 0.9), (1.0, 0.5)] {
            let tv = tv_distance(&logits, t, p, 200_000);
            assert!(tv < 0.01, "T {t} top_p {p}: total variation {tv}");
        }
    }

    #[test]
    fn the_nucleus_is_the_full_sorts_prefix() {
        for seed in 0..6 {
            let logits = row(49_152, seed);
            for (t, p) in [
                (0.7, 0.9),
                (1.0, 0.5),
                (2.0, 0.95),
                (0.3, 0.99),
                (1.0, 0.01),
            ] {
                let want = nucleus_by_full_sort(&logits, t, p);
                let mut s = Sampler::new(seed, f64::from(t), f64::from(p));
                for _ in 0..50 {
                    let tok = s.sample(&logits);
                    assert!(
                        want.contains(&tok),
                        "seed {seed} T {t} p {p}: {tok} outside"
                    );
                }
                // The draw's nucleus is that prefix.
                let mut want = want;
                want.sort_unstable();
                assert_eq!(s.nucleus, want, "seed {seed} T {t} p {p}");
            }
        }
    }

    #[test]
    fn a_variate_falls_where_its_share_of_the_mass_does_in_token_order() {
        // Four equal weights: u's quarter names the token.
        let flat = [0.0f32; 4];
        let mut s = Sampler::new(0, 1.0, 1.0);
        for (u, tok) in [(0.0, 0), (0.24, 0), (0.26, 1), (0.6, 2), (0.99, 3)] {
            assert_eq!(s.pick(&flat, u), tok, "u {u}");
        }
        // Top-p 0.5 over weights 4:3:2:1 (ids 3, 0, 2, 1): the nucleus is the two heaviest,
        // {3, 0}, walked in id order: 0 (mass 3 of 7) then 3.
        let logits = [3f32.ln(), 1f32.ln(), 2f32.ln(), 4f32.ln()];
        let mut s = Sampler::new(0, 1.0, 0.5);
        assert_eq!(s.pick(&logits, 0.4), 0);
        assert_eq!(s.pick(&logits, 0.45), 3);
        assert_eq!(s.pick(&logits, 0.99), 3);
        // A stream's sample is its next draw's pick, and `for_draw` picks alike.
        let row = row(49_152, 5);
        let (mut a, mut b) = (Sampler::new(11, 0.8, 0.9), Sampler::new(11, 0.8, 0.9));
        for _ in 0..20 {
            let d = b.draw();
            let want = Sampler::for_draw(d).pick(&row, d.u);
            assert_eq!(a.sample(&row), want);
            assert!((0.0..1.0).contains(&d.u));
        }
    }

    #[test]
    fn a_draw_on_a_boundary_may_land_on_either_side() {
        let flat = [0.0f32; 4];
        let d = |u| Draw {
            inv_temperature: 1.0,
            top_p: 1.0,
            u,
        };
        // u = 0.25 is where token 0's quarter ends: 0 and 1 are both right.
        let near = picks_near(&flat, d(0.25));
        assert!(near.contains(&0) && near.contains(&1), "{near:?}");
        // Mid-quarter, every neighbour agrees.
        assert_eq!(picks_near(&flat, d(0.6)), [2; 5]);
        // The top variate stays below 1 when moved up.
        assert!(picks_near(&flat, d(0.99999)).iter().all(|&t| t == 3));
    }

    #[test]
    fn a_seed_repeats_its_draws_and_another_seed_does_not() {
        let logits = row(49_152, 1);
        let run = |seed| {
            let mut s = Sampler::new(seed, 1.0, 1.0);
            (0..64).map(|_| s.sample(&logits)).collect::<Vec<_>>()
        };
        assert_eq!(run(3), run(3));
        assert_ne!(run(3), run(4));
    }

    #[test]
    fn rows_without_finite_mass_fall_back_to_greedy() {
        let mut s = Sampler::new(0, 1.0, 0.9);
        assert_eq!(s.sample(&[0.0, 1.0, f32::INFINITY, f32::NAN]), 2);
        assert_eq!(s.sample(&[0.0, 1.0, f32::NAN, 0.5]), 1);
        assert_eq!(s.sample(&[f32::NEG_INFINITY; 4]), 0);
        // -inf logits (masked tokens) are never drawn.
        let masked = [f32::NEG_INFINITY, 0.0, f32::NEG_INFINITY, 0.0];
        for _ in 0..100 {
            assert!(matches!(s.sample(&masked), 1 | 3));
        }
        // A very low temperature is an argmax.
        let mut cold = Sampler::new(0, 1e-6, 1.0);
        assert_eq!(cold.sample(&[0.1, 0.3, 0.2]), 1);
    }

    #[test]
    fn logprob_matches_the_exact_log_softmax() {
        let logits = row(49_152, 9);
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let lse = f64::from(max)
            + logits
                .iter()
                .map(|&l| f64::from(l - max).exp())
                .sum::<f64>()
                .ln();
        for tok in [0u32, 3, 1000, 49_151] {
            let want = f64::from(logits[tok as usize]) - lse;
            let got = f64::from(logprob(&logits, tok));
            assert!((got - want).abs() < 1e-4, "token {tok}: {got} vs {want}");
        }
    }
}
