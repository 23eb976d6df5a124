//! `ragcluster.v1.Shard` over gRPC. Every handler hands the blocking work (RocksDB, tantivy,
//! hnsw_rs) to the blocking pool so the async runtime keeps serving.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;

use ragcluster_proto::v1::shard_server::Shard as ShardRpc;
use ragcluster_proto::v1::*;
use tonic::{Request, Response, Status};

use crate::error::ShardError;
use crate::node::Node;

pub struct ShardService {
    node: Arc<Node>,
    write_timeout: Duration,
    fault_injection: bool,
}

impl ShardService {
    pub fn new(node: Arc<Node>, cfg: &crate::ShardNodeConfig) -> Self {
        Self {
            node,
            write_timeout: cfg.write_timeout,
            fault_injection: cfg.fault_injection,
        }
    }

    /// For strong reads: a read-index round on the replica before it answers.
    async fn consistent(&self, shard: Option<&ShardRef>, consistency: i32) -> Result<(), Status> {
        if consistency == Consistency::Strong as i32 {
            let r = self.node.replica(shard)?;
            r.read_index(READ_INDEX_TIMEOUT).await?;
        }
        Ok(())
    }
}

const READ_INDEX_TIMEOUT: Duration = Duration::from_secs(3);

/// The caller's gRPC deadline ("grpc-timeout" header), if it sent one.
fn deadline<T>(req: &Request<T>) -> Option<Duration> {
    let v = req.metadata().get("grpc-timeout")?.to_str().ok()?;
    let (num, unit) = v.split_at(v.len().checked_sub(1)?);
    let n: u64 = num.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n * 3600),
        "M" => Duration::from_secs(n * 60),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
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
    async fn node_info(
        &self,
        _req: Request<NodeInfoRequest>,
    ) -> Result<Response<NodeInfoResponse>, Status> {
        let node = self.node.clone();
        let shards = blocking(move || {
            node.replicas()
                .into_iter()
                .map(|r| {
                    let mut i = r.shard.info()?;
                    i.raft = Some(r.status());
                    Ok(i)
                })
                .collect::<Result<Vec<_>, ShardError>>()
        })
        .await?;
        Ok(Response::new(NodeInfoResponse {
            node_id: self.node.node_id(),
            shards,
        }))
    }

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
        let replica = self.node.replica(req.get_ref().shard.as_ref())?;
        let timeout = deadline(&req).map_or(self.write_timeout, |d| d.min(self.write_timeout));
        let started = std::time::Instant::now();
        let r = replica.write(req.into_inner(), timeout).await?;
        // Proposal to applied-on-leader: the commit latency clients see.
        metrics::histogram!("raft_proposal_seconds").record(started.elapsed().as_secs_f64());
        Ok(Response::new(r))
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
        self.consistent(r.shard.as_ref(), r.consistency).await?;
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
        self.consistent(r.shard.as_ref(), r.consistency).await?;
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
        self.consistent(r.shard.as_ref(), r.consistency).await?;
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
        let replica = self.node.replica(req.get_ref().shard.as_ref())?;
        let r = replica.clone();
        let mut info = blocking(move || r.shard.info()).await?;
        info.raft = Some(replica.status());
        Ok(Response::new(info))
    }

    async fn change_replicas(
        &self,
        req: Request<ChangeReplicasRequest>,
    ) -> Result<Response<ChangeReplicasResponse>, Status> {
        use raft::eraftpb::{ConfChange, ConfChangeType};
        let r = req.into_inner();
        let replica = self.node.replica(r.shard.as_ref())?;
        let peer = r
            .peer
            .ok_or_else(|| Status::invalid_argument("peer is required"))?;
        if peer.node_id == 0 {
            return Err(Status::invalid_argument("peer.node_id must be non-zero"));
        }
        let kind = match ReplicaChange::try_from(r.change) {
            Ok(ReplicaChange::AddLearner) => ConfChangeType::AddLearnerNode,
            Ok(ReplicaChange::Promote) => ConfChangeType::AddNode,
            Ok(ReplicaChange::Remove) => ConfChangeType::RemoveNode,
            _ => return Err(Status::invalid_argument("change is required")),
        };
        if kind == ConfChangeType::AddLearnerNode && !peer.address.starts_with("http") {
            return Err(Status::invalid_argument(
                "peer.address (http://host:port) is required to add a replica",
            ));
        }
        let mut cc = ConfChange::default();
        cc.set_change_type(kind);
        cc.node_id = peer.node_id;
        cc.context = peer.address.into_bytes();
        let cs = replica.change(cc, self.write_timeout).await?;
        Ok(Response::new(ChangeReplicasResponse {
            voters: cs.voters,
            learners: cs.learners,
        }))
    }

    async fn transfer_leader(
        &self,
        req: Request<TransferLeaderRequest>,
    ) -> Result<Response<TransferLeaderResponse>, Status> {
        let r = req.into_inner();
        let replica = self.node.replica(r.shard.as_ref())?;
        let st = replica.status();
        if st.role != "leader" {
            return Err(ShardError::NotLeader(
                (st.leader_id != 0).then(|| (st.leader_id, st.leader_address.clone())),
            )
            .into());
        }
        if !st.voters.contains(&r.to_node_id) {
            return Err(Status::failed_precondition(format!(
                "node {} is not a voter of this shard",
                r.to_node_id
            )));
        }
        replica.transfer_leader(r.to_node_id)?;
        // Leadership moves within a few heartbeats when the target is caught up. Raft aborts
        // a transfer the target does not finish within an election timeout (a busy or lagging
        // target), so while this replica still leads, ask again now and then.
        let me = st.leader_id;
        let until = std::time::Instant::now() + self.write_timeout;
        let mut asked = std::time::Instant::now();
        while std::time::Instant::now() < until {
            let now = replica.status().leader_id;
            if now == r.to_node_id {
                return Ok(Response::new(TransferLeaderResponse {}));
            }
            if now == me && asked.elapsed() >= Duration::from_secs(1) {
                replica.transfer_leader(r.to_node_id)?;
                asked = std::time::Instant::now();
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Err(Status::unavailable(format!(
            "leadership did not move to node {} in time (is it caught up?)",
            r.to_node_id
        )))
    }

    async fn raft(
        &self,
        req: Request<tonic::Streaming<RaftBatch>>,
    ) -> Result<Response<RaftDone>, Status> {
        let mut stream = req.into_inner();
        let transport = self.node.transport().clone();
        while let Some(batch) = stream.next().await {
            let batch = batch?;
            for m in &batch.messages {
                transport.deliver(batch.from_node_id, m);
            }
        }
        Ok(Response::new(RaftDone {}))
    }

    async fn install_snapshot(
        &self,
        req: Request<tonic::Streaming<SnapshotChunk>>,
    ) -> Result<Response<RaftDone>, Status> {
        use protobuf::Message as _;
        use tokio::io::AsyncWriteExt;
        let mut stream = req.into_inner();
        let first = stream
            .next()
            .await
            .ok_or_else(|| Status::invalid_argument("empty snapshot stream"))??;
        let transport = self.node.transport().clone();
        if transport.is_isolated(first.from_node_id) {
            return Err(Status::unavailable("isolated (fault injection)"));
        }
        let rm = first
            .message
            .ok_or_else(|| Status::invalid_argument("first chunk carries no raft message"))?;
        let mut msg = raft::eraftpb::Message::default();
        msg.merge_from_bytes(&rm.message)
            .map_err(|e| Status::invalid_argument(format!("raft message: {e}")))?;
        let shard = self.node.replica(rm.shard.as_ref())?.shard.clone();
        let meta = msg.get_snapshot().get_metadata().clone();
        let desc = crate::raft::snapshot::Descriptor::decode(&msg.get_snapshot().data)?;
        let dir = transport.snap_dir().to_path_buf();
        let tmp = crate::raft::snapshot::temp_path(&dir, &shard.key, meta.index, meta.term);
        let mut f = tokio::fs::File::create(&tmp).await?;
        let mut size = first.data.len() as u64;
        f.write_all(&first.data).await?;
        while let Some(chunk) = stream.next().await {
            let chunk = chunk?;
            size += chunk.data.len() as u64;
            if size > desc.size {
                let _ = tokio::fs::remove_file(&tmp).await;
                return Err(Status::data_loss("snapshot stream longer than announced"));
            }
            f.write_all(&chunk.data).await?;
        }
        f.sync_all().await?;
        drop(f);
        let checked = {
            let tmp = tmp.clone();
            tokio::task::spawn_blocking(move || crate::raft::snapshot::verify(&tmp, &desc))
                .await
                .map_err(|e| Status::internal(e.to_string()))?
        };
        if let Err(e) = checked {
            let _ = tokio::fs::remove_file(&tmp).await;
            metrics::counter!("raft_snapshots_rejected_total").increment(1);
            tracing::warn!(shard = %shard.key, error = %e, "snapshot rejected");
            return Err(Status::data_loss(e.to_string()));
        }
        let path = crate::raft::snapshot::received_path(&dir, &shard.key, meta.index, meta.term);
        tokio::fs::rename(&tmp, &path).await?;
        metrics::counter!("raft_snapshots_received_total").increment(1);
        transport.deliver(first.from_node_id, &rm);
        Ok(Response::new(RaftDone {}))
    }

    async fn set_faults(
        &self,
        req: Request<SetFaultsRequest>,
    ) -> Result<Response<SetFaultsResponse>, Status> {
        if !self.fault_injection {
            return Err(Status::failed_precondition(
                "fault injection is disabled (shard_node.fault_injection)",
            ));
        }
        let r = req.into_inner();
        let f = &self.node.transport().faults;
        *f.isolated.write() = r.isolate_from.into_iter().collect();
        f.corrupt_snapshots
            .store(r.corrupt_snapshots, std::sync::atomic::Ordering::SeqCst);
        tracing::warn!(isolated = ?f.isolated.read(), corrupt = r.corrupt_snapshots, "faults set");
        Ok(Response::new(SetFaultsResponse {}))
    }
}
