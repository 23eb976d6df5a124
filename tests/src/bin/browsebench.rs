//! `browsebench`: reading a collection back at scale (issue 69's targets: Scroll all of a
//! 1M-chunk collection at >= 50,000 chunks/s on 2 cores; Count by filter at 100k chunks,
//! p50 <= 5 ms). For each size a fresh local cluster (`--shard-nodes` shard nodes, `--shards`
//! shards, replication 1, one coordinator) is fed chunks straight into the shard nodes:
//! SciFact abstracts cut into four pieces each, repeated under new document ids, with random
//! unit vectors (neither call reads the graphs, so they are built cheaply: M 4,
//! ef_construction 16) and keyword fields `p2`, `p10`, `p100`, `p1000` (chunk i: i mod k),
//! for filters that match 50%, 10%, 1% and 0.1% of the chunks. Once the shards are idle,
//! through the coordinator's gRPC API, one client:
//!
//! - Scroll every chunk in pages of 1,000 (chunks/s, and MB/s of response), and the chunks of
//!   the 10% filter;
//! - Count, each filter and none, `--counts` calls each: p50 / p99.
//!
//! With `--engines PYTHON` (qdrant-edge-py: `bash scripts/setup-bench-python.sh --engines`)
//! the same corpus then goes to `scripts/browse_ref.py`: the Qdrant engine in process
//! scrolls it (pages of 1,000, payload included) and counts it by the same filters (exact,
//! with a keyword payload index), for side-by-side ratios.
//!
//! `cargo run --release -p ragcluster-tests --bin browsebench -- --sizes 100000,1000000`

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use clap::Parser;
use prost::Message as _;
use ragcluster_proto::v1::coordinator_client::CoordinatorClient;
use ragcluster_proto::v1::*;
use ragcluster_tests::bench::scale::{create_collection, quiet_cpu, write_direct_with};
use ragcluster_tests::{BeirDoc, Cluster, datasets_dir, percentile, read_jsonl};
use rand::{Rng, SeedableRng};
use serde_json::{Map, Value, json};
use tonic::transport::Channel;

#[derive(Parser)]
struct Args {
    #[arg(long, value_delimiter = ',', default_value = "100000,1000000")]
    sizes: Vec<usize>,
    #[arg(long, default_value_t = 3)]
    shards: u32,
    #[arg(long, default_value_t = 3)]
    shard_nodes: usize,
    /// Count calls per filter.
    #[arg(long, default_value_t = 200)]
    counts: usize,
    /// A Python with qdrant-edge-py: the Qdrant engine on the same corpus, side by side.
    #[arg(long)]
    engines: Option<PathBuf>,
    #[arg(long)]
    out: Option<PathBuf>,
}

/// Filters by selectivity: key (chunk i holds i mod `m`), `m`, and the share it matches.
const FILTERS: [(&str, usize, &str); 4] = [
    ("p2", 2, "50%"),
    ("p10", 10, "10%"),
    ("p100", 100, "1%"),
    ("p1000", 1000, "0.1%"),
];
const DIM: usize = 384;
const PIECES: usize = 4;

/// `n` chunks, four per document, from SciFact's abstracts.
fn corpus(abstracts: &[BeirDoc], n: usize) -> Vec<Chunk> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(11);
    (0..n)
        .map(|i| {
            let (d, position) = (i / PIECES, i % PIECES);
            let src = &abstracts[d % abstracts.len()];
            let doc = format!("{}~{}", src.id, d / abstracts.len());
            let chars: Vec<char> = src.text.chars().collect();
            let piece = chars.len().div_ceil(PIECES).max(1);
            let text: String = chars
                .iter()
                .skip(position * piece)
                .take(piece)
                .collect::<String>();
            let mut v: Vec<f32> = (0..DIM).map(|_| rng.random::<f32>() - 0.5).collect();
            let norm = v.iter().map(|x| x * x).sum::<f32>().sqrt();
            v.iter_mut().for_each(|x| *x /= norm);
            let id = |p: usize| format!("{doc}#{p}");
            Chunk {
                fields: Default::default(),
                embedding_revision: String::new(),
                chunk_id: id(position),
                doc_id: doc.clone(),
                position: position as u32,
                prev_chunk_id: if position > 0 {
                    id(position - 1)
                } else {
                    String::new()
                },
                next_chunk_id: if position + 1 < PIECES {
                    id(position + 1)
                } else {
                    String::new()
                },
                title: src.title.clone(),
                section: String::new(),
                text: if text.is_empty() { "-".into() } else { text },
                metadata: FILTERS
                    .iter()
                    .map(|(k, m, _)| ((*k).to_owned(), (i % m).to_string()))
                    .collect(),
                embedding: v,
            }
        })
        .collect()
}

