//! The CPU decoder against llama.cpp on the same GGUF and machine, as llama.cpp's own
//! `llama-bench` measures itself: prompt processing (one forward over `--prompt` tokens, "pp")
//! and generation (`--tokens` single-token steps from an empty context, "tg"), tokens/s, plus
//! resident memory. Each weight format (`model_worker.dequantize`) runs in a child process of
//! its own, so its memory is its own; `--llama-bench PATH` runs llama.cpp's bench in the same
//! run with the same threads (build it from the vendored llama.cpp of llama-cpp-python's
//! source package: docs/bench/README.md). Prints one JSON object with the ratios.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::Parser;
use model_worker::backend::decoder::{Row, load};
use ragcluster_tests::generate_model;
use serde_json::{Value, json};

#[derive(Parser)]
struct Args {
    /// The GGUF (default: the tests' generator, `RAGCLUSTER_GENERATE_MODEL`).
    #[arg(long)]
    model: Option<PathBuf>,
    #[arg(long, default_value_t = 512)]
    prompt: usize,
    #[arg(long, default_value_t = 128)]
    tokens: usize,
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    /// Weight formats of our decoder.
    #[arg(long, value_delimiter = ',', default_value = "none,f32")]
    dequantize: Vec<String>,
    /// llama.cpp's `llama-bench` binary.
    #[arg(long)]
    llama_bench: Option<PathBuf>,
    /// Threads for llama.cpp (ours: the rayon pool, one per core).
    #[arg(long)]
    threads: Option<usize>,
    /// Internal: measure one format in this process.
    #[arg(long, hide = true)]
    child: Option<String>,
}

/// Resident and peak resident memory of this process, MB.
fn memory() -> (f64, f64) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<f64>().ok())
            .map_or(0.0, |kb| kb / 1024.0)
    };
    (field("VmRSS:"), field("VmHWM:"))
}

/// Token ids spread over the vocabulary (llama-bench also decodes arbitrary tokens).
fn tokens(n: usize, vocab: usize, salt: usize) -> Vec<u32> {
    (0..n)
        .map(|i| ((i * 7919 + salt * 104_729 + 13) % vocab.min(30_000)) as u32)
        .collect()
}

/// One format, measured here: best of `repeats` for pp and tg.
fn child(a: &Args, model: &Path) -> Result<Value> {
    let t0 = Instant::now();
    let m = load(model, a.prompt.max(a.tokens) + 8)?;
    let load_s = t0.elapsed().as_secs_f64();
    let vocab = m.dims.vocab;
    let (mut pp, mut tg) = (0f64, 0f64);
    for rep in 0..a.repeats.max(1) {
        let mut cache = m.new_cache();
        let rows: Vec<Row> = tokens(a.prompt, vocab, rep)
            .into_iter()
            .map(|token| Row { seq: 0, token })
            .collect();
        let t = Instant::now();
        m.forward(&rows, &mut [&mut cache], &[rows.len() - 1])?;
        pp = pp.max(a.prompt as f64 / t.elapsed().as_secs_f64());
        let mut cache = m.new_cache();
        let t = Instant::now();
        for token in tokens(a.tokens, vocab, rep + 100) {
            m.forward(&[Row { seq: 0, token }], &mut [&mut cache], &[0])?;
        }
        tg = tg.max(a.tokens as f64 / t.elapsed().as_secs_f64());
    }
    let (rss, hwm) = memory();
    Ok(json!({
        "load_s": load_s,
        "quantized_kernels": m.quantized(),
        "pp_tokens_per_s": pp,
        "tg_tokens_per_s": tg,
        "rss_mb": rss,
        "peak_rss_mb": hwm,
    }))
}

