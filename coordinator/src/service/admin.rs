//! The operator `Admin` service: cluster status, replica moves, leadership transfers, API keys.

use std::sync::Arc;
use std::time::Duration;

use futures::future::join_all;
use ragcluster_proto::v1::admin_server::Admin;
use ragcluster_proto::v1::*;
use tonic::{Request, Response, Status};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_client::HealthClient;

use super::forward::{Forwarder, is_forwarded};
use super::gate;
use crate::auth;
use crate::channels::Channels;
use crate::collections::Collections;
use crate::error::CoordError;
use crate::handles::Handles;
use crate::ingest::{Ingestor, check_collection};
use crate::membership::Membership;
use crate::rebalance::Rebalancer;

/// How long a forwarded key change may take to be applied here.
const KEY_CATCH_UP: Duration = Duration::from_secs(10);

pub struct AdminService {
    pub handles: Arc<Handles>,
    pub collections: Arc<Collections>,
    pub rebalancer: Arc<Rebalancer>,
    /// Writes restored documents (RestoreDocuments).
    pub ingestor: Arc<Ingestor>,
    pub forward: Arc<Forwarder>,
    pub channels: Arc<Channels>,
    pub membership: Arc<Membership>,
    /// Configured shard node addresses (seeds), listed until a member holds them.
    pub shard_nodes: Vec<String>,
    pub reembedder: Arc<crate::reembed::Reembedder>,
}

/// Passes a stream from the catalog leader on to the caller until either side ends.
async fn relay<T>(mut up: tonic::Streaming<T>, tx: tokio::sync::mpsc::Sender<Result<T, Status>>) {
    while let Some(m) = up.message().await.transpose() {
        if tx.send(m).await.is_err() {
            break;
        }
    }
}

/// A member's `grpc.health.v1` answer: "SERVING", "NOT_SERVING", or why it gave none.
async fn health_of(channels: &Channels, addr: &str) -> String {
    let ch = match channels.get(addr) {
        Ok(c) => c,
        Err(e) => return e.to_string(),
    };
    let mut c = HealthClient::new(ch);
    let check = c.check(HealthCheckRequest {
        service: String::new(),
    });
    match tokio::time::timeout(Duration::from_secs(2), check).await {
        Err(_) => "timeout".into(),
        Ok(Err(s)) => format!("error: {}", s.message()),
        Ok(Ok(r)) => match r.into_inner().status {
            1 => "SERVING".into(),
            2 => "NOT_SERVING".into(),
            s => format!("status {s}"),
        },
    }
}

impl AdminService {
    /// Every member (removed ones left out), then configured addresses no member holds.
    async fn nodes(&self, collections: &[CollectionInfo]) -> Vec<NodeStatus> {
        let channels = &self.channels;
        let membership = &self.membership;
        let full = membership.full_disks();
        let mut rows: Vec<NodeStatus> = self
            .handles
            .catalog
            .members()
            .into_iter()
            .filter(|m| m.state() != MemberState::Removed)
            .map(|m| {
                let seen = membership.last_seen(m.node_id);
                NodeStatus {
                    address: m.address.clone(),
                    kind: m.kind,
                    node_id: m.node_id,
                    state: m.state,
                    heartbeat_age_ms: seen.map_or(0, |(age, _, _)| age.as_millis() as u64),
                    disk_used_bytes: seen.map_or(0, |(_, disk, _)| disk),
                    disk_full: full.get(&m.node_id).cloned().unwrap_or_default(),
                    models: m.models.clone(),
                    shards: replicas_on(collections, m.node_id, &m.address),
                    ..Default::default()
                }
            })
            .collect();
        let known = |rows: &[NodeStatus], a: &str| rows.iter().any(|r| r.address == a);
        for a in &self.shard_nodes {
            if !known(&rows, a) {
                rows.push(NodeStatus {
                    address: a.clone(),
                    kind: NodeKind::ShardNode as i32,
                    shards: replicas_on(collections, 0, a),
                    ..Default::default()
                });
            }
        }
        for a in self.handles.models.addresses() {
            if !known(&rows, &a) {
                rows.push(NodeStatus {
                    address: a,
                    kind: NodeKind::ModelWorker as i32,
                    ..Default::default()
                });
            }
        }
        let health = join_all(rows.iter().map(|r| health_of(channels, &r.address))).await;
        for (r, h) in rows.iter_mut().zip(health) {
            r.health = h;
        }
        rows
    }
}

