//! The catalog group member: a thread that owns the `RawNode`, persists in raft-rs' Ready
//! order (send leader messages, install snapshot, apply committed, persist entries and hard
//! state, send the rest, advance) and answers proposers once their entry is applied.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

use parking_lot::RwLock;
use prost::Message as _;
use raft::eraftpb::{Entry, EntryType, HardState, Message, Snapshot};
use raft::{RawNode, StateRole};
use ragcluster_proto::v1::{
    CatalogCommand, CatalogPeerStatus, CatalogState, CatalogStatus, catalog_command::Op,
};
use tokio::sync::oneshot;

use super::View;
use super::log::CatalogLog;
use super::store::CatalogStore;
use super::transport::Transport;
use crate::error::{CoordError, Result};

pub type Reply = oneshot::Sender<Result<()>>;

pub enum Msg {
    Raft(Box<Message>),
    Propose { data: Vec<u8>, reply: Reply },
    Unreachable(u64),
    Stop,
}

pub fn leadership_moved() -> CoordError {
    CoordError::Unavailable {
        what: "catalog".into(),
        reason: "coordinator leadership moved before the change was committed; retry".into(),
        retry_after_ms: 300,
    }
}

pub struct Group {
    pub raw: RawNode<CatalogLog>,
    pub rx: Receiver<Msg>,
    pub store: Arc<CatalogStore>,
    pub view: Arc<RwLock<View>>,
    pub status: Arc<RwLock<CatalogStatus>>,
    pub transport: Arc<Transport>,
    pub node_id: u64,
    pub tick: Duration,
    /// Log entries kept behind the applied index (`raft_log_gc_threshold`).
    pub keep: u64,
    pub waiters: BTreeMap<u64, (u64, Reply)>,
    pub last_leader: u64,
}

impl Group {
    pub fn run(&mut self) {
        // A lone coordinator campaigned before the thread started: publish its leadership now.
        if let Err(e) = self.on_ready() {
            tracing::error!(error = %e, "catalog raft member failed at start");
            return;
        }
        self.publish();
        let mut next_tick = Instant::now() + self.tick;
        loop {
            let wait = next_tick.saturating_duration_since(Instant::now());
            let mut stop = false;
            match self.rx.recv_timeout(wait) {
                Ok(Msg::Stop) | Err(RecvTimeoutError::Disconnected) => stop = true,
                Ok(m) => self.handle(m),
                Err(RecvTimeoutError::Timeout) => {}
            }
            while !stop {
                match self.rx.try_recv() {
                    Ok(Msg::Stop) => stop = true,
                    Ok(m) => self.handle(m),
                    Err(_) => break,
                }
            }
            if stop {
                break;
            }
            if Instant::now() >= next_tick {
                self.raw.tick();
                next_tick = Instant::now() + self.tick;
            }
            if let Err(e) = self.on_ready() {
                // The catalog could no longer be persisted: stop this member (the others carry
                // on) rather than acknowledge changes that are not durable.
                tracing::error!(error = %e, "catalog raft member failed; stopped");
                break;
            }
            self.publish();
        }
        for (_, (_, r)) in std::mem::take(&mut self.waiters) {
            let _ = r.send(Err(CoordError::Unavailable {
                what: "catalog".into(),
                reason: "coordinator shutting down".into(),
                retry_after_ms: 500,
            }));
        }
        self.status.write().role = "stopped".into();
    }

