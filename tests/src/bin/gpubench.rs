//! Every model-worker figure of the GPU issue, side by side in one run, as one JSON object:
//! - `encoder`: all-MiniLM-L6-v2 in-process at each `--batches` size on CUDA, plus the CPU
//!   path at batch 32, on 1,024 SciFact passages cut to 300 characters and sorted longest
//!   first, and the lowest cosine between the CUDA and CPU embeddings (must exceed 0.999);
//! - `cpu_encoder_scaling`: the CPU encoder at batch 32 at each `--cpu-threads` count (each
//!   in its own process, its rayon pool sized by `RAYON_NUM_THREADS`), and with `--python`
//!   sentence-transformers on the CPU over the same texts with 2 threads and with every core;
//! - `served_embed`: a model-worker process (`device = "auto"`) under `--clients`
//!   single-text clients, and 16 clients sending 32 texts per call;
//! - `generation`: SmolLM2-135M through the model worker's Generate, greedy, `--gen-tokens`
//!   new tokens after a ~200-token prompt, at each `--gen-streams` count: aggregate and
//!   per-stream decode tokens/s and time to first token;
//! - `python` (with `--python`): sentence-transformers fp32 and fp16 on the same GPU and
//!   texts, and transformers `generate` on the same GGUF (needs the `gguf` wheel);
//! - `cluster` (with `--cluster`): wall time of `ragctl eval retrieval --ingest` on SciFact
//!   against a local 3-shard cluster;
//! - `ingest_pipeline` (with `--cluster`): `ragctl ingest` of SciFact into a fresh 3-shard
//!   cluster, chunks/s with the model and with it excluded (embedding cache), the worker's
//!   device-busy share and `nvidia-smi` utilisation samples (`ragcluster_tests::bench::pipeline`).
//!
//! - `profile` (with CUDA): the CUDA decoder in process, a 2,040-row prefill step and decode
//!   steps of 1, 8 and 64 rows: host wall time per forward (graphs on and off) and device
//!   time per operation (`ragcluster_tests::bench::decodeprof`).
//!
//! The served sections also report the worker's own histograms over each load (batch sizes,
//! time in the encoder's forwards, queueing; the decode forward's time per step), which say
//! where a request's time went. `--sections` runs a subset; `--out` writes the JSON after
//! every section, and a failed section records its error while the rest still run, so a
//! short GPU lease brings back whatever could be measured.
//!
//! Without a usable GPU every section still runs on the CPU (and says so in `machine`), so
//! the binary is exercised on any machine; the GPU targets only mean something on one.

use std::process::Command;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::Parser;
use model_worker::backend::device::Placement;
use model_worker::backend::encoder::bert::{self, BertEncoder, HeadKind};
use model_worker::backend::{Encoder, Seq};
use ragcluster_proto::v1::model_worker_client::ModelWorkerClient;
use ragcluster_tests::bench::threads::Sample;
use ragcluster_tests::bench::workerload::{Sampling, embed_load, generate_load, generate_stream};
use ragcluster_tests::{Cluster, Proc, datasets_dir, embed_model, generate_model};
use serde_json::{Value, json};
use tonic::transport::Channel;

#[derive(Parser)]
struct Args {
    #[arg(long, value_delimiter = ',', default_value = "1,8,32,128,256")]
    batches: Vec<usize>,
    /// Concurrent single-text Embed clients.
    #[arg(long, default_value_t = 64)]
    clients: usize,
    /// Embed calls per client.
    #[arg(long, default_value_t = 32)]
    requests: usize,
    #[arg(long, value_delimiter = ',', default_value = "1,8,64")]
    gen_streams: Vec<usize>,
    #[arg(long, default_value_t = 128)]
    gen_tokens: u32,
    /// Python with torch, sentence_transformers and transformers (+ gguf); "" = skip.
    #[arg(long, default_value = "")]
    python: String,
    /// Also time `ragctl eval retrieval --ingest` of SciFact on a local cluster.
    #[arg(long)]
    cluster: bool,
    /// Sections to run (encoder, cpu, served, generation, profile, python, cluster, ingest);
    /// empty = all that apply (profile with CUDA, python with `--python`, cluster and ingest
    /// with `--cluster`).
    #[arg(long, value_delimiter = ',')]
    sections: Vec<String>,
    /// Also write the JSON here after every section, so a run cut short keeps what it measured.
    #[arg(long)]
    out: Option<std::path::PathBuf>,
    /// Thread counts of the CPU encoder's scaling curve; 0 = every core.
    #[arg(long, value_delimiter = ',', default_value = "2,0")]
    cpu_threads: Vec<usize>,
    /// Internal: print the CPU encoder's batch-32 rate and exit.
    #[arg(long, hide = true)]
    cpu_encoder_child: bool,
}

