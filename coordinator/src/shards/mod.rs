//! The shard client: every call the coordinator makes to shard nodes goes through `Shards`,
//! which owns routing (which replica serves a call: `routing`), the one retry and failover
//! policy, deadline propagation and the typed errors of `error`. Nodes are reached through a
//! `node::Connector`: gRPC (small reads multiplexed on one stream per node: `reads`), or
//! directly for a shard node in this process (`local`).
//!
//! - Writes go to the shard's leader, follow NotLeader hints, try the other replicas with
//!   backoff while the leader is unknown or down, and retry with the same request id, so a
//!   batch whose first attempt timed out but did commit is not applied twice.
//! - Reads fail over to another replica when one fails or does not answer within its share of
//!   the time left. Strong reads start on the leader; when it cannot be reached they go to a
//!   follower, which answers only after its own read-index round with the leader (through
//!   Raft, over the links between the nodes), so it is never stale.
//! - Writes that reach a follower are passed on to the leader by the follower itself, so a
//!   coordinator cut off from a leader still writes through any replica it reaches.
//! - Membership and leadership changes go to the leader, found again when it moves.

pub mod local;
pub mod node;
mod pinned;
pub mod reads;
pub mod routing;
#[cfg(test)]
pub(crate) mod scripted;
#[cfg(test)]
mod tests;

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use ragcluster_proto::v1::*;

pub use crate::error::ShardCallError;
pub use node::{Connector, GrpcConnector, ShardNode};
pub use routing::Routing;

use crate::error::{CoordError, Result};
use crate::read_token::{NO_TOKEN, ReadToken};

/// The shortest time without an answer that says something about a replica. A call cut off
/// sooner ran out of the caller's time (a client that sends 1 ms deadlines): the replica is
/// not avoided for it, or one such client would steer everyone's load away from it.
const SLOW_REPLICA_EVIDENCE: Duration = Duration::from_millis(200);

/// Whether a failed call is a reason to avoid its replica for a while: not a caller's short
/// deadline, not "no leader" (a healthy replica of a group that is electing, which a strong
/// read asked for a read index), and not a full disk (the node still serves reads).
fn counts_against(e: &ShardCallError, budget: Duration) -> bool {
    match e {
        ShardCallError::Deadline => budget >= SLOW_REPLICA_EVIDENCE,
        ShardCallError::NotLeader { .. } | ShardCallError::DiskFull { .. } => false,
        _ => true,
    }
}

/// One read of a collection: the replicas of each shard, its consistency and deadline.
#[derive(Clone, Copy)]
pub struct ReadPlan<'a> {
    pub collection: &'a str,
    pub replicas: &'a [ShardPlacement],
    pub consistency: Consistency,
    pub deadline: Instant,
    /// The client's read token: each shard is read from a replica that applied this far.
    pub token: &'a ReadToken,
}

impl ReadPlan<'_> {
    fn replicas(&self, shard: u32) -> &[String] {
        self.replicas
            .get(shard as usize)
            .map_or(&[][..], |p| &p.nodes[..])
    }

    fn min_applied(&self, shard: u32) -> u64 {
        self.token.min_applied(shard)
    }

    fn sref(&self, shard: u32) -> Option<ShardRef> {
        Some(ShardRef {
            collection: self.collection.to_owned(),
            shard,
        })
    }
}

/// Per-attempt limit of a shard write (the whole write gets its own timeout).
const WRITE_ATTEMPT: Duration = Duration::from_secs(3);
/// A write attempt with no answer after this long is sent again, under the same request id,
/// through another replica (a follower forwards it to its leader): a leader this coordinator
/// cannot reach while the replicas reach it (a partition between the two) then costs this
/// much, not the whole attempt. The request id makes the batch apply once whichever arrives.
const WRITE_HEDGE: Duration = Duration::from_secs(1);
/// How long a write keeps asking a shard whose leader refused it for a full disk: about two
/// election timeouts, in which a full leader hands its leadership to a replica with room.
/// Past it the client hears RESOURCE_EXHAUSTED naming the node and the cause.
const DISK_FULL_WAIT: Duration = Duration::from_secs(3);
/// Admin calls (membership views, node ids).
const ADMIN_CALL: Duration = Duration::from_secs(10);

