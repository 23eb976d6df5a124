//! The cost of picking a sampled token, per row of real SmolLM2 logits (49,152 entries):
//! the engine's sampler (`model_worker::backend::decoder::sampling`) next to candle's
//! `LogitsProcessor` (what the engine used before) in one run, for several temperature /
//! top-p settings; how far each one's draws are from the exact distribution (total variation
//! over `--draws` draws of a few rows, the same noise floor for both); and the response's
//! log-probability, vectorised against the scalar libm loop it replaced.
//! Rows come from the CPU decoder: each test prompt, then greedy steps. Prints one JSON object.

use std::time::Instant;

use anyhow::Result;
use candle_core::{Device, Tensor};
use candle_transformers::generation::LogitsProcessor;
use clap::Parser;
use model_worker::backend::decoder::llama::LlamaGenerator;
use model_worker::backend::decoder::sampling::{Sampler, logprob};
use model_worker::backend::decoder::{self, Row};
use ragcluster_tests::generate_model;
use ragcluster_tests::llama::{PROMPTS, argmax};
use serde_json::json;

#[derive(Parser)]
struct Args {
    /// Greedy steps after each prompt whose logits are kept (rows = prompts x (1 + steps)).
    #[arg(long, default_value_t = 15)]
    steps: usize,
    /// Passes over the rows per timing.
    #[arg(long, default_value_t = 10)]
    passes: usize,
    /// Draws per row for the distribution check (candle's sampler takes milliseconds each).
    #[arg(long, default_value_t = 4_000)]
    draws: usize,
}

/// (temperature, top_p) settings; top_p 1 is no cut-off.
const SETTINGS: [(f64, f64); 5] = [(0.7, 1.0), (1.0, 1.0), (0.7, 0.9), (1.0, 0.95), (0.7, 0.5)];

fn rows(steps: usize) -> Result<Vec<Vec<f32>>> {
    let path = generate_model()?;
    let generator = LlamaGenerator::load("smollm2", &path)?;
    let model = decoder::load(&path, 4096)?;
    let mut out = Vec::new();
    for p in PROMPTS {
        let prompt = generator.prompt_tokens(p, "", &[], false, "")?;
        let mut cache = model.new_cache();
        let rows: Vec<Row> = prompt.iter().map(|&token| Row { seq: 0, token }).collect();
        let mut logits = model
            .forward(&rows, &mut [&mut cache], &[rows.len() - 1])?
            .remove(0);
        for _ in 0..steps {
            let token = argmax(&logits);
            out.push(logits);
            logits = model
                .forward(&[Row { seq: 0, token }], &mut [&mut cache], &[0])?
                .remove(0);
        }
        out.push(logits);
    }
    Ok(out)
}

/// Microseconds per row of `pick` over every row, `passes` times.
fn time(rows: &[Vec<f32>], passes: usize, mut pick: impl FnMut(&[f32]) -> u32) -> f64 {
    let mut sink = 0u64;
    let t = Instant::now();
    for _ in 0..passes {
        for r in rows {
            sink = sink.wrapping_add(u64::from(pick(r)));
        }
    }
    std::hint::black_box(sink);
    t.elapsed().as_secs_f64() * 1e6 / (passes * rows.len()) as f64
}

/// The exact distribution of a row under (temperature, top_p), in f64: nucleus by a
/// stable sort of every token, as `LogitsProcessor` cuts it.
fn exact(row: &[f32], t: f64, p: f64) -> Vec<f64> {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let w: Vec<f64> = row
        .iter()
        .map(|&l| (f64::from(l - max) / t).exp())
        .collect();
    let total: f64 = w.iter().sum();
    let mut keep = vec![p >= 1.0; row.len()];
    if p < 1.0 {
        let mut idx: Vec<usize> = (0..row.len()).collect();
        idx.sort_by(|&a, &b| w[b].total_cmp(&w[a]));
        let mut mass = 0.0;
        for i in idx {
            if mass >= p * total {
                break;
            }
            mass += w[i];
            keep[i] = true;
        }
    }
    let kept: f64 = w.iter().zip(&keep).filter(|x| *x.1).map(|x| x.0).sum();
    w.iter()
        .zip(&keep)
        .map(|(&x, &k)| if k { x / kept } else { 0.0 })
        .collect()
}

