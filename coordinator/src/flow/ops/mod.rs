//! The executor and the operators, one file per family behind the `Operator` trait.
//!
//! The flow's steps read and write one context (`Ctx`: query, query variants, chunks, prompt,
//! answer, branch results, verdict). Control operators run nested steps: `branch` on cloned
//! contexts in parallel, `loop` until a judge accepts or its bound, `recurse` level by level
//! to its depth, `route` into another flow, `verify` back to the last retrieval with a wider
//! top_k. Every step leaves a trace entry (path, operator, input and output summaries, time,
//! branches, iterations, decisions) in a shared list, so a request cut by its deadline still
//! returns what ran.

mod active;
mod answer;
mod branch;
mod control;
mod fuse;
mod query;
mod retrieval;

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::time::Instant;

use ragcluster_common::prompt::{MAX_START_BIAS, YES_NO_STARTS, is_yes_no_question};
use ragcluster_proto::v1::{AskToken, ChatMessage, GenerateRequest, TraceStep};

use super::citations::{fill, render};
use super::llm;
use super::run::{Ctx, Generated, Note, Passage, Prompt, Run};
use super::spec::{GenerateParams, LlmPrompt, Op, Step, YesNo};
use super::trace::{input_summary, output_summary};
use crate::error::{CoordError, Result};

pub use retrieval::{reorder, retrieve};

/// Where a step runs: its step list and position (verify reruns earlier steps), its trace
/// path, and whether generation may stream to the client.
#[derive(Clone, Copy)]
pub struct At<'a> {
    pub steps: &'a [Step],
    pub index: usize,
    pub path: &'a str,
    pub stream: bool,
}

impl At<'_> {
    /// The step name generation streams under, when it may stream.
    pub fn stream_as(&self) -> Option<&str> {
        self.stream.then_some(self.path)
    }
}

/// One family of operators.
#[tonic::async_trait]
pub trait Operator: Send + Sync {
    /// Runs `op` (one of this family's) on `ctx`.
    async fn run(&self, rt: &Run, op: &Op, at: At<'_>, ctx: &mut Ctx) -> Result<Note>;
}

/// The family that runs `op`.
fn family(op: &Op) -> &'static dyn Operator {
    match op {
        Op::Noop | Op::Route { .. } | Op::Loop { .. } => &control::Control,
        Op::Rewrite(_)
        | Op::Hyde(_)
        | Op::MultiQuery { .. }
        | Op::Decompose { .. }
        | Op::StepBack(_) => &query::QueryTransforms,
        Op::Retrieve(_)
        | Op::Rerank { .. }
        | Op::Mmr { .. }
        | Op::PrevNext { .. }
        | Op::Threshold { .. }
        | Op::Compress { .. }
        | Op::Reorder(_) => &retrieval::Retrieval,
        Op::Prompt { .. } | Op::Generate(_) | Op::Verify { .. } | Op::Judge { .. } => {
            &answer::Answering
        }
        Op::Branch { .. } | Op::Recurse { .. } => &branch::Branching,
        Op::Fuse { .. } => &fuse::Fusing,
        Op::Active { .. } => &active::Active,
    }
}

type Fut<'a> = Pin<Box<dyn Future<Output = Result<()>> + Send + 'a>>;

/// Runs `steps` on `ctx`. `at` prefixes the steps' trace paths; `stream` lets generation
/// stream to the client (top level, loops, routes; not inside parallel branches).
pub fn run_steps<'a>(
    rt: &'a Run,
    steps: &'a [Step],
    ctx: &'a mut Ctx,
    at: &'a str,
    stream: bool,
) -> Fut<'a> {
    Box::pin(async move {
        for (i, step) in steps.iter().enumerate() {
            let path = format!("{at}{}", i + 1);
            if rt.left().is_zero() {
                return Err(CoordError::Deadline(format!(
                    "flow step {path} ({})",
                    step.op.name()
                )));
            }
            let input = input_summary(&step.op, ctx);
            let t0 = Instant::now();
            let before = rt.generated.load(Ordering::Acquire);
            let here = At {
                steps,
                index: i,
                path: &path,
                stream,
            };
            let (note, err) = match family(&step.op).run(rt, &step.op, here, ctx).await {
                Ok(n) => (n, None),
                Err(e) => (Note::default(), Some(e)),
            };
            rt.record(TraceStep {
                path: path.clone(),
                op: step.op.name().into(),
                input,
                output: if err.is_none() {
                    output_summary(&step.op, ctx)
                } else {
                    String::new()
                },
                started_us: t0.duration_since(rt.started).as_micros() as u64,
                took_us: t0.elapsed().as_micros() as u64,
                branches: note.branches,
                iteration: note.iteration,
                decision: note.decision,
                error: err.as_ref().map(|e| e.to_string()).unwrap_or_default(),
                tokens: note
                    .tokens
                    .max((rt.generated.load(Ordering::Acquire) - before) as u32),
            });
            if let Some(e) = err {
                return Err(e);
            }
        }
        Ok(())
    })
}

