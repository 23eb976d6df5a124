//! Text generation with a llama-architecture GGUF model (SmolLM2-135M-Instruct). The weights
//! are loaded once (`batch`, read by `gguf`); generations are decoded together, one forward per step
//! over every active stream, on the model's decode thread (`engine`). Scoring calls
//! (LLM relevance, UPR) run one forward on the calling thread.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use candle_core::quantized::gguf_file;
use candle_core::quantized::tokenizer::TokenizerFromGguf;
use tokenizers::Tokenizer;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;

use super::engine::{Engine, Event, Job};
pub use super::engine::{Finish, GenParams, Piece};
use super::{Cache, Decoder, Row, Sampled, Want};
use crate::backend::device::Placement;
use crate::error::ModelError;

/// Context window: prompt plus generated tokens (the length of the rotary table).
pub const CONTEXT: usize = 4096;

/// The prefix cache of a generator loaded without a worker configuration
/// (`model_worker.prefix_cache_mb`'s default).
pub const DEFAULT_PREFIX_CACHE_BYTES: usize = 256 << 20;

/// Rows per scoring forward: the sequences of a rerank call share forwards up to this many
/// rows (a longer sequence runs alone).
const SCORE_ROWS: usize = 1024;

/// Logit rows per scoring forward (each is a vocabulary of f32: 196 KB for SmolLM2), so a
/// rerank call's memory stays bounded whatever its passage count.
const SCORE_LOGITS: usize = 256;

/// A scoring item: prompt tokens, continuation tokens, and how many final positions'
/// logits are wanted.
type Scored<'a> = (&'a [u32], &'a [u32], usize);

/// Text the GPU decoder must score like the CPU one before it serves.
const PROBE: &str = "<|im_start|>user\nWhy do retrieval systems rerank their candidates?<|im_end|>\n<|im_start|>assistant\nBecause";

pub struct LlamaGenerator {
    pub name: String,
    model: Arc<Decoder>,
    engine: Engine,
    tokenizer: Arc<Tokenizer>,
    chatml: bool,
    /// Single-token spellings of "yes" / "no" (for LLM relevance scoring).
    yes: Vec<u32>,
    no: Vec<u32>,
}

impl LlamaGenerator {
    /// On the CPU, with a prefix cache of [`DEFAULT_PREFIX_CACHE_BYTES`].
    pub fn load(name: &str, path: &Path) -> Result<Self, ModelError> {
        Self::load_on(name, path, Placement::Cpu, 0, DEFAULT_PREFIX_CACHE_BYTES)
    }

    /// As `load`, decoding on `placement`; on CUDA the KV cache pool holds `pool_tokens`
    /// positions shared by every sequence, and the GPU decoder is checked against the CPU
    /// one at load. On the CPU, `prefix_cache` bytes of finished generations' keys and
    /// values are kept for prompts that begin the same way (0: none).
    pub fn load_on(
        name: &str,
        path: &Path,
        placement: Placement,
        pool_tokens: usize,
        prefix_cache: usize,
    ) -> Result<Self, ModelError> {
        let load_err = |reason: String| ModelError::Load {
            name: name.to_owned(),
            path: path.display().to_string(),
            reason,
        };
        let mut f = std::fs::File::open(path).map_err(|e| load_err(e.to_string()))?;
        let content = gguf_file::Content::read(&mut f)
            .map_err(|e| load_err(format!("not a GGUF file: {e}")))?;
        let arch = content
            .metadata
            .get("general.architecture")
            .and_then(|v| v.to_string().ok())
            .cloned()
            .unwrap_or_default();
        if arch != "llama" && arch != "qwen2" {
            return Err(load_err(format!(
                "architecture {arch:?}: llama and qwen2 GGUF models are served"
            )));
        }
        let mut tokenizer = Tokenizer::from_gguf(&content)
            .map_err(|e| load_err(format!("tokenizer from GGUF metadata: {e}")))?;
        // The GGUF names SmolLM2's pre-tokenizer "smollm", which candle maps to GPT-2 with a
        // prefix space; HF transformers tokenises without it.
        tokenizer.with_pre_tokenizer(Some(ByteLevel::new(false, true, true)));
        let template = content
            .metadata
            .get("tokenizer.chat_template")
            .and_then(|v| v.to_string().ok())
            .cloned()
            .unwrap_or_default();
        let mut eos = Vec::new();
        if let Some(id) = content
            .metadata
            .get("tokenizer.ggml.eos_token_id")
            .and_then(|v| v.to_u32().ok())
        {
            eos.push(id);
        }
        for t in ["<|im_end|>", "<|endoftext|>"] {
            if let Some(id) = tokenizer.token_to_id(t)
                && !eos.contains(&id)
            {
                eos.push(id);
            }
        }
        let probe = tokenizer
            .encode(PROBE, false)
            .map_err(|e| load_err(format!("tokenize the probe: {e}")))?
            .get_ids()
            .to_vec();
        let model = Arc::new(
            Decoder::load(&content, &mut f, CONTEXT, placement, pool_tokens, &probe)
                .map_err(|e| load_err(format!("weights: {e}")))?,
        );
        let single = |words: &[&str]| -> Vec<u32> {
            words
                .iter()
                .filter_map(|w| {
                    let e = tokenizer.encode(*w, false).ok()?;
                    (e.get_ids().len() == 1).then(|| e.get_ids()[0])
                })
                .collect()
        };
        let yes = single(&["yes", "Yes", " yes", " Yes"]);
        let no = single(&["no", "No", " no", " No"]);
        let tokenizer = Arc::new(tokenizer);
        let engine = Engine::start(name, model.clone(), tokenizer.clone(), eos, prefix_cache)?;
        Ok(Self {
            name: name.to_owned(),
            model,
            engine,
            tokenizer,
            chatml: template.contains("<|im_start|>"),
            yes,
            no,
        })
    }

