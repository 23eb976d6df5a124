//! Node-to-node Raft transport. Outgoing: one task per peer node keeps a client-streaming
//! `Shard.Raft` call open and feeds it batches of whatever messages (of any group) are queued
//! for that peer; when the stream breaks it reports the peer unreachable to every local group
//! and reconnects with exponential backoff (100 ms .. 2 s). Queues are bounded and drop on
//! overflow: Raft resends what matters. Snapshots go on their own `InstallSnapshot` stream in
//! 1 MiB chunks, so HTTP/2 flow control paces them without holding up heartbeats.
//! Incoming messages are routed to the group's mailbox by shard; unknown groups are ignored.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use parking_lot::RwLock;
use protobuf::Message as _;
use raft::eraftpb::Message;
use ragcluster_proto::v1::shard_client::ShardClient;
use ragcluster_proto::v1::{RaftBatch, RaftMessage, ShardRef, SnapshotChunk};
use tokio::sync::mpsc;

use super::group::GroupMsg;
use crate::storage::{ShardKey, Store};

pub type Router = Arc<RwLock<HashMap<ShardKey, std::sync::mpsc::Sender<GroupMsg>>>>;

const QUEUE: usize = 16_384;
const MAX_BATCH: usize = 512;
const SNAPSHOT_CHUNK: usize = 1 << 20;

/// Test hooks (`Shard.SetFaults`).
#[derive(Default)]
pub struct Faults {
    pub isolated: RwLock<HashSet<u64>>,
    pub corrupt_snapshots: AtomicU32,
}

pub struct Transport {
    node_id: u64,
    handle: tokio::runtime::Handle,
    addresses: RwLock<HashMap<u64, String>>,
    peers: RwLock<HashMap<u64, mpsc::Sender<RaftMessage>>>,
    router: Router,
    store: Arc<Store>,
    snap_dir: PathBuf,
    pub faults: Faults,
    /// Member certificate for `https://` peers.
    tls: Option<Arc<ragcluster_common::tls::Tls>>,
}

fn shard_ref(key: &ShardKey) -> ShardRef {
    ShardRef {
        collection: key.collection.clone(),
        shard: key.shard,
    }
}

impl Transport {
    pub fn new(
        node_id: u64,
        handle: tokio::runtime::Handle,
        router: Router,
        store: Arc<Store>,
        snap_dir: PathBuf,
        tls: Option<Arc<ragcluster_common::tls::Tls>>,
    ) -> crate::error::Result<Arc<Self>> {
        let addresses = store.peers()?.into_iter().collect();
        Ok(Arc::new(Self {
            node_id,
            handle,
            addresses: RwLock::new(addresses),
            peers: RwLock::new(HashMap::new()),
            router,
            store,
            snap_dir,
            faults: Faults::default(),
            tls,
        }))
    }

    pub fn node_id(&self) -> u64 {
        self.node_id
    }

    pub fn snap_dir(&self) -> &Path {
        &self.snap_dir
    }

    pub fn address(&self, id: u64) -> Option<String> {
        self.addresses.read().get(&id).cloned()
    }

    /// Records a peer's address (from OpenShard or a conf change) and persists the table.
    pub fn learn_peer(&self, id: u64, address: String) {
        if id == self.node_id || address.is_empty() {
            return;
        }
        let mut g = self.addresses.write();
        if g.get(&id) == Some(&address) {
            return;
        }
        g.insert(id, address);
        let list: Vec<(u64, String)> = g.iter().map(|(k, v)| (*k, v.clone())).collect();
        drop(g);
        if let Err(e) = self.store.put_peers(&list) {
            tracing::warn!(error = %e, "could not persist peer table");
        }
    }

    fn isolated(&self, id: u64) -> bool {
        let f = self.faults.isolated.read();
        !f.is_empty() && f.contains(&id)
    }

    /// Queues a message for its peer; drops it when the peer is cut off or its queue is full.
    pub fn send(self: &Arc<Self>, key: &ShardKey, m: Message) {
        let to = m.to;
        if self.isolated(to) {
            return;
        }
        let Ok(bytes) = m.write_to_bytes() else {
            return;
        };
        let msg = RaftMessage {
            shard: Some(shard_ref(key)),
            message: bytes,
        };
        if self.peer(to).try_send(msg).is_err() {
            metrics::counter!("raft_messages_dropped_total").increment(1);
        }
    }

    fn peer(self: &Arc<Self>, to: u64) -> mpsc::Sender<RaftMessage> {
        if let Some(tx) = self.peers.read().get(&to) {
            return tx.clone();
        }
        let mut g = self.peers.write();
        g.entry(to)
            .or_insert_with(|| {
                let (tx, rx) = mpsc::channel(QUEUE);
                let this = self.clone();
                self.handle
                    .spawn(async move { this.peer_loop(to, rx).await });
                tx
            })
            .clone()
    }

    /// Tells every local group that `peer` could not be reached.
    fn report_unreachable(&self, peer: u64) {
        for tx in self.router.read().values() {
            let _ = tx.send(GroupMsg::Unreachable(peer));
        }
    }

    async fn connect(&self, to: u64) -> Option<ShardClient<tonic::transport::Channel>> {
        let addr = self.address(to)?;
        let ch = ragcluster_common::tls::channel(&addr, self.tls.as_ref(), |ep| {
            ep.connect_timeout(Duration::from_millis(500))
                .tcp_nodelay(true)
                .http2_keep_alive_interval(Duration::from_secs(2))
                .keep_alive_timeout(Duration::from_secs(3))
        })
        .await
        .inspect_err(|e| tracing::debug!(peer = to, error = %e, "raft peer unreachable"))
        .ok()?;
        Some(
            ShardClient::new(ch)
                .max_encoding_message_size(64 << 20)
                .max_decoding_message_size(64 << 20),
        )
    }

