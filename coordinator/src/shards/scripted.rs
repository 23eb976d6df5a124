//! A shard node whose answers a test scripts, behind the same `ShardNode` trait as the gRPC
//! and in-process ones: per call name a queue of answers (succeed, fail with a typed error, a
//! leader hint, or take a while first), a Raft view to report, and a log of every call. The
//! coordinator's retry and failover policy, its leader following and its deadlines are
//! tested against it without a process or a socket (`shards::tests`).

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use prost::Message as _;
use ragcluster_proto::v1::*;

use super::node::{Connector, ShardNode};
use crate::error::ShardCallError;

type Result<T> = std::result::Result<T, ShardCallError>;

/// One scripted answer to one call.
#[derive(Debug, Clone)]
pub enum Answer {
    /// Succeed (with the node's defaults: its Raft view, no hits, a written batch).
    Ok,
    /// Fail with this error.
    Fail(ShardCallError),
    /// Take this long, then answer with the next entry of the script (or `Ok`). A delay past
    /// the caller's timeout ends in `Deadline` when the timeout runs out, as a gRPC call would.
    Delay(Duration),
}

impl Answer {
    pub fn not_leader(hint: Option<(u64, &str)>) -> Self {
        Answer::Fail(ShardCallError::NotLeader {
            leader: hint.map(|(id, a)| (id, a.to_owned())),
        })
    }

    pub fn unavailable() -> Self {
        Answer::Fail(ShardCallError::Unavailable {
            reason: "scripted".into(),
            retry_after: Duration::from_millis(10),
        })
    }

    pub fn rejected() -> Self {
        Answer::Fail(ShardCallError::Rejected(tonic::Status::invalid_argument(
            "scripted refusal",
        )))
    }
}

/// One call as the node saw it.
#[derive(Debug, Clone)]
pub struct Call {
    pub method: &'static str,
    /// The write's request id (writes only).
    pub request_id: String,
    pub timeout: Duration,
}

/// A shard's Raft group as its scripted replicas report it: who leads, the voters and
/// learners, the commit index. Membership changes and leadership transfers sent to the leader
/// take effect at once; sent to another replica they are refused with a leader hint.
#[derive(Default)]
pub struct ScriptedGroup {
    state: Mutex<GroupState>,
}

#[derive(Default, Clone)]
struct GroupState {
    term: u64,
    leader: (u64, String),
    voters: Vec<u64>,
    learners: Vec<u64>,
    commit: u64,
}

impl ScriptedGroup {
    /// A group of `voters`, led by the first, everything up to `commit` applied everywhere.
    pub fn new(voters: &[&Arc<ScriptedNode>], commit: u64) -> Arc<Self> {
        let g = Arc::new(Self {
            state: Mutex::new(GroupState {
                term: 1,
                leader: (voters[0].id, voters[0].address.clone()),
                voters: voters.iter().map(|n| n.id).collect(),
                learners: Vec::new(),
                commit,
            }),
        });
        for n in voters {
            *n.group.lock() = Some(g.clone());
        }
        g
    }

    /// `n` holds a replica of the group (a node that opened one to join it).
    pub fn attach(self: &Arc<Self>, n: &ScriptedNode) {
        *n.group.lock() = Some(self.clone());
    }

    pub fn voters(&self) -> Vec<u64> {
        self.state.lock().voters.clone()
    }

    pub fn learners(&self) -> Vec<u64> {
        self.state.lock().learners.clone()
    }

    pub fn leader(&self) -> u64 {
        self.state.lock().leader.0
    }

    fn view(&self, id: u64) -> RaftStatus {
        let g = self.state.lock();
        let role = if g.leader.0 == id {
            RaftRole::Leader
        } else if g.learners.contains(&id) {
            RaftRole::Learner
        } else {
            RaftRole::Follower
        };
        RaftStatus {
            node_id: id,
            role: role as i32,
            term: g.term,
            leader_id: g.leader.0,
            leader_address: g.leader.1.clone(),
            commit_index: g.commit,
            applied_index: g.commit,
            voters: g.voters.clone(),
            learners: g.learners.clone(),
            ..Default::default()
        }
    }

