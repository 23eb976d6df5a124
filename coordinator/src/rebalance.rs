//! Moving shard replicas between shard nodes while they serve (`ragctl shard move`, `node
//! drain`, `rebalance`; the plans that choose the moves are `ragctl`'s).
//!
//! A move is Raft membership change done one safe step at a time: the target joins as a
//! learner and catches up (by snapshot if the log was compacted), is promoted, leadership
//! leaves the source if it led, the source is removed, and only then does the catalog record
//! the new placement. Every step checks the group's current membership first, so asking again
//! after an interruption resumes where the move stopped. Moves run on the catalog leader (the
//! gRPC edge forwards them there). `repair` rebuilds a failed replica in place the same way.

use std::sync::Arc;
use std::time::{Duration, Instant};

use ragcluster_proto::v1::*;
use tokio::sync::mpsc;

use crate::catalog::Catalog;
use crate::error::{CoordError, Result};
use crate::membership::Membership;
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
    /// The member table (a move's source and target must be shard nodes of it).
    membership: Arc<Membership>,
}

/// One move, as validated: the shard, its replicas before the move, source and target.
struct Move<'a> {
    sref: ShardRef,
    info: CollectionInfo,
    /// (node id, current address) of each replica before the move.
    placement: Vec<(u64, String)>,
    /// Addresses of everyone who may lead during the move: the old replicas and the newcomer.
    members: Vec<String>,
    from: (u64, String),
    to: (u64, String),
    progress: &'a Progress,
}

impl<'a> Move<'a> {
    /// The move of `collection`/`shard` from `from` to `to`; everyone who may lead during it
    /// is a member (the replicas and the target).
    fn new(
        collection: &str,
        shard: u32,
        info: CollectionInfo,
        placement: Vec<(u64, String)>,
        from: (u64, String),
        to: (u64, String),
        progress: &'a Progress,
    ) -> Self {
        let mut members: Vec<String> = placement.iter().map(|(_, a)| a.clone()).collect();
        if !members.contains(&to.1) {
            members.push(to.1.clone());
        }
        Self {
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
        }
    }

    fn addresses(&self) -> Vec<String> {
        self.placement.iter().map(|(_, a)| a.clone()).collect()
    }
}

impl Move<'_> {
    async fn say(&self, m: MoveReplicaProgress) {
        let _ = self.progress.send(Ok(m)).await;
    }
}

