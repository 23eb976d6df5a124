//! Write throughput and commit latency with replication factor 1 vs 3 on a local 3-node
//! cluster: documents with precomputed embeddings through Coordinator.UpsertDocuments (so no
//! model time), `--batch` documents per call, `--concurrency` calls in flight. Then snapshot
//! transfer: a shard of `--snapshot-docs` documents gets a new learner replica on a second
//! node, which can only catch up by snapshot (the log was compacted); reports the stream rate
//! (sender side, file to acknowledged install) and the whole catch-up time. Prints one JSON
//! object; each write phase also reports the CPU the coordinator and shard nodes used per
//! chunk and how many cores they kept busy.

use std::time::{Duration, Instant};

use anyhow::Result;
use clap::Parser;
use futures::StreamExt;
use ragcluster_proto::v1::shard_client::ShardClient;
use ragcluster_proto::v1::*;
use ragcluster_tests::{Cluster, metric_sum, percentile};
use rand::{Rng, SeedableRng};
use tonic::transport::Channel;

#[derive(Parser)]
struct Args {
    #[arg(long, default_value_t = 5000)]
    docs: u64,
    #[arg(long, default_value_t = 50)]
    batch: u64,
    #[arg(long, default_value_t = 4)]
    concurrency: usize,
    /// Documents in the shard whose snapshot is measured (0: skip).
    #[arg(long, default_value_t = 30_000)]
    snapshot_docs: u64,
}

fn doc(id: u64) -> Document {
    let mut rng = rand::rngs::StdRng::seed_from_u64(id);
    let v: Vec<f32> = (0..384).map(|_| rng.random_range(-1.0..1.0)).collect();
    Document {
        id: format!("d{id}"),
        text: format!("benchmark document {id} about replicated retrieval"),
        embedding: v,
        ..Default::default()
    }
}

