//! `hnswbench`: the HNSW walk in process, where a dense query spends its server time.
//!
//! Builds hnsw_rs graphs over N SciFact MiniLM vectors (the chunks saved by
//! `ragbench --dump-chunks`, perturbed copies beyond the real 11k, see `ragcluster_tests::bench::scale`)
//! with the shard's parameters (M 16, ef_construction 200), then times single-threaded searches
//! at several ef and their recall@10 against brute force, side by side in one run:
//!
//! - `portable`: the distance as a plain 8-lane loop (what the compiler makes of it for baseline
//!   x86-64: SSE2);
//! - `avx2`: the shard's distance (AVX2 + FMA, chosen at run time);
//! - each searched with a filter closure (`filter`, how the shard searched before: hnsw_rs then
//!   never stops its layer-0 walk early) and without one (`nofilter`);
//! - `sq8`: raw hnsw_rs built and walked on the int8 codes the shard uses (`index/hnsw/sq8.rs`), the
//!   ef hits rescored with the f32 vectors;
//! - `index`: the shard's own `HnswIndex` (fed in groups of 512 like the index worker; ids and
//!   tombstones resolved through its slot table; int8 graph, f32 rescoring), i.e. what a shard
//!   adds to raw hnsw_rs; `search` walks hnsw_rs's graph, `search_flat` the bottom-layer copy
//!   the index worker takes when writes pause (`index/hnsw/flat.rs`), and `reach` how many of
//!   the graph's points no walk could reach before the copy linked them in (`relinked`);
//!   with `--filters`, `search_flat_filtered` the same searches with a keyword filter per
//!   share (the filter planner: `index/hnsw/planner.rs`).
//!
//! Build figures (`build_s`, `points_per_s`) are the parallel insert of all points on every
//! core, the shard's ingest cost at this size.
//!
//! Queries are SciFact's 300 test queries embedded by a model worker process (MiniLM), as a
//! user's would be.
//!
//! `cargo run --release -p ragcluster-tests --bin hnswbench -- --chunks bench-out/scifact-chunks.pb --points 100000`

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::Parser;
use hnsw_rs::anndists::dist::Distance;
use hnsw_rs::hnsw::Hnsw;
use prost::Message;
use ragcluster_proto::v1::model_worker_client::ModelWorkerClient;
use ragcluster_proto::v1::{Chunk, GetChunksResponse};
use ragcluster_tests::bench::scale::{embed_queries, perturbed_copies};
use ragcluster_tests::{BeirQuery, Proc, datasets_dir, percentile, read_jsonl, read_qrels};
use serde_json::{Map, Value, json};
use shard_node::index::Filter;
use shard_node::index::hnsw::distance::{UnitCosine, dot, dot_portable};
use shard_node::index::hnsw::sq8::{self, Sq8Cosine};
use shard_node::index::hnsw::{HnswIndex, HnswParams};
use shard_node::index::point;
use tonic::transport::Channel;

#[derive(Parser)]
struct Args {
    /// Chunks with vectors saved by `ragbench --dump-chunks`.
    #[arg(long, default_value = "bench-out/scifact-chunks.pb")]
    chunks: PathBuf,
    /// Points in the graph.
    #[arg(long, default_value_t = 100_000)]
    points: usize,
    #[arg(long, default_value_t = 300)]
    queries: usize,
    #[arg(long, default_value_t = 16)]
    m: usize,
    #[arg(long, default_value_t = 200)]
    ef_construction: usize,
    /// Search breadths to sweep.
    #[arg(long, value_delimiter = ',', default_value = "16,32,64,128,256")]
    ef: Vec<usize>,
    /// Skip the `portable` graph (one build less).
    #[arg(long)]
    skip_portable: bool,
    /// Skip the shard's `HnswIndex` (one build less).
    #[arg(long)]
    skip_index: bool,
    /// Skip the f32 `avx2` graph (one build less; it is the reference the others compare to).
    #[arg(long)]
    skip_f32: bool,
    /// Skip the raw int8 `sq8` graph (one build less).
    #[arg(long)]
    skip_sq8: bool,
    /// Filtered searches of the shard's `HnswIndex`: chunk i gets the keyword field `p{k}` =
    /// i mod k for each k here, and each filter `p{k}` = "1" (a share of 1/k) is swept like
    /// the plain search, recall@10 against the exact filtered top 10 (`--filters 2,10,100,1000`
    /// for `filterbench`'s selectivities, in process and single-threaded).
    #[arg(long, value_delimiter = ',')]
    filters: Vec<usize>,
    #[arg(long)]
    out: Option<PathBuf>,
}

/// The shard node's allocator, so in-process graphs cost what they cost in a shard.
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// The distance before the AVX2 path: the same formula on the portable loop.
#[derive(Default, Clone, Copy)]
struct PortableCosine;

impl Distance<f32> for PortableCosine {
    fn eval(&self, a: &[f32], b: &[f32]) -> f32 {
        (1.0 - dot_portable(a, b)).max(0.0)
    }
}

