//! TLS for every gRPC port, with rustls: certificates from PEM files (a Kubernetes secret
//! mount), reloaded when the files change so that rotating a secret needs no restart, and
//! mutual TLS between cluster members. A caller's certificate is a *member* certificate when
//! it chains to `ca_file`; internal services (Shard, ModelWorker, CatalogPeer) accept only
//! members, client-facing ones take API keys instead (see the coordinator's `auth`).
//!
//! Servers accept connections through [`incoming`], which runs every handshake in its own
//! task under a timeout (a slow or plaintext client never stalls the accept loop). Clients dial
//! `https://` addresses through [`lazy_channel`], whose connector reads the current client
//! configuration on every (re)connect, so reloaded certificates reach new connections too.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, Weak};
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime};

use hyper_util::rt::TokioIo;
use parking_lot::RwLock;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream, UnixListener, UnixStream};
use tonic::transport::{Channel, Endpoint, Uri};

/// How long a TLS handshake may take before the connection is dropped.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("tls: cannot read {path}: {source}")]
    Read { path: PathBuf, source: io::Error },
    #[error("tls: {path}: {reason}")]
    Pem { path: PathBuf, reason: String },
    #[error("tls: {0}")]
    Config(String),
    #[error(
        "{0} is an https:// address but this process has no TLS client configuration \
         (set tls.ca_file)"
    )]
    NoClientTls(String),
    #[error("invalid address {0}: {1}")]
    Address(String, String),
    #[error("cannot connect to {0}: {1}")]
    Connect(String, String),
}

/// Whether callers must present a member certificate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ClientAuth {
    /// Every caller must present a certificate that chains to `ca_file` (internal services).
    Required,
    /// Callers may present one (cluster members do); others authenticate with API keys.
    Optional,
}

/// `[<process>.tls]`: TLS is on when `cert_file` is set.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TlsConfig {
    /// PEM certificate chain this process presents, as a server and as a client of other
    /// members (so it needs both serverAuth and clientAuth usages).
    pub cert_file: Option<PathBuf>,
    /// PEM private key of `cert_file` (PKCS#8, PKCS#1 or SEC1).
    pub key_file: Option<PathBuf>,
    /// PEM CA bundle of the cluster: verifies the servers this process dials and the member
    /// certificates callers present.
    pub ca_file: Option<PathBuf>,
    /// "required" (shard nodes, model workers) or "optional" (coordinator: clients come with
    /// API keys, peers with member certificates).
    pub client_auth: ClientAuth,
    /// How often the three files are checked for changes; a changed set is loaded for new
    /// connections (a set that fails to load is logged and the previous one kept).
    #[serde(with = "humantime_serde")]
    pub reload_interval: Duration,
}

impl TlsConfig {
    pub fn with_client_auth(client_auth: ClientAuth) -> Self {
        Self {
            cert_file: None,
            key_file: None,
            ca_file: None,
            client_auth,
            reload_interval: Duration::from_secs(10),
        }
    }

    pub fn enabled(&self) -> bool {
        self.cert_file.is_some()
    }

    /// Checks that the fields make sense together (files are read by [`Tls::load`]).
    pub fn validate(&self, section: &str) -> Result<(), String> {
        match (&self.cert_file, &self.key_file, &self.ca_file) {
            (None, None, None) => Ok(()),
            (Some(_), Some(_), Some(_)) => {
                if self.reload_interval.is_zero() {
                    return Err(format!("{section}.tls.reload_interval must be positive"));
                }
                Ok(())
            }
            (None, None, Some(_)) => Ok(()),
            _ => Err(format!(
                "{section}.tls: set cert_file, key_file and ca_file together (TLS is mutual \
                 between members)"
            )),
        }
    }
}

impl Default for TlsConfig {
    fn default() -> Self {
        Self::with_client_auth(ClientAuth::Required)
    }
}

fn read(path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read {
        path: path.to_owned(),
        source,
    })
}

fn certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let pem = read(path)?;
    let certs = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| TlsError::Pem {
            path: path.to_owned(),
            reason: e.to_string(),
        })?;
    if certs.is_empty() {
        return Err(TlsError::Pem {
            path: path.to_owned(),
            reason: "no CERTIFICATE block".into(),
        });
    }
    Ok(certs)
}

