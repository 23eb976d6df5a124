//! A shard node in the coordinator's own process (the `colocated` binary), called directly: no
//! socket, no HTTP/2 framing, no protobuf encoding on the hop that every query takes. As with
//! Elasticsearch's data nodes that also coordinate, a read whose replica lives in this process
//! is served here; every other node is still reached over gRPC. The node itself is a full
//! member (it serves `ragcluster.v1.Shard` on its own port for Raft peers and the other
//! coordinators), so co-location changes cost, not behaviour. The in-process `ShardNode` comes
//! from the composing binary: this crate does not know the shard node's.

use std::sync::Arc;

use super::node::{Connector, ShardNode};
use crate::error::ShardCallError;

type Result<T> = std::result::Result<T, ShardCallError>;

/// The co-located node at its advertised address, every other address through `remote`.
pub struct ColocatedConnector {
    address: String,
    local: Arc<dyn ShardNode>,
    remote: Arc<dyn Connector>,
}

impl ColocatedConnector {
    pub fn new(address: String, local: Arc<dyn ShardNode>, remote: Arc<dyn Connector>) -> Self {
        Self {
            address,
            local,
            remote,
        }
    }
}

impl Connector for ColocatedConnector {
    fn node(&self, address: &str) -> Result<Arc<dyn ShardNode>> {
        if address == self.address {
            metrics::counter!("coordinator_colocated_calls_total").increment(1);
            return Ok(self.local.clone());
        }
        self.remote.node(address)
    }

    fn local_address(&self) -> Option<&str> {
        Some(&self.address)
    }
}
