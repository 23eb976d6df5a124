//! One group member: the owner of a raft-rs `RawNode`. It steps messages and proposals, ticks,
//! and handles every `Ready` in the order raft-rs documents: send the leader's messages,
//! install a snapshot, apply committed entries, persist entries and hard state, send the
//! messages that needed them persisted, advance, then the same for the light ready. Proposers
//! wait on their log index and are answered once their entry is applied.
//!
//! `RaftNode` is driven from outside: by `driver::Member`'s thread in production (wall-clock
//! ticks, a mailbox), or step by step by the deterministic simulation.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use protobuf::Message as _;
use raft::eraftpb::{
    ConfChange, ConfChangeSingle, ConfChangeType, ConfChangeV2, ConfState, Entry, EntryType,
    Message, MessageType, Snapshot,
};
use raft::{RawNode, StateRole};
use tokio::sync::watch;

use crate::error::{Fatal, RaftError};
use crate::machine::StateMachine;
use crate::mailbox::{Msg, Reply};
use crate::options::Options;
use crate::read_ctx;
use crate::status::{Role, Status};
use crate::storage::{LogStore, RaftLog};
use crate::transport::Outbox;

/// With `compact_applied`, applied entries are also dropped once the log holds about this
/// many bytes: bulk writes carry hundreds of chunks per entry (1.4 MB for 512 MiniLM
/// chunks), so a step counted in entries alone kept hundreds of megabytes.
const COMPACT_APPLIED_BYTES: u64 = 16 << 20;

/// With `compact_applied`, a log that took no new entry for this long drops every applied
/// entry all members have, whatever the steps above, and has its store give their disk back:
/// a collection loaded and then left (SciFact: 2 KB per chunk in 3 shards) would otherwise
/// keep its whole log, under both steps, for as long as it sees no further write.
const COMPACT_IDLE: Duration = Duration::from_secs(10);

/// Between two tries of a write that failed for want of space (`RaftNode::until_space`).
const NO_SPACE_RETRY: Duration = Duration::from_millis(250);

enum Waiter<R> {
    Entry(u64, Reply<R>),
    Conf(u64, Reply<ConfState>),
}

impl<R> Waiter<R> {
    fn fail(self, e: RaftError) {
        let _ = match self {
            Waiter::Entry(_, r) => r.send(Err(e)).is_ok(),
            Waiter::Conf(_, r) => r.send(Err(e)).is_ok(),
        };
    }
}

pub struct RaftNode<L: LogStore, M: StateMachine> {
    raw: RawNode<RaftLog<L, M>>,
    sm: Arc<M>,
    outbox: Arc<dyn Outbox>,
    opts: Options,
    /// Proposals by log index, answered when that index is applied.
    waiters: BTreeMap<u64, Waiter<M::Response>>,
    reads: HashMap<u64, Reply<u64>>,
    read_seq: u64,
    read_nonce: u64, // random per instance, in every read-index context (`read_ctx`)
    /// Ticks since start (re-asks pending read indexes every heartbeat).
    ticks: u64,
    /// The tick each peer was last heard from. raft-rs clears every follower's `recent_active`
    /// at each check-quorum pass, so right after one it reads as if no peer were reachable;
    /// membership checks also count a voter heard within an election timeout.
    heard: HashMap<u64, u64>,
    /// Read-index answers waiting for the applied index to reach theirs.
    applied_reads: Vec<(u64, Reply<u64>)>,
    status: watch::Sender<Status>,
    last_leader: u64,
    removed: bool,
    /// The last log index at the previous tick, and for how many ticks it has not moved
    /// (see `COMPACT_IDLE`).
    idle_last_index: u64,
    idle_ticks: u64,
    /// Set when a message shows this member's log lost entries it acknowledged: why. The
    /// next ready cycle fails the member with it, and no message is stepped after it.
    lost: Option<String>,
    /// Set by the member's handle when it is asked to stop: a write waiting for space gives up.
    stopping: Arc<AtomicBool>,
}

fn metric(prefix: &str, what: &str) -> String {
    format!("{prefix}_{what}")
}

