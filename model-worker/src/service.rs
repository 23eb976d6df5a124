//! `ragcluster.v1.ModelWorker` over gRPC.

use std::collections::HashMap;
use std::pin::Pin;

use futures::Stream;
use ragcluster_proto::v1::model_worker_server::ModelWorker;
use ragcluster_proto::v1::*;
use tonic::{Request, Response, Status};

use crate::backend::cpu::BertEmbedder;
use crate::batcher::EmbedBatcher;
use crate::config::{ModelSpec, ModelWorkerConfig};
use crate::error::ModelError;

/// Texts per Embed call.
pub const MAX_TEXTS: usize = 256;
/// Bytes per text (longer input is truncated to the model's token limit anyway).
pub const MAX_TEXT_BYTES: usize = 1 << 20;

pub struct ModelWorkerService {
    embedders: HashMap<String, (EmbedBatcher, ModelSpec)>,
    default_embed: String,
}

impl ModelWorkerService {
    pub fn load(cfg: &ModelWorkerConfig) -> Result<Self, ModelError> {
        let mut embedders = HashMap::new();
        let mut default_embed = String::new();
        for spec in &cfg.models {
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
        _req: Request<GenerateRequest>,
    ) -> Result<Response<Self::GenerateStream>, Status> {
        Err(Status::unimplemented(
            "Generate is not served by this model worker version",
        ))
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
        models.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(Response::new(ListModelsResponse { models }))
    }
}
