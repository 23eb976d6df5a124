//! `colocated` binary: a coordinator with a shard node in its process. It reads the
//! `[coordinator]`, `[shard_node]` and `[telemetry]` sections of one cluster config (file, then
//! `RAGCLUSTER__{SECTION}__{KEY}`, then flags), as the two separate binaries do.

use std::path::PathBuf;

use clap::Parser;
use coordinator::CoordinatorConfig;
use coordinator::config::CoordinatorFlags;
use ragcluster_common::config::{TelemetryConfig, TelemetryFlags, load_section};
use ragcluster_common::{server, telemetry};
use serde::Serialize;
use shard_node::ShardNodeConfig;

/// Both processes' reasons hold here: hnsw_rs's per-point allocations and the per-query small
/// objects of h2 and prost.
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(
    name = "colocated",
    about = "ragcluster coordinator with a shard node in its process"
)]
struct Flags {
    /// Cluster config file (TOML); the [coordinator], [shard_node] and [telemetry] sections
    /// are read.
    #[arg(long, short = 'c', env = "RAGCLUSTER_CONFIG")]
    config: Option<PathBuf>,
    #[command(flatten)]
    coordinator: CoordinatorFlags,
    #[command(flatten)]
    shard: ShardFlags,
    #[command(flatten)]
    telemetry: TelemetryFlags,
}

#[derive(clap::Args, Serialize)]
struct ShardFlags {
    /// gRPC listen address of the shard node, for Raft peers and other coordinators
    /// (shard_node.listen).
    #[arg(long = "shard-listen", id = "shard_listen", value_name = "ADDR")]
    #[serde(rename = "listen", skip_serializing_if = "Option::is_none")]
    listen: Option<String>,
    /// The shard node's data directory (shard_node.data_dir).
    #[arg(long = "shard-data-dir", id = "shard_data_dir", value_name = "DIR")]
    #[serde(rename = "data_dir", skip_serializing_if = "Option::is_none")]
    data_dir: Option<PathBuf>,
    /// Write the shard node's bound addresses here as JSON (shard_node.port_file).
    #[arg(long = "shard-port-file", id = "shard_port_file", value_name = "PATH")]
    #[serde(rename = "port_file", skip_serializing_if = "Option::is_none")]
    port_file: Option<PathBuf>,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let flags = Flags::parse();
    let file = flags.config.as_deref();
    let tel = TelemetryConfig::load(file, &flags.telemetry)?;
    telemetry::init_logging(&tel);
    let mut coord: CoordinatorConfig = load_section(file, "coordinator", &flags.coordinator)?;
    coord
        .resolve_node_id(std::env::var("HOSTNAME").ok().as_deref())
        .map_err(anyhow::Error::msg)?;
    coord.shard_nodes.retain(|a| !a.is_empty());
    coord.validate().map_err(anyhow::Error::msg)?;
    let shard: ShardNodeConfig = load_section(file, "shard_node", &flags.shard)?;
    shard.validate().map_err(anyhow::Error::msg)?;
    shard_node::init_index_threads(&shard)?;
    // The longer of the two drains bounds the process.
    let limit = coord.shutdown_timeout.max(shard.shutdown_timeout);
    let shutdown = async move {
        server::shutdown_signal().await;
        server::exit_after(limit);
    };
    colocated::run(coord, shard, &tel.metrics_listen, shutdown).await
}
