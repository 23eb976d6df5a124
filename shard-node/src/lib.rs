//! A ragcluster shard node: hosts many shards of many collections. RocksDB (`storage`) is the
//! source of truth for chunks, documents and each shard's applied sequence number; every shard
//! also keeps a tantivy BM25 index (`index::bm25`) and an hnsw_rs graph (`index::hnsw`) that
//! are derived state, updated off the Raft thread (`index::worker`) and caught up or rebuilt
//! from RocksDB after a crash (`shard`). Every shard is a Raft group of the shared core
//! (`ragcluster_raft`); `raft` holds what is the shard's own (state machine, replica handle,
//! transport dialer, snapshot files). `service` maps the internal `ragcluster.v1.Shard` gRPC
//! service onto `node::Node`, converting the wire types in `service::convert`. `space` is what
//! the node does when its disk (or a peer's) is full.
//! This crate must not depend on the coordinator or the model worker.

pub mod checksum;
pub mod config;
pub mod error;
pub mod families;
pub mod index;
pub mod membership;
pub mod node;
pub mod raft;
pub mod service;
pub mod shard;
pub mod space;
pub mod storage;
#[cfg(test)]
pub(crate) mod testutil;

pub use config::ShardNodeConfig;
pub use node::Node;

use std::sync::Arc;

use ragcluster_common::{server, telemetry};
use ragcluster_proto::v1::shard_server::ShardServer;

use std::time::{Duration, Instant};

/// Kept for flushing the indexes at the end of a bounded shutdown.
const FLUSH_RESERVE: Duration = Duration::from_secs(2);

/// A started shard node: recovered, serving gRPC on `addr` and `/metrics` on `metrics_addr`.
pub struct Running {
    pub node: Arc<Node>,
    pub addr: std::net::SocketAddr,
    pub metrics_addr: std::net::SocketAddr,
    /// Ends when the server has drained after `shutdown` and the indexes are flushed.
    pub served: tokio::task::JoinHandle<anyhow::Result<()>>,
}

/// Sizes and names rayon's global pool, on which hnsw_rs runs its parallel inserts
/// (`index_threads`; 0: one per core). Call it once at process start, before anything uses
/// the pool.
pub fn init_index_threads(cfg: &ShardNodeConfig) -> anyhow::Result<()> {
    rayon::ThreadPoolBuilder::new()
        .num_threads(cfg.index_threads)
        .thread_name(|i| format!("hnsw-insert-{i}"))
        .build_global()?;
    Ok(())
}

/// Runs a shard node until `shutdown` resolves: opens (and recovers) every shard, serves gRPC
/// and `/metrics`, then flushes the indexes on the way out.
pub async fn run(
    cfg: ShardNodeConfig,
    metrics_listen: &str,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let limit = cfg.shutdown_timeout;
    let bounded = async move {
        shutdown.await;
        server::exit_after(limit);
    };
    start(cfg, metrics_listen, bounded).await?.served.await?
}