/// Replicas placed on a node (by id, or by address in placements without ids).
fn replicas_on(collections: &[CollectionInfo], id: u64, address: &str) -> u32 {
    collections
        .iter()
        .flat_map(|c| &c.shards)
        .filter(|p| {
            (id != 0 && p.node_ids.contains(&id))
                || (p.node_ids.is_empty() && p.nodes.iter().any(|n| n == address))
        })
        .count() as u32
}

type MoveStream = tokio_stream::wrappers::ReceiverStream<Result<MoveReplicaProgress, Status>>;
type ExportParts = futures::stream::BoxStream<'static, Result<ExportPart, Status>>;
type ReembedStream = tokio_stream::wrappers::ReceiverStream<Result<ReembedProgress, Status>>;

#[tonic::async_trait]
impl Admin for AdminService {
    async fn cluster_status(
        &self,
        req: Request<ClusterStatusRequest>,
    ) -> Result<Response<ClusterStatusResponse>, Status> {
        let _g = gate(&self.handles, &req, "ClusterStatus", Role::Admin, None)?;
        let collections = self.handles.catalog.list();
        let mut nodes = self.nodes(&collections).await;
        let mut out = Vec::new();
        for c in collections {
            let shards = self.collections.stats(&c).await;
            for st in &shards {
                if let Some(n) = nodes.iter_mut().find(|n| n.address == st.leader) {
                    n.leaders += 1;
                }
                for r in &st.replicas {
                    if let Some(n) = nodes.iter_mut().find(|n| n.address == r.node) {
                        n.chunks += r.chunks;
                        n.bytes += st.bm25_index_bytes;
                    }
                }
            }
            out.push(CollectionStatus {
                collection: Some(c),
                shards,
            });
        }
        Ok(Response::new(ClusterStatusResponse {
            nodes,
            collections: out,
            catalog: Some(self.handles.catalog.status()),
        }))
    }

    type MoveReplicaStream = MoveStream;

    async fn move_replica(
        &self,
        req: Request<MoveReplicaRequest>,
    ) -> Result<Response<MoveStream>, Status> {
        // Moves are long: they hold no admission slot.
        let (caller, _p) = gate(&self.handles, &req, "MoveReplica", Role::Admin, None)?;
        let forwarded = is_forwarded(req.metadata());
        let r = req.into_inner();
        let (tx, rx) = tokio::sync::mpsc::channel(64);
        // Moves change the catalog: they run on its leader.
        if let Some(leader) = self.handles.catalog.change_target(forwarded).await? {
            let up = self.forward.move_replica(&leader, r, &caller).await?;
            tokio::spawn(relay(up, tx));
        } else {
            let rebalancer = self.rebalancer.clone();
            tokio::spawn(async move {
                let moved = rebalancer
                    .move_replica(&r.collection, r.shard, &r.from, &r.to, &tx)
                    .await;
                if let Err(e) = moved {
                    tracing::warn!(collection = r.collection, shard = r.shard, from = r.from,
                                   to = r.to, error = %e, "replica move failed");
                    let _ = tx.send(Err(e.into())).await;
                }
            });
        }
        Ok(Response::new(tokio_stream::wrappers::ReceiverStream::new(
            rx,
        )))
    }

    type BackupShardStream = ExportParts;

