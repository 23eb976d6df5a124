//! The RAG flow engine behind `Coordinator.Ask`: Modular RAG's operators and flow patterns
//! (linear, conditional, branching, loops) over this cluster's search and model worker.
//!
//! - `spec`: flows as data (serde structs), lowered to operators and validated (errors name
//!   the place).
//! - `ops`: the executor and the operators, one file per family behind the `Operator` trait.
//! - `run`: what one request shares (`Run`) and the context its steps read and write.
//! - `trace`: what each step's trace entry says it read and produced.
//! - `route`: keyword / semantic routing scores (eq. 19-22).
//! - `citations`: chunk-tagged prompts, citation parsing, validation and spans.
//! - `llm`: calls to the model worker under the request's token budget and deadline.

pub mod citations;
pub mod llm;
pub mod ops;
pub mod route;
pub mod run;
pub mod spec;
#[cfg(test)]
mod tests;
pub mod trace;

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use ragcluster_proto::v1::*;
use tokio::sync::mpsc;

use crate::catalog::Catalog;
use crate::error::{CoordError, Result};
use crate::limits::{
    MAX_ASK_TIMEOUT_MS, MAX_FLOW_TOP_K, MAX_HISTORY, MAX_QUESTION_BYTES, MAX_STEP_TOKENS,
};
use crate::read_token::ReadToken;
use run::{Ctx, Limits, Overrides, Run, Services};
use spec::{Flow, FlowSet};

/// The shipped example flows (one per pattern), used when no flow file is configured.
pub const EXAMPLE_FLOWS: &str = include_str!("../../flows/examples.toml");

/// The loaded flows and what the engine caches across requests.
pub struct Flows {
    pub set: Arc<FlowSet>,
    pub intents: Arc<route::IntentCache>,
}

impl Flows {
    /// Loads `path` (or the shipped examples); an invalid file stops the coordinator with the
    /// place of the problem.
    pub fn load(path: Option<&Path>) -> std::result::Result<Self, String> {
        let text = match path {
            Some(p) => std::fs::read_to_string(p).map_err(|e| format!("{}: {e}", p.display()))?,
            None => EXAMPLE_FLOWS.to_owned(),
        };
        let set = FlowSet::parse(&text).map_err(|e| match path {
            Some(p) => format!("{}: {e}", p.display()),
            None => e,
        })?;
        Ok(Self {
            set: Arc::new(set),
            intents: Default::default(),
        })
    }
}

type Events = mpsc::Receiver<std::result::Result<AskResponse, tonic::Status>>;

/// Checks an Ask request's per-call overrides against the caps.
pub fn overrides(o: &AskOverrides, max_tokens_cap: usize) -> Result<Overrides> {
    let mut out = Overrides::default();
    if let Some(k) = o.top_k {
        if !(1..=MAX_FLOW_TOP_K as u32).contains(&k) {
            return Err(CoordError::invalid(
                "overrides.top_k",
                format!("must be in [1, {MAX_FLOW_TOP_K}]"),
            ));
        }
        out.top_k = Some(k as usize);
    }
    if let Some(f) = &o.fusion {
        spec::parse_fusion(f, None, 60.0)
            .map_err(|e| CoordError::invalid("overrides.fusion", e))?;
        out.fusion = Some(f.clone());
    }
    if let Some(w) = o.dense_weight {
        if !(0.0..=1.0).contains(&w) {
            return Err(CoordError::invalid(
                "overrides.dense_weight",
                "must be in [0, 1]",
            ));
        }
        out.dense_weight = Some(w);
    }
    if let Some(m) = o.max_tokens {
        if m == 0 || m as usize > max_tokens_cap.min(MAX_STEP_TOKENS) {
            return Err(CoordError::invalid(
                "overrides.max_tokens",
                format!("must be in [1, {}]", max_tokens_cap.min(MAX_STEP_TOKENS)),
            ));
        }
        out.max_tokens = Some(m as usize);
    }
    if let Some(t) = o.temperature {
        if !(t.is_finite() && (0.0..=2.0).contains(&t)) {
            return Err(CoordError::invalid(
                "overrides.temperature",
                "must be in [0, 2]",
            ));
        }
        out.temperature = Some(t);
    }
    out.generate_model = o.generate_model.clone().filter(|m| !m.is_empty());
    out.rerank_model = o.rerank_model.clone().filter(|m| !m.is_empty());
    Ok(out)
}

/// Caps and defaults of Ask (`coordinator.ask_*`).
#[derive(Debug, Clone)]
pub struct AskOptions {
    pub timeout: Duration,
    pub max_generated_tokens: usize,
    pub max_branches: usize,
    pub max_iterations: usize,
}

/// Runs flows: the loaded flows and what every operator may call (search, shards, models,
/// tokenizer).
pub struct Engine {
    pub flows: Flows,
    pub catalog: Arc<Catalog>,
    pub services: Arc<Services>,
    pub opts: AskOptions,
}

