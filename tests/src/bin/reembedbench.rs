//! `reembedbench`: a live SciFact collection moved from all-MiniLM-L6-v2 to
//! nomic-embed-text-v1.5 (issue 69's re-embedding target). A fresh local cluster (3 shard
//! nodes, 3 shards, one coordinator, one model worker serving both models on the same 2
//! cores) ingests SciFact's judged documents plus `--limit-docs` others with MiniLM behind the
//! alias `scifact`, and `ragctl eval retrieval` scores it. Then 8 clients search (hybrid,
//! SciFact's test queries) and 2 write (new abstracts, re-upserts of loaded ones with new
//! metadata, deletes of their own new documents) through the alias without pause while
//! `Admin.Reembed` copies the collection into a nomic one, switches the alias and lets the
//! load run on. Reported: calls and failures per phase (none may fail), search latency
//! before / during the copy / after the switch, copy and switch times, every acknowledged
//! write checked in the new collection, and nDCG@10 of both collections over the same
//! documents afterwards.
//!
//! `cargo run --release -p ragcluster-tests --bin reembedbench -- --limit-docs 300`

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use clap::Parser;
use parking_lot::Mutex;
use ragcluster_proto::v1::admin_client::AdminClient;
use ragcluster_proto::v1::coordinator_client::CoordinatorClient;
use ragcluster_proto::v1::*;
use ragcluster_tests::{
    BeirDoc, Cluster, Options, datasets_dir, latency_summary, models_dir, ragctl_at, read_jsonl,
};
use serde_json::{Value as Json, json};
use tonic::transport::Channel;

#[derive(Parser)]
struct Args {
    /// Unjudged SciFact documents loaded beside the judged ones.
    #[arg(long, default_value_t = 300)]
    limit_docs: usize,
    #[arg(long, default_value_t = 8)]
    searchers: usize,
    #[arg(long, default_value_t = 2)]
    writers: usize,
    /// Seconds the load runs after the switch.
    #[arg(long, default_value_t = 20)]
    after_switch: u64,
    /// Copy batches in flight per shard.
    #[arg(long, default_value_t = 2)]
    parallel: u32,
    #[arg(long)]
    out: Option<PathBuf>,
}

const SRC: &str = "sf";
const ALIAS: &str = "scifact";
const NOMIC: &str = "nomic-embed-text-v1.5.f16";

/// The phase the load is in (its calls are counted per phase).
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
enum Phase {
    Before,
    Copy,
    Switched,
}

