//! One shard node as the coordinator calls it (`ShardNode`), and how an address becomes one
//! (`Connector`): over gRPC (`GrpcConnector`), or directly for a node in this process
//! (`local`: a co-located node, or every node of a test's one-process cluster). Every call
//! carries its deadline to the node; the small reads of queries go on the node's `Reads`
//! stream (`reads`).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use ragcluster_proto::v1::shard_client::ShardClient;
use ragcluster_proto::v1::*;
use tonic::transport::Channel;

use ragcluster_proto::v1::read_call::Call;
use ragcluster_proto::v1::read_reply::Reply;

use super::reads::{Conn, MAX_STREAM_ITEMS, ReadStream};
use crate::channels::{Channels, MAX_MESSAGE, expired};
use crate::error::ShardCallError;

type Result<T> = std::result::Result<T, ShardCallError>;

/// A shard's export (`Shard.Export`): its documents as of one moment, message by message.
pub type ExportStream = futures::stream::BoxStream<'static, Result<ExportPart>>;

/// How long an export may take to start (its read index); the stream itself has no deadline.
pub const EXPORT_START: Duration = Duration::from_secs(10);

/// The calls the coordinator makes to a shard node.
#[tonic::async_trait]
pub trait ShardNode: Send + Sync {
    async fn node_info(&self, timeout: Duration) -> Result<NodeInfoResponse>;
    async fn open_shard(&self, req: OpenShardRequest, timeout: Duration) -> Result<()>;
    async fn drop_shard(&self, shard: ShardRef, timeout: Duration) -> Result<()>;
    async fn write_batch(
        &self,
        req: WriteBatchRequest,
        timeout: Duration,
    ) -> Result<WriteBatchResponse>;
    /// Hits, or `stats_stale` when the statistics sent no longer match the shard.
    async fn bm25_search(
        &self,
        req: Bm25SearchRequest,
        timeout: Duration,
    ) -> Result<ShardSearchResponse>;
    async fn vector_search(
        &self,
        req: VectorSearchRequest,
        timeout: Duration,
    ) -> Result<Vec<ShardHit>>;
    async fn term_statistics(
        &self,
        req: TermStatisticsRequest,
        timeout: Duration,
    ) -> Result<TermStatisticsResponse>;
    async fn get_chunks(&self, req: GetChunksRequest, timeout: Duration) -> Result<Vec<Chunk>>;
    async fn get_neighbours(
        &self,
        req: GetNeighboursRequest,
        timeout: Duration,
    ) -> Result<Vec<Chunk>>;
    /// One shard's part of a Scroll page.
    async fn scan(&self, req: ScanRequest, timeout: Duration) -> Result<ScanResponse>;
    async fn count(&self, req: ShardCountRequest, timeout: Duration) -> Result<ShardCountResponse>;
    async fn shard_info(&self, shard: ShardRef, timeout: Duration) -> Result<ShardInfoResponse>;
    async fn change_replicas(
        &self,
        req: ChangeReplicasRequest,
        timeout: Duration,
    ) -> Result<ChangeReplicasResponse>;
    async fn transfer_leader(&self, req: TransferLeaderRequest, timeout: Duration) -> Result<()>;
    /// Starts a shard's export (backups) within `EXPORT_START`.
    async fn export(&self, req: ExportRequest) -> Result<ExportStream>;
}

/// Resolves a shard node's address.
pub trait Connector: Send + Sync {
    fn node(&self, address: &str) -> Result<Arc<dyn ShardNode>>;

    /// The address of the shard node running in this process, if any: eventual reads
    /// prefer its replicas (`Routing`), which cost no network hop.
    fn local_address(&self) -> Option<&str> {
        None
    }
}

/// Shard nodes over gRPC, on the coordinator's member channels.
pub struct GrpcConnector {
    channels: Arc<Channels>,
    nodes: Mutex<HashMap<String, Arc<GrpcShardNode>>>,
    /// Small reads go on each node's `Reads` stream (`reads`); off: one unary call each.
    read_streams: bool,
}

