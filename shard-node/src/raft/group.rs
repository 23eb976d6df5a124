//! One Raft group member: a thread that owns the replica's `RawNode` and a handle (`Replica`)
//! through which gRPC handlers propose writes, membership changes and read-index requests.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender};
use std::time::{Duration, Instant};

use parking_lot::{Mutex, RwLock};
use prost::Message as _;
use protobuf::Message as _;
use raft::eraftpb::{
    ConfChange, ConfChangeType, ConfState, Entry, EntryType, Message, MessageType,
};
use raft::{RawNode, StateRole};
use ragcluster_proto::v1::{RaftCommand, RaftStatus, WriteBatchRequest, WriteBatchResponse};
use tokio::sync::oneshot;

use super::log::GroupLog;
use super::transport::Transport;
use super::{LeaderHint, RaftOptions, now_ms, snapshot};
use crate::error::{Result, ShardError};
use crate::shard::Shard;
use crate::storage::ShardKey;

type Reply<T> = oneshot::Sender<Result<T>>;

pub enum GroupMsg {
    Raft(Box<Message>),
    Propose {
        data: Vec<u8>,
        reply: Reply<WriteBatchResponse>,
    },
    ConfChange {
        cc: ConfChange,
        reply: Reply<ConfState>,
    },
    ReadIndex {
        reply: Reply<()>,
    },
    TransferLeader(u64),
    Unreachable(u64),
    SnapshotStatus {
        to: u64,
        ok: bool,
    },
    Stop,
}

enum Waiter {
    Write(u64, Reply<WriteBatchResponse>),
    Conf(u64, Reply<ConfState>),
}

