//! Generation throughput of the model worker on this machine: one stream, then `--streams`
//! concurrent streams, for each weight format (`model_worker.dequantize`: f32, f16, none).
//! Reports decode tokens/s (aggregate and per stream), time to first token and prompt size;
//! then the latency of a UPR rerank call (the generator scoring `--rerank-passages`
//! passages, all in shared forwards).
//! Prints one JSON object.

use anyhow::Result;
use clap::Parser;
use ragcluster_proto::v1::RerankRequest;
use ragcluster_proto::v1::model_worker_client::ModelWorkerClient;
use ragcluster_tests::bench::workerload::{Sampling, generate_load, generate_stream};
use ragcluster_tests::{Proc, datasets_dir, generate_model};
use tonic::transport::Channel;

#[derive(Parser)]
struct Args {
    /// Tokens generated per stream.
    #[arg(long, default_value_t = 64)]
    tokens: u32,
    #[arg(long, default_value_t = 8)]
    streams: usize,
    /// Weight formats to compare.
    #[arg(long, value_delimiter = ',', default_value = "f32,f16,none")]
    dequantize: Vec<String>,
    /// Sampling temperature of every stream (0 = greedy).
    #[arg(long, default_value_t = 0.7)]
    temperature: f32,
    /// Nucleus cut-off of every stream (1 = off).
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// SciFact passages (600 characters each) put before the question, as a RAG prompt
    /// would: about 130 tokens each, so attention's share of a step shows (0 = the short
    /// prompt alone).
    #[arg(long, default_value_t = 0)]
    passages: usize,
    /// Passages per UPR rerank call (the generator as a reranker; 0 = skip).
    #[arg(long, default_value_t = 20)]
    rerank_passages: usize,
}

/// UPR rerank of `n` SciFact passages (cut to 600 characters) for one query with the GGUF
/// generator as the reranker: latency of each of 3 calls after a warm-up, in ms.
/// The first `n` SciFact passages, cut to 600 characters.
fn scifact_passages(n: usize) -> Result<Vec<String>> {
    let corpus = std::fs::read_to_string(datasets_dir().join("scifact/corpus.jsonl"))?;
    Ok(corpus
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|v| v["text"].as_str().map(|t| t.chars().take(600).collect()))
        .take(n)
        .collect())
}

async fn upr_rerank(n: usize, dq: &str) -> Result<serde_json::Value> {
    let passages = scifact_passages(n)?;
    let dir = tempfile::tempdir()?;
    let cfg = dir.path().join("mw.toml");
    std::fs::write(&cfg, format!("[model_worker]\ndequantize = \"{dq}\"\n"))?;
    let gguf = generate_model()?.display().to_string();
    let worker =
        Proc::model_worker_with(dir.path(), false, Some(&cfg), &["--rerank-model", &gguf])?;
    let mut c = ModelWorkerClient::new(Channel::from_shared(worker.grpc.clone())?.connect().await?);
    let call = RerankRequest {
        query: "Does vitamin D supplementation reduce fracture risk in older adults?".into(),
        passages,
        ..Default::default()
    };
    c.rerank(call.clone()).await?; // warm-up
    let mut ms = Vec::new();
    for _ in 0..3 {
        let t = std::time::Instant::now();
        c.rerank(call.clone()).await?;
        ms.push(t.elapsed().as_secs_f64() * 1e3);
    }
    Ok(serde_json::json!({"passages": n, "chars_per_passage": 600, "ms": ms}))
}

const PROMPT: &str = "Retrieval-augmented generation combines a retriever with a language \
model. Explain in a few sentences why retrieving passages before generating an answer helps \
a small model answer factual questions.";

#[tokio::main]
async fn main() -> Result<()> {
    let a = Args::parse();
    let sampling = Sampling {
        temperature: a.temperature,
        top_p: a.top_p,
    };
    let mut prompt = String::new();
    for p in scifact_passages(a.passages)? {
        prompt.push_str(&p);
        prompt.push('\n');
    }
    prompt.push_str(PROMPT);
    let mut out = serde_json::Map::new();
    for dq in &a.dequantize {
        let dir = tempfile::tempdir()?;
        let cfg = dir.path().join("mw.toml");
        std::fs::write(
            &cfg,
            format!(
                "[model_worker]\ndequantize = \"{dq}\"\nmax_concurrent_generations = {}\n",
                a.streams
            ),
        )?;
        let worker = Proc::model_worker(dir.path(), true, Some(&cfg))?;
        let c = ModelWorkerClient::new(Channel::from_shared(worker.grpc.clone())?.connect().await?);
        generate_stream(c.clone(), prompt.clone(), 4, sampling, 0).await?; // warm-up
        let mut row = serde_json::Map::new();
        for n in [1usize, a.streams] {
            row.insert(
                format!("streams_{n}"),
                generate_load(&c, &prompt, n, a.tokens, sampling).await?,
            );
        }
        out.insert(format!("dequantize_{dq}"), serde_json::Value::Object(row));
    }
    if a.rerank_passages > 0 {
        let dq = a.dequantize.first().map_or("f32", String::as_str);
        out.insert(
            format!("upr_rerank_dequantize_{dq}"),
            upr_rerank(a.rerank_passages, dq).await?,
        );
    }
    out.insert("prompt_chars".into(), prompt.len().into());
    out.insert("tokens_per_stream".into(), a.tokens.into());
    out.insert("temperature".into(), a.temperature.into());
    out.insert("top_p".into(), a.top_p.into());
    println!("{}", serde_json::to_string_pretty(&out)?);
    Ok(())
}
