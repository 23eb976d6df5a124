//! The model worker as the coordinator calls it: embeddings (batched, several calls in
//! flight), reranking, streamed generation and the list of served models. An unreachable
//! worker is `UNAVAILABLE` with a retry hint. Calls go to the worker serving the model with
//! the fewest tokens outstanding; one that cannot be reached is passed over and an idempotent
//! call (embed, rerank, list) or a stream not yet started goes to another.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::{Mutex, RwLock};

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

/// A registered model worker (from the member table).
#[derive(Debug, Clone)]
pub struct Worker {
    pub address: String,
    pub models: Vec<String>,
}

/// How long a worker that failed a call is passed over.
const DOWN_FOR: Duration = Duration::from_secs(2);

pub struct Models {
    /// `model_worker` from the config: used while no worker has registered at that address.
    seed: String,
    channels: Arc<Channels>,
    embed: EmbedOptions,
    /// UP workers of the member table.
    workers: RwLock<Vec<Worker>>,
    /// Estimated tokens in flight per worker address.
    outstanding: Mutex<HashMap<String, Arc<AtomicU64>>>,
    down_until: Mutex<HashMap<String, Instant>>,
}

/// Counts a call's tokens as outstanding on its worker until dropped.
struct Outstanding(Arc<AtomicU64>, u64);

impl Drop for Outstanding {
    fn drop(&mut self) {
        self.0.fetch_sub(self.1, Ordering::Relaxed);
    }
}

/// A rough token count (4 bytes a token) for balancing, never for limits.
fn tokens(texts: &[&str]) -> u64 {
    texts.iter().map(|t| t.len() as u64 / 4 + 1).sum()
}

/// Whether another worker may succeed where this one failed: it could not be reached or is
/// going away, not a wrong request.
fn worth_another(e: &CoordError) -> bool {
    matches!(e, CoordError::Unavailable { .. })
}

impl Models {
    pub fn new(seed: String, channels: Arc<Channels>, embed: EmbedOptions) -> Self {
        Self {
            seed,
            channels,
            embed,
            workers: RwLock::new(Vec::new()),
            outstanding: Mutex::default(),
            down_until: Mutex::default(),
        }
    }

    /// Replaces the registered workers (the member table changed).
    pub fn set_workers(&self, workers: Vec<Worker>) {
        *self.workers.write() = workers;
    }

    /// Every worker calls may go to: the registered ones, and the configured address unless
    /// a registered worker holds it.
    pub fn addresses(&self) -> Vec<String> {
        let mut v: Vec<String> = self
            .workers
            .read()
            .iter()
            .map(|w| w.address.clone())
            .collect();
        if !self.seed.is_empty() && !v.contains(&self.seed) {
            v.push(self.seed.clone());
        }
        v
    }

    fn load(&self, addr: &str) -> u64 {
        self.outstanding
            .lock()
            .get(addr)
            .map_or(0, |c| c.load(Ordering::Relaxed))
    }

    fn is_down(&self, addr: &str) -> bool {
        self.down_until
            .lock()
            .get(addr)
            .is_some_and(|t| *t > Instant::now())
    }

    fn mark_down(&self, addr: &str) {
        metrics::counter!("coordinator_model_worker_failovers_total").increment(1);
        self.down_until
            .lock()
            .insert(addr.to_owned(), Instant::now() + DOWN_FOR);
    }

    /// The worker serving `model` ("" = any) with the fewest tokens outstanding, healthy
    /// ones first, none of `tried`.
    fn pick(&self, model: &str, tried: &[String]) -> Option<String> {
        let registered = self.workers.read();
        let serving = registered
            .iter()
            .filter(|w| model.is_empty() || w.models.iter().any(|m| m == model))
            .map(|w| w.address.as_str());
        // The configured address serves whatever it serves, unless a registered worker holds it.
        let seed = (!self.seed.is_empty() && !registered.iter().any(|w| w.address == self.seed))
            .then_some(self.seed.as_str());
        serving
            .chain(seed)
            .filter(|a| !tried.iter().any(|t| t == a))
            .min_by_key(|a| (self.is_down(a), self.load(a)))
            .map(str::to_owned)
    }

    fn track(&self, addr: &str, tokens: u64) -> Outstanding {
        let c = self
            .outstanding
            .lock()
            .entry(addr.to_owned())
            .or_default()
            .clone();
        c.fetch_add(tokens, Ordering::Relaxed);
        Outstanding(c, tokens)
    }

