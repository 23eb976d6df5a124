//! A ragcluster model worker: loads the models named in config (`registry`) and serves them
//! over gRPC (`service`) and, optionally, an OpenAI-compatible HTTP API (`http`).
//! Encoder models (embeddings, cross-encoder and MaxSim reranking; `backend::encoder`) run on
//! a thread per model fed by a dynamic batcher (`batcher`). Generation (`backend::decoder`, a
//! llama GGUF on candle's quantized llama, or `remote`, an OpenAI-compatible server) streams
//! tokens with log-probabilities from a bounded set of decoding slots. This crate must not
//! depend on the coordinator or shard nodes.

pub mod backend;
pub mod batcher;
pub mod config;
pub mod error;
pub mod families;
pub mod http;
pub mod registry;
pub mod remote;
pub mod service;
pub mod tokenize;

use std::sync::Arc;

pub use config::ModelWorkerConfig;

use ragcluster_common::{server, telemetry};
use ragcluster_proto::v1::model_worker_server::ModelWorkerServer;

/// Loads every configured model (failing fast with the offending path), then serves until
/// `shutdown` resolves.
pub async fn run(
    cfg: ModelWorkerConfig,
    metrics_listen: &str,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let reg = {
        let cfg = cfg.clone();
        Arc::new(tokio::task::spawn_blocking(move || registry::Registry::load(&cfg)).await??)
    };
    let tls = ragcluster_common::tls::Tls::load(&cfg.tls)?;
    let metrics_addr = telemetry::serve_metrics(metrics_listen).await?;
    ragcluster_common::families::register(&crate::families::all());
    let (listener, addr) = server::bind(&cfg.listen).await?;
    // Both servers stop on the one shutdown signal.
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let mut http_addr = None;
    let mut http_task = None;
    if !cfg.http_listen.is_empty() {
        let (l, a) = server::bind(&cfg.http_listen).await?;
        http_addr = Some(a);
        let app = http::router(reg.clone());
        let mut stop = stop_rx.clone();
        let l = http::TlsListener(ragcluster_common::tls::Listener::new(l, tls.clone())?);
        http_task = Some(tokio::spawn(async move {
            axum::serve(l, app)
                .with_graceful_shutdown(async move {
                    let _ = stop.wait_for(|s| *s).await;
                })
                .await
        }));
    }
    if let Some(p) = &cfg.port_file {
        server::write_port_file_with(p, addr, metrics_addr, http_addr, cfg.tls.enabled())?;
    }
    tracing::info!(%addr, %metrics_addr, http = ?http_addr, models = cfg.models.len(),
                   tls = cfg.tls.enabled(), "model worker listening");
    let heartbeat = join(&cfg, addr, &reg, tls.clone())?;
    let (_reporter, router) = server::router(&["ragcluster.v1.ModelWorker"]).await;
    let incoming = ragcluster_common::tls::incoming(listener, tls);
    let grpc_shutdown = async move {
        shutdown.await;
        let _ = stop_tx.send(true);
    };
    router
        .add_service(
            ModelWorkerServer::new(service::ModelWorkerService::new(reg))
                .max_decoding_message_size(32 * 1024 * 1024)
                .max_encoding_message_size(32 * 1024 * 1024),
        )
        .serve_with_incoming_shutdown(incoming, grpc_shutdown)
        .await?;
    if let Some(h) = heartbeat {
        h.abort();
    }
    if let Some(t) = http_task {
        t.await??;
    }
    Ok(())
}

/// Registers with the coordinators (when configured) and heartbeats, under the node id kept in
/// `data_dir/node_id`, naming the models served.
fn join(
    cfg: &ModelWorkerConfig,
    bound: std::net::SocketAddr,
    reg: &registry::Registry,
    tls: Option<Arc<ragcluster_common::tls::Tls>>,
) -> anyhow::Result<Option<tokio::task::JoinHandle<()>>> {
    use ragcluster_common::membership as member;
    use ragcluster_proto::v1::{HeartbeatRequest, NodeKind};
    if cfg.coordinators.is_empty() {
        return Ok(None);
    }
    let address = if !cfg.advertise_address.is_empty() {
        cfg.advertise_address.clone()
    } else if bound.ip().is_unspecified() {
        anyhow::bail!("model_worker.advertise_address is needed when listening on {bound}");
    } else {
        let scheme = if cfg.tls.enabled() { "https" } else { "http" };
        format!("{scheme}://{bound}")
    };
    let node_id = member::node_id_file(&cfg.data_dir.join("node_id"))?;
    let models: Vec<String> = reg.models().into_iter().map(|m| m.name).collect();
    tracing::info!(node_id, %address, ?models, coordinators = ?cfg.coordinators,
                   "joining the cluster");
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get() as u32);
    let report = Arc::new(move || HeartbeatRequest {
        node_id,
        kind: NodeKind::ModelWorker as i32,
        address: address.clone(),
        models: models.clone(),
        cpus,
        disk_total_bytes: 0,
        disk_used_bytes: 0,
        disk_full: String::new(),
    });
    Ok(Some(member::spawn(
        member::Heartbeat {
            coordinators: cfg.coordinators.clone(),
            interval: cfg.heartbeat_interval,
            tls,
        },
        report,
        Arc::new(|_| {}),
    )))
}
