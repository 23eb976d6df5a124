//! From the file's data (`file`) to operators: defaults filled, ranges and templates checked,
//! every error prefixed with its place (`flow "x", step 3 (rerank)`).

use super::file::{self, read};
use super::*;

/// The error of a step's value.
fn bad<T>(place: &str, msg: impl std::fmt::Display) -> SpecResult<T> {
    Err(format!("{place}: {msg}"))
}

fn int_in(
    place: &str,
    k: &str,
    v: Option<usize>,
    default: usize,
    lo: usize,
    hi: usize,
) -> SpecResult<usize> {
    let v = v.unwrap_or(default);
    if !(lo..=hi).contains(&v) {
        return bad(place, format!("{k} must be in [{lo}, {hi}], got {v}"));
    }
    Ok(v)
}

fn float_in(
    place: &str,
    k: &str,
    v: Option<f32>,
    default: f32,
    lo: f32,
    hi: f32,
) -> SpecResult<f32> {
    let v = v.unwrap_or(default);
    if !(v.is_finite() && (lo..=hi).contains(&v)) {
        return bad(place, format!("{k} must be in [{lo}, {hi}], got {v}"));
    }
    Ok(v)
}

/// A required bound in [1, max] (loops and recursion must say how far they may go).
fn bound(place: &str, k: &str, v: Option<usize>, max: usize, what: &str) -> SpecResult<usize> {
    match v {
        None => bad(place, format!("{what} needs {k} (its bound)")),
        Some(n) if (1..=max).contains(&n) => Ok(n),
        Some(n) => bad(place, format!("{k} must be in [1, {max}], got {n}")),
    }
}

/// One of a fixed set of names, mapped to its value; the error lists the choices.
fn choice<T: Copy>(
    place: &str,
    k: &str,
    v: Option<&str>,
    default: &str,
    options: &[(&str, T)],
) -> SpecResult<T> {
    let v = v.unwrap_or(default);
    match options.iter().find(|(name, _)| *name == v) {
        Some((_, t)) => Ok(*t),
        None => {
            let names: Vec<&str> = options.iter().map(|(n, _)| *n).collect();
            bad(place, format!("{k} {v:?}: use {}", names.join(", ")))
        }
    }
}

/// A prompt template whose placeholders must all be in `allowed`.
fn template(
    place: &str,
    k: &str,
    v: Option<&str>,
    default: &str,
    allowed: &[&str],
) -> SpecResult<String> {
    let t = v.unwrap_or(default);
    for name in placeholders(t) {
        if !allowed.contains(&name.as_str()) {
            let allowed: Vec<String> = allowed.iter().map(|a| format!("{{{a}}}")).collect();
            return bad(
                place,
                format!(
                    "{k}: unknown placeholder {{{name}}} (allowed: {})",
                    allowed.join(", ")
                ),
            );
        }
    }
    Ok(t.to_owned())
}

fn llm(
    place: &str,
    s: &file::LlmSpec,
    default: &str,
    allowed: &[&str],
    max_tokens: usize,
) -> SpecResult<LlmPrompt> {
    Ok(LlmPrompt {
        template: template(place, "template", s.template.as_deref(), default, allowed)?,
        system: s.system.clone().unwrap_or_default(),
        max_tokens: int_in(
            place,
            "max_tokens",
            s.max_tokens,
            max_tokens,
            1,
            MAX_STEP_TOKENS,
        )?,
        model: s.model.clone().unwrap_or_default(),
    })
}

fn generate(place: &str, s: &file::GenerateSpec, max_tokens: usize) -> SpecResult<GenerateParams> {
    let stop = match &s.stop {
        None => vec![DEFAULT_STOP.to_owned()],
        Some(v) if v.len() > 8 || v.iter().any(|x| x.is_empty() || x.len() > 64) => {
            return bad(place, "stop: at most 8 strings of 1 to 64 bytes");
        }
        Some(v) => v.clone(),
    };
    Ok(GenerateParams {
        max_tokens: int_in(
            place,
            "max_tokens",
            s.max_tokens,
            max_tokens,
            1,
            MAX_STEP_TOKENS,
        )?,
        temperature: float_in(place, "temperature", s.temperature, 0.0, 0.0, 2.0)?,
        model: s.model.clone().unwrap_or_default(),
        stop,
        yes_no: choice(
            place,
            "yes_no",
            s.yes_no.as_deref(),
            "off",
            &[
                ("off", YesNo::Off),
                ("start", YesNo::Start),
                ("calibrated", YesNo::Calibrated),
            ],
        )?,
    })
}

