//! A ragcluster model worker: loads the models named in config and serves them over gRPC.
//! Embedding runs on a backend thread (`backend::cpu`, candle) fed by a bounded queue
//! (`batcher`) that merges concurrent requests into length-sorted batches. Generation
//! (`backend::llama`, a llama GGUF on candle's quantized llama) streams tokens with
//! log-probabilities from a bounded set of decoding slots. Reranking is declared in the
//! contract and answers UNIMPLEMENTED until it lands. This crate must not depend on the
//! coordinator or shard nodes.

pub mod backend;
pub mod batcher;
pub mod config;
pub mod error;
pub mod service;

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
    let svc = {
        let cfg = cfg.clone();
        tokio::task::spawn_blocking(move || service::ModelWorkerService::load(&cfg)).await??
    };
    let metrics_addr = telemetry::serve_metrics(metrics_listen).await?;
    let (listener, addr) = server::bind(&cfg.listen).await?;
    if let Some(p) = &cfg.port_file {
        server::write_port_file(p, addr, metrics_addr)?;
    }
    tracing::info!(%addr, %metrics_addr, models = cfg.models.len(), "model worker listening");
    let (_reporter, health, reflection) =
        server::health_and_reflection(&["ragcluster.v1.ModelWorker"]).await;
    let incoming = futures::stream::unfold(listener, |l| async move {
        let r = l.accept().await.map(|(s, _)| {
            let _ = s.set_nodelay(true);
            s
        });
        Some((r, l))
    });
    tonic::transport::Server::builder()
        .layer(server::GrpcMetricsLayer)
        .add_service(health)
        .add_service(reflection)
        .add_service(
            ModelWorkerServer::new(svc)
                .max_decoding_message_size(32 * 1024 * 1024)
                .max_encoding_message_size(32 * 1024 * 1024),
        )
        .serve_with_incoming_shutdown(incoming, shutdown)
        .await?;
    Ok(())
}
