//! Collection lifecycle: validate, place shards, open them on their nodes, record in the
//! catalog; drop; describe with live shard statistics.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures::future::join_all;
use ragcluster_proto::v1::*;

use crate::catalog::Leader;
use crate::error::{CoordError, Result};
use crate::fanout::{call, request};
use crate::{State, placement};

pub const DEFAULT_SHARDS: u32 = 3;
pub const MAX_SHARDS: u32 = 256;
pub const DEFAULT_CHUNK_SIZE: u32 = 200;
pub const DEFAULT_OVERLAP: u32 = 32;
pub const DEFAULT_MIN_CHUNK: u32 = 16;
const ADMIN_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a coordinator that forwarded a catalog change waits to see it applied locally.
const CATCH_UP: Duration = Duration::from_secs(5);
/// Marks a catalog change forwarded by another coordinator.
pub const FORWARDED: &str = "x-ragcluster-forwarded";

/// A call to the catalog leader on behalf of `caller`, whose key goes along: the leader
/// checks it again rather than trusting the forwarder.
pub(crate) fn forward<T>(
    msg: T,
    timeout: Duration,
    caller: &crate::auth::Caller,
) -> tonic::Request<T> {
    let mut r = request(msg, timeout);
    r.metadata_mut()
        .insert(FORWARDED, tonic::metadata::MetadataValue::from_static("1"));
    if let Some(k) = &caller.presented
        && let Ok(v) = format!("Bearer {k}").parse()
    {
        r.metadata_mut()
            .insert(ragcluster_common::client::AUTHORIZATION, v);
    }
    r
}

pub(crate) fn valid_name(n: &str) -> bool {
    !n.is_empty()
        && n.len() <= 64
        && n.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-')
}

/// Fills defaults and checks ranges of a chunking config.
pub fn normalize_chunking(c: Option<ChunkingConfig>, max_seq: u32) -> Result<ChunkingConfig> {
    let mut c = c.unwrap_or_default();
    if c.strategy == ChunkingStrategy::Unspecified as i32 {
        c.strategy = ChunkingStrategy::Sentence as i32;
    }
    if ChunkingStrategy::try_from(c.strategy).is_err() {
        return Err(CoordError::invalid(
            "chunking.strategy",
            format!("unknown value {}", c.strategy),
        ));
    }
    if c.chunk_size == 0 {
        c.chunk_size = DEFAULT_CHUNK_SIZE;
    }
    if c.chunk_overlap == 0 && c.strategy == ChunkingStrategy::Fixed as i32 {
        c.chunk_overlap = DEFAULT_OVERLAP;
    }
    if c.min_chunk_tokens == 0 {
        c.min_chunk_tokens = DEFAULT_MIN_CHUNK;
    }
    if !(16..=512).contains(&c.chunk_size) {
        return Err(CoordError::invalid(
            "chunking.chunk_size",
            "must be in [16, 512] tokens",
        ));
    }
    if max_seq > 0 && c.chunk_size > max_seq {
        return Err(CoordError::invalid(
            "chunking.chunk_size",
            format!(
                "{} exceeds the embedding model's {max_seq}-token limit",
                c.chunk_size
            ),
        ));
    }
    if c.chunk_overlap >= c.chunk_size {
        return Err(CoordError::invalid(
            "chunking.chunk_overlap",
            "must be smaller than chunk_size",
        ));
    }
    if c.label_with_title.is_none() {
        c.label_with_title = Some(true);
    }
    Ok(c)
}

