//! Writes forwarded to the shard's leader. A replica that does not lead passes a write on to
//! the leader it knows (over the node-to-node link its Raft traffic uses) instead of sending
//! the caller away with a hint: a coordinator cut off from a leader that still holds its
//! quorum (the nodes reach each other, the coordinator reaches only the followers) can still
//! write through any replica it reaches. A forwarded write carries `FORWARDED` and is never
//! forwarded again, so a stale leader hint cannot make a loop; the leader's answer (its
//! status included) goes back to the caller as it is, except NOT_FOUND from a former leader
//! that no longer holds the shard, which becomes UNAVAILABLE (try again).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use ragcluster_proto::v1::shard_client::ShardClient;
use ragcluster_proto::v1::{WriteBatchRequest, WriteBatchResponse};
use tonic::transport::Channel;
use tonic::{Request, Status};

use crate::raft::GrpcDialer;

/// Metadata key of a write a replica forwarded to its leader.
pub const FORWARDED: &str = "x-ragcluster-forwarded";

/// Clients of the leaders writes were forwarded to, by address.
#[derive(Clone, Default)]
pub struct Forwarder {
    clients: Arc<Mutex<HashMap<String, ShardClient<Channel>>>>,
}

impl Forwarder {
    /// Sends `req` to the leader at `address` within `timeout`.
    pub async fn write(
        &self,
        tls: Option<Arc<ragcluster_common::tls::Tls>>,
        address: &str,
        req: WriteBatchRequest,
        timeout: Duration,
    ) -> Result<WriteBatchResponse, Status> {
        let cached = self.clients.lock().get(address).cloned();
        let mut client = match cached {
            Some(c) => c,
            None => {
                let c = GrpcDialer::connect(tls, address).await.map_err(|e| {
                    Status::unavailable(format!("forwarding to the leader at {address}: {e}"))
                })?;
                self.clients.lock().insert(address.to_owned(), c.clone());
                c
            }
        };
        let mut r = Request::new(req);
        r.set_timeout(timeout);
        r.metadata_mut()
            .insert(FORWARDED, tonic::metadata::MetadataValue::from_static("1"));
        metrics::counter!("shard_writes_forwarded_total").increment(1);
        match tokio::time::timeout(timeout, client.write_batch(r)).await {
            Ok(Ok(resp)) => {
                let mut r = resp.into_inner();
                r.forwarded_to = address.to_owned();
                Ok(r)
            }
            // The leader this replica knew moved away (its replica was dropped): that says
            // nothing of the shard, so the caller tries again (same request id) instead of
            // taking it for a missing shard.
            Ok(Err(s)) if s.code() == tonic::Code::NotFound => Err(Status::unavailable(format!(
                "forwarded to the leader at {address}, which no longer holds the shard: {}",
                s.message()
            ))),
            Ok(Err(s)) => Err(s),
            Err(_) => Err(Status::deadline_exceeded(format!(
                "forwarded to the leader at {address}: no answer within {} ms",
                timeout.as_millis()
            ))),
        }
    }
}
