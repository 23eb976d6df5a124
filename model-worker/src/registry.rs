//! The models a worker serves, loaded from config before it listens, and the operations on
//! them shared by the gRPC service and the OpenAI-compatible HTTP API: embed, rerank and
//! generate (local GGUF or a remote OpenAI-compatible server).

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use ragcluster_proto::v1::{EmbedInput, GenerateRequest, GenerateResponse, ModelInfo};
use tokio::sync::{Semaphore, mpsc};

use crate::backend::Seq;
use crate::backend::decoder::llama::{CONTEXT, GenParams, LlamaGenerator};
use crate::backend::device::{self, Placement};
use crate::backend::encoder::Prompts;
use crate::backend::encoder::bert::{self, BertEncoder, HeadKind};
use crate::batcher::{BatchConfig, Batcher};
use crate::config::{ModelSpec, ModelWorkerConfig};
use crate::error::ModelError;
use crate::remote::RemoteGenerator;
use crate::tokenize::{TextTokenizer, TokenizerPool};

/// Texts per Embed call and passages per Rerank call.
pub const MAX_TEXTS: usize = 256;
/// Bytes per text (longer input is truncated to the model's token limit anyway).
pub const MAX_TEXT_BYTES: usize = 1 << 20;
/// Generation limits (see model_worker.proto).
pub const MAX_GEN_TOKENS: usize = 2048;
pub const DEFAULT_GEN_TOKENS: usize = 256;
pub const MAX_STOPS: usize = 8;
pub const MAX_STOP_BYTES: usize = 64;
/// `starts_with`: beginnings per request and bytes per beginning.
pub const MAX_STARTS: usize = 8;
pub const MAX_START_BYTES: usize = 64;
pub use ragcluster_common::prompt::MAX_START_BIAS;
pub const MAX_HISTORY: usize = 64;
/// Passage tokens kept per LLM relevance prompt.
const LLM_RERANK_PASSAGE_TOKENS: usize = 384;

/// A sentence the rate probe of each encoder repeats (see `Batcher::start_probed`).
const RATE_PROBE: &str = "The quick brown fox jumps over the lazy dog. ";

/// An encoder model behind its batcher.
pub struct EncoderModel {
    pub placement: Placement,
    batcher: Batcher,
    tokenizer: Arc<TextTokenizer>,
    pub dim: usize,
    pub max_len: usize,
    /// `ModelInfo.revision`.
    pub revision: String,
    /// Task prefixes put before queries and documents (nomic-embed-text).
    pub prompts: Prompts,
}

/// A local GGUF generator on its configured device. Under `device = "auto"` a GPU decoder
/// that fails to load, or disagrees with the CPU at load, leaves the model on the CPU. The
/// GPU's KV cache pool holds a full context for every concurrent generation, plus a few for
/// scoring calls.
fn load_generator(spec: &ModelSpec, cfg: &ModelWorkerConfig) -> Result<LlamaGenerator, ModelError> {
    let wanted = device::resolve(&spec.name, &spec.device, true)?;
    let pool = (cfg.max_concurrent_generations + 4) * CONTEXT;
    let prefix = cfg.prefix_cache_mb << 20;
    match LlamaGenerator::load_on(&spec.name, &spec.path, wanted, pool, prefix) {
        Err(e) if wanted == Placement::Cuda && spec.device == "auto" => {
            tracing::warn!(model = %spec.name, error = %e, "device auto: CUDA decoder failed, using cpu");
            LlamaGenerator::load_on(&spec.name, &spec.path, Placement::Cpu, 0, prefix)
        }
        r => r,
    }
}