impl State {
    pub async fn create_collection(
        &self,
        r: CreateCollectionRequest,
        forwarded: bool,
        caller: &crate::auth::Caller,
    ) -> Result<CollectionInfo> {
        if let Some(addr) = self.catalog_leader(forwarded).await? {
            let name = r.name.clone();
            let info = call(
                &format!("leader coordinator {addr}"),
                ADMIN_TIMEOUT,
                self.clients.coordinator(&addr)?.create_collection(forward(
                    r,
                    ADMIN_TIMEOUT,
                    caller,
                )),
            )
            .await?
            .collection
            .unwrap_or_default();
            self.catalog
                .wait_for(|v| v.collections.contains_key(&name), CATCH_UP)
                .await;
            return Ok(info);
        }
        if !valid_name(&r.name) {
            return Err(CoordError::invalid("name", "must match [a-z0-9_-]{1,64}"));
        }
        let shard_count = if r.shard_count == 0 {
            DEFAULT_SHARDS
        } else {
            r.shard_count
        };
        if shard_count > MAX_SHARDS {
            return Err(CoordError::invalid(
                "shard_count",
                format!("must be in [1, {MAX_SHARDS}]"),
            ));
        }
        let rf = if r.replication_factor == 0 {
            1
        } else {
            r.replication_factor
        };
        let nodes = self.cfg.shard_nodes.len() as u32;
        if rf > nodes || rf > 7 {
            return Err(CoordError::invalid(
                "replication_factor",
                format!("must be in [1, min(7, shard nodes = {nodes})]"),
            ));
        }
        let mut hnsw = r.hnsw.unwrap_or_default();
        if hnsw.m == 0 {
            hnsw.m = 16;
        }
        if hnsw.ef_construction == 0 {
            hnsw.ef_construction = 200;
        }
        if hnsw.ef_search == 0 {
            hnsw.ef_search = 64;
        }
        if !(2..=256).contains(&hnsw.m) {
            return Err(CoordError::invalid("hnsw.m", "must be in [2, 256]"));
        }
        if hnsw.ef_construction > 4096 || hnsw.ef_search > 4096 {
            return Err(CoordError::invalid(
                "hnsw",
                "ef_construction and ef_search must be at most 4096",
            ));
        }
        let _serial = self.catalog_changes.lock().await;
        if self.catalog.contains(&r.name) {
            return Err(CoordError::CollectionExists(r.name));
        }
        // The model decides the dimension and the token limit of a chunk.
        let models = call(
            "model worker",
            ADMIN_TIMEOUT,
            self.clients
                .model_worker()?
                .list_models(ListModelsRequest {}),
        )
        .await?;
        let embedding_model = if r.embedding_model.is_empty() {
            models
                .models
                .iter()
                .find(|m| m.kind == "embed")
                .map(|m| m.name.clone())
                .unwrap_or_default()
        } else {
            r.embedding_model.clone()
        };
        let model = models
            .models
            .iter()
            .find(|m| m.name == embedding_model && m.kind == "embed")
            .ok_or_else(|| {
                CoordError::invalid(
                    "embedding_model",
                    format!("{embedding_model:?} is not served by the model worker"),
                )
            })?;
        let chunking = normalize_chunking(r.chunking, model.max_sequence_length)?;
        let placed = placement::place_shards(&r.name, shard_count, rf, &self.cfg.shard_nodes);
        // Raft ids of every node involved, asked before anything is created.
        let mut ids = std::collections::HashMap::new();
        for n in placed.iter().flatten() {
            if !ids.contains_key(n) {
                ids.insert(n.clone(), self.node_id(n).await?);
            }
        }
        let info = CollectionInfo {
            name: r.name.clone(),
            shard_count,
            replication_factor: rf,
            chunking: Some(chunking),
            embedding_model,
            dimension: model.dimension,
            hnsw: Some(hnsw),
            shards: placed
                .iter()
                .map(|nodes| ShardPlacement {
                    nodes: nodes.clone(),
                })
                .collect(),
            created_at_ms: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_millis() as u64)
                .unwrap_or(0),
        };
        // Shards with this name are leftovers of a create that crashed before the catalog
        // write: the name is not in the catalog, so they hold nothing acknowledged. Drop them.
        let opens = placed.iter().enumerate().flat_map(|(i, nodes)| {
            let peers: Vec<Peer> = nodes
                .iter()
                .map(|n| Peer {
                    node_id: ids[n],
                    address: n.clone(),
                })
                .collect();
            nodes.iter().map(move |node| (i, node, peers.clone()))
        });
        let opens = opens.map(|(i, node, peers)| {
            let shard = ShardRef {
                collection: r.name.clone(),
                shard: i as u32,
            };
            let req = OpenShardRequest {
                shard: Some(shard.clone()),
                dimension: model.dimension,
                hnsw: Some(hnsw),
                peers,
                join: false,
            };
            async move {
                let mut c = self.clients.shard(node)?;
                let _ = c
                    .drop_shard(request(
                        DropShardRequest { shard: Some(shard) },
                        ADMIN_TIMEOUT,
                    ))
                    .await;
                call(
                    &format!("shard node {node}"),
                    ADMIN_TIMEOUT,
                    c.open_shard(request(req, ADMIN_TIMEOUT)),
                )
                .await
            }
        });
        for r in join_all(opens).await {
            r?;
        }
        self.catalog.insert(info.clone(), ADMIN_TIMEOUT).await?;
        tracing::info!(collection = %info.name, shards = shard_count, "collection created");
        Ok(info)
    }

    pub async fn drop_collection(
        &self,
        name: &str,
        forwarded: bool,
        caller: &crate::auth::Caller,
    ) -> Result<()> {
        if let Some(addr) = self.catalog_leader(forwarded).await? {
            let req = DropCollectionRequest {
                name: name.to_owned(),
            };
            call(
                &format!("leader coordinator {addr}"),
                ADMIN_TIMEOUT,
                self.clients.coordinator(&addr)?.drop_collection(forward(
                    req,
                    ADMIN_TIMEOUT,
                    caller,
                )),
            )
            .await?;
            self.catalog
                .wait_for(|v| !v.collections.contains_key(name), CATCH_UP)
                .await;
            return Ok(());
        }
        let _serial = self.catalog_changes.lock().await;
        let info = self.catalog.remove(name, ADMIN_TIMEOUT).await?;
        let drops = info
            .shards
            .iter()
            .enumerate()
            .flat_map(|(i, p)| p.nodes.iter().map(move |node| (i, node)));
        let drops = drops.map(|(i, node)| {
            let req = DropShardRequest {
                shard: Some(ShardRef {
                    collection: info.name.clone(),
                    shard: i as u32,
                }),
            };
            async move {
                let mut c = self.clients.shard(node)?;
                call(
                    &format!("shard node {node}"),
                    ADMIN_TIMEOUT,
                    c.drop_shard(request(req, ADMIN_TIMEOUT)),
                )
                .await
            }
        });
        for (i, r) in join_all(drops).await.into_iter().enumerate() {
            if let Err(e) = r {
                // The collection is gone from the catalog, so nothing can reach the shard; it
                // is dropped again if the name is ever re-created.
                tracing::warn!(collection = name, shard = i, error = %e, "could not drop shard");
            }
        }
        Ok(())
    }

    /// Where a catalog change must be made: `None` here (this coordinator leads the catalog),
    /// or the leader's address. A change forwarded once is not forwarded again.
    pub(crate) async fn catalog_leader(&self, forwarded: bool) -> Result<Option<String>> {
        let unavailable = |reason: &str| CoordError::Unavailable {
            what: "catalog".into(),
            reason: reason.into(),
            retry_after_ms: 500,
        };
        // Two election timeouts: a change sent during an election waits for its outcome.
        let election = self.cfg.raft_tick * (2 * self.cfg.raft_election_ticks as u32);
        match self.catalog.wait_leader(election).await {
            Leader::Me => Ok(None),
            Leader::Other(_) if forwarded => Err(unavailable(
                "catalog leadership is moving between coordinators",
            )),
            Leader::Other(addr) => Ok(Some(addr)),
            Leader::Unknown => Err(unavailable(
                "no coordinator leads the catalog (election in progress or no quorum)",
            )),
        }
    }

    /// The Raft id of the shard node at `addr` (cached).
    pub async fn node_id(&self, addr: &str) -> Result<u64> {
        if let Some(id) = self.node_ids.lock().get(addr) {
            return Ok(*id);
        }
        let mut c = self.clients.shard(addr)?;
        let r = call(
            &format!("shard node {addr}"),
            Duration::from_secs(5),
            c.node_info(request(NodeInfoRequest {}, Duration::from_secs(5))),
        )
        .await?;
        self.node_ids.lock().insert(addr.to_owned(), r.node_id);
        Ok(r.node_id)
    }

    /// Every replica of every shard asked for its figures and Raft view; the shard's row shows
    /// the leader's figures (or the first replica that answered).
    pub async fn shard_stats(&self, info: &CollectionInfo) -> Vec<ShardStats> {
        let calls = info.shards.iter().enumerate().map(|(i, p)| async move {
            let req = ShardInfoRequest {
                shard: Some(ShardRef {
                    collection: info.name.clone(),
                    shard: i as u32,
                }),
            };
            let answers = join_all(p.nodes.iter().map(|node| {
                let req = req.clone();
                async move {
                    let res = match self.clients.shard(node) {
                        Ok(mut c) => {
                            call(
                                node,
                                Duration::from_secs(5),
                                c.shard_info(request(req, Duration::from_secs(5))),
                            )
                            .await
                        }
                        Err(e) => Err(e),
                    };
                    (node.clone(), res)
                }
            }))
            .await;
            let mut stats = ShardStats {
                shard: i as u32,
                ..Default::default()
            };
            let mut errors = Vec::new();
            let mut best: Option<(bool, ShardInfoResponse, String)> = None;
            for (node, res) in answers {
                match res {
                    Ok(s) => {
                        let raft = s.raft.clone().unwrap_or_default();
                        stats.replicas.push(ReplicaStatus {
                            node: node.clone(),
                            role: raft.role.clone(),
                            applied_index: raft.applied_index,
                            chunks: s.chunks,
                        });
                        let leads = raft.role == "leader";
                        if leads {
                            self.routing.set_leader(&info.name, i as u32, &node);
                        }
                        if best.as_ref().is_none_or(|b| !b.0 && leads) {
                            best = Some((leads, s, node));
                        }
                    }
                    Err(e) => {
                        stats.replicas.push(ReplicaStatus {
                            node: node.clone(),
                            role: "unreachable".into(),
                            ..Default::default()
                        });
                        errors.push(format!("{node}: {e}"));
                    }
                }
            }
            match best {
                Some((leads, s, node)) => {
                    let raft = s.raft.unwrap_or_default();
                    stats.node = node.clone();
                    stats.documents = s.documents;
                    stats.chunks = s.chunks;
                    stats.applied_seq = s.applied_seq;
                    stats.bm25_index_bytes = s.bm25_index_bytes;
                    stats.hnsw_points = s.hnsw_points;
                    stats.hnsw_tombstones = s.hnsw_tombstones;
                    stats.term = raft.term;
                    stats.commit_index = raft.commit_index;
                    stats.leader = if leads { node } else { raft.leader_address };
                }
                None => stats.error = errors.join("; "),
            }
            stats
        });
        join_all(calls).await
    }
}
