//! A whole cluster in one process: shard nodes opened from the shard-node library, a model
//! worker, and a coordinator that reaches the shard nodes through `LocalConnector`, direct
//! calls into each node's `ShardService` (`colocated::LocalNode`: no sockets, no protobuf
//! encoding). Raft traffic
//! between the shard nodes still goes over loopback gRPC as in production, so leader
//! election, replication and snapshots are the real thing; only the coordinator-to-shard hop
//! is short-circuited. Nodes stop and restart in place (same data directory and address).
//!
//! What it cannot do: process-global failpoints (`fail`) act on every node at once here, so
//! partitions stay in the process-level tests.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use colocated::LocalNode;
use coordinator::shards::{Connector, ShardCallError, ShardNode};
use parking_lot::RwLock;
use ragcluster_proto::v1::coordinator_client::CoordinatorClient;
use ragcluster_proto::v1::*;
use shard_node::ShardNodeConfig;
use tokio::sync::oneshot;
use tonic::transport::Channel;

type CallResult<T> = std::result::Result<T, ShardCallError>;

/// Shard node addresses resolved to the nodes running in this process; a stopped node's
/// address answers UNAVAILABLE, as a dead process does.
#[derive(Default)]
pub struct LocalConnector {
    nodes: RwLock<HashMap<String, Arc<LocalNode>>>,
}

impl LocalConnector {
    /// The node serving `address`, to call directly (e.g. for its Raft status).
    pub fn get(&self, address: &str) -> Option<Arc<LocalNode>> {
        self.nodes.read().get(address).cloned()
    }
}

impl Connector for LocalConnector {
    fn node(&self, address: &str) -> CallResult<Arc<dyn ShardNode>> {
        match self.get(address) {
            Some(n) => Ok(n),
            None => Err(ShardCallError::Unavailable {
                reason: format!("no shard node running at {address}"),
                retry_after: Duration::from_millis(100),
            }),
        }
    }
}

/// A shard node of the in-process cluster.
struct Member {
    address: String,
    cfg: ShardNodeConfig,
    running: Option<Running>,
}

struct Running {
    stop: oneshot::Sender<()>,
    served: tokio::task::JoinHandle<Result<()>>,
    node: Arc<shard_node::Node>,
}

/// A running in-process cluster; dropping it stops every server (the test's runtime ends
/// them anyway).
pub struct InProcCluster {
    pub dir: tempfile::TempDir,
    pub connector: Arc<LocalConnector>,
    /// The coordinator's gRPC address (the public API, over loopback).
    pub coordinator: String,
    /// The coordinator's `/metrics` URL. The process has one metrics recorder, so it shows
    /// every server of the cluster (metric names say which component counted).
    pub metrics: String,
    members: Vec<Member>,
    stops: Vec<oneshot::Sender<()>>,
}

