//! `[coordinator]` section of the cluster config.

use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CoordinatorConfig {
    /// gRPC listen address for clients (Coordinator and Admin services); port 0 = any free port.
    pub listen: String,
    /// The catalog (collections and their shard placement) is persisted here.
    pub data_dir: PathBuf,
    /// Shard node addresses ("http://host:port"). Static placement in this version: shard i of
    /// a collection goes to node (hash(collection) + i) mod N.
    pub shard_nodes: Vec<String>,
    /// Model worker address.
    pub model_worker: String,
    /// tokenizer.json of the embedding model; chunk sizes are counted in its tokens.
    pub embedding_tokenizer: PathBuf,
    /// Deadline for one search when the request gives none.
    #[serde(with = "humantime_serde")]
    pub search_timeout: Duration,
    /// Deadline for one write to a shard node (includes its fsync and index commit).
    #[serde(with = "humantime_serde")]
    pub write_timeout: Duration,
    /// Deadline for one embedding call.
    #[serde(with = "humantime_serde")]
    pub embed_timeout: Duration,
    /// Texts per Embed call during ingest.
    pub embed_batch: usize,
    /// Embed calls in flight per ingest request.
    pub embed_concurrency: usize,
    pub port_file: Option<PathBuf>,
}

impl Default for CoordinatorConfig {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:7000".into(),
            data_dir: PathBuf::from("data/coordinator"),
            shard_nodes: vec!["http://127.0.0.1:7100".into()],
            model_worker: "http://127.0.0.1:7200".into(),
            embedding_tokenizer: PathBuf::from("models/all-MiniLM-L6-v2/tokenizer.json"),
            search_timeout: Duration::from_secs(5),
            write_timeout: Duration::from_secs(30),
            embed_timeout: Duration::from_secs(120),
            embed_batch: 32,
            embed_concurrency: 2,
            port_file: None,
        }
    }
}

impl CoordinatorConfig {
    pub fn validate(&self) -> Result<(), String> {
        if self.shard_nodes.is_empty() {
            return Err("coordinator.shard_nodes is empty".into());
        }
        for (i, a) in self.shard_nodes.iter().enumerate() {
            if !(a.starts_with("http://") || a.starts_with("https://")) {
                return Err(format!(
                    "coordinator.shard_nodes[{i}] must start with http:// or https://"
                ));
            }
        }
        if self.embed_batch == 0 || self.embed_batch > 256 {
            return Err("coordinator.embed_batch must be in [1, 256]".into());
        }
        if self.embed_concurrency == 0 {
            return Err("coordinator.embed_concurrency must be positive".into());
        }
        Ok(())
    }
}
