//! Moving shard replicas between shard nodes while they serve (`ragctl shard move`, `node
//! drain`, `rebalance`), and the plan that evens replicas and leaders per node.
//!
//! A move is Raft membership change done one safe step at a time: the target joins as a
//! learner and catches up (by snapshot if the log was compacted), is promoted, leadership
//! leaves the source if it led, the source is removed, and only then does the catalog record
//! the new placement. Every step checks the group's current membership first, so asking again
//! after an interruption resumes where the move stopped. Moves run on the catalog leader (the
//! gRPC edge forwards them there).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ragcluster_proto::v1::*;
use tokio::sync::mpsc;

use crate::catalog::Catalog;
use crate::error::{CoordError, Result};
use crate::shards::Shards;

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

pub struct Rebalancer {
    catalog: Arc<Catalog>,
    shards: Arc<Shards>,
    /// The cluster's shard nodes (a move's source and target must be among them).
    shard_nodes: Vec<String>,
}

/// One move, as validated: the shard, its replicas before the move, source and target.
struct Move<'a> {
    sref: ShardRef,
    info: CollectionInfo,
    placement: Vec<String>,
    /// Everyone who may lead during the move: the old replicas and the newcomer.
    members: Vec<String>,
    from: &'a str,
    to: &'a str,
    progress: &'a Progress,
}

impl Move<'_> {
    async fn say(&self, m: MoveReplicaProgress) {
        let _ = self.progress.send(Ok(m)).await;
    }
}

impl Rebalancer {
    pub fn new(catalog: Arc<Catalog>, shards: Arc<Shards>, shard_nodes: Vec<String>) -> Self {
        Self {
            catalog,
            shards,
            shard_nodes,
        }
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
        let Some(m) = self.check(collection, shard, from, to, progress).await? else {
            return Ok(());
        };
        let from_id = self.shards.node_id(from).await?;
        let to_id = self.shards.node_id(to).await?;
        let to_peer = Peer {
            node_id: to_id,
            address: to.to_owned(),
        };
        self.join(&m, to_id, &to_peer).await?;
        self.catch_up(&m).await?;
        // Promote.
        let (_, view) = self.shards.leader(&m.sref, &m.members).await?;
        if view.learners.contains(&to_id) {
            self.shards
                .change_replicas(&m.sref, &m.members, ReplicaChange::Promote, to_peer)
                .await?;
            m.say(step("promoted", to)).await;
        }
        self.lead_away(&m).await?;
        // Remove the source.
        let (_, view) = self.shards.leader(&m.sref, &m.members).await?;
        if view.voters.contains(&from_id) || view.learners.contains(&from_id) {
            let peer = Peer {
                node_id: from_id,
                address: from.to_owned(),
            };
            self.shards
                .change_replicas(&m.sref, &m.members, ReplicaChange::Remove, peer)
                .await?;
            m.say(step("removed", from)).await;
        }
        self.record(&m).await?;
        // The removed replica drops its data once it applies its removal; one cut off at that
        // moment is dropped here (best effort: it may be down).
        let _ = self
            .shards
            .drop_shard(from, m.sref.clone(), STEP_TIMEOUT)
            .await;
        metrics::counter!("coordinator_replica_moves_total").increment(1);
        m.say(step("done", format!("{from} -> {to}"))).await;
        Ok(())
    }

