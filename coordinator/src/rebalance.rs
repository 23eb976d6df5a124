//! Moving shard replicas between shard nodes while they serve (`ragctl shard move`, `node
//! drain`, `rebalance`), and the plan that evens replicas and leaders per node.
//!
//! A move is Raft membership change done one safe step at a time: the target joins as a
//! learner and catches up (by snapshot if the log was compacted), is promoted, leadership
//! leaves the source if it led, the source is removed, and only then does the catalog record
//! the new placement. Every step checks the group's current membership first, so asking again
//! after an interruption resumes where the move stopped.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use ragcluster_proto::v1::*;
use tokio::sync::mpsc;

use crate::State;
use crate::error::{CoordError, Result};
use crate::fanout::{call, request};

const STEP_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a new replica may take to catch up (snapshot of a large shard included).
const CATCH_UP_TIMEOUT: Duration = Duration::from_secs(600);
const CATALOG_TIMEOUT: Duration = Duration::from_secs(30);

/// Progress of a move, as streamed to the caller.
pub type Progress = mpsc::Sender<std::result::Result<MoveReplicaProgress, tonic::Status>>;

fn step(name: &str, detail: impl Into<String>) -> MoveReplicaProgress {
    MoveReplicaProgress {
        step: name.into(),
        detail: detail.into(),
        ..Default::default()
    }
}

impl State {
    /// Each replica's Raft view of shard `shard` (None where the node did not answer).
    async fn raft_views(&self, sref: &ShardRef, nodes: &[String]) -> Vec<Option<RaftStatus>> {
        let calls = nodes.iter().map(|n| async move {
            let mut c = self.clients.shard(n).ok()?;
            let r = call(
                n,
                STEP_TIMEOUT,
                c.shard_info(request(
                    ShardInfoRequest {
                        shard: Some(sref.clone()),
                    },
                    STEP_TIMEOUT,
                )),
            )
            .await
            .ok()?;
            r.raft
        });
        futures::future::join_all(calls).await
    }