    /// A shard's export, passed through: the stream holds no admission slot (it is long).
    async fn backup_shard(
        &self,
        req: Request<BackupShardRequest>,
    ) -> Result<Response<ExportParts>, Status> {
        use futures::StreamExt;
        let _g = gate(&self.handles, &req, "BackupShard", Role::Admin, None)?;
        let r = req.into_inner();
        check_collection("collection", &r.collection)?;
        let info = self.handles.catalog.get(&r.collection)?;
        let Some(p) = info.shards.get(r.shard as usize) else {
            return Err(CoordError::invalid(
                "shard",
                format!("{} has shards 0 to {}", info.name, info.shard_count - 1),
            )
            .into());
        };
        let parts = (self.handles.shards)
            .export(&info.name, r.shard, &p.nodes)
            .await?;
        let what = format!("shard {} of {}", r.shard, info.name);
        tracing::info!(
            collection = info.name,
            shard = r.shard,
            "backup of a shard started"
        );
        Ok(Response::new(
            parts
                .map(move |p| {
                    p.map_err(|error| {
                        let what = what.clone();
                        Status::from(CoordError::Shard { what, error })
                    })
                })
                .boxed(),
        ))
    }

    async fn restore_documents(
        &self,
        req: Request<RestoreDocumentsRequest>,
    ) -> Result<Response<UpsertDocumentsResponse>, Status> {
        let _g = gate(&self.handles, &req, "RestoreDocuments", Role::Admin, None)?;
        let client = ragcluster_common::server::grpc_timeout(req.metadata());
        let r = self.ingestor.restore(req.into_inner(), client).await?;
        Ok(Response::new(r))
    }

    type ReembedStream = ReembedStream;

    /// Runs on the catalog leader (it creates and drops collections); other coordinators
    /// pass the stream through. Long: holds no admission slot.
    async fn reembed(
        &self,
        req: Request<ReembedRequest>,
    ) -> Result<Response<ReembedStream>, Status> {
        let (caller, _p) = gate(&self.handles, &req, "Reembed", Role::Admin, None)?;
        let forwarded = is_forwarded(req.metadata());
        let r = req.into_inner();
        crate::reembed::check(&r)?;
        let (tx, rx) = tokio::sync::mpsc::channel(64);
        if let Some(leader) = self.handles.catalog.change_target(forwarded).await? {
            let up = self.forward.reembed(&leader, r, &caller).await?;
            tokio::spawn(relay(up, tx));
        } else {
            let reembedder = self.reembedder.clone();
            tokio::spawn(async move {
                if let Err(e) = reembedder.run(r.clone(), &tx).await {
                    tracing::warn!(collection = r.collection, action = ?r.action(), error = %e,
                                   "re-embedding step failed");
                    let _ = tx.send(Err(e.into())).await;
                }
            });
        }
        Ok(Response::new(tokio_stream::wrappers::ReceiverStream::new(
            rx,
        )))
    }

    async fn transfer_shard_leader(
        &self,
        req: Request<TransferShardLeaderRequest>,
    ) -> Result<Response<TransferShardLeaderResponse>, Status> {
        let _g = gate(
            &self.handles,
            &req,
            "TransferShardLeader",
            Role::Admin,
            None,
        )?;
        let r = req.into_inner();
        self.rebalancer
            .transfer_shard_leader(&r.collection, r.shard, &r.to)
            .await?;
        Ok(Response::new(TransferShardLeaderResponse {}))
    }

    /// Makes a key on the catalog leader and waits until this coordinator has applied it, so
    /// the key works here as soon as it is returned.
    async fn create_api_key(
        &self,
        req: Request<CreateApiKeyRequest>,
    ) -> Result<Response<CreateApiKeyResponse>, Status> {
        let h = &self.handles;
        let (caller, _p) = gate(h, &req, "CreateApiKey", Role::Admin, None)?;
        let forwarded = is_forwarded(req.metadata());
        let r = req.into_inner();
        let resp = match h.catalog.change_target(forwarded).await? {
            None => auth::create_key(&h.catalog, r, &caller).await?,
            Some(leader) => self.forward.create_api_key(&leader, r, &caller).await?,
        };
        let id = resp.key.as_ref().map(|k| k.id.clone()).unwrap_or_default();
        h.catalog
            .wait_for(|v| v.api_keys.contains_key(&id), KEY_CATCH_UP)
            .await;
        Ok(Response::new(resp))
    }

