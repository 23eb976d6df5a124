//! `updatebench`: changing stored documents (issue 69's partial updates). A fresh local
//! cluster (3 shard nodes, 3 shards, one coordinator, a MiniLM model worker) ingests the
//! first `--docs` SciFact abstracts, each with a keyword `bucket` (i mod 10) and an integer
//! field `rev`. Then, through the coordinator's gRPC API, one client:
//!
//! - `UpdateDocuments` by ids, `--batch` documents a call, setting `rev`: documents/s and
//!   p50 / p99 per call (every chunk's vector and graph slot kept);
//! - `UpdateDocuments` by filter (`bucket = k`, 10% of the documents), `--filter-calls` calls;
//! - the same change the way it had to be made before partial updates, by upserting whole
//!   documents again: unchanged text (the stored vectors are reused, `reused_chunks`), and
//!   text changed so that every chunk is embedded again (the cost of a re-upsert when no
//!   vector can be reused: a restarted coordinator without its embedding cache did this for
//!   unchanged text too);
//! - `DeleteDocuments` by filter (10%).
//!
//! Every step is checked by `Count`. With `--engines PYTHON` (qdrant-edge-py: `bash
//! scripts/setup-bench-python.sh --engines`) `scripts/update_ref.py` does the same to the
//! Qdrant engine in process: as many points as we stored chunks (random unit vectors; a
//! payload change does not read them), `set_payload` on the chunks of `--batch` documents at a
//! time, by the bucket filter (with a keyword payload index), and delete by filter.
//!
//! `cargo run --release -p ragcluster-tests --bin updatebench -- --docs 2000`

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use clap::Parser;
use ragcluster_proto::v1::coordinator_client::CoordinatorClient;
use ragcluster_proto::v1::*;
use ragcluster_tests::{BeirDoc, Cluster, datasets_dir, latency_summary, read_jsonl};
use serde_json::{Map, Value as Json, json};
use tonic::transport::Channel;

#[derive(Parser)]
struct Args {
    #[arg(long, default_value_t = 2000)]
    docs: usize,
    /// Documents per UpdateDocuments / UpsertDocuments call.
    #[arg(long, default_value_t = 100)]
    batch: usize,
    #[arg(long, default_value_t = 10)]
    filter_calls: usize,
    #[arg(long)]
    engines: Option<PathBuf>,
    #[arg(long)]
    out: Option<PathBuf>,
}

const C: &str = "upd";

fn val(k: value::Kind) -> Value {
    Value { kind: Some(k) }
}

fn bucket(k: usize) -> Filter {
    Filter {
        must: vec![Condition {
            kind: Some(condition::Kind::Match(Match {
                field: "bucket".into(),
                value: Some(val(value::Kind::Keyword(k.to_string()))),
            })),
        }],
        ..Default::default()
    }
}

fn rev(r: i64) -> Filter {
    Filter {
        must: vec![Condition {
            kind: Some(condition::Kind::Match(Match {
                field: "rev".into(),
                value: Some(val(value::Kind::Integer(r))),
            })),
        }],
        ..Default::default()
    }
}

fn document(i: usize, d: &BeirDoc, r: i64, suffix: &str) -> Document {
    Document {
        id: format!("d{i:05}"),
        title: d.title.clone(),
        text: format!("{}{suffix}", d.text),
        metadata: [("bucket".to_owned(), (i % 10).to_string())].into(),
        fields: [("rev".to_owned(), val(value::Kind::Integer(r)))].into(),
        ..Default::default()
    }
}

async fn count(c: &mut CoordinatorClient<Channel>, f: Option<Filter>) -> Result<(u64, u64)> {
    let r = c
        .count(CountRequest {
            collection: C.into(),
            conditions: f,
            ..Default::default()
        })
        .await?
        .into_inner();
    Ok((r.documents, r.chunks))
}

