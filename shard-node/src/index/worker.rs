//! Applies committed batches to a shard's indexes on a thread of their own, so the Raft thread
//! only writes RocksDB (durable) and moves on. Jobs arrive in log order; the worker takes all
//! that queued up, updates HNSW, stages everything in tantivy and commits once with the last
//! sequence number as payload (group commit), then publishes that sequence as visible. Writes
//! are acknowledged, and strong reads answered, once their sequence is visible.
//!
//! A tantivy commit costs the same whatever it holds (a new segment: its files, a term table
//! sized from the writer's memory budget, meta.json; about 7.5 ms of CPU on the 2-core test
//! machine for 25 or 500 documents alike), so a shard written concurrently commits at most
//! once per `Committing::interval`: groups staged sooner after the last commit wait for the
//! next one (HNSW inserts are not held back). A lone batch after a lone batch, or after a
//! quiet interval, commits at once, so a single writer waiting for each acknowledgement adds
//! no latency. Uncommitted tantivy state is what a crash loses anyway:
//! the op log is kept back to the committed seq and replays it.
//!
//! Crash windows: a batch is in RocksDB and the op log before it is queued here, so one lost in
//! a crash is replayed at open: into BM25 from its committed seq, into HNSW from the seq of its
//! last dump. The worker writes those dumps (`Dumping`) and keeps the op log back to the
//! older of the two.

use std::sync::Arc;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, Sender};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use ragcluster_proto::v1::DocumentWrite;
use tokio::sync::watch;

use super::hnsw_dump::Dumps;
use super::{Indexes, point, recovery};
use crate::error::{Result, ShardError};
use crate::storage::{ShardKey, ShardMeta, Store};
pub use holding::Following;

/// What the Raft thread hands over, in log order.
pub enum Job {
    /// A batch durable at `seq`: its writes, and the chunk ids it replaced that it did not
    /// write again.
    Batch {
        seq: u64,
        writes: Vec<DocumentWrite>,
        removed: Vec<String>,
    },
    /// An entry that changed no chunk.
    Skip(u64),
    /// A snapshot was installed at `seq`: the HNSW graph comes from the dump it shipped
    /// (`dump`, its seq, received beside the other dumps) when there is one, else both
    /// indexes are rebuilt from RocksDB.
    Rebuild { seq: u64, dump: Option<u64> },
    /// Dump the graph now if it changed since the last dump (a snapshot waits for it).
    /// Carries no seq: it is taken out of a group before the group is applied.
    DumpNow,
    /// The leader's dump of this seq was received (`Dumps::receive`): a follower loads it
    /// instead of inserting the points it holds pending. Taken out of a group like `DumpNow`
    /// and handled after it.
    Adopt(u64),
}

impl Job {
    fn seq(&self) -> u64 {
        match self {
            Job::Batch { seq, .. } | Job::Skip(seq) | Job::Rebuild { seq, .. } => *seq,
            Job::DumpNow | Job::Adopt(_) => 0,
        }
    }
}

/// When to rebuild the HNSW graph: tombstones over `ratio` of all points and at least `min`.
#[derive(Debug, Clone, Copy)]
pub struct Compaction {
    pub ratio: f64,
    pub min: usize,
}

/// When to dump the HNSW graph: once `min_changes` points changed (or a tenth of the graph, if
/// more, so a big graph is not rewritten all the time), or `interval` after a change.
#[derive(Debug, Clone, Copy)]
pub struct Dumping {
    pub min_changes: usize,
    pub interval: Duration,
}

/// When tantivy commits (see the module doc).
#[derive(Debug, Clone, Copy)]
pub struct Committing {
    /// Least time between two commits while groups keep coming (zero: one per group).
    pub interval: Duration,
    /// ...unless this many chunks wait uncommitted.
    pub max_chunks: usize,
}

/// Where the HNSW graph stands against its dumps when the worker starts.
pub struct DumpState {
    /// Seq of the dump on disk, if any.
    pub dumped: Option<u64>,
    /// Points inserted or removed since then.
    pub changes: usize,
}