/// One shard's part of a write: whole documents, or changes the shard resolves when it
/// applies them (`WriteBatchRequest.changes`).
pub enum Batch {
    Writes(Vec<DocumentWrite>),
    Changes(Vec<DocumentChange>),
    /// A re-embedding's copy or mirror: documents written only where the shard holds no
    /// newer version (`WriteBatchRequest.version`).
    Versioned(Vec<DocumentWrite>, u64),
    /// A write to the collection that serves during a re-embedding: versioned by the shard
    /// with its own log index in this epoch (`WriteBatchRequest.version_epoch`).
    InEpoch(Box<Batch>, u32),
}

impl Batch {
    /// Writes, changes, version and epoch of the request.
    fn parts(self) -> (Vec<DocumentWrite>, Vec<DocumentChange>, u64, u32) {
        match self {
            Batch::Writes(w) => (w, Vec::new(), 0, 0),
            Batch::Changes(c) => (Vec::new(), c, 0, 0),
            Batch::Versioned(w, v) => (w, Vec::new(), v, 0),
            Batch::InEpoch(b, epoch) => {
                let (w, c, v, _) = b.parts();
                (w, c, v, epoch)
            }
        }
    }
}

pub struct Shards {
    connector: Arc<dyn Connector>,
    routing: Routing,
    /// Raft id of each shard node, by address (asked once with NodeInfo).
    node_ids: Mutex<HashMap<String, u64>>,
}

/// A shard call's error, named for the client without internal addresses.
fn shard_error(collection: &str, shard: u32, e: ShardCallError) -> CoordError {
    CoordError::Shard {
        what: format!("shard {shard} of {collection}"),
        error: e,
    }
}

fn node_error(node: &str, e: ShardCallError) -> CoordError {
    CoordError::Shard {
        what: format!("shard node {node}"),
        error: e,
    }
}

impl Shards {
    pub fn new(connector: Arc<dyn Connector>) -> Self {
        Self {
            routing: Routing::with_local(connector.local_address().map(str::to_owned)),
            connector,
            node_ids: Default::default(),
        }
    }

    pub fn routing(&self) -> &Routing {
        &self.routing
    }

    fn node(&self, address: &str) -> std::result::Result<Arc<dyn ShardNode>, ShardCallError> {
        if address.is_empty() {
            // A replica whose node lost its address to another member (see the catalog view):
            // down until that node registers again.
            return Err(ShardCallError::Unavailable {
                reason: "the replica's node is down (its address was taken by another member)"
                    .into(),
                retry_after: Duration::from_millis(500),
            });
        }
        self.connector.node(address)
    }

    /// One replica per shard for every phase of a read, counted in flight while the returned
    /// guards live.
    pub fn targets(&self, plan: &ReadPlan<'_>) -> (Vec<String>, Vec<routing::InFlight>) {
        let targets: Vec<String> = plan
            .replicas
            .iter()
            .enumerate()
            .map(|(i, p)| {
                self.routing
                    .read_target(plan.collection, i as u32, &p.nodes, plan.consistency)
            })
            .collect();
        let guards = targets.iter().map(|n| self.routing.track(n)).collect();
        (targets, guards)
    }

