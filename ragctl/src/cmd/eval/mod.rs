//! `ragctl eval retrieval`: retrieval quality of search configurations or flows on a BEIR
//! dataset. Every judged query runs through each configuration; documents are ranked by
//! their best chunk; the metrics of `ragctl::eval::metrics` are averaged over queries.
//! Writes `per_query.jsonl`, `summary.json`, one TREC run file per configuration (for
//! trec_eval / pytrec_eval) and `report.html` (charts) into `--out`, and prints a table.
//! `ragctl eval answers` lives in `answers`.

mod answers;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use comfy_table::{Table, presets::UTF8_FULL_CONDENSED};
use futures::StreamExt;
use indicatif::{ProgressBar, ProgressStyle};
use ragcluster_common::client::KeyedChannel;
use ragcluster_proto::v1::coordinator_client::CoordinatorClient;
use ragcluster_proto::v1::*;
use ragctl::client::ask_result;
use ragctl::eval::beir::{self, BeirDoc};
use ragctl::eval::metrics;
use serde_json::json;

pub(crate) use answers::{ANSWER_METRICS, FlowRef, model_worker, score_answer};
pub use answers::{AnswersArgs, run as answers};

#[derive(clap::Subcommand)]
pub enum EvalCmd {
    /// Retrieval quality (nDCG@10, recall, MRR, MAP, context precision, latency) on a BEIR
    /// dataset, for search configurations or retrieval flows.
    Retrieval(RetrievalArgs),
    /// Answer quality of a flow on a QA file (JSON lines: question, answer, answers, yes_no,
    /// key_facts, gold_chunk_ids, gold_doc_ids): exact match, token F1 and ROUGE-L (short
    /// answers), yes/no accuracy, SemScore, key-fact and final score (UniversalRAG eq. 5-8),
    /// gold article retrieved / cited, citation precision, optional LLM judge (1-5); per
    /// generator model, end to end and with the oracle paragraph (--oracle).
    Answers(AnswersArgs),
}

#[derive(clap::Args)]
pub struct RetrievalArgs {
    /// Collection holding (or to be loaded with, --ingest) the corpus.
    #[arg(long, default_value = "docs")]
    collection: String,
    /// BEIR directory: corpus.jsonl, queries.jsonl, qrels/SPLIT.tsv.
    #[arg(long)]
    dataset: PathBuf,
    /// qrels split to judge with (qrels/SPLIT.tsv).
    #[arg(long, default_value = "test")]
    split: String,
    /// Create the collection (markdown-free sentence chunking) and load the corpus first.
    #[arg(long)]
    ingest: bool,
    /// Shards of the collection --ingest creates.
    #[arg(long, default_value_t = 3)]
    shards: u32,
    /// Embedding model of the collection --ingest creates (default: the worker's first).
    #[arg(long, default_value = "")]
    embedding_model: String,
    /// With --ingest: documents per upsert call. A slow embedder (nomic on two cores, ~3
    /// chunks/s) wants smaller calls or `--concurrency 1`: an upload fails after 120 s without
    /// any call acknowledged.
    #[arg(long, default_value_t = super::ingest::DEFAULT_BATCH)]
    batch: usize,
    /// With --ingest: load only the documents judged for the evaluated queries plus this many
    /// others (a smaller corpus; scores are then higher than on the full corpus).
    #[arg(long)]
    limit_docs: Option<usize>,
    /// Evaluate only the first N judged queries.
    #[arg(long)]
    limit_queries: Option<usize>,
    /// Search configurations: bm25, dense, hybrid-rrf, hybrid-cc, hybrid-dbsf.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "bm25,dense,hybrid-rrf,hybrid-cc,hybrid-dbsf"
    )]
    configs: Vec<String>,
    /// Flows to evaluate instead of (with --configs "") or besides the search configurations;
    /// a flow's final contexts are its ranking.
    #[arg(long, value_delimiter = ',')]
    flow: Vec<String>,
    /// Also evaluate the default flow of this flow file (e.g. `ragctl optimize`'s
    /// best-flow.toml), sent inline.
    #[arg(long)]
    flow_file: Option<PathBuf>,
    /// Documents ranked per query.
    #[arg(long, default_value_t = 100)]
    top_k: usize,
    /// K of context precision@K (the AutoRAG seed uses 10 for retrieval).
    #[arg(long, default_value_t = 10)]
    context_precision_k: usize,
    /// Queries in flight.
    #[arg(long, default_value_t = 4)]
    concurrency: usize,
    /// Directory for the report (JSON, HTML and TREC run files).
    #[arg(long, default_value = "eval-out")]
    out: PathBuf,
}

