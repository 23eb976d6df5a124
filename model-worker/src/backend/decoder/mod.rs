//! Llama-architecture decoders (GGUF: SmolLM2, Qwen2.5) and continuous batching over them.
//!
//! `llama` is the generator a worker loads (tokenizer, chat template, streams and scoring
//! calls); `engine` decodes every active stream in one forward per step; `placed` is the
//! decoder that forward runs on, `batch` on the CPU (weights read by `gguf`, decode-shaped
//! products by `skinny`) or `cuda` on a GPU (f16 weights, a paged KV cache); `sampling` draws
//! tokens, and `prefix` keeps finished streams' keys and values for prompts that begin the
//! same way. What they all speak, rows in and answers out, is defined here.

mod attention;
pub mod batch;
pub mod cuda;
pub mod engine;
mod gguf;
pub mod llama;
pub mod placed;
mod prefix;
pub mod quant;
mod rows;
pub mod sampling;
mod skinny;
mod weights;

pub use batch::{KvCache, LlamaModel};
pub use gguf::load;
pub use placed::{Cache, Decoder};
pub use sampling::{greedy, logprob};

use sampling::{Draw, Sampler};

use crate::error::ModelError;

/// The model's shapes, from the GGUF metadata.
#[derive(Debug, Clone, Copy)]
pub struct Dims {
    pub hidden: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub vocab: usize,
    pub eps: f32,
    /// Longest sequence (rotary table length).
    pub context: usize,
}

impl Dims {
    pub(crate) fn kv_width(&self) -> usize {
        self.kv_heads * self.head_dim
    }
}

/// One token of one sequence in a forward.
#[derive(Debug, Clone, Copy)]
pub struct Row {
    /// Index into the caches passed to [`LlamaModel::forward`].
    pub seq: usize,
    pub token: u32,
}

/// What a caller needs from one wanted row of a forward: a decoder on a GPU answers the last
/// two on the device, so only two numbers per row cross to the host.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Want {
    /// The row's logits (sampling with a temperature, or a score over several tokens).
    Logits,
    /// The greedy token (the first largest logit) and its log-probability.
    Greedy,
    /// The log-probability of this token.
    LogprobOf(u32),
    /// A token drawn with this draw (`sampling`'s rule) and its log-probability.
    Sample(Draw),
}

/// A wanted row's result: its logits, or a token with its log-probability (temperature 1).
#[derive(Debug, Clone, PartialEq)]
pub enum Sampled {
    Logits(Vec<f32>),
    Token { token: u32, logprob: f32 },
}

impl Sampled {
    /// The host's answer to `want` from a row's logits (what the GPU kernel computes).
    pub fn from_logits(logits: Vec<f32>, want: Want) -> Self {
        match want {
            Want::Logits => Sampled::Logits(logits),
            Want::Greedy => {
                let token = greedy(&logits);
                Sampled::Token {
                    token,
                    logprob: logprob(&logits, token),
                }
            }
            Want::LogprobOf(token) => Sampled::Token {
                token,
                logprob: logprob(&logits, token),
            },
            Want::Sample(d) => {
                let token = Sampler::for_draw(d).pick(&logits, d.u);
                Sampled::Token {
                    token,
                    logprob: logprob(&logits, token),
                }
            }
        }
    }
}

/// Checks a forward's `how` (one per wanted row, targets inside the vocabulary) before it runs.
pub fn check_wants(how: &[Want], wanted: usize, vocab: usize) -> Result<(), ModelError> {
    if how.len() != wanted {
        return Err(ModelError::Inference(format!(
            "{} answers asked for {wanted} wanted rows",
            how.len()
        )));
    }
    for h in how {
        match *h {
            Want::LogprobOf(t) if t as usize >= vocab => {
                return Err(ModelError::InvalidArgument(format!(
                    "token {t} is outside the vocabulary of {vocab}"
                )));
            }
            Want::Sample(d)
                if !(d.inv_temperature > 0.0
                    && d.inv_temperature.is_finite()
                    && d.top_p > 0.0
                    && d.top_p <= 1.0
                    && (0.0..1.0).contains(&d.u)) =>
            {
                return Err(ModelError::InvalidArgument(format!(
                    "sampling draw out of range: {d:?}"
                )));
            }
            _ => {}
        }
    }
    Ok(())
}