    async fn peer_loop(self: Arc<Self>, to: u64, mut rx: mpsc::Receiver<RaftMessage>) {
        let mut backoff = Duration::from_millis(100);
        loop {
            let Some(mut client) = self.connect(to).await else {
                self.report_unreachable(to);
                // Drop what queued up meanwhile: Raft resends from its own state.
                while rx.try_recv().is_ok() {}
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(2));
                continue;
            };
            let (btx, brx) = mpsc::channel::<RaftBatch>(64);
            let mut call = tokio::spawn(async move {
                client
                    .raft(tokio_stream::wrappers::ReceiverStream::new(brx))
                    .await
            });
            let connected = Instant::now();
            loop {
                tokio::select! {
                    m = rx.recv() => {
                        let Some(m) = m else {
                            call.abort();
                            return;
                        };
                        let mut messages = vec![m];
                        while messages.len() < MAX_BATCH {
                            match rx.try_recv() {
                                Ok(m) => messages.push(m),
                                Err(_) => break,
                            }
                        }
                        let batch = RaftBatch { from_node_id: self.node_id, messages };
                        if btx.send(batch).await.is_err() {
                            break;
                        }
                    }
                    r = &mut call => {
                        tracing::debug!(peer = to, result = ?r.map(|x| x.map(|_| ())), "raft stream ended");
                        break;
                    }
                }
            }
            call.abort();
            self.report_unreachable(to);
            if connected.elapsed() > Duration::from_secs(5) {
                backoff = Duration::from_millis(100);
            }
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_secs(2));
        }
    }

    /// Streams the snapshot file at `path` with its raft message to the peer, then reports
    /// the outcome to the group (raft-rs retries after a failure).
    pub fn send_snapshot(self: &Arc<Self>, key: &ShardKey, m: Message, path: PathBuf) {
        let this = self.clone();
        let key = key.clone();
        self.handle.spawn(async move {
            let to = m.to;
            let started = Instant::now();
            let r = this.stream_snapshot(&key, m, &path).await;
            let ok = r.is_ok();
            match r {
                Ok(bytes) => {
                    let secs = started.elapsed().as_secs_f64().max(1e-6);
                    metrics::counter!("raft_snapshots_sent_total").increment(1);
                    metrics::counter!("raft_snapshot_sent_bytes_total").increment(bytes);
                    metrics::histogram!("raft_snapshot_send_seconds").record(secs);
                    tracing::info!(shard = %key, to, bytes, ms = (secs * 1e3) as u64,
                        mb_per_s = bytes as f64 / secs / 1e6, "snapshot sent");
                }
                Err(e) => {
                    metrics::counter!("raft_snapshot_failures_total").increment(1);
                    tracing::warn!(shard = %key, to, error = %e, "snapshot send failed");
                }
            }
            if let Some(tx) = this.router.read().get(&key) {
                let _ = tx.send(GroupMsg::SnapshotStatus { to, ok });
            }
        });
    }

    async fn stream_snapshot(
        &self,
        key: &ShardKey,
        m: Message,
        path: &Path,
    ) -> anyhow::Result<u64> {
        use tokio::io::AsyncReadExt;
        let to = m.to;
        if self.isolated(to) {
            anyhow::bail!("peer {to} is isolated (fault injection)");
        }
        let mut client = self
            .connect(to)
            .await
            .ok_or_else(|| anyhow::anyhow!("cannot connect to node {to}"))?;
        let mut file = tokio::fs::File::open(path).await?;
        let header = SnapshotChunk {
            from_node_id: self.node_id,
            message: Some(RaftMessage {
                shard: Some(shard_ref(key)),
                message: m.write_to_bytes()?,
            }),
            data: Vec::new(),
        };
        let corrupt = self
            .faults
            .corrupt_snapshots
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        let (tx, rx) = mpsc::channel::<SnapshotChunk>(4);
        let reader = tokio::spawn(async move {
            let mut total = 0u64;
            if tx.send(header).await.is_err() {
                return Ok::<u64, std::io::Error>(total);
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
                if tx
                    .send(SnapshotChunk {
                        data: buf,
                        ..Default::default()
                    })
                    .await
                    .is_err()
                {
                    break;
                }
            }
            Ok(total)
        });
        client
            .install_snapshot(tokio_stream::wrappers::ReceiverStream::new(rx))
            .await?;
        Ok(reader.await??)
    }

    /// Routes an incoming message to its group. Unknown groups and undecodable messages are
    /// ignored: a sender that is ahead of us (a shard not opened yet) or behind (dropped).
    pub fn deliver(&self, from: u64, m: &RaftMessage) {
        if self.isolated(from) {
            return;
        }
        let Some(r) = &m.shard else {
            return;
        };
        let key = ShardKey::new(r.collection.clone(), r.shard);
        let Some(tx) = self.router.read().get(&key).cloned() else {
            metrics::counter!("raft_messages_unknown_group_total").increment(1);
            return;
        };
        let mut msg = Message::default();
        if msg.merge_from_bytes(&m.message).is_err() || msg.to != self.node_id {
            metrics::counter!("raft_messages_invalid_total").increment(1);
            return;
        }
        let _ = tx.send(GroupMsg::Raft(Box::new(msg)));
    }

    pub fn is_isolated(&self, from: u64) -> bool {
        self.isolated(from)
    }
}
