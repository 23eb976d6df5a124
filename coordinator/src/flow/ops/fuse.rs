//! Fusion of branch results: RRF of their chunk lists, the weighted ensemble of eq. 23-24,
//! concatenation, or an LLM synthesis.

use std::collections::HashMap;

use super::{At, Operator};
use super::{emit_whole, generate};
use crate::error::CoordError;
use crate::error::Result;
use crate::flow::citations::{self, fill, render};
use crate::flow::run::{BranchOut, Generated, Passage, Prompt, sort_desc};
use crate::flow::run::{Ctx, Note, Run};
use crate::flow::spec::Op;
use crate::flow::spec::{DEFAULT_SYSTEM, FuseMethod, GenerateParams};

pub struct Fusing;

#[tonic::async_trait]
impl Operator for Fusing {
    async fn run(&self, rt: &Run, op: &Op, at: At<'_>, ctx: &mut Ctx) -> Result<Note> {
        let mut note = Note::default();
        let path = at.path;
        let stream = at.stream;
        if let Op::Fuse {
            method,
            k,
            template,
            generation,
        } = op
        {
            note.decision = fuse(
                rt,
                ctx,
                *method,
                *k,
                template,
                generation,
                stream.then_some(path),
            )
            .await?;
        }
        Ok(note)
    }
}

/// Union of the branches' contexts (first occurrence order) and, per branch, the map from its
/// own context numbers to the union's.
fn union_contexts(bs: &[BranchOut]) -> (Vec<Passage>, Vec<Vec<u32>>) {
    let mut all: Vec<Passage> = Vec::new();
    let mut maps = Vec::new();
    for b in bs {
        let mut m = Vec::new();
        for c in &b.contexts {
            let pos = match all.iter().position(|a| a.chunk_id == c.chunk_id) {
                Some(p) => p,
                None => {
                    all.push(c.clone());
                    all.len() - 1
                }
            };
            m.push(pos as u32 + 1);
        }
        maps.push(m);
    }
    (all, maps)
}

/// Merges `ctx.branches` by `method`; returns the trace's decision line.
async fn fuse(
    rt: &Run,
    ctx: &mut Ctx,
    method: FuseMethod,
    k: f32,
    template: &str,
    generation: &GenerateParams,
    stream: Option<&str>,
) -> Result<String> {
    let bs = std::mem::take(&mut ctx.branches);
    match method {
        FuseMethod::Rrf => Ok(fuse_rrf(ctx, &bs, k)),
        FuseMethod::Weighted => fuse_weighted(rt, ctx, &bs, stream).await,
        FuseMethod::Concat => Ok(fuse_concat(rt, ctx, &bs, stream).await),
        FuseMethod::Llm => fuse_llm(rt, ctx, &bs, template, generation, stream).await,
    }
}

/// Σ 1 / (k + rank) over the branches' chunk lists.
fn fuse_rrf(ctx: &mut Ctx, bs: &[BranchOut], k: f32) -> String {
    // Σ 1 / (k + rank) over the branches' lists.
    let mut acc: HashMap<String, (f32, Passage)> = HashMap::new();
    for b in bs {
        for (r, c) in b.chunks.iter().enumerate() {
            let e = acc.entry(c.chunk_id.clone()).or_insert((0.0, c.clone()));
            e.0 += 1.0 / (k + r as f32 + 1.0);
        }
    }
    let mut out: Vec<Passage> = acc
        .into_values()
        .map(|(s, p)| Passage { score: s, ..p })
        .collect();
    sort_desc(&mut out);
    let why = format!("rrf over {} lists -> {} chunks", bs.len(), out.len());
    ctx.chunks = out;
    why
}