impl<L: LogStore, M: StateMachine> RaftNode<L, M> {
    pub fn new(
        opts: Options,
        store: L,
        sm: Arc<M>,
        outbox: Arc<dyn Outbox>,
    ) -> Result<(Self, watch::Receiver<Status>), Fatal> {
        let (min, max) = match opts.fixed_election_timeout {
            Some(t) => (t, t + 1),
            None => (0, 0),
        };
        let cfg = raft::Config {
            id: opts.id,
            election_tick: opts.election_ticks,
            heartbeat_tick: opts.heartbeat_ticks,
            min_election_tick: min,
            max_election_tick: max,
            applied: sm.applied_index(),
            max_size_per_msg: 1 << 20,
            max_inflight_msgs: 256,
            check_quorum: true,
            pre_vote: true,
            ..Default::default()
        };
        cfg.validate()?;
        let log = RaftLog::open(store, sm.clone())?;
        let logger = slog::Logger::root(slog::Discard, slog::o!());
        let mut raw = RawNode::new(&cfg, log, &logger)?;
        if opts.campaign {
            raw.campaign()?;
        }
        let (status, rx) = watch::channel(Status {
            id: opts.id,
            ..Default::default()
        });
        let node = Self {
            raw,
            sm,
            outbox,
            opts,
            waiters: BTreeMap::new(),
            reads: HashMap::new(),
            read_seq: 0,
            read_nonce: rand::random(),
            ticks: 0,
            heard: HashMap::new(),
            applied_reads: Vec::new(),
            status,
            last_leader: 0,
            removed: false,
            idle_last_index: 0,
            idle_ticks: 0,
            lost: None,
            stopping: Arc::default(),
        };
        node.publish();
        Ok((node, rx))
    }

    pub fn state_machine(&self) -> &Arc<M> {
        &self.sm
    }

    pub fn raw(&self) -> &RawNode<RaftLog<L, M>> {
        &self.raw
    }

    pub fn removed(&self) -> bool {
        self.removed
    }

    pub fn is_leader(&self) -> bool {
        self.raw.raft.state == StateRole::Leader
    }

    pub fn commit_index(&self) -> u64 {
        self.raw.raft.raft_log.committed
    }

    /// No longer leading (stepped down in a partition, or a newer term came): waiting
    /// proposals and read indexes hear "not the leader" now, not at their deadline, and turn
    /// to the new leader. An entry proposed here may still commit: its outcome is unknown.
    fn deposed(&mut self) {
        let hint = self.leader_hint();
        for (_, w) in std::mem::take(&mut self.waiters) {
            w.fail(hint.clone());
        }
        for (_, r) in self.reads.drain() {
            let _ = r.send(Err(hint.clone()));
        }
    }

    fn leader_hint(&self) -> RaftError {
        let l = self.raw.raft.leader_id;
        RaftError::NotLeader {
            leader: (l != 0 && l != self.opts.id).then_some(l),
        }
    }

    pub fn tick(&mut self) {
        self.raw.tick();
        let last = self.raw.raft.raft_log.last_index();
        if last == self.idle_last_index {
            self.idle_ticks += 1;
        } else {
            self.idle_last_index = last;
            self.idle_ticks = 0;
        }
        self.reads.retain(|_, r| !r.is_closed());
        // raft-rs drops a read index it cannot serve yet (a new leader that has not committed
        // in its term, a request forwarded while there was no leader, a lost message): ask
        // again every heartbeat until the caller's deadline ends the wait.
        self.ticks += 1;
        if self
            .ticks
            .is_multiple_of(self.opts.heartbeat_ticks.max(1) as u64)
            && self.raw.raft.leader_id != 0
        {
            let pending: Vec<u64> = self.reads.keys().copied().collect();
            for seq in pending {
                self.raw.read_index(read_ctx::encode(self.read_nonce, seq));
            }
        }
    }

