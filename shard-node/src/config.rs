//! `[shard_node]` section of the cluster config.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ShardNodeConfig {
    /// gRPC listen address; port 0 picks a free port (see `port_file`).
    pub listen: String,
    /// RocksDB lives in `<data_dir>/rocksdb`, BM25 indexes in `<data_dir>/bm25/<collection>/<shard>`.
    pub data_dir: PathBuf,
    /// fsync the RocksDB WAL before acknowledging a write. Turning it off trades durability
    /// for speed: acknowledged writes can be lost on power failure (not on process crash).
    pub sync_writes: bool,
    /// Rebuild a shard's HNSW graph once tombstones exceed this fraction of its points.
    pub hnsw_compact_ratio: f64,
    /// ...and at least this many tombstones.
    pub hnsw_compact_min: usize,
    /// Memory budget of each shard's tantivy writer, bytes (at least 15 MB).
    pub bm25_writer_memory: usize,
    /// Where to write `{"grpc": addr, "metrics": addr}` once listening.
    pub port_file: Option<PathBuf>,
}

impl Default for ShardNodeConfig {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:7100".into(),
            data_dir: PathBuf::from("data/shard-node"),
            sync_writes: true,
            hnsw_compact_ratio: 0.25,
            hnsw_compact_min: 1000,
            bm25_writer_memory: 32 * 1024 * 1024,
            port_file: None,
        }
    }
}

impl ShardNodeConfig {
    pub fn validate(&self) -> Result<(), String> {
        if !(0.0..=1.0).contains(&self.hnsw_compact_ratio) {
            return Err("shard_node.hnsw_compact_ratio must be in [0, 1]".into());
        }
        if self.bm25_writer_memory < 15_000_000 {
            return Err("shard_node.bm25_writer_memory must be at least 15000000 bytes".into());
        }
        Ok(())
    }
}
