//! HNSW graph dumps (`hnsw::dump` owns the files): a restart loads the newest dump and catches
//! it up from the op log instead of rebuilding the graph, and the op log before a dump can go.

use std::sync::atomic::Ordering;
use std::time::Instant;

use super::super::{Worker, crash_point};
use crate::index::hnsw::dump::DumpState;

impl Worker {
    /// Dumps the graph as of `graph_through` when it holds changes the last dump lacks and
    /// enough changed, the interval passed, or `force`. A follower's pending points wait for
    /// its leader's dump instead (as do a leftover backlog's without write-behind).
    pub(in super::super) fn dump_graph(&mut self, force: bool) {
        let changes = self.state.changes;
        let pending = self.indexes.hnsw.pending_len();
        let while_holding = self.policy.following.dumps_while_holding(self.defers());
        if changes == 0 || (pending > 0 && !while_holding) {
            return;
        }
        let through = self.indexes.hnsw.graph_through(self.at);
        if self.state.dumped.is_some_and(|d| d >= through) {
            return;
        }
        let (live, dead) = self.indexes.hnsw.counts();
        let dumping = self.policy.dumping;
        let enough = changes.saturating_sub(pending) >= dumping.min_changes.max((live + dead) / 10);
        let due = self.schedule.last_dump.elapsed() >= dumping.interval;
        if force || enough || due {
            self.write_dump(through);
        }
    }

    /// Writes a dump of the graph as of `self.at`, its pending points inserted first (a
    /// snapshot waits for it).
    pub(super) fn dump(&mut self) {
        if self.indexes.hnsw.pending_len() > 0 {
            let _g = self.indexes.update.lock();
            self.indexes.hnsw.absorb_pending();
        }
        self.write_dump(self.at);
    }

    /// Writes a dump of the graph, which holds every point up to `seq`. A failure is logged and
    /// retried later: the op log is kept back to the last good dump meanwhile.
    fn write_dump(&mut self, seq: u64) {
        let started = Instant::now();
        self.schedule.last_dump = started;
        crash_point!("index_dump_start");
        match self.dumps.write(&self.indexes.hnsw, seq) {
            Ok(bytes) => {
                crash_point!("index_dump_written");
                let secs = started.elapsed().as_secs_f64();
                metrics::histogram!("shard_hnsw_dump_seconds").record(secs);
                let pending = self.indexes.hnsw.pending_len();
                tracing::info!(shard = %self.key, seq, applied = self.at, pending, bytes,
                    ms = (secs * 1e3) as u64, "hnsw graph dumped");
                self.state = DumpState {
                    dumped: Some(seq),
                    changes: pending,
                };
                self.shared.dumped.store(seq, Ordering::Release);
                self.shared.undumped.store(pending, Ordering::Release);
                // Held points inserted while writes pause are dumped without a BM25 commit
                // after them: the entries they kept are let go here.
                self.trim_oplog();
            }
            Err(e) => {
                metrics::counter!("shard_hnsw_dump_failures_total").increment(1);
                tracing::error!(shard = %self.key, error = %e,
                    "hnsw dump failed; the op log is kept back to the previous dump");
            }
        }
    }
}
