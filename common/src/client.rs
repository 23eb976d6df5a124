//! How tools and services dial ragcluster: a channel (plaintext or TLS, see `tls`) that adds
//! the caller's API key to every request as `authorization: Bearer <key>`.

use std::task::{Context, Poll};

use tonic::body::Body;
use tonic::metadata::MetadataMap;
use tonic::transport::Channel;

/// The metadata key API keys travel in (`x-api-key` is accepted too).
pub const AUTHORIZATION: &str = "authorization";
pub const X_API_KEY: &str = "x-api-key";

/// The metadata key of a refusal's retry hint, in milliseconds (every process sets it on
/// UNAVAILABLE and RESOURCE_EXHAUSTED answers worth retrying later).
pub const RETRY_AFTER_MS: &str = "retry-after-ms";

/// The retry hint an error status carries, if any.
pub fn retry_after_ms(s: &tonic::Status) -> Option<u64> {
    s.metadata()
        .get(RETRY_AFTER_MS)?
        .to_str()
        .ok()?
        .parse()
        .ok()
}

/// The API key a request carries, if any: `authorization: Bearer KEY` or `x-api-key: KEY`.
pub fn api_key(md: &MetadataMap) -> Option<&str> {
    if let Some(v) = md.get(AUTHORIZATION).and_then(|v| v.to_str().ok()) {
        let v = v.trim();
        return Some(
            v.strip_prefix("Bearer ")
                .or_else(|| v.strip_prefix("bearer "))
                .unwrap_or(v)
                .trim(),
        );
    }
    md.get(X_API_KEY)
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
}

/// A channel that presents an API key on every call (or none).
#[derive(Clone)]
pub struct KeyedChannel {
    inner: Channel,
    header: Option<http::HeaderValue>,
}

#[derive(Debug, thiserror::Error)]
#[error("API key contains characters not allowed in gRPC metadata")]
pub struct BadKey;

impl KeyedChannel {
    pub fn new(inner: Channel, key: Option<&str>) -> Result<Self, BadKey> {
        let header = match key.map(str::trim).filter(|k| !k.is_empty()) {
            None => None,
            Some(k) => {
                let mut v =
                    http::HeaderValue::from_str(&format!("Bearer {k}")).map_err(|_| BadKey)?;
                // Kept out of HPACK tables and debug output.
                v.set_sensitive(true);
                Some(v)
            }
        };
        Ok(Self { inner, header })
    }
}

impl tower::Service<http::Request<Body>> for KeyedChannel {
    type Response = http::Response<Body>;
    type Error = tonic::transport::Error;
    type Future = <Channel as tower::Service<http::Request<Body>>>::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        tower::Service::poll_ready(&mut self.inner, cx)
    }

    fn call(&mut self, mut req: http::Request<Body>) -> Self::Future {
        if let Some(h) = &self.header
            && !req.headers().contains_key(AUTHORIZATION)
        {
            req.headers_mut().insert(AUTHORIZATION, h.clone());
        }
        tower::Service::call(&mut self.inner, req)
    }
}