/// Handle of a running group member.
pub struct Replica {
    pub shard: Arc<Shard>,
    tx: Sender<GroupMsg>,
    status: Arc<RwLock<RaftStatus>>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl Replica {
    /// Starts the group thread. `campaign`: start an election at once (a fresh group's
    /// preferred leader, or a single-replica group) instead of waiting out a timeout.
    pub fn start(
        shard: Arc<Shard>,
        log: GroupLog,
        node_id: u64,
        opts: &RaftOptions,
        transport: Arc<Transport>,
        campaign: bool,
    ) -> Result<(Arc<Self>, Sender<GroupMsg>)> {
        let cfg = raft::Config {
            id: node_id,
            election_tick: opts.election_ticks,
            heartbeat_tick: opts.heartbeat_ticks,
            applied: shard.applied_seq(),
            max_size_per_msg: 1 << 20,
            max_inflight_msgs: 256,
            check_quorum: true,
            pre_vote: true,
            ..Default::default()
        };
        cfg.validate()
            .map_err(|e| ShardError::InvalidArgument(format!("raft config: {e}")))?;
        let logger = slog::Logger::root(slog::Discard, slog::o!());
        let key = log.key.clone();
        let mut raw = RawNode::new(&cfg, log, &logger)
            .map_err(|e| ShardError::Corrupt(format!("{key}: {e}")))?;
        if campaign {
            let _ = raw.campaign();
        }
        let (tx, rx) = std::sync::mpsc::channel();
        let status = Arc::new(RwLock::new(RaftStatus {
            node_id,
            ..Default::default()
        }));
        let mut g = Group {
            key: key.clone(),
            raw,
            rx,
            shard: shard.clone(),
            transport,
            node_id,
            tick: opts.tick,
            gc_threshold: opts.log_gc_threshold,
            waiters: BTreeMap::new(),
            reads: HashMap::new(),
            read_seq: 0,
            applied_reads: Vec::new(),
            status: status.clone(),
            last_leader: 0,
            removed: false,
        };
        let thread = std::thread::Builder::new()
            .name(format!("raft-{key}"))
            .spawn(move || g.run())?;
        let replica = Arc::new(Self {
            shard,
            tx: tx.clone(),
            status,
            thread: Mutex::new(Some(thread)),
        });
        Ok((replica, tx))
    }

    pub fn status(&self) -> RaftStatus {
        self.status.read().clone()
    }

    fn send(&self, m: GroupMsg) -> Result<()> {
        self.tx
            .send(m)
            .map_err(|_| ShardError::Unavailable(format!("replica {} stopped", self.shard.key)))
    }

    fn not_leader(&self) -> ShardError {
        let s = self.status();
        ShardError::NotLeader(
            (s.leader_id != 0 && s.leader_id != s.node_id)
                .then(|| (s.leader_id, s.leader_address.clone())),
        )
    }

    async fn wait<T>(
        &self,
        rx: oneshot::Receiver<Result<T>>,
        timeout: Duration,
        what: &str,
    ) -> Result<T> {
        match tokio::time::timeout(timeout, rx).await {
            Ok(Ok(r)) => r,
            Ok(Err(_)) => Err(ShardError::Unavailable(format!(
                "replica {} stopped",
                self.shard.key
            ))),
            Err(_) => Err(ShardError::Unavailable(format!(
                "{what} not committed within {} ms (no quorum?); the outcome is unknown, retry \
                 with the same request_id",
                timeout.as_millis()
            ))),
        }
    }

    /// Proposes a write batch and waits until it is committed and applied here.
    pub async fn write(
        &self,
        mut req: WriteBatchRequest,
        timeout: Duration,
    ) -> Result<WriteBatchResponse> {
        if self.status().role != "leader" {
            return Err(self.not_leader());
        }
        self.shard.validate(&mut req)?;
        let data = RaftCommand {
            proposed_at_ms: now_ms(),
            batch: Some(req),
        }
        .encode_to_vec();
        let (reply, rx) = oneshot::channel();
        self.send(GroupMsg::Propose { data, reply })?;
        self.wait(rx, timeout, "write").await
    }

    pub async fn change(&self, cc: ConfChange, timeout: Duration) -> Result<ConfState> {
        let (reply, rx) = oneshot::channel();
        self.send(GroupMsg::ConfChange { cc, reply })?;
        self.wait(rx, timeout, "membership change").await
    }

    /// Waits until this replica has applied everything committed before the call (Raft read
    /// index), so a read that follows sees every acknowledged write.
    pub async fn read_index(&self, timeout: Duration) -> Result<()> {
        let (reply, rx) = oneshot::channel();
        self.send(GroupMsg::ReadIndex { reply })?;
        match tokio::time::timeout(timeout, rx).await {
            Ok(Ok(r)) => r,
            _ => Err(ShardError::Unavailable(format!(
                "no read index for {} within {} ms (no leader or no quorum)",
                self.shard.key,
                timeout.as_millis()
            ))),
        }
    }

    pub fn transfer_leader(&self, to: u64) -> Result<()> {
        self.send(GroupMsg::TransferLeader(to))
    }

    /// Stops the thread and waits for it.
    pub fn stop(&self) {
        let _ = self.tx.send(GroupMsg::Stop);
        if let Some(t) = self.thread.lock().take() {
            let _ = t.join();
        }
    }
}

struct Group {
    key: ShardKey,
    raw: RawNode<GroupLog>,
    rx: Receiver<GroupMsg>,
    shard: Arc<Shard>,
    transport: Arc<Transport>,
    node_id: u64,
    tick: Duration,
    gc_threshold: u64,
    /// Proposals by log index, answered when that index is applied.
    waiters: BTreeMap<u64, Waiter>,
    reads: HashMap<u64, Reply<()>>,
    read_seq: u64,
    /// Read-index answers waiting for the applied index to reach theirs.
    applied_reads: Vec<(u64, Reply<()>)>,
    status: Arc<RwLock<RaftStatus>>,
    last_leader: u64,
    removed: bool,
}

impl Group {
    fn run(&mut self) {
        let mut next_tick = Instant::now() + self.tick;
        loop {
            let wait = next_tick.saturating_duration_since(Instant::now());
            match self.rx.recv_timeout(wait) {
                Ok(GroupMsg::Stop) | Err(RecvTimeoutError::Disconnected) => break,
                Ok(m) => self.handle(m),
                Err(RecvTimeoutError::Timeout) => {}
            }
            let mut stop = false;
            for _ in 0..4096 {
                match self.rx.try_recv() {
                    Ok(GroupMsg::Stop) => {
                        stop = true;
                        break;
                    }
                    Ok(m) => self.handle(m),
                    Err(_) => break,
                }
            }
            if Instant::now() >= next_tick {
                self.raw.tick();
                next_tick = Instant::now() + self.tick;
                self.reads.retain(|_, r| !r.is_closed());
            }
            if let Err(e) = self.on_ready() {
                // A storage failure leaves the replica unable to follow the log safely: stop
                // it (the other replicas carry on) rather than diverge.
                tracing::error!(shard = %self.key, error = %e, "raft group failed; replica stopped");
                break;
            }
            self.publish();
            if stop || self.removed {
                break;
            }
        }
        self.fail_all(|| ShardError::Unavailable("replica stopped".into()));
        self.publish_stopped();
    }

