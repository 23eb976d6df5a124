//! The gRPC server shell every process uses: a pre-bound listener (port 0 works, the bound
//! address is reported through an optional port file), `grpc.health.v1`, server reflection,
//! request count/latency metrics per RPC, and graceful shutdown on SIGINT/SIGTERM.

use std::net::SocketAddr;
use std::path::Path;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Instant;

use tokio::net::TcpListener;
use tower::{Layer, Service};

/// Resolves when the process receives SIGINT or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(_) => {
                    let _ = ctrl_c.await;
                    return;
                }
            };
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = ctrl_c.await;
    }
    tracing::info!("shutdown signal received, draining");
}

/// Bounds a shutdown: once called (after the signal), the process exits with status 1 if it is
/// still running `limit` later, whatever it is waiting for. Binaries call it; an in-process
/// server (tests) must not.
pub fn exit_after(limit: std::time::Duration) {
    std::thread::spawn(move || {
        std::thread::sleep(limit);
        tracing::error!(
            limit_ms = limit.as_millis() as u64,
            "shutdown took too long; exiting"
        );
        std::process::exit(1);
    });
}

/// Binds the gRPC listener.
pub async fn bind(listen: &str) -> std::io::Result<(TcpListener, SocketAddr)> {
    let l = TcpListener::bind(listen).await?;
    let a = l.local_addr()?;
    Ok((l, a))
}

/// Binds a Unix socket at `path` for clients on the same host, its file given the permission
/// bits `mode` (connecting takes write permission). A socket file left by a process that is
/// gone (nothing accepts on it) is replaced; one a live server accepts on, or any other file,
/// is an error. The file is removed when the returned guard drops.
pub fn bind_unix(
    path: &Path,
    mode: u32,
) -> std::io::Result<(tokio::net::UnixListener, UnixSocketFile)> {
    use std::os::unix::fs::{FileTypeExt, PermissionsExt};
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        let in_use = || {
            std::io::Error::new(
                std::io::ErrorKind::AddrInUse,
                format!("{}: a server already listens there", path.display()),
            )
        };
        if !meta.file_type().is_socket() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::AlreadyExists,
                format!("{}: exists and is not a socket", path.display()),
            ));
        }
        if std::os::unix::net::UnixStream::connect(path).is_ok() {
            return Err(in_use());
        }
        std::fs::remove_file(path)?;
    }
    let l = tokio::net::UnixListener::bind(path)?;
    let file = UnixSocketFile(path.to_owned());
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))?;
    Ok((l, file))
}

/// Removes a bound Unix socket's file when dropped (at shutdown).
pub struct UnixSocketFile(std::path::PathBuf);

impl Drop for UnixSocketFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Writes `{"grpc": "...", "metrics": "...", "tls": bool}` atomically, so launchers and tests
/// learn the ports (and scheme) of a process started with port 0 without sleeping or parsing
/// logs.
pub fn write_port_file(
    path: &Path,
    grpc: SocketAddr,
    metrics: SocketAddr,
    tls: bool,
) -> std::io::Result<()> {
    write_port_file_with(path, grpc, metrics, None, tls)
}

/// `write_port_file` plus an `"http"` address for processes that also serve HTTP.
pub fn write_port_file_with(
    path: &Path,
    grpc: SocketAddr,
    metrics: SocketAddr,
    http: Option<SocketAddr>,
    tls: bool,
) -> std::io::Result<()> {
    let tmp = path.with_extension("tmp");
    let http = http
        .map(|h| format!(",\"http\":\"{h}\""))
        .unwrap_or_default();
    std::fs::write(
        &tmp,
        format!(
            "{{\"grpc\":\"{grpc}\",\"metrics\":\"{metrics}\"{http},\"tls\":{tls},\"pid\":{}}}\n",
            std::process::id()
        ),
    )?;
    std::fs::rename(tmp, path)
}

/// Reflection of a port lists only `services` and the health service; v1 and v1alpha are both
/// served (grpcurl and PyPI's grpcio-reflection still speak v1alpha).
fn reflection_builder(services: &[&str]) -> tonic_reflection::server::Builder<'static> {
    let mut b = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(ragcluster_proto::v1::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .with_service_name("grpc.health.v1.Health")
        .with_service_name("grpc.reflection.v1.ServerReflection")
        .with_service_name("grpc.reflection.v1alpha.ServerReflection");
    for s in services {
        b = b.with_service_name(*s);
    }
    b
}

/// The router every process starts from: per-RPC metrics, the health service (`services` and
/// the whole process SERVING) and reflection (v1 and v1alpha) listing exactly `services`. The
/// caller adds its own services; the reporter keeps health SERVING while it lives.
pub async fn router(
    services: &[&str],
) -> (
    tonic_health::server::HealthReporter,
    tonic::transport::server::Router<
        tower::layer::util::Stack<GrpcMetricsLayer, tower::layer::util::Identity>,
    >,
) {
    let (reporter, health) = tonic_health::server::health_reporter();
    for name in services {
        reporter
            .set_service_status(*name, tonic_health::ServingStatus::Serving)
            .await;
    }
    reporter
        .set_service_status("", tonic_health::ServingStatus::Serving)
        .await;
    let v1 = reflection_builder(services)
        .build_v1()
        .expect("embedded descriptor sets are valid");
    let v1alpha = reflection_builder(services)
        .build_v1alpha()
        .expect("embedded descriptor sets are valid");
    let router = tonic::transport::Server::builder()
        .layer(GrpcMetricsLayer)
        .add_service(health)
        .add_service(v1)
        .add_service(v1alpha);
    (reporter, router)
}