impl Engine {
    /// Validates an Ask request and starts its flow; events arrive on the returned channel:
    /// answer tokens, then one `AskResult` (also when the flow fails, with the partial trace,
    /// followed by the error status).
    pub async fn ask(self: &Arc<Self>, r: AskRequest) -> Result<Events> {
        let info = self.catalog.get(&r.collection)?;
        let question = r.question.trim().to_owned();
        if question.is_empty() {
            return Err(CoordError::invalid("question", "is empty"));
        }
        if r.question.len() > MAX_QUESTION_BYTES {
            return Err(CoordError::invalid(
                "question",
                format!("is longer than {MAX_QUESTION_BYTES} bytes"),
            ));
        }
        let flow = self.flow_of(&r)?;
        let o = overrides(
            &r.overrides.clone().unwrap_or_default(),
            self.opts.max_generated_tokens,
        )?;
        let limits = self.limits(&r)?;
        let read_token = ReadToken::parse("read_token", &r.read_token, &info, &r.collection)?;
        if let Some(f) = &r.conditions {
            crate::schema::check_filter("conditions", f, &info)?;
        }
        self.check_models(&o).await?;
        let timeout = match r.timeout_ms {
            0 => self.opts.timeout,
            ms => Duration::from_millis(u64::from(ms)),
        };
        let (tx, rx) = mpsc::channel(256);
        let started = Instant::now();
        let run = Arc::new(Run {
            services: self.services.clone(),
            info,
            question: question.clone(),
            history: r.history,
            overrides: o,
            tokens_left: AtomicI64::new(limits.max_generated_tokens as i64),
            limits,
            flows: self.flows.set.clone(),
            intents: self.flows.intents.clone(),
            trace: Default::default(),
            generated: AtomicU64::new(0),
            streamed: AtomicBool::new(false),
            sink: Some(tx.clone()),
            started,
            deadline: started + timeout,
            read_token,
            conditions: r.conditions,
        });
        tokio::spawn(drive(run, flow, question, timeout, tx));
        Ok(rx)
    }

    /// The request's flow: named, inline (parsed and checked against the loaded flows), or the
    /// collection's default.
    fn flow_of(&self, r: &AskRequest) -> Result<Flow> {
        let set = &self.flows.set;
        match (r.flow.is_empty(), r.inline_flow.is_empty()) {
            (false, false) => Err(CoordError::invalid(
                "inline_flow",
                "give either flow or inline_flow",
            )),
            (_, false) => {
                let v: toml::Value = r
                    .inline_flow
                    .parse::<toml::Table>()
                    .map(toml::Value::Table)
                    .map_err(|e| CoordError::invalid("inline_flow", e.to_string()))?;
                let f = spec::parse_flow("inline", &v)
                    .map_err(|e| CoordError::invalid("inline_flow", e))?;
                set.validate_inline(&f)
                    .map_err(|e| CoordError::invalid("inline_flow", e))?;
                Ok(f)
            }
            _ => Ok(set
                .resolve(&r.flow, &r.collection)
                .map_err(|e| CoordError::invalid("flow", e))?
                .clone()),
        }
    }

    /// The request's history and caps, checked; caps are the configured ones lowered by the
    /// request.
    fn limits(&self, r: &AskRequest) -> Result<Limits> {
        let cfg = &self.opts;
        if r.history.len() > MAX_HISTORY {
            return Err(CoordError::invalid(
                "history",
                format!("at most {MAX_HISTORY} turns"),
            ));
        }
        if let Some(i) = r
            .history
            .iter()
            .position(|m| m.role != "user" && m.role != "assistant")
        {
            return Err(CoordError::invalid(
                format!("history[{i}].role"),
                "must be \"user\" or \"assistant\"",
            ));
        }
        if r.timeout_ms > MAX_ASK_TIMEOUT_MS {
            return Err(CoordError::invalid(
                "timeout_ms",
                format!("must be at most {MAX_ASK_TIMEOUT_MS}"),
            ));
        }
        let max_generated_tokens = match r.max_generated_tokens {
            0 => cfg.max_generated_tokens,
            n if n as usize <= cfg.max_generated_tokens => n as usize,
            n => {
                return Err(CoordError::invalid(
                    "max_generated_tokens",
                    format!(
                        "{n} is above the coordinator's cap of {}",
                        cfg.max_generated_tokens
                    ),
                ));
            }
        };
        Ok(Limits {
            max_generated_tokens,
            max_branches: cap("max_branches", r.max_branches, cfg.max_branches)?,
            max_iterations: cap("max_iterations", r.max_iterations, cfg.max_iterations)?,
        })
    }

