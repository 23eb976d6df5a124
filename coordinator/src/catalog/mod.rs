//! The collection catalog (collections and their shard placement), replicated with raft-rs
//! among the coordinators listed in `coordinator.peers` (1 or 3, static membership), so losing
//! a coordinator or its disk does not lose it. Every coordinator serves reads (search, ingest,
//! describe) from its applied copy; changes are proposed on the leader (others forward them)
//! and acknowledged once committed, applied and synced. Which replica of a shard leads is not
//! part of it: that changes on every election, and coordinators learn it from shard nodes.

mod group;
mod log;
mod store;
mod transport;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::mpsc::Sender;
use std::time::{Duration, Instant};

use parking_lot::{Mutex, RwLock};
use prost::Message as _;
use protobuf::Message as _;
use raft::eraftpb::{ConfState, Message, Snapshot};
use raft::storage::MemStorage;
use ragcluster_proto::v1::catalog_peer_server::CatalogPeer;
use ragcluster_proto::v1::{
    ApiKeyRecord, CatalogCommand, CatalogRaftAck, CatalogRaftBatch, CatalogState, CatalogStatus,
    CollectionInfo, catalog_command::Op,
};
use tokio::sync::oneshot;

use crate::config::CoordinatorConfig;
use crate::error::{CoordError, Result};
use group::{Group, Msg, raft_err};

/// The catalog as of an applied index.
#[derive(Clone, Default)]
pub struct View {
    pub collections: BTreeMap<String, CollectionInfo>,
    /// API keys by id (hashed; see `auth`).
    pub api_keys: BTreeMap<String, ApiKeyRecord>,
    pub applied_index: u64,
    pub applied_term: u64,
}

impl View {
    fn from_state(st: CatalogState) -> Self {
        Self {
            collections: st
                .collections
                .into_iter()
                .map(|c| (c.name.clone(), c))
                .collect(),
            api_keys: st
                .api_keys
                .into_iter()
                .filter_map(|k| Some((k.info.as_ref()?.id.clone(), k)))
                .collect(),
            applied_index: st.applied_index,
            applied_term: st.applied_term,
        }
    }

    fn state(&self) -> CatalogState {
        CatalogState {
            applied_index: self.applied_index,
            applied_term: self.applied_term,
            collections: self.collections.values().cloned().collect(),
            api_keys: self.api_keys.values().cloned().collect(),
        }
    }
}

/// Where catalog changes must go.
pub enum Leader {
    Me,
    Other(String),
    Unknown,
}