fn key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    let pem = read(path)?;
    PrivateKeyDer::from_pem_slice(&pem).map_err(|e| TlsError::Pem {
        path: path.to_owned(),
        reason: e.to_string(),
    })
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn cfg_err(e: impl std::fmt::Display) -> TlsError {
    TlsError::Config(e.to_string())
}

/// Loaded server and client configurations, replaced whole on reload.
#[derive(Clone)]
struct Loaded {
    server: Option<Arc<ServerConfig>>,
    client: Arc<ClientConfig>,
    stamp: Vec<Option<SystemTime>>,
}

/// One process's TLS material: what its servers present and how it dials others.
pub struct Tls {
    cfg: TlsConfig,
    loaded: RwLock<Loaded>,
}

impl Tls {
    /// Loads the files; `None` when the section configures neither a certificate nor a CA.
    /// Starts the reload watcher (it stops when the returned value is dropped).
    pub fn load(cfg: &TlsConfig) -> Result<Option<Arc<Self>>, TlsError> {
        if cfg.cert_file.is_none() && cfg.ca_file.is_none() {
            return Ok(None);
        }
        let loaded = Self::build(cfg)?;
        let tls = Arc::new(Self {
            cfg: cfg.clone(),
            loaded: RwLock::new(loaded),
        });
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(watch(Arc::downgrade(&tls), cfg.reload_interval));
        }
        Ok(Some(tls))
    }

    fn files(cfg: &TlsConfig) -> Vec<&PathBuf> {
        [&cfg.cert_file, &cfg.key_file, &cfg.ca_file]
            .into_iter()
            .flatten()
            .collect()
    }

    fn stamp(cfg: &TlsConfig) -> Vec<Option<SystemTime>> {
        Self::files(cfg)
            .into_iter()
            .map(|p| std::fs::metadata(p).and_then(|m| m.modified()).ok())
            .collect()
    }

    fn build(cfg: &TlsConfig) -> Result<Loaded, TlsError> {
        let stamp = Self::stamp(cfg);
        let mut roots = RootCertStore::empty();
        if let Some(ca) = &cfg.ca_file {
            for c in certs(ca)? {
                roots.add(c).map_err(|e| TlsError::Pem {
                    path: ca.clone(),
                    reason: e.to_string(),
                })?;
            }
        }
        let roots = Arc::new(roots);
        let identity = match (&cfg.cert_file, &cfg.key_file) {
            (Some(c), Some(k)) => Some((certs(c)?, key(k)?)),
            _ => None,
        };
        let client = ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(cfg_err)?
            .with_root_certificates(roots.clone());
        let mut client = match &identity {
            Some((c, k)) => client
                .with_client_auth_cert(c.clone(), k.clone_key())
                .map_err(cfg_err)?,
            None => client.with_no_client_auth(),
        };
        client.alpn_protocols = vec![b"h2".to_vec()];
        let server = match identity {
            None => None,
            Some((c, k)) => {
                let verifier = WebPkiClientVerifier::builder_with_provider(roots, provider());
                let verifier = match cfg.client_auth {
                    ClientAuth::Required => verifier.build(),
                    ClientAuth::Optional => verifier.allow_unauthenticated().build(),
                }
                .map_err(cfg_err)?;
                let mut s = ServerConfig::builder_with_provider(provider())
                    .with_safe_default_protocol_versions()
                    .map_err(cfg_err)?
                    .with_client_cert_verifier(verifier)
                    .with_single_cert(c, k)
                    .map_err(cfg_err)?;
                s.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
                Some(Arc::new(s))
            }
        };
        Ok(Loaded {
            server,
            client: Arc::new(client),
            stamp,
        })
    }

    /// Reloads when any file changed since the last load. Returns whether it reloaded.
    pub fn reload_if_changed(&self) -> Result<bool, TlsError> {
        if Self::stamp(&self.cfg) == self.loaded.read().stamp {
            return Ok(false);
        }
        let fresh = Self::build(&self.cfg)?;
        *self.loaded.write() = fresh;
        Ok(true)
    }

    /// Whether this process serves TLS (it has a certificate).
    pub fn serves(&self) -> bool {
        self.loaded.read().server.is_some()
    }

    fn server_config(&self) -> Option<Arc<ServerConfig>> {
        self.loaded.read().server.clone()
    }

    fn client_config(&self) -> Arc<ClientConfig> {
        self.loaded.read().client.clone()
    }
}