/// Every chunk through Scroll pages of 1,000: chunks, bytes and seconds.
async fn scroll_all(
    c: &mut CoordinatorClient<Channel>,
    filter: &[(&str, &str)],
) -> Result<(usize, usize, f64)> {
    let filter: std::collections::HashMap<String, String> = filter
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    let t = Instant::now();
    let (mut n, mut bytes, mut cursor) = (0, 0, String::new());
    loop {
        let page = c
            .scroll(ScrollRequest {
                collection: "browse".into(),
                filter: filter.clone(),
                limit: 1000,
                cursor: cursor.clone(),
                timeout_ms: 60_000,
                ..Default::default()
            })
            .await?
            .into_inner();
        n += page.chunks.len();
        bytes += page.encoded_len();
        cursor = page.next_cursor;
        if cursor.is_empty() {
            return Ok((n, bytes, t.elapsed().as_secs_f64()));
        }
    }
}

async fn counts(
    c: &mut CoordinatorClient<Channel>,
    filter: &[(&str, &str)],
    calls: usize,
) -> Result<Value> {
    let req = CountRequest {
        collection: "browse".into(),
        filter: filter
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect(),
        ..Default::default()
    };
    let mut lat = Vec::with_capacity(calls);
    let mut last = CountResponse::default();
    for _ in 0..calls {
        let t = Instant::now();
        last = c.count(req.clone()).await?.into_inner();
        lat.push(t.elapsed().as_secs_f64() * 1e3);
    }
    Ok(json!({"chunks": last.chunks, "documents": last.documents,
              "p50_ms": percentile(&mut lat, 50.0), "p99_ms": percentile(&mut lat, 99.0)}))
}

async fn one_size(args: &Args, abstracts: &[BeirDoc], n: usize) -> Result<Value> {
    let chunks = corpus(abstracts, n);
    let cluster = Cluster::start_opts(ragcluster_tests::Options {
        shard_nodes: args.shard_nodes,
        ..Default::default()
    })?;
    let mut c = cluster.client().await?;
    let info = create_collection(
        &mut c,
        CreateCollectionRequest {
            name: "browse".into(),
            shard_count: args.shards,
            hnsw: Some(HnswParams {
                m: 4,
                ef_construction: 16,
                ef_search: 0,
            }),
            ..Default::default()
        },
    )
    .await?;
    let t = Instant::now();
    write_direct_with(&info, chunks, 2).await?;
    let ingest_s = t.elapsed().as_secs_f64();
    let quiet_s = quiet_cpu(
        || cluster.data_path_cpu_seconds(),
        Duration::from_secs(5),
        Duration::from_secs(1800),
    )
    .await;
    let mut c = cluster.client().await?.max_decoding_message_size(64 << 20);
    let (scrolled, bytes, secs) = scroll_all(&mut c, &[]).await?;
    ensure!(scrolled == n, "scrolled {scrolled} of {n} chunks");
    let (filtered, _, fsecs) = scroll_all(&mut c, &[("p10", "3")]).await?;
    let want = (0..n).filter(|i| i % 10 == 3).count();
    ensure!(
        filtered == want,
        "the 10% scroll gave {filtered} of {want} chunks"
    );
    let mut count = Map::new();
    count.insert("none".into(), counts(&mut c, &[], args.counts).await?);
    for (k, _, share) in FILTERS {
        let row = counts(&mut c, &[(k, "1")], args.counts).await?;
        count.insert(format!("{k} ({share})"), row);
    }
    Ok(json!({
        "chunks": n, "shards": args.shards, "shard_nodes": args.shard_nodes,
        "ingest_s": ingest_s, "quiet_after_s": quiet_s,
        "scroll": {"chunks": scrolled, "seconds": secs, "chunks_per_s": scrolled as f64 / secs,
                   "mb_per_s": bytes as f64 / secs / 1e6, "bytes_per_chunk": bytes as f64 / scrolled as f64},
        "scroll_p10": {"chunks": filtered, "seconds": fsecs, "chunks_per_s": filtered as f64 / fsecs},
        "count": count,
    }))
}

