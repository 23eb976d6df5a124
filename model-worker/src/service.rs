//! `ragcluster.v1.ModelWorker` over gRPC: a thin edge over `registry::Registry` that maps
//! `ModelError`s to statuses.

use std::pin::Pin;
use std::sync::Arc;

use futures::{Stream, StreamExt};
use ragcluster_proto::v1::model_worker_server::ModelWorker;
use ragcluster_proto::v1::*;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

use crate::registry::Registry;

pub struct ModelWorkerService {
    reg: Arc<Registry>,
}

impl ModelWorkerService {
    pub fn new(reg: Arc<Registry>) -> Self {
        Self { reg }
    }
}

type GenStream = Pin<Box<dyn Stream<Item = Result<GenerateResponse, Status>> + Send>>;

#[tonic::async_trait]
impl ModelWorker for ModelWorkerService {
    async fn embed(&self, req: Request<EmbedRequest>) -> Result<Response<EmbedResponse>, Status> {
        let deadline = ragcluster_common::server::grpc_timeout(req.metadata());
        let r = req.into_inner();
        let input = r.input();
        let out = self.reg.embed(&r.model, r.texts, input, deadline).await?;
        Ok(Response::new(EmbedResponse {
            model: out.model,
            dimension: out.dim as u32,
            embeddings: out
                .vectors
                .into_iter()
                .map(|values| Embedding { values })
                .collect(),
            tokens: out.tokens as u32,
            truncated: out.truncated,
            revision: out.revision,
        }))
    }

    async fn rerank(
        &self,
        req: Request<RerankRequest>,
    ) -> Result<Response<RerankResponse>, Status> {
        let r = req.into_inner();
        let out = self.reg.rerank(&r.model, &r.query, r.passages).await?;
        Ok(Response::new(RerankResponse {
            scores: out.scores,
            model: out.model,
            truncated: out.truncated,
        }))
    }

    type GenerateStream = GenStream;

    async fn generate(
        &self,
        req: Request<GenerateRequest>,
    ) -> Result<Response<Self::GenerateStream>, Status> {
        let rx = self.reg.generate(req.into_inner()).await?;
        let stream = ReceiverStream::new(rx).map(|m| m.map_err(Status::from));
        Ok(Response::new(Box::pin(stream)))
    }

    async fn list_models(
        &self,
        _req: Request<ListModelsRequest>,
    ) -> Result<Response<ListModelsResponse>, Status> {
        Ok(Response::new(ListModelsResponse {
            models: self.reg.models(),
        }))
    }
}