impl Rebalancer {
    pub fn new(catalog: Arc<Catalog>, shards: Arc<Shards>, membership: Arc<Membership>) -> Self {
        Self {
            catalog,
            shards,
            membership,
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
        let started = Instant::now();
        let (from_id, from) = (m.from.0, m.from.1.as_str());
        let (to_id, to) = (m.to.0, m.to.1.as_str());
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
        metrics::histogram!("coordinator_replica_move_seconds")
            .record(started.elapsed().as_secs_f64());
        tracing::info!(
            collection,
            shard,
            from,
            to,
            ms = started.elapsed().as_millis() as u64,
            "replica moved"
        );
        m.say(step("done", format!("{from} -> {to}"))).await;
        Ok(())
    }

    /// Checks a move; `None` when it was done already. `from` and `to` name shard nodes by
    /// address or node id.
    async fn check<'a>(
        &self,
        collection: &str,
        shard: u32,
        from: &str,
        to: &str,
        progress: &'a Progress,
    ) -> Result<Option<Move<'a>>> {
        let info = self.catalog.get(collection)?;
        let p = info.shards.get(shard as usize).ok_or_else(|| {
            CoordError::invalid(
                "shard",
                format!("{collection} has {} shards", info.shards.len()),
            )
        })?;
        let placement = self.resolve(p)?;
        let node = |field: &str, name: &str| {
            self.membership.shard_node(name).ok_or_else(|| {
                CoordError::invalid(
                    field,
                    format!("{name} is not a shard node of this cluster (ragctl node list)"),
                )
            })
        };
        let (from, to) = (node("from", from)?, node("to", to)?);
        if from.0 == to.0 {
            return Err(CoordError::invalid("to", "the same node as from"));
        }
        let holds = |id: u64| placement.iter().any(|(n, _)| *n == id);
        let listed = || {
            placement
                .iter()
                .map(|(id, a)| format!("{id} at {a}"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        if !holds(from.0) {
            if holds(to.0) {
                let _ = progress.send(Ok(step("done", "already moved"))).await;
                return Ok(None);
            }
            return Err(CoordError::invalid(
                "from",
                format!(
                    "node {} holds no replica of shard {shard} ({})",
                    from.0,
                    listed()
                ),
            ));
        }
        if holds(to.0) {
            return Err(CoordError::invalid(
                "to",
                format!("node {} already holds a replica of shard {shard}", to.0),
            ));
        }
        Ok(Some(Move::new(
            collection, shard, info, placement, from, to, progress,
        )))
    }

    /// A placement's (node id, address) pairs; catalogs written before node ids existed get
    /// them from the member table.
    fn resolve(&self, p: &ShardPlacement) -> Result<Vec<(u64, String)>> {
        if p.node_ids.len() == p.nodes.len() {
            return Ok(p.node_ids.iter().copied().zip(p.nodes.clone()).collect());
        }
        p.nodes
            .iter()
            .map(|a| {
                let m = self.catalog.member_at(a).ok_or_else(|| {
                    CoordError::FailedPrecondition(format!(
                        "shard node {a} has not registered yet (no node id); retry shortly"
                    ))
                })?;
                Ok((m.node_id, a.clone()))
            })
            .collect()
    }

    /// Step 1: the newcomer opens an empty replica and joins as a learner.
    async fn join(&self, m: &Move<'_>, to_id: u64, to_peer: &Peer) -> Result<()> {
        let old = m.addresses();
        let (_, view) = self.shards.leader(&m.sref, &old).await?;
        if view.voters.contains(&to_id) || view.learners.contains(&to_id) {
            return Ok(());
        }
        let peers = m
            .placement
            .iter()
            .map(|(id, a)| Peer {
                node_id: *id,
                address: a.clone(),
            })
            .collect();
        let open = OpenShardRequest {
            shard: Some(m.sref.clone()),
            dimension: m.info.dimension,
            hnsw: m.info.hnsw,
            peers,
            join: true,
        };
        // Opening again after an interrupted attempt is a no-op on the node.
        self.shards.open(&m.to.1, open, STEP_TIMEOUT).await?;
        self.shards
            .change_replicas(&m.sref, &old, ReplicaChange::AddLearner, to_peer.clone())
            .await?;
        m.say(step("learner-added", &m.to.1)).await;
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
            let mine = self
                .shards
                .views(&m.sref, std::slice::from_ref(&m.to.1))
                .await;
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
                    m.to.1, m.sref.shard
                )));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Step 4: leadership leaves the source: to another old replica (which the catalog's placement
    /// lists throughout), else the newcomer.
    async fn lead_away(&self, m: &Move<'_>) -> Result<()> {
        let (leader, _) = self.shards.leader(&m.sref, &m.members).await?;
        if leader != m.from.1 {
            return Ok(());
        }
        let target = m
            .placement
            .iter()
            .find(|(id, _)| *id != m.from.0)
            .map_or_else(|| m.to.1.clone(), |(_, a)| a.clone());
        self.shards
            .transfer_leader(&m.sref, &m.members, &target)
            .await?;
        m.say(step("leader-moved", target)).await;
        Ok(())
    }

    /// Step 6: the catalog records the new placement (the newcomer takes the source's place, so the
    /// preferred-leader order is kept).
    async fn record(&self, m: &Move<'_>) -> Result<()> {
        let new: Vec<(u64, String)> = m
            .placement
            .iter()
            .map(|n| {
                if n.0 == m.from.0 {
                    m.to.clone()
                } else {
                    n.clone()
                }
            })
            .collect();
        let ids: Vec<u64> = new.iter().map(|(id, _)| *id).collect();
        let shown = new
            .iter()
            .map(|(_, a)| a.as_str())
            .collect::<Vec<_>>()
            .join(",");
        let (collection, shard) = (&m.sref.collection, m.sref.shard);
        self.catalog
            .set_placement(collection, shard, new, CATALOG_TIMEOUT)
            .await?;
        self.catalog
            .wait_for(
                |v| {
                    v.collections
                        .get(collection)
                        .and_then(|c| c.shards.get(shard as usize))
                        .is_some_and(|p| p.node_ids == ids)
                },
                CATALOG_TIMEOUT,
            )
            .await;
        m.say(step("placed", shown)).await;
        Ok(())
    }

    /// `Admin.TransferShardLeader`.
    pub async fn transfer_shard_leader(
        &self,
        collection: &str,
        shard: u32,
        to: &str,
    ) -> Result<()> {
        let to = self
            .membership
            .shard_node(to)
            .map_or_else(|| to.to_owned(), |(_, a)| a);
        let to = to.as_str();
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

pub mod repair;
#[cfg(test)]
mod tests;
