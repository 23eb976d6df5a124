//! `coordinator` binary: flags -> layered config -> `coordinator::run`.

use std::path::PathBuf;

use clap::Parser;
use coordinator::CoordinatorConfig;
use ragcluster_common::config::{TelemetryConfig, TelemetryFlags, load_section};
use ragcluster_common::{server, telemetry};
use serde::Serialize;

/// Every query allocates and frees many small objects (h2 frames, prost messages, hit lists);
/// mimalloc's per-thread free lists serve them with less CPU than glibc's malloc.
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser, Serialize)]
#[command(
    name = "coordinator",
    about = "ragcluster coordinator: catalog, ingest and distributed search"
)]
struct Flags {
    /// Cluster config file (TOML); the [coordinator] and [telemetry] sections are read.
    #[arg(long, short = 'c', env = "RAGCLUSTER_CONFIG")]
    #[serde(skip)]
    config: Option<PathBuf>,
    /// gRPC listen address (coordinator.listen).
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    listen: Option<String>,
    /// Catalog directory (coordinator.data_dir).
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    data_dir: Option<PathBuf>,
    /// Shard node addresses, comma separated (coordinator.shard_nodes).
    #[arg(long, value_delimiter = ',')]
    #[serde(skip_serializing_if = "Option::is_none")]
    shard_nodes: Option<Vec<String>>,
    /// Model worker address (coordinator.model_worker).
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    model_worker: Option<String>,
    /// tokenizer.json of the embedding model (coordinator.embedding_tokenizer).
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    embedding_tokenizer: Option<PathBuf>,
    /// Raft id of this coordinator in the catalog group (coordinator.node_id).
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    node_id: Option<u64>,
    /// All coordinators as ID=URL, comma separated (coordinator.peers).
    #[arg(long, value_delimiter = ',')]
    #[serde(skip_serializing_if = "Option::is_none")]
    peers: Option<Vec<String>>,
    /// Flow file for Ask (coordinator.flows_file); default: the shipped example flows.
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    flows_file: Option<PathBuf>,
    /// Write the bound addresses here as JSON (coordinator.port_file).
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    port_file: Option<PathBuf>,
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
    let mut cfg: CoordinatorConfig = load_section(file, "coordinator", &flags)?;
    cfg.resolve_node_id(std::env::var("HOSTNAME").ok().as_deref())
        .map_err(anyhow::Error::msg)?;
    // `--shard-nodes ""` (no seeds: members register themselves) is an empty list.
    cfg.shard_nodes.retain(|a| !a.is_empty());
    cfg.validate().map_err(anyhow::Error::msg)?;
    let limit = cfg.shutdown_timeout;
    let shutdown = async move {
        server::shutdown_signal().await;
        server::exit_after(limit);
    };
    coordinator::run(cfg, &tel.metrics_listen, shutdown).await
}
