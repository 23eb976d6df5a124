//! `ingestbench`: the ingest pipeline end to end (`ragctl ingest` of SciFact into a local
//! cluster of `--shard-nodes` shard nodes, a coordinator and a model worker on `device =
//! "auto"`), with the model and then with the model excluded (every vector from the
//! coordinator's embedding cache, `ragcluster_tests::bench::pipeline`). Prints one JSON object.
//!
//! `cargo run --release -p ragcluster-tests --bin ingestbench -- --docs 0` (= `make bench-ingest`)

use std::path::PathBuf;

use anyhow::Result;
use clap::Parser;
use ragcluster_tests::bench::pipeline::{PipelineOptions, ingest_twice};
use ragcluster_tests::{Cluster, datasets_dir};

#[derive(Parser)]
struct Args {
    /// BEIR dataset directory (default: the shared SciFact).
    #[arg(long)]
    dataset: Option<PathBuf>,
    /// Only the first N documents (0: all).
    #[arg(long, default_value_t = 0)]
    docs: usize,
    /// The corpus this many times over, each copy new work for the model (`ID~k`, `TITLE
    /// (k)`): a longer run than SciFact's 11k chunks, for steady-state rates.
    #[arg(long, default_value_t = 1)]
    copies: usize,
    #[arg(long, default_value_t = 3)]
    shard_nodes: usize,
    /// Shards of the collections.
    #[arg(long, default_value_t = 3)]
    shards: u32,
    /// `ragctl ingest --batch` (documents per upsert) and `--concurrency` (upserts in flight).
    #[arg(long, default_value_t = 128)]
    batch: usize,
    #[arg(long, default_value_t = 16)]
    concurrency: usize,
    /// HNSW ef_construction of the collections (default: the coordinator's).
    #[arg(long)]
    ef_construction: Option<u32>,
    /// Passes with the model excluded (each into a fresh collection; the median is reported).
    #[arg(long, default_value_t = 3)]
    cached_passes: usize,
    /// Save the chunks of the pass with the model, with their vectors (for `scalebench`,
    /// `hnswbench`).
    #[arg(long)]
    dump_chunks: Option<PathBuf>,
    #[arg(long)]
    out: Option<PathBuf>,
}

#[tokio::main]
async fn main() -> Result<()> {
    let a = Args::parse();
    let dataset = a
        .dataset
        .clone()
        .unwrap_or_else(|| datasets_dir().join("scifact"));
    let cluster = Cluster::start(a.shard_nodes)?;
    let report = ingest_twice(
        &cluster,
        &PipelineOptions {
            dataset: &dataset,
            docs: a.docs,
            copies: a.copies,
            shards: a.shards,
            batch: a.batch,
            concurrency: a.concurrency,
            ef_construction: a.ef_construction,
            cached_passes: a.cached_passes,
            dump_chunks: a.dump_chunks.as_deref(),
        },
    )
    .await?;
    let text = serde_json::to_string_pretty(&report)?;
    match &a.out {
        Some(p) => std::fs::write(p, &text)?,
        None => println!("{text}"),
    }
    Ok(())
}
