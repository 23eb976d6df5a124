//! `ragctl ask`: an answer streamed to the terminal, then its sources.

use anyhow::{Context, Result, bail};
use comfy_table::{Table, presets::UTF8_FULL_CONDENSED};
use ragcluster_proto::v1::coordinator_client::CoordinatorClient;
use ragcluster_proto::v1::*;

use crate::{AskArgs, Cli, channel};

/// Streams an answer to the terminal, then its sources (and the trace with `--trace`).
pub async fn ask(cli: &Cli, a: &AskArgs) -> Result<()> {
    use std::io::Write;
    let inline_flow = match &a.flow_file {
        Some(p) => std::fs::read_to_string(p).with_context(|| p.display().to_string())?,
        None => String::new(),
    };
    let req = AskRequest {
        collection: a.collection.clone(),
        question: a.question.clone(),
        flow: a.flow.clone(),
        inline_flow,
        overrides: Some(AskOverrides {
            top_k: a.top_k,
            max_tokens: a.max_tokens,
            ..Default::default()
        }),
        timeout_ms: a.timeout_ms.unwrap_or(0),
        conditions: super::browse::conditions(cli, &a.collection, a.where_.as_deref()).await?,
        ..Default::default()
    };
    let mut stream = CoordinatorClient::new(channel(cli).await?)
        .ask(req)
        .await?
        .into_inner();
    let mut out = std::io::stdout();
    let mut result = None;
    let mut failure = None;
    while let Some(m) = futures::StreamExt::next(&mut stream).await {
        match m {
            Err(s) => {
                failure = Some(s);
                break;
            }
            Ok(AskResponse {
                event: Some(ask_response::Event::Token(t)),
            }) if !a.json => {
                if t.restart {
                    writeln!(out, "\n[{}: new answer]", t.step)?;
                }
                write!(out, "{}", t.text)?;
                out.flush()?;
            }
            Ok(AskResponse {
                event: Some(ask_response::Event::Result(r)),
            }) => result = Some(r),
            Ok(_) => {}
        }
    }
    let Some(r) = result else {
        match failure {
            Some(s) => bail!("{:?}: {}", s.code(), s.message()),
            None => bail!("the coordinator closed the stream without a result"),
        }
    };
    print_result(a, &r)?;
    if let Some(s) = failure {
        bail!("{:?}: {}", s.code(), s.message());
    }
    Ok(())
}

/// The cited sources, each once in order of first citation, with the distinct spans quoted
/// from it under it (several answer sentences often cite the same chunk).
fn sources(citations: &[Citation]) -> String {
    let mut order: Vec<u32> = Vec::new();
    for c in citations {
        if !order.contains(&c.number) {
            order.push(c.number);
        }
    }
    let mut out = String::new();
    for n in order {
        let cited: Vec<&Citation> = citations.iter().filter(|c| c.number == n).collect();
        let first = cited[0];
        out.push_str(&format!("  [{n}] {} ({})\n", first.title, first.chunk_id));
        let mut quoted: Vec<(&str, bool)> = Vec::new();
        for c in cited {
            if !quoted
                .iter()
                .any(|(s, a)| *s == c.span && *a == c.attributed)
            {
                quoted.push((&c.span, c.attributed));
            }
        }
        for (span, attributed) in quoted {
            let how = if attributed {
                " (attributed by overlap)"
            } else {
                ""
            };
            out.push_str(&format!("      \"{span}\"{how}\n"));
        }
    }
    out
}

/// The answer's sources, figures and (with `--trace`) trace, or all of it as JSON.
fn print_result(a: &AskArgs, r: &AskResult) -> Result<()> {
    if a.json {
        let v = serde_json::json!({
            "answer": r.answer, "flow": r.flow, "status": r.status, "error": r.error,
            "generated_tokens": r.generated_tokens, "took_ms": r.took_us as f64 / 1e3,
            "dropped_citations": r.dropped_citations,
            "citations": r.citations.iter().map(|c| serde_json::json!({
                "number": c.number, "chunk_id": c.chunk_id, "doc_id": c.doc_id, "title": c.title,
                "span": c.span, "attributed": c.attributed})).collect::<Vec<_>>(),
            "contexts": r.contexts.iter().map(|c| serde_json::json!({
                "number": c.number, "chunk_id": c.chunk_id, "doc_id": c.doc_id, "score": c.score})).collect::<Vec<_>>(),
            "trace": r.trace.iter().map(|s| serde_json::json!({
                "path": s.path, "op": s.op, "took_ms": s.took_us as f64 / 1e3, "branches": s.branches,
                "iteration": s.iteration, "decision": s.decision, "output": s.output, "error": s.error})).collect::<Vec<_>>(),
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        println!();
        if r.answer.is_empty() {
            println!("(flow {} generates no answer)", r.flow);
        }
        if !r.citations.is_empty() {
            println!("\nSources:");
            print!("{}", sources(&r.citations));
        } else if !r.contexts.is_empty() {
            println!("\nContexts (none cited):");
            for c in &r.contexts {
                println!(
                    "  [{}] {} ({}) {:.3}",
                    c.number, c.title, c.chunk_id, c.score
                );
            }
        }
        if r.dropped_citations > 0 {
            println!(
                "  ({} citation(s) to chunks that were not given were dropped)",
                r.dropped_citations
            );
        }
        println!(
            "\nflow {}: {} generated tokens in {:.1} s",
            r.flow,
            r.generated_tokens,
            r.took_us as f64 / 1e6
        );
        if a.trace {
            let mut t = Table::new();
            t.load_preset(UTF8_FULL_CONDENSED);
            t.set_header(["step", "op", "ms", "branches", "iter", "decision / output"]);
            for s in &r.trace {
                let what = if s.decision.is_empty() {
                    &s.output
                } else {
                    &s.decision
                };
                t.add_row(vec![
                    s.path.clone(),
                    s.op.clone(),
                    format!("{:.1}", s.took_us as f64 / 1e3),
                    s.branches.to_string(),
                    s.iteration.to_string(),
                    what.chars().take(90).collect(),
                ]);
            }
            println!("{t}");
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cite(number: u32, span: &str, attributed: bool) -> Citation {
        Citation {
            number,
            chunk_id: format!("doc.md#{number}"),
            title: format!("Doc {number}"),
            span: span.into(),
            attributed,
            ..Default::default()
        }
    }

    #[test]
    fn a_source_cited_twice_is_listed_once_with_each_distinct_span() {
        let out = sources(&[
            cite(3, "Raft keeps a replicated log.", true),
            cite(1, "A follower times out.", false),
            cite(3, "It elects a leader.", true),
            cite(3, "Raft keeps a replicated log.", true),
        ]);
        assert_eq!(
            out,
            "  [3] Doc 3 (doc.md#3)\n      \"Raft keeps a replicated log.\" (attributed by overlap)\n      \"It elects a leader.\" (attributed by overlap)\n  [1] Doc 1 (doc.md#1)\n      \"A follower times out.\"\n"
        );
    }
}
