//! Flow definitions: read from TOML as data (`file`: serde structs), turned into operators
//! with defaults and ranges checked (`lower`), and validated as a whole (`check`) before
//! anything runs.
//!
//! A flow is a list of operator steps; control operators hold nested steps (`branch`, `loop`,
//! `recurse`) or name other flows (`route`), so a flow file describes a graph of operators
//! whose only cycles are bounded loops. Validation names the place of every problem
//! (`flow "x", step 3 (rerank)`): unknown operators and keys, values out of range, an input
//! that no earlier step produces (e.g. `generate` without a `prompt`), unknown placeholders in
//! prompt templates, route targets that do not exist, and cycles between flows (route a -> b
//! -> a), which would have no loop bound.

mod check;
mod file;
mod lower;

pub use lower::parse_flow;

use std::collections::{BTreeMap, HashMap};

use crate::fusion::Fusion;
use ragcluster_proto::v1::ChatMessage;

pub use crate::limits::{
    MAX_EXAMPLE_FIELD_BYTES, MAX_FLOW_BRANCHES as MAX_BRANCHES, MAX_FLOW_DEPTH as MAX_DEPTH,
    MAX_FLOW_ITERATIONS as MAX_ITERATIONS, MAX_FLOW_TOP_K as MAX_TOP_K, MAX_PROMPT_EXAMPLES,
    MAX_STEP_TOKENS,
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
    pub fn name(self) -> &'static str {
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
    /// By the question's form (the seed's "nature of the question"): the first target whose
    /// `form` the question has.
    Form,
}

/// The form of a question, read from its words (`prompt::is_yes_no_question`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuestionForm {
    /// Opens with an auxiliary verb: "Is ...", "In 1796, did ...".
    YesNo,
    /// Any other question.
    Other,
}

#[derive(Debug, Clone)]
pub struct RouteTarget {
    pub flow: String,
    pub keywords: Vec<String>,
    pub intents: Vec<String>,
    /// Read by `RouteMethod::Form` only (and required by it).
    pub form: Option<QuestionForm>,
}

#[derive(Debug, Clone)]
pub struct GenerateParams {
    pub max_tokens: usize,
    pub temperature: f32,
    pub model: String,
    /// Stop strings (at most 8), default `DEFAULT_STOP`.
    pub stop: Vec<String>,
    /// How a question that reads as yes/no (`prompt::is_yes_no_question`) is answered.
    pub yes_no: YesNo,
}

/// The generate step's `yes_no`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum YesNo {
    /// As any question.
    Off,
    /// The answer starts "Yes" or "No", the model choosing which
    /// (`GenerateRequest.starts_with`).
    Start,
    /// As `Start`, the choice calibrated against the same prompt without its contexts
    /// (Zhao et al. 2021, "Calibrate Before Use"): the answer the contexts make more likely
    /// than the model thought it beforehand, not the one it favours anyway. Costs one
    /// context-free prefill and one token per yes/no question.
    Calibrated,
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
        /// Drops chunks whose reranker score is below this (UniversalRAG's threshold rerank).
        min_score: Option<f32>,
        /// The reranker's weight in a convex combination with the score the chunk came with
        /// (both min-max normalised over the candidates, AutoRAG's CC); None: the reranker's
        /// score alone.
        blend: Option<f32>,
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
        /// Worked examples (few-shot) as the chat turns asked before the question, rendered
        /// through `template` once when the flow is read.
        examples: Vec<ChatMessage>,
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

/// The generation prompt's defaults live in `ragcluster_common::prompt` (the oracle reader of
/// `ragctl eval answers` asks the same way).
pub use ragcluster_common::prompt::{
    DEFAULT_PROMPT, DEFAULT_STOP, DEFAULT_SYSTEM, Example, example_turns,
};
pub(super) const REWRITE: &str = "Rewrite this search query so that it is specific and self-contained. Reply with the rewritten query only.\n\nQuery: {query}";
pub(super) const HYDE: &str =
    "Write a short passage that answers the question.\n\nQuestion: {query}";
pub(super) const MULTI_QUERY: &str = "Write {n} different search queries for the question, one per line, without numbering.\n\nQuestion: {query}";
pub(super) const DECOMPOSE: &str = "Break the question into at most {n} simpler sub-questions, one per line. If it is already simple, reply NONE.\n\nQuestion: {query}";
pub(super) const STEP_BACK: &str = "Write a more general question behind this question. Reply with the question only.\n\nQuestion: {query}";
pub(super) const RECURSE: &str = "Question: {query}\nAnswer: {answer}\n\nWhich follow-up questions must still be answered? Write at most {n}, one per line, or NONE.";
pub(super) const FUSE_LLM: &str = "Notes:\n{answers}\n\n{contexts}\n\nUsing the notes and chunks above, answer in one or two sentences and cite the chunk numbers like [1].\nQuestion: {question}";

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

#[cfg(test)]
mod tests {
    use super::*;

    fn err(text: &str) -> String {
        FlowSet::parse(text).unwrap_err()
    }

