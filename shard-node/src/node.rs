//! The set of shards a node hosts, opened from RocksDB at start.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use parking_lot::RwLock;
use raft::eraftpb::ConfState;
use ragcluster_proto::v1::{HnswParams, OpenShardRequest, ShardRef};

use crate::config::ShardNodeConfig;
use crate::error::{Result, ShardError};
use crate::raft::group::Replica;
use crate::raft::log::GroupLog;
use crate::raft::transport::{Router, Transport};
use crate::shard::{Shard, ShardOptions};
use crate::storage::{RaftPersisted, ShardKey, Store};

pub struct Node {
    cfg: ShardNodeConfig,
    store: Arc<Store>,
    node_id: u64,
    replicas: RwLock<HashMap<ShardKey, Arc<Replica>>>,
    router: Router,
    transport: Arc<Transport>,
    /// Serialises open/drop so two creators of one shard cannot race.
    admin: parking_lot::Mutex<()>,
}

impl Node {
    /// Opens the node's RocksDB and restarts every replica recorded in it. `rt` runs the
    /// Raft transport.
    pub fn open(
        cfg: ShardNodeConfig,
        rt: tokio::runtime::Handle,
        tls: Option<Arc<ragcluster_common::tls::Tls>>,
    ) -> Result<Self> {
        std::fs::create_dir_all(&cfg.data_dir)?;
        let store = Arc::new(Store::open(&cfg.data_dir.join("rocksdb"), cfg.sync_writes)?);
        let node_id = store.node_id()?;
        let snap_dir = cfg.data_dir.join("snap");
        std::fs::create_dir_all(&snap_dir)?;
        let router: Router = Default::default();
        let transport = Transport::new(node_id, rt, router.clone(), store.clone(), snap_dir, tls)?;
        let node = Self {
            store,
            node_id,
            replicas: RwLock::new(HashMap::new()),
            router,
            transport,
            admin: Default::default(),
            cfg,
        };
        for (key, meta) in node.store.list_shards()? {
            match node.store.raft_state(&key)? {
                Some(p) => node.start_replica(
                    key,
                    meta.dimension,
                    meta.hnsw.unwrap_or_default(),
                    p,
                    false,
                )?,
                None => {
                    // Parameters without Raft state: a create that crashed half-way; it never
                    // acknowledged anything.
                    tracing::warn!(shard = %key, "dropping half-created shard");
                    node.store.drop_shard(&key)?;
                }
            }
        }
        tracing::info!(node_id, replicas = node.shard_count(), "node open");
        Ok(node)
    }

    pub fn node_id(&self) -> u64 {
        self.node_id
    }

    pub fn transport(&self) -> &Arc<Transport> {
        &self.transport
    }

    fn bm25_dir(&self, key: &ShardKey) -> PathBuf {
        self.cfg
            .data_dir
            .join("bm25")
            .join(&key.collection)
            .join(key.shard.to_string())
    }

    fn start_replica(
        &self,
        key: ShardKey,
        dimension: u32,
        params: HnswParams,
        p: RaftPersisted,
        campaign: bool,
    ) -> Result<()> {
        let opts = ShardOptions {
            bm25_writer_memory: self.cfg.bm25_writer_memory,
            compact_ratio: self.cfg.hnsw_compact_ratio,
            compact_min: self.cfg.hnsw_compact_min,
        };
        let dir = self.bm25_dir(&key);
        let shard = Arc::new(Shard::open(
            key.clone(),
            dimension,
            params,
            self.store.clone(),
            &dir,
            &opts,
        )?);
        let log = GroupLog::new(
            key.clone(),
            self.store.clone(),
            shard.clone(),
            self.transport.snap_dir().to_path_buf(),
            p,
        );
        let (replica, tx) = Replica::start(
            shard,
            log,
            self.node_id,
            &self.cfg.raft(),
            self.transport.clone(),
            campaign,
        )?;
        self.router.write().insert(key.clone(), tx);
        self.replicas.write().insert(key, replica);
        Ok(())
    }

    pub fn shard_count(&self) -> usize {
        self.replicas.read().len()
    }

