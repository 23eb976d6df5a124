//! What the trace says a step read and produced.

use super::run::{Ctx, Passage};
use super::spec::{BranchOver, FuseMethod, Op};

fn clip(s: &str, n: usize) -> String {
    let s = s.trim().replace('\n', " ");
    if s.chars().count() <= n {
        s
    } else {
        format!("{}…", s.chars().take(n).collect::<String>())
    }
}

fn chunks_summary(c: &[Passage]) -> String {
    match c.first() {
        None => "0 chunks".into(),
        Some(f) => format!("{} chunks, top {} ({:.3})", c.len(), f.chunk_id, f.score),
    }
}

/// What a step reads, for the trace.
pub fn input_summary(op: &Op, ctx: &Ctx) -> String {
    match op {
        Op::Retrieve(_)
        | Op::Rewrite(_)
        | Op::Hyde(_)
        | Op::MultiQuery { .. }
        | Op::Decompose { .. }
        | Op::StepBack(_)
        | Op::Route { .. }
        | Op::Recurse { .. } => {
            format!("query: {}", clip(&ctx.query, 80))
        }
        Op::Generate(_) => ctx
            .prompt
            .as_ref()
            .map(|p| {
                format!(
                    "prompt with {} contexts, {} chars",
                    p.contexts.len(),
                    p.user.len()
                )
            })
            .unwrap_or_default(),
        Op::Verify { .. } | Op::Judge { .. } => ctx
            .answer
            .as_ref()
            .map(|a| format!("answer: {}", clip(&a.text, 60)))
            .unwrap_or_else(|| chunks_summary(&ctx.chunks)),
        Op::Fuse { .. } => format!("{} branches", ctx.branches.len()),
        Op::Branch {
            over: BranchOver::Queries,
            ..
        } => format!("{} queries", ctx.queries.len().max(1)),
        Op::Noop => String::new(),
        _ => chunks_summary(&ctx.chunks),
    }
}

/// What a step produced, for the trace.
pub fn output_summary(op: &Op, ctx: &Ctx) -> String {
    match op {
        Op::Rewrite(_) => format!("query: {}", clip(&ctx.query, 80)),
        Op::Hyde(_) => format!(
            "hypothetical passage: {}",
            clip(ctx.hyde.as_deref().unwrap_or(""), 80)
        ),
        Op::MultiQuery { .. } | Op::Decompose { .. } | Op::StepBack(_) => {
            format!(
                "{} queries: {}",
                ctx.queries.len(),
                clip(&ctx.queries.join(" | "), 120)
            )
        }
        Op::Prompt { .. } => ctx
            .prompt
            .as_ref()
            .map(|p| format!("{} contexts, {} chars", p.contexts.len(), p.user.len()))
            .unwrap_or_default(),
        Op::Generate(_) | Op::Active { .. } | Op::Verify { .. } => ctx
            .answer
            .as_ref()
            .map(|a| format!("answer ({} tokens): {}", a.tokens.len(), clip(&a.text, 80)))
            .unwrap_or_default(),
        Op::Judge { .. } => format!("verdict: {:?}", ctx.verdict),
        Op::Branch { .. } | Op::Recurse { .. } => format!("{} branch results", ctx.branches.len()),
        Op::Fuse {
            method: FuseMethod::Rrf,
            ..
        } => chunks_summary(&ctx.chunks),
        Op::Fuse { .. } | Op::Loop { .. } | Op::Route { .. } => match &ctx.answer {
            Some(a) => format!("answer: {}", clip(&a.text, 80)),
            None => chunks_summary(&ctx.chunks),
        },
        Op::Noop => String::new(),
        _ => chunks_summary(&ctx.chunks),
    }
}
