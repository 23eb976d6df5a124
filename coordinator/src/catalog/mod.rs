//! The collection catalog (collections and their shard placement), replicated with raft-rs
//! among the coordinators listed in `coordinator.peers` (1 or 3, static membership), so losing
//! a coordinator or its disk does not lose it. Every coordinator serves reads (search, ingest,
//! describe) from its applied copy; changes are proposed on the leader (others forward them)
//! and acknowledged once committed, applied and synced. Which replica of a shard leads is not
//! part of it: that changes on every election, and coordinators learn it from shard nodes.

mod machine;
mod reembed;
mod store;
mod transport;
mod view;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use prost::Message as _;
use ragcluster_common::disk::DiskGuard;
use ragcluster_proto::v1::{
    AddFieldsRequest, Alias, ApiKeyRecord, CatalogCommand, CatalogPeerStatus, CatalogStatus,
    CollectionInfo, MemberState, RaftRole, UpdateAliasesRequest, catalog_command::Op,
};
use ragcluster_raft::eraftpb::MessageType;
use ragcluster_raft::{Member, Options, RaftError, Role};

use crate::error::{CoordError, Result};
use machine::{CatalogMachine, CatalogResponse};
pub use reembed::Mirror;
use transport::{CatalogDialer, CatalogTransport, GROUP};
pub use view::View;

/// Collection names: `[a-z0-9_-]{1,64}`.
pub fn valid_name(n: &str) -> bool {
    !n.is_empty()
        && n.len() <= 64
        && n.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-')
}

/// Where catalog changes must go.
pub enum Leader {
    Me,
    Other(String),
    Unknown,
}

/// How this coordinator takes part in the catalog group.
#[derive(Debug, Clone)]
pub struct CatalogOptions {
    pub node_id: u64,
    /// Every coordinator of the group by Raft id, this one included.
    pub members: BTreeMap<u64, String>,
    /// The store lives in `data_dir/catalog`.
    pub data_dir: std::path::PathBuf,
    pub tick: Duration,
    pub election_ticks: usize,
    pub heartbeat_ticks: usize,
    pub log_gc_threshold: u64,
    /// How the free space of `data_dir` is watched (a full disk refuses changes).
    pub disk: ragcluster_common::disk::DiskPolicy,
}

pub struct Catalog {
    node_id: u64,
    /// Two election timeouts: a change sent during an election waits for its outcome.
    election: Duration,
    machine: Arc<CatalogMachine>,
    member: Member<CatalogResponse>,
    transport: Arc<CatalogTransport>,
    /// Every coordinator of the group, this one included.
    members: BTreeMap<u64, String>,
    disk: Arc<DiskGuard>,
}

/// Why a change did not happen, in the client's terms.
pub fn leadership_moved() -> CoordError {
    CoordError::Unavailable {
        what: "catalog".into(),
        reason: "coordinator leadership moved before the change was committed; retry".into(),
        retry_after_ms: 300,
    }
}