fn texts() -> Result<Vec<String>> {
    let corpus = std::fs::read_to_string(datasets_dir().join("scifact/corpus.jsonl"))
        .context("scifact corpus")?;
    Ok(corpus
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter_map(|v| v["text"].as_str().map(|t| t.chars().take(300).collect()))
        .take(1024)
        .collect())
}

/// Sentences/s over the first `max(8 b, 64)` sequences in batches of `b` (after one warm
/// batch), the median of three passes. `seqs` is sorted longest first, as the worker's
/// batcher and sentence-transformers' `encode` order their input.
fn rate(enc: &mut BertEncoder, seqs: &[Seq], b: usize) -> Result<f64> {
    let n = seqs.len().min((b * 8).max(64));
    let refs: Vec<&Seq> = seqs[..n].iter().collect();
    enc.forward(&refs[..b.min(n)])?;
    let mut passes = Vec::with_capacity(3);
    for _ in 0..3 {
        let t = Instant::now();
        for chunk in refs.chunks(b) {
            enc.forward(chunk)?;
        }
        passes.push(n as f64 / t.elapsed().as_secs_f64());
    }
    passes.sort_by(f64::total_cmp);
    Ok(passes[1])
}

/// Median ms per forward over batches of `b` from `seqs`, each after `gap` of idling.
fn forward_ms(
    enc: &mut BertEncoder,
    seqs: &[Seq],
    b: usize,
    gap: Option<std::time::Duration>,
) -> Result<f64> {
    let refs: Vec<&Seq> = seqs.iter().take(b * 16).collect();
    let mut ms = Vec::new();
    for chunk in refs.chunks(b) {
        if let Some(g) = gap {
            std::thread::sleep(g);
        }
        let t = Instant::now();
        enc.forward(chunk)?;
        ms.push(t.elapsed().as_secs_f64() * 1e3);
    }
    ms.sort_by(f64::total_cmp);
    Ok(ms[ms.len() / 2])
}

fn sorted_seqs(enc: &BertEncoder, texts: &[String]) -> Result<Vec<Seq>> {
    let mut seqs = bert::tokenize(&enc.tokenizer(), texts)?;
    seqs.sort_by_key(|s| std::cmp::Reverse(s.ids.len()));
    Ok(seqs)
}

fn encoder(texts: &[String], batches: &[usize], cuda: bool) -> Result<Value> {
    let dir = embed_model()?;
    let mut cpu = BertEncoder::load_on("minilm", &dir, 0, HeadKind::MeanPool, Placement::Cpu)?;
    let seqs = sorted_seqs(&cpu, texts)?;
    let mut out = json!({"cpu_batch_32": rate(&mut cpu, &seqs, 32)?});
    if !cuda {
        return Ok(out);
    }
    let mut gpu = BertEncoder::load_on("minilm", &dir, 0, HeadKind::MeanPool, Placement::Cuda)?;
    let mut min_cos = 1f32;
    for chunk in seqs[..256].chunks(32) {
        let refs: Vec<&Seq> = chunk.iter().collect();
        for (x, y) in cpu.forward(&refs)?.iter().zip(&gpu.forward(&refs)?) {
            min_cos = min_cos.min(x.iter().zip(y).map(|(p, q)| p * q).sum());
        }
    }
    let mut rates = serde_json::Map::new();
    for &b in batches {
        rates.insert(b.to_string(), json!(rate(&mut gpu, &seqs, b)?));
    }
    out["cuda_sentences_per_s"] = Value::Object(rates);
    // A served worker's forwards come between idle gaps (requests gathering): the same
    // batches of 32 with 3 ms between forwards, as ms per forward, against back to back.
    out["cuda_batch_32_ms_per_forward"] = json!({
        "back_to_back": forward_ms(&mut gpu, &seqs, 32, None)?,
        "after_3ms_idle": forward_ms(&mut gpu, &seqs, 32, Some(std::time::Duration::from_millis(3)))?,
    });
    out["min_cosine_cuda_vs_cpu"] = json!(min_cos);
    Ok(out)
}