pub struct IndexWorker {
    tx: Mutex<Option<Sender<Job>>>,
    /// Set before `stop` when the graph should be dumped on the way out (shutdown).
    dump_on_stop: Arc<AtomicBool>,
    visible: watch::Receiver<u64>,
    failed: Arc<AtomicBool>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
    wake: Arc<OnceLock<Box<dyn Fn() + Send + Sync>>>,
    undumped: Arc<AtomicUsize>,
    /// Whether this replica follows (set from its Raft role) and defers inserts.
    following: Arc<AtomicBool>,
    /// Seq of the dump the graph comes from (0: none), for the leader to ship a newer one.
    dumped: Arc<AtomicU64>,
}

struct Worker {
    key: ShardKey,
    store: Arc<Store>,
    indexes: Arc<Indexes>,
    compaction: Compaction,
    visible: watch::Sender<u64>,
    wake: Arc<OnceLock<Box<dyn Fn() + Send + Sync>>>,
    dumps: Arc<Dumps>,
    dumping: Dumping,
    state: DumpState,
    /// `state.changes` as others see it.
    undumped: Arc<AtomicUsize>,
    following: Arc<AtomicBool>,
    follow: Following,
    dumped: Arc<AtomicU64>,
    last_dump: Instant,
    /// Write silence before the next flat copy: ten times the last copy's duration (at
    /// least `FLAT_AFTER_QUIET`), so copying takes at most about a tenth of the worker's
    /// time and a trickle of writes to a big shard does not keep it copying.
    flat_quiet: Duration,
    /// The seq the indexes reflect (the last group applied; tantivy once committed).
    at: u64,
    /// The op log is trimmed through here (a trim that would drop nothing new is skipped).
    trimmed: u64,
    committing: Committing,
    /// The last seq staged in tantivy but not committed (searches do not see it yet).
    staged: Option<u64>,
    /// What is staged since the last commit, and how that commit went.
    tally: Staged,
}

const MAX_GROUP: usize = 256;

/// What waits for a tantivy commit, and how the last one went.
#[derive(Debug, Clone, Copy, Default)]
struct Staged {
    /// Batches and chunks staged since the last commit.
    batches: usize,
    chunks: usize,
    last_commit: Option<Instant>,
    /// Batches the last commit held: more than one means writes come concurrently.
    last_commit_batches: usize,
}

/// When staged work is committed (see `Worker::commit_at`).
fn commit_due(c: &Committing, s: Staged, now: Instant) -> Instant {
    let concurrent = s.batches > 1 || s.last_commit_batches > 1;
    if !concurrent || s.chunks >= c.max_chunks {
        return now;
    }
    s.last_commit.map_or(now, |t| t + c.interval)
}

/// `first` and the jobs queued behind it (up to `MAX_GROUP`), without the control jobs: and
/// whether a dump was asked for, and the newest leader dump to adopt.
fn group(first: Job, rx: &Receiver<Job>) -> (Vec<Job>, bool, Option<u64>) {
    let mut jobs = vec![first];
    while jobs.len() < MAX_GROUP {
        match rx.try_recv() {
            Ok(j) => jobs.push(j),
            Err(_) => break,
        }
    }
    let asked = jobs.iter().any(|j| matches!(j, Job::DumpNow));
    let adopt = jobs
        .iter()
        .filter_map(|j| match j {
            Job::Adopt(seq) => Some(*seq),
            _ => None,
        })
        .max();
    jobs.retain(|j| !matches!(j, Job::DumpNow | Job::Adopt(_)));
    (jobs, asked, adopt)
}

/// Least write silence after which the HNSW graph's bottom layer is copied for fast walks
/// (`hnsw_flat`); short, as searches take hnsw_rs's slower walk until then.
const FLAT_AFTER_QUIET: Duration = Duration::from_millis(50);
/// Write silence before the BM25 segments are merged into one: at least this, and ten times
/// the last merge's duration, so merging takes at most about a tenth of a core while writes
/// come in bursts.
const MERGE_AFTER_QUIET: Duration = Duration::from_secs(1);