    /// Refuses with a leader hint unless `id` leads.
    fn at_leader(&self, id: u64) -> Result<()> {
        let g = self.state.lock();
        if g.leader.0 == id {
            return Ok(());
        }
        Err(ShardCallError::NotLeader {
            leader: Some(g.leader.clone()),
        })
    }

    fn change(&self, id: u64, req: &ChangeReplicasRequest) -> Result<()> {
        self.at_leader(id)?;
        let peer = req.peer.as_ref().map_or(0, |p| p.node_id);
        let mut g = self.state.lock();
        match req.change() {
            ReplicaChange::AddLearner if !g.voters.contains(&peer) => g.learners.push(peer),
            ReplicaChange::Promote if g.learners.contains(&peer) => {
                g.learners.retain(|l| *l != peer);
                g.voters.push(peer);
            }
            ReplicaChange::Remove => {
                g.voters.retain(|v| *v != peer);
                g.learners.retain(|l| *l != peer);
            }
            _ => {}
        }
        g.learners.dedup();
        Ok(())
    }

    fn transfer(&self, id: u64, to: u64, nodes: &[(u64, String)]) -> Result<()> {
        self.at_leader(id)?;
        let mut g = self.state.lock();
        if let Some(n) = nodes.iter().find(|(i, _)| *i == to)
            && g.voters.contains(&to)
        {
            g.leader = n.clone();
            g.term += 1;
        }
        Ok(())
    }
}

/// A scripted shard node.
pub struct ScriptedNode {
    pub address: String,
    pub id: u64,
    script: Mutex<HashMap<&'static str, VecDeque<Answer>>>,
    /// What `shard_info` reports as this replica's Raft view, unless it is in a `group`.
    view: Mutex<RaftStatus>,
    /// The group its replica belongs to, which then answers for the view, membership changes
    /// and leadership transfers.
    group: Mutex<Option<Arc<ScriptedGroup>>>,
    /// Every node of the test (id, address), for transfers to name their target.
    peers: Mutex<Vec<(u64, String)>>,
    calls: Mutex<Vec<Call>>,
    /// The chunks its replica holds (`hold`).
    chunks: Mutex<Vec<Chunk>>,
}

impl ScriptedNode {
    pub fn new(address: &str, id: u64) -> Arc<Self> {
        Arc::new(Self {
            address: address.to_owned(),
            id,
            script: Default::default(),
            view: Mutex::new(RaftStatus {
                node_id: id,
                role: RaftRole::Follower as i32,
                term: 1,
                ..Default::default()
            }),
            group: Default::default(),
            peers: Default::default(),
            calls: Default::default(),
            chunks: Default::default(),
        })
    }

    /// Queues answers for the next calls of `method` (a `ShardNode` method's name).
    pub fn script(&self, method: &'static str, answers: impl IntoIterator<Item = Answer>) {
        self.script
            .lock()
            .entry(method)
            .or_default()
            .extend(answers);
    }

    /// Adds chunks to what its replica holds, for searches and chunk reads to find.
    pub fn hold(&self, chunks: impl IntoIterator<Item = Chunk>) {
        self.chunks.lock().extend(chunks);
    }

