//! How the contract's enums read in logs, tables and flags (one spelling for every process
//! and client).

use ragcluster_proto::v1::{NodeKind, RaftRole, Role};

/// An API key's role.
pub fn role_name(r: Role) -> &'static str {
    match r {
        Role::Reader => "reader",
        Role::Writer => "writer",
        Role::Admin => "admin",
        Role::Unspecified => "none",
    }
}

pub fn parse_role(s: &str) -> Option<Role> {
    match s {
        "reader" => Some(Role::Reader),
        "writer" => Some(Role::Writer),
        "admin" => Some(Role::Admin),
        _ => None,
    }
}

/// A replica's Raft role.
pub fn raft_role_name(r: RaftRole) -> &'static str {
    match r {
        RaftRole::Unspecified => "unknown",
        RaftRole::Follower => "follower",
        RaftRole::PreCandidate => "pre-candidate",
        RaftRole::Candidate => "candidate",
        RaftRole::Leader => "leader",
        RaftRole::Learner => "learner",
        RaftRole::Stopped => "stopped",
        RaftRole::Removed => "removed",
        RaftRole::Unreachable => "unreachable",
    }
}

/// A cluster member's kind.
pub fn node_kind_name(k: NodeKind) -> &'static str {
    match k {
        NodeKind::ShardNode => "shard-node",
        NodeKind::ModelWorker => "model-worker",
        NodeKind::Unspecified => "unknown",
    }
}
