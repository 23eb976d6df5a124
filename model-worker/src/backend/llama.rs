//! Text generation with a llama-architecture GGUF model (SmolLM2-135M-Instruct) on candle's
//! quantized llama. The weights are loaded once; every generation runs on its own clone (the
//! tensors are shared, only the KV cache is per generation) on the calling thread.

use std::path::Path;

use candle_core::quantized::gguf_file;
use candle_core::quantized::tokenizer::TokenizerFromGguf;
use candle_core::{DType, Device, Tensor};
use candle_transformers::generation::LogitsProcessor;
use candle_transformers::models::quantized_llama::{MAX_SEQ_LEN, ModelWeights};
use tokenizers::Tokenizer;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;

use crate::error::ModelError;

/// Context window: prompt plus generated tokens (candle's rotary table for quantized llama).
pub const CONTEXT: usize = MAX_SEQ_LEN;

/// How a generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    /// End-of-sequence token or a stop string.
    Stop,
    /// `max_tokens` reached.
    Length,
    /// The client went away.
    Cancelled,
}

impl Finish {
    pub fn as_str(self) -> &'static str {
        match self {
            Finish::Stop => "stop",
            Finish::Length => "length",
            Finish::Cancelled => "cancelled",
        }
    }
}

/// Decoding parameters, validated by the service.
#[derive(Debug, Clone)]
pub struct GenParams {
    pub max_tokens: usize,
    /// 0 = greedy.
    pub temperature: f64,
    pub top_p: f64,
    pub stop: Vec<String>,
    pub seed: u64,
}

/// One generated token as streamed: the text it adds (possibly empty while a multi-byte
/// character or a possible stop string is incomplete) and its log-probability under the
/// model's distribution (temperature 1, before top-p).
pub struct Piece {
    pub text: String,
    pub token_id: u32,
    pub logprob: f32,
}

pub struct LlamaGenerator {
    pub name: String,
    weights: ModelWeights,
    tokenizer: Tokenizer,
    eos: Vec<u32>,
    chatml: bool,
    /// Single-token spellings of "yes" / "no" (for LLM relevance scoring).
    yes: Vec<u32>,
    no: Vec<u32>,
}

