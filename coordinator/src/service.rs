//! The public `Coordinator` and operator `Admin` gRPC services: thin adapters over `State`.

use std::sync::Arc;
use std::time::Duration;

use futures::future::join_all;
use ragcluster_proto::v1::admin_server::Admin;
use ragcluster_proto::v1::coordinator_server::Coordinator;
use ragcluster_proto::v1::*;
use tonic::{Request, Response, Status};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_client::HealthClient;

use crate::State;

pub struct CoordinatorService(pub Arc<State>);
pub struct AdminService(pub Arc<State>);

#[tonic::async_trait]
impl Coordinator for CoordinatorService {
    async fn create_collection(
        &self,
        req: Request<CreateCollectionRequest>,
    ) -> Result<Response<CreateCollectionResponse>, Status> {
        let fwd = req.metadata().contains_key(crate::collections::FORWARDED);
        let c = self.0.create_collection(req.into_inner(), fwd).await?;
        Ok(Response::new(CreateCollectionResponse {
            collection: Some(c),
        }))
    }

    async fn drop_collection(
        &self,
        req: Request<DropCollectionRequest>,
    ) -> Result<Response<DropCollectionResponse>, Status> {
        let fwd = req.metadata().contains_key(crate::collections::FORWARDED);
        self.0.drop_collection(&req.into_inner().name, fwd).await?;
        Ok(Response::new(DropCollectionResponse {}))
    }

    async fn list_collections(
        &self,
        _req: Request<ListCollectionsRequest>,
    ) -> Result<Response<ListCollectionsResponse>, Status> {
        Ok(Response::new(ListCollectionsResponse {
            collections: self.0.catalog.list(),
        }))
    }

    async fn describe_collection(
        &self,
        req: Request<DescribeCollectionRequest>,
    ) -> Result<Response<DescribeCollectionResponse>, Status> {
        let info = self.0.catalog.get(&req.into_inner().name)?;
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
        Ok(Response::new(self.0.upsert(req.into_inner()).await?))
    }

    async fn delete_documents(
        &self,
        req: Request<DeleteDocumentsRequest>,
    ) -> Result<Response<DeleteDocumentsResponse>, Status> {
        Ok(Response::new(self.0.delete(req.into_inner()).await?))
    }

    async fn search(
        &self,
        req: Request<SearchRequest>,
    ) -> Result<Response<SearchResponse>, Status> {
        Ok(Response::new(self.0.search(req.into_inner()).await?))
    }

    type AskStream = tokio_stream::wrappers::ReceiverStream<Result<AskResponse, Status>>;

    async fn ask(&self, req: Request<AskRequest>) -> Result<Response<Self::AskStream>, Status> {
        let rx = self.0.ask(req.into_inner()).await?;
        Ok(Response::new(tokio_stream::wrappers::ReceiverStream::new(
            rx,
        )))
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
        _req: Request<ClusterStatusRequest>,
    ) -> Result<Response<ClusterStatusResponse>, Status> {
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
        let fwd = req.metadata().contains_key(crate::collections::FORWARDED);
        let r = req.into_inner();
        let (tx, rx) = tokio::sync::mpsc::channel(64);
        // Moves change the catalog: they run on its leader.
        if let Some(addr) = self.0.catalog_leader(fwd).await? {
            let ch = self.0.clients.channel(&addr)?;
            let mut up = ragcluster_proto::v1::admin_client::AdminClient::new(ch)
                .move_replica(crate::collections::forward(r, Duration::from_secs(3600)))
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
        let r = req.into_inner();
        self.0
            .transfer_shard_leader(&r.collection, r.shard, &r.to)
            .await?;
        Ok(Response::new(TransferShardLeaderResponse {}))
    }
}