/// The Qdrant engine on the same corpus (`scripts/browse_ref.py`), its figures as JSON.
fn engines(python: &PathBuf, abstracts: &[BeirDoc], n: usize, counts: usize) -> Result<Value> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("corpus.jsonl");
    let mut out = std::io::BufWriter::new(std::fs::File::create(&path)?);
    for ch in corpus(abstracts, n) {
        use std::io::Write as _;
        writeln!(
            out,
            "{}",
            json!({"chunk_id": ch.chunk_id, "doc_id": ch.doc_id, "position": ch.position,
                   "title": ch.title, "text": ch.text, "metadata": ch.metadata,
                   "vector": ch.embedding})
        )?;
    }
    drop(out);
    let script = ragcluster_tests::workspace().join("scripts/browse_ref.py");
    let o = std::process::Command::new(python)
        .arg(&script)
        .arg(&path)
        .arg("--counts")
        .arg(counts.to_string())
        .arg("--work")
        .arg(dir.path().join("qdrant"))
        .output()?;
    ensure!(
        o.status.success(),
        "browse_ref.py failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    Ok(serde_json::from_slice(&o.stdout)?)
}

/// Ours over the engine's, for every figure both have (time: lower is better).
fn ratios(ours: &Value, engine: &Value) -> Value {
    let f = |v: &Value, p: &str| v.pointer(p).and_then(Value::as_f64);
    let mut r = Map::new();
    if let (Some(a), Some(b)) = (
        f(ours, "/scroll/chunks_per_s"),
        f(engine, "/scroll/chunks_per_s"),
    ) {
        r.insert("scroll_chunks_per_s".into(), json!(a / b));
    }
    for key in ["none", "p2 (50%)", "p10 (10%)", "p100 (1%)", "p1000 (0.1%)"] {
        let p = format!("/count/{}/p50_ms", key.replace('/', "~1"));
        if let (Some(a), Some(b)) = (f(ours, &p), f(engine, &p)) {
            r.insert(format!("count_p50 {key}"), json!(a / b));
        }
    }
    Value::Object(r)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<()> {
    let args = Args::parse();
    let path = datasets_dir().join("scifact/corpus.jsonl");
    let abstracts: Vec<BeirDoc> =
        read_jsonl(&path, usize::MAX).with_context(|| path.display().to_string())?;
    let mut report = Map::new();
    for &n in &args.sizes {
        let mut row = one_size(&args, &abstracts, n).await?;
        if let Some(python) = &args.engines {
            let engine = engines(python, &abstracts, n, args.counts)?;
            row["vs_qdrant_engine"] = ratios(&row, &engine);
            row["qdrant_engine"] = engine;
        }
        eprintln!("{n} chunks: {}", serde_json::to_string(&row)?);
        report.insert(n.to_string(), row);
    }
    let text = serde_json::to_string_pretty(&Value::Object(report))?;
    match &args.out {
        Some(p) => std::fs::write(p, text)?,
        None => println!("{text}"),
    }
    Ok(())
}