    #[test]
    fn shipped_flows_parse() {
        let set = FlowSet::parse(crate::flow::EXAMPLE_FLOWS).unwrap();
        for f in [
            "linear",
            "conditional",
            "by_form",
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

    /// The flow variants that docs/evaluation.md compares (`ragctl eval answers --flow-file`)
    /// keep parsing as the schema changes.
    #[test]
    fn documented_eval_flows_parse() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/eval");
        let mut n = 0;
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            if name.starts_with("flow-") && name.ends_with(".toml") {
                let text = std::fs::read_to_string(&path).unwrap();
                let set = FlowSet::parse(&text).unwrap_or_else(|e| panic!("{name}: {e}"));
                assert!(set.flows.contains_key(&set.default), "{name}");
                n += 1;
            }
        }
        assert!(n >= 4, "{n} flow files in {}", dir.display());
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
        let e = err("[flows.a]\nsteps = [{ op = \"bm25\" }, { op = \"rerank\", blend = 1.5 }]");
        assert!(
            e.contains("step 2 (rerank): blend must be in [0, 1], got 1.5"),
            "{e}"
        );
        let e = err("[flows.a]\nsteps = [{ op = \"bm25\" }, { op = \"rerank\", min_score = nan }]");
        assert!(e.contains("min_score must be a finite number"), "{e}");
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
    fn prompt_examples_are_read_and_bounded() {
        let flow = |examples: &str| {
            format!(
                "[flows.a]\nsteps = [{{ op = \"bm25\" }}, {{ op = \"prompt\", examples = [{examples}] }}]"
            )
        };
        let one = "{ title = \"T\", context = \"c\", question = \"q?\", answer = \"a\" }";
        let set = FlowSet::parse(&flow(one)).unwrap();
        let Op::Prompt { examples, .. } = &set.flows["a"].steps[1].op else {
            panic!("not a prompt step");
        };
        let turns: Vec<_> = examples
            .iter()
            .map(|m| (m.role.as_str(), m.content.as_str()))
            .collect();
        assert_eq!(turns.len(), 2);
        assert_eq!(turns[0].0, "user");
        assert!(
            turns[0].1.starts_with("<chunk id=\"1\">T\nc</chunk>"),
            "{turns:?}"
        );
        assert!(turns[0].1.ends_with("Question: q?"), "{turns:?}");
        assert_eq!(turns[1], ("assistant", "a"));
        let nine = [one; MAX_PROMPT_EXAMPLES + 1].join(", ");
        assert!(err(&flow(&nine)).contains("examples: at most 8, got 9"));
        let e = err(&flow(
            "{ context = \" \", question = \"q\", answer = \"a\" }",
        ));
        assert!(
            e.contains("step 2 (prompt): examples[0].context: 1 to 4096 bytes"),
            "{e}"
        );
        let e = err(&flow("{ context = \"c\", question = \"q\" }"));
        assert!(e.contains("answer"), "{e}");
    }

    #[test]
    fn yes_no_answers_are_named_modes() {
        let flow = |v: &str| {
            format!(
                "[flows.a]\nsteps = [{{ op = \"bm25\" }}, {{ op = \"prompt\" }}, \
                 {{ op = \"generate\"{v} }}]"
            )
        };
        let mode = |v: &str| match &FlowSet::parse(&flow(v)).unwrap().flows["a"].steps[2].op {
            Op::Generate(g) => g.yes_no,
            other => panic!("{other:?}"),
        };
        assert_eq!(mode(""), YesNo::Off);
        assert_eq!(mode(", yes_no = \"start\""), YesNo::Start);
        assert_eq!(mode(", yes_no = \"calibrated\""), YesNo::Calibrated);
        let e = err(&flow(", yes_no = \"maybe\""));
        assert!(
            e.contains("yes_no \"maybe\": use off, start, calibrated"),
            "{e}"
        );
        assert!(err(&flow(", yes_no = true")).contains("yes_no"));
    }

    #[test]
    fn form_routes_name_a_form_each() {
        let flow = |routes: &str| {
            format!(
                "[flows.a]\nsteps = [{{ op = \"route\", method = \"form\", routes = [{routes}] }}]\n\
                 [flows.b]\nsteps = [{{ op = \"bm25\" }}]\n[flows.c]\nsteps = [{{ op = \"bm25\" }}]"
            )
        };
        let set = FlowSet::parse(&flow(
            "{ flow = \"b\", form = \"yes_no\" }, { flow = \"c\", form = \"other\" }",
        ))
        .unwrap();
        match &set.flows["a"].steps[0].op {
            Op::Route { method, routes, .. } => {
                assert_eq!(*method, RouteMethod::Form);
                assert_eq!(routes[0].form, Some(QuestionForm::YesNo));
                assert_eq!(routes[1].form, Some(QuestionForm::Other));
            }
            other => panic!("{other:?}"),
        }
        let e = err(&flow("{ flow = \"b\" }"));
        assert!(
            e.contains("route 1: method \"form\" needs a form per route"),
            "{e}"
        );
        let e = err(&flow("{ flow = \"b\", form = \"open\" }"));
        assert!(e.contains("form \"open\": use yes_no, other"), "{e}");
        let e = err(&flow(
            "{ flow = \"b\", form = \"other\", keywords = [\"x\"] }",
        ));
        assert!(e.contains("reads no keywords or intents"), "{e}");
        let e = err(
            "[flows.a]\nsteps = [{ op = \"route\", routes = [{ flow = \"b\", form = \"other\" }] }]\n\
             [flows.b]\nsteps = [{ op = \"bm25\" }]",
        );
        assert!(e.contains("form is read by method = \"form\" only"), "{e}");
    }

    #[test]
    fn placeholders_are_found() {
        assert_eq!(placeholders("a {x} b {y_1} {} {a b}"), vec!["x", "y_1"]);
    }
}
