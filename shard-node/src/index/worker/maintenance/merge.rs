//! BM25 segment merges: the segments small commits left are merged into one once writes
//! pause (tantivy merges on its own threads; this starts it).

use super::super::{Worker, crash_point};

impl Worker {
    pub(super) fn merge_segments(&mut self) {
        crash_point!("index_merge_start");
        if let Err(e) = self.indexes.bm25.merge_segments() {
            tracing::warn!(shard = %self.key, error = %e, "bm25 merge not started");
        }
    }
}
