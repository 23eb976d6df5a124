//! Flow definitions: parsed from TOML and validated before anything runs.
//!
//! A flow is a list of operator steps; control operators hold nested steps (`branch`, `loop`,
//! `recurse`) or name other flows (`route`), so a flow file describes a graph of operators
//! whose only cycles are bounded loops. Validation names the place of every problem
//! (`flow "x", step 3 (rerank)`): unknown operators and keys, values out of range, an input
//! that no earlier step produces (e.g. `generate` without a `prompt`), unknown placeholders in
//! prompt templates, route targets that do not exist, and cycles between flows (route a -> b
//! -> a), which would have no loop bound.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use crate::fusion::Fusion;

pub use crate::limits::{
    MAX_FLOW_BRANCHES as MAX_BRANCHES, MAX_FLOW_DEPTH as MAX_DEPTH,
    MAX_FLOW_ITERATIONS as MAX_ITERATIONS, MAX_FLOW_TOP_K as MAX_TOP_K, MAX_STEP_TOKENS,
};

/// What a step reads and writes; validation tracks which are defined after each step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Slot {
    /// Query variants or sub-questions (multi_query, decompose, step_back).
    Queries,
    /// Retrieved passages.
    Chunks,
    /// A rendered prompt with its numbered contexts.
    Prompt,
    /// A generated answer.
    Answer,
    /// Results of parallel branches or recursion levels, waiting for `fuse`.
    Branches,
    /// A judge's verdict.
    Verdict,
}

impl Slot {
    fn name(self) -> &'static str {
        match self {
            Slot::Queries => "queries",
            Slot::Chunks => "chunks",
            Slot::Prompt => "prompt",
            Slot::Answer => "answer",
            Slot::Branches => "branches",
            Slot::Verdict => "verdict",
        }
    }
}

/// An LLM-backed query transform: prompt template (placeholders `{query}`, `{question}`)
/// and decoding limit.
#[derive(Debug, Clone)]
pub struct LlmPrompt {
    pub template: String,
    pub system: String,
    pub max_tokens: usize,
    pub model: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Bm25,
    Dense,
    Hybrid,
}