fn bar(n: usize, what: &str) -> Result<ProgressBar> {
    let b = ProgressBar::new(n as u64);
    b.set_style(ProgressStyle::with_template(&format!(
        "{{bar:40}} {{pos}}/{{len}} {what} [{{elapsed}}]"
    ))?);
    Ok(b)
}

async fn ingest(
    c: &CoordinatorClient<KeyedChannel>,
    a: &RetrievalArgs,
    judged: &HashSet<String>,
) -> Result<()> {
    let corpus: Vec<BeirDoc> = beir::read_jsonl(&a.dataset.join("corpus.jsonl"), usize::MAX)?;
    let mut extra = a.limit_docs.unwrap_or(usize::MAX);
    let docs: Vec<BeirDoc> = corpus
        .into_iter()
        .filter(|d| {
            if judged.contains(&d.id) {
                return true;
            }
            let keep = extra > 0;
            extra = extra.saturating_sub(1);
            keep
        })
        .collect();
    c.clone()
        .create_collection(CreateCollectionRequest {
            name: a.collection.clone(),
            shard_count: a.shards,
            chunking: Some(ChunkingConfig {
                strategy: ChunkingStrategy::Sentence as i32,
                ..Default::default()
            }),
            embedding_model: a.embedding_model.clone(),
            ..Default::default()
        })
        .await
        .with_context(|| format!("creating collection {}", a.collection))?;
    let b = bar(docs.len(), "documents")?;
    let docs = docs.into_iter().filter_map(|d| {
        super::ingest::corpus_document(d.id, d.title, d.text, HashMap::new()).map(Ok)
    });
    let t =
        super::ingest::upload(c, &a.collection, docs, a.batch.max(1), a.concurrency, &b).await?;
    b.finish();
    eprintln!(
        "ingested {} documents as {} chunks ({})",
        t.documents,
        t.chunks,
        t.split()
    );
    Ok(())
}

/// One configuration's ranking of a query: doc ids and the time it took.
pub(crate) async fn rank(
    mut c: CoordinatorClient<KeyedChannel>,
    collection: &str,
    config: &str,
    query: &str,
    top_k: usize,
) -> Result<(Vec<String>, f64)> {
    let t = Instant::now();
    // "flow:NAME" runs a named flow, "inline:TOML" an inline one.
    let named = config.strip_prefix("flow:");
    let inline = config.strip_prefix("inline:");
    if named.is_some() || inline.is_some() {
        let r = ask_result(
            &mut c,
            AskRequest {
                collection: collection.into(),
                question: query.into(),
                flow: named.unwrap_or_default().into(),
                inline_flow: inline.unwrap_or_default().into(),
                ..Default::default()
            },
        )
        .await?;
        let docs = metrics::doc_ranking(r.contexts.iter().map(|c| c.doc_id.as_str()));
        return Ok((docs, t.elapsed().as_secs_f64() * 1e3));
    }
    let (mode, fusion) = match config {
        "bm25" => (SearchMode::Bm25, ""),
        "dense" => (SearchMode::Dense, ""),
        "hybrid-rrf" => (SearchMode::Hybrid, "rrf"),
        "hybrid-cc" => (SearchMode::Hybrid, "cc"),
        "hybrid-dbsf" | "hybrid" => (SearchMode::Hybrid, "dbsf"),
        other => bail!(
            "unknown configuration {other:?} (bm25, dense, hybrid-rrf, hybrid-cc, hybrid-dbsf)"
        ),
    };
    // Several chunks of one document may rank high: ask for more chunks than documents.
    let r = c
        .search(SearchRequest {
            collection: collection.into(),
            query: query.into(),
            top_k: (top_k * 3).min(1000) as u32,
            mode: mode as i32,
            fusion: fusion.into(),
            ..Default::default()
        })
        .await?
        .into_inner();
    let mut docs = metrics::doc_ranking(r.hits.iter().map(|h| h.doc_id.as_str()));
    docs.truncate(top_k);
    Ok((docs, t.elapsed().as_secs_f64() * 1e3))
}

