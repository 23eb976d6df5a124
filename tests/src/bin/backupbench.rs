//! `backupbench`: backup and restore (issue 69). A source cluster (3 shard nodes, 3 shards)
//! holds `--size` SciFact chunks (their MiniLM vectors, perturbed copies beyond the real
//! ones: `make bench-chunks` writes them), written straight to the shards. Then:
//!
//! - `ragctl backup create` while `--writers` clients keep upserting one document a call
//!   through the coordinator: backup time, bytes, chunks/s, and the writes acknowledged
//!   before it began, during it and after it;
//! - `ragctl backup restore` into a fresh cluster of `--restore-nodes` shard nodes: restore
//!   time (the calls acknowledged), then the time until every restored point is in its
//!   shard's HNSW graph;
//! - every write acknowledged before the backup began is in the restored collection, and
//!   the restored document count is the manifest's;
//! - writes stopped, a second backup restored in place of the first, then `--queries`
//!   SciFact queries (MiniLM) against both sides, dense and BM25: how many top 10 lists are
//!   identical, and the overlap of the dense ones (two HNSW graphs built apart need not give
//!   the same approximate lists; BM25 is exact). Lists count as identical with the same scores and the same hits above
//!   the 10th score (ties at the cut are ordered by where documents sit in each index). Then
//!   the same dense queries with `exact` (every vector scored, equal scores by chunk id): the
//!   restored data answers with the same ids in the same order.
//!
//! `cargo run --release -p ragcluster-tests --bin backupbench -- --size 200000`

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use clap::Parser;
use parking_lot::Mutex;
use prost::Message;
use ragcluster_proto::v1::coordinator_client::CoordinatorClient;
use ragcluster_proto::v1::model_worker_client::ModelWorkerClient;
use ragcluster_proto::v1::*;
use ragcluster_tests::bench::scale::{
    create_collection, embed_queries, perturbed_copies, wait_graphs, write_direct_with,
};
use ragcluster_tests::{
    BeirQuery, Cluster, bin_dir, datasets_dir, missing_documents, read_jsonl, same_ranking,
};
use serde_json::json;
use tonic::transport::Channel;

#[derive(Parser)]
struct Args {
    #[arg(long, default_value = "bench-out/scifact-chunks.pb")]
    chunks: PathBuf,
    #[arg(long, default_value_t = 200_000)]
    size: usize,
    #[arg(long, default_value_t = 2)]
    writers: usize,
    /// Seconds the writers run before the backup begins (the writes it must hold).
    #[arg(long, default_value_t = 30.0)]
    writes_before_s: f64,
    #[arg(long, default_value_t = 1)]
    restore_nodes: usize,
    #[arg(long, default_value_t = 300)]
    queries: usize,
    #[arg(long)]
    out: Option<PathBuf>,
}

const C: &str = "bk";

type Acks = Arc<Mutex<Vec<(String, Instant)>>>;

/// Upserts one document a call (a copy of a real chunk's vector) until `stop`.
async fn writer(
    mut c: CoordinatorClient<Channel>,
    who: usize,
    base: Vec<Chunk>,
    stop: Arc<AtomicBool>,
    acks: Acks,
) -> Result<()> {
    let mut k = 0;
    while !stop.load(Ordering::Relaxed) {
        let src = &base[(who * 7919 + k) % base.len()];
        let id = format!("w{who}-{k}");
        c.upsert_documents(UpsertDocumentsRequest {
            collection: C.into(),
            documents: vec![Document {
                id: id.clone(),
                title: src.title.clone(),
                text: src.text.clone(),
                embedding: src.embedding.clone(),
                ..Default::default()
            }],
            ..Default::default()
        })
        .await?;
        acks.lock().push((id, Instant::now()));
        k += 1;
    }
    Ok(())
}

