//! The in-process cluster (`ragcluster_tests::cluster::inproc`): three shard nodes, a model worker and a
//! coordinator in this test's process, the coordinator calling the shard nodes through the
//! shard client's in-process implementation. The same leader-loss scenario as the
//! process-level Raft tests, at in-process cost.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use ragcluster_proto::v1::*;
use ragcluster_tests::cluster::inproc::InProcCluster;
use shard_node::ShardNodeConfig;

fn fast_raft() -> ShardNodeConfig {
    ShardNodeConfig {
        raft_tick: Duration::from_millis(50),
        raft_election_ticks: 10,
        raft_heartbeat_ticks: 2,
        write_timeout: Duration::from_secs(5),
        ..Default::default()
    }
}

fn shard0(collection: &str) -> ShardRef {
    ShardRef {
        collection: collection.into(),
        shard: 0,
    }
}

fn doc(i: u64) -> Document {
    Document {
        id: format!("d{i}"),
        title: format!("Note {i}"),
        text: format!("inproc note number {i} about raft replication and retrieval"),
        ..Default::default()
    }
}

/// Upserts `ids` one document per call; every call must be acknowledged (the coordinator's
/// shard client follows the leader and retries while the group elects).
async fn write_all(c: &InProcCluster, coll: &str, ids: std::ops::Range<u64>) -> Result<()> {
    let mut cc = c.client().await?;
    for i in ids {
        let mut req = tonic::Request::new(UpsertDocumentsRequest {
            collection: coll.into(),
            documents: vec![doc(i)],
            ..Default::default()
        });
        req.set_timeout(Duration::from_secs(20));
        cc.upsert_documents(req)
            .await
            .with_context(|| format!("write d{i}"))?;
    }
    Ok(())
}

/// Index of the node leading shard 0 of `coll`.
async fn leader(c: &InProcCluster, coll: &str) -> Result<usize> {
    let until = Instant::now() + Duration::from_secs(10);
    loop {
        for i in 0..c.nodes() {
            if c.raft_status(i, &shard0(coll))
                .await
                .is_some_and(|s| s.role() == RaftRole::Leader)
            {
                return Ok(i);
            }
        }
        if Instant::now() > until {
            bail!("no leader for {coll}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits until every replica applied the same index and holds `chunks` chunks.
async fn converged(c: &InProcCluster, coll: &str, chunks: u64) -> Result<()> {
    let until = Instant::now() + Duration::from_secs(60);
    loop {
        let mut seen = Vec::new();
        for i in 0..c.nodes() {
            let n = c.connector.get(c.address(i)).context("node stopped")?;
            let info = coordinator::shards::ShardNode::shard_info(
                n.as_ref(),
                shard0(coll),
                Duration::from_secs(1),
            )
            .await
            .ok();
            seen.push(info.map(|i| (i.raft.map_or(0, |r| r.applied_index), i.chunks)));
        }
        if seen
            .iter()
            .all(|s| s.is_some_and(|(a, n)| n == chunks && Some(a) == seen[0].map(|s| s.0)))
        {
            return Ok(());
        }
        if Instant::now() > until {
            bail!("replicas did not converge on {chunks} chunks: {seen:?}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_cluster_in_one_process_searches_and_survives_losing_its_leader() -> Result<()> {
    let mut c = InProcCluster::start(3, fast_raft()).await?;
    let mut cc = c.client().await?;
    cc.create_collection(CreateCollectionRequest {
        name: "ip".into(),
        shard_count: 1,
        replication_factor: 3,
        ..Default::default()
    })
    .await?;
    write_all(&c, "ip", 0..20).await?;
    for mode in [SearchMode::Bm25, SearchMode::Dense, SearchMode::Hybrid] {
        let hits = cc
            .search(SearchRequest {
                collection: "ip".into(),
                query: "note number 7".into(),
                top_k: 5,
                mode: mode as i32,
                ..Default::default()
            })
            .await?
            .into_inner()
            .hits;
        ensure!(hits.len() == 5, "{mode:?}: {} hits", hits.len());
        if mode == SearchMode::Bm25 {
            ensure!(
                hits[0].doc_id == "d7",
                "{mode:?}: first hit {}",
                hits[0].doc_id
            );
        }
    }

    // Stop the leader: the two others elect one and writes go on through the shard client.
    let l = leader(&c, "ip").await?;
    c.stop_node(l).await?;
    let stopped = Instant::now();
    write_all(&c, "ip", 20..40).await?;
    let new_leader = leader(&c, "ip").await?;
    ensure!(new_leader != l);
    eprintln!(
        "in-process: 20 writes acknowledged {} ms after the leader stopped",
        stopped.elapsed().as_millis()
    );

    // Restarted in place, it recovers from its data directory and catches up.
    c.start_node(l).await?;
    converged(&c, "ip", 40).await?;
    let hits = cc
        .search(SearchRequest {
            collection: "ip".into(),
            query: "note number 33".into(),
            top_k: 3,
            mode: SearchMode::Bm25 as i32,
            consistency: Consistency::Strong as i32,
            ..Default::default()
        })
        .await?
        .into_inner()
        .hits;
    ensure!(
        hits.first().is_some_and(|h| h.doc_id == "d33"),
        "after restart: {hits:?}"
    );
    Ok(())
}
