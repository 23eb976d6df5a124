//! `ragctl eval answers`: answer quality on a QA file, end to end through Ask and, with
//! `--oracle`, by the same generator given the gold article's paragraph that holds the answer
//! (asked with the default flow's prompt), so a loss is placed in retrieval or in generation.
//! Short-answer questions are scored by SQuAD exact match, token F1 and ROUGE-L (best over
//! the gold answers, citation markers removed), SemScore and the key-fact score; yes/no
//! questions by the yes or no the answer starts with; every question by whether the gold
//! article was retrieved and cited, and by citation precision. Each generator of
//! `--generate-models` is one configuration of the same run. Writes `answers.jsonl`,
//! `answers-summary.json` and `report.html` into `--out`, and prints a table.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use comfy_table::{Table, presets::UTF8_FULL_CONDENSED};
use futures::StreamExt;
use ragcluster_common::client::KeyedChannel;
use ragcluster_common::prompt::{DEFAULT_PROMPT, DEFAULT_STOP, DEFAULT_SYSTEM, chunk_tag, fill};
use ragcluster_proto::v1::coordinator_client::CoordinatorClient;
use ragcluster_proto::v1::model_worker_client::ModelWorkerClient;
use ragcluster_proto::v1::*;
use ragctl::client::ask_result;
use ragctl::eval::answers::{self, QaItem};
use ragctl::eval::beir::{self, BeirDoc};
use serde_json::json;

use super::{bar, default_flow_of, percentile};

#[derive(clap::Args)]
pub struct AnswersArgs {
    /// QA file: JSON lines with question, answer, answers, yes_no, key_facts, gold_chunk_ids
    /// and gold_doc_ids (the format of datasets/cmuqa/qa.jsonl).
    #[arg(long)]
    qa: PathBuf,
    /// Collection the questions are asked against.
    #[arg(long, default_value = "docs")]
    collection: String,
    /// The flow answering (default: the collection's).
    #[arg(long, default_value = "")]
    flow: String,
    /// Flow files whose default flow (sent inline) is also evaluated, each beside `--flow`
    /// for every generator: prompt or pipeline variants in one run.
    #[arg(long, value_delimiter = ',')]
    flow_file: Vec<PathBuf>,
    /// Generator models to compare, each one configuration of the run (empty: the flow's).
    #[arg(long, value_delimiter = ',')]
    generate_models: Vec<String>,
    /// Also ask each generator with the gold article's paragraph that holds the answer as its
    /// only context (the default flow's prompt): the reader's score without retrieval.
    #[arg(long)]
    oracle: bool,
    /// The corpus (BEIR corpus.jsonl) the gold_doc_ids name, for --oracle (default:
    /// corpus.jsonl beside the QA file).
    #[arg(long)]
    corpus: Option<PathBuf>,
    /// New tokens of the oracle reader (the default flow's generate step has 96).
    #[arg(long, default_value_t = 96)]
    oracle_max_tokens: u32,
    /// Also score every answer 1-5 with the model worker's generator (G-Eval style).
    #[arg(long)]
    judge: bool,
    /// Model worker for SemScore embeddings, the oracle and the judge (default: the local
    /// cluster's).
    #[arg(long)]
    pub model_worker: Option<String>,
    /// Only the first N questions.
    #[arg(long)]
    limit: Option<usize>,
    /// N questions spread evenly over the file (after --limit): every article gets its share.
    #[arg(long)]
    sample: Option<usize>,
    /// Where in each stride of `--sample` the question is taken, from 0 (its first, the
    /// default) to below 1: 0.5 takes the questions halfway between those of 0, a held-out
    /// sample disjoint from the one flows were tuned on (while the stride is 2 or more).
    #[arg(long, default_value_t = 0.0, value_parser = sample_offset)]
    sample_offset: f64,
    /// Questions in flight per configuration.
    #[arg(long, default_value_t = 2)]
    concurrency: usize,
    /// Directory for the report (JSON and HTML).
    #[arg(long, default_value = "eval-out")]
    out: PathBuf,
}

const JUDGE: &str = "Rate the answer to the question against the reference answer for correctness and completeness, on a scale from 1 (wrong) to 5 (fully correct). Reply with the number only.";