/// Runs `ragctl --coordinator ADDR ARGS` off the runtime; its seconds.
async fn ragctl(addr: &str, args: &[&str]) -> Result<f64> {
    let mut cmd = std::process::Command::new(bin_dir().join("ragctl"));
    cmd.args(["--coordinator", addr]).args(args);
    let t = Instant::now();
    let o = tokio::task::spawn_blocking(move || cmd.output()).await??;
    let took = t.elapsed().as_secs_f64();
    eprint!("{}", String::from_utf8_lossy(&o.stdout));
    ensure!(
        o.status.success(),
        "ragctl {args:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    Ok(took)
}

async fn top10(
    c: &mut CoordinatorClient<Channel>,
    q: &BeirQuery,
    v: &[f32],
    mode: SearchMode,
    exact: bool,
) -> Result<Vec<(String, f32)>> {
    let r = c
        .search(SearchRequest {
            collection: C.into(),
            query: q.text.clone(),
            query_vector: v.to_vec(),
            top_k: 10,
            mode: mode as i32,
            exact,
            timeout_ms: 60_000,
            ..Default::default()
        })
        .await?
        .into_inner();
    Ok(r.hits.into_iter().map(|h| (h.chunk_id, h.score)).collect())
}

fn dir_bytes(p: &std::path::Path) -> u64 {
    std::fs::read_dir(p).map_or(0, |rd| {
        rd.flatten()
            .map(|e| match e.file_type() {
                Ok(t) if t.is_dir() => dir_bytes(&e.path()),
                _ => e.metadata().map_or(0, |m| m.len()),
            })
            .sum()
    })
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<()> {
    let args = Args::parse();
    let real = GetChunksResponse::decode(
        &*std::fs::read(&args.chunks)
            .with_context(|| format!("{} (make bench-chunks)", args.chunks.display()))?,
    )?
    .chunks;
    let chunks = perturbed_copies(&real, args.size);
    let queries: Vec<BeirQuery> =
        read_jsonl::<BeirQuery>(&datasets_dir().join("scifact/queries.jsonl"), args.queries)?;

    let src = Cluster::start(3)?;
    let mut mw = ModelWorkerClient::new(
        Channel::from_shared(src.model_worker.grpc.clone())?
            .connect()
            .await?,
    );
    let qvecs = embed_queries(&mut mw, &queries).await?;
    let mut c = src.client().await?;
    let req = CreateCollectionRequest {
        name: C.into(),
        shard_count: 3,
        ..Default::default()
    };
    let info = create_collection(&mut c, req).await?;
    let t = Instant::now();
    write_direct_with(&info, chunks, 2).await?;
    wait_graphs(&info, Duration::from_secs(3600)).await?;
    let load_s = t.elapsed().as_secs_f64();
    eprintln!("{} chunks in the graphs after {load_s:.1} s", args.size);

    // Backup under a write load.
    let stop = Arc::new(AtomicBool::new(false));
    let acks: Acks = Arc::default();
    let mut writers = Vec::new();
    for who in 0..args.writers {
        let w = writer(
            src.client().await?,
            who,
            real.clone(),
            stop.clone(),
            acks.clone(),
        );
        writers.push(tokio::spawn(w));
    }
    tokio::time::sleep(Duration::from_secs_f64(args.writes_before_s)).await;
    let dir = tempfile::tempdir()?;
    let backup = dir.path().join("b");
    let began = Instant::now();
    let addr = src.coordinator.grpc.clone();
    let backup_s = ragctl(
        &addr,
        &["backup", "create", "--to", &backup.to_string_lossy()],
    )
    .await?;
    let ended = Instant::now();
    tokio::time::sleep(Duration::from_secs(1)).await;
    stop.store(true, Ordering::Relaxed);
    for w in writers {
        w.await??;
    }
    let acks = acks.lock().clone();
    let before: Vec<String> = acks
        .iter()
        .filter(|a| a.1 < began)
        .map(|a| a.0.clone())
        .collect();
    let during = acks.iter().filter(|a| a.1 >= began && a.1 < ended).count();
    let manifest: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(backup.join("manifest.json"))?)?;
    let saved_docs: u64 = manifest["collections"][0]["shards"]
        .as_array()
        .context("manifest")?
        .iter()
        .filter_map(|s| s["documents"].as_u64())
        .sum();
    let saved_chunks: u64 = manifest["collections"][0]["shards"]
        .as_array()
        .context("manifest")?
        .iter()
        .filter_map(|s| s["chunks"].as_u64())
        .sum();
    let bytes = dir_bytes(&backup);

    // Restore into a fresh cluster.
    let dst = Cluster::start(args.restore_nodes)?;
    let to = dst.coordinator.grpc.clone();
    let t_restore = Instant::now();
    let restore_s = ragctl(
        &to,
        &["backup", "restore", "--from", &backup.to_string_lossy()],
    )
    .await?;
    let mut d = dst.client().await?;
    let restored = d
        .describe_collection(DescribeCollectionRequest { name: C.into() })
        .await?
        .into_inner()
        .collection
        .context("restored collection")?;
    wait_graphs(&restored, Duration::from_secs(3600)).await?;
    let indexed_s = t_restore.elapsed().as_secs_f64();
    let lost = missing_documents(&mut d, C, &before).await?;
    ensure!(
        lost.is_empty(),
        "acknowledged before the backup, not restored: {lost:?}"
    );
    let count = d
        .count(CountRequest {
            collection: C.into(),
            ..Default::default()
        })
        .await?
        .into_inner();
    ensure!(
        count.documents == saved_docs,
        "restored {count:?}, saved {saved_docs}"
    );

    // Writes stopped: a second backup restored in place of the first, then the same
    // queries on both sides (the same documents, so the same BM25 statistics).
    let quiet = dir.path().join("quiet");
    ragctl(
        &addr,
        &["backup", "create", "--to", &quiet.to_string_lossy()],
    )
    .await?;
    d.drop_collection(DropCollectionRequest { name: C.into() })
        .await?;
    ragctl(
        &to,
        &["backup", "restore", "--from", &quiet.to_string_lossy()],
    )
    .await?;
    wait_graphs(&restored, Duration::from_secs(3600)).await?;
    let (mut dense_same, mut bm25_same, mut overlap, mut exact_same) = (0, 0, 0, 0);
    let mut exact_score_diff = 0f32;
    let mut exact_ms = Vec::new();
    for (q, v) in queries.iter().zip(&qvecs) {
        let (a, b) = (
            top10(&mut c, q, v, SearchMode::Dense, false).await?,
            top10(&mut d, q, v, SearchMode::Dense, false).await?,
        );
        dense_same += usize::from(same_ranking(&a, &b));
        let a: BTreeSet<_> = a.into_iter().map(|h| h.0).collect();
        overlap += b.iter().filter(|x| a.contains(&x.0)).count();
        let (a, b) = (
            top10(&mut c, q, v, SearchMode::Bm25, false).await?,
            top10(&mut d, q, v, SearchMode::Bm25, false).await?,
        );
        bm25_same += usize::from(same_ranking(&a, &b));
        // Exact dense searches (every vector scored): the same ids in the same order.
        let t = Instant::now();
        let a = top10(&mut c, q, v, SearchMode::Dense, true).await?;
        exact_ms.push(t.elapsed().as_secs_f64() * 1e3);
        let t = Instant::now();
        let b = top10(&mut d, q, v, SearchMode::Dense, true).await?;
        exact_ms.push(t.elapsed().as_secs_f64() * 1e3);
        let ids = |h: &[(String, f32)]| h.iter().map(|x| x.0.clone()).collect::<Vec<_>>();
        exact_same += usize::from(ids(&a) == ids(&b) && a.len() == 10);
        for (x, y) in a.iter().zip(&b) {
            exact_score_diff = exact_score_diff.max((x.1 - y.1).abs());
        }
    }
    exact_ms.sort_by(f64::total_cmp);
    let n = queries.len();
    let out = json!({
        "bench": "backup",
        "chunks": args.size,
        "load_s": load_s,
        "writers": args.writers,
        "writes_before_s": args.writes_before_s,
        "writes_acknowledged": {"before": before.len(), "during": during, "all": acks.len()},
        "backup": {
            "seconds": backup_s,
            "documents": saved_docs,
            "chunks": saved_chunks,
            "bytes": bytes,
            "chunks_per_s": saved_chunks as f64 / backup_s,
            "mib_per_s": bytes as f64 / f64::from(1 << 20) / backup_s,
        },
        "restore": {
            "shard_nodes": args.restore_nodes,
            "seconds": restore_s,
            "chunks_per_s": saved_chunks as f64 / restore_s,
            "until_graphs_built_s": indexed_s,
        },
        "acknowledged_before_backup_restored": format!("{}/{}", before.len() - lost.len(), before.len()),
        "searches": {
            "queries": n,
            "dense_top10_identical": dense_same as f64 / n as f64,
            "dense_overlap_at_10": overlap as f64 / (10 * n) as f64,
            "bm25_top10_identical": bm25_same as f64 / n as f64,
            "dense_exact_top10_identical": exact_same as f64 / n as f64,
            "dense_exact_max_score_difference": exact_score_diff,
            "dense_exact_p50_ms": exact_ms.get(exact_ms.len() / 2),
        },
    });
    let text = serde_json::to_string_pretty(&out)?;
    println!("{text}");
    if let Some(p) = &args.out {
        std::fs::write(p, text)?;
    }
    Ok(())
}
