//! The `colocated` binary, a coordinator with a shard node in its process, with real processes
//! on loopback: its node is a full member (replicas on it and on a separate shard node, Raft
//! between them), the coordinator reads its replicas in process (`coordinator_colocated_calls_total`)
//! and keeps answering from them when the other node dies, one `/metrics` carries both
//! processes' families, and SIGTERM drains and flushes both so that a restart serves the same
//! hits. Beside replicated coordinators, its node registers whichever one leads the catalog.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use ragcluster_proto::v1::coordinator_client::CoordinatorClient;
use ragcluster_proto::v1::*;
use ragcluster_tests::{Cluster, Options, http_get, metric_sum, upsert_with_vectors};
use tonic::transport::Channel;

/// `n` eventual BM25 searches; each must return `k` hits. Returns the last one's chunk ids.
async fn searches(c: &mut CoordinatorClient<Channel>, n: usize, k: usize) -> Result<Vec<String>> {
    let mut last = Vec::new();
    for i in 0..n {
        let r = c
            .search(SearchRequest {
                collection: "co".into(),
                query: "document 7 of co about colocated reads".into(),
                top_k: k as u32,
                mode: SearchMode::Bm25 as i32,
                consistency: Consistency::Eventual as i32,
                ..Default::default()
            })
            .await
            .with_context(|| format!("search {i}"))?
            .into_inner();
        ensure!(r.hits.len() == k, "search {i}: {} hits", r.hits.len());
        last = r.hits.into_iter().map(|h| h.chunk_id).collect();
    }
    Ok(last)
}

/// Creates `name` with 2 shards of 2 replicas (retrying while fewer than two shard nodes are
/// up, for at most 30 s), checks that every shard is on both nodes, and upserts `n` documents.
async fn on_both_nodes(c: &mut CoordinatorClient<Channel>, name: &str, n: usize) -> Result<()> {
    let started = Instant::now();
    let info = loop {
        let r = c
            .create_collection(CreateCollectionRequest {
                name: name.into(),
                shard_count: 2,
                replication_factor: 2,
                ..Default::default()
            })
            .await;
        match r {
            Ok(r) => break r.into_inner().collection.context("no collection")?,
            Err(e) => ensure!(
                started.elapsed() < Duration::from_secs(30),
                "two shard nodes never up: {e}"
            ),
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    };
    for p in &info.shards {
        ensure!(
            p.nodes.len() == 2,
            "shard on {:?}: both nodes expected",
            p.nodes
        );
    }
    upsert_with_vectors(c, name, name, "colocated reads", info.dimension as usize, n).await
}

fn local_calls(page: &str) -> f64 {
    metric_sum(page, "coordinator_colocated_calls_total")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn colocated_node_is_a_member_read_in_process() -> Result<()> {
    let mut cluster = Cluster::start_opts(Options {
        shard_nodes: 1,
        colocated: true,
        ..Default::default()
    })?;
    let mut c = cluster.client().await?;
    on_both_nodes(&mut c, "co", 300).await?;

    // Eventual reads may reach a follower before it applied the writes: wait for both.
    let started = Instant::now();
    while searches(&mut c, 5, 5).await.is_err() {
        ensure!(
            started.elapsed() < Duration::from_secs(20),
            "replicas never caught up"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let page = http_get(&cluster.coordinator.metrics).await?;
    let before = local_calls(&page);
    // One endpoint for both: the shard node's families are on the coordinator's page.
    for family in ["shard_read_calls_total", "coordinator_search_seconds"] {
        ensure!(
            page.lines()
                .any(|l| l.starts_with(&format!("# TYPE {family} "))),
            "{family} missing from the colocated process's /metrics"
        );
    }
    let hits = searches(&mut c, 40, 5).await?;
    let after = local_calls(&http_get(&cluster.coordinator.metrics).await?);
    eprintln!("figures: {} of 80 shard reads in process", after - before);
    // Sequential searches: the local replica is never past its slack, so it serves every read.
    ensure!(
        after - before >= 80.0,
        "only {} of 80 shard reads in process",
        after - before
    );

    // The separate node dies: the local replicas answer everything.
    cluster.shards[0].kill9();
    ensure!(
        searches(&mut c, 20, 5).await? == hits,
        "other hits without the other node"
    );

    // SIGTERM: both drain, the indexes flush, the process exits cleanly and in time.
    let t = Instant::now();
    let status = cluster.coordinator.terminate()?;
    ensure!(status.success(), "colocated exited with {status}");
    ensure!(
        t.elapsed() < Duration::from_secs(15),
        "exit took {:?}",
        t.elapsed()
    );
    cluster.shards[0].restart(Duration::from_secs(60))?;
    cluster.coordinator.restart(Duration::from_secs(60))?;
    let mut c = cluster.client().await?;
    let started = Instant::now();
    loop {
        match searches(&mut c, 5, 5).await {
            Ok(h) if h == hits => break,
            r => ensure!(
                started.elapsed() < Duration::from_secs(30),
                "after a restart: {r:?}, before: {hits:?}"
            ),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Ok(())
}

/// With replicated coordinators, the colocated node heartbeats to its own coordinator, which
/// passes its registration on to whichever one leads the catalog: it gets replicas.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn colocated_node_registers_with_replicated_coordinators() -> Result<()> {
    let cluster = Cluster::start_opts(Options {
        shard_nodes: 1,
        coordinators: 3,
        colocated: true,
        ..Default::default()
    })?;
    let mut c = cluster.client().await?;
    on_both_nodes(&mut c, "co3", 20).await?;
    Ok(())
}
