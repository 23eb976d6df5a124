//! Side-by-side rows against the engines a user would pick instead (issue 20's reference
//! table): a benchmark's corpus, query vectors and exact top 10 are written out for
//! `scripts/engines_bench.py`, which measures tantivy-py and the Qdrant engine (qdrant-edge-py)
//! in process on the same machine, and the figures are set next to ragcluster's as ratios.

use std::io::Write;
use std::path::Path;

use anyhow::{Context, Result, ensure};
use ragcluster_proto::v1::Chunk;
use serde_json::{Map, Value, json};
use shard_node::index::bm25::indexed_text;

use crate::{BeirQuery, workspace};

/// Writes what `engines_bench.py` reads (its docstring names the files): the text each chunk
/// is BM25-indexed by, its vector, the queries with their vectors, and each query's exact top
/// 10 chunk ids.
pub fn export(
    dir: &Path,
    chunks: &[Chunk],
    queries: &[BeirQuery],
    qvecs: &[Vec<f32>],
    exact: &[Vec<String>],
) -> Result<()> {
    ensure!(queries.len() == qvecs.len() && qvecs.len() == exact.len());
    let dim = chunks.first().map_or(0, |c| c.embedding.len());
    let file = |name: &str| -> Result<std::io::BufWriter<std::fs::File>> {
        Ok(std::io::BufWriter::new(std::fs::File::create(
            dir.join(name),
        )?))
    };
    let (mut corpus, mut vectors) = (file("corpus.jsonl")?, file("vectors.f32")?);
    for c in chunks {
        ensure!(
            c.embedding.len() == dim,
            "chunk {} has no vector",
            c.chunk_id
        );
        let text = indexed_text(&c.title, &c.section, &c.text);
        writeln!(corpus, "{}", json!({"id": c.chunk_id, "text": text}))?;
        for x in &c.embedding {
            vectors.write_all(&x.to_le_bytes())?;
        }
    }
    let (mut qs, mut qv, mut ex) = (
        file("queries.jsonl")?,
        file("query_vectors.f32")?,
        file("exact.jsonl")?,
    );
    for ((q, v), e) in queries.iter().zip(qvecs).zip(exact) {
        writeln!(qs, "{}", json!({"text": q.text}))?;
        for x in v {
            qv.write_all(&x.to_le_bytes())?;
        }
        writeln!(ex, "{}", serde_json::to_string(e)?)?;
    }
    for mut w in [corpus, vectors, qs, qv, ex] {
        w.flush()?;
    }
    let meta = json!({"chunks": chunks.len(), "queries": queries.len(), "dim": dim});
    std::fs::write(dir.join("meta.json"), meta.to_string())?;
    Ok(())
}

/// What `engines_bench.py` measures on an exported directory.
pub struct Load<'a> {
    pub concurrency: usize,
    pub qps_seconds: f64,
    pub dense_ef: &'a [u32],
    pub dense_only: bool,
}

/// Runs `scripts/engines_bench.py` with `python` on `dir` and returns its JSON.
pub fn run(python: &Path, dir: &Path, load: &Load) -> Result<Value> {
    let ef: Vec<String> = load.dense_ef.iter().map(u32::to_string).collect();
    let mut cmd = std::process::Command::new(python);
    cmd.arg(workspace().join("scripts/engines_bench.py"))
        .arg("--dir")
        .arg(dir)
        .args(["--concurrency", &load.concurrency.to_string()])
        .args(["--qps-seconds", &load.qps_seconds.to_string()])
        .args(["--dense-ef", &ef.join(",")]);
    if load.dense_only {
        cmd.arg("--dense-only");
    }
    let out = cmd
        .output()
        .with_context(|| format!("running {}", python.display()))?;
    ensure!(
        out.status.success(),
        "engines_bench.py failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(serde_json::from_slice(&out.stdout)?)
}

/// Ours over theirs for each mode both measured: p50 and CPU per query (lower is better for
/// us below 1) and QPS (higher is better above 1). Our CPU leaves out the bench client, the
/// engines' includes their Python client loop (their normal client path).
pub fn ratios(ours: &Value, engines: &Value) -> Value {
    let mut pairs: Vec<(String, &str, String)> = vec![
        ("bm25".into(), "tantivy", "bm25".into()),
        ("bm25".into(), "qdrant_edge", "bm25".into()),
        ("dense".into(), "qdrant_edge", "dense".into()),
        ("hybrid-rrf".into(), "qdrant_edge", "hybrid-rrf".into()),
    ];
    if let Some(o) = ours.as_object() {
        for k in o.keys().filter(|k| k.starts_with("dense_ef")) {
            pairs.push((k.clone(), "qdrant_edge", k.clone()));
        }
    }
    let mut out = Map::new();
    for (mode, engine, theirs) in pairs {
        let (a, b) = (&ours[&mode], &engines[engine][&theirs]);
        if !a.is_object() || !b.is_object() {
            continue;
        }
        let ratio = |k: &str| match (a[k].as_f64(), b[k].as_f64()) {
            (Some(x), Some(y)) if y > 0.0 => json!(x / y),
            _ => Value::Null,
        };
        out.insert(
            format!("{mode} / {engine} {theirs}"),
            json!({"p50": ratio("p50_ms"), "qps": ratio("qps"),
                   "cpu_per_query": ratio("cpu_ms_per_query"),
                   "recall@10": [a["recall@10"], b["recall@10"]]}),
        );
    }
    Value::Object(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ratios_pair_modes_that_both_sides_measured() {
        let ours = json!({"bm25": {"p50_ms": 0.6, "qps": 3000.0, "cpu_ms_per_query": 0.4},
                          "dense_ef128": {"p50_ms": 1.0, "qps": 1000.0, "cpu_ms_per_query": 1.0,
                                          "recall@10": 0.99}});
        let engines = json!({"tantivy": {"bm25": {"p50_ms": 0.2, "qps": 6000.0,
                                                  "cpu_ms_per_query": 0.2}},
                             "qdrant_edge": {"dense_ef128": {"p50_ms": 0.5, "qps": 2000.0,
                                                             "cpu_ms_per_query": 0.5,
                                                             "recall@10": 0.98}}});
        let r = ratios(&ours, &engines);
        let t = &r["bm25 / tantivy bm25"];
        assert!((t["p50"].as_f64().unwrap() - 3.0).abs() < 1e-9);
        assert!((t["qps"].as_f64().unwrap() - 0.5).abs() < 1e-9);
        assert!((t["cpu_per_query"].as_f64().unwrap() - 2.0).abs() < 1e-9);
        assert_eq!(
            r["dense_ef128 / qdrant_edge dense_ef128"]["recall@10"],
            json!([0.99, 0.98])
        );
        // Modes one side lacks are left out.
        assert!(r.get("bm25 / qdrant_edge bm25").is_none());
        assert!(r.get("dense / qdrant_edge dense").is_none());
    }
}
