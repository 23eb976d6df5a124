//! The ragcluster coordinator: the public gRPC API. It owns the collection catalog, replicated
//! among coordinators with raft-rs (`catalog`), static shard placement (`placement`), chunking (`chunking`), ingest through the
//! model worker to shard nodes (`ingest`), and distributed hybrid search with the seeds'
//! fusion formulas (`search`, `fusion`), and answers questions with RAG flows (`flow`). It
//! talks to shard nodes and model workers only over
//! gRPC (`fanout`), never through their crates. `ragctl` (the CLI) lives here too.

pub mod auth;
pub mod catalog;
pub mod chunking;
pub mod collections;
pub mod config;
pub mod error;
pub mod eval;
pub mod fanout;
pub mod flow;
pub mod fusion;
pub mod fuzzing;
pub mod ingest;
pub mod placement;
pub mod rebalance;
pub mod routing;
pub mod search;
pub mod service;

use std::sync::Arc;

pub use config::CoordinatorConfig;
use ragcluster_common::{server, telemetry};
use ragcluster_proto::v1::admin_server::AdminServer;
use ragcluster_proto::v1::catalog_peer_server::CatalogPeerServer;
use ragcluster_proto::v1::coordinator_server::CoordinatorServer;

/// Shared state behind every RPC.
pub struct State {
    pub cfg: CoordinatorConfig,
    pub catalog: catalog::Catalog,
    pub clients: fanout::Clients,
    pub routing: routing::Routing,
    /// Raft id of each shard node, by address (asked once with Shard.NodeInfo).
    pub node_ids: parking_lot::Mutex<std::collections::HashMap<String, u64>>,
    pub tokens: Arc<dyn chunking::Tokens>,
    /// Serialises collection creates and drops on the catalog leader, so two creates of one
    /// name cannot both open (and drop each other's) shards.
    pub catalog_changes: tokio::sync::Mutex<()>,
    /// Validated flows for Ask.
    pub flows: flow::Flows,
    /// API keys, roles and admission (`auth`).
    pub auth: auth::Auth,
    /// This coordinator's certificates, when TLS is on.
    pub tls: Option<Arc<ragcluster_common::tls::Tls>>,
}

impl State {
    pub fn open(cfg: CoordinatorConfig) -> anyhow::Result<Self> {
        let tls = ragcluster_common::tls::Tls::load(&cfg.tls)?;
        let catalog =
            catalog::Catalog::open(&cfg, &tokio::runtime::Handle::current(), tls.as_ref())?;
        let tokens: Arc<dyn chunking::Tokens> =
            Arc::new(chunking::HfTokens::load(&cfg.embedding_tokenizer)?);
        let clients = fanout::Clients::new(cfg.model_worker.clone(), tls.clone());
        let auth = auth::Auth::new(
            &cfg.auth,
            cfg.limits.max_concurrent_requests,
            cfg.limits.max_concurrent_requests_per_key,
        )?;
        let flows = flow::Flows::load(cfg.flows_file.as_deref()).map_err(anyhow::Error::msg)?;
        Ok(Self {
            flows,
            cfg,
            catalog,
            clients,
            routing: Default::default(),
            node_ids: Default::default(),
            tokens,
            catalog_changes: Default::default(),
            auth,
            tls,
        })
    }
}

/// Serves the Coordinator and Admin services until `shutdown` resolves.
pub async fn run(
    cfg: CoordinatorConfig,
    metrics_listen: &str,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let state = Arc::new(State::open(cfg.clone())?);
    tracing::info!(collections = state.catalog.list().len(), "catalog loaded");
    tracing::info!(
        flows = state.flows.set.flows.len(),
        default = %state.flows.set.default,
        "flows loaded"
    );
    let metrics_addr = telemetry::serve_metrics(metrics_listen).await?;
    let (listener, addr) = server::bind(&cfg.listen).await?;
    if let Some(p) = &cfg.port_file {
        server::write_port_file(
            p,
            addr,
            metrics_addr,
            state.tls.as_ref().is_some_and(|t| t.serves()),
        )?;
    }
    tracing::info!(%addr, %metrics_addr, shard_nodes = cfg.shard_nodes.len(),
                   tls = cfg.tls.enabled(), auth = cfg.auth.enabled, "coordinator listening");
    let (_reporter, health, reflection) = server::health_and_reflection(&[
        "ragcluster.v1.Coordinator",
        "ragcluster.v1.Admin",
        "ragcluster.v1.CatalogPeer",
    ])
    .await;
    let incoming = ragcluster_common::tls::incoming(listener, state.tls.clone());
    tonic::transport::Server::builder()
        .layer(server::GrpcMetricsLayer)
        .add_service(health)
        .add_service(reflection)
        .add_service(
            CoordinatorServer::new(service::CoordinatorService(state.clone()))
                .max_decoding_message_size(cfg.limits.max_request_bytes)
                .max_encoding_message_size(64 * 1024 * 1024),
        )
        .add_service(
            AdminServer::new(service::AdminService(state.clone()))
                .max_decoding_message_size(1024 * 1024),
        )
        .add_service(
            CatalogPeerServer::new(catalog::CatalogPeerService(state.clone()))
                .max_decoding_message_size(64 * 1024 * 1024),
        )
        .serve_with_incoming_shutdown(incoming, shutdown)
        .await?;
    state.catalog.stop();
    Ok(())
}
