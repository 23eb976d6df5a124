//! The typed shard reads: each request is pinned (`Pinned`: its shard, consistency and the
//! read token's floor for that shard) and sent through `Shards::read`'s failover, so every
//! read kind (search, chunks, scroll, count...) follows the same replica and token rules.

use ragcluster_proto::v1::*;

use super::{ReadPlan, ShardCallError, ShardNode, Shards};
use crate::error::Result;

/// A shard read request: where it goes and what it must see.
pub trait Pinned: Clone {
    fn pin(&mut self, plan: &ReadPlan<'_>, shard: u32);
}

/// `Pinned` for requests with `shard`, `min_applied_seq` and, when named, `consistency`.
macro_rules! pinned {
    (consistency: $($t:ty),*) => {$(
        impl Pinned for $t {
            fn pin(&mut self, plan: &ReadPlan<'_>, shard: u32) {
                self.shard = plan.sref(shard);
                self.consistency = plan.consistency as i32;
                self.min_applied_seq = plan.min_applied(shard);
            }
        }
    )*};
    ($($t:ty),*) => {$(
        impl Pinned for $t {
            fn pin(&mut self, plan: &ReadPlan<'_>, shard: u32) {
                self.shard = plan.sref(shard);
                self.min_applied_seq = plan.min_applied(shard);
            }
        }
    )*};
}
pinned!(consistency: Bm25SearchRequest, VectorSearchRequest, GetChunksRequest, ScanRequest, ShardCountRequest);
pinned!(TermStatisticsRequest, GetNeighboursRequest);

type Node = std::sync::Arc<dyn ShardNode>;

impl Shards {
    /// `req` pinned to `shard` and sent by `call`, starting on replica `first`.
    async fn pinned<R, T, F, Fut>(
        &self,
        plan: &ReadPlan<'_>,
        shard: u32,
        first: &str,
        mut req: R,
        call: F,
    ) -> Result<T>
    where
        R: Pinned,
        F: Fn(Node, R, std::time::Duration) -> Fut,
        Fut: Future<Output = std::result::Result<T, ShardCallError>>,
    {
        req.pin(plan, shard);
        self.read(plan, shard, first, |n, t| call(n, req.clone(), t))
            .await
    }

    pub async fn bm25(
        &self,
        plan: &ReadPlan<'_>,
        shard: u32,
        first: &str,
        req: Bm25SearchRequest,
    ) -> Result<ShardSearchResponse> {
        self.pinned(plan, shard, first, req, async |n, r, t| {
            n.bm25_search(r, t).await
        })
        .await
    }

    pub async fn vector(
        &self,
        plan: &ReadPlan<'_>,
        shard: u32,
        first: &str,
        req: VectorSearchRequest,
    ) -> Result<Vec<ShardHit>> {
        self.pinned(plan, shard, first, req, async |n, r, t| {
            n.vector_search(r, t).await
        })
        .await
    }

    pub async fn term_stats(
        &self,
        plan: &ReadPlan<'_>,
        shard: u32,
        first: &str,
        query: &str,
    ) -> Result<TermStatisticsResponse> {
        let req = TermStatisticsRequest {
            query: query.to_owned(),
            ..Default::default()
        };
        self.pinned(plan, shard, first, req, async |n, r, t| {
            n.term_statistics(r, t).await
        })
        .await
    }

    /// Chunks by id (with their embeddings when asked); ids no longer stored are left out.
    pub async fn chunks(
        &self,
        plan: &ReadPlan<'_>,
        shard: u32,
        first: &str,
        chunk_ids: Vec<String>,
        with_embedding: bool,
    ) -> Result<Vec<Chunk>> {
        let req = GetChunksRequest {
            chunk_ids,
            with_embedding,
            ..Default::default()
        };
        self.pinned(plan, shard, first, req, async |n, r, t| {
            n.get_chunks(r, t).await
        })
        .await
    }

    /// Every chunk of documents `doc_ids` (all owned by `shard`), each in position order.
    pub async fn documents(
        &self,
        plan: &ReadPlan<'_>,
        shard: u32,
        first: &str,
        doc_ids: Vec<String>,
        with_embedding: bool,
    ) -> Result<Vec<Chunk>> {
        let req = GetChunksRequest {
            doc_ids,
            with_embedding,
            ..Default::default()
        };
        self.pinned(plan, shard, first, req, async |n, r, t| {
            n.get_chunks(r, t).await
        })
        .await
    }

    /// A chunk with up to `before` preceding and `after` following chunks of its document.
    pub async fn neighbours(
        &self,
        plan: &ReadPlan<'_>,
        shard: u32,
        chunk_id: &str,
        before: u32,
        after: u32,
    ) -> Result<Vec<Chunk>> {
        let first = self.routing.read_target(
            plan.collection,
            shard,
            plan.replicas(shard),
            plan.consistency,
        );
        let req = GetNeighboursRequest {
            chunk_id: chunk_id.to_owned(),
            before,
            after,
            ..Default::default()
        };
        self.pinned(plan, shard, &first, req, async |n, r, t| {
            n.get_neighbours(r, t).await
        })
        .await
    }

    /// One shard's part of a Scroll page.
    pub async fn scan(
        &self,
        plan: &ReadPlan<'_>,
        shard: u32,
        first: &str,
        req: ScanRequest,
    ) -> Result<ScanResponse> {
        self.pinned(plan, shard, first, req, async |n, r, t| n.scan(r, t).await)
            .await
    }

    /// One shard's count of the chunks and documents matching the request's filters.
    pub async fn count(
        &self,
        plan: &ReadPlan<'_>,
        shard: u32,
        first: &str,
        req: ShardCountRequest,
    ) -> Result<ShardCountResponse> {
        self.pinned(plan, shard, first, req, async |n, r, t| n.count(r, t).await)
            .await
    }
}
