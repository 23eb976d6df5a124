//! The set of shard replicas a node hosts, opened from RocksDB at start.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use parking_lot::RwLock;
use ragcluster_common::disk::DiskGuard;
use ragcluster_raft::eraftpb::{ConfState, MessageType};
use ragcluster_raft::{Options, Role, Transport};

use crate::config::ShardNodeConfig;
use crate::error::{Result, ShardError};
use crate::index::worker::{Committing, Compaction, Dumping, Following};

/// Chunks staged in a shard's tantivy writer that make it commit before `bm25_commit_interval`.
const BM25_COMMIT_MAX_CHUNKS: usize = 4096;
use crate::raft::Replica;
use crate::raft::transport::{GrpcDialer, ShardTransport};
use crate::shard::{Shard, ShardDirs, ShardOptions};
use crate::space::Space;
use crate::storage::{ShardKey, ShardMeta, Store};

/// A replica to create: a member of a new group (`peers`, this node among them) or, with
/// `join`, an empty replica waiting to be added to an existing group whose current members are
/// `peers`.
#[derive(Debug, Clone)]
pub struct OpenShard {
    pub key: ShardKey,
    pub meta: ShardMeta,
    /// (node id, address) of the group's members.
    pub peers: Vec<(u64, String)>,
    pub join: bool,
}