/// The default flow of a flow file as an inline flow (`steps = [...]`).
fn default_flow_of(p: &std::path::Path) -> Result<String> {
    let doc: toml::Table = std::fs::read_to_string(p)
        .with_context(|| p.display().to_string())?
        .parse()
        .with_context(|| format!("{}: not TOML", p.display()))?;
    let name = doc
        .get("default")
        .and_then(|d| d.as_str())
        .context("the flow file has no default flow")?;
    let flow = doc
        .get("flows")
        .and_then(|f| f.get(name))
        .and_then(|f| f.get("steps"))
        .with_context(|| format!("flow {name:?} has no steps"))?;
    let mut t = toml::Table::new();
    t.insert("steps".into(), flow.clone());
    Ok(toml::to_string(&t)?)
}

pub(crate) fn percentile(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let i = ((p / 100.0) * v.len() as f64).ceil() as usize;
    v[i.clamp(1, v.len()) - 1]
}

/// Every configuration `ragctl eval retrieval` runs: (label, what runs); an inline flow is
/// labelled by its file name.
fn configurations(a: &RetrievalArgs) -> Result<Vec<(String, String)>> {
    let mut configs: Vec<String> = a
        .configs
        .iter()
        .filter(|s| !s.is_empty())
        .cloned()
        .collect();
    configs.extend(a.flow.iter().map(|f| format!("flow:{f}")));
    let mut configs: Vec<(String, String)> = configs.into_iter().map(|c| (c.clone(), c)).collect();
    if let Some(p) = &a.flow_file {
        let stem = p
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default();
        configs.push((
            format!("inline:{stem}"),
            format!("inline:{}", default_flow_of(p)?),
        ));
    }
    Ok(configs)
}

/// One configuration's ranking of every query: (query id, doc ids, latency ms).
async fn run_config(
    client: &CoordinatorClient<KeyedChannel>,
    a: &RetrievalArgs,
    config: &str,
    spec: &str,
    queries: &[beir::BeirQuery],
) -> Result<Vec<(String, Vec<String>, f64)>> {
    let b = bar(queries.len(), config)?;
    let results: Vec<Result<(String, Vec<String>, f64)>> = futures::stream::iter(queries.iter())
        .map(|q| {
            let c = client.clone();
            let b = b.clone();
            async move {
                let (docs, ms) = rank(c, &a.collection, spec, &q.text, a.top_k).await?;
                b.inc(1);
                Ok((q.id.clone(), docs, ms))
            }
        })
        .buffered(a.concurrency.max(1))
        .collect()
        .await;
    b.finish_and_clear();
    results.into_iter().collect()
}

/// What one configuration's rankings add up to.
struct Scored {
    means: BTreeMap<String, f64>,
    values: BTreeMap<String, Vec<f64>>,
    p50: f64,
    p99: f64,
    /// One JSON line per query.
    per_query: String,
    /// The TREC run file.
    trec: String,
}

