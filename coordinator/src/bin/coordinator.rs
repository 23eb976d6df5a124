//! `coordinator` binary: flags -> layered config -> `coordinator::run`.

use std::path::PathBuf;

use clap::Parser;
use coordinator::CoordinatorConfig;
use coordinator::config::CoordinatorFlags;
use ragcluster_common::config::{TelemetryConfig, TelemetryFlags, load_section};
use ragcluster_common::{server, telemetry};

/// Every query allocates and frees many small objects (h2 frames, prost messages, hit lists);
/// mimalloc's per-thread free lists serve them with less CPU than glibc's malloc.
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(
    name = "coordinator",
    about = "ragcluster coordinator: catalog, ingest and distributed search"
)]
struct Flags {
    /// Cluster config file (TOML); the [coordinator] and [telemetry] sections are read.
    #[arg(long, short = 'c', env = "RAGCLUSTER_CONFIG")]
    config: Option<PathBuf>,
    #[command(flatten)]
    coordinator: CoordinatorFlags,
    #[command(flatten)]
    telemetry: TelemetryFlags,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let flags = Flags::parse();
    let file = flags.config.as_deref();
    let tel = TelemetryConfig::load(file, &flags.telemetry)?;
    telemetry::init_logging(&tel);
    let mut cfg: CoordinatorConfig = load_section(file, "coordinator", &flags.coordinator)?;
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
