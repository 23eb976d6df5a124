//! `ragctl optimize`: AutoRAG's greedy node-by-node pipeline search (seed §3.1) over flows.
//!
//! The search space (YAML) lists nodes in pipeline order (query expansion, retrieval,
//! passage augmentation, reranking, prompt maker, generator), each with candidate modules
//! (flow operators) and parameter grids. For each node in turn, every candidate (module ×
//! grid point) is tried with the earlier nodes fixed to their winners, and the best by the
//! node's strategy (a metric or a weighted mean of metrics, optionally under a latency
//! limit) wins: m + n trials instead of m × n.
//!
//! A node is judged by retrieval metrics (on a BEIR dataset, or on the QA file's gold
//! documents) or by answer metrics (on the QA file), whichever its strategy names. A node
//! that cannot be judged alone is judged through the node that follows it, as the seed does:
//! a query expansion through the first retrieval candidate after it, a prompt maker through
//! the first generator candidate after it. Every trial is an inline flow run through `Ask`.
//! Trials are cached in `trials.jsonl` by flow text, so an interrupted run resumes where it
//! stopped; the judged questions are a seeded sample, so a run is reproducible. Output:
//! `best-flow.toml` (ready for `coordinator.flows_file`), the trial table, `summary.json`
//! and `report.html`.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;

use anyhow::{Context, Result, bail, ensure};
use comfy_table::{Table, presets::UTF8_FULL_CONDENSED};
use futures::StreamExt;
use ragcluster_common::client::KeyedChannel;
use ragcluster_proto::v1::coordinator_client::CoordinatorClient;
use ragcluster_proto::v1::model_worker_client::ModelWorkerClient;
use ragctl::eval::answers::QaItem;
use ragctl::eval::beir::{self, BeirQuery};
use ragctl::eval::metrics::{self, Rels};
use serde::Deserialize;
use serde_json::json;

use crate::cmd::eval::{ANSWER_METRICS, FlowRef, percentile, rank, score_answer};