/// Upserts every document in batches; (seconds, chunks written, chunks reused).
async fn upsert_all(
    c: &mut CoordinatorClient<Channel>,
    docs: &[Document],
    batch: usize,
) -> Result<(f64, u64, u64)> {
    let t = Instant::now();
    let (mut chunks, mut reused) = (0, 0);
    for b in docs.chunks(batch) {
        let r = c
            .upsert_documents(UpsertDocumentsRequest {
                collection: C.into(),
                documents: b.to_vec(),
                ..Default::default()
            })
            .await?
            .into_inner();
        chunks += u64::from(r.chunks);
        reused += u64::from(r.reused_chunks);
    }
    Ok((t.elapsed().as_secs_f64(), chunks, reused))
}

fn patch_rev(r: i64) -> MetadataPatch {
    MetadataPatch {
        set_fields: [("rev".to_owned(), val(value::Kind::Integer(r)))].into(),
        ..Default::default()
    }
}

async fn updates_by_id(c: &mut CoordinatorClient<Channel>, n: usize, batch: usize) -> Result<Json> {
    let ids: Vec<String> = (0..n).map(|i| format!("d{i:05}")).collect();
    let mut lat = Vec::new();
    let t = Instant::now();
    for b in ids.chunks(batch) {
        let s = Instant::now();
        let r = c
            .update_documents(UpdateDocumentsRequest {
                collection: C.into(),
                ids: b.to_vec(),
                patch: Some(patch_rev(1)),
                ..Default::default()
            })
            .await?
            .into_inner();
        ensure!(r.updated as usize == b.len(), "updated {}", r.updated);
        lat.push(s.elapsed().as_secs_f64() * 1000.0);
    }
    let secs = t.elapsed().as_secs_f64();
    ensure!(count(c, Some(rev(1))).await?.0 == n as u64);
    Ok(json!({"docs_per_s": n as f64 / secs, "seconds": secs, "per_call_ms": latency_summary(lat)}))
}

async fn updates_by_filter(c: &mut CoordinatorClient<Channel>, calls: usize) -> Result<Json> {
    let mut lat = Vec::new();
    let mut docs = 0;
    for k in 0..calls {
        let s = Instant::now();
        let r = c
            .update_documents(UpdateDocumentsRequest {
                collection: C.into(),
                conditions: Some(bucket(k % 10)),
                patch: Some(patch_rev(2)),
                ..Default::default()
            })
            .await?
            .into_inner();
        lat.push(s.elapsed().as_secs_f64() * 1000.0);
        docs += u64::from(r.updated);
    }
    let per_call = docs as f64 / calls as f64;
    let total: f64 = lat.iter().sum::<f64>() / 1000.0;
    Ok(
        json!({"docs_per_call": per_call, "docs_per_s": docs as f64 / total,
              "per_call_ms": latency_summary(lat)}),
    )
}

