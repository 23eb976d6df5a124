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
use crate::embed_cache::{EmbedCache, Key};
use crate::error::{CoordError, Result};

/// How ingest and queries embed.
#[derive(Debug, Clone)]
pub struct EmbedOptions {
    /// Texts per Embed call; 0: the model's advertised `max_batch` (one forward pass per
    /// call), `FALLBACK_BATCH` until the workers' models are known.
    pub batch: usize,
    /// Embed calls in flight per request.
    pub concurrency: usize,
    /// Deadline of one Embed call.
    pub timeout: Duration,
    /// Bytes of the embedding cache (`embed_cache`); 0: off.
    pub cache_bytes: usize,
}

/// An Embed call refused for load is sent again for up to this many `timeout`s in all: other
/// calls may take the room a refused one waited for, so one deadline is not always enough
/// during a large ingest into a slow worker.
const BACKLOG_WAIT_DEADLINES: u32 = 5;

/// How long to wait before calling a worker that answered RESOURCE_EXHAUSTED again.
fn backoff(retry_after_ms: u64) -> Duration {
    Duration::from_millis(retry_after_ms.clamp(10, 5_000))
}

/// Texts per Embed call under `batch = 0` while no worker has told its limits.
const FALLBACK_BATCH: usize = 32;
/// Texts per Embed call at most (the worker's `MAX_TEXTS`).
const MAX_EMBED_TEXTS: usize = 256;
/// How often the workers' models (revisions, batch limits) are listed again.
const META_EVERY: Duration = Duration::from_secs(10);
/// Deadline of one such listing.
const META_TIMEOUT: Duration = Duration::from_secs(2);
/// Least time between listings made because a model was not known.
const META_RETRY: Duration = Duration::from_secs(1);
/// Texts of one call hashed beyond this many bytes are hashed off the async workers.
const HASH_INLINE_BYTES: usize = 256 * 1024;

/// What the coordinator knows of a model from the workers serving it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ModelMeta {
    /// The revision every answering worker reported; None when they differ (a model being
    /// replaced) or report none: its vectors are then not cached.
    pub revision: Option<String>,
    /// The smallest advertised `max_batch` among them (0: none advertised).
    pub max_batch: usize,
    /// "embed", "rerank" or "generate", as the first answering worker reported it.
    pub kind: String,
}

/// Joins the model lists of several workers: per model, one revision if all agree.
pub fn merge_meta<'a>(
    lists: impl IntoIterator<Item = &'a [ModelInfo]>,
) -> HashMap<String, ModelMeta> {
    let mut out: HashMap<String, (Option<Option<String>>, usize, String)> = HashMap::new();
    for list in lists {
        for m in list {
            let e = out
                .entry(m.name.clone())
                .or_insert_with(|| (None, 0, m.kind.clone()));
            let rev = (!m.revision.is_empty()).then(|| m.revision.clone());
            e.0 = match e.0.take() {
                None => Some(rev),
                Some(r) if r == rev => Some(r),
                Some(_) => Some(None),
            };
            let b = m.max_batch as usize;
            if b > 0 && (e.1 == 0 || b < e.1) {
                e.1 = b;
            }
        }
    }
    out.into_iter()
        .map(|(name, (rev, max_batch, kind))| {
            (
                name,
                ModelMeta {
                    revision: rev.flatten(),
                    max_batch,
                    kind,
                },
            )
        })
        .collect()
}

