//! Which replica serves a request. Writes and strong reads go to the shard leader (learned
//! from NotLeader hints and successful writes, the preferred leader first); eventual reads go
//! to the healthy replica with the fewest requests in flight, the replica in this process
//! (a co-located shard node) first unless it has `LOCAL_SLACK` more in flight than another.
//! Nodes that just failed a call are avoided for a short while.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use ragcluster_proto::v1::Consistency;

const DOWN_FOR: Duration = Duration::from_secs(2);
/// Requests in flight by which the co-located replica may exceed the least loaded other one
/// and still take an eventual read: it serves without a network hop or protobuf encoding
/// (12-20% of a 1-shard query's server CPU on 2 cores), so it is worth a short queue, but a
/// node whose queue grows past that gives way to idle replicas elsewhere.
const LOCAL_SLACK: usize = 2;

#[derive(Default)]
pub struct Routing {
    leaders: Mutex<HashMap<(String, u32), String>>,
    inflight: Mutex<HashMap<String, Arc<AtomicUsize>>>,
    down_until: Mutex<HashMap<String, Instant>>,
    /// Addresses of members the catalog marks DOWN (missed heartbeats): avoided until they
    /// come back.
    members_down: parking_lot::RwLock<std::collections::HashSet<String>>,
    rotation: AtomicUsize,
    /// The co-located shard node's address (`Connector::local_address`).
    local: Option<String>,
}

/// Counts a request in flight on a node until dropped.
pub struct InFlight(Arc<AtomicUsize>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Routing {
    /// Routing that prefers the replicas of the shard node at `local` (this process).
    pub fn with_local(local: Option<String>) -> Self {
        Self {
            local,
            ..Self::default()
        }
    }

    pub fn leader(&self, collection: &str, shard: u32, replicas: &[String]) -> String {
        self.leaders
            .lock()
            .get(&(collection.to_owned(), shard))
            .cloned()
            .unwrap_or_else(|| replicas.first().cloned().unwrap_or_default())
    }

    pub fn set_leader(&self, collection: &str, shard: u32, node: &str) {
        self.leaders
            .lock()
            .insert((collection.to_owned(), shard), node.to_owned());
    }

    pub fn mark_down(&self, node: &str) {
        self.down_until
            .lock()
            .insert(node.to_owned(), Instant::now() + DOWN_FOR);
    }

    /// The member table's DOWN members, by address.
    pub fn set_members_down(&self, down: std::collections::HashSet<String>) {
        *self.members_down.write() = down;
    }

    /// Whether `node` is avoided now (DOWN in the member table, or failed a moment ago).
    pub fn is_down(&self, node: &str) -> bool {
        self.members_down.read().contains(node)
            || self
                .down_until
                .lock()
                .get(node)
                .is_some_and(|t| *t > Instant::now())
    }

    fn load(&self, node: &str) -> usize {
        self.inflight
            .lock()
            .get(node)
            .map_or(0, |c| c.load(Ordering::Relaxed))
    }

    pub fn track(&self, node: &str) -> InFlight {
        let c = self
            .inflight
            .lock()
            .entry(node.to_owned())
            .or_default()
            .clone();
        c.fetch_add(1, Ordering::Relaxed);
        InFlight(c)
    }

    /// The replica a read of this consistency goes to.
    pub fn read_target(
        &self,
        collection: &str,
        shard: u32,
        replicas: &[String],
        consistency: Consistency,
    ) -> String {
        if consistency == Consistency::Strong || replicas.len() <= 1 {
            return self.leader(collection, shard, replicas);
        }
        // Lowest load among healthy replicas; ties broken by rotation so idle replicas share.
        let start = self.rotation.fetch_add(1, Ordering::Relaxed);
        let n = replicas.len();
        let best = (0..n)
            .map(|i| &replicas[(start + i) % n])
            .min_by_key(|r| (self.is_down(r), self.load(r)))
            .cloned()
            .unwrap_or_default();
        match &self.local {
            Some(local)
                if *local != best
                    && replicas.contains(local)
                    && !self.is_down(local)
                    && self.load(local) <= self.load(&best) + LOCAL_SLACK =>
            {
                local.clone()
            }
            _ => best,
        }
    }

    /// The replica an eventual read fails over to after `tried` failed: untried, healthy
    /// first, then least loaded; `None` when every replica was tried.
    pub fn failover(&self, replicas: &[String], tried: &[String]) -> Option<String> {
        replicas
            .iter()
            .filter(|r| !tried.contains(r))
            .min_by_key(|r| (self.is_down(r), self.load(r)))
            .cloned()
    }

    /// The replica to try after `failed` for a write with no leader hint.
    pub fn next_replica(&self, replicas: &[String], failed: &str) -> String {
        let i = replicas.iter().position(|r| r == failed).unwrap_or(0);
        let n = replicas.len().max(1);
        (1..=n)
            .map(|k| &replicas[(i + k) % n])
            .find(|r| !self.is_down(r))
            .unwrap_or(&replicas[(i + 1) % n])
            .clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn eventual_reads_avoid_busy_and_down_replicas() {
        let r = Routing::default();
        let reps: Vec<String> = ["a", "b", "c"].iter().map(|s| s.to_string()).collect();
        let _busy = (r.track("a"), r.track("b"));
        for _ in 0..5 {
            assert_eq!(r.read_target("x", 0, &reps, Consistency::Eventual), "c");
        }
        r.set_members_down(["a".to_string()].into());
        let _busy_c = (r.track("c"), r.track("c"));
        assert_eq!(r.read_target("x", 0, &reps, Consistency::Eventual), "b");
        r.set_members_down(Default::default());
        drop(_busy_c);
        r.mark_down("c");
        let t = r.read_target("x", 0, &reps, Consistency::Eventual);
        assert!(t == "a" || t == "b");
        assert_eq!(r.read_target("x", 0, &reps, Consistency::Strong), "a");
        r.set_leader("x", 0, "b");
        assert_eq!(r.read_target("x", 0, &reps, Consistency::Strong), "b");
        assert_eq!(r.next_replica(&reps, "b"), "a", "c is down");
        assert_eq!(r.failover(&reps, &["a".into()]).as_deref(), Some("b"));
        assert_eq!(
            r.failover(&reps, &["a".into(), "b".into()]).as_deref(),
            Some("c")
        );
        assert_eq!(r.failover(&reps, &reps), None);
    }

    #[test]
    fn eventual_reads_prefer_the_colocated_replica_within_its_slack() {
        let r = Routing::with_local(Some("b".into()));
        let reps: Vec<String> = ["a", "b", "c"].iter().map(|s| s.to_string()).collect();
        let mut held = Vec::new();
        for _ in 0..=LOCAL_SLACK {
            assert_eq!(r.read_target("x", 0, &reps, Consistency::Eventual), "b");
            held.push(r.track("b"));
        }
        // Past its slack the least loaded other replica takes the read.
        let t = r.read_target("x", 0, &reps, Consistency::Eventual);
        assert!(t == "a" || t == "c", "{t}");
        held.pop();
        assert_eq!(r.read_target("x", 0, &reps, Consistency::Eventual), "b");
        // Down, or not a replica of the shard: no preference.
        r.mark_down("b");
        assert_ne!(r.read_target("x", 0, &reps, Consistency::Eventual), "b");
        let others: Vec<String> = ["a", "c"].iter().map(|s| s.to_string()).collect();
        assert_ne!(r.read_target("x", 0, &others, Consistency::Eventual), "b");
        // Strong reads stay on the leader.
        assert_eq!(r.read_target("x", 0, &reps, Consistency::Strong), "a");
    }
}