    async fn list_api_keys(
        &self,
        req: Request<ListApiKeysRequest>,
    ) -> Result<Response<ListApiKeysResponse>, Status> {
        let _g = gate(&self.handles, &req, "ListApiKeys", Role::Admin, None)?;
        let keys = self.handles.catalog.api_keys();
        Ok(Response::new(ListApiKeysResponse {
            keys: keys.into_iter().filter_map(|k| k.info).collect(),
        }))
    }

    /// Revokes a key on the catalog leader and waits until this coordinator refuses it.
    async fn revoke_api_key(
        &self,
        req: Request<RevokeApiKeyRequest>,
    ) -> Result<Response<RevokeApiKeyResponse>, Status> {
        let h = &self.handles;
        let (caller, _p) = gate(h, &req, "RevokeApiKey", Role::Admin, None)?;
        let forwarded = is_forwarded(req.metadata());
        let id = req.into_inner().id;
        if h.catalog.api_key(&id).is_none() {
            return Err(crate::error::CoordError::UnknownApiKey(id).into());
        }
        match h.catalog.change_target(forwarded).await? {
            None => auth::revoke_key(&h.catalog, &id, &caller).await?,
            Some(leader) => self.forward.revoke_api_key(&leader, &id, &caller).await?,
        }
        let revoked = |v: &crate::catalog::View| {
            v.api_keys
                .get(&id)
                .and_then(|k| k.info.as_ref())
                .is_some_and(|i| i.revoked_at_ms != 0)
        };
        h.catalog.wait_for(revoked, KEY_CATCH_UP).await;
        Ok(Response::new(RevokeApiKeyResponse {
            key: h.catalog.api_key(&id).and_then(|k| k.info),
        }))
    }

    async fn set_node_state(
        &self,
        req: Request<SetNodeStateRequest>,
    ) -> Result<Response<SetNodeStateResponse>, Status> {
        let h = &self.handles;
        let (caller, _p) = gate(h, &req, "SetNodeState", Role::Admin, None)?;
        let forwarded = is_forwarded(req.metadata());
        let r = req.into_inner();
        let resp = match h.catalog.change_target(forwarded).await? {
            None => SetNodeStateResponse {
                member: Some(self.membership.set_drain(r.node_id, r.state()).await?),
            },
            Some(leader) => self.forward.set_node_state(&leader, r, &caller).await?,
        };
        let want = resp.member.as_ref().map(|m| m.state);
        h.catalog
            .wait_for(
                |v| v.members.get(&r.node_id).map(|m| m.state) == want,
                KEY_CATCH_UP,
            )
            .await;
        Ok(Response::new(resp))
    }

    async fn remove_node(
        &self,
        req: Request<RemoveNodeRequest>,
    ) -> Result<Response<RemoveNodeResponse>, Status> {
        let h = &self.handles;
        let (caller, _p) = gate(h, &req, "RemoveNode", Role::Admin, None)?;
        let forwarded = is_forwarded(req.metadata());
        let r = req.into_inner();
        let resp = match h.catalog.change_target(forwarded).await? {
            None => RemoveNodeResponse {
                member: Some(self.membership.remove(r.node_id).await?),
            },
            Some(leader) => self.forward.remove_node(&leader, r, &caller).await?,
        };
        h.catalog
            .wait_for(
                |v| {
                    v.members
                        .get(&r.node_id)
                        .is_some_and(|m| m.state() == MemberState::Removed)
                },
                KEY_CATCH_UP,
            )
            .await;
        Ok(Response::new(resp))
    }
}
