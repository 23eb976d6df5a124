//! The apply pipeline: what an acknowledgement waits on. A group of jobs updates HNSW (or
//! holds its points beside the graph) and is staged in tantivy; a commit makes the staged
//! groups searchable and publishes their last seq as visible.
//!
//! A tantivy commit costs the same whatever it holds (a new segment: its files, a term table
//! sized from the writer's memory budget, meta.json; about 7.5 ms of CPU on the 2-core test
//! machine for 25 or 500 documents alike), so a shard written concurrently commits at most
//! once per `Committing::interval`: groups staged sooner after the last commit wait for the
//! next one (HNSW inserts are not held back). A lone batch after a lone batch, or after a
//! quiet interval, commits at once, so a single writer waiting for each acknowledgement adds
//! no latency. Uncommitted tantivy state is what a crash loses anyway: the op log is kept back
//! to the committed seq and replays it.

use std::sync::atomic::Ordering;
use std::time::Instant;

use super::{Committing, Job, Worker, crash_point};
use crate::error::{Result, ShardError};
use crate::index::{point, recovery};
use crate::storage::ShardMeta;

/// What waits for a tantivy commit, and how the last one went.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Staged {
    /// The last seq staged in tantivy but not committed (searches do not see it yet).
    pub(super) seq: Option<u64>,
    /// Batches and chunks staged since the last commit.
    pub(super) batches: usize,
    pub(super) chunks: usize,
    pub(super) last_commit: Option<Instant>,
    /// Batches the last commit held: more than one means writes come concurrently.
    pub(super) last_commit_batches: usize,
}

/// When staged work is committed: at once unless writes come concurrently (the last commit or
/// the staged work holds more than one batch), so a lone writer waiting for each
/// acknowledgement never waits for the interval and concurrent writers share commits.
pub(super) fn commit_due(c: &Committing, s: Staged, now: Instant) -> Instant {
    let concurrent = s.batches > 1 || s.last_commit_batches > 1;
    if !concurrent || s.chunks >= c.max_chunks {
        return now;
    }
    s.last_commit.map_or(now, |t| t + c.interval)
}

impl Worker {
    /// Applies a group of jobs and commits it when due (a rebuilt index at once).
    pub(super) fn apply_group(&mut self, jobs: Vec<Job>) -> Result<()> {
        let rebuilt = jobs.iter().any(|j| matches!(j, Job::Rebuild { .. }));
        let last = jobs.last().map_or(self.at, Job::seq);
        let applied = self.apply(jobs);
        // HNSW took the whole group even when tantivy failed part-way (it stages last): a
        // BM25 restart (`restart`) brings tantivy to the same seq.
        self.at = self.at.max(last);
        applied?;
        crash_point!("index_apply_staged");
        if rebuilt || self.commit_is_due() {
            self.commit()?;
        }
        Ok(())
    }

    /// When the staged tantivy changes are to be committed (None: nothing staged).
    pub(super) fn commit_at(&self) -> Option<Instant> {
        self.staged.seq?;
        Some(commit_due(
            &self.policy.committing,
            self.staged,
            Instant::now(),
        ))
    }

    pub(super) fn commit_is_due(&self) -> bool {
        self.commit_at().is_some_and(|at| at <= Instant::now())
    }

    /// Commits what tantivy has staged, with the last staged seq as payload, and publishes
    /// that seq as visible (acknowledging its writes). The op log behind it is trimmed by the
    /// maintenance scheduler, after the acknowledgement.
    pub(super) fn commit(&mut self) -> Result<()> {
        let Some(seq) = self.staged.seq.take() else {
            return Ok(());
        };
        let started = Instant::now();
        self.indexes.bm25.commit(seq)?;
        crash_point!("index_commit_before_visible");
        self.staged = Staged {
            seq: None,
            batches: 0,
            chunks: 0,
            last_commit: Some(Instant::now()),
            last_commit_batches: self.staged.batches,
        };
        self.visible.send_replace(seq);
        if let Some(w) = self.shared.wake.get() {
            w();
        }
        metrics::histogram!("shard_bm25_commit_seconds").record(started.elapsed().as_secs_f64());
        Ok(())
    }

