//! Structured logs (`tracing`) and the Prometheus endpoint. The exporter's own listener cannot
//! bind port 0 and report it, so `/metrics` is served here on a listener we bind ourselves.

use std::net::SocketAddr;

use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tracing_subscriber::EnvFilter;

use crate::config::TelemetryConfig;

/// Installs the global `tracing` subscriber (stderr, text or JSON).
pub fn init_logging(cfg: &TelemetryConfig) {
    let filter = EnvFilter::try_new(&cfg.log_level).unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        // Colours only for a terminal: launchers redirect stderr to log files.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()));
    let result = if cfg.log_format == "json" {
        builder.json().try_init()
    } else {
        builder.try_init()
    };
    // A second init (tests running several servers in one process) keeps the first subscriber.
    let _ = result;
}

/// The process's one recorder: several servers in one process (an in-process test cluster)
/// share it, so each `/metrics` shows the whole process.
static RECORDER: std::sync::Mutex<Option<PrometheusHandle>> = std::sync::Mutex::new(None);

/// Installs the global metrics recorder (once per process) and serves `GET /metrics` on
/// `listen`. Returns the bound address.
pub async fn serve_metrics(listen: &str) -> std::io::Result<SocketAddr> {
    let handle = {
        let mut installed = RECORDER.lock().unwrap_or_else(|e| e.into_inner());
        match &*installed {
            Some(h) => h.clone(),
            None => {
                let h = PrometheusBuilder::new()
                    .set_buckets(&[
                        0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                        0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                    ])
                    .map_err(std::io::Error::other)?
                    .install_recorder()
                    .map_err(std::io::Error::other)?;
                *installed = Some(h.clone());
                h
            }
        }
    };
    let listener = TcpListener::bind(listen).await?;
    let addr = listener.local_addr()?;
    tokio::spawn(metrics_loop(listener, handle));
    Ok(addr)
}

async fn metrics_loop(listener: TcpListener, handle: PrometheusHandle) {
    loop {
        let Ok((mut sock, _)) = listener.accept().await else {
            continue;
        };
        let handle = handle.clone();
        tokio::spawn(async move {
            let mut buf = [0u8; 2048];
            let n = match sock.read(&mut buf).await {
                Ok(n) => n,
                Err(_) => return,
            };
            let head = String::from_utf8_lossy(&buf[..n]);
            let (status, body) = if head.starts_with("GET /metrics") {
                handle.run_upkeep();
                ("200 OK", handle.render())
            } else {
                (
                    "404 Not Found",
                    "only GET /metrics is served here\n".to_string(),
                )
            };
            let resp = format!(
                "HTTP/1.1 {status}\r\ncontent-type: text/plain; version=0.0.4\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = sock.write_all(resp.as_bytes()).await;
            let _ = sock.shutdown().await;
        });
    }
}