impl Catalog {
    /// Opens the durable store under `data_dir/catalog` and starts this coordinator's member
    /// of the group. A lone coordinator elects itself at once.
    pub fn open(
        cfg: &CatalogOptions,
        rt: &tokio::runtime::Handle,
        tls: Option<&Arc<ragcluster_common::tls::Tls>>,
    ) -> Result<Self> {
        let members = cfg.members.clone();
        let node_id = cfg.node_id;
        let disk = DiskGuard::start(&cfg.data_dir, cfg.disk)
            .map_err(|e| CoordError::Catalog(format!("{}: {e}", cfg.data_dir.display())))?;
        let store = store::CatalogStore::open(&cfg.data_dir.join("catalog"))?;
        store.prepare(&members.keys().copied().collect::<Vec<_>>())?;
        let log = store.log();
        let machine = Arc::new(CatalogMachine::open(store)?);
        let dialer = Arc::new(CatalogDialer {
            node_id,
            tls: tls.cloned(),
        });
        let peers = members
            .iter()
            .filter(|(id, _)| **id != node_id)
            .map(|(id, a)| (*id, a.clone()))
            .collect();
        let transport = CatalogTransport::new(
            node_id,
            rt.clone(),
            dialer,
            peers,
            Box::new(|_| {}),
            "catalog",
        );
        // A full disk takes no new catalog entries, snapshots or leadership (as a shard node).
        let full = disk.clone();
        transport.set_refuse(Arc::new(move |t: MessageType| {
            matches!(
                t,
                MessageType::MsgAppend | MessageType::MsgSnapshot | MessageType::MsgTimeoutNow
            ) && full.full().is_some()
        }));
        let mailbox = ragcluster_raft::mailbox();
        transport.register(GROUP, mailbox.0.clone());
        let opts = Options {
            id: node_id,
            tick: cfg.tick,
            election_ticks: cfg.election_ticks,
            heartbeat_ticks: cfg.heartbeat_ticks,
            log_gc_threshold: cfg.log_gc_threshold.max(2),
            compact_applied: false,
            campaign: members.len() == 1,
            created: false,
            fixed_election_timeout: None,
            name: GROUP.into(),
            metrics_prefix: "catalog",
        };
        let member = Member::start(opts, log, machine.clone(), transport.outbox(GROUP), mailbox)
            .map_err(|e| CoordError::Catalog(e.0))?;
        let mut status = member.watch();
        rt.spawn(async move {
            while status.changed().await.is_ok() {
                let s = status.borrow().clone();
                metrics::gauge!("catalog_term").set(s.term as f64);
                metrics::gauge!("catalog_commit_index").set(s.commit_index as f64);
                metrics::gauge!("catalog_applied_index").set(s.applied_index as f64);
                metrics::gauge!("catalog_is_leader").set(f64::from(u8::from(s.is_leader())));
            }
        });
        Ok(Self {
            node_id,
            election: cfg.tick * (2 * cfg.election_ticks as u32),
            machine,
            member,
            transport,
            members,
            disk,
        })
    }

    /// Why the catalog's disk counts as full, if it does.
    pub fn disk_full(&self) -> Option<String> {
        self.disk.full()
    }

    /// While the disk is full and this coordinator leads: asks the other coordinators in turn
    /// to take the lead (one whose disk is full too turns it down, and the next is asked).
    pub fn spawn_disk_handoff(self: &Arc<Self>) -> tokio::task::JoinHandle<()> {
        let this = Arc::downgrade(self);
        let mut full = self.disk.watch();
        tokio::spawn(async move {
            let mut next = 0usize;
            loop {
                if full.wait_for(Option::is_some).await.is_err() {
                    return;
                }
                let Some(c) = this.upgrade() else { return };
                if c.is_leader() {
                    let others: Vec<u64> = c
                        .members
                        .keys()
                        .copied()
                        .filter(|id| *id != c.node_id)
                        .collect();
                    if let Some(to) = others.get(next % others.len().max(1)) {
                        tracing::info!(to, "catalog disk full: handing the catalog lead over");
                        let _ = c.member.transfer_leader(*to);
                    }
                    next += 1;
                }
                let wait = c.election;
                drop(c);
                tokio::time::sleep(wait).await;
            }
        })
    }

    /// The collection `name` names, directly or through an alias: every data call reads the
    /// catalog once here, so a call under way finishes on the collection it started on.
    pub fn get(&self, name: &str) -> Result<CollectionInfo> {
        let v = self.machine.view();
        v.collections
            .get(v.resolve(name))
            .cloned()
            .ok_or_else(|| CoordError::UnknownCollection(name.to_owned()))
    }

    /// The collection of exactly this name (no alias).
    pub fn get_exact(&self, name: &str) -> Option<CollectionInfo> {
        self.machine.view().collections.get(name).cloned()
    }

    /// The collection alias `name` stands for, if it is an alias.
    pub fn alias_target(&self, name: &str) -> Option<String> {
        self.machine.view().aliases.get(name).cloned()
    }

    /// Every alias (of `collection` when given).
    pub fn aliases(&self, collection: Option<&str>) -> Vec<Alias> {
        self.machine.view().aliases(collection)
    }

