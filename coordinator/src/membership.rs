//! The member table's keeper: shard nodes and model workers register and heartbeat
//! (`Membership.Heartbeat`, served on every coordinator and passed on to the catalog leader),
//! and the catalog leader marks a member DOWN once it has neither heartbeated nor answered a
//! probe for `membership_down_after`. Members configured only as seed addresses
//! (`shard_nodes`) are registered by the leader from their `NodeInfo`, and probed instead of
//! heard from, so clusters whose nodes do not know the coordinators keep working.
//!
//! Only state changes go through the catalog's Raft log; heartbeat times stay in the memory of
//! the coordinator that hears them (a log entry per node per second would cost an fsync each),
//! and a new catalog leader starts by giving every member a full `down_after` of grace.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::future::join_all;
use parking_lot::Mutex;
use ragcluster_proto::v1::{
    HeartbeatRequest, HeartbeatResponse, Member, MemberState, NodeKind, ShardPlacement,
};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_client::HealthClient;

use crate::auth::now_ms;
use crate::catalog::Catalog;
use crate::channels::Channels;
use crate::error::{CoordError, Result};
use crate::models::{Models, Worker};
use crate::shards::Shards;

const CATALOG_TIMEOUT: Duration = Duration::from_secs(10);
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);

/// `[coordinator]` settings of membership.
#[derive(Debug, Clone)]
pub struct MembershipOptions {
    /// How often members heartbeat (told to them in every answer).
    pub interval: Duration,
    /// Silence after which a member is marked DOWN.
    pub down_after: Duration,
    /// Shard node addresses to register without their help (`shard_nodes`).
    pub shard_seeds: Vec<String>,
}

/// What the coordinator last heard from a member.
#[derive(Debug, Clone)]
struct Seen {
    at: Instant,
    /// From its last heartbeat (0 for probed seeds).
    disk_used_bytes: u64,
    /// From its last heartbeat: why its disk counts as full (empty: it has room).
    disk_full: String,
    /// Whether it heartbeats at all (seeds are only probed).
    heartbeats: bool,
}

pub struct Membership {
    catalog: Arc<Catalog>,
    shards: Arc<Shards>,
    models: Arc<Models>,
    channels: Arc<Channels>,
    opts: MembershipOptions,
    seen: Mutex<HashMap<u64, Seen>>,
    /// Serialises registrations, so two heartbeats of one member do not race.
    register: tokio::sync::Mutex<()>,
}

impl Membership {
    pub fn new(
        catalog: Arc<Catalog>,
        shards: Arc<Shards>,
        models: Arc<Models>,
        channels: Arc<Channels>,
        opts: MembershipOptions,
    ) -> Arc<Self> {
        Arc::new(Self {
            catalog,
            shards,
            models,
            channels,
            opts,
            seen: Mutex::default(),
            register: Default::default(),
        })
    }

    pub fn interval(&self) -> Duration {
        self.opts.interval
    }

    /// Starts the background work: on the catalog leader, seed registration and DOWN
    /// marking; everywhere, routing and model calls follow the member table.
    pub fn spawn(self: &Arc<Self>) {
        let this = self.clone();
        tokio::spawn(async move { this.follow_table().await });
        let this = self.clone();
        tokio::spawn(async move { this.watch().await });
    }

    /// Keeps routing (DOWN members avoided at once) and the model workers' list in step with
    /// the applied member table.
    async fn follow_table(self: Arc<Self>) {
        let mut changes = self.catalog.changes();
        loop {
            let members = self.catalog.members();
            let down: HashSet<String> = members
                .iter()
                .filter(|m| m.state() == MemberState::Down && !m.address.is_empty())
                .map(|m| m.address.clone())
                .collect();
            self.shards.routing().set_members_down(down);
            let workers = members
                .iter()
                .filter(|m| {
                    m.kind() == NodeKind::ModelWorker
                        && matches!(m.state(), MemberState::Up | MemberState::Draining)
                })
                .map(|m| Worker {
                    address: m.address.clone(),
                    models: m.models.clone(),
                })
                .collect();
            self.models.set_workers(workers);
            if changes.changed().await.is_err() {
                return;
            }
        }
    }

    /// The leader's loop: one round per heartbeat interval.
    async fn watch(self: Arc<Self>) {
        let mut leading = false;
        loop {
            tokio::time::sleep(self.opts.interval).await;
            if !self.catalog.is_leader() {
                leading = false;
                continue;
            }
            if !leading {
                // New leader: nobody has been heard from here yet; give everyone full grace.
                leading = true;
                let now = Instant::now();
                let mut seen = self.seen.lock();
                for m in self.catalog.members() {
                    seen.entry(m.node_id).or_insert(Seen {
                        at: now,
                        disk_used_bytes: 0,
                        disk_full: String::new(),
                        heartbeats: false,
                    });
                }
            }
            self.register_seeds().await;
            self.check_liveness().await;
        }
    }

