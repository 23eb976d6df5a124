//! Embedding throughput on this machine, side by side in one run:
//! 1. all-MiniLM-L6-v2 forward passes in-process (our candle encoder) at batch 1, 8, 32, 128
//!    vs sentence-transformers (PyTorch, same model directory, same texts, same threads) when
//!    a Python with sentence_transformers is given (`--python`, default `python3`).
//! 2. A model-worker process under `--clients` concurrent single-text clients, dynamic
//!    batching on vs off: sentences/s and request latency p50/p99.
//!
//! Texts are SciFact passages cut to `--chars` characters (48-98 tokens, mean 66, at 300).
//! Both sides batch the texts longest first (sentence-transformers' encode sorts by length
//! itself). Prints one JSON object.

use std::time::Instant;

use anyhow::{Context, Result};
use clap::Parser;
use model_worker::backend::encoder::bert::{self, BertEncoder, HeadKind};
use model_worker::backend::{Encoder, Seq};
use ragcluster_proto::v1::model_worker_client::ModelWorkerClient;
use ragcluster_tests::bench::workerload::embed_load;
use ragcluster_tests::{Proc, datasets_dir, embed_model, workspace};
use serde_json::json;
use tonic::transport::Channel;

#[derive(Parser)]
struct Args {
    #[arg(long, value_delimiter = ',', default_value = "1,8,32,128")]
    batches: Vec<usize>,
    #[arg(long, default_value_t = 300)]
    chars: usize,
    #[arg(long, default_value_t = 64)]
    clients: usize,
    /// Requests per client in the concurrency phase.
    #[arg(long, default_value_t = 12)]
    requests: usize,
    /// The worker's batch limits in the concurrency phase (0 = its defaults).
    #[arg(long, default_value_t = 0)]
    max_batch: usize,
    #[arg(long, default_value_t = 0)]
    max_batch_tokens: usize,
    /// Python with sentence_transformers and torch ("" = skip the reference).
    #[arg(long, default_value = "python3")]
    python: String,
}

fn texts(chars: usize, n: usize) -> Result<Vec<String>> {
    let corpus = std::fs::read_to_string(datasets_dir().join("scifact/corpus.jsonl"))?;
    Ok(corpus
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|v| v["text"].as_str().map(|t| t.chars().take(chars).collect()))
        .take(n)
        .collect())
}

fn threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// In-process sentences/s at each batch size.
fn ours(texts: &[String], batches: &[usize]) -> Result<serde_json::Map<String, serde_json::Value>> {
    let mut enc = BertEncoder::load("minilm", &embed_model()?, 0, HeadKind::MeanPool)?;
    let tok = enc.tokenizer();
    let seqs = bert::tokenize(&tok, texts)?;
    let warm: Vec<&Seq> = seqs.iter().take(32).collect();
    enc.forward(&warm)?;
    let mut out = serde_json::Map::new();
    for &b in batches {
        let n = seqs.len().min((b * 4).max(64));
        let t = Instant::now();
        // The same first n texts as the reference, longest first (as the worker's batcher
        // packs them and as sentence-transformers' encode sorts its input); unsorted, this
        // corpus pads batches ~1.5x.
        let mut sorted: Vec<&Seq> = seqs[..n].iter().collect();
        sorted.sort_by_key(|s| std::cmp::Reverse(s.ids.len()));
        for refs in sorted.chunks(b) {
            enc.forward(refs)?;
        }
        out.insert(b.to_string(), json!(n as f64 / t.elapsed().as_secs_f64()));
    }
    Ok(out)
}

fn reference(python: &str, texts: &[String], batches: &[usize]) -> Result<serde_json::Value> {
    let file = std::env::temp_dir().join(format!("embedbench-{}.json", std::process::id()));
    std::fs::write(&file, serde_json::to_string(texts)?)?;
    let b: Vec<String> = batches.iter().map(|b| b.to_string()).collect();
    let out = std::process::Command::new(python)
        .arg(workspace().join("scripts/st_embed_bench.py"))
        .arg(embed_model()?)
        .arg(&file)
        .arg(b.join(","))
        .arg(threads().to_string())
        .output()?;
    let _ = std::fs::remove_file(&file);
    anyhow::ensure!(
        out.status.success(),
        "sentence-transformers reference failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(serde_json::from_slice(&out.stdout)?)
}

/// `clients` concurrent clients, each sending `requests` single-text Embed calls.
async fn concurrent(batching: bool, texts: &[String], a: &Args) -> Result<serde_json::Value> {
    let dir = tempfile::tempdir()?;
    let cfg = dir.path().join("w.toml");
    let mut toml = format!("[model_worker]\nbatching = {batching}\n");
    if a.max_batch > 0 {
        toml.push_str(&format!("max_batch = {}\n", a.max_batch));
    }
    if a.max_batch_tokens > 0 {
        toml.push_str(&format!("max_batch_tokens = {}\n", a.max_batch_tokens));
    }
    std::fs::write(&cfg, toml)?;
    let worker = Proc::model_worker(dir.path(), false, Some(&cfg))?;
    let ch = Channel::from_shared(worker.grpc.clone())?.connect().await?;
    let c = ModelWorkerClient::new(ch);
    let mut out = embed_load(&c, texts, a.clients, a.requests, 1).await?;
    out["batching"] = json!(batching);
    Ok(out)
}

#[tokio::main]
async fn main() -> Result<()> {
    let a = Args::parse();
    let texts = texts(a.chars, 1024).context("scifact corpus")?;
    let ours = ours(&texts, &a.batches)?;
    let st = if a.python.is_empty() {
        None
    } else {
        match reference(&a.python, &texts, &a.batches) {
            Ok(v) => Some(v),
            Err(e) => {
                eprintln!("embedbench: no sentence-transformers reference: {e}");
                None
            }
        }
    };
    let mut ratios = serde_json::Map::new();
    if let Some(st) = &st {
        for (b, v) in &ours {
            if let Some(r) = st["sentences_per_s"][b].as_f64() {
                ratios.insert(b.clone(), json!(v.as_f64().unwrap_or(0.0) / r));
            }
        }
    }
    let on = concurrent(true, &texts, &a).await?;
    let off = concurrent(false, &texts, &a).await?;
    let speedup = on["sentences_per_s"].as_f64().unwrap_or(0.0)
        / off["sentences_per_s"].as_f64().unwrap_or(1.0);
    println!(
        "{}",
        serde_json::to_string_pretty(&json!({
            "threads": threads(),
            "chars_per_text": a.chars,
            "candle_sentences_per_s": ours,
            "sentence_transformers": st,
            "ratio_candle_over_st": ratios,
            "concurrent_clients": a.clients,
            "batching_on": on,
            "batching_off": off,
            "batching_speedup": speedup,
        }))?
    );
    Ok(())
}