fn main() -> Result<()> {
    let args = Args::parse();
    let bytes = std::fs::read(&args.chunks).with_context(|| {
        format!(
            "{} (make it with `ragbench --scale-chunks 0 --skip-quality --skip-restart --dump-chunks {0}`)",
            args.chunks.display()
        )
    })?;
    let real = GetChunksResponse::decode(bytes.as_slice())?.chunks;
    let mut points = perturbed_copies(&real, args.points);
    for (i, c) in points.iter_mut().enumerate() {
        for k in &args.filters {
            c.fields
                .insert(format!("p{k}"), keyword((i % k).to_string()));
        }
    }
    let queries = query_vectors(args.queries)?;
    let t = Instant::now();
    let exact: Vec<Vec<usize>> = queries.iter().map(|q| exact_top10(q, &points)).collect();
    eprintln!(
        "{} points, {} queries, exact top-10 in {:.1} s",
        points.len(),
        queries.len(),
        t.elapsed().as_secs_f64()
    );
    let mut report = Map::new();
    report.insert(
        "setup".into(),
        json!({"points": points.len(), "queries": queries.len(), "m": args.m,
               "ef_construction": args.ef_construction, "threads": std::thread::available_parallelism().map_or(1, |n| n.get())}),
    );
    if !args.skip_portable {
        report.insert(
            "portable".into(),
            graph_rows(&args, PortableCosine, &points, &queries, &exact),
        );
    }
    if !args.skip_f32 {
        report.insert(
            "avx2".into(),
            graph_rows(&args, UnitCosine, &points, &queries, &exact),
        );
    }
    if !args.skip_sq8 {
        report.insert("sq8".into(), sq8_rows(&args, &points, &queries, &exact));
    }
    if !args.skip_index {
        report.insert("index".into(), index_rows(&args, &points, &queries, &exact));
    }
    let text = serde_json::to_string_pretty(&Value::Object(report))?;
    match &args.out {
        Some(p) => std::fs::write(p, text)?,
        None => println!("{text}"),
    }
    Ok(())
}

/// SciFact's test queries through a model worker process (MiniLM, as at ingest).
fn query_vectors(n: usize) -> Result<Vec<Vec<f32>>> {
    let dir = datasets_dir().join("scifact");
    let qrels = read_qrels(&dir.join("qrels/test.tsv"))?;
    let queries: Vec<BeirQuery> = read_jsonl::<BeirQuery>(&dir.join("queries.jsonl"), usize::MAX)?
        .into_iter()
        .filter(|q| qrels.contains_key(&q.id))
        .take(n)
        .collect();
    let tmp = tempfile::tempdir()?;
    let mw = Proc::model_worker(tmp.path(), false, None)?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let mut c = ModelWorkerClient::new(Channel::from_shared(mw.grpc.clone())?.connect().await?);
        embed_queries(&mut c, &queries).await
    })
}

fn keyword(s: String) -> ragcluster_proto::v1::Value {
    ragcluster_proto::v1::Value {
        kind: Some(ragcluster_proto::v1::value::Kind::Keyword(s)),
    }
}

fn exact_top10(q: &[f32], points: &[Chunk]) -> Vec<usize> {
    exact_top10_where(q, points, |_| true)
}

/// The exact top 10 among the points `keep` takes.
fn exact_top10_where(q: &[f32], points: &[Chunk], keep: impl Fn(usize) -> bool) -> Vec<usize> {
    let mut s: Vec<(f32, usize)> = points
        .iter()
        .enumerate()
        .filter(|(i, _)| keep(*i))
        .map(|(i, c)| (dot(q, &c.embedding), i))
        .collect();
    s.select_nth_unstable_by(9, |a, b| b.0.total_cmp(&a.0));
    s[..10].iter().map(|x| x.1).collect()
}

/// One sweep over ef: p50/p99 in µs and recall@10, each query timed alone.
fn sweep(
    args: &Args,
    queries: &[Vec<f32>],
    exact: &[Vec<usize>],
    mut search: impl FnMut(&[f32], usize) -> Vec<usize>,
) -> Value {
    let mut rows = Map::new();
    for &ef in &args.ef {
        for q in queries.iter().take(20) {
            search(q, ef);
        }
        let mut lat = Vec::with_capacity(queries.len());
        let mut recall = 0.0;
        for (q, ex) in queries.iter().zip(exact) {
            let t = Instant::now();
            let got = search(q, ef);
            lat.push(t.elapsed().as_secs_f64() * 1e6);
            recall += got.iter().filter(|i| ex.contains(i)).count() as f64 / 10.0;
        }
        let recall = recall / queries.len() as f64;
        let p50 = percentile(&mut lat, 50.0);
        let p99 = percentile(&mut lat, 99.0);
        rows.insert(
            format!("ef{ef}"),
            json!({"p50_us": p50, "p99_us": p99, "recall@10": recall}),
        );
    }
    Value::Object(rows)
}

