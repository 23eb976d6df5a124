//! `ragcluster.v1.ModelWorker` over gRPC.

use std::collections::HashMap;
use std::pin::Pin;

use futures::Stream;
use ragcluster_proto::v1::model_worker_server::ModelWorker;
use ragcluster_proto::v1::*;
use tonic::{Request, Response, Status};

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::sync::Semaphore;
use tokio_stream::wrappers::ReceiverStream;

use crate::backend::cpu::BertEmbedder;
use crate::backend::llama::{CONTEXT, GenParams, LlamaGenerator};
use crate::batcher::EmbedBatcher;
use crate::config::{ModelSpec, ModelWorkerConfig};
use crate::error::ModelError;

/// Texts per Embed call.
pub const MAX_TEXTS: usize = 256;
/// Bytes per text (longer input is truncated to the model's token limit anyway).
pub const MAX_TEXT_BYTES: usize = 1 << 20;

/// Generation limits (see model_worker.proto).
pub const MAX_GEN_TOKENS: usize = 2048;
pub const DEFAULT_GEN_TOKENS: usize = 256;
pub const MAX_STOPS: usize = 8;
pub const MAX_STOP_BYTES: usize = 64;

pub struct ModelWorkerService {
    embedders: HashMap<String, (EmbedBatcher, ModelSpec)>,
    default_embed: String,
    generators: HashMap<String, (Arc<LlamaGenerator>, ModelSpec)>,
    default_generate: String,
    /// Decoding slots, and how many generations may wait for one.
    gen_slots: Arc<Semaphore>,
    gen_waiting: Arc<AtomicUsize>,
    max_waiting: usize,
    slots: usize,
}

impl ModelWorkerService {
    pub fn load(cfg: &ModelWorkerConfig) -> Result<Self, ModelError> {
        let mut embedders = HashMap::new();
        let mut default_embed = String::new();
        let mut generators = HashMap::new();
        let mut default_generate = String::new();
        for spec in &cfg.models {
            if spec.kind == "generate" {
                let started = std::time::Instant::now();
                let g = LlamaGenerator::load(&spec.name, &spec.path)?;
                tracing::info!(model = %spec.name, dequantize = %cfg.dequantize, ms = started.elapsed().as_millis() as u64, "generation model loaded");
                if default_generate.is_empty() {
                    default_generate = spec.name.clone();
                }
                generators.insert(spec.name.clone(), (Arc::new(g), spec.clone()));
                continue;
            }
            if spec.device == "auto" {
                tracing::info!(model = %spec.name, "device auto: no CUDA backend in this build, using cpu");
            }
            let started = std::time::Instant::now();
            let backend = BertEmbedder::load(&spec.name, &spec.path, spec.max_sequence_length)?;
            let batcher = EmbedBatcher::start(
                spec.name.clone(),
                Box::new(backend),
                cfg.max_queue,
                cfg.max_batch,
            );
            tracing::info!(model = %spec.name, dim = batcher.dimension, ms = started.elapsed().as_millis() as u64, "model loaded");
            if default_embed.is_empty() {
                default_embed = spec.name.clone();
            }
            embedders.insert(spec.name.clone(), (batcher, spec.clone()));
        }
        Ok(Self {
            embedders,
            default_embed,
            generators,
            default_generate,
            gen_slots: Arc::new(Semaphore::new(cfg.max_concurrent_generations)),
            gen_waiting: Arc::new(AtomicUsize::new(0)),
            max_waiting: cfg.max_queued_generations,
            slots: cfg.max_concurrent_generations,
        })
    }
}

type GenStream = Pin<Box<dyn Stream<Item = Result<GenerateResponse, Status>> + Send>>;

#[tonic::async_trait]
impl ModelWorker for ModelWorkerService {
    async fn embed(&self, req: Request<EmbedRequest>) -> Result<Response<EmbedResponse>, Status> {
        let r = req.into_inner();
        let name = if r.model.is_empty() {
            self.default_embed.clone()
        } else {
            r.model
        };
        let (batcher, _) = self
            .embedders
            .get(&name)
            .ok_or_else(|| ModelError::UnknownModel(name.clone()))?;
        if r.texts.is_empty() {
            return Err(ModelError::InvalidArgument("texts is empty".into()).into());
        }
        if r.texts.len() > MAX_TEXTS {
            return Err(ModelError::InvalidArgument(format!(
                "texts has {} entries, at most {MAX_TEXTS}",
                r.texts.len()
            ))
            .into());
        }
        if let Some(i) = r.texts.iter().position(|t| t.len() > MAX_TEXT_BYTES) {
            return Err(ModelError::InvalidArgument(format!(
                "texts[{i}] is over {MAX_TEXT_BYTES} bytes"
            ))
            .into());
        }
        let (vecs, tokens) = batcher.embed(r.texts).await?;
        Ok(Response::new(EmbedResponse {
            model: name,
            dimension: batcher.dimension as u32,
            embeddings: vecs
                .into_iter()
                .map(|values| Embedding { values })
                .collect(),
            tokens: tokens as u32,
        }))
    }

