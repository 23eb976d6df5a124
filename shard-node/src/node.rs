//! The set of shards a node hosts, opened from RocksDB at start.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use parking_lot::RwLock;
use ragcluster_proto::v1::{HnswParams, OpenShardRequest, ShardRef};

use crate::config::ShardNodeConfig;
use crate::error::{Result, ShardError};
use crate::shard::{Shard, ShardOptions};
use crate::storage::{ShardKey, Store};

pub struct Node {
    cfg: ShardNodeConfig,
    store: Arc<Store>,
    shards: RwLock<HashMap<ShardKey, Arc<Shard>>>,
    /// Serialises open/drop so two creators of one shard cannot race.
    admin: parking_lot::Mutex<()>,
}

impl Node {
    /// Opens the node's RocksDB and recovers every shard recorded in it.
    pub fn open(cfg: ShardNodeConfig) -> Result<Self> {
        std::fs::create_dir_all(&cfg.data_dir)?;
        let store = Arc::new(Store::open(&cfg.data_dir.join("rocksdb"), cfg.sync_writes)?);
        let node = Self {
            store,
            shards: RwLock::new(HashMap::new()),
            admin: Default::default(),
            cfg,
        };
        for (key, meta) in node.store.list_shards()? {
            let shard =
                node.open_shard_files(key.clone(), meta.dimension, meta.hnsw.unwrap_or_default())?;
            node.shards.write().insert(key, Arc::new(shard));
        }
        Ok(node)
    }

    fn bm25_dir(&self, key: &ShardKey) -> PathBuf {
        self.cfg
            .data_dir
            .join("bm25")
            .join(&key.collection)
            .join(key.shard.to_string())
    }

    fn open_shard_files(&self, key: ShardKey, dimension: u32, params: HnswParams) -> Result<Shard> {
        let opts = ShardOptions {
            bm25_writer_memory: self.cfg.bm25_writer_memory,
            compact_ratio: self.cfg.hnsw_compact_ratio,
            compact_min: self.cfg.hnsw_compact_min,
        };
        let dir = self.bm25_dir(&key);
        Shard::open(key, dimension, params, self.store.clone(), &dir, &opts)
    }

    pub fn shard_count(&self) -> usize {
        self.shards.read().len()
    }

    pub fn shard(&self, r: Option<&ShardRef>) -> Result<Arc<Shard>> {
        let r = r.ok_or_else(|| ShardError::InvalidArgument("shard is required".into()))?;
        let key = ShardKey::new(r.collection.clone(), r.shard);
        self.shards
            .read()
            .get(&key)
            .cloned()
            .ok_or_else(|| ShardError::UnknownShard(key.to_string()))
    }

    /// Creates a shard, or confirms an existing one with the same dimension.
    pub fn open_shard(&self, req: OpenShardRequest) -> Result<()> {
        let r = req
            .shard
            .clone()
            .ok_or_else(|| ShardError::InvalidArgument("shard is required".into()))?;
        if r.collection.is_empty() || r.collection.contains('\0') {
            return Err(ShardError::InvalidArgument(
                "shard.collection is empty or has NUL".into(),
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
        let _g = self.admin.lock();
        let key = ShardKey::new(r.collection, r.shard);
        if let Some(s) = self.shards.read().get(&key) {
            if s.dimension != req.dimension {
                return Err(ShardError::ShardConflict {
                    shard: key.to_string(),
                    existing: s.dimension,
                    requested: req.dimension,
                });
            }
            return Ok(());
        }
        self.store.put_shard_meta(&key, &req)?;
        let shard = self.open_shard_files(key.clone(), req.dimension, params)?;
        self.shards.write().insert(key, Arc::new(shard));
        Ok(())
    }

    pub fn drop_shard(&self, r: Option<&ShardRef>) -> Result<()> {
        let shard = self.shard(r)?;
        let _g = self.admin.lock();
        self.shards.write().remove(&shard.key);
        self.store.drop_shard(&shard.key)?;
        let dir = self.bm25_dir(&shard.key);
        drop(shard);
        if dir.exists() {
            std::fs::remove_dir_all(dir)?;
        }
        Ok(())
    }

    pub fn shards(&self) -> Vec<Arc<Shard>> {
        self.shards.read().values().cloned().collect()
    }

    pub fn store(&self) -> &Store {
        &self.store
    }

    /// Publishes per-shard index sizes and RocksDB figures as Prometheus gauges.
    pub fn export_metrics(&self) -> Result<()> {
        for s in self.shards() {
            let info = s.info()?;
            let label = s.key.to_string();
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
        Ok(())
    }

    pub fn flush(&self) -> Result<()> {
        for s in self.shards() {
            s.flush()?;
        }
        self.store.flush()
    }
}
