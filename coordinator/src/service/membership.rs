//! The internal `Membership` service: shard nodes' and model workers' heartbeats, handled on
//! the catalog leader (other coordinators pass them on).

use std::sync::Arc;

use ragcluster_proto::v1::membership_server;
use ragcluster_proto::v1::{HeartbeatRequest, HeartbeatResponse};

use super::forward::{Forwarder, is_forwarded};
use crate::catalog::Catalog;
use crate::membership::Membership;

pub struct MembershipService {
    pub membership: Arc<Membership>,
    pub catalog: Arc<Catalog>,
    pub forward: Arc<Forwarder>,
    /// This coordinator's certificates, when TLS is on.
    pub tls: Option<Arc<ragcluster_common::tls::Tls>>,
}

#[tonic::async_trait]
impl membership_server::Membership for MembershipService {
    async fn heartbeat(
        &self,
        req: tonic::Request<HeartbeatRequest>,
    ) -> Result<tonic::Response<HeartbeatResponse>, tonic::Status> {
        // With TLS on, only holders of a member certificate may join.
        if self.tls.as_ref().is_some_and(|t| t.serves())
            && !ragcluster_common::tls::peer(req.extensions()).member
        {
            return Err(tonic::Status::unauthenticated(
                "Membership is internal: callers must present a cluster member certificate",
            ));
        }
        let forwarded = is_forwarded(req.metadata());
        let r = req.into_inner();
        Membership::check(&r)?;
        let resp = match self.catalog.change_target(forwarded).await? {
            None => self.membership.heartbeat(r).await?,
            Some(leader) => self.forward.heartbeat(&leader, r).await?,
        };
        Ok(tonic::Response::new(resp))
    }
}
