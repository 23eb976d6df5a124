//! `tokenbench`: what large Embed calls cost a model worker beside their own answer.
//!
//! A call may carry up to 32 MB of text; the HF tokenizer reads each text whole before
//! truncating it to the model's limit, so tokenising such a call takes seconds of CPU. This
//! bench starts a model worker (MiniLM) and measures, side by side for whatever worker binary
//! sits next to it (run it from two directories to compare builds):
//!
//! - `large_call_ms`: one Embed call of `--texts` texts of `--text-kb` KB each (SciFact
//!   passages repeated), alone;
//! - `under_load`: `--loaders` clients sending such calls back to back for `--seconds`, while
//!   one prober sends a `grpc.health.v1` Check every 5 ms and another a one-text Embed call
//!   every 20 ms: p50/p99/max latency of each, i.e. how long other callers wait on the
//!   worker while the large calls are tokenised.
//!
//! `cargo run --release -p ragcluster-tests --bin tokenbench`

use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use clap::Parser;
use ragcluster_proto::v1::EmbedRequest;
use ragcluster_proto::v1::model_worker_client::ModelWorkerClient;
use ragcluster_tests::{Proc, datasets_dir, latency_summary};
use serde_json::json;
use tonic::transport::Channel;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_client::HealthClient;

#[derive(Parser)]
struct Args {
    #[arg(long, default_value_t = 16)]
    texts: usize,
    #[arg(long, default_value_t = 1024)]
    text_kb: usize,
    #[arg(long, default_value_t = 2)]
    loaders: usize,
    #[arg(long, default_value_t = 20)]
    seconds: u64,
}

fn large_texts(n: usize, kb: usize) -> Result<Vec<String>> {
    let corpus = std::fs::read_to_string(datasets_dir().join("scifact/corpus.jsonl"))?;
    let passages: Vec<String> = corpus
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|v| v["text"].as_str().map(str::to_owned))
        .take(2000)
        .collect();
    Ok((0..n)
        .map(|i| {
            let mut t = String::with_capacity(kb * 1024 + 4096);
            let mut j = i * 97;
            while t.len() < kb * 1024 {
                t.push_str(&passages[j % passages.len()]);
                t.push(' ');
                j += 1;
            }
            t.truncate(t.floor_char_boundary(kb * 1024));
            t
        })
        .collect())
}

#[tokio::main]
async fn main() -> Result<()> {
    let a = Args::parse();
    let texts = large_texts(a.texts, a.text_kb).context("scifact corpus")?;
    let dir = tempfile::tempdir()?;
    let worker = Proc::model_worker(dir.path(), false, None)?;
    let ch = Channel::from_shared(worker.grpc.clone())?.connect().await?;
    let embed = ModelWorkerClient::new(ch.clone())
        .max_encoding_message_size(64 << 20)
        .max_decoding_message_size(64 << 20);
    let call = |mut c: ModelWorkerClient<Channel>, texts: Vec<String>| async move {
        let t = Instant::now();
        c.embed(EmbedRequest {
            texts,
            ..Default::default()
        })
        .await?;
        anyhow::Ok(t.elapsed().as_secs_f64() * 1e3)
    };
    // Warm-up, then the large call alone (three times).
    call(embed.clone(), vec!["warm up".into()]).await?;
    let mut alone = Vec::new();
    for _ in 0..3 {
        alone.push(call(embed.clone(), texts.clone()).await?);
    }

    let until = Instant::now() + Duration::from_secs(a.seconds);
    let loaders: Vec<_> = (0..a.loaders)
        .map(|_| {
            let (c, texts) = (embed.clone(), texts.clone());
            tokio::spawn(async move {
                let mut lat = Vec::new();
                while Instant::now() < until {
                    lat.push(call(c.clone(), texts.clone()).await?);
                }
                anyhow::Ok(lat)
            })
        })
        .collect();
    let health = {
        let mut h = HealthClient::new(ch.clone());
        tokio::spawn(async move {
            let mut lat = Vec::new();
            while Instant::now() < until {
                let t = Instant::now();
                h.check(HealthCheckRequest::default()).await?;
                lat.push(t.elapsed().as_secs_f64() * 1e3);
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            anyhow::Ok(lat)
        })
    };
    let small = {
        let c = embed.clone();
        tokio::spawn(async move {
            let mut lat = Vec::new();
            while Instant::now() < until {
                lat.push(call(c.clone(), vec!["how does raft elect a leader?".into()]).await?);
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            anyhow::Ok(lat)
        })
    };
    let mut large = Vec::new();
    for l in loaders {
        large.extend(l.await??);
    }
    let health = health.await??;
    let small = small.await??;
    println!(
        "{}",
        serde_json::to_string_pretty(&json!({
            "texts_per_call": a.texts,
            "kb_per_text": a.text_kb,
            "cores": std::thread::available_parallelism().map_or(1, |n| n.get()),
            "large_call_ms": alone,
            "under_load": {
                "loaders": a.loaders,
                "seconds": a.seconds,
                "large_calls": latency_summary(large),
                "health_check": latency_summary(health),
                "small_embed": latency_summary(small),
            },
        }))?
    );
    Ok(())
}
