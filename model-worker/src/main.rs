//! `model-worker` binary: flags -> layered config -> `model_worker::run`.

use std::path::PathBuf;

use clap::Parser;
use model_worker::ModelWorkerConfig;
use ragcluster_common::config::{TelemetryConfig, TelemetryFlags, load_section};
use ragcluster_common::{server, telemetry};
use serde::Serialize;

#[derive(Parser, Serialize)]
#[command(
    name = "model-worker",
    about = "ragcluster model worker: embeddings on CPU"
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
    /// Write the bound addresses here as JSON (model_worker.port_file).
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    port_file: Option<PathBuf>,
    /// Path of the default embedding model directory (replaces model_worker.models with one
    /// all-MiniLM-L6-v2-style embed model at this path).
    #[arg(long)]
    #[serde(skip)]
    embed_model: Option<PathBuf>,
    #[command(flatten)]
    #[serde(skip)]
    telemetry: TelemetryFlags,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let flags = Flags::parse();
    let file = flags.config.as_deref();
    let tel = TelemetryConfig::load(file, &flags.telemetry)?;
    telemetry::init_logging(&tel);
    let mut cfg: ModelWorkerConfig = load_section(file, "model_worker", &flags)?;
    if let Some(path) = &flags.embed_model {
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "embed".into());
        cfg.models = vec![model_worker::config::ModelSpec {
            name,
            kind: "embed".into(),
            path: path.clone(),
            device: "auto".into(),
            max_sequence_length: 0,
        }];
    }
    cfg.validate().map_err(anyhow::Error::msg)?;
    model_worker::run(cfg, &tel.metrics_listen, server::shutdown_signal()).await
}
