//! The index worker: one thread per shard that keeps its indexes up to date, so the Raft thread
//! only writes RocksDB (durable) and moves on. It has two parts.
//!
//! - The **apply pipeline** (`apply`): jobs arrive in log order; the worker takes all that
//!   queued up, updates HNSW, stages everything in tantivy and commits once with the last
//!   sequence number as payload (group commit), then publishes that sequence as visible. Writes
//!   are acknowledged, and strong reads answered, once their sequence is visible: this is the
//!   only part an acknowledgement waits on.
//! - The **maintenance scheduler** (`maintenance`): upkeep that no acknowledgement needs (HNSW
//!   write-behind inserts, graph dumps, the flat copy of the graph's bottom layer, BM25 segment
//!   merges, op-log trims, graph compaction, adopting a leader's dump), one file per task and
//!   one place (`maintenance::Schedule`) that says when each runs. Tasks run on this thread
//!   between groups of jobs, mostly when writes pause; the few that must also run under a
//!   steady load (a dump once enough changed, compaction once tombstones pile up) run right
//!   after a group, so the next one waits for at most that task.
//!
//! Crash windows: a batch is in RocksDB and the op log before it is queued here, so one lost in
//! a crash is replayed at open (`recovery`): into BM25 from its committed seq, into HNSW from
//! the seq of its last dump. The dumps keep the op log back to the older of the two. Every
//! task has a crash point (`crash_point!`, feature `failpoints`) where the fault tests kill the
//! process to check exactly that.

use std::sync::Arc;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use ragcluster_proto::v1::DocumentWrite;
use tokio::sync::watch;

use super::Indexes;
use super::hnsw::dump::{DumpState, Dumps};
use crate::error::{Result, ShardError};
use crate::storage::{ShardKey, Store};
pub use holding::Following;

mod apply;
mod holding;
mod maintenance;
mod restart;
#[cfg(test)]
mod tests;

/// Kills the process at a named point of an index task when the fault tests arm the failpoint
/// of that name (`return`): a crash exactly there, with no unwinding, no destructor and no
/// flush, as kill -9 would leave it. Compiled out without the `failpoints` feature.
macro_rules! crash_point {
    ($name:literal) => {
        #[cfg(feature = "failpoints")]
        fail::fail_point!($name, |_| {
            tracing::error!(point = $name, "crash point reached; aborting");
            std::process::abort()
        });
    };
}
pub(crate) use crash_point;

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

/// When tantivy commits (see `apply`).
#[derive(Debug, Clone, Copy)]
pub struct Committing {
    /// Least time between two commits while groups keep coming (zero: one per group).
    pub interval: Duration,
    /// ...unless this many chunks wait uncommitted.
    pub max_chunks: usize,
}

/// The worker's settings, from the shard node's configuration.
#[derive(Debug, Clone, Copy)]
pub struct Policy {
    pub compaction: Compaction,
    pub dumping: Dumping,
    pub following: Following,
    pub committing: Committing,
}

/// The handle the shard keeps: queues jobs, reports and waits for visibility, stops the thread.
pub struct IndexWorker {
    tx: Mutex<Option<Sender<Job>>>,
    /// Set before `stop` when the graph should be dumped on the way out (shutdown).
    dump_on_stop: Arc<AtomicBool>,
    visible: watch::Receiver<u64>,
    failed: Arc<AtomicBool>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
    shared: Arc<Shared>,
}

/// What the thread publishes for the handle besides visibility.
#[derive(Default)]
struct Shared {
    /// Called after each commit (the Raft member republishes its status).
    wake: OnceLock<Box<dyn Fn() + Send + Sync>>,
    /// Points inserted or removed since the last HNSW dump.
    undumped: AtomicUsize,
    /// Whether this replica follows (set from its Raft role) and defers inserts.
    following: AtomicBool,
    /// Seq of the dump the graph comes from (0: none), for the leader to ship a newer one.
    dumped: AtomicU64,
    /// Why BM25 is being restarted (`restart`), while it is.
    degraded: Mutex<Option<String>>,
    /// Set by `stop`: a BM25 restart waiting for space gives up.
    stopping: AtomicBool,
}

/// The thread's state, which the pipeline and the maintenance tasks share.
struct Worker {
    key: ShardKey,
    store: Arc<Store>,
    indexes: Arc<Indexes>,
    policy: Policy,
    shared: Arc<Shared>,
    visible: watch::Sender<u64>,
    dumps: Arc<Dumps>,
    /// Where the graph stands against its dumps (`shared.undumped` and `shared.dumped` mirror
    /// it for the handle).
    state: DumpState,
    /// The seq the indexes reflect (the last group applied; tantivy once committed).
    at: u64,
    /// The op log is trimmed through here (a trim that would drop nothing new is skipped).
    trimmed: u64,
    /// What the pipeline has staged in tantivy and not committed yet.
    staged: apply::Staged,
    schedule: maintenance::Schedule,
}

