//! Trials of `ragctl optimize`: the judged questions, one trial's run and score, and the
//! cache of trials already run.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;

use anyhow::{Context, Result, ensure};
use futures::StreamExt;
use ragcluster_common::client::KeyedChannel;
use ragcluster_proto::v1::coordinator_client::CoordinatorClient;
use ragcluster_proto::v1::model_worker_client::ModelWorkerClient;
use ragctl::eval::answers::QaItem;
use ragctl::eval::beir::{self, BeirQuery};
use ragctl::eval::metrics::{self, Rels};
use serde_json::json;

use super::{Judge, OptimizeArgs, Step, Strategy, sample};
use crate::cmd::eval::{ANSWER_METRICS, FlowRef, percentile, rank, score_answer};

/// One candidate's result.
pub(super) struct Trial {
    pub(super) node: String,
    pub(super) judge: Judge,
    pub(super) step: String,
    pub(super) flow: String,
    pub(super) metrics: BTreeMap<String, f64>,
    pub(super) p50_ms: f64,
    pub(super) score: f64,
    pub(super) allowed: bool,
    pub(super) cached: bool,
    pub(super) won: bool,
}

pub(super) fn flow_text(steps: &[Step]) -> String {
    let s: Vec<&str> = steps.iter().map(|s| s.text.as_str()).collect();
    format!("steps = [{}]", s.join(", "))
}

/// The questions a judge runs: (id, question) with qrels for retrieval, QA items for answers.
pub(super) struct Judged {
    pub(super) retrieval: Option<(Vec<BeirQuery>, HashMap<String, Rels>)>,
    pub(super) answers: Option<Vec<QaItem>>,
}

pub(super) fn load_judged(a: &OptimizeArgs) -> Result<Judged> {
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
pub(super) async fn run_trial(
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
                        "",
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

pub(super) fn score(node: &str, s: &Strategy, means: &BTreeMap<String, f64>) -> Result<f64> {
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

/// Trials already run, from `trials.jsonl`: an interrupted run resumes where it stopped.
pub(super) struct TrialCache {
    path: PathBuf,
    /// Cached trials count only for the same questions: data files, sample size and seed.
    data: String,
    sample: usize,
    seed: u64,
    entries: HashMap<String, serde_json::Value>,
}

impl TrialCache {
    pub(super) fn open(a: &OptimizeArgs) -> Result<TrialCache> {
        std::fs::create_dir_all(&a.out)?;
        let path = a.out.join("trials.jsonl");
        let data = format!(
            "{}:{} {}",
            a.dataset
                .as_ref()
                .map_or(String::new(), |d| d.display().to_string()),
            a.split,
            a.qa.as_ref()
                .map_or(String::new(), |d| d.display().to_string())
        );
        let entries = std::fs::read_to_string(&path)
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
                Some((Self::key(judge, v["flow"].as_str()?), v))
            })
            .collect();
        Ok(TrialCache {
            path,
            data,
            sample: a.queries,
            seed: a.seed,
            entries,
        })
    }

    fn key(judge: Judge, flow: &str) -> String {
        format!("{}\t{flow}", judge.name())
    }

    /// Mean metrics and p50 latency of a trial run before.
    pub(super) fn get(
        &self,
        judge: Judge,
        flow: &str,
    ) -> Result<Option<(BTreeMap<String, f64>, f64)>> {
        let Some(v) = self.entries.get(&Self::key(judge, flow)) else {
            return Ok(None);
        };
        Ok(Some((
            serde_json::from_value(v["metrics"].clone())?,
            v["p50_ms"].as_f64().unwrap_or(0.0),
        )))
    }

    /// Appends a trial to `trials.jsonl` as soon as it is measured.
    pub(super) fn record(
        &mut self,
        node: &str,
        judge: Judge,
        flow: &str,
        means: &BTreeMap<String, f64>,
        p50: f64,
    ) -> Result<()> {
        let line = json!({"node": node, "judge": judge.name(), "flow": flow,
                          "metrics": means, "p50_ms": p50, "sample": self.sample,
                          "seed": self.seed, "data": self.data});
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.path)?;
        std::io::Write::write_all(&mut f, format!("{line}\n").as_bytes())?;
        self.entries.insert(Self::key(judge, flow), line);
        Ok(())
    }
}