    async fn rerank(
        &self,
        _req: Request<RerankRequest>,
    ) -> Result<Response<RerankResponse>, Status> {
        Err(Status::unimplemented(
            "Rerank is not served by this model worker version",
        ))
    }

    type GenerateStream = GenStream;

    async fn generate(
        &self,
        req: Request<GenerateRequest>,
    ) -> Result<Response<Self::GenerateStream>, Status> {
        let r = req.into_inner();
        let name = if r.model.is_empty() {
            self.default_generate.clone()
        } else {
            r.model.clone()
        };
        let (model, _) = self
            .generators
            .get(&name)
            .ok_or_else(|| ModelError::UnknownModel(name.clone()))?;
        let params = gen_params(&r)?;
        if r.prompt.is_empty() {
            return Err(ModelError::InvalidArgument("prompt is empty".into()).into());
        }
        if r.prompt.len() > MAX_TEXT_BYTES || r.system.len() > MAX_TEXT_BYTES {
            return Err(ModelError::InvalidArgument(format!(
                "prompt and system must be at most {MAX_TEXT_BYTES} bytes"
            ))
            .into());
        }
        let prompt = model.prompt_tokens(&r.prompt, &r.system, r.raw)?;
        if prompt.len() + params.max_tokens > CONTEXT {
            return Err(ModelError::InvalidArgument(format!(
                "prompt has {} tokens; prompt + max_tokens ({}) must be at most {CONTEXT}",
                prompt.len(),
                params.max_tokens
            ))
            .into());
        }
        // Not yet decoding: those waiting for a slot plus those about to take a free one.
        if self.gen_waiting.fetch_add(1, Ordering::AcqRel) >= self.max_waiting + self.slots {
            self.gen_waiting.fetch_sub(1, Ordering::AcqRel);
            return Err(ModelError::Overloaded(name).into());
        }
        let (tx, rx) = tokio::sync::mpsc::channel(64);
        let model = model.clone();
        let slots = self.gen_slots.clone();
        let waiting = self.gen_waiting.clone();
        tokio::spawn(async move {
            let queued = std::time::Instant::now();
            let permit = tokio::select! {
                p = slots.acquire_owned() => p,
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
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn list_models(
        &self,
        _req: Request<ListModelsRequest>,
    ) -> Result<Response<ListModelsResponse>, Status> {
        let mut models: Vec<ModelInfo> = self
            .embedders
            .values()
            .map(|(b, spec)| ModelInfo {
                name: spec.name.clone(),
                kind: spec.kind.clone(),
                path: spec.path.display().to_string(),
                device: "cpu".into(),
                dimension: b.dimension as u32,
                max_sequence_length: b.max_sequence_length as u32,
                state: "ready".into(),
            })
            .collect();
        models.extend(self.generators.values().map(|(_, spec)| ModelInfo {
            name: spec.name.clone(),
            kind: spec.kind.clone(),
            path: spec.path.display().to_string(),
            device: "cpu".into(),
            dimension: 0,
            max_sequence_length: CONTEXT as u32,
            state: "ready".into(),
        }));
        models.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(Response::new(ListModelsResponse { models }))
    }
}

/// Checks and defaults the decoding parameters of a request.
fn gen_params(r: &GenerateRequest) -> Result<GenParams, ModelError> {
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
    if r.stop.len() > MAX_STOPS {
        return Err(bad(format!("at most {MAX_STOPS} stop strings")));
    }
    if r.stop
        .iter()
        .any(|s| s.is_empty() || s.len() > MAX_STOP_BYTES)
    {
        return Err(bad(format!(
            "stop strings must be 1 to {MAX_STOP_BYTES} bytes"
        )));
    }
    Ok(GenParams {
        max_tokens,
        temperature: f64::from(r.temperature),
        top_p: f64::from(top_p),
        stop: r.stop.clone(),
        seed: r.seed,
    })
}

/// Runs one generation on a blocking thread, streaming a message per token; stops when the
/// receiver (the client's stream) is gone.
fn run_generation(
    model: &LlamaGenerator,
    prompt: &[u32],
    params: &GenParams,
    tx: &tokio::sync::mpsc::Sender<Result<GenerateResponse, Status>>,
) {
    let started = std::time::Instant::now();
    let mut first: Option<std::time::Duration> = None;
    let mut pending: Option<GenerateResponse> = None;
    let label = model.name.clone();
    let result = model.generate(prompt, params, |p| {
        first.get_or_insert_with(|| started.elapsed());
        // Each message goes out once the next exists, so the last can carry `finished`.
        let prev = pending.replace(GenerateResponse {
            text: p.text,
            logprob: p.logprob,
            token_id: p.token_id,
            ..Default::default()
        });
        match prev {
            Some(m) => tx.blocking_send(Ok(m)).is_ok(),
            None => !tx.is_closed(),
        }
    });
    match result {
        Ok((finish, tokens)) => {
            let mut last = pending.unwrap_or_default();
            last.finished = true;
            last.finish_reason = finish.as_str().into();
            last.prompt_tokens = prompt.len() as u32;
            last.completion_tokens = tokens as u32;
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
            let _ = tx.blocking_send(Err(e.into()));
        }
    }
}
