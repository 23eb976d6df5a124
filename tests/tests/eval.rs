//! `ragctl eval retrieval` and `ragctl optimize` as a user runs them: against a real cluster, loading a SciFact subset
//! (`--ingest`: the documents judged for 40 queries plus 200 others) and evaluating bm25, dense
//! and hybrid. Checks the outputs (table, summary.json, per-query JSONL, TREC run files, the
//! HTML report with its two SVG charts) and
//! then scores the run files with pytrec_eval (trec_eval) and requires every per-query metric to
//! equal ours within 1e-6. That last part needs a Python with `pytrec_eval`
//! (`RAGCLUSTER_PYTHON`, else ~/.cache/ragcluster-pyenv, made by scripts/setup.sh, else
//! ~/.cache/st-venv, else python3; `pip install pytrec-eval-terrier`) and is skipped with a
//! message without one.

use std::process::Command;

use anyhow::{Context, Result, ensure};
use ragcluster_tests::{
    Cluster, Options, bin_dir, datasets_dir, python_with, ragctl_at, workspace,
};

#[test]
fn eval_retrieval_matches_trec_eval() -> Result<()> {
    let cluster = Cluster::start(2)?;
    let out = cluster.dir.path().join("eval-out");
    let dataset = datasets_dir().join("scifact");
    let run = Command::new(bin_dir().join("ragctl"))
        .args([
            "--coordinator",
            &cluster.coordinator.grpc,
            "eval",
            "retrieval",
        ])
        .args(["--collection", "scifact", "--ingest", "--shards", "2"])
        .args(["--limit-queries", "40", "--limit-docs", "200"])
        .args(["--configs", "bm25,dense,hybrid-rrf,hybrid-dbsf"])
        .arg("--dataset")
        .arg(&dataset)
        .arg("--out")
        .arg(&out)
        .env("RUST_BACKTRACE", "0")
        .output()?;
    let stdout = String::from_utf8_lossy(&run.stdout);
    println!("{stdout}");
    ensure!(
        run.status.success(),
        "ragctl eval failed: {}",
        String::from_utf8_lossy(&run.stderr)
    );
    ensure!(stdout.contains("ndcg@10") && stdout.contains("hybrid-dbsf"));

    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("summary.json"))?)?;
    for c in ["bm25", "dense", "hybrid-rrf", "hybrid-dbsf"] {
        let m = &summary["configurations"][c]["metrics"];
        let ndcg = m["ndcg@10"].as_f64().context("ndcg@10")?;
        // A 40-query subset over ~250 documents: every retriever finds most answers.
        ensure!((0.3..=1.0).contains(&ndcg), "{c}: nDCG@10 {ndcg}");
        for k in [
            "recall@10",
            "recall@100",
            "mrr@10",
            "map@100",
            "p@10",
            "context_precision@10",
        ] {
            ensure!((0.0..=1.0).contains(&m[k].as_f64().context(k)?), "{c} {k}");
        }
        ensure!(out.join(format!("{c}.trec")).exists());
    }
    let html = std::fs::read_to_string(out.join("report.html"))?;
    ensure!(
        html.matches("<svg").count() == 2 && html.contains("hybrid-dbsf") && html.contains("<rect")
    );
    let lines = std::fs::read_to_string(out.join("per_query.jsonl"))?
        .lines()
        .count();
    ensure!(lines == 4 * 40, "{lines} per-query lines");

    // The optimiser on the same collection: greedy node-wise trials, a flow file that the
    // coordinator accepts, a second run served from the trial cache, the winner evaluated.
    let space = cluster.dir.path().join("space.yaml");
    std::fs::write(
        &space,
        "strategy:\n  metrics: { \"ndcg@10\": 1.0 }\nnodes:\n  - node: retrieval\n    modules:\n      - { op: bm25, top_k: 10 }\n      - { op: hybrid, top_k: 10, fusion: [rrf, dbsf] }\n  - node: passage_augmenter\n    modules:\n      - { op: noop }\n      - { op: prev_next, before: 1, after: 1 }\n",
    )?;
    let opt_out = cluster.dir.path().join("opt");
    let optimize = || {
        Command::new(bin_dir().join("ragctl"))
            .args([
                "--coordinator",
                &cluster.coordinator.grpc,
                "optimize",
                "--collection",
                "scifact",
            ])
            .args(["--limit-queries", "40", "--queries", "30", "--seed", "7"])
            .arg("--dataset")
            .arg(&dataset)
            .arg("--space")
            .arg(&space)
            .arg("--out")
            .arg(&opt_out)
            .env("RUST_BACKTRACE", "0")
            .output()
    };
    let first = optimize()?;
    ensure!(
        first.status.success(),
        "optimize: {}",
        String::from_utf8_lossy(&first.stderr)
    );
    println!("{}", String::from_utf8_lossy(&first.stdout));
    let best = std::fs::read_to_string(opt_out.join("best-flow.toml"))?;
    coordinator::flow::spec::FlowSet::parse(&best).map_err(anyhow::Error::msg)?;
    // The trials ran on queries whose documents were ingested: the scores are real ones.
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(opt_out.join("summary.json"))?)?;
    for t in summary["trials"].as_array().context("trials")? {
        let n = t["metrics"]["ndcg@10"].as_f64().context("ndcg")?;
        ensure!(n > 0.6, "{t}");
    }
    let trials = std::fs::read_to_string(opt_out.join("trials.jsonl"))?
        .lines()
        .count();
    ensure!(
        trials == 4,
        "3 retrieval trials + 1 augmenter trial (the other is cached): {trials}"
    );
    let second = optimize()?;
    ensure!(second.status.success());
    let log = String::from_utf8_lossy(&second.stderr);
    ensure!(
        log.matches("(cached)").count() == 5,
        "a rerun is served from the cache: {log}"
    );
    ensure!(
        std::fs::read_to_string(opt_out.join("best-flow.toml"))? == best,
        "reproducible"
    );
    let winner = Command::new(bin_dir().join("ragctl"))
        .args([
            "--coordinator",
            &cluster.coordinator.grpc,
            "eval",
            "retrieval",
            "--collection",
            "scifact",
        ])
        .args(["--limit-queries", "40", "--configs", "bm25"])
        .arg("--dataset")
        .arg(&dataset)
        .arg("--flow-file")
        .arg(opt_out.join("best-flow.toml"))
        .arg("--out")
        .arg(cluster.dir.path().join("winner"))
        .env("RUST_BACKTRACE", "0")
        .output()?;
    ensure!(
        winner.status.success(),
        "{}",
        String::from_utf8_lossy(&winner.stderr)
    );
    ensure!(String::from_utf8_lossy(&winner.stdout).contains("inline:"));

    let Some(python) = python_with("pytrec_eval") else {
        ragcluster_common::skip::skipped(
            ragcluster_common::skip::SkipReason::NotSetUp,
            "eval::pytrec_eval_cross_check",
            "no Python with pytrec_eval (bash scripts/setup.sh installs it; or set RAGCLUSTER_PYTHON)",
        );
        return Ok(());
    };
    let check = Command::new(&python)
        .arg(workspace().join("scripts/trec_check.py"))
        .arg(dataset.join("qrels/test.tsv"))
        .arg(&out)
        .output()?;
    let report = String::from_utf8_lossy(&check.stdout);
    println!("pytrec_eval cross-check: {report}");
    ensure!(
        check.status.success(),
        "metrics differ from pytrec_eval: {report} {}",
        String::from_utf8_lossy(&check.stderr)
    );
    Ok(())
}