    pub fn replica(&self, r: Option<&ShardRef>) -> Result<Arc<Replica>> {
        let r = r.ok_or_else(|| ShardError::InvalidArgument("shard is required".into()))?;
        let key = ShardKey::new(r.collection.clone(), r.shard);
        self.replicas
            .read()
            .get(&key)
            .cloned()
            .ok_or_else(|| ShardError::UnknownShard(key.to_string()))
    }

    pub fn shard(&self, r: Option<&ShardRef>) -> Result<Arc<Shard>> {
        Ok(self.replica(r)?.shard.clone())
    }

    /// Creates a replica: a member of a new group (`peers`, this node among them) or an empty
    /// replica that waits to be added to an existing group (`join`). Idempotent.
    pub fn open_shard(&self, req: OpenShardRequest) -> Result<()> {
        let r = req
            .shard
            .clone()
            .ok_or_else(|| ShardError::InvalidArgument("shard is required".into()))?;
        if r.collection.is_empty() || r.collection.contains('\0') || r.collection.starts_with('~') {
            return Err(ShardError::InvalidArgument(
                "shard.collection is empty, starts with '~' or has NUL".into(),
            ));
        }
        if req.dimension == 0 || req.dimension > 8192 {
            return Err(ShardError::InvalidArgument(
                "dimension must be in [1, 8192]".into(),
            ));
        }
        let params = req.hnsw.unwrap_or_default();
        if !(2..=256).contains(&params.m) {
            return Err(ShardError::InvalidArgument(
                "hnsw.m must be in [2, 256]".into(),
            ));
        }
        // With `join`, peers are the group's current members: only their addresses are used
        // (the leader adds this replica; its answers must reach the leader).
        let mut voters: Vec<u64> = if req.join {
            Vec::new()
        } else {
            req.peers.iter().map(|p| p.node_id).collect()
        };
        if req.join
            && req
                .peers
                .iter()
                .any(|p| p.node_id == 0 || p.address.is_empty())
        {
            return Err(ShardError::InvalidArgument(
                "peers of a join need node_id and address".into(),
            ));
        }
        if !req.join {
            if voters.is_empty() {
                voters.push(self.node_id);
            }
            if !voters.contains(&self.node_id) {
                return Err(ShardError::InvalidArgument(format!(
                    "peers do not include this node (id {})",
                    self.node_id
                )));
            }
            if voters.contains(&0) || {
                let mut v = voters.clone();
                v.sort_unstable();
                v.dedup();
                v.len() != voters.len()
            } {
                return Err(ShardError::InvalidArgument(
                    "peer node ids must be non-zero and distinct".into(),
                ));
            }
        }
        for p in &req.peers {
            self.transport.learn_peer(p.node_id, p.address.clone());
        }
        let _g = self.admin.lock();
        let key = ShardKey::new(r.collection, r.shard);
        if let Some(s) = self.replicas.read().get(&key) {
            if s.shard.dimension != req.dimension {
                return Err(ShardError::ShardConflict {
                    shard: key.to_string(),
                    existing: s.shard.dimension,
                    requested: req.dimension,
                });
            }
            return Ok(());
        }
        let cs = ConfState {
            voters: voters.clone(),
            ..Default::default()
        };
        // Raft state first: parameters without it mean a half-done create (dropped at open).
        self.store.raft_init(&key, &cs)?;
        self.store.put_shard_meta(&key, &req)?;
        let p = self
            .store
            .raft_state(&key)?
            .ok_or_else(|| ShardError::Corrupt(format!("raft state of {key} vanished")))?;
        // The first peer is the preferred leader: it campaigns at once instead of waiting out
        // an election timeout.
        let campaign = !req.join && voters.first() == Some(&self.node_id);
        self.start_replica(key, req.dimension, params, p, campaign)
    }

    pub fn drop_shard(&self, r: Option<&ShardRef>) -> Result<()> {
        let replica = self.replica(r)?;
        let _g = self.admin.lock();
        let key = replica.shard.key.clone();
        replica.stop();
        self.router.write().remove(&key);
        self.replicas.write().remove(&key);
        self.store.drop_shard(&key)?;
        let dir = self.bm25_dir(&key);
        drop(replica);
        if dir.exists() {
            std::fs::remove_dir_all(dir)?;
        }
        crate::raft::snapshot::remove_others(self.transport.snap_dir(), "gen", &key, None);
        crate::raft::snapshot::remove_others(self.transport.snap_dir(), "recv", &key, None);
        Ok(())
    }

