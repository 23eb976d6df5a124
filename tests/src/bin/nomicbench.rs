//! nomic-embed-text-v1.5 on our CPU encoder against llama.cpp's `llama-embedding` on the same
//! GGUF, texts and machine: passages/s and tokens/s of the encoding itself (model loading
//! apart), and how far the two sets of vectors agree (cosine per passage). The passages are
//! SciFact abstracts cut to `--chars` characters (about a chunk of ours), with the
//! "search_document: " prefix both sides. llama.cpp's time is its own `prompt eval time`
//! (llama_perf), for each of its batch sizes (it encodes the prompts of a batch in one ubatch;
//! its attention spans the whole ubatch, so the size matters). Prints one JSON object.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::Parser;
use model_worker::backend::encoder::bert::{self, BertEncoder, HeadKind};
use model_worker::backend::{Encoder, Seq};
use ragcluster_tests::{datasets_dir, models_dir};
use serde_json::{Value, json};

#[derive(Parser)]
struct Args {
    #[arg(long)]
    model: Option<PathBuf>,
    /// Passages (SciFact abstracts, in corpus order).
    #[arg(long, default_value_t = 256)]
    passages: usize,
    /// Characters kept of each abstract.
    #[arg(long, default_value_t = 800)]
    chars: usize,
    /// Passages per forward of ours (the worker's default batch).
    #[arg(long, default_value_t = 32)]
    batch: usize,
    #[arg(long, default_value_t = 2)]
    repeats: usize,
    /// llama.cpp's `llama-embedding` binary.
    #[arg(long)]
    llama_embedding: Option<PathBuf>,
    /// llama.cpp batch sizes (tokens per ubatch) to try.
    #[arg(long, value_delimiter = ',', default_value = "1024,4096")]
    llama_batch: Vec<usize>,
    #[arg(long, default_value_t = 2)]
    threads: usize,
}

fn passages(n: usize, chars: usize) -> Result<Vec<String>> {
    let path = datasets_dir().join("scifact/corpus.jsonl");
    let text = std::fs::read_to_string(&path).with_context(|| path.display().to_string())?;
    let mut out = Vec::with_capacity(n);
    for line in text.lines().take(n) {
        let v: Value = serde_json::from_str(line)?;
        let body = format!(
            "{}. {}",
            v["title"].as_str().unwrap_or(""),
            v["text"].as_str().unwrap_or("")
        );
        let cut: String = body.chars().take(chars).collect();
        // One passage per line for llama-embedding.
        out.push(format!(
            "search_document: {}",
            cut.replace(['\n', '\r'], " ")
        ));
    }
    Ok(out)
}

fn cosine(a: &[f32], b: &[f32]) -> f32 {
    let dot: f32 = a.iter().zip(b).map(|(x, y)| x * y).sum();
    let n = |v: &[f32]| v.iter().map(|x| x * x).sum::<f32>().sqrt();
    dot / (n(a) * n(b)).max(1e-12)
}