    fn leader_hint(&self) -> LeaderHint {
        let l = self.raw.raft.leader_id;
        (l != 0 && l != self.node_id).then(|| (l, self.transport.address(l).unwrap_or_default()))
    }

    fn handle(&mut self, m: GroupMsg) {
        match m {
            GroupMsg::Raft(msg) => {
                // Stale terms, unknown peers and the like are rejected by raft-rs itself.
                if let Err(e) = self.raw.step(*msg) {
                    tracing::debug!(shard = %self.key, error = %e, "raft message ignored");
                }
            }
            GroupMsg::Propose { data, reply } => {
                if self.raw.raft.state != StateRole::Leader {
                    let _ = reply.send(Err(ShardError::NotLeader(self.leader_hint())));
                    return;
                }
                let before = self.raw.raft.raft_log.last_index();
                match self.raw.propose(vec![], data) {
                    Ok(()) if self.raw.raft.raft_log.last_index() > before => {
                        let idx = self.raw.raft.raft_log.last_index();
                        self.waiters
                            .insert(idx, Waiter::Write(self.raw.raft.term, reply));
                    }
                    Ok(()) | Err(_) => {
                        let _ = reply.send(Err(ShardError::NotLeader(self.leader_hint())));
                    }
                }
            }
            GroupMsg::ConfChange { cc, reply } => {
                if let Err(e) = self.check_conf_change(&cc) {
                    let _ = reply.send(Err(e));
                    return;
                }
                let before = self.raw.raft.raft_log.last_index();
                let context = cc.context.clone();
                match self.raw.propose_conf_change(context, cc) {
                    Ok(()) if self.raw.raft.raft_log.last_index() > before => {
                        let idx = self.raw.raft.raft_log.last_index();
                        self.waiters
                            .insert(idx, Waiter::Conf(self.raw.raft.term, reply));
                    }
                    Ok(()) | Err(_) => {
                        let _ = reply.send(Err(ShardError::FailedPrecondition(
                            "membership change dropped by raft (leadership moving?)".into(),
                        )));
                    }
                }
            }
            GroupMsg::ReadIndex { reply } => {
                if self.raw.raft.leader_id == 0 {
                    let _ = reply.send(Err(ShardError::NotLeader(None)));
                    return;
                }
                self.read_seq += 1;
                self.raw.read_index(self.read_seq.to_be_bytes().to_vec());
                self.reads.insert(self.read_seq, reply);
            }
            GroupMsg::TransferLeader(to) => self.raw.transfer_leader(to),
            GroupMsg::Unreachable(id) => self.raw.report_unreachable(id),
            GroupMsg::SnapshotStatus { to, ok } => {
                let s = if ok {
                    raft::SnapshotStatus::Finish
                } else {
                    raft::SnapshotStatus::Failure
                };
                self.raw.report_snapshot(to, s);
            }
            GroupMsg::Stop => {}
        }
    }

