//! `scalebench`: how cost grows with the corpus. For each size (default 10k, 100k, 1M chunks)
//! a fresh local cluster (3 shard nodes, 3 shards, replication 1, one coordinator, a model
//! worker for the query vectors only; `--shard-nodes`, `--shards`, and `--colocated` for a
//! coordinator with a shard node in its process) is fed SciFact's chunks and MiniLM vectors, repeated with
//! perturbed vectors beyond the real 11k (`ragcluster_tests::bench::scale`), straight into the shard
//! nodes (embedding excluded; a write is acknowledged once searchable). Then, through the
//! coordinator's gRPC API with SciFact's 300 test queries at top_k 10:
//!
//! - ingest rate (chunks/s, until the last write is acknowledged);
//! - p50/p99 of one client and QPS of `--concurrency` clients per mode (bm25, dense,
//!   hybrid rrf);
//! - dense recall@10 against brute force over all vectors, at the collection's ef_search and
//!   at each `--dense-ef`;
//! - RAM (resident set of the shard nodes) and disk (their data directories) per chunk, disk
//!   also once the shards have settled (`settled`: graphs dumped, op logs dropped).
//!
//! With `--engines PYTHON` (a Python with qdrant-edge-py and tantivy: `bash
//! scripts/setup-bench-python.sh --engines`), each size's corpus, queries and exact top 10 are
//! also handed to `scripts/engines_bench.py` once the cluster is stopped: tantivy-py and the
//! Qdrant engine measured in process on the same machine in the same run, with ratios
//! (`vs_engines`: ragcluster's figure over the engine's).
//!
//! `cargo run --release -p ragcluster-tests --bin scalebench -- --chunks bench-out/scifact-chunks.pb --sizes 10000,100000,1000000`

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use clap::Parser;
use prost::Message;
use ragcluster_proto::v1::coordinator_client::CoordinatorClient;
use ragcluster_proto::v1::model_worker_client::ModelWorkerClient;
use ragcluster_proto::v1::*;
use ragcluster_tests::bench::scale::{
    QPS_SECONDS, create_collection, embed_queries, held_points, measure, perturbed_copies,
    quiet_cpu, req, settled_bytes, wait_graphs, write_direct_with,
};
use ragcluster_tests::{
    BeirQuery, Cluster, bench::engines, datasets_dir, percentile, read_jsonl, read_qrels,
};
use serde_json::{Map, Value, json};
use shard_node::index::hnsw::distance::dot;
use tonic::transport::Channel;

#[derive(Parser)]
struct Args {
    /// Chunks with vectors saved by `ragbench --dump-chunks`.
    #[arg(long, default_value = "bench-out/scifact-chunks.pb")]
    chunks: PathBuf,
    #[arg(long, value_delimiter = ',', default_value = "10000,100000,1000000")]
    sizes: Vec<usize>,
    /// Clients in flight for the QPS figure.
    #[arg(long, default_value_t = 8)]
    concurrency: usize,
    /// Each QPS figure cycles through the queries for at least this long.
    #[arg(long, default_value_t = QPS_SECONDS)]
    qps_seconds: f64,
    /// Extra dense rows at these search breadths (request `ef_search`), for recall vs cost.
    #[arg(long, value_delimiter = ',', default_value = "128,256")]
    dense_ef: Vec<u32>,
    /// Above this many chunks only dense search is measured.
    #[arg(long, default_value_t = usize::MAX)]
    dense_only_above: usize,
    /// The collection's HNSW ef_construction (0: the server's default).
    #[arg(long, default_value_t = 0)]
    ef_construction: u32,
    /// Write batches (512 chunks) in flight per shard during the ingest; 1 waits for each
    /// acknowledgement before the next batch, as every curve in docs/bench did.
    #[arg(long, default_value_t = 1)]
    writes_in_flight: usize,
    /// The collection's default search breadth (0: the server's default).
    #[arg(long, default_value_t = 0)]
    ef_search: u32,
    /// After the last size, keep `--concurrency` clients sending dense queries for this many
    /// seconds (for `perf record -a -g` from another shell; "soak" is printed at the start).
    #[arg(long, default_value_t = 0)]
    soak_seconds: u64,
    /// Search mode of the soak: bm25, dense or hybrid-rrf.
    #[arg(long, default_value = "dense")]
    soak_mode: String,
    /// Shards of the collection (each on its own shard node up to three).
    #[arg(long, default_value_t = 3)]
    shards: u32,
    /// Separate shard-node processes (with `--colocated`, besides the coordinator's own).
    #[arg(long, default_value_t = 3)]
    shard_nodes: usize,
    /// The coordinator is the `colocated` binary, a shard node in its process: with
    /// `--shard-nodes 0` a one-process deployment, every shard read in process.
    #[arg(long)]
    colocated: bool,
    /// A Python with qdrant-edge-py and tantivy: run `scripts/engines_bench.py` on each size's
    /// corpus after the cluster's figures, for side-by-side rows.
    #[arg(long)]
    engines: Option<PathBuf>,
    #[arg(long)]
    out: Option<PathBuf>,
}