/// The answer metrics `ragctl eval answers` reports (and `ragctl optimize` can maximise).
/// Short-answer questions only: exact_match .. final_score; yes/no questions only:
/// yes_no_accuracy; every question: the rest.
pub(crate) const ANSWER_METRICS: [&str; 11] = [
    "exact_match",
    "token_f1",
    "rouge_l",
    "sem_score",
    "key_fact",
    "final_score",
    "yes_no_accuracy",
    "gold_retrieved",
    "gold_cited",
    "citation_precision",
    "judge",
];

/// A client of the model worker at `addr` (SemScore embeddings, the oracle, the judge).
pub(crate) async fn model_worker(addr: Option<String>) -> Result<ModelWorkerClient<KeyedChannel>> {
    let addr = addr.context("no model worker: pass --model-worker (needed for SemScore)")?;
    Ok(ModelWorkerClient::new(
        crate::connect(&addr, std::time::Duration::from_secs(5))
            .await
            .with_context(|| format!("cannot reach the model worker at {addr}"))?,
    ))
}

fn mean(v: &[f64]) -> Option<f64> {
    (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64)
}

/// Where an answer comes from: a named flow (empty = the collection's) or an inline one.
#[derive(Clone, Copy)]
pub(crate) enum FlowRef<'a> {
    Named(&'a str),
    Inline(&'a str),
}

fn share(hit: bool) -> f64 {
    if hit { 1.0 } else { 0.0 }
}

/// The scores of one answer text against its question's gold (see the module doc for which
/// apply to which question), SemScore with one Embed call for short answers.
async fn score_text(
    mw: &mut ModelWorkerClient<KeyedChannel>,
    row: &mut serde_json::Value,
    raw: &str,
    item: &QaItem,
) -> Result<()> {
    let answer = answers::strip_citations(raw);
    if item.yes_no {
        if let Some(gold) = item.gold_yes_no() {
            row["yes_no_accuracy"] = json!(share(answers::yes_no(&answer) == Some(gold)));
        }
        return Ok(());
    }
    let golds = item.golds();
    row["exact_match"] = json!(answers::best_over(&golds, &answer, answers::exact_match));
    row["token_f1"] = json!(answers::best_over(&golds, &answer, answers::token_f1));
    row["rouge_l"] = json!(answers::best_over(&golds, &answer, answers::rouge_l));
    let emb = mw
        .embed(EmbedRequest {
            texts: vec![
                if answer.is_empty() {
                    " ".into()
                } else {
                    answer.clone()
                },
                item.answer.clone(),
            ],
            ..Default::default()
        })
        .await?
        .into_inner()
        .embeddings;
    let s_cos = answers::sem_score(&emb[0].values, &emb[1].values);
    row["sem_score"] = json!(s_cos);
    if let Some(k) = answers::key_fact_score(&answer, &item.key_facts) {
        row["key_fact"] = json!(k);
        row["final_score"] = json!(answers::final_score(s_cos, k));
    }
    Ok(())
}

/// Generates with `req` and returns the whole text.
async fn generate_text(
    mw: &mut ModelWorkerClient<KeyedChannel>,
    req: GenerateRequest,
) -> Result<String> {
    let mut s = mw.generate(req).await?.into_inner();
    let mut text = String::new();
    while let Some(m) = s.next().await {
        text.push_str(&m?.text);
    }
    Ok(text)
}

/// The G-Eval style 1-5 score of `answer`, by the worker's default generator.
async fn judge_answer(
    mw: &mut ModelWorkerClient<KeyedChannel>,
    row: &mut serde_json::Value,
    item: &QaItem,
    answer: &str,
) -> Result<()> {
    let reply = generate_text(
        mw,
        GenerateRequest {
            system: JUDGE.into(),
            prompt: format!(
                "Question: {}\nReference answer: {}\nAnswer: {}\nScore (1-5):",
                item.question, item.answer, answer
            ),
            max_tokens: 4,
            ..Default::default()
        },
    )
    .await?;
    if let Some(j) = answers::judge_score(&reply) {
        row["judge"] = json!(j);
    }
    Ok(())
}

/// One question through Ask, scored against its gold answer: the row of `answers.jsonl`
/// (answer, every answer metric that applies) and the time the Ask took. `model` overrides
/// the flow's generator (empty: the flow's).
pub(crate) async fn score_answer(
    mut c: CoordinatorClient<KeyedChannel>,
    mut mw: ModelWorkerClient<KeyedChannel>,
    collection: &str,
    flow: FlowRef<'_>,
    model: &str,
    item: &QaItem,
    judge: bool,
) -> Result<(serde_json::Value, f64)> {
    let t = Instant::now();
    let (flow, inline_flow) = match flow {
        FlowRef::Named(n) => (n.to_string(), String::new()),
        FlowRef::Inline(f) => (String::new(), f.to_string()),
    };
    let r = ask_result(
        &mut c,
        AskRequest {
            collection: collection.into(),
            question: item.question.clone(),
            flow,
            inline_flow,
            overrides: (!model.is_empty()).then(|| AskOverrides {
                generate_model: Some(model.to_owned()),
                ..Default::default()
            }),
            ..Default::default()
        },
    )
    .await?;
    let ms = t.elapsed().as_secs_f64() * 1e3;
    let cited: Vec<(String, String)> = r
        .citations
        .iter()
        .map(|c| (c.chunk_id.clone(), c.doc_id.clone()))
        .collect();
    let mut row = json!({
        "id": item.id, "question": item.question, "answer": r.answer, "gold": item.answer,
        "yes_no": item.yes_no, "status": r.status, "latency_ms": ms, "citations": cited.len(),
    });
    score_text(&mut mw, &mut row, &r.answer, item).await?;
    if !item.gold_doc_ids.is_empty() {
        let gold = |d: &String| item.gold_doc_ids.contains(d);
        row["gold_retrieved"] = json!(share(r.contexts.iter().any(|c| gold(&c.doc_id))));
        row["gold_cited"] = json!(share(cited.iter().any(|(_, d)| gold(d))));
    }
    if let Some(p) = answers::citation_precision(&cited, item) {
        row["citation_precision"] = json!(p);
    }
    if judge {
        judge_answer(&mut mw, &mut row, item, &r.answer).await?;
    }
    Ok((row, ms))
}

/// One question answered by `model` from the gold paragraph alone, with the default flow's
/// system prompt, template, chunk tag and stop string; scored like an Ask.
async fn score_oracle(
    mut mw: ModelWorkerClient<KeyedChannel>,
    model: &str,
    item: &QaItem,
    doc: &BeirDoc,
    max_tokens: u32,
    judge: bool,
) -> Result<(serde_json::Value, f64)> {
    let paragraph = answers::oracle_paragraph(&doc.text, item);
    let contexts = chunk_tag(1, &doc.title, "", paragraph);
    let t = Instant::now();
    let answer = generate_text(
        &mut mw,
        GenerateRequest {
            model: model.to_owned(),
            system: DEFAULT_SYSTEM.into(),
            prompt: fill(
                DEFAULT_PROMPT,
                &[
                    ("contexts", contexts.trim_end()),
                    ("question", &item.question),
                    ("query", &item.question),
                ],
            ),
            max_tokens,
            stop: vec![DEFAULT_STOP.into()],
            ..Default::default()
        },
    )
    .await?;
    let ms = t.elapsed().as_secs_f64() * 1e3;
    let mut row = json!({
        "id": item.id, "question": item.question, "answer": answer.trim(), "gold": item.answer,
        "yes_no": item.yes_no, "latency_ms": ms, "paragraph": paragraph,
    });
    score_text(&mut mw, &mut row, &answer, item).await?;
    if judge {
        judge_answer(&mut mw, &mut row, item, &answer).await?;
    }
    Ok((row, ms))
}

/// `n` questions spread evenly over `items` (all of them when there are fewer).
fn spread(items: Vec<QaItem>, n: usize, offset: f64) -> Vec<QaItem> {
    if n == 0 || n >= items.len() {
        return items;
    }
    let step = items.len() as f64 / n as f64;
    (0..n)
        .map(|i| items[(((i as f64 + offset) * step) as usize).min(items.len() - 1)].clone())
        .collect()
}

/// `--sample-offset`: a share of the stride, in [0, 1).
fn sample_offset(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if (0.0..1.0).contains(&v) => Ok(v),
        _ => Err(format!("{s:?}: the offset is a number from 0 to below 1")),
    }
}

