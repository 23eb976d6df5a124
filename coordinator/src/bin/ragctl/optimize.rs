//! `ragctl optimize`: AutoRAG's greedy node-by-node pipeline search (seed §3.1) over flows.
//!
//! The search space (YAML) lists nodes in pipeline order, each with candidate modules (flow
//! operators) and parameter grids. For each node in turn, every candidate (module × grid
//! point) is tried with the earlier nodes fixed to their winners, and the best by the
//! strategy (a metric or a weighted mean of metrics, optionally under a latency limit) wins:
//! m + n trials instead of m × n. A node whose module does not retrieve (`noop`, a query
//! transform) is judged through the retrieval that follows it in the flow, as the seed does
//! for query expansion. Every trial is an inline flow run through `Ask` on the judged
//! queries and scored with the retrieval metrics of `ragctl eval`. Trials are cached in
//! `trials.jsonl` by flow text, so an interrupted run resumes where it stopped; the query
//! subset is a seeded sample, so a run is reproducible. Output: `best-flow.toml` (ready for
//! `coordinator.flows_file`), the trial table, and `trials.jsonl`.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use comfy_table::{Table, presets::UTF8_FULL_CONDENSED};
use coordinator::eval::beir;
use coordinator::eval::metrics;
use futures::StreamExt;
use ragcluster_proto::v1::coordinator_client::CoordinatorClient;
use serde::Deserialize;
use serde_json::json;
use tonic::transport::Channel;

use crate::eval::{percentile, rank};

#[derive(clap::Args)]
pub struct OptimizeArgs {
    #[arg(long, default_value = "docs")]
    collection: String,
    /// BEIR directory with the (already ingested) corpus's queries and qrels.
    #[arg(long)]
    dataset: PathBuf,
    #[arg(long, default_value = "test")]
    split: String,
    /// The search space (YAML): strategy and nodes, see docs/eval/space-retrieval.yaml.
    #[arg(long)]
    space: PathBuf,
    /// Queries sampled (seeded) from the judged ones; 0 = all.
    #[arg(long, default_value_t = 0)]
    queries: usize,
    #[arg(long, default_value_t = 42)]
    seed: u64,
    #[arg(long, default_value_t = 4)]
    concurrency: usize,
    #[arg(long, default_value = "optimize-out")]
    out: PathBuf,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Space {
    strategy: Strategy,
    nodes: Vec<Node>,
}

#[derive(Debug, Deserialize)]
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
    /// Each module: `op` plus parameters; a list value is a grid to try.
    modules: Vec<BTreeMap<String, serde_yaml::Value>>,
}

/// Every grid point of a module, as TOML inline-table text (`noop` = the node left out).
fn expand(module: &BTreeMap<String, serde_yaml::Value>) -> Result<Vec<Option<String>>> {
    let op = module
        .get("op")
        .and_then(|v| v.as_str())
        .context("every module needs an op")?
        .to_owned();
    let mut points: Vec<Vec<(String, String)>> = vec![vec![("op".into(), format!("{op:?}"))]];
    for (k, v) in module.iter().filter(|(k, _)| k.as_str() != "op") {
        let values = match v {
            serde_yaml::Value::Sequence(s) => s.clone(),
            other => vec![other.clone()],
        };
        let mut next = Vec::new();
        for p in &points {
            for v in &values {
                let text = match v {
                    serde_yaml::Value::String(s) => format!("{s:?}"),
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
                format!("{{ {} }}", body.join(", "))
            })
        })
        .collect())
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

struct Trial {
    node: String,
    step: String,
    metrics: BTreeMap<String, f64>,
    p50_ms: f64,
    score: f64,
    cached: bool,
}

fn flow_text(steps: &[String]) -> String {
    format!("steps = [{}]", steps.join(", "))
}