    /// One read of a shard, starting on the replica `first`. An eventual read that fails on a
    /// replica, or gets no answer within its share of the time left, marks that replica down
    /// for a while and goes on to the next one: a lost or cut-off node costs latency, not an
    /// error. Strong reads do the same from the leader on: a follower serves one only after a
    /// Raft read index with the leader.
    async fn read<T, F, Fut>(&self, plan: &ReadPlan<'_>, shard: u32, first: &str, f: F) -> Result<T>
    where
        F: Fn(Arc<dyn ShardNode>, Duration) -> Fut,
        Fut: Future<Output = std::result::Result<T, ShardCallError>>,
    {
        let replicas = plan.replicas(shard);
        let mut tried: Vec<String> = Vec::new();
        let mut node = first.to_owned();
        loop {
            tried.push(node.clone());
            let next = self.routing.failover(replicas, &tried);
            let left = plan.deadline.saturating_duration_since(Instant::now());
            let budget = if next.is_some() { left / 2 } else { left };
            let res = match self.node(&node) {
                Ok(c) => f(c, budget).await,
                Err(e) => Err(e),
            };
            match (res, next) {
                (Ok(v), _) => return Ok(v),
                (Err(e), Some(n)) if e.is_retryable() => {
                    tracing::warn!(shard, from = %node, to = %n, error = %e, "read failover");
                    metrics::counter!("coordinator_read_failovers_total").increment(1);
                    if counts_against(&e, budget) {
                        self.routing.mark_down(&node);
                    }
                    node = n;
                }
                (Err(e), _) => {
                    tracing::debug!(shard, node = %node, error = %e, "shard read failed");
                    return Err(shard_error(plan.collection, shard, e));
                }
            }
        }
    }

    /// Writes one shard's batch through its Raft leader within `timeout` (see the module doc).
    pub async fn write(
        &self,
        collection: &str,
        shard: u32,
        replicas: &[String],
        batch: Batch,
        timeout: Duration,
    ) -> Result<WriteBatchResponse> {
        let (writes, changes, version, version_epoch) = batch.parts();
        let req = WriteBatchRequest {
            shard: Some(ShardRef {
                collection: collection.to_owned(),
                shard,
            }),
            writes,
            request_id: format!("{:032x}", rand::random::<u128>()),
            changes,
            version,
            version_epoch,
        };
        let deadline = Instant::now() + timeout;
        let mut target = self.routing.leader(collection, shard, replicas);
        let mut backoff = Duration::from_millis(20);
        let mut last = ShardCallError::Deadline;
        let mut not_here = 0;
        let mut disk_full_since: Option<Instant> = None;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                metrics::counter!("coordinator_write_failures_total").increment(1);
                tracing::warn!(collection, shard, leader = %target, error = %last,
                               timeout_ms = timeout.as_millis() as u64,
                               "write not committed in time");
                return Err(CoordError::Unavailable {
                    what: format!("shard {shard} of {collection}"),
                    reason: format!(
                        "not committed within {} ms (last error: {last}); retrying the same \
                         call is safe",
                        timeout.as_millis()
                    ),
                    retry_after_ms: 500,
                });
            }
            // One attempt may hang on a cut-off leader; keep time for the others.
            let attempt = left.min(WRITE_ATTEMPT);
            let (res, answered) = self.hedged_write(&req, replicas, &target, attempt).await;
            if answered != target {
                // The leader did not answer in time but another replica did: avoid it for a
                // moment, go through the one that answered meanwhile.
                tracing::info!(collection, shard, slow = %target, via = %answered,
                    "write answered through another replica");
                metrics::counter!("coordinator_write_hedges_total").increment(1);
                self.routing.mark_down(&target);
                target = answered;
            }
            let e = match res {
                Ok(r) => {
                    // Through a forwarding follower: the next batches go to the leader it
                    // named, unless that one is unreachable from here.
                    let leader = match r.forwarded_to.as_str() {
                        l if !l.is_empty()
                            && replicas.iter().any(|x| x == l)
                            && !self.routing.is_down(l) =>
                        {
                            l
                        }
                        _ => target.as_str(),
                    };
                    self.routing.set_leader(collection, shard, leader);
                    return Ok(r);
                }
                // A replica that moved away (a stale leader cache after a move): the others
                // are asked before the shard counts as missing.
                Err(ShardCallError::NotHere(why)) if not_here + 1 < replicas.len() => {
                    not_here += 1;
                    tracing::info!(collection, shard, node = %target, %why,
                        "write reached a node without the shard; trying the next replica");
                    target = self.routing.next_replica(replicas, &target);
                    continue;
                }
                // Nothing was proposed. A full leader hands off within an election timeout or
                // two, and then answers NotLeader naming the new one; until then ask again.
                Err(e @ ShardCallError::DiskFull { .. }) => {
                    let since = *disk_full_since.get_or_insert_with(Instant::now);
                    if since.elapsed() >= DISK_FULL_WAIT || left <= Duration::from_millis(250) {
                        metrics::counter!("coordinator_write_failures_total").increment(1);
                        tracing::warn!(collection, shard, node = %target, error = %e,
                                       "write refused: disk full");
                        return Err(shard_error(collection, shard, e));
                    }
                    tracing::info!(collection, shard, node = %target, error = %e,
                                   "write refused for a full disk; asking again");
                    tokio::time::sleep(Duration::from_millis(250).min(left)).await;
                    last = e;
                    continue;
                }
                // Bad input or a missing shard: retrying cannot help.
                Err(e @ (ShardCallError::Rejected(_) | ShardCallError::NotHere(_))) => {
                    tracing::warn!(collection, shard, node = %target, error = %e, "write refused");
                    return Err(shard_error(collection, shard, e));
                }
                Err(e) => e,
            };
            metrics::counter!("coordinator_write_retries_total").increment(1);
            tracing::info!(collection, shard, node = %target, error = %e,
                           left_ms = left.as_millis() as u64, "write retry");
            match &e {
                ShardCallError::NotLeader {
                    leader: Some((_, addr)),
                } if !addr.is_empty() && *addr != target => {
                    self.routing.set_leader(collection, shard, addr);
                    target = addr.clone();
                }
                _ => {
                    // A live replica without a leader means an election is running: poll
                    // again soon (those answers are cheap) so the write lands right after it.
                    let electing = matches!(e, ShardCallError::NotLeader { .. });
                    if counts_against(&e, attempt) {
                        // Unreachable or timed out: avoid it for a moment.
                        self.routing.mark_down(&target);
                    }
                    target = self.routing.next_replica(replicas, &target);
                    tokio::time::sleep(backoff.min(left)).await;
                    let cap = if electing { 50 } else { 500 };
                    backoff = (backoff * 2).min(Duration::from_millis(cap));
                }
            }
            last = e;
        }
    }

    /// One write attempt at `target`, sent again through the next replica when `target` has
    /// not answered within `WRITE_HEDGE`; also returns who answered. An error from the second
    /// replica does not end the attempt (the first may still answer) unless it names another
    /// leader than `target`.
    async fn hedged_write(
        &self,
        req: &WriteBatchRequest,
        replicas: &[String],
        target: &str,
        attempt: Duration,
    ) -> (
        std::result::Result<WriteBatchResponse, ShardCallError>,
        String,
    ) {
        let first = async {
            match self.node(target) {
                Ok(n) => n.write_batch(req.clone(), attempt).await,
                Err(e) => Err(e),
            }
        };
        tokio::pin!(first);
        let other = self.routing.next_replica(replicas, target);
        // A hedge needs time of its own: an attempt shorter than the hedge delay is not
        // hedged (a second call sent with no time left would outrun the caller's deadline).
        let hedged = other != target && attempt > WRITE_HEDGE;
        tokio::select! {
            r = &mut first => return (r, target.to_owned()),
            () = tokio::time::sleep(WRITE_HEDGE), if hedged => {}
        }
        let second = async {
            match self.node(&other) {
                Ok(n) => n.write_batch(req.clone(), attempt - WRITE_HEDGE).await,
                Err(e) => Err(e),
            }
        };
        tokio::pin!(second);
        tokio::select! {
            r = &mut first => (r, target.to_owned()),
            r = &mut second => match r {
                Ok(r) => (Ok(r), other.clone()),
                // It names another leader: the first was not it, go there.
                Err(e) if matches!(&e, ShardCallError::NotLeader { leader: Some((_, a)) }
                    if a != target) => (Err(e), other.clone()),
                Err(_) => (first.await, target.to_owned()),
            },
        }
    }

    /// Waits until `shard` answers a STRONG read: a leader that serves read indexes (a fresh
    /// group has none until its election and first commit). Tries the replicas in turn.
    pub async fn wait_readable(
        &self,
        collection: &str,
        shard: u32,
        replicas: &[ShardPlacement],
        deadline: Instant,
    ) -> Result<()> {
        let nodes = replicas
            .get(shard as usize)
            .map_or(&[][..], |p| &p.nodes[..]);
        let mut target = self
            .routing
            .read_target(collection, shard, nodes, Consistency::Strong);
        loop {
            let plan = ReadPlan {
                collection,
                replicas,
                consistency: Consistency::Strong,
                deadline: deadline.min(Instant::now() + Duration::from_secs(1)),
                token: &NO_TOKEN,
            };
            let e = match self.chunks(&plan, shard, &target, Vec::new(), false).await {
                Ok(_) => {
                    self.routing.set_leader(collection, shard, &target);
                    return Ok(());
                }
                Err(e) => e,
            };
            if Instant::now() >= deadline || !e.is_retryable() {
                return Err(e);
            }
            target = match &e {
                CoordError::Shard {
                    error:
                        ShardCallError::NotLeader {
                            leader: Some((_, addr)),
                        },
                    ..
                } if !addr.is_empty() => addr.clone(),
                _ => self.routing.next_replica(nodes, &target),
            };
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Starts the export of a shard (backups) on one of its replicas, the leader first: each
    /// serves it after a read index, so every write acknowledged before the call is in it.
    pub async fn export(
        &self,
        collection: &str,
        shard: u32,
        replicas: &[String],
    ) -> Result<node::ExportStream> {
        let mut target = self.routing.leader(collection, shard, replicas);
        let mut tried = 1;
        loop {
            let req = ExportRequest {
                shard: Some(ShardRef {
                    collection: collection.to_owned(),
                    shard,
                }),
                max_bytes: 0,
            };
            let res = match self.node(&target) {
                Ok(n) => n.export(req).await,
                Err(e) => Err(e),
            };
            match res {
                Ok(parts) => return Ok(parts),
                Err(e) if e.is_retryable() && tried < replicas.len() => {
                    tracing::info!(collection, shard, node = %target, error = %e,
                                   "export: trying the next replica");
                    tried += 1;
                    target = self.routing.next_replica(replicas, &target);
                }
                Err(e) => return Err(shard_error(collection, shard, e)),
            }
        }
    }

    /// The Raft id of the shard node at `address` (cached).
    pub async fn node_id(&self, address: &str) -> Result<u64> {
        if let Some(id) = self.node_ids.lock().get(address) {
            return Ok(*id);
        }
        let n = self.node(address).map_err(|e| node_error(address, e))?;
        let r = n
            .node_info(Duration::from_secs(5))
            .await
            .map_err(|e| node_error(address, e))?;
        self.node_ids.lock().insert(address.to_owned(), r.node_id);
        Ok(r.node_id)
    }

    /// The node id answering at `address` now (not cached: members move).
    pub async fn probe(&self, address: &str, timeout: Duration) -> Result<u64> {
        let n = self.node(address).map_err(|e| node_error(address, e))?;
        let r = n
            .node_info(timeout)
            .await
            .map_err(|e| node_error(address, e))?;
        self.node_ids.lock().insert(address.to_owned(), r.node_id);
        Ok(r.node_id)
    }

    pub async fn open(
        &self,
        address: &str,
        req: OpenShardRequest,
        timeout: Duration,
    ) -> Result<()> {
        let n = self.node(address).map_err(|e| node_error(address, e))?;
        n.open_shard(req, timeout)
            .await
            .map_err(|e| node_error(address, e))
    }

    pub async fn drop_shard(
        &self,
        address: &str,
        shard: ShardRef,
        timeout: Duration,
    ) -> Result<()> {
        let n = self.node(address).map_err(|e| node_error(address, e))?;
        n.drop_shard(shard, timeout)
            .await
            .map_err(|e| node_error(address, e))
    }

    /// One replica's figures and Raft view.
    pub async fn info(
        &self,
        address: &str,
        shard: ShardRef,
        timeout: Duration,
    ) -> std::result::Result<ShardInfoResponse, ShardCallError> {
        self.node(address)?.shard_info(shard, timeout).await
    }

    /// Each replica's Raft view of `shard` (None where the node did not answer).
    pub async fn views(&self, shard: &ShardRef, nodes: &[String]) -> Vec<Option<RaftStatus>> {
        let calls = nodes
            .iter()
            .map(|n| async move { self.info(n, shard.clone(), ADMIN_CALL).await.ok()?.raft });
        futures::future::join_all(calls).await
    }

    /// The current leader of a shard among `nodes` and its Raft view, waiting out an election.
    pub async fn leader(&self, shard: &ShardRef, nodes: &[String]) -> Result<(String, RaftStatus)> {
        let until = Instant::now() + ADMIN_CALL;
        loop {
            let views = self.views(shard, nodes).await;
            if let Some((n, v)) = nodes
                .iter()
                .zip(views)
                .filter_map(|(n, v)| Some((n, v?)))
                .filter(|(_, v)| v.role() == RaftRole::Leader)
                .max_by_key(|(_, v)| v.term)
            {
                self.routing.set_leader(&shard.collection, shard.shard, n);
                return Ok((n.clone(), v));
            }
            if Instant::now() >= until {
                return Err(CoordError::Unavailable {
                    what: format!("shard {} of {}", shard.shard, shard.collection),
                    reason: format!("no leader among {nodes:?}"),
                    retry_after_ms: 1000,
                });
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// A membership change sent to the shard's leader (found again if leadership moved).
    pub async fn change_replicas(
        &self,
        shard: &ShardRef,
        nodes: &[String],
        change: ReplicaChange,
        peer: Peer,
    ) -> Result<ChangeReplicasResponse> {
        let mut last = None;
        for _ in 0..5 {
            let (leader, _) = self.leader(shard, nodes).await?;
            let req = ChangeReplicasRequest {
                shard: Some(shard.clone()),
                change: change as i32,
                peer: Some(peer.clone()),
            };
            let res = match self.node(&leader) {
                Ok(n) => n.change_replicas(req, ADMIN_CALL).await,
                Err(e) => Err(e),
            };
            match res {
                Ok(r) => return Ok(r),
                Err(e) if e.is_retryable() => {
                    last = Some(e);
                    tokio::time::sleep(Duration::from_millis(300)).await;
                }
                Err(e) => return Err(shard_error(&shard.collection, shard.shard, e)),
            }
        }
        Err(shard_error(
            &shard.collection,
            shard.shard,
            last.unwrap_or(ShardCallError::Deadline),
        ))
    }

    /// Moves a shard's leadership to the replica on `to` and waits until it leads.
    pub async fn transfer_leader(
        &self,
        shard: &ShardRef,
        nodes: &[String],
        to: &str,
    ) -> Result<()> {
        let to_id = self.node_id(to).await?;
        let until = Instant::now() + ADMIN_CALL * 3;
        loop {
            let (leader, _) = self.leader(shard, nodes).await?;
            if leader == to {
                return Ok(());
            }
            if Instant::now() >= until {
                return Err(CoordError::Deadline(format!(
                    "leadership of shard {} moving to {to}",
                    shard.shard
                )));
            }
            let req = TransferLeaderRequest {
                shard: Some(shard.clone()),
                to_node_id: to_id,
            };
            if let Ok(n) = self.node(&leader)
                && let Err(e) = n.transfer_leader(req, ADMIN_CALL).await
            {
                tracing::debug!(shard = shard.shard, to, error = %e, "leadership transfer");
            }
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    }
}