    /// The held chunks that contain a word of the query, scored by how often the query's
    /// words occur in them, best first (ties by id), as a shard answers a BM25 search.
    fn lexical_hits(&self, req: &Bm25SearchRequest) -> Vec<ShardHit> {
        let wanted: HashSet<String> = words(&req.query).collect();
        let chunks = self.chunks.lock();
        let mut scored: Vec<(f32, &Chunk)> = chunks
            .iter()
            .filter_map(|c| {
                let n = words(&c.text).filter(|w| wanted.contains(w)).count();
                (n > 0).then_some((n as f32, c))
            })
            .collect();
        scored.sort_by(|a, b| {
            b.0.total_cmp(&a.0)
                .then_with(|| a.1.chunk_id.cmp(&b.1.chunk_id))
        });
        scored.truncate(req.top_k as usize);
        scored
            .into_iter()
            .map(|(score, c)| {
                let c = Chunk {
                    embedding: Vec::new(),
                    ..c.clone()
                };
                match (req.ids_only, req.encoded_chunks) {
                    (true, _) => ShardHit {
                        chunk_id: c.chunk_id,
                        score,
                        ..Default::default()
                    },
                    (false, true) => ShardHit {
                        chunk_id: c.chunk_id.clone(),
                        chunk_encoded: c.encode_to_vec().into(),
                        score,
                        ..Default::default()
                    },
                    (false, false) => ShardHit {
                        chunk: Some(c),
                        score,
                        ..Default::default()
                    },
                }
            })
            .collect()
    }

    /// Up to `before` preceding and `after` following chunks of the anchor's document, in
    /// order, the anchor included (as a shard node answers).
    fn neighbours(&self, req: &GetNeighboursRequest) -> Result<Vec<Chunk>> {
        let chunks = self.chunks.lock();
        let Some(anchor) = chunks.iter().find(|c| c.chunk_id == req.chunk_id) else {
            return Err(ShardCallError::NotHere(format!("chunk {}", req.chunk_id)));
        };
        let from = anchor.position.saturating_sub(req.before);
        let to = anchor.position.saturating_add(req.after);
        let mut out: Vec<Chunk> = chunks
            .iter()
            .filter(|c| c.doc_id == anchor.doc_id && (from..=to).contains(&c.position))
            .cloned()
            .collect();
        out.sort_by_key(|c| c.position);
        Ok(out)
    }

    /// Drops what is left of `method`'s script: its calls succeed again.
    pub fn clear(&self, method: &str) {
        self.script.lock().remove(method);
    }

    /// Sets the role and term `shard_info` reports.
    pub fn set_view(&self, role: RaftRole, term: u64) {
        let mut v = self.view.lock();
        v.role = role as i32;
        v.term = term;
    }

    /// Every call so far, in order.
    pub fn calls(&self) -> Vec<Call> {
        self.calls.lock().clone()
    }

    /// How many calls of `method` came.
    pub fn count(&self, method: &str) -> usize {
        self.calls
            .lock()
            .iter()
            .filter(|c| c.method == method)
            .count()
    }

    /// Logs the call, then plays its script: Ok(()) to succeed with the defaults.
    async fn answer(
        &self,
        method: &'static str,
        request_id: &str,
        timeout: Duration,
    ) -> Result<()> {
        self.calls.lock().push(Call {
            method,
            request_id: request_id.to_owned(),
            timeout,
        });
        if timeout.is_zero() {
            // As gRPC does: a call sent with no time left fails at once.
            return Err(ShardCallError::Deadline);
        }
        let mut waited = Duration::ZERO;
        loop {
            let next = self
                .script
                .lock()
                .get_mut(method)
                .and_then(|q| q.pop_front());
            match next {
                None | Some(Answer::Ok) => return Ok(()),
                Some(Answer::Fail(e)) => return Err(e),
                Some(Answer::Delay(d)) => {
                    let left = timeout.saturating_sub(waited);
                    if d >= left {
                        tokio::time::sleep(left).await;
                        return Err(ShardCallError::Deadline);
                    }
                    tokio::time::sleep(d).await;
                    waited += d;
                }
            }
        }
    }
}

#[tonic::async_trait]
impl ShardNode for ScriptedNode {
    async fn node_info(&self, timeout: Duration) -> Result<NodeInfoResponse> {
        self.answer("node_info", "", timeout).await?;
        Ok(NodeInfoResponse {
            node_id: self.id,
            ..Default::default()
        })
    }