    /// Where the decoder runs.
    pub fn placement(&self) -> Placement {
        self.model.placement()
    }

    /// The first `max_tokens` tokens of `text` as text, and whether anything was cut.
    pub fn truncate_text(
        &self,
        text: &str,
        max_tokens: usize,
    ) -> Result<(String, bool), ModelError> {
        let e = self
            .tokenizer
            .encode(text, false)
            .map_err(|e| ModelError::Inference(format!("tokenize: {e}")))?;
        if e.get_ids().len() <= max_tokens {
            return Ok((text.to_owned(), false));
        }
        let t = self
            .tokenizer
            .decode(&e.get_ids()[..max_tokens], true)
            .map_err(|e| ModelError::Inference(format!("detokenize: {e}")))?;
        Ok((t, true))
    }

    /// P(yes) / (P(yes) + P(no)) for the first token the model would write after each
    /// prompt (a chat prompt asking a yes/no question): pointwise LLM relevance. Prefill
    /// only, the prompts run together (`score_many`).
    pub fn yes_probabilities(&self, prompts: &[Vec<u32>]) -> Result<Vec<f32>, ModelError> {
        if self.yes.is_empty() || self.no.is_empty() {
            return Err(ModelError::Inference(format!(
                "model {}: \"yes\" / \"no\" are not single tokens in its vocabulary",
                self.name
            )));
        }
        let items: Vec<Scored> = prompts.iter().map(|p| (&p[..], &[][..], 1)).collect();
        self.score_many(
            &items,
            |_| Want::Logits,
            |out| {
                let Some(Sampled::Logits(logits)) = out.first() else {
                    return f32::NAN;
                };
                // Only the ratio matters, so raw logits do: the softmax normaliser cancels.
                let lse = |ids: &[u32]| {
                    let m = ids
                        .iter()
                        .map(|&i| logits[i as usize])
                        .fold(f32::NEG_INFINITY, f32::max);
                    m + ids
                        .iter()
                        .map(|&i| (logits[i as usize] - m).exp())
                        .sum::<f32>()
                        .ln()
                };
                let (y, n) = (lse(&self.yes), lse(&self.no));
                // Softmax over the two answers, computed stably.
                1.0 / (1.0 + (n - y).exp())
            },
        )
    }

    /// For each prompt, the mean natural log-probability of `target` following it (teacher
    /// forcing): the UPR reranker (Sachan et al., AutoRAG seed) scores a passage by how
    /// likely the model is to write the query after reading it. The prompts run together.
    pub fn continuation_logprobs(
        &self,
        prompts: &[Vec<u32>],
        target: &[u32],
    ) -> Result<Vec<f32>, ModelError> {
        if target.is_empty() {
            return Err(ModelError::InvalidArgument("empty target".into()));
        }
        let more = &target[..target.len() - 1];
        let items: Vec<Scored> = prompts
            .iter()
            .map(|p| (&p[..], more, target.len()))
            .collect();
        // Only the target tokens' log-probabilities leave the decoder (on a GPU: computed
        // there, two numbers per row instead of the vocabulary's logits).
        self.score_many(
            &items,
            |j| Want::LogprobOf(target[j]),
            |out| {
                let total: f32 = out
                    .iter()
                    .map(|o| match o {
                        Sampled::Token { logprob, .. } => *logprob,
                        Sampled::Logits(_) => f32::NAN,
                    })
                    .sum();
                total / target.len() as f32
            },
        )
    }

