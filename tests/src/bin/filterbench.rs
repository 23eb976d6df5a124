//! `filterbench`: filtered dense search (issue 69's target: on 100k SciFact chunks with a
//! keyword field matching 50%, 10%, 1% and 0.1% of them, recall@10 >= 0.95 against the exact
//! filtered top 10 at every selectivity, and QPS at 8 clients at least the Qdrant engine's
//! with the same filter, side by side in one run).
//!
//! A fresh local cluster (3 shard nodes, 3 shards, replication 1, one coordinator, a model
//! worker for the query vectors) is fed SciFact's chunks and MiniLM vectors, repeated with
//! perturbed vectors beyond the real 11k (`ragcluster_tests::bench::scale`), straight into
//! the shard nodes, each chunk i with typed keyword fields `p2`, `p10`, `p100`, `p1000` =
//! i mod k (declared in the collection's schema). Once the graphs hold everything and the
//! shards are idle, through the coordinator's gRPC API, SciFact's 300 test queries, dense,
//! top 10, at the collection's ef_search: no filter, then `conditions` = field "1" for each
//! field: p50 / p99 of one client, QPS of `--concurrency` clients, recall@10 against brute
//! force over the matching vectors.
//!
//! The clients (and the whole bench) run on one thread, a current-thread tokio runtime: on the
//! 2-core VM the cluster shares the cores with them, and a client on two runtime threads spent
//! more CPU per call than the server (perf at 0.1% selectivity: 58% of its time in the kernel,
//! a third of that switching threads for cross-thread wake-ups), which the Qdrant reference,
//! called in process, does not pay. One thread with 8 calls in flight on one connection costs
//! less per call, so the QPS figure says more about the server and less about the client.
//!
//! With `--engines PYTHON` (qdrant-edge-py: `bash scripts/setup-bench-python.sh --engines`)
//! the same vectors, fields and exact top 10s go to `scripts/filter_ref.py`: the Qdrant engine
//! in process with a keyword payload index on each field, measured the same way.
//!
//! `cargo run --release -p ragcluster-tests --bin filterbench -- --engines ~/.cache/engines-venv/bin/python`

use std::io::Write as _;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use clap::Parser;
use prost::Message;
use ragcluster_proto::v1::model_worker_client::ModelWorkerClient;
use ragcluster_proto::v1::*;
use ragcluster_tests::bench::scale::{
    QPS_SECONDS, create_collection, embed_queries, measure, perturbed_copies, quiet_cpu, req,
    wait_graphs, write_direct_with,
};
use ragcluster_tests::{BeirQuery, Cluster, datasets_dir, read_jsonl, read_qrels};
use serde_json::{Map, Value as Json, json};
use shard_node::index::hnsw::distance::dot;
use tonic::transport::Channel;

#[derive(Parser)]
struct Args {
    /// Chunks with vectors saved by `ragbench --dump-chunks`.
    #[arg(long, default_value = "bench-out/scifact-chunks.pb")]
    chunks: PathBuf,
    #[arg(long, default_value_t = 100_000)]
    size: usize,
    #[arg(long, default_value_t = 8)]
    concurrency: usize,
    #[arg(long, default_value_t = QPS_SECONDS)]
    qps_seconds: f64,
    #[arg(long, default_value_t = 3)]
    shards: u32,
    #[arg(long, default_value_t = 3)]
    shard_nodes: usize,
    /// The coordinator is the `colocated` binary, a shard node in its process: with
    /// `--shard-nodes 0` a one-process deployment (every shard read in process), the closest
    /// to an engine called in process.
    #[arg(long)]
    colocated: bool,
    /// A Python with qdrant-edge-py: the Qdrant engine on the same corpus, side by side.
    #[arg(long)]
    engines: Option<PathBuf>,
    /// Searches ask for ids only (`SearchRequest.ids_only`: no chunk read or sent), as the
    /// Qdrant reference asks with `with_payload=False`.
    #[arg(long)]
    ids_only: bool,
    /// The clients dial the coordinator's Unix socket (`coordinator.unix_socket`) instead of
    /// its TCP port: a client on the same host without the loopback TCP stack.
    #[arg(long)]
    unix: bool,
    #[arg(long)]
    out: Option<PathBuf>,
}

