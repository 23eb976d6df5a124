//! A shard's dense index: an hnsw_rs graph over L2-normalised embeddings, scored by cosine.
//!
//! The graph is built and walked on int8 codes of the vectors (`sq8`): every distance an
//! insert evaluates reads a quarter of the bytes, which is what ingest at 100k points is bound
//! by. The f32 vectors stay beside the slot table, and a walk's candidates are rescored with
//! them, so the scores a search returns are exact cosines and the order among the ef
//! candidates is exact (as Qdrant and Lucene do with their quantised HNSW).
//!
//! hnsw_rs cannot delete points, so a replaced or deleted chunk leaves a tombstone: its slot is
//! marked dead and filtered out at query time. When tombstones pile up the shard rebuilds the
//! graph from RocksDB (`HnswIndex::rebuild`). A metadata filter is planned by the share of
//! points it matches (`planner`): few are scored exactly, a large share walks the plain graph
//! wider and drops the rest, and in between hnsw_rs walks with the filter.
//!
//! The graph and its slot table can be written to a directory and read back
//! (`write_parts`/`read_parts`; `dump` owns the files' lifecycle), so a restart loads the
//! graph instead of rebuilding it.
//!
//! The files: `graph` (the index: slots, inserts, searches, rebuilds), `pending` (points
//! searched beside the graph), `flat` and `links` (the read-optimised copy of the bottom layer
//! and the links it mends), `parts` (the graph and slot table as files), `dump` (those files'
//! lifecycle), `vectors` (dumps without a second copy of the vectors), `planner` (how a filtered search walks), `sq8` and `distance`
//! (the codes the graph walks and the exact scores), `bq` (one-bit codes that shortlist a
//! filter's many matches). They share the vocabulary below; none
//! reaches into another's types.

mod bq;
pub mod distance;
pub mod dump;
mod flat;
mod graph;
mod links;
mod parts;
mod pending;
pub mod planner;
pub mod sq8;
mod vectors;

pub use crate::storage::HnswParams;
pub use distance::{UnitCosine, dot, normalize};
pub use flat::Reach;
pub use graph::HnswIndex;
pub use vectors::FetchVectors;

use hnsw_rs::hnsw::Hnsw;

use super::Filter;
pub use super::filter::Meta;
use sq8::Sq8Cosine;

/// The graph as hnsw_rs holds it: int8 codes under the code distance.
pub type CodeGraph = Hnsw<'static, i8, Sq8Cosine>;

/// How a dense search finds its candidates.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scan {
    /// Walk the graph this wide (ef), as the filter's plan says.
    Walk(usize),
    /// Score every live point matching the filter with its f32 vector: the exact top.
    Exact,
}

/// One point to insert.
#[derive(Clone)]
pub struct Point {
    pub chunk_id: String,
    pub doc_id: String,
    pub vector: Vec<f32>,
    pub meta: Meta,
}

/// File names inside a dump directory: hnsw_rs writes `<GRAPH_BASENAME>.hnsw.graph` and
/// `.hnsw.data` (the codes; replaced by `vectors`' files); the slot table is ours.
pub const GRAPH_BASENAME: &str = "graph";
pub const SLOTS_FILE: &str = "slots.bin";

/// Starts loading the first `lines` cache lines of `data` (fewer if it is shorter).
#[inline]
pub fn prefetch_lines<T>(data: &[T], lines: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
        let bytes = std::mem::size_of_val(data);
        let start = data.as_ptr() as *const i8;
        // SAFETY: a prefetch is a hint that cannot fault; every address is inside `data`.
        #[allow(unsafe_code)]
        unsafe {
            for off in (0..bytes).step_by(64).take(lines) {
                _mm_prefetch::<_MM_HINT_T0>(start.add(off));
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (data, lines);
}

#[cfg(test)]
pub(crate) mod tests;