impl IndexWorker {
    /// Starts the worker with everything up to `visible` already in the indexes.
    pub fn start(
        key: ShardKey,
        store: Arc<Store>,
        indexes: Arc<Indexes>,
        visible: u64,
        dumps: Arc<Dumps>,
        state: DumpState,
        policy: Policy,
    ) -> Result<Self> {
        let (tx, rx) = std::sync::mpsc::channel();
        let shared = Arc::new(Shared::default());
        shared
            .dumped
            .store(state.dumped.unwrap_or(0), Ordering::Release);
        shared.undumped.store(state.changes, Ordering::Release);
        let (vtx, vrx) = watch::channel(visible);
        let failed = Arc::new(AtomicBool::new(false));
        let w = Worker {
            key: key.clone(),
            store,
            indexes,
            policy,
            shared: shared.clone(),
            visible: vtx,
            dumps,
            state,
            at: visible,
            trimmed: 0,
            staged: apply::Staged::default(),
            schedule: maintenance::Schedule::new(),
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
            shared,
        })
    }

    /// Whether this replica follows its group's leader (and so defers inserts, when enabled).
    pub fn set_following(&self, following: bool) {
        self.shared.following.store(following, Ordering::Release);
    }

    /// Seq of the dump the graph comes from, 0 when none.
    pub fn dumped_seq(&self) -> u64 {
        self.shared.dumped.load(Ordering::Acquire)
    }

    /// Called after each commit (the Raft member republishes its status).
    pub fn on_progress(&self, f: Box<dyn Fn() + Send + Sync>) {
        let _ = self.shared.wake.set(f);
    }

    pub fn push(&self, job: Job) {
        if let Some(tx) = self.tx.lock().as_ref() {
            let _ = tx.send(job);
        }
    }

    /// Points inserted or removed since the last HNSW dump.
    pub fn undumped(&self) -> usize {
        self.shared.undumped.load(Ordering::Acquire)
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
        if let Ok(Ok(_)) = tokio::time::timeout(left, rx.wait_for(|v| *v >= seq)).await {
            return Ok(());
        }
        let restarting = self.shared.degraded.lock().clone();
        Err(ShardError::Unavailable(match restarting {
            Some(why) => format!(
                "entry {seq} is durable; it becomes searchable once the shard's BM25 writer, \
                 restarting after a failed update, catches up ({why})"
            ),
            None if self.failed.load(Ordering::Acquire) => {
                "the shard's indexes failed to update; the write is durable and is indexed \
                 again when the node restarts"
                    .into()
            }
            None => format!(
                "entry {seq} is durable but not yet searchable after {} ms",
                left.as_millis()
            ),
        }))
    }

    /// Finishes the queued jobs and stops the thread; with `dump`, writes an HNSW dump first if
    /// the graph changed since the last one (a clean shutdown then restarts without replay).
    pub fn stop(&self, dump: bool) {
        self.shared.stopping.store(true, Ordering::Release);
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

/// Most jobs applied as one group.
const MAX_GROUP: usize = 256;

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

impl Worker {
    /// The thread's loop: a group of jobs goes through the pipeline, then whatever maintenance
    /// is due after a group; a quiet moment goes to the pipeline's pending commit or to one
    /// round of idle maintenance.
    fn run(mut self, rx: Receiver<Job>, failed: &AtomicBool, dump_on_stop: &AtomicBool) {
        self.at_start();
        loop {
            let wait = self.next_wait();
            let first = match rx.recv_timeout(wait) {
                Ok(j) => j,
                Err(RecvTimeoutError::Timeout) => {
                    if !self.commit_is_due() {
                        self.idle();
                    } else if let Err(e) = self.commit() {
                        if let Err(e) = self.restart_bm25(e) {
                            return self.fail(failed, e);
                        }
                    } else {
                        self.trim_oplog();
                    }
                    continue;
                }
                Err(RecvTimeoutError::Disconnected) => {
                    return self.finish(dump_on_stop.load(Ordering::Acquire));
                }
            };
            let (jobs, asked, adopt) = group(first, &rx);
            let wrote = !jobs.is_empty();
            if wrote
                && let Err(e) = self.apply_group(jobs)
                && let Err(e) = self.restart_bm25(e)
            {
                return self.fail(failed, e);
            }
            self.after_group(wrote, asked, adopt);
        }
    }

    /// How long the loop may wait for a job: until the pipeline's commit or the next
    /// maintenance task is due.
    fn next_wait(&self) -> Duration {
        let wait = self.schedule.wait(self);
        match self.commit_at() {
            Some(at) => wait.min(at.saturating_duration_since(Instant::now())),
            None => wait,
        }
    }

    /// Whether this replica defers its inserts (a follower holding points for its leader's
    /// dumps).
    fn defers(&self) -> bool {
        self.policy.following.enabled && self.shared.following.load(Ordering::Acquire)
    }

    /// The worker stops when it panicked, or was stopped while restarting BM25: writes then
    /// get a clear UNAVAILABLE.
    fn fail(&self, failed: &AtomicBool, e: ShardError) {
        tracing::error!(shard = %self.key, error = %e,
            "index update failed; writes stay durable and are re-indexed at restart");
        failed.store(true, Ordering::Release);
    }

    /// The queue closed (shutdown or drop): commit what is staged, and dump when asked to.
    fn finish(&mut self, dump: bool) {
        match self.commit() {
            Ok(()) => self.trim_oplog(),
            Err(e) => tracing::warn!(shard = %self.key, error = %e,
                "last bm25 commit failed; the op log replays it at restart"),
        }
        // Pending points are not in the graph: a restart catches them up from the op log
        // after the dump instead.
        if dump {
            self.dump_graph(true);
        }
    }
}