/// The CPU encoder's batch-32 rate in a child process limited to `threads` threads.
fn cpu_rate_with(threads: usize) -> Result<f64> {
    let out = Command::new(std::env::current_exe()?)
        .arg("--cpu-encoder-child")
        .env("RAYON_NUM_THREADS", threads.to_string())
        .output()?;
    anyhow::ensure!(
        out.status.success(),
        "cpu encoder child: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8_lossy(&out.stdout).trim().parse()?)
}

fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// The texts `rate` encodes at batch 32: the 256 with the most tokens (ties in corpus order).
fn cpu_texts(texts: &[String]) -> Result<Vec<String>> {
    let enc = BertEncoder::load("minilm", &embed_model()?, 0, HeadKind::MeanPool)?;
    let seqs = bert::tokenize(&enc.tokenizer(), texts)?;
    let mut order: Vec<usize> = (0..texts.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(seqs[i].ids.len()));
    Ok(order.iter().take(256).map(|&i| texts[i].clone()).collect())
}

/// Our CPU encoder's batch-32 rate at each thread count, its scaling from 2 threads to every
/// core, and with `--python` sentence-transformers on the CPU over the same 256 texts (2
/// threads and every core) with our rate over theirs.
fn cpu_scaling(a: &Args, texts: &[String]) -> Result<Value> {
    let all = cores();
    let mut counts: Vec<usize> = a
        .cpu_threads
        .iter()
        .map(|&t| if t == 0 { all } else { t.min(all) })
        .collect();
    counts.sort_unstable();
    counts.dedup();
    let mut ours = serde_json::Map::new();
    for &t in &counts {
        ours.insert(t.to_string(), json!(cpu_rate_with(t)?));
    }
    let at = |t: usize| ours.get(&t.to_string()).and_then(Value::as_f64);
    let mut out = json!({
        "sentences_per_s_by_threads": ours.clone(),
        "all_threads": all,
        "ratio_all_over_2": at(all).zip(at(2)).map(|(x, y)| x / y),
    });
    if a.python.is_empty() {
        return Ok(out);
    }
    let file = std::env::temp_dir().join(format!("gpubench-cpu-{}.json", std::process::id()));
    let same = cpu_texts(texts)?;
    std::fs::write(&file, serde_json::to_string(&same)?)?;
    let mut st = serde_json::Map::new();
    for t in [2.min(all), all] {
        let o = Command::new(&a.python)
            .arg(python_script("st_embed_bench.py").display().to_string())
            .arg(embed_model()?.display().to_string())
            .arg(file.display().to_string())
            .args(["32", &t.to_string(), "cpu", "fp32", &same.len().to_string()])
            .output()?;
        let v: Value = serde_json::from_slice(&o.stdout).unwrap_or_else(
            |_| json!({"error": String::from_utf8_lossy(&o.stderr).lines().last().unwrap_or("").to_owned()}),
        );
        let theirs = v["sentences_per_s"]["32"].as_f64();
        st.insert(
            t.to_string(),
            json!({"sentences_per_s": theirs, "ours_over_theirs": at(t).zip(theirs).map(|(x, y)| x / y), "run": v}),
        );
    }
    let _ = std::fs::remove_file(&file);
    out["sentence_transformers_cpu_batch_32"] = Value::Object(st);
    Ok(out)
}

/// A script of `scripts/`: the checkout this was built in, else the current directory (a
/// copy of the tree on another machine, as the README's GPU command runs it).
fn python_script(name: &str) -> std::path::PathBuf {
    Some(ragcluster_tests::workspace())
        .filter(|w| w.join("scripts").is_dir())
        .unwrap_or_else(|| std::path::PathBuf::from("."))
        .join("scripts")
        .join(name)
}

async fn connect(p: &Proc) -> Result<ModelWorkerClient<Channel>> {
    Ok(ModelWorkerClient::new(
        Channel::from_shared(p.grpc.clone())?.connect().await?,
    ))
}

async fn served_embed(texts: &[String], a: &Args) -> Result<Value> {
    let dir = tempfile::tempdir()?;
    let cfg = dir.path().join("mw.toml");
    std::fs::write(
        &cfg,
        "[model_worker]\nmax_batch = 256\nmax_batch_tokens = 32768\n",
    )?;
    let worker = Proc::model_worker(dir.path(), false, Some(&cfg))?;
    let c = connect(&worker).await?;
    embed_load(&c, texts, 8, 2, 1).await?; // warm-up
    let mut out = serde_json::Map::new();
    // The first single-text round meets new batch shapes (the encoder captures a CUDA graph
    // per shape on first use); the second is the steady state of a server that has run.
    for (key, clients, requests, per_call) in [
        ("single_text_first", a.clients, a.requests, 1),
        ("single_text", a.clients, a.requests, 1),
        ("batched_calls", 16, 8, 32),
    ] {
        let before = worker_stats(&worker).await?;
        let threads = worker.pid().map(Sample::take);
        let t = Instant::now();
        let mut load = embed_load(&c, texts, clients, requests, per_call).await?;
        let wall = t.elapsed().as_secs_f64();
        load["worker"] = stats_delta(&before, &worker_stats(&worker).await?, wall);
        if let (Some(b), Some(pid)) = (threads, worker.pid()) {
            load["worker_threads"] = b.until(&Sample::take(pid));
        }
        out.insert(key.into(), load);
    }
    Ok(Value::Object(out))
}

/// Sums and counts of the model worker's histograms that say where a request's time went
/// (and counters, ending in `_total`: their value).
const WORKER_HISTOGRAMS: [&str; 8] = [
    "model_device_seconds",
    "model_encoder_enqueue_seconds",
    "model_encoder_finish_seconds",
    "model_batch_size",
    "model_queue_seconds",
    "model_decode_forward_seconds",
    "model_decode_step_rows",
    "model_encoder_graph_captures_total",
];

async fn worker_stats(p: &Proc) -> Result<Vec<(f64, f64)>> {
    let page = ragcluster_tests::http_get(&p.metrics).await?;
    Ok(WORKER_HISTOGRAMS
        .iter()
        .map(|h| match h.ends_with("_total") {
            true => (ragcluster_tests::metric_sum(&page, h), 0.0),
            false => (
                ragcluster_tests::metric_sum(&page, &format!("{h}_sum")),
                ragcluster_tests::metric_sum(&page, &format!("{h}_count")),
            ),
        })
        .collect())
}

/// Per histogram over one load: observations, their mean, and their sum over the wall time
/// (for `model_device_seconds`: the share of the time the encoder was in a forward).
fn stats_delta(before: &[(f64, f64)], after: &[(f64, f64)], wall: f64) -> Value {
    let mut out = serde_json::Map::new();
    for (name, (b, a)) in WORKER_HISTOGRAMS.iter().zip(before.iter().zip(after)) {
        let (sum, count) = (a.0 - b.0, a.1 - b.1);
        if name.ends_with("_total") {
            out.insert((*name).into(), json!({"delta": sum, "value": a.0}));
        } else if count > 0.0 {
            out.insert(
                (*name).into(),
                json!({"count": count, "mean": sum / count, "sum_over_wall": sum / wall}),
            );
        }
    }
    Value::Object(out)
}

/// A chat prompt of about 200 tokens (SmolLM2's tokenizer): SciFact passages to answer from.
fn gen_prompt(texts: &[String]) -> String {
    let mut p = String::from("Answer from these passages.\n");
    for t in texts.iter().take(3) {
        p.push_str(t);
        p.push('\n');
    }
    p.push_str("Question: what do the passages say about the measured effect?");
    p
}

async fn generation(texts: &[String], a: &Args) -> Result<Value> {
    let most = a.gen_streams.iter().copied().max().unwrap_or(1);
    let dir = tempfile::tempdir()?;
    let cfg = dir.path().join("mw.toml");
    std::fs::write(
        &cfg,
        format!("[model_worker]\nmax_concurrent_generations = {most}\n"),
    )?;
    let worker = Proc::model_worker(dir.path(), true, Some(&cfg))?;
    let c = connect(&worker).await?;
    let prompt = gen_prompt(texts);
    generate_stream(c.clone(), prompt.clone(), 4, Sampling::GREEDY, 0).await?; // warm-up
    let mut out = serde_json::Map::new();
    for &n in &a.gen_streams {
        let before = worker_stats(&worker).await?;
        let threads = worker.pid().map(Sample::take);
        let t = Instant::now();
        let mut load = generate_load(&c, &prompt, n, a.gen_tokens, Sampling::GREEDY).await?;
        let wall = t.elapsed().as_secs_f64();
        load["worker"] = stats_delta(&before, &worker_stats(&worker).await?, wall);
        if let (Some(b), Some(pid)) = (threads, worker.pid()) {
            load["worker_threads"] = b.until(&Sample::take(pid));
        }
        out.insert(format!("streams_{n}"), load);
    }
    // The same load at the most streams with a temperature and a nucleus cut-off: on CUDA
    // the decoder draws those rows itself (`sample_rows`); RAGCLUSTER_DEVICE_SAMPLING=0 in
    // the environment copies their logits to the host sampler instead (the A/B).
    let sampled = Sampling {
        temperature: 0.7,
        top_p: 0.9,
    };
    let before = worker_stats(&worker).await?;
    let t = Instant::now();
    let mut load = generate_load(&c, &prompt, most, a.gen_tokens, sampled).await?;
    load["worker"] = stats_delta(
        &before,
        &worker_stats(&worker).await?,
        t.elapsed().as_secs_f64(),
    );
    load["sampling"] = json!({"temperature": 0.7, "top_p": 0.9, "RAGCLUSTER_DEVICE_SAMPLING": std::env::var("RAGCLUSTER_DEVICE_SAMPLING").ok()});
    out.insert(format!("streams_{most}_sampled"), load);
    out.insert("prompt_chars".into(), json!(prompt.len()));
    out.insert("worker_log_device".into(), json!(device_line(&worker)));
    Ok(Value::Object(out))
}

/// The model worker's log line that says where each model runs.
fn device_line(p: &Proc) -> Vec<String> {
    std::fs::read_to_string(p.log())
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains("CUDA") || l.contains("cuda") || l.contains("device"))
        .take(8)
        .map(str::to_owned)
        .collect()
}