    async fn open_shard(&self, _req: OpenShardRequest, timeout: Duration) -> Result<()> {
        self.answer("open_shard", "", timeout).await
    }

    async fn drop_shard(&self, _shard: ShardRef, timeout: Duration) -> Result<()> {
        self.answer("drop_shard", "", timeout).await
    }

    async fn write_batch(
        &self,
        req: WriteBatchRequest,
        timeout: Duration,
    ) -> Result<WriteBatchResponse> {
        self.answer("write_batch", &req.request_id, timeout).await?;
        Ok(WriteBatchResponse::default())
    }

    async fn bm25_search(
        &self,
        req: Bm25SearchRequest,
        timeout: Duration,
    ) -> Result<ShardSearchResponse> {
        self.answer("bm25_search", "", timeout).await?;
        Ok(ShardSearchResponse {
            hits: self.lexical_hits(&req),
            ..Default::default()
        })
    }

    async fn vector_search(
        &self,
        _req: VectorSearchRequest,
        timeout: Duration,
    ) -> Result<Vec<ShardHit>> {
        self.answer("vector_search", "", timeout).await?;
        Ok(Vec::new())
    }

    async fn term_statistics(
        &self,
        _req: TermStatisticsRequest,
        timeout: Duration,
    ) -> Result<TermStatisticsResponse> {
        self.answer("term_statistics", "", timeout).await?;
        Ok(TermStatisticsResponse::default())
    }

    async fn get_chunks(&self, req: GetChunksRequest, timeout: Duration) -> Result<Vec<Chunk>> {
        self.answer("get_chunks", "", timeout).await?;
        let chunks = self.chunks.lock();
        let mut out: Vec<Chunk> = req
            .chunk_ids
            .iter()
            .filter_map(|id| chunks.iter().find(|c| &c.chunk_id == id).cloned())
            .collect();
        for d in &req.doc_ids {
            let mut of_doc: Vec<Chunk> =
                chunks.iter().filter(|c| &c.doc_id == d).cloned().collect();
            of_doc.sort_by_key(|c| c.position);
            out.extend(of_doc);
        }
        Ok(out)
    }

    async fn get_neighbours(
        &self,
        req: GetNeighboursRequest,
        timeout: Duration,
    ) -> Result<Vec<Chunk>> {
        self.answer("get_neighbours", "", timeout).await?;
        self.neighbours(&req)
    }

    async fn scan(&self, req: ScanRequest, timeout: Duration) -> Result<ScanResponse> {
        self.answer("scan", "", timeout).await?;
        let mut held: Vec<Chunk> = self
            .chunks
            .lock()
            .iter()
            .filter(|c| {
                req.filter.iter().all(|(k, v)| c.metadata.get(k) == Some(v))
                    && (!req.after
                        || (c.doc_id.as_str(), c.position)
                            > (req.after_doc_id.as_str(), req.after_position))
            })
            .cloned()
            .collect();
        held.sort_by(|a, b| (&a.doc_id, a.position).cmp(&(&b.doc_id, b.position)));
        let done = held.len() <= req.limit as usize;
        held.truncate(req.limit as usize);
        Ok(ScanResponse {
            chunks: held,
            done,
            seq: 1,
        })
    }

    async fn count(&self, req: ShardCountRequest, timeout: Duration) -> Result<ShardCountResponse> {
        self.answer("count", "", timeout).await?;
        let chunks = self.chunks.lock();
        let matching: Vec<&Chunk> = chunks
            .iter()
            .filter(|c| req.filter.iter().all(|(k, v)| c.metadata.get(k) == Some(v)))
            .collect();
        let docs: HashSet<&str> = matching.iter().map(|c| c.doc_id.as_str()).collect();
        Ok(ShardCountResponse {
            chunks: matching.len() as u64,
            documents: docs.len() as u64,
            seq: 1,
        })
    }

