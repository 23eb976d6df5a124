//! `chunkbench`: the coordinator's chunking CPU in process, over SciFact's corpus with the
//! MiniLM tokenizer and the collection defaults (sentence chunking, 200 tokens, min 16):
//! token spans from the tokenizer over each whole document (the reference: what the
//! coordinator did before, raw `tokenizers`) against `HfTokens`' per-run cache, then the whole
//! chunker with each. Checks both give the same chunks; prints one JSON object.
//!
//! `cargo run --release -p ragcluster-tests --bin chunkbench -- --passes 3`

use std::time::Instant;

use anyhow::{Result, ensure};
use clap::Parser;
use coordinator::chunking::{self, ChunkParams, HfTokens, Strategy, Tokens};
use ragcluster_tests::{datasets_dir, models_dir};
use serde_json::json;

#[derive(Parser)]
struct Args {
    /// Only the first N documents (0: all).
    #[arg(long, default_value_t = 0)]
    docs: usize,
    /// Timed passes over the corpus per side (alternating; the best is reported).
    #[arg(long, default_value_t = 3)]
    passes: usize,
}

/// Seconds for one pass of `f` over `texts`.
fn pass(texts: &[String], f: &dyn Fn(&str) -> usize) -> (f64, usize) {
    let t = Instant::now();
    let n: usize = texts.iter().map(|s| f(s)).sum();
    (t.elapsed().as_secs_f64(), n)
}

fn main() -> Result<()> {
    let a = Args::parse();
    let corpus = std::fs::read_to_string(datasets_dir().join("scifact/corpus.jsonl"))?;
    let mut texts = Vec::new();
    for line in corpus.lines() {
        let v: serde_json::Value = serde_json::from_str(line)?;
        texts.push(v["text"].as_str().unwrap_or_default().to_string());
    }
    if a.docs > 0 {
        texts.truncate(a.docs);
    }
    let bytes: usize = texts.iter().map(String::len).sum();
    let path = models_dir().join("all-MiniLM-L6-v2/tokenizer.json");
    let cached = HfTokens::load(&path)?;
    ensure!(
        cached.caches_runs(),
        "MiniLM's tokenizer should take the per-run path"
    );
    let whole = HfTokens::load(&path)?.without_cache();
    let params = ChunkParams {
        strategy: Strategy::Sentence,
        chunk_size: 200,
        overlap: 0,
        min_tokens: 16,
    };
    for t in &texts {
        ensure!(
            chunking::chunk(t, &params, &cached) == chunking::chunk(t, &params, &whole),
            "chunks differ"
        );
    }
    let mut rows = Vec::new();
    for (name, tok) in [("whole_text", &whole), ("per_run_cache", &cached)] {
        let spans = |s: &str| tok.spans(s).len();
        let chunk = |s: &str| chunking::chunk(s, &params, tok).len();
        let (mut best_spans, mut best_chunk, mut tokens, mut chunks) = (f64::MAX, f64::MAX, 0, 0);
        for _ in 0..a.passes {
            let (s, n) = pass(&texts, &spans);
            best_spans = best_spans.min(s);
            tokens = n;
            let (s, n) = pass(&texts, &chunk);
            best_chunk = best_chunk.min(s);
            chunks = n;
        }
        rows.push(json!({
            "tokens": name,
            "tokens_counted": tokens,
            "chunks": chunks,
            "spans_docs_per_s": texts.len() as f64 / best_spans,
            "spans_mb_per_s": bytes as f64 / best_spans / 1e6,
            "chunker_docs_per_s": texts.len() as f64 / best_chunk,
            "chunker_us_per_doc": best_chunk / texts.len() as f64 * 1e6,
        }));
    }
    let ratio = |k: &str| rows[1][k].as_f64().unwrap_or(0.0) / rows[0][k].as_f64().unwrap_or(1.0);
    let out = json!({
        "docs": texts.len(),
        "mb": bytes as f64 / 1e6,
        "sides": rows,
        "spans_ratio": ratio("spans_docs_per_s"),
        "chunker_ratio": ratio("chunker_docs_per_s"),
    });
    println!("{}", serde_json::to_string_pretty(&out)?);
    Ok(())
}
