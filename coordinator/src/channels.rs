//! gRPC channels to the other members of the cluster (shard nodes, model workers, other
//! coordinators): one lazily connected channel per address, with the cluster's TLS settings.

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

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

/// Awaits `fut` under `timeout`, mapping errors of the call named `what`. A call that fails
/// once its deadline has (all but) passed failed because of the deadline, whatever the callee
/// or the transport answered (a server cuts an expired call with CANCELLED, a stream torn
/// down at the deadline reads UNKNOWN): it is DEADLINE_EXCEEDED, the caller's own limit, and
/// never counts against the member (no failover, no marking it down).
pub async fn call<T>(
    what: &str,
    timeout: Duration,
    fut: impl Future<Output = std::result::Result<tonic::Response<T>, tonic::Status>>,
) -> Result<T> {
    let started = Instant::now();
    match tokio::time::timeout(timeout, fut).await {
        Err(_) => Err(CoordError::Deadline(what.to_owned())),
        Ok(Err(s)) if expired(&s, started.elapsed(), timeout) => {
            Err(CoordError::Deadline(what.to_owned()))
        }
        Ok(Err(s)) => Err(CoordError::upstream(what, s)),
        Ok(Ok(r)) => Ok(r.into_inner()),
    }
}

/// Whether a failed call's status is its deadline running out: a transport-level code
/// arriving when at most a twentieth of the deadline (or a millisecond) was left.
pub fn expired(s: &tonic::Status, elapsed: Duration, timeout: Duration) -> bool {
    use tonic::Code;
    let slack = (timeout / 20).max(Duration::from_millis(1));
    matches!(
        s.code(),
        Code::DeadlineExceeded | Code::Cancelled | Code::Unknown | Code::Unavailable
    ) && elapsed + slack >= timeout
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failure_at_the_deadline_is_the_deadline() {
        let ms = Duration::from_millis;
        let cut = tonic::Status::cancelled("Timeout expired");
        assert!(expired(&cut, ms(1), ms(1)));
        assert!(expired(&cut, ms(97), ms(100)));
        assert!(expired(
            &tonic::Status::unknown("stream reset"),
            ms(2_000),
            ms(2_000)
        ));
        // Early, the same codes are the member's failure.
        assert!(!expired(&cut, ms(10), ms(100)));
        assert!(!expired(
            &tonic::Status::unavailable("connection refused"),
            ms(1),
            ms(5_000)
        ));
        // A refusal is a refusal whenever it comes.
        assert!(!expired(
            &tonic::Status::invalid_argument("bad"),
            ms(100),
            ms(100)
        ));
    }

    #[tokio::test]
    async fn a_call_cut_at_its_deadline_is_deadline_exceeded() {
        let slow = async {
            tokio::time::sleep(Duration::from_millis(5)).await;
            Err::<tonic::Response<()>, _>(tonic::Status::cancelled("Timeout expired"))
        };
        let e = call("model worker", Duration::from_millis(5), slow)
            .await
            .unwrap_err();
        assert!(matches!(e, CoordError::Deadline(_)), "{e:?}");
        let refused = async { Err::<tonic::Response<()>, _>(tonic::Status::unavailable("down")) };
        let e = call("model worker", Duration::from_secs(5), refused)
            .await
            .unwrap_err();
        assert!(matches!(e, CoordError::Unavailable { .. }), "{e:?}");
    }
}