impl GrpcConnector {
    pub fn new(channels: Arc<Channels>, read_streams: bool) -> Self {
        Self {
            channels,
            nodes: Mutex::new(HashMap::new()),
            read_streams,
        }
    }
}

impl Connector for GrpcConnector {
    fn node(&self, address: &str) -> Result<Arc<dyn ShardNode>> {
        if let Some(n) = self.nodes.lock().get(address) {
            return Ok(n.clone());
        }
        let ch = self.channels.get(address).map_err(|e| {
            ShardCallError::Rejected(tonic::Status::invalid_argument(e.to_string()))
        })?;
        let client = ShardClient::new(ch)
            .max_decoding_message_size(MAX_MESSAGE)
            .max_encoding_message_size(MAX_MESSAGE);
        let reads = self.read_streams.then(|| ReadStream::new(client.clone()));
        let n = Arc::new(GrpcShardNode { client, reads });
        self.nodes.lock().insert(address.to_owned(), n.clone());
        Ok(n)
    }
}

pub struct GrpcShardNode {
    client: ShardClient<Channel>,
    reads: Option<ReadStream>,
}

impl GrpcShardNode {
    /// The node's read stream for a read of `items` hits or chunks, if that read goes on it.
    async fn stream(&self, items: usize, timeout: Duration) -> Result<Option<Arc<Conn>>> {
        match &self.reads {
            Some(r) if items <= MAX_STREAM_ITEMS => r.conn(timeout).await,
            _ => Ok(None),
        }
    }
}

/// A reply of a kind the call does not answer with (a node bug, not the caller's).
fn mismatched() -> ShardCallError {
    ShardCallError::Rejected(tonic::Status::internal(
        "shard node answered a read with the wrong reply",
    ))
}

/// A request with a gRPC deadline, so the node stops working when we stop waiting.
pub fn request<T>(msg: T, timeout: Duration) -> tonic::Request<T> {
    let mut r = tonic::Request::new(msg);
    r.set_timeout(timeout);
    r
}

/// Awaits a call under `timeout` (a node that accepted the connection but hangs), typing its
/// status. In-process implementations await their handlers through it too.
pub async fn call<T>(
    timeout: Duration,
    fut: impl Future<Output = std::result::Result<tonic::Response<T>, tonic::Status>>,
) -> Result<T> {
    let started = Instant::now();
    match tokio::time::timeout(timeout, fut).await {
        Err(_) => Err(ShardCallError::Deadline),
        // Cut at its deadline (CANCELLED from the node, a reset stream): the deadline's doing.
        Ok(Err(s)) if expired(&s, started.elapsed(), timeout) => Err(ShardCallError::Deadline),
        Ok(Err(s)) => Err(ShardCallError::from_status(s)),
        Ok(Ok(r)) => Ok(r.into_inner()),
    }
}

#[tonic::async_trait]
impl ShardNode for GrpcShardNode {
    async fn node_info(&self, timeout: Duration) -> Result<NodeInfoResponse> {
        let mut c = self.client.clone();
        call(timeout, c.node_info(request(NodeInfoRequest {}, timeout))).await
    }

    async fn open_shard(&self, req: OpenShardRequest, timeout: Duration) -> Result<()> {
        let mut c = self.client.clone();
        call(timeout, c.open_shard(request(req, timeout)))
            .await
            .map(|_| ())
    }

    async fn drop_shard(&self, shard: ShardRef, timeout: Duration) -> Result<()> {
        let mut c = self.client.clone();
        let req = DropShardRequest { shard: Some(shard) };
        call(timeout, c.drop_shard(request(req, timeout)))
            .await
            .map(|_| ())
    }

    async fn write_batch(
        &self,
        req: WriteBatchRequest,
        timeout: Duration,
    ) -> Result<WriteBatchResponse> {
        let mut c = self.client.clone();
        call(timeout, c.write_batch(request(req, timeout))).await
    }

