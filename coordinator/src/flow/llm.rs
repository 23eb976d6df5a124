//! The flow engine's calls to the model worker: streamed generation under the request's
//! token budget and deadline, yes/no judgements, embeddings and reranking. An unreachable
//! worker is `UNAVAILABLE` (with a retry hint), so LLM operators fail cleanly while
//! retrieval-only flows go on.

use std::sync::atomic::Ordering;

use ragcluster_proto::v1::*;

use super::run::{Generated, Run};
use crate::error::{CoordError, Result};

/// Runs one generation. With `stream` set, every token goes to the client as it arrives
/// (preceded by a restart marker when an earlier answer was already streamed).
pub async fn generate(
    rt: &Run,
    mut req: GenerateRequest,
    stream: Option<&str>,
) -> Result<Generated> {
    // The request's budget of generated tokens, shared by every operator.
    let left = rt.tokens_left.load(Ordering::Acquire);
    if left <= 0 {
        return Err(CoordError::TooLarge {
            field: "max_generated_tokens".into(),
            reason: format!(
                "the flow used its budget of {} generated tokens",
                rt.limits.max_generated_tokens
            ),
        });
    }
    req.max_tokens = req.max_tokens.min(left as u32).max(1);
    let mut s = rt.services.models.generate(req, rt.left()).await?;
    if let Some(step) = stream {
        rt.begin_answer(step).await;
    }
    let mut out = Generated::default();
    loop {
        let next = match tokio::time::timeout(rt.left(), s.next()).await {
            Err(_) => return Err(CoordError::Deadline("model worker generation".into())),
            Ok(None) => break,
            // A stream cut at the Ask's deadline failed because of the deadline.
            Ok(Some(Err(_))) if rt.left().is_zero() => {
                return Err(CoordError::Deadline("model worker generation".into()));
            }
            Ok(Some(Err(e))) => return Err(CoordError::upstream("model worker", e)),
            Ok(Some(Ok(m))) => m,
        };
        if out.start_logprobs.is_empty() {
            out.start_logprobs = next.start_logprobs.clone();
        }
        out.text.push_str(&next.text);
        if !(next.finished && next.text.is_empty() && next.token_id == 0 && next.logprob == 0.0) {
            out.tokens.push(next.text.clone());
            out.logprobs.push(next.logprob);
        }
        if let Some(step) = stream
            && !next.text.is_empty()
        {
            rt.emit_token(AskToken {
                text: next.text.clone(),
                logprob: next.logprob,
                step: step.to_owned(),
                restart: false,
            })
            .await;
        }
        if next.finished {
            out.finish = next.finish_reason;
            out.completion_tokens = next.completion_tokens;
            break;
        }
    }
    let used = i64::from(out.completion_tokens.max(out.tokens.len() as u32));
    rt.tokens_left.fetch_sub(used, Ordering::AcqRel);
    rt.generated.fetch_add(used as u64, Ordering::AcqRel);
    Ok(out)
}

/// A plain (unstreamed) generation of a user prompt.
pub async fn ask_llm(
    rt: &Run,
    prompt: String,
    system: &str,
    max_tokens: usize,
    model: &str,
) -> Result<Generated> {
    generate(
        rt,
        GenerateRequest {
            model: model.to_owned(),
            prompt,
            system: system.to_owned(),
            max_tokens: max_tokens as u32,
            ..Default::default()
        },
        None,
    )
    .await
}

/// P(yes) of a yes/no question from the first generated token: its probability when it is
/// "yes", one minus it when it is "no", 0.5 when the model answers neither.
pub async fn yes_probability(rt: &Run, prompt: String, model: &str) -> Result<f32> {
    let g = ask_llm(rt, prompt, "Answer only yes or no.", 1, model).await?;
    let word = g.text.trim().to_lowercase();
    let p = g.logprobs.first().map_or(0.5, |l| l.exp());
    Ok(if word.starts_with("yes") {
        p
    } else if word.starts_with("no") {
        1.0 - p
    } else {
        0.5
    })
}

/// Embeds with the collection's model; `input` marks queries apart from documents (the task
/// prefix of models that have one).
pub async fn embed(rt: &Run, texts: Vec<String>, input: EmbedInput) -> Result<Vec<Vec<f32>>> {
    rt.services
        .models
        .embed(&rt.info.embedding_model, texts, input)
        .await
}

pub async fn rerank(rt: &Run, model: &str, query: &str, passages: Vec<String>) -> Result<Vec<f32>> {
    rt.services
        .models
        .rerank(model, query, passages, rt.left())
        .await
}

/// Lines of an LLM answer as a list: numbering, bullets and quotes removed, empty lines,
/// "NONE" and duplicates dropped, at most `n`.
pub fn lines(text: &str, n: usize, exclude: &[String]) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for l in text.lines() {
        let l = l
            .trim()
            .trim_start_matches(|c: char| {
                c.is_ascii_digit() || matches!(c, '.' | ')' | '-' | '*' | '•')
            })
            .trim()
            .trim_matches('"')
            .trim();
        // "Question: ..." / "Sub-question 2: ..." labels.
        let l = match l.split_once(':') {
            Some((head, rest)) if head.len() < 30 && head.to_lowercase().contains("question") => {
                rest.trim()
            }
            _ => l,
        };
        if l.len() < 3 || l.eq_ignore_ascii_case("none") || l.to_lowercase().starts_with("none") {
            continue;
        }
        let dup = |s: &String| s.eq_ignore_ascii_case(l);
        if out.iter().any(dup) || exclude.iter().any(dup) {
            continue;
        }
        out.push(l.to_owned());
        if out.len() == n {
            break;
        }
    }
    out
}

/// The first meaningful line of a one-line answer (a rewritten query, a step-back question),
/// with a leading label such as "Rewritten query:" removed.
pub fn one_line(text: &str) -> Option<String> {
    let l = text.lines().map(str::trim).find(|l| !l.is_empty())?;
    let l = match l.split_once(':') {
        Some((head, rest)) if head.len() < 30 && !rest.trim().is_empty() => rest.trim(),
        _ => l,
    };
    let l = l.trim_matches('"').trim();
    (l.len() >= 3).then(|| l.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn list_parsing() {
        let t = "1. What is Raft?\n2) How are leaders elected?\n- what is raft?\nNONE\n\n* \"Term numbers\"";
        assert_eq!(
            lines(t, 5, &[]),
            vec!["What is Raft?", "How are leaders elected?", "Term numbers"]
        );
        assert_eq!(
            lines(t, 1, &["what is raft?".into()]),
            vec!["How are leaders elected?"]
        );
        assert!(lines("None.", 3, &[]).is_empty());
        assert_eq!(
            lines(
                "Question: What is Raft?\nSub-question 2: Why?",
                3,
                &["what is raft?".into()]
            ),
            vec!["Why?"]
        );
        assert_eq!(
            one_line("\nRewritten query: \"raft leader election\"\nmore"),
            Some("raft leader election".into())
        );
        assert_eq!(one_line("  "), None);
    }
}
