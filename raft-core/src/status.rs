//! A member's view of its group, published on a `tokio::sync::watch` channel after every ready
//! cycle, so callers wait for a change instead of polling.

/// What a member is in its group. `Stopped` and `Removed` are final.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Role {
    #[default]
    Follower,
    PreCandidate,
    Candidate,
    Leader,
    /// A non-voting member catching up.
    Learner,
    /// Shut down, or stopped by a storage failure.
    Stopped,
    /// Applied a membership change that removed it.
    Removed,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Follower => "follower",
            Role::PreCandidate => "pre-candidate",
            Role::Candidate => "candidate",
            Role::Leader => "leader",
            Role::Learner => "learner",
            Role::Stopped => "stopped",
            Role::Removed => "removed",
        }
    }
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Status {
    pub id: u64,
    pub role: Role,
    pub term: u64,
    /// 0 when no leader is known.
    pub leader_id: u64,
    pub commit_index: u64,
    /// The index whose effects reads see (`StateMachine::visible_index`).
    pub applied_index: u64,
    /// First index still in the log; earlier entries live only in the state machine.
    pub first_log_index: u64,
    pub voters: Vec<u64>,
    pub learners: Vec<u64>,
    /// On the leader: (member, highest index known to be replicated there).
    pub matched: Vec<(u64, u64)>,
    /// Why the member stopped on its own (raft-rs panicked on what its log holds, or the log
    /// could not be persisted); `None` while it runs and after a requested stop. A failed
    /// member's replica must not serve: what it holds may be behind what it acknowledged.
    pub failed: Option<String>,
}

impl Status {
    pub fn is_leader(&self) -> bool {
        self.role == Role::Leader
    }

    /// Whether the member stopped on its own (`failed`).
    pub fn has_failed(&self) -> bool {
        self.failed.is_some()
    }

    /// The leader when it is another member.
    pub fn other_leader(&self) -> Option<u64> {
        (self.leader_id != 0 && self.leader_id != self.id).then_some(self.leader_id)
    }

    pub fn is_member(&self, id: u64) -> bool {
        self.voters.contains(&id) || self.learners.contains(&id)
    }
}