#[derive(clap::Args)]
pub struct OptimizeArgs {
    #[arg(long, default_value = "docs")]
    collection: String,
    /// BEIR directory with the (already ingested) corpus's queries and qrels: judges nodes
    /// with retrieval metrics.
    #[arg(long)]
    dataset: Option<PathBuf>,
    #[arg(long, default_value = "test")]
    split: String,
    /// QA file (JSON lines, as for `ragctl eval answers`): judges nodes with answer metrics,
    /// and retrieval nodes too (by its gold_doc_ids) when no --dataset is given.
    #[arg(long)]
    qa: Option<PathBuf>,
    /// The search space (YAML): strategy and nodes, see docs/eval/space-*.yaml.
    #[arg(long)]
    space: PathBuf,
    /// Only the first N judged queries (e.g. those whose documents were ingested with
    /// `ragctl eval retrieval --ingest --limit-queries N`).
    #[arg(long)]
    limit_queries: Option<usize>,
    /// Queries sampled (seeded) from the judged ones; 0 = all.
    #[arg(long, default_value_t = 0)]
    queries: usize,
    #[arg(long, default_value_t = 42)]
    seed: u64,
    #[arg(long, default_value_t = 4)]
    concurrency: usize,
    /// Model worker for answer metrics (SemScore, the judge); default: the local cluster's.
    #[arg(long)]
    pub model_worker: Option<String>,
    #[arg(long, default_value = "optimize-out")]
    out: PathBuf,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Space {
    /// The default strategy of every node.
    strategy: Strategy,
    nodes: Vec<Node>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct Strategy {
    /// Metric name -> weight (the weighted mean is maximised).
    metrics: BTreeMap<String, f64>,
    /// Candidates slower than this (p50 ms per query) are not chosen.
    #[serde(default)]
    latency_ms_max: Option<f64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Node {
    node: String,
    /// This node's own strategy (e.g. answer metrics for a generator node).
    #[serde(default)]
    strategy: Option<Strategy>,
    /// Each module: `op` plus parameters; a list value is a grid to try.
    modules: Vec<BTreeMap<String, serde_yaml::Value>>,
}

/// One flow step as TOML inline-table text, with its operator.
#[derive(Debug, Clone, PartialEq)]
struct Step {
    op: String,
    text: String,
}

impl Step {
    fn new(op: &str, text: &str) -> Step {
        Step {
            op: op.into(),
            text: text.into(),
        }
    }
    /// Puts chunks into the context (a retriever, or active retrieval which retrieves itself).
    fn retrieves(&self) -> bool {
        matches!(self.op.as_str(), "bm25" | "dense" | "hybrid" | "active")
    }
    fn generates(&self) -> bool {
        matches!(self.op.as_str(), "generate" | "active")
    }
}

/// A one-line TOML basic string (a trial's flow is one line of `trials.jsonl` and the table).
fn quoted(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\t' => out.push_str("\\t"),
            '\r' => out.push_str("\\r"),
            c if c.is_control() => out.push_str(&format!("\\u{:04X}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// Every grid point of a module (`None` = `noop`, the node left out).
fn expand(module: &BTreeMap<String, serde_yaml::Value>) -> Result<Vec<Option<Step>>> {
    let op = module
        .get("op")
        .and_then(|v| v.as_str())
        .context("every module needs an op")?
        .to_owned();
    let mut points: Vec<Vec<(String, String)>> = vec![vec![("op".into(), quoted(&op))]];
    for (k, v) in module.iter().filter(|(k, _)| k.as_str() != "op") {
        let values = match v {
            serde_yaml::Value::Sequence(s) => s.clone(),
            other => vec![other.clone()],
        };
        let mut next = Vec::new();
        for p in &points {
            for v in &values {
                let text = match v {
                    serde_yaml::Value::String(s) => quoted(s),
                    serde_yaml::Value::Number(n) => n.to_string(),
                    serde_yaml::Value::Bool(b) => b.to_string(),
                    other => bail!("{op}.{k}: unsupported value {other:?}"),
                };
                let mut q = p.clone();
                q.push((k.clone(), text));
                next.push(q);
            }
        }
        points = next;
    }
    Ok(points
        .into_iter()
        .map(|p| {
            (op != "noop").then(|| {
                let body: Vec<String> = p.iter().map(|(k, v)| format!("{k} = {v}")).collect();
                Step::new(&op, &format!("{{ {} }}", body.join(", ")))
            })
        })
        .collect())
}

/// What a node's strategy measures.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Judge {
    Retrieval,
    Answers,
}

impl Judge {
    fn name(self) -> &'static str {
        match self {
            Judge::Retrieval => "retrieval",
            Judge::Answers => "answers",
        }
    }
}

fn judge_of(node: &str, s: &Strategy) -> Result<Judge> {
    ensure!(
        !s.metrics.is_empty(),
        "node {node}: strategy.metrics is empty"
    );
    let retrieval: Vec<String> = metrics::all(&[], &Rels::new(), 10)
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    let answers = s
        .metrics
        .keys()
        .filter(|m| ANSWER_METRICS.contains(&m.as_str()));
    let n_answers = answers.count();
    for m in s.metrics.keys() {
        ensure!(
            retrieval.contains(m) || ANSWER_METRICS.contains(&m.as_str()),
            "node {node}: unknown metric {m:?} (retrieval: {retrieval:?}; answers: {ANSWER_METRICS:?})"
        );
    }
    match n_answers {
        0 => Ok(Judge::Retrieval),
        n if n == s.metrics.len() => Ok(Judge::Answers),
        _ => bail!("node {node}: a strategy weighs either retrieval or answer metrics, not both"),
    }
}

/// The steps of a trial, completed so that they can be judged: a retrieval when none is
/// there (the first retrieving candidate of a later node, else bm25), and for answer
/// metrics a generator (likewise, else the default) with a prompt before it.
fn complete(steps: &[Step], judge: Judge, later: &[Vec<Option<Step>>]) -> Vec<Step> {
    let first = |f: &dyn Fn(&Step) -> bool| -> Option<Step> {
        later.iter().flatten().flatten().find(|s| f(s)).cloned()
    };
    let mut out = steps.to_vec();
    if !out.iter().any(Step::retrieves) {
        out.push(
            first(&|s| s.retrieves() && s.op != "active")
                .unwrap_or_else(|| Step::new("bm25", "{ op = \"bm25\", top_k = 10 }")),
        );
    }
    if judge == Judge::Answers {
        if !out.iter().any(Step::generates) {
            out.push(
                first(&|s| s.op == "generate")
                    .unwrap_or_else(|| Step::new("generate", "{ op = \"generate\" }")),
            );
        }
        if let Some(g) = out.iter().position(|s| s.op == "generate")
            && !out[..g].iter().any(|s| s.op == "prompt")
        {
            let prompt = first(&|s| s.op == "prompt")
                .unwrap_or_else(|| Step::new("prompt", "{ op = \"prompt\" }"));
            out.insert(g, prompt);
        }
    }
    out
}

/// A seeded sample of `n` items (all when n is 0 or larger than the list).
fn sample<T: Clone>(v: &[T], n: usize, seed: u64) -> Vec<T> {
    if n == 0 || n >= v.len() {
        return v.to_vec();
    }
    // xorshift64*: deterministic without a dependency on rand's algorithms.
    let mut x = seed.max(1);
    let mut idx: Vec<usize> = (0..v.len()).collect();
    for i in (1..idx.len()).rev() {
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        let r = x.wrapping_mul(0x2545_F491_4F6C_DD1D) as usize % (i + 1);
        idx.swap(i, r);
    }
    idx.truncate(n);
    idx.sort_unstable();
    idx.into_iter().map(|i| v[i].clone()).collect()
}

/// One candidate's result.
struct Trial {
    node: String,
    judge: Judge,
    step: String,
    flow: String,
    metrics: BTreeMap<String, f64>,
    p50_ms: f64,
    score: f64,
    allowed: bool,
    cached: bool,
    won: bool,
}

fn flow_text(steps: &[Step]) -> String {
    let s: Vec<&str> = steps.iter().map(|s| s.text.as_str()).collect();
    format!("steps = [{}]", s.join(", "))
}

/// The questions a judge runs: (id, question) with qrels for retrieval, QA items for answers.
struct Judged {
    retrieval: Option<(Vec<BeirQuery>, HashMap<String, Rels>)>,
    answers: Option<Vec<QaItem>>,
}

fn load_judged(a: &OptimizeArgs) -> Result<Judged> {
    let qa: Option<Vec<QaItem>> =
        a.qa.as_ref()
            .map(|p| beir::read_jsonl(p, usize::MAX))
            .transpose()?;
    let retrieval = match (&a.dataset, &qa) {
        (Some(d), _) => {
            let j = beir::judged_queries(d, &a.split, a.limit_queries.unwrap_or(usize::MAX))?;
            Some((sample(&j.queries, a.queries, a.seed), j.qrels))
        }
        (None, Some(items)) => {
            let mut queries = Vec::new();
            let mut qrels = HashMap::new();
            for (i, it) in items
                .iter()
                .enumerate()
                .filter(|(_, it)| !it.gold_doc_ids.is_empty())
            {
                let id = format!("qa-{i}");
                queries.push(BeirQuery {
                    id: id.clone(),
                    text: it.question.clone(),
                });
                qrels.insert(id, it.gold_doc_ids.iter().map(|d| (d.clone(), 1)).collect());
            }
            Some((sample(&queries, a.queries, a.seed), qrels))
        }
        (None, None) => None,
    };
    Ok(Judged {
        retrieval,
        answers: qa.map(|items| sample(&items, a.queries, a.seed)),
    })
}

/// Mean metrics and p50 latency of one flow over the judged questions.
async fn run_trial(
    client: &CoordinatorClient<KeyedChannel>,
    mw: Option<&ModelWorkerClient<KeyedChannel>>,
    a: &OptimizeArgs,
    judged: &Judged,
    judge: Judge,
    with_llm_judge: bool,
    flow: &str,
) -> Result<(BTreeMap<String, f64>, f64)> {
    let mut sums: BTreeMap<String, (f64, usize)> = BTreeMap::new();
    let mut lat = Vec::new();
    match judge {
        Judge::Retrieval => {
            let (queries, qrels) = judged
                .retrieval
                .as_ref()
                .context("retrieval metrics need --dataset (or a --qa file with gold_doc_ids)")?;
            ensure!(!queries.is_empty(), "no judged queries");
            let config = format!("inline:{flow}");
            let results: Vec<Result<(String, Vec<String>, f64)>> =
                futures::stream::iter(queries.iter())
                    .map(|q| {
                        let c = client.clone();
                        let config = config.clone();
                        async move {
                            let (docs, ms) = rank(c, &a.collection, &config, &q.text, 100).await?;
                            Ok((q.id.clone(), docs, ms))
                        }
                    })
                    .buffered(a.concurrency.max(1))
                    .collect()
                    .await;
            for r in results {
                let (qid, docs, ms) = r?;
                lat.push(ms);
                for (n, v) in metrics::all(&docs, &qrels[&qid], 10) {
                    let e = sums.entry(n).or_default();
                    e.0 += v;
                    e.1 += 1;
                }
            }
        }
        Judge::Answers => {
            let items = judged
                .answers
                .as_ref()
                .context("answer metrics need --qa")?;
            ensure!(!items.is_empty(), "the QA file has no questions");
            let mw = mw.context("answer metrics need a model worker (--model-worker)")?;
            let results: Vec<Result<(serde_json::Value, f64)>> = futures::stream::iter(items)
                .map(|item| {
                    score_answer(
                        client.clone(),
                        mw.clone(),
                        &a.collection,
                        FlowRef::Inline(flow),
                        item,
                        with_llm_judge,
                    )
                })
                .buffered(a.concurrency.max(1))
                .collect()
                .await;
            for r in results {
                let (row, ms) = r?;
                lat.push(ms);
                for k in ANSWER_METRICS {
                    if let Some(v) = row[k].as_f64() {
                        let e = sums.entry(k.to_string()).or_default();
                        e.0 += v;
                        e.1 += 1;
                    }
                }
            }
        }
    }
    let means = sums
        .into_iter()
        .map(|(k, (v, n))| (k, v / n as f64))
        .collect();
    Ok((means, percentile(&mut lat, 50.0)))
}

fn score(node: &str, s: &Strategy, means: &BTreeMap<String, f64>) -> Result<f64> {
    let total: f64 = s.metrics.values().sum();
    let mut score = 0.0;
    for (m, w) in &s.metrics {
        let v = means.get(m).with_context(|| {
            format!(
                "node {node}: strategy metric {m:?} was not measured (measured: {:?}; key_fact \
                 and final_score need key_facts, citation_precision gold ids)",
                means.keys().collect::<Vec<_>>()
            )
        })?;
        score += w * v / total;
    }
    Ok(score)
}

pub async fn optimize(
    client: CoordinatorClient<KeyedChannel>,
    model_worker: Option<String>,
    a: &OptimizeArgs,
) -> Result<()> {
    let space: Space = serde_yaml::from_str(
        &std::fs::read_to_string(&a.space).with_context(|| a.space.display().to_string())?,
    )
    .with_context(|| format!("{}: not a valid search space", a.space.display()))?;
    let mut plan = Vec::new();
    for node in &space.nodes {
        let strategy = node.strategy.clone().unwrap_or(space.strategy.clone());
        let judge = judge_of(&node.node, &strategy)?;
        let mut candidates = Vec::new();
        for m in &node.modules {
            candidates.extend(expand(m).with_context(|| format!("node {}", node.node))?);
        }
        ensure!(!candidates.is_empty(), "node {}: no modules", node.node);
        if judge == Judge::Retrieval
            && let Some(s) = candidates
                .iter()
                .flatten()
                .find(|s| s.generates() || s.op == "prompt")
        {
            bail!(
                "node {}: candidate {} writes answers; give the node an answer-metric strategy \
                 (e.g. strategy: {{ metrics: {{ sem_score: 1.0 }} }})",
                node.node,
                s.text
            );
        }
        plan.push((node, strategy, judge, candidates));
    }
    let judged = load_judged(a)?;
    let needs = |j: Judge| plan.iter().any(|p| p.2 == j);
    if needs(Judge::Retrieval) && judged.retrieval.is_none() {
        bail!(
            "nodes judged by retrieval metrics need --dataset (or a --qa file with gold_doc_ids)"
        );
    }
    if needs(Judge::Answers) && judged.answers.is_none() {
        bail!("nodes judged by answer metrics need --qa");
    }
    let mw = if needs(Judge::Answers) {
        Some(crate::cmd::eval::model_worker(model_worker).await?)
    } else {
        None
    };
    std::fs::create_dir_all(&a.out)?;
    let cache_path = a.out.join("trials.jsonl");
    // Cached trials count only for the same questions: data files, sample size and seed.
    let data = format!(
        "{}:{} {}",
        a.dataset
            .as_ref()
            .map_or(String::new(), |d| d.display().to_string()),
        a.split,
        a.qa.as_ref()
            .map_or(String::new(), |d| d.display().to_string())
    );
    let key = |judge: Judge, flow: &str| format!("{}\t{flow}", judge.name());
    let mut cache: HashMap<String, serde_json::Value> = std::fs::read_to_string(&cache_path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["sample"] == a.queries && v["seed"] == a.seed && v["data"] == data)
        .filter_map(|v| {
            let judge = if v["judge"] == "answers" {
                Judge::Answers
            } else {
                Judge::Retrieval
            };
            Some((key(judge, v["flow"].as_str()?), v))
        })
        .collect();
    let mut fixed: Vec<Step> = Vec::new();
    let mut trials: Vec<Trial> = Vec::new();
    let mut last_judge = Judge::Retrieval;
    for (i, (node, strategy, judge, candidates)) in plan.iter().enumerate() {
        let later: Vec<Vec<Option<Step>>> = plan[i + 1..].iter().map(|p| p.3.clone()).collect();
        let with_llm_judge = strategy.metrics.contains_key("judge");
        let first_trial = trials.len();
        for step in candidates {
            let mut steps = fixed.clone();
            steps.extend(step.clone());
            let flow = flow_text(&complete(&steps, *judge, &later));
            let (means, p50, cached) = match cache.get(&key(*judge, &flow)) {
                Some(v) => (
                    serde_json::from_value::<BTreeMap<String, f64>>(v["metrics"].clone())?,
                    v["p50_ms"].as_f64().unwrap_or(0.0),
                    true,
                ),
                None => {
                    let (means, p50) = run_trial(
                        &client,
                        mw.as_ref(),
                        a,
                        &judged,
                        *judge,
                        with_llm_judge,
                        &flow,
                    )
                    .await
                    .with_context(|| format!("node {}: trial {flow}", node.node))?;
                    let line = json!({"node": node.node, "judge": judge.name(), "flow": flow,
                                      "metrics": means, "p50_ms": p50, "sample": a.queries,
                                      "seed": a.seed, "data": data});
                    let mut f = std::fs::OpenOptions::new()
                        .create(true)
                        .append(true)
                        .open(&cache_path)?;
                    std::io::Write::write_all(&mut f, format!("{line}\n").as_bytes())?;
                    cache.insert(key(*judge, &flow), line);
                    (means, p50, false)
                }
            };
            let score = score(&node.node, strategy, &means)?;
            let allowed = strategy.latency_ms_max.is_none_or(|max| p50 <= max);
            eprintln!(
                "{:<18} {score:.4} {p50:>8.1} ms {}{flow}",
                node.node,
                if cached { "(cached) " } else { "" }
            );
            trials.push(Trial {
                node: node.node.clone(),
                judge: *judge,
                step: step.as_ref().map_or("(none)".into(), |s| s.text.clone()),
                flow,
                metrics: means,
                p50_ms: p50,
                score,
                allowed,
                cached,
                won: false,
            });
        }
        // The first best among allowed candidates wins (ties keep the earlier, simpler one).
        let mut best: Option<usize> = None;
        for (j, t) in trials.iter().enumerate().skip(first_trial) {
            if t.allowed && best.is_none_or(|b| t.score > trials[b].score) {
                best = Some(j);
            }
        }
        let best = best.with_context(|| {
            format!("node {}: no candidate within the latency limit", node.node)
        })?;
        trials[best].won = true;
        fixed.extend(candidates[best - first_trial].clone());
        last_judge = *judge;
    }
    let winner = complete(&fixed, last_judge, &[]);
    let best_flow = format!(
        "# Written by `ragctl optimize` (space {}, {} questions sampled with seed {}).\ndefault = \"optimized\"\n\n[flows.optimized]\ndescription = \"greedy node-wise optimum\"\n{}\n",
        a.space.display(),
        if a.queries == 0 {
            "all".to_string()
        } else {
            a.queries.to_string()
        },
        a.seed,
        flow_text(&winner)
    );
    std::fs::write(a.out.join("best-flow.toml"), &best_flow)?;
    let mut t = Table::new();
    t.load_preset(UTF8_FULL_CONDENSED);
    t.set_header([
        "node",
        "candidate",
        "score",
        "metrics",
        "p50 ms",
        "",
        "cached",
    ]);
    let shown = |tr: &Trial| -> String {
        let strategy = plan
            .iter()
            .find(|p| p.0.node == tr.node)
            .map(|p| &p.1.metrics);
        tr.metrics
            .iter()
            .filter(|(k, _)| strategy.is_some_and(|m| m.contains_key(*k)) || *k == "ndcg@10")
            .map(|(k, v)| format!("{k} {v:.4}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    for tr in &trials {
        t.add_row(vec![
            tr.node.clone(),
            tr.step.clone(),
            format!("{:.4}", tr.score),
            shown(tr),
            format!("{:.1}", tr.p50_ms),
            if tr.won {
                "winner".into()
            } else if !tr.allowed {
                "too slow".into()
            } else {
                String::new()
            },
            if tr.cached {
                "yes".into()
            } else {
                String::new()
            },
        ]);
    }
    let summary = json!({
        "space": a.space.display().to_string(), "collection": a.collection, "seed": a.seed,
        "sample": a.queries, "winner": flow_text(&winner),
        "trials": trials.iter().map(|t| json!({"node": t.node, "judge": t.judge.name(),
            "candidate": t.step, "flow": t.flow, "metrics": t.metrics, "p50_ms": t.p50_ms,
            "score": t.score, "within_latency_limit": t.allowed, "winner": t.won})).collect::<Vec<_>>(),
    });
    std::fs::write(
        a.out.join("summary.json"),
        serde_json::to_string_pretty(&summary)?,
    )?;
    let rows: Vec<crate::cmd::report::TrialRow> = trials
        .iter()
        .map(|t| crate::cmd::report::TrialRow {
            node: t.node.clone(),
            candidate: t.step.clone(),
            metrics: shown(t),
            score: t.score,
            p50_ms: t.p50_ms,
            allowed: t.allowed,
            won: t.won,
        })
        .collect();
    std::fs::write(
        a.out.join("report.html"),
        crate::cmd::report::optimizer_html(
            &format!("ragctl optimize: {}", a.space.display()),
            &flow_text(&winner),
            &rows,
        )?,
    )?;
    println!("{t}");
    println!(
        "winner: {}\nwritten to {} (summary.json, report.html, trials.jsonl beside it)",
        flow_text(&winner),
        a.out.join("best-flow.toml").display()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn module(yaml: &str) -> BTreeMap<String, serde_yaml::Value> {
        serde_yaml::from_str(yaml).unwrap()
    }

    #[test]
    fn grids_expand_to_inline_steps() {
        let e = expand(&module("{ op: hybrid, fusion: [rrf, dbsf], top_k: 10 }")).unwrap();
        assert_eq!(
            e,
            vec![
                Some(Step::new(
                    "hybrid",
                    "{ op = \"hybrid\", fusion = \"rrf\", top_k = 10 }"
                )),
                Some(Step::new(
                    "hybrid",
                    "{ op = \"hybrid\", fusion = \"dbsf\", top_k = 10 }"
                )),
            ]
        );
        assert_eq!(expand(&module("{ op: noop }")).unwrap(), vec![None]);
        assert_eq!(
            sample(&[1, 2, 3, 4, 5], 2, 7),
            sample(&[1, 2, 3, 4, 5], 2, 7)
        );
        assert_eq!(sample(&[1, 2, 3], 0, 7), vec![1, 2, 3]);
    }

    #[test]
    fn strings_quote_as_one_line_toml() {
        let s = "a \"b\" \\ {contexts}\n\tend\u{1}";
        let q = quoted(s);
        assert!(!q.contains('\n'));
        let v: toml::Table = toml::from_str(&format!("x = {q}")).unwrap();
        assert_eq!(v["x"].as_str(), Some(s));
    }

    fn ops(steps: &[Step]) -> Vec<&str> {
        steps.iter().map(|s| s.op.as_str()).collect()
    }

    /// Nodes that cannot be judged alone are judged through the node after them.
    #[test]
    fn trials_are_completed_through_the_next_node() {
        let later = vec![
            vec![Some(Step::new("dense", "{ op = \"dense\" }"))],
            vec![None, Some(Step::new("rerank", "{ op = \"rerank\" }"))],
            vec![Some(Step::new(
                "prompt",
                "{ op = \"prompt\", system = \"x\" }",
            ))],
            vec![Some(Step::new(
                "generate",
                "{ op = \"generate\", max_tokens = 9 }",
            ))],
        ];
        // A query expansion: through the first retrieval candidate after it.
        let hyde = [Step::new("hyde", "{ op = \"hyde\" }")];
        assert_eq!(
            ops(&complete(&hyde, Judge::Retrieval, &later)),
            ["hyde", "dense"]
        );
        // No retrieval anywhere later: bm25.
        assert_eq!(
            ops(&complete(&hyde, Judge::Retrieval, &[])),
            ["hyde", "bm25"]
        );
        // A prompt maker: through the first generator candidate after it.
        let fixed = [
            Step::new("bm25", "{ op = \"bm25\" }"),
            Step::new("prompt", "{ op = \"prompt\" }"),
        ];
        let c = complete(&fixed, Judge::Answers, &later[3..]);
        assert_eq!(ops(&c), ["bm25", "prompt", "generate"]);
        assert!(c[2].text.contains("max_tokens = 9"));
        // A generator without a prompt maker before it gets the default prompt.
        let fixed = [
            Step::new("bm25", "{ op = \"bm25\" }"),
            Step::new("generate", "{ op = \"generate\" }"),
        ];
        assert_eq!(
            ops(&complete(&fixed, Judge::Answers, &[])),
            ["bm25", "prompt", "generate"]
        );
        // Active retrieval retrieves and generates by itself.
        let active = [Step::new("active", "{ op = \"active\" }")];
        assert_eq!(ops(&complete(&active, Judge::Answers, &later)), ["active"]);
    }

    #[test]
    fn strategies_weigh_one_kind_of_metric() {
        let s = |yaml: &str| -> Strategy { serde_yaml::from_str(yaml).unwrap() };
        assert_eq!(
            judge_of("r", &s("metrics: { \"ndcg@10\": 1, \"recall@10\": 1 }")).unwrap(),
            Judge::Retrieval
        );
        assert_eq!(
            judge_of("g", &s("metrics: { sem_score: 0.5, rouge_l: 0.5 }")).unwrap(),
            Judge::Answers
        );
        let mixed = judge_of("m", &s("metrics: { sem_score: 1, \"ndcg@10\": 1 }"));
        assert!(mixed.unwrap_err().to_string().contains("not both"));
        let unknown = judge_of("u", &s("metrics: { bleu: 1 }"));
        assert!(unknown.unwrap_err().to_string().contains("unknown metric"));
        let means: BTreeMap<String, f64> = [("a".to_string(), 0.5), ("b".to_string(), 1.0)].into();
        let st = s("metrics: { a: 3, b: 1 }");
        assert!((score("n", &st, &means).unwrap() - 0.625).abs() < 1e-12);
    }
}