    /// Registers seed addresses no member holds yet (leader only).
    async fn register_seeds(&self) {
        for addr in &self.opts.shard_seeds {
            if self.catalog.member_at(addr).is_some() {
                continue;
            }
            let Ok(id) = self.shards.probe(addr, PROBE_TIMEOUT).await else {
                continue;
            };
            let now = now_ms();
            let m = Member {
                node_id: id,
                kind: NodeKind::ShardNode as i32,
                address: addr.clone(),
                state: MemberState::Up as i32,
                joined_at_ms: now,
                state_since_ms: now,
                ..Default::default()
            };
            let _g = self.register.lock().await;
            match self.catalog.upsert_member(m, CATALOG_TIMEOUT).await {
                Ok(()) => {
                    self.mark_seen(id, 0, false);
                    tracing::info!(node_id = id, address = %addr, "seed shard node registered");
                }
                Err(e) => tracing::warn!(address = %addr, error = %e, "seed not registered"),
            }
        }
    }

    /// Probes members not heard from for two intervals; marks DOWN those silent for
    /// `down_after`, UP again those that answer.
    async fn check_liveness(&self) {
        let now = Instant::now();
        let quiet = self.opts.interval * 2;
        let candidates: Vec<(Member, Duration)> = {
            let seen = self.seen.lock();
            self.catalog
                .members()
                .into_iter()
                .filter(|m| m.state() != MemberState::Removed)
                .filter_map(|m| {
                    let age = seen
                        .get(&m.node_id)
                        .map_or(Duration::MAX, |s| now.duration_since(s.at));
                    (age > quiet || matches!(m.state(), MemberState::Joining)).then_some((m, age))
                })
                .collect()
        };
        let probes = candidates.into_iter().map(|(m, age)| async move {
            let alive = self.probe(&m).await.is_ok();
            (m, age, alive)
        });
        for (m, age, alive) in join_all(probes).await {
            let state = m.state();
            // Model workers hold no data: one gone for long (a replaced pod with a new id)
            // leaves the table instead of piling up there.
            if !alive
                && state == MemberState::Down
                && m.kind() == NodeKind::ModelWorker
                && age >= self.opts.down_after * 10
            {
                self.set_state(&m, MemberState::Removed, "model worker gone")
                    .await;
                continue;
            }
            if alive {
                self.mark_seen(m.node_id, 0, false);
                if matches!(state, MemberState::Down | MemberState::Joining) {
                    self.set_state(&m, MemberState::Up, "answers again").await;
                }
            } else if age >= self.opts.down_after
                && matches!(
                    state,
                    MemberState::Up | MemberState::Draining | MemberState::Joining
                )
            {
                self.set_state(&m, MemberState::Down, "missed heartbeats")
                    .await;
            }
        }
    }

    async fn set_state(&self, m: &Member, state: MemberState, why: &str) {
        match self
            .catalog
            .set_member_state(m.node_id, state, CATALOG_TIMEOUT)
            .await
        {
            Ok(()) => {
                metrics::counter!("coordinator_member_state_changes_total",
                                  "state" => state.as_str_name())
                .increment(1);
                tracing::warn!(node_id = m.node_id, address = %m.address,
                               from = m.state().as_str_name(), to = state.as_str_name(),
                               why, "member state changed");
            }
            Err(e) => tracing::debug!(node_id = m.node_id, error = %e, "member state not changed"),
        }
    }

    fn mark_seen(&self, id: u64, disk_used_bytes: u64, heartbeats: bool) {
        let mut seen = self.seen.lock();
        let e = seen.entry(id).or_insert(Seen {
            at: Instant::now(),
            disk_used_bytes,
            disk_full: String::new(),
            heartbeats,
        });
        e.at = Instant::now();
        if heartbeats {
            e.disk_used_bytes = disk_used_bytes;
            e.heartbeats = true;
        }
    }

    fn mark_disk(&self, id: u64, disk_full: &str) {
        if let Some(e) = self.seen.lock().get_mut(&id) {
            e.disk_full = disk_full.to_owned();
        }
    }

    /// Members heard from within `down_after` whose last heartbeat said their disk is full,
    /// with the reason (a member that went quiet is judged by its state instead).
    pub fn full_disks(&self) -> HashMap<u64, String> {
        self.seen
            .lock()
            .iter()
            .filter(|(_, s)| !s.disk_full.is_empty() && s.at.elapsed() < self.opts.down_after)
            .map(|(id, s)| (*id, s.disk_full.clone()))
            .collect()
    }