impl EncoderModel {
    fn load(
        spec: &ModelSpec,
        head: HeadKind,
        cfg: &ModelWorkerConfig,
    ) -> Result<(Self, BatchConfig), ModelError> {
        let wanted = device::resolve(&spec.name, &spec.device, true)?;
        let enc = match BertEncoder::load_on(
            &spec.name,
            &spec.path,
            spec.max_sequence_length,
            head,
            wanted,
        ) {
            // "auto" never fails over a GPU problem: log it and use the CPU.
            Err(e) if wanted == Placement::Cuda && spec.device == "auto" => {
                tracing::warn!(model = %spec.name, error = %e, "device auto: CUDA load failed, using cpu");
                BertEncoder::load_on(
                    &spec.name,
                    &spec.path,
                    spec.max_sequence_length,
                    head,
                    Placement::Cpu,
                )?
            }
            r => r?,
        };
        let batch = BatchConfig {
            max_batch: if spec.max_batch > 0 {
                spec.max_batch
            } else {
                cfg.max_batch
            },
            max_batch_tokens: cfg.batch_tokens(spec, enc.placement()),
            max_wait: cfg.batch_wait,
            max_queue: cfg.max_queue,
            batching: cfg.batching,
            small_first: cfg.small_first,
        };
        let placement = enc.placement();
        // Four sequences of ~120 tokens: the encoder's speed, measured before traffic.
        let probe = bert::tokenize(&enc.tokenizer(), &vec![RATE_PROBE.repeat(12); 4])?;
        let m = Self {
            placement,
            tokenizer: Arc::new(if cfg.word_cache {
                TextTokenizer::new(enc.tokenizer())
            } else {
                TextTokenizer::whole(enc.tokenizer())
            }),
            dim: enc.dimension(),
            max_len: enc.max_sequence_length(),
            revision: enc.revision().to_owned(),
            prompts: enc.prompts().clone(),
            batcher: Batcher::start_probed(spec.name.clone(), Box::new(enc), batch.clone(), &probe),
        };
        Ok((m, batch))
    }
}

pub enum Reranker {
    CrossEncoder(EncoderModel),
    MaxSim(EncoderModel),
    /// Pointwise yes/no relevance from a generator.
    Llm(Arc<LlamaGenerator>),
    /// UPR: log-likelihood of the query given the passage.
    Upr(Arc<LlamaGenerator>),
}

pub enum Generator {
    Local(Arc<LlamaGenerator>),
    Remote(Arc<RemoteGenerator>),
}

/// Output of `Registry::embed`.
pub struct Embedded {
    pub model: String,
    pub dim: usize,
    pub vectors: Vec<Vec<f32>>,
    pub tokens: usize,
    pub truncated: Vec<u32>,
    pub revision: String,
}

/// Output of `Registry::rerank`.
pub struct Reranked {
    pub model: String,
    pub scores: Vec<f32>,
    pub truncated: Vec<u32>,
}

/// Decoding slots shared by local generations and LLM reranking, and how many may wait.
struct Slots {
    sem: Arc<Semaphore>,
    waiting: Arc<AtomicUsize>,
    max_waiting: usize,
    slots: usize,
}

pub struct Registry {
    embedders: HashMap<String, EncoderModel>,
    default_embed: String,
    rerankers: HashMap<String, Reranker>,
    default_rerank: String,
    generators: HashMap<String, Generator>,
    default_generate: String,
    slots: Slots,
    infos: Vec<ModelInfo>,
    /// Every encoder call is tokenised here, off the async runtime.
    tokenize: TokenizerPool,
}

