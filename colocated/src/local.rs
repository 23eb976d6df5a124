//! `LocalNode`: the coordinator's `ShardNode` calls made directly on a shard node's
//! `ShardService` handlers. Requests keep their deadlines (`grpc-timeout`), so the node behaves
//! as it does for a call over the wire; only the transport is gone.

use std::sync::Arc;
use std::time::Duration;

use coordinator::shards::node::{EXPORT_START, ExportStream, call, request};
use coordinator::shards::{ShardCallError, ShardNode};
use ragcluster_proto::v1::shard_server::Shard as ShardRpc;
use ragcluster_proto::v1::*;
use shard_node::service::ShardService;

type Result<T> = std::result::Result<T, ShardCallError>;

/// A shard node's gRPC service, called in process.
pub struct LocalNode {
    svc: ShardService,
}

impl LocalNode {
    pub fn new(node: Arc<shard_node::Node>, cfg: &shard_node::ShardNodeConfig) -> Self {
        Self {
            svc: ShardService::new(node, cfg),
        }
    }
}

#[tonic::async_trait]
impl ShardNode for LocalNode {
    async fn node_info(&self, timeout: Duration) -> Result<NodeInfoResponse> {
        call(
            timeout,
            self.svc.node_info(request(NodeInfoRequest {}, timeout)),
        )
        .await
    }

    async fn open_shard(&self, req: OpenShardRequest, timeout: Duration) -> Result<()> {
        call(timeout, self.svc.open_shard(request(req, timeout)))
            .await
            .map(|_| ())
    }

    async fn drop_shard(&self, shard: ShardRef, timeout: Duration) -> Result<()> {
        let req = DropShardRequest { shard: Some(shard) };
        call(timeout, self.svc.drop_shard(request(req, timeout)))
            .await
            .map(|_| ())
    }

    async fn write_batch(
        &self,
        req: WriteBatchRequest,
        timeout: Duration,
    ) -> Result<WriteBatchResponse> {
        call(timeout, self.svc.write_batch(request(req, timeout))).await
    }

    async fn bm25_search(
        &self,
        req: Bm25SearchRequest,
        timeout: Duration,
    ) -> Result<ShardSearchResponse> {
        call(timeout, self.svc.bm25_search(request(req, timeout))).await
    }

    async fn vector_search(
        &self,
        req: VectorSearchRequest,
        timeout: Duration,
    ) -> Result<Vec<ShardHit>> {
        Ok(call(timeout, self.svc.vector_search(request(req, timeout)))
            .await?
            .hits)
    }

    async fn term_statistics(
        &self,
        req: TermStatisticsRequest,
        timeout: Duration,
    ) -> Result<TermStatisticsResponse> {
        call(timeout, self.svc.term_statistics(request(req, timeout))).await
    }

    async fn get_chunks(&self, req: GetChunksRequest, timeout: Duration) -> Result<Vec<Chunk>> {
        Ok(call(timeout, self.svc.get_chunks(request(req, timeout)))
            .await?
            .chunks)
    }

    async fn get_neighbours(
        &self,
        req: GetNeighboursRequest,
        timeout: Duration,
    ) -> Result<Vec<Chunk>> {
        Ok(
            call(timeout, self.svc.get_neighbours(request(req, timeout)))
                .await?
                .chunks,
        )
    }

    async fn scan(&self, req: ScanRequest, timeout: Duration) -> Result<ScanResponse> {
        call(timeout, self.svc.scan(request(req, timeout))).await
    }

    async fn count(&self, req: ShardCountRequest, timeout: Duration) -> Result<ShardCountResponse> {
        call(timeout, self.svc.count(request(req, timeout))).await
    }

    async fn shard_info(&self, shard: ShardRef, timeout: Duration) -> Result<ShardInfoResponse> {
        let req = ShardInfoRequest { shard: Some(shard) };
        call(timeout, self.svc.shard_info(request(req, timeout))).await
    }

    async fn change_replicas(
        &self,
        req: ChangeReplicasRequest,
        timeout: Duration,
    ) -> Result<ChangeReplicasResponse> {
        call(timeout, self.svc.change_replicas(request(req, timeout))).await
    }

    async fn transfer_leader(&self, req: TransferLeaderRequest, timeout: Duration) -> Result<()> {
        call(timeout, self.svc.transfer_leader(request(req, timeout)))
            .await
            .map(|_| ())
    }

    async fn export(&self, req: ExportRequest) -> Result<ExportStream> {
        use futures::StreamExt;
        let parts = call(EXPORT_START, self.svc.export(tonic::Request::new(req))).await?;
        Ok(parts
            .map(|p| p.map_err(ShardCallError::from_status))
            .boxed())
    }
}
