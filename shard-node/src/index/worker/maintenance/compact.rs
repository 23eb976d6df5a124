//! Graph compaction: hnsw_rs cannot delete points, so replaced and deleted chunks leave
//! tombstones; once they exceed the configured share the graph is rebuilt from RocksDB.

use std::time::Instant;

use super::super::{Worker, crash_point};
use crate::index::point;

impl Worker {
    /// Rebuilds the HNSW graph when tombstones exceed the configured share. A failure to read
    /// the chunks is logged and tried again after the next group (searches skip tombstones
    /// meanwhile).
    pub(super) fn compact_if_due(&mut self) {
        let (live, dead) = self.indexes.hnsw.counts();
        let c = self.policy.compaction;
        if dead < c.min || (dead as f64) < c.ratio * (live + dead) as f64 {
            return;
        }
        let started = Instant::now();
        let _g = self.indexes.update.lock();
        let mut points = Vec::with_capacity(live);
        let read = self.store.for_each_chunk(&self.key, true, |ch| {
            points.push(point(&ch));
            Ok(())
        });
        if let Err(e) = read {
            tracing::warn!(shard = %self.key, error = %e, "hnsw compaction could not read the chunks");
            return;
        }
        crash_point!("index_compact_read");
        self.indexes.hnsw.rebuild(points);
        tracing::info!(shard = %self.key, dead, live, ms = started.elapsed().as_millis() as u64,
            "hnsw compacted");
    }
}
