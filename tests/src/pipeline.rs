//! The ingest pipeline end to end as a user runs it: `ragctl ingest` of a BEIR corpus into a
//! local cluster (chunking, Embed calls, per-shard Raft writes, indexing), run twice. The first
//! pass embeds every chunk with the model; the second writes the same corpus into a second
//! collection while the coordinator's embedding cache holds every chunk's vector, so it is the
//! same pipeline with the model excluded. For each pass: chunks/s, the summed stage times,
//! how busy the model worker's device was (its `model_device_seconds` over the wall time, and
//! `nvidia-smi`'s utilisation samples where there is one), and the CPU each process used.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Instant;

use anyhow::{Context, Result};
use serde_json::{Value, json};

use crate::{Cluster, Proc, bin_dir, http_get, metric_sum};

/// Options of `ingest_twice`.
pub struct PipelineOptions<'a> {
    /// A BEIR dataset directory (its `corpus.jsonl`).
    pub dataset: &'a Path,
    /// Only the first N documents (0: all), copied to a temporary corpus.
    pub docs: usize,
    pub shards: u32,
    /// `ragctl ingest --batch` and `--concurrency`.
    pub batch: usize,
    pub concurrency: usize,
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
        anyhow::Ok((
            metric_sum(&page, "model_device_seconds_sum"),
            metric_sum(&page, "model_tokens_total"),
        ))
    };
    let cache_hits = || async {
        let page = http_get(&cluster.coordinator.metrics).await?;
        anyhow::Ok(metric_sum(&page, "coordinator_embed_cache_hits_total"))
    };
    let (device0, tokens0) = worker_metrics().await?;
    let hits0 = cache_hits().await?;
    let cpu0 = (
        cpu(&cluster.coordinator),
        cluster.shards.iter().map(cpu).sum::<f64>(),
        cpu(&cluster.model_worker),
    );
    let gpu = GpuSampler::start();
    let t = Instant::now();
    let out = Command::new(bin_dir().join("ragctl"))
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
        .output()?;
    let wall = t.elapsed().as_secs_f64();
    let gpu = gpu.map_or(Value::Null, GpuSampler::stop);
    anyhow::ensure!(
        out.status.success(),
        "ragctl ingest: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let mut summary: Value = serde_json::from_slice(&out.stdout).context("ragctl ingest --json")?;
    let (device1, tokens1) = worker_metrics().await?;
    let hits = cache_hits().await? - hits0;
    let chunks = summary["chunks"].as_f64().unwrap_or(0.0);
    summary["wall_s_with_process_start"] = json!(wall);
    summary["embed_cache_hits"] = json!(hits);
    summary["model_worker"] = json!({
        "device_busy_share": (device1 - device0) / wall,
        "tokens": tokens1 - tokens0,
        "cpu_s": cpu(&cluster.model_worker) - cpu0.2,
    });
    summary["gpu"] = gpu;
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

/// Ingests the corpus with the model (`with_model`) and again into fresh collections with
/// every vector cached (`model_excluded`: the median pass by chunks/s).
pub async fn ingest_twice(cluster: &Cluster, o: &PipelineOptions<'_>) -> Result<Value> {
    let tmp = tempfile::tempdir()?;
    let corpus_dir = if o.docs == 0 {
        o.dataset.to_path_buf()
    } else {
        let text = std::fs::read_to_string(o.dataset.join("corpus.jsonl"))?;
        let head: Vec<&str> = text.lines().take(o.docs).collect();
        std::fs::write(tmp.path().join("corpus.jsonl"), head.join("\n") + "\n")?;
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
        let chunks = crate::scale::fetch_chunks(&nodes, "pipeline-model", o.shards, &ids).await?;
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
    let rate = |r: &Value| r["chunks_per_s"].as_f64().unwrap_or(0.0);
    let mut order: Vec<usize> = (0..runs.len()).collect();
    order.sort_by(|a, b| rate(&runs[*a]).total_cmp(&rate(&runs[*b])));
    let model_excluded = runs[order[order.len() / 2]].clone();
    let rates: Vec<f64> = runs.iter().map(rate).collect();
    Ok(json!({
        "dataset": o.dataset.display().to_string(),
        "docs_limit": o.docs,
        "shards": o.shards,
        "shard_nodes": cluster.shards.len(),
        "batch": o.batch,
        "concurrency": o.concurrency,
        "with_model": with_model,
        "model_excluded": model_excluded,
        "model_excluded_chunks_per_s_each_pass": rates,
    }))
}