pub struct Node {
    cfg: ShardNodeConfig,
    store: Arc<Store>,
    node_id: u64,
    replicas: RwLock<HashMap<ShardKey, Arc<Replica>>>,
    transport: Arc<ShardTransport>,
    /// Serialises open/drop so two creators of one shard cannot race.
    admin: parking_lot::Mutex<()>,
    /// Set when the node starts shutting down: peers' endless Raft streams end on it, so the
    /// server can drain.
    closing: tokio::sync::watch::Sender<bool>,
    /// Member certificate for calls to `https://` peers (Raft, graph dumps, forwarded writes).
    tls: Option<Arc<ragcluster_common::tls::Tls>>,
    /// Free space here and the peers that said theirs is full.
    space: Arc<Space>,
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
        // Before RocksDB: the reserve is taken while there is room.
        let guard = DiskGuard::start(&cfg.data_dir, cfg.disk_policy())?;
        let (store, salvaged) =
            crate::storage::open_checked(&cfg.data_dir.join("rocksdb"), cfg.sync_writes)?;
        let store = Arc::new(store);
        let node_id = store.node_id()?;
        let space = Arc::new(Space::new(guard, node_id));
        let snap_dir = cfg.data_dir.join("snap");
        std::fs::create_dir_all(&snap_dir)?;
        let dialer = Arc::new(GrpcDialer {
            node_id,
            snap_dir,
            tls: tls.clone(),
            snapshot_timeout: cfg.snapshot_send_timeout,
        });
        let persist = store.clone();
        let on_learn = Box::new(move |list: &[(u64, String)]| {
            if let Err(e) = persist.put_peers(list) {
                tracing::warn!(error = %e, "could not persist peer table");
            }
        });
        let transport = Transport::new(node_id, rt, dialer, store.peers()?, on_learn, "raft");
        let refuses = space.clone();
        transport.set_refuse(Arc::new(move |t: MessageType| refuses.refuses(t)));
        let node = Self {
            store,
            node_id,
            replicas: RwLock::new(HashMap::new()),
            transport,
            admin: Default::default(),
            closing: tokio::sync::watch::Sender::new(false),
            tls,
            space,
            cfg,
        };
        for (key, meta) in node.store.list_shards()? {
            if let Some(why) = node.store.damaged(&key)? {
                // Its indexes were built from data the salvage dropped.
                for dir in [node.bm25_dir(&key), node.hnsw_dir(&key)] {
                    let _ = std::fs::remove_dir_all(dir);
                }
                node.start_replica(key, meta, (false, false), Some(why))?;
            } else if node.store.raft_log(&key).exists().map_err(raft_store)? {
                node.start_replica(key, meta, (false, false), None)?;
            } else {
                // Parameters without Raft state: a create that crashed half-way; it never
                // acknowledged anything.
                tracing::warn!(shard = %key, "dropping half-created shard");
                node.store.drop_shard(&key)?;
            }
        }
        tracing::info!(
            node_id,
            replicas = node.shard_count(),
            salvaged = salvaged.is_some(),
            "node open"
        );
        Ok(node)
    }

    pub fn node_id(&self) -> u64 {
        self.node_id
    }

    pub fn transport(&self) -> &Arc<ShardTransport> {
        &self.transport
    }

    pub fn space(&self) -> &Arc<Space> {
        &self.space
    }

    /// The member certificate this node presents to its peers.
    pub fn tls(&self) -> Option<Arc<ragcluster_common::tls::Tls>> {
        self.tls.clone()
    }

    /// Starts shutting down: inbound Raft streams end (peers redial another time).
    pub fn begin_close(&self) {
        self.closing.send_replace(true);
    }

    /// Moves every leadership this node holds to the most caught-up other voter whose disk
    /// has room, so a node that is going away (or whose disk is full) leaves no shard without
    /// a writable leader for an election timeout. Returns (leaderships held, moved within
    /// `timeout`).
    pub async fn hand_off_leaderships(&self, timeout: std::time::Duration) -> (usize, usize) {
        let replicas: Vec<Arc<Replica>> = self.replicas.read().values().cloned().collect();
        let moves: Vec<_> = replicas
            .into_iter()
            .filter_map(|r| {
                let st = r.status();
                if !st.is_leader() {
                    return None;
                }
                let to = st
                    .matched
                    .iter()
                    .filter(|(id, _)| {
                        *id != st.id && st.voters.contains(id) && !self.space.peer_full(*id)
                    })
                    .max_by_key(|(_, m)| *m)
                    .map(|(id, _)| *id)?;
                Some(async move {
                    let moved = r.transfer_leader(to, timeout).await;
                    if let Err(e) = &moved {
                        tracing::warn!(shard = %r.shard.key, to, error = %e,
                                       "leadership not handed off");
                    }
                    moved.is_ok()
                })
            })
            .collect();
        let held = moves.len();
        let moved = futures::future::join_all(moves)
            .await
            .into_iter()
            .filter(|ok| *ok)
            .count();
        (held, moved)
    }

    /// Resolves once `begin_close` was called.
    pub async fn closed(&self) {
        let mut rx = self.closing.subscribe();
        let _ = rx.wait_for(|c| *c).await;
    }

    fn snap_dir(&self) -> PathBuf {
        self.cfg.data_dir.join("snap")
    }

    fn bm25_dir(&self, key: &ShardKey) -> PathBuf {
        self.cfg
            .data_dir
            .join("bm25")
            .join(&key.collection)
            .join(key.shard.to_string())
    }

    fn hnsw_dir(&self, key: &ShardKey) -> PathBuf {
        self.cfg
            .data_dir
            .join("hnsw")
            .join(&key.collection)
            .join(key.shard.to_string())
    }

    /// Starts the replica's Raft member and indexes: `campaign` at once (a new group's
    /// preferred leader), `created` when its storage was just made empty (raft-core's
    /// `Options::created`), not opened from disk.
    fn start_replica(
        &self,
        key: ShardKey,
        meta: ShardMeta,
        (campaign, created): (bool, bool),
        damaged: Option<String>,
    ) -> Result<()> {
        let opts = ShardOptions {
            bm25_writer_memory: self.cfg.bm25_writer_memory,
            compaction: Compaction {
                ratio: self.cfg.hnsw_compact_ratio,
                min: self.cfg.hnsw_compact_min,
            },
            dumping: Dumping {
                min_changes: self.cfg.hnsw_dump_min_changes,
                interval: self.cfg.hnsw_dump_interval,
            },
            following: Following {
                enabled: self.cfg.hnsw_follow_leader_graph,
                pending_max: self.cfg.hnsw_follower_pending_max,
                behind_max: self.cfg.hnsw_write_behind_max,
            },
            committing: Committing {
                interval: self.cfg.bm25_commit_interval,
                max_chunks: BM25_COMMIT_MAX_CHUNKS,
            },
        };
        let (bm25, hnsw, snap) = (self.bm25_dir(&key), self.hnsw_dir(&key), self.snap_dir());
        let dirs = ShardDirs {
            bm25: &bm25,
            hnsw: &hnsw,
            snap: &snap,
        };
        let shard = Arc::new(Shard::open(
            key.clone(),
            meta,
            self.store.clone(),
            &dirs,
            &opts,
        )?);
        let raft = Options {
            id: self.node_id,
            tick: self.cfg.raft_tick,
            election_ticks: self.cfg.raft_election_ticks,
            heartbeat_ticks: self.cfg.raft_heartbeat_ticks,
            log_gc_threshold: self.cfg.raft_log_gc_threshold,
            compact_applied: true,
            campaign,
            created,
            fixed_election_timeout: None,
            name: key.to_string(),
            metrics_prefix: "raft",
        };
        let log = self.store.raft_log(&key);
        let replica = Replica::start(
            shard,
            log,
            raft,
            self.transport.clone(),
            self.space.clone(),
            damaged,
        )?;
        self.replicas.write().insert(key, replica);
        Ok(())
    }

    pub fn shard_count(&self) -> usize {
        self.replicas.read().len()
    }

    pub fn replica(&self, key: &ShardKey) -> Result<Arc<Replica>> {
        self.replicas
            .read()
            .get(key)
            .cloned()
            .ok_or_else(|| ShardError::UnknownShard(key.to_string()))
    }

    /// Creates a replica (see `OpenShard`). Idempotent when the parameters match. Refused
    /// while the disk is full (a new replica would fill it further).
    pub fn open_shard(&self, req: OpenShard) -> Result<()> {
        let mut voters: Vec<u64> = if req.join {
            Vec::new()
        } else {
            req.peers.iter().map(|p| p.0).collect()
        };
        if !req.join && voters.is_empty() {
            voters.push(self.node_id);
        }
        if !req.join && !voters.contains(&self.node_id) {
            return Err(ShardError::InvalidArgument(format!(
                "peers do not include this node (id {})",
                self.node_id
            )));
        }
        for (id, address) in &req.peers {
            self.transport.learn_peer(*id, address);
        }
        let _g = self.admin.lock();
        let key = req.key;
        if let Some(s) = self.replicas.read().get(&key) {
            if s.shard.dimension != req.meta.dimension {
                return Err(ShardError::ShardConflict {
                    shard: key.to_string(),
                    existing: s.shard.dimension,
                    requested: req.meta.dimension,
                });
            }
            return Ok(());
        }
        if let Some(why) = self.space.full() {
            return Err(ShardError::DiskFull(format!(
                "shard node {} takes no new replica: {why}",
                self.node_id
            )));
        }
        let cs = ConfState {
            voters: voters.clone(),
            ..Default::default()
        };
        // Raft state first: parameters without it mean a half-done create (dropped at open).
        self.store.raft_log(&key).init(&cs).map_err(raft_store)?;
        self.store.put_shard_meta(&key, &req.meta)?;
        // The first peer is the preferred leader: it campaigns at once instead of waiting out
        // an election timeout.
        let campaign = !req.join && voters.first() == Some(&self.node_id);
        self.start_replica(key, req.meta, (campaign, true), None)
    }

    pub fn drop_shard(&self, key: &ShardKey) -> Result<()> {
        let replica = self.replica(key)?;
        let _g = self.admin.lock();
        replica.stop();
        self.transport.unregister(key);
        self.replicas.write().remove(key);
        // The index worker finishes before the files go.
        replica.shard.stop_indexing();
        drop(replica);
        self.store.drop_shard(key)?;
        for dir in [self.bm25_dir(key), self.hnsw_dir(key)] {
            if dir.exists() {
                std::fs::remove_dir_all(dir)?;
            }
        }
        let snaps = self.snap_dir();
        crate::raft::snapshot::remove_others(&snaps, "gen", key, None);
        crate::raft::snapshot::remove_others(&snaps, "recv", key, None);
        Ok(())
    }

    /// Drops the data of replicas that applied a membership change removing them. (A replica
    /// removed while cut off never learns it; the operator drops it with DropShard.)
    pub fn reap_removed(&self) {
        for r in self.replicas() {
            let st = r.status();
            // Also after a restart: the applied membership no longer lists this node. (A
            // joining replica has no membership at all until its snapshot arrives.)
            let gone = st.role == Role::Removed || (!st.voters.is_empty() && !st.is_member(st.id));
            if !gone {
                continue;
            }
            let key = r.shard.key.clone();
            match self.drop_shard(&key) {
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

    pub fn store(&self) -> &Store {
        &self.store
    }

    pub fn store_handle(&self) -> Arc<Store> {
        self.store.clone()
    }

    /// Takes the replicas with keys in a damaged file out of service (the scrub found it):
    /// the catalog leader rebuilds them from their peers, and the next open salvages the
    /// store without the file.
    pub fn take_out_damaged(&self, d: &crate::storage::scrub::Damage) {
        for key in &d.shards {
            if let Ok(r) = self.replica(key) {
                r.fail(d.to_string());
            }
        }
        if d.node_records {
            tracing::error!(file = %d.file,
                "the damaged file may hold this node's own records (id, peers); the next open \
                 refuses to start if they are unreadable");
        }
    }

    /// Publishes per-shard index sizes and RocksDB figures as Prometheus gauges.
    pub fn export_metrics(&self) {
        let mut leaders = 0;
        for r in self.replicas() {
            let f = r.shard.figures();
            let label = r.shard.key.to_string();
            let st = r.status();
            leaders += usize::from(st.is_leader());
            let g = |name: &'static str, v: f64| {
                metrics::gauge!(name, "shard" => label.clone()).set(v);
            };
            g("raft_term", st.term as f64);
            g("raft_commit_index", st.commit_index as f64);
            g("raft_applied_index", st.applied_index as f64);
            g("raft_is_leader", f64::from(u8::from(st.is_leader())));
            g("raft_member_failed", f64::from(u8::from(st.has_failed())));
            g("shard_documents", f.documents as f64);
            g("shard_chunks", f.chunks as f64);
            g("shard_applied_seq", f.visible_seq as f64);
            g("shard_bm25_index_bytes", f.bm25_index_bytes as f64);
            g("shard_hnsw_points", f.hnsw_points as f64);
            g("shard_hnsw_tombstones", f.hnsw_tombstones as f64);
            g("shard_hnsw_pending_points", f.hnsw_pending as f64);
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
    }

    /// Stops every group and flushes the indexes (graceful shutdown).
    pub fn flush(&self) -> Result<()> {
        for r in self.replicas() {
            r.stop();
        }
        self.transport.close();
        for r in self.replicas() {
            r.shard.flush()?;
        }
        self.store.flush()
    }
}

fn raft_store(e: ragcluster_raft::Fatal) -> ShardError {
    ShardError::Corrupt(e.0)
}