    /// Refuses membership changes that could not complete or would cost the group its quorum.
    fn check_conf_change(&self, cc: &ConfChange) -> Result<()> {
        if self.raw.raft.state != StateRole::Leader {
            return Err(ShardError::NotLeader(self.leader_hint()));
        }
        if self.raw.raft.has_pending_conf() {
            return Err(ShardError::FailedPrecondition(
                "another membership change is still being applied".into(),
            ));
        }
        let cs = &self.raw.store().cs;
        let id = cc.node_id;
        let is_voter = cs.voters.contains(&id);
        let is_learner = cs.learners.contains(&id);
        match cc.get_change_type() {
            ConfChangeType::AddLearnerNode if is_voter => Err(ShardError::FailedPrecondition(
                format!("node {id} is already a voter"),
            )),
            ConfChangeType::AddNode if !is_learner && !is_voter => {
                Err(ShardError::FailedPrecondition(format!(
                    "node {id} must be added as a learner and catch up before promotion"
                )))
            }
            ConfChangeType::RemoveNode => {
                if !is_voter && !is_learner {
                    return Err(ShardError::FailedPrecondition(format!(
                        "node {id} is not a replica of this shard"
                    )));
                }
                if id == self.node_id {
                    return Err(ShardError::FailedPrecondition(
                        "the leader cannot remove itself: transfer leadership first".into(),
                    ));
                }
                if is_voter {
                    let remaining: Vec<u64> =
                        cs.voters.iter().copied().filter(|v| *v != id).collect();
                    let prs = self.raw.raft.prs();
                    let active = remaining
                        .iter()
                        .filter(|v| {
                            **v == self.node_id || prs.get(**v).is_some_and(|p| p.recent_active)
                        })
                        .count();
                    if remaining.is_empty() || active < remaining.len() / 2 + 1 {
                        return Err(ShardError::FailedPrecondition(format!(
                            "removing node {id} leaves {active} of {} voters reachable: \
                             below quorum",
                            remaining.len()
                        )));
                    }
                }
                Ok(())
            }
            _ => Ok(()),
        }
    }

    fn send_messages(&self, msgs: Vec<Message>) {
        for m in msgs {
            if m.get_msg_type() == MessageType::MsgSnapshot {
                let meta = m.get_snapshot().get_metadata();
                let path = snapshot::generated_path(
                    self.transport.snap_dir(),
                    &self.key,
                    meta.index,
                    meta.term,
                );
                self.transport.send_snapshot(&self.key, m, path);
            } else {
                self.transport.send(&self.key, m);
            }
        }
    }

    fn on_ready(&mut self) -> Result<()> {
        if !self.raw.has_ready() {
            return Ok(());
        }
        let mut rd = self.raw.ready();
        if let Some(ss) = rd.ss()
            && ss.leader_id != self.last_leader
        {
            self.last_leader = ss.leader_id;
            metrics::counter!("raft_leader_changes_total", "shard" => self.key.to_string())
                .increment(1);
            tracing::info!(shard = %self.key, leader = ss.leader_id, term = self.raw.raft.term, "raft leader changed");
        }
        self.send_messages(rd.take_messages());
        if !rd.snapshot().is_empty() {
            self.install_snapshot(rd.snapshot().clone())?;
        }
        for rs in rd.take_read_states() {
            self.on_read_state(rs.index, &rs.request_ctx);
        }
        self.apply(rd.take_committed_entries())?;
        let hs = rd.hs().cloned();
        if !rd.entries().is_empty() || hs.is_some() {
            self.raw.mut_store().append(rd.entries(), hs.as_ref())?;
        }
        self.send_messages(rd.take_persisted_messages());
        let mut light = self.raw.advance(rd);
        if let Some(commit) = light.commit_index() {
            self.raw.mut_store().set_commit(commit)?;
        }
        self.send_messages(light.take_messages());
        self.apply(light.take_committed_entries())?;
        self.raw.advance_apply();
        self.release_reads();
        self.maybe_compact()
    }