/// `ragctl eval answers` on the shipped sample QA file: the demo's `ragctl ingest docs/sample`,
/// then every question through the `linear` flow with SmolLM2, scored with ROUGE-L, token F1,
/// SemScore, the key-fact and final scores, citation precision and the 1-5 judge.
#[test]
fn eval_answers_on_the_sample() -> Result<()> {
    let cluster = Cluster::start_for_ask(2)?;
    let ragctl = |args: &[&str]| -> Result<String> {
        let o = Command::new(bin_dir().join("ragctl"))
            .current_dir(workspace())
            .args(["--coordinator", &cluster.coordinator.grpc])
            .args(args)
            .env("RUST_BACKTRACE", "0")
            .output()?;
        ensure!(
            o.status.success(),
            "ragctl {args:?}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        Ok(String::from_utf8_lossy(&o.stdout).into_owned())
    };
    ragctl(&["ingest", "docs/sample"])?;
    let out = cluster.dir.path().join("answers-out");
    let table = ragctl(&[
        "eval",
        "answers",
        "--qa",
        "docs/eval/sample-qa.jsonl",
        "--flow",
        "linear",
        "--judge",
        "--model-worker",
        &cluster.model_worker.grpc,
        "--out",
        &out.display().to_string(),
    ])?;
    println!("{table}");
    let s: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("answers-summary.json"))?)?;
    ensure!(s["questions"] == 6);
    // One configuration: the named flow with the worker's default generator.
    let configs = s["configurations"].as_object().context("configurations")?;
    ensure!(configs.len() == 1, "{s}");
    let c = configs.values().next().context("a configuration")?;
    ensure!(out.join("report.html").exists());
    for k in [
        "rouge_l",
        "token_f1",
        "sem_score",
        "key_fact",
        "final_score",
    ] {
        let m = &c["metrics"][k];
        ensure!(m["n"] == 6, "{k}: {m}");
        ensure!(
            (0.0..=1.0).contains(&m["mean"].as_f64().context(k)?),
            "{k}: {m}"
        );
    }
    // Answers are about the right topic: SemScore against the gold answers is well above
    // unrelated text (MiniLM cosines of unrelated sentences sit near 0.1).
    ensure!(
        c["metrics"]["sem_score"]["mean"].as_f64().unwrap_or(0.0) > 0.4,
        "{s}"
    );
    let rows = std::fs::read_to_string(out.join("answers.jsonl"))?;
    for l in rows.lines() {
        let r: serde_json::Value = serde_json::from_str(l)?;
        let s_cos = r["sem_score"].as_f64().context("sem")?;
        let s_key = r["key_fact"].as_f64().context("key")?;
        let want = 0.4 * s_cos + 0.6 * s_key;
        ensure!((r["final_score"].as_f64().context("final")? - want).abs() < 1e-12);
    }
    Ok(())
}