fn python_refs(python: &str, texts: &[String], batches: &[usize], a: &Args) -> Result<Value> {
    let file = std::env::temp_dir().join(format!("gpubench-{}.json", std::process::id()));
    std::fs::write(&file, serde_json::to_string(texts)?)?;
    let b: Vec<String> = batches.iter().map(|b| b.to_string()).collect();
    let run = |args: Vec<String>| -> Value {
        match Command::new(python).args(&args).output() {
            Ok(o) if o.status.success() => serde_json::from_slice(&o.stdout)
                .unwrap_or_else(|e| json!({"error": e.to_string()})),
            Ok(o) => {
                json!({"error": String::from_utf8_lossy(&o.stderr).lines().last().unwrap_or("").to_owned()})
            }
            Err(e) => json!({"error": e.to_string()}),
        }
    };
    let model = embed_model()?.display().to_string();
    let st = |dtype: &str| {
        run(vec![
            python_script("st_embed_bench.py").display().to_string(),
            model.clone(),
            file.display().to_string(),
            b.join(","),
            cores().to_string(),
            "cuda".into(),
            dtype.into(),
        ])
    };
    let streams: Vec<String> = a.gen_streams.iter().map(|s| s.to_string()).collect();
    let out = json!({
        "sentence_transformers_fp32": st("fp32"),
        "sentence_transformers_fp16": st("fp16"),
        "transformers_generate": run(vec![
            python_script("hf_generate_bench.py").display().to_string(),
            generate_model()?.display().to_string(),
            gen_prompt(texts),
            streams.join(","),
            a.gen_tokens.to_string(),
        ]),
    });
    let _ = std::fs::remove_file(&file);
    Ok(out)
}

