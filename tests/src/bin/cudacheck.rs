//! On a machine with an NVIDIA GPU: loads all-MiniLM-L6-v2 on the CPU and on CUDA, embeds
//! SciFact passages with both, and reports the lowest cosine between the two (must exceed
//! 0.999) and sentences/s at batch 1, 8, 32, 128 on each. Without a usable GPU it says so
//! and exits 0. Prints one JSON object.

use std::time::Instant;

use anyhow::{Result, ensure};
use model_worker::backend::device::Placement;
use model_worker::backend::encoder::bert::{self, BertEncoder, HeadKind};
use model_worker::backend::{Encoder, Seq};
use ragcluster_tests::{datasets_dir, embed_model};
use serde_json::json;

fn rate(enc: &mut BertEncoder, seqs: &[Seq], b: usize) -> Result<f64> {
    let n = seqs.len().min((b * 8).max(64));
    let warm: Vec<&Seq> = seqs.iter().take(b).collect();
    enc.forward(&warm)?;
    let t = Instant::now();
    for chunk in seqs[..n].chunks(b) {
        let refs: Vec<&Seq> = chunk.iter().collect();
        enc.forward(&refs)?;
    }
    Ok(n as f64 / t.elapsed().as_secs_f64())
}

fn main() -> Result<()> {
    if !model_worker::backend::cuda::available() {
        println!(
            "{}",
            json!({"cuda": false, "note": "no usable CUDA device: nothing to check"})
        );
        return Ok(());
    }
    let dir = embed_model()?;
    let corpus = std::fs::read_to_string(datasets_dir().join("scifact/corpus.jsonl"))?;
    let texts: Vec<String> = corpus
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|v| v["text"].as_str().map(|t| t.chars().take(300).collect()))
        .take(1024)
        .collect();
    let mut cpu = BertEncoder::load_on("minilm", &dir, 0, HeadKind::MeanPool, Placement::Cpu)?;
    let mut gpu = BertEncoder::load_on("minilm", &dir, 0, HeadKind::MeanPool, Placement::Cuda)?;
    let seqs = bert::tokenize(&cpu.tokenizer(), &texts)?;
    let mut min_cos = 1f32;
    for chunk in seqs[..256].chunks(32) {
        let refs: Vec<&Seq> = chunk.iter().collect();
        let a = cpu.forward(&refs)?;
        let b = gpu.forward(&refs)?;
        for (x, y) in a.iter().zip(&b) {
            let c: f32 = x.iter().zip(y).map(|(p, q)| p * q).sum();
            min_cos = min_cos.min(c);
        }
    }
    let mut out = serde_json::Map::new();
    for b in [1usize, 8, 32, 128] {
        out.insert(
            b.to_string(),
            json!({"cpu": rate(&mut cpu, &seqs, b)?, "cuda": rate(&mut gpu, &seqs, b)?}),
        );
    }
    println!(
        "{}",
        serde_json::to_string_pretty(&json!({
            "cuda": true,
            "min_cosine_cuda_vs_cpu": min_cos,
            "sentences_per_s": out,
        }))?
    );
    ensure!(
        min_cos > 0.999,
        "CUDA embeddings differ from CPU: cosine {min_cos}"
    );
    Ok(())
}