impl LlamaGenerator {
    pub fn load(name: &str, path: &Path) -> Result<Self, ModelError> {
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
        if arch != "llama" {
            return Err(load_err(format!(
                "architecture {arch:?}: only llama GGUF models are served"
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
        let weights = ModelWeights::from_gguf(content, &mut f, &Device::Cpu)
            .map_err(|e| load_err(format!("weights: {e}")))?;
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
        Ok(Self {
            name: name.to_owned(),
            weights,
            tokenizer,
            eos,
            chatml: template.contains("<|im_start|>"),
            yes,
            no,
        })
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

    /// P(yes) / (P(yes) + P(no)) for the first token the model would write after `prompt`
    /// (a chat prompt asking a yes/no question): pointwise LLM relevance. One prefill, no
    /// decoding.
    pub fn yes_probability(&self, prompt: &[u32]) -> Result<f32, ModelError> {
        if self.yes.is_empty() || self.no.is_empty() {
            return Err(ModelError::Inference(format!(
                "model {}: \"yes\" / \"no\" are not single tokens in its vocabulary",
                self.name
            )));
        }
        let mut model = self.weights.clone();
        model.clear_kv_cache();
        let input = Tensor::new(prompt, &Device::Cpu)?.unsqueeze(0)?;
        let logits = model.forward(&input, 0)?.squeeze(0)?.to_dtype(DType::F32)?;
        let lp = candle_nn::ops::log_softmax(&logits, 0)?.to_vec1::<f32>()?;
        let lse = |ids: &[u32]| {
            let m = ids
                .iter()
                .map(|&i| lp[i as usize])
                .fold(f32::NEG_INFINITY, f32::max);
            m + ids
                .iter()
                .map(|&i| (lp[i as usize] - m).exp())
                .sum::<f32>()
                .ln()
        };
        let (y, n) = (lse(&self.yes), lse(&self.no));
        // Softmax over the two answers, computed stably.
        Ok(1.0 / (1.0 + (n - y).exp()))
    }

    /// Mean natural log-probability of `target` following `prompt` (teacher forcing): the
    /// UPR reranker (Sachan et al., AutoRAG seed) scores a passage by how likely the model is
    /// to write the query after reading it. One prefill, then one step per target token
    /// (candle's quantized llama yields the last position's logits only).
    pub fn continuation_logprob(&self, prompt: &[u32], target: &[u32]) -> Result<f32, ModelError> {
        if target.is_empty() {
            return Err(ModelError::InvalidArgument("empty target".into()));
        }
        let mut model = self.weights.clone();
        model.clear_kv_cache();
        let input = Tensor::new(prompt, &Device::Cpu)?.unsqueeze(0)?;
        let mut logits = model.forward(&input, 0)?.squeeze(0)?;
        let mut total = 0.0f32;
        for (i, &t) in target.iter().enumerate() {
            let lp = candle_nn::ops::log_softmax(&logits.to_dtype(DType::F32)?, 0)?
                .get(t as usize)?
                .to_scalar::<f32>()?;
            total += lp;
            if i + 1 < target.len() {
                let input = Tensor::new(&[t], &Device::Cpu)?.unsqueeze(0)?;
                logits = model.forward(&input, prompt.len() + i)?.squeeze(0)?;
            }
        }
        Ok(total / target.len() as f32)
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
    /// client has gone (the generation then stops).
    pub fn generate(
        &self,
        prompt: &[u32],
        p: &GenParams,
        mut emit: impl FnMut(Piece) -> bool,
    ) -> Result<(Finish, usize), ModelError> {
        let mut model = self.weights.clone();
        model.clear_kv_cache();
        let temperature = (p.temperature > 0.0).then_some(p.temperature);
        let top_p = (p.top_p < 1.0).then_some(p.top_p);
        let mut sampler = LogitsProcessor::new(p.seed, temperature, top_p);
        let input = Tensor::new(prompt, &Device::Cpu)?.unsqueeze(0)?;
        let mut logits = model.forward(&input, 0)?.squeeze(0)?;
        let mut ids: Vec<u32> = Vec::new();
        let mut sent = 0usize;
        let longest_stop = p.stop.iter().map(String::len).max().unwrap_or(0);
        for step in 0..p.max_tokens {
            let logits32 = logits.to_dtype(DType::F32)?;
            let next = sampler.sample(&logits32)?;
            let logprob = candle_nn::ops::log_softmax(&logits32, 0)?
                .get(next as usize)?
                .to_scalar::<f32>()?;
            if self.eos.contains(&next) {
                emit(Piece {
                    text: String::new(),
                    token_id: next,
                    logprob,
                });
                return Ok((Finish::Stop, step + 1));
            }
            ids.push(next);
            let text = self
                .tokenizer
                .decode(&ids, true)
                .map_err(|e| ModelError::Inference(format!("detokenize: {e}")))?;
            // A stop string ends the text just before it.
            let from = sent.saturating_sub(longest_stop);
            let stop_at = p
                .stop
                .iter()
                .filter_map(|s| text.get(from..)?.find(s.as_str()).map(|i| from + i))
                .min();
            if let Some(end) = stop_at {
                let delta = text.get(sent..end).unwrap_or_default().to_owned();
                emit(Piece {
                    text: delta,
                    token_id: next,
                    logprob,
                });
                return Ok((Finish::Stop, step + 1));
            }
            // Hold back an incomplete character and any tail that could start a stop string.
            let mut ready = text.len();
            if text.ends_with('\u{FFFD}') {
                ready = text.rfind('\u{FFFD}').unwrap_or(ready);
            }
            for s in &p.stop {
                for k in (1..s.len()).rev() {
                    if s.is_char_boundary(k) && text[..ready].ends_with(&s[..k]) {
                        ready = (ready - k).max(sent);
                        break;
                    }
                }
            }
            let last = step + 1 == p.max_tokens;
            let end = if last { text.len() } else { ready.max(sent) };
            let delta = text.get(sent..end).unwrap_or_default().to_owned();
            sent = end.max(sent);
            if !emit(Piece {
                text: delta,
                token_id: next,
                logprob,
            }) {
                return Ok((Finish::Cancelled, step + 1));
            }
            if last {
                break;
            }
            let input = Tensor::new(&[next], &Device::Cpu)?.unsqueeze(0)?;
            logits = model.forward(&input, prompt.len() + step)?.squeeze(0)?;
        }
        Ok((Finish::Length, p.max_tokens))
    }
}
