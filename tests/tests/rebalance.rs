//! Moving replicas while clients work, as an operator does it with ragctl: on four shard nodes
//! holding a 4-shard, 3-replica collection, one client writes and another searches without
//! pause while `ragctl shard move` moves a shard's preferred leader away, `ragctl node drain`
//! empties a node, and `ragctl rebalance` evens replicas and leaders again. No client request
//! may fail except with a retried UNAVAILABLE / DEADLINE_EXCEEDED, every acknowledged write
//! must be found afterwards, and the replicas must converge.

use std::collections::BTreeMap;

use std::time::Duration;

use anyhow::{Context, Result, ensure};
use ragcluster_proto::v1::admin_client::AdminClient;
use ragcluster_proto::v1::*;
use ragcluster_tests::load::{Load, converged};
use ragcluster_tests::{Cluster, ragctl_at};
use tonic::transport::Channel;

/// Replicas and leaders per shard node.
async fn spread(
    admin: &mut AdminClient<Channel>,
) -> Result<(BTreeMap<String, u32>, BTreeMap<String, u32>)> {
    let st = admin
        .cluster_status(ClusterStatusRequest {})
        .await?
        .into_inner();
    let nodes = st.nodes.iter().filter(|n| n.kind() == NodeKind::ShardNode);
    Ok((
        nodes
            .clone()
            .map(|n| (n.address.clone(), n.shards))
            .collect(),
        nodes.map(|n| (n.address.clone(), n.leaders)).collect(),
    ))
}

fn within_one(m: &BTreeMap<String, u32>) -> bool {
    let (lo, hi) = (m.values().min(), m.values().max());
    matches!((lo, hi), (Some(lo), Some(hi)) if hi - lo <= 1)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn move_drain_rebalance_under_load() -> Result<()> {
    let cluster = Cluster::start(4)?;
    let mut c = cluster.client().await?;
    let info = c
        .create_collection(CreateCollectionRequest {
            name: "moving".into(),
            shard_count: 4,
            replication_factor: 3,
            ..Default::default()
        })
        .await?
        .into_inner()
        .collection
        .context("collection")?;
    let mut admin = AdminClient::new(
        Channel::from_shared(cluster.coordinator.grpc.clone())?
            .connect()
            .await?,
    );
    let load = Load::start(c.clone(), "moving", "rb", SearchMode::Hybrid);
    while load.written().await < 30 {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // 1. Move shard 0's preferred leader to the node that lacks the shard.
    let placed = info.shards[0].nodes.clone();
    let from = placed[0].clone();
    let to = cluster
        .shards
        .iter()
        .map(|p| p.grpc.clone())
        .find(|a| !placed.contains(a))
        .context("a node without shard 0")?;
    let out = tokio::task::block_in_place(|| {
        ragctl_at(
            &cluster.coordinator.grpc,
            &["shard", "move", "moving/0", "--from", &from, "--to", &to],
        )
    })?;
    ensure!(out.is_empty() || !out.contains("error"), "{out}");
    let now = c
        .describe_collection(DescribeCollectionRequest {
            name: "moving".into(),
        })
        .await?
        .into_inner()
        .collection
        .context("collection")?;
    ensure!(
        now.shards[0].nodes.contains(&to) && !now.shards[0].nodes.contains(&from),
        "placement after the move: {:?}",
        now.shards[0].nodes
    );
    // Asking again is a no-op (the move is done).
    tokio::task::block_in_place(|| {
        ragctl_at(
            &cluster.coordinator.grpc,
            &["shard", "move", "moving/0", "--from", &from, "--to", &to],
        )
    })?;

    // 2. Drain a node.
    let drained = cluster.shards[1].grpc.clone();
    tokio::task::block_in_place(|| {
        ragctl_at(&cluster.coordinator.grpc, &["node", "drain", &drained])
    })?;
    let (replicas, _) = spread(&mut admin).await?;
    ensure!(replicas[&drained] == 0, "after drain: {replicas:?}");

    // 3. Rebalance: plan, then run; a second run has nothing to do.
    let plan = tokio::task::block_in_place(|| {
        ragctl_at(&cluster.coordinator.grpc, &["rebalance", "--dry-run"])
    })?;
    ensure!(plan.contains("move replica"), "{plan}");
    tokio::task::block_in_place(|| ragctl_at(&cluster.coordinator.grpc, &["rebalance"]))?;
    let (replicas, leaders) = spread(&mut admin).await?;
    ensure!(within_one(&replicas), "replicas per node: {replicas:?}");
    ensure!(
        replicas.values().sum::<u32>() == 12,
        "replicas: {replicas:?}"
    );
    ensure!(within_one(&leaders), "leaders per node: {leaders:?}");
    let again =
        tokio::task::block_in_place(|| ragctl_at(&cluster.coordinator.grpc, &["rebalance"]))?;
    ensure!(again.contains("nothing to do"), "{again}");

    load.stop().await?;
    converged(&mut admin, "moving", 3, Duration::from_secs(60)).await?;
    load.verify(c).await?;
    Ok(())
}
