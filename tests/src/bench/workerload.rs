//! Client loads on a model worker for the benches (embedbench, genbench, gpubench): many
//! concurrent Embed callers, and one Generate stream timed token by token.

use std::time::Instant;

use anyhow::{Context, Result};
use futures::StreamExt;
use ragcluster_proto::v1::model_worker_client::ModelWorkerClient;
use ragcluster_proto::v1::*;
use serde_json::json;
use tonic::transport::Channel;

use crate::percentile;

/// `clients` tasks each sending `requests` Embed calls of `per_call` texts (taken round-robin
/// from `texts`): sentences/s over the whole run and call latency p50/p99.
pub async fn embed_load(
    c: &ModelWorkerClient<Channel>,
    texts: &[String],
    clients: usize,
    requests: usize,
    per_call: usize,
) -> Result<serde_json::Value> {
    let t = Instant::now();
    let tasks = (0..clients).map(|k| {
        let mut c = c.clone();
        let texts = texts.to_vec();
        tokio::spawn(async move {
            let mut lat = Vec::with_capacity(requests);
            for i in 0..requests {
                let start = (k * requests + i) * per_call;
                let batch = (0..per_call)
                    .map(|j| texts[(start + j) % texts.len()].clone())
                    .collect();
                let s = Instant::now();
                c.embed(EmbedRequest {
                    texts: batch,
                    ..Default::default()
                })
                .await?;
                lat.push(s.elapsed().as_secs_f64() * 1e3);
            }
            anyhow::Ok(lat)
        })
    });
    let mut lat = Vec::new();
    for r in futures::future::join_all(tasks).await {
        lat.extend(r??);
    }
    let secs = t.elapsed().as_secs_f64();
    Ok(json!({
        "clients": clients,
        "texts_per_call": per_call,
        "sentences_per_s": (lat.len() * per_call) as f64 / secs,
        "latency_ms_p50": percentile(&mut lat, 50.0),
        "latency_ms_p99": percentile(&mut lat, 99.0),
    }))
}

/// How a load's streams pick tokens (`GREEDY`, or a temperature with a nucleus cut-off).
#[derive(Debug, Clone, Copy)]
pub struct Sampling {
    pub temperature: f32,
    /// 1 = no cut-off.
    pub top_p: f32,
}

impl Sampling {
    pub const GREEDY: Sampling = Sampling {
        temperature: 0.0,
        top_p: 1.0,
    };
}

/// One Generate stream: (seconds to the first token, tokens, total seconds).
pub async fn generate_stream(
    mut c: ModelWorkerClient<Channel>,
    prompt: String,
    tokens: u32,
    sampling: Sampling,
    seed: u64,
) -> Result<(f64, u32, f64)> {
    let t = Instant::now();
    let mut s = c
        .generate(GenerateRequest {
            prompt,
            max_tokens: tokens,
            temperature: sampling.temperature,
            top_p: sampling.top_p,
            seed,
            ..Default::default()
        })
        .await?
        .into_inner();
    let (mut first, mut n) = (None, 0);
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

/// `n` concurrent streams of `tokens` tokens: aggregate tokens/s, mean per-stream decode
/// rate (after the first token) and time to first token p50.
pub async fn generate_load(
    c: &ModelWorkerClient<Channel>,
    prompt: &str,
    n: usize,
    tokens: u32,
    sampling: Sampling,
) -> Result<serde_json::Value> {
    let t = Instant::now();
    let runs = futures::future::join_all(
        (0..n).map(|i| generate_stream(c.clone(), prompt.to_owned(), tokens, sampling, i as u64)),
    )
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
    Ok(json!({
        "tokens_per_s": f64::from(total) / wall,
        "decode_tokens_per_s_per_stream": per_stream.iter().sum::<f64>() / n as f64,
        "ttft_p50_ms": percentile(&mut ttft, 50.0),
        "tokens": total,
    }))
}
