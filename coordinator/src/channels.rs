//! gRPC channels to the other members of the cluster (shard nodes, model workers, other
//! coordinators): one lazily connected channel per address, with the cluster's TLS settings.

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use ragcluster_common::tls::{Tls, lazy_channel};
use tonic::transport::Channel;

use crate::error::{CoordError, Result};

/// Largest message to or from a member.
pub const MAX_MESSAGE: usize = 64 * 1024 * 1024;

pub struct Channels {
    cache: Mutex<HashMap<String, Channel>>,
    /// Member certificate and CA for `https://` members.
    tls: Option<Arc<Tls>>,
}

impl Channels {
    pub fn new(tls: Option<Arc<Tls>>) -> Self {
        Self {
            cache: Mutex::new(HashMap::new()),
            tls,
        }
    }

    pub fn get(&self, addr: &str) -> Result<Channel> {
        let mut g = self.cache.lock();
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