    /// Whether the member answers at its address as itself: a shard node's `NodeInfo` names
    /// its id; a model worker answers `grpc.health.v1`.
    async fn probe(&self, m: &Member) -> Result<()> {
        self.probe_at(m.kind(), m.node_id, &m.address).await
    }

    async fn probe_at(&self, kind: NodeKind, id: u64, address: &str) -> Result<()> {
        match kind {
            NodeKind::ShardNode => {
                let got = self.shards.probe(address, PROBE_TIMEOUT).await?;
                if got == id {
                    Ok(())
                } else {
                    Err(CoordError::FailedPrecondition(format!(
                        "{address} answers as node {got}, not {id}"
                    )))
                }
            }
            _ => {
                let mut c = HealthClient::new(self.channels.get(address)?);
                let check = c.check(HealthCheckRequest {
                    service: String::new(),
                });
                match tokio::time::timeout(PROBE_TIMEOUT, check).await {
                    Ok(Ok(r)) if r.get_ref().status == 1 => Ok(()),
                    Ok(Ok(_)) => Err(CoordError::FailedPrecondition(format!(
                        "{address} is not serving"
                    ))),
                    Ok(Err(s)) => Err(CoordError::upstream(address, s)),
                    Err(_) => Err(CoordError::Deadline(format!("probe of {address}"))),
                }
            }
        }
    }

    /// Checks a heartbeat before anything is recorded.
    pub fn check(req: &HeartbeatRequest) -> Result<()> {
        if req.node_id == 0 {
            return Err(CoordError::invalid("node_id", "must not be 0"));
        }
        if !matches!(
            NodeKind::try_from(req.kind),
            Ok(NodeKind::ShardNode | NodeKind::ModelWorker)
        ) {
            return Err(CoordError::invalid(
                "kind",
                "must be NODE_KIND_SHARD_NODE or NODE_KIND_MODEL_WORKER",
            ));
        }
        let a = &req.address;
        let ok = (a.starts_with("http://") || a.starts_with("https://"))
            && a.len() <= 256
            && a.parse::<tonic::codegen::http::Uri>()
                .is_ok_and(|u| u.port_u16().is_some());
        if !ok {
            return Err(CoordError::invalid(
                "address",
                format!("{a:?} is not an http(s)://host:port address"),
            ));
        }
        if req.models.len() > 256 || req.models.iter().any(|m| m.is_empty() || m.len() > 128) {
            return Err(CoordError::invalid(
                "models",
                "at most 256 names of 1 to 128 bytes",
            ));
        }
        if req.disk_full.len() > 4096 {
            return Err(CoordError::invalid("disk_full", "at most 4096 bytes"));
        }
        Ok(())
    }

    /// A heartbeat on the catalog leader: records it, registers the member (or its new
    /// address, or its return) when the table says otherwise, and answers with the table.
    pub async fn heartbeat(&self, req: HeartbeatRequest) -> Result<HeartbeatResponse> {
        Self::check(&req)?;
        let id = req.node_id;
        let current = self.catalog.member(id);
        if let Some(m) = &current {
            if m.state() == MemberState::Removed {
                return Err(CoordError::FailedPrecondition(format!(
                    "node {id} was removed from the cluster; start it with a new data directory \
                     to join again"
                )));
            }
            if m.kind != req.kind {
                return Err(CoordError::FailedPrecondition(format!(
                    "node id {id} belongs to a member of another kind"
                )));
            }
        }
        self.mark_seen(id, req.disk_used_bytes, true);
        self.mark_disk(id, &req.disk_full);
        let stale = match &current {
            None => true,
            Some(m) => {
                m.address != req.address
                    || m.models != req.models
                    || m.cpus != req.cpus
                    || m.disk_total_bytes != req.disk_total_bytes
                    || matches!(m.state(), MemberState::Down | MemberState::Joining)
            }
        };
        if stale {
            let _g = self.register.lock().await;
            let reachable = self.probe_at(req.kind(), id, &req.address).await;
            if let Err(e) = &reachable {
                tracing::warn!(node_id = id, address = %req.address, error = %e,
                               "member's advertised address does not answer: JOINING");
            }
            let state = if reachable.is_ok() {
                MemberState::Up
            } else {
                MemberState::Joining
            };
            let now = now_ms();
            let m = Member {
                node_id: id,
                kind: req.kind,
                address: req.address.clone(),
                state: state as i32,
                models: req.models.clone(),
                joined_at_ms: now,
                state_since_ms: now,
                cpus: req.cpus,
                disk_total_bytes: req.disk_total_bytes,
            };
            self.catalog.upsert_member(m, CATALOG_TIMEOUT).await?;
            tracing::info!(node_id = id, address = %req.address, kind = req.kind().as_str_name(),
                           state = state.as_str_name(),
                           moved = current.as_ref().is_some_and(|c| c.address != req.address),
                           "member registered");
        }
        Ok(self.answer(id))
    }