    /// The current leader of a shard among `nodes` and its Raft view, waiting out an election.
    async fn shard_leader(
        &self,
        sref: &ShardRef,
        nodes: &[String],
    ) -> Result<(String, RaftStatus)> {
        let until = Instant::now() + STEP_TIMEOUT;
        loop {
            let views = self.raft_views(sref, nodes).await;
            if let Some((n, v)) = nodes
                .iter()
                .zip(views)
                .filter_map(|(n, v)| Some((n, v?)))
                .filter(|(_, v)| v.role == "leader")
                .max_by_key(|(_, v)| v.term)
            {
                return Ok((n.clone(), v));
            }
            if Instant::now() >= until {
                return Err(CoordError::Upstream(tonic::Status::failed_precondition(
                    format!(
                        "shard {} of {} has no leader among {nodes:?}",
                        sref.shard, sref.collection
                    ),
                )));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// A membership change sent to the shard's leader (found again if leadership moved).
    async fn change_replicas(
        &self,
        sref: &ShardRef,
        nodes: &[String],
        change: ReplicaChange,
        peer: Peer,
    ) -> Result<ChangeReplicasResponse> {
        let mut last = None;
        for _ in 0..5 {
            let (leader, _) = self.shard_leader(sref, nodes).await?;
            let mut c = self.clients.shard(&leader)?;
            let req = ChangeReplicasRequest {
                shard: Some(sref.clone()),
                change: change as i32,
                peer: Some(peer.clone()),
            };
            match call(
                &format!("shard {} on {leader}", sref.shard),
                STEP_TIMEOUT,
                c.change_replicas(request(req, STEP_TIMEOUT)),
            )
            .await
            {
                Ok(r) => return Ok(r),
                Err(e) if e.is_retryable() => {
                    last = Some(e);
                    tokio::time::sleep(Duration::from_millis(300)).await;
                }
                Err(e) => return Err(e),
            }
        }
        Err(last.unwrap_or_else(|| CoordError::Deadline("membership change".into())))
    }

    /// Moves the replica of `collection`/`shard` on `from` to `to` (see the module doc),
    /// reporting each step on `progress`.
    pub async fn move_replica(
        &self,
        collection: &str,
        shard: u32,
        from: &str,
        to: &str,
        progress: &Progress,
    ) -> Result<()> {
        let say = |m: MoveReplicaProgress| async move {
            let _ = progress.send(Ok(m)).await;
        };
        let info = self.catalog.get(collection)?;
        let placement = info
            .shards
            .get(shard as usize)
            .ok_or_else(|| {
                CoordError::invalid(
                    "shard",
                    format!("{collection} has {} shards", info.shards.len()),
                )
            })?
            .nodes
            .clone();
        for (field, node) in [("from", from), ("to", to)] {
            if !self.cfg.shard_nodes.iter().any(|n| n == node) {
                return Err(CoordError::invalid(
                    field,
                    format!("{node} is not a shard node of this cluster"),
                ));
            }
        }
        if from == to {
            return Err(CoordError::invalid("to", "the same node as from"));
        }
        if !placement.iter().any(|n| n == from) {
            if placement.iter().any(|n| n == to) {
                say(step("done", "already moved")).await;
                return Ok(());
            }
            return Err(CoordError::invalid(
                "from",
                format!("{from} holds no replica of shard {shard} ({placement:?})"),
            ));
        }
        if placement.iter().any(|n| n == to) {
            return Err(CoordError::invalid(
                "to",
                format!("{to} already holds a replica of shard {shard}"),
            ));
        }
        let sref = ShardRef {
            collection: collection.to_owned(),
            shard,
        };
        let from_id = self.node_id(from).await?;
        let to_id = self.node_id(to).await?;
        let to_peer = Peer {
            node_id: to_id,
            address: to.to_owned(),
        };
        // Everyone who may lead during the move: the old replicas and the newcomer.
        let mut members = placement.clone();
        members.push(to.to_owned());

        // 1. The newcomer joins as a learner.
        let (_, view) = self.shard_leader(&sref, &placement).await?;
        if !view.voters.contains(&to_id) && !view.learners.contains(&to_id) {
            let mut peers = Vec::new();
            for n in &placement {
                peers.push(Peer {
                    node_id: self.node_id(n).await?,
                    address: n.clone(),
                });
            }
            let mut c = self.clients.shard(to)?;
            let open = call(
                &format!("shard node {to}"),
                STEP_TIMEOUT,
                c.open_shard(request(
                    OpenShardRequest {
                        shard: Some(sref.clone()),
                        dimension: info.dimension,
                        hnsw: info.hnsw,
                        peers,
                        join: true,
                    },
                    STEP_TIMEOUT,
                )),
            )
            .await;
            match open {
                Ok(_) => {}
                // Opened by an earlier, interrupted attempt.
                Err(CoordError::Upstream(s)) if s.code() == tonic::Code::AlreadyExists => {}
                Err(e) => return Err(e),
            }
            self.change_replicas(
                &sref,
                &placement,
                ReplicaChange::AddLearner,
                to_peer.clone(),
            )
            .await?;
            say(step("learner-added", to)).await;
        }

        // 2. Catch up: the newcomer applies everything the leader had committed when the
        // catch-up began (under a steady write load it trails by the replication pipeline, as
        // every follower does).
        let until = Instant::now() + CATCH_UP_TIMEOUT;
        let mut target = 0;
        loop {
            let (_, lv) = self.shard_leader(&sref, &members).await?;
            if target == 0 {
                target = lv.commit_index;
            }
            let mine = self.raft_views(&sref, &[to.to_owned()]).await;
            let applied = mine
                .first()
                .cloned()
                .flatten()
                .map_or(0, |v| v.applied_index);
            let _ = progress
                .send(Ok(MoveReplicaProgress {
                    step: "catching-up".into(),
                    applied,
                    target,
                    detail: String::new(),
                }))
                .await;
            if applied >= target && target > 0 {
                break;
            }
            if Instant::now() >= until {
                return Err(CoordError::Deadline(format!(
                    "{to} catching up on shard {shard} ({applied} of {target})"
                )));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }

        // 3. Promote.
        let (_, view) = self.shard_leader(&sref, &members).await?;
        if view.learners.contains(&to_id) {
            self.change_replicas(&sref, &members, ReplicaChange::Promote, to_peer)
                .await?;
            say(step("promoted", to)).await;
        }

        // 4. Leadership leaves the source: to another old replica (which the catalog's
        // placement lists throughout), else the newcomer.
        let (leader, _) = self.shard_leader(&sref, &members).await?;
        if leader == from {
            let target = placement
                .iter()
                .find(|n| n.as_str() != from)
                .cloned()
                .unwrap_or_else(|| to.to_owned());
            self.transfer_to(&sref, &members, &target).await?;
            say(step("leader-moved", target)).await;
        }

        // 5. Remove the source.
        let (_, view) = self.shard_leader(&sref, &members).await?;
        if view.voters.contains(&from_id) || view.learners.contains(&from_id) {
            self.change_replicas(
                &sref,
                &members,
                ReplicaChange::Remove,
                Peer {
                    node_id: from_id,
                    address: from.to_owned(),
                },
            )
            .await?;
            say(step("removed", from)).await;
        }

        // 6. The catalog records the new placement (the newcomer takes the source's place, so
        // the preferred-leader order is kept).
        let new: Vec<String> = placement
            .iter()
            .map(|n| if n == from { to.to_owned() } else { n.clone() })
            .collect();
        self.catalog
            .set_placement(collection, shard, new.clone(), CATALOG_TIMEOUT)
            .await?;
        self.catalog
            .wait_for(
                |v| {
                    v.collections
                        .get(collection)
                        .and_then(|c| c.shards.get(shard as usize))
                        .is_some_and(|p| p.nodes == new)
                },
                CATALOG_TIMEOUT,
            )
            .await;
        say(step("placed", new.join(","))).await;

        // The removed replica drops its data once it applies its removal; one cut off at that
        // moment is dropped here (best effort: it may be down).
        if let Ok(mut c) = self.clients.shard(from) {
            let _ = call(
                from,
                STEP_TIMEOUT,
                c.drop_shard(request(
                    DropShardRequest {
                        shard: Some(sref.clone()),
                    },
                    STEP_TIMEOUT,
                )),
            )
            .await;
        }
        metrics::counter!("coordinator_replica_moves_total").increment(1);
        say(step("done", format!("{from} -> {to}"))).await;
        Ok(())
    }

    /// Moves a shard's leadership to the replica on `to` and waits until it leads.
    async fn transfer_to(&self, sref: &ShardRef, nodes: &[String], to: &str) -> Result<()> {
        let to_id = self.node_id(to).await?;
        let until = Instant::now() + STEP_TIMEOUT * 3;
        loop {
            let (leader, _) = self.shard_leader(sref, nodes).await?;
            if leader == to {
                return Ok(());
            }
            if Instant::now() >= until {
                return Err(CoordError::Deadline(format!(
                    "leadership of shard {} moving to {to}",
                    sref.shard
                )));
            }
            let mut c = self.clients.shard(&leader)?;
            let _ = call(
                &leader,
                STEP_TIMEOUT,
                c.transfer_leader(request(
                    TransferLeaderRequest {
                        shard: Some(sref.clone()),
                        to_node_id: to_id,
                    },
                    STEP_TIMEOUT,
                )),
            )
            .await;
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    }

    /// `Admin.TransferShardLeader`.
    pub async fn transfer_shard_leader(
        &self,
        collection: &str,
        shard: u32,
        to: &str,
    ) -> Result<()> {
        let info = self.catalog.get(collection)?;
        let nodes = info
            .shards
            .get(shard as usize)
            .ok_or_else(|| CoordError::invalid("shard", format!("no shard {shard}")))?
            .nodes
            .clone();
        if !nodes.iter().any(|n| n == to) {
            return Err(CoordError::invalid(
                "to",
                format!("{to} holds no replica of shard {shard} ({nodes:?})"),
            ));
        }
        let sref = ShardRef {
            collection: collection.to_owned(),
            shard,
        };
        self.transfer_to(&sref, &nodes, to).await?;
        self.routing.set_leader(collection, shard, to);
        Ok(())
    }
}

/// One shard as the planner sees it.
#[derive(Debug, Clone)]
pub struct ShardView {
    pub collection: String,
    pub shard: u32,
    pub nodes: Vec<String>,
    /// Empty when unknown.
    pub leader: String,
}

/// One step of a plan.
#[derive(Debug, Clone, PartialEq)]
pub enum Step {
    Move {
        collection: String,
        shard: u32,
        from: String,
        to: String,
    },
    Leader {
        collection: String,
        shard: u32,
        to: String,
    },
}

/// Replica moves that empty `drain` (if given) and then even the replicas per node to within
/// one, each move from the fullest node to the emptiest one that lacks that shard.
pub fn plan_replicas(nodes: &[String], shards: &[ShardView], drain: Option<&str>) -> Vec<Step> {
    let mut shards = shards.to_vec();
    let targets: Vec<&String> = nodes.iter().filter(|n| Some(n.as_str()) != drain).collect();
    let count = |shards: &[ShardView], n: &str| {
        shards
            .iter()
            .filter(|s| s.nodes.iter().any(|x| x == n))
            .count()
    };
    let mut steps = Vec::new();
    let mut apply = |shards: &mut Vec<ShardView>, i: usize, from: &str, to: &str| {
        let s = &mut shards[i];
        for n in s.nodes.iter_mut() {
            if n == from {
                *n = to.to_owned();
            }
        }
        steps.push(Step::Move {
            collection: s.collection.clone(),
            shard: s.shard,
            from: from.to_owned(),
            to: to.to_owned(),
        });
    };
    if let Some(d) = drain {
        for i in 0..shards.len() {
            if !shards[i].nodes.iter().any(|n| n == d) {
                continue;
            }
            let to = targets
                .iter()
                .filter(|t| !shards[i].nodes.contains(t))
                .min_by_key(|t| (count(&shards, t), t.as_str()));
            if let Some(to) = to {
                let to = to.to_string();
                apply(&mut shards, i, d, &to);
            }
        }
    }
    // Bounded: every move narrows the gap between the fullest and the emptiest node.
    for _ in 0..shards.len() * nodes.len().max(1) {
        let (Some(max), Some(min)) = (
            targets
                .iter()
                .max_by_key(|t| (count(&shards, t), std::cmp::Reverse(t.as_str()))),
            targets
                .iter()
                .min_by_key(|t| (count(&shards, t), t.as_str())),
        ) else {
            break;
        };
        if count(&shards, max) <= count(&shards, min) + 1 {
            break;
        }
        let Some(i) = shards
            .iter()
            .position(|s| s.nodes.contains(max) && !s.nodes.contains(min))
        else {
            break;
        };
        let (from, to) = (max.to_string(), min.to_string());
        apply(&mut shards, i, &from, &to);
    }
    steps
}

/// Leadership transfers that even the leaders per node to within one.
pub fn plan_leaders(nodes: &[String], shards: &[ShardView]) -> Vec<Step> {
    let mut leaders: BTreeMap<&str, usize> = nodes.iter().map(|n| (n.as_str(), 0)).collect();
    for s in shards {
        if let Some(c) = leaders.get_mut(s.leader.as_str()) {
            *c += 1;
        }
    }
    let mut shards = shards.to_vec();
    let mut steps = Vec::new();
    for _ in 0..shards.len() {
        let (Some((&max, &hi)), Some((&min, &lo))) = (
            leaders
                .iter()
                .max_by_key(|(n, c)| (**c, std::cmp::Reverse(**n))),
            leaders.iter().min_by_key(|(n, c)| (**c, **n)),
        ) else {
            break;
        };
        if hi <= lo + 1 {
            break;
        }
        let Some(s) = shards
            .iter_mut()
            .find(|s| s.leader == max && s.nodes.iter().any(|n| n == min))
        else {
            break;
        };
        s.leader = min.to_owned();
        steps.push(Step::Leader {
            collection: s.collection.clone(),
            shard: s.shard,
            to: min.to_owned(),
        });
        *leaders.get_mut(max).unwrap_or(&mut 0) -= 1;
        *leaders.get_mut(min).unwrap_or(&mut 0) += 1;
    }
    steps
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nodes(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("n{i}")).collect()
    }

    fn view(shard: u32, nodes: &[&str], leader: &str) -> ShardView {
        ShardView {
            collection: "c".into(),
            shard,
            nodes: nodes.iter().map(|s| s.to_string()).collect(),
            leader: leader.into(),
        }
    }

    fn counts(nodes: &[String], shards: &[ShardView], steps: &[Step]) -> Vec<usize> {
        let mut shards = shards.to_vec();
        for s in steps {
            if let Step::Move {
                shard, from, to, ..
            } = s
            {
                let v = shards.iter_mut().find(|v| v.shard == *shard).unwrap();
                assert!(!v.nodes.contains(to), "a shard twice on {to}");
                for n in v.nodes.iter_mut() {
                    if n == from {
                        *n = to.clone();
                    }
                }
            }
        }
        nodes
            .iter()
            .map(|n| shards.iter().filter(|s| s.nodes.contains(n)).count())
            .collect()
    }

    #[test]
    fn drain_empties_a_node_and_rebalance_evens_replicas() {
        let n = nodes(4);
        // 4 shards x 3 replicas, all piled on n0..n2; n3 empty.
        let shards: Vec<ShardView> = (0..4).map(|i| view(i, &["n0", "n1", "n2"], "n0")).collect();
        let steps = plan_replicas(&n, &shards, None);
        let c = counts(&n, &shards, &steps);
        assert_eq!(c.iter().sum::<usize>(), 12);
        assert!(
            c.iter().max().unwrap() - c.iter().min().unwrap() <= 1,
            "{c:?}"
        );
        assert_eq!(steps.len(), 3, "{steps:?}");
        // Draining n1 moves its four replicas; the rest stays within one.
        let steps = plan_replicas(&n, &shards, Some("n1"));
        let c = counts(&n, &shards, &steps);
        assert_eq!(c[1], 0, "{c:?}");
        assert_eq!(c.iter().sum::<usize>(), 12);
        // Balanced already: nothing to do.
        let balanced = vec![view(0, &["n0", "n1"], "n0"), view(1, &["n2", "n3"], "n2")];
        assert!(plan_replicas(&n, &balanced, None).is_empty());
    }

    #[test]
    fn leaders_even_out_among_replicas() {
        let n = nodes(3);
        let shards: Vec<ShardView> = (0..6).map(|i| view(i, &["n0", "n1", "n2"], "n0")).collect();
        let steps = plan_leaders(&n, &shards);
        assert_eq!(steps.len(), 4, "{steps:?}");
        let mut led = BTreeMap::new();
        for s in &shards {
            *led.entry(s.leader.clone()).or_insert(0) += 1;
        }
        for s in &steps {
            if let Step::Leader { to, .. } = s {
                *led.entry(to.clone()).or_insert(0) += 1;
                *led.get_mut("n0").unwrap() -= 1;
            }
        }
        assert_eq!(led.values().copied().collect::<Vec<_>>(), vec![2, 2, 2]);
    }
}