async fn watch(tls: Weak<Tls>, every: Duration) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    loop {
        tick.tick().await;
        let Some(t) = tls.upgrade() else { return };
        match t.reload_if_changed() {
            Ok(false) => {}
            Ok(true) => {
                tracing::info!("tls certificates reloaded");
                metrics::counter!("tls_reloads_total", "result" => "ok").increment(1);
            }
            Err(e) => {
                tracing::warn!(error = %e, "tls reload failed; keeping the previous certificates");
                metrics::counter!("tls_reloads_total", "result" => "error").increment(1);
            }
        }
    }
}

/// What the server knows of the peer of a connection; tonic puts it in every request's
/// extensions (see [`peer`]).
#[derive(Debug, Clone, Default)]
pub struct PeerInfo {
    pub remote: Option<SocketAddr>,
    /// The peer presented a certificate that chains to the cluster CA (rustls verified it
    /// during the handshake; an invalid one fails the handshake).
    pub member: bool,
}

/// The peer of the connection a request came on.
pub fn peer(ext: &http::Extensions) -> PeerInfo {
    ext.get::<PeerInfo>().cloned().unwrap_or_default()
}

/// A server-side connection, plaintext or TLS over TCP, or a Unix socket's (a client on the
/// same host: no TLS, the socket file's permissions decide who may connect).
pub enum ServerConn {
    Plain(TcpStream),
    Tls(Box<tokio_rustls::server::TlsStream<TcpStream>>),
    Unix(UnixStream),
}

impl tonic::transport::server::Connected for ServerConn {
    type ConnectInfo = PeerInfo;

    fn connect_info(&self) -> PeerInfo {
        match self {
            Self::Plain(s) => PeerInfo {
                remote: s.peer_addr().ok(),
                member: false,
            },
            Self::Tls(s) => {
                let (tcp, session) = s.get_ref();
                PeerInfo {
                    remote: tcp.peer_addr().ok(),
                    member: session.peer_certificates().is_some_and(|c| !c.is_empty()),
                }
            }
            // No certificate: never a member, so internal services stay behind mutual TLS.
            Self::Unix(_) => PeerInfo::default(),
        }
    }
}

impl AsyncRead for ServerConn {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Self::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Self::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
            Self::Unix(s) => Pin::new(s).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for ServerConn {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Self::Plain(s) => Pin::new(s).poll_write(cx, buf),
            Self::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
            Self::Unix(s) => Pin::new(s).poll_write(cx, buf),
        }
    }
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Self::Plain(s) => Pin::new(s).poll_flush(cx),
            Self::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
            Self::Unix(s) => Pin::new(s).poll_flush(cx),
        }
    }
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Self::Plain(s) => Pin::new(s).poll_shutdown(cx),
            Self::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
            Self::Unix(s) => Pin::new(s).poll_shutdown(cx),
        }
    }
    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Self::Plain(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            Self::Tls(s) => Pin::new(s.as_mut()).poll_write_vectored(cx, bufs),
            Self::Unix(s) => Pin::new(s).poll_write_vectored(cx, bufs),
        }
    }
    fn is_write_vectored(&self) -> bool {
        match self {
            Self::Plain(s) => s.is_write_vectored(),
            Self::Tls(s) => s.is_write_vectored(),
            Self::Unix(s) => s.is_write_vectored(),
        }
    }
}

/// Accepted connections of `listener`, after the TLS handshake when `tls` serves TLS.
/// Handshakes run concurrently, each under a timeout; failures (a plaintext client, an
/// untrusted or missing client certificate) are counted in `tls_handshake_failures_total` and
/// logged at debug level, and never reach the server.
pub fn incoming(
    listener: TcpListener,
    tls: Option<Arc<Tls>>,
) -> tokio_stream::wrappers::ReceiverStream<io::Result<ServerConn>> {
    incoming_with_unix(listener, tls, None)
}