fn retrieve(place: &str, s: &file::RetrieveSpec, mode: Mode, top_k: usize) -> SpecResult<Retrieve> {
    let top_k = int_in(place, "top_k", s.top_k, top_k, 1, MAX_TOP_K)?;
    let fusion_name = s.fusion.clone().unwrap_or_else(|| "dbsf".into());
    if let Some(w) = s.dense_weight
        && !(0.0..=1.0).contains(&w)
    {
        return bad(place, format!("dense_weight must be in [0, 1], got {w}"));
    }
    let k = float_in(place, "rrf_k", s.rrf_k, 60.0, 1.0, 10_000.0)?;
    let fusion = parse_fusion(&fusion_name, s.dense_weight, k).or_else(|e| bad(place, e))?;
    Ok(Retrieve {
        mode,
        top_k,
        fusion,
        fusion_name,
        dense_weight: s.dense_weight,
        filter: s.filter.clone().unwrap_or_default(),
    })
}

/// The steps of a flow (or of a control operator at `prefix`).
fn steps(flow: &str, prefix: &str, v: &toml::Value) -> SpecResult<Vec<Step>> {
    let arr = v
        .as_array()
        .ok_or_else(|| format!("flow {flow:?}{prefix}: steps must be a list of tables"))?;
    if arr.is_empty() {
        return Err(format!("flow {flow:?}{prefix}: steps is empty"));
    }
    arr.iter()
        .enumerate()
        .map(|(i, s)| step(flow, &format!("{prefix}, step {}", i + 1), s))
        .collect()
}

/// The nested steps of a control operator.
fn nested(
    flow: &str,
    at: &str,
    op: &str,
    place: &str,
    v: Option<&toml::Value>,
) -> SpecResult<Vec<Step>> {
    match v {
        Some(s) => steps(flow, &format!("{at} ({op})"), s),
        None => bad(place, "missing steps"),
    }
}

fn step(flow: &str, at: &str, v: &toml::Value) -> SpecResult<Step> {
    let t = v
        .as_table()
        .ok_or_else(|| format!("flow {flow:?}{at}: a step must be a table with an \"op\""))?;
    let op = t
        .get("op")
        .and_then(|o| o.as_str())
        .ok_or_else(|| format!("flow {flow:?}{at}: missing \"op\""))?;
    let place = format!("flow {flow:?}{at} ({op})");
    let op = match op {
        "noop" | "rewrite" | "hyde" | "multi_query" | "decompose" | "step_back" => {
            query_op(&place, op, t)?
        }
        "bm25" | "dense" | "hybrid" | "rerank" | "mmr" | "prev_next" | "threshold" | "compress"
        | "reorder" => chunk_op(&place, op, t)?,
        "prompt" | "generate" | "verify" | "judge" | "fuse" | "active" => answer_op(&place, op, t)?,
        "route" | "branch" | "loop" | "recurse" => control_op(flow, at, &place, op, t)?,
        other => {
            return bad(
                &place,
                format!(
                    "unknown operator {other:?} (operators: {})",
                    OPERATORS.join(", ")
                ),
            );
        }
    };
    Ok(Step { op, place })
}

/// Pre-retrieval operators: query transforms.
fn query_op(place: &str, op: &str, t: &toml::Table) -> SpecResult<Op> {
    let q = &["query", "question"];
    let qn = &["query", "question", "n"];
    let queries = |s: file::QueriesSpec, default: &str| -> SpecResult<(LlmPrompt, usize)> {
        let n = int_in(place, "n", s.n, 3, 1, MAX_BRANCHES)?;
        Ok((llm(place, &s.llm(), default, qn, 96)?, n))
    };
    Ok(match op {
        "noop" => {
            read::<file::NoopSpec>(place, t, "op")?;
            Op::Noop
        }
        "rewrite" => Op::Rewrite(llm(place, &read(place, t, "op")?, REWRITE, q, 64)?),
        "hyde" => Op::Hyde(llm(place, &read(place, t, "op")?, HYDE, q, 128)?),
        "multi_query" => {
            let (llm, n) = queries(read(place, t, "op")?, MULTI_QUERY)?;
            Op::MultiQuery { llm, n }
        }
        "decompose" => {
            let (llm, n) = queries(read(place, t, "op")?, DECOMPOSE)?;
            Op::Decompose { llm, n }
        }
        _ => Op::StepBack(llm(place, &read(place, t, "op")?, STEP_BACK, q, 48)?),
    })
}