    pub fn handle(&mut self, m: Msg<M::Response>) {
        match m {
            Msg::Fail(why) => self.lost = self.lost.take().or(Some(why)),
            Msg::Raft(msg) => {
                if self.lost.is_some() {
                    return;
                }
                if let Some(why) = self.shows_lost_entries(&msg) {
                    if self.opts.created {
                        tracing::debug!(group = %self.opts.name, from = msg.from,
                            commit = msg.commit, "heartbeat for an earlier replica dropped");
                        metrics::counter!(metric(
                            self.opts.metrics_prefix,
                            "stale_heartbeats_total"
                        ))
                        .increment(1);
                    } else {
                        self.lost = Some(why);
                    }
                    return;
                }
                if msg.from != 0 {
                    self.heard.insert(msg.from, self.ticks);
                }
                // Stale terms, unknown peers and the like are rejected by raft-rs itself.
                if let Err(e) = self.raw.step(*msg) {
                    tracing::debug!(group = %self.opts.name, error = %e, "raft message ignored");
                }
            }
            Msg::Propose { data, reply } => {
                if self.raw.raft.state != StateRole::Leader {
                    let _ = reply.send(Err(self.leader_hint()));
                    return;
                }
                let before = self.raw.raft.raft_log.last_index();
                match self.raw.propose(vec![], data) {
                    Ok(()) if self.raw.raft.raft_log.last_index() > before => {
                        let idx = self.raw.raft.raft_log.last_index();
                        self.waiters
                            .insert(idx, Waiter::Entry(self.raw.raft.term, reply));
                    }
                    // Dropped by raft-rs: a leadership transfer is under way.
                    Ok(()) | Err(_) => {
                        let _ = reply.send(Err(self.leader_hint()));
                    }
                }
            }
            Msg::ConfChange { cc, reply } => self.propose_conf_change(cc, reply),
            Msg::ReadIndex { reply } => {
                if self.raw.raft.leader_id == 0 {
                    let _ = reply.send(Err(RaftError::NotLeader { leader: None }));
                    return;
                }
                self.read_seq += 1;
                self.raw
                    .read_index(read_ctx::encode(self.read_nonce, self.read_seq));
                self.reads.insert(self.read_seq, reply);
            }
            Msg::TransferLeader(to) => self.raw.transfer_leader(to),
            Msg::Campaign => {
                let _ = self.raw.campaign();
            }
            Msg::Unreachable(id) => self.raw.report_unreachable(id),
            Msg::SnapshotStatus { to, ok } => {
                let s = if ok {
                    raft::SnapshotStatus::Finish
                } else {
                    raft::SnapshotStatus::Failure
                };
                self.raw.report_snapshot(to, s);
            }
            Msg::Wake | Msg::Stop => {}
        }
    }

    fn propose_conf_change(&mut self, cc: ConfChangeV2, reply: Reply<ConfState>) {
        if let Err(e) = self.check_conf_change(&cc) {
            let _ = reply.send(Err(e));
            return;
        }
        let before = self.raw.raft.raft_log.last_index();
        match self.raw.propose_conf_change(vec![], cc) {
            Ok(()) if self.raw.raft.raft_log.last_index() > before => {
                let idx = self.raw.raft.raft_log.last_index();
                self.waiters
                    .insert(idx, Waiter::Conf(self.raw.raft.term, reply));
            }
            Ok(()) | Err(_) => {
                let _ = reply.send(Err(RaftError::FailedPrecondition(
                    "membership change dropped by raft (leadership moving?)".into(),
                )));
            }
        }
    }

