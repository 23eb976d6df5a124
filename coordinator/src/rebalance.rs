//! Moving shard replicas between shard nodes while they serve (`ragctl shard move`, `node
//! drain`, `rebalance`; the plans that choose the moves are `ragctl`'s).
//!
//! A move is Raft membership change done one safe step at a time: the target joins as a
//! learner and catches up (by snapshot if the log was compacted), is promoted, leadership
//! leaves the source if it led, the source is removed, and only then does the catalog record
//! the new placement. Every step checks the group's current membership first, so asking again
//! after an interruption resumes where the move stopped. Moves run on the catalog leader (the
//! gRPC edge forwards them there).

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