/// Fields by selectivity: name, modulus (chunk i holds i mod m), share matched by "1".
const FIELDS: [(&str, usize, &str); 4] = [
    ("p2", 2, "50%"),
    ("p10", 10, "10%"),
    ("p100", 100, "1%"),
    ("p1000", 1000, "0.1%"),
];

fn keyword(s: String) -> ragcluster_proto::v1::Value {
    ragcluster_proto::v1::Value {
        kind: Some(value::Kind::Keyword(s)),
    }
}

/// `field = "1"` as a typed filter.
fn condition(field: &str) -> Filter {
    Filter {
        must: vec![Condition {
            kind: Some(condition::Kind::Match(Match {
                field: field.into(),
                value: Some(keyword("1".into())),
            })),
        }],
        ..Default::default()
    }
}

/// Each query's exact top 10 (chunk indexes) among the chunks `keep` takes.
fn exact_top10(
    vectors: &[Vec<f32>],
    qvecs: &[Vec<f32>],
    keep: &dyn Fn(usize) -> bool,
) -> Vec<Vec<usize>> {
    let matching: Vec<usize> = (0..vectors.len()).filter(|&i| keep(i)).collect();
    qvecs
        .iter()
        .map(|q| {
            let mut s: Vec<(f32, usize)> =
                matching.iter().map(|&i| (dot(q, &vectors[i]), i)).collect();
            let k = 10.min(s.len());
            s.select_nth_unstable_by(k.saturating_sub(1), |a, b| b.0.total_cmp(&a.0));
            s.truncate(k);
            s.sort_by(|a, b| b.0.total_cmp(&a.0));
            s.into_iter().map(|x| x.1).collect()
        })
        .collect()
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<()> {
    let args = Args::parse();
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
    let mut chunks = perturbed_copies(&real, args.size);
    for (i, c) in chunks.iter_mut().enumerate() {
        for (f, m, _) in FIELDS {
            c.fields.insert(f.into(), keyword((i % m).to_string()));
        }
    }
    let vectors: Vec<Vec<f32>> = chunks.iter().map(|c| c.embedding.clone()).collect();
    let index_of: std::collections::HashMap<String, usize> = chunks
        .iter()
        .enumerate()
        .map(|(i, c)| (c.chunk_id.clone(), i))
        .collect();
    let sock = std::env::temp_dir().join(format!("filterbench-{}.sock", std::process::id()));
    let unix_config = format!("[coordinator]\nunix_socket = \"{}\"\n", sock.display());
    let cluster = Cluster::start_opts(ragcluster_tests::Options {
        shard_nodes: args.shard_nodes,
        colocated: args.colocated,
        coordinator_config: args.unix.then_some(unix_config.as_str()),
        ..Default::default()
    })?;
    let mut mw = ModelWorkerClient::new(
        Channel::from_shared(cluster.model_worker.grpc.clone())?
            .connect()
            .await?,
    );
    let qvecs = embed_queries(&mut mw, &queries).await?;
    let mut c = if args.unix {
        let ch = ragcluster_common::tls::channel(&format!("unix:{}", sock.display()), None, |e| e)
            .await?;
        ragcluster_proto::v1::coordinator_client::CoordinatorClient::new(ch)
    } else {
        cluster.client().await?
    };
    let info = create_collection(
        &mut c,
        CreateCollectionRequest {
            name: "filtered".into(),
            shard_count: args.shards,
            fields: FIELDS
                .iter()
                .map(|(f, _, _)| FieldSchema {
                    name: (*f).into(),
                    r#type: FieldType::Keyword as i32,
                })
                .collect(),
            ..Default::default()
        },
    )
    .await?;
    let t = Instant::now();
    write_direct_with(&info, chunks, 2).await?;
    wait_graphs(&info, Duration::from_secs(3600)).await?;
    eprintln!(
        "{} chunks in the graphs after {:.1} s",
        args.size,
        t.elapsed().as_secs_f64()
    );
    quiet_cpu(
        || cluster.data_path_cpu_seconds(),
        Duration::from_secs(12),
        Duration::from_secs(180),
    )
    .await;
    let mut report = Map::new();
    let mut exacts: Vec<(String, Vec<Vec<usize>>)> = Vec::new();
    let filters: Vec<(String, Option<Filter>, usize)> =
        std::iter::once(("none".to_owned(), None, 1))
            .chain(
                FIELDS
                    .iter()
                    .map(|(f, m, _)| ((*f).to_owned(), Some(condition(f)), *m)),
            )
            .collect();
    for (name, conditions, m) in &filters {
        let exact = exact_top10(&vectors, &qvecs, &|i| i % m == 1 % m);
        let request = |q: &BeirQuery, v: &[f32]| SearchRequest {
            conditions: conditions.clone(),
            ids_only: args.ids_only,
            ..req("filtered", q, v, SearchMode::Dense, "", 10)
        };
        let (row, top) = measure(
            &cluster,
            &mut c,
            &queries,
            &qvecs,
            &request,
            (args.concurrency, args.qps_seconds),
        )
        .await?;
        let top: Vec<Vec<usize>> = top
            .iter()
            .map(|ids| {
                ids.iter()
                    .filter_map(|id| index_of.get(id).copied())
                    .collect()
            })
            .collect();
        let mut row = row;
        row["recall@10"] = json!(recall(&exact, &top));
        eprintln!("{name}: {row}");
        report.insert(name.clone(), row);
        exacts.push((name.clone(), exact));
    }
    drop(cluster);
    if let Some(python) = &args.engines {
        let reference = engines(python, &args, &vectors, &qvecs, &exacts)?;
        for (name, _, _) in &filters {
            let ours = report[name]["qps"].as_f64().unwrap_or(0.0);
            let theirs = reference[name]["qps"].as_f64().unwrap_or(f64::NAN);
            report[name]["vs_qdrant_qps"] = json!(ours / theirs);
        }
        report.insert("qdrant_edge".into(), reference);
    }
    let text = serde_json::to_string_pretty(&Json::Object(report))?;
    match &args.out {
        Some(p) => std::fs::write(p, text)?,
        None => println!("{text}"),
    }
    Ok(())
}

fn recall(exact: &[Vec<usize>], got: &[Vec<usize>]) -> f64 {
    let mut hit = 0.0;
    for (e, g) in exact.iter().zip(got) {
        let e: std::collections::HashSet<_> = e.iter().collect();
        hit += g.iter().filter(|i| e.contains(i)).count() as f64 / e.len().max(1) as f64;
    }
    hit / exact.len().max(1) as f64
}

/// Writes what `scripts/filter_ref.py` reads and runs it.
fn engines(
    python: &std::path::Path,
    args: &Args,
    vectors: &[Vec<f32>],
    qvecs: &[Vec<f32>],
    exacts: &[(String, Vec<Vec<usize>>)],
) -> Result<Json> {
    let dir = tempfile::tempdir()?;
    let write_f32 = |name: &str, rows: &[Vec<f32>]| -> Result<()> {
        let mut w = std::io::BufWriter::new(std::fs::File::create(dir.path().join(name))?);
        for r in rows {
            for x in r {
                w.write_all(&x.to_le_bytes())?;
            }
        }
        w.flush()?;
        Ok(())
    };
    write_f32("vectors.f32", vectors)?;
    write_f32("query_vectors.f32", qvecs)?;
    for (name, exact) in exacts {
        let mut w = std::fs::File::create(dir.path().join(format!("exact_{name}.jsonl")))?;
        for e in exact {
            writeln!(w, "{}", serde_json::to_string(e)?)?;
        }
    }
    let dim = vectors.first().map_or(0, Vec::len);
    let meta = json!({"chunks": vectors.len(), "queries": qvecs.len(), "dim": dim});
    std::fs::write(dir.path().join("meta.json"), meta.to_string())?;
    let out = std::process::Command::new(python)
        .arg(ragcluster_tests::workspace().join("scripts/filter_ref.py"))
        .arg("--dir")
        .arg(dir.path())
        .args(["--concurrency", &args.concurrency.to_string()])
        .args(["--qps-seconds", &args.qps_seconds.to_string()])
        .output()?;
    anyhow::ensure!(
        out.status.success(),
        "filter_ref.py failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(serde_json::from_slice(&out.stdout)?)
}
