//! Generation operators: the prompt, the generation, its verification and judgement.

use super::{At, Operator};
use super::{generate, make_prompt, run_steps};
use crate::error::CoordError;
use crate::error::Result;
use crate::flow::citations::render;
use crate::flow::llm;
use crate::flow::run::{Ctx, Note, Run};
use crate::flow::spec::Op;
use crate::flow::spec::{JudgeRule, Step};

pub struct Answering;

#[tonic::async_trait]
impl Operator for Answering {
    async fn run(&self, rt: &Run, op: &Op, at: At<'_>, ctx: &mut Ctx) -> Result<Note> {
        let mut note = Note::default();
        let (path, stream) = (at.path, at.stream);
        match op {
            Op::Verify {
                threshold,
                max_retries,
                widen,
                model,
            } => {
                let v = Verify {
                    threshold: *threshold,
                    max_retries: *max_retries,
                    widen: *widen,
                    model,
                };
                return verify(rt, at.steps, at.index, ctx, path, stream, v).await;
            }
            Op::Prompt {
                template,
                system,
                examples,
            } => {
                let p = make_prompt(rt, template, system, examples, &ctx.query, &ctx.chunks);
                ctx.prompt = Some(p);
            }
            Op::Generate(g) => {
                let p = ctx
                    .prompt
                    .clone()
                    .ok_or_else(|| CoordError::invalid("flow", "generate without a prompt"))?;
                let out = generate(rt, g, &p, stream.then_some(path)).await?;
                note.tokens = out.tokens.len() as u32;
                ctx.contexts = p.contexts;
                ctx.answer = Some(out);
            }
            Op::Judge {
                rule,
                threshold,
                model,
            } => {
                let (ok, why) = judge(rt, ctx, *rule, *threshold, model).await?;
                ctx.verdict = Some(ok);
                note.decision = why;
            }
            _ => {}
        }
        Ok(note)
    }
}

async fn judge(
    rt: &Run,
    ctx: &Ctx,
    rule: JudgeRule,
    threshold: f32,
    model: &str,
) -> Result<(bool, String)> {
    Ok(match rule {
        JudgeRule::MinTokenProb => {
            let a = ctx
                .answer
                .as_ref()
                .map(|a| a.logprobs.as_slice())
                .unwrap_or_default();
            let min = a.iter().map(|l| l.exp()).fold(1.0f32, f32::min);
            (
                min >= threshold,
                format!("min token probability {min:.3} vs {threshold}"),
            )
        }
        JudgeRule::MinScore => {
            let top = ctx.chunks.first().map_or(f32::NEG_INFINITY, |c| c.score);
            (
                top >= threshold,
                format!("top chunk score {top:.3} vs {threshold}"),
            )
        }
        JudgeRule::Llm => {
            let a = ctx
                .answer
                .as_ref()
                .map(|a| a.text.as_str())
                .unwrap_or_default();
            let p = llm::yes_probability(
                rt,
                format!("Question: {}\nAnswer: {a}\n\nDoes the answer fully answer the question? Answer yes or no.", rt.question),
                model,
            )
            .await?;
            (p >= threshold, format!("P(yes) {p:.3} vs {threshold}"))
        }
    })
}

/// A verify step's settings.
struct Verify<'a> {
    threshold: f32,
    max_retries: usize,
    widen: usize,
    model: &'a str,
}

/// Judges the answer's support by its contexts; on failure reruns the steps from the last
/// retrieval with top_k widened, up to `max_retries` times.
async fn verify(
    rt: &Run,
    steps: &[Step],
    at: usize,
    ctx: &mut Ctx,
    path: &str,
    stream: bool,
    v: Verify<'_>,
) -> Result<Note> {
    let Verify {
        threshold,
        max_retries,
        widen,
        model,
    } = v;
    let from = steps[..at]
        .iter()
        .rposition(|s| matches!(s.op, Op::Retrieve(_)))
        .ok_or_else(|| CoordError::invalid("flow", "verify without retrieval"))?;
    let mut note = Note::default();
    let mut retries = 0;
    loop {
        let (contexts, _) = render(&ctx.contexts);
        let a = ctx
            .answer
            .as_ref()
            .map(|a| a.text.clone())
            .unwrap_or_default();
        let p = llm::yes_probability(
            rt,
            format!("{contexts}\n\nAnswer: {a}\n\nIs every statement of the answer supported by the chunks above? Answer yes or no."),
            model,
        )
        .await?;
        note.decision = format!("P(supported) {p:.3} vs {threshold} after {retries} retries");
        if p >= threshold || retries >= max_retries.min(rt.limits.max_iterations) {
            break;
        }
        retries += 1;
        ctx.widen = ctx.widen.max(1) * widen;
        run_steps(
            rt,
            &steps[from..at],
            ctx,
            &format!("{path}~{retries}/"),
            stream,
        )
        .await?;
    }
    note.iteration = retries as u32;
    ctx.verdict = None;
    Ok(note)
}
