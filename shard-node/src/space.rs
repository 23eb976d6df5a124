//! Disk space as a shard node acts on it: its own data directory (`DiskGuard`) and which of
//! its peers said in their last heartbeat that theirs is full (the coordinators pass that
//! on). A replica refuses a write when this node is full, or when too few of its group's
//! voters can write for the entry to commit; either way RESOURCE_EXHAUSTED names the nodes
//! and the cause, and nothing was proposed. A full node takes no new log entries, snapshots
//! or leadership from its peers, and hands the leaderships it holds to voters with room.

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::RwLock;
use ragcluster_common::disk::DiskGuard;
use ragcluster_raft::eraftpb::MessageType;

use crate::error::{Result, ShardError};
use crate::storage::ShardKey;

pub struct Space {
    pub guard: Arc<DiskGuard>,
    node_id: u64,
    /// Peers whose last heartbeat said their disk is full, with the reason.
    peers: RwLock<HashMap<u64, String>>,
}

impl Space {
    pub fn new(guard: Arc<DiskGuard>, node_id: u64) -> Self {
        Self {
            guard,
            node_id,
            peers: RwLock::new(HashMap::new()),
        }
    }

    /// Why this node's disk counts as full, if it does.
    pub fn full(&self) -> Option<String> {
        self.guard.full()
    }

    /// The full peers as the coordinators last reported them.
    pub fn set_full_peers(&self, full: HashMap<u64, String>) {
        *self.peers.write() = full;
    }

    pub fn peer_full(&self, id: u64) -> bool {
        self.peers.read().contains_key(&id)
    }

    /// A write error of this node's storage: a want of space makes it full at once.
    pub fn note_error(&self, e: &ShardError) {
        self.guard.note_error(&e.to_string());
    }

    /// Whether a write to the group of `voters` can be taken: `Err(DiskFull)` when this node
    /// is full, or when fewer than a quorum of the voters have room.
    pub fn writable(
        &self,
        key: &ShardKey,
        voters: &[u64],
        address: impl Fn(u64) -> String,
    ) -> Result<()> {
        if let Some(why) = self.full() {
            return Err(ShardError::DiskFull(format!(
                "shard node {} refuses writes: {why}; writes resume by themselves once space \
                 is freed, and its leaderships move to replicas that can write",
                self.node_id
            )));
        }
        let peers = self.peers.read();
        let full: Vec<String> = voters
            .iter()
            .filter_map(|id| {
                peers
                    .get(id)
                    .map(|why| format!("node {id} at {}: {why}", address(*id)))
            })
            .collect();
        let room = voters.len() - full.len();
        if !voters.is_empty() && room < voters.len() / 2 + 1 {
            return Err(ShardError::DiskFull(format!(
                "shard {key} cannot commit writes: {room} of its {} voters have disk space, a \
                 majority must ({})",
                voters.len(),
                full.join("; ")
            )));
        }
        Ok(())
    }

    /// The incoming Raft messages a full node turns away: new log entries and snapshots (it
    /// could not persist them) and leadership (it could not take writes). Heartbeats and
    /// votes still pass, so it stays in its groups and elects no one by silence.
    pub fn refuses(&self, t: MessageType) -> bool {
        matches!(
            t,
            MessageType::MsgAppend | MessageType::MsgSnapshot | MessageType::MsgTimeoutNow
        ) && self.guard.full().is_some()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use ragcluster_common::disk::DiskPolicy;

    use super::*;

    fn space(min_free: u64) -> (tempfile::TempDir, Space) {
        let dir = tempfile::tempdir().unwrap();
        let guard = DiskGuard::start(
            dir.path(),
            DiskPolicy {
                min_free,
                reserve: 0,
                interval: Duration::from_secs(3600),
            },
        )
        .unwrap();
        (dir, Space::new(guard, 1))
    }

    fn key() -> ShardKey {
        ShardKey::new("c", 0)
    }

    #[test]
    fn a_full_node_refuses_writes_naming_itself_and_new_entries() {
        let (_d, s) = space(u64::MAX);
        let e = s
            .writable(&key(), &[1, 2, 3], |_| String::new())
            .unwrap_err();
        assert!(
            matches!(&e, ShardError::DiskFull(m) if m.contains("shard node 1")),
            "{e}"
        );
        assert!(s.refuses(MessageType::MsgAppend));
        assert!(s.refuses(MessageType::MsgTimeoutNow));
        assert!(!s.refuses(MessageType::MsgHeartbeat));
        assert!(!s.refuses(MessageType::MsgRequestVote));
    }

    #[test]
    fn a_group_needs_a_quorum_of_voters_with_room() {
        let (_d, s) = space(0);
        assert!(!s.refuses(MessageType::MsgAppend));
        s.set_full_peers(HashMap::from([(2, "disk full there".to_owned())]));
        // Two of three voters have room: a quorum.
        s.writable(&key(), &[1, 2, 3], |_| String::new()).unwrap();
        s.set_full_peers(HashMap::from([
            (2, "disk full there".to_owned()),
            (3, "and there".to_owned()),
        ]));
        let e = s
            .writable(&key(), &[1, 2, 3], |id| format!("http://n{id}"))
            .unwrap_err();
        let m = e.to_string();
        assert!(m.contains("1 of its 3 voters"), "{m}");
        assert!(m.contains("node 2 at http://n2: disk full there"), "{m}");
        // A lone replica with room writes whatever its former peers say.
        s.writable(&key(), &[1], |_| String::new()).unwrap();
    }
}