    /// Checks a move; `None` when it was done already.
    async fn check<'a>(
        &self,
        collection: &str,
        shard: u32,
        from: &'a str,
        to: &'a str,
        progress: &'a Progress,
    ) -> Result<Option<Move<'a>>> {
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
            if !self.shard_nodes.iter().any(|n| n == node) {
                return Err(CoordError::invalid(
                    field,
                    format!("{node} is not a shard node of this cluster"),
                ));
            }
        }
        if from == to {
            return Err(CoordError::invalid("to", "the same node as from"));
        }
        let holds = |n: &str| placement.iter().any(|p| p == n);
        if !holds(from) {
            if holds(to) {
                let _ = progress.send(Ok(step("done", "already moved"))).await;
                return Ok(None);
            }
            return Err(CoordError::invalid(
                "from",
                format!("{from} holds no replica of shard {shard} ({placement:?})"),
            ));
        }
        if holds(to) {
            return Err(CoordError::invalid(
                "to",
                format!("{to} already holds a replica of shard {shard}"),
            ));
        }
        let mut members = placement.clone();
        members.push(to.to_owned());
        Ok(Some(Move {
            sref: ShardRef {
                collection: collection.to_owned(),
                shard,
            },
            info,
            placement,
            members,
            from,
            to,
            progress,
        }))
    }

    /// Step 1: the newcomer opens an empty replica and joins as a learner.
    async fn join(&self, m: &Move<'_>, to_id: u64, to_peer: &Peer) -> Result<()> {
        let (_, view) = self.shards.leader(&m.sref, &m.placement).await?;
        if view.voters.contains(&to_id) || view.learners.contains(&to_id) {
            return Ok(());
        }
        let mut peers = Vec::new();
        for n in &m.placement {
            peers.push(Peer {
                node_id: self.shards.node_id(n).await?,
                address: n.clone(),
            });
        }
        let open = OpenShardRequest {
            shard: Some(m.sref.clone()),
            dimension: m.info.dimension,
            hnsw: m.info.hnsw,
            peers,
            join: true,
        };
        // Opening again after an interrupted attempt is a no-op on the node.
        self.shards.open(m.to, open, STEP_TIMEOUT).await?;
        self.shards
            .change_replicas(
                &m.sref,
                &m.placement,
                ReplicaChange::AddLearner,
                to_peer.clone(),
            )
            .await?;
        m.say(step("learner-added", m.to)).await;
        Ok(())
    }

    /// Step 2: the newcomer applies everything the leader had committed when the catch-up began
    /// (under a steady write load it trails by the replication pipeline, as every follower
    /// does).
    async fn catch_up(&self, m: &Move<'_>) -> Result<()> {
        let until = Instant::now() + CATCH_UP_TIMEOUT;
        let mut target = 0;
        loop {
            let (_, lv) = self.shards.leader(&m.sref, &m.members).await?;
            if target == 0 {
                target = lv.commit_index;
            }
            let mine = self.shards.views(&m.sref, &[m.to.to_owned()]).await;
            let applied = mine
                .first()
                .cloned()
                .flatten()
                .map_or(0, |v| v.applied_index);
            m.say(MoveReplicaProgress {
                step: "catching-up".into(),
                applied,
                target,
                detail: String::new(),
            })
            .await;
            if applied >= target && target > 0 {
                return Ok(());
            }
            if Instant::now() >= until {
                return Err(CoordError::Deadline(format!(
                    "{} catching up on shard {} ({applied} of {target})",
                    m.to, m.sref.shard
                )));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Step 4: leadership leaves the source: to another old replica (which the catalog's placement
    /// lists throughout), else the newcomer.
    async fn lead_away(&self, m: &Move<'_>) -> Result<()> {
        let (leader, _) = self.shards.leader(&m.sref, &m.members).await?;
        if leader != m.from {
            return Ok(());
        }
        let target = m
            .placement
            .iter()
            .find(|n| n.as_str() != m.from)
            .cloned()
            .unwrap_or_else(|| m.to.to_owned());
        self.shards
            .transfer_leader(&m.sref, &m.members, &target)
            .await?;
        m.say(step("leader-moved", target)).await;
        Ok(())
    }

    /// Step 6: the catalog records the new placement (the newcomer takes the source's place, so the
    /// preferred-leader order is kept).
    async fn record(&self, m: &Move<'_>) -> Result<()> {
        let new: Vec<String> = m
            .placement
            .iter()
            .map(|n| {
                if n == m.from {
                    m.to.to_owned()
                } else {
                    n.clone()
                }
            })
            .collect();
        let (collection, shard) = (&m.sref.collection, m.sref.shard);
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
        m.say(step("placed", new.join(","))).await;
        Ok(())
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
        self.shards.transfer_leader(&sref, &nodes, to).await?;
        self.shards.routing().set_leader(collection, shard, to);
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