#[tokio::main]
async fn main() -> Result<()> {
    let a = Args::parse();
    let cluster = Cluster::start(3)?;
    let mut out = serde_json::Map::new();
    for rf in [1u32, 3] {
        let mut c = cluster.client().await?;
        let name = format!("rf{rf}");
        c.create_collection(CreateCollectionRequest {
            name: name.clone(),
            shard_count: 1,
            replication_factor: rf,
            ..Default::default()
        })
        .await?;
        // Warm-up: leader elected, channels connected.
        c.upsert_documents(UpsertDocumentsRequest {
            collection: name.clone(),
            documents: vec![doc(u64::MAX / 2)],
            ..Default::default()
        })
        .await?;
        let cpu_before = cluster.data_path_cpu_seconds();
        let started = Instant::now();
        let lat: Vec<f64> = futures::stream::iter((0..a.docs).step_by(a.batch as usize))
            .map(|s| {
                let mut c = c.clone();
                let name = name.clone();
                let docs = (s..(s + a.batch).min(a.docs)).map(doc).collect();
                async move {
                    let t = Instant::now();
                    c.upsert_documents(UpsertDocumentsRequest {
                        collection: name,
                        documents: docs,
                        ..Default::default()
                    })
                    .await?;
                    anyhow::Ok(t.elapsed().as_secs_f64() * 1e3)
                }
            })
            .buffer_unordered(a.concurrency)
            .collect::<Vec<_>>()
            .await
            .into_iter()
            .collect::<Result<_>>()?;
        let secs = started.elapsed().as_secs_f64();
        let cpu = cluster.data_path_cpu_seconds() - cpu_before;
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
        let mut l = lat.clone();
        out.insert(
            name,
            serde_json::json!({
                "chunks_per_s": a.docs as f64 / secs,
                "batch_docs": a.batch,
                "concurrency": a.concurrency,
                "p50_ms": percentile(&mut l, 50.0),
                "p99_ms": percentile(&mut l, 99.0),
                // Coordinator + shard nodes: whether the run was bound by the cores (a
                // replica factor of 3 does three times the indexing).
                "cpu_ms_per_chunk": 1e3 * cpu / a.docs as f64,
                "cores_busy": cpu / secs,
                "cores": cores,
            }),
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    drop(cluster);
    if a.snapshot_docs > 0 {
        out.insert("snapshot".into(), snapshot_transfer(&a).await?);
    }
    println!("{}", serde_json::to_string_pretty(&out)?);
    Ok(())
}

async fn shard(addr: &str) -> Result<ShardClient<Channel>> {
    Ok(
        ShardClient::new(Channel::from_shared(addr.to_owned())?.connect().await?)
            .max_decoding_message_size(64 << 20),
    )
}

async fn snapshot_transfer(a: &Args) -> Result<serde_json::Value> {
    let cluster = Cluster::start_with(2, Some("[shard_node]\nraft_log_gc_threshold = 100\n"))?;
    let mut c = cluster.client().await?;
    c.create_collection(CreateCollectionRequest {
        name: "snap".into(),
        shard_count: 1,
        replication_factor: 1,
        ..Default::default()
    })
    .await?;
    let ids: Vec<u64> = (0..a.snapshot_docs).collect();
    futures::stream::iter(ids.chunks(a.batch as usize).map(|b| b.to_vec()))
        .map(|b| {
            let mut c = c.clone();
            async move {
                c.upsert_documents(UpsertDocumentsRequest {
                    collection: "snap".into(),
                    documents: b.into_iter().map(doc).collect(),
                    ..Default::default()
                })
                .await
            }
        })
        .buffer_unordered(a.concurrency)
        .collect::<Vec<_>>()
        .await
        .into_iter()
        .collect::<Result<Vec<_>, _>>()?;
    let placed = c
        .describe_collection(DescribeCollectionRequest {
            name: "snap".into(),
        })
        .await?
        .into_inner()
        .collection
        .unwrap_or_default()
        .shards[0]
        .nodes[0]
        .clone();
    let (leader, learner) = if cluster.shards[0].grpc == placed {
        (&cluster.shards[0], &cluster.shards[1])
    } else {
        (&cluster.shards[1], &cluster.shards[0])
    };
    let sref = Some(ShardRef {
        collection: "snap".into(),
        shard: 0,
    });
    let mut lc = shard(&leader.grpc).await?;
    let mut nc = shard(&learner.grpc).await?;
    let learner_id = nc.node_info(NodeInfoRequest {}).await?.into_inner().node_id;
    let leader_id = lc.node_info(NodeInfoRequest {}).await?.into_inner().node_id;
    nc.open_shard(OpenShardRequest {
        shard: sref.clone(),
        dimension: 384,
        hnsw: Some(HnswParams {
            m: 16,
            ef_construction: 200,
            ef_search: 64,
        }),
        peers: vec![Peer {
            node_id: leader_id,
            address: leader.grpc.clone(),
        }],
        join: true,
    })
    .await?;
    let commit = lc
        .shard_info(ShardInfoRequest {
            shard: sref.clone(),
        })
        .await?
        .into_inner()
        .raft
        .unwrap_or_default();
    let started = Instant::now();
    lc.change_replicas(ChangeReplicasRequest {
        shard: sref.clone(),
        change: ReplicaChange::AddLearner as i32,
        peer: Some(Peer {
            node_id: learner_id,
            address: learner.grpc.clone(),
        }),
    })
    .await?;
    loop {
        let st = nc
            .shard_info(ShardInfoRequest {
                shard: sref.clone(),
            })
            .await?
            .into_inner();
        if st
            .raft
            .is_some_and(|r| r.applied_index >= commit.commit_index)
            && st.chunks >= a.snapshot_docs
        {
            break;
        }
        anyhow::ensure!(
            started.elapsed() < Duration::from_secs(600),
            "learner did not catch up"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let catch_up = started.elapsed().as_secs_f64();
    let m = ragcluster_tests::http_get(&leader.metrics).await?;
    let bytes = metric_sum(&m, "raft_snapshot_sent_bytes_total");
    let secs = metric_sum(&m, "raft_snapshot_send_seconds_sum");
    anyhow::ensure!(bytes > 0.0 && secs > 0.0, "no snapshot was sent");
    // Whether the learner loaded the graph the snapshot shipped or rebuilt it.
    let lm = ragcluster_tests::http_get(&learner.metrics).await?;
    let graph = |source: &str| {
        metric_sum(
            &lm,
            &format!("shard_snapshot_graphs_total{{graph=\"{source}\"}}"),
        )
    };
    Ok(serde_json::json!({
        "graph_shipped": graph("shipped"),
        "graph_rebuilt": graph("rebuilt"),
        "docs": a.snapshot_docs,
        "first_log_index_at_add": commit.first_log_index,
        "snapshot_bytes": bytes,
        "stream_mb_per_s": bytes / secs / 1e6,
        "catch_up_s": catch_up,
        "catch_up_mb_per_s": bytes / catch_up / 1e6,
    }))
}