pub struct Catalog {
    node_id: u64,
    view: Arc<RwLock<View>>,
    status: Arc<RwLock<CatalogStatus>>,
    tx: Sender<Msg>,
    transport: Arc<transport::Transport>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl Catalog {
    /// Opens the durable store under `data_dir/catalog`, rebuilds the Raft log and starts the
    /// group member. A lone coordinator elects itself at once.
    pub fn open(
        cfg: &CoordinatorConfig,
        rt: &tokio::runtime::Handle,
        tls: Option<&Arc<ragcluster_common::tls::Tls>>,
    ) -> Result<Self> {
        let members = cfg.catalog_members().map_err(CoordError::Catalog)?;
        let node_id = cfg.node_id;
        let store = Arc::new(store::CatalogStore::open(&cfg.data_dir.join("catalog"))?);
        let loaded = store.load()?;
        let conf = ConfState {
            voters: members.keys().copied().collect(),
            ..Default::default()
        };
        let mem = MemStorage::new_with_conf_state(conf.clone());
        let applied = loaded.state.applied_index;
        {
            let mut core = mem.wl();
            if applied > 0 {
                let mut snap = Snapshot::default();
                let m = snap.mut_metadata();
                m.index = applied;
                m.term = loaded.state.applied_term;
                m.set_conf_state(conf.clone());
                core.apply_snapshot(snap).map_err(raft_err)?;
            }
            if let Some(first) = loaded.entries.first()
                && first.index != applied + 1
            {
                return Err(CoordError::Catalog(format!(
                    "log starts at {} but the catalog is applied up to {applied}",
                    first.index
                )));
            }
            core.append(&loaded.entries).map_err(raft_err)?;
            let mut hs = loaded.hard_state.clone();
            let last = loaded.entries.last().map_or(applied, |e| e.index);
            hs.commit = hs.commit.clamp(applied, last);
            hs.term = hs.term.max(loaded.state.applied_term);
            core.set_hardstate(hs);
        }
        let view = Arc::new(RwLock::new(View::from_state(loaded.state)));
        let raft_cfg = raft::Config {
            id: node_id,
            election_tick: cfg.raft_election_ticks,
            heartbeat_tick: cfg.raft_heartbeat_ticks,
            applied,
            check_quorum: true,
            pre_vote: true,
            ..Default::default()
        };
        raft_cfg.validate().map_err(raft_err)?;
        let logger = slog::Logger::root(slog::Discard, slog::o!());
        let storage = log::CatalogLog {
            mem,
            view: view.clone(),
            conf,
        };
        let mut raw = raft::RawNode::new(&raft_cfg, storage, &logger).map_err(raft_err)?;
        if members.len() == 1 {
            raw.campaign().map_err(raft_err)?;
        }
        let (tx, rx) = std::sync::mpsc::channel();
        let transport = Arc::new(
            transport::Transport::start(node_id, members, tx.clone(), rt, tls)
                .map_err(CoordError::Catalog)?,
        );
        let status = Arc::new(RwLock::new(CatalogStatus {
            node_id,
            role: "follower".into(),
            ..Default::default()
        }));
        let mut g = Group {
            raw,
            rx,
            store,
            view: view.clone(),
            status: status.clone(),
            transport: transport.clone(),
            node_id,
            tick: cfg.raft_tick,
            keep: cfg.raft_log_gc_threshold,
            waiters: BTreeMap::new(),
            last_leader: 0,
        };
        let thread = std::thread::Builder::new()
            .name("catalog-raft".into())
            .spawn(move || g.run())
            .map_err(|e| CoordError::Catalog(format!("spawn: {e}")))?;
        Ok(Self {
            node_id,
            view,
            status,
            tx,
            transport,
            thread: Mutex::new(Some(thread)),
        })
    }

    pub fn get(&self, name: &str) -> Result<CollectionInfo> {
        self.view
            .read()
            .collections
            .get(name)
            .cloned()
            .ok_or_else(|| CoordError::UnknownCollection(name.to_owned()))
    }

    pub fn list(&self) -> Vec<CollectionInfo> {
        self.view.read().collections.values().cloned().collect()
    }

    pub fn contains(&self, name: &str) -> bool {
        self.view.read().collections.contains_key(name)
    }

    pub fn status(&self) -> CatalogStatus {
        self.status.read().clone()
    }

    pub fn leader(&self) -> Leader {
        let s = self.status.read();
        if s.role == "leader" {
            Leader::Me
        } else if s.leader_id != 0 && !s.leader_address.is_empty() {
            Leader::Other(s.leader_address.clone())
        } else {
            Leader::Unknown
        }
    }

    /// Where changes go, waiting up to `timeout` while an election runs.
    pub async fn wait_leader(&self, timeout: Duration) -> Leader {
        let until = Instant::now() + timeout;
        loop {
            match self.leader() {
                Leader::Unknown if Instant::now() < until => {
                    tokio::time::sleep(Duration::from_millis(10)).await
                }
                l => return l,
            }
        }
    }

    async fn propose(&self, cmd: CatalogCommand, timeout: Duration) -> Result<()> {
        let (reply, rx) = oneshot::channel();
        self.tx
            .send(Msg::Propose {
                data: cmd.encode_to_vec(),
                reply,
            })
            .map_err(|_| group::leadership_moved())?;
        let started = Instant::now();
        let r = match tokio::time::timeout(timeout, rx).await {
            Ok(Ok(r)) => r,
            Ok(Err(_)) => Err(group::leadership_moved()),
            Err(_) => Err(CoordError::Unavailable {
                what: "catalog".into(),
                reason: format!(
                    "change not committed within {} ms (no coordinator quorum?)",
                    timeout.as_millis()
                ),
                retry_after_ms: 1000,
            }),
        };
        metrics::histogram!("catalog_proposal_seconds").record(started.elapsed().as_secs_f64());
        r
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
        let info = self.get(name)?;
        let cmd = CatalogCommand {
            op: Some(Op::DropCollection(name.to_owned())),
        };
        self.propose(cmd, timeout).await?;
        Ok(info)
    }

    /// Records a shard's new replica list (leader only), after a replica move.
    pub async fn set_placement(
        &self,
        collection: &str,
        shard: u32,
        nodes: Vec<String>,
        timeout: Duration,
    ) -> Result<()> {
        let cmd = CatalogCommand {
            op: Some(Op::SetPlacement(ragcluster_proto::v1::SetPlacement {
                collection: collection.to_owned(),
                shard,
                nodes,
            })),
        };
        self.propose(cmd, timeout).await
    }

    /// One API key record by id, as of this coordinator's applied catalog.
    pub fn api_key(&self, id: &str) -> Option<ApiKeyRecord> {
        self.view.read().api_keys.get(id).cloned()
    }

    pub fn api_keys(&self) -> Vec<ApiKeyRecord> {
        self.view.read().api_keys.values().cloned().collect()
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
        let until = Instant::now() + timeout;
        loop {
            if ok(&self.view.read()) {
                return true;
            }
            if Instant::now() >= until {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Stops the group member (graceful shutdown).
    pub fn stop(&self) {
        let _ = self.tx.send(Msg::Stop);
        if let Some(t) = self.thread.lock().take() {
            let _ = t.join();
        }
    }
}

impl Drop for Catalog {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The internal `CatalogPeer` service: Raft messages from other coordinators.
pub struct CatalogPeerService(pub Arc<crate::State>);

#[tonic::async_trait]
impl CatalogPeer for CatalogPeerService {
    async fn raft(
        &self,
        req: tonic::Request<CatalogRaftBatch>,
    ) -> std::result::Result<tonic::Response<CatalogRaftAck>, tonic::Status> {
        // With TLS on, only coordinators holding a member certificate may talk Raft.
        if self.0.tls.as_ref().is_some_and(|t| t.serves())
            && !ragcluster_common::tls::peer(req.extensions()).member
        {
            return Err(tonic::Status::unauthenticated(
                "CatalogPeer is internal: callers must present a cluster member certificate",
            ));
        }
        let b = req.into_inner();
        let cat = &self.0.catalog;
        if !cat.transport.is_member(b.from_node_id) {
            return Err(tonic::Status::permission_denied(format!(
                "coordinator {} is not in coordinator.peers of coordinator {}",
                b.from_node_id,
                cat.transport.node_id()
            )));
        }
        for bytes in b.messages {
            let mut m = Message::default();
            if m.merge_from_bytes(&bytes).is_err()
                || m.to != cat.node_id
                || m.from != b.from_node_id
            {
                metrics::counter!("catalog_messages_ignored_total").increment(1);
                continue;
            }
            cat.tx
                .send(Msg::Raft(Box::new(m)))
                .map_err(|_| tonic::Status::unavailable("catalog stopped"))?;
        }
        Ok(tonic::Response::new(CatalogRaftAck {}))
    }
}