impl Registry {
    /// Loads every configured model; the first failure names the model and path.
    pub fn load(cfg: &ModelWorkerConfig) -> Result<Self, ModelError> {
        let mut r = Self {
            tokenize: TokenizerPool::start(cfg.tokenizer_threads, cfg.max_queue),
            embedders: HashMap::new(),
            default_embed: String::new(),
            rerankers: HashMap::new(),
            default_rerank: String::new(),
            generators: HashMap::new(),
            default_generate: String::new(),
            slots: Slots {
                sem: Arc::new(Semaphore::new(cfg.max_concurrent_generations)),
                waiting: Arc::new(AtomicUsize::new(0)),
                max_waiting: cfg.max_queued_generations,
                slots: cfg.max_concurrent_generations,
            },
            infos: Vec::new(),
        };
        for spec in &cfg.models {
            let started = std::time::Instant::now();
            let mut info = ModelInfo {
                name: spec.name.clone(),
                kind: spec.kind.clone(),
                path: spec.path.display().to_string(),
                device: "cpu".into(),
                state: "ready".into(),
                ..Default::default()
            };
            match spec.kind.as_str() {
                "embed" => {
                    let (m, b) = EncoderModel::load(spec, HeadKind::MeanPool, cfg)?;
                    info.device = m.placement.as_str().into();
                    info.dimension = m.dim as u32;
                    info.max_sequence_length = m.max_len as u32;
                    info.max_batch = b.max_batch as u32;
                    info.max_batch_tokens = b.max_batch_tokens as u32;
                    info.revision = m.revision.clone();
                    if r.default_embed.is_empty() {
                        r.default_embed = spec.name.clone();
                    }
                    r.embedders.insert(spec.name.clone(), m);
                }
                "rerank" => {
                    let method = rerank_method(spec);
                    info.method = method.into();
                    let rr = match method {
                        "llm" | "upr" => {
                            let g = Arc::new(load_generator(spec, cfg)?);
                            info.device = g.placement().as_str().into();
                            info.max_sequence_length = CONTEXT as u32;
                            if method == "llm" {
                                Reranker::Llm(g)
                            } else {
                                Reranker::Upr(g)
                            }
                        }
                        m => {
                            let cross = m == "cross-encoder";
                            let head = if cross {
                                HeadKind::Classifier
                            } else {
                                HeadKind::Tokens
                            };
                            let (m, b) = EncoderModel::load(spec, head, cfg)?;
                            info.device = m.placement.as_str().into();
                            info.dimension = m.dim as u32;
                            info.max_sequence_length = m.max_len as u32;
                            info.max_batch = b.max_batch as u32;
                            info.max_batch_tokens = b.max_batch_tokens as u32;
                            info.revision = m.revision.clone();
                            if cross {
                                Reranker::CrossEncoder(m)
                            } else {
                                Reranker::MaxSim(m)
                            }
                        }
                    };
                    if r.default_rerank.is_empty() {
                        r.default_rerank = spec.name.clone();
                    }
                    r.rerankers.insert(spec.name.clone(), rr);
                }
                _ => {
                    let g = if spec.endpoint.is_empty() {
                        let g = load_generator(spec, cfg)?;
                        info.method = "local".into();
                        info.device = g.placement().as_str().into();
                        info.max_sequence_length = CONTEXT as u32;
                        Generator::Local(Arc::new(g))
                    } else {
                        info.method = "openai".into();
                        info.state = "remote".into();
                        info.device = "remote".into();
                        info.endpoint = spec.endpoint.clone();
                        info.path = String::new();
                        Generator::Remote(Arc::new(RemoteGenerator::new(spec)?))
                    };
                    if r.default_generate.is_empty() {
                        r.default_generate = spec.name.clone();
                    }
                    r.generators.insert(spec.name.clone(), g);
                }
            }
            tracing::info!(
                model = %spec.name,
                kind = %spec.kind,
                method = %info.method,
                device = %info.device,
                ms = started.elapsed().as_millis() as u64,
                "model loaded"
            );
            r.infos.push(info);
        }
        r.infos.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(r)
    }

    pub fn models(&self) -> Vec<ModelInfo> {
        self.infos.clone()
    }