/// Retrieval and post-retrieval operators over chunks.
fn chunk_op(place: &str, op: &str, t: &toml::Table) -> SpecResult<Op> {
    Ok(match op {
        "bm25" => Op::Retrieve(retrieve(place, &read(place, t, "op")?, Mode::Bm25, 5)?),
        "dense" => Op::Retrieve(retrieve(place, &read(place, t, "op")?, Mode::Dense, 5)?),
        "hybrid" => Op::Retrieve(retrieve(place, &read(place, t, "op")?, Mode::Hybrid, 5)?),
        "rerank" => {
            let s: file::RerankSpec = read(place, t, "op")?;
            if s.min_score.is_some_and(|m| !m.is_finite()) {
                return bad(place, "min_score must be a finite number");
            }
            Op::Rerank {
                model: s.model.unwrap_or_default(),
                keep: int_in(place, "keep", s.keep, 5, 1, MAX_TOP_K)?,
                min_score: s.min_score,
                blend: s
                    .blend
                    .map(|b| float_in(place, "blend", Some(b), 1.0, 0.0, 1.0))
                    .transpose()?,
            }
        }
        "mmr" => {
            let s: file::MmrSpec = read(place, t, "op")?;
            Op::Mmr {
                lambda: float_in(place, "lambda", s.lambda, 0.7, 0.0, 1.0)?,
                keep: int_in(place, "keep", s.keep, 5, 1, MAX_TOP_K)?,
            }
        }
        "prev_next" => {
            let s: file::PrevNextSpec = read(place, t, "op")?;
            Op::PrevNext {
                before: int_in(place, "before", s.before, 1, 0, 5)? as u32,
                after: int_in(place, "after", s.after, 1, 0, 5)? as u32,
            }
        }
        "threshold" => threshold(place, read(place, t, "op")?)?,
        "compress" => {
            let s: file::CompressSpec = read(place, t, "op")?;
            Op::Compress {
                budget_tokens: int_in(place, "budget_tokens", s.budget_tokens, 256, 16, 4096)?,
            }
        }
        _ => {
            let s: file::ReorderSpec = read(place, t, "op")?;
            Op::Reorder(choice(
                place,
                "mode",
                s.mode.as_deref(),
                "long_context",
                &[
                    ("long_context", ReorderMode::LongContext),
                    ("best_last", ReorderMode::BestLast),
                    ("best_first", ReorderMode::BestFirst),
                ],
            )?)
        }
    })
}

fn threshold(place: &str, s: file::ThresholdSpec) -> SpecResult<Op> {
    if let Some(f) = s.keep_fraction
        && !(f > 0.0 && f <= 1.0)
    {
        return bad(place, format!("keep_fraction must be in (0, 1], got {f}"));
    }
    if s.keep == Some(0) {
        return bad(place, "keep must be at least 1");
    }
    if s.min_score.is_none() && s.keep_fraction.is_none() && s.keep.is_none() {
        return bad(place, "set at least one of min_score, keep_fraction, keep");
    }
    Ok(Op::Threshold {
        min_score: s.min_score,
        keep_fraction: s.keep_fraction,
        keep: s.keep,
    })
}

/// A prompt step's worked examples: at most `MAX_PROMPT_EXAMPLES`, each with a context, a
/// question and an answer of 1 to `MAX_EXAMPLE_FIELD_BYTES` bytes (`[]` asks none).
fn examples(place: &str, specs: Vec<file::ExampleSpec>) -> SpecResult<Vec<Example>> {
    if specs.len() > MAX_PROMPT_EXAMPLES {
        return bad(
            place,
            format!(
                "examples: at most {MAX_PROMPT_EXAMPLES}, got {}",
                specs.len()
            ),
        );
    }
    let mut out = Vec::with_capacity(specs.len());
    for (i, e) in specs.into_iter().enumerate() {
        let title = e.title.unwrap_or_default();
        for (k, v, required) in [
            ("title", &title, false),
            ("context", &e.context, true),
            ("question", &e.question, true),
            ("answer", &e.answer, true),
        ] {
            if (required && v.trim().is_empty()) || v.len() > MAX_EXAMPLE_FIELD_BYTES {
                return bad(
                    place,
                    format!("examples[{i}].{k}: 1 to {MAX_EXAMPLE_FIELD_BYTES} bytes of text"),
                );
            }
        }
        out.push(Example {
            title,
            context: e.context,
            question: e.question,
            answer: e.answer,
        });
    }
    Ok(out)
}

const CONTEXT_PLACEHOLDERS: &[&str] = &["contexts", "question", "query"];