fn cluster_eval() -> Result<Value> {
    let cluster = Cluster::start(3)?;
    let t = Instant::now();
    let dataset = datasets_dir().join("scifact").display().to_string();
    let report = ragcluster_tests::ragctl_at(
        &cluster.coordinator.grpc,
        &[
            "eval",
            "retrieval",
            "--collection",
            "scifact",
            "--dataset",
            &dataset,
            "--ingest",
        ],
    )?;
    Ok(json!({
        "shard_nodes": 3,
        "wall_s": t.elapsed().as_secs_f64(),
        "report_tail": report.lines().rev().take(8).collect::<Vec<_>>(),
    }))
}

/// `ragctl ingest` of SciFact into a fresh 3-shard cluster, with the model and without it.
async fn ingest_pipeline() -> Result<Value> {
    let cluster = Cluster::start(3)?;
    let dataset = datasets_dir().join("scifact");
    ragcluster_tests::bench::pipeline::ingest_twice(
        &cluster,
        &ragcluster_tests::bench::pipeline::PipelineOptions {
            dataset: &dataset,
            docs: 0,
            copies: 1,
            shards: 3,
            batch: 128,
            concurrency: 16,
            ef_construction: None,
            cached_passes: 3,
            dump_chunks: None,
        },
    )
    .await
}