/// An operator's own LLM prompt, filled with the query, the question and `extra`.
pub async fn llm_prompt(
    rt: &Run,
    l: &LlmPrompt,
    ctx: &Ctx,
    extra: &[(&str, &str)],
) -> Result<Generated> {
    let mut vars = vec![
        ("query", ctx.query.as_str()),
        ("question", rt.question.as_str()),
    ];
    vars.extend_from_slice(extra);
    let model = rt
        .overrides
        .generate_model
        .clone()
        .unwrap_or_else(|| l.model.clone());
    llm::ask_llm(
        rt,
        fill(&l.template, &vars),
        &l.system,
        l.max_tokens,
        &model,
    )
    .await
}

/// The prompt of a generation step: the numbered contexts that fit, the question, the query,
/// after the step's worked examples (chat turns rendered when the flow was read).
pub fn make_prompt(
    rt: &Run,
    template: &str,
    system: &str,
    examples: &[ChatMessage],
    query: &str,
    chunks: &[Passage],
) -> Prompt {
    let (contexts, used) = render(chunks);
    let user = |contexts: &str| {
        fill(
            template,
            &[
                ("contexts", contexts),
                ("question", &rt.question),
                ("query", query),
            ],
        )
    };
    Prompt {
        system: system.to_owned(),
        examples: examples.to_vec(),
        user: user(&contexts),
        contexts: chunks[..used].to_vec(),
        bare: user(""),
    }
}

/// A generation step's request, with the request's overrides.
pub async fn generate(
    rt: &Run,
    g: &GenerateParams,
    p: &Prompt,
    stream: Option<&str>,
) -> Result<Generated> {
    let yes_no = g.yes_no != YesNo::Off && is_yes_no_question(&rt.question);
    let mut req = GenerateRequest {
        model: rt
            .overrides
            .generate_model
            .clone()
            .unwrap_or_else(|| g.model.clone()),
        prompt: p.user.clone(),
        system: p.system.clone(),
        max_tokens: rt.overrides.max_tokens.unwrap_or(g.max_tokens) as u32,
        temperature: rt.overrides.temperature.unwrap_or(g.temperature),
        history: p.examples.iter().chain(&rt.history).cloned().collect(),
        stop: g.stop.clone(),
        starts_with: if yes_no {
            YES_NO_STARTS.map(String::from).to_vec()
        } else {
            Vec::new()
        },
        ..Default::default()
    };
    if yes_no && g.yes_no == YesNo::Calibrated && !p.bare.is_empty() {
        // The model's leaning before it reads the contexts, subtracted from its pick.
        let prior = GenerateRequest {
            prompt: p.bare.clone(),
            max_tokens: 1,
            ..req.clone()
        };
        let prior = llm::generate(rt, prior, None).await?;
        if prior.start_logprobs.len() == req.starts_with.len() {
            req.starts_bias = prior
                .start_logprobs
                .iter()
                .map(|l| (-l).clamp(-MAX_START_BIAS, MAX_START_BIAS))
                .collect();
        }
    }
    llm::generate(rt, req, stream).await
}

/// Streams an answer that was produced without streaming (a branch's), as one event.
pub async fn emit_whole(rt: &Run, step: &str, a: &Generated) {
    rt.begin_answer(step).await;
    rt.emit_token(AskToken {
        text: a.text.clone(),
        logprob: a.logprobs.iter().sum(),
        step: step.to_owned(),
        restart: false,
    })
    .await;
}
