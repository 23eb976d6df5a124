//! A failed BM25 update (a full disk, an I/O error, a killed tantivy indexing thread) does not
//! stop the worker: the tantivy writer is rolled back to its last commit and started afresh,
//! the op-log entries after that commit are replayed into it (every applied batch is in the
//! op log until BM25 commits it), and it commits through the last applied seq. Tried again
//! with a growing pause until it succeeds, so a node whose disk filled indexes again by itself
//! once space is freed. HNSW needs nothing: it lives in memory and `apply` updates it for the
//! whole group before tantivy stages any of it.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::Worker;
use super::apply::Staged;
use crate::error::{Result, ShardError};
use crate::index::recovery;

/// First and longest pause between two tries.
const FIRST_PAUSE: Duration = Duration::from_millis(200);
const LONGEST_PAUSE: Duration = Duration::from_secs(5);

impl Worker {
    /// Brings BM25 to `self.at` after `e`; `Err` only when the worker is asked to stop first
    /// (the op log replays the rest at the next start).
    pub(super) fn restart_bm25(&mut self, e: ShardError) -> Result<()> {
        if matches!(e, ShardError::Corrupt(_)) {
            return Err(e);
        }
        let target = self.at;
        let started = Instant::now();
        tracing::warn!(shard = %self.key, error = %e, target,
            "bm25 update failed; restarting its writer from the last commit and the op log");
        *self.shared.degraded.lock() = Some(e.to_string());
        let mut pause = FIRST_PAUSE;
        let mut tries = 0u32;
        loop {
            tries += 1;
            match self.refill_bm25(target) {
                Ok(()) => break,
                Err(e) => {
                    tracing::debug!(shard = %self.key, error = %e, tries, "bm25 restart failed");
                    *self.shared.degraded.lock() = Some(e.to_string());
                }
            }
            if self.shared.stopping.load(Ordering::Acquire) {
                return Err(e);
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(LONGEST_PAUSE);
        }
        *self.shared.degraded.lock() = None;
        self.staged = Staged {
            last_commit: Some(Instant::now()),
            ..Staged::default()
        };
        self.visible.send_replace(target);
        if let Some(w) = self.shared.wake.get() {
            w();
        }
        metrics::counter!("shard_bm25_writer_restarts_total").increment(1);
        tracing::info!(shard = %self.key, target, tries,
            ms = started.elapsed().as_millis() as u64, "bm25 writer restarted");
        Ok(())
    }

    /// One try: a fresh writer at the last commit, caught up to `target`.
    fn refill_bm25(&mut self, target: u64) -> Result<()> {
        let bm25 = &self.indexes.bm25;
        bm25.restart_writer()?;
        recovery::catch_up_bm25(&self.key, &self.store, bm25, target)
    }
}
