//! The public `Coordinator` and operator `Admin` gRPC services: thin adapters over `State`.
//! Every call is authenticated and authorised first (`auth`), then admitted (or refused with
//! RESOURCE_EXHAUSTED); nothing runs for a refused call, so it has no side effect.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use futures::future::join_all;
use ragcluster_proto::v1::admin_server::Admin;
use ragcluster_proto::v1::coordinator_server::Coordinator;
use ragcluster_proto::v1::*;
use tonic::{Request, Response, Status};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_client::HealthClient;

use crate::State;
use crate::auth::{Caller, Permit};
use crate::error::CoordError;

pub struct CoordinatorService(pub Arc<State>);
pub struct AdminService(pub Arc<State>);

impl State {
    /// Authenticates, authorises (`need` on `collection`; `None` = cluster operation) and
    /// admits one call.
    fn gate<T>(
        &self,
        req: &Request<T>,
        what: &str,
        need: Role,
        collection: Option<&str>,
    ) -> Result<(Caller, Permit), Status> {
        let caller = self
            .auth
            .authorize(req.metadata(), &self.catalog, what, need, collection)
            .inspect_err(|e| {
                let kind = match e {
                    CoordError::Unauthenticated(_) => "unauthenticated",
                    _ => "permission_denied",
                };
                metrics::counter!("coordinator_auth_refusals_total", "reason" => kind).increment(1);
            })?;
        let permit = self.auth.admit(&caller)?;
        Ok((caller, permit))
    }
}

/// The caller's remaining deadline (`grpc-timeout`) in ms when it is tighter than the
/// request's own `timeout_ms` (0 = none), so shard and model calls inherit it.
fn tighter_timeout(req_ms: u32, md: &tonic::metadata::MetadataMap, max_ms: u32) -> u32 {
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
    inner: S,
    _permit: Permit,
}

impl<S: futures::Stream + Unpin> futures::Stream for Admitted<S> {
    type Item = S::Item;
    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<S::Item>> {
        Pin::new(&mut self.inner).poll_next(cx)
    }
}

#[tonic::async_trait]
impl Coordinator for CoordinatorService {
    async fn create_collection(
        &self,
        req: Request<CreateCollectionRequest>,
    ) -> Result<Response<CreateCollectionResponse>, Status> {
        let name = req.get_ref().name.clone();
        let (caller, _p) = self
            .0
            .gate(&req, "CreateCollection", Role::Admin, Some(&name))?;
        let fwd = req.metadata().contains_key(crate::collections::FORWARDED);
        let c = self
            .0
            .create_collection(req.into_inner(), fwd, &caller)
            .await?;
        Ok(Response::new(CreateCollectionResponse {
            collection: Some(c),
        }))
    }

    async fn drop_collection(
        &self,
        req: Request<DropCollectionRequest>,
    ) -> Result<Response<DropCollectionResponse>, Status> {
        let name = req.get_ref().name.clone();
        let (caller, _p) = self
            .0
            .gate(&req, "DropCollection", Role::Admin, Some(&name))?;
        let fwd = req.metadata().contains_key(crate::collections::FORWARDED);
        self.0.drop_collection(&name, fwd, &caller).await?;
        Ok(Response::new(DropCollectionResponse {}))
    }

    async fn list_collections(
        &self,
        req: Request<ListCollectionsRequest>,
    ) -> Result<Response<ListCollectionsResponse>, Status> {
        // Any reader may list, but sees only the collections its key may touch.
        let caller = self.0.auth.authenticate(req.metadata(), &self.0.catalog)?;
        crate::auth::check(
            &Caller {
                collections: Vec::new(),
                ..caller.clone()
            },
            "ListCollections",
            Role::Reader,
            None,
        )?;
        let _p = self.0.auth.admit(&caller)?;
        let mut collections = self.0.catalog.list();
        collections.retain(|c| caller.may_see(&c.name));
        Ok(Response::new(ListCollectionsResponse { collections }))
    }

