//! The ingest pipeline end to end as a user runs it: `ragctl ingest` of a BEIR corpus into a
//! local cluster (chunking, Embed calls, per-shard Raft writes, indexing), run twice. The first
//! pass embeds every chunk with the model; the second writes the same corpus into a second
//! collection while the coordinator's embedding cache holds every chunk's vector, so it is the
//! same pipeline with the model excluded. For each pass: chunks/s, the summed stage times,
//! how busy the model worker's device was (its `model_device_seconds` over the wall time, and
//! `nvidia-smi`'s utilisation samples where there is one), the CPU each process used, and how
//! long a query's one-text Embed call waited on the model worker meanwhile (`query_embed`).

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use serde_json::{Value, json};

use super::threads::Sample;
use crate::{Cluster, Proc, bin_dir, http_get, latency_summary, metric_sum};

/// Options of `ingest_twice`.
pub struct PipelineOptions<'a> {
    /// A BEIR dataset directory (its `corpus.jsonl`).
    pub dataset: &'a Path,
    /// Only the first N documents (0: all), copied to a temporary corpus.
    pub docs: usize,
    /// The corpus this many times over (1: once). Copy k > 0 of a document gets the id
    /// `ID~k` and the title `TITLE (k)`: the title labels every chunk's embedded text, so each
    /// copy is new work for the model (no embedding-cache hits), as a bigger corpus would be.
    pub copies: usize,
    pub shards: u32,
    /// `ragctl ingest --batch` and `--concurrency`.
    pub batch: usize,
    pub concurrency: usize,
    /// `ragctl ingest --ef-construction` (None: the coordinator's default).
    pub ef_construction: Option<u32>,
    /// Passes with the model excluded, each into a fresh collection (the median is reported).
    pub cached_passes: usize,
    /// After the pass with the model, save its chunks with their vectors here (protobuf
    /// `GetChunksResponse`, the chunks file of `scalebench` and `hnswbench`).
    pub dump_chunks: Option<&'a Path>,
}

/// `nvidia-smi` sampling GPU utilisation every 100 ms until stopped; None without one.
struct GpuSampler(std::process::Child);

impl GpuSampler {
    fn start() -> Option<Self> {
        Command::new("nvidia-smi")
            .args([
                "--query-gpu=utilization.gpu",
                "--format=csv,noheader,nounits",
                "-lms",
                "100",
            ])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .ok()
            .map(Self)
    }

    /// Mean utilisation (%) and the share of samples at or above 70 %.
    fn stop(mut self) -> Value {
        let _ = self.0.kill();
        let Some(out) = self.0.stdout.take() else {
            return Value::Null;
        };
        let samples: Vec<f64> = BufReader::new(out)
            .lines()
            .map_while(Result::ok)
            .filter_map(|l| l.trim().parse().ok())
            .collect();
        let _ = self.0.wait();
        if samples.is_empty() {
            return Value::Null;
        }
        let n = samples.len() as f64;
        json!({
            "samples": samples.len(),
            "mean_utilization_pct": samples.iter().sum::<f64>() / n,
            "share_at_least_70pct": samples.iter().filter(|x| **x >= 70.0).count() as f64 / n,
        })
    }
}

/// A user's queries beside the ingest: a one-text Embed call (a new sentence each time) to
/// the model worker every 20 ms, timed, until stopped. A refused call (a full queue) is
/// counted, not timed, and does not stop the bench.
struct QueryProber {
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<Result<(Vec<f64>, usize)>>,
}