const MODES: [(&str, SearchMode, &str); 3] = [
    ("bm25", SearchMode::Bm25, ""),
    ("dense", SearchMode::Dense, ""),
    ("hybrid-rrf", SearchMode::Hybrid, "rrf"),
];

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<()> {
    let args = Args::parse();
    soak_mode(&args)?; // a wrong name fails now, not after the measurements
    let real = GetChunksResponse::decode(
        &*std::fs::read(&args.chunks).with_context(|| args.chunks.display().to_string())?,
    )?
    .chunks;
    let dir = datasets_dir().join("scifact");
    let qrels = read_qrels(&dir.join("qrels/test.tsv"))?;
    let queries: Vec<BeirQuery> = read_jsonl::<BeirQuery>(&dir.join("queries.jsonl"), usize::MAX)?
        .into_iter()
        .filter(|q| qrels.contains_key(&q.id))
        .collect();
    let mut report = Map::new();
    let mut qvecs: Vec<Vec<f32>> = Vec::new();
    for &n in &args.sizes {
        let started = Instant::now();
        let (mut row, exact) = one_size(&args, &real, n, &queries, &mut qvecs).await?;
        if let Some(python) = &args.engines {
            compare(
                python,
                &args,
                &mut row,
                (&real, n),
                (&queries, &qvecs, &exact),
            )?;
        }
        eprintln!(
            "{n} chunks: {} ({:.0} s in all)",
            serde_json::to_string(&row)?,
            started.elapsed().as_secs_f64()
        );
        row["bench_wall_s"] = json!(started.elapsed().as_secs_f64());
        report.insert(n.to_string(), row);
    }
    let text = serde_json::to_string_pretty(&Value::Object(report))?;
    match &args.out {
        Some(p) => std::fs::write(p, text)?,
        None => println!("{text}"),
    }
    Ok(())
}