fn engines(python: &PathBuf, chunks_per_doc: &[u32], a: &Args) -> Result<Json> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("docs.json");
    std::fs::write(&path, serde_json::to_vec(chunks_per_doc)?)?;
    let script = ragcluster_tests::workspace().join("scripts/update_ref.py");
    let o = std::process::Command::new(python)
        .arg(&script)
        .args(["--docs-file", &path.display().to_string()])
        .args(["--batch", &a.batch.to_string()])
        .args(["--filter-calls", &a.filter_calls.to_string()])
        .args(["--work", &dir.path().join("qdrant").display().to_string()])
        .output()?;
    ensure!(
        o.status.success(),
        "update_ref.py failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    Ok(serde_json::from_slice(&o.stdout)?)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<()> {
    let a = Args::parse();
    let path = datasets_dir().join("scifact/corpus.jsonl");
    let abstracts: Vec<BeirDoc> =
        read_jsonl(&path, a.docs).with_context(|| path.display().to_string())?;
    let n = abstracts.len();
    let cluster = Cluster::start(3)?;
    let mut c = cluster.client().await?;
    c.create_collection(CreateCollectionRequest {
        name: C.into(),
        shard_count: 3,
        ..Default::default()
    })
    .await?;
    let docs: Vec<Document> = abstracts
        .iter()
        .enumerate()
        .map(|(i, d)| document(i, d, 0, ""))
        .collect();
    let (secs, chunks, _) = upsert_all(&mut c, &docs, 32).await?;
    let mut report = Map::new();
    report.insert(
        "ingest".into(),
        json!({"docs": n, "chunks": chunks, "seconds": secs, "docs_per_s": n as f64 / secs}),
    );
    tokio::time::sleep(Duration::from_secs(2)).await;
    report.insert(
        "update_by_ids".into(),
        updates_by_id(&mut c, n, a.batch).await?,
    );
    report.insert(
        "update_by_filter_10pct".into(),
        updates_by_filter(&mut c, a.filter_calls).await?,
    );
    // The change as whole documents: unchanged text (vectors reused), then changed text.
    let same: Vec<Document> = abstracts
        .iter()
        .enumerate()
        .map(|(i, d)| document(i, d, 3, ""))
        .collect();
    let (secs, chunks, reused) = upsert_all(&mut c, &same, a.batch.min(256)).await?;
    ensure!(count(&mut c, Some(rev(3))).await?.0 == n as u64);
    report.insert(
        "reupsert_unchanged_text".into(),
        json!({"docs_per_s": n as f64 / secs, "seconds": secs, "chunks": chunks,
               "reused_chunks": reused}),
    );
    let changed: Vec<Document> = abstracts
        .iter()
        .enumerate()
        .map(|(i, d)| document(i, d, 4, " (revised)"))
        .collect();
    let (secs, chunks, reused) = upsert_all(&mut c, &changed, a.batch.min(256)).await?;
    report.insert(
        "reupsert_changed_text".into(),
        json!({"docs_per_s": n as f64 / secs, "seconds": secs, "chunks": chunks,
               "reused_chunks": reused}),
    );
    let before = count(&mut c, None).await?;
    let t = Instant::now();
    let r = c
        .delete_documents(DeleteDocumentsRequest {
            collection: C.into(),
            conditions: Some(bucket(9)),
            ..Default::default()
        })
        .await?
        .into_inner();
    let took = t.elapsed().as_secs_f64() * 1000.0;
    ensure!(count(&mut c, None).await?.0 == before.0 - u64::from(r.deleted));
    report.insert(
        "delete_by_filter_10pct".into(),
        json!({"docs": r.deleted, "ms": took}),
    );
    let f = |k: &str| report[k]["docs_per_s"].as_f64().unwrap_or(0.0);
    let by_ids = f("update_by_ids");
    report.insert(
        "speedup_update_over_reupsert".into(),
        json!({"unchanged_text": by_ids / f("reupsert_unchanged_text"),
               "changed_text": by_ids / f("reupsert_changed_text")}),
    );
    if let Some(python) = &a.engines {
        // Chunks of each document, for the engine's points.
        let mut per_doc = Vec::with_capacity(n);
        let ids: Vec<String> = (0..n).map(|i| format!("d{i:05}")).collect();
        for b in ids.chunks(256) {
            let r = c
                .get_documents(GetDocumentsRequest {
                    collection: C.into(),
                    ids: b.to_vec(),
                    ..Default::default()
                })
                .await?
                .into_inner();
            per_doc.extend(r.documents.iter().map(|d| d.chunks.len() as u32));
        }
        let engine = engines(python, &per_doc, &a)?;
        let g = |v: &Json, p: &str| v.pointer(p).and_then(Json::as_f64).unwrap_or(f64::NAN);
        let ours = Json::Object(report.clone());
        report.insert(
            "vs_qdrant_engine".into(),
            json!({
                "update_by_ids_docs_per_s": g(&ours, "/update_by_ids/docs_per_s")
                    / g(&engine, "/update_by_ids/docs_per_s"),
                "update_by_filter_p50": g(&ours, "/update_by_filter_10pct/per_call_ms/p50_ms")
                    / g(&engine, "/update_by_filter_10pct/per_call_ms/p50_ms"),
            }),
        );
        report.insert("qdrant_engine".into(), engine);
    }
    let text = serde_json::to_string_pretty(&Json::Object(report))?;
    match &a.out {
        Some(p) => std::fs::write(p, text)?,
        None => println!("{text}"),
    }
    Ok(())
}
