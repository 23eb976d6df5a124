//! Collection lifecycle: validate, place shards, open them on their nodes, record in the
//! catalog; drop; describe with live shard statistics. Creates and drops run on the catalog
//! leader (the gRPC edge forwards them there).

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures::future::join_all;
use ragcluster_proto::v1::*;

use crate::catalog::{Catalog, valid_name};
use crate::error::{CoordError, Result};
use crate::limits::{MAX_ALIAS_ACTIONS, MAX_REPLICATION_FACTOR, MAX_SHARDS};
use crate::membership::Membership;
use crate::models::Models;
use crate::placement;
use crate::shards::Shards;

pub const DEFAULT_SHARDS: u32 = 3;
pub const DEFAULT_CHUNK_SIZE: u32 = 200;
pub const DEFAULT_OVERLAP: u32 = 32;
pub const DEFAULT_MIN_CHUNK: u32 = 16;
const ADMIN_TIMEOUT: Duration = Duration::from_secs(30);
const INFO_TIMEOUT: Duration = Duration::from_secs(5);

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

/// A create's shard layout and index parameters, defaults filled and ranges checked.
struct Layout {
    shard_count: u32,
    replication_factor: u32,
    hnsw: HnswParams,
}

fn layout(r: &CreateCollectionRequest, nodes: usize) -> Result<Layout> {
    if !valid_name(&r.name) {
        return Err(CoordError::invalid("name", "must match [a-z0-9_-]{1,64}"));
    }
    let shard_count = match r.shard_count {
        0 => DEFAULT_SHARDS,
        n => n,
    };
    if shard_count > MAX_SHARDS {
        return Err(CoordError::invalid(
            "shard_count",
            format!("must be in [1, {MAX_SHARDS}]"),
        ));
    }
    let rf = r.replication_factor.max(1);
    let nodes = nodes as u32;
    if rf > nodes || rf > MAX_REPLICATION_FACTOR {
        return Err(CoordError::invalid(
            "replication_factor",
            format!("must be in [1, min({MAX_REPLICATION_FACTOR}, shard nodes = {nodes})]"),
        ));
    }
    crate::schema::check_fields("fields", &r.fields)?;
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
    Ok(Layout {
        shard_count,
        replication_factor: rf,
        hnsw,
    })
}

pub struct Collections {
    catalog: Arc<Catalog>,
    shards: Arc<Shards>,
    models: Arc<Models>,
    /// Where new collections are placed (UP shard nodes).
    membership: Arc<Membership>,
    /// Serialises creates and drops, so two creates of one name cannot both open (and drop
    /// each other's) shards.
    changes: tokio::sync::Mutex<()>,
}

impl Collections {
    pub fn new(
        catalog: Arc<Catalog>,
        shards: Arc<Shards>,
        models: Arc<Models>,
        membership: Arc<Membership>,
    ) -> Self {
        Self {
            catalog,
            shards,
            models,
            membership,
            changes: Default::default(),
        }
    }