/// Reads the corpus the oracle needs: the documents the questions name.
fn oracle_docs(a: &AnswersArgs, items: &[QaItem]) -> Result<HashMap<String, BeirDoc>> {
    let path = match &a.corpus {
        Some(p) => p.clone(),
        None => a.qa.with_file_name("corpus.jsonl"),
    };
    let docs: Vec<BeirDoc> = beir::read_jsonl(&path, usize::MAX)
        .with_context(|| format!("--oracle needs the corpus: {}", path.display()))?;
    let docs: HashMap<String, BeirDoc> = docs.into_iter().map(|d| (d.id.clone(), d)).collect();
    for item in items {
        let id = item
            .gold_doc_ids
            .first()
            .with_context(|| format!("--oracle: question {:?} names no gold_doc_ids", item.id))?;
        if !docs.contains_key(id) {
            bail!("--oracle: {} holds no document {id}", path.display());
        }
    }
    Ok(docs)
}

/// One configuration's results: rows and latencies.
struct Run {
    name: String,
    rows: Vec<serde_json::Value>,
    latency: Vec<f64>,
}

async fn run_config(
    client: &CoordinatorClient<KeyedChannel>,
    mw: &ModelWorkerClient<KeyedChannel>,
    a: &AnswersArgs,
    items: &[QaItem],
    docs: Option<&HashMap<String, BeirDoc>>,
    model: &str,
    flow: (&str, FlowRef<'_>),
) -> Result<Run> {
    let model_name = if model.is_empty() {
        "default generator"
    } else {
        model
    };
    let name = match docs {
        Some(_) => format!("oracle paragraph, {model_name}"),
        None => format!("{}, {model_name}", flow.0),
    };
    let b = bar(items.len(), &name)?;
    let results: Vec<Result<(serde_json::Value, f64)>> = futures::stream::iter(items)
        .map(|item| {
            let b = &b;
            async move {
                let r = match docs {
                    Some(docs) => {
                        let doc = &docs[&item.gold_doc_ids[0]];
                        score_oracle(mw.clone(), model, item, doc, a.oracle_max_tokens, a.judge)
                            .await
                    }
                    None => {
                        score_answer(
                            client.clone(),
                            mw.clone(),
                            &a.collection,
                            flow.1,
                            model,
                            item,
                            a.judge,
                        )
                        .await
                    }
                };
                b.inc(1);
                r
            }
        })
        .buffered(a.concurrency.max(1))
        .collect()
        .await;
    b.finish_and_clear();
    let mut run = Run {
        name,
        rows: Vec::new(),
        latency: Vec::new(),
    };
    for r in results {
        let (mut row, ms) = r?;
        row["config"] = json!(run.name);
        run.rows.push(row);
        run.latency.push(ms);
    }
    Ok(run)
}

pub async fn run(
    client: CoordinatorClient<KeyedChannel>,
    mw: ModelWorkerClient<KeyedChannel>,
    a: &AnswersArgs,
) -> Result<()> {
    let items: Vec<QaItem> = beir::read_jsonl(&a.qa, a.limit.unwrap_or(usize::MAX))?;
    let items = spread(items, a.sample.unwrap_or(0), a.sample_offset);
    if items.is_empty() {
        bail!("{}: no questions", a.qa.display());
    }
    let docs = if a.oracle {
        Some(oracle_docs(a, &items)?)
    } else {
        None
    };
    std::fs::create_dir_all(&a.out)?;
    let models = if a.generate_models.is_empty() {
        vec![String::new()]
    } else {
        a.generate_models.clone()
    };
    let inline: Vec<(String, String)> = a
        .flow_file
        .iter()
        .map(|p| Ok((p.display().to_string(), default_flow_of(p)?)))
        .collect::<Result<_>>()?;
    let named = if a.flow.is_empty() {
        "default flow"
    } else {
        &a.flow
    };
    let mut flows = vec![(named, FlowRef::Named(&a.flow))];
    flows.extend(inline.iter().map(|(n, f)| (n.as_str(), FlowRef::Inline(f))));
    let mut runs = Vec::new();
    for model in &models {
        for &flow in &flows {
            runs.push(run_config(&client, &mw, a, &items, None, model, flow).await?);
        }
        if let Some(docs) = &docs {
            let oracle = run_config(&client, &mw, a, &items, Some(docs), model, flows[0]);
            runs.push(oracle.await?);
        }
    }
    report(a, &items, &mut runs)
}

/// The table, `answers.jsonl`, `answers-summary.json` and `report.html`.
fn report(a: &AnswersArgs, items: &[QaItem], runs: &mut [Run]) -> Result<()> {
    let mut lines = String::new();
    let mut charts = Vec::new();
    let mut summary = serde_json::Map::new();
    for run in runs.iter_mut() {
        let mut per_query: BTreeMap<String, Vec<f64>> = BTreeMap::new();
        for row in &run.rows {
            lines.push_str(&row.to_string());
            lines.push('\n');
            for k in ANSWER_METRICS {
                if let Some(v) = row[k].as_f64() {
                    per_query.entry(k.to_string()).or_default().push(v);
                }
            }
        }
        let means: BTreeMap<String, f64> = per_query
            .iter()
            .filter_map(|(k, v)| Some((k.clone(), mean(v)?)))
            .collect();
        let (p50, p99) = (
            percentile(&mut run.latency.clone(), 50.0),
            percentile(&mut run.latency, 99.0),
        );
        let metrics: serde_json::Map<String, serde_json::Value> = per_query
            .iter()
            .map(|(k, v)| (k.clone(), json!({"mean": means[k], "n": v.len()})))
            .collect();
        summary.insert(
            run.name.clone(),
            json!({"metrics": metrics, "latency_ms": {"p50": p50, "p99": p99}}),
        );
        charts.push(crate::cmd::report::Config {
            name: run.name.clone(),
            means,
            per_query,
            p50_ms: p50,
            p99_ms: p99,
        });
    }
    std::fs::write(a.out.join("answers.jsonl"), lines)?;
    let yes_no = items.iter().filter(|i| i.yes_no).count();
    let summary = json!({"qa": a.qa.display().to_string(), "collection": a.collection,
                         "flow": a.flow, "questions": items.len(), "yes_no_questions": yes_no,
                         "configurations": summary});
    std::fs::write(
        a.out.join("answers-summary.json"),
        serde_json::to_string_pretty(&summary)?,
    )?;
    let mut table = Table::new();
    table.load_preset(UTF8_FULL_CONDENSED);
    let mut header = vec!["metric (questions)".to_string()];
    header.extend(charts.iter().map(|c| c.name.clone()));
    table.set_header(header);
    let shown: Vec<String> = ANSWER_METRICS
        .iter()
        .filter(|k| charts.iter().any(|c| c.means.contains_key(**k)))
        .map(|k| k.to_string())
        .collect();
    for k in &shown {
        let n = charts
            .iter()
            .filter_map(|c| c.per_query.get(k).map(Vec::len))
            .max()
            .unwrap_or(0);
        let mut row = vec![format!("{k} ({n})")];
        row.extend(charts.iter().map(|c| match c.means.get(k) {
            Some(m) => format!("{m:.3}"),
            None => "-".into(),
        }));
        table.add_row(row);
    }
    let mut lat = vec!["latency p50 / p99 ms".to_string()];
    lat.extend(
        charts
            .iter()
            .map(|c| format!("{:.0} / {:.0}", c.p50_ms, c.p99_ms)),
    );
    table.add_row(lat);
    let title = format!(
        "Answer evaluation: {} ({} questions, {yes_no} yes/no), collection {}",
        a.qa.display(),
        items.len(),
        a.collection
    );
    // The judge's 1-5 scale does not fit the 0-1 bars.
    let bars: Vec<String> = shown.into_iter().filter(|k| k != "judge").collect();
    std::fs::write(
        a.out.join("report.html"),
        crate::cmd::report::html(&title, &charts, &bars, "token_f1")?,
    )?;
    println!("{table}");
    println!(
        "per-question results in {}",
        a.out.join("answers.jsonl").display()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sample_takes_every_kth_question() {
        let items: Vec<QaItem> = (0..10)
            .map(|i| QaItem {
                id: i.to_string(),
                ..Default::default()
            })
            .collect();
        let ids = |v: Vec<QaItem>| v.into_iter().map(|i| i.id).collect::<Vec<_>>();
        assert_eq!(ids(spread(items.clone(), 4, 0.0)), ["0", "2", "5", "7"]);
        // Halfway through each stride: none of the questions above.
        assert_eq!(ids(spread(items.clone(), 4, 0.5)), ["1", "3", "6", "8"]);
        assert_eq!(ids(spread(items.clone(), 0, 0.5)).len(), 10);
        assert_eq!(ids(spread(items, 20, 0.0)).len(), 10);
        assert!(sample_offset("1").is_err() && sample_offset("-0.1").is_err());
        assert_eq!(sample_offset("0.5"), Ok(0.5));
    }
}