fn graph_rows<D: Distance<f32> + Send + Sync + Copy>(
    args: &Args,
    dist: D,
    points: &[Chunk],
    queries: &[Vec<f32>],
    exact: &[Vec<usize>],
) -> Value {
    let t = Instant::now();
    let hnsw: Hnsw<f32, D> = Hnsw::new(args.m, points.len(), 16, args.ef_construction, dist);
    let data: Vec<(&Vec<f32>, usize)> = points
        .iter()
        .enumerate()
        .map(|(i, c)| (&c.embedding, i))
        .collect();
    hnsw.parallel_insert(&data);
    let build = t.elapsed().as_secs_f64();
    let accept = |_: &usize| true;
    let filtered = sweep(args, queries, exact, |q, ef| {
        hnsw.search_filter(q, 10, ef, Some(&accept))
            .into_iter()
            .map(|n| n.d_id)
            .collect()
    });
    let plain = sweep(args, queries, exact, |q, ef| {
        hnsw.search_filter(q, 10, ef, None)
            .into_iter()
            .map(|n| n.d_id)
            .collect()
    });
    let out = json!({"build_s": build, "points_per_s": points.len() as f64 / build,
                     "filter": filtered, "nofilter": plain});
    eprintln!("{}", serde_json::to_string(&out).unwrap_or_default());
    out
}

/// The graph built and walked on int8 codes (`index/hnsw/sq8.rs`), its ef hits rescored with the
/// f32 vectors.
fn sq8_rows(args: &Args, points: &[Chunk], queries: &[Vec<f32>], exact: &[Vec<usize>]) -> Value {
    let codes: Vec<Vec<i8>> = points.iter().map(|c| sq8::encode(&c.embedding)).collect();
    let t = Instant::now();
    let hnsw: Hnsw<i8, Sq8Cosine> =
        Hnsw::new(args.m, points.len(), 16, args.ef_construction, Sq8Cosine);
    let data: Vec<(&Vec<i8>, usize)> = codes.iter().enumerate().map(|(i, c)| (c, i)).collect();
    hnsw.parallel_insert(&data);
    let build = t.elapsed().as_secs_f64();
    let rows = sweep(args, queries, exact, |q, ef| {
        let code = sq8::encode(q);
        let mut hits: Vec<(f32, usize)> = hnsw
            .search_filter(&code, ef, ef, None)
            .into_iter()
            .map(|n| (dot(q, &points[n.d_id].embedding), n.d_id))
            .collect();
        hits.sort_by(|a, b| b.0.total_cmp(&a.0));
        hits.into_iter().take(10).map(|h| h.1).collect()
    });
    let out = json!({"build_s": build, "points_per_s": points.len() as f64 / build,
                     "nofilter_rescored": rows});
    eprintln!("{}", serde_json::to_string(&out).unwrap_or_default());
    out
}

fn index_rows(args: &Args, points: &[Chunk], queries: &[Vec<f32>], exact: &[Vec<usize>]) -> Value {
    let params = HnswParams {
        m: args.m as u32,
        ef_construction: args.ef_construction as u32,
        ef_search: 64,
    };
    let idx = HnswIndex::new(384, params, points.len());
    let t = Instant::now();
    for group in points.chunks(512) {
        idx.insert(group.iter().map(point).collect());
    }
    let build = t.elapsed().as_secs_f64();
    let pos: std::collections::HashMap<&str, usize> = points
        .iter()
        .enumerate()
        .map(|(i, c)| (c.chunk_id.as_str(), i))
        .collect();
    let search = |q: &[f32], ef: usize| {
        idx.search(q, 10, ef, &Filter::default())
            .iter()
            .map(|(id, _)| pos[id.as_str()])
            .collect()
    };
    let rows = sweep(args, queries, exact, search);
    let t = Instant::now();
    idx.refresh_flat();
    let copy = t.elapsed().as_secs_f64();
    let reach = idx.flat_reach();
    let flat = sweep(args, queries, exact, search);
    let mut filtered = Map::new();
    for &k in &args.filters {
        let field = format!("p{k}");
        let f = Filter::keywords([(field.as_str(), "1")]);
        let exact: Vec<Vec<usize>> = queries
            .iter()
            .map(|q| exact_top10_where(q, points, |i| i % k == 1 % k))
            .collect();
        let search = |q: &[f32], ef: usize| {
            idx.search(q, 10, ef, &f)
                .iter()
                .map(|(id, _)| pos[id.as_str()])
                .collect()
        };
        filtered.insert(field, sweep(args, queries, &exact, search));
    }
    let out = json!({"build_s": build, "points_per_s": points.len() as f64 / build,
                     "search": rows, "flat_copy_s": copy, "reach": reach, "search_flat": flat,
                     "search_flat_filtered": filtered});
    eprintln!("{}", serde_json::to_string(&out).unwrap_or_default());
    out
}