    async fn describe_collection(
        &self,
        req: Request<DescribeCollectionRequest>,
    ) -> Result<Response<DescribeCollectionResponse>, Status> {
        let name = req.get_ref().name.clone();
        let _g = self
            .0
            .gate(&req, "DescribeCollection", Role::Reader, Some(&name))?;
        let info = self.0.catalog.get(&name)?;
        let shards = self.0.shard_stats(&info).await;
        Ok(Response::new(DescribeCollectionResponse {
            collection: Some(info),
            shards,
        }))
    }

    async fn upsert_documents(
        &self,
        req: Request<UpsertDocumentsRequest>,
    ) -> Result<Response<UpsertDocumentsResponse>, Status> {
        let coll = req.get_ref().collection.clone();
        let _g = self
            .0
            .gate(&req, "UpsertDocuments", Role::Writer, Some(&coll))?;
        Ok(Response::new(self.0.upsert(req.into_inner()).await?))
    }

    async fn delete_documents(
        &self,
        req: Request<DeleteDocumentsRequest>,
    ) -> Result<Response<DeleteDocumentsResponse>, Status> {
        let coll = req.get_ref().collection.clone();
        let _g = self
            .0
            .gate(&req, "DeleteDocuments", Role::Writer, Some(&coll))?;
        Ok(Response::new(self.0.delete(req.into_inner()).await?))
    }

    async fn search(
        &self,
        req: Request<SearchRequest>,
    ) -> Result<Response<SearchResponse>, Status> {
        let coll = req.get_ref().collection.clone();
        let _g = self.0.gate(&req, "Search", Role::Reader, Some(&coll))?;
        let md = req.metadata().clone();
        let mut r = req.into_inner();
        r.timeout_ms = tighter_timeout(r.timeout_ms, &md, crate::search::MAX_TIMEOUT_MS);
        Ok(Response::new(self.0.search(r).await?))
    }

    type AskStream = Admitted<tokio_stream::wrappers::ReceiverStream<Result<AskResponse, Status>>>;

    async fn ask(&self, req: Request<AskRequest>) -> Result<Response<Self::AskStream>, Status> {
        let coll = req.get_ref().collection.clone();
        let (_caller, permit) = self.0.gate(&req, "Ask", Role::Reader, Some(&coll))?;
        let md = req.metadata().clone();
        let mut r = req.into_inner();
        r.timeout_ms = tighter_timeout(r.timeout_ms, &md, crate::flow::MAX_ASK_TIMEOUT_MS);
        let rx = self.0.ask(r).await?;
        Ok(Response::new(Admitted {
            inner: tokio_stream::wrappers::ReceiverStream::new(rx),
            _permit: permit,
        }))
    }
}

async fn health_of(state: &State, addr: &str) -> String {
    let ch = match state.clients.channel(addr) {
        Ok(c) => c,
        Err(e) => return e.to_string(),
    };
    let mut c = HealthClient::new(ch);
    match tokio::time::timeout(
        Duration::from_secs(2),
        c.check(HealthCheckRequest {
            service: String::new(),
        }),
    )
    .await
    {
        Err(_) => "timeout".into(),
        Ok(Err(s)) => format!("error: {}", s.message()),
        Ok(Ok(r)) => match r.into_inner().status {
            1 => "SERVING".into(),
            2 => "NOT_SERVING".into(),
            s => format!("status {s}"),
        },
    }
}

#[tonic::async_trait]
impl Admin for AdminService {
    async fn cluster_status(
        &self,
        req: Request<ClusterStatusRequest>,
    ) -> Result<Response<ClusterStatusResponse>, Status> {
        let _g = self.0.gate(&req, "ClusterStatus", Role::Admin, None)?;
        let s = &self.0;
        let collections = s.catalog.list();
        let collections = &collections;
        let mut nodes: Vec<NodeStatus> =
            join_all(s.cfg.shard_nodes.iter().map(|addr| async move {
                let shards = collections
                    .iter()
                    .map(|c| c.shards.iter().filter(|p| p.nodes.contains(addr)).count() as u32)
                    .sum();
                NodeStatus {
                    address: addr.clone(),
                    role: "shard-node".into(),
                    health: health_of(s, addr).await,
                    shards,
                    leaders: 0,
                }
            }))
            .await;
        let mw = s.clients.model_worker_addr().to_owned();
        nodes.push(NodeStatus {
            health: health_of(s, &mw).await,
            address: mw,
            role: "model-worker".into(),
            shards: 0,
            leaders: 0,
        });
        let mut out = Vec::new();
        for c in collections.iter().cloned() {
            let shards = s.shard_stats(&c).await;
            for st in &shards {
                if let Some(n) = nodes.iter_mut().find(|n| n.address == st.leader) {
                    n.leaders += 1;
                }
            }
            out.push(CollectionStatus {
                collection: Some(c),
                shards,
            });
        }
        Ok(Response::new(ClusterStatusResponse {
            nodes,
            collections: out,
            catalog: Some(s.catalog.status()),
        }))
    }