    /// Applies a group of jobs under the update lock: HNSW at once (or held beside the graph)
    /// for the whole group, then tantivy staged (committed by `commit`), so a tantivy failure
    /// leaves only tantivy behind. Returns the group's last seq.
    fn apply(&mut self, jobs: Vec<Job>) -> Result<u64> {
        let started = Instant::now();
        let n = jobs.len();
        let last = jobs.last().map_or(0, Job::seq);
        let ix = self.indexes.clone();
        let _g = ix.update.lock();
        // A snapshot replaced the state of every entry before it: start at the last one.
        let from = jobs
            .iter()
            .rposition(|j| matches!(j, Job::Rebuild { .. }))
            .unwrap_or(0);
        let mut batches = Vec::new();
        let mut rebuild_bm25 = false;
        for job in jobs.into_iter().skip(from) {
            match job {
                Job::Batch {
                    seq,
                    writes,
                    removed,
                } => {
                    let points: Vec<_> = writes
                        .iter()
                        .flat_map(|w| w.chunks.iter().map(point))
                        .collect();
                    self.state.changes += points.len() + removed.len();
                    let points = ix.hnsw.update_in_place(points);
                    let defers = self.defers();
                    self.policy.following.place(&ix.hnsw, defers, points, seq);
                    ix.hnsw.remove(&removed);
                    batches.push(writes);
                }
                Job::Skip(_) | Job::DumpNow | Job::Adopt(_) => {}
                Job::Rebuild { seq, dump } => {
                    // A graph that cannot be restored is not tantivy's to repair.
                    self.restore_graph(seq, dump)
                        .map_err(|e| ShardError::Corrupt(format!("graph not restored: {e}")))?;
                    rebuild_bm25 = true;
                }
            }
        }
        if rebuild_bm25 {
            self.restore_bm25(last)?;
        }
        for writes in &batches {
            ix.bm25.stage(writes)?;
            self.staged.chunks += writes.iter().map(|w| w.chunks.len()).sum::<usize>();
            self.staged.batches += 1;
        }
        let per_group = self.policy.following.per_group();
        if !self.defers() && per_group > 0 {
            ix.hnsw.absorb_some(per_group);
        }
        self.staged.seq = Some(last);
        self.shared
            .undumped
            .store(self.state.changes, Ordering::Release);
        metrics::histogram!("shard_index_group_seconds").record(started.elapsed().as_secs_f64());
        metrics::histogram!("shard_index_group_entries").record(n as f64);
        Ok(last)
    }

    /// Brings the graph to a snapshot installed at `seq`. The replica's own dumps describe a
    /// state the snapshot replaced and go; the graph is loaded from the dump the snapshot
    /// shipped and caught up from the op-log entries it carried (as at open), or rebuilt
    /// from RocksDB. BM25 is rebuilt next (`restore_bm25`).
    fn restore_graph(&mut self, seq: u64, dump: Option<u64>) -> Result<()> {
        let t = Instant::now();
        if !dump.is_some_and(|d| self.dumps.adopt_received(d)) {
            self.dumps.remove_except(None);
        }
        let hnsw = &self.indexes.hnsw;
        let meta = ShardMeta {
            dimension: hnsw.dim() as u32,
            hnsw: hnsw.params(),
        };
        let (graph, mut state) =
            recovery::open_hnsw(&self.key, &meta, &self.store, &self.dumps, seq)?;
        hnsw.replace(graph);
        hnsw.absorb_pending();
        let source = if state.dumped.is_some() {
            "shipped"
        } else {
            // Dumped right after this group, so a restart need not rebuild it again.
            state.changes = usize::MAX / 2;
            "rebuilt"
        };
        self.shared
            .dumped
            .store(state.dumped.unwrap_or(0), Ordering::Release);
        self.state = state;
        crash_point!("index_restore_graph_loaded");
        metrics::counter!("shard_snapshot_graphs_total", "graph" => source).increment(1);
        tracing::info!(shard = %self.key, seq, graph = source, points = hnsw.counts().0,
            ms = t.elapsed().as_millis() as u64, "graph brought to an installed snapshot");
        Ok(())
    }

    /// Rebuilds BM25 from RocksDB after a snapshot was installed (staged; committed with the
    /// group it came in).
    fn restore_bm25(&mut self, seq: u64) -> Result<()> {
        let t = Instant::now();
        self.indexes.bm25.clear()?;
        self.store.for_each_chunk(&self.key, false, |c| {
            self.indexes.bm25.stage_chunks(std::slice::from_ref(&c))
        })?;
        tracing::info!(shard = %self.key, seq, ms = t.elapsed().as_millis() as u64,
            "bm25 rebuilt for an installed snapshot");
        Ok(())
    }
}