    /// The table as a member sees it.
    pub fn answer(&self, id: u64) -> HeartbeatResponse {
        let members: Vec<Member> = self
            .catalog
            .members()
            .into_iter()
            .filter(|m| m.state() != MemberState::Removed)
            .collect();
        HeartbeatResponse {
            member: members.iter().find(|m| m.node_id == id).cloned(),
            members,
            interval_ms: self.opts.interval.as_millis() as u32,
            disk_full: self.full_disks(),
        }
    }

    /// Since the last heartbeat (or answered probe) here, and the disk use it reported.
    pub fn last_seen(&self, id: u64) -> Option<(Duration, u64, bool)> {
        self.seen
            .lock()
            .get(&id)
            .map(|s| (s.at.elapsed(), s.disk_used_bytes, s.heartbeats))
    }

    /// The shard nodes new replicas may go to: UP, ordered by node id. On the catalog leader,
    /// seed addresses not registered yet are registered first.
    pub async fn placeable(&self) -> Vec<(u64, String)> {
        if self.catalog.is_leader() {
            self.register_seeds().await;
        }
        self.catalog
            .members()
            .into_iter()
            .filter(|m| m.kind() == NodeKind::ShardNode && m.state() == MemberState::Up)
            .map(|m| (m.node_id, m.address))
            .collect()
    }

    /// A shard node named by its address or its id (decimal), as (id, current address).
    pub fn shard_node(&self, name: &str) -> Option<(u64, String)> {
        let m = match name.parse::<u64>() {
            Ok(id) => self.catalog.member(id)?,
            Err(_) => self.catalog.member_at(name)?,
        };
        (m.kind() == NodeKind::ShardNode && m.state() != MemberState::Removed)
            .then_some((m.node_id, m.address))
    }

    /// Removes a member that holds no replica (leader only).
    pub async fn remove(&self, id: u64) -> Result<Member> {
        let m = self.catalog.member(id).ok_or(CoordError::UnknownNode(id))?;
        if m.state() == MemberState::Removed {
            return Ok(m);
        }
        if m.kind() == NodeKind::ShardNode {
            let held = holding(&self.catalog.list(), id);
            if !held.is_empty() {
                return Err(CoordError::FailedPrecondition(format!(
                    "node {id} still holds {} replicas ({}); drain it first (`ragctl node \
                     remove` moves them away, and refuses when no other node can take them)",
                    held.len(),
                    held.join(", ")
                )));
            }
        }
        self.catalog
            .set_member_state(id, MemberState::Removed, CATALOG_TIMEOUT)
            .await?;
        self.seen.lock().remove(&id);
        tracing::warn!(node_id = id, address = %m.address, "member removed");
        self.catalog.member(id).ok_or(CoordError::UnknownNode(id))
    }

    /// Marks a member DRAINING or UP (leader only).
    pub async fn set_drain(&self, id: u64, state: MemberState) -> Result<Member> {
        if !matches!(state, MemberState::Draining | MemberState::Up) {
            return Err(CoordError::invalid(
                "state",
                "must be MEMBER_STATE_DRAINING or MEMBER_STATE_UP",
            ));
        }
        let m = self.catalog.member(id).ok_or(CoordError::UnknownNode(id))?;
        if m.state() == MemberState::Removed {
            return Err(CoordError::FailedPrecondition(format!(
                "node {id} was removed"
            )));
        }
        self.catalog
            .set_member_state(id, state, CATALOG_TIMEOUT)
            .await?;
        self.catalog.member(id).ok_or(CoordError::UnknownNode(id))
    }
}

/// "collection/shard" of every replica on node `id`.
pub fn holding(collections: &[ragcluster_proto::v1::CollectionInfo], id: u64) -> Vec<String> {
    collections
        .iter()
        .flat_map(|c| {
            c.shards
                .iter()
                .enumerate()
                .filter(|(_, p)| holds(p, id))
                .map(move |(i, _)| format!("{}/{i}", c.name))
        })
        .collect()
}

fn holds(p: &ShardPlacement, id: u64) -> bool {
    p.node_ids.contains(&id)
}

#[cfg(test)]
mod tests;