    /// Model overrides must name a model the worker serves for that kind of step.
    async fn check_models(&self, o: &Overrides) -> Result<()> {
        let wanted = [
            ("overrides.generate_model", "generate", &o.generate_model),
            ("overrides.rerank_model", "rerank", &o.rerank_model),
        ];
        if wanted.iter().all(|(_, _, m)| m.is_none()) {
            return Ok(());
        }
        let served = self.services.models.list(MODEL_LIST_TIMEOUT).await?;
        for (field, kind, model) in wanted {
            if let Some(m) = model
                && !served.iter().any(|s| s.kind == kind && s.name == *m)
            {
                let names: Vec<&str> = served
                    .iter()
                    .filter(|s| s.kind == kind)
                    .map(|s| s.name.as_str())
                    .collect();
                return Err(CoordError::invalid(
                    field,
                    format!(
                        "{m:?} is not a {kind} model of the model worker (it serves {names:?})"
                    ),
                ));
            }
        }
        Ok(())
    }
}

/// How long Ask waits for the model worker's model list when a request overrides a model.
const MODEL_LIST_TIMEOUT: Duration = Duration::from_secs(5);

/// A per-request cap: 0 takes the configured one, more than it is refused.
fn cap(field: &str, asked: u32, configured: usize) -> Result<usize> {
    match asked as usize {
        0 => Ok(configured),
        n if n <= configured => Ok(n),
        n => Err(CoordError::invalid(
            field,
            format!("{n} is above the coordinator's cap of {configured}"),
        )),
    }
}

/// Runs the flow to its end (or deadline) and sends the result; stops when the client goes.
async fn drive(
    run: Arc<Run>,
    flow: Flow,
    question: String,
    timeout: Duration,
    tx: mpsc::Sender<std::result::Result<AskResponse, tonic::Status>>,
) {
    let mut ctx = Ctx {
        query: question,
        widen: 1,
        ..Default::default()
    };
    let res = {
        let fut = ops::run_steps(&run, &flow.steps, &mut ctx, "", true);
        tokio::select! {
            r = tokio::time::timeout(timeout, fut) => match r {
                Err(_) => Err(CoordError::Deadline(format!("ask (flow {:?}, {} ms)", flow.name, timeout.as_millis()))),
                Ok(r) => r,
            },
            // The client went away: stop every operator (dropping the flow cancels model
            // worker streams and searches).
            _ = tx.closed() => return,
        }
    };
    let (result, err) = match res {
        Ok(()) => (finish(&run, &flow, &ctx, "ok"), None),
        Err(e) => {
            let status: tonic::Status = e.into();
            let mut r = finish(&run, &flow, &ctx, code_name(status.code()));
            r.error = status.message().to_owned();
            (r, Some(status))
        }
    };
    let label = result.status.clone();
    metrics::histogram!("coordinator_ask_seconds", "flow" => flow.name.clone(), "status" => label)
        .record(run.started.elapsed().as_secs_f64());
    let _ = tx
        .send(Ok(AskResponse {
            event: Some(ask_response::Event::Result(result)),
        }))
        .await;
    if let Some(s) = err {
        let _ = tx.send(Err(s)).await;
    }
}

/// gRPC's canonical name of a status code, in lower case ("deadline_exceeded").
pub fn code_name(c: tonic::Code) -> &'static str {
    use tonic::Code::*;
    match c {
        Ok => "ok",
        Cancelled => "cancelled",
        Unknown => "unknown",
        InvalidArgument => "invalid_argument",
        DeadlineExceeded => "deadline_exceeded",
        NotFound => "not_found",
        AlreadyExists => "already_exists",
        PermissionDenied => "permission_denied",
        ResourceExhausted => "resource_exhausted",
        FailedPrecondition => "failed_precondition",
        Aborted => "aborted",
        OutOfRange => "out_of_range",
        Unimplemented => "unimplemented",
        Internal => "internal",
        Unavailable => "unavailable",
        DataLoss => "data_loss",
        Unauthenticated => "unauthenticated",
    }
}

/// The final message: answer, validated citations, the contexts behind them and the trace.
fn finish(run: &Run, flow: &Flow, ctx: &Ctx, status: &str) -> AskResult {
    let answer = ctx
        .answer
        .as_ref()
        .map(|a| a.text.trim().to_owned())
        .unwrap_or_default();
    let contexts = if ctx.answer.is_some() {
        &ctx.contexts
    } else {
        &ctx.chunks
    };
    let (citations, dropped) = citations::extract(&answer, &run.question, contexts);
    if dropped > 0 {
        metrics::counter!("coordinator_ask_citations_dropped_total").increment(u64::from(dropped));
    }
    let generated = run.generated.load(Ordering::Acquire);
    metrics::counter!("coordinator_ask_generated_tokens_total").increment(generated);
    AskResult {
        answer,
        citations,
        dropped_citations: dropped,
        contexts: contexts
            .iter()
            .enumerate()
            .map(|(i, c)| AskContext {
                number: i as u32 + 1,
                chunk_id: c.chunk_id.clone(),
                doc_id: c.doc_id.clone(),
                title: c.title.clone(),
                section: c.section.clone(),
                text: c.text.clone(),
                score: c.score,
            })
            .collect(),
        trace: run.trace.lock().clone(),
        flow: flow.name.clone(),
        generated_tokens: generated as u32,
        took_us: run.started.elapsed().as_micros() as u64,
        status: status.to_owned(),
        error: String::new(),
    }
}
