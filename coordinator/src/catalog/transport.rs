//! How coordinators reach each other for the catalog group (the `Dialer` of the shared Raft
//! transport): what queued up for a peer goes as one unary `CatalogPeer.Raft` call. Catalog
//! traffic is heartbeats plus rare changes, so unary calls are plenty.

use std::sync::Arc;
use std::time::Duration;

use futures::FutureExt;
use futures::future::BoxFuture;
use ragcluster_proto::v1::CatalogRaftBatch;
use ragcluster_proto::v1::catalog_peer_client::CatalogPeerClient;
use ragcluster_raft::{Dialer, Envelope, Transport};
use tokio::sync::mpsc;

use super::machine::CatalogResponse;

/// The catalog is the one group coordinators share.
pub const GROUP: &str = "catalog";

pub type CatalogTransport = Transport<&'static str, CatalogResponse>;

const CALL_TIMEOUT: Duration = Duration::from_secs(2);

pub struct CatalogDialer {
    pub node_id: u64,
    pub tls: Option<Arc<ragcluster_common::tls::Tls>>,
}

impl Dialer<&'static str> for CatalogDialer {
    fn stream(
        &self,
        to: u64,
        address: String,
        mut batches: mpsc::Receiver<Vec<Envelope<&'static str>>>,
    ) -> BoxFuture<'static, Result<(), String>> {
        let from = self.node_id;
        let ch = ragcluster_common::tls::lazy_channel(&address, self.tls.as_ref(), |ep| {
            ep.connect_timeout(Duration::from_secs(1)).tcp_nodelay(true)
        });
        async move {
            let ch = ch.map_err(|e| format!("coordinator {to} at {address}: {e}"))?;
            let mut client = CatalogPeerClient::new(ch).max_decoding_message_size(64 << 20);
            while let Some(batch) = batches.recv().await {
                let req = CatalogRaftBatch {
                    from_node_id: from,
                    messages: batch.into_iter().map(|(_, m)| m).collect(),
                };
                match tokio::time::timeout(CALL_TIMEOUT, client.raft(req)).await {
                    Ok(Ok(_)) => {}
                    Ok(Err(e)) => return Err(e.to_string()),
                    Err(_) => return Err("call timed out".into()),
                }
            }
            Ok(())
        }
        .boxed()
    }
}