    fn install_snapshot(&mut self, snap: raft::eraftpb::Snapshot) -> Result<()> {
        let meta = snap.get_metadata().clone();
        let path =
            snapshot::received_path(self.transport.snap_dir(), &self.key, meta.index, meta.term);
        let desc = snapshot::Descriptor::decode(&snap.data)?;
        snapshot::verify(&path, &desc)?;
        let mut hs = self.raw.store().hs.clone();
        hs.term = hs.term.max(meta.term);
        hs.commit = hs.commit.max(meta.index);
        let mut f = std::io::BufReader::with_capacity(1 << 20, std::fs::File::open(&path)?);
        self.shard.install_snapshot(&mut f, &meta, &hs)?;
        self.raw.mut_store().snapshot_installed(
            meta.index,
            meta.term,
            meta.conf_state.clone().unwrap_or_default(),
            hs,
        );
        let _ = std::fs::remove_file(&path);
        metrics::counter!("raft_snapshots_applied_total").increment(1);
        // Entries before the snapshot whose proposers wait here were overwritten or included.
        let stale: Vec<u64> = self.waiters.range(..=meta.index).map(|(k, _)| *k).collect();
        for k in stale {
            if let Some(w) = self.waiters.remove(&k) {
                fail(w, ShardError::NotLeader(None));
            }
        }
        Ok(())
    }

    fn on_read_state(&mut self, index: u64, ctx: &[u8]) {
        let Ok(b) = <[u8; 8]>::try_from(ctx) else {
            return;
        };
        if let Some(reply) = self.reads.remove(&u64::from_be_bytes(b)) {
            self.applied_reads.push((index, reply));
        }
    }

    fn release_reads(&mut self) {
        let applied = self.shard.applied_seq();
        let (ready, waiting): (Vec<_>, Vec<_>) = std::mem::take(&mut self.applied_reads)
            .into_iter()
            .partition(|(i, _)| *i <= applied);
        self.applied_reads = waiting;
        for (_, r) in ready {
            let _ = r.send(Ok(()));
        }
    }

    fn apply(&mut self, entries: Vec<Entry>) -> Result<()> {
        for e in entries {
            if e.index <= self.shard.applied_seq() {
                continue;
            }
            match e.get_entry_type() {
                EntryType::EntryNormal if !e.data.is_empty() => {
                    let cmd = RaftCommand::decode(&*e.data)
                        .map_err(|err| ShardError::Corrupt(format!("entry {}: {err}", e.index)))?;
                    let r = self.shard.apply_entry(
                        e.index,
                        cmd.batch.unwrap_or_default(),
                        cmd.proposed_at_ms,
                    )?;
                    if let Some(w) = self.waiters.remove(&e.index) {
                        match w {
                            Waiter::Write(term, reply) if term == e.term => {
                                let _ = reply.send(r);
                            }
                            w => fail(w, ShardError::NotLeader(self.leader_hint())),
                        }
                    }
                }
                EntryType::EntryConfChange => {
                    let mut cc = ConfChange::default();
                    cc.merge_from_bytes(&e.data).map_err(|err| {
                        ShardError::Corrupt(format!("conf change {}: {err}", e.index))
                    })?;
                    let newcomer = {
                        let old = &self.raw.store().cs;
                        !old.voters.contains(&cc.node_id) && !old.learners.contains(&cc.node_id)
                    } && matches!(
                        cc.get_change_type(),
                        ConfChangeType::AddLearnerNode | ConfChangeType::AddNode
                    );
                    let cs = self.raw.apply_conf_change(&cc).map_err(|err| {
                        ShardError::Corrupt(format!("conf change {}: {err}", e.index))
                    })?;
                    if !cc.context.is_empty() {
                        let addr = String::from_utf8_lossy(&cc.context).into_owned();
                        self.transport.learn_peer(cc.node_id, addr);
                    }
                    self.shard.apply_noop(e.index, Some(&cs))?;
                    self.raw.mut_store().cs = cs.clone();
                    // A newcomer starts empty, without the group's initial membership, so it
                    // cannot apply the log from index 1: dropping the log up to this change
                    // makes whichever replica leads send it a snapshot (state + membership).
                    if newcomer {
                        self.raw.mut_store().compact(e.index)?;
                    }
                    // Visible to RPCs (e.g. a TransferLeader to a just-promoted voter) before
                    // the proposer hears back.
                    self.publish();
                    tracing::info!(shard = %self.key, change = ?cc.get_change_type(), node = cc.node_id,
                        voters = ?cs.voters, learners = ?cs.learners, "membership changed");
                    if cc.get_change_type() == ConfChangeType::RemoveNode
                        && cc.node_id == self.node_id
                    {
                        self.removed = true;
                    }
                    if let Some(w) = self.waiters.remove(&e.index) {
                        match w {
                            Waiter::Conf(term, reply) if term == e.term => {
                                let _ = reply.send(Ok(cs));
                            }
                            w => fail(w, ShardError::NotLeader(self.leader_hint())),
                        }
                    }
                }
                _ => {
                    self.shard.apply_noop(e.index, None)?;
                    if let Some(w) = self.waiters.remove(&e.index) {
                        fail(w, ShardError::NotLeader(self.leader_hint()));
                    }
                }
            }
        }
        Ok(())
    }