pub async fn optimize(client: CoordinatorClient<Channel>, a: &OptimizeArgs) -> Result<()> {
    let space: Space = serde_yaml::from_str(
        &std::fs::read_to_string(&a.space).with_context(|| a.space.display().to_string())?,
    )
    .with_context(|| format!("{}: not a valid search space", a.space.display()))?;
    if space.strategy.metrics.is_empty() {
        bail!("strategy.metrics is empty");
    }
    let judged = beir::judged_queries(&a.dataset, &a.split, usize::MAX)?;
    let queries = sample(&judged.queries, a.queries, a.seed);
    if queries.is_empty() {
        bail!("no judged queries");
    }
    std::fs::create_dir_all(&a.out)?;
    let cache_path = a.out.join("trials.jsonl");
    let mut cache: HashMap<String, serde_json::Value> = std::fs::read_to_string(&cache_path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["queries"] == queries.len() && v["seed"] == a.seed)
        .filter_map(|v| Some((v["flow"].as_str()?.to_owned(), v)))
        .collect();
    let mut fixed: Vec<String> = Vec::new();
    let mut trials: Vec<Trial> = Vec::new();
    for node in &space.nodes {
        let mut best: Option<(f64, Option<String>)> = None;
        for module in &node.modules {
            for step in expand(module).with_context(|| format!("node {}", node.node))? {
                let mut steps = fixed.clone();
                steps.extend(step.clone());
                // A node judged alone must end in retrieval; a pre-retrieval node is judged
                // through the best retrieval known so far (or bm25).
                if !steps.iter().any(|s| {
                    ["bm25", "dense", "hybrid"]
                        .iter()
                        .any(|op| s.contains(&format!("op = \"{op}\"")))
                }) {
                    steps.push("{ op = \"bm25\", top_k = 10 }".into());
                }
                let flow = flow_text(&steps);
                let (means, p50, cached) = match cache.get(&flow) {
                    Some(v) => (
                        serde_json::from_value::<BTreeMap<String, f64>>(v["metrics"].clone())?,
                        v["p50_ms"].as_f64().unwrap_or(0.0),
                        true,
                    ),
                    None => {
                        let config = format!("inline:{flow}");
                        let results: Vec<Result<(String, Vec<String>, f64)>> =
                            futures::stream::iter(queries.iter())
                                .map(|q| {
                                    let c = client.clone();
                                    let config = config.clone();
                                    async move {
                                        let (docs, ms) =
                                            rank(c, &a.collection, &config, &q.text, 100).await?;
                                        Ok((q.id.clone(), docs, ms))
                                    }
                                })
                                .buffered(a.concurrency.max(1))
                                .collect()
                                .await;
                        let mut sums: BTreeMap<String, f64> = BTreeMap::new();
                        let mut lat = Vec::new();
                        for r in results {
                            let (qid, docs, ms) = r.with_context(|| format!("trial {flow}"))?;
                            lat.push(ms);
                            for (n, v) in metrics::all(&docs, &judged.qrels[&qid], 10) {
                                *sums.entry(n).or_default() += v;
                            }
                        }
                        let means: BTreeMap<String, f64> = sums
                            .into_iter()
                            .map(|(k, v)| (k, v / queries.len() as f64))
                            .collect();
                        let p50 = percentile(&mut lat, 50.0);
                        let line = json!({"node": node.node, "flow": flow, "metrics": means, "p50_ms": p50,
                                          "queries": queries.len(), "seed": a.seed});
                        let mut f = std::fs::OpenOptions::new()
                            .create(true)
                            .append(true)
                            .open(&cache_path)?;
                        std::io::Write::write_all(&mut f, format!("{line}\n").as_bytes())?;
                        cache.insert(flow.clone(), line);
                        (means, p50, false)
                    }
                };
                let total: f64 = space.strategy.metrics.values().sum();
                let mut score = 0.0;
                for (m, w) in &space.strategy.metrics {
                    let v = means.get(m).with_context(|| {
                        format!(
                            "strategy metric {m:?} is not one of {:?}",
                            means.keys().collect::<Vec<_>>()
                        )
                    })?;
                    score += w * v / total;
                }
                let allowed = space.strategy.latency_ms_max.is_none_or(|max| p50 <= max);
                if allowed && best.as_ref().is_none_or(|(s, _)| score > *s) {
                    best = Some((score, step.clone()));
                }
                eprintln!(
                    "{:<14} {score:.4} {p50:>7.1} ms {}{flow}",
                    node.node,
                    if cached { "(cached) " } else { "" }
                );
                trials.push(Trial {
                    node: node.node.clone(),
                    step: step.clone().unwrap_or_else(|| "(none)".into()),
                    metrics: means,
                    p50_ms: p50,
                    score,
                    cached,
                });
            }
        }
        let (_, winner) = best.with_context(|| {
            format!("node {}: no candidate within the latency limit", node.node)
        })?;
        fixed.extend(winner);
    }
    if !fixed.iter().any(|s| {
        ["bm25", "dense", "hybrid"]
            .iter()
            .any(|op| s.contains(&format!("op = \"{op}\"")))
    }) {
        fixed.push("{ op = \"bm25\", top_k = 10 }".into());
    }
    let best_flow = format!(
        "# Written by `ragctl optimize` (space {}, {} queries, seed {}).\ndefault = \"optimized\"\n\n[flows.optimized]\ndescription = \"greedy node-wise optimum\"\n{}\n",
        a.space.display(),
        queries.len(),
        a.seed,
        flow_text(&fixed)
    );
    std::fs::write(a.out.join("best-flow.toml"), &best_flow)?;
    let mut t = Table::new();
    t.load_preset(UTF8_FULL_CONDENSED);
    t.set_header([
        "node",
        "candidate",
        "score",
        "ndcg@10",
        "recall@10",
        "p50 ms",
        "cached",
    ]);
    for tr in &trials {
        t.add_row(vec![
            tr.node.clone(),
            tr.step.clone(),
            format!("{:.4}", tr.score),
            format!("{:.4}", tr.metrics.get("ndcg@10").copied().unwrap_or(0.0)),
            format!("{:.4}", tr.metrics.get("recall@10").copied().unwrap_or(0.0)),
            format!("{:.1}", tr.p50_ms),
            if tr.cached {
                "yes".into()
            } else {
                String::new()
            },
        ]);
    }
    println!("{t}");
    println!(
        "winner: {}\nwritten to {}",
        flow_text(&fixed),
        a.out.join("best-flow.toml").display()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grids_expand_to_inline_steps() {
        let m: BTreeMap<String, serde_yaml::Value> =
            serde_yaml::from_str("{ op: hybrid, fusion: [rrf, dbsf], top_k: 10 }").unwrap();
        let e = expand(&m).unwrap();
        assert_eq!(
            e,
            vec![
                Some("{ op = \"hybrid\", fusion = \"rrf\", top_k = 10 }".to_string()),
                Some("{ op = \"hybrid\", fusion = \"dbsf\", top_k = 10 }".to_string()),
            ]
        );
        let noop: BTreeMap<String, serde_yaml::Value> =
            serde_yaml::from_str("{ op: noop }").unwrap();
        assert_eq!(expand(&noop).unwrap(), vec![None]);
        assert_eq!(
            sample(&[1, 2, 3, 4, 5], 2, 7),
            sample(&[1, 2, 3, 4, 5], 2, 7)
        );
        assert_eq!(sample(&[1, 2, 3], 0, 7), vec![1, 2, 3]);
    }
}
