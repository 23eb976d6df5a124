//! `ragbench`: quality and speed of ragcluster on SciFact, measured on real processes.
//!
//! 1. Starts a local cluster (model worker, 3 shard nodes, coordinator) on loopback.
//! 2. Ingests the SciFact corpus through the coordinator (chunking + embedding included).
//! 3. Quality: nDCG@10 and Recall@100 on the test queries for bm25, dense and hybrid
//!    (rrf / cc / dbsf).
//! 4. Latency: the same queries at top_k = 10 through the coordinator (query vectors
//!    precomputed, so the model is out of the loop) next to one in-process tantivy index and
//!    one in-process hnsw_rs graph over the very same chunks and vectors; HNSW recall@10
//!    against exact brute force.
//! 5. Scale: 100k chunks (SciFact's chunks repeated, vectors perturbed) written straight to the
//!    shard nodes (embedding excluded), the same latency comparison, and the restart time of a
//!    node holding 100k chunks after kill -9.
//!
//! `cargo run --release -p ragcluster-tests --bin ragbench -- --out bench-out/scifact.json`

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use clap::Parser;
use futures::stream::{self, StreamExt};
use hnsw_rs::hnsw::Hnsw;
use prost::Message;
use ragcluster_proto::v1::model_worker_client::ModelWorkerClient;
use ragcluster_proto::v1::shard_client::ShardClient;
use ragcluster_proto::v1::*;
use ragcluster_tests::bench::metrics::{doc_ranking, ndcg_at, recall_at};
use ragcluster_tests::bench::scale::{
    MODES, QPS_SECONDS, create_collection, embed_queries, perturbed_copies, qps, req, write_direct,
};
use ragcluster_tests::{
    BeirDoc, BeirQuery, Cluster, Proc, datasets_dir, percentile, read_jsonl, read_qrels,
};
use serde_json::json;
use shard_node::index::bm25::Bm25Index;
use shard_node::index::hnsw::{UnitCosine, dot};
use tonic::transport::Channel;

#[derive(Parser)]
struct Args {
    /// Documents of the corpus to ingest (default: all).
    #[arg(long, default_value_t = usize::MAX)]
    docs: usize,
    /// Chunks for the scale test (0 skips it).
    #[arg(long, default_value_t = 100_000)]
    scale_chunks: usize,
    /// Write all figures here as JSON.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Concurrent clients for the throughput figure.
    #[arg(long, default_value_t = 8)]
    concurrency: usize,
    /// After ingest, save every chunk with its vector here (protobuf), for --load-chunks.
    #[arg(long)]
    dump_chunks: Option<PathBuf>,
    /// Skip embedding: write the chunks saved by --dump-chunks straight to the shards.
    #[arg(long)]
    load_chunks: Option<PathBuf>,
    /// Skip the kill -9 restart measurement.
    #[arg(long)]
    skip_restart: bool,
    /// Only the restart measurement, on --scale-chunks chunks made from --load-chunks.
    #[arg(long, requires = "load_chunks")]
    only_restart: bool,
    /// Skip the quality section (reload runs that only want speed figures).
    #[arg(long)]
    skip_quality: bool,
    /// Sweep fusion parameters on SciFact's train queries (the dev set) and score the best
    /// setting of each fusion on the test queries.
    #[arg(long)]
    tune: bool,
}