    fn client(&self, addr: &str) -> Result<ModelWorkerClient<Channel>> {
        Ok(ModelWorkerClient::new(self.channels.get(addr)?)
            .max_decoding_message_size(MAX_MESSAGE)
            .max_encoding_message_size(MAX_MESSAGE))
    }

    /// Runs an idempotent call on the least loaded worker serving `model`; when that worker
    /// cannot be reached it is passed over for a while and the call goes to another one.
    async fn with_worker<T, F, Fut>(
        &self,
        model: &str,
        tokens: u64,
        f: F,
    ) -> Result<(T, Outstanding)>
    where
        F: Fn(ModelWorkerClient<Channel>) -> Fut,
        Fut: std::future::Future<Output = Result<T>>,
    {
        let mut tried = Vec::new();
        loop {
            let Some(addr) = self.pick(model, &tried) else {
                return Err(CoordError::Unavailable {
                    what: "model worker".into(),
                    reason: if tried.is_empty() {
                        format!("no model worker serves {model:?}")
                    } else {
                        format!("every model worker serving {model:?} failed")
                    },
                    retry_after_ms: 500,
                });
            };
            let g = self.track(&addr, tokens);
            match f(self.client(&addr)?).await {
                Err(e) if worth_another(&e) => {
                    tracing::warn!(worker = %addr, error = %e, "model worker failed; trying another");
                    self.mark_down(&addr);
                    tried.push(addr);
                }
                r => return r.map(|v| (v, g)),
            }
        }
    }

    /// Every model the workers serve (the first answer per name).
    pub async fn list(&self, timeout: Duration) -> Result<Vec<ModelInfo>> {
        let addrs = self.addresses();
        let calls = addrs.iter().map(|a| async move {
            let mut c = self.client(a)?;
            call(
                "model worker",
                timeout,
                c.list_models(request(ListModelsRequest {}, timeout)),
            )
            .await
        });
        let mut out: Vec<ModelInfo> = Vec::new();
        let mut last = None;
        for r in futures::future::join_all(calls).await {
            match r {
                Ok(r) => {
                    for m in r.models {
                        if !out.iter().any(|o| o.name == m.name) {
                            out.push(m);
                        }
                    }
                }
                Err(e) => last = Some(e),
            }
        }
        match (out.is_empty(), last) {
            (true, Some(e)) => Err(e),
            _ => Ok(out),
        }
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
                let refs: Vec<&str> = b.iter().map(String::as_str).collect();
                let (r, _) = self
                    .with_worker(model, tokens(&refs), |mut c| {
                        let req = request(
                            EmbedRequest {
                                model: model.to_owned(),
                                texts: b.clone(),
                            },
                            timeout,
                        );
                        async move { call("model worker", timeout, c.embed(req)).await }
                    })
                    .await?;
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
        let mut refs: Vec<&str> = passages.iter().map(String::as_str).collect();
        refs.push(query);
        let req = RerankRequest {
            model: model.to_owned(),
            query: query.to_owned(),
            passages: passages.clone(),
        };
        let (r, _) = self
            .with_worker(model, tokens(&refs), |mut c| {
                let req = request(req.clone(), timeout);
                async move { call("model worker", timeout, c.rerank(req)).await }
            })
            .await?;
        Ok(r.scores)
    }

    /// Starts a streamed generation.
    pub async fn generate(&self, req: GenerateRequest, timeout: Duration) -> Result<Generation> {
        // A started stream is not retried (tokens may have reached the client); its tokens
        // count as outstanding on its worker until it is dropped.
        let mut texts: Vec<&str> = req.history.iter().map(|m| m.content.as_str()).collect();
        texts.extend([req.prompt.as_str(), req.system.as_str()]);
        let max = if req.max_tokens == 0 {
            256
        } else {
            req.max_tokens
        };
        let est = tokens(&texts) + u64::from(max);
        let model = req.model.clone();
        let (stream, load) = self
            .with_worker(&model, est, |mut c| {
                let req = request(req.clone(), timeout);
                async move { call("model worker", timeout, c.generate(req)).await }
            })
            .await?;
        Ok(Generation {
            stream,
            _load: load,
        })
    }
}

/// A streamed generation, counted on its worker while it lives.
pub struct Generation {
    stream: tonic::Streaming<GenerateResponse>,
    _load: Outstanding,
}

impl Generation {
    /// The next message of the stream; `None` at its end.
    pub async fn next(&mut self) -> Option<std::result::Result<GenerateResponse, tonic::Status>> {
        self.stream.next().await
    }
}
