//! `ragcluster.v1.Shard` over gRPC. Every handler hands the blocking work (RocksDB, tantivy,
//! hnsw_rs) to the blocking pool so the async runtime keeps serving.

use std::sync::Arc;

use ragcluster_proto::v1::shard_server::Shard as ShardRpc;
use ragcluster_proto::v1::*;
use tonic::{Request, Response, Status};

use crate::error::ShardError;
use crate::node::Node;

pub struct ShardService {
    node: Arc<Node>,
}

impl ShardService {
    pub fn new(node: Arc<Node>) -> Self {
        Self { node }
    }
}

/// Runs a short read (a search, a lookup) in place: the worker thread hands its other tasks
/// to the rest of the runtime instead of paying a thread hand-off per request.
fn read<T>(f: impl FnOnce() -> Result<T, ShardError>) -> Result<T, Status> {
    tokio::task::block_in_place(f).map_err(Status::from)
}

/// Runs `f` on the blocking pool and maps its error to a gRPC status.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, ShardError> + Send + 'static,
) -> Result<T, Status> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| Status::from(ShardError::Join(e.to_string())))?
        .map_err(Status::from)
}

fn filter(m: &std::collections::HashMap<String, String>) -> Vec<(String, String)> {
    let mut f: Vec<_> = m.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
    f.sort();
    f
}

fn hits(v: Vec<(Chunk, f32)>) -> ShardSearchResponse {
    ShardSearchResponse {
        hits: v
            .into_iter()
            .map(|(c, s)| ShardHit {
                chunk: Some(c),
                score: s,
            })
            .collect(),
    }
}

const MAX_TOP_K: u32 = 10_000;

#[tonic::async_trait]
impl ShardRpc for ShardService {
    async fn open_shard(
        &self,
        req: Request<OpenShardRequest>,
    ) -> Result<Response<OpenShardResponse>, Status> {
        let node = self.node.clone();
        blocking(move || node.open_shard(req.into_inner())).await?;
        Ok(Response::new(OpenShardResponse {}))
    }

    async fn drop_shard(
        &self,
        req: Request<DropShardRequest>,
    ) -> Result<Response<DropShardResponse>, Status> {
        let node = self.node.clone();
        blocking(move || node.drop_shard(req.get_ref().shard.as_ref())).await?;
        Ok(Response::new(DropShardResponse {}))
    }

    async fn write_batch(
        &self,
        req: Request<WriteBatchRequest>,
    ) -> Result<Response<WriteBatchResponse>, Status> {
        let shard = self.node.shard(req.get_ref().shard.as_ref())?;
        let started = std::time::Instant::now();
        let applied = blocking(move || shard.apply(req.into_inner())).await?;
        metrics::histogram!("shard_write_batch_seconds").record(started.elapsed().as_secs_f64());
        Ok(Response::new(WriteBatchResponse {
            applied_seq: applied.seq,
            existed: applied.effect.existed,
            not_found: applied.effect.not_found,
        }))
    }

    async fn bm25_search(
        &self,
        req: Request<Bm25SearchRequest>,
    ) -> Result<Response<ShardSearchResponse>, Status> {
        let r = req.into_inner();
        let shard = self.node.shard(r.shard.as_ref())?;
        if r.top_k == 0 || r.top_k > MAX_TOP_K {
            return Err(Status::invalid_argument(format!(
                "top_k must be in [1, {MAX_TOP_K}]"
            )));
        }
        let v = read(|| {
            shard.bm25_search(
                &r.query,
                r.top_k as usize,
                &filter(&r.filter),
                r.stats.as_ref(),
                r.ids_only,
            )
        })?;
        Ok(Response::new(hits(v)))
    }

    async fn vector_search(
        &self,
        req: Request<VectorSearchRequest>,
    ) -> Result<Response<ShardSearchResponse>, Status> {
        let r = req.into_inner();
        let shard = self.node.shard(r.shard.as_ref())?;
        if r.top_k == 0 || r.top_k > MAX_TOP_K {
            return Err(Status::invalid_argument(format!(
                "top_k must be in [1, {MAX_TOP_K}]"
            )));
        }
        let ef = if r.ef_search == 0 {
            shard.params.ef_search.max(1)
        } else {
            r.ef_search
        } as usize;
        let v = read(|| {
            shard.vector_search(
                &r.vector,
                r.top_k as usize,
                ef,
                &filter(&r.filter),
                r.ids_only,
            )
        })?;
        Ok(Response::new(hits(v)))
    }

    async fn term_statistics(
        &self,
        req: Request<TermStatisticsRequest>,
    ) -> Result<Response<TermStatisticsResponse>, Status> {
        let r = req.into_inner();
        let shard = self.node.shard(r.shard.as_ref())?;
        let s = read(|| shard.term_stats(&r.query))?;
        Ok(Response::new(TermStatisticsResponse {
            num_docs: s.num_docs,
            total_tokens: s.total_tokens,
            doc_freq: s.doc_freq,
        }))
    }

    async fn get_chunks(
        &self,
        req: Request<GetChunksRequest>,
    ) -> Result<Response<GetChunksResponse>, Status> {
        let r = req.into_inner();
        let shard = self.node.shard(r.shard.as_ref())?;
        let chunks = read(|| shard.get_chunks(&r.chunk_ids, r.with_embedding))?;
        Ok(Response::new(GetChunksResponse { chunks }))
    }

    async fn get_neighbours(
        &self,
        req: Request<GetNeighboursRequest>,
    ) -> Result<Response<GetChunksResponse>, Status> {
        let r = req.into_inner();
        let shard = self.node.shard(r.shard.as_ref())?;
        let chunks =
            blocking(move || shard.neighbours(&r.chunk_id, r.before.min(64), r.after.min(64)))
                .await?;
        Ok(Response::new(GetChunksResponse { chunks }))
    }

    async fn shard_info(
        &self,
        req: Request<ShardInfoRequest>,
    ) -> Result<Response<ShardInfoResponse>, Status> {
        let shard = self.node.shard(req.get_ref().shard.as_ref())?;
        let info = blocking(move || shard.info()).await?;
        Ok(Response::new(info))
    }
}
