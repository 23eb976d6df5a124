//! A coordinator and a shard node in one process, the way an Elasticsearch node can hold data
//! and coordinate: on 2 cores the hop between the two was 12-20% of a 1-shard query's server
//! CPU, and without it whole SciFact serves 1.16-1.31x the BM25 and dense queries per second
//! (docs/bench/2026-11-27-colocated.json). The shard node is a full member on its own port
//! (Raft peers, other coordinators, `ragctl`); the coordinator calls it through `LocalNode`,
//! directly into its gRPC service with no socket and no encoding, and prefers its replicas
//! for eventual reads.
//!
//! This crate only composes: the coordinator knows shard nodes through its `ShardNode` trait,
//! and neither process crate depends on the other.

pub mod local;

pub use local::LocalNode;

use std::future::Future;
use std::sync::Arc;

use coordinator::CoordinatorConfig;
use ragcluster_common::telemetry;
use shard_node::ShardNodeConfig;
use tokio::sync::watch;

/// Where the node registers when `shard_node.coordinators` is not set: among replicated
/// coordinators only the catalog leader registers seed addresses, and that may be another one,
/// so the node heartbeats to its own coordinator, which passes the registration on to the
/// leader. (A single coordinator registers its node itself.)
pub fn register_with_own(
    coordinator: &CoordinatorConfig,
    shard: &mut ShardNodeConfig,
) -> anyhow::Result<()> {
    if shard.coordinators.is_empty() && !coordinator.peers.is_empty() {
        let members = coordinator.catalog_members().map_err(anyhow::Error::msg)?;
        if let Some(own) = members.get(&coordinator.node_id) {
            shard.coordinators = vec![own.clone()];
        }
    }
    Ok(())
}

/// Serves both until `shutdown` resolves: the coordinator drains while the shard node hands
/// its leaderships to other replicas and drains, and the node's indexes are flushed last.
pub async fn run(
    coordinator: CoordinatorConfig,
    mut shard: ShardNodeConfig,
    metrics_listen: &str,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    register_with_own(&coordinator, &mut shard)?;
    // One `/metrics` for both (their families have distinct prefixes).
    let metrics_addr = telemetry::serve_metrics(metrics_listen).await?;
    let (stop_tx, stop_rx) = watch::channel(false);
    let stop_tx = Arc::new(stop_tx);
    {
        let stop_tx = stop_tx.clone();
        tokio::spawn(async move {
            shutdown.await;
            stop_tx.send_replace(true);
        });
    }
    let stopped = |mut rx: watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|s| *s).await;
    };
    let node =
        shard_node::start_sharing_metrics(shard.clone(), metrics_addr, stopped(stop_rx.clone()))
            .await?;
    let address = shard_node::membership::advertised(&shard, node.addr)?;
    tracing::info!(%address, "co-located shard node serving");
    let local = Arc::new(LocalNode::new(node.node.clone(), &shard));
    let served =
        coordinator::run_colocated(coordinator, metrics_addr, stopped(stop_rx), address, local)
            .await;
    // A coordinator that failed to start (or stopped on its own) takes the node down with it.
    stop_tx.send_replace(true);
    let flushed = node.served.await?;
    served.and(flushed)
}