/// Waits for a server's port file and returns its `grpc` and `metrics` addresses.
async fn port_file(path: &Path, timeout: Duration) -> Result<(String, String)> {
    let until = Instant::now() + timeout;
    loop {
        if let Ok(s) = std::fs::read_to_string(path)
            && let Ok(v) = serde_json::from_str::<serde_json::Value>(&s)
            && let (Some(a), Some(m)) = (v["grpc"].as_str(), v["metrics"].as_str())
        {
            return Ok((a.to_owned(), m.to_owned()));
        }
        if Instant::now() > until {
            bail!("{} not written within {timeout:?}", path.display());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

impl InProcCluster {
    /// Starts `shard_nodes` shard nodes configured by `shard` (listen address and data
    /// directory are set here), a model worker with the embedding model, and one coordinator.
    /// `RUST_LOG` set: every server's logs on stderr.
    pub async fn start(shard_nodes: usize, shard: ShardNodeConfig) -> Result<Self> {
        if let Ok(level) = std::env::var("RUST_LOG") {
            ragcluster_common::telemetry::init_logging(
                &ragcluster_common::config::TelemetryConfig {
                    log_level: level,
                    ..Default::default()
                },
            );
        }
        let dir = tempfile::Builder::new()
            .prefix("ragcluster-inproc-")
            .tempdir()?;
        let connector = Arc::new(LocalConnector::default());
        let mut members = Vec::new();
        for i in 0..shard_nodes {
            // A fixed port, so a restarted node keeps the address its Raft peers know.
            let port = crate::free_port()?;
            let mut cfg = shard.clone();
            cfg.listen = format!("127.0.0.1:{port}");
            cfg.data_dir = dir.path().join(format!("shard-{i}"));
            members.push(Member {
                address: format!("http://127.0.0.1:{port}"),
                cfg,
                running: None,
            });
        }
        let mut c = InProcCluster {
            dir,
            connector,
            coordinator: String::new(),
            metrics: String::new(),
            members,
            stops: Vec::new(),
        };
        for i in 0..shard_nodes {
            c.start_node(i).await?;
        }
        let model_worker = c.start_model_worker().await?;
        let (grpc, metrics) = c.start_coordinator(model_worker).await?;
        c.coordinator = format!("http://{grpc}");
        c.metrics = format!("http://{metrics}/metrics");
        Ok(c)
    }

    async fn start_model_worker(&mut self) -> Result<String> {
        let model = crate::embed_model()?;
        let port_file_path = self.dir.path().join("model-worker.port");
        let cfg = model_worker::ModelWorkerConfig {
            listen: "127.0.0.1:0".into(),
            models: vec![model_worker::config::ModelSpec::new(
                "all-MiniLM-L6-v2",
                "embed",
                model,
            )],
            port_file: Some(port_file_path.clone()),
            ..Default::default()
        };
        let (tx, rx) = oneshot::channel::<()>();
        self.stops.push(tx);
        tokio::spawn(async move {
            if let Err(e) = model_worker::run(cfg, "127.0.0.1:0", async {
                let _ = rx.await;
            })
            .await
            {
                eprintln!("in-process model worker: {e:#}");
            }
        });
        let (grpc, _) = port_file(&port_file_path, Duration::from_secs(60)).await?;
        Ok(format!("http://{grpc}"))
    }

    /// Starts the coordinator; its gRPC and metrics addresses.
    async fn start_coordinator(&mut self, model_worker: String) -> Result<(String, String)> {
        let port_file_path = self.dir.path().join("coordinator.port");
        let cfg = coordinator::CoordinatorConfig {
            listen: "127.0.0.1:0".into(),
            data_dir: self.dir.path().join("coordinator"),
            shard_nodes: self.members.iter().map(|m| m.address.clone()).collect(),
            model_worker,
            embedding_tokenizer: crate::embed_model()?.join("tokenizer.json"),
            port_file: Some(port_file_path.clone()),
            ..Default::default()
        };
        let (tx, rx) = oneshot::channel::<()>();
        self.stops.push(tx);
        let connector: Arc<dyn Connector> = self.connector.clone();
        tokio::spawn(async move {
            let stop = async {
                let _ = rx.await;
            };
            if let Err(e) = coordinator::run_with(cfg, "127.0.0.1:0", stop, Some(connector)).await {
                eprintln!("in-process coordinator: {e:#}");
            }
        });
        port_file(&port_file_path, Duration::from_secs(60)).await
    }

    /// Starts (or restarts, recovering from its data directory) shard node `i`.
    pub async fn start_node(&mut self, i: usize) -> Result<()> {
        let m = &mut self.members[i];
        if m.running.is_some() {
            bail!("shard node {i} is already running");
        }
        let (tx, rx) = oneshot::channel::<()>();
        let running = shard_node::start(m.cfg.clone(), "127.0.0.1:0", async {
            let _ = rx.await;
        })
        .await
        .with_context(|| format!("in-process shard node {i}"))?;
        let local = LocalNode::new(running.node.clone(), &m.cfg);
        self.connector
            .nodes
            .write()
            .insert(m.address.clone(), Arc::new(local));
        let served = running.served;
        m.running = Some(Running {
            stop: tx,
            served: tokio::spawn(async move { served.await? }),
            node: running.node,
        });
        Ok(())
    }

    /// Stops shard node `i` (its server drains, its replicas stop, its indexes flush) and
    /// waits until its RocksDB is closed, so it can start again in place.
    pub async fn stop_node(&mut self, i: usize) -> Result<()> {
        let m = &mut self.members[i];
        let r = m.running.take().context("shard node is not running")?;
        self.connector.nodes.write().remove(&m.address);
        let _ = r.stop.send(());
        r.served.await??;
        // Calls in flight and Raft streams may hold the node a moment longer; RocksDB closes
        // when the last one lets go.
        let until = Instant::now() + Duration::from_secs(10);
        while Arc::strong_count(&r.node) > 1 {
            if Instant::now() > until {
                bail!("shard node {i} is still referenced after it stopped");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        drop(r.node);
        Ok(())
    }

    /// Shard node `i`'s address, as the coordinator and the Raft peers know it.
    pub fn address(&self, i: usize) -> &str {
        &self.members[i].address
    }

    pub fn nodes(&self) -> usize {
        self.members.len()
    }

    pub async fn client(&self) -> Result<CoordinatorClient<Channel>> {
        crate::coordinator_client(&self.coordinator).await
    }

    /// Raft status of `shard` on node `i`, called in process; `None` when it is stopped or
    /// holds no replica.
    pub async fn raft_status(&self, i: usize, shard: &ShardRef) -> Option<RaftStatus> {
        let n = self.connector.get(self.address(i))?;
        n.shard_info(shard.clone(), Duration::from_secs(1))
            .await
            .ok()?
            .raft
    }
}

impl Drop for InProcCluster {
    fn drop(&mut self) {
        for m in &mut self.members {
            if let Some(r) = m.running.take() {
                let _ = r.stop.send(());
            }
        }
        for tx in self.stops.drain(..) {
            let _ = tx.send(());
        }
    }
}
