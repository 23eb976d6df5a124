//! `ragcluster.v1.Shard` over gRPC. Every handler hands the blocking work (RocksDB, tantivy,
//! hnsw_rs) to the blocking pool so the async runtime keeps serving. Requests become domain
//! values in `convert`, the one place the wire meets the node. `reads` serves the small reads
//! multiplexed on one stream; `forward` passes writes that reach a follower on to the leader.

pub mod convert;
#[cfg(feature = "failpoints")]
pub mod failpoints;
pub mod forward;
pub mod reads;

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;

use ragcluster_proto::v1::shard_server::Shard as ShardRpc;
use ragcluster_proto::v1::*;
use tonic::{Request, Response, Status};

use crate::error::ShardError;
use crate::index::hnsw::Scan;
use crate::node::Node;
use crate::raft::Replica;
use crate::shard::{HitForm, Shard};

#[derive(Clone)]
pub struct ShardService {
    node: Arc<Node>,
    write_timeout: Duration,
    forward: forward::Forwarder,
}

impl ShardService {
    pub fn new(node: Arc<Node>, cfg: &crate::ShardNodeConfig) -> Self {
        Self {
            node,
            write_timeout: cfg.write_timeout,
            forward: forward::Forwarder::default(),
        }
    }

    fn replica(&self, r: Option<&ShardRef>) -> Result<Arc<Replica>, Status> {
        Ok(self.node.replica(&convert::key(r)?)?)
    }

    /// The shard of a replica in service (`Replica::serving`): what a snapshot is installed
    /// into, which a learner must accept.
    fn shard(&self, r: Option<&ShardRef>) -> Result<Arc<Shard>, Status> {
        let replica = self.replica(r)?;
        replica.serving()?;
        Ok(replica.shard.clone())
    }

    /// The shard a read is served from: only while its replica is in service and a voter
    /// (`Replica::readable`).
    fn read_shard(&self, r: Option<&ShardRef>) -> Result<Arc<Shard>, Status> {
        let replica = self.replica(r)?;
        replica.readable()?;
        Ok(replica.shard.clone())
    }

    /// Waits until the shard's searches see Raft index `seq` (a client's read token; 0: no
    /// wait), within the caller's deadline `wait` less a tenth: a replica that does not get
    /// there answers UNAVAILABLE while the caller still has time to ask another one. One that
    /// has not heard of `seq` being committed within `TOKEN_HEARD_WITHIN` gives up then.
    async fn caught_up(
        &self,
        r: Option<&ShardRef>,
        shard: &Shard,
        seq: u64,
        wait: Option<Duration>,
    ) -> Result<(), Status> {
        if seq == 0 || shard.visible_seq() >= seq {
            return Ok(());
        }
        let started = std::time::Instant::now();
        let wait = wait.unwrap_or(TOKEN_WAIT);
        let until = started + wait.saturating_sub((wait / 10).max(Duration::from_millis(2)));
        let heard = until.min(started + TOKEN_HEARD_WITHIN);
        let mut ok = shard.wait_visible(seq, heard).await.is_ok();
        if !ok && self.replica(r)?.status().commit_index >= seq {
            ok = shard.wait_visible(seq, until).await.is_ok();
        }
        if ok {
            metrics::histogram!("shard_read_token_wait_seconds")
                .record(started.elapsed().as_secs_f64());
            return Ok(());
        }
        metrics::counter!("shard_read_token_timeouts_total").increment(1);
        Err(ShardError::Unavailable(format!(
            "replica {} has applied {} of the {seq} this read's token asks for, after {} ms; \
             another replica may be further",
            shard.key,
            shard.visible_seq(),
            started.elapsed().as_millis()
        ))
        .into())
    }

    /// The start of every read: the shard `r` names, once it has applied the read token's
    /// `seq` (`caught_up`) and, for a strong read, confirmed its leader's commit (`consistent`).
    async fn ready(
        &self,
        r: Option<&ShardRef>,
        seq: u64,
        consistency: i32,
        wait: Option<Duration>,
    ) -> Result<Arc<Shard>, Status> {
        let shard = self.read_shard(r)?;
        self.caught_up(r, &shard, seq, wait).await?;
        self.consistent(r, consistency).await?;
        Ok(shard)
    }