    /// Drops the data of replicas that applied a membership change removing them. (A replica
    /// removed while cut off never learns it; the operator drops it with DropShard.)
    pub fn reap_removed(&self) {
        for r in self.replicas() {
            let st = r.status();
            // Also after a restart: the applied membership no longer lists this node. (A
            // joining replica has no membership at all until its snapshot arrives.)
            let gone = st.role == "removed"
                || (!st.voters.is_empty()
                    && !st.voters.contains(&st.node_id)
                    && !st.learners.contains(&st.node_id));
            if !gone {
                continue;
            }
            let key = r.shard.key.clone();
            let sref = ShardRef {
                collection: key.collection.clone(),
                shard: key.shard,
            };
            match self.drop_shard(Some(&sref)) {
                Ok(()) => tracing::info!(shard = %key, "removed replica dropped"),
                Err(e) => {
                    tracing::warn!(shard = %key, error = %e, "could not drop removed replica")
                }
            }
        }
    }

    pub fn replicas(&self) -> Vec<Arc<Replica>> {
        self.replicas.read().values().cloned().collect()
    }

    pub fn shards(&self) -> Vec<Arc<Shard>> {
        self.replicas()
            .into_iter()
            .map(|r| r.shard.clone())
            .collect()
    }

    pub fn store(&self) -> &Store {
        &self.store
    }

    /// Publishes per-shard index sizes and RocksDB figures as Prometheus gauges.
    pub fn export_metrics(&self) -> Result<()> {
        let mut leaders = 0;
        for r in self.replicas() {
            let s = &r.shard;
            let info = s.info()?;
            let label = s.key.to_string();
            let st = r.status();
            leaders += usize::from(st.role == "leader");
            metrics::gauge!("raft_term", "shard" => label.clone()).set(st.term as f64);
            metrics::gauge!("raft_commit_index", "shard" => label.clone())
                .set(st.commit_index as f64);
            metrics::gauge!("raft_applied_index", "shard" => label.clone())
                .set(st.applied_index as f64);
            metrics::gauge!("raft_is_leader", "shard" => label.clone())
                .set(f64::from(u8::from(st.role == "leader")));
            metrics::gauge!("shard_documents", "shard" => label.clone()).set(info.documents as f64);
            metrics::gauge!("shard_chunks", "shard" => label.clone()).set(info.chunks as f64);
            metrics::gauge!("shard_applied_seq", "shard" => label.clone())
                .set(info.applied_seq as f64);
            metrics::gauge!("shard_bm25_index_bytes", "shard" => label.clone())
                .set(info.bm25_index_bytes as f64);
            metrics::gauge!("shard_hnsw_points", "shard" => label.clone())
                .set(info.hnsw_points as f64);
            metrics::gauge!("shard_hnsw_tombstones", "shard" => label)
                .set(info.hnsw_tombstones as f64);
        }
        for (name, prop) in [
            ("rocksdb_live_sst_bytes", "rocksdb.live-sst-files-size"),
            ("rocksdb_memtable_bytes", "rocksdb.cur-size-all-mem-tables"),
            ("rocksdb_estimated_keys", "rocksdb.estimate-num-keys"),
            (
                "rocksdb_pending_compaction_bytes",
                "rocksdb.estimate-pending-compaction-bytes",
            ),
        ] {
            metrics::gauge!(name).set(self.store.property(prop) as f64);
        }
        metrics::gauge!("shard_node_shards").set(self.shard_count() as f64);
        metrics::gauge!("raft_leaders").set(leaders as f64);
        Ok(())
    }

    /// Stops every group and flushes the indexes (graceful shutdown).
    pub fn flush(&self) -> Result<()> {
        for r in self.replicas() {
            r.stop();
        }
        for s in self.shards() {
            s.flush()?;
        }
        self.store.flush()
    }
}
