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

mod output;
mod trials;

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;

use anyhow::{Context, Result, bail, ensure};
use ragcluster_common::client::KeyedChannel;
use ragcluster_proto::v1::coordinator_client::CoordinatorClient;
use ragcluster_proto::v1::model_worker_client::ModelWorkerClient;
use ragctl::eval::metrics::{self, Rels};
use serde::Deserialize;

use crate::cmd::eval::ANSWER_METRICS;

use trials::{Judged, Trial, TrialCache, flow_text, load_judged, run_trial, score};

#[derive(clap::Args)]
pub struct OptimizeArgs {
    /// Collection the trials search.
    #[arg(long, default_value = "docs")]
    collection: String,
    /// BEIR directory with the (already ingested) corpus's queries and qrels: judges nodes
    /// with retrieval metrics.
    #[arg(long)]
    dataset: Option<PathBuf>,
    /// qrels split to judge with (qrels/SPLIT.tsv).
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
    /// Seed of the query sample.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Queries in flight.
    #[arg(long, default_value_t = 4)]
    concurrency: usize,
    /// Model worker for answer metrics (SemScore, the judge); default: the local cluster's.
    #[arg(long)]
    pub model_worker: Option<String>,
    /// Directory for the trials, the winners and the report.
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

/// One node of the search space, ready to search: its strategy, judge and candidates.
struct Planned<'a> {
    node: &'a Node,
    strategy: Strategy,
    judge: Judge,
    candidates: Vec<Option<Step>>,
}

/// Expands every node's modules into candidates and checks each node can be judged.
fn plan_nodes(space: &Space) -> Result<Vec<Planned<'_>>> {
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
        plan.push(Planned {
            node,
            strategy,
            judge,
            candidates,
        });
    }
    Ok(plan)
}

/// What every trial shares: the cluster, the judged questions and the cache.
struct Trials<'a> {
    client: CoordinatorClient<KeyedChannel>,
    mw: Option<ModelWorkerClient<KeyedChannel>>,
    a: &'a OptimizeArgs,
    judged: Judged,
    cache: TrialCache,
    done: Vec<Trial>,
}

impl Trials<'_> {
    /// Tries every candidate of one node after the winners `fixed`; returns the winner's index.
    async fn node(
        &mut self,
        p: &Planned<'_>,
        fixed: &[Step],
        later: &[Vec<Option<Step>>],
    ) -> Result<usize> {
        let with_llm_judge = p.strategy.metrics.contains_key("judge");
        let first = self.done.len();
        for step in &p.candidates {
            let mut steps = fixed.to_vec();
            steps.extend(step.clone());
            let flow = flow_text(&complete(&steps, p.judge, later));
            let (means, p50, cached) = match self.cache.get(p.judge, &flow)? {
                Some((means, p50)) => (means, p50, true),
                None => {
                    let (means, p50) = run_trial(
                        &self.client,
                        self.mw.as_ref(),
                        self.a,
                        &self.judged,
                        p.judge,
                        with_llm_judge,
                        &flow,
                    )
                    .await
                    .with_context(|| format!("node {}: trial {flow}", p.node.node))?;
                    self.cache
                        .record(&p.node.node, p.judge, &flow, &means, p50)?;
                    (means, p50, false)
                }
            };
            let score = score(&p.node.node, &p.strategy, &means)?;
            let allowed = p.strategy.latency_ms_max.is_none_or(|max| p50 <= max);
            eprintln!(
                "{:<18} {score:.4} {p50:>8.1} ms {}{flow}",
                p.node.node,
                if cached { "(cached) " } else { "" }
            );
            self.done.push(Trial {
                node: p.node.node.clone(),
                judge: p.judge,
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
        for (j, t) in self.done.iter().enumerate().skip(first) {
            if t.allowed && best.is_none_or(|b| t.score > self.done[b].score) {
                best = Some(j);
            }
        }
        let best = best.with_context(|| {
            format!(
                "node {}: no candidate within the latency limit",
                p.node.node
            )
        })?;
        self.done[best].won = true;
        Ok(best - first)
    }
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
    let plan = plan_nodes(&space)?;
    let judged = load_judged(a)?;
    let needs = |j: Judge| plan.iter().any(|p| p.judge == j);
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
    let mut trials = Trials {
        client,
        mw,
        a,
        judged,
        cache: TrialCache::open(a)?,
        done: Vec::new(),
    };
    let mut fixed: Vec<Step> = Vec::new();
    let mut last_judge = Judge::Retrieval;
    for (i, p) in plan.iter().enumerate() {
        let later: Vec<Vec<Option<Step>>> =
            plan[i + 1..].iter().map(|p| p.candidates.clone()).collect();
        let best = trials.node(p, &fixed, &later).await?;
        fixed.extend(p.candidates[best].clone());
        last_judge = p.judge;
    }
    let winner = complete(&fixed, last_judge, &[]);
    let strategies: HashMap<&str, &Strategy> = plan
        .iter()
        .map(|p| (p.node.node.as_str(), &p.strategy))
        .collect();
    output::write(a, &strategies, &trials.done, &flow_text(&winner))
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
