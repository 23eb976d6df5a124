//! The two derived indexes of a shard. Both are rebuilt or caught up from RocksDB, never the
//! other way round.

pub mod bm25;
pub mod hnsw;

/// Metadata filter: every (key, value) pair must match exactly.
pub type Filter = Vec<(String, String)>;
