//! The two derived indexes of a shard, each a folder with its own vocabulary: `bm25`
//! (tantivy) and `hnsw` (hnsw_rs over int8 codes, with its dumps). Both are rebuilt or caught
//! up from RocksDB, never the other way round: `recovery` brings them to the applied seq when a
//! shard opens, and `worker` applies committed batches to them off the Raft thread (its apply
//! pipeline) and runs their upkeep between batches (its maintenance scheduler: HNSW dumps so
//! that a restart need not rebuild the graph, flat copies, segment merges, op-log trims).
//! This module holds only what both share: the filter (`filter`: typed metadata, conditions
//! and the terms BM25 stores for them), the pair, and a chunk as a point.

pub mod bm25;
pub mod filter;
pub mod hnsw;
pub mod recovery;
pub mod worker;

use parking_lot::Mutex;
use ragcluster_proto::v1::Chunk;

pub use filter::Filter;

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
        meta: filter::meta_of(c),
    }
}
