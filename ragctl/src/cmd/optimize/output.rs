//! What `ragctl optimize` writes: `best-flow.toml`, the trial table, `summary.json` and
//! `report.html`.

use std::collections::HashMap;

use anyhow::Result;
use comfy_table::{Table, presets::UTF8_FULL_CONDENSED};
use serde_json::json;

use super::trials::Trial;
use super::{OptimizeArgs, Strategy};

/// Writes the winner and every trial to `a.out` and prints the table.
pub(super) fn write(
    a: &OptimizeArgs,
    strategies: &HashMap<&str, &Strategy>,
    trials: &[Trial],
    winner: &str,
) -> Result<()> {
    let best_flow = format!(
        "# Written by `ragctl optimize` (space {}, {} questions sampled with seed {}).\ndefault = \"optimized\"\n\n[flows.optimized]\ndescription = \"greedy node-wise optimum\"\n{winner}\n",
        a.space.display(),
        if a.queries == 0 {
            "all".to_string()
        } else {
            a.queries.to_string()
        },
        a.seed,
    );
    std::fs::write(a.out.join("best-flow.toml"), &best_flow)?;
    // The metrics a node's strategy weighs, and nDCG@10 always.
    let shown = |tr: &Trial| -> String {
        let strategy = strategies.get(tr.node.as_str()).map(|s| &s.metrics);
        tr.metrics
            .iter()
            .filter(|(k, _)| strategy.is_some_and(|m| m.contains_key(*k)) || *k == "ndcg@10")
            .map(|(k, v)| format!("{k} {v:.4}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let summary = json!({
        "space": a.space.display().to_string(), "collection": a.collection, "seed": a.seed,
        "sample": a.queries, "winner": winner,
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
            winner,
            &rows,
        )?,
    )?;
    println!("{}", table(trials, &shown));
    println!(
        "winner: {winner}\nwritten to {} (summary.json, report.html, trials.jsonl beside it)",
        a.out.join("best-flow.toml").display()
    );
    Ok(())
}

fn table(trials: &[Trial], shown: &dyn Fn(&Trial) -> String) -> Table {
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
    for tr in trials {
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
    t
}