    /// For strong reads: a read-index round on the replica before it answers.
    async fn consistent(&self, shard: Option<&ShardRef>, consistency: i32) -> Result<(), Status> {
        if consistency == Consistency::Strong as i32 {
            cut_from_clients()?;
            self.replica(shard)?.read_index(READ_INDEX_TIMEOUT).await?;
        }
        Ok(())
    }
}

fn info(r: &Replica) -> ShardInfoResponse {
    let st = r.status();
    let leader = r.leader_address(st.leader_id);
    let raft = convert::raft_status(
        &st,
        if st.is_leader() {
            String::new()
        } else {
            leader
        },
    );
    convert::shard_info(
        &r.shard.key,
        r.shard.figures(),
        Some(raft),
        r.shard.disk_bytes(),
    )
}

const READ_INDEX_TIMEOUT: Duration = Duration::from_secs(3);

/// Failpoint `cut_from_clients` (tests): writes and strong reads from clients are
/// refused as if the coordinator could not reach this node, while its peers still do (their
/// forwarded writes and Raft traffic pass).
fn cut_from_clients() -> Result<(), Status> {
    fail::fail_point!("cut_from_clients", |_| Err(Status::unavailable(
        "failpoint cut_from_clients: this node is cut off from its clients"
    )));
    Ok(())
}

/// How long a read waits for its token's index when the caller sent no deadline.
const TOKEN_WAIT: Duration = Duration::from_secs(5);
/// After this long, a replica that has not even learned that the token's index is committed
/// (cut off from its leader, or far behind) gives up at once instead of at the deadline.
const TOKEN_HEARD_WITHIN: Duration = Duration::from_millis(100);

/// Bytes per message of a shipped graph dump (under tonic's 4 MiB default).
const GRAPH_CHUNK_BYTES: usize = 1 << 20;

/// The caller's gRPC deadline ("grpc-timeout" header), if it sent one.
/// A result count (`top_k`, a scan's `limit`): in [1, MAX_TOP_K].
fn in_range(field: &str, n: u32) -> Result<(), Status> {
    if n == 0 || n > MAX_TOP_K {
        return Err(Status::invalid_argument(format!(
            "{field} must be in [1, {MAX_TOP_K}]"
        )));
    }
    Ok(())
}

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

/// Reads of up to this many items (results, chunks, graph-walk steps of a vector search as
/// `Shard::vector_search_cost` estimates them) run inline (`read`).
const INLINE_READ_ITEMS: usize = 256;

