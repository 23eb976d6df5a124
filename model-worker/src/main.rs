//! `model-worker` binary: flags -> layered config -> `model_worker::run`.

use std::path::PathBuf;

use clap::Parser;
use model_worker::ModelWorkerConfig;
use model_worker::config::ModelSpec;
use ragcluster_common::config::{TelemetryConfig, TelemetryFlags, load_section};
use ragcluster_common::{server, telemetry};
use serde::Serialize;

#[derive(Parser, Serialize)]
#[command(
    name = "model-worker",
    about = "ragcluster model worker: embeddings, reranking and text generation"
)]
struct Flags {
    /// Cluster config file (TOML); the [model_worker] and [telemetry] sections are read.
    #[arg(long, short = 'c', env = "RAGCLUSTER_CONFIG")]
    #[serde(skip)]
    config: Option<PathBuf>,
    /// gRPC listen address (model_worker.listen).
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    listen: Option<String>,
    /// Coordinators to register with and heartbeat to, comma separated
    /// (model_worker.coordinators).
    #[arg(long, value_delimiter = ',')]
    #[serde(skip_serializing_if = "Option::is_none")]
    coordinators: Option<Vec<String>>,
    /// Where the node id is kept (model_worker.data_dir).
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    data_dir: Option<PathBuf>,
    /// Write the bound addresses here as JSON (model_worker.port_file).
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    port_file: Option<PathBuf>,
    /// Path of an embedding model: an HF directory (all-MiniLM-L6-v2) or a nomic-bert
    /// .gguf, named after the directory or the file's stem; repeat the flag to serve several,
    /// the first being the default (replaces the embed models of model_worker.models).
    #[arg(long)]
    #[serde(skip)]
    embed_model: Vec<PathBuf>,
    /// Path of a GGUF generator (llama or qwen2 architecture) to serve for Generate, named
    /// after the file; repeat the flag to serve several, the first being the default
    /// (replaces the generate models of model_worker.models).
    #[arg(long)]
    #[serde(skip)]
    generate_model: Vec<PathBuf>,
    /// Path of a rerank model (added to model_worker.models as kind "rerank", named after the
    /// file): an HF cross-encoder directory, a BERT directory (MaxSim) or a GGUF (LLM yes/no).
    #[arg(long)]
    #[serde(skip)]
    rerank_model: Option<PathBuf>,
    /// OpenAI-compatible HTTP API address (model_worker.http_listen).
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    http_listen: Option<String>,
    #[command(flatten)]
    #[serde(skip)]
    telemetry: TelemetryFlags,
}

fn main() -> anyhow::Result<()> {
    let flags = Flags::parse();
    let file = flags.config.as_deref();
    let tel = TelemetryConfig::load(file, &flags.telemetry)?;
    let mut cfg: ModelWorkerConfig = load_section(file, "model_worker", &flags)?;
    if !flags.embed_model.is_empty() {
        cfg.models.retain(|m| m.kind != "embed");
    }
    for (i, path) in flags.embed_model.iter().enumerate() {
        let name = if path.is_dir() {
            path.file_name()
        } else {
            path.file_stem()
        }
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "embed".into());
        cfg.models
            .insert(i, ModelSpec::new(&name, "embed", path.clone()));
    }
    if !flags.generate_model.is_empty() {
        cfg.models.retain(|m| m.kind != "generate");
    }
    for path in &flags.generate_model {
        let name = path
            .file_stem()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "generate".into());
        cfg.models
            .push(ModelSpec::new(&name, "generate", path.clone()));
    }
    if let Some(path) = &flags.rerank_model {
        let stem = path
            .file_stem()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "rerank".into());
        cfg.models.retain(|m| m.kind != "rerank");
        // Unique even when the same directory also serves embeddings.
        cfg.models.push(ModelSpec::new(
            &format!("{stem}-rerank"),
            "rerank",
            path.clone(),
        ));
    }
    cfg.validate().map_err(anyhow::Error::msg)?;
    // candle decides at load time, from these variables, whether quantized weights are
    // dequantized; set them before any thread exists.
    let var = match cfg.dequantize.as_str() {
        "f32" => Some("CANDLE_DEQUANTIZE_ALL"),
        "f16" => Some("CANDLE_DEQUANTIZE_ALL_F16"),
        _ => None,
    };
    if let Some(v) = var {
        // SAFETY: single-threaded here: no runtime, logger or other thread has started, so
        // nothing reads the environment concurrently.
        #[allow(unsafe_code)]
        unsafe {
            std::env::set_var(v, "1")
        };
    }
    telemetry::init_logging(&tel);
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?
        .block_on(async move {
            let limit = cfg.shutdown_timeout;
            let shutdown = async move {
                server::shutdown_signal().await;
                server::exit_after(limit);
            };
            model_worker::run(cfg, &tel.metrics_listen, shutdown).await
        })
}