#[derive(Debug, Clone)]
pub struct Retrieve {
    pub mode: Mode,
    pub top_k: usize,
    pub fusion: Fusion,
    /// Raw fusion name and weight, for the search request.
    pub fusion_name: String,
    pub dense_weight: Option<f32>,
    pub filter: HashMap<String, String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReorderMode {
    /// "Lost in the middle": best first and last, weakest in the middle.
    LongContext,
    /// Best passage last, nearest the question (UniversalRAG).
    BestLast,
    BestFirst,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JudgeRule {
    /// Every answer token has probability >= threshold (FLARE-style confidence).
    MinTokenProb,
    /// The best chunk scores at least threshold.
    MinScore,
    /// The generator says the answer is complete and supported: P(yes) >= threshold.
    Llm,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FuseMethod {
    /// Chunk lists of the branches by reciprocal rank fusion.
    Rrf,
    /// Branch answers by the weighted ensemble of eq. 23-24.
    Weighted,
    /// Branch answers synthesised by the generator.
    Llm,
    /// Branch answers joined in order.
    Concat,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BranchOver {
    Queries,
    Chunks,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RouteMethod {
    Keyword,
    Semantic,
    Hybrid,
}

#[derive(Debug, Clone)]
pub struct RouteTarget {
    pub flow: String,
    pub keywords: Vec<String>,
    pub intents: Vec<String>,
}

#[derive(Debug, Clone)]
pub struct GenerateParams {
    pub max_tokens: usize,
    pub temperature: f32,
    pub model: String,
    /// Stop strings (at most 8), default `DEFAULT_STOP`.
    pub stop: Vec<String>,
}

#[derive(Debug, Clone)]
pub enum Op {
    /// Does nothing; measures the engine's own cost.
    Noop,
    Rewrite(LlmPrompt),
    Hyde(LlmPrompt),
    MultiQuery {
        llm: LlmPrompt,
        n: usize,
    },
    Decompose {
        llm: LlmPrompt,
        n: usize,
    },
    StepBack(LlmPrompt),
    Retrieve(Retrieve),
    Rerank {
        model: String,
        keep: usize,
        min_score: Option<f32>,
    },
    Mmr {
        lambda: f32,
        keep: usize,
    },
    PrevNext {
        before: u32,
        after: u32,
    },
    Threshold {
        min_score: Option<f32>,
        keep_fraction: Option<f32>,
        keep: Option<usize>,
    },
    Compress {
        budget_tokens: usize,
    },
    Reorder(ReorderMode),
    Prompt {
        template: String,
        system: String,
    },
    Generate(GenerateParams),
    Verify {
        threshold: f32,
        max_retries: usize,
        widen: usize,
        model: String,
    },
    Route {
        method: RouteMethod,
        alpha: f32,
        temperature: f32,
        routes: Vec<RouteTarget>,
        default: String,
    },
    Judge {
        rule: JudgeRule,
        threshold: f32,
        model: String,
    },
    Fuse {
        method: FuseMethod,
        k: f32,
        template: String,
        generation: GenerateParams,
    },
    Branch {
        over: BranchOver,
        max_branches: usize,
        steps: Vec<Step>,
    },
    Loop {
        max_iterations: usize,
        augment_query: bool,
        steps: Vec<Step>,
    },
    Recurse {
        max_depth: usize,
        max_queries: usize,
        llm: LlmPrompt,
        steps: Vec<Step>,
    },
    Active {
        threshold: f32,
        max_sentences: usize,
        max_retrievals: usize,
        sentence_tokens: usize,
        retrieve: Retrieve,
        template: String,
        system: String,
        generation: GenerateParams,
    },
}

impl Op {
    pub fn name(&self) -> &'static str {
        match self {
            Op::Noop => "noop",
            Op::Rewrite(_) => "rewrite",
            Op::Hyde(_) => "hyde",
            Op::MultiQuery { .. } => "multi_query",
            Op::Decompose { .. } => "decompose",
            Op::StepBack(_) => "step_back",
            Op::Retrieve(r) => match r.mode {
                Mode::Bm25 => "bm25",
                Mode::Dense => "dense",
                Mode::Hybrid => "hybrid",
            },
            Op::Rerank { .. } => "rerank",
            Op::Mmr { .. } => "mmr",
            Op::PrevNext { .. } => "prev_next",
            Op::Threshold { .. } => "threshold",
            Op::Compress { .. } => "compress",
            Op::Reorder(_) => "reorder",
            Op::Prompt { .. } => "prompt",
            Op::Generate(_) => "generate",
            Op::Verify { .. } => "verify",
            Op::Route { .. } => "route",
            Op::Judge { .. } => "judge",
            Op::Fuse { .. } => "fuse",
            Op::Branch { .. } => "branch",
            Op::Loop { .. } => "loop",
            Op::Recurse { .. } => "recurse",
            Op::Active { .. } => "active",
        }
    }

    /// True for operators that call the generator or the embedding model.
    pub fn uses_models(&self) -> bool {
        match self {
            Op::Noop | Op::PrevNext { .. } | Op::Threshold { .. } | Op::Reorder(_) => false,
            Op::Prompt { .. } => false,
            Op::Retrieve(r) => r.mode != Mode::Bm25,
            Op::Judge { rule, .. } => *rule == JudgeRule::Llm,
            Op::Fuse { method, .. } => *method == FuseMethod::Llm,
            Op::Branch { steps, .. } | Op::Loop { steps, .. } => {
                steps.iter().any(|s| s.op.uses_models())
            }
            _ => true,
        }
    }
}

#[derive(Debug, Clone)]
pub struct Step {
    pub op: Op,
    /// Where the step was declared, e.g. `flow "linear", step 3 (rerank)`.
    pub place: String,
}

#[derive(Debug, Clone)]
pub struct Flow {
    pub name: String,
    pub description: String,
    pub steps: Vec<Step>,
}

/// Every flow of a flow file, the default flow and per-collection defaults.
#[derive(Debug, Clone, Default)]
pub struct FlowSet {
    pub flows: BTreeMap<String, Flow>,
    pub default: String,
    pub collections: BTreeMap<String, String>,
}

pub type SpecResult<T> = Result<T, String>;

pub const OPERATORS: &[&str] = &[
    "noop",
    "rewrite",
    "hyde",
    "multi_query",
    "decompose",
    "step_back",
    "bm25",
    "dense",
    "hybrid",
    "rerank",
    "mmr",
    "prev_next",
    "threshold",
    "compress",
    "reorder",
    "prompt",
    "generate",
    "verify",
    "route",
    "judge",
    "fuse",
    "branch",
    "loop",
    "recurse",
    "active",
];

/// Context first, the instruction and question last: SmolLM2-135M echoed the prompt when
/// the question came right after the chunks without an instruction (measured on
/// docs/sample; this wording answered all three test questions without echoing).
pub const DEFAULT_SYSTEM: &str =
    "You are a helpful assistant. Answer using only the numbered chunks and cite them like [1].";
pub const DEFAULT_PROMPT: &str = "{contexts}\n\nUsing the chunks above, answer in one or two sentences and cite the chunk numbers like [1].\nQuestion: {question}";
/// Generation stops here by default: a small model may go on to invent the next question.
pub const DEFAULT_STOP: &str = "\nQuestion:";
const REWRITE: &str = "Rewrite this search query so that it is specific and self-contained. Reply with the rewritten query only.\n\nQuery: {query}";
const HYDE: &str = "Write a short passage that answers the question.\n\nQuestion: {query}";
const MULTI_QUERY: &str = "Write {n} different search queries for the question, one per line, without numbering.\n\nQuestion: {query}";
const DECOMPOSE: &str = "Break the question into at most {n} simpler sub-questions, one per line. If it is already simple, reply NONE.\n\nQuestion: {query}";
const STEP_BACK: &str = "Write a more general question behind this question. Reply with the question only.\n\nQuestion: {query}";
const RECURSE: &str = "Question: {query}\nAnswer: {answer}\n\nWhich follow-up questions must still be answered? Write at most {n}, one per line, or NONE.";
const FUSE_LLM: &str = "Notes:\n{answers}\n\n{contexts}\n\nUsing the notes and chunks above, answer in one or two sentences and cite the chunk numbers like [1].\nQuestion: {question}";

/// A TOML table of one step, with the keys taken so far (the rest are unknown keys).
struct Keys<'a> {
    t: &'a toml::Table,
    place: &'a str,
    used: BTreeSet<&'static str>,
}

impl<'a> Keys<'a> {
    fn err<T>(&self, msg: impl std::fmt::Display) -> SpecResult<T> {
        Err(format!("{}: {msg}", self.place))
    }

    fn get(&mut self, k: &'static str) -> Option<&'a toml::Value> {
        self.used.insert(k);
        self.t.get(k)
    }

    fn string(&mut self, k: &'static str, default: &str) -> SpecResult<String> {
        match self.get(k) {
            None => Ok(default.to_owned()),
            Some(toml::Value::String(s)) => Ok(s.clone()),
            Some(_) => self.err(format!("{k} must be a string")),
        }
    }

    fn float(&mut self, k: &'static str) -> SpecResult<Option<f32>> {
        match self.get(k) {
            None => Ok(None),
            Some(toml::Value::Float(f)) => Ok(Some(*f as f32)),
            Some(toml::Value::Integer(i)) => Ok(Some(*i as f32)),
            Some(_) => self.err(format!("{k} must be a number")),
        }
    }

    fn float_in(&mut self, k: &'static str, default: f32, lo: f32, hi: f32) -> SpecResult<f32> {
        let v = self.float(k)?.unwrap_or(default);
        if !(v.is_finite() && (lo..=hi).contains(&v)) {
            return self.err(format!("{k} must be in [{lo}, {hi}], got {v}"));
        }
        Ok(v)
    }

    fn int(&mut self, k: &'static str) -> SpecResult<Option<usize>> {
        match self.get(k) {
            None => Ok(None),
            Some(toml::Value::Integer(i)) if *i >= 0 => Ok(Some(*i as usize)),
            Some(_) => self.err(format!("{k} must be a non-negative integer")),
        }
    }

    fn int_in(
        &mut self,
        k: &'static str,
        default: usize,
        lo: usize,
        hi: usize,
    ) -> SpecResult<usize> {
        let v = self.int(k)?.unwrap_or(default);
        if !(lo..=hi).contains(&v) {
            return self.err(format!("{k} must be in [{lo}, {hi}], got {v}"));
        }
        Ok(v)
    }

    fn boolean(&mut self, k: &'static str, default: bool) -> SpecResult<bool> {
        match self.get(k) {
            None => Ok(default),
            Some(toml::Value::Boolean(b)) => Ok(*b),
            Some(_) => self.err(format!("{k} must be true or false")),
        }
    }

    fn strings(&mut self, k: &'static str) -> SpecResult<Vec<String>> {
        match self.get(k) {
            None => Ok(Vec::new()),
            Some(toml::Value::Array(a)) => a
                .iter()
                .map(|v| v.as_str().map(str::to_owned))
                .collect::<Option<Vec<_>>>()
                .map_or_else(|| self.err(format!("{k} must be a list of strings")), Ok),
            Some(_) => self.err(format!("{k} must be a list of strings")),
        }
    }

    /// One of a fixed set of names, mapped to its value; the error lists the choices.
    fn choice<T: Copy>(
        &mut self,
        k: &'static str,
        default: &str,
        options: &[(&str, T)],
    ) -> SpecResult<T> {
        let v = self.string(k, default)?;
        match options.iter().find(|(name, _)| *name == v) {
            Some((_, t)) => Ok(*t),
            None => {
                let names: Vec<&str> = options.iter().map(|(n, _)| *n).collect();
                self.err(format!("{k} {v:?}: use {}", names.join(", ")))
            }
        }
    }

    /// A required bound in [1, max] (loops and recursion must say how far they may go).
    fn bound(&mut self, k: &'static str, max: usize, what: &str) -> SpecResult<usize> {
        match self.int(k)? {
            None => self.err(format!("{what} needs {k} (its bound)")),
            Some(n) if (1..=max).contains(&n) => Ok(n),
            Some(n) => self.err(format!("{k} must be in [1, {max}], got {n}")),
        }
    }

    /// The nested `steps` of a control operator.
    fn nested(&mut self, flow: &str, at: &str, op: &str) -> SpecResult<Vec<Step>> {
        match self.get("steps") {
            Some(s) => parse_steps(flow, &format!("{at} ({op})"), s),
            None => self.err("missing steps"),
        }
    }

    /// Fails on any key the operator does not know.
    fn finish(&self) -> SpecResult<()> {
        let unknown: Vec<&String> = self
            .t
            .keys()
            .filter(|k| k.as_str() != "op" && !self.used.contains(k.as_str()))
            .collect();
        if let Some(k) = unknown.first() {
            let known: Vec<&str> = self.used.iter().copied().collect();
            return self.err(format!("unknown key {k:?} (known: {})", known.join(", ")));
        }
        Ok(())
    }

    /// A prompt template whose placeholders must all be in `allowed`.
    fn template(&mut self, k: &'static str, default: &str, allowed: &[&str]) -> SpecResult<String> {
        let t = self.string(k, default)?;
        for name in placeholders(&t) {
            if !allowed.contains(&name.as_str()) {
                return self.err(format!(
                    "{k}: unknown placeholder {{{name}}} (allowed: {})",
                    allowed
                        .iter()
                        .map(|a| format!("{{{a}}}"))
                        .collect::<Vec<_>>()
                        .join(", ")
                ));
            }
        }
        Ok(t)
    }

    fn llm(&mut self, default: &str, allowed: &[&str], max_tokens: usize) -> SpecResult<LlmPrompt> {
        Ok(LlmPrompt {
            template: self.template("template", default, allowed)?,
            system: self.string("system", "")?,
            max_tokens: self.int_in("max_tokens", max_tokens, 1, MAX_STEP_TOKENS)?,
            model: self.string("model", "")?,
        })
    }

    fn generate(&mut self, max_tokens: usize) -> SpecResult<GenerateParams> {
        Ok(GenerateParams {
            max_tokens: self.int_in("max_tokens", max_tokens, 1, MAX_STEP_TOKENS)?,
            temperature: self.float_in("temperature", 0.0, 0.0, 2.0)?,
            model: self.string("model", "")?,
            stop: match self.get("stop") {
                None => vec![DEFAULT_STOP.to_owned()],
                Some(_) => {
                    let s = self.strings("stop")?;
                    if s.len() > 8 || s.iter().any(|x| x.is_empty() || x.len() > 64) {
                        return self.err("stop: at most 8 strings of 1 to 64 bytes");
                    }
                    s
                }
            },
        })
    }

    fn retrieve(&mut self, mode: Mode, top_k: usize) -> SpecResult<Retrieve> {
        let top_k = self.int_in("top_k", top_k, 1, MAX_TOP_K)?;
        let fusion_name = self.string("fusion", "dbsf")?;
        let dense_weight = self.float("dense_weight")?;
        if let Some(w) = dense_weight
            && !(0.0..=1.0).contains(&w)
        {
            return self.err(format!("dense_weight must be in [0, 1], got {w}"));
        }
        let k = self.float_in("rrf_k", 60.0, 1.0, 10_000.0)?;
        let fusion =
            parse_fusion(&fusion_name, dense_weight, k).map_or_else(|e| self.err(e), Ok)?;
        let filter = match self.get("filter") {
            None => HashMap::new(),
            Some(toml::Value::Table(t)) => t
                .iter()
                .map(|(k, v)| v.as_str().map(|s| (k.clone(), s.to_owned())))
                .collect::<Option<_>>()
                .map_or_else(|| self.err("filter values must be strings"), Ok)?,
            Some(_) => return self.err("filter must be a table of strings"),
        };
        Ok(Retrieve {
            mode,
            top_k,
            fusion,
            fusion_name,
            dense_weight,
            filter,
        })
    }
}

pub fn parse_fusion(name: &str, dense_weight: Option<f32>, k: f32) -> Result<Fusion, String> {
    let w = dense_weight.unwrap_or(crate::search::query::DEFAULT_DENSE_WEIGHT);
    match name {
        "" | "dbsf" => Ok(Fusion::Dbsf {
            lex_weight: 1.0 - w,
        }),
        "cc" => Ok(Fusion::Cc {
            lex_weight: 1.0 - w,
        }),
        "rrf" => Ok(Fusion::Rrf { k }),
        other => Err(format!("fusion {other:?} is unknown; use rrf, cc or dbsf")),
    }
}

/// `{name}` placeholders of a template.
pub fn placeholders(t: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = t;
    while let Some(i) = rest.find('{') {
        rest = &rest[i + 1..];
        if let Some(j) = rest.find('}') {
            let name = &rest[..j];
            if !name.is_empty() && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
                out.push(name.to_owned());
            }
            rest = &rest[j + 1..];
        }
    }
    out
}

fn parse_steps(flow: &str, prefix: &str, v: &toml::Value) -> SpecResult<Vec<Step>> {
    let arr = v
        .as_array()
        .ok_or_else(|| format!("flow {flow:?}{prefix}: steps must be a list of tables"))?;
    if arr.is_empty() {
        return Err(format!("flow {flow:?}{prefix}: steps is empty"));
    }
    arr.iter()
        .enumerate()
        .map(|(i, s)| parse_step(flow, &format!("{prefix}, step {}", i + 1), s))
        .collect()
}

fn parse_step(flow: &str, at: &str, v: &toml::Value) -> SpecResult<Step> {
    let t = v
        .as_table()
        .ok_or_else(|| format!("flow {flow:?}{at}: a step must be a table with an \"op\""))?;
    let op = t
        .get("op")
        .and_then(|o| o.as_str())
        .ok_or_else(|| format!("flow {flow:?}{at}: missing \"op\""))?;
    let place = format!("flow {flow:?}{at} ({op})");
    let mut k = Keys {
        t,
        place: &place,
        used: BTreeSet::new(),
    };
    let q = &["query", "question"];
    let op = match op {
        "noop" => Op::Noop,
        "rewrite" => Op::Rewrite(k.llm(REWRITE, q, 64)?),
        "hyde" => Op::Hyde(k.llm(HYDE, q, 128)?),
        "multi_query" => {
            let n = k.int_in("n", 3, 1, MAX_BRANCHES)?;
            Op::MultiQuery {
                llm: k.llm(MULTI_QUERY, &["query", "question", "n"], 96)?,
                n,
            }
        }
        "decompose" => {
            let n = k.int_in("n", 3, 1, MAX_BRANCHES)?;
            Op::Decompose {
                llm: k.llm(DECOMPOSE, &["query", "question", "n"], 96)?,
                n,
            }
        }
        "step_back" => Op::StepBack(k.llm(STEP_BACK, q, 48)?),
        "bm25" => Op::Retrieve(k.retrieve(Mode::Bm25, 5)?),
        "dense" => Op::Retrieve(k.retrieve(Mode::Dense, 5)?),
        "hybrid" => Op::Retrieve(k.retrieve(Mode::Hybrid, 5)?),
        "rerank" => Op::Rerank {
            model: k.string("model", "")?,
            keep: k.int_in("keep", 5, 1, MAX_TOP_K)?,
            min_score: k.float("min_score")?,
        },
        "mmr" => Op::Mmr {
            lambda: k.float_in("lambda", 0.7, 0.0, 1.0)?,
            keep: k.int_in("keep", 5, 1, MAX_TOP_K)?,
        },
        "prev_next" => Op::PrevNext {
            before: k.int_in("before", 1, 0, 5)? as u32,
            after: k.int_in("after", 1, 0, 5)? as u32,
        },
        "threshold" => {
            let min_score = k.float("min_score")?;
            let keep_fraction = k.float("keep_fraction")?;
            let keep = k.int("keep")?;
            if let Some(f) = keep_fraction
                && !(f > 0.0 && f <= 1.0)
            {
                return k.err(format!("keep_fraction must be in (0, 1], got {f}"));
            }
            if keep == Some(0) {
                return k.err("keep must be at least 1");
            }
            if min_score.is_none() && keep_fraction.is_none() && keep.is_none() {
                return k.err("set at least one of min_score, keep_fraction, keep");
            }
            Op::Threshold {
                min_score,
                keep_fraction,
                keep,
            }
        }
        "compress" => Op::Compress {
            budget_tokens: k.int_in("budget_tokens", 256, 16, 4096)?,
        },
        "reorder" => Op::Reorder(k.choice(
            "mode",
            "long_context",
            &[
                ("long_context", ReorderMode::LongContext),
                ("best_last", ReorderMode::BestLast),
                ("best_first", ReorderMode::BestFirst),
            ],
        )?),
        "prompt" => Op::Prompt {
            template: k.template(
                "template",
                DEFAULT_PROMPT,
                &["contexts", "question", "query"],
            )?,
            system: k.string("system", DEFAULT_SYSTEM)?,
        },
        "generate" => Op::Generate(k.generate(128)?),
        "verify" => Op::Verify {
            threshold: k.float_in("threshold", 0.5, 0.0, 1.0)?,
            max_retries: k.int_in("max_retries", 1, 0, MAX_ITERATIONS)?,
            widen: k.int_in("widen", 2, 1, 10)?,
            model: k.string("model", "")?,
        },
        "route" => {
            let method = k.choice(
                "method",
                "hybrid",
                &[
                    ("keyword", RouteMethod::Keyword),
                    ("semantic", RouteMethod::Semantic),
                    ("hybrid", RouteMethod::Hybrid),
                ],
            )?;
            let routes = match k.get("routes") {
                Some(toml::Value::Array(a)) if !a.is_empty() => a
                    .iter()
                    .enumerate()
                    .map(|(i, r)| parse_route(&format!("{place}, route {}", i + 1), r))
                    .collect::<SpecResult<Vec<_>>>()?,
                _ => return k.err("routes must be a non-empty list of {flow, keywords, intents}"),
            };
            Op::Route {
                method,
                alpha: k.float_in("alpha", 0.5, 0.0, 1.0)?,
                temperature: k.float_in("temperature", 0.1, 0.001, 10.0)?,
                default: k.string("default", "")?,
                routes,
            }
        }
        "judge" => Op::Judge {
            rule: k.choice(
                "rule",
                "min_token_prob",
                &[
                    ("min_token_prob", JudgeRule::MinTokenProb),
                    ("min_score", JudgeRule::MinScore),
                    ("llm", JudgeRule::Llm),
                ],
            )?,
            threshold: k.float_in("threshold", 0.3, -1e6, 1e6)?,
            model: k.string("model", "")?,
        },
        "fuse" => {
            let method = k.choice(
                "method",
                "rrf",
                &[
                    ("rrf", FuseMethod::Rrf),
                    ("weighted", FuseMethod::Weighted),
                    ("llm", FuseMethod::Llm),
                    ("concat", FuseMethod::Concat),
                ],
            )?;
            Op::Fuse {
                method,
                k: k.float_in("k", 60.0, 1.0, 10_000.0)?,
                template: k.template(
                    "template",
                    FUSE_LLM,
                    &["contexts", "question", "query", "answers"],
                )?,
                generation: k.generate(128)?,
            }
        }
        "branch" => {
            let over = k.choice(
                "over",
                "",
                &[
                    ("queries", BranchOver::Queries),
                    ("chunks", BranchOver::Chunks),
                ],
            )?;
            let max_branches = k.int_in("max_branches", 4, 1, MAX_BRANCHES)?;
            let steps = k.nested(flow, at, "branch")?;
            Op::Branch {
                over,
                max_branches,
                steps,
            }
        }
        "loop" => {
            let max_iterations = k.bound("max_iterations", MAX_ITERATIONS, "a loop")?;
            let augment_query = k.boolean("augment_query", true)?;
            let steps = k.nested(flow, at, "loop")?;
            Op::Loop {
                max_iterations,
                augment_query,
                steps,
            }
        }
        "recurse" => {
            let max_depth = k.bound("max_depth", MAX_DEPTH, "recursion")?;
            let max_queries = k.int_in("max_queries", 4, 1, MAX_BRANCHES)?;
            let llm = k.llm(RECURSE, &["query", "question", "answer", "n"], 64)?;
            let steps = k.nested(flow, at, "recurse")?;
            Op::Recurse {
                max_depth,
                max_queries,
                llm,
                steps,
            }
        }
        "active" => {
            let mode = k.choice(
                "mode",
                "hybrid",
                &[
                    ("bm25", Mode::Bm25),
                    ("dense", Mode::Dense),
                    ("hybrid", Mode::Hybrid),
                ],
            )?;
            Op::Active {
                threshold: k.float_in("threshold", 0.4, 0.0, 1.0)?,
                max_sentences: k.int_in("max_sentences", 4, 1, 32)?,
                max_retrievals: k.int_in("max_retrievals", 2, 0, MAX_ITERATIONS)?,
                sentence_tokens: k.int_in("sentence_tokens", 48, 4, 256)?,
                retrieve: k.retrieve(mode, 3)?,
                template: k.template(
                    "template",
                    DEFAULT_PROMPT,
                    &["contexts", "question", "query"],
                )?,
                system: k.string("system", DEFAULT_SYSTEM)?,
                generation: k.generate(160)?,
            }
        }
        other => {
            return Err(format!(
                "{place}: unknown operator {other:?} (operators: {})",
                OPERATORS.join(", ")
            ));
        }
    };
    k.finish()?;
    Ok(Step { op, place })
}

fn parse_route(place: &str, v: &toml::Value) -> SpecResult<RouteTarget> {
    let t = v
        .as_table()
        .ok_or_else(|| format!("{place}: must be a table"))?;
    let mut k = Keys {
        t,
        place,
        used: BTreeSet::new(),
    };
    let flow = k.string("flow", "")?;
    if flow.is_empty() {
        return k.err("missing flow");
    }
    let r = RouteTarget {
        flow,
        keywords: k
            .strings("keywords")?
            .into_iter()
            .map(|s| s.to_lowercase())
            .collect(),
        intents: k.strings("intents")?,
    };
    k.finish()?;
    Ok(r)
}

/// Parses one flow from its TOML table (`description`, `steps`).
pub fn parse_flow(name: &str, v: &toml::Value) -> SpecResult<Flow> {
    let t = v
        .as_table()
        .ok_or_else(|| format!("flow {name:?}: must be a table with steps"))?;
    for k in t.keys() {
        if k != "steps" && k != "description" {
            return Err(format!(
                "flow {name:?}: unknown key {k:?} (known: description, steps)"
            ));
        }
    }
    let steps = t
        .get("steps")
        .ok_or_else(|| format!("flow {name:?}: missing steps"))?;
    Ok(Flow {
        name: name.to_owned(),
        description: t
            .get("description")
            .and_then(|d| d.as_str())
            .unwrap_or_default()
            .to_owned(),
        steps: parse_steps(name, "", steps)?,
    })
}

impl FlowSet {
    /// Parses and validates a flow file.
    pub fn parse(text: &str) -> SpecResult<Self> {
        let doc: toml::Table = text.parse().map_err(|e| format!("flow file: {e}"))?;
        let mut set = FlowSet::default();
        for (k, v) in &doc {
            match k.as_str() {
                "default" => {
                    set.default = v
                        .as_str()
                        .ok_or("flow file: default must be a flow name")?
                        .to_owned()
                }
                "collections" => {
                    let t = v
                        .as_table()
                        .ok_or("flow file: collections must be a table")?;
                    for (c, f) in t {
                        let f = f
                            .as_str()
                            .ok_or_else(|| format!("collections.{c} must be a flow name"))?;
                        set.collections.insert(c.clone(), f.to_owned());
                    }
                }
                "flows" => {
                    let t = v.as_table().ok_or("flow file: flows must be a table")?;
                    for (name, f) in t {
                        set.flows.insert(name.clone(), parse_flow(name, f)?);
                    }
                }
                other => {
                    return Err(format!(
                        "flow file: unknown key {other:?} (known: default, collections, flows)"
                    ));
                }
            }
        }
        set.validate()?;
        Ok(set)
    }

    /// The flow for a request: the named one, else the collection's default, else the file's.
    pub fn resolve(&self, name: &str, collection: &str) -> SpecResult<&Flow> {
        let n = if !name.is_empty() {
            name
        } else if let Some(f) = self.collections.get(collection) {
            f
        } else {
            &self.default
        };
        self.flows.get(n).ok_or_else(|| {
            format!(
                "flow {n:?} is not defined (flows: {})",
                self.flows.keys().cloned().collect::<Vec<_>>().join(", ")
            )
        })
    }

    fn validate(&self) -> SpecResult<()> {
        if self.flows.is_empty() {
            return Err("flow file: no flows".into());
        }
        if !self.default.is_empty() && !self.flows.contains_key(&self.default) {
            return Err(format!(
                "flow file: default flow {:?} is not defined",
                self.default
            ));
        }
        for (c, f) in &self.collections {
            if !self.flows.contains_key(f) {
                return Err(format!("collections.{c}: flow {f:?} is not defined"));
            }
        }
        // Route targets exist, and flows reference each other without cycles.
        for f in self.flows.values() {
            self.check_routes(&f.steps)?;
        }
        for f in self.flows.values() {
            self.find_cycle(&f.name, &mut Vec::new())?;
        }
        for f in self.flows.values() {
            self.check_inputs(f, &BTreeSet::new())?;
        }
        Ok(())
    }

    /// Validates a single flow against this set (inline flows of a request).
    pub fn validate_inline(&self, f: &Flow) -> SpecResult<()> {
        self.check_routes(&f.steps)?;
        for name in referenced(&f.steps) {
            self.find_cycle(&name, &mut vec![f.name.clone()])?;
        }
        self.check_inputs(f, &BTreeSet::new())?;
        Ok(())
    }

    fn check_routes(&self, steps: &[Step]) -> SpecResult<()> {
        for s in steps {
            match &s.op {
                Op::Route {
                    routes, default, ..
                } => {
                    for t in routes
                        .iter()
                        .map(|r| &r.flow)
                        .chain(std::iter::once(default).filter(|d| !d.is_empty()))
                    {
                        if !self.flows.contains_key(t) {
                            return Err(format!(
                                "{}: route target flow {t:?} is not defined",
                                s.place
                            ));
                        }
                    }
                }
                Op::Branch { steps, .. } | Op::Loop { steps, .. } | Op::Recurse { steps, .. } => {
                    self.check_routes(steps)?
                }
                _ => {}
            }
        }
        Ok(())
    }

    fn find_cycle(&self, name: &str, path: &mut Vec<String>) -> SpecResult<()> {
        if let Some(i) = path.iter().position(|p| p == name) {
            let mut cycle = path[i..].to_vec();
            cycle.push(name.to_owned());
            return Err(format!(
                "flows {}: a cycle without a loop bound (use a loop step with max_iterations)",
                cycle.join(" -> ")
            ));
        }
        let Some(f) = self.flows.get(name) else {
            return Ok(());
        };
        path.push(name.to_owned());
        for next in referenced(&f.steps) {
            self.find_cycle(&next, path)?;
        }
        path.pop();
        Ok(())
    }

    /// Walks the steps with the set of defined slots; fails at the first missing input.
    fn check_inputs(&self, f: &Flow, start: &BTreeSet<Slot>) -> SpecResult<BTreeSet<Slot>> {
        self.walk(&f.steps, start.clone())
    }

    fn walk(&self, steps: &[Step], mut have: BTreeSet<Slot>) -> SpecResult<BTreeSet<Slot>> {
        for (i, s) in steps.iter().enumerate() {
            let need = |have: &BTreeSet<Slot>, slot: Slot, hint: &str| -> SpecResult<()> {
                if have.contains(&slot) {
                    Ok(())
                } else {
                    Err(format!(
                        "{}: input {:?} is not produced by any earlier step ({hint})",
                        s.place,
                        slot.name()
                    ))
                }
            };
            match &s.op {
                Op::Noop | Op::Rewrite(_) | Op::Hyde(_) => {}
                Op::MultiQuery { .. } | Op::Decompose { .. } | Op::StepBack(_) => {
                    have.insert(Slot::Queries);
                }
                Op::Retrieve(_) => {
                    have.insert(Slot::Chunks);
                }
                Op::Rerank { .. }
                | Op::Mmr { .. }
                | Op::PrevNext { .. }
                | Op::Threshold { .. }
                | Op::Compress { .. }
                | Op::Reorder(_) => {
                    need(&have, Slot::Chunks, "add bm25, dense or hybrid before it")?
                }
                Op::Prompt { .. } => {
                    need(&have, Slot::Chunks, "add bm25, dense or hybrid before it")?;
                    have.insert(Slot::Prompt);
                }
                Op::Generate(_) => {
                    need(&have, Slot::Prompt, "add a prompt step before it")?;
                    have.insert(Slot::Answer);
                }
                Op::Verify { .. } => {
                    need(&have, Slot::Answer, "verify checks a generated answer")?;
                    if !steps[..i].iter().any(|p| matches!(p.op, Op::Retrieve(_))) {
                        return Err(format!(
                            "{}: verify widens the retrieval of its own step list, which has none",
                            s.place
                        ));
                    }
                }
                Op::Judge { rule, .. } => {
                    match rule {
                        JudgeRule::MinScore => {
                            need(&have, Slot::Chunks, "min_score judges chunks")?
                        }
                        _ => need(&have, Slot::Answer, "this rule judges a generated answer")?,
                    }
                    have.insert(Slot::Verdict);
                }
                Op::Fuse { method, .. } => {
                    need(
                        &have,
                        Slot::Branches,
                        "fuse merges the results of a branch or recurse step",
                    )?;
                    have.remove(&Slot::Branches);
                    match method {
                        FuseMethod::Rrf => {
                            have.insert(Slot::Chunks);
                        }
                        _ => {
                            have.insert(Slot::Answer);
                            have.insert(Slot::Chunks);
                            have.insert(Slot::Prompt);
                        }
                    }
                }
                Op::Route {
                    routes, default, ..
                } => {
                    // After a route, only what every target produces is certain.
                    let mut out: Option<BTreeSet<Slot>> = None;
                    for t in routes
                        .iter()
                        .map(|r| &r.flow)
                        .chain(std::iter::once(default).filter(|d| !d.is_empty()))
                    {
                        let f = &self.flows[t];
                        let got = self.walk(&f.steps, have.clone())?;
                        out = Some(match out {
                            None => got,
                            Some(o) => o.intersection(&got).copied().collect(),
                        });
                    }
                    have = out.unwrap_or(have);
                }
                Op::Branch { over, steps, .. } => {
                    match over {
                        BranchOver::Queries => need(
                            &have,
                            Slot::Queries,
                            "add multi_query, decompose or step_back before it",
                        )?,
                        BranchOver::Chunks => {
                            need(&have, Slot::Chunks, "add bm25, dense or hybrid before it")?
                        }
                    }
                    let mut inner = have.clone();
                    if *over == BranchOver::Chunks {
                        inner.insert(Slot::Chunks);
                    }
                    self.walk(steps, inner)?;
                    have.insert(Slot::Branches);
                }
                Op::Loop { steps, .. } => {
                    have = self.walk(steps, have)?;
                }
                Op::Recurse { steps, .. } => {
                    let got = self.walk(steps, have.clone())?;
                    if !got.contains(&Slot::Answer) {
                        return Err(format!(
                            "{}: the steps of a recursion must generate an answer",
                            s.place
                        ));
                    }
                    have.insert(Slot::Branches);
                }
                Op::Active { .. } => {
                    need(
                        &have,
                        Slot::Chunks,
                        "active generation starts from retrieved chunks",
                    )?;
                    have.insert(Slot::Answer);
                    have.insert(Slot::Prompt);
                }
            }
        }
        Ok(have)
    }
}

/// Flows named by route steps, at any depth.
fn referenced(steps: &[Step]) -> Vec<String> {
    let mut out = Vec::new();
    for s in steps {
        match &s.op {
            Op::Route {
                routes, default, ..
            } => {
                out.extend(routes.iter().map(|r| r.flow.clone()));
                if !default.is_empty() {
                    out.push(default.clone());
                }
            }
            Op::Branch { steps, .. } | Op::Loop { steps, .. } | Op::Recurse { steps, .. } => {
                out.extend(referenced(steps))
            }
            _ => {}
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(text: &str) -> String {
        FlowSet::parse(text).unwrap_err()
    }

    #[test]
    fn shipped_flows_parse() {
        let set = FlowSet::parse(super::super::EXAMPLE_FLOWS).unwrap();
        for f in [
            "linear",
            "conditional",
            "multi_query",
            "per_chunk",
            "iterative",
            "recursive",
            "active",
        ] {
            assert!(set.flows.contains_key(f), "{f}");
        }
        assert_eq!(set.resolve("", "anything").unwrap().name, set.default);
    }

    #[test]
    fn errors_name_the_place() {
        let e = err("[flows.a]\nsteps = [{ op = \"bm25\" }, { op = \"rerankk\" }]");
        assert!(
            e.contains("flow \"a\", step 2 (rerankk): unknown operator"),
            "{e}"
        );
        let e = err("[flows.a]\nsteps = [{ op = \"bm25\", top_kk = 3 }]");
        assert!(e.contains("step 1 (bm25): unknown key \"top_kk\""), "{e}");
        let e = err("[flows.a]\nsteps = [{ op = \"bm25\" }, { op = \"generate\" }]");
        assert!(
            e.contains("step 2 (generate): input \"prompt\" is not produced"),
            "{e}"
        );
        let e = err("[flows.a]\nsteps = [{ op = \"rerank\" }]");
        assert!(e.contains("step 1 (rerank): input \"chunks\""), "{e}");
        let e = err(
            "[flows.a]\nsteps = [{ op = \"bm25\" }, { op = \"prompt\", template = \"{nope}\" }]",
        );
        assert!(e.contains("unknown placeholder {nope}"), "{e}");
        let e = err("[flows.a]\nsteps = [{ op = \"bm25\", top_k = 0 }]");
        assert!(e.contains("top_k must be in [1, 100]"), "{e}");
        let e = err("[flows.a]\nsteps = [{ op = \"loop\", steps = [{ op = \"noop\" }] }]");
        assert!(
            e.contains("step 1 (loop): a loop needs max_iterations"),
            "{e}"
        );
        let e = err(
            "[flows.a]\nsteps = [{ op = \"bm25\" }, { op = \"branch\", over = \"chunks\", steps = [{ op = \"generate\" }] }]",
        );
        assert!(
            e.contains("step 2 (branch), step 1 (generate): input \"prompt\""),
            "{e}"
        );
    }

    #[test]
    fn route_cycles_and_targets() {
        let e = err(
            "[flows.a]\nsteps = [{ op = \"route\", routes = [{ flow = \"b\" }] }]\n\
             [flows.b]\nsteps = [{ op = \"route\", routes = [{ flow = \"a\" }] }]",
        );
        assert!(
            e.contains("a -> b -> a: a cycle without a loop bound"),
            "{e}"
        );
        let e = err("[flows.a]\nsteps = [{ op = \"route\", routes = [{ flow = \"zzz\" }] }]");
        assert!(
            e.contains("route target flow \"zzz\" is not defined"),
            "{e}"
        );
        // After a route only what every target produces is known.
        let e = err(
            "[flows.a]\nsteps = [{ op = \"route\", routes = [{ flow = \"b\" }, { flow = \"c\" }] }, { op = \"rerank\" }]\n\
             [flows.b]\nsteps = [{ op = \"bm25\" }]\n[flows.c]\nsteps = [{ op = \"noop\" }]",
        );
        assert!(e.contains("step 2 (rerank): input \"chunks\""), "{e}");
    }

    #[test]
    fn placeholders_are_found() {
        assert_eq!(placeholders("a {x} b {y_1} {} {a b}"), vec!["x", "y_1"]);
    }
}