    fn handle(&mut self, m: Msg) {
        match m {
            Msg::Raft(msg) => {
                // Stale terms and unknown senders are rejected by raft-rs itself.
                if let Err(e) = self.raw.step(*msg) {
                    tracing::debug!(error = %e, "catalog raft message ignored");
                }
            }
            Msg::Propose { data, reply } => {
                if self.raw.raft.state != StateRole::Leader {
                    let _ = reply.send(Err(leadership_moved()));
                    return;
                }
                let before = self.raw.raft.raft_log.last_index();
                match self.raw.propose(vec![], data) {
                    Ok(()) if self.raw.raft.raft_log.last_index() > before => {
                        let idx = self.raw.raft.raft_log.last_index();
                        self.waiters.insert(idx, (self.raw.raft.term, reply));
                    }
                    _ => {
                        let _ = reply.send(Err(leadership_moved()));
                    }
                }
            }
            Msg::Unreachable(id) => self.raw.report_unreachable(id),
            Msg::Stop => {}
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
            metrics::counter!("catalog_leader_changes_total").increment(1);
            tracing::info!(
                leader = ss.leader_id,
                term = self.raw.raft.term,
                "catalog leader changed"
            );
        }
        self.transport.send(rd.take_messages());
        if !rd.snapshot().is_empty() {
            self.install(rd.snapshot().clone())?;
        }
        self.apply(rd.take_committed_entries())?;
        let hs = rd.hs().cloned();
        if !rd.entries().is_empty() || hs.is_some() {
            self.store.append(rd.entries(), hs.as_ref())?;
            let mem = &self.raw.store().mem;
            let mut core = mem.wl();
            core.append(rd.entries()).map_err(raft_err)?;
            if let Some(hs) = hs {
                core.set_hardstate(hs);
            }
        }
        self.transport.send(rd.take_persisted_messages());
        let mut light = self.raw.advance(rd);
        if let Some(commit) = light.commit_index() {
            let hs = {
                let mut core = self.raw.store().mem.wl();
                core.mut_hard_state().commit = commit;
                core.hard_state().clone()
            };
            self.store.append(&[], Some(&hs))?;
        }
        self.transport.send(light.take_messages());
        self.apply(light.take_committed_entries())?;
        self.raw.advance_apply();
        Ok(())
    }

    fn install(&mut self, snap: Snapshot) -> Result<()> {
        let meta = snap.get_metadata().clone();
        let mut st = CatalogState::decode(&*snap.data)
            .map_err(|e| CoordError::Catalog(format!("snapshot from leader: {e}")))?;
        st.applied_index = meta.index;
        st.applied_term = meta.term;
        let mut hs: HardState = self.raw.store().mem.rl().hard_state().clone();
        hs.term = hs.term.max(meta.term);
        hs.commit = hs.commit.max(meta.index);
        self.store.install(&st, &hs)?;
        self.raw
            .store()
            .mem
            .wl()
            .apply_snapshot(snap)
            .map_err(raft_err)?;
        *self.view.write() = View::from_state(st);
        metrics::counter!("catalog_snapshots_applied_total").increment(1);
        tracing::info!(
            index = meta.index,
            "catalog replaced by the leader's snapshot"
        );
        let stale: Vec<u64> = self.waiters.range(..=meta.index).map(|(k, _)| *k).collect();
        for k in stale {
            if let Some((_, r)) = self.waiters.remove(&k) {
                let _ = r.send(Err(leadership_moved()));
            }
        }
        Ok(())
    }

    /// Applies committed entries to the catalog, persists it once (synced), then answers the
    /// proposers: a change is acknowledged only when it is durable here.
    fn apply(&mut self, entries: Vec<Entry>) -> Result<()> {
        let mut answers = Vec::new();
        let mut next = self.view.read().clone();
        let before = next.applied_index;
        for e in entries {
            if e.index <= next.applied_index {
                continue;
            }
            let outcome = if e.get_entry_type() == EntryType::EntryNormal && !e.data.is_empty() {
                let cmd = CatalogCommand::decode(&*e.data)
                    .map_err(|err| CoordError::Catalog(format!("log entry {}: {err}", e.index)))?;
                next.apply(cmd)
            } else {
                Ok(())
            };
            next.applied_index = e.index;
            next.applied_term = e.term;
            if let Some((term, reply)) = self.waiters.remove(&e.index) {
                if term == e.term {
                    answers.push((reply, outcome));
                } else {
                    answers.push((reply, Err(leadership_moved())));
                }
            }
        }
        if next.applied_index == before {
            return Ok(());
        }
        let first = raft::Storage::first_index(&self.raw.store().mem).map_err(raft_err)?;
        // Once `keep` entries trail the applied index, drop the older half.
        let to = next.applied_index.saturating_sub(self.keep / 2);
        let compact = (next.applied_index >= first + self.keep.max(1) && to > first).then_some(to);
        self.store.put_state(&next.state(), compact)?;
        if let Some(i) = compact {
            self.raw.store().mem.wl().compact(i).map_err(raft_err)?;
        }
        *self.view.write() = next;
        for (reply, outcome) in answers {
            let _ = reply.send(outcome);
        }
        Ok(())
    }

