//! The flat copy of the graph's bottom layer (`hnsw::flat`) that searches walk, taken again
//! once writes pause.

use std::time::Instant;

use super::super::{Worker, crash_point};
use super::FLAT_AFTER_QUIET;

impl Worker {
    /// Copies the bottom layer unless the copy is current, and spaces the next copy ten times
    /// this one's duration after the next write.
    pub(super) fn refresh_flat(&mut self) {
        let started = Instant::now();
        if self.indexes.hnsw.refresh_flat() {
            crash_point!("index_flat_copied");
            let took = started.elapsed();
            self.schedule.flat_quiet = (took * 10).max(FLAT_AFTER_QUIET);
            let secs = took.as_secs_f64();
            metrics::histogram!("shard_hnsw_flat_copy_seconds").record(secs);
            tracing::debug!(shard = %self.key, ms = (secs * 1e3) as u64,
                "hnsw bottom layer copied for fast walks");
        }
    }
}