/// llama-embedding over `texts` with `batch` tokens per ubatch: (prompt eval ms, tokens,
/// vectors).
fn llama(
    bin: &Path,
    model: &Path,
    texts: &[String],
    batch: usize,
    threads: usize,
) -> Result<(f64, usize, Vec<Vec<f32>>)> {
    let file = std::env::temp_dir().join(format!("nomicbench-{}.txt", std::process::id()));
    std::fs::write(&file, texts.join("\n"))?;
    let out = Command::new(bin)
        .args([
            "-m",
            &model.display().to_string(),
            "-f",
            &file.display().to_string(),
        ])
        .args([
            "-c",
            &batch.to_string(),
            "-b",
            &batch.to_string(),
            "-ub",
            &batch.to_string(),
        ])
        .args([
            "--pooling",
            "mean",
            "--embd-normalize",
            "2",
            "--embd-output-format",
            "json",
        ])
        .args([
            "-t",
            &threads.to_string(),
            "--no-warmup",
            "--perf",
            "-lv",
            "4",
        ])
        .output()?;
    let _ = std::fs::remove_file(&file);
    let stderr = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() {
        bail!(
            "llama-embedding failed: {}",
            stderr.lines().rev().take(5).collect::<Vec<_>>().join(" | ")
        );
    }
    // "prompt eval time =   1234.56 ms /  5678 tokens (...)"
    let line = stderr
        .lines()
        .find(|l| l.contains("prompt eval time"))
        .context("no prompt eval time in llama-embedding's output")?;
    let after = line.split('=').nth(1).context("prompt eval line")?;
    let ms: f64 = after.split_whitespace().next().context("ms")?.parse()?;
    let tokens: usize = after
        .split('/')
        .nth(1)
        .and_then(|t| t.split_whitespace().next())
        .context("tokens")?
        .parse()?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let start = stdout.find('{').context("no JSON from llama-embedding")?;
    let v: Value = serde_json::from_str(&stdout[start..])?;
    let vectors = v["data"]
        .as_array()
        .context("data")?
        .iter()
        .map(|d| {
            d["embedding"]
                .as_array()
                .map(|a| a.iter().map(|x| x.as_f64().unwrap_or(0.0) as f32).collect())
                .unwrap_or_default()
        })
        .collect();
    Ok((ms, tokens, vectors))
}

fn main() -> Result<()> {
    let a = Args::parse();
    let model = a
        .model
        .clone()
        .unwrap_or_else(|| models_dir().join("nomic-embed-text-v1.5.f16.gguf"));
    let texts = passages(a.passages, a.chars)?;
    let t0 = Instant::now();
    let mut enc = BertEncoder::load("nomic", &model, 0, HeadKind::MeanPool)?;
    let load_s = t0.elapsed().as_secs_f64();
    let seqs = bert::tokenize(&enc.tokenizer(), &texts)?;
    let tokens: usize = seqs.iter().map(|s| s.ids.len()).sum();
    let mut best = f64::MAX;
    let mut ours: Vec<Vec<f32>> = Vec::new();
    for _ in 0..a.repeats.max(1) {
        let t = Instant::now();
        let mut out = Vec::with_capacity(seqs.len());
        for chunk in seqs.chunks(a.batch.max(1)) {
            let refs: Vec<&Seq> = chunk.iter().collect();
            out.extend(enc.forward(&refs)?);
        }
        best = best.min(t.elapsed().as_secs_f64());
        ours = out;
    }
    let mut report = json!({
        "model": model.display().to_string(),
        "passages": texts.len(),
        "chars_per_passage": a.chars,
        "threads": a.threads,
        "ours": {
            "load_s": load_s,
            "batch": a.batch,
            "tokens": tokens,
            "seconds": best,
            "passages_per_s": texts.len() as f64 / best,
            "tokens_per_s": tokens as f64 / best,
        },
    });
    if let Some(bin) = &a.llama_embedding {
        let mut runs = Vec::new();
        let mut best_tps = 0f64;
        for &b in &a.llama_batch {
            let (ms, ltokens, vectors) = llama(bin, &model, &texts, b, a.threads)?;
            let cos: Vec<f32> = ours
                .iter()
                .zip(&vectors)
                .map(|(x, y)| cosine(x, y))
                .collect();
            let min = cos.iter().copied().fold(f32::MAX, f32::min);
            let mean = cos.iter().sum::<f32>() / cos.len().max(1) as f32;
            let tps = ltokens as f64 / (ms / 1000.0);
            best_tps = best_tps.max(tps);
            runs.push(json!({
                "batch_tokens": b,
                "tokens": ltokens,
                "seconds": ms / 1000.0,
                "passages_per_s": texts.len() as f64 / (ms / 1000.0),
                "tokens_per_s": tps,
                "cosine_vs_ours_min": min,
                "cosine_vs_ours_mean": mean,
            }));
        }
        report["llama_cpp"] = json!(runs);
        report["ours_over_best_llama_cpp"] = json!((tokens as f64 / best) / best_tps);
    }
    println!("{}", serde_json::to_string_pretty(&report)?);
    Ok(())
}