    async fn bm25_search(
        &self,
        req: Bm25SearchRequest,
        timeout: Duration,
    ) -> Result<ShardSearchResponse> {
        if let Some(conn) = self.stream(req.top_k as usize, timeout).await? {
            return match conn.call(Call::Bm25(req), timeout).await? {
                Reply::Search(r) => Ok(r),
                _ => Err(mismatched()),
            };
        }
        let mut c = self.client.clone();
        call(timeout, c.bm25_search(request(req, timeout))).await
    }

    async fn vector_search(
        &self,
        req: VectorSearchRequest,
        timeout: Duration,
    ) -> Result<Vec<ShardHit>> {
        if let Some(conn) = self.stream(req.top_k as usize, timeout).await? {
            return match conn.call(Call::Vector(req), timeout).await? {
                Reply::Search(r) => Ok(r.hits),
                _ => Err(mismatched()),
            };
        }
        let mut c = self.client.clone();
        Ok(call(timeout, c.vector_search(request(req, timeout)))
            .await?
            .hits)
    }

    async fn term_statistics(
        &self,
        req: TermStatisticsRequest,
        timeout: Duration,
    ) -> Result<TermStatisticsResponse> {
        if let Some(conn) = self.stream(1, timeout).await? {
            return match conn.call(Call::TermStats(req), timeout).await? {
                Reply::TermStats(r) => Ok(r),
                _ => Err(mismatched()),
            };
        }
        let mut c = self.client.clone();
        call(timeout, c.term_statistics(request(req, timeout))).await
    }

    async fn get_chunks(&self, req: GetChunksRequest, timeout: Duration) -> Result<Vec<Chunk>> {
        // Embeddings make a chunk ~10x bigger: those loads keep a call of their own.
        let items = if req.with_embedding || !req.doc_ids.is_empty() {
            usize::MAX
        } else {
            req.chunk_ids.len()
        };
        if let Some(conn) = self.stream(items, timeout).await? {
            return match conn.call(Call::Chunks(req), timeout).await? {
                Reply::Chunks(r) => Ok(r.chunks),
                _ => Err(mismatched()),
            };
        }
        let mut c = self.client.clone();
        Ok(call(timeout, c.get_chunks(request(req, timeout)))
            .await?
            .chunks)
    }

    async fn get_neighbours(
        &self,
        req: GetNeighboursRequest,
        timeout: Duration,
    ) -> Result<Vec<Chunk>> {
        let mut c = self.client.clone();
        Ok(call(timeout, c.get_neighbours(request(req, timeout)))
            .await?
            .chunks)
    }

    async fn scan(&self, req: ScanRequest, timeout: Duration) -> Result<ScanResponse> {
        let mut c = self.client.clone();
        call(timeout, c.scan(request(req, timeout))).await
    }

    async fn count(&self, req: ShardCountRequest, timeout: Duration) -> Result<ShardCountResponse> {
        let mut c = self.client.clone();
        call(timeout, c.count(request(req, timeout))).await
    }

    async fn shard_info(&self, shard: ShardRef, timeout: Duration) -> Result<ShardInfoResponse> {
        let mut c = self.client.clone();
        let req = ShardInfoRequest { shard: Some(shard) };
        call(timeout, c.shard_info(request(req, timeout))).await
    }

    async fn change_replicas(
        &self,
        req: ChangeReplicasRequest,
        timeout: Duration,
    ) -> Result<ChangeReplicasResponse> {
        let mut c = self.client.clone();
        call(timeout, c.change_replicas(request(req, timeout))).await
    }

    async fn transfer_leader(&self, req: TransferLeaderRequest, timeout: Duration) -> Result<()> {
        let mut c = self.client.clone();
        call(timeout, c.transfer_leader(request(req, timeout)))
            .await
            .map(|_| ())
    }

    async fn export(&self, req: ExportRequest) -> Result<ExportStream> {
        use futures::StreamExt;
        let mut c = self.client.clone();
        let parts = call(EXPORT_START, c.export(tonic::Request::new(req))).await?;
        Ok(parts
            .map(|p| p.map_err(ShardCallError::from_status))
            .boxed())
    }
}