    fn pick<'a, T>(
        map: &'a HashMap<String, T>,
        default: &str,
        asked: &str,
        kind: &str,
    ) -> Result<(String, &'a T), ModelError> {
        let name = if asked.is_empty() { default } else { asked };
        if name.is_empty() {
            return Err(ModelError::UnknownModel(format!(
                "(no {kind} model is configured)"
            )));
        }
        map.get(name)
            .map(|m| (name.to_owned(), m))
            .ok_or_else(|| ModelError::UnknownModel(name.to_owned()))
    }

    /// `deadline`: how long the caller waits (its gRPC deadline), so that a backlog longer
    /// than that is refused up front (see `batcher`).
    pub async fn embed(
        &self,
        model: &str,
        texts: Vec<String>,
        input: EmbedInput,
        deadline: Option<Duration>,
    ) -> Result<Embedded, ModelError> {
        let (name, m) = Self::pick(&self.embedders, &self.default_embed, model, "embed")?;
        check_texts("texts", &texts)?;
        let prefix = match input {
            EmbedInput::Query => &m.prompts.query,
            EmbedInput::Unspecified | EmbedInput::Document => &m.prompts.document,
        };
        let texts = if prefix.is_empty() {
            texts
        } else {
            texts.into_iter().map(|t| format!("{prefix}{t}")).collect()
        };
        let seqs = self.tokenize.texts(&name, &m.tokenizer, texts).await?;
        let tokens = seqs.iter().map(|s| s.ids.len()).sum();
        let truncated = truncated(&seqs);
        let vectors = m.batcher.run(seqs, deadline).await?;
        Ok(Embedded {
            model: name,
            dim: m.dim,
            vectors,
            tokens,
            truncated,
            revision: m.revision.clone(),
        })
    }

    pub async fn rerank(
        &self,
        model: &str,
        query: &str,
        passages: Vec<String>,
    ) -> Result<Reranked, ModelError> {
        let (name, m) = Self::pick(&self.rerankers, &self.default_rerank, model, "rerank")?;
        if query.trim().is_empty() {
            return Err(ModelError::InvalidArgument("query is empty".into()));
        }
        if query.len() > MAX_TEXT_BYTES {
            return Err(ModelError::InvalidArgument(format!(
                "query is over {MAX_TEXT_BYTES} bytes"
            )));
        }
        check_texts("passages", &passages)?;
        let (scores, truncated) = match m {
            Reranker::CrossEncoder(enc) => {
                let seqs = self
                    .tokenize
                    .pairs(&name, &enc.tokenizer, query, passages)
                    .await?;
                let t = truncated(&seqs);
                let out = enc.batcher.run(seqs, None).await?;
                (out.into_iter().map(|v| v[0]).collect(), t)
            }
            Reranker::MaxSim(enc) => {
                let mut texts = Vec::with_capacity(passages.len() + 1);
                texts.push(query.to_owned());
                texts.extend(passages);
                let seqs = self.tokenize.texts(&name, &enc.tokenizer, texts).await?;
                let t = truncated(&seqs[1..]);
                let out = enc.batcher.run(seqs, None).await?;
                let q = &out[0];
                let scores = out[1..].iter().map(|d| maxsim(q, d, enc.dim)).collect();
                (scores, t)
            }
            Reranker::Llm(g) | Reranker::Upr(g) => {
                let upr = matches!(m, Reranker::Upr(_));
                let permit = self.acquire_slot(&name).await?;
                let g = g.clone();
                let query = query.to_owned();
                tokio::task::spawn_blocking(move || {
                    let _permit = permit;
                    if upr {
                        upr_rerank(&g, &query, &passages)
                    } else {
                        llm_rerank(&g, &query, &passages)
                    }
                })
                .await
                .map_err(|e| ModelError::Inference(e.to_string()))??
            }
        };
        Ok(Reranked {
            model: name,
            scores,
            truncated,
        })
    }

    /// Waits for a decoding slot, or refuses when too many already wait.
    async fn acquire_slot(
        &self,
        name: &str,
    ) -> Result<tokio::sync::OwnedSemaphorePermit, ModelError> {
        let s = &self.slots;
        if s.waiting.fetch_add(1, Ordering::AcqRel) >= s.max_waiting + s.slots {
            s.waiting.fetch_sub(1, Ordering::AcqRel);
            return Err(ModelError::Overloaded(name.to_owned()));
        }
        let p = s.sem.clone().acquire_owned().await;
        s.waiting.fetch_sub(1, Ordering::AcqRel);
        p.map_err(|_| ModelError::Inference("worker shutting down".into()))
    }

    /// Validates a generation request and starts it; tokens arrive on the returned channel
    /// (closing it cancels the generation).
    pub async fn generate(
        &self,
        r: GenerateRequest,
    ) -> Result<mpsc::Receiver<Result<GenerateResponse, ModelError>>, ModelError> {
        let (name, g) = Self::pick(
            &self.generators,
            &self.default_generate,
            &r.model,
            "generate",
        )?;
        let params = gen_params(&r)?;
        if r.prompt.is_empty() {
            return Err(ModelError::InvalidArgument("prompt is empty".into()));
        }
        if r.prompt.len() > MAX_TEXT_BYTES
            || r.system.len() > MAX_TEXT_BYTES
            || r.assistant_prefix.len() > MAX_TEXT_BYTES
        {
            return Err(ModelError::InvalidArgument(format!(
                "prompt, system and assistant_prefix must be at most {MAX_TEXT_BYTES} bytes"
            )));
        }
        if r.history.len() > MAX_HISTORY {
            return Err(ModelError::InvalidArgument(format!(
                "history has {} turns, at most {MAX_HISTORY}",
                r.history.len()
            )));
        }
        if let Some(i) = r
            .history
            .iter()
            .position(|m| m.role != "user" && m.role != "assistant")
        {
            return Err(ModelError::InvalidArgument(format!(
                "history[{i}].role must be \"user\" or \"assistant\""
            )));
        }
        let (tx, rx) = mpsc::channel(64);
        match g {
            Generator::Remote(_) if !r.starts_with.is_empty() => {
                return Err(ModelError::InvalidArgument(format!(
                    "starts_with needs a local model; {name} is remote"
                )));
            }
            Generator::Remote(remote) => {
                let remote = remote.clone();
                tokio::spawn(async move { remote.generate(r, params, tx).await });
            }
            Generator::Local(model) => {
                let history: Vec<(&str, &str)> = r
                    .history
                    .iter()
                    .map(|m| (m.role.as_str(), m.content.as_str()))
                    .collect();
                let prompt = model.prompt_tokens(
                    &r.prompt,
                    &r.system,
                    &history,
                    r.raw,
                    &r.assistant_prefix,
                )?;
                if prompt.len() + params.max_tokens > CONTEXT {
                    return Err(ModelError::InvalidArgument(format!(
                        "prompt has {} tokens; prompt + max_tokens ({}) must be at most {CONTEXT}",
                        prompt.len(),
                        params.max_tokens
                    )));
                }
                // Not yet decoding: those waiting for a slot plus those about to take one.
                let s = &self.slots;
                if s.waiting.fetch_add(1, Ordering::AcqRel) >= s.max_waiting + s.slots {
                    s.waiting.fetch_sub(1, Ordering::AcqRel);
                    return Err(ModelError::Overloaded(name));
                }
                let model = model.clone();
                let sem = s.sem.clone();
                let waiting = s.waiting.clone();
                tokio::spawn(async move {
                    let queued = std::time::Instant::now();
                    let permit = tokio::select! {
                        p = sem.acquire_owned() => p,
                        _ = tx.closed() => {
                            waiting.fetch_sub(1, Ordering::AcqRel);
                            return;
                        }
                    };
                    waiting.fetch_sub(1, Ordering::AcqRel);
                    let Ok(permit) = permit else { return };
                    metrics::histogram!("model_queue_seconds", "model" => model.name.clone())
                        .record(queued.elapsed().as_secs_f64());
                    let _ = tokio::task::spawn_blocking(move || {
                        let _permit = permit;
                        run_generation(&model, &prompt, &params, &tx)
                    })
                    .await;
                });
            }
        }
        Ok(rx)
    }
}