    /// Applies alias changes together (leader only).
    pub async fn update_aliases(&self, r: UpdateAliasesRequest, timeout: Duration) -> Result<()> {
        let cmd = CatalogCommand {
            op: Some(Op::UpdateAliases(r)),
        };
        self.propose(cmd, timeout).await
    }

    /// Adds fields to a collection's schema (leader only).
    pub async fn add_fields(&self, r: AddFieldsRequest, timeout: Duration) -> Result<()> {
        let cmd = CatalogCommand {
            op: Some(Op::AddFields(r)),
        };
        self.propose(cmd, timeout).await
    }

    pub fn list(&self) -> Vec<CollectionInfo> {
        self.machine.view().collections.values().cloned().collect()
    }

    pub fn contains(&self, name: &str) -> bool {
        self.machine.view().collections.contains_key(name)
    }

    /// This coordinator's view of the group (Admin.ClusterStatus).
    pub fn status(&self) -> CatalogStatus {
        let s = self.member.status();
        let matched: BTreeMap<u64, u64> = s.matched.iter().copied().collect();
        CatalogStatus {
            node_id: self.node_id,
            role: match s.role {
                Role::Leader => RaftRole::Leader,
                Role::Candidate => RaftRole::Candidate,
                Role::PreCandidate => RaftRole::PreCandidate,
                Role::Follower => RaftRole::Follower,
                Role::Learner => RaftRole::Learner,
                Role::Stopped => RaftRole::Stopped,
                Role::Removed => RaftRole::Removed,
            } as i32,
            leader_id: s.leader_id,
            leader_address: self.members.get(&s.leader_id).cloned().unwrap_or_default(),
            term: s.term,
            commit_index: s.commit_index,
            applied_index: s.applied_index,
            peers: self
                .members
                .iter()
                .map(|(id, address)| CatalogPeerStatus {
                    node_id: *id,
                    address: address.clone(),
                    matched: matched.get(id).copied().unwrap_or(0),
                })
                .collect(),
        }
    }

    fn leader_of(&self, s: &ragcluster_raft::Status) -> Leader {
        if s.is_leader() {
            Leader::Me
        } else if let Some(addr) = s.other_leader().and_then(|l| self.members.get(&l)) {
            Leader::Other(addr.clone())
        } else {
            Leader::Unknown
        }
    }

    pub fn leader(&self) -> Leader {
        self.leader_of(&self.member.status())
    }

    /// Where changes go, waiting up to `timeout` while an election runs.
    pub async fn wait_leader(&self, timeout: Duration) -> Leader {
        match self
            .member
            .wait_for(timeout, |s| s.is_leader() || s.other_leader().is_some())
            .await
        {
            Ok(s) | Err(s) => self.leader_of(&s),
        }
    }

    /// Where a catalog change must be made: `None` here (this coordinator leads the catalog),
    /// or the leader's address. A change forwarded once is not forwarded again.
    pub async fn change_target(&self, forwarded: bool) -> Result<Option<String>> {
        let unavailable = |reason: &str| CoordError::Unavailable {
            what: "catalog".into(),
            reason: reason.into(),
            retry_after_ms: 500,
        };
        match self.wait_leader(self.election).await {
            Leader::Me => Ok(None),
            Leader::Other(_) if forwarded => Err(unavailable(
                "catalog leadership is moving between coordinators",
            )),
            Leader::Other(addr) => Ok(Some(addr)),
            Leader::Unknown => Err(unavailable(
                "no coordinator leads the catalog (election in progress or no quorum)",
            )),
        }
    }

    /// Whether `node_id` is a coordinator of the group (in `coordinator.peers`).
    pub fn is_member(&self, node_id: u64) -> bool {
        self.members.contains_key(&node_id)
    }

    /// Hands Raft messages from coordinator `from` to the group.
    pub fn deliver(&self, from: u64, messages: Vec<Vec<u8>>) {
        for bytes in messages {
            self.transport.deliver(from, &GROUP, &bytes);
        }
    }

