//! The composition root: builds the catalog, the clients and the components from the config,
//! and serves them until shutdown.

use std::sync::Arc;

use ragcluster_common::{server, telemetry};
use ragcluster_proto::v1::admin_server::AdminServer;
use ragcluster_proto::v1::catalog_peer_server::CatalogPeerServer;
use ragcluster_proto::v1::coordinator_server::CoordinatorServer;
use ragcluster_proto::v1::membership_server::MembershipServer;

use crate::auth::Auth;
use crate::catalog::{Catalog, CatalogOptions};
use crate::channels::Channels;
use crate::chunking::{HfTokens, Tokens};
use crate::collections::Collections;
use crate::config::CoordinatorConfig;
use crate::flow::run::Services;
use crate::flow::{AskOptions, Engine, Flows};
use crate::handles::Handles;
use crate::ingest::Ingestor;
use crate::membership::{Membership, MembershipOptions};
use crate::models::{EmbedOptions, Models};
use crate::rebalance::Rebalancer;
use crate::reembed::Reembedder;
use crate::search::Searcher;
use crate::service::forward::Forwarder;
use crate::service::{AdminService, CatalogPeerService, CoordinatorService, MembershipService};
use crate::shards::local::ColocatedConnector;
use crate::shards::{Connector, GrpcConnector, ShardNode, Shards};

/// Serves the Coordinator and Admin services until `shutdown` resolves, reaching shard nodes
/// over gRPC.
pub async fn run(
    cfg: CoordinatorConfig,
    metrics_listen: &str,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    run_with(cfg, metrics_listen, shutdown, None).await
}

/// As `run`, reaching shard nodes through `connector` when given (a test's in-process nodes).
pub async fn run_with(
    cfg: CoordinatorConfig,
    metrics_listen: &str,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    connector: Option<Arc<dyn Connector>>,
) -> anyhow::Result<()> {
    // The recorder first: the catalog's first election is an event too.
    let metrics_addr = telemetry::serve_metrics(metrics_listen).await?;
    let access = match connector {
        Some(c) => ShardAccess::Given(c),
        None => ShardAccess::Grpc,
    };
    serve(cfg, metrics_addr, shutdown, access).await
}

/// As `run`, with the shard node at `address` running in this process and called through
/// `local` (the `colocated` binary); `/metrics` is already served at `metrics_addr`.
pub async fn run_colocated(
    mut cfg: CoordinatorConfig,
    metrics_addr: std::net::SocketAddr,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    address: String,
    local: Arc<dyn ShardNode>,
) -> anyhow::Result<()> {
    if !cfg.shard_nodes.contains(&address) {
        cfg.shard_nodes.push(address.clone());
    }
    serve(
        cfg,
        metrics_addr,
        shutdown,
        ShardAccess::Colocated { address, local },
    )
    .await
}

/// How this coordinator reaches shard nodes.
enum ShardAccess {
    Grpc,
    /// Over gRPC, except the node at `address`, which runs in this process.
    Colocated {
        address: String,
        local: Arc<dyn ShardNode>,
    },
    /// A caller's connector (tests).
    Given(Arc<dyn Connector>),
}

async fn serve(
    cfg: CoordinatorConfig,
    metrics_addr: std::net::SocketAddr,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    access: ShardAccess,
) -> anyhow::Result<()> {
    let tls = ragcluster_common::tls::Tls::load(&cfg.tls)?;
    ragcluster_common::families::register(&crate::families::all());
    let channels = Arc::new(Channels::new(tls.clone()));
    let catalog_opts = CatalogOptions {
        node_id: cfg.node_id,
        members: cfg.catalog_members().map_err(anyhow::Error::msg)?,
        data_dir: cfg.data_dir.clone(),
        tick: cfg.raft_tick,
        election_ticks: cfg.raft_election_ticks,
        heartbeat_ticks: cfg.raft_heartbeat_ticks,
        log_gc_threshold: cfg.raft_log_gc_threshold,
        disk: ragcluster_common::disk::DiskPolicy {
            min_free: cfg.disk_min_free_bytes,
            reserve: cfg.disk_reserve_bytes,
            interval: cfg.disk_check_interval,
        },
    };
    let catalog = Arc::new(Catalog::open(
        &catalog_opts,
        &tokio::runtime::Handle::current(),
        tls.as_ref(),
    )?);
    let grpc = || -> Arc<dyn Connector> {
        Arc::new(GrpcConnector::new(channels.clone(), cfg.shard_read_streams))
    };
    let connector: Arc<dyn Connector> = match access {
        ShardAccess::Grpc => grpc(),
        ShardAccess::Colocated { address, local } => {
            Arc::new(ColocatedConnector::new(address, local, grpc()))
        }
        ShardAccess::Given(c) => c,
    };
    let (coordinator, admin) = services(&cfg, catalog.clone(), channels, connector)?;
    admin.membership.spawn();
    let members = MembershipService {
        membership: admin.membership.clone(),
        catalog: catalog.clone(),
        forward: admin.forward.clone(),
        tls: tls.clone(),
    };
    let peer = CatalogPeerService {
        catalog: catalog.clone(),
        tls: tls.clone(),
    };
    let (listener, addr) = server::bind(&cfg.listen).await?;
    // The guard removes the socket file when serving ends.
    let (unix, _unix_file) = match &cfg.unix_socket {
        Some(p) => {
            let (l, f) = server::bind_unix(p, cfg.unix_socket_mode)
                .map_err(|e| anyhow::anyhow!("coordinator.unix_socket {}: {e}", p.display()))?;
            (Some(l), Some(f))
        }
        None => (None, None),
    };
    if let Some(p) = &cfg.port_file {
        let serves_tls = tls.as_ref().is_some_and(|t| t.serves());
        server::write_port_file(p, addr, metrics_addr, serves_tls)?;
    }
    tracing::info!(%addr, %metrics_addr, unix_socket = ?cfg.unix_socket,
                   shard_nodes = cfg.shard_nodes.len(),
                   tls = cfg.tls.enabled(), auth = cfg.auth.enabled, "coordinator listening");
    let (_reporter, router) = server::router(&[
        "ragcluster.v1.Coordinator",
        "ragcluster.v1.Admin",
        "ragcluster.v1.CatalogPeer",
        "ragcluster.v1.Membership",
    ])
    .await;
    let incoming = ragcluster_common::tls::incoming_with_unix(listener, tls, unix);
    router
        .add_service(
            CoordinatorServer::new(coordinator)
                .max_decoding_message_size(cfg.limits.max_request_bytes)
                .max_encoding_message_size(64 * 1024 * 1024),
        )
        .add_service(
            // RestoreDocuments carries backed-up documents with their vectors.
            AdminServer::new(admin)
                .max_decoding_message_size(crate::limits::MAX_RESTORE_BYTES)
                .max_encoding_message_size(64 * 1024 * 1024),
        )
        .add_service(CatalogPeerServer::new(peer).max_decoding_message_size(64 * 1024 * 1024))
        .add_service(MembershipServer::new(members).max_decoding_message_size(1024 * 1024))
        .serve_with_incoming_shutdown(incoming, shutdown)
        .await?;
    catalog.stop();
    Ok(())
}