    fn publish(&self) {
        let r = &self.raw.raft;
        let role = match r.state {
            StateRole::Leader => "leader",
            StateRole::Candidate => "candidate",
            StateRole::PreCandidate => "pre-candidate",
            StateRole::Follower => "follower",
        };
        let leader = r.state == StateRole::Leader;
        let peers = self
            .transport
            .members()
            .into_iter()
            .map(|(id, address)| CatalogPeerStatus {
                node_id: id,
                address,
                matched: if leader {
                    r.prs().get(id).map(|p| p.matched).unwrap_or(0)
                } else {
                    0
                },
            })
            .collect();
        let s = CatalogStatus {
            node_id: self.node_id,
            role: role.into(),
            leader_id: r.leader_id,
            leader_address: self.transport.address(r.leader_id).unwrap_or_default(),
            term: r.term,
            commit_index: r.raft_log.committed,
            applied_index: self.view.read().applied_index,
            peers,
        };
        metrics::gauge!("catalog_term").set(s.term as f64);
        metrics::gauge!("catalog_commit_index").set(s.commit_index as f64);
        metrics::gauge!("catalog_applied_index").set(s.applied_index as f64);
        metrics::gauge!("catalog_is_leader").set(if leader { 1.0 } else { 0.0 });
        let mut g = self.status.write();
        if *g != s {
            *g = s;
        }
    }
}

pub fn raft_err(e: raft::Error) -> CoordError {
    CoordError::Catalog(format!("raft: {e}"))
}

impl View {
    /// One catalog change; the outcome goes back to the proposer.
    fn apply(&mut self, cmd: CatalogCommand) -> Result<()> {
        match cmd.op {
            Some(Op::CreateCollection(c)) => {
                if self.collections.contains_key(&c.name) {
                    return Err(CoordError::CollectionExists(c.name));
                }
                self.collections.insert(c.name.clone(), c);
                Ok(())
            }
            Some(Op::DropCollection(name)) => self
                .collections
                .remove(&name)
                .map(|_| ())
                .ok_or(CoordError::UnknownCollection(name)),
            Some(Op::SetPlacement(p)) => {
                let c = self
                    .collections
                    .get_mut(&p.collection)
                    .ok_or_else(|| CoordError::UnknownCollection(p.collection.clone()))?;
                let shard = c
                    .shards
                    .get_mut(p.shard as usize)
                    .ok_or_else(|| CoordError::invalid("shard", format!("no shard {}", p.shard)))?;
                shard.nodes = p.nodes;
                Ok(())
            }
            Some(Op::CreateApiKey(k)) => {
                let id = k.info.as_ref().map(|i| i.id.clone()).unwrap_or_default();
                if id.is_empty() || self.api_keys.contains_key(&id) {
                    return Err(CoordError::invalid(
                        "api key",
                        format!("id {id:?} is taken"),
                    ));
                }
                self.api_keys.insert(id, k);
                Ok(())
            }
            Some(Op::RevokeApiKey(r)) => {
                let info = self
                    .api_keys
                    .get_mut(&r.id)
                    .and_then(|k| k.info.as_mut())
                    .ok_or_else(|| CoordError::UnknownApiKey(r.id.clone()))?;
                // Revoking twice keeps the first time.
                if info.revoked_at_ms == 0 {
                    info.revoked_at_ms = r.at_ms.max(1);
                }
                Ok(())
            }
            None => Ok(()),
        }
    }
}
