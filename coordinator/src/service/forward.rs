//! Catalog changes (collections, API keys, replica moves) are made on the coordinator that
//! leads the catalog; the others forward the call there with the caller's key, which the
//! leader checks again rather than trusting the forwarder.

use std::sync::Arc;
use std::time::Duration;

use ragcluster_proto::v1::admin_client::AdminClient;
use ragcluster_proto::v1::coordinator_client::CoordinatorClient;
use ragcluster_proto::v1::membership_client::MembershipClient;
use ragcluster_proto::v1::*;
use tonic::transport::Channel;

use crate::auth::Caller;
use crate::channels::{Channels, MAX_MESSAGE, call, request};
use crate::error::Result;

/// Marks a call forwarded by another coordinator (never forwarded twice).
pub const FORWARDED: &str = "x-ragcluster-forwarded";
const TIMEOUT: Duration = Duration::from_secs(30);
/// Replica moves stream progress for as long as they take.
const MOVE_TIMEOUT: Duration = Duration::from_secs(3600);
/// Within the member's own 5 s heartbeat deadline.
const HEARTBEAT_TIMEOUT: Duration = Duration::from_secs(4);

pub fn is_forwarded(md: &tonic::metadata::MetadataMap) -> bool {
    md.contains_key(FORWARDED)
}

pub struct Forwarder {
    channels: Arc<Channels>,
}

/// A call to the leader on behalf of `caller`, whose key goes along.
fn forward<T>(msg: T, timeout: Duration, caller: &Caller) -> tonic::Request<T> {
    let mut r = request(msg, timeout);
    r.metadata_mut()
        .insert(FORWARDED, tonic::metadata::MetadataValue::from_static("1"));
    if let Some(k) = &caller.presented
        && let Ok(v) = format!("Bearer {k}").parse()
    {
        r.metadata_mut()
            .insert(ragcluster_common::client::AUTHORIZATION, v);
    }
    r
}

impl Forwarder {
    pub fn new(channels: Arc<Channels>) -> Self {
        Self { channels }
    }

    fn coordinator(&self, addr: &str) -> Result<CoordinatorClient<Channel>> {
        Ok(CoordinatorClient::new(self.channels.get(addr)?)
            .max_decoding_message_size(MAX_MESSAGE)
            .max_encoding_message_size(MAX_MESSAGE))
    }

    fn admin(&self, addr: &str) -> Result<AdminClient<Channel>> {
        Ok(AdminClient::new(self.channels.get(addr)?).max_decoding_message_size(MAX_MESSAGE))
    }

    pub async fn create_collection(
        &self,
        leader: &str,
        r: CreateCollectionRequest,
        caller: &Caller,
    ) -> Result<CollectionInfo> {
        let mut c = self.coordinator(leader)?;
        let what = format!("leader coordinator {leader}");
        let r = call(
            &what,
            TIMEOUT,
            c.create_collection(forward(r, TIMEOUT, caller)),
        )
        .await?;
        Ok(r.collection.unwrap_or_default())
    }

    pub async fn drop_collection(&self, leader: &str, name: &str, caller: &Caller) -> Result<()> {
        let mut c = self.coordinator(leader)?;
        let what = format!("leader coordinator {leader}");
        let r = DropCollectionRequest {
            name: name.to_owned(),
        };
        call(
            &what,
            TIMEOUT,
            c.drop_collection(forward(r, TIMEOUT, caller)),
        )
        .await?;
        Ok(())
    }

    pub async fn update_aliases(
        &self,
        leader: &str,
        r: UpdateAliasesRequest,
        caller: &Caller,
    ) -> Result<()> {
        let mut c = self.coordinator(leader)?;
        let what = format!("leader coordinator {leader}");
        call(
            &what,
            TIMEOUT,
            c.update_aliases(forward(r, TIMEOUT, caller)),
        )
        .await?;
        Ok(())
    }

    pub async fn add_fields(
        &self,
        leader: &str,
        r: AddFieldsRequest,
        caller: &Caller,
    ) -> Result<Vec<FieldSchema>> {
        let mut c = self.coordinator(leader)?;
        let what = format!("leader coordinator {leader}");
        let r = call(&what, TIMEOUT, c.add_fields(forward(r, TIMEOUT, caller))).await?;
        Ok(r.fields)
    }

    pub async fn create_api_key(
        &self,
        leader: &str,
        r: CreateApiKeyRequest,
        caller: &Caller,
    ) -> Result<CreateApiKeyResponse> {
        let mut c = self.admin(leader)?;
        call(
            "catalog leader",
            TIMEOUT,
            c.create_api_key(forward(r, TIMEOUT, caller)),
        )
        .await
    }

    pub async fn revoke_api_key(&self, leader: &str, id: &str, caller: &Caller) -> Result<()> {
        let mut c = self.admin(leader)?;
        let r = RevokeApiKeyRequest { id: id.to_owned() };
        call(
            "catalog leader",
            TIMEOUT,
            c.revoke_api_key(forward(r, TIMEOUT, caller)),
        )
        .await?;
        Ok(())
    }

    pub async fn move_replica(
        &self,
        leader: &str,
        r: MoveReplicaRequest,
        caller: &Caller,
    ) -> std::result::Result<tonic::Streaming<MoveReplicaProgress>, tonic::Status> {
        let mut c = self.admin(leader)?;
        Ok(c.move_replica(forward(r, MOVE_TIMEOUT, caller))
            .await?
            .into_inner())
    }

    pub async fn reembed(
        &self,
        leader: &str,
        r: ReembedRequest,
        caller: &Caller,
    ) -> std::result::Result<tonic::Streaming<ReembedProgress>, tonic::Status> {
        let mut c = self.admin(leader)?;
        Ok(c.reembed(forward(r, MOVE_TIMEOUT, caller))
            .await?
            .into_inner())
    }

    pub async fn set_node_state(
        &self,
        leader: &str,
        r: SetNodeStateRequest,
        caller: &Caller,
    ) -> Result<SetNodeStateResponse> {
        let mut c = self.admin(leader)?;
        call(
            "catalog leader",
            TIMEOUT,
            c.set_node_state(forward(r, TIMEOUT, caller)),
        )
        .await
    }

    pub async fn remove_node(
        &self,
        leader: &str,
        r: RemoveNodeRequest,
        caller: &Caller,
    ) -> Result<RemoveNodeResponse> {
        let mut c = self.admin(leader)?;
        call(
            "catalog leader",
            TIMEOUT,
            c.remove_node(forward(r, TIMEOUT, caller)),
        )
        .await
    }

    /// A member's heartbeat, passed on to the catalog leader (members carry no API key).
    pub async fn heartbeat(&self, leader: &str, r: HeartbeatRequest) -> Result<HeartbeatResponse> {
        let mut c = MembershipClient::new(self.channels.get(leader)?);
        let mut req = request(r, HEARTBEAT_TIMEOUT);
        req.metadata_mut()
            .insert(FORWARDED, tonic::metadata::MetadataValue::from_static("1"));
        call("catalog leader", HEARTBEAT_TIMEOUT, c.heartbeat(req)).await
    }
}
