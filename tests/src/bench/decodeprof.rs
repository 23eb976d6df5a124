//! Where a CUDA decoder forward's time goes (`gpubench --sections profile`): SmolLM2 loaded
//! in process, a prefill step of the size the engine takes (2,040 prompt rows over ten
//! sequences) and decode steps of 1, 8 and 64 rows at a span of about 200. For each: the
//! host's wall time per forward (decode steps as the engine runs them, replayed from CUDA
//! graphs, and launched one by one; with graphs, by the row-wise attention kernel's block
//! size), and the device's time per operation from
//! `CudaLlama::set_profiling` (no launch gaps), so the next kernel to work on is the one
//! that shows.

use std::collections::BTreeMap;
use std::time::Instant;

use anyhow::{Context, Result};
use model_worker::backend::decoder::cuda::{CudaLlama, PagedCache};
use model_worker::backend::decoder::{Row, Want};
use serde_json::{Value, json};

/// Prompt tokens per sequence.
const PROMPT: usize = 200;
/// Forwards per measurement.
const REPS: usize = 8;

/// Token ids spread over the vocabulary (the timing does not depend on the text).
fn tokens(seq: usize, n: usize, vocab: usize) -> Vec<u32> {
    (0..n)
        .map(|i| ((seq * 7919 + i * 104_729 + 17) % vocab) as u32)
        .collect()
}

/// Rows of consecutive whole prompts for `seqs` fresh sequences; the last row of each.
fn prompt_rows(seqs: usize, len: usize, vocab: usize) -> (Vec<Row>, Vec<usize>) {
    let mut rows = Vec::with_capacity(seqs * len);
    let mut last = Vec::with_capacity(seqs);
    for seq in 0..seqs {
        rows.extend(
            tokens(seq, len, vocab)
                .into_iter()
                .map(|token| Row { seq, token }),
        );
        last.push(rows.len() - 1);
    }
    (rows, last)
}

