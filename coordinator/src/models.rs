//! The model worker as the coordinator calls it: embeddings (batched, several calls in
//! flight), reranking, streamed generation and the list of served models. An unreachable
//! worker is `UNAVAILABLE` with a retry hint.

use std::sync::Arc;
use std::time::Duration;

use futures::stream::{self, StreamExt, TryStreamExt};
use ragcluster_proto::v1::model_worker_client::ModelWorkerClient;
use ragcluster_proto::v1::*;
use tonic::transport::Channel;

use crate::channels::{Channels, MAX_MESSAGE, call, request};
use crate::error::{CoordError, Result};

/// How ingest and queries embed.
#[derive(Debug, Clone)]
pub struct EmbedOptions {
    /// Texts per Embed call.
    pub batch: usize,
    /// Embed calls in flight per request.
    pub concurrency: usize,
    /// Deadline of one Embed call.
    pub timeout: Duration,
}

pub struct Models {
    address: String,
    channels: Arc<Channels>,
    embed: EmbedOptions,
}

impl Models {
    pub fn new(address: String, channels: Arc<Channels>, embed: EmbedOptions) -> Self {
        Self {
            address,
            channels,
            embed,
        }
    }

    pub fn address(&self) -> &str {
        &self.address
    }

    fn client(&self) -> Result<ModelWorkerClient<Channel>> {
        Ok(ModelWorkerClient::new(self.channels.get(&self.address)?)
            .max_decoding_message_size(MAX_MESSAGE)
            .max_encoding_message_size(MAX_MESSAGE))
    }

    pub async fn list(&self, timeout: Duration) -> Result<Vec<ModelInfo>> {
        let mut c = self.client()?;
        let r = call(
            "model worker",
            timeout,
            c.list_models(request(ListModelsRequest {}, timeout)),
        )
        .await?;
        Ok(r.models)
    }

    /// Embeds texts with `model`, `batch` at a time with `concurrency` calls in flight.
    pub async fn embed(&self, model: &str, texts: Vec<String>) -> Result<Vec<Vec<f32>>> {
        let n = texts.len();
        let batches: Vec<Vec<String>> = texts
            .chunks(self.embed.batch.max(1))
            .map(<[String]>::to_vec)
            .collect();
        let timeout = self.embed.timeout;
        let out: Vec<Vec<Vec<f32>>> = stream::iter(batches)
            .map(|b| async move {
                let mut c = self.client()?;
                let req = request(
                    EmbedRequest {
                        model: model.to_owned(),
                        texts: b,
                    },
                    timeout,
                );
                let r = call("model worker", timeout, c.embed(req)).await?;
                Ok::<_, CoordError>(r.embeddings.into_iter().map(|e| e.values).collect())
            })
            .buffered(self.embed.concurrency.max(1))
            .try_collect()
            .await?;
        let out: Vec<Vec<f32>> = out.into_iter().flatten().collect();
        if out.len() != n {
            return Err(CoordError::Unavailable {
                what: "model worker".into(),
                reason: format!("returned {} embeddings for {n} texts", out.len()),
                retry_after_ms: 100,
            });
        }
        Ok(out)
    }

    /// One score per passage, in the given order.
    pub async fn rerank(
        &self,
        model: &str,
        query: &str,
        passages: Vec<String>,
        timeout: Duration,
    ) -> Result<Vec<f32>> {
        let mut c = self.client()?;
        let req = RerankRequest {
            model: model.to_owned(),
            query: query.to_owned(),
            passages,
        };
        let r = call("model worker", timeout, c.rerank(request(req, timeout))).await?;
        Ok(r.scores)
    }

    /// Starts a streamed generation.
    pub async fn generate(
        &self,
        req: GenerateRequest,
        timeout: Duration,
    ) -> Result<tonic::Streaming<GenerateResponse>> {
        let mut c = self.client()?;
        call("model worker", timeout, c.generate(request(req, timeout))).await
    }
}