    /// Refuses membership changes that could not complete or would cost the group its
    /// quorum: one change at a time, learners first, never the leader itself, never below a
    /// quorum of reachable voters.
    fn check_conf_change(&self, cc: &ConfChangeV2) -> Result<(), RaftError> {
        let fail = |m: String| Err(RaftError::FailedPrecondition(m));
        if self.raw.raft.state != StateRole::Leader {
            return Err(self.leader_hint());
        }
        if self.raw.raft.has_pending_conf() {
            return fail("another membership change is still being applied".into());
        }
        let [single] = cc.changes.as_slice() else {
            return fail("one membership change at a time".into());
        };
        let cs = &self.raw.store().cs;
        let id = single.node_id;
        let is_voter = cs.voters.contains(&id);
        let is_learner = cs.learners.contains(&id);
        match single.get_change_type() {
            ConfChangeType::AddLearnerNode if is_voter => {
                fail(format!("node {id} is already a voter"))
            }
            ConfChangeType::AddNode if !is_learner && !is_voter => fail(format!(
                "node {id} must be added as a learner and catch up before promotion"
            )),
            ConfChangeType::RemoveNode => {
                if !is_voter && !is_learner {
                    return fail(format!("node {id} is not a member of this group"));
                }
                if id == self.opts.id {
                    return fail(
                        "the leader cannot remove itself: transfer leadership first".into(),
                    );
                }
                if is_voter {
                    let remaining: Vec<u64> =
                        cs.voters.iter().copied().filter(|v| *v != id).collect();
                    let prs = self.raw.raft.prs();
                    let timeout = self.opts.election_ticks as u64;
                    let heard = |v: u64| {
                        self.heard
                            .get(&v)
                            .is_some_and(|t| self.ticks.saturating_sub(*t) <= timeout)
                    };
                    let active = remaining
                        .iter()
                        .filter(|v| {
                            **v == self.opts.id
                                || prs.get(**v).is_some_and(|p| p.recent_active)
                                || heard(**v)
                        })
                        .count();
                    if remaining.is_empty() || active < remaining.len() / 2 + 1 {
                        return fail(format!(
                            "removing node {id} leaves {active} of {} voters reachable: below quorum",
                            remaining.len()
                        ));
                    }
                }
                Ok(())
            }
            _ => Ok(()),
        }
    }

    /// Handles one ready cycle, if raft-rs has one. A failure is a storage failure: the caller
    /// stops the member.
    /// A leader's heartbeat commits min(its commit, what this member acknowledged to it).
    /// Above this member's last index it means the member acknowledged entries its log no
    /// longer holds (its storage lost them: a damaged or truncated write-ahead log). raft-rs
    /// would panic on it ("to_commit N is out of range"); the member fails instead, with both
    /// indexes, so its replica stops serving and can be rebuilt from its peers. (A member
    /// created in this process lost nothing: see `Options::created`.)
    fn shows_lost_entries(&self, m: &Message) -> Option<String> {
        let last = self.raw.raft.raft_log.last_index();
        (m.get_msg_type() == MessageType::MsgHeartbeat
            && m.term >= self.raw.raft.term
            && m.commit > last)
            .then(|| {
                format!(
                    "lost acknowledged log entries: leader {} commits {} here but the log ends \
                     at {last}",
                    m.from, m.commit
                )
            })
    }

    /// Why the member found its log lost acknowledged entries, if it did.
    pub fn lost_entries(&self) -> Option<&str> {
        self.lost.as_deref()
    }

    /// The flag that makes a write waiting for space give up (set when the member stops).
    pub fn stop_flag(&self) -> Arc<AtomicBool> {
        self.stopping.clone()
    }

    /// Runs `f`, a write of the log or of the state machine, again while it fails for want of
    /// space, until it succeeds or the member stops: a full disk stalls the member (a leader's
    /// peers elect another) instead of failing it, and it carries on once space is freed. A
    /// failed try changed nothing (one atomic RocksDB batch). Other failures return at once.
    fn until_space<T>(
        &mut self,
        what: &str,
        mut f: impl FnMut(&mut Self) -> Result<T, Fatal>,
    ) -> Result<T, Fatal> {
        let started = Instant::now();
        let mut tries = 0u64;
        loop {
            match f(self) {
                Err(e) if e.is_no_space() && !self.stopping.load(Ordering::Acquire) => {
                    if tries == 0 {
                        metrics::counter!(metric(self.opts.metrics_prefix, "writes_stalled_total"))
                            .increment(1);
                        tracing::warn!(group = %self.opts.name, what, error = %e,
                            "raft write failed for want of space; retrying until space is freed");
                    }
                    tries += 1;
                    std::thread::sleep(NO_SPACE_RETRY);
                }
                r => {
                    if tries > 0 {
                        tracing::info!(group = %self.opts.name, what, tries,
                            ms = started.elapsed().as_millis() as u64,
                            "raft write went through once space was freed");
                    }
                    return r;
                }
            }
        }
    }