impl QueryProber {
    fn start(worker: &str) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let (flag, addr) = (stop.clone(), worker.to_owned());
        let task = tokio::spawn(async move {
            use ragcluster_proto::v1::EmbedRequest;
            use ragcluster_proto::v1::model_worker_client::ModelWorkerClient;
            let mut c = ModelWorkerClient::connect(addr).await?;
            let (mut lat, mut refused) = (Vec::new(), 0);
            let mut i = 0u64;
            while !flag.load(Ordering::Relaxed) {
                i += 1;
                let t = Instant::now();
                let answer = c
                    .embed(EmbedRequest {
                        texts: vec![format!("question {i}: how do cells sense low oxygen?")],
                        ..Default::default()
                    })
                    .await;
                match answer {
                    Ok(_) => lat.push(t.elapsed().as_secs_f64() * 1e3),
                    Err(s) if s.code() == tonic::Code::ResourceExhausted => refused += 1,
                    Err(s) => return Err(s.into()),
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Ok((lat, refused))
        });
        Self { stop, task }
    }

    /// n/p50/p99/max of the answered calls' latency (ms), and the refusals.
    async fn stop(self) -> Result<Value> {
        self.stop.store(true, Ordering::Relaxed);
        let (lat, refused) = self.task.await??;
        let mut out = latency_summary(lat);
        out["refused"] = json!(refused);
        Ok(out)
    }
}

/// The model worker's encoder counters (its Prometheus page), to difference across a pass.
struct WorkerCounters {
    /// Summed forward time of the encoder thread.
    device_s: f64,
    forwards: f64,
    sequences: f64,
    tokens: f64,
    /// Summed time Embed requests waited for the encoder thread, and how many waited.
    queue_s: f64,
    requests: f64,
}

impl WorkerCounters {
    fn read(page: &str) -> Self {
        Self {
            device_s: metric_sum(page, "model_device_seconds_sum"),
            forwards: metric_sum(page, "model_device_seconds_count"),
            sequences: metric_sum(page, "model_batch_size_sum"),
            tokens: metric_sum(page, "model_tokens_total"),
            queue_s: metric_sum(page, "model_queue_seconds_sum"),
            requests: metric_sum(page, "model_queue_seconds_count"),
        }
    }
}

fn cpu(p: &Proc) -> f64 {
    p.cpu_seconds().unwrap_or(0.0)
}

/// One `ragctl ingest` pass into `collection`.
async fn pass(
    cluster: &Cluster,
    corpus_dir: &Path,
    collection: &str,
    o: &PipelineOptions<'_>,
) -> Result<Value> {
    let worker_metrics = || async {
        let page = http_get(&cluster.model_worker.metrics).await?;
        anyhow::Ok(WorkerCounters::read(&page))
    };
    let cache_hits = || async {
        let page = http_get(&cluster.coordinator.metrics).await?;
        anyhow::Ok(metric_sum(&page, "coordinator_embed_cache_hits_total"))
    };
    let w0 = worker_metrics().await?;
    let hits0 = cache_hits().await?;
    let cpu0 = (
        cpu(&cluster.coordinator),
        cluster.shards.iter().map(cpu).sum::<f64>(),
        cpu(&cluster.model_worker),
    );
    let shard_pids: Vec<u32> = cluster.shards.iter().filter_map(Proc::pid).collect();
    let threads0 = Sample::take_all(&shard_pids);
    let gpu = GpuSampler::start();
    let prober = QueryProber::start(&cluster.model_worker.grpc);
    let t = Instant::now();
    let mut ragctl = Command::new(bin_dir().join("ragctl"));
    ragctl
        .args(["--coordinator", &cluster.coordinator.grpc, "ingest"])
        .arg(corpus_dir)
        .args([
            "--collection",
            collection,
            "--shards",
            &o.shards.to_string(),
            "--batch",
            &o.batch.to_string(),
            "--concurrency",
            &o.concurrency.to_string(),
            "--json",
        ])
        .args(
            o.ef_construction
                .map(|e| ["--ef-construction".to_owned(), e.to_string()])
                .into_iter()
                .flatten(),
        );
    let out = tokio::task::spawn_blocking(move || ragctl.output()).await??;
    let wall = t.elapsed().as_secs_f64();
    let gpu = gpu.map_or(Value::Null, GpuSampler::stop);
    let query_embed = prober.stop().await?;
    let shard_threads = threads0.until(&Sample::take_all(&shard_pids));
    anyhow::ensure!(
        out.status.success(),
        "ragctl ingest: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let mut summary: Value = serde_json::from_slice(&out.stdout).context("ragctl ingest --json")?;
    let w1 = worker_metrics().await?;
    let hits = cache_hits().await? - hits0;
    let chunks = summary["chunks"].as_f64().unwrap_or(0.0);
    summary["wall_s_with_process_start"] = json!(wall);
    summary["embed_cache_hits"] = json!(hits);
    let per = |a: f64, b: f64| if b > 0.0 { a / b } else { 0.0 };
    let forwards = w1.forwards - w0.forwards;
    summary["model_worker"] = json!({
        "device_busy_share": (w1.device_s - w0.device_s) / wall,
        "tokens": w1.tokens - w0.tokens,
        "forwards": forwards,
        "sequences_per_forward": per(w1.sequences - w0.sequences, forwards),
        "ms_per_forward": 1e3 * per(w1.device_s - w0.device_s, forwards),
        "queue_ms_per_request": 1e3 * per(w1.queue_s - w0.queue_s, w1.requests - w0.requests),
        "cpu_s": cpu(&cluster.model_worker) - cpu0.2,
    });
    summary["gpu"] = gpu;
    summary["query_embed"] = query_embed;
    // Where the shard nodes' CPU went, by thread name, summed over the nodes.
    summary["shard_node_threads"] = shard_threads;
    summary["cpu_s"] = json!({
        "coordinator": cpu(&cluster.coordinator) - cpu0.0,
        "shard_nodes": cluster.shards.iter().map(cpu).sum::<f64>() - cpu0.1,
    });
    summary["cpu_ms_per_chunk_data_path"] = json!(
        1e3 * (cpu(&cluster.coordinator) - cpu0.0 + cluster.shards.iter().map(cpu).sum::<f64>()
            - cpu0.1)
            / chunks.max(1.0)
    );
    Ok(summary)
}

/// The worker's embed model as it advertises itself: where it runs and the batch limits in
/// effect (`max_batch_tokens` 0 in the config resolves by device), so a run says what it ran.
async fn embed_model(worker: &str) -> Result<Value> {
    let m = crate::embed_model_info(worker).await?;
    Ok(json!({
        "name": m.name,
        "device": m.device,
        "max_batch": m.max_batch,
        "max_batch_tokens": m.max_batch_tokens,
    }))
}

/// `lines` (BEIR corpus rows) `copies` times over: copy k > 0 of each row with the id `ID~k`
/// and the title `TITLE (k)`.
fn copied(lines: &[&str], copies: usize) -> Result<String> {
    let mut out = String::new();
    for k in 0..copies.max(1) {
        for line in lines.iter().filter(|l| !l.trim().is_empty()) {
            if k == 0 {
                out.push_str(line);
            } else {
                let mut v: Value = serde_json::from_str(line).context("corpus row")?;
                let id = match &v["_id"] {
                    Value::String(s) => s.clone(),
                    other => other.to_string(),
                };
                v["_id"] = json!(format!("{id}~{k}"));
                let title = v["title"].as_str().unwrap_or_default().to_owned();
                v["title"] = json!(format!("{title} ({k})"));
                out.push_str(&v.to_string());
            }
            out.push('\n');
        }
    }
    Ok(out)
}

/// Ingests the corpus with the model (`with_model`) and again into fresh collections with
/// every vector cached (`model_excluded`: the median pass by chunks/s).
pub async fn ingest_twice(cluster: &Cluster, o: &PipelineOptions<'_>) -> Result<Value> {
    let tmp = tempfile::tempdir()?;
    let corpus_dir = if o.docs == 0 && o.copies <= 1 {
        o.dataset.to_path_buf()
    } else {
        let text = std::fs::read_to_string(o.dataset.join("corpus.jsonl"))?;
        let take = if o.docs == 0 { usize::MAX } else { o.docs };
        let head: Vec<&str> = text.lines().take(take).collect();
        let corpus = copied(&head, o.copies)?;
        std::fs::write(tmp.path().join("corpus.jsonl"), corpus)?;
        tmp.path().to_path_buf()
    };
    let with_model = pass(cluster, &corpus_dir, "pipeline-model", o).await?;
    eprintln!("with the model: {with_model}");
    if let Some(path) = o.dump_chunks {
        let text = std::fs::read_to_string(corpus_dir.join("corpus.jsonl"))?;
        let ids: Vec<String> = text
            .lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .filter_map(|v| match &v["_id"] {
                Value::String(s) => Some(s.clone()),
                Value::Null => None,
                other => Some(other.to_string()),
            })
            .collect();
        let nodes: Vec<String> = cluster.shards.iter().map(|p| p.grpc.clone()).collect();
        let chunks = super::scale::fetch_chunks(&nodes, "pipeline-model", o.shards, &ids).await?;
        eprintln!("saving {} chunks to {}", chunks.len(), path.display());
        let msg = ragcluster_proto::v1::GetChunksResponse { chunks };
        std::fs::write(path, prost::Message::encode_to_vec(&msg))?;
    }
    let mut runs = Vec::new();
    for i in 0..o.cached_passes.max(1) {
        let r = pass(cluster, &corpus_dir, &format!("pipeline-cached-{i}"), o).await?;
        eprintln!("model excluded: {r}");
        runs.push(r);
    }
    let embed_model = embed_model(&cluster.model_worker.grpc).await?;
    let rate = |r: &Value| r["chunks_per_s"].as_f64().unwrap_or(0.0);
    let mut order: Vec<usize> = (0..runs.len()).collect();
    order.sort_by(|a, b| rate(&runs[*a]).total_cmp(&rate(&runs[*b])));
    let model_excluded = runs[order[order.len() / 2]].clone();
    let rates: Vec<f64> = runs.iter().map(rate).collect();
    Ok(json!({
        "dataset": o.dataset.display().to_string(),
        "docs_limit": o.docs,
        "copies": o.copies.max(1),
        "shards": o.shards,
        "shard_nodes": cluster.shards.len(),
        "batch": o.batch,
        "concurrency": o.concurrency,
        "embed_model": embed_model,
        "with_model": with_model,
        "model_excluded": model_excluded,
        "model_excluded_chunks_per_s_each_pass": rates,
    }))
}