fn total_variation(want: &[f64], counts: &[u32], draws: usize) -> f64 {
    want.iter()
        .zip(counts)
        .map(|(w, &c)| (w - f64::from(c) / draws as f64).abs())
        .sum::<f64>()
        / 2.0
}

/// The log-probability as the worker computed it before (scalar, libm exp).
fn logprob_scalar(logits: &[f32], token: u32) -> f32 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let lse = max + logits.iter().map(|l| (l - max).exp()).sum::<f32>().ln();
    logits[token as usize] - lse
}

fn main() -> Result<()> {
    let a = Args::parse();
    let rows = rows(a.steps)?;
    let vocab = rows[0].len();
    let mut settings = Vec::new();
    for (t, p) in SETTINGS {
        let mut ours = Sampler::new(1, t, p);
        let mut candle = LogitsProcessor::new(1, Some(t), (p < 1.0).then_some(p));
        // Alternate, twice each, so drift on the machine hits both.
        let mut us_ours = Vec::new();
        let mut us_candle = Vec::new();
        for _ in 0..2 {
            us_ours.push(time(&rows, a.passes, |r| ours.sample(r)));
            us_candle.push(time(&rows, a.passes, |r| {
                candle
                    .sample(&Tensor::new(r, &Device::Cpu).expect("row tensor"))
                    .expect("candle sample")
            }));
        }
        let best = |v: &[f64]| v.iter().copied().fold(f64::INFINITY, f64::min);
        // Distribution check on the first prompt's prefill row and its first decode row.
        let mut tv_ours = Vec::new();
        let mut tv_candle = Vec::new();
        for r in [0, 1] {
            let row = &rows[r.min(rows.len() - 1)];
            let want = exact(row, t, p);
            let mut c_ours = vec![0u32; vocab];
            let mut c_candle = vec![0u32; vocab];
            let tensor = Tensor::new(row.as_slice(), &Device::Cpu)?;
            for _ in 0..a.draws {
                c_ours[ours.sample(row) as usize] += 1;
                c_candle[candle.sample(&tensor)? as usize] += 1;
            }
            tv_ours.push(total_variation(&want, &c_ours, a.draws));
            tv_candle.push(total_variation(&want, &c_candle, a.draws));
        }
        settings.push(json!({
            "temperature": t,
            "top_p": p,
            "us_per_row_ours": us_ours,
            "us_per_row_candle": us_candle,
            "speedup_best_of_2": best(&us_candle) / best(&us_ours),
            "total_variation_vs_exact_ours": tv_ours,
            "total_variation_vs_exact_candle": tv_candle,
        }));
    }
    let tokens: Vec<u32> = rows.iter().map(|r| argmax(r)).collect();
    let mut k = 0;
    let us_lp = time(&rows, a.passes, |r| {
        k += 1;
        logprob(r, tokens[k % tokens.len()]).to_bits()
    });
    let mut k = 0;
    let us_lp_scalar = time(&rows, a.passes, |r| {
        k += 1;
        logprob_scalar(r, tokens[k % tokens.len()]).to_bits()
    });
    let max_diff = rows
        .iter()
        .zip(&tokens)
        .map(|(r, &t)| (logprob(r, t) - logprob_scalar(r, t)).abs())
        .fold(0f32, f32::max);
    let out = json!({
        "rows": rows.len(),
        "vocab": vocab,
        "passes": a.passes,
        "draws_per_row": a.draws,
        "settings": settings,
        "logprob": {
            "us_per_row_vectorised": us_lp,
            "us_per_row_scalar": us_lp_scalar,
            "max_abs_difference": max_diff,
        },
        "threads": 1,
    });
    println!("{}", serde_json::to_string_pretty(&out)?);
    Ok(())
}
