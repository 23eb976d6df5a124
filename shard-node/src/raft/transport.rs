//! How shard nodes reach each other (the `Dialer` of the shared Raft transport): one
//! client-streaming `Shard.Raft` call per peer node carries batches of every group's
//! messages; a snapshot goes on its own `Shard.InstallSnapshot` stream in 1 MiB chunks, so
//! HTTP/2 flow control paces it without holding up heartbeats.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use futures::{FutureExt, StreamExt};
use protobuf::Message as _;
use ragcluster_proto::v1::shard_client::ShardClient;
use ragcluster_proto::v1::{RaftBatch, RaftMessage, ShardRef, SnapshotChunk};
use ragcluster_raft::eraftpb::Message;
use ragcluster_raft::{Dialer, Envelope, Transport};
use tokio::sync::mpsc;

use super::machine::ShardResponse;
use super::snapshot;
use crate::storage::ShardKey;

pub type ShardTransport = Transport<ShardKey, ShardResponse>;

const SNAPSHOT_CHUNK: usize = 1 << 20;

pub fn shard_ref(key: &ShardKey) -> ShardRef {
    ShardRef {
        collection: key.collection.clone(),
        shard: key.shard,
    }
}

pub struct GrpcDialer {
    pub node_id: u64,
    pub snap_dir: PathBuf,
    /// Member certificate for `https://` peers.
    pub tls: Option<Arc<ragcluster_common::tls::Tls>>,
    /// Base deadline of one snapshot send (`snapshot_deadline`).
    pub snapshot_timeout: Duration,
}

impl GrpcDialer {
    pub(crate) async fn connect(
        tls: Option<Arc<ragcluster_common::tls::Tls>>,
        address: &str,
    ) -> Result<ShardClient<tonic::transport::Channel>, String> {
        let ch = ragcluster_common::tls::channel(address, tls.as_ref(), |ep| {
            ep.connect_timeout(Duration::from_millis(500))
                .tcp_nodelay(true)
                .http2_keep_alive_interval(Duration::from_secs(2))
                .keep_alive_timeout(Duration::from_secs(3))
        })
        .await
        .map_err(|e| e.to_string())?;
        Ok(ShardClient::new(ch)
            .max_encoding_message_size(64 << 20)
            .max_decoding_message_size(64 << 20))
    }
}

impl Dialer<ShardKey> for GrpcDialer {
    fn stream(
        &self,
        to: u64,
        address: String,
        batches: mpsc::Receiver<Vec<Envelope<ShardKey>>>,
    ) -> BoxFuture<'static, Result<(), String>> {
        let from = self.node_id;
        let tls = self.tls.clone();
        async move {
            let mut client = Self::connect(tls, &address)
                .await
                .inspect_err(|e| tracing::debug!(peer = to, error = %e, "raft peer unreachable"))?;
            let stream =
                tokio_stream::wrappers::ReceiverStream::new(batches).map(move |b| RaftBatch {
                    from_node_id: from,
                    messages: b
                        .into_iter()
                        .map(|(key, message)| RaftMessage {
                            shard: Some(shard_ref(&key)),
                            message,
                        })
                        .collect(),
                });
            client
                .raft(stream)
                .await
                .map(|_| ())
                .map_err(|e| e.to_string())
        }
        .boxed()
    }

    fn send_snapshot(
        &self,
        to: u64,
        address: String,
        key: ShardKey,
        msg: Message,
    ) -> Option<BoxFuture<'static, Result<u64, String>>> {
        let meta = msg.get_snapshot().get_metadata();
        let path = snapshot::generated_path(&self.snap_dir, &key, meta.index, meta.term);
        let (from, tls, base) = (self.node_id, self.tls.clone(), self.snapshot_timeout);
        Some(
            async move {
                let started = Instant::now();
                // A send that stalls (a peer that accepted the stream and stopped reading)
                // must end: until its outcome is reported, raft-rs sends that follower
                // nothing else, and it would stay behind for good.
                let size = tokio::fs::metadata(&path).await.map_or(0, |m| m.len());
                let limit = snapshot_deadline(base, size);
                let r = match tokio::time::timeout(
                    limit,
                    stream_snapshot(from, tls, &address, &key, msg, &path),
                )
                .await
                {
                    Ok(r) => r,
                    Err(_) => Err(format!(
                        "snapshot of {size} bytes not sent within {} s",
                        limit.as_secs()
                    )),
                };
                match &r {
                    Ok(bytes) => {
                        let secs = started.elapsed().as_secs_f64().max(1e-6);
                        metrics::counter!("raft_snapshots_sent_total").increment(1);
                        metrics::counter!("raft_snapshot_sent_bytes_total").increment(*bytes);
                        metrics::histogram!("raft_snapshot_send_seconds").record(secs);
                        tracing::info!(shard = %key, to, bytes, ms = (secs * 1e3) as u64,
                            mb_per_s = *bytes as f64 / secs / 1e6, "snapshot sent");
                    }
                    Err(e) => {
                        metrics::counter!("raft_snapshot_failures_total").increment(1);
                        tracing::warn!(shard = %key, to, error = %e, "snapshot send failed");
                    }
                }
                r
            }
            .boxed(),
        )
    }
}

