//! The ragcluster coordinator: the public gRPC API.
//!
//! - `catalog`: collections, placement and API keys, replicated among the coordinators as a
//!   group of the shared Raft core.
//! - `shards`: the one client of shard nodes (routing, retries and failover, typed errors).
//! - `models`: the model worker client; `embed_cache`: embeddings already computed.
//! - Components, each owning its work: `collections` (lifecycle), `ingest` (chunk, embed,
//!   write), `search` (distributed BM25/dense/hybrid with the seeds' `fusion` formulas),
//!   `flow` (Ask and the RAG flow engine), `rebalance` (replica moves and plans),
//!   `read_token` (reads pinned to a write), `reembed` (moving a collection to another
//!   embedding model while it serves).
//! - `service`: the gRPC edge (authentication, admission, forwarding to the catalog leader,
//!   wire <-> domain conversions); `server`: the composition root.
//!
//! It talks to shard nodes and model workers only over gRPC or through its own `ShardNode`
//! trait (implemented in process by the `colocated` crate and the tests), never through their
//! crates; it must not depend on `shard-node` or `model-worker`.

pub mod auth;
pub mod catalog;
pub mod channels;
pub mod chunking;
pub mod collections;
pub mod config;
pub mod documents;
pub mod embed_cache;
pub mod error;
pub mod families;
pub mod flow;
pub mod fusion;
pub mod fuzzing;
pub mod handles;
pub mod ingest;
pub mod limits;
pub mod membership;
pub mod models;
pub mod placement;
pub mod read_token;
pub mod rebalance;
pub mod reembed;
pub mod schema;
pub mod search;
pub mod server;
pub mod service;
pub mod shards;
#[cfg(test)]
pub(crate) mod testing;

pub use config::CoordinatorConfig;
pub use server::{run, run_colocated, run_with};