/// `seqs` sequences whose prompts are in the cache, prefilled ten at a time.
fn prefilled(m: &CudaLlama, seqs: usize) -> Result<Vec<PagedCache>> {
    let mut caches: Vec<PagedCache> = (0..seqs).map(|_| m.new_cache()).collect();
    for chunk in caches.chunks_mut(10) {
        let (rows, _) = prompt_rows(chunk.len(), PROMPT, m.dims.vocab);
        let mut refs: Vec<&mut PagedCache> = chunk.iter_mut().collect();
        m.forward(&rows, &mut refs, &[])?;
    }
    Ok(caches)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// `REPS` forwards with profiling on: device ms per forward by operation, and their total.
fn device_ms(m: &CudaLlama, mut forward: impl FnMut() -> Result<()>) -> Result<Value> {
    m.set_profiling(true)?;
    let run = (0..REPS).try_for_each(|_| forward());
    let profile = m.take_profile();
    m.set_profiling(false)?;
    run?;
    let p = profile?;
    let n = p.get("forwards").copied().context("no profiled forward")?;
    let per: BTreeMap<&str, f64> = p
        .iter()
        .filter(|(op, _)| **op != "forwards")
        .map(|(op, ms)| (*op, ms / n))
        .collect();
    Ok(json!({"total": per.values().sum::<f64>(), "by_op": per}))
}

/// Host wall ms per forward (median of `REPS`).
fn wall_ms(mut forward: impl FnMut() -> Result<()>) -> Result<f64> {
    let mut ms = Vec::with_capacity(REPS);
    for _ in 0..REPS {
        let t = Instant::now();
        forward()?;
        ms.push(t.elapsed().as_secs_f64() * 1e3);
    }
    Ok(median(ms))
}

/// One decode step over every sequence in `caches`, each wanting a greedy token.
fn decode(m: &CudaLlama, caches: &mut [PagedCache]) -> Result<()> {
    let rows: Vec<Row> = (0..caches.len())
        .map(|seq| Row { seq, token: 42 })
        .collect();
    let want: Vec<usize> = (0..rows.len()).collect();
    let how = vec![Want::Greedy; rows.len()];
    let mut refs: Vec<&mut PagedCache> = caches.iter_mut().collect();
    m.forward_sampled(&rows, &mut refs, &want, &how)?;
    Ok(())
}

/// The breakdown for SmolLM2's GGUF at `path` on GPU 0.
pub fn decoder_profile(path: &std::path::Path) -> Result<Value> {
    let mut f = std::fs::File::open(path)?;
    let content = candle_core::quantized::gguf_file::Content::read(&mut f)?;
    let mut m = CudaLlama::from_gguf(&content, &mut f, 4096, 256 * 512, 0)?;
    let vocab = m.dims.vocab;
    let mut out = serde_json::Map::new();
    // A prefill step: ten fresh 204-token prompts (2,040 rows), each's last row wanted.
    let prefill = |m: &CudaLlama| -> Result<()> {
        let (rows, last) = prompt_rows(10, 204, vocab);
        let mut caches: Vec<PagedCache> = (0..10).map(|_| m.new_cache()).collect();
        let mut refs: Vec<&mut PagedCache> = caches.iter_mut().collect();
        m.forward(&rows, &mut refs, &last)?;
        Ok(())
    };
    let wall = wall_ms(|| prefill(&m))?;
    let device = device_ms(&m, || prefill(&m))?;
    // Rows per attention tile, other sizes against the serving default (16, last).
    let mut by_tile = serde_json::Map::new();
    for t in [8, 32, 64, 16] {
        m.set_prefill_tile(t)?;
        by_tile.insert(t.to_string(), json!(wall_ms(|| prefill(&m))?));
    }
    out.insert(
        "prefill_2040_rows".into(),
        json!({"wall_ms": wall, "wall_ms_by_tile_rows": by_tile, "device_ms": device}),
    );
    for n in [1, 8, 64] {
        let mut caches = prefilled(&m, n)?;
        m.set_graphs(true);
        let graphs = wall_ms(|| decode(&m, &mut caches))?;
        // The row-wise attention kernel's block size, fixed sizes against the default (by
        // step size).
        let mut by_threads = serde_json::Map::new();
        for t in [Some(128), Some(256), Some(512), None] {
            m.set_row_threads(t)?;
            let key = t.map_or("default".to_owned(), |t| t.to_string());
            by_threads.insert(key, json!(wall_ms(|| decode(&m, &mut caches))?));
        }
        m.set_graphs(false);
        let launched = wall_ms(|| decode(&m, &mut caches))?;
        let device = device_ms(&m, || decode(&m, &mut caches))?;
        out.insert(
            format!("decode_{n}_rows"),
            json!({
                "wall_ms_graphs": graphs,
                "wall_ms_graphs_by_attention_threads": by_threads,
                "wall_ms_launched": launched,
                "device_ms": device,
            }),
        );
    }
    drop(m);
    out.insert("engine_64_streams".into(), engine(path, 64)?);
    Ok(Value::Object(out))
}

/// The model worker's decode engine in process (no gRPC, no tokio): `streams` greedy
/// generations of up to 64 tokens after a chat prompt of about 200 tokens, started together
/// from threads, as `gpubench`'s served generation load: tokens/s over the wall time, the
/// mean per-stream decode rate and the time to first token (p50). Against the served
/// figures it says what the serving process adds.
fn engine(path: &std::path::Path, streams: usize) -> Result<Value> {
    use model_worker::backend::decoder::llama::{CONTEXT, GenParams, LlamaGenerator};
    use model_worker::backend::device::Placement;
    let g = LlamaGenerator::load_on("smollm2", path, Placement::Cuda, (streams + 4) * CONTEXT, 0)?;
    let params = GenParams {
        max_tokens: 64,
        temperature: 0.0,
        top_p: 1.0,
        stop: vec![],
        seed: 0,
        starts_with: Vec::new(),
        starts_bias: Vec::new(),
    };
    let text = "Retrieval-augmented generation fetches passages from a corpus and hands them \
                to a language model, which then answers from what it was given. "
        .repeat(8);
    let prompt = g.prompt_tokens(&format!("{text}What does it fetch?"), "", &[], false, "")?;
    // Warm-up: one stream (captures nothing for 64 rows, loads the kernels).
    g.generate(&prompt, &params, |_| true)?;
    let t = Instant::now();
    let runs: Vec<(f64, usize, f64)> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..streams)
            .map(|_| {
                s.spawn(|| {
                    let start = Instant::now();
                    let mut first = None;
                    let mut n = 0;
                    g.generate(&prompt, &params, |_| {
                        first.get_or_insert(start.elapsed().as_secs_f64());
                        n += 1;
                        true
                    })?;
                    anyhow::Ok((first.unwrap_or(0.0), n, start.elapsed().as_secs_f64()))
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| {
                h.join()
                    .map_err(|_| anyhow::anyhow!("stream thread panicked"))?
            })
            .collect::<Result<Vec<_>>>()
    })?;
    let wall = t.elapsed().as_secs_f64();
    let tokens: usize = runs.iter().map(|r| r.1).sum();
    let per_stream: Vec<f64> = runs
        .iter()
        .map(|r| (r.1.saturating_sub(1)) as f64 / (r.2 - r.0).max(1e-9))
        .collect();
    Ok(json!({
        "streams": streams,
        "tokens_per_s": tokens as f64 / wall,
        "decode_tokens_per_s_per_stream": per_stream.iter().sum::<f64>() / streams as f64,
        "ttft_p50_ms": median(runs.iter().map(|r| r.0 * 1e3).collect()),
        "tokens": tokens,
    }))
}