fn score(
    config: &str,
    results: Vec<(String, Vec<String>, f64)>,
    qrels: &HashMap<String, metrics::Rels>,
    k: usize,
) -> Scored {
    let n = results.len().max(1) as f64;
    let mut sums: BTreeMap<String, f64> = BTreeMap::new();
    let mut values: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    let mut lat = Vec::new();
    let (mut trec, mut per_query) = (String::new(), String::new());
    let tag = config.replace(':', "_");
    for (qid, docs, ms) in results {
        let m = metrics::all(&docs, &qrels[&qid], k);
        for (n, v) in &m {
            *sums.entry(n.clone()).or_default() += v;
            values.entry(n.clone()).or_default().push(*v);
        }
        lat.push(ms);
        let mut line = json!({"config": config, "query_id": qid, "latency_ms": ms,
                              "top10": docs.iter().take(10).collect::<Vec<_>>()});
        for (n, v) in m {
            line[n] = json!(v);
        }
        per_query.push_str(&line.to_string());
        per_query.push('\n');
        for (i, d) in docs.iter().enumerate() {
            // Strictly decreasing scores: trec_eval re-sorts by score.
            trec.push_str(&format!(
                "{qid} Q0 {d} {} {} {tag}\n",
                i + 1,
                docs.len() - i
            ));
        }
    }
    Scored {
        means: sums.into_iter().map(|(k, v)| (k, v / n)).collect(),
        values,
        p50: percentile(&mut lat, 50.0),
        p99: percentile(&mut lat, 99.0),
        per_query,
        trec,
    }
}

pub async fn retrieval(client: CoordinatorClient<KeyedChannel>, a: &RetrievalArgs) -> Result<()> {
    let mut judged =
        beir::judged_queries(&a.dataset, &a.split, a.limit_queries.unwrap_or(usize::MAX))?;
    if judged.queries.is_empty() {
        bail!(
            "no judged queries in {} ({} split)",
            a.dataset.display(),
            a.split
        );
    }
    if a.ingest {
        let ids: HashSet<String> = judged
            .queries
            .iter()
            .flat_map(|q| judged.qrels[&q.id].keys().cloned())
            .collect();
        ingest(&client, a, &ids).await?;
    }
    std::fs::create_dir_all(&a.out)?;
    let configs = configurations(a)?;
    let mut per_query = String::new();
    let mut summary = serde_json::Map::new();
    let mut table = Table::new();
    table.load_preset(UTF8_FULL_CONDENSED);
    let names: Vec<String> = metrics::all(&[], &Default::default(), a.context_precision_k)
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    let mut header = vec!["configuration".to_string()];
    header.extend(names.iter().cloned());
    header.extend(["p50 ms".into(), "p99 ms".into()]);
    table.set_header(header);
    let queries = std::mem::take(&mut judged.queries);
    let mut charts: Vec<crate::cmd::report::Config> = Vec::new();
    for (config, spec) in &configs {
        let results = run_config(&client, a, config, spec, &queries).await?;
        let s = score(config, results, &judged.qrels, a.context_precision_k);
        let mut row = vec![config.clone()];
        row.extend(
            names
                .iter()
                .map(|k| format!("{:.4}", s.means.get(k).copied().unwrap_or(0.0))),
        );
        row.extend([format!("{:.1}", s.p50), format!("{:.1}", s.p99)]);
        table.add_row(row);
        summary.insert(
            config.clone(),
            json!({"queries": queries.len(), "metrics": s.means, "latency_ms": {"p50": s.p50, "p99": s.p99}}),
        );
        std::fs::write(
            a.out.join(format!("{}.trec", config.replace(':', "_"))),
            &s.trec,
        )?;
        per_query.push_str(&s.per_query);
        charts.push(crate::cmd::report::Config {
            name: config.clone(),
            means: s.means,
            per_query: s.values,
            p50_ms: s.p50,
            p99_ms: s.p99,
        });
    }
    std::fs::write(a.out.join("per_query.jsonl"), per_query)?;
    let summary = json!({
        "dataset": a.dataset.display().to_string(),
        "split": a.split,
        "collection": a.collection,
        "top_k": a.top_k,
        "configurations": summary,
    });
    std::fs::write(
        a.out.join("summary.json"),
        serde_json::to_string_pretty(&summary)?,
    )?;
    let title = format!(
        "Retrieval evaluation: {} ({} split, {} queries), collection {}",
        a.dataset.display(),
        a.split,
        queries.len(),
        a.collection
    );
    std::fs::write(
        a.out.join("report.html"),
        crate::cmd::report::html(&title, &charts, &names, "ndcg@10")?,
    )?;
    println!("{table}");
    println!(
        "{} queries; per-query results, run files and summary.json in {}",
        queries.len(),
        a.out.display()
    );
    Ok(())
}