/// How long sending a snapshot of `size` bytes may take: `base` plus 1 s per 4 MiB (a rate
/// far below the measured ~500 MB/s, so only a stalled send hits it).
fn snapshot_deadline(base: Duration, size: u64) -> Duration {
    base + Duration::from_secs(size / (4 << 20))
}

/// Whether the next outgoing snapshot stalls after its first message, never finishing
/// (failpoint `raft_snapshot_stall`, e.g. `1*return`): what a receiver that stops reading, or a
/// stream lost without a reset, looks like to the sender.
fn stall_snapshot() -> bool {
    fail::fail_point!("raft_snapshot_stall", |_| true);
    false
}

/// Whether to corrupt the next outgoing snapshot (failpoint `raft_snapshot_corrupt`, e.g.
/// `1*return` to corrupt one): the receiver must reject it and Raft send it again.
fn corrupt_snapshot() -> bool {
    fail::fail_point!("raft_snapshot_corrupt", |_| true);
    false
}

/// Streams the snapshot file at `path` with its Raft message to the peer.
async fn stream_snapshot(
    from: u64,
    tls: Option<Arc<ragcluster_common::tls::Tls>>,
    address: &str,
    key: &ShardKey,
    m: Message,
    path: &std::path::Path,
) -> Result<u64, String> {
    use tokio::io::AsyncReadExt;
    let to = m.to;
    if ragcluster_raft::transport::isolated(to) {
        return Err(format!("peer {to} is isolated (failpoint raft_isolate)"));
    }
    let mut client = GrpcDialer::connect(tls, address).await?;
    let mut file = tokio::fs::File::open(path)
        .await
        .map_err(|e| format!("{}: {e}", path.display()))?;
    let header = SnapshotChunk {
        from_node_id: from,
        message: Some(RaftMessage {
            shard: Some(shard_ref(key)),
            message: m.write_to_bytes().map_err(|e| e.to_string())?,
        }),
        data: Vec::new(),
    };
    let corrupt = corrupt_snapshot();
    let stall = stall_snapshot();
    let (tx, rx) = mpsc::channel::<SnapshotChunk>(4);
    let reader = tokio::spawn(async move {
        let mut total = 0u64;
        if tx.send(header).await.is_err() {
            return Ok::<u64, std::io::Error>(total);
        }
        if stall {
            tracing::warn!("snapshot send stalls (failpoint raft_snapshot_stall)");
            tx.closed().await;
            return Ok(total);
        }
        let mut first = true;
        loop {
            let mut buf = vec![0u8; SNAPSHOT_CHUNK];
            let n = file.read(&mut buf).await?;
            if n == 0 {
                break;
            }
            buf.truncate(n);
            if corrupt && first {
                buf[n / 2] ^= 0x5a;
            }
            first = false;
            total += n as u64;
            let chunk = SnapshotChunk {
                data: buf,
                ..Default::default()
            };
            if tx.send(chunk).await.is_err() {
                break;
            }
        }
        Ok(total)
    });
    client
        .install_snapshot(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .map_err(|e| e.to_string())?;
    reader
        .await
        .map_err(|e| e.to_string())?
        .map_err(|e| e.to_string())
}