impl IndexWorker {
    /// Starts the worker with everything up to `visible` already in the indexes.
    #[allow(clippy::too_many_arguments)]
    pub fn start(
        key: ShardKey,
        store: Arc<Store>,
        indexes: Arc<Indexes>,
        visible: u64,
        compaction: Compaction,
        dumps: Arc<Dumps>,
        dumping: Dumping,
        state: DumpState,
        follow: Following,
        committing: Committing,
    ) -> Result<Self> {
        let (tx, rx) = std::sync::mpsc::channel();
        let following = Arc::new(AtomicBool::new(false));
        let dumped = Arc::new(AtomicU64::new(state.dumped.unwrap_or(0)));
        let (vtx, vrx) = watch::channel(visible);
        let failed = Arc::new(AtomicBool::new(false));
        let wake: Arc<OnceLock<Box<dyn Fn() + Send + Sync>>> = Arc::default();
        let undumped = Arc::new(AtomicUsize::new(state.changes));
        let w = Worker {
            key: key.clone(),
            store,
            indexes,
            compaction,
            visible: vtx,
            wake: wake.clone(),
            dumps,
            dumping,
            state,
            undumped: undumped.clone(),
            following: following.clone(),
            follow,
            dumped: dumped.clone(),
            last_dump: Instant::now(),
            flat_quiet: FLAT_AFTER_QUIET,
            at: visible,
            trimmed: 0,
            committing,
            staged: None,
            tally: Staged::default(),
        };
        let f = failed.clone();
        let dump_on_stop = Arc::new(AtomicBool::new(false));
        let d = dump_on_stop.clone();
        let thread = std::thread::Builder::new()
            .name(format!("index-{key}"))
            .spawn(move || {
                // A panic (hnsw_rs asserts) fails the worker like an error does: writes then
                // get a clear UNAVAILABLE instead of waiting for visibility until their deadline.
                let run = std::panic::AssertUnwindSafe(|| w.run(rx, &f, &d));
                if std::panic::catch_unwind(run).is_err() {
                    f.store(true, Ordering::Release);
                }
            })?;
        Ok(Self {
            tx: Mutex::new(Some(tx)),
            dump_on_stop,
            visible: vrx,
            failed,
            thread: Mutex::new(Some(thread)),
            wake,
            undumped,
            following,
            dumped,
        })
    }

    /// Whether this replica follows its group's leader (and so defers inserts, when enabled).
    pub fn set_following(&self, following: bool) {
        self.following.store(following, Ordering::Release);
    }

    /// Seq of the dump the graph comes from, 0 when none.
    pub fn dumped_seq(&self) -> u64 {
        self.dumped.load(Ordering::Acquire)
    }

    /// Called after each group of jobs (the Raft member republishes its status).
    pub fn on_progress(&self, f: Box<dyn Fn() + Send + Sync>) {
        let _ = self.wake.set(f);
    }

    pub fn push(&self, job: Job) {
        if let Some(tx) = self.tx.lock().as_ref() {
            let _ = tx.send(job);
        }
    }

    /// Points inserted or removed since the last HNSW dump.
    pub fn undumped(&self) -> usize {
        self.undumped.load(Ordering::Acquire)
    }

    /// The highest sequence whose effects searches see.
    pub fn visible(&self) -> u64 {
        *self.visible.borrow()
    }

    /// Waits until `seq` is visible, or fails at `deadline`.
    pub async fn wait_visible(&self, seq: u64, deadline: Instant) -> Result<()> {
        if self.visible() >= seq {
            return Ok(());
        }
        let mut rx = self.visible.clone();
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, rx.wait_for(|v| *v >= seq)).await {
            Ok(Ok(_)) => Ok(()),
            _ if self.failed.load(Ordering::Acquire) => Err(ShardError::Unavailable(
                "the shard's indexes failed to update; the write is durable and is indexed \
                 again when the node restarts"
                    .into(),
            )),
            _ => Err(ShardError::Unavailable(format!(
                "entry {seq} is durable but not yet searchable after {} ms",
                left.as_millis()
            ))),
        }
    }

    /// Finishes the queued jobs and stops the thread; with `dump`, writes an HNSW dump first if
    /// the graph changed since the last one (a clean shutdown then restarts without replay).
    pub fn stop(&self, dump: bool) {
        if dump {
            self.dump_on_stop.store(true, Ordering::Release);
        }
        self.tx.lock().take();
        if let Some(t) = self.thread.lock().take() {
            let _ = t.join();
        }
    }
}