/// Runs this binary for format `dq` (candle reads its dequantization choice from the
/// environment at load, as the model worker sets it from its config).
fn ours(a: &Args, model: &Path, dq: &str) -> Result<Value> {
    let mut cmd = Command::new(std::env::current_exe()?);
    cmd.args(["--child", dq, "--model"])
        .arg(model)
        .args(["--prompt", &a.prompt.to_string()])
        .args(["--tokens", &a.tokens.to_string()])
        .args(["--repeats", &a.repeats.to_string()]);
    cmd.env_remove("CANDLE_DEQUANTIZE_ALL")
        .env_remove("CANDLE_DEQUANTIZE_ALL_F16");
    match dq {
        "f32" => cmd.env("CANDLE_DEQUANTIZE_ALL", "1"),
        "f16" => cmd.env("CANDLE_DEQUANTIZE_ALL_F16", "1"),
        "none" => &mut cmd,
        other => bail!("unknown format {other}"),
    };
    let out = cmd.output()?;
    if !out.status.success() {
        bail!("{dq}: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(serde_json::from_slice(&out.stdout)?)
}

/// llama-bench's pp and tg (mean tokens/s over its repetitions) and its peak memory.
fn llama_cpp(a: &Args, bin: &Path, model: &Path, threads: usize) -> Result<Value> {
    let out = Command::new("/usr/bin/time")
        .arg("-v")
        .arg(bin)
        .arg("-m")
        .arg(model)
        .args(["-p", &a.prompt.to_string(), "-n", &a.tokens.to_string()])
        .args(["-t", &threads.to_string(), "-r", &a.repeats.to_string()])
        // The repacked ("extra") weight buffers die with a general protection fault on
        // VMs that list AMX (as llama-cpp-python's `use_extra_bufts=False` avoids).
        .args(["--repack", "0", "-o", "json"])
        .output()
        .context("llama-bench (and /usr/bin/time)")?;
    if !out.status.success() {
        bail!("llama-bench: {}", String::from_utf8_lossy(&out.stderr));
    }
    let runs: Vec<Value> = serde_json::from_slice(&out.stdout)?;
    let rate = |pp: bool| {
        runs.iter()
            .find(|r| (r["n_prompt"].as_u64().unwrap_or(0) > 0) == pp)
            .and_then(|r| r["avg_ts"].as_f64())
    };
    let stderr = String::from_utf8_lossy(&out.stderr);
    let peak = stderr
        .lines()
        .find_map(|l| l.trim().strip_prefix("Maximum resident set size (kbytes):"))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .map(|kb| kb / 1024.0);
    Ok(json!({
        "pp_tokens_per_s": rate(true),
        "tg_tokens_per_s": rate(false),
        "peak_rss_mb": peak,
        "build": runs.first().map(|r| r["build_commit"].clone()),
        "cpu": runs.first().map(|r| r["cpu_info"].clone()),
    }))
}

fn main() -> Result<()> {
    let a = Args::parse();
    let model = match &a.model {
        Some(m) => m.clone(),
        None => generate_model()?,
    };
    if a.child.is_some() {
        println!("{}", child(&a, &model)?);
        return Ok(());
    }
    let threads = a.threads.unwrap_or_else(num_cpus);
    let file_mb = std::fs::metadata(&model)?.len() as f64 / 1048576.0;
    let mut out = json!({
        "model": model.file_name().map(|f| f.to_string_lossy().into_owned()),
        "file_mb": file_mb,
        "prompt": a.prompt,
        "tokens": a.tokens,
        "threads": threads,
    });
    let reference = match &a.llama_bench {
        Some(bin) => Some(llama_cpp(&a, bin, &model, threads)?),
        None => None,
    };
    for dq in &a.dequantize {
        let mut r = ours(&a, &model, dq)?;
        r["peak_rss_over_file"] = json!(r["peak_rss_mb"].as_f64().unwrap_or(0.0) / file_mb);
        if let Some(l) = &reference {
            for k in ["pp_tokens_per_s", "tg_tokens_per_s"] {
                if let (Some(x), Some(y)) = (r[k].as_f64(), l[k].as_f64()) {
                    r[format!("{k}_vs_llama_cpp")] = json!(x / y);
                }
            }
        }
        out[format!("dequantize_{dq}")] = r;
    }
    if let Some(l) = reference {
        out["llama_cpp"] = l;
    }
    println!("{}", serde_json::to_string_pretty(&out)?);
    Ok(())
}

fn num_cpus() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}