    /// Creates a collection (on the catalog leader): every replica opened, then recorded.
    pub async fn create(&self, r: CreateCollectionRequest) -> Result<CollectionInfo> {
        let nodes = self.membership.placeable().await;
        let l = layout(&r, nodes.len())?;
        let _serial = self.changes.lock().await;
        if self.catalog.contains(&r.name) {
            return Err(CoordError::CollectionExists(r.name));
        }
        if let Some(to) = self.catalog.alias_target(&r.name) {
            return Err(CoordError::invalid(
                "name",
                format!("{:?} is an alias of collection {to:?}", r.name),
            ));
        }
        let model = self.embedding_model(&r.embedding_model).await?;
        let chunking = normalize_chunking(r.chunking, model.max_sequence_length)?;
        let placed = placement::place_shards(&r.name, l.shard_count, l.replication_factor, &nodes);
        let info = CollectionInfo {
            name: r.name.clone(),
            shard_count: l.shard_count,
            replication_factor: l.replication_factor,
            chunking: Some(chunking),
            embedding_model: model.name.clone(),
            dimension: model.dimension,
            hnsw: Some(l.hnsw),
            shards: placed
                .iter()
                .map(|replicas| ShardPlacement {
                    nodes: replicas.iter().map(|(_, a)| a.clone()).collect(),
                    node_ids: replicas.iter().map(|(id, _)| *id).collect(),
                })
                .collect(),
            created_at_ms: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_millis() as u64)
                .unwrap_or(0),
            fields: Vec::new(),
            reembed: None,
            reembed_epoch: 0,
        };
        let mut info = info;
        // Declared fields, and the keyword field chunking sets.
        let mut fields = r.fields.clone();
        fields.push(FieldSchema {
            name: crate::schema::SECTION.into(),
            r#type: FieldType::Keyword as i32,
        });
        let add = AddFieldsRequest {
            collection: info.name.clone(),
            fields,
        };
        crate::schema::apply_add_fields(&mut info, &add)?;
        self.open_shards(&info).await?;
        // Acknowledged only once every shard serves STRONG reads (a leader with a read index).
        let deadline = std::time::Instant::now() + ADMIN_TIMEOUT;
        let ready = (0..info.shard_count).map(|s| {
            self.shards
                .wait_readable(&info.name, s, &info.shards, deadline)
        });
        for r in join_all(ready).await {
            r?;
        }
        self.catalog.insert(info.clone(), ADMIN_TIMEOUT).await?;
        tracing::info!(collection = %info.name, shards = l.shard_count, "collection created");
        Ok(info)
    }

    /// The model decides the dimension and the token limit of a chunk.
    async fn embedding_model(&self, name: &str) -> Result<ModelInfo> {
        let models = self.models.list(ADMIN_TIMEOUT).await?;
        let wanted = |m: &&ModelInfo| m.kind == "embed" && (name.is_empty() || m.name == name);
        models.iter().find(wanted).cloned().ok_or_else(|| {
            CoordError::invalid(
                "embedding_model",
                format!("{name:?} is not served by the model worker"),
            )
        })
    }

    /// Opens every replica of a new collection. Shards with its name are leftovers of a create
    /// that crashed before the catalog write (the name is not in the catalog, so they hold
    /// nothing acknowledged): they are dropped first.
    async fn open_shards(&self, info: &CollectionInfo) -> Result<()> {
        let opens = info.shards.iter().enumerate().flat_map(|(i, p)| {
            let peers: Vec<Peer> = p
                .node_ids
                .iter()
                .zip(&p.nodes)
                .map(|(id, n)| Peer {
                    node_id: *id,
                    address: n.clone(),
                })
                .collect();
            p.nodes.iter().map(move |node| {
                let shard = ShardRef {
                    collection: info.name.clone(),
                    shard: i as u32,
                };
                let req = OpenShardRequest {
                    shard: Some(shard.clone()),
                    dimension: info.dimension,
                    hnsw: info.hnsw,
                    peers: peers.clone(),
                    join: false,
                };
                async move {
                    let _ = self.shards.drop_shard(node, shard, ADMIN_TIMEOUT).await;
                    self.shards.open(node, req, ADMIN_TIMEOUT).await
                }
            })
        });
        for r in join_all(opens).await {
            r?;
        }
        Ok(())
    }

    /// Drops a collection (on the catalog leader): out of the catalog first, then its shards.
    pub async fn remove(&self, name: &str) -> Result<()> {
        let _serial = self.changes.lock().await;
        if let Some(to) = self.catalog.alias_target(name) {
            return Err(CoordError::FailedPrecondition(format!(
                "{name:?} is an alias of collection {to:?}: drop the collection by its own \
                 name, or delete the alias with UpdateAliases"
            )));
        }
        let info = self.catalog.remove(name, ADMIN_TIMEOUT).await?;
        let drops = info.shards.iter().enumerate().flat_map(|(i, p)| {
            let info = &info;
            p.nodes.iter().map(move |node| async move {
                let shard = ShardRef {
                    collection: info.name.clone(),
                    shard: i as u32,
                };
                (i, self.shards.drop_shard(node, shard, ADMIN_TIMEOUT).await)
            })
        });
        for (i, r) in join_all(drops).await {
            if let Err(e) = r {
                // The collection is gone from the catalog, so nothing can reach the shard; it
                // is dropped again if the name is ever re-created.
                tracing::warn!(collection = name, shard = i, error = %e, "could not drop shard");
            }
        }
        Ok(())
    }

    /// Fields added to a collection's schema (on the leader), serialized with collection
    /// changes; `r.collection` is a collection's own name. Returns the schema after.
    pub async fn add_fields(&self, r: AddFieldsRequest) -> Result<Vec<FieldSchema>> {
        crate::schema::check_fields("fields", &r.fields)?;
        let _serial = self.changes.lock().await;
        let name = r.collection.clone();
        let mut info = self.catalog.get(&name)?;
        if crate::schema::holds(&info, &r.fields) {
            return Ok(info.fields);
        }
        // Refused here as the catalog would refuse it, with the request's own paths.
        crate::schema::apply_add_fields(&mut info, &r)?;
        self.catalog.add_fields(r, ADMIN_TIMEOUT).await?;
        Ok(self.catalog.get(&name)?.fields)
    }

    /// Alias changes, validated whole here and applied together by the catalog (on the
    /// leader), serialized with collection changes.
    pub async fn update_aliases(&self, r: UpdateAliasesRequest) -> Result<()> {
        check_alias_actions(&r)?;
        let _serial = self.changes.lock().await;
        self.catalog.update_aliases(r, ADMIN_TIMEOUT).await
    }

    /// Every replica of every shard asked for its figures and Raft view; the shard's row shows
    /// the leader's figures (or the first replica that answered).
    pub async fn stats(&self, info: &CollectionInfo) -> Vec<ShardStats> {
        let calls = info
            .shards
            .iter()
            .enumerate()
            .map(|(i, p)| self.shard_stats(&info.name, i as u32, &p.nodes));
        join_all(calls).await
    }

    async fn shard_stats(&self, collection: &str, shard: u32, nodes: &[String]) -> ShardStats {
        let sref = ShardRef {
            collection: collection.to_owned(),
            shard,
        };
        let answers = join_all(nodes.iter().map(|node| {
            let sref = sref.clone();
            async move { (node, self.shards.info(node, sref, INFO_TIMEOUT).await) }
        }))
        .await;
        let mut stats = ShardStats {
            shard,
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
                        role: raft.role,
                        applied_index: raft.applied_index,
                        chunks: s.chunks,
                        failed: raft.failed.clone(),
                    });
                    let leads = raft.role() == RaftRole::Leader;
                    if leads {
                        self.shards.routing().set_leader(collection, shard, node);
                    }
                    if best.as_ref().is_none_or(|b| !b.0 && leads) {
                        best = Some((leads, s, node.clone()));
                    }
                }
                Err(e) => {
                    stats.replicas.push(ReplicaStatus {
                        node: node.clone(),
                        role: RaftRole::Unreachable as i32,
                        ..Default::default()
                    });
                    errors.push(format!("{node}: {e}"));
                }
            }
        }
        match best {
            Some((leads, s, node)) => {
                let raft = s.raft.unwrap_or_default();
                stats.documents = s.documents;
                stats.chunks = s.chunks;
                stats.applied_seq = s.applied_seq;
                stats.bm25_index_bytes = s.bm25_index_bytes;
                stats.hnsw_points = s.hnsw_points;
                stats.hnsw_tombstones = s.hnsw_tombstones;
                stats.hnsw_pending = s.hnsw_pending;
                stats.bytes_by_family = s.bytes_by_family;
                stats.term = raft.term;
                stats.commit_index = raft.commit_index;
                stats.leader = if leads {
                    node.clone()
                } else {
                    raft.leader_address
                };
                stats.node = node;
            }
            None => stats.error = errors.join("; "),
        }
        stats
    }
}