impl Drop for IndexWorker {
    fn drop(&mut self) {
        self.stop(false);
    }
}

impl Worker {
    fn run(mut self, rx: Receiver<Job>, failed: &AtomicBool, dump_on_stop: &AtomicBool) {
        // Points caught up at open go into the graph first (searches merge them meanwhile);
        // then a graph rebuilt at open is dumped at once, so the next restart loads it.
        // A write-behind replica leaves them to its idle moments and serves writes at once.
        let started = Instant::now();
        let n = if self.follow.absorbs_at_start() {
            self.indexes.hnsw.absorb_pending()
        } else {
            0
        };
        if n > 0 {
            tracing::info!(shard = %self.key, points = n, ms = started.elapsed().as_millis() as u64,
                "points caught up at open inserted into the hnsw graph");
        }
        self.dump_graph(false);
        // The flat copy of the graph's bottom layer is taken once writes pause this long,
        // BM25's segments are merged after a longer pause.
        let mut flat_due = true;
        let mut merge_due = true;
        let mut last_write = Instant::now();
        loop {
            let mut wait = self
                .dumping
                .interval
                .saturating_sub(self.last_dump.elapsed())
                .max(Duration::from_millis(10));
            if flat_due {
                wait = wait.min(self.flat_quiet);
            }
            let merge_quiet = (self.indexes.bm25.last_merge() * 10).max(MERGE_AFTER_QUIET);
            if merge_due {
                let left = merge_quiet.saturating_sub(last_write.elapsed());
                wait = wait.min(left.max(Duration::from_millis(10)));
            }
            if let Some(at) = self.commit_at() {
                wait = wait.min(at.saturating_duration_since(Instant::now()));
            }
            // Points to insert once writes pause (a leftover backlog at once).
            if !self.defers() && self.indexes.hnsw.pending_len() > 0 {
                wait = wait.min(self.follow.quiet().saturating_sub(last_write.elapsed()));
            }
            let first = match rx.recv_timeout(wait) {
                Ok(j) => j,
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                    if self.commit_at().is_some_and(|at| at <= Instant::now()) {
                        if let Err(e) = self.commit() {
                            return self.fail(failed, e);
                        }
                        continue;
                    }
                    if last_write.elapsed() >= self.follow.quiet() && self.absorb_slice() {
                        flat_due = true;
                        continue;
                    }
                    if flat_due {
                        self.refresh_flat();
                        flat_due = false;
                    }
                    if merge_due && last_write.elapsed() >= merge_quiet {
                        merge_due = false;
                        if let Err(e) = self.indexes.bm25.merge_segments() {
                            tracing::warn!(shard = %self.key, error = %e, "bm25 merge not started");
                        }
                    }
                    self.dump_graph(false);
                    continue;
                }
                Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                    return self.finish(dump_on_stop.load(Ordering::Acquire));
                }
            };
            let (jobs, asked, adopt) = group(first, &rx);
            if jobs.is_empty() {
                if let Some(seq) = adopt {
                    self.adopt(seq);
                    flat_due = true;
                }
                if asked && self.state.changes > 0 {
                    self.dump();
                }
                continue;
            }
            let rebuilt = jobs.iter().any(|j| matches!(j, Job::Rebuild { .. }));
            let applied = self.apply(jobs).and_then(|seq| {
                self.at = seq;
                // A rebuilt index is committed at once; other groups when due.
                if rebuilt || self.commit_at().is_some_and(|at| at <= Instant::now()) {
                    self.commit()?;
                }
                Ok(seq)
            });
            match applied {
                Ok(_) => {
                    flat_due = true;
                    merge_due = true;
                    last_write = Instant::now();
                    if let Some(seq) = adopt {
                        self.adopt(seq);
                    }
                    if asked && self.state.changes > 0 {
                        self.dump();
                    } else {
                        self.dump_graph(false);
                    }
                }
                Err(e) => return self.fail(failed, e),
            }
        }
    }

    /// The worker stops on an index error: writes then get a clear UNAVAILABLE.
    fn fail(&self, failed: &AtomicBool, e: ShardError) {
        tracing::error!(shard = %self.key, error = %e,
            "index update failed; writes stay durable and are re-indexed at restart");
        failed.store(true, Ordering::Release);
    }

    /// The queue closed (shutdown or drop): commit what is staged, and dump when asked to.
    fn finish(&mut self, dump: bool) {
        if self.staged.is_some()
            && let Err(e) = self.commit()
        {
            tracing::warn!(shard = %self.key, error = %e,
                "last bm25 commit failed; the op log replays it at restart");
        }
        // Pending points are not in the graph: a restart catches them up from the op log
        // after the dump instead.
        if dump {
            self.dump_graph(true);
        }
    }

    /// When the staged tantivy changes are to be committed (None: nothing staged). At once
    /// unless writes come concurrently (the last commit or the staged work holds more than
    /// one batch): a lone writer waiting for each acknowledgement never waits for the
    /// interval, concurrent writers share commits.
    fn commit_at(&self) -> Option<Instant> {
        self.staged?;
        Some(commit_due(&self.committing, self.tally, Instant::now()))
    }

    /// Commits what tantivy has staged, with the last staged seq as payload, and publishes
    /// that seq as visible (acknowledging its writes); trims the op log behind it.
    fn commit(&mut self) -> Result<()> {
        let Some(seq) = self.staged.take() else {
            return Ok(());
        };
        let started = Instant::now();
        self.indexes.bm25.commit(seq)?;
        self.tally = Staged {
            batches: 0,
            chunks: 0,
            last_commit: Some(Instant::now()),
            last_commit_batches: self.tally.batches,
        };
        self.trim_oplog(seq)?;
        self.visible.send_replace(seq);
        if let Some(w) = self.wake.get() {
            w();
        }
        metrics::histogram!("shard_bm25_commit_seconds").record(started.elapsed().as_secs_f64());
        Ok(())
    }

    /// Applies a group of jobs under the update lock: HNSW at once, tantivy staged (committed
    /// by `commit`).
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
                    self.follow.place(&ix.hnsw, self.defers(), points, seq);
                    ix.hnsw.remove(&removed);
                    ix.bm25.stage(&writes)?;
                    self.tally.chunks += writes.iter().map(|w| w.chunks.len()).sum::<usize>();
                    self.tally.batches += 1;
                }
                Job::Skip(_) | Job::DumpNow | Job::Adopt(_) => {}
                Job::Rebuild { seq, dump } => self.restore(seq, dump)?,
            }
        }
        if !self.defers() && self.follow.per_group() > 0 {
            ix.hnsw.absorb_some(self.follow.per_group());
        }
        self.staged = Some(last);
        self.maybe_compact()?;
        self.undumped.store(self.state.changes, Ordering::Release);
        metrics::histogram!("shard_index_group_seconds").record(started.elapsed().as_secs_f64());
        metrics::histogram!("shard_index_group_entries").record(n as f64);
        Ok(last)
    }

    /// Brings both indexes to a snapshot installed at `seq`. The replica's own dumps
    /// describe a state the snapshot replaced and go; the graph is loaded from the dump the
    /// snapshot shipped and caught up from the op-log entries it carried (as at open), or
    /// rebuilt from RocksDB. BM25 is rebuilt.
    fn restore(&mut self, seq: u64, dump: Option<u64>) -> Result<()> {
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
        self.dumped
            .store(state.dumped.unwrap_or(0), Ordering::Release);
        self.state = state;
        let graph_ms = t.elapsed().as_millis() as u64;
        self.indexes.bm25.clear()?;
        self.store.for_each_chunk(&self.key, false, |c| {
            self.indexes.bm25.stage_chunks(std::slice::from_ref(&c))
        })?;
        metrics::counter!("shard_snapshot_graphs_total", "graph" => source).increment(1);
        tracing::info!(shard = %self.key, seq, graph = source, points = hnsw.counts().0,
            graph_ms, ms = t.elapsed().as_millis() as u64,
            "indexes brought to an installed snapshot");
        Ok(())
    }

    fn defers(&self) -> bool {
        self.follow.enabled && self.following.load(Ordering::Acquire)
    }

    /// A leader with points pending (written behind, or left from its follower days) inserts
    /// a slice of them; true when it did. The slice that empties the backlog is dumped at
    /// once: the burst is over, and the dump lets go of the op log it kept (and with it the
    /// write-ahead log) instead of keeping both until `hnsw_dump_interval`.
    fn absorb_slice(&mut self) -> bool {
        if self.defers() || self.indexes.hnsw.pending_len() == 0 {
            return false;
        }
        let n = {
            let _g = self.indexes.update.lock();
            self.indexes.hnsw.absorb_some(self.follow.idle_slice())
        };
        if n > 0 && self.indexes.hnsw.pending_len() == 0 {
            self.dump_graph(true);
        }
        n > 0
    }

    /// Loads the leader's dump of `seq` (received beside this replica's dumps) caught up to
    /// the applied seq from the op log, replacing the graph and the pending points it covers.
    /// A dump that cannot be caught up is removed and the graph kept.
    fn adopt(&mut self, seq: u64) {
        let t = Instant::now();
        let newer = self.state.dumped.is_none_or(|d| d < seq);
        if !self.defers() || !newer || seq > self.at || !self.dumps.promote_received(seq) {
            self.dumps.discard_received(seq);
            metrics::counter!("shard_hnsw_graph_adoptions_total", "outcome" => "skipped")
                .increment(1);
            return;
        }
        let hnsw = &self.indexes.hnsw;
        let meta = ShardMeta {
            dimension: hnsw.dim() as u32,
            hnsw: hnsw.params(),
        };
        let pending_before = hnsw.pending_len();
        match recovery::caught_up_dump(&self.key, &meta, &self.store, &self.dumps, self.at) {
            Ok(Some((graph, state))) if state.dumped == Some(seq) => {
                {
                    let _g = self.indexes.update.lock();
                    hnsw.replace(graph);
                }
                self.dumps.remove_except(Some(seq));
                self.dumped.store(seq, Ordering::Release);
                self.state = state;
                self.undumped.store(self.state.changes, Ordering::Release);
                metrics::counter!("shard_hnsw_graph_adoptions_total", "outcome" => "adopted")
                    .increment(1);
                tracing::info!(shard = %self.key, dump = seq, applied = self.at,
                    points = hnsw.counts().0, pending_before, pending = hnsw.pending_len(),
                    ms = t.elapsed().as_millis() as u64, "leader's hnsw graph adopted");
            }
            other => {
                if let Err(e) = &other {
                    tracing::warn!(shard = %self.key, dump = seq, error = %e,
                        "leader's hnsw dump not adopted");
                }
                self.dumps.remove(seq);
                metrics::counter!("shard_hnsw_graph_adoptions_total", "outcome" => "refused")
                    .increment(1);
            }
        }
    }

    fn refresh_flat(&mut self) {
        let started = Instant::now();
        if self.indexes.hnsw.refresh_flat() {
            let took = started.elapsed();
            self.flat_quiet = (took * 10).max(FLAT_AFTER_QUIET);
            let secs = took.as_secs_f64();
            metrics::histogram!("shard_hnsw_flat_copy_seconds").record(secs);
            tracing::debug!(shard = %self.key, ms = (secs * 1e3) as u64,
                "hnsw bottom layer copied for fast walks");
        }
    }

    /// Dumps the graph as of `graph_through` when it holds changes the last dump lacks and
    /// enough changed, the interval passed, or `force`. A follower's pending points wait for
    /// its leader's dump instead (as do a leftover backlog's without write-behind).
    fn dump_graph(&mut self, force: bool) {
        let changes = self.state.changes;
        let pending = self.indexes.hnsw.pending_len();
        if changes == 0 || (pending > 0 && !self.follow.dumps_while_holding(self.defers())) {
            return;
        }
        let through = self.indexes.hnsw.graph_through(self.at);
        if self.state.dumped.is_some_and(|d| d >= through) {
            return;
        }
        let (live, dead) = self.indexes.hnsw.counts();
        let enough =
            changes.saturating_sub(pending) >= self.dumping.min_changes.max((live + dead) / 10);
        let due = self.last_dump.elapsed() >= self.dumping.interval;
        if force || enough || due {
            self.write_dump(through);
        }
    }

    /// Writes a dump of the graph as of `self.at`, its pending points inserted first (a
    /// snapshot waits for it).
    fn dump(&mut self) {
        if self.indexes.hnsw.pending_len() > 0 {
            let _g = self.indexes.update.lock();
            self.indexes.hnsw.absorb_pending();
        }
        self.write_dump(self.at);
    }

    /// Drops the op-log entries no restart needs, BM25 having committed through `committed`.
    /// Entries after the HNSW dump stay: a restart catches the dump up from them. So do the
    /// entries after the last one whose points are all in the graph: a leader's dump is
    /// caught up from them.
    fn trim_oplog(&mut self, committed: u64) -> Result<()> {
        let keep_after = self
            .state
            .dumped
            .map_or(committed, |d| d.min(committed))
            .min(self.indexes.hnsw.graph_through(committed));
        if keep_after > self.trimmed {
            self.store.truncate_oplog(&self.key, keep_after)?;
            self.trimmed = keep_after;
        }
        Ok(())
    }

    /// Writes a dump of the graph, which holds every point up to `seq`. A failure is logged and
    /// retried later: the op log is kept back to the last good dump meanwhile.
    fn write_dump(&mut self, seq: u64) {
        let started = Instant::now();
        self.last_dump = started;
        match self.dumps.write(&self.indexes.hnsw, seq) {
            Ok(bytes) => {
                let secs = started.elapsed().as_secs_f64();
                metrics::histogram!("shard_hnsw_dump_seconds").record(secs);
                let pending = self.indexes.hnsw.pending_len();
                tracing::info!(shard = %self.key, seq, applied = self.at, pending, bytes,
                    ms = (secs * 1e3) as u64, "hnsw graph dumped");
                self.state = DumpState {
                    dumped: Some(seq),
                    changes: pending,
                };
                self.dumped.store(seq, Ordering::Release);
                self.undumped.store(pending, Ordering::Release);
                // Held points inserted while writes pause are dumped without a BM25 commit
                // after them: the entries they kept are let go here.
                let committed = *self.visible.borrow();
                if let Err(e) = self.trim_oplog(committed) {
                    tracing::warn!(shard = %self.key, error = %e, "op log not trimmed after a dump");
                }
            }
            Err(e) => {
                metrics::counter!("shard_hnsw_dump_failures_total").increment(1);
                tracing::error!(shard = %self.key, error = %e,
                    "hnsw dump failed; the op log is kept back to the previous dump");
            }
        }
    }

    /// Rebuilds the HNSW graph when tombstones exceed the configured share.
    fn maybe_compact(&self) -> Result<()> {
        let (live, dead) = self.indexes.hnsw.counts();
        let c = self.compaction;
        if dead < c.min || (dead as f64) < c.ratio * (live + dead) as f64 {
            return Ok(());
        }
        let started = Instant::now();
        let mut points = Vec::with_capacity(live);
        self.store.for_each_chunk(&self.key, true, |ch| {
            points.push(point(&ch));
            Ok(())
        })?;
        self.indexes.hnsw.rebuild(points);
        tracing::info!(shard = %self.key, dead, live, ms = started.elapsed().as_millis() as u64,
            "hnsw compacted");
        Ok(())
    }
}

mod holding;
#[cfg(test)]
mod tests;
