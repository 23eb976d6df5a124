//! What one Ask request shares across its steps and branches (`Run`), the context the steps
//! read and write (`Ctx`), and the passages, prompts and branch results they pass along.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use ragcluster_proto::v1::*;
use tokio::sync::mpsc;

use super::route;
use super::spec::FlowSet;
use crate::chunking::Tokens;
use crate::models::Models;
use crate::read_token::ReadToken;
use crate::search::{self, Searcher};
use crate::shards::{ReadPlan, Shards};

/// A finished generation with per-token text and log-probabilities.
#[derive(Debug, Clone, Default)]
pub struct Generated {
    pub text: String,
    pub tokens: Vec<String>,
    pub logprobs: Vec<f32>,
    pub finish: String,
    pub completion_tokens: u32,
    /// Each `starts_with` beginning's first-token log-probability (constrained requests).
    pub start_logprobs: Vec<f32>,
}

impl Generated {
    /// exp(mean log-probability): the length-normalised sequence probability.
    pub fn mean_prob(&self) -> f32 {
        if self.logprobs.is_empty() {
            return 0.0;
        }
        (self.logprobs.iter().sum::<f32>() / self.logprobs.len() as f32).exp()
    }
}

/// What operators call: the coordinator's search, shards, model worker and tokenizer.
pub struct Services {
    pub searcher: Arc<Searcher>,
    pub shards: Arc<Shards>,
    pub models: Arc<Models>,
    pub tokens: Arc<dyn Tokens>,
}

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

#[cfg(test)]
impl Passage {
    /// A passage with only an id and a score (operator tests).
    pub fn scored(id: &str, score: f32) -> Self {
        Self {
            chunk_id: id.into(),
            score,
            ..Default::default()
        }
    }
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

#[derive(Debug, Clone, Default)]
pub struct Prompt {
    pub system: String,
    /// The prompt step's worked examples as earlier turns (user, assistant, ...), placed
    /// before the request's own history.
    pub examples: Vec<ChatMessage>,
    pub user: String,
    /// The numbered contexts the prompt shows, in order (`[n]` = contexts[n - 1]).
    pub contexts: Vec<Passage>,
    /// The user turn with no contexts: the content-free prompt a calibrated yes/no answer
    /// is measured against (empty where a step built no template prompt).
    pub bare: String,
}

/// What one branch (or recursion node) produced.
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
/// Per-request caps (config defaults, lowered by the request).
#[derive(Debug, Clone)]
pub struct Limits {
    pub max_generated_tokens: usize,
    pub max_branches: usize,
    pub max_iterations: usize,
}

type Sink = mpsc::Sender<std::result::Result<AskResponse, tonic::Status>>;

/// Everything one Ask request shares across its steps and branches.
/// Everything one Ask request shares across its steps and branches.
pub struct Run {
    pub services: Arc<Services>,
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
    /// The request's read token: every shard read of the flow honours it.
    pub read_token: ReadToken,
    /// The request's typed filter: every retrieval step applies it (with its own filter).
    pub conditions: Option<ragcluster_proto::v1::Filter>,
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

    pub fn record(&self, t: TraceStep) {
        let op = t.op.clone();
        metrics::histogram!("coordinator_ask_operator_seconds", "op" => op)
            .record(t.took_us as f64 / 1e6);
        self.trace.lock().push(t);
    }
}

/// Extra facts a step reports into its trace entry.
#[derive(Default)]
pub struct Note {
    pub branches: u32,
    pub iteration: u32,
    pub decision: String,
    pub tokens: u32,
}

/// Best first; ties by chunk id, so equal scores order the same every time.
pub fn sort_desc(c: &mut [Passage]) {
    c.sort_by(|a, b| {
        b.score
            .total_cmp(&a.score)
            .then_with(|| a.chunk_id.cmp(&b.chunk_id))
    });
}

/// An eventual read of the Ask's collection within what is left of its deadline.
pub fn read_plan(rt: &Run) -> ReadPlan<'_> {
    ReadPlan {
        collection: &rt.info.name,
        replicas: &rt.info.shards,
        consistency: Consistency::Eventual,
        deadline: rt.deadline,
        token: &rt.read_token,
    }
}
