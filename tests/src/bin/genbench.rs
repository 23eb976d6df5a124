//! Generation throughput of the model worker on this machine: one stream, then `--streams`
//! concurrent streams, for each weight format (`model_worker.dequantize`: f32, f16, none).
//! Reports decode tokens/s (aggregate and per stream), time to first token and prompt size.
//! Prints one JSON object.

use std::time::Instant;

use anyhow::{Context, Result};
use clap::Parser;
use futures::StreamExt;
use ragcluster_proto::v1::model_worker_client::ModelWorkerClient;
use ragcluster_proto::v1::*;
use ragcluster_tests::{Proc, percentile};
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
}

const PROMPT: &str = "Retrieval-augmented generation combines a retriever with a language \
model. Explain in a few sentences why retrieving passages before generating an answer helps \
a small model answer factual questions.";

/// One stream: (time to first token, tokens, total seconds).
async fn stream(
    mut c: ModelWorkerClient<Channel>,
    tokens: u32,
    seed: u64,
) -> Result<(f64, u32, f64)> {
    let t = Instant::now();
    let mut s = c
        .generate(GenerateRequest {
            prompt: PROMPT.into(),
            max_tokens: tokens,
            temperature: 0.7,
            seed,
            ..Default::default()
        })
        .await?
        .into_inner();
    let mut first = None;
    let mut n = 0;
    while let Some(m) = s.next().await {
        let m = m?;
        first.get_or_insert(t.elapsed().as_secs_f64());
        n += 1;
        if m.finished {
            break;
        }
    }
    Ok((first.context("no token")?, n, t.elapsed().as_secs_f64()))
}

#[tokio::main]
async fn main() -> Result<()> {
    let a = Args::parse();
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
        stream(c.clone(), 4, 0).await?; // warm-up
        let mut row = serde_json::Map::new();
        for n in [1usize, a.streams] {
            let t = Instant::now();
            let runs =
                futures::future::join_all((0..n).map(|i| stream(c.clone(), a.tokens, i as u64)))
                    .await
                    .into_iter()
                    .collect::<Result<Vec<_>>>()?;
            let wall = t.elapsed().as_secs_f64();
            let total: u32 = runs.iter().map(|r| r.1).sum();
            let mut ttft: Vec<f64> = runs.iter().map(|r| r.0 * 1e3).collect();
            let per_stream: Vec<f64> = runs
                .iter()
                .map(|r| f64::from(r.1.saturating_sub(1)) / (r.2 - r.0).max(1e-9))
                .collect();
            row.insert(
                format!("streams_{n}"),
                serde_json::json!({
                    "tokens_per_s": f64::from(total) / wall,
                    "decode_tokens_per_s_per_stream": per_stream.iter().sum::<f64>() / n as f64,
                    "ttft_p50_ms": percentile(&mut ttft, 50.0),
                    "tokens": total,
                }),
            );
        }
        out.insert(format!("dequantize_{dq}"), serde_json::Value::Object(row));
    }
    out.insert("prompt_chars".into(), PROMPT.len().into());
    out.insert("tokens_per_stream".into(), a.tokens.into());
    println!("{}", serde_json::to_string_pretty(&out)?);
    Ok(())
}