    pub fn on_ready(&mut self) -> Result<(), Fatal> {
        if let Some(why) = &self.lost {
            return Err(Fatal(why.clone()));
        }
        if !self.raw.has_ready() {
            // A lone member's idle log sees no ready at all (no heartbeats to send).
            return if self.idle() {
                self.maybe_compact()
            } else {
                Ok(())
            };
        }
        let mut rd = self.raw.ready();
        if let Some(ss) = rd.ss()
            && ss.raft_state != StateRole::Leader
        {
            self.deposed();
        }
        if let Some(ss) = rd.ss()
            && ss.leader_id != self.last_leader
        {
            self.last_leader = ss.leader_id;
            metrics::counter!(metric(self.opts.metrics_prefix, "leader_changes_total"),
                "group" => self.opts.name.clone())
            .increment(1);
            tracing::info!(group = %self.opts.name, leader = ss.leader_id,
                term = self.raw.raft.term, "raft leader changed");
        }
        self.outbox.send(rd.take_messages());
        if !rd.snapshot().is_empty() {
            self.install_snapshot(rd.snapshot().clone())?;
        }
        for rs in rd.take_read_states() {
            self.on_read_state(rs.index, &rs.request_ctx);
        }
        self.apply(rd.take_committed_entries())?;
        let hs = rd.hs().cloned();
        if !rd.entries().is_empty() || hs.is_some() {
            self.until_space("log append", |n| {
                n.raw.mut_store().append(rd.entries(), hs.as_ref())
            })?;
        }
        self.outbox.send(rd.take_persisted_messages());
        // A member that applied its own removal stops here: raft-rs cannot advance a leader
        // that is no longer in its own configuration (a leader elected while the change
        // removing it was uncommitted ends up applying it).
        if self.removed {
            return Ok(());
        }
        let mut light = self.raw.advance(rd);
        if let Some(commit) = light.commit_index() {
            self.until_space("commit index", |n| n.raw.mut_store().set_commit(commit))?;
        }
        self.outbox.send(light.take_messages());
        self.apply(light.take_committed_entries())?;
        if self.removed {
            return Ok(());
        }
        self.raw.advance_apply();
        self.release_reads();
        self.maybe_compact()
    }

    fn install_snapshot(&mut self, snap: Snapshot) -> Result<(), Fatal> {
        let meta = snap.get_metadata().clone();
        let mut hs = self.raw.store().hs.clone();
        hs.term = hs.term.max(meta.term);
        hs.commit = hs.commit.max(meta.index);
        self.until_space("snapshot install", |n| n.sm.restore(&meta, &snap.data, &hs))?;
        let cs = meta.conf_state.clone().unwrap_or_default();
        self.until_space("snapshot install", |n| {
            n.raw
                .mut_store()
                .reset(meta.index, meta.term, cs.clone(), hs.clone())
        })?;
        metrics::counter!(metric(self.opts.metrics_prefix, "snapshots_applied_total")).increment(1);
        tracing::info!(group = %self.opts.name, index = meta.index, term = meta.term,
            "state replaced by the leader's snapshot");
        // Entries up to the snapshot whose proposers wait here were overwritten or included;
        // their outcome here is unknown.
        let stale: Vec<u64> = self.waiters.range(..=meta.index).map(|(k, _)| *k).collect();
        for k in stale {
            if let Some(w) = self.waiters.remove(&k) {
                w.fail(RaftError::NotLeader { leader: None });
            }
        }
        Ok(())
    }

    /// A read-index answer: released once applied, if it answers a request of this instance.
    fn on_read_state(&mut self, index: u64, ctx: &[u8]) {
        if let Some(seq) = read_ctx::decode(self.read_nonce, ctx)
            && let Some(reply) = self.reads.remove(&seq)
        {
            self.applied_reads.push((index, reply));
        }
    }

    fn release_reads(&mut self) {
        let applied = self.sm.applied_index();
        let (ready, waiting): (Vec<_>, Vec<_>) = std::mem::take(&mut self.applied_reads)
            .into_iter()
            .partition(|(i, _)| *i <= applied);
        self.applied_reads = waiting;
        for (i, r) in ready {
            let _ = r.send(Ok(i));
        }
    }