/// Tower layer that counts requests and records latency per gRPC method and status code:
/// `grpc_server_requests_total{service,method,code}` and
/// `grpc_server_request_duration_seconds{service,method}`.
#[derive(Clone, Default)]
pub struct GrpcMetricsLayer;

impl<S> Layer<S> for GrpcMetricsLayer {
    type Service = GrpcMetrics<S>;
    fn layer(&self, inner: S) -> Self::Service {
        GrpcMetrics { inner }
    }
}

#[derive(Clone)]
pub struct GrpcMetrics<S> {
    inner: S,
}

type BoxFuture<T> = Pin<Box<dyn std::future::Future<Output = T> + Send + 'static>>;

impl<S, B, RB> Service<http::Request<B>> for GrpcMetrics<S>
where
    S: Service<http::Request<B>, Response = http::Response<RB>> + Send,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    RB: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = BoxFuture<Result<S::Response, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let path = req.uri().path().to_owned();
        let start = Instant::now();
        let fut = self.inner.call(req);
        Box::pin(async move {
            let res = fut.await;
            let (service, method) = split_path(&path);
            let code = match &res {
                // Errors travel in trailers-only responses, i.e. in the headers; OK statuses
                // arrive in the trailers, so a missing header means OK.
                Ok(r) => r
                    .headers()
                    .get("grpc-status")
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or("0")
                    .to_owned(),
                Err(_) => "transport".to_owned(),
            };
            metrics::counter!("grpc_server_requests_total",
                "service" => service.clone(), "method" => method.clone(), "code" => code)
            .increment(1);
            metrics::histogram!("grpc_server_request_duration_seconds",
                "service" => service, "method" => method)
            .record(start.elapsed().as_secs_f64());
            res
        })
    }
}

/// The deadline a caller set with `grpc-timeout` (e.g. "250m"), so a coordinator can pass
/// what is left of it on to shard nodes and model workers.
pub fn grpc_timeout(md: &tonic::metadata::MetadataMap) -> Option<std::time::Duration> {
    let v = md.get("grpc-timeout")?.to_str().ok()?;
    if v.len() < 2 || v.len() > 9 {
        return None;
    }
    let (n, unit) = v.split_at(v.len() - 1);
    let n: u64 = n.parse().ok()?;
    use std::time::Duration;
    Some(match unit {
        "H" => Duration::from_secs(n.saturating_mul(3600)),
        "M" => Duration::from_secs(n.saturating_mul(60)),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

fn split_path(path: &str) -> (String, String) {
    let mut it = path.trim_start_matches('/').splitn(2, '/');
    let service = it.next().unwrap_or_default().to_owned();
    let method = it.next().unwrap_or_default().to_owned();
    (service, method)
}

#[cfg(test)]
mod tests {
    #[test]
    fn parses_grpc_timeouts() {
        let mut md = tonic::metadata::MetadataMap::new();
        assert_eq!(super::grpc_timeout(&md), None);
        md.insert("grpc-timeout", "250m".parse().unwrap());
        assert_eq!(
            super::grpc_timeout(&md),
            Some(std::time::Duration::from_millis(250))
        );
        md.insert("grpc-timeout", "2S".parse().unwrap());
        assert_eq!(
            super::grpc_timeout(&md),
            Some(std::time::Duration::from_secs(2))
        );
        md.insert("grpc-timeout", "xS".parse().unwrap());
        assert_eq!(super::grpc_timeout(&md), None);
    }

    /// A server on a TCP port and a Unix socket answers on the socket through a `unix:`
    /// address; a second bind of a live socket is refused, a stale socket file is replaced,
    /// any other file is left alone.
    #[tokio::test]
    async fn serves_a_unix_socket_beside_tcp() {
        use tonic_health::pb::HealthCheckRequest;
        use tonic_health::pb::health_client::HealthClient;
        let dir = std::env::temp_dir().join(format!("rc-unix-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("grpc.sock");
        let (unix, guard) = super::bind_unix(&path, 0o600).unwrap();
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(&path).unwrap().permissions().mode();
            assert_eq!(mode & 0o777, 0o600, "the socket file's permission bits");
        }
        let (tcp, _) = super::bind("127.0.0.1:0").await.unwrap();
        let (_reporter, router) = super::router(&[]).await;
        let incoming = crate::tls::incoming_with_unix(tcp, None, Some(unix));
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(router.serve_with_incoming_shutdown(incoming, async {
            let _ = stopped.await;
        }));
        for addr in [
            format!("unix:{}", path.display()),
            format!("unix://{}", path.display()),
        ] {
            let ch = crate::tls::channel(&addr, None, |e| e).await.unwrap();
            let r = HealthClient::new(ch)
                .check(HealthCheckRequest::default())
                .await
                .unwrap();
            assert_eq!(r.into_inner().status, 1, "SERVING over {addr}");
        }
        let again = super::bind_unix(&path, 0o600).err().expect("a live socket");
        assert_eq!(again.kind(), std::io::ErrorKind::AddrInUse);
        let _ = stop.send(());
        server.await.unwrap().unwrap();
        drop(guard);
        assert!(!path.exists(), "the guard removes the socket file");
        // A socket file nothing accepts on (its process is gone) is replaced.
        drop(std::os::unix::net::UnixListener::bind(&path).unwrap());
        assert!(path.exists());
        let (_l, _g) = super::bind_unix(&path, 0o660).unwrap();
        let other = dir.join("not-a-socket");
        std::fs::write(&other, b"x").unwrap();
        assert!(super::bind_unix(&other, 0o660).is_err());
        assert_eq!(std::fs::read(&other).unwrap(), b"x");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn splits_grpc_paths() {
        assert_eq!(
            super::split_path("/ragcluster.v1.Shard/WriteBatch"),
            ("ragcluster.v1.Shard".into(), "WriteBatch".into())
        );
    }
}
