//! Write-behind inserts: points held beside the graph (`hnsw::pending`) go into it, a slice
//! at a time while writes pause, so a write that arrives meanwhile waits for at most one slice
//! (`holding` says how many and when).

use std::time::Instant;

use super::super::{Worker, crash_point};

impl Worker {
    /// Without write-behind, the points a restart caught up go into the graph before new
    /// writes; a write-behind replica leaves them to its idle moments and serves writes at
    /// once.
    pub(in super::super) fn absorb_at_start(&mut self) {
        if !self.policy.following.absorbs_at_start() {
            return;
        }
        let started = Instant::now();
        let n = self.indexes.hnsw.absorb_pending();
        if n > 0 {
            tracing::info!(shard = %self.key, points = n, ms = started.elapsed().as_millis() as u64,
                "points caught up at open inserted into the hnsw graph");
        }
    }

    /// A leader with points pending (written behind, or left from its follower days) inserts
    /// a slice of them; true when it did. The slice that empties the backlog is dumped at
    /// once: the burst is over, and the dump lets go of the op log it kept (and with it the
    /// write-ahead log) instead of keeping both until `hnsw_dump_interval`.
    pub(super) fn absorb_slice(&mut self) -> bool {
        if self.defers() || self.indexes.hnsw.pending_len() == 0 {
            return false;
        }
        let n = {
            let _g = self.indexes.update.lock();
            self.indexes
                .hnsw
                .absorb_some(self.policy.following.idle_slice())
        };
        crash_point!("index_absorb_slice");
        if n > 0 && self.indexes.hnsw.pending_len() == 0 {
            self.dump_graph(true);
        }
        n > 0
    }
}