    fn apply(&mut self, entries: Vec<Entry>) -> Result<(), Fatal> {
        for e in entries {
            if self.removed {
                break;
            }
            // Replayed after a restart: the state machine has it already.
            if e.index <= self.sm.applied_index() {
                continue;
            }
            match e.get_entry_type() {
                EntryType::EntryNormal if !e.data.is_empty() => {
                    let r = self.until_space("apply", |n| n.sm.apply(e.index, e.term, &e.data))?;
                    match self.waiters.remove(&e.index) {
                        Some(Waiter::Entry(term, reply)) if term == e.term => {
                            let _ = reply.send(Ok(r));
                        }
                        Some(w) => w.fail(self.leader_hint()),
                        None => {}
                    }
                }
                EntryType::EntryConfChange | EntryType::EntryConfChangeV2 => {
                    self.apply_conf_change(&e)?;
                }
                _ => {
                    self.until_space("apply", |n| n.sm.apply_empty(e.index, e.term, None))?;
                    if let Some(w) = self.waiters.remove(&e.index) {
                        w.fail(self.leader_hint());
                    }
                }
            }
        }
        Ok(())
    }

    fn apply_conf_change(&mut self, e: &Entry) -> Result<(), Fatal> {
        let bad = |err: protobuf::ProtobufError| Fatal(format!("conf change {}: {err}", e.index));
        // Logs written before ConfChangeV2 hold v1 changes.
        let (changes, context, cs) = if e.get_entry_type() == EntryType::EntryConfChange {
            let mut cc = ConfChange::default();
            cc.merge_from_bytes(&e.data).map_err(bad)?;
            let mut single = ConfChangeSingle::default();
            single.set_change_type(cc.get_change_type());
            single.node_id = cc.node_id;
            let old = self.raw.store().cs.clone();
            let cs = self.raw.apply_conf_change(&cc)?;
            (vec![(single, old)], cc.context.to_vec(), cs)
        } else {
            let mut cc = ConfChangeV2::default();
            cc.merge_from_bytes(&e.data).map_err(bad)?;
            let old = self.raw.store().cs.clone();
            let cs = self.raw.apply_conf_change(&cc)?;
            let changes = cc
                .changes
                .iter()
                .map(|c| (c.clone(), old.clone()))
                .collect();
            (changes, cc.context.to_vec(), cs)
        };
        let mut newcomer = false;
        for (c, old) in &changes {
            let id = c.node_id;
            let adds = matches!(
                c.get_change_type(),
                ConfChangeType::AddLearnerNode | ConfChangeType::AddNode
            );
            if adds && !old.voters.contains(&id) && !old.learners.contains(&id) {
                newcomer = true;
            }
            if adds && !context.is_empty() {
                self.outbox
                    .learn_peer(id, &String::from_utf8_lossy(&context));
            }
            if c.get_change_type() == ConfChangeType::RemoveNode && id == self.opts.id {
                self.removed = true;
            }
        }
        self.until_space("apply", |n| n.sm.apply_empty(e.index, e.term, Some(&cs)))?;
        self.raw.mut_store().cs = cs.clone();
        // A newcomer starts empty, without the group's first membership, so it cannot apply
        // the log from index 1: dropping the log up to this change makes whichever member
        // leads send it a snapshot (state and membership).
        if newcomer {
            self.until_space("log compaction", |n| n.raw.mut_store().compact(e.index))?;
        }
        // Visible to callers (a transfer to a just-promoted voter) before the proposer hears.
        self.publish();
        tracing::info!(group = %self.opts.name, index = e.index, voters = ?cs.voters,
            learners = ?cs.learners, "membership changed");
        match self.waiters.remove(&e.index) {
            Some(Waiter::Conf(term, reply)) if term == e.term => {
                let _ = reply.send(Ok(cs));
            }
            Some(w) => w.fail(self.leader_hint()),
            None => {}
        }
        Ok(())
    }

    /// Whether the log has taken no new entry for `COMPACT_IDLE`.
    fn idle(&self) -> bool {
        let tick_ms = self.opts.tick.as_millis().max(1);
        let ticks = COMPACT_IDLE.as_millis().div_ceil(tick_ms);
        u128::from(self.idle_ticks) >= ticks
    }