/// Generation and judgement operators.
fn answer_op(place: &str, op: &str, t: &toml::Table) -> SpecResult<Op> {
    Ok(match op {
        "prompt" => {
            let s: file::PromptSpec = read(place, t, "op")?;
            let template = template(
                place,
                "template",
                s.template.as_deref(),
                DEFAULT_PROMPT,
                CONTEXT_PLACEHOLDERS,
            )?;
            let examples = examples(place, s.examples.unwrap_or_default())?;
            Op::Prompt {
                examples: example_turns(&template, &examples),
                template,
                system: s.system.unwrap_or_else(|| DEFAULT_SYSTEM.into()),
            }
        }
        "generate" => Op::Generate(generate(place, &read(place, t, "op")?, 128)?),
        "verify" => {
            let s: file::VerifySpec = read(place, t, "op")?;
            Op::Verify {
                threshold: float_in(place, "threshold", s.threshold, 0.5, 0.0, 1.0)?,
                max_retries: int_in(place, "max_retries", s.max_retries, 1, 0, MAX_ITERATIONS)?,
                widen: int_in(place, "widen", s.widen, 2, 1, 10)?,
                model: s.model.unwrap_or_default(),
            }
        }
        "judge" => {
            let s: file::JudgeSpec = read(place, t, "op")?;
            let rules = [
                ("min_token_prob", JudgeRule::MinTokenProb),
                ("min_score", JudgeRule::MinScore),
                ("llm", JudgeRule::Llm),
            ];
            Op::Judge {
                rule: choice(place, "rule", s.rule.as_deref(), "min_token_prob", &rules)?,
                threshold: float_in(place, "threshold", s.threshold, 0.3, -1e6, 1e6)?,
                model: s.model.unwrap_or_default(),
            }
        }
        "fuse" => {
            let s: file::FuseSpec = read(place, t, "op")?;
            let methods = [
                ("rrf", FuseMethod::Rrf),
                ("weighted", FuseMethod::Weighted),
                ("llm", FuseMethod::Llm),
                ("concat", FuseMethod::Concat),
            ];
            let allowed = &["contexts", "question", "query", "answers"];
            Op::Fuse {
                method: choice(place, "method", s.method.as_deref(), "rrf", &methods)?,
                k: float_in(place, "k", s.k, 60.0, 1.0, 10_000.0)?,
                template: template(place, "template", s.template.as_deref(), FUSE_LLM, allowed)?,
                generation: generate(place, &s.generate(), 128)?,
            }
        }
        _ => active(place, read(place, t, "op")?)?,
    })
}

fn active(place: &str, s: file::ActiveSpec) -> SpecResult<Op> {
    let modes = [
        ("bm25", Mode::Bm25),
        ("dense", Mode::Dense),
        ("hybrid", Mode::Hybrid),
    ];
    let mode = choice(place, "mode", s.mode.as_deref(), "hybrid", &modes)?;
    Ok(Op::Active {
        threshold: float_in(place, "threshold", s.threshold, 0.4, 0.0, 1.0)?,
        max_sentences: int_in(place, "max_sentences", s.max_sentences, 4, 1, 32)?,
        max_retrievals: int_in(
            place,
            "max_retrievals",
            s.max_retrievals,
            2,
            0,
            MAX_ITERATIONS,
        )?,
        sentence_tokens: int_in(place, "sentence_tokens", s.sentence_tokens, 48, 4, 256)?,
        retrieve: retrieve(place, &s.retrieve(), mode, 3)?,
        template: template(
            place,
            "template",
            s.template.as_deref(),
            DEFAULT_PROMPT,
            CONTEXT_PLACEHOLDERS,
        )?,
        system: s.system.clone().unwrap_or_else(|| DEFAULT_SYSTEM.into()),
        generation: generate(place, &s.generate(), 160)?,
    })
}

/// Control operators: routing, branches, loops, recursion.
fn control_op(flow: &str, at: &str, place: &str, op: &str, t: &toml::Table) -> SpecResult<Op> {
    Ok(match op {
        "route" => route(place, read(place, t, "op")?)?,
        "branch" => {
            let s: file::BranchSpec = read(place, t, "op")?;
            let overs = [
                ("queries", BranchOver::Queries),
                ("chunks", BranchOver::Chunks),
            ];
            let over = choice(place, "over", s.over.as_deref(), "", &overs)?;
            let max_branches = int_in(place, "max_branches", s.max_branches, 4, 1, MAX_BRANCHES)?;
            Op::Branch {
                over,
                max_branches,
                steps: nested(flow, at, "branch", place, s.steps.as_ref())?,
            }
        }
        "loop" => {
            let s: file::LoopSpec = read(place, t, "op")?;
            let max_iterations = bound(
                place,
                "max_iterations",
                s.max_iterations,
                MAX_ITERATIONS,
                "a loop",
            )?;
            Op::Loop {
                max_iterations,
                augment_query: s.augment_query.unwrap_or(true),
                steps: nested(flow, at, "loop", place, s.steps.as_ref())?,
            }
        }
        _ => {
            let s: file::RecurseSpec = read(place, t, "op")?;
            let max_depth = bound(place, "max_depth", s.max_depth, MAX_DEPTH, "recursion")?;
            let max_queries = int_in(place, "max_queries", s.max_queries, 4, 1, MAX_BRANCHES)?;
            let allowed = &["query", "question", "answer", "n"];
            Op::Recurse {
                max_depth,
                max_queries,
                llm: llm(place, &s.llm(), RECURSE, allowed, 64)?,
                steps: nested(flow, at, "recurse", place, s.steps.as_ref())?,
            }
        }
    })
}