#[derive(Default)]
struct Tallies {
    calls: BTreeMap<(Phase, &'static str), u64>,
    failures: Vec<String>,
    search_ms: BTreeMap<Phase, Vec<f64>>,
    /// id -> text and rev as the last acknowledged write left it (None: deleted).
    acked: BTreeMap<String, Option<(String, String)>>,
}

struct Shared {
    phase: Mutex<Phase>,
    stop: AtomicBool,
    t: Mutex<Tallies>,
}

impl Shared {
    fn phase(&self) -> Phase {
        *self.phase.lock()
    }
    fn record(&self, phase: Phase, what: &'static str, r: std::result::Result<(), String>) {
        let mut t = self.t.lock();
        *t.calls.entry((phase, what)).or_default() += 1;
        if let Err(e) = r {
            t.failures.push(format!("{phase:?} {what}: {e}"));
        }
    }
}

fn doc(id: String, d: &BeirDoc, rev: usize) -> Document {
    Document {
        id,
        title: d.title.clone(),
        text: d.text.clone(),
        metadata: [("rev".to_owned(), rev.to_string())].into(),
        ..Default::default()
    }
}

async fn searcher(s: Arc<Shared>, addr: String, queries: Arc<Vec<String>>, k: usize) -> Result<()> {
    let mut c = ragcluster_tests::coordinator_client(&addr).await?;
    let mut i = k;
    while !s.stop.load(Ordering::Relaxed) {
        let phase = s.phase();
        let t = Instant::now();
        let r = c
            .search(SearchRequest {
                collection: ALIAS.into(),
                query: queries[i % queries.len()].clone(),
                top_k: 10,
                mode: SearchMode::Hybrid as i32,
                ..Default::default()
            })
            .await;
        let ms = t.elapsed().as_secs_f64() * 1e3;
        if r.is_ok() {
            s.t.lock().search_ms.entry(phase).or_default().push(ms);
        }
        s.record(phase, "search", r.map(|_| ()).map_err(|e| e.to_string()));
        i += 7;
    }
    Ok(())
}

/// New abstracts (`w{k}-{n}`), re-upserts of loaded ones with a new `rev`, deletes of its
/// own new documents, in turn.
async fn writer(
    s: Arc<Shared>,
    addr: String,
    loaded: Arc<Vec<BeirDoc>>,
    spare: Arc<Vec<BeirDoc>>,
    k: usize,
) -> Result<()> {
    let mut c = ragcluster_tests::coordinator_client(&addr).await?;
    let mut n = 0usize;
    let mut mine: Vec<String> = Vec::new();
    while !s.stop.load(Ordering::Relaxed) {
        n += 1;
        let phase = s.phase();
        let (what, id, want, r) = match n % 3 {
            0 if !mine.is_empty() => {
                let id = mine.remove(0);
                let r = c
                    .delete_documents(DeleteDocumentsRequest {
                        collection: ALIAS.into(),
                        ids: vec![id.clone()],
                        ..Default::default()
                    })
                    .await
                    .map(|_| ());
                ("delete", id, None, r)
            }
            1 => {
                let d = &loaded[(n * 31 + k * 17) % loaded.len()];
                let d = doc(d.id.clone(), d, n);
                let want = Some((d.text.clone(), n.to_string()));
                let id = d.id.clone();
                let r = upsert(&mut c, d).await;
                ("reupsert", id, want, r)
            }
            _ => {
                let d = &spare[(n + k * 1000) % spare.len()];
                let id = format!("w{k}-{n}");
                let d = doc(id.clone(), d, n);
                let want = Some((d.text.clone(), n.to_string()));
                let r = upsert(&mut c, d).await;
                if r.is_ok() {
                    mine.push(id.clone());
                }
                ("upsert", id, want, r)
            }
        };
        if r.is_ok() {
            s.t.lock().acked.insert(id, want);
        }
        s.record(phase, what, r.map_err(|e| e.to_string()));
    }
    Ok(())
}

async fn upsert(
    c: &mut CoordinatorClient<Channel>,
    d: Document,
) -> std::result::Result<(), tonic::Status> {
    c.upsert_documents(UpsertDocumentsRequest {
        collection: ALIAS.into(),
        documents: vec![d],
        ..Default::default()
    })
    .await
    .map(|_| ())
}

/// One Reembed step run to its end: the last progress message and the seconds it took.
async fn step(
    a: &mut AdminClient<Channel>,
    action: ReembedAction,
    parallel: u32,
) -> Result<(ReembedProgress, f64)> {
    let t = Instant::now();
    let mut st = a
        .reembed(ReembedRequest {
            collection: ALIAS.into(),
            action: action as i32,
            embedding_model: NOMIC.into(),
            parallel,
            ..Default::default()
        })
        .await?
        .into_inner();
    let mut last = None;
    while let Some(p) = st.message().await? {
        if !p.done {
            eprintln!(
                "[{:6.1} s] {}: {}/{} documents, {} chunks embedded, {} reused",
                t.elapsed().as_secs_f64(),
                p.phase,
                p.documents_copied,
                p.documents_total,
                p.chunks_embedded,
                p.chunks_reused
            );
        }
        last = Some(p);
    }
    Ok((last.context("no progress")?, t.elapsed().as_secs_f64()))
}

fn progress_json(p: &ReembedProgress, secs: f64) -> Json {
    json!({"seconds": secs, "documents": p.documents_copied, "documents_total": p.documents_total,
           "chunks_embedded": p.chunks_embedded, "chunks_reused": p.chunks_reused,
           "documents_newer_in_target": p.documents_newer,
           "documents_deleted": p.documents_deleted,
           "chunks_embedded_per_s": p.chunks_embedded as f64 / secs})
}

/// `ragctl eval retrieval` on `collection`: nDCG@10 per configuration.
fn ndcg(
    addr: &str,
    collection: &str,
    dir: &std::path::Path,
    ingest: Option<usize>,
) -> Result<Json> {
    let dataset = datasets_dir().join("scifact");
    let out = dir.join(collection);
    let limit = ingest.map(|n| n.to_string());
    let mut args = vec![
        "eval",
        "retrieval",
        "--collection",
        collection,
        "--dataset",
        dataset.to_str().context("path")?,
        "--configs",
        "bm25,dense,hybrid-dbsf",
        "--out",
        out.to_str().context("path")?,
    ];
    if let Some(l) = &limit {
        args.extend(["--ingest", "--limit-docs", l]);
    }
    ragctl_at(addr, &args)?;
    let s: Json = serde_json::from_str(&std::fs::read_to_string(out.join("summary.json"))?)?;
    let mut m = serde_json::Map::new();
    for (config, v) in s["configurations"].as_object().context("configurations")? {
        m.insert(config.clone(), v["metrics"]["ndcg@10"].clone());
    }
    Ok(Json::Object(m))
}

/// Every acknowledged write as the new collection holds it: mismatches (at most 10 named).
async fn check_acked(
    c: &mut CoordinatorClient<Channel>,
    collection: &str,
    acked: &BTreeMap<String, Option<(String, String)>>,
) -> Result<(usize, Vec<String>)> {
    let mut bad = Vec::new();
    let ids: Vec<&String> = acked.keys().collect();
    for b in ids.chunks(200) {
        let r = c
            .get_documents(GetDocumentsRequest {
                collection: collection.into(),
                ids: b.iter().map(|s| (*s).clone()).collect(),
                with_embedding: true,
                consistency: Consistency::Strong as i32,
                ..Default::default()
            })
            .await?
            .into_inner();
        let held: BTreeMap<String, &StoredDocument> =
            r.documents.iter().map(|d| (d.id.clone(), d)).collect();
        for id in b {
            let ok = match (&acked[*id], held.get(*id)) {
                (None, None) => true,
                (Some((text, rev)), Some(d)) => {
                    let t: String = d.chunks.iter().map(|c| c.text.as_str()).collect();
                    d.metadata.get("rev") == Some(rev)
                        && squash(&t) == squash(text)
                        && d.chunks.iter().all(|c| c.embedding.len() == 768)
                }
                _ => false,
            };
            if !ok {
                bad.push((*id).clone());
            }
        }
    }
    Ok((acked.len(), bad))
}

/// Text without whitespace (chunks are cut at sentence boundaries).
fn squash(s: &str) -> String {
    s.split_whitespace().collect()
}

#[tokio::main(flavor = "multi_thread", worker_threads = 4)]
async fn main() -> Result<()> {
    let a = Args::parse();
    let gguf = models_dir().join(format!("{NOMIC}.gguf"));
    ensure!(
        gguf.exists(),
        "{} missing: scripts/fetch-models.sh nomic",
        gguf.display()
    );
    let path = gguf.display().to_string();
    let cluster = Cluster::start_opts(Options {
        shard_nodes: 3,
        model_worker_args: &["--embed-model", &path],
        ..Default::default()
    })?;
    let addr = cluster.coordinator.grpc.clone();
    let mut c = cluster.client().await?;
    let mut admin = cluster.admin().await?;
    let work = tempfile::tempdir()?;
    // The MiniLM collection, scored quiet.
    let t = Instant::now();
    let before = ndcg(&addr, SRC, work.path(), Some(a.limit_docs))?;
    let ingest_s = t.elapsed().as_secs_f64();
    c.update_aliases(UpdateAliasesRequest {
        actions: vec![AliasAction {
            action: Some(alias_action::Action::Put(Alias {
                alias: ALIAS.into(),
                collection: SRC.into(),
            })),
        }],
    })
    .await?;
    let dataset = datasets_dir().join("scifact");
    let corpus: Vec<BeirDoc> = read_jsonl(&dataset.join("corpus.jsonl"), usize::MAX)?;
    let stored: std::collections::HashSet<String> = {
        let n = c
            .count(CountRequest {
                collection: ALIAS.into(),
                ..Default::default()
            })
            .await?
            .into_inner()
            .documents;
        eprintln!("{n} documents loaded");
        let mut ids = std::collections::HashSet::new();
        for b in corpus.chunks(200) {
            let r = c
                .get_documents(GetDocumentsRequest {
                    collection: ALIAS.into(),
                    ids: b.iter().map(|d| d.id.clone()).collect(),
                    ..Default::default()
                })
                .await?
                .into_inner();
            ids.extend(r.documents.into_iter().map(|d| d.id));
        }
        ids
    };
    let (loaded, spare): (Vec<BeirDoc>, Vec<BeirDoc>) =
        corpus.into_iter().partition(|d| stored.contains(&d.id));
    let queries: Vec<String> =
        read_jsonl::<ragcluster_tests::BeirQuery>(&dataset.join("queries.jsonl"), usize::MAX)?
            .into_iter()
            .map(|q| q.text)
            .collect();
    let s = Arc::new(Shared {
        phase: Mutex::new(Phase::Before),
        stop: AtomicBool::new(false),
        t: Mutex::new(Tallies::default()),
    });
    let (loaded, spare, queries) = (Arc::new(loaded), Arc::new(spare), Arc::new(queries));
    let mut tasks = Vec::new();
    for k in 0..a.searchers {
        tasks.push(tokio::spawn(searcher(
            s.clone(),
            addr.clone(),
            queries.clone(),
            k,
        )));
    }
    for k in 0..a.writers {
        let (l, sp) = (loaded.clone(), spare.clone());
        tasks.push(tokio::spawn(writer(s.clone(), addr.clone(), l, sp, k)));
    }
    tokio::time::sleep(Duration::from_secs(10)).await;
    *s.phase.lock() = Phase::Copy;
    let (copy, copy_s) = step(&mut admin, ReembedAction::Start, a.parallel).await?;
    let target = copy.target.clone();
    let (switch, switch_s) = step(&mut admin, ReembedAction::Switch, a.parallel).await?;
    *s.phase.lock() = Phase::Switched;
    tokio::time::sleep(Duration::from_secs(a.after_switch)).await;
    s.stop.store(true, Ordering::Relaxed);
    for t in tasks {
        t.await??;
    }
    let t = std::mem::take(&mut *s.t.lock());
    let (acked, bad) = check_acked(&mut c, &target, &t.acked).await?;
    // Both collections now hold the same documents: score both.
    let after_minilm = ndcg(&addr, SRC, work.path(), None)?;
    let after_nomic = ndcg(&addr, &target, work.path(), None)?;
    let calls: BTreeMap<String, u64> = t
        .calls
        .iter()
        .map(|((p, w), n)| (format!("{p:?}/{w}"), *n))
        .collect();
    let latency: BTreeMap<String, Json> = t
        .search_ms
        .into_iter()
        .map(|(p, v)| (format!("{p:?}"), latency_summary(v)))
        .collect();
    let report = json!({
        "what": "issue 69: re-embedding a live SciFact collection from all-MiniLM-L6-v2 to nomic-embed-text-v1.5 (Admin.Reembed: copy, alias switch) while clients search and write through the alias",
        "setup": {"shard_nodes": 3, "shards": 3, "searchers": a.searchers, "writers": a.writers,
                  "unjudged_documents": a.limit_docs, "copy_parallel_per_shard": a.parallel,
                  "ingest_and_eval_seconds": ingest_s},
        "copy": progress_json(&copy, copy_s),
        "switch_including_sync": progress_json(&switch, switch_s),
        "calls": calls,
        "failed_calls": t.failures.len(),
        "failures": t.failures.iter().take(10).collect::<Vec<_>>(),
        "search_latency_ms": latency,
        "acknowledged_writes_checked": acked,
        "acknowledged_writes_missing_or_stale_in_new_collection": bad,
        "ndcg@10": {"minilm_before_quiet": before, "minilm_after": after_minilm,
                     "nomic_after": after_nomic},
    });
    let text = serde_json::to_string_pretty(&report)?;
    println!("{text}");
    if let Some(out) = &a.out {
        if let Some(dir) = out.parent() {
            std::fs::create_dir_all(dir)?;
        }
        std::fs::write(out, &text)?;
    }
    ensure!(t.failures.is_empty(), "{} calls failed", t.failures.len());
    ensure!(
        bad.is_empty(),
        "acknowledged writes not in the new collection: {bad:?}"
    );
    Ok(())
}
