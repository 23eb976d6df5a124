//! The two derived indexes of a shard. Both are rebuilt or caught up from RocksDB, never the
//! other way round; `worker` applies committed batches to them off the Raft thread and dumps
//! the HNSW graph now and then (`hnsw_dump`) so that a restart need not rebuild it.

pub mod bm25;
pub mod bm25_ids;
pub mod bm25_terms;
pub mod distance;
pub mod hnsw;
pub mod hnsw_dump;
pub mod hnsw_flat;
mod hnsw_links;
pub mod hnsw_pending;
pub mod hnsw_vectors;
pub mod recovery;
pub mod sq8;
pub mod worker;

use parking_lot::Mutex;
use ragcluster_proto::v1::Chunk;

/// Metadata filter: every (key, value) pair must match exactly.
pub type Filter = Vec<(String, String)>;

/// A shard's BM25 and HNSW indexes.
pub struct Indexes {
    pub bm25: bm25::Bm25Index,
    pub hnsw: hnsw::HnswIndex,
    /// Held while a group of batches updates both indexes, and by readers of their figures,
    /// so that figures describe one state (never a batch in HNSW but not yet in BM25).
    pub update: Mutex<()>,
}

/// A chunk as an HNSW point.
pub fn point(c: &Chunk) -> hnsw::Point {
    hnsw::Point {
        chunk_id: c.chunk_id.clone(),
        doc_id: c.doc_id.clone(),
        vector: c.embedding.clone(),
        meta: c
            .metadata
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect(),
    }
}
