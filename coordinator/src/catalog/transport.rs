//! Catalog Raft traffic between coordinators: one task per peer drains a bounded queue and
//! sends what accumulated as one unary `CatalogPeer.Raft` call. A failed call reports the peer
//! unreachable to raft-rs (which then probes instead of streaming) and backs off; raft-rs
//! resends whatever was lost. Catalog traffic is heartbeats plus rare changes, so unary calls
//! are plenty.

use std::collections::BTreeMap;
use std::sync::mpsc::Sender;
use std::time::Duration;

use protobuf::Message as _;
use raft::eraftpb::Message;
use ragcluster_proto::v1::CatalogRaftBatch;
use ragcluster_proto::v1::catalog_peer_client::CatalogPeerClient;
use tokio::sync::mpsc;
use tonic::transport::Channel;

use super::group::Msg;

const QUEUE: usize = 1024;
const CALL_TIMEOUT: Duration = Duration::from_secs(2);

pub struct Transport {
    node_id: u64,
    /// Every member's address, this one's included.
    members: BTreeMap<u64, String>,
    queues: BTreeMap<u64, mpsc::Sender<Vec<u8>>>,
}

impl Transport {
    pub fn start(
        node_id: u64,
        members: BTreeMap<u64, String>,
        group: Sender<Msg>,
        rt: &tokio::runtime::Handle,
        tls: Option<&std::sync::Arc<ragcluster_common::tls::Tls>>,
    ) -> Result<Self, String> {
        let mut queues = BTreeMap::new();
        for (&id, addr) in &members {
            if id == node_id {
                continue;
            }
            let ch = ragcluster_common::tls::lazy_channel(addr, tls, |ep| {
                ep.connect_timeout(Duration::from_secs(1)).tcp_nodelay(true)
            })
            .map_err(|e| format!("coordinator.peers {id}={addr}: {e}"))?;
            let (tx, rx) = mpsc::channel(QUEUE);
            rt.spawn(peer_loop(node_id, id, ch, rx, group.clone()));
            queues.insert(id, tx);
        }
        Ok(Self {
            node_id,
            members,
            queues,
        })
    }

    pub fn members(&self) -> Vec<(u64, String)> {
        self.members
            .iter()
            .map(|(id, a)| (*id, a.clone()))
            .collect()
    }

    pub fn address(&self, id: u64) -> Option<String> {
        self.members.get(&id).cloned()
    }

    pub fn is_member(&self, id: u64) -> bool {
        self.members.contains_key(&id)
    }

    pub fn send(&self, msgs: Vec<Message>) {
        for m in msgs {
            let Some(q) = self.queues.get(&m.to) else {
                continue;
            };
            match m.write_to_bytes() {
                // A full queue means the peer is far behind or down; raft-rs resends.
                Ok(b) => {
                    if q.try_send(b).is_err() {
                        metrics::counter!("catalog_messages_dropped_total").increment(1);
                    }
                }
                Err(e) => tracing::error!(error = %e, "catalog raft message not encodable"),
            }
        }
    }

    pub fn node_id(&self) -> u64 {
        self.node_id
    }
}

async fn peer_loop(
    from: u64,
    to: u64,
    ch: Channel,
    mut rx: mpsc::Receiver<Vec<u8>>,
    group: Sender<Msg>,
) {
    let mut client = CatalogPeerClient::new(ch).max_decoding_message_size(64 << 20);
    let mut backoff = Duration::from_millis(100);
    while let Some(first) = rx.recv().await {
        let mut messages = vec![first];
        while messages.len() < 256 {
            match rx.try_recv() {
                Ok(m) => messages.push(m),
                Err(_) => break,
            }
        }
        let req = CatalogRaftBatch {
            from_node_id: from,
            messages,
        };
        match tokio::time::timeout(CALL_TIMEOUT, client.raft(req)).await {
            Ok(Ok(_)) => backoff = Duration::from_millis(100),
            Ok(Err(e)) => {
                tracing::debug!(peer = to, error = %e, "catalog peer unreachable");
                if group.send(Msg::Unreachable(to)).is_err() {
                    return;
                }
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(1));
            }
            Err(_) => {
                if group.send(Msg::Unreachable(to)).is_err() {
                    return;
                }
            }
        }
    }
}