fn route(place: &str, s: file::RouteSpec) -> SpecResult<Op> {
    let methods = [
        ("keyword", RouteMethod::Keyword),
        ("semantic", RouteMethod::Semantic),
        ("hybrid", RouteMethod::Hybrid),
        ("form", RouteMethod::Form),
    ];
    let method = choice(place, "method", s.method.as_deref(), "hybrid", &methods)?;
    let routes = match s.routes.as_ref().and_then(|r| r.as_array()) {
        Some(a) if !a.is_empty() => a
            .iter()
            .enumerate()
            .map(|(i, r)| route_target(&format!("{place}, route {}", i + 1), r, method))
            .collect::<SpecResult<Vec<_>>>()?,
        _ => {
            return bad(
                place,
                "routes must be a non-empty list of {flow, keywords, intents} (or {flow, form})",
            );
        }
    };
    Ok(Op::Route {
        method,
        alpha: float_in(place, "alpha", s.alpha, 0.5, 0.0, 1.0)?,
        temperature: float_in(place, "temperature", s.temperature, 0.1, 0.001, 10.0)?,
        default: s.default.unwrap_or_default(),
        routes,
    })
}

fn route_target(place: &str, v: &toml::Value, method: RouteMethod) -> SpecResult<RouteTarget> {
    let t = v
        .as_table()
        .ok_or_else(|| format!("{place}: must be a table"))?;
    let s: file::RouteTargetSpec = read(place, t, "")?;
    let flow = s.flow.unwrap_or_default();
    if flow.is_empty() {
        return bad(place, "missing flow");
    }
    // A form is the whole rule of method "form" and means nothing to the scoring methods:
    // refused where it would be ignored, required where it decides.
    let form = match (method, s.form.as_deref()) {
        (RouteMethod::Form, None) => return bad(place, "method \"form\" needs a form per route"),
        (RouteMethod::Form, f) => Some(choice(
            place,
            "form",
            f,
            "",
            &[
                ("yes_no", QuestionForm::YesNo),
                ("other", QuestionForm::Other),
            ],
        )?),
        (_, Some(_)) => return bad(place, "form is read by method = \"form\" only"),
        (_, None) => None,
    };
    if form.is_some() && !(s.keywords.is_empty() && s.intents.is_empty()) {
        return bad(place, "method \"form\" reads no keywords or intents");
    }
    Ok(RouteTarget {
        flow,
        keywords: s.keywords.iter().map(|k| k.to_lowercase()).collect(),
        intents: s.intents,
        form,
    })
}

/// Parses one flow from its TOML table (`description`, `steps`).
pub fn parse_flow(name: &str, v: &toml::Value) -> SpecResult<Flow> {
    let t = v
        .as_table()
        .ok_or_else(|| format!("flow {name:?}: must be a table with steps"))?;
    let f: file::FlowSpec = read(&format!("flow {name:?}"), t, "")?;
    let steps_value = f
        .steps
        .ok_or_else(|| format!("flow {name:?}: missing steps"))?;
    Ok(Flow {
        name: name.to_owned(),
        description: f.description,
        steps: steps(name, "", &steps_value)?,
    })
}

/// Reads a whole flow file (before the checks across flows).
pub(super) fn parse_file(text: &str) -> SpecResult<FlowSet> {
    let doc: toml::Table = text.parse().map_err(|e| format!("flow file: {e}"))?;
    let f: file::FileSpec = read("flow file", &doc, "")?;
    let mut set = FlowSet {
        default: f.default,
        collections: f.collections,
        ..Default::default()
    };
    for (name, v) in &f.flows {
        set.flows.insert(name.clone(), parse_flow(name, v)?);
    }
    Ok(set)
}