    async fn propose(&self, cmd: CatalogCommand, timeout: Duration) -> Result<()> {
        if let Some(why) = self.disk.full() {
            return Err(CoordError::DiskFull(format!(
                "coordinator {} refuses catalog changes: {why}; they are taken again by \
                 themselves once space is freed",
                self.node_id
            )));
        }
        let started = Instant::now();
        let r = match self.member.propose(cmd.encode_to_vec(), timeout).await {
            Ok(outcome) => outcome,
            Err(RaftError::Timeout { after, .. }) => Err(CoordError::Unavailable {
                what: "catalog".into(),
                reason: format!(
                    "change not committed within {} ms (no coordinator quorum?)",
                    after.as_millis()
                ),
                retry_after_ms: 1000,
            }),
            Err(_) => Err(leadership_moved()),
        };
        metrics::histogram!("catalog_proposal_seconds").record(started.elapsed().as_secs_f64());
        r
    }

    /// Starts, changes or (`job` None) ends the re-embedding of `source` (leader only).
    pub async fn set_reembed(
        &self,
        source: &str,
        job: Option<ragcluster_proto::v1::ReembedJob>,
        timeout: Duration,
    ) -> Result<()> {
        let cmd = CatalogCommand {
            op: Some(Op::SetReembed(ragcluster_proto::v1::SetReembed {
                source: source.to_owned(),
                job,
            })),
        };
        self.propose(cmd, timeout).await
    }

    /// The re-embedding `name` (a collection's own name) takes part in, with its source.
    pub fn reembed_job(&self, name: &str) -> Option<(String, ragcluster_proto::v1::ReembedJob)> {
        self.machine.view().reembed_job(name)
    }

    /// Where a write to `name` (a collection or an alias) goes: the collection, and during a
    /// re-embedding the other collection it is mirrored to, both read from one view so that a
    /// switch cannot fall between them (`View::mirror`).
    pub fn write_route(&self, name: &str) -> Result<(CollectionInfo, Option<Mirror>)> {
        let v = self.machine.view();
        let info = (v.collections.get(v.resolve(name)).cloned())
            .ok_or_else(|| CoordError::UnknownCollection(name.to_owned()))?;
        let mirror = v.mirror(&info.name)?;
        Ok((info, mirror))
    }

    /// Records a new collection (leader only); refused if the name exists.
    pub async fn insert(&self, c: CollectionInfo, timeout: Duration) -> Result<()> {
        let cmd = CatalogCommand {
            op: Some(Op::CreateCollection(c)),
        };
        self.propose(cmd, timeout).await
    }

    /// Removes a collection (leader only) and returns what it was.
    pub async fn remove(&self, name: &str, timeout: Duration) -> Result<CollectionInfo> {
        let info = self
            .get_exact(name)
            .ok_or_else(|| CoordError::UnknownCollection(name.to_owned()))?;
        let cmd = CatalogCommand {
            op: Some(Op::DropCollection(name.to_owned())),
        };
        self.propose(cmd, timeout).await?;
        Ok(info)
    }

    /// Records a shard's new replica list (leader only), after a replica move: node ids with
    /// their current addresses, in the same order.
    pub async fn set_placement(
        &self,
        collection: &str,
        shard: u32,
        nodes: Vec<(u64, String)>,
        timeout: Duration,
    ) -> Result<()> {
        let (node_ids, nodes) = nodes.into_iter().unzip();
        let cmd = CatalogCommand {
            op: Some(Op::SetPlacement(ragcluster_proto::v1::SetPlacement {
                collection: collection.to_owned(),
                shard,
                nodes,
                node_ids,
            })),
        };
        self.propose(cmd, timeout).await
    }

    /// Every member ever registered (removed ones included), by node id.
    pub fn members(&self) -> Vec<ragcluster_proto::v1::Member> {
        self.machine.view().members.values().cloned().collect()
    }

    pub fn member(&self, node_id: u64) -> Option<ragcluster_proto::v1::Member> {
        self.machine.view().members.get(&node_id).cloned()
    }

    /// The member (not removed) now at `address`.
    pub fn member_at(&self, address: &str) -> Option<ragcluster_proto::v1::Member> {
        self.machine.view().member_at(address).cloned()
    }