async fn one_size(
    args: &Args,
    real: &[Chunk],
    n: usize,
    queries: &[BeirQuery],
    qvecs: &mut Vec<Vec<f32>>,
) -> Result<(Value, Vec<Vec<String>>)> {
    let chunks = perturbed_copies(real, n);
    let cluster = Cluster::start_opts(ragcluster_tests::Options {
        shard_nodes: args.shard_nodes,
        colocated: args.colocated,
        ..Default::default()
    })?;
    if qvecs.is_empty() {
        let mut mw = ModelWorkerClient::new(
            Channel::from_shared(cluster.model_worker.grpc.clone())?
                .connect()
                .await?,
        );
        *qvecs = embed_queries(&mut mw, queries).await?;
    }
    let mut c = cluster.client().await?;
    let info = create_collection(
        &mut c,
        CreateCollectionRequest {
            name: "scale".into(),
            shard_count: args.shards,
            hnsw: Some(HnswParams {
                m: 0,
                ef_construction: args.ef_construction,
                ef_search: args.ef_search,
            }),
            ..Default::default()
        },
    )
    .await?;
    let idle_rss: u64 = cluster
        .shard_processes()
        .filter_map(|s| s.rss_bytes())
        .sum();
    // The vectors stay here for the recall figure; the chunks go to the cluster.
    let vectors: Vec<(String, Vec<f32>)> = chunks
        .iter()
        .map(|c| (c.chunk_id.clone(), c.embedding.clone()))
        .collect();
    let t = Instant::now();
    write_direct_with(&info, chunks, args.writes_in_flight).await?;
    let ingest_s = t.elapsed().as_secs_f64();
    // Acknowledged is durable and searchable; written-behind points may still be outside the
    // graphs (searched by brute force). What a user querying right after the burst sees:
    // one client's dense queries while the graphs take the held points in (this also slows
    // that work a little).
    let held = held_points(&info).await?;
    let mut while_held = json!({"held_points": held});
    if held > 0 {
        let mut lat = Vec::with_capacity(queries.len());
        for (q, v) in queries.iter().zip(qvecs.iter()) {
            let t = Instant::now();
            c.search(req("scale", q, v, SearchMode::Dense, "", 10))
                .await?;
            lat.push(t.elapsed().as_secs_f64() * 1e3);
        }
        while_held["dense_p50_ms"] = json!(percentile(&mut lat, 50.0));
        while_held["dense_p99_ms"] = json!(percentile(&mut lat, 99.0));
        while_held["held_points_after"] = json!(held_points(&info).await?);
    }
    // The rest is timed once the graphs hold everything.
    wait_graphs(&info, Duration::from_secs(3600)).await?;
    let indexed_s = t.elapsed().as_secs_f64();
    eprintln!(
        "{n}: ingested in {ingest_s:.1} s = {:.0} chunks/s; all in the graphs after {indexed_s:.1} s = {:.0} chunks/s",
        n as f64 / ingest_s,
        n as f64 / indexed_s
    );
    // Background merges and dumps of the load settle before timing, and the Raft logs' idle
    // compaction (10 s after the last write) is over.
    let quiet_after_s = quiet_cpu(
        || cluster.data_path_cpu_seconds(),
        Duration::from_secs(12),
        Duration::from_secs(180),
    )
    .await;
    let mut out = Map::new();
    out.insert(
        "ingest".into(),
        json!({"seconds": ingest_s, "chunks_per_s": n as f64 / ingest_s, "writes_in_flight": args.writes_in_flight,
            "graph_complete_seconds": indexed_s, "graph_complete_chunks_per_s": n as f64 / indexed_s,
            "quiet_after_s": quiet_after_s}),
    );
    out.insert("right_after_ingest".into(), while_held);
    let exact = exact_top10(&vectors, qvecs);
    drop(vectors);
    let modes: Vec<_> = MODES
        .iter()
        .filter(|m| n <= args.dense_only_above || m.0 == "dense")
        .collect();
    for &&(name, mode, fusion) in &modes {
        let (row, top) = latency(
            &cluster,
            &mut c,
            queries,
            qvecs,
            (mode, fusion, 0),
            (args.concurrency, args.qps_seconds),
        )
        .await?;
        out.insert(name.into(), with_recall(row, mode, &exact, &top));
    }
    for &ef in &args.dense_ef {
        let dense = (SearchMode::Dense, "", ef);
        let load = (args.concurrency, args.qps_seconds);
        let (row, top) = latency(&cluster, &mut c, queries, qvecs, dense, load).await?;
        let row = with_recall(row, SearchMode::Dense, &exact, &top);
        out.insert(format!("dense_ef{ef}"), row);
    }
    if args.soak_seconds > 0 && Some(&n) == args.sizes.last() {
        let mode = soak_mode(args)?;
        soak(
            &c,
            queries,
            qvecs,
            (mode.1, mode.2),
            args.concurrency,
            args.soak_seconds,
        )
        .await?;
    }
    let rss: u64 = cluster
        .shard_processes()
        .filter_map(|s| s.rss_bytes())
        .sum();
    let disk: u64 = cluster.shard_processes().map(|s| s.data_bytes()).sum();
    out.insert(
        "ram_bytes_per_chunk".into(),
        json!(rss.saturating_sub(idle_rss) as f64 / n as f64),
    );
    out.insert("disk_bytes_per_chunk".into(), json!(disk as f64 / n as f64));
    // The disk figure above is taken while the load's logs may still be trimmed; this one
    // once the shards have settled (graphs dumped, op logs dropped).
    let dirs = || {
        cluster
            .shard_processes()
            .map(|s| s.data_bytes())
            .sum::<u64>()
    };
    let (after_s, disk, by_place) = settled_bytes(&info, dirs, Duration::from_secs(300)).await?;
    out.insert(
        "settled".into(),
        json!({"after_s": after_s, "disk_bytes_per_chunk": disk as f64 / n as f64,
               "bytes_per_chunk_by_place": by_place}),
    );
    out.insert(
        "shard_nodes_rss_bytes".into(),
        json!({"idle": idle_rss, "loaded": rss}),
    );
    Ok((Value::Object(out), exact))
}