/// The components and the two public services over them.
fn services(
    cfg: &CoordinatorConfig,
    catalog: Arc<Catalog>,
    channels: Arc<Channels>,
    connector: Arc<dyn Connector>,
) -> anyhow::Result<(CoordinatorService, AdminService)> {
    let embed = EmbedOptions {
        batch: cfg.embed_batch,
        concurrency: cfg.embed_concurrency,
        timeout: cfg.embed_timeout,
        cache_bytes: cfg.embed_cache_bytes,
    };
    let limits = &cfg.limits;
    let h = Arc::new(Handles {
        catalog: catalog.clone(),
        shards: Arc::new(Shards::new(connector)),
        models: Arc::new(Models::new(
            cfg.model_worker.clone(),
            channels.clone(),
            embed,
        )),
        auth: Arc::new(Auth::new(
            &cfg.auth,
            limits.max_concurrent_requests,
            limits.max_concurrent_requests_per_key,
        )?),
    });
    // Revisions (the embedding cache's keys) and batch limits of the workers' models.
    h.models.spawn_meta_refresh();
    let membership = Membership::new(
        catalog.clone(),
        h.shards.clone(),
        h.models.clone(),
        channels.clone(),
        MembershipOptions {
            interval: cfg.heartbeat_interval,
            down_after: cfg.down_after,
            shard_seeds: cfg.shard_nodes.clone(),
        },
    );
    let tokens: Arc<dyn Tokens> = Arc::new(HfTokens::load(&cfg.embedding_tokenizer)?);
    let flows = Flows::load(cfg.flows_file.as_deref()).map_err(anyhow::Error::msg)?;
    tracing::info!(collections = catalog.list().len(), "catalog loaded");
    tracing::info!(flows = flows.set.flows.len(), default = %flows.set.default, "flows loaded");
    let searcher = Arc::new(Searcher::new(
        catalog.clone(),
        h.shards.clone(),
        h.models.clone(),
    ));
    let collections = Arc::new(Collections::new(
        catalog.clone(),
        h.shards.clone(),
        h.models.clone(),
        membership.clone(),
    ));
    let documents = Arc::new(crate::documents::Documents::new(
        catalog.clone(),
        h.shards.clone(),
        cfg.search_timeout,
        limits.max_batch_documents,
    ));
    let ingestor = Arc::new(Ingestor::new(
        catalog.clone(),
        h.shards.clone(),
        h.models.clone(),
        tokens.clone(),
        cfg.write_timeout,
        limits.max_batch_documents,
    ));
    let engine = Engine {
        flows,
        catalog: catalog.clone(),
        services: Arc::new(Services {
            searcher: searcher.clone(),
            shards: h.shards.clone(),
            models: h.models.clone(),
            tokens,
        }),
        opts: AskOptions {
            timeout: cfg.ask_timeout,
            max_generated_tokens: cfg.ask_max_generated_tokens,
            max_branches: cfg.ask_max_branches,
            max_iterations: cfg.ask_max_iterations,
        },
    };
    let forward = Arc::new(Forwarder::new(channels.clone()));
    let coordinator = CoordinatorService {
        handles: h.clone(),
        collections: collections.clone(),
        ingestor: ingestor.clone(),
        searcher,
        documents,
        engine: Arc::new(engine),
        forward: forward.clone(),
        search_timeout: cfg.search_timeout,
        max_top_k: limits.max_top_k,
    };
    drop(catalog.spawn_disk_handoff());
    let rebalancer = Arc::new(Rebalancer::new(
        catalog,
        h.shards.clone(),
        membership.clone(),
    ));
    // Dropped with the server's runtime.
    drop(crate::rebalance::repair::spawn_repairs(rebalancer.clone()));
    let admin = AdminService {
        reembedder: Reembedder::arc(&h, &collections, &ingestor, cfg.write_timeout),
        handles: h,
        collections,
        ingestor,
        rebalancer,
        forward,
        channels,
        membership,
        shard_nodes: cfg.shard_nodes.clone(),
    };
    Ok((coordinator, admin))
}