/// `ragctl optimize` over the whole pipeline on the sample corpus and QA file: query
/// expansion and retrieval judged by retrieval metrics on the QA file's gold documents, the
/// prompt maker (through the generator after it) and the generator by answer metrics with
/// SmolLM2 and MiniLM; a space that asks a generator for nDCG is refused before any trial.
#[test]
fn optimize_the_whole_pipeline_on_the_sample() -> Result<()> {
    let cluster = Cluster::start_for_ask(2)?;
    let ragctl = |args: &[&str]| -> Result<std::process::Output> {
        Ok(Command::new(bin_dir().join("ragctl"))
            .current_dir(workspace())
            .args(["--coordinator", &cluster.coordinator.grpc])
            .args(args)
            .env("RUST_BACKTRACE", "0")
            .output()?)
    };
    let o = ragctl(&["ingest", "docs/sample"])?;
    ensure!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let out = cluster.dir.path().join("opt");
    let out_s = out.display().to_string();
    let o = ragctl(&[
        "optimize",
        "--qa",
        "docs/eval/sample-qa.jsonl",
        "--space",
        "docs/eval/space-answers.yaml",
        "--model-worker",
        &cluster.model_worker.grpc,
        "--out",
        &out_s,
    ])?;
    ensure!(
        o.status.success(),
        "optimize: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    println!("{}", String::from_utf8_lossy(&o.stdout));
    let best = std::fs::read_to_string(out.join("best-flow.toml"))?;
    let set = coordinator::flow::spec::FlowSet::parse(&best).map_err(anyhow::Error::msg)?;
    let ops: Vec<&str> = set.flows["optimized"]
        .steps
        .iter()
        .map(|s| s.op.name())
        .collect();
    ensure!(
        ops.ends_with(&["prompt", "generate"]),
        "the winner answers: {ops:?}"
    );
    let s: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("summary.json"))?)?;
    let trials = s["trials"].as_array().context("trials")?;
    // 2 expansions + 3 retrievers + 2 rerankers + 2 prompts + 2 generator settings.
    ensure!(trials.len() == 11, "{} trials", trials.len());
    for node in [
        "query_expansion",
        "retrieval",
        "passage_reranker",
        "prompt_maker",
        "generator",
    ] {
        let won = trials
            .iter()
            .filter(|t| t["node"] == node && t["winner"] == true)
            .count();
        ensure!(won == 1, "{node}: {won} winners");
    }
    for t in trials {
        let answers = t["judge"] == "answers";
        ensure!(
            answers == (t["node"] == "prompt_maker" || t["node"] == "generator"),
            "{t}"
        );
        let m = if answers { "sem_score" } else { "ndcg@10" };
        let v = t["metrics"][m].as_f64().context("metric")?;
        ensure!((0.0..=1.0).contains(&v), "{t}");
        if answers {
            ensure!(t["flow"].as_str().unwrap_or("").contains("\"generate\""));
        }
    }
    // Trials with the same flow are run once: the rerank `noop`, the retriever the query
    // expansion was judged through and the generator setting the prompt maker was judged
    // through come from the cache.
    let unique = std::fs::read_to_string(out.join("trials.jsonl"))?
        .lines()
        .count();
    ensure!(unique == 8, "{unique} trials run");
    let html = std::fs::read_to_string(out.join("report.html"))?;
    ensure!(html.matches("<svg").count() == 6, "5 node charts + latency");

    // A generator judged by nDCG is refused before anything runs.
    let bad = cluster.dir.path().join("bad.yaml");
    std::fs::write(
        &bad,
        "strategy:\n  metrics: { \"ndcg@10\": 1.0 }\nnodes:\n  - node: generator\n    modules:\n      - { op: generate }\n",
    )?;
    let o = ragctl(&[
        "optimize",
        "--qa",
        "docs/eval/sample-qa.jsonl",
        "--space",
        &bad.display().to_string(),
        "--out",
        &out_s,
    ])?;
    let err = String::from_utf8_lossy(&o.stderr);
    ensure!(
        !o.status.success() && err.contains("answer-metric strategy"),
        "{err}"
    );
    Ok(())
}