/// The revision all of `revisions` name, if they agree on one.
fn one_revision(revisions: &[String]) -> Option<String> {
    let first = revisions.first()?;
    (!first.is_empty() && revisions.iter().all(|r| r == first)).then(|| first.clone())
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
    /// Per model name, from the workers' ListModels (refreshed by `spawn_meta_refresh`).
    meta: RwLock<HashMap<String, ModelMeta>>,
    /// Wakes the refresher early (the worker set changed).
    meta_due: tokio::sync::Notify,
    /// When the models were last listed (an unknown model lists them again, at most once
    /// per `META_RETRY`).
    meta_at: Mutex<Option<Instant>>,
    cache: Option<EmbedCache>,
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

/// The cache keys of `texts`; many bytes are hashed off the async workers.
async fn keys_of(
    model: &str,
    revision: &str,
    texts: Vec<String>,
) -> Result<(Vec<String>, Vec<Key>)> {
    let hash = |model: &str, revision: &str, texts: Vec<String>| {
        let keys = texts
            .iter()
            .map(|t| EmbedCache::key(model, revision, t))
            .collect();
        (texts, keys)
    };
    if texts.iter().map(String::len).sum::<usize>() <= HASH_INLINE_BYTES {
        return Ok(hash(model, revision, texts));
    }
    let (model, revision) = (model.to_owned(), revision.to_owned());
    tokio::task::spawn_blocking(move || hash(&model, &revision, texts))
        .await
        .map_err(|e| CoordError::Catalog(format!("hashing texts: {e}")))
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
            cache: EmbedCache::new(embed.cache_bytes),
            embed,
            workers: RwLock::new(Vec::new()),
            outstanding: Mutex::default(),
            down_until: Mutex::default(),
            meta: RwLock::default(),
            meta_due: tokio::sync::Notify::new(),
            meta_at: Mutex::new(None),
        }
    }

    /// Replaces the registered workers (the member table changed).
    pub fn set_workers(&self, workers: Vec<Worker>) {
        let changed = {
            let mut w = self.workers.write();
            let changed = w
                .iter()
                .map(|w| (&w.address, &w.models))
                .ne(workers.iter().map(|w| (&w.address, &w.models)));
            *w = workers;
            changed
        };
        if changed {
            self.meta_due.notify_one();
        }
    }

    /// What is known of `model` from the workers (None before they first answered).
    pub fn meta(&self, model: &str) -> Option<ModelMeta> {
        self.meta.read().get(model).cloned()
    }

    /// The embedding cache's entries and bytes (None when off).
    pub fn cache_usage(&self) -> Option<(usize, usize)> {
        self.cache.as_ref().map(EmbedCache::usage)
    }

    /// Lists the workers' models now. A worker that does not answer keeps nothing of its
    /// models: a model only it serves is dropped until it answers (no revision, no caching).
    pub async fn refresh_meta(&self) {
        *self.meta_at.lock() = Some(Instant::now());
        let answers = self.list_each(META_TIMEOUT).await;
        let lists: Vec<Vec<ModelInfo>> = answers.into_iter().filter_map(|(_, r)| r.ok()).collect();
        let merged = merge_meta(lists.iter().map(Vec::as_slice));
        *self.meta.write() = merged;
    }

    /// Keeps `meta` current: every `META_EVERY`, and at once when the worker set changes.
    /// Runs until the runtime stops.
    pub fn spawn_meta_refresh(self: &Arc<Self>) -> tokio::task::JoinHandle<()> {
        let me = self.clone();
        tokio::spawn(async move {
            loop {
                me.refresh_meta().await;
                tokio::select! {
                    _ = tokio::time::sleep(META_EVERY) => {}
                    _ = me.meta_due.notified() => {}
                }
            }
        })
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

    /// The worker serving `model` ("" = its default model of `kind`: any worker serving a
    /// model of that kind) with the fewest tokens outstanding, healthy ones first, none of
    /// `tried`.
    fn pick(&self, model: &str, kind: &str, tried: &[String]) -> Option<String> {
        let registered = self.workers.read();
        let meta = self.meta.read();
        // A model whose kind is not known yet (not listed) may be of any kind.
        let of_kind = |m: &String| {
            meta.get(m)
                .is_none_or(|mm| mm.kind.is_empty() || mm.kind == kind)
        };
        let serving = registered
            .iter()
            .filter(|w| {
                if model.is_empty() {
                    w.models.iter().any(of_kind)
                } else {
                    w.models.iter().any(|m| m == model)
                }
            })
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
        kind: &str,
        tokens: u64,
        f: F,
    ) -> Result<(T, Outstanding)>
    where
        F: Fn(ModelWorkerClient<Channel>) -> Fut,
        Fut: std::future::Future<Output = Result<T>>,
    {
        let mut tried = Vec::new();
        loop {
            let Some(addr) = self.pick(model, kind, &tried) else {
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

    /// Each worker's models, or why it did not answer.
    async fn list_each(&self, timeout: Duration) -> Vec<(String, Result<Vec<ModelInfo>>)> {
        let addrs = self.addresses();
        let calls = addrs.into_iter().map(|a| async move {
            let r = async {
                let mut c = self.client(&a)?;
                call(
                    "model worker",
                    timeout,
                    c.list_models(request(ListModelsRequest {}, timeout)),
                )
                .await
            }
            .await;
            (a, r.map(|r| r.models))
        });
        futures::future::join_all(calls).await
    }

    /// Every model the workers serve (the first answer per name).
    pub async fn list(&self, timeout: Duration) -> Result<Vec<ModelInfo>> {
        let mut out: Vec<ModelInfo> = Vec::new();
        let mut last = None;
        for (_, r) in self.list_each(timeout).await {
            match r {
                Ok(models) => {
                    for m in models {
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

    /// Texts per Embed call for `model` (see `EmbedOptions::batch`).
    fn batch_for(&self, meta: Option<&ModelMeta>) -> usize {
        match (self.embed.batch, meta) {
            (0, Some(m)) if m.max_batch > 0 => m.max_batch.min(MAX_EMBED_TEXTS),
            (0, _) => FALLBACK_BATCH,
            (b, _) => b,
        }
    }

    /// Embeds texts with `model`: cached vectors where the cache has them (each distinct text
    /// of the rest embedded once), the rest through the workers, `batch` texts per call with
    /// `concurrency` calls in flight. `input` says whether the texts are queries or documents
    /// (the worker adds the model's task prefix); queries are cached apart from documents.
    pub async fn embed(
        &self,
        model: &str,
        texts: Vec<String>,
        input: EmbedInput,
    ) -> Result<Vec<Vec<f32>>> {
        Ok(self.embed_revised(model, texts, input).await?.0)
    }

    /// As `embed`, with the model revision every vector comes from (None when the workers
    /// reported none, or several: a model being replaced).
    pub async fn embed_revised(
        &self,
        model: &str,
        texts: Vec<String>,
        input: EmbedInput,
    ) -> Result<(Vec<Vec<f32>>, Option<String>)> {
        let mut meta = self.meta(model);
        // A model not listed yet (just started, a worker just joined): list now, not in 10 s.
        let retry = self
            .meta_at
            .lock()
            .is_none_or(|t| t.elapsed() >= META_RETRY);
        if meta.is_none() && retry {
            self.refresh_meta().await;
            meta = self.meta(model);
        }
        let batch = self.batch_for(meta.as_ref());
        let (Some(_), Some(revision)) = (&self.cache, meta.and_then(|m| m.revision)) else {
            let (vectors, revisions) = self.embed_calls(model, texts, input, batch).await?;
            return Ok((vectors, one_revision(&revisions)));
        };
        // A query's vector is keyed apart (revisions are hex: no document key is "…/query").
        let keyed = match input {
            EmbedInput::Query => format!("{revision}/query"),
            _ => revision.clone(),
        };
        let (texts, keys) = keys_of(model, &keyed, texts).await?;
        let cache = self.cache.as_ref().expect("checked above");
        let mut out: Vec<Option<Arc<[f32]>>> = cache.get_many(&keys);
        // The misses, each distinct text once, and where each answer goes.
        let mut todo: Vec<String> = Vec::new();
        let mut answered = Some(revision.clone());
        let mut todo_keys: Vec<Key> = Vec::new();
        let mut slot_of: HashMap<Key, usize> = HashMap::new();
        let mut wanted: Vec<(usize, usize)> = Vec::new();
        for (i, (text, key)) in texts.into_iter().zip(&keys).enumerate() {
            if out[i].is_some() {
                continue;
            }
            let slot = *slot_of.entry(*key).or_insert_with(|| {
                todo.push(text);
                todo_keys.push(*key);
                todo.len() - 1
            });
            wanted.push((i, slot));
        }
        if !todo.is_empty() {
            let (vectors, revisions) = self.embed_calls(model, todo, input, batch).await?;
            let vectors: Vec<Arc<[f32]>> = vectors.into_iter().map(Arc::from).collect();
            // Only vectors of the revision keyed by are kept (a worker replaced meanwhile
            // answers with another).
            if revisions.iter().all(|r| *r == revision) {
                cache.put_many(todo_keys.into_iter().zip(vectors.iter().cloned()));
            } else {
                answered = None;
            }
            for (i, slot) in wanted {
                out[i] = Some(vectors[slot].clone());
            }
        }
        let vectors = out
            .into_iter()
            .map(|v| v.map(|v| v.to_vec()).unwrap_or_default())
            .collect();
        Ok((vectors, answered))
    }

    /// Embeds through the workers, `batch` texts per call with `concurrency` calls in flight;
    /// also returns the revision each call reported.
    async fn embed_calls(
        &self,
        model: &str,
        texts: Vec<String>,
        input: EmbedInput,
        batch: usize,
    ) -> Result<(Vec<Vec<f32>>, Vec<String>)> {
        let n = texts.len();
        let batches: Vec<Vec<String>> =
            texts.chunks(batch.max(1)).map(<[String]>::to_vec).collect();
        let timeout = self.embed.timeout;
        let out: Vec<(Vec<Vec<f32>>, String)> = stream::iter(batches)
            .map(|b| async move {
                let refs: Vec<&str> = b.iter().map(String::as_str).collect();
                let started = Instant::now();
                let r = loop {
                    let r = self
                        .with_worker(model, "embed", tokens(&refs), |mut c| {
                            let req = request(
                                EmbedRequest {
                                    model: model.to_owned(),
                                    texts: b.clone(),
                                    input: input.into(),
                                },
                                timeout,
                            );
                            async move { call("model worker", timeout, c.embed(req)).await }
                        })
                        .await;
                    // A worker with more queued than it can do within the deadline (or a
                    // full queue) says when to come back: the call waits that out, for
                    // `BACKLOG_WAIT_DEADLINES` deadlines in all, instead of failing the
                    // whole request.
                    match r {
                        Err(CoordError::Overloaded { retry_after_ms, .. })
                            if started.elapsed() + backoff(retry_after_ms)
                                < timeout * BACKLOG_WAIT_DEADLINES =>
                        {
                            metrics::counter!("coordinator_embed_backlog_waits_total").increment(1);
                            tokio::time::sleep(backoff(retry_after_ms)).await;
                        }
                        r => break r?.0,
                    }
                };
                let vectors = r.embeddings.into_iter().map(|e| e.values).collect();
                Ok::<_, CoordError>((vectors, r.revision))
            })
            .buffered(self.embed.concurrency.max(1))
            .try_collect()
            .await?;
        let (vectors, revisions): (Vec<Vec<Vec<f32>>>, Vec<String>) = out.into_iter().unzip();
        let out: Vec<Vec<f32>> = vectors.into_iter().flatten().collect();
        if out.len() != n {
            return Err(CoordError::Unavailable {
                what: "model worker".into(),
                reason: format!("returned {} embeddings for {n} texts", out.len()),
                retry_after_ms: 100,
            });
        }
        Ok((out, revisions))
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
            .with_worker(model, "rerank", tokens(&refs), |mut c| {
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
            .with_worker(&model, "generate", est, |mut c| {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn info(name: &str, revision: &str, max_batch: u32) -> ModelInfo {
        ModelInfo {
            name: name.into(),
            kind: "embed".into(),
            revision: revision.into(),
            max_batch,
            ..Default::default()
        }
    }

    #[test]
    fn a_model_is_cached_only_while_its_workers_agree_on_its_revision() {
        let a = vec![info("mini", "r1", 64), info("gen", "", 0)];
        let b = vec![info("mini", "r1", 256)];
        let m = merge_meta([a.as_slice(), b.as_slice()]);
        assert_eq!(
            m["mini"],
            ModelMeta {
                revision: Some("r1".into()),
                max_batch: 64,
                kind: "embed".into(),
            },
            "one revision; calls sized for the smallest batch"
        );
        assert_eq!(m["gen"].revision, None, "no revision reported");
        // A worker with other weights under the same name (a model being replaced).
        let c = vec![info("mini", "r2", 64)];
        let m = merge_meta([a.as_slice(), c.as_slice(), b.as_slice()]);
        assert_eq!(m["mini"].revision, None);
        // One that reports none.
        let d = vec![info("mini", "", 64)];
        assert_eq!(
            merge_meta([a.as_slice(), d.as_slice()])["mini"].revision,
            None
        );
    }

    #[test]
    fn a_call_naming_no_model_goes_to_a_worker_serving_its_kind() {
        let models = Models::new(
            String::new(),
            Arc::new(Channels::new(None)),
            EmbedOptions {
                batch: 0,
                concurrency: 1,
                timeout: Duration::from_secs(1),
                cache_bytes: 0,
            },
        );
        let worker = |address: &str, models: &[&str]| Worker {
            address: address.into(),
            models: models.iter().map(|m| m.to_string()).collect(),
        };
        models.set_workers(vec![
            worker("http://reranker", &["qwen-llm"]),
            worker("http://generator", &["qwen", "mini"]),
        ]);
        // Before the workers were listed, any worker may take it.
        assert!(models.pick("", "generate", &[]).is_some());
        let kind = |name: &str, kind: &str| ModelInfo {
            name: name.into(),
            kind: kind.into(),
            ..Default::default()
        };
        let lists = [
            vec![kind("qwen-llm", "rerank")],
            vec![kind("qwen", "generate"), kind("mini", "embed")],
        ];
        *models.meta.write() = merge_meta(lists.iter().map(Vec::as_slice));
        for _ in 0..4 {
            assert_eq!(
                models.pick("", "generate", &[]).as_deref(),
                Some("http://generator")
            );
        }
        assert_eq!(
            models.pick("", "rerank", &[]).as_deref(),
            Some("http://reranker")
        );
        assert_eq!(
            models.pick("qwen-llm", "rerank", &[]).as_deref(),
            Some("http://reranker")
        );
        let tried = ["http://generator".to_string()];
        assert_eq!(models.pick("", "generate", &tried), None);
    }
}
