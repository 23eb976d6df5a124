//! Clients of shard nodes, the model worker and other coordinators, one lazily connected channel per address, and
//! the parallel fan-out of per-shard calls under a deadline.

use std::collections::HashMap;
use std::future::Future;
use std::time::Duration;

use parking_lot::Mutex;
use ragcluster_proto::v1::coordinator_client::CoordinatorClient;
use ragcluster_proto::v1::model_worker_client::ModelWorkerClient;
use ragcluster_proto::v1::shard_client::ShardClient;
use std::sync::Arc;

use ragcluster_common::tls::{Tls, lazy_channel};
use tonic::transport::Channel;

use crate::error::{CoordError, Result};

const MAX_MESSAGE: usize = 64 * 1024 * 1024;

pub struct Clients {
    channels: Mutex<HashMap<String, Channel>>,
    model_worker: String,
    /// Member certificate and CA for `https://` members.
    tls: Option<Arc<Tls>>,
}

impl Clients {
    pub fn new(model_worker: String, tls: Option<Arc<Tls>>) -> Self {
        Self {
            channels: Mutex::new(HashMap::new()),
            model_worker,
            tls,
        }
    }

    pub fn channel(&self, addr: &str) -> Result<Channel> {
        let mut g = self.channels.lock();
        if let Some(c) = g.get(addr) {
            return Ok(c.clone());
        }
        let ch = lazy_channel(addr, self.tls.as_ref(), |ep| {
            ep.connect_timeout(Duration::from_secs(2))
                .tcp_nodelay(true)
                .http2_keep_alive_interval(Duration::from_secs(20))
        })
        .map_err(|e| CoordError::invalid("address", e.to_string()))?;
        g.insert(addr.to_owned(), ch.clone());
        Ok(ch)
    }

    pub fn shard(&self, addr: &str) -> Result<ShardClient<Channel>> {
        Ok(ShardClient::new(self.channel(addr)?)
            .max_decoding_message_size(MAX_MESSAGE)
            .max_encoding_message_size(MAX_MESSAGE))
    }

    /// Another coordinator (catalog changes are forwarded to the leader).
    pub fn coordinator(&self, addr: &str) -> Result<CoordinatorClient<Channel>> {
        Ok(CoordinatorClient::new(self.channel(addr)?)
            .max_decoding_message_size(MAX_MESSAGE)
            .max_encoding_message_size(MAX_MESSAGE))
    }

    pub fn model_worker(&self) -> Result<ModelWorkerClient<Channel>> {
        Ok(ModelWorkerClient::new(self.channel(&self.model_worker)?)
            .max_decoding_message_size(MAX_MESSAGE)
            .max_encoding_message_size(MAX_MESSAGE))
    }

    pub fn model_worker_addr(&self) -> &str {
        &self.model_worker
    }
}

/// A request with a gRPC deadline, so the callee stops working when we stop waiting.
pub fn request<T>(msg: T, timeout: Duration) -> tonic::Request<T> {
    let mut r = tonic::Request::new(msg);
    r.set_timeout(timeout);
    r
}

/// Awaits `fut` under `timeout`, mapping errors of the call named `what`.
pub async fn call<T>(
    what: &str,
    timeout: Duration,
    fut: impl Future<Output = std::result::Result<tonic::Response<T>, tonic::Status>>,
) -> Result<T> {
    match tokio::time::timeout(timeout, fut).await {
        Err(_) => Err(CoordError::Deadline(what.to_owned())),
        Ok(Err(s)) => Err(CoordError::upstream(what, s)),
        Ok(Ok(r)) => Ok(r.into_inner()),
    }
}
