//! Write throughput and commit latency with replication factor 1 vs 3 on a local 3-node
//! cluster: documents with precomputed embeddings through Coordinator.UpsertDocuments (so no
//! model time), `--batch` documents per call, `--concurrency` calls in flight. Prints one
//! JSON object.

use std::time::{Duration, Instant};

use anyhow::Result;
use clap::Parser;
use futures::StreamExt;
use ragcluster_proto::v1::*;
use ragcluster_tests::{Cluster, percentile};
use rand::{Rng, SeedableRng};

#[derive(Parser)]
struct Args {
    #[arg(long, default_value_t = 5000)]
    docs: u64,
    #[arg(long, default_value_t = 50)]
    batch: u64,
    #[arg(long, default_value_t = 4)]
    concurrency: usize,
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
        })
        .await?;
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
        let mut l = lat.clone();
        out.insert(
            name,
            serde_json::json!({
                "chunks_per_s": a.docs as f64 / secs,
                "batch_docs": a.batch,
                "concurrency": a.concurrency,
                "p50_ms": percentile(&mut l, 50.0),
                "p99_ms": percentile(&mut l, 99.0),
            }),
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    println!("{}", serde_json::to_string_pretty(&out)?);
    Ok(())
}