/// Runs a read on the calling async worker. A small one (a top-k search with ef_search, or a
/// lookup, of up to `INLINE_READ_ITEMS`: ~0.1-0.5 ms) runs inline: `block_in_place` hands the
/// worker's core to another thread on every call, a thread wake-up that cost more CPU than
/// the search itself (perf, 1-shard BM25 at 8 clients). A bigger one still leaves the core to
/// the other connections while it runs.
fn read<T>(items: usize, f: impl FnOnce() -> Result<T, ShardError>) -> Result<T, Status> {
    if items <= INLINE_READ_ITEMS {
        f().map_err(Status::from)
    } else {
        tokio::task::block_in_place(f).map_err(Status::from)
    }
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

/// A request's filter: its exact-match map and typed conditions together.
fn filter(
    m: &std::collections::HashMap<String, String>,
    conditions: Option<&ragcluster_proto::v1::Filter>,
) -> Result<crate::index::Filter, Status> {
    crate::index::Filter::of_request(m, conditions).map_err(Status::from)
}

fn hits(hits: Vec<ShardHit>) -> ShardSearchResponse {
    ShardSearchResponse {
        hits,
        stats_stale: false,
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
        let shards =
            blocking(move || Ok(node.replicas().iter().map(|r| info(r)).collect())).await?;
        Ok(Response::new(NodeInfoResponse {
            node_id: self.node.node_id(),
            shards,
            disk_full: self.node.space().full().unwrap_or_default(),
        }))
    }

    async fn open_shard(
        &self,
        req: Request<OpenShardRequest>,
    ) -> Result<Response<OpenShardResponse>, Status> {
        let open = convert::open_shard(req.into_inner())?;
        let node = self.node.clone();
        blocking(move || node.open_shard(open)).await?;
        Ok(Response::new(OpenShardResponse {}))
    }

    async fn drop_shard(
        &self,
        req: Request<DropShardRequest>,
    ) -> Result<Response<DropShardResponse>, Status> {
        let key = convert::key(req.get_ref().shard.as_ref())?;
        let node = self.node.clone();
        blocking(move || node.drop_shard(&key)).await?;
        Ok(Response::new(DropShardResponse {}))
    }

    async fn write_batch(
        &self,
        req: Request<WriteBatchRequest>,
    ) -> Result<Response<WriteBatchResponse>, Status> {
        let replica = self.replica(req.get_ref().shard.as_ref())?;
        let timeout = deadline(&req).map_or(self.write_timeout, |d| d.min(self.write_timeout));
        // Not the leader: pass the write on to the one this replica knows (once).
        let forwarded = req.metadata().contains_key(forward::FORWARDED);
        if !forwarded {
            cut_from_clients()?;
        }
        if !forwarded
            && replica.serving().is_ok()
            && !replica.status().is_leader()
            && let Some((_, leader)) = replica.leader_hint().filter(|(_, a)| !a.is_empty())
        {
            let r = self
                .forward
                .write(self.node.tls(), &leader, req.into_inner(), timeout)
                .await?;
            return Ok(Response::new(r));
        }
        let started = std::time::Instant::now();
        let r = replica.write(req.into_inner(), timeout).await;
        let took = started.elapsed().as_secs_f64();
        // Every call, refused or failed ones included: what callers wait.
        metrics::histogram!("shard_write_batch_seconds").record(took);
        let r = r?;
        // Proposal to applied-on-leader: the commit latency clients see.
        metrics::histogram!("raft_proposal_seconds").record(took);
        Ok(Response::new(r))
    }

    async fn bm25_search(
        &self,
        req: Request<Bm25SearchRequest>,
    ) -> Result<Response<ShardSearchResponse>, Status> {
        let wait = deadline(&req);
        let r = req.into_inner();
        in_range("top_k", r.top_k)?;
        let shard = (self.ready(r.shard.as_ref(), r.min_applied_seq, r.consistency, wait)).await?;
        if r.stats_seq != 0 && r.stats.is_some() && shard.visible_seq() != r.stats_seq {
            return Ok(Response::new(ShardSearchResponse {
                hits: Vec::new(),
                stats_stale: true,
            }));
        }
        let f = filter(&r.filter, r.conditions.as_ref())?;
        let v = read(r.top_k as usize, || {
            shard.bm25_search(
                &r.query,
                r.top_k as usize,
                &f,
                r.stats.as_ref(),
                HitForm::of(r.ids_only, r.encoded_chunks),
            )
        })?;
        Ok(Response::new(hits(v)))
    }

    async fn vector_search(
        &self,
        req: Request<VectorSearchRequest>,
    ) -> Result<Response<ShardSearchResponse>, Status> {
        let wait = deadline(&req);
        let r = req.into_inner();
        in_range("top_k", r.top_k)?;
        let shard = (self.ready(r.shard.as_ref(), r.min_applied_seq, r.consistency, wait)).await?;
        let ef = if r.ef_search == 0 {
            shard.params.ef_search.max(1)
        } else {
            r.ef_search
        } as usize;
        let scan = if r.exact { Scan::Exact } else { Scan::Walk(ef) };
        // The walk's cost grows with ef, a filtered search's with what its plan reads (100
        // postings candidates of a 0.1% filter cost a few walk steps); an exact one scores
        // every point: never inline.
        let f = filter(&r.filter, r.conditions.as_ref())?;
        let items = shard.vector_search_cost(scan, &f).max(r.top_k as usize);
        let v = read(items, || {
            shard.vector_search(
                &r.vector,
                r.top_k as usize,
                scan,
                &f,
                HitForm::of(r.ids_only, r.encoded_chunks),
            )
        })?;
        Ok(Response::new(hits(v)))
    }

    async fn term_statistics(
        &self,
        req: Request<TermStatisticsRequest>,
    ) -> Result<Response<TermStatisticsResponse>, Status> {
        let wait = deadline(&req);
        let r = req.into_inner();
        let eventual = Consistency::Eventual as i32;
        let shard = (self.ready(r.shard.as_ref(), r.min_applied_seq, eventual, wait)).await?;
        let seq = shard.visible_seq();
        let s = read(1, || shard.term_stats(&r.query))?;
        Ok(Response::new(TermStatisticsResponse {
            num_docs: s.num_docs,
            total_tokens: s.total_tokens,
            doc_freq: s.doc_freq,
            seq,
        }))
    }

    async fn get_chunks(
        &self,
        req: Request<GetChunksRequest>,
    ) -> Result<Response<GetChunksResponse>, Status> {
        let wait = deadline(&req);
        let r = req.into_inner();
        if r.doc_ids.len() > MAX_TOP_K as usize {
            return Err(Status::invalid_argument(format!(
                "at most {MAX_TOP_K} doc_ids per call"
            )));
        }
        let shard = (self.ready(r.shard.as_ref(), r.min_applied_seq, r.consistency, wait)).await?;
        let mut chunks = read(r.chunk_ids.len(), || {
            shard.get_chunks(&r.chunk_ids, r.with_embedding)
        })?;
        if !r.doc_ids.is_empty() {
            let docs = blocking(move || shard.doc_chunks(&r.doc_ids, r.with_embedding)).await?;
            chunks.extend(docs);
        }
        Ok(Response::new(GetChunksResponse { chunks }))
    }

    async fn scan(&self, req: Request<ScanRequest>) -> Result<Response<ScanResponse>, Status> {
        let wait = deadline(&req);
        let r = req.into_inner();
        in_range("limit", r.limit)?;
        let f = filter(&r.filter, r.conditions.as_ref())?;
        let shard = (self.ready(r.shard.as_ref(), r.min_applied_seq, r.consistency, wait)).await?;
        let (scanned, seq) = blocking(move || {
            let after = r.after.then(|| crate::storage::After {
                doc_id: r.after_doc_id.clone(),
                position: r.after_position,
            });
            let spec = crate::storage::ScanSpec {
                after: after.as_ref(),
                limit: r.limit as usize,
                max_bytes: usize::try_from(r.max_bytes).unwrap_or(usize::MAX),
                with_embedding: r.with_embedding,
            };
            shard.scan(&spec, &f)
        })
        .await?;
        Ok(Response::new(ScanResponse {
            chunks: scanned.chunks,
            done: scanned.done,
            seq,
        }))
    }

    async fn count(
        &self,
        req: Request<ShardCountRequest>,
    ) -> Result<Response<ShardCountResponse>, Status> {
        let wait = deadline(&req);
        let r = req.into_inner();
        let shard = (self.ready(r.shard.as_ref(), r.min_applied_seq, r.consistency, wait)).await?;
        // A filtered count walks every match: off the async worker.
        let f = filter(&r.filter, r.conditions.as_ref())?;
        let items = if f.is_empty() { 1 } else { usize::MAX };
        let (chunks, documents, seq) = read(items, || shard.count(&f))?;
        Ok(Response::new(ShardCountResponse {
            chunks,
            documents,
            seq,
        }))
    }

    type ExportStream = tokio_stream::wrappers::ReceiverStream<Result<ExportPart, Status>>;

    async fn export(
        &self,
        req: Request<ExportRequest>,
    ) -> Result<Response<Self::ExportStream>, Status> {
        use crate::shard::export::{DEFAULT_PART_BYTES, MAX_PART_BYTES};
        let wait = deadline(&req);
        let r = req.into_inner();
        let max_bytes = match usize::try_from(r.max_bytes).unwrap_or(usize::MAX) {
            0 => DEFAULT_PART_BYTES,
            n => n.min(MAX_PART_BYTES),
        };
        // A read index first: every write acknowledged before the call is in the snapshot.
        let strong = Consistency::Strong as i32;
        let shard = (self.ready(r.shard.as_ref(), 0, strong, wait)).await?;
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        tokio::task::spawn_blocking(move || {
            let sent = shard.export(max_bytes, |p| tx.blocking_send(Ok(p)).is_ok());
            match sent {
                Ok(seq) => tracing::info!(shard = %shard.key, seq, "export done"),
                Err(e) => {
                    tracing::warn!(shard = %shard.key, error = %e, "export failed");
                    let _ = tx.blocking_send(Err(Status::from(e)));
                }
            }
        });
        Ok(Response::new(tokio_stream::wrappers::ReceiverStream::new(
            rx,
        )))
    }

    async fn get_neighbours(
        &self,
        req: Request<GetNeighboursRequest>,
    ) -> Result<Response<GetChunksResponse>, Status> {
        let wait = deadline(&req);
        let r = req.into_inner();
        let eventual = Consistency::Eventual as i32;
        let shard = (self.ready(r.shard.as_ref(), r.min_applied_seq, eventual, wait)).await?;
        let chunks =
            blocking(move || shard.neighbours(&r.chunk_id, r.before.min(64), r.after.min(64)))
                .await?;
        Ok(Response::new(GetChunksResponse { chunks }))
    }

    async fn shard_info(
        &self,
        req: Request<ShardInfoRequest>,
    ) -> Result<Response<ShardInfoResponse>, Status> {
        let replica = self.replica(req.get_ref().shard.as_ref())?;
        Ok(Response::new(blocking(move || Ok(info(&replica))).await?))
    }

    async fn change_replicas(
        &self,
        req: Request<ChangeReplicasRequest>,
    ) -> Result<Response<ChangeReplicasResponse>, Status> {
        use ragcluster_raft::eraftpb::ConfChangeType;
        let r = req.into_inner();
        let replica = self.replica(r.shard.as_ref())?;
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
        let cs = replica
            .change(kind, peer.node_id, &peer.address, self.write_timeout)
            .await?;
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
        let replica = self.replica(r.shard.as_ref())?;
        replica
            .transfer_leader(r.to_node_id, self.write_timeout)
            .await?;
        Ok(Response::new(TransferLeaderResponse {}))
    }

    async fn raft(
        &self,
        req: Request<tonic::Streaming<RaftBatch>>,
    ) -> Result<Response<RaftDone>, Status> {
        let mut stream = req.into_inner();
        let transport = self.node.transport().clone();
        let closed = self.node.closed();
        tokio::pin!(closed);
        loop {
            // A peer's stream never ends by itself: stop reading when this node shuts down.
            let batch = tokio::select! {
                b = stream.next() => match b {
                    Some(b) => b?,
                    None => break,
                },
                () = &mut closed => {
                    return Err(Status::unavailable("shard node shutting down"));
                }
            };
            for m in &batch.messages {
                if let Some(r) = &m.shard {
                    let key = crate::storage::ShardKey::new(r.collection.clone(), r.shard);
                    transport.deliver(batch.from_node_id, &key, &m.message);
                }
            }
        }
        Ok(Response::new(RaftDone {}))
    }

    type FetchGraphDumpStream = std::pin::Pin<
        Box<dyn futures::Stream<Item = Result<GraphDumpChunk, Status>> + Send + 'static>,
    >;

    async fn fetch_graph_dump(
        &self,
        req: Request<FetchGraphDumpRequest>,
    ) -> Result<Response<Self::FetchGraphDumpStream>, Status> {
        let r = req.into_inner();
        let shard = self.read_shard(r.shard.as_ref())?;
        let (after, max_seq) = (r.after_seq, r.max_seq);
        let section = tokio::task::spawn_blocking(move || shard.graph_dump_after(after, max_seq))
            .await
            .map_err(|e| Status::internal(e.to_string()))??;
        let chunks: Vec<Result<GraphDumpChunk, Status>> = section
            .unwrap_or_default()
            .chunks(GRAPH_CHUNK_BYTES)
            .map(|c| Ok(GraphDumpChunk { data: c.to_vec() }))
            .collect();
        Ok(Response::new(Box::pin(futures::stream::iter(chunks))))
    }

    type ReadsStream = reads::ReadsStream;

    async fn reads(
        &self,
        req: Request<tonic::Streaming<ReadCalls>>,
    ) -> Result<Response<Self::ReadsStream>, Status> {
        Ok(Response::new(reads::serve(self.clone(), req.into_inner())))
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
        if ragcluster_raft::transport::isolated(first.from_node_id) {
            return Err(Status::unavailable("isolated (failpoint raft_isolate)"));
        }
        let rm = first
            .message
            .ok_or_else(|| Status::invalid_argument("first chunk carries no raft message"))?;
        let mut msg = ragcluster_raft::eraftpb::Message::default();
        msg.merge_from_bytes(&rm.message)
            .map_err(|e| Status::invalid_argument(format!("raft message: {e}")))?;
        let shard = self.shard(rm.shard.as_ref())?;
        if let Some(why) = self.node.space().full() {
            // The leader sends it again once this node has room (it asks after each report).
            return Err(Status::resource_exhausted(format!(
                "shard node {} takes no snapshot: {why}",
                self.node.node_id()
            )));
        }
        let meta = msg.get_snapshot().get_metadata().clone();
        let desc = crate::raft::snapshot::Descriptor::decode(&msg.get_snapshot().data)?;
        let dir = shard.snap_dir.clone();
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
        transport.deliver(first.from_node_id, &shard.key, &rm.message);
        Ok(Response::new(RaftDone {}))
    }
}
