//! The internal `CatalogPeer` service: Raft messages from other coordinators.

use std::sync::Arc;

use ragcluster_proto::v1::catalog_peer_server::CatalogPeer;
use ragcluster_proto::v1::{CatalogRaftAck, CatalogRaftBatch};

use crate::catalog::Catalog;

pub struct CatalogPeerService {
    pub catalog: Arc<Catalog>,
    /// This coordinator's certificates, when TLS is on.
    pub tls: Option<Arc<ragcluster_common::tls::Tls>>,
}

#[tonic::async_trait]
impl CatalogPeer for CatalogPeerService {
    async fn raft(
        &self,
        req: tonic::Request<CatalogRaftBatch>,
    ) -> Result<tonic::Response<CatalogRaftAck>, tonic::Status> {
        // With TLS on, only coordinators holding a member certificate may talk Raft.
        if self.tls.as_ref().is_some_and(|t| t.serves())
            && !ragcluster_common::tls::peer(req.extensions()).member
        {
            return Err(tonic::Status::unauthenticated(
                "CatalogPeer is internal: callers must present a cluster member certificate",
            ));
        }
        let b = req.into_inner();
        if !self.catalog.is_member(b.from_node_id) {
            return Err(tonic::Status::permission_denied(format!(
                "coordinator {} is not in coordinator.peers of this coordinator",
                b.from_node_id
            )));
        }
        self.catalog.deliver(b.from_node_id, b.messages);
        Ok(tonic::Response::new(CatalogRaftAck {}))
    }
}
