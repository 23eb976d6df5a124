//! Where the wire meets the shard node's domain: the one place generated `ragcluster.v1`
//! request types become domain values (validated) and domain values become responses.

use ragcluster_proto::v1::{
    HnswParams as HnswProto, OpenShardRequest, RaftRole, RaftStatus, ShardInfoResponse, ShardRef,
};
use ragcluster_raft::{Role, Status};

use crate::error::{Result, ShardError};
use crate::index::hnsw::HnswParams;
use crate::node::OpenShard;
use crate::raft::transport::shard_ref;
use crate::shard::Figures;
use crate::storage::{ShardKey, ShardMeta};

/// The shard a request addresses.
pub fn key(r: Option<&ShardRef>) -> Result<ShardKey> {
    let r = r.ok_or_else(|| ShardError::InvalidArgument("shard is required".into()))?;
    Ok(ShardKey::new(r.collection.clone(), r.shard))
}

pub fn hnsw(p: Option<HnswProto>) -> HnswParams {
    let p = p.unwrap_or_default();
    HnswParams {
        m: p.m,
        ef_construction: p.ef_construction,
        ef_search: p.ef_search,
    }
}

/// Checks an `OpenShard` request; the node checks what depends on its own identity.
pub fn open_shard(req: OpenShardRequest) -> Result<OpenShard> {
    let bad = |m: &str| Err(ShardError::InvalidArgument(m.into()));
    let key = key(req.shard.as_ref())?;
    let c = &key.collection;
    if c.is_empty() || c.contains('\0') || c.starts_with('~') {
        return bad("shard.collection is empty, starts with '~' or has NUL");
    }
    if req.dimension == 0 || req.dimension > 8192 {
        return bad("dimension must be in [1, 8192]");
    }
    let params = hnsw(req.hnsw);
    if !(2..=256).contains(&params.m) {
        return bad("hnsw.m must be in [2, 256]");
    }
    if req.join
        && req
            .peers
            .iter()
            .any(|p| p.node_id == 0 || p.address.is_empty())
    {
        return bad("peers of a join need node_id and address");
    }
    let mut ids: Vec<u64> = req.peers.iter().map(|p| p.node_id).collect();
    ids.sort_unstable();
    ids.dedup();
    if !req.join && (ids.contains(&0) || ids.len() != req.peers.len()) {
        return bad("peer node ids must be non-zero and distinct");
    }
    Ok(OpenShard {
        key,
        meta: ShardMeta {
            dimension: req.dimension,
            hnsw: params,
        },
        peers: req
            .peers
            .into_iter()
            .map(|p| (p.node_id, p.address))
            .collect(),
        join: req.join,
    })
}

pub fn role(r: Role) -> RaftRole {
    match r {
        Role::Follower => RaftRole::Follower,
        Role::PreCandidate => RaftRole::PreCandidate,
        Role::Candidate => RaftRole::Candidate,
        Role::Leader => RaftRole::Leader,
        Role::Learner => RaftRole::Learner,
        Role::Stopped => RaftRole::Stopped,
        Role::Removed => RaftRole::Removed,
    }
}

pub fn raft_status(s: &Status, leader_address: String) -> RaftStatus {
    RaftStatus {
        node_id: s.id,
        role: role(s.role) as i32,
        term: s.term,
        leader_id: s.leader_id,
        leader_address,
        commit_index: s.commit_index,
        applied_index: s.applied_index,
        first_log_index: s.first_log_index,
        voters: s.voters.clone(),
        learners: s.learners.clone(),
        failed: s.failed.clone().unwrap_or_default(),
    }
}

pub fn shard_info(
    key: &ShardKey,
    f: Figures,
    raft: Option<RaftStatus>,
    bytes: Vec<(String, u64)>,
) -> ShardInfoResponse {
    ShardInfoResponse {
        bytes_by_family: bytes.into_iter().collect(),
        documents: f.documents,
        chunks: f.chunks,
        applied_seq: f.visible_seq,
        bm25_index_bytes: f.bm25_index_bytes,
        hnsw_points: f.hnsw_points,
        hnsw_tombstones: f.hnsw_tombstones,
        hnsw_pending: f.hnsw_pending,
        dimension: f.dimension,
        shard: Some(shard_ref(key)),
        raft,
    }
}
