//! Which written points a replica holds beside its HNSW graph (`hnsw::pending`) instead of
//! inserting them before their write is acknowledged, and when it inserts them.
//!
//! A follower holds them and loads its leader's dumps of them (`Job::Adopt`) instead of
//! inserting each point itself, so a shard's graph is built once, not once per replica. A
//! leader (or a lone replica) with `behind_max` > 0 writes behind: up to that many points are
//! acknowledged before they are in the graph, and inserted once writes pause, or the oldest
//! first to make room, so a burst of writes is not held to hnsw_rs's insert rate while writes
//! keep the cores busy. Its dumps stand for the graph as of the entry before the oldest held
//! point.

use std::time::Duration;

use crate::index::hnsw::{HnswIndex, Point};

#[derive(Debug, Clone, Copy)]
pub struct Following {
    /// Whether followers hold their points for the leader's dumps.
    pub enabled: bool,
    /// At most this many held points on a follower (plus `behind_max`, by which the leader's
    /// graph, and so its dumps, may lag): beyond, it inserts new points itself.
    pub pending_max: usize,
    /// A leader's write-behind bound (0: insert before acknowledging).
    pub behind_max: usize,
}

/// Pending points a leader without write-behind inserts per group of jobs (and per idle
/// moment) after it took over from a follower's role, so a write after a failover waits for
/// a slice of that work, not all of it; also the most a write-behind leader inserts per group
/// to make room.
const ABSORB_SLICE: usize = 1024;
/// Pending points a write-behind leader inserts per idle moment: a write that arrives
/// meanwhile waits for at most this slice (about 50 ms on 2 cores at ef_construction 200).
const IDLE_SLICE: usize = 128;
/// Write silence after which a write-behind leader inserts held points. Long enough that a
/// writer with one batch in flight per shard does not look like a pause: on 2 cores with
/// three shard nodes the gaps between one shard's batches of 512 chunks run to hundreds of
/// milliseconds (Raft, RocksDB, the other shards), and at 50 ms the graph took those gaps
/// and ingest ran at its insert rate as before (100k chunks: 1,020 against 993 chunks/s).
const ABSORB_AFTER_QUIET: Duration = Duration::from_secs(1);

impl Following {
    /// Holds or inserts the points the entry at `seq` wrote, on a follower (`following`) or a
    /// leader.
    pub(super) fn place(&self, hnsw: &HnswIndex, following: bool, points: Vec<Point>, seq: u64) {
        let (pending, n) = (hnsw.pending_len(), points.len());
        if following {
            if pending + n <= self.pending_max + self.behind_max {
                hnsw.defer(points, seq);
            } else {
                hnsw.insert(points);
            }
        } else if self.behind_max > 0 && n <= self.behind_max {
            // Room is made by inserting the oldest (a slice at a time when a follower's
            // backlog is bigger than the bound).
            let over = (pending + n).saturating_sub(self.behind_max);
            if over > 0 {
                hnsw.absorb_some(over.min(ABSORB_SLICE.max(n)));
            }
            hnsw.defer(points, seq);
        } else {
            hnsw.insert(points);
        }
    }

    /// Held points a leader inserts after each group of writes, pause or not.
    pub(super) fn per_group(&self) -> usize {
        if self.behind_max == 0 {
            ABSORB_SLICE
        } else {
            0
        }
    }

    /// Held points a leader inserts per idle moment.
    pub(super) fn idle_slice(&self) -> usize {
        if self.behind_max == 0 {
            ABSORB_SLICE
        } else {
            IDLE_SLICE
        }
    }

    /// Write silence before a leader inserts held points.
    pub(super) fn quiet(&self) -> Duration {
        if self.behind_max == 0 {
            Duration::ZERO
        } else {
            ABSORB_AFTER_QUIET
        }
    }

    /// Whether held points are inserted at once when the worker starts (without write-behind
    /// a restart's caught-up points go into the graph before new writes).
    pub(super) fn absorbs_at_start(&self) -> bool {
        self.behind_max == 0
    }

    /// Whether a replica may dump its graph while points are held beside it: a write-behind
    /// leader may (the dump stands for the graph's own seq); a follower waits for its leader.
    pub(super) fn dumps_while_holding(&self, following: bool) -> bool {
        !following && self.behind_max > 0
    }
}
