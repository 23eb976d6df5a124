//! The maintenance scheduler: the index upkeep no acknowledgement waits on, one file per task,
//! and `Schedule`, the one place that says when each runs.
//!
//! | task | file | runs |
//! |---|---|---|
//! | write-behind inserts | `absorb` | at start (without write-behind); a slice per idle moment once writes pause `Following::quiet` |
//! | flat copy of the bottom layer | `flat_copy` | once writes pause `flat_quiet` (ten times the last copy, at least 50 ms) |
//! | BM25 segment merge | `merge` | once writes pause ten times the last merge, at least 1 s |
//! | HNSW graph dump | `dump` | after a group once enough changed, or `Dumping::interval` after a change; asked by a snapshot; at shutdown |
//! | op-log trim | `trim` | after every group and commit, and after each dump |
//! | graph compaction | `compact` | after a group once tombstones exceed `Compaction` |
//! | leader's dump adopted | `adopt` | after the group it arrived with (followers) |
//!
//! Tasks run on the worker's thread: in a quiet moment (`idle`, one round at a time, so a job
//! that arrives meanwhile waits for at most one task), or right after a group (`after_group`)
//! for the ones a steady load must not starve.

mod absorb;
mod adopt;
mod compact;
mod dump;
mod flat_copy;
mod merge;
mod trim;

use std::time::{Duration, Instant};

use super::Worker;

/// Least write silence after which the HNSW graph's bottom layer is copied for fast walks
/// (`hnsw::flat`); short, as searches take hnsw_rs's slower walk until then.
const FLAT_AFTER_QUIET: Duration = Duration::from_millis(50);
/// Write silence before the BM25 segments are merged into one: at least this, and ten times
/// the last merge's duration, so merging takes at most about a tenth of a core while writes
/// come in bursts.
const MERGE_AFTER_QUIET: Duration = Duration::from_secs(1);
/// Shortest wait between two rounds of idle maintenance.
const MIN_WAIT: Duration = Duration::from_millis(10);

/// When each task is next due.
pub(super) struct Schedule {
    /// When the last group with writes was applied.
    last_write: Instant,
    /// The flat copy is stale (writes since the last one).
    flat_due: bool,
    /// Segments were written since the last merge.
    merge_due: bool,
    /// Write silence before the next flat copy: ten times the last copy's duration (at least
    /// `FLAT_AFTER_QUIET`), so copying takes at most about a tenth of the worker's time and a
    /// trickle of writes to a big shard does not keep it copying.
    flat_quiet: Duration,
    /// When the last dump was written (or tried).
    last_dump: Instant,
}

impl Schedule {
    pub(super) fn new() -> Self {
        Self {
            last_write: Instant::now(),
            flat_due: true,
            merge_due: true,
            flat_quiet: FLAT_AFTER_QUIET,
            last_dump: Instant::now(),
        }
    }

    /// A group with writes was applied: every idle task is due again after its quiet time.
    fn wrote(&mut self) {
        self.flat_due = true;
        self.merge_due = true;
        self.last_write = Instant::now();
    }

    /// Write silence before a merge.
    fn merge_quiet(w: &Worker) -> Duration {
        (w.indexes.bm25.last_merge() * 10).max(MERGE_AFTER_QUIET)
    }

    /// How long the worker may wait for a job before some task is due.
    pub(super) fn wait(&self, w: &Worker) -> Duration {
        let mut wait = w
            .policy
            .dumping
            .interval
            .saturating_sub(self.last_dump.elapsed())
            .max(MIN_WAIT);
        if self.flat_due {
            wait = wait.min(self.flat_quiet);
        }
        if self.merge_due {
            let left = Self::merge_quiet(w).saturating_sub(self.last_write.elapsed());
            wait = wait.min(left.max(MIN_WAIT));
        }
        // Points to insert once writes pause (a leftover backlog at once).
        if !w.defers() && w.indexes.hnsw.pending_len() > 0 {
            let quiet = w.policy.following.quiet();
            wait = wait.min(quiet.saturating_sub(self.last_write.elapsed()));
        }
        wait
    }
}

impl Worker {
    /// Before the first job: points caught up at open go into the graph (without
    /// write-behind), then a graph rebuilt at open is dumped at once, so the next restart
    /// loads it.
    pub(super) fn at_start(&mut self) {
        self.absorb_at_start();
        self.dump_graph(false);
    }

    /// One round of maintenance in a quiet moment, in order of what searches gain most from:
    /// a slice of held points into the graph (and nothing else this round), else the flat
    /// copy, a segment merge and a dump when each is due.
    pub(super) fn idle(&mut self) {
        let quiet = self.schedule.last_write.elapsed();
        if quiet >= self.policy.following.quiet() && self.absorb_slice() {
            self.schedule.flat_due = true;
            return;
        }
        if self.schedule.flat_due {
            self.refresh_flat();
            self.schedule.flat_due = false;
        }
        if self.schedule.merge_due && quiet >= Schedule::merge_quiet(self) {
            self.schedule.merge_due = false;
            self.merge_segments();
        }
        self.dump_graph(false);
        self.trim_oplog();
    }

    /// What is due right after a group: `wrote` when it held entries (not only control jobs).
    /// A dump a snapshot asked for, or one enough changes call for; a leader's dump to adopt;
    /// compaction; the op-log trim the last commit allows.
    pub(super) fn after_group(&mut self, wrote: bool, asked: bool, adopt: Option<u64>) {
        if wrote {
            self.schedule.wrote();
        }
        if let Some(seq) = adopt {
            self.adopt(seq);
            self.schedule.flat_due = true;
        }
        if asked && self.state.changes > 0 {
            self.dump();
        } else if wrote {
            self.dump_graph(false);
        }
        if wrote {
            self.compact_if_due();
        }
        self.trim_oplog();
    }
}