/// `ragctl ingest` of JSON lines and of a BEIR dataset directory (only its corpus): several
/// calls in flight, chunks/s and the stage split printed, metadata stored and filterable; a
/// malformed line is named before anything is written (no collection is created). The model
/// worker queues one Embed request at most, so a load of them is refused with a retry hint
/// (RESOURCE_EXHAUSTED): the coordinator waits the hint out and calls again (and ragctl would
/// wait out one that reached it: backpressure end to end), and every document is stored.
#[test]
fn ragctl_ingest_reads_jsonl_and_beir_corpora() -> Result<()> {
    let cluster = Cluster::start_opts(Options {
        shard_nodes: 2,
        coordinator_config: Some("[coordinator]\nembed_batch = 2\nembed_concurrency = 4\n"),
        model_worker_config: Some("[model_worker]\nmax_queue = 1\n"),
        ..Default::default()
    })?;
    let at = cluster.coordinator.grpc.as_str();
    let dir = cluster.dir.path();
    std::fs::write(
        dir.join("rows.jsonl"),
        "{\"id\":\"r1\",\"title\":\"Zebras\",\"text\":\"Zebras graze on the savanna grass.\",\"metadata\":{\"year\":2024}}\n\
         {\"id\":\"r2\",\"text\":\"Glaciers carve valleys over millennia.\",\"metadata\":{\"year\":1999}}\n\
         {\"id\":\"r3\",\"title\":\"Volcanoes erupt molten basalt\"}\n",
    )?;
    let rows = dir.join("rows.jsonl").display().to_string();
    let out = ragctl_at(
        at,
        &[
            "ingest",
            &rows,
            "--collection",
            "rows",
            "--shards",
            "2",
            "--batch",
            "1",
        ],
    )?;
    ensure!(
        out.contains("ingested 3 documents") && out.contains("chunks/s") && out.contains("embed"),
        "{out}"
    );
    let hits = ragctl_at(
        at,
        &[
            "search",
            "basalt",
            "--collection",
            "rows",
            "--mode",
            "bm25",
            "--json",
        ],
    )?;
    ensure!(hits.contains("\"r3\""), "{hits}");
    let hits = ragctl_at(
        at,
        &[
            "search",
            "zebras glaciers",
            "--collection",
            "rows",
            "--mode",
            "bm25",
            "--json",
            "--filter",
            "year=1999",
        ],
    )?;
    ensure!(
        hits.contains("\"r2\"") && !hits.contains("\"r1\""),
        "{hits}"
    );

    std::fs::write(
        dir.join("bad.jsonl"),
        "{\"id\":\"b1\",\"text\":\"fine\"}\n{\"id\": oops\n",
    )?;
    let bad = dir.join("bad.jsonl").display().to_string();
    let o = Command::new(bin_dir().join("ragctl"))
        .args(["--coordinator", at, "ingest", &bad, "--collection", "never"])
        .output()?;
    let err = String::from_utf8_lossy(&o.stderr);
    ensure!(!o.status.success() && err.contains("bad.jsonl:2"), "{err}");
    let list = ragctl_at(at, &["collection", "list"])?;
    ensure!(!list.contains("never"), "{list}");

    // A BEIR directory: its corpus only (queries.jsonl beside it is not ingested).
    let beir = dir.join("mini-scifact");
    std::fs::create_dir_all(&beir)?;
    let corpus = std::fs::read_to_string(datasets_dir().join("scifact/corpus.jsonl"))?;
    let first: Vec<&str> = corpus.lines().take(30).collect();
    std::fs::write(beir.join("corpus.jsonl"), first.join("\n"))?;
    std::fs::copy(
        datasets_dir().join("scifact/queries.jsonl"),
        beir.join("queries.jsonl"),
    )?;
    let out = ragctl_at(
        at,
        &[
            "ingest",
            &beir.display().to_string(),
            "--collection",
            "mini",
            "--concurrency",
            "3",
            "--batch",
            "4",
        ],
    )?;
    ensure!(
        out.contains("ingested 30 documents") && out.contains("sentence chunking"),
        "{out}"
    );

    // Sixteen Embed calls at once against a queue of one: refused, retried, all stored.
    let many: Vec<String> = (0..64)
        .map(|i| format!("{{\"id\":\"m{i}\",\"text\":\"Note {i} about tide pools and kelp.\"}}"))
        .collect();
    std::fs::write(dir.join("many.jsonl"), many.join("\n"))?;
    let many = dir.join("many.jsonl").display().to_string();
    let out = ragctl_at(
        at,
        &[
            "ingest",
            &many,
            "--collection",
            "many",
            "--batch",
            "16",
            "--concurrency",
            "4",
        ],
    )?;
    ensure!(out.contains("ingested 64 documents"), "{out}");
    // The coordinator waited the worker's refusals out itself (ragctl would retry the ones
    // that reached it, "retries after load refusals").
    let page = tokio::runtime::Runtime::new()?
        .block_on(ragcluster_tests::http_get(&cluster.coordinator.metrics))?;
    let waits = ragcluster_tests::metric_sum(&page, "coordinator_embed_backlog_waits_total");
    ensure!(
        waits > 0.0 || out.contains("retries after load refusals"),
        "no refusal was waited out: {out}"
    );
    Ok(())
}