fn rerank_method(spec: &ModelSpec) -> &'static str {
    match spec.method.as_str() {
        "cross-encoder" => "cross-encoder",
        "maxsim" => "maxsim",
        "llm" => "llm",
        "upr" => "upr",
        // UPR ranks well even with a small generator; yes/no judgements need a larger one.
        _ if spec.path.extension().is_some_and(|e| e == "gguf") => "upr",
        _ if bert::is_classifier(&spec.path) => "cross-encoder",
        _ => "maxsim",
    }
}

fn check_texts(field: &str, texts: &[String]) -> Result<(), ModelError> {
    if texts.is_empty() {
        return Err(ModelError::InvalidArgument(format!("{field} is empty")));
    }
    if texts.len() > MAX_TEXTS {
        return Err(ModelError::InvalidArgument(format!(
            "{field} has {} entries, at most {MAX_TEXTS}",
            texts.len()
        )));
    }
    if let Some(i) = texts.iter().position(|t| t.len() > MAX_TEXT_BYTES) {
        return Err(ModelError::InvalidArgument(format!(
            "{field}[{i}] is over {MAX_TEXT_BYTES} bytes"
        )));
    }
    Ok(())
}

fn truncated(seqs: &[Seq]) -> Vec<u32> {
    seqs.iter()
        .enumerate()
        .filter(|(_, s)| s.truncated)
        .map(|(i, _)| i as u32)
        .collect()
}

