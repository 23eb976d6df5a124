//! A search in the coordinator's own terms: what the flow engine and the gRPC edge hand the
//! searcher, and what it answers.

use std::collections::HashMap;
use std::time::Duration;

use crate::fusion::Fusion;
use crate::read_token::ReadToken;

/// Dense weight of cc/dbsf. UniversalRAG uses 0.8; on SciFact's train queries (our dev set)
/// 0.5 scored higher for dbsf (nDCG@10 0.7317 vs 0.7105; test 0.7312 vs 0.7215), measured with
/// `ragbench --tune`.
pub const DEFAULT_DENSE_WEIGHT: f32 = 0.5;
pub const DEFAULT_RRF_K: u32 = 60;
/// Candidates per retriever of a hybrid search, when the request gives none.
pub const DEFAULT_CANDIDATES: u32 = 50;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Bm25,
    Dense,
    Hybrid,
}

impl Mode {
    pub fn name(self) -> &'static str {
        match self {
            Mode::Bm25 => "bm25",
            Mode::Dense => "dense",
            Mode::Hybrid => "hybrid",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Consistency {
    /// Any replica answers from what it applied (the least loaded one).
    #[default]
    Eventual,
    /// The leader answers after a Raft read index: sees every acknowledged write.
    Strong,
}

#[derive(Debug, Clone)]
pub struct Query {
    pub collection: String,
    /// The text for BM25 (and for the query embedding when `vector` is absent).
    pub text: String,
    /// A query vector given by the caller (e.g. HyDE's passage embedding).
    pub vector: Option<Vec<f32>>,
    pub mode: Mode,
    pub fusion: Fusion,
    pub top_k: usize,
    /// Candidates each retriever contributes to the fusion (at least `top_k`).
    pub candidates: usize,
    /// Exact-match metadata filter.
    pub filter: HashMap<String, String>,
    /// Typed filter (checked against the schema), with `filter`.
    pub conditions: Option<ragcluster_proto::v1::Filter>,
    /// HNSW search breadth; 0 = the collection's.
    pub ef_search: u32,
    /// The dense list scored over every point, no graph walk (recall 1, linear cost).
    pub exact: bool,
    /// Hits without their chunks' bodies (ids, positions and scores only).
    pub ids_only: bool,
    pub consistency: Consistency,
    /// Each shard is read from a replica that applied at least this far (a write's token).
    pub token: ReadToken,
    pub timeout: Duration,
}

/// A retriever's view of a hit: its 1-based rank and raw score in that retriever's list.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rank {
    pub rank: u32,
    pub score: f32,
}

#[derive(Debug, Clone)]
pub struct Hit {
    pub chunk_id: String,
    pub doc_id: String,
    pub title: String,
    pub section: String,
    pub text: String,
    pub metadata: HashMap<String, String>,
    pub position: u32,
    pub shard: u32,
    pub score: f32,
    pub bm25: Option<Rank>,
    pub dense: Option<Rank>,
}

#[derive(Debug, Clone)]
pub struct Results {
    pub hits: Vec<Hit>,
    pub took: Duration,
    pub shards_total: u32,
    pub shards_ok: u32,
}
