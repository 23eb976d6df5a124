//! `bm25bench`: one shard's BM25 search in process with each traversal (`Bm25Index::set_scoring`):
//! tantivy's block-WAND pruning, tantivy's scorer tree over every match, and our term-at-a-time
//! scoring, on SciFact's chunks (and repeated copies for the bigger sizes) with its 300 test
//! queries at top_k 10, one thread. Every traversal must give the same scores; the figure is
//! time per query on one busy thread (the machine otherwise idle), rounds alternating.
//!
//! `cargo run --release -p ragcluster-tests --bin bm25bench -- --sizes 11235,100000`

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result, ensure};
use clap::Parser;
use prost::Message;
use ragcluster_proto::v1::{Chunk, GetChunksResponse};
use ragcluster_tests::bench::scale::perturbed_copies;
use ragcluster_tests::{BeirQuery, datasets_dir, read_jsonl, read_qrels};
use serde_json::{Map, Value, json};
use shard_node::index::bm25::{Bm25Index, Scoring};

#[derive(Parser)]
struct Args {
    /// Chunks with vectors saved by `ingestbench --dump-chunks`.
    #[arg(long, default_value = "bench-out/scifact-chunks.pb")]
    chunks: PathBuf,
    #[arg(long, value_delimiter = ',', default_value = "11235,100000")]
    sizes: Vec<usize>,
    /// Alternating rounds per traversal.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Passes over the queries per round.
    #[arg(long, default_value_t = 10)]
    passes: usize,
}

fn main() -> Result<()> {
    let args = Args::parse();
    let real = GetChunksResponse::decode(
        &*std::fs::read(&args.chunks).with_context(|| args.chunks.display().to_string())?,
    )?
    .chunks;
    let dir = datasets_dir().join("scifact");
    let qrels = read_qrels(&dir.join("qrels/test.tsv"))?;
    let queries: Vec<String> = read_jsonl::<BeirQuery>(&dir.join("queries.jsonl"), usize::MAX)?
        .into_iter()
        .filter(|q| qrels.contains_key(&q.id))
        .map(|q| q.text)
        .collect();
    let mut report = Map::new();
    for &n in &args.sizes {
        report.insert(n.to_string(), one_size(&args, &real, n, &queries)?);
    }
    println!("{}", serde_json::to_string_pretty(&Value::Object(report))?);
    Ok(())
}

/// One query's hits: chunk id and score, best first.
type Hits = Vec<(String, f32)>;

fn one_size(args: &Args, real: &[Chunk], n: usize, queries: &[String]) -> Result<Value> {
    let tmp = tempfile::tempdir()?;
    let idx = Bm25Index::open(tmp.path(), 200_000_000)?;
    let t = Instant::now();
    for group in perturbed_copies(real, n).chunks(10_000) {
        idx.stage_chunks(group)?;
    }
    idx.commit(1)?;
    if idx.merge_segments()? {
        // The merge runs on its own thread and reloads the reader when done.
        std::thread::sleep(std::time::Duration::from_secs(2));
        while idx.merge_segments()? {
            std::thread::sleep(std::time::Duration::from_secs(1));
        }
    }
    eprintln!("{n}: indexed in {:.1} s", t.elapsed().as_secs_f64());
    let run = |scoring: Scoring| -> Result<(f64, Vec<Hits>)> {
        idx.set_scoring(scoring);
        let mut tops = Vec::new();
        let t = Instant::now();
        for pass in 0..args.passes {
            for q in queries {
                let top = idx.search(q, 10, &shard_node::index::Filter::default(), None)?;
                if pass == 0 {
                    tops.push(top);
                }
            }
        }
        let per = t.elapsed().as_secs_f64() / (args.passes * queries.len()) as f64;
        Ok((per * 1e6, tops))
    };
    let modes = [
        ("block_wand", Scoring::BlockWand),
        ("every_match", Scoring::EveryMatch),
        ("term_at_a_time", Scoring::TermAtATime),
    ];
    run(Scoring::BlockWand)?; // warm-up
    let mut times: Vec<Vec<f64>> = vec![Vec::new(); modes.len()];
    for _ in 0..args.rounds {
        let mut reference: Option<Vec<Hits>> = None;
        let mut line = Vec::new();
        for (i, (name, scoring)) in modes.iter().enumerate() {
            let (us, tops) = run(*scoring)?;
            if let Some(r) = &reference {
                for (q, (a, b)) in r.iter().zip(&tops).enumerate() {
                    ensure!(
                        a.len() == b.len()
                            && a.iter().zip(b).all(|(x, y)| (x.1 - y.1).abs() < 1e-4),
                        "query {q}: {name} scores differ: {a:?} vs {b:?}"
                    );
                }
            } else {
                reference = Some(tops);
            }
            times[i].push(us);
            line.push(format!("{name} {us:.1}"));
        }
        eprintln!("{n}: {} us per query", line.join(", "));
    }
    let median = |v: &[f64]| {
        let mut v = v.to_vec();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let mut out = Map::new();
    out.insert("docs".into(), json!(idx.num_docs()));
    let wand = median(&times[0]);
    for (i, (name, _)) in modes.iter().enumerate() {
        let m = median(&times[i]);
        out.insert(format!("{name}_us_per_query"), json!(m));
        out.insert(format!("{name}_over_block_wand"), json!(m / wand));
        out.insert(format!("{name}_rounds"), json!(times[i]));
    }
    Ok(Value::Object(out))
}