#[tokio::main]
async fn main() -> Result<()> {
    let a = Args::parse();
    let texts = texts()?;
    if a.cpu_encoder_child {
        let mut cpu = BertEncoder::load("minilm", &embed_model()?, 0, HeadKind::MeanPool)?;
        let seqs = sorted_seqs(&cpu, &texts)?;
        println!("{}", rate(&mut cpu, &seqs, 32)?);
        return Ok(());
    }
    let cuda = model_worker::backend::cuda::available();
    let mut out = json!({
        "machine": {
            "cores": cores(),
            "cuda": cuda,
            "gpu": model_worker::backend::cuda::device_name(),
        },
        "texts": texts.len(),
        "chars_per_text": 300,
    });
    let want = |name: &str| a.sections.is_empty() || a.sections.iter().any(|s| s == name);
    // A section that fails records its error and the run goes on: one GPU lease should
    // bring back every figure that could be measured.
    let save = |out: &Value| -> Result<()> {
        if let Some(p) = &a.out {
            std::fs::write(p, serde_json::to_string_pretty(out)?)?;
        }
        Ok(())
    };
    let record = |out: &mut Value, key: &str, r: Result<Value>, t: Instant| -> Result<()> {
        let v = r.unwrap_or_else(|e| json!({"error": format!("{e:#}")}));
        eprintln!("gpubench: {key} done in {:.1} s", t.elapsed().as_secs_f64());
        out[key] = v;
        save(out)
    };
    if want("encoder") {
        let t = Instant::now();
        record(&mut out, "encoder", encoder(&texts, &a.batches, cuda), t)?;
    }
    if want("cpu") {
        let t = Instant::now();
        record(&mut out, "cpu_encoder_scaling", cpu_scaling(&a, &texts), t)?;
    }
    if want("served") {
        let t = Instant::now();
        record(&mut out, "served_embed", served_embed(&texts, &a).await, t)?;
    }
    if want("generation") {
        let t = Instant::now();
        record(&mut out, "generation", generation(&texts, &a).await, t)?;
    }
    if cuda && want("profile") {
        let t = Instant::now();
        let r =
            generate_model().and_then(|p| ragcluster_tests::bench::decodeprof::decoder_profile(&p));
        record(&mut out, "decoder_profile", r, t)?;
    }
    if !a.python.is_empty() && want("python") {
        let t = Instant::now();
        let r = python_refs(&a.python, &texts, &a.batches, &a);
        record(&mut out, "python", r, t)?;
    }
    if a.cluster && want("cluster") {
        let t = Instant::now();
        record(&mut out, "cluster", cluster_eval(), t)?;
    }
    if a.cluster && want("ingest") {
        let t = Instant::now();
        let r = ingest_pipeline().await;
        record(&mut out, "ingest_pipeline", r, t)?;
    }
    println!("{}", serde_json::to_string_pretty(&out)?);
    Ok(())
}