    /// Keeps the log under `log_gc_threshold` entries: drops the older half once it is reached.
    /// With `compact_applied`, drops applied entries before that too (in steps, or all of them
    /// once the log is idle), but on a leader only those every member has (a member behind
    /// the log's start needs a whole snapshot).
    fn maybe_compact(&mut self) -> Result<(), Fatal> {
        let store = self.raw.store();
        let applied = self.sm.applied_index();
        let mut to = 0;
        let applied_kept = applied.saturating_sub(store.truncated_index);
        let idle = self.opts.compact_applied && applied_kept > 0 && self.idle();
        if self.opts.compact_applied
            && (idle
                || applied_kept >= (self.opts.log_gc_threshold / 64).max(16)
                || (applied_kept > 0 && store.entry_bytes() >= COMPACT_APPLIED_BYTES))
        {
            to = applied;
            if self.raw.raft.state == StateRole::Leader {
                let me = self.opts.id;
                let slowest = self
                    .raw
                    .raft
                    .prs()
                    .iter()
                    .filter(|(id, _)| **id != me)
                    .map(|(_, p)| p.matched)
                    .min();
                to = to.min(slowest.unwrap_or(applied));
            }
        }
        if store.entry_count() >= self.opts.log_gc_threshold {
            to = to.max(applied.saturating_sub(self.opts.log_gc_threshold / 2));
        }
        if to > store.truncated_index {
            match self.raw.mut_store().compact(to) {
                // Dropping entries can wait for space like anything else; nothing depends on it.
                Err(e) if e.is_no_space() => return Ok(()),
                r => r?,
            }
            if idle {
                self.raw.mut_store().reclaim(to);
            }
            metrics::counter!(metric(self.opts.metrics_prefix, "log_compactions_total"))
                .increment(1);
        }
        Ok(())
    }

    /// Publishes the member's view (only when it changed).
    pub fn publish(&self) {
        let r = &self.raw.raft;
        let store = self.raw.store();
        let learner = store.cs.learners.contains(&self.opts.id);
        let role = match r.state {
            StateRole::Leader => Role::Leader,
            StateRole::Candidate => Role::Candidate,
            StateRole::PreCandidate => Role::PreCandidate,
            StateRole::Follower if learner => Role::Learner,
            StateRole::Follower => Role::Follower,
        };
        let mut matched: Vec<(u64, u64)> = if role == Role::Leader {
            r.prs().iter().map(|(id, p)| (*id, p.matched)).collect()
        } else {
            Vec::new()
        };
        matched.sort_unstable();
        let mut voters = store.cs.voters.clone();
        voters.sort_unstable();
        let mut learners = store.cs.learners.clone();
        learners.sort_unstable();
        let s = Status {
            id: self.opts.id,
            role,
            term: r.term,
            leader_id: r.leader_id,
            commit_index: r.raft_log.committed,
            applied_index: self.sm.visible_index(),
            first_log_index: store.truncated_index + 1,
            voters,
            learners,
            matched,
            failed: None,
        };
        self.status.send_if_modified(|old| {
            let changed = *old != s;
            if changed {
                *old = s;
            }
            changed
        });
    }

    /// Fails every waiting caller and publishes the final role. Called once, when the member
    /// stops.
    pub fn shutdown(&mut self) {
        for (_, w) in std::mem::take(&mut self.waiters) {
            w.fail(RaftError::Stopped);
        }
        for (_, r) in self.reads.drain() {
            let _ = r.send(Err(RaftError::Stopped));
        }
        for (_, r) in self.applied_reads.drain(..) {
            let _ = r.send(Err(RaftError::Stopped));
        }
        let role = if self.removed {
            Role::Removed
        } else {
            Role::Stopped
        };
        self.status.send_modify(|s| {
            s.role = role;
            s.leader_id = 0;
        });
    }

    /// Publishes that the member stopped on its own, and why (after `shutdown`, or instead of
    /// it when raft-rs' state cannot be trusted after a panic).
    pub fn publish_failure(&self, why: String) {
        self.status.send_modify(|s| {
            s.role = Role::Stopped;
            s.leader_id = 0;
            s.failed = Some(why);
        });
    }
}