/// Each row's position, given each sequence's cached length; checks that a sequence's rows
/// are contiguous and fit the context.
pub(crate) fn positions(
    rows: &[Row],
    lens: &[usize],
    context: usize,
) -> Result<Vec<usize>, ModelError> {
    let mut next: Vec<Option<usize>> = vec![None; lens.len()];
    let mut out = Vec::with_capacity(rows.len());
    let mut prev_seq = None;
    for r in rows {
        let len = *lens.get(r.seq).ok_or_else(|| {
            ModelError::InvalidArgument(format!("row of sequence {} without a cache", r.seq))
        })?;
        let p = match next[r.seq] {
            None => len,
            Some(_) if prev_seq != Some(r.seq) => {
                return Err(ModelError::InvalidArgument(format!(
                    "rows of sequence {} are not contiguous",
                    r.seq
                )));
            }
            Some(p) => p,
        };
        if p >= context {
            return Err(ModelError::InvalidArgument(format!(
                "position {p} beyond the context of {context}"
            )));
        }
        next[r.seq] = Some(p + 1);
        prev_seq = Some(r.seq);
        out.push(p);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Tensor};
    use candle_transformers::generation::LogitsProcessor;

    use super::*;

    /// `greedy` is candle's argmax (the decode engine used `LogitsProcessor` for greedy
    /// streams before the decoder picked tokens itself): first of equal maxima included.
    #[test]
    fn greedy_matches_candles_argmax() {
        let mut state = 0x2545_f491_u64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            // Few distinct values, so ties are common.
            (state % 7) as f32 - 3.0
        };
        for len in [1, 2, 5, 64, 1000] {
            for _ in 0..50 {
                let logits: Vec<f32> = (0..len).map(|_| next()).collect();
                let t = Tensor::new(&logits[..], &Device::Cpu).unwrap();
                let want = LogitsProcessor::new(0, None, None).sample(&t).unwrap();
                assert_eq!(greedy(&logits), want, "{logits:?}");
            }
        }
        assert_eq!(greedy(&[f32::NEG_INFINITY; 4]), 0);
    }

    #[test]
    fn wants_answered_from_logits() {
        let logits = vec![0.5f32, 2.0, -1.0, 2.0];
        let lse = logits.iter().map(|l| l.exp()).sum::<f32>().ln();
        assert_eq!(
            Sampled::from_logits(logits.clone(), Want::Logits),
            Sampled::Logits(logits.clone())
        );
        let Sampled::Token { token, logprob } = Sampled::from_logits(logits.clone(), Want::Greedy)
        else {
            panic!("greedy gives a token");
        };
        assert_eq!(token, 1);
        assert!((logprob - (2.0 - lse)).abs() < 1e-6);
        let Sampled::Token { token, logprob } =
            Sampled::from_logits(logits.clone(), Want::LogprobOf(2))
        else {
            panic!("a target gives a token");
        };
        assert_eq!(token, 2);
        assert!((logprob - (-1.0 - lse)).abs() < 1e-6);
        // A draw at temperature 1 without a cut-off: half the mass (1.14 of 2.27, weights
        // relative to the max) falls in token 1's weight (cumulative 0.22, then 1.22).
        let d = Draw {
            inv_temperature: 1.0,
            top_p: 1.0,
            u: 0.5,
        };
        let Sampled::Token { token, logprob } =
            Sampled::from_logits(logits.clone(), Want::Sample(d))
        else {
            panic!("a draw gives a token");
        };
        assert_eq!(token, 1);
        assert!((logprob - (2.0 - lse)).abs() < 1e-6);
        for bad in [
            Draw { u: 1.0, ..d },
            Draw { top_p: 0.0, ..d },
            Draw {
                inv_temperature: f32::INFINITY,
                ..d
            },
        ] {
            assert!(check_wants(&[Want::Sample(bad)], 1, 4).is_err(), "{bad:?}");
        }
        assert!(check_wants(&[Want::Sample(d)], 1, 4).is_ok());
    }
}