/// [`incoming`], plus the connections of `unix` (a Unix socket for clients on the same host:
/// no TCP stack or TLS on their path) when given.
pub fn incoming_with_unix(
    listener: TcpListener,
    tls: Option<Arc<Tls>>,
    unix: Option<UnixListener>,
) -> tokio_stream::wrappers::ReceiverStream<io::Result<ServerConn>> {
    let (tx, rx) = tokio::sync::mpsc::channel(256);
    if let Some(unix) = unix {
        let tx = tx.clone();
        tokio::spawn(async move {
            loop {
                let accepted = tokio::select! {
                    _ = tx.closed() => return,
                    r = unix.accept() => r,
                };
                match accepted {
                    Ok((s, _)) => {
                        if tx.send(Ok(ServerConn::Unix(s))).await.is_err() {
                            return;
                        }
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "unix socket accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                }
            }
        });
    }
    tokio::spawn(async move {
        loop {
            let accepted = tokio::select! {
                _ = tx.closed() => return,
                r = listener.accept() => r,
            };
            let (tcp, remote) = match accepted {
                Ok(a) => a,
                Err(e) => {
                    // Out of file descriptors and the like: back off instead of spinning.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            let _ = tcp.set_nodelay(true);
            let Some(server) = tls.as_ref().and_then(|t| t.server_config()) else {
                if tx.send(Ok(ServerConn::Plain(tcp))).await.is_err() {
                    return;
                }
                continue;
            };
            let tx = tx.clone();
            tokio::spawn(async move {
                let acceptor = tokio_rustls::TlsAcceptor::from(server);
                match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                    Ok(Ok(s)) => {
                        let _ = tx.send(Ok(ServerConn::Tls(Box::new(s)))).await;
                    }
                    Ok(Err(e)) => {
                        tracing::debug!(%remote, error = %e, "tls handshake failed");
                        metrics::counter!("tls_handshake_failures_total").increment(1);
                    }
                    Err(_) => {
                        tracing::debug!(%remote, "tls handshake timed out");
                        metrics::counter!("tls_handshake_failures_total").increment(1);
                    }
                }
            });
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(rx)
}

/// [`incoming`] one connection at a time, for servers other than tonic (the model worker's
/// HTTP API).
pub struct Listener {
    rx: tokio_stream::wrappers::ReceiverStream<io::Result<ServerConn>>,
    local: SocketAddr,
}

impl Listener {
    pub fn new(listener: TcpListener, tls: Option<Arc<Tls>>) -> io::Result<Self> {
        let local = listener.local_addr()?;
        Ok(Self {
            rx: incoming(listener, tls),
            local,
        })
    }

    /// The next connection, or `None` once the accept loop has ended.
    pub async fn next(&mut self) -> Option<(ServerConn, SocketAddr)> {
        use tokio_stream::StreamExt;
        loop {
            match self.rx.next().await? {
                Ok(c) => {
                    let remote = match &c {
                        ServerConn::Plain(s) => s.peer_addr(),
                        ServerConn::Tls(s) => s.get_ref().0.peer_addr(),
                        ServerConn::Unix(_) => Ok(self.local),
                    };
                    return Some((c, remote.unwrap_or(self.local)));
                }
                Err(_) => continue,
            }
        }
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }
}

/// Dials TLS with the process's current client configuration; the server name (checked
/// against the certificate's SANs) is the address's host, a DNS name or an IP.
#[derive(Clone)]
pub struct Connector {
    tls: Arc<Tls>,
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send + 'static>>;

impl tower::Service<Uri> for Connector {
    type Response = TokioIo<tokio_rustls::client::TlsStream<TcpStream>>;
    type Error = io::Error;
    type Future = BoxFuture<io::Result<Self::Response>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let cfg = self.tls.client_config();
        Box::pin(async move {
            let bad = |m: &str| io::Error::new(io::ErrorKind::InvalidInput, m.to_owned());
            let host = uri
                .host()
                .ok_or_else(|| bad("address has no host"))?
                .trim_start_matches('[')
                .trim_end_matches(']')
                .to_owned();
            let port = uri.port_u16().unwrap_or(443);
            let tcp = TcpStream::connect((host.as_str(), port)).await?;
            let _ = tcp.set_nodelay(true);
            let name = ServerName::try_from(host).map_err(|e| bad(&e.to_string()))?;
            let s = tokio_rustls::TlsConnector::from(cfg)
                .connect(name, tcp)
                .await?;
            Ok(TokioIo::new(s))
        })
    }
}

/// The socket path of a `unix:` address (gRPC's naming: `unix:/run/rag.sock`,
/// `unix:///run/rag.sock`, or a relative `unix:rag.sock`), `None` for any other address.
pub fn unix_path(addr: &str) -> Option<&Path> {
    let rest = addr.strip_prefix("unix:")?;
    Some(Path::new(rest.strip_prefix("//").unwrap_or(rest)))
}

/// Dials a Unix socket (a server on the same host), whatever the URI.
#[derive(Clone)]
struct UnixConnector(Arc<PathBuf>);

impl tower::Service<Uri> for UnixConnector {
    type Response = TokioIo<UnixStream>;
    type Error = io::Error;
    type Future = BoxFuture<io::Result<Self::Response>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _uri: Uri) -> Self::Future {
        let path = self.0.clone();
        Box::pin(async move { Ok(TokioIo::new(UnixStream::connect(&*path).await?)) })
    }
}

/// The endpoint and connector of a `unix:` address: the URI only fills the :authority header.
fn unix_endpoint(path: &Path) -> (Endpoint, UnixConnector) {
    (
        Endpoint::from_static("http://localhost"),
        UnixConnector(Arc::new(path.to_owned())),
    )
}

/// A lazily connected channel to `addr`: `https://` dials TLS with `tls` (an error without
/// one), `http://` plaintext, `unix:PATH` a Unix socket (plaintext; the server is on this
/// host). `configure` sets timeouts and the like on the endpoint.
pub fn lazy_channel(
    addr: &str,
    tls: Option<&Arc<Tls>>,
    configure: impl FnOnce(Endpoint) -> Endpoint,
) -> Result<Channel, TlsError> {
    let bad = |e: &dyn std::fmt::Display| TlsError::Address(addr.to_owned(), e.to_string());
    if let Some(path) = unix_path(addr) {
        let (ep, connector) = unix_endpoint(path);
        Ok(configure(ep).connect_with_connector_lazy(connector))
    } else if let Some(rest) = addr.strip_prefix("https://") {
        let tls = tls.ok_or_else(|| TlsError::NoClientTls(addr.to_owned()))?;
        // tonic would insist on its own TLS for an https URI; the connector does it instead.
        let ep = Endpoint::from_shared(format!("http://{rest}")).map_err(|e| bad(&e))?;
        Ok(configure(ep).connect_with_connector_lazy(Connector { tls: tls.clone() }))
    } else {
        let ep = Endpoint::from_shared(addr.to_owned()).map_err(|e| bad(&e))?;
        Ok(configure(ep).connect_lazy())
    }
}

/// [`lazy_channel`], connected now (errors surface here rather than on the first call).
pub async fn channel(
    addr: &str,
    tls: Option<&Arc<Tls>>,
    configure: impl FnOnce(Endpoint) -> Endpoint,
) -> Result<Channel, TlsError> {
    let bad = |e: &dyn std::fmt::Display| TlsError::Address(addr.to_owned(), e.to_string());
    let conn = |e: tonic::transport::Error| {
        use std::error::Error;
        let mut msg = e.to_string();
        let mut src = e.source();
        while let Some(s) = src {
            msg = format!("{msg}: {s}");
            src = s.source();
        }
        TlsError::Connect(addr.to_owned(), msg)
    };
    if let Some(path) = unix_path(addr) {
        let (ep, connector) = unix_endpoint(path);
        configure(ep)
            .connect_with_connector(connector)
            .await
            .map_err(conn)
    } else if let Some(rest) = addr.strip_prefix("https://") {
        let tls = tls.ok_or_else(|| TlsError::NoClientTls(addr.to_owned()))?;
        let ep = Endpoint::from_shared(format!("http://{rest}")).map_err(|e| bad(&e))?;
        configure(ep)
            .connect_with_connector(Connector { tls: tls.clone() })
            .await
            .map_err(conn)
    } else {
        let ep = Endpoint::from_shared(addr.to_owned()).map_err(|e| bad(&e))?;
        configure(ep).connect().await.map_err(conn)
    }
}

/// Checks that every address agrees with whether TLS is on: a member with a certificate
/// dials `https://`, one without dials `http://`.
pub fn check_scheme(section: &str, field: &str, addr: &str, tls: &TlsConfig) -> Result<(), String> {
    let https = addr.starts_with("https://");
    if https && tls.ca_file.is_none() {
        return Err(format!(
            "{section}.{field}: {addr} is https:// but {section}.tls.ca_file is not set"
        ));
    }
    if !https && tls.enabled() {
        return Err(format!(
            "{section}.{field}: {addr} must be https:// when {section}.tls is enabled \
             (members speak mutual TLS)"
        ));
    }
    Ok(())
}
