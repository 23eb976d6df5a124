//! Branching operators: parallel branches over query variants or chunks, and recursive
//! question decomposition (Algorithm 6).

use futures::future::join_all;

use super::{At, Operator};
use super::{llm_prompt, run_steps};
use crate::error::CoordError;
use crate::error::Result;
use crate::flow::llm;
use crate::flow::run::BranchOut;
use crate::flow::run::{Ctx, Note, Run};
use crate::flow::spec::Op;
use crate::flow::spec::{BranchOver, LlmPrompt, Step};

pub struct Branching;

#[tonic::async_trait]
impl Operator for Branching {
    async fn run(&self, rt: &Run, op: &Op, at: At<'_>, ctx: &mut Ctx) -> Result<Note> {
        let mut note = Note::default();
        let path = at.path;
        match op {
            Op::Branch {
                over,
                max_branches,
                steps,
            } => {
                note.branches = branch(rt, ctx, *over, *max_branches, steps, path).await? as u32;
            }
            Op::Recurse {
                max_depth,
                max_queries,
                llm: l,
                steps,
            } => {
                let (depth, why) =
                    recurse(rt, ctx, *max_depth, *max_queries, l, steps, path).await?;
                note.iteration = depth as u32;
                note.branches = ctx.branches.len() as u32;
                note.decision = why;
            }
            _ => {}
        }
        Ok(note)
    }
}

async fn branch(
    rt: &Run,
    ctx: &mut Ctx,
    over: BranchOver,
    max: usize,
    steps: &[Step],
    path: &str,
) -> Result<usize> {
    let cap = max.min(rt.limits.max_branches).max(1);
    let items: Vec<Ctx> = match over {
        BranchOver::Queries => {
            let qs = if ctx.queries.is_empty() {
                vec![ctx.query.clone()]
            } else {
                ctx.queries.clone()
            };
            qs.into_iter()
                .take(cap)
                .map(|q| Ctx {
                    query: q,
                    queries: Vec::new(),
                    branches: Vec::new(),
                    ..ctx.clone()
                })
                .collect()
        }
        BranchOver::Chunks => ctx
            .chunks
            .iter()
            .take(cap)
            .map(|c| Ctx {
                chunks: vec![c.clone()],
                branches: Vec::new(),
                ..ctx.clone()
            })
            .collect(),
    };
    let n = items.len();
    let runs = items.into_iter().enumerate().map(|(i, mut b)| async move {
        let at = format!("{path}[{}]/", i + 1);
        run_steps(rt, steps, &mut b, &at, false).await?;
        Ok::<_, CoordError>(b)
    });
    let mut outs = Vec::with_capacity(n);
    for (i, r) in join_all(runs).await.into_iter().enumerate() {
        let b = r?;
        let label = match over {
            BranchOver::Queries => b.query.clone(),
            BranchOver::Chunks => ctx.chunks[i].chunk_id.clone(),
        };
        outs.push(BranchOut {
            label,
            score: match over {
                BranchOver::Chunks => ctx.chunks[i].score,
                BranchOver::Queries => 0.0,
            },
            contexts: if b.answer.is_some() {
                b.contexts
            } else {
                Vec::new()
            },
            chunks: b.chunks,
            answer: b.answer,
        });
    }
    ctx.branches = outs;
    Ok(n)
}

/// Algorithm 6: answer every query of a level, derive follow-up queries from (q, D, Y), go
/// one level deeper, until no new query or `max_depth`.
async fn recurse(
    rt: &Run,
    ctx: &mut Ctx,
    max_depth: usize,
    max_queries: usize,
    l: &LlmPrompt,
    steps: &[Step],
    path: &str,
) -> Result<(usize, String)> {
    let cap = max_queries.min(rt.limits.max_branches).max(1);
    let mut level = vec![ctx.query.clone()];
    let mut seen: Vec<String> = level.clone();
    let mut all = Vec::new();
    let mut depth = 0;
    let mut why = format!("max_depth {max_depth} reached");
    while !level.is_empty() && depth < max_depth {
        depth += 1;
        let runs = level.iter().take(cap).enumerate().map(|(i, q)| {
            let mut b = Ctx {
                query: q.clone(),
                queries: Vec::new(),
                branches: Vec::new(),
                ..ctx.clone()
            };
            async move {
                let at = format!("{path}^{depth}[{}]/", i + 1);
                run_steps(rt, steps, &mut b, &at, false).await?;
                let a = b
                    .answer
                    .as_ref()
                    .map(|a| a.text.clone())
                    .unwrap_or_default();
                let more = if depth < max_depth {
                    let g = llm_prompt(rt, l, &b, &[("answer", &a), ("n", "2")]).await?;
                    llm::lines(&g.text, 2, std::slice::from_ref(&b.query))
                } else {
                    Vec::new()
                };
                Ok::<_, CoordError>((b, more))
            }
        });
        let mut next = Vec::new();
        for r in join_all(runs).await {
            let (b, more) = r?;
            for q in more {
                if !seen.iter().any(|s| s.eq_ignore_ascii_case(&q)) {
                    seen.push(q.clone());
                    next.push(q);
                }
            }
            all.push(BranchOut {
                label: b.query.clone(),
                chunks: b.chunks,
                contexts: b.contexts,
                answer: b.answer,
                score: 0.0,
            });
        }
        if next.is_empty() {
            why = format!("no new questions at depth {depth}");
        }
        level = next;
    }
    ctx.branches = all;
    Ok((depth, why))
}