#[derive(Clone)]
struct Stored {
    chunk: Chunk,
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn lat_summary(mut v: Vec<f64>) -> serde_json::Value {
    let mean = v.iter().sum::<f64>() / v.len().max(1) as f64;
    json!({"p50_ms": percentile(&mut v, 50.0), "p99_ms": percentile(&mut v, 99.0), "mean_ms": mean, "qps_1_client": 1000.0 / mean})
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<()> {
    let args = Args::parse();
    let dir = datasets_dir().join("scifact");
    let corpus: Vec<BeirDoc> =
        read_jsonl(&dir.join("corpus.jsonl"), args.docs).context("SciFact corpus")?;
    let qrels = read_qrels(&dir.join("qrels/test.tsv"))?;
    let queries: Vec<BeirQuery> = read_jsonl::<BeirQuery>(&dir.join("queries.jsonl"), usize::MAX)?
        .into_iter()
        .filter(|q| qrels.contains_key(&q.id))
        .collect();
    eprintln!(
        "scifact: {} documents, {} test queries",
        corpus.len(),
        queries.len()
    );
    let mut report = serde_json::Map::new();
    if args.only_restart
        && let Some(p) = &args.load_chunks
    {
        let chunks = GetChunksResponse::decode(&*std::fs::read(p)?)?.chunks;
        let stored: Vec<Stored> = chunks.into_iter().map(|chunk| Stored { chunk }).collect();
        let scaled = scale_up(&stored, args.scale_chunks);
        report.insert("restart".into(), restart_time(&scaled).await?);
        return write_report(report, args.out);
    }

    let cluster = Cluster::start(3)?;
    let mut c = cluster.client().await?;
    c.create_collection(CreateCollectionRequest {
        name: "scifact".into(),
        shard_count: 3,
        ..Default::default()
    })
    .await?;

    let loaded = match &args.load_chunks {
        Some(p) => Some(
            GetChunksResponse::decode(
                &*std::fs::read(p).with_context(|| p.display().to_string())?,
            )?
            .chunks,
        ),
        None => None,
    };
    if let Some(chunks) = &loaded {
        let info = c
            .describe_collection(DescribeCollectionRequest {
                name: "scifact".into(),
            })
            .await?
            .into_inner()
            .collection
            .context("info")?;
        let stored: Vec<Stored> = chunks
            .iter()
            .cloned()
            .map(|chunk| Stored { chunk })
            .collect();
        let t0 = Instant::now();
        write_direct(&info, chunks_of(&stored)).await?;
        eprintln!(
            "loaded {} saved chunks in {:.1} s (no embedding)",
            stored.len(),
            t0.elapsed().as_secs_f64()
        );
    } else {
        // Ingest with embedding.
        let t0 = Instant::now();
        let mut chunks_total = 0u64;
        let batches: Vec<Vec<Document>> = corpus
            .chunks(32)
            .map(|b| {
                b.iter()
                    .map(|d| Document {
                        id: d.id.clone(),
                        title: d.title.clone(),
                        text: d.text.clone(),
                        ..Default::default()
                    })
                    .collect()
            })
            .collect();
        let nb = batches.len();
        let ingest_client = c.clone();
        let mut results = stream::iter(batches)
            .map(|documents| {
                let mut c = ingest_client.clone();
                async move {
                    c.upsert_documents(UpsertDocumentsRequest {
                        collection: "scifact".into(),
                        documents,
                        ..Default::default()
                    })
                    .await
                }
            })
            .buffer_unordered(2);
        let mut done = 0;
        while let Some(r) = results.next().await {
            chunks_total += u64::from(r?.into_inner().chunks);
            done += 1;
            if done % 20 == 0 {
                eprintln!(
                    "  ingested {done}/{nb} batches, {chunks_total} chunks, {:.0} s",
                    t0.elapsed().as_secs_f64()
                );
            }
        }
        drop(results);
        let ingest_s = t0.elapsed().as_secs_f64();
        eprintln!(
            "ingest with embedding: {chunks_total} chunks in {ingest_s:.1} s = {:.1} chunks/s",
            chunks_total as f64 / ingest_s
        );
        report.insert("ingest_with_embedding".into(), json!({"documents": corpus.len(), "chunks": chunks_total, "seconds": ingest_s, "chunks_per_s": chunks_total as f64 / ingest_s}));
    }
    // Query vectors, once.
    let mut mw = ModelWorkerClient::new(
        Channel::from_shared(cluster.model_worker.grpc.clone())?
            .connect()
            .await?,
    );
    let t0 = Instant::now();
    let qvecs = embed_queries(&mut mw, &queries).await?;
    report.insert(
        "query_embedding_ms_per_query".into(),
        json!(ms(t0.elapsed()) / queries.len() as f64),
    );

    // Quality.
    let mut quality = serde_json::Map::new();
    let quality_modes: &[(&str, SearchMode, &str)] = if args.skip_quality { &[] } else { &MODES };
    for &(name, mode, fusion) in quality_modes {
        let (mut ndcg, mut recall) = (0.0, 0.0);
        for (q, v) in queries.iter().zip(&qvecs) {
            let r = c
                .search(req("scifact", q, v, mode, fusion, 300))
                .await?
                .into_inner();
            let docs = doc_ranking(r.hits.iter().map(|h| h.doc_id.as_str()));
            ndcg += ndcg_at(&docs, &qrels[&q.id], 10);
            recall += recall_at(&docs, &qrels[&q.id], 100);
        }
        let n = queries.len() as f64;
        eprintln!(
            "quality {name:12} nDCG@10 {:.4}  Recall@100 {:.4}",
            ndcg / n,
            recall / n
        );
        quality.insert(
            name.into(),
            json!({"ndcg@10": ndcg / n, "recall@100": recall / n}),
        );
    }
    report.insert("quality".into(), quality.into());
    if args.tune {
        report.insert(
            "tuning".into(),
            tune(&mut c, &mut mw, &dir, &queries, &qvecs, &qrels).await?,
        );
    }

    // Fetch every chunk with its vector from the shards, for the in-process references.
    let stored = fetch_all(&cluster, "scifact", &corpus).await?;
    eprintln!("fetched {} chunks with vectors", stored.len());
    if let Some(p) = &args.dump_chunks {
        let msg = GetChunksResponse {
            chunks: stored.iter().map(|s| s.chunk.clone()).collect(),
        };
        std::fs::write(p, msg.encode_to_vec())?;
    }
    let small = compare_latency(
        &mut c,
        "scifact",
        &stored,
        &queries,
        &qvecs,
        args.concurrency,
    )
    .await?;
    report.insert("scifact_latency".into(), small);

    if args.scale_chunks > 0 {
        let scaled = scale_up(&stored, args.scale_chunks);
        let info = create_collection(
            &mut c,
            CreateCollectionRequest {
                name: "scale".into(),
                shard_count: 3,
                ..Default::default()
            },
        )
        .await?;
        let t0 = Instant::now();
        write_direct(&info, chunks_of(&scaled)).await?;
        let s = t0.elapsed().as_secs_f64();
        eprintln!(
            "ingest without embedding: {} chunks in {s:.1} s = {:.0} chunks/s",
            scaled.len(),
            scaled.len() as f64 / s
        );
        report.insert(
            "ingest_without_embedding".into(),
            json!({"chunks": scaled.len(), "seconds": s, "chunks_per_s": scaled.len() as f64 / s}),
        );
        let big =
            compare_latency(&mut c, "scale", &scaled, &queries, &qvecs, args.concurrency).await?;
        report.insert("scale_latency".into(), big);
        drop(cluster);
        if !args.skip_restart {
            report.insert("restart".into(), restart_time(&scaled).await?);
        }
    }
    write_report(report, args.out)
}

fn write_report(
    report: serde_json::Map<String, serde_json::Value>,
    out: Option<PathBuf>,
) -> Result<()> {
    let report = serde_json::Value::Object(report);
    println!("{}", serde_json::to_string_pretty(&report)?);
    if let Some(p) = out {
        if let Some(d) = p.parent() {
            std::fs::create_dir_all(d)?;
        }
        std::fs::write(p, serde_json::to_string_pretty(&report)?)?;
    }
    Ok(())
}

/// Query embeddings from the model worker, 64 per call.
/// Mean nDCG@10 of one hybrid setting over a query set.
async fn ndcg_of(
    c: &mut ragcluster_proto::v1::coordinator_client::CoordinatorClient<Channel>,
    qs: &[BeirQuery],
    vs: &[Vec<f32>],
    qrels: &HashMap<String, HashMap<String, u32>>,
    fusion: &str,
    weight: f32,
    rrf_k: u32,
) -> Result<f64> {
    let mut sum = 0.0;
    for (q, v) in qs.iter().zip(vs) {
        let mut r = req("scifact", q, v, SearchMode::Hybrid, fusion, 100);
        r.dense_weight = Some(weight);
        r.rrf_k = Some(rrf_k);
        let hits = c.search(r).await?.into_inner().hits;
        sum += ndcg_at(
            &doc_ranking(hits.iter().map(|h| h.doc_id.as_str())),
            &qrels[&q.id],
            10,
        );
    }
    Ok(sum / qs.len() as f64)
}

/// Grid over dense weight (cc, dbsf) and k (rrf) on the train split; the best of each is then
/// scored on the test split.
async fn tune(
    c: &mut ragcluster_proto::v1::coordinator_client::CoordinatorClient<Channel>,
    mw: &mut ModelWorkerClient<Channel>,
    dir: &std::path::Path,
    test_q: &[BeirQuery],
    test_v: &[Vec<f32>],
    test_rels: &HashMap<String, HashMap<String, u32>>,
) -> Result<serde_json::Value> {
    let train_rels = read_qrels(&dir.join("qrels/train.tsv"))?;
    let train_q: Vec<BeirQuery> = read_jsonl::<BeirQuery>(&dir.join("queries.jsonl"), usize::MAX)?
        .into_iter()
        .filter(|q| train_rels.contains_key(&q.id))
        .collect();
    let train_v = embed_queries(mw, &train_q).await?;
    let mut out = serde_json::Map::new();
    out.insert("train_queries".into(), json!(train_q.len()));
    let mut grid: Vec<(&str, f32, u32)> = Vec::new();
    for w in [0.3f32, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9] {
        grid.push(("cc", w, 60));
        grid.push(("dbsf", w, 60));
    }
    for k in [10u32, 30, 60, 100] {
        grid.push(("rrf", 0.5, k));
    }
    let mut trials = Vec::new();
    let mut best: HashMap<&str, (f64, f32, u32)> = HashMap::new();
    for (f, w, k) in grid {
        let n = ndcg_of(c, &train_q, &train_v, &train_rels, f, w, k).await?;
        eprintln!("tune {f:5} dense_weight {w:.1} k {k:3}: train nDCG@10 {n:.4}");
        trials.push(json!({"fusion": f, "dense_weight": w, "rrf_k": k, "train_ndcg@10": n}));
        let e = best.entry(f).or_insert((f64::MIN, w, k));
        if n > e.0 {
            *e = (n, w, k);
        }
    }
    out.insert("trials".into(), trials.into());
    for (f, (n, w, k)) in best {
        let t = ndcg_of(c, test_q, test_v, test_rels, f, w, k).await?;
        eprintln!("tune best {f}: dense_weight {w:.1} k {k}: train {n:.4}, test nDCG@10 {t:.4}");
        out.insert(
            format!("best_{f}"),
            json!({"dense_weight": w, "rrf_k": k, "train_ndcg@10": n, "test_ndcg@10": t}),
        );
    }
    Ok(out.into())
}

/// All chunks of the collection with their vectors (chunk ids are `doc#position`).
async fn fetch_all(cluster: &Cluster, coll: &str, corpus: &[BeirDoc]) -> Result<Vec<Stored>> {
    let nodes: Vec<String> = cluster.shards.iter().map(|p| p.grpc.clone()).collect();
    let ids: Vec<String> = corpus.iter().map(|d| d.id.clone()).collect();
    Ok(
        ragcluster_tests::bench::scale::fetch_chunks(&nodes, coll, 3, &ids)
            .await?
            .into_iter()
            .map(|chunk| Stored { chunk })
            .collect(),
    )
}

/// `n` chunks: the real ones repeated under new document ids, vectors perturbed by Gaussian-ish
/// noise (σ ≈ 0.02 per dimension) and renormalised.
fn chunks_of(s: &[Stored]) -> Vec<Chunk> {
    s.iter().map(|s| s.chunk.clone()).collect()
}

fn scale_up(real: &[Stored], n: usize) -> Vec<Stored> {
    let chunks: Vec<Chunk> = real.iter().map(|s| s.chunk.clone()).collect();
    perturbed_copies(&chunks, n)
        .into_iter()
        .map(|chunk| Stored { chunk })
        .collect()
}

/// Coordinator (3 shards) vs one in-process tantivy index and one hnsw_rs graph over the same
/// chunks, timed query by query in turn so both sides see the same machine; plus HNSW
/// recall@10 against brute force, in-process and through the cluster.
async fn compare_latency(
    c: &mut ragcluster_proto::v1::coordinator_client::CoordinatorClient<Channel>,
    coll: &str,
    chunks: &[Stored],
    queries: &[BeirQuery],
    qvecs: &[Vec<f32>],
    concurrency: usize,
) -> Result<serde_json::Value> {
    let mut out = serde_json::Map::new();
    out.insert("chunks".into(), json!(chunks.len()));
    // The in-process references, same analyzer and HNSW parameters (M 16, ef_c 200, ef 64).
    let dir = tempfile::tempdir()?;
    let bm25 = Bm25Index::open(dir.path(), 200_000_000)?;
    let t = Instant::now();
    for group in chunks.chunks(5000) {
        let group: Vec<Chunk> = group.iter().map(|s| s.chunk.clone()).collect();
        bm25.stage_chunks(&group)?;
    }
    bm25.commit(1)?;
    out.insert(
        "inprocess_tantivy_build_s".into(),
        json!(t.elapsed().as_secs_f64()),
    );
    let t = Instant::now();
    let hnsw: Hnsw<f32, UnitCosine> = Hnsw::new(16, chunks.len(), 16, 200, UnitCosine);
    let data: Vec<(&Vec<f32>, usize)> = chunks
        .iter()
        .enumerate()
        .map(|(i, s)| (&s.chunk.embedding, i))
        .collect();
    hnsw.parallel_insert(&data);
    out.insert(
        "inprocess_hnsw_build_s".into(),
        json!(t.elapsed().as_secs_f64()),
    );
    // Let the shard nodes finish background segment merges and compactions of the load.
    tokio::time::sleep(Duration::from_secs(20)).await;

    // Warm-up, then every query through every path in turn.
    for (q, v) in queries.iter().zip(qvecs).take(20) {
        for (_, mode, fusion) in MODES {
            c.search(req(coll, q, v, mode, fusion, 10)).await?;
        }
        bm25.search(&q.text, 10, &shard_node::index::Filter::default(), None)?;
        hnsw.search(v, 10, 64);
    }
    let mut lat: HashMap<&str, Vec<f64>> = HashMap::new();
    let mut cluster_dense_top: Vec<Vec<String>> = Vec::new();
    let mut direct_top: Vec<Vec<usize>> = Vec::new();
    for (q, v) in queries.iter().zip(qvecs) {
        for (name, mode, fusion) in MODES {
            let t = Instant::now();
            let r = c
                .search(req(coll, q, v, mode, fusion, 10))
                .await?
                .into_inner();
            lat.entry(name).or_default().push(ms(t.elapsed()));
            if name == "dense" {
                cluster_dense_top.push(r.hits.into_iter().map(|h| h.chunk_id).collect());
            }
        }
        let t = Instant::now();
        bm25.search(&q.text, 10, &shard_node::index::Filter::default(), None)?;
        lat.entry("inprocess_tantivy")
            .or_default()
            .push(ms(t.elapsed()));
        let t = Instant::now();
        let r = hnsw.search(v, 10, 64);
        lat.entry("inprocess_hnsw")
            .or_default()
            .push(ms(t.elapsed()));
        direct_top.push(r.into_iter().map(|n| n.d_id).collect());
    }
    let p50 = |v: &[f64]| percentile(&mut v.to_vec(), 50.0);
    let (t50, h50) = (p50(&lat["inprocess_tantivy"]), p50(&lat["inprocess_hnsw"]));
    for (name, mode, fusion) in MODES {
        // Throughput with several clients in flight.
        let reqs: Vec<SearchRequest> = queries
            .iter()
            .zip(qvecs)
            .map(|(q, v)| req(coll, q, v, mode, fusion, 10))
            .collect();
        let (qps, _) = qps(c, reqs, concurrency, QPS_SECONDS).await?;
        let v = &lat[name];
        let reference = match mode {
            SearchMode::Bm25 => t50,
            SearchMode::Dense => h50,
            _ => t50 + h50,
        };
        let mut s = lat_summary(v.clone());
        s["qps_concurrent"] = json!(qps);
        s["p50_ratio_to_inprocess"] = json!(p50(v) / reference);
        eprintln!(
            "[{coll}] coordinator {name:12} p50 {:.3} ms p99 {:.3} ms ({:.1}x in-process p50), {qps:.0} qps at {concurrency} clients",
            s["p50_ms"].as_f64().unwrap_or(0.0),
            s["p99_ms"].as_f64().unwrap_or(0.0),
            p50(v) / reference
        );
        out.insert(format!("coordinator_{name}"), s);
    }
    for name in ["inprocess_tantivy", "inprocess_hnsw"] {
        let s = lat_summary(lat[name].clone());
        eprintln!(
            "[{coll}] {name:20} p50 {:.3} ms p99 {:.3} ms",
            s["p50_ms"].as_f64().unwrap_or(0.0),
            s["p99_ms"].as_f64().unwrap_or(0.0)
        );
        out.insert(name.into(), s);
    }
    // Exact top-10 by brute force.
    let (mut rec_direct, mut rec_cluster) = (0.0, 0.0);
    for (qi, v) in qvecs.iter().enumerate() {
        let mut scored: Vec<(f32, usize)> = chunks
            .iter()
            .enumerate()
            .map(|(i, s)| (dot(v, &s.chunk.embedding), i))
            .collect();
        scored.select_nth_unstable_by(9, |a, b| b.0.total_cmp(&a.0));
        let exact: Vec<usize> = scored[..10].iter().map(|x| x.1).collect();
        rec_direct += direct_top[qi].iter().filter(|i| exact.contains(i)).count() as f64 / 10.0;
        let exact_ids: Vec<&str> = exact
            .iter()
            .map(|&i| chunks[i].chunk.chunk_id.as_str())
            .collect();
        rec_cluster += cluster_dense_top[qi]
            .iter()
            .filter(|id| exact_ids.contains(&id.as_str()))
            .count() as f64
            / 10.0;
    }
    let n = qvecs.len() as f64;
    eprintln!(
        "[{coll}] HNSW recall@10 vs brute force: in-process {:.4}, cluster {:.4}",
        rec_direct / n,
        rec_cluster / n
    );
    out.insert("hnsw_recall@10_inprocess".into(), json!(rec_direct / n));
    out.insert("hnsw_recall@10_cluster".into(), json!(rec_cluster / n));
    Ok(out.into())
}

/// One shard node with all chunks in one shard: kill -9 right after the last write, restart,
/// time until it serves again (the HNSW dump is then up to a tenth of the graph behind); then
/// the same after a clean SIGTERM (the graph is dumped on the way out).
async fn restart_time(chunks: &[Stored]) -> Result<serde_json::Value> {
    let dir = tempfile::tempdir()?;
    let mut node = Proc::shard_node("lone", dir.path())?;
    let info = CollectionInfo {
        name: "restart".into(),
        shard_count: 1,
        shards: vec![ShardPlacement {
            nodes: vec![node.grpc.clone()],
            ..Default::default()
        }],
        ..Default::default()
    };
    let shard = Some(ShardRef {
        collection: "restart".into(),
        shard: 0,
    });
    let mut sc = ShardClient::new(Channel::from_shared(node.grpc.clone())?.connect().await?);
    sc.open_shard(OpenShardRequest {
        shard: shard.clone(),
        dimension: 384,
        hnsw: Some(HnswParams {
            m: 16,
            ef_construction: 200,
            ef_search: 64,
        }),
        peers: vec![],
        join: false,
    })
    .await?;
    let t = Instant::now();
    write_direct(&info, chunks_of(chunks)).await?;
    let write_s = t.elapsed().as_secs_f64();
    let probe = chunks[chunks.len() / 2].chunk.clone();
    let mut times = Vec::new();
    for clean in [false, true] {
        let t = Instant::now();
        if clean {
            node.terminate()?;
        } else {
            node.kill9();
        }
        let stop_s = t.elapsed().as_secs_f64();
        let t = Instant::now();
        tokio::task::block_in_place(|| node.restart(Duration::from_secs(1800)))?;
        let mut sc = ShardClient::new(Channel::from_shared(node.grpc.clone())?.connect().await?);
        // Serving means answering: the probe chunk's own vector finds it.
        let hits = sc
            .vector_search(VectorSearchRequest {
                shard: shard.clone(),
                vector: probe.embedding.clone(),
                top_k: 1,
                ..Default::default()
            })
            .await?
            .into_inner()
            .hits;
        let restart_s = t.elapsed().as_secs_f64();
        anyhow::ensure!(
            hits.first()
                .and_then(|h| h.chunk.as_ref())
                .map(|c| c.chunk_id.as_str())
                == Some(probe.chunk_id.as_str()),
            "the probe vector did not find its chunk after the restart"
        );
        let log = std::fs::read_to_string(node.log()).unwrap_or_default();
        let how = log
            .lines()
            .rev()
            .find(|l| l.contains("hnsw dump caught up") || l.contains("hnsw graph rebuilt"))
            .unwrap_or("")
            .to_owned();
        let what = if clean { "SIGTERM" } else { "kill -9" };
        eprintln!(
            "restart after {what} (stop took {stop_s:.2} s): serving in {restart_s:.2} s\n  {how}"
        );
        times.push(json!({"stop": what, "stop_s": stop_s, "restart_s": restart_s, "log": how}));
    }
    let mut sc = ShardClient::new(Channel::from_shared(node.grpc.clone())?.connect().await?);
    let req = ShardInfoRequest { shard };
    // After the clean stop flushed every memtable, the SST sizes cover everything. Points
    // written behind still keep their entries in the op log here.
    let i = sc.shard_info(req.clone()).await?.into_inner();
    let (chunks, hnsw_points) = (i.chunks, i.hnsw_points);
    let at_restart = disk_figures(&i, dir.path());
    eprintln!(
        "disk after the restarts ({} points held): {at_restart}",
        i.hnsw_pending
    );
    // Settled: the held points inserted, the graph dumped and the op log behind it dropped.
    let t = Instant::now();
    let settled = loop {
        let i = sc.shard_info(req.clone()).await?.into_inner();
        let oplog = i.bytes_by_family.get("oplog").copied().unwrap_or(0);
        if (i.hnsw_pending == 0 && oplog < 100 * i.chunks) || t.elapsed() > Duration::from_secs(300)
        {
            let mut f = disk_figures(&i, dir.path());
            f["after_s"] = json!(t.elapsed().as_secs_f64());
            f["hnsw_pending"] = json!(i.hnsw_pending);
            break f;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    eprintln!("disk once settled: {settled}");
    Ok(json!({
        "chunks": chunks, "hnsw_points": hnsw_points, "single_node_write_s": write_s,
        "restart_s": times[0]["restart_s"], "runs": times,
        "data_dir_bytes": at_restart["data_dir_bytes"],
        "data_dir_bytes_per_chunk": at_restart["data_dir_bytes_per_chunk"],
        "bytes_per_chunk_by_place": at_restart["bytes_per_chunk_by_place"],
        "settled": settled,
    }))
}

/// The node's data directory and the shard's bytes by place, per chunk.
fn disk_figures(i: &ShardInfoResponse, dir: &std::path::Path) -> serde_json::Value {
    let disk = ragcluster_common::membership::dir_bytes(dir);
    let n = i.chunks.max(1) as f64;
    let per_chunk: serde_json::Map<String, serde_json::Value> = i
        .bytes_by_family
        .iter()
        .map(|(k, v)| (k.clone(), json!(*v as f64 / n)))
        .collect();
    json!({"data_dir_bytes": disk, "data_dir_bytes_per_chunk": disk as f64 / n,
           "bytes_per_chunk_by_place": per_chunk})
}