/// Opens every shard, binds the ports and serves in a task until `shutdown` resolves. The
/// returned node is what an in-process cluster (tests) calls directly.
pub async fn start(
    cfg: ShardNodeConfig,
    metrics_listen: &str,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> anyhow::Result<Running> {
    // The recorder first: recovery elects leaders, and those are events too.
    let metrics_addr = telemetry::serve_metrics(metrics_listen).await?;
    start_sharing_metrics(cfg, metrics_addr, shutdown).await
}

/// As `start`, in a process that already serves `/metrics` at `metrics_addr` (a coordinator
/// hosting this node): the node's families join that endpoint.
pub async fn start_sharing_metrics(
    cfg: ShardNodeConfig,
    metrics_addr: std::net::SocketAddr,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> anyhow::Result<Running> {
    let started = std::time::Instant::now();
    let tls = ragcluster_common::tls::Tls::load(&cfg.tls)?;
    ragcluster_common::families::register(&crate::families::all());
    let node = {
        let cfg = cfg.clone();
        let rt = tokio::runtime::Handle::current();
        let tls = tls.clone();
        tokio::task::spawn_blocking(move || Node::open(cfg, rt, tls)).await??
    };
    let node = Arc::new(node);
    tracing::info!(
        shards = node.shard_count(),
        recovery_ms = started.elapsed().as_millis() as u64,
        "shard node recovered"
    );
    let reaper = spawn_reaper(node.clone());
    let handoff = spawn_disk_handoff(node.clone(), cfg.raft_tick * cfg.raft_election_ticks as u32);
    let scrubber = spawn_scrub(&node, &cfg)?;
    let follower = {
        let node = node.clone();
        raft::graph_follow::spawn(
            move || node.replicas(),
            tls.clone(),
            cfg.hnsw_follow_leader_graph,
        )
    };
    let (listener, addr) = server::bind(&cfg.listen).await?;
    if let Some(p) = &cfg.port_file {
        server::write_port_file(p, addr, metrics_addr, cfg.tls.enabled())?;
    }
    tracing::info!(%addr, %metrics_addr, data_dir = %cfg.data_dir.display(),
                   tls = cfg.tls.enabled(), "shard node listening");
    let heartbeat = membership::spawn(&cfg, addr, &node, tls.clone())?;
    let services: &[&str] = if cfg!(feature = "failpoints") {
        &["ragcluster.v1.Shard", "ragcluster.v1.Failpoints"]
    } else {
        &["ragcluster.v1.Shard"]
    };
    let (reporter, router) = server::router(services).await;
    let svc = ShardServer::new(service::ShardService::new(node.clone(), &cfg))
        .max_decoding_message_size(64 * 1024 * 1024)
        .max_encoding_message_size(64 * 1024 * 1024);
    let router = router.add_service(svc);
    #[cfg(feature = "failpoints")]
    let router = router.add_service(
        ragcluster_proto::v1::failpoints_server::FailpointsServer::new(
            service::failpoints::FailpointService,
        ),
    );
    let limit = cfg.shutdown_timeout;
    let served = {
        let node = node.clone();
        tokio::spawn(async move {
            let (drain_tx, drain_rx) = tokio::sync::oneshot::channel::<Instant>();
            let closing = close(node.clone(), shutdown, limit, drain_tx);
            let serve = router.serve_with_incoming_shutdown(
                ragcluster_common::tls::incoming(listener, tls),
                closing,
            );
            // Calls still running when only the flush reserve of the limit is left are cut off.
            let served = tokio::select! {
                r = serve => r,
                () = async {
                    let Ok(signalled) = drain_rx.await else {
                        return std::future::pending().await;
                    };
                    let drain = limit.saturating_sub(FLUSH_RESERVE).max(Duration::from_secs(1));
                    tokio::time::sleep_until((signalled + drain).into()).await;
                } => {
                    tracing::warn!(limit = ?limit, "calls still running; stopping anyway");
                    Ok(())
                }
            };
            drop(reporter);
            reaper.abort();
            handoff.abort();
            follower.abort();
            if let Some(h) = heartbeat {
                h.abort();
            }
            served?;
            tracing::info!("grpc drained; flushing indexes");
            tokio::task::spawn_blocking(move || {
                drop(scrubber);
                node.flush()
            })
            .await??;
            Ok(())
        })
    };
    Ok(Running {
        node,
        addr,
        metrics_addr,
        served,
    })
}

/// Every second: drop replicas that applied their own removal; every 10 s: index sizes and
/// RocksDB figures for /metrics. Aborted when the server stops.
fn spawn_reaper(node: Arc<Node>) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        for round in 0u64.. {
            tick.tick().await;
            let n = node.clone();
            let _ = tokio::task::spawn_blocking(move || {
                n.reap_removed();
                if round % 10 == 0 {
                    n.export_metrics();
                }
            })
            .await;
        }
    })
}

/// While this node's disk is full: every second, the leaderships it holds go to voters with
/// room (a full node refuses writes; its peers refuse to take leadership while theirs is
/// full too, and the next try picks another). Aborted when the server stops.
fn spawn_disk_handoff(node: Arc<Node>, election: Duration) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut full = node.space().guard.watch();
        loop {
            if full.wait_for(Option::is_some).await.is_err() {
                return;
            }
            let (held, moved) = node.hand_off_leaderships(election * 2).await;
            if held > 0 {
                tracing::info!(held, moved, "disk full: leaderships handed off");
                metrics::counter!("shard_disk_full_handoffs_total").increment(moved as u64);
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    })
}

/// The background scrub of the node's RocksDB (`storage::scrub`), unless turned off.
fn spawn_scrub(
    node: &Arc<Node>,
    cfg: &ShardNodeConfig,
) -> std::io::Result<Option<crate::storage::scrub::Scrubber>> {
    if cfg.scrub_interval.is_zero() {
        return Ok(None);
    }
    let (keys, hit) = (node.clone(), node.clone());
    crate::storage::scrub::Scrubber::spawn(
        node.store_handle(),
        cfg.scrub_interval,
        cfg.scrub_bytes_per_sec,
        move || {
            keys.replicas()
                .iter()
                .map(|r| r.shard.key.clone())
                .collect()
        },
        move |d| hit.take_out_damaged(d),
    )
    .map(Some)
}

/// After `shutdown`: leaderships first (while this node still serves Raft, the other replicas
/// take over at once instead of after an election timeout), then the node closes its Raft
/// streams and the server drains; `drain` learns when the signal came.
async fn close(
    node: Arc<Node>,
    shutdown: impl std::future::Future<Output = ()>,
    limit: Duration,
    drain: tokio::sync::oneshot::Sender<Instant>,
) {
    shutdown.await;
    let signalled = Instant::now();
    let (held, moved) = node.hand_off_leaderships(limit / 3).await;
    tracing::info!(
        held,
        moved,
        took_ms = signalled.elapsed().as_millis() as u64,
        "leaderships handed off"
    );
    node.begin_close();
    let _ = drain.send(signalled);
}