/// ColBERT's late interaction over unit token vectors (rows of `dim` floats): for every query
/// token the best cosine with any passage token, averaged over query tokens (ColBERT sums;
/// the mean ranks identically and stays in [-1, 1] for thresholds).
pub fn maxsim(q: &[f32], d: &[f32], dim: usize) -> f32 {
    let nq = q.len() / dim;
    if nq == 0 || d.len() < dim {
        return 0.0;
    }
    let mut total = 0.0f32;
    for qt in q.chunks_exact(dim) {
        let best = d
            .chunks_exact(dim)
            .map(|dt| qt.iter().zip(dt).map(|(a, b)| a * b).sum::<f32>())
            .fold(f32::NEG_INFINITY, f32::max);
        total += best;
    }
    total / nq as f32
}

/// Every passage (cut to `LLM_RERANK_PASSAGE_TOKENS`) put in a chat prompt by `prompt`;
/// returns the prompts' tokens and the indices of passages that were cut.
fn passage_prompts(
    g: &LlamaGenerator,
    passages: &[String],
    prompt: impl Fn(&str) -> Result<Vec<u32>, ModelError>,
) -> Result<(Vec<Vec<u32>>, Vec<u32>), ModelError> {
    let mut prompts = Vec::with_capacity(passages.len());
    let mut cut = Vec::new();
    for (i, p) in passages.iter().enumerate() {
        let (passage, was_cut) = g.truncate_text(p, LLM_RERANK_PASSAGE_TOKENS)?;
        if was_cut {
            cut.push(i as u32);
        }
        prompts.push(prompt(&passage)?);
    }
    Ok((prompts, cut))
}

/// Pointwise LLM relevance: one yes/no prompt per passage, scored by P(yes); the prompts
/// share forwards.
fn llm_rerank(
    g: &LlamaGenerator,
    query: &str,
    passages: &[String],
) -> Result<(Vec<f32>, Vec<u32>), ModelError> {
    let system = "You judge search results. Answer only yes or no.";
    let (prompts, cut) = passage_prompts(g, passages, |passage| {
        let prompt = format!(
            "Passage: {passage}\n\nQuery: {query}\n\nDoes the passage answer the query? Answer yes or no."
        );
        g.prompt_tokens(&prompt, system, &[], false, "")
    })?;
    Ok((g.yes_probabilities(&prompts)?, cut))
}

/// UPR (Sachan et al.; the AutoRAG seed's log-prob reranker): each passage scores the mean
/// log-probability of the query as the model's reply to "write a question this passage
/// answers". Query tokens longer than 128 are cut (the score is a mean, so comparable). The
/// passages' sequences share forwards.
fn upr_rerank(
    g: &LlamaGenerator,
    query: &str,
    passages: &[String],
) -> Result<(Vec<f32>, Vec<u32>), ModelError> {
    let mut target = g.encode(query)?;
    target.truncate(128);
    let (prompts, cut) = passage_prompts(g, passages, |passage| {
        let prompt = format!("Passage: {passage}\n\nWrite a question that this passage answers.");
        g.prompt_tokens(&prompt, "", &[], false, "")
    })?;
    Ok((g.continuation_logprobs(&prompts, &target)?, cut))
}