    /// For each item (prompt, continuation, `last`): `score` of the decoder's answers to
    /// `want_of(j)` after each (the j-th) of the last `last` tokens of prompt + continuation. The items' sequences share forwards of
    /// up to [`SCORE_ROWS`] rows and [`SCORE_LOGITS`] logit rows (an item beyond either runs
    /// alone), on the calling thread; each forward's logits are scored and dropped before
    /// the next.
    fn score_many(
        &self,
        items: &[Scored],
        want_of: impl Fn(usize) -> Want,
        score: impl Fn(&[Sampled]) -> f32,
    ) -> Result<Vec<f32>, ModelError> {
        let mut out = Vec::with_capacity(items.len());
        let mut next = 0;
        while next < items.len() {
            let (mut rows, mut want, mut lasts) = (Vec::new(), Vec::new(), Vec::new());
            let mut how = Vec::new();
            while let Some(&(prompt, more, last)) = items.get(next) {
                let n = prompt.len() + more.len();
                if n == 0 || last == 0 || last > n {
                    return Err(ModelError::InvalidArgument("empty prompt".into()));
                }
                let full = rows.len() + n > SCORE_ROWS || want.len() + last > SCORE_LOGITS;
                if !rows.is_empty() && full {
                    break;
                }
                let seq = lasts.len();
                want.extend(rows.len() + n - last..rows.len() + n);
                how.extend((0..last).map(&want_of));
                rows.extend(prompt.iter().chain(more).map(|&token| Row { seq, token }));
                lasts.push(last);
                next += 1;
            }
            let mut caches: Vec<Cache> = lasts.iter().map(|_| self.model.new_cache()).collect();
            let mut refs: Vec<&mut Cache> = caches.iter_mut().collect();
            let answers = self.model.forward_sampled(&rows, &mut refs, &want, &how)?;
            let mut at = 0;
            for last in lasts {
                out.push(score(&answers[at..at + last]));
                at += last;
            }
        }
        Ok(out)
    }

    /// Token ids of plain text (no special tokens).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, ModelError> {
        Ok(self
            .tokenizer
            .encode(text, false)
            .map_err(|e| ModelError::Inference(format!("tokenize: {e}")))?
            .get_ids()
            .to_vec())
    }

    /// The prompt as token ids: wrapped in the model's chat template (ChatML for SmolLM2) with
    /// an optional system message and earlier (role, content) turns, or taken verbatim with
    /// `raw`. Without a chat template the turns are joined as plain text. `prefix` starts the
    /// assistant's reply, so generation continues it.
    pub fn prompt_tokens(
        &self,
        prompt: &str,
        system: &str,
        history: &[(&str, &str)],
        raw: bool,
        prefix: &str,
    ) -> Result<Vec<u32>, ModelError> {
        let mut text = if raw {
            prompt.to_owned()
        } else if !self.chatml {
            let mut t = String::new();
            for part in std::iter::once(system)
                .chain(history.iter().map(|(_, c)| *c))
                .filter(|p| !p.is_empty())
            {
                t.push_str(part);
                t.push_str("\n\n");
            }
            t.push_str(prompt);
            t
        } else {
            let mut t = String::new();
            if !system.is_empty() {
                t.push_str(&format!("<|im_start|>system\n{system}<|im_end|>\n"));
            }
            for (role, content) in history {
                t.push_str(&format!("<|im_start|>{role}\n{content}<|im_end|>\n"));
            }
            t.push_str(&format!(
                "<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"
            ));
            t
        };
        text.push_str(prefix);
        let enc = self
            .tokenizer
            .encode(text, false)
            .map_err(|e| ModelError::Inference(format!("tokenize: {e}")))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Generates after `prompt` and hands each token to `emit`, which returns false once the
    /// client has gone (the generation then stops). Blocks the calling thread; the decoding
    /// happens on the model's decode thread, batched with every other stream.
    pub fn generate(
        &self,
        prompt: &[u32],
        p: &GenParams,
        mut emit: impl FnMut(Piece) -> bool,
    ) -> Result<(Finish, usize), ModelError> {
        if prompt.is_empty() {
            return Err(ModelError::InvalidArgument("empty prompt".into()));
        }
        if p.max_tokens == 0 {
            return Ok((Finish::Length, 0));
        }
        let starts = p
            .starts_with
            .iter()
            .map(|s| self.encode(s))
            .collect::<Result<Vec<_>, _>>()?;
        if starts.iter().any(Vec::is_empty) {
            return Err(ModelError::InvalidArgument(
                "a starts_with string has no tokens".into(),
            ));
        }
        let (events, rx) = std::sync::mpsc::channel();
        let cancel = Arc::new(AtomicBool::new(false));
        self.engine.submit(Job {
            prompt: prompt.to_vec(),
            params: p.clone(),
            events,
            cancel: cancel.clone(),
            starts,
        })?;
        let mut n = 0;
        for e in rx {
            match e {
                Event::Piece(piece) => {
                    n += 1;
                    if !emit(piece) {
                        cancel.store(true, Ordering::Release);
                        return Ok((Finish::Cancelled, n));
                    }
                }
                Event::Done(r) => return r,
            }
        }
        Err(ModelError::Inference(
            "the decode thread has stopped".into(),
        ))
    }
}