    type MoveReplicaStream =
        tokio_stream::wrappers::ReceiverStream<Result<MoveReplicaProgress, Status>>;

    async fn move_replica(
        &self,
        req: Request<MoveReplicaRequest>,
    ) -> Result<Response<Self::MoveReplicaStream>, Status> {
        // Moves are long: they hold no admission slot.
        let (caller, _p) = self.0.gate(&req, "MoveReplica", Role::Admin, None)?;
        let fwd = req.metadata().contains_key(crate::collections::FORWARDED);
        let r = req.into_inner();
        let (tx, rx) = tokio::sync::mpsc::channel(64);
        // Moves change the catalog: they run on its leader.
        if let Some(addr) = self.0.catalog_leader(fwd).await? {
            let ch = self.0.clients.channel(&addr)?;
            let mut up = ragcluster_proto::v1::admin_client::AdminClient::new(ch)
                .move_replica(crate::collections::forward(
                    r,
                    Duration::from_secs(3600),
                    &caller,
                ))
                .await?
                .into_inner();
            tokio::spawn(async move {
                while let Some(m) = up.message().await.transpose() {
                    if tx.send(m).await.is_err() {
                        break;
                    }
                }
            });
        } else {
            let s = self.0.clone();
            tokio::spawn(async move {
                if let Err(e) = s
                    .move_replica(&r.collection, r.shard, &r.from, &r.to, &tx)
                    .await
                {
                    tracing::warn!(collection = r.collection, shard = r.shard, from = r.from,
                                   to = r.to, error = %e, "replica move failed");
                    let _ = tx.send(Err(e.into())).await;
                }
            });
        }
        Ok(Response::new(tokio_stream::wrappers::ReceiverStream::new(
            rx,
        )))
    }

    async fn transfer_shard_leader(
        &self,
        req: Request<TransferShardLeaderRequest>,
    ) -> Result<Response<TransferShardLeaderResponse>, Status> {
        let _g = self
            .0
            .gate(&req, "TransferShardLeader", Role::Admin, None)?;
        let r = req.into_inner();
        self.0
            .transfer_shard_leader(&r.collection, r.shard, &r.to)
            .await?;
        Ok(Response::new(TransferShardLeaderResponse {}))
    }

    async fn create_api_key(
        &self,
        req: Request<CreateApiKeyRequest>,
    ) -> Result<Response<CreateApiKeyResponse>, Status> {
        let (caller, _p) = self.0.gate(&req, "CreateApiKey", Role::Admin, None)?;
        let fwd = req.metadata().contains_key(crate::collections::FORWARDED);
        let r = req.into_inner();
        Ok(Response::new(self.0.create_api_key(r, fwd, &caller).await?))
    }

    async fn list_api_keys(
        &self,
        req: Request<ListApiKeysRequest>,
    ) -> Result<Response<ListApiKeysResponse>, Status> {
        let _g = self.0.gate(&req, "ListApiKeys", Role::Admin, None)?;
        Ok(Response::new(ListApiKeysResponse {
            keys: self
                .0
                .catalog
                .api_keys()
                .into_iter()
                .filter_map(|k| k.info)
                .collect(),
        }))
    }

    async fn revoke_api_key(
        &self,
        req: Request<RevokeApiKeyRequest>,
    ) -> Result<Response<RevokeApiKeyResponse>, Status> {
        let (caller, _p) = self.0.gate(&req, "RevokeApiKey", Role::Admin, None)?;
        let fwd = req.metadata().contains_key(crate::collections::FORWARDED);
        let r = req.into_inner();
        Ok(Response::new(
            self.0.revoke_api_key(&r.id, fwd, &caller).await?,
        ))
    }
}