    /// Keeps the log under `gc_threshold` entries: drops the older half once it is reached.
    /// A follower that falls further behind catches up from a snapshot.
    fn maybe_compact(&mut self) -> Result<()> {
        let applied = self.shard.applied_seq();
        let store = self.raw.store();
        if store.last_index.saturating_sub(store.truncated_index) < self.gc_threshold {
            return Ok(());
        }
        let to = applied.saturating_sub(self.gc_threshold / 2);
        if to > store.truncated_index {
            self.raw.mut_store().compact(to)?;
            metrics::counter!("raft_log_compactions_total").increment(1);
        }
        Ok(())
    }

    fn fail_all(&mut self, e: impl Fn() -> ShardError) {
        for (_, w) in std::mem::take(&mut self.waiters) {
            fail(w, e());
        }
        for (_, r) in self.reads.drain() {
            let _ = r.send(Err(e()));
        }
        for (_, r) in self.applied_reads.drain(..) {
            let _ = r.send(Err(e()));
        }
    }

    fn publish(&self) {
        let r = &self.raw.raft;
        let store = self.raw.store();
        let learner = store.cs.learners.contains(&self.node_id);
        let role = match r.state {
            StateRole::Leader => "leader",
            StateRole::Candidate => "candidate",
            StateRole::PreCandidate => "pre-candidate",
            StateRole::Follower if learner => "learner",
            StateRole::Follower => "follower",
        };
        let s = RaftStatus {
            node_id: self.node_id,
            role: role.into(),
            term: r.term,
            leader_id: r.leader_id,
            leader_address: if r.leader_id == self.node_id {
                String::new()
            } else {
                self.transport.address(r.leader_id).unwrap_or_default()
            },
            commit_index: r.raft_log.committed,
            applied_index: self.shard.applied_seq(),
            first_log_index: store.truncated_index + 1,
            voters: store.cs.voters.clone(),
            learners: store.cs.learners.clone(),
        };
        let mut g = self.status.write();
        if *g != s {
            *g = s;
        }
    }

    fn publish_stopped(&self) {
        let mut g = self.status.write();
        g.role = if self.removed { "removed" } else { "stopped" }.into();
        g.leader_id = 0;
    }
}

fn fail(w: Waiter, e: ShardError) {
    match w {
        Waiter::Write(_, r) => {
            let _ = r.send(Err(e));
        }
        Waiter::Conf(_, r) => {
            let _ = r.send(Err(e));
        }
    }
}
