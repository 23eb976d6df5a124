//! The gRPC edge: the public `Coordinator` and operator `Admin` services and the internal
//! `CatalogPeer` and `Membership` services, thin adapters over the components. Every call is authenticated and
//! authorised first, then admitted (or refused with RESOURCE_EXHAUSTED); nothing runs for a
//! refused call, so it has no side effect. Wire types become domain values in `convert`;
//! catalog changes go to the catalog leader through `forward`.

pub mod admin;
pub mod convert;
pub mod coordinator;
pub mod forward;
pub mod membership;
pub mod peer;

use std::pin::Pin;
use std::task::{Context, Poll};

use ragcluster_proto::v1::Role;
use tonic::{Request, Status};

use crate::auth::{Caller, Permit};
use crate::error::CoordError;
use crate::handles::Handles;

pub use admin::AdminService;
pub use coordinator::CoordinatorService;
pub use membership::MembershipService;
pub use peer::CatalogPeerService;

/// Authenticates, authorises (`need` on `collection`; `None` = cluster operation) and admits
/// one call.
pub fn gate<T>(
    h: &Handles,
    req: &Request<T>,
    what: &str,
    need: Role,
    collection: Option<&str>,
) -> Result<(Caller, Permit), Status> {
    let caller = h
        .auth
        .authorize(req.metadata(), &h.catalog, what, need, collection)
        .inspect_err(|e| {
            let kind = match e {
                CoordError::Unauthenticated(_) => "unauthenticated",
                _ => "permission_denied",
            };
            metrics::counter!("coordinator_auth_refusals_total", "reason" => kind).increment(1);
        })?;
    let permit = h.auth.admit(&caller)?;
    Ok((caller, permit))
}

/// The caller's remaining deadline (`grpc-timeout`) in ms when it is tighter than the
/// request's own `timeout_ms` (0 = none), so shard and model calls inherit it.
pub fn tighter_timeout(req_ms: u32, md: &tonic::metadata::MetadataMap, max_ms: u32) -> u32 {
    match ragcluster_common::server::grpc_timeout(md) {
        Some(d) => {
            let ms = d.as_millis().clamp(1, u128::from(max_ms)) as u32;
            if req_ms == 0 { ms } else { req_ms.min(ms) }
        }
        None => req_ms,
    }
}

/// A response stream that holds its admission slot until the stream ends.
pub struct Admitted<S> {
    pub inner: S,
    pub _permit: Permit,
}

impl<S: futures::Stream + Unpin> futures::Stream for Admitted<S> {
    type Item = S::Item;
    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<S::Item>> {
        Pin::new(&mut self.inner).poll_next(cx)
    }
}