/// Eq. 24: λ(d, q) = softmax of the branch documents' retrieval scores; eq. 23 weighs
/// p(y | d, q). Only y_d, generated from d, has a probability under d here (off-diagonal
/// terms would need forced decoding), so each candidate scores λ(d, q) · p(y_d | d, q) with p
/// the length-normalised sequence probability.
async fn fuse_weighted(
    rt: &Run,
    ctx: &mut Ctx,
    bs: &[BranchOut],
    stream: Option<&str>,
) -> Result<String> {
    let cands: Vec<&BranchOut> = bs.iter().filter(|b| b.answer.is_some()).collect();
    if cands.is_empty() {
        return Err(CoordError::invalid(
            "flow",
            "fuse weighted: no branch produced an answer",
        ));
    }
    let max = cands
        .iter()
        .map(|b| b.score)
        .fold(f32::NEG_INFINITY, f32::max);
    let z: f32 = cands.iter().map(|b| (b.score - max).exp()).sum();
    let scored: Vec<(f32, f32, f32)> = cands
        .iter()
        .map(|b| {
            let lambda = (b.score - max).exp() / z;
            let p = b.answer.as_ref().map_or(0.0, Generated::mean_prob);
            (lambda, p, lambda * p)
        })
        .collect();
    let best = scored
        .iter()
        .enumerate()
        .max_by(|a, b| a.1.2.total_cmp(&b.1.2))
        .map_or(0, |(i, _)| i);
    let b = cands[best];
    let a = b.answer.clone().unwrap_or_default();
    if let Some(step) = stream {
        emit_whole(rt, step, &a).await;
    }
    ctx.contexts = b.contexts.clone();
    ctx.chunks = bs.iter().flat_map(|b| b.contexts.clone()).collect();
    ctx.prompt = Some(Prompt {
        system: String::new(),
        user: String::new(),
        contexts: b.contexts.clone(),
        ..Default::default()
    });
    ctx.answer = Some(a);
    Ok(format!(
        "branch {} of {}: {}",
        best + 1,
        cands.len(),
        scored
            .iter()
            .map(|(l, p, s)| format!("λ {l:.3} · p {p:.3} = {s:.3}"))
            .collect::<Vec<_>>()
            .join("; ")
    ))
}

/// The branches' answers joined in order, their citations renumbered into the union of
/// their contexts.
async fn fuse_concat(rt: &Run, ctx: &mut Ctx, bs: &[BranchOut], stream: Option<&str>) -> String {
    let (all, maps) = union_contexts(bs);
    let mut text = String::new();
    let mut ans = Generated::default();
    for (b, m) in bs.iter().zip(&maps) {
        if let Some(a) = &b.answer {
            let t = citations::renumber(a.text.trim(), &|n| {
                m.get((n as usize).wrapping_sub(1)).copied()
            });
            if !text.is_empty() {
                text.push('\n');
            }
            text.push_str(&t);
            ans.logprobs.extend(&a.logprobs);
            ans.tokens.extend(a.tokens.iter().cloned());
        }
    }
    ans.text = text;
    if let Some(step) = stream {
        emit_whole(rt, step, &ans).await;
    }
    ctx.contexts = all.clone();
    ctx.chunks = all.clone();
    ctx.prompt = Some(Prompt {
        system: String::new(),
        user: String::new(),
        contexts: all,
        ..Default::default()
    });
    ctx.answer = Some(ans);
    format!("{} answers joined", bs.len())
}

/// An answer synthesised by the generator from the branches' answers and contexts.
async fn fuse_llm(
    rt: &Run,
    ctx: &mut Ctx,
    bs: &[BranchOut],
    template: &str,
    generation: &GenerateParams,
    stream: Option<&str>,
) -> Result<String> {
    let (all, maps) = union_contexts(bs);
    let (rendered, used) = render(&all);
    let answers: Vec<String> = bs
        .iter()
        .zip(&maps)
        .filter_map(|(b, m)| {
            let a = b.answer.as_ref()?;
            let t = citations::renumber(a.text.trim(), &|n| {
                m.get((n as usize).wrapping_sub(1)).copied()
            });
            Some(format!("- {}: {}", b.label, t))
        })
        .collect();
    let p = Prompt {
        system: DEFAULT_SYSTEM.to_owned(),
        user: fill(
            template,
            &[
                ("contexts", &rendered),
                ("answers", &answers.join("\n")),
                ("question", &rt.question),
                ("query", &ctx.query),
            ],
        ),
        contexts: all[..used].to_vec(),
        ..Default::default()
    };
    let out = generate(rt, generation, &p, stream).await?;
    ctx.contexts = p.contexts.clone();
    ctx.chunks = all;
    ctx.prompt = Some(p);
    ctx.answer = Some(out);
    Ok(format!("{} branch answers synthesised", answers.len()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(id: &str, score: f32) -> Passage {
        Passage::scored(id, score)
    }

    #[test]
    fn union_of_branch_contexts() {
        let b = |ids: &[&str]| BranchOut {
            contexts: ids.iter().map(|i| p(i, 0.0)).collect(),
            ..Default::default()
        };
        let (all, maps) = union_contexts(&[b(&["a", "b"]), b(&["b", "c"])]);
        assert_eq!(all.len(), 3);
        assert_eq!(maps, vec![vec![1, 2], vec![2, 3]]);
    }
}
