//! Rebuilding a replica whose Raft member failed (`RaftStatus.failed`: its log lost entries it
//! had acknowledged, raft-rs panicked on it, its log could not be persisted). Such a replica
//! serves nothing, and it cannot be repaired by Raft alone: the leader still believes it holds
//! what it acknowledged. So the catalog leader rebuilds it on the same node, as a move onto
//! itself: the replica is removed from its group (the others keep their quorum), its data is
//! dropped, an empty replica joins as a learner (a learner neither votes nor leads, so it can
//! elect no one while it holds nothing) and catches up by snapshot, then it is promoted.
//! The placement does not change.

use std::sync::Arc;
use std::time::{Duration, Instant};

use ragcluster_proto::v1::*;
use tokio::sync::mpsc;

use super::{Move, Rebalancer, STEP_TIMEOUT, step};
use crate::error::{CoordError, Result};

/// How often the catalog leader looks for failed replicas.
pub const REPAIR_SCAN: Duration = Duration::from_secs(3);

impl Rebalancer {
    /// Rebuilds the replica of `collection`/`shard` on the node at `node` from its peers (see
    /// the module doc).
    pub async fn repair(&self, collection: &str, shard: u32, node: &str) -> Result<()> {
        let started = Instant::now();
        let info = self.catalog.get(collection)?;
        let p = info
            .shards
            .get(shard as usize)
            .ok_or_else(|| CoordError::invalid("shard", format!("{collection} has no {shard}")))?;
        let placement = self.resolve(p)?;
        let Some(me) = placement.iter().find(|(_, a)| a == node).cloned() else {
            return Err(CoordError::invalid(
                "node",
                format!("{node} holds no replica of {collection}/{shard}"),
            ));
        };
        if placement.len() < 2 {
            return Err(CoordError::FailedPrecondition(format!(
                "{collection}/{shard} has no other replica to rebuild {node} from"
            )));
        }
        let (progress, _) = mpsc::channel(1);
        let m = Move::new(
            collection,
            shard,
            info,
            placement,
            me.clone(),
            me.clone(),
            &progress,
        );
        let peer = Peer {
            node_id: me.0,
            address: me.1.clone(),
        };
        // Out of the group first: the others' quorum no longer counts on it.
        let others: Vec<String> = m.members.iter().filter(|a| **a != me.1).cloned().collect();
        let (_, view) = self.shards.leader(&m.sref, &others).await?;
        if view.voters.contains(&me.0) || view.learners.contains(&me.0) {
            self.shards
                .change_replicas(&m.sref, &others, ReplicaChange::Remove, peer.clone())
                .await?;
        }
        // Its data goes; an empty replica joins as a learner and catches up by snapshot.
        self.shards
            .drop_shard(&me.1, m.sref.clone(), STEP_TIMEOUT)
            .await?;
        self.join(&m, me.0, &peer).await?;
        self.catch_up(&m).await?;
        let (_, view) = self.shards.leader(&m.sref, &m.members).await?;
        if view.learners.contains(&me.0) {
            self.shards
                .change_replicas(&m.sref, &m.members, ReplicaChange::Promote, peer)
                .await?;
        }
        m.say(step("done", format!("{node} rebuilt"))).await;
        metrics::counter!("coordinator_replica_repairs_total").increment(1);
        tracing::warn!(
            collection,
            shard,
            node,
            ms = started.elapsed().as_millis() as u64,
            "failed replica rebuilt from its peers"
        );
        Ok(())
    }

    /// Every replica whose member failed, as (collection, shard, node address, why).
    async fn failed_replicas(&self) -> Vec<(String, u32, String, String)> {
        let mut out = Vec::new();
        for info in self.catalog.list() {
            for (shard, p) in info.shards.iter().enumerate() {
                let sref = ShardRef {
                    collection: info.name.clone(),
                    shard: shard as u32,
                };
                let views = self.shards.views(&sref, &p.nodes).await;
                for (node, v) in p.nodes.iter().zip(views) {
                    if let Some(v) = v.filter(|v| !v.failed.is_empty()) {
                        out.push((info.name.clone(), shard as u32, node.clone(), v.failed));
                    }
                }
            }
        }
        out
    }
}

/// On the catalog leader, every `REPAIR_SCAN`: rebuilds each failed replica (one at a time).
pub fn spawn_repairs(r: Arc<Rebalancer>) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(REPAIR_SCAN);
        loop {
            tick.tick().await;
            if !r.catalog.is_leader() {
                continue;
            }
            for (collection, shard, node, why) in r.failed_replicas().await {
                tracing::warn!(%collection, shard, %node, %why,
                    "replica out of service; rebuilding it from its peers");
                if let Err(e) = r.repair(&collection, shard, &node).await {
                    metrics::counter!("coordinator_replica_repair_failures_total").increment(1);
                    tracing::warn!(%collection, shard, %node, error = %e,
                        "replica rebuild failed; tried again at the next scan");
                }
            }
        }
    })
}