    /// Registers a member or records its new address (leader only).
    pub async fn upsert_member(
        &self,
        m: ragcluster_proto::v1::Member,
        timeout: Duration,
    ) -> Result<()> {
        let cmd = CatalogCommand {
            op: Some(Op::UpsertMember(m)),
        };
        self.propose(cmd, timeout).await
    }

    /// Changes a member's state (leader only).
    pub async fn set_member_state(
        &self,
        node_id: u64,
        state: MemberState,
        timeout: Duration,
    ) -> Result<()> {
        let cmd = CatalogCommand {
            op: Some(Op::SetMemberState(ragcluster_proto::v1::SetMemberState {
                node_id,
                state: state as i32,
                at_ms: std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_millis() as u64),
            })),
        };
        self.propose(cmd, timeout).await
    }

    /// The applied index, changing with every applied entry.
    pub fn changes(&self) -> tokio::sync::watch::Receiver<u64> {
        self.machine.changes()
    }

    /// Whether this coordinator leads the catalog now.
    pub fn is_leader(&self) -> bool {
        self.member.status().is_leader()
    }

    /// One API key record by id, as of this coordinator's applied catalog.
    pub fn api_key(&self, id: &str) -> Option<ApiKeyRecord> {
        self.machine.view().api_keys.get(id).cloned()
    }

    pub fn api_keys(&self) -> Vec<ApiKeyRecord> {
        self.machine.view().api_keys.values().cloned().collect()
    }

    /// Records a new API key (leader only).
    pub async fn add_api_key(&self, rec: ApiKeyRecord, timeout: Duration) -> Result<()> {
        let cmd = CatalogCommand {
            op: Some(Op::CreateApiKey(rec)),
        };
        self.propose(cmd, timeout).await
    }

    /// Marks an API key revoked at `at_ms` (leader only).
    pub async fn revoke_api_key(&self, id: &str, at_ms: u64, timeout: Duration) -> Result<()> {
        let cmd = CatalogCommand {
            op: Some(Op::RevokeApiKey(ragcluster_proto::v1::RevokeApiKey {
                id: id.to_owned(),
                at_ms,
            })),
        };
        self.propose(cmd, timeout).await
    }

    /// Waits until this coordinator's applied catalog satisfies `ok` (after a change made on
    /// the leader), so a client sees its own change here.
    pub async fn wait_for(&self, ok: impl Fn(&View) -> bool, timeout: Duration) -> bool {
        let mut changes = self.machine.changes();
        let until = tokio::time::Instant::now() + timeout;
        loop {
            if ok(&self.machine.view()) {
                return true;
            }
            if tokio::time::timeout_at(until, changes.changed())
                .await
                .is_err()
            {
                return ok(&self.machine.view());
            }
        }
    }

    /// Stops the group member (graceful shutdown).
    pub fn stop(&self) {
        self.member.stop();
    }
}

impl Drop for Catalog {
    fn drop(&mut self) {
        self.stop();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A lone coordinator whose data directory counts as full (a threshold above any free
    /// space) refuses catalog changes with RESOURCE_EXHAUSTED, naming itself and the cause,
    /// and the catalog is unchanged.
    #[tokio::test]
    async fn a_full_disk_refuses_catalog_changes() {
        let dir = tempfile::tempdir().unwrap();
        let mut opts = crate::testing::lone_catalog(dir.path());
        opts.disk.min_free = u64::MAX;
        let catalog = Catalog::open(&opts, &tokio::runtime::Handle::current(), None).unwrap();
        assert!(matches!(
            catalog.wait_leader(Duration::from_secs(5)).await,
            Leader::Me
        ));
        let c = CollectionInfo {
            name: "c".into(),
            shard_count: 1,
            replication_factor: 1,
            ..Default::default()
        };
        let e = catalog.insert(c, Duration::from_secs(2)).await.unwrap_err();
        assert_eq!(e.to_status_code(), tonic::Code::ResourceExhausted, "{e}");
        assert!(
            e.to_string()
                .contains("coordinator 1 refuses catalog changes"),
            "{e}"
        );
        assert!(e.retry_after_ms().is_some());
        assert!(catalog.list().is_empty());
        assert!(catalog.disk_full().is_some());
    }
}