/// An UpdateAliases request as a whole: 1 to `MAX_ALIAS_ACTIONS` actions, each naming a valid
/// alias (and collection). What it refers to is checked when the catalog applies it.
pub fn check_alias_actions(r: &UpdateAliasesRequest) -> Result<()> {
    if r.actions.is_empty() {
        return Err(CoordError::invalid("actions", "is empty"));
    }
    if r.actions.len() > MAX_ALIAS_ACTIONS {
        return Err(CoordError::TooLarge {
            field: "actions".into(),
            reason: format!("at most {MAX_ALIAS_ACTIONS} per call"),
        });
    }
    let name = |field: String, v: &str| {
        if valid_name(v) {
            Ok(())
        } else {
            Err(CoordError::invalid(
                field,
                format!("{v:?} is not a name: [a-z0-9_-], 1 to 64 characters"),
            ))
        }
    };
    for (i, a) in r.actions.iter().enumerate() {
        match &a.action {
            Some(alias_action::Action::Put(p)) => {
                name(format!("actions[{i}].put.alias"), &p.alias)?;
                name(format!("actions[{i}].put.collection"), &p.collection)?;
            }
            Some(alias_action::Action::Delete(alias)) => {
                name(format!("actions[{i}].delete"), alias)?;
            }
            None => {
                return Err(CoordError::invalid(
                    format!("actions[{i}]"),
                    "names neither put nor delete",
                ));
            }
        }
    }
    Ok(())
}