    async fn shard_info(&self, _shard: ShardRef, timeout: Duration) -> Result<ShardInfoResponse> {
        self.answer("shard_info", "", timeout).await?;
        let group = self.group.lock().clone();
        let raft = match group {
            Some(g) => g.view(self.id),
            None => self.view.lock().clone(),
        };
        Ok(ShardInfoResponse {
            raft: Some(raft),
            ..Default::default()
        })
    }

    async fn change_replicas(
        &self,
        req: ChangeReplicasRequest,
        timeout: Duration,
    ) -> Result<ChangeReplicasResponse> {
        self.answer("change_replicas", "", timeout).await?;
        let group = self.group.lock().clone();
        if let Some(g) = group {
            g.change(self.id, &req)?;
        }
        Ok(ChangeReplicasResponse::default())
    }

    async fn transfer_leader(&self, req: TransferLeaderRequest, timeout: Duration) -> Result<()> {
        self.answer("transfer_leader", "", timeout).await?;
        let group = self.group.lock().clone();
        match group {
            Some(g) => g.transfer(self.id, req.to_node_id, &self.peers.lock()),
            None => Ok(()),
        }
    }

    async fn export(&self, _req: ExportRequest) -> Result<super::node::ExportStream> {
        use futures::StreamExt;
        self.answer("export", "", super::node::EXPORT_START).await?;
        let mut held = self.chunks.lock().clone();
        held.sort_by(|a, b| (&a.doc_id, a.position).cmp(&(&b.doc_id, b.position)));
        let mut documents: Vec<DocumentWrite> = Vec::new();
        for c in held {
            match documents.last_mut() {
                Some(d) if d.doc_id == c.doc_id => d.chunks.push(c),
                _ => documents.push(DocumentWrite {
                    doc_id: c.doc_id.clone(),
                    chunks: vec![c],
                    delete: false,
                }),
            }
        }
        let part = ExportPart {
            seq: 1,
            documents,
            done: true,
        };
        Ok(futures::stream::iter([Ok(part)]).boxed())
    }
}

/// Lower-cased alphanumeric words.
fn words(text: &str) -> impl Iterator<Item = String> + '_ {
    text.split(|c: char| !c.is_alphanumeric())
        .filter(|w| !w.is_empty())
        .map(str::to_lowercase)
}

/// Scripted nodes by address; an address without one is unreachable.
#[derive(Default)]
pub struct ScriptedConnector {
    nodes: HashMap<String, Arc<ScriptedNode>>,
}

impl ScriptedConnector {
    /// A connector over these nodes, by their addresses.
    pub fn new(nodes: &[Arc<ScriptedNode>]) -> Arc<Self> {
        let peers: Vec<(u64, String)> = nodes.iter().map(|n| (n.id, n.address.clone())).collect();
        for n in nodes {
            *n.peers.lock() = peers.clone();
        }
        Arc::new(Self {
            nodes: nodes
                .iter()
                .map(|n| (n.address.clone(), n.clone()))
                .collect(),
        })
    }

    /// A connector over nodes `n0`, `n1`, ... with ids 1, 2, ...
    pub fn with_nodes(n: usize) -> (Arc<Self>, Vec<Arc<ScriptedNode>>) {
        let nodes: Vec<_> = (0..n)
            .map(|i| ScriptedNode::new(&format!("n{i}"), i as u64 + 1))
            .collect();
        (Self::new(&nodes), nodes)
    }
}

impl Connector for ScriptedConnector {
    fn node(&self, address: &str) -> Result<Arc<dyn ShardNode>> {
        match self.nodes.get(address) {
            Some(n) => Ok(n.clone()),
            None => Err(ShardCallError::Unavailable {
                reason: format!("no scripted node at {address}"),
                retry_after: Duration::from_millis(10),
            }),
        }
    }
}
