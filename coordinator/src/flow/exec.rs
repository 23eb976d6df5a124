//! Runs a validated flow for one Ask request.
//!
//! The flow's steps read and write one context (`Ctx`: query, query variants, chunks, prompt,
//! answer, branch results, verdict). Control operators run nested steps: `branch` on cloned
//! contexts in parallel, `loop` until a judge accepts or its bound, `recurse` level by level
//! to its depth, `route` into another flow, `verify` back to the last retrieval with a wider
//! top_k. Every step leaves a trace entry (path, operator, input and output summaries, time,
//! branches, iterations, decisions) in a shared list, so a request cut by its deadline still
//! returns what ran.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use futures::future::join_all;
use parking_lot::Mutex;
use ragcluster_proto::v1::*;
use tokio::sync::mpsc;

use super::citations::{self, fill, render};
use super::llm::{self, Generated};
use super::route;
use super::spec::*;
use crate::error::{CoordError, Result};
use crate::fusion::Fusion;
use crate::search;
use crate::shards::ReadPlan;

/// One retrieved passage as flows carry it.
#[derive(Debug, Clone, Default)]
pub struct Passage {
    pub chunk_id: String,
    pub doc_id: String,
    pub title: String,
    pub section: String,
    pub text: String,
    pub score: f32,
    pub shard: u32,
    pub position: u32,
}

impl From<search::Hit> for Passage {
    fn from(h: search::Hit) -> Self {
        Self {
            chunk_id: h.chunk_id,
            doc_id: h.doc_id,
            title: h.title,
            section: h.section,
            text: h.text,
            score: h.score,
            shard: h.shard,
            position: h.position,
        }
    }
}

#[derive(Debug, Clone)]
pub struct Prompt {
    pub system: String,
    pub user: String,
    /// The numbered contexts the prompt shows, in order (`[n]` = contexts[n - 1]).
    pub contexts: Vec<Passage>,
}

/// What one branch (or recursion node) produced.
#[derive(Debug, Clone, Default)]
pub struct BranchOut {
    pub label: String,
    pub chunks: Vec<Passage>,
    pub answer: Option<Generated>,
    pub contexts: Vec<Passage>,
    /// Retrieval score of the branch's chunk (post-retrieval branching), for eq. 24.
    pub score: f32,
}

#[derive(Debug, Clone, Default)]
pub struct Ctx {
    pub query: String,
    pub queries: Vec<String>,
    pub hyde: Option<String>,
    pub chunks: Vec<Passage>,
    pub prompt: Option<Prompt>,
    pub answer: Option<Generated>,
    /// Contexts behind the current answer (what its citations refer to).
    pub contexts: Vec<Passage>,
    pub branches: Vec<BranchOut>,
    pub verdict: Option<bool>,
    /// top_k multiplier set by `verify` when it widens retrieval.
    pub widen: usize,
}

/// Request-level settings that override the flow's own values.
#[derive(Debug, Clone, Default)]
pub struct Overrides {
    pub top_k: Option<usize>,
    pub fusion: Option<String>,
    pub dense_weight: Option<f32>,
    pub max_tokens: Option<usize>,
    pub temperature: Option<f32>,
    pub generate_model: Option<String>,
    pub rerank_model: Option<String>,
}

/// Per-request caps (config defaults, lowered by the request).
#[derive(Debug, Clone)]
pub struct Limits {
    pub max_generated_tokens: usize,
    pub max_branches: usize,
    pub max_iterations: usize,
}

type Sink = mpsc::Sender<std::result::Result<AskResponse, tonic::Status>>;

/// Everything one Ask request shares across its steps and branches.
pub struct Run {
    pub engine: Arc<super::Engine>,
    pub info: CollectionInfo,
    pub question: String,
    pub history: Vec<ChatMessage>,
    pub overrides: Overrides,
    pub limits: Limits,
    pub flows: Arc<FlowSet>,
    pub intents: Arc<route::IntentCache>,
    pub trace: Mutex<Vec<TraceStep>>,
    pub tokens_left: AtomicI64,
    pub generated: AtomicU64,
    pub streamed: AtomicBool,
    pub sink: Option<Sink>,
    pub started: Instant,
    pub deadline: Instant,
}