/// The engines' rows for the same corpus and queries (`--engines`), measured once the size's
/// cluster has stopped, under `row["engines"]`, with ours-over-theirs in `row["vs_engines"]`.
fn compare(
    python: &std::path::Path,
    args: &Args,
    row: &mut Value,
    (real, n): (&[Chunk], usize),
    (queries, qvecs, exact): (&[BeirQuery], &[Vec<f32>], &[Vec<String>]),
) -> Result<()> {
    let dir = tempfile::tempdir()?;
    engines::export(
        dir.path(),
        &perturbed_copies(real, n),
        queries,
        qvecs,
        exact,
    )?;
    let load = engines::Load {
        concurrency: args.concurrency,
        qps_seconds: args.qps_seconds,
        dense_ef: &args.dense_ef,
        dense_only: n > args.dense_only_above,
    };
    let theirs = engines::run(python, dir.path(), &load)?;
    row["vs_engines"] = engines::ratios(row, &theirs);
    row["engines"] = theirs;
    eprintln!("{n} chunks, vs engines: {}", row["vs_engines"]);
    Ok(())
}

/// One client query by query (p50/p99), then `concurrency` clients for at least `qps_seconds`
/// (QPS and CPU per query); returns the row and the chunk ids each query got.
async fn latency(
    cluster: &Cluster,
    c: &mut CoordinatorClient<Channel>,
    queries: &[BeirQuery],
    qvecs: &[Vec<f32>],
    (mode, fusion, ef): (SearchMode, &str, u32),
    (concurrency, qps_seconds): (usize, f64),
) -> Result<(Value, Vec<Vec<String>>)> {
    let req = |q: &BeirQuery, v: &[f32]| SearchRequest {
        ef_search: ef,
        ..req("scale", q, v, mode, fusion, 10)
    };
    measure(cluster, c, queries, qvecs, &req, (concurrency, qps_seconds)).await
}

fn soak_mode(args: &Args) -> Result<&'static (&'static str, SearchMode, &'static str)> {
    MODES.iter().find(|m| m.0 == args.soak_mode).ok_or_else(|| {
        let names: Vec<&str> = MODES.iter().map(|m| m.0).collect();
        anyhow::anyhow!(
            "--soak-mode {}: one of {}",
            args.soak_mode,
            names.join(", ")
        )
    })
}

/// Queries of one mode from `concurrency` clients for `seconds`, for a profiler to watch.
async fn soak(
    c: &CoordinatorClient<Channel>,
    queries: &[BeirQuery],
    qvecs: &[Vec<f32>],
    (mode, fusion): (SearchMode, &'static str),
    concurrency: usize,
    seconds: u64,
) -> Result<()> {
    eprintln!("soak: {concurrency} clients, {mode:?}, {seconds} s");
    let end = Instant::now() + Duration::from_secs(seconds);
    let clients = (0..concurrency).map(|k| {
        let mut c = c.clone();
        async move {
            let mut i = k;
            let mut n = 0u64;
            while Instant::now() < end {
                let (q, v) = (&queries[i % queries.len()], &qvecs[i % qvecs.len()]);
                c.search(req("scale", q, v, mode, fusion, 10)).await?;
                i += concurrency;
                n += 1;
            }
            anyhow::Ok(n)
        }
    });
    let mut total = 0;
    for r in futures::future::join_all(clients).await {
        total += r?;
    }
    eprintln!("soak: {:.0} qps", total as f64 / seconds as f64);
    Ok(())
}

/// Adds dense recall@10 (against `exact`) to a dense row.
fn with_recall(
    mut row: Value,
    mode: SearchMode,
    exact: &[Vec<String>],
    top: &[Vec<String>],
) -> Value {
    if mode == SearchMode::Dense {
        let hit: f64 = exact
            .iter()
            .zip(top)
            .map(|(e, g)| g.iter().filter(|id| e.contains(id)).count() as f64 / 10.0)
            .sum();
        row["recall@10"] = json!(hit / exact.len().max(1) as f64);
    }
    row
}

/// Each query's exact top-10 chunk ids, by brute force over all vectors.
fn exact_top10(vectors: &[(String, Vec<f32>)], qvecs: &[Vec<f32>]) -> Vec<Vec<String>> {
    qvecs
        .iter()
        .map(|q| {
            let mut s: Vec<(f32, usize)> = vectors
                .iter()
                .enumerate()
                .map(|(i, v)| (dot(q, &v.1), i))
                .collect();
            s.select_nth_unstable_by(9, |a, b| b.0.total_cmp(&a.0));
            s[..10].iter().map(|x| vectors[x.1].0.clone()).collect()
        })
        .collect()
}
