//! Distributed BM25 must score like one index: the same SciFact slice in a 1-shard and a
//! 4-shard collection returns the same top-10 with scores equal to 1e-4, because shards score
//! with collection-wide statistics gathered by the coordinator. That holds for repeated
//! queries answered from the coordinator's statistics cache, and after writes made its figures
//! stale. It needs no process fault, so it runs on the in-process cluster
//! (`ragcluster_tests::cluster::inproc`): the coordinator's shard client calls the four shard nodes
//! directly, and the statistics rounds are the same code.

use anyhow::{Context, Result, ensure};
use ragcluster_proto::v1::coordinator_client::CoordinatorClient;
use ragcluster_proto::v1::*;
use ragcluster_tests::cluster::inproc::InProcCluster;
use ragcluster_tests::{BeirDoc, BeirQuery, datasets_dir, http_get, metric_sum, read_jsonl};
use shard_node::ShardNodeConfig;
use tonic::transport::Channel;

const DOCS: usize = 200;
const QUERIES: usize = 40;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_shards_score_like_one() -> Result<()> {
    let scifact = datasets_dir().join("scifact");
    let corpus: Vec<BeirDoc> = read_jsonl(&scifact.join("corpus.jsonl"), DOCS)
        .context("SciFact corpus (../shared/datasets)")?;
    let queries: Vec<BeirQuery> = read_jsonl(&scifact.join("queries.jsonl"), QUERIES)?;
    let cluster = InProcCluster::start(4, ShardNodeConfig::default()).await?;
    let mut c = cluster.client().await?;
    for (name, shards) in [("one", 1), ("four", 4)] {
        c.create_collection(CreateCollectionRequest {
            name: name.into(),
            shard_count: shards,
            ..Default::default()
        })
        .await?;
    }
    upsert(&mut c, &corpus[..DOCS - 50]).await?;
    let d = c
        .describe_collection(DescribeCollectionRequest {
            name: "four".into(),
        })
        .await?
        .into_inner();
    assert!(
        d.shards.iter().all(|s| s.chunks > 0),
        "every shard holds part of the corpus"
    );
    let cache = |outcome: &'static str| {
        let m = cluster.metrics.clone();
        async move {
            let text = http_get(&m).await?;
            let line = format!("coordinator_bm25_stats_cache_total{{outcome=\"{outcome}\"}}");
            anyhow::Ok(metric_sum(&text, &line))
        }
    };
    // First pass: every query misses the cache; second: every one hits it (one round).
    compare(&mut c, &queries).await?;
    let hits = cache("hit").await?;
    compare(&mut c, &queries).await?;
    ensure!(
        cache("hit").await? - hits >= QUERIES as f64,
        "repeated queries did not use the cached statistics"
    );
    // Writes move every shard: the cached figures are refused and both rounds run again.
    let stale = cache("stale").await?;
    upsert(&mut c, &corpus[DOCS - 50..]).await?;
    compare(&mut c, &queries).await?;
    ensure!(
        cache("stale").await? - stale >= QUERIES as f64,
        "stale statistics were not detected"
    );
    Ok(())
}

/// Writes `docs` into both collections.
async fn upsert(c: &mut CoordinatorClient<Channel>, docs: &[BeirDoc]) -> Result<()> {
    for name in ["one", "four"] {
        for batch in docs.chunks(100) {
            let documents = batch
                .iter()
                .map(|d| Document {
                    id: d.id.clone(),
                    title: d.title.clone(),
                    text: d.text.clone(),
                    ..Default::default()
                })
                .collect();
            c.upsert_documents(UpsertDocumentsRequest {
                collection: name.into(),
                documents,
                ..Default::default()
            })
            .await?;
        }
    }
    Ok(())
}

/// Every query on both collections: same scores, same chunks above the cut-off.
async fn compare(c: &mut CoordinatorClient<Channel>, queries: &[BeirQuery]) -> Result<()> {
    let mut compared = 0;
    for q in queries {
        let run = |coll: &str| SearchRequest {
            collection: coll.into(),
            query: q.text.clone(),
            top_k: 10,
            mode: SearchMode::Bm25 as i32,
            ..Default::default()
        };
        let one = c.search(run("one")).await?.into_inner().hits;
        let four = c.search(run("four")).await?.into_inner().hits;
        assert_eq!(one.len(), four.len(), "query {}", q.id);
        for (i, (a, b)) in one.iter().zip(&four).enumerate() {
            assert!(
                (a.score - b.score).abs() <= 1e-4,
                "query {} rank {i}: {} vs {}",
                q.id,
                a.score,
                b.score
            );
        }
        // Same chunks, apart from ties at the cut-off score (either tied chunk may make the cut).
        let floor = one.last().map_or(0.0, |h| h.score) + 1e-4;
        let above = |v: &[SearchHit]| {
            let mut ids: Vec<String> = v
                .iter()
                .filter(|h| h.score > floor)
                .map(|h| h.chunk_id.clone())
                .collect();
            ids.sort();
            ids
        };
        assert_eq!(above(&one), above(&four), "query {}", q.id);
        compared += one.len();
    }
    assert!(
        compared > QUERIES * 5,
        "queries returned too few hits to compare ({compared})"
    );
    Ok(())
}