impl Run {
    /// Time left before the request's deadline.
    pub fn left(&self) -> Duration {
        self.deadline.saturating_duration_since(Instant::now())
    }

    pub async fn emit_token(&self, t: AskToken) {
        if let Some(s) = &self.sink {
            let _ = s
                .send(Ok(AskResponse {
                    event: Some(ask_response::Event::Token(t)),
                }))
                .await;
        }
    }

    /// Called before a step streams a new answer: when an earlier answer was already
    /// streamed, the client gets a `restart` marker first.
    pub async fn begin_answer(&self, step: &str) {
        if self.streamed.swap(true, Ordering::AcqRel) {
            self.emit_token(AskToken {
                restart: true,
                step: step.to_owned(),
                ..Default::default()
            })
            .await;
        }
    }

    fn record(&self, t: TraceStep) {
        let op = t.op.clone();
        metrics::histogram!("coordinator_ask_operator_seconds", "op" => op)
            .record(t.took_us as f64 / 1e6);
        self.trace.lock().push(t);
    }
}

type Fut<'a> = Pin<Box<dyn Future<Output = Result<()>> + Send + 'a>>;

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
fn input_summary(op: &Op, ctx: &Ctx) -> String {
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
fn output_summary(op: &Op, ctx: &Ctx) -> String {
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

/// Extra facts a step reports into its trace entry.
#[derive(Default)]
struct Note {
    branches: u32,
    iteration: u32,
    decision: String,
    tokens: u32,
}

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
            let r = match &step.op {
                Op::Verify {
                    threshold,
                    max_retries,
                    widen,
                    model,
                } => {
                    verify(
                        rt,
                        steps,
                        i,
                        ctx,
                        &path,
                        stream,
                        *threshold,
                        *max_retries,
                        *widen,
                        model,
                    )
                    .await
                }
                op => run_op(rt, op, ctx, &path, stream).await,
            };
            let (note, err) = match r {
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

async fn run_op(rt: &Run, op: &Op, ctx: &mut Ctx, path: &str, stream: bool) -> Result<Note> {
    let mut note = Note::default();
    match op {
        Op::Noop => {}
        Op::Rewrite(l) => {
            let g = llm_prompt(rt, l, ctx, &[]).await?;
            if let Some(q) = llm::one_line(&g.text) {
                ctx.query = q;
            }
        }
        Op::Hyde(l) => {
            let g = llm_prompt(rt, l, ctx, &[]).await?;
            ctx.hyde = Some(g.text.trim().to_owned()).filter(|t| !t.is_empty());
        }
        Op::MultiQuery { llm: l, n } => {
            let g = llm_prompt(rt, l, ctx, &[("n", &n.to_string())]).await?;
            let mut qs = vec![ctx.query.clone()];
            qs.extend(llm::lines(&g.text, *n, &qs.clone()));
            ctx.queries = qs;
        }
        Op::Decompose { llm: l, n } => {
            let g = llm_prompt(rt, l, ctx, &[("n", &n.to_string())]).await?;
            let subs = llm::lines(&g.text, *n, std::slice::from_ref(&ctx.query));
            ctx.queries = if subs.is_empty() {
                vec![ctx.query.clone()]
            } else {
                subs
            };
        }
        Op::StepBack(l) => {
            let g = llm_prompt(rt, l, ctx, &[]).await?;
            ctx.queries = vec![ctx.query.clone()];
            if let Some(q) = llm::one_line(&g.text) {
                ctx.queries.push(q);
            }
        }
        Op::Retrieve(r) => {
            ctx.chunks = retrieve(rt, r, &ctx.query, ctx.hyde.as_deref(), ctx.widen).await?;
        }
        Op::Rerank {
            model,
            keep,
            min_score,
        } => {
            if !ctx.chunks.is_empty() {
                let model = rt
                    .overrides
                    .rerank_model
                    .clone()
                    .unwrap_or_else(|| model.clone());
                let texts = ctx.chunks.iter().map(|c| c.text.clone()).collect();
                let scores = llm::rerank(rt, &model, &ctx.query, texts).await?;
                for (c, s) in ctx.chunks.iter_mut().zip(scores) {
                    c.score = s;
                }
                sort_desc(&mut ctx.chunks);
                if let Some(m) = min_score {
                    ctx.chunks.retain(|c| c.score >= *m);
                }
                ctx.chunks.truncate(*keep);
            }
        }
        Op::Mmr { lambda, keep } => {
            ctx.chunks = mmr(
                rt,
                &ctx.query,
                std::mem::take(&mut ctx.chunks),
                *lambda,
                *keep,
            )
            .await?;
        }
        Op::PrevNext { before, after } => {
            ctx.chunks = prev_next(rt, std::mem::take(&mut ctx.chunks), *before, *after).await?;
        }
        Op::Threshold {
            min_score,
            keep_fraction,
            keep,
        } => {
            sort_desc(&mut ctx.chunks);
            if let Some(m) = min_score {
                ctx.chunks.retain(|c| c.score >= *m);
            }
            if let Some(f) = keep_fraction {
                let n = ((ctx.chunks.len() as f32) * f).ceil().max(1.0) as usize;
                ctx.chunks.truncate(n);
            }
            if let Some(k) = keep {
                ctx.chunks.truncate(*k);
            }
        }
        Op::Compress { budget_tokens } => {
            ctx.chunks = compress(
                rt,
                &ctx.query,
                std::mem::take(&mut ctx.chunks),
                *budget_tokens,
            )
            .await?;
        }
        Op::Reorder(m) => reorder(&mut ctx.chunks, *m),
        Op::Prompt { template, system } => {
            ctx.prompt = Some(make_prompt(rt, template, system, &ctx.query, &ctx.chunks));
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
        Op::Verify { .. } => unreachable_verify()?,
        Op::Route {
            method,
            alpha,
            temperature,
            routes,
            default,
        } => {
            let (flow, why) = route::choose(
                rt,
                &ctx.query,
                *method,
                *alpha,
                *temperature,
                routes,
                default,
            )
            .await?;
            note.decision = why;
            let f = rt.flows.flows.get(&flow).ok_or_else(|| {
                CoordError::invalid("flow", format!("route target {flow:?} is gone"))
            })?;
            run_steps(rt, &f.steps, ctx, &format!("{path}/{flow}:"), stream).await?;
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
        Op::Fuse {
            method,
            k,
            template,
            generation,
        } => {
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
        Op::Branch {
            over,
            max_branches,
            steps,
        } => {
            note.branches = branch(rt, ctx, *over, *max_branches, steps, path).await? as u32;
        }
        Op::Loop {
            max_iterations,
            augment_query,
            steps,
        } => {
            let bound = (*max_iterations).min(rt.limits.max_iterations).max(1);
            let mut it = 0;
            note.decision = format!("max_iterations {bound} reached");
            while it < bound {
                it += 1;
                if it > 1 && *augment_query {
                    // ITER-RETGEN: the next retrieval sees the question and the last answer.
                    if let Some(a) = &ctx.answer {
                        ctx.query = format!("{} {}", rt.question, a.text.trim());
                    }
                }
                ctx.verdict = None;
                run_steps(rt, steps, ctx, &format!("{path}#{it}/"), stream).await?;
                if ctx.verdict == Some(true) {
                    note.decision = format!("judge accepted at iteration {it}");
                    break;
                }
            }
            note.iteration = it as u32;
        }
        Op::Recurse {
            max_depth,
            max_queries,
            llm: l,
            steps,
        } => {
            let (depth, why) = recurse(rt, ctx, *max_depth, *max_queries, l, steps, path).await?;
            note.iteration = depth as u32;
            note.branches = ctx.branches.len() as u32;
            note.decision = why;
        }
        Op::Active {
            threshold,
            max_sentences,
            max_retrievals,
            sentence_tokens,
            retrieve: r,
            template,
            system,
            generation,
        } => {
            let (n, why) = active(
                rt,
                ctx,
                ActiveParams {
                    threshold: *threshold,
                    max_sentences: *max_sentences,
                    max_retrievals: *max_retrievals,
                    sentence_tokens: *sentence_tokens,
                    retrieve: r,
                    template,
                    system,
                    generation,
                },
                stream.then_some(path),
            )
            .await?;
            note.iteration = n as u32;
            note.decision = why;
        }
    }
    Ok(note)
}

/// `verify` runs in `run_steps` (it needs the step list); reaching it here is a bug.
fn unreachable_verify() -> Result<()> {
    Err(CoordError::invalid("flow", "verify outside a step list"))
}

fn sort_desc(c: &mut [Passage]) {
    c.sort_by(|a, b| {
        b.score
            .total_cmp(&a.score)
            .then_with(|| a.chunk_id.cmp(&b.chunk_id))
    });
}

async fn llm_prompt(
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

fn make_prompt(rt: &Run, template: &str, system: &str, query: &str, chunks: &[Passage]) -> Prompt {
    let (contexts, used) = render(chunks);
    Prompt {
        system: system.to_owned(),
        user: fill(
            template,
            &[
                ("contexts", &contexts),
                ("question", &rt.question),
                ("query", query),
            ],
        ),
        contexts: chunks[..used].to_vec(),
    }
}

async fn generate(
    rt: &Run,
    g: &GenerateParams,
    p: &Prompt,
    stream: Option<&str>,
) -> Result<Generated> {
    let req = GenerateRequest {
        model: rt
            .overrides
            .generate_model
            .clone()
            .unwrap_or_else(|| g.model.clone()),
        prompt: p.user.clone(),
        system: p.system.clone(),
        max_tokens: rt.overrides.max_tokens.unwrap_or(g.max_tokens) as u32,
        temperature: rt.overrides.temperature.unwrap_or(g.temperature),
        history: rt.history.clone(),
        stop: g.stop.clone(),
        ..Default::default()
    };
    llm::generate(rt, req, stream).await
}

/// One retrieval through the coordinator's own distributed search.
pub async fn retrieve(
    rt: &Run,
    r: &Retrieve,
    query: &str,
    hyde: Option<&str>,
    widen: usize,
) -> Result<Vec<Passage>> {
    let top_k = rt.overrides.top_k.unwrap_or(r.top_k) * widen.max(1);
    let (mode, fusion_name) = (
        r.mode,
        rt.overrides
            .fusion
            .clone()
            .unwrap_or_else(|| r.fusion_name.clone()),
    );
    // HyDE: the dense side searches with the hypothetical passage's embedding.
    let query_vector = match (hyde, mode) {
        (Some(h), Mode::Dense | Mode::Hybrid) => llm::embed(rt, vec![h.to_owned()])
            .await?
            .pop()
            .unwrap_or_default(),
        _ => Vec::new(),
    };
    // The step's fusion, or the request's override, as the search API would parse them.
    let rrf_k = match r.fusion {
        Fusion::Rrf { k } => k,
        _ => search::query::DEFAULT_RRF_K as f32,
    };
    let dense_weight = rt.overrides.dense_weight.or(r.dense_weight);
    let fusion = parse_fusion(&fusion_name, dense_weight, rrf_k)
        .map_err(|e| CoordError::invalid("overrides.fusion", e))?;
    let top_k = top_k.min(crate::limits::MAX_SEARCH_TOP_K as usize);
    let q = search::Query {
        collection: rt.info.name.clone(),
        text: query.to_owned(),
        vector: (!query_vector.is_empty()).then_some(query_vector),
        mode: match mode {
            Mode::Bm25 => search::Mode::Bm25,
            Mode::Dense => search::Mode::Dense,
            Mode::Hybrid => search::Mode::Hybrid,
        },
        fusion,
        top_k,
        candidates: if mode == Mode::Hybrid {
            top_k.max(search::query::DEFAULT_CANDIDATES as usize)
        } else {
            top_k
        },
        filter: r.filter.clone(),
        ef_search: 0,
        consistency: search::Consistency::Eventual,
        timeout: rt.left().max(Duration::from_millis(1)),
    };
    Ok(rt
        .engine
        .searcher
        .search(q)
        .await?
        .hits
        .into_iter()
        .map(Passage::from)
        .collect())
}

fn cosine(a: &[f32], b: &[f32]) -> f32 {
    let dot: f32 = a.iter().zip(b).map(|(x, y)| x * y).sum();
    let na = a.iter().map(|x| x * x).sum::<f32>().sqrt();
    let nb = b.iter().map(|x| x * x).sum::<f32>().sqrt();
    dot / (na * nb).max(1e-12)
}

/// An eventual read of the Ask's collection within what is left of its deadline.
fn read_plan(rt: &Run) -> ReadPlan<'_> {
    ReadPlan {
        collection: &rt.info.name,
        replicas: &rt.info.shards,
        consistency: Consistency::Eventual,
        deadline: rt.deadline,
    }
}

/// Stored embeddings of passages, read from their shards (no re-embedding).
async fn stored_vectors(rt: &Run, ps: &[Passage]) -> Result<HashMap<String, Vec<f32>>> {
    let mut by_shard: HashMap<u32, Vec<String>> = HashMap::new();
    for p in ps {
        by_shard
            .entry(p.shard)
            .or_default()
            .push(p.chunk_id.clone());
    }
    let plan = read_plan(rt);
    let plan = &plan;
    let shards = &rt.engine.shards;
    let loads = by_shard.into_iter().map(|(shard, ids)| async move {
        let nodes = plan
            .replicas
            .get(shard as usize)
            .map(|s| &s.nodes[..])
            .unwrap_or(&[]);
        let first = shards
            .routing()
            .read_target(plan.collection, shard, nodes, plan.consistency);
        shards.chunks(plan, shard, &first, ids, true).await
    });
    let mut out = HashMap::new();
    for r in join_all(loads).await {
        for c in r? {
            out.insert(c.chunk_id, c.embedding);
        }
    }
    Ok(out)
}

/// Maximal marginal relevance: λ·sim(q, d) − (1 − λ)·max sim(d, selected).
async fn mmr(
    rt: &Run,
    query: &str,
    ps: Vec<Passage>,
    lambda: f32,
    keep: usize,
) -> Result<Vec<Passage>> {
    if ps.len() <= 1 {
        return Ok(ps);
    }
    let q = llm::embed(rt, vec![query.to_owned()])
        .await?
        .pop()
        .unwrap_or_default();
    let vecs = stored_vectors(rt, &ps).await?;
    let v: Vec<&[f32]> = ps
        .iter()
        .map(|p| vecs.get(&p.chunk_id).map_or(&[][..], Vec::as_slice))
        .collect();
    let rel: Vec<f32> = v.iter().map(|d| cosine(&q, d)).collect();
    let mut chosen: Vec<usize> = Vec::new();
    let mut left: Vec<usize> = (0..ps.len()).collect();
    while chosen.len() < keep && !left.is_empty() {
        let (pos, _) = left
            .iter()
            .enumerate()
            .map(|(pos, &i)| {
                let red = chosen
                    .iter()
                    .map(|&j| cosine(v[i], v[j]))
                    .fold(f32::NEG_INFINITY, f32::max);
                let red = if chosen.is_empty() { 0.0 } else { red };
                (pos, lambda * rel[i] - (1.0 - lambda) * red)
            })
            .max_by(|a, b| a.1.total_cmp(&b.1))
            .unwrap_or((0, 0.0));
        chosen.push(left.remove(pos));
    }
    Ok(chosen
        .into_iter()
        .map(|i| Passage {
            score: rel[i],
            ..ps[i].clone()
        })
        .collect())
}

/// AutoRAG's prev-next augmenter: each passage is joined by its neighbours in the document
/// (previous ones before it, next ones after it), with its score; duplicates are skipped.
async fn prev_next(rt: &Run, ps: Vec<Passage>, before: u32, after: u32) -> Result<Vec<Passage>> {
    let plan = read_plan(rt);
    let plan = &plan;
    let loads = ps.iter().map(|p| {
        rt.engine
            .shards
            .neighbours(plan, p.shard, &p.chunk_id, before, after)
    });
    let results = join_all(loads).await;
    let mut seen = std::collections::HashSet::new();
    let mut out = Vec::new();
    for (p, r) in ps.iter().zip(results) {
        let mut group: Vec<Passage> = r?
            .into_iter()
            .map(|c| Passage {
                chunk_id: c.chunk_id,
                doc_id: c.doc_id,
                title: c.title,
                section: c.section,
                text: c.text,
                score: p.score,
                shard: p.shard,
                position: c.position,
            })
            .collect();
        if !group.iter().any(|g| g.chunk_id == p.chunk_id) {
            group.push(p.clone());
        }
        group.sort_by_key(|g| g.position);
        for g in group {
            if seen.insert(g.chunk_id.clone()) {
                out.push(g);
            }
        }
    }
    Ok(out)
}

/// Extractive compression: the sentences most similar to the query, within a token budget,
/// kept in document order; passages left without a sentence are dropped.
async fn compress(rt: &Run, query: &str, ps: Vec<Passage>, budget: usize) -> Result<Vec<Passage>> {
    use unicode_segmentation::UnicodeSegmentation;
    let mut sents: Vec<(usize, String)> = Vec::new();
    for (i, p) in ps.iter().enumerate() {
        for s in p.text.split_sentence_bounds() {
            if !s.trim().is_empty() {
                sents.push((i, s.to_owned()));
            }
        }
    }
    if sents.is_empty() {
        return Ok(ps);
    }
    sents.truncate(255);
    let mut texts = vec![query.to_owned()];
    texts.extend(sents.iter().map(|(_, s)| s.clone()));
    let vecs = llm::embed(rt, texts).await?;
    let mut order: Vec<(usize, f32)> = (0..sents.len())
        .map(|k| (k, cosine(&vecs[0], &vecs[k + 1])))
        .collect();
    order.sort_by(|a, b| b.1.total_cmp(&a.1));
    let mut keep = vec![false; sents.len()];
    let mut used = 0;
    for (k, _) in order {
        let n = rt.engine.tokens.spans(&sents[k].1).len();
        if used + n > budget && used > 0 {
            continue;
        }
        used += n;
        keep[k] = true;
    }
    let mut out = Vec::new();
    for (i, p) in ps.into_iter().enumerate() {
        let text: String = sents
            .iter()
            .zip(&keep)
            .filter(|((j, _), k)| *j == i && **k)
            .map(|((_, s), _)| s.as_str())
            .collect();
        if !text.trim().is_empty() {
            out.push(Passage {
                text: text.trim().to_owned(),
                ..p
            });
        }
    }
    Ok(out)
}

pub fn reorder(c: &mut Vec<Passage>, m: ReorderMode) {
    sort_desc(c);
    match m {
        ReorderMode::BestFirst => {}
        ReorderMode::BestLast => c.reverse(),
        ReorderMode::LongContext => {
            // Ranks 1, 3, 5, ... from the front, 2, 4, 6, ... from the back.
            let mut front = Vec::new();
            let mut back = Vec::new();
            for (i, p) in c.drain(..).enumerate() {
                if i % 2 == 0 {
                    front.push(p);
                } else {
                    back.push(p);
                }
            }
            back.reverse();
            front.extend(back);
            *c = front;
        }
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

#[allow(clippy::too_many_arguments)]
async fn verify(
    rt: &Run,
    steps: &[Step],
    at: usize,
    ctx: &mut Ctx,
    path: &str,
    stream: bool,
    threshold: f32,
    max_retries: usize,
    widen: usize,
    model: &str,
) -> Result<Note> {
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
        FuseMethod::Rrf => {
            // Σ 1 / (k + rank) over the branches' lists.
            let mut acc: HashMap<String, (f32, Passage)> = HashMap::new();
            for b in &bs {
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
            Ok(why)
        }
        FuseMethod::Weighted => {
            // Eq. 24: λ(d, q) = softmax of the branch documents' retrieval scores; eq. 23
            // weighs p(y | d, q). Only y_d, generated from d, has a probability under d here
            // (off-diagonal terms would need forced decoding), so each candidate scores
            // λ(d, q) · p(y_d | d, q) with p the length-normalised sequence probability.
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
        FuseMethod::Concat => {
            let (all, maps) = union_contexts(&bs);
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
            });
            ctx.answer = Some(ans);
            Ok(format!("{} answers joined", bs.len()))
        }
        FuseMethod::Llm => {
            let (all, maps) = union_contexts(&bs);
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
            };
            let out = generate(rt, generation, &p, stream).await?;
            ctx.contexts = p.contexts.clone();
            ctx.chunks = all;
            ctx.prompt = Some(p);
            ctx.answer = Some(out);
            Ok(format!("{} branch answers synthesised", answers.len()))
        }
    }
}

/// Streams an answer that was produced without streaming (a branch's), as one event.
async fn emit_whole(rt: &Run, step: &str, a: &Generated) {
    rt.begin_answer(step).await;
    rt.emit_token(AskToken {
        text: a.text.clone(),
        logprob: a.logprobs.iter().sum(),
        step: step.to_owned(),
        restart: false,
    })
    .await;
}

struct ActiveParams<'a> {
    threshold: f32,
    max_sentences: usize,
    max_retrievals: usize,
    sentence_tokens: usize,
    retrieve: &'a Retrieve,
    template: &'a str,
    system: &'a str,
    generation: &'a GenerateParams,
}

/// The first sentence of a generation: tokens up to and including the one that ends it.
fn first_sentence(g: &Generated) -> (usize, bool) {
    let mut text = String::new();
    for (i, t) in g.tokens.iter().enumerate() {
        text.push_str(t);
        let trimmed = text.trim_end();
        let ends = trimmed.ends_with(['.', '!', '?']) || (t.contains('\n') && !trimmed.is_empty());
        if ends && trimmed.len() > 1 {
            return (i + 1, false);
        }
    }
    (g.tokens.len(), true)
}

/// FLARE (active retrieval, Algorithm 7): generate the answer a sentence at a time, continuing
/// the accepted prefix; when a sentence has a token below `threshold`, retrieve with the
/// sentence's confident tokens (FLARE's masked query) and regenerate it with the new contexts.
async fn active(
    rt: &Run,
    ctx: &mut Ctx,
    p: ActiveParams<'_>,
    stream: Option<&str>,
) -> Result<(usize, String)> {
    let mut contexts = ctx.chunks.clone();
    let mut answer = Generated::default();
    let mut retrievals = 0;
    let mut sentences = 0;
    let mut log = Vec::new();
    let budget = rt.overrides.max_tokens.unwrap_or(p.generation.max_tokens);
    let model = rt
        .overrides
        .generate_model
        .clone()
        .unwrap_or_else(|| p.generation.model.clone());
    while sentences < p.max_sentences && answer.tokens.len() < budget {
        let prompt = make_prompt(rt, p.template, p.system, &ctx.query, &contexts);
        let ask = |prefix: String, prompt: &Prompt| GenerateRequest {
            model: model.clone(),
            prompt: prompt.user.clone(),
            system: prompt.system.clone(),
            max_tokens: p.sentence_tokens.min(budget - answer.tokens.len()).max(1) as u32,
            temperature: rt.overrides.temperature.unwrap_or(p.generation.temperature),
            history: rt.history.clone(),
            stop: p.generation.stop.clone(),
            assistant_prefix: prefix,
            ..Default::default()
        };
        let mut g = llm::generate(rt, ask(answer.text.clone(), &prompt), None).await?;
        let (mut n, mut done) = first_sentence(&g);
        if n == 0 {
            break;
        }
        let min = g.logprobs[..n]
            .iter()
            .map(|l| l.exp())
            .fold(1.0f32, f32::min);
        if min < p.threshold && retrievals < p.max_retrievals {
            // Masked query: the question plus the sentence's confident tokens.
            let confident: String = g.tokens[..n]
                .iter()
                .zip(&g.logprobs[..n])
                .filter(|(_, l)| l.exp() >= p.threshold)
                .map(|(t, _)| t.as_str())
                .collect();
            let q = format!("{} {}", rt.question, confident.trim());
            let found = retrieve(rt, p.retrieve, &q, None, 1).await?;
            retrievals += 1;
            for f in found {
                if !contexts.iter().any(|c| c.chunk_id == f.chunk_id) {
                    contexts.push(f);
                }
            }
            let prompt = make_prompt(rt, p.template, p.system, &ctx.query, &contexts);
            g = llm::generate(rt, ask(answer.text.clone(), &prompt), None).await?;
            (n, done) = first_sentence(&g);
            log.push(format!(
                "sentence {} below {} ({min:.3}): retrieved, regenerated",
                sentences + 1,
                p.threshold
            ));
            if n == 0 {
                break;
            }
        }
        let finished = g.finish == "stop" && n == g.tokens.len();
        for (t, l) in g.tokens[..n].iter().zip(&g.logprobs[..n]) {
            answer.text.push_str(t);
            answer.tokens.push(t.clone());
            answer.logprobs.push(*l);
            if let Some(step) = stream
                && !t.is_empty()
            {
                if sentences == 0 && answer.tokens.len() == 1 {
                    rt.begin_answer(step).await;
                }
                rt.emit_token(AskToken {
                    text: t.clone(),
                    logprob: *l,
                    step: step.to_owned(),
                    restart: false,
                })
                .await;
            }
        }
        sentences += 1;
        if done || finished {
            break;
        }
    }
    let (_, used) = render(&contexts);
    contexts.truncate(used);
    ctx.prompt = Some(make_prompt(rt, p.template, p.system, &ctx.query, &contexts));
    ctx.contexts = contexts;
    ctx.answer = Some(answer);
    let why = if log.is_empty() {
        format!("{sentences} sentences, all confident")
    } else {
        format!(
            "{sentences} sentences, {retrievals} retrievals: {}",
            log.join("; ")
        )
    };
    Ok((sentences, why))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(id: &str, score: f32) -> Passage {
        Passage {
            chunk_id: id.into(),
            score,
            ..Default::default()
        }
    }

    #[test]
    fn reorders() {
        let base: Vec<Passage> = (1..=5).map(|i| p(&i.to_string(), 1.0 / i as f32)).collect();
        let ids = |v: &[Passage]| {
            v.iter()
                .map(|c| c.chunk_id.clone())
                .collect::<Vec<_>>()
                .join("")
        };
        let mut c = base.clone();
        reorder(&mut c, ReorderMode::LongContext);
        assert_eq!(ids(&c), "13542");
        let mut c = base.clone();
        reorder(&mut c, ReorderMode::BestLast);
        assert_eq!(ids(&c), "54321");
    }

    #[test]
    fn sentences_of_a_generation() {
        let g = Generated {
            tokens: vec![
                "Paris".into(),
                " is".into(),
                " big".into(),
                ".".into(),
                " It".into(),
            ],
            logprobs: vec![0.0; 5],
            ..Default::default()
        };
        assert_eq!(first_sentence(&g), (4, false));
        let g = Generated {
            tokens: vec!["no".into(), " end".into()],
            logprobs: vec![0.0; 2],
            ..Default::default()
        };
        assert_eq!(first_sentence(&g), (2, true));
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