/// Checks and defaults the decoding parameters of a request.
pub fn gen_params(r: &GenerateRequest) -> Result<GenParams, ModelError> {
    let bad = |m: String| ModelError::InvalidArgument(m);
    let max_tokens = match r.max_tokens as usize {
        0 => DEFAULT_GEN_TOKENS,
        n if n > MAX_GEN_TOKENS => {
            return Err(bad(format!("max_tokens {n} is above {MAX_GEN_TOKENS}")));
        }
        n => n,
    };
    if !r.temperature.is_finite() || !(0.0..=2.0).contains(&r.temperature) {
        return Err(bad(format!(
            "temperature {} must be in [0, 2]",
            r.temperature
        )));
    }
    let top_p = if r.top_p == 0.0 { 1.0 } else { r.top_p };
    if !(top_p.is_finite() && top_p > 0.0 && top_p <= 1.0) {
        return Err(bad(format!("top_p {} must be in (0, 1]", r.top_p)));
    }
    // Stop strings and reply beginnings: a few short non-empty strings each.
    let strings = |field: &str, v: &[String], most: usize, bytes: usize| {
        if v.len() > most {
            return Err(bad(format!("at most {most} {field} strings")));
        }
        if v.iter().any(|s| s.is_empty() || s.len() > bytes) {
            return Err(bad(format!("{field} strings must be 1 to {bytes} bytes")));
        }
        Ok(())
    };
    strings("stop", &r.stop, MAX_STOPS, MAX_STOP_BYTES)?;
    strings("starts_with", &r.starts_with, MAX_STARTS, MAX_START_BYTES)?;
    if !r.starts_bias.is_empty() && r.starts_bias.len() != r.starts_with.len() {
        return Err(bad(format!(
            "starts_bias has {} values for {} starts_with strings",
            r.starts_bias.len(),
            r.starts_with.len()
        )));
    }
    if let Some(b) = r
        .starts_bias
        .iter()
        .find(|b| !(b.is_finite() && b.abs() <= MAX_START_BIAS))
    {
        return Err(bad(format!(
            "starts_bias {b} must be in [-{MAX_START_BIAS}, {MAX_START_BIAS}]"
        )));
    }
    Ok(GenParams {
        max_tokens,
        temperature: f64::from(r.temperature),
        top_p: f64::from(top_p),
        stop: r.stop.clone(),
        seed: r.seed,
        starts_with: r.starts_with.clone(),
        starts_bias: r.starts_bias.clone(),
    })
}

/// Runs one generation on a blocking thread, sending a message per token; stops when the
/// receiver (the client's stream) is gone.
fn run_generation(
    model: &LlamaGenerator,
    prompt: &[u32],
    params: &GenParams,
    tx: &mpsc::Sender<Result<GenerateResponse, ModelError>>,
) {
    let started = std::time::Instant::now();
    let mut first: Option<std::time::Duration> = None;
    let mut pending: Option<GenerateResponse> = None;
    let label = model.name.clone();
    let mut cached = 0;
    let result = model.generate(prompt, params, |p| {
        first.get_or_insert_with(|| started.elapsed());
        cached = p.cached_tokens;
        let m = GenerateResponse {
            text: p.text,
            logprob: p.logprob,
            token_id: p.token_id,
            start_logprobs: p.start_logprobs,
            ..Default::default()
        };
        // A token goes out as soon as it exists; the stream's last one waits for the end
        // (which follows in the same decode step) so that it can carry `finished`.
        if p.last {
            pending = Some(m);
            !tx.is_closed()
        } else {
            tx.blocking_send(Ok(m)).is_ok()
        }
    });
    match result {
        Ok((finish, tokens)) => {
            let mut last = pending.unwrap_or_default();
            last.finished = true;
            last.finish_reason = finish.as_str().into();
            last.prompt_tokens = prompt.len() as u32;
            last.completion_tokens = tokens as u32;
            last.cached_tokens = cached as u32;
            let _ = tx.blocking_send(Ok(last));
            let secs = started.elapsed().as_secs_f64();
            metrics::counter!("model_generated_tokens_total", "model" => label.clone())
                .increment(tokens as u64);
            metrics::counter!("model_tokens_total", "model" => label.clone())
                .increment((prompt.len() + tokens) as u64);
            metrics::histogram!("model_device_seconds", "model" => label.clone()).record(secs);
            if let Some(f) = first {
                metrics::histogram!("model_time_to_first_token_seconds", "model" => label)
                    .record(f.as_secs_f64());
            }
            tracing::debug!(
                prompt = prompt.len(),
                tokens,
                finish = finish.as_str(),
                ms = (secs * 1e3) as u64,
                "generation done"
            );
        }
        Err(e) => {
            let _ = tx.blocking_send(Err(e));
        }
    }
}
