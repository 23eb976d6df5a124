//! The node's RocksDB: the source of truth for every shard it hosts. One database per node,
//! one column family per record kind; keys start with the shard prefix
//! `collection 0x00 shard(u32 BE)` so a shard is one contiguous key range in each family.
//!
//! | cf       | key suffix       | value                                           |
//! |----------|------------------|-------------------------------------------------|
//! | `meta`   | `m`              | shard parameters (`ShardMeta`)                   |
//! | `meta`   | `s`              | applied sequence number (u64 BE)                 |
//! | `chunks` | chunk id         | `Chunk` (prost), embedding left out              |
//! | `vectors`| chunk id         | the embedding, f32 little-endian                 |
//! | `docs`   | doc id           | the document's chunk ids (u32-length-prefixed)   |
//! | `meta`   | `r` request id   | ts (u64 BE) + first `WriteBatchResponse` (dedupe) |
//! | `meta`   | `q` ts + id      | empty: request ids in time order, for pruning    |
//! | `meta`   | `x`              | why a salvage dropped the shard's data (`salvage`) |
//! | `meta`   | `v` doc id       | version of a re-embedding's copy (`versions`)    |
//! | `oplog`  | seq (u64 BE)     | the `WriteBatchRequest` applied at that seq      |
//! | `raft`   | `h` / `c` / `t`  | hard state, conf state, truncated (index, term)  |
//! | `raft`   | `e` index (BE)   | a Raft log entry (`eraftpb.Entry`)               |
//!
//! The applied seq is the Raft index of the last applied entry: the state machine and its
//! applied index change in one atomic write, so replaying the log after a crash never applies
//! an entry twice. Node-wide records (`~node/...` in `meta`) hold the node's Raft id and the
//! addresses of its peers.
//! Vectors sit apart from chunk records so that loading the text of search hits never reads
//! them. A write batch is one atomic RocksDB write (fsync'd when `sync_writes`), so after a crash a
//! batch is either wholly present or wholly absent. The op log keeps the batches the BM25
//! index has not committed yet, to catch it up on restart.

use std::fmt;
use std::path::Path;

use prost::Message;
use ragcluster_proto::v1::{Chunk, WriteBatchRequest, WriteBatchResponse};
use ragcluster_raft::eraftpb::ConfState;
use ragcluster_raft::{Keys, RocksLog};
use rocksdb::{
    ColumnFamilyDescriptor, DB, Direction, IteratorMode, Options, WriteBatch, WriteOptions,
};

use crate::error::{Result, ShardError};

mod salvage;
mod scan;
pub mod scrub;
mod snapshot;
mod versions;
pub use salvage::open_checked;
pub use scan::{After, ScanSpec, Scanned};
pub use snapshot::{SECTION_END, StoreSnapshot};

const CF_META: &str = "meta";
const CF_CHUNKS: &str = "chunks";
const CF_DOCS: &str = "docs";
const CF_OPLOG: &str = "oplog";
const CF_VECTORS: &str = "vectors";
pub const CF_RAFT: &str = "raft";
const ALL_CFS: [&str; 6] = [CF_META, CF_CHUNKS, CF_VECTORS, CF_DOCS, CF_OPLOG, CF_RAFT];
const NODE_ID_KEY: &[u8] = b"~node/id";
const PEERS_KEY: &[u8] = b"~node/peers";
/// Request ids are remembered this long (by the proposal timestamp in the log, so every
/// replica forgets the same ids at the same log position).
pub const DEDUPE_WINDOW_MS: u64 = 3_600_000;
/// Dropped op-log bytes left on disk (in files shared with other entries) worth a compaction
/// once a shard's op log is empty: about 400 chunks with their vectors.
const OPLOG_COMPACT_BYTES: u64 = 1 << 20;
/// Memtable bytes worth a flush once a shard's op log is empty (writes paused): below it
/// the write-ahead log they keep is a few MiB at most.
const FLUSH_AT_REST_BYTES: u64 = 4 << 20;
/// The write-ahead log's bound: past it RocksDB flushes the memtables that keep its oldest
/// file. Every chunk is in it three times (Raft entry, op-log entry, the chunk), and with
/// RocksDB's default (four times all memtables, gigabytes) a node that took a burst of
/// writes kept ~7 KB per chunk of log on disk until its memtables filled or it restarted.
const WAL_MAX_BYTES: u64 = 128 << 20;

/// Identifies a shard on a node.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ShardKey {
    pub collection: String,
    pub shard: u32,
}

impl ShardKey {
    pub fn new(collection: impl Into<String>, shard: u32) -> Self {
        Self {
            collection: collection.into(),
            shard,
        }
    }

    /// `collection 0x00 shard(u32 BE)`: the start of every key of the shard.
    pub fn prefix(&self) -> Vec<u8> {
        let mut p = Vec::with_capacity(self.collection.len() + 5);
        p.extend_from_slice(self.collection.as_bytes());
        p.push(0);
        p.extend_from_slice(&self.shard.to_be_bytes());
        p
    }

    fn key(&self, suffix: &[u8]) -> Vec<u8> {
        let mut k = self.prefix();
        k.extend_from_slice(suffix);
        k
    }

    /// Exclusive upper bound of the shard's key range.
    fn end(&self) -> Vec<u8> {
        let mut p = self.collection.as_bytes().to_vec();
        p.push(0);
        // Shard numbers are validated below u32::MAX by the coordinator (at most 256 shards).
        p.extend_from_slice(&(self.shard.saturating_add(1)).to_be_bytes());
        p
    }

    fn parse(key: &[u8]) -> Option<(Self, &[u8])> {
        let zero = key.iter().position(|b| *b == 0)?;
        let collection = std::str::from_utf8(&key[..zero]).ok()?.to_owned();
        let shard = u32::from_be_bytes(key.get(zero + 1..zero + 5)?.try_into().ok()?);
        Some((Self { collection, shard }, &key[zero + 5..]))
    }
}

impl fmt::Display for ShardKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.collection, self.shard)
    }
}

/// Graph parameters of a shard (validated by the service: `m` in [2, 256]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct HnswParams {
    /// Links per node.
    pub m: u32,
    pub ef_construction: u32,
    /// Default search breadth when a query does not give one.
    pub ef_search: u32,
}

/// A shard's parameters, kept under `m` in `meta`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ShardMeta {
    pub dimension: u32,
    pub hnsw: HnswParams,
}

// On-disk records. Their tags match what earlier versions wrote (an `OpenShardRequest` for
// both), so data directories from before still open.
#[derive(Clone, PartialEq, prost::Message)]
struct MetaRecord {
    #[prost(uint32, tag = "2")]
    dimension: u32,
    #[prost(message, optional, tag = "3")]
    hnsw: Option<HnswRecord>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct HnswRecord {
    #[prost(uint32, tag = "1")]
    m: u32,
    #[prost(uint32, tag = "2")]
    ef_construction: u32,
    #[prost(uint32, tag = "3")]
    ef_search: u32,
}

#[derive(Clone, PartialEq, prost::Message)]
struct PeersRecord {
    #[prost(message, repeated, tag = "4")]
    peers: Vec<PeerRecord>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct PeerRecord {
    #[prost(uint64, tag = "1")]
    node_id: u64,
    #[prost(string, tag = "2")]
    address: String,
}

/// What a committed batch changed, for the in-memory indexes.
#[derive(Debug, Default)]
pub struct BatchEffect {
    /// Chunk ids that existed before the batch for the documents it touched.
    pub removed_chunks: Vec<String>,
    pub existed: u32,
    pub not_found: Vec<String>,
}

pub struct Store {
    db: std::sync::Arc<DB>,
    sync: bool,
    /// Set when the scrub found a damaged file: compactions asked for here would meet it.
    damaged: std::sync::atomic::AtomicBool,
}

impl Store {
    pub fn open(path: &Path, sync: bool) -> Result<Self> {
        let mut opts = Options::default();
        opts.create_if_missing(true);
        opts.create_missing_column_families(true);
        opts.set_compression_type(rocksdb::DBCompressionType::Lz4);
        opts.enable_statistics();
        opts.set_max_total_wal_size(WAL_MAX_BYTES);
        let cfs = ALL_CFS
            .into_iter()
            .map(|n| ColumnFamilyDescriptor::new(n, opts.clone()));
        let db = DB::open_cf_descriptors(&opts, path, cfs)?;
        Ok(Self {
            db: std::sync::Arc::new(db),
            sync,
            damaged: Default::default(),
        })
    }

    /// Notes that a live file is damaged (see `damaged`).
    pub fn mark_damaged(&self) {
        self.damaged
            .store(true, std::sync::atomic::Ordering::Release);
    }

    fn cf(&self, name: &str) -> &rocksdb::ColumnFamily {
        self.db
            .cf_handle(name)
            .expect("column families are created at open")
    }

    fn write(&self, batch: WriteBatch) -> Result<()> {
        self.write_opt(batch, self.sync)
    }

    fn write_opt(&self, batch: WriteBatch, sync: bool) -> Result<()> {
        let mut wo = WriteOptions::default();
        wo.set_sync(sync);
        self.db.write_opt(batch, &wo)?;
        Ok(())
    }

    pub fn sync_enabled(&self) -> bool {
        self.sync
    }

    /// This node's Raft id, chosen at random on first start and kept.
    pub fn node_id(&self) -> Result<u64> {
        let cf = self.cf(CF_META);
        if let Some(v) = self.db.get_cf(cf, NODE_ID_KEY)? {
            let b: [u8; 8] = v
                .as_slice()
                .try_into()
                .map_err(|_| ShardError::Corrupt("node id".into()))?;
            return Ok(u64::from_be_bytes(b));
        }
        // Below 2^53 so that JSON tooling shows it exactly.
        let id = rand::random_range(1..(1u64 << 53));
        let mut b = WriteBatch::default();
        b.put_cf(cf, NODE_ID_KEY, id.to_be_bytes());
        self.write_opt(b, true)?;
        Ok(id)
    }

    /// Known peer addresses (node id -> gRPC address).
    pub fn peers(&self) -> Result<Vec<(u64, String)>> {
        let Some(v) = self.db.get_cf(self.cf(CF_META), PEERS_KEY)? else {
            return Ok(Vec::new());
        };
        let list = PeersRecord::decode(&*v)
            .map_err(|e| ShardError::Corrupt(format!("peer table: {e}")))?;
        Ok(list
            .peers
            .into_iter()
            .map(|p| (p.node_id, p.address))
            .collect())
    }

    pub fn put_peers(&self, peers: &[(u64, String)]) -> Result<()> {
        let list = PeersRecord {
            peers: peers
                .iter()
                .map(|(id, a)| PeerRecord {
                    node_id: *id,
                    address: a.clone(),
                })
                .collect(),
        };
        let mut b = WriteBatch::default();
        b.put_cf(self.cf(CF_META), PEERS_KEY, list.encode_to_vec());
        self.write(b)
    }

    /// The Raft log of a shard's group, in the `raft` family under the shard's prefix.
    pub fn raft_log(&self, key: &ShardKey) -> RocksLog {
        RocksLog::new(self.db.clone(), CF_RAFT, key.prefix(), self.sync)
    }

    /// Every shard recorded on this node with its parameters.
    pub fn list_shards(&self) -> Result<Vec<(ShardKey, ShardMeta)>> {
        let mut out = Vec::new();
        for item in self.db.iterator_cf(self.cf(CF_META), IteratorMode::Start) {
            let (k, v) = item?;
            if let Some((key, b"m")) = ShardKey::parse(&k) {
                let r = MetaRecord::decode(&*v)
                    .map_err(|e| ShardError::Corrupt(format!("shard meta {key}: {e}")))?;
                let h = r.hnsw.unwrap_or_default();
                let meta = ShardMeta {
                    dimension: r.dimension,
                    hnsw: HnswParams {
                        m: h.m,
                        ef_construction: h.ef_construction,
                        ef_search: h.ef_search,
                    },
                };
                out.push((key, meta));
            }
        }
        Ok(out)
    }

    pub fn put_shard_meta(&self, key: &ShardKey, meta: &ShardMeta) -> Result<()> {
        let r = MetaRecord {
            dimension: meta.dimension,
            hnsw: Some(HnswRecord {
                m: meta.hnsw.m,
                ef_construction: meta.hnsw.ef_construction,
                ef_search: meta.hnsw.ef_search,
            }),
        };
        let mut b = WriteBatch::default();
        b.put_cf(self.cf(CF_META), key.key(b"m"), r.encode_to_vec());
        self.write(b)
    }

    pub fn applied_seq(&self, key: &ShardKey) -> Result<u64> {
        Ok(self
            .db
            .get_cf(self.cf(CF_META), key.key(b"s"))?
            .and_then(|v| v.as_slice().try_into().ok().map(u64::from_be_bytes))
            .unwrap_or(0))
    }

    pub fn doc_chunk_ids(&self, key: &ShardKey, doc_id: &str) -> Result<Option<Vec<String>>> {
        match self
            .db
            .get_cf(self.cf(CF_DOCS), key.key(doc_id.as_bytes()))?
        {
            None => Ok(None),
            Some(v) => decode_ids(&v).map(Some),
        }
    }

    /// Chunks by id (None where missing), with their embeddings when `with_embedding`.
    pub fn get_chunks(
        &self,
        key: &ShardKey,
        ids: &[String],
        with_embedding: bool,
    ) -> Result<Vec<Option<Chunk>>> {
        let mut chunks = self
            .get_chunks_encoded(key, ids)?
            .into_iter()
            .map(|v| match v {
                None => Ok(None),
                Some(v) => Chunk::decode(&*v)
                    .map(Some)
                    .map_err(|e| ShardError::Corrupt(format!("chunk in {key}: {e}"))),
            })
            .collect::<Result<Vec<_>>>()?;
        if with_embedding {
            for (c, v) in chunks.iter_mut().zip(self.get_vectors(key, ids)?) {
                if let (Some(c), Some(v)) = (c.as_mut(), v) {
                    c.embedding = v;
                }
            }
        }
        Ok(chunks)
    }

    /// Chunks by id as stored (an encoded `Chunk` without its embedding; None where missing),
    /// for callers that pass them on undecoded.
    pub fn get_chunks_encoded(
        &self,
        key: &ShardKey,
        ids: &[String],
    ) -> Result<Vec<Option<Vec<u8>>>> {
        let cf = self.cf(CF_CHUNKS);
        let keys: Vec<_> = ids.iter().map(|id| (cf, key.key(id.as_bytes()))).collect();
        self.db
            .multi_get_cf(keys)
            .into_iter()
            .map(|r| Ok(r?))
            .collect()
    }

    /// The stored embeddings of chunk ids, in order (None where none is stored).
    pub fn get_vectors(&self, key: &ShardKey, ids: &[String]) -> Result<Vec<Option<Vec<f32>>>> {
        let cf = self.cf(CF_VECTORS);
        let keys: Vec<_> = ids.iter().map(|id| (cf, key.key(id.as_bytes()))).collect();
        self.db
            .multi_get_cf(keys)
            .into_iter()
            .map(|v| Ok(v?.map(|v| decode_vector(&v))))
            .collect()
    }

    /// Commits one write batch atomically together with its sequence number and op-log entry.
    /// Writes within the batch are applied in order; the caller serialises batches per shard.
    pub fn commit_batch(
        &self,
        key: &ShardKey,
        seq: u64,
        req: &WriteBatchRequest,
        dedupe: Option<(u64, &Respond<'_>)>,
    ) -> Result<BatchEffect> {
        let (cf_chunks, cf_docs, cf_vectors) =
            (self.cf(CF_CHUNKS), self.cf(CF_DOCS), self.cf(CF_VECTORS));
        let mut b = WriteBatch::default();
        let mut effect = BatchEffect::default();
        for w in &req.writes {
            match self.doc_chunk_ids(key, &w.doc_id)? {
                Some(old) => {
                    effect.existed += 1;
                    for id in &old {
                        b.delete_cf(cf_chunks, key.key(id.as_bytes()));
                        b.delete_cf(cf_vectors, key.key(id.as_bytes()));
                    }
                    effect.removed_chunks.extend(old);
                }
                None if w.delete => effect.not_found.push(w.doc_id.clone()),
                None => {}
            }
            if w.delete {
                b.delete_cf(cf_docs, key.key(w.doc_id.as_bytes()));
            } else {
                for c in &w.chunks {
                    let k = key.key(c.chunk_id.as_bytes());
                    b.put_cf(cf_vectors, &k, encode_vector(&c.embedding));
                    let bare = Chunk {
                        embedding: Vec::new(),
                        ..c.clone()
                    };
                    b.put_cf(cf_chunks, k, bare.encode_to_vec());
                }
                let ids: Vec<&str> = w.chunks.iter().map(|c| c.chunk_id.as_str()).collect();
                b.put_cf(cf_docs, key.key(w.doc_id.as_bytes()), encode_ids(&ids));
            }
        }
        if let Some((ts, response)) = dedupe {
            if !req.request_id.is_empty() {
                let mut v = ts.to_be_bytes().to_vec();
                v.extend(response(&effect).encode_to_vec());
                b.put_cf(self.cf(CF_META), request_key(key, &req.request_id), v);
                b.put_cf(
                    self.cf(CF_META),
                    request_order_key(key, ts, &req.request_id),
                    [],
                );
            }
            self.prune_requests(key, ts.saturating_sub(DEDUPE_WINDOW_MS), &mut b)?;
        }
        self.record_versions(key, req, &mut b)?;
        b.put_cf(self.cf(CF_META), key.key(b"s"), seq.to_be_bytes());
        b.put_cf(
            self.cf(CF_OPLOG),
            key.key(&seq.to_be_bytes()),
            req.encode_to_vec(),
        );
        self.write_opt(b, false)?;
        Ok(effect)
    }

    /// Moves the applied index over an entry that changes no chunk (an empty entry of a new
    /// leader, a rejected batch, a conf change with its new conf state). The empty op-log
    /// record keeps the log contiguous for BM25 replay.
    pub fn commit_noop(&self, key: &ShardKey, seq: u64, conf: Option<&ConfState>) -> Result<()> {
        let mut b = WriteBatch::default();
        b.put_cf(self.cf(CF_META), key.key(b"s"), seq.to_be_bytes());
        b.put_cf(
            self.cf(CF_OPLOG),
            key.key(&seq.to_be_bytes()),
            WriteBatchRequest::default().encode_to_vec(),
        );
        if let Some(cs) = conf {
            b.put_cf(
                self.cf(CF_RAFT),
                Keys::new(key.prefix()).conf_state(),
                pb(cs)?,
            );
        }
        // A conf change must survive a crash like any applied entry; a no-op may be lost and
        // re-applied from the log.
        self.write_opt(b, conf.is_some() && self.sync)
    }

    /// The recorded outcome of an applied request id, if it is still remembered.
    pub fn request_result(&self, key: &ShardKey, id: &str) -> Result<Option<WriteBatchResponse>> {
        let Some(v) = self.db.get_cf(self.cf(CF_META), request_key(key, id))? else {
            return Ok(None);
        };
        let body = v
            .get(8..)
            .ok_or_else(|| ShardError::Corrupt(format!("request record in {key}")))?;
        WriteBatchResponse::decode(body)
            .map(Some)
            .map_err(|e| ShardError::Corrupt(format!("request record in {key}: {e}")))
    }

    /// Forgets request ids recorded before `before_ms` (at most 256 per call).
    fn prune_requests(&self, key: &ShardKey, before_ms: u64, b: &mut WriteBatch) -> Result<()> {
        let start = key.key(b"q");
        let end = request_order_key(key, before_ms, "");
        let cf = self.cf(CF_META);
        for item in self
            .db
            .iterator_cf(cf, IteratorMode::From(&start, Direction::Forward))
            .take(256)
        {
            let (k, _) = item?;
            if *k >= *end {
                break;
            }
            let id = &k[start.len() + 8..];
            b.delete_cf(cf, request_key(key, &String::from_utf8_lossy(id)));
            b.delete_cf(cf, &k);
        }
        Ok(())
    }

    /// Calls `f` for every chunk of the shard in key order, with its embedding when
    /// `with_embedding` (the two families hold the same keys, so they are walked in step).
    pub fn for_each_chunk(
        &self,
        key: &ShardKey,
        with_embedding: bool,
        mut f: impl FnMut(Chunk) -> Result<()>,
    ) -> Result<()> {
        let prefix = key.prefix();
        let mode = IteratorMode::From(&prefix, Direction::Forward);
        let mut vectors = self.db.iterator_cf(self.cf(CF_VECTORS), mode);
        for item in self.db.iterator_cf(self.cf(CF_CHUNKS), mode) {
            let (k, v) = item?;
            if !k.starts_with(&prefix) {
                break;
            }
            let mut c = Chunk::decode(&*v)
                .map_err(|e| ShardError::Corrupt(format!("chunk in {key}: {e}")))?;
            if with_embedding {
                let (vk, vv) = vectors
                    .next()
                    .ok_or_else(|| ShardError::Corrupt(format!("vector missing in {key}")))??;
                if vk != k {
                    return Err(ShardError::Corrupt(format!(
                        "chunk and vector keys diverge in {key}"
                    )));
                }
                c.embedding = decode_vector(&vv);
            }
            f(c)?;
        }
        Ok(())
    }

    /// Counts the shard's documents (keys of the `docs` family).
    pub fn count_docs(&self, key: &ShardKey) -> Result<u64> {
        let prefix = key.prefix();
        let mut n = 0;
        for item in self.db.iterator_cf(
            self.cf(CF_DOCS),
            IteratorMode::From(&prefix, Direction::Forward),
        ) {
            let (k, _) = item?;
            if !k.starts_with(&prefix) {
                break;
            }
            n += 1;
        }
        Ok(n)
    }

    /// Op-log entries with seq > `after`, in order.
    pub fn oplog_after(&self, key: &ShardKey, after: u64) -> Result<Vec<(u64, WriteBatchRequest)>> {
        let prefix = key.prefix();
        let start = key.key(&(after + 1).to_be_bytes());
        let mut out = Vec::new();
        for item in self.db.iterator_cf(
            self.cf(CF_OPLOG),
            IteratorMode::From(&start, Direction::Forward),
        ) {
            let (k, v) = item?;
            if !k.starts_with(&prefix) {
                break;
            }
            let seq = u64::from_be_bytes(
                k[prefix.len()..]
                    .try_into()
                    .map_err(|_| ShardError::Corrupt("oplog key".into()))?,
            );
            let req = WriteBatchRequest::decode(&*v)
                .map_err(|e| ShardError::Corrupt(format!("oplog {key}@{seq}: {e}")))?;
            out.push((seq, req));
        }
        Ok(out)
    }

    /// Drops op-log entries up to and including `upto` (the BM25 index has committed them).
    pub fn truncate_oplog(&self, key: &ShardKey, upto: u64) -> Result<()> {
        let mut b = WriteBatch::default();
        b.delete_range_cf(
            self.cf(CF_OPLOG),
            key.prefix(),
            key.key(&(upto + 1).to_be_bytes()),
        );
        // Losing this delete in a crash only means replaying batches the index already has.
        let mut wo = WriteOptions::default();
        wo.set_sync(false);
        self.db.write_opt(b, &wo)?;
        // A range delete frees nothing until a compaction reaches the files under it; after
        // a burst that is the whole burst again on disk. Files holding only dropped entries
        // (of this shard: the range ends at its last dropped key, inclusive) go at once. What
        // is left in files shared with other entries (level 0's above all) is compacted away
        // once the shard keeps no entry (writes paused, or a dump caught up with them), so
        // ingest is not slowed by compactions of a log it is still writing.
        let cf = self.cf(CF_OPLOG);
        let (start, last) = (key.prefix(), key.key(&upto.to_be_bytes()));
        self.db.delete_file_in_range_cf(cf, &start, &last)?;
        let end = key.key(&(upto + 1).to_be_bytes());
        let left = self
            .db
            .get_approximate_sizes_cf(cf, &[rocksdb::Range::new(&start, &end)])
            .first()
            .copied()
            .unwrap_or(0);
        let unflushed = self.property("rocksdb.cur-size-all-mem-tables");
        if left < OPLOG_COMPACT_BYTES && unflushed < FLUSH_AT_REST_BYTES {
            return Ok(());
        }
        let kept = self
            .db
            .iterator_cf(cf, IteratorMode::From(&end, Direction::Forward))
            .next()
            .transpose()?
            .is_some_and(|(k, _)| k.starts_with(&start));
        if kept {
            return Ok(());
        }
        // At rest the memtables are flushed, so the write-ahead log behind them (every
        // chunk of the burst written three times: Raft entry, op-log entry, the chunk
        // itself) can be deleted; until a memtable fills, nothing else would release it.
        if unflushed >= FLUSH_AT_REST_BYTES {
            self.flush_memtables()?;
        }
        if left >= OPLOG_COMPACT_BYTES {
            self.db
                .compact_range_cf(cf, Some(&start[..]), Some(&end[..]));
        }
        Ok(())
    }

    /// Starts flushing every column family's memtable (without waiting), after which
    /// RocksDB deletes the write-ahead-log files no memtable needs any more.
    pub fn flush_memtables(&self) -> Result<()> {
        let mut fo = rocksdb::FlushOptions::default();
        fo.set_wait(false);
        let cfs: Vec<_> = ALL_CFS.iter().map(|n| self.cf(n)).collect();
        self.db.flush_cfs_opt(&cfs, &fo)?;
        Ok(())
    }

    /// Deletes every key of the shard, then compacts its ranges so the disk is given back
    /// now: a range delete only writes a tombstone, and the files under it would otherwise
    /// stay until a compaction happens to reach them (gigabytes after many drops).
    pub fn drop_shard(&self, key: &ShardKey) -> Result<()> {
        let mut b = WriteBatch::default();
        for cf in ALL_CFS {
            b.delete_range_cf(self.cf(cf), key.prefix(), key.end());
        }
        self.write(b)?;
        if self.damaged.load(std::sync::atomic::Ordering::Acquire) {
            // Left to the salvage at the next open (a compaction meeting the file would stop
            // the database's writes).
            return Ok(());
        }
        let (start, end) = (key.prefix(), key.end());
        for cf in ALL_CFS {
            self.db
                .compact_range_cf(self.cf(cf), Some(&start[..]), Some(&end[..]));
        }
        Ok(())
    }

    /// Approximate bytes of the shard's keys by column family, in flushed SST files (RocksDB
    /// cannot size a key range of a memtable through this API).
    pub fn shard_bytes(&self, key: &ShardKey) -> Vec<(&'static str, u64)> {
        let (start, end) = (key.prefix(), key.end());
        ALL_CFS
            .into_iter()
            .map(|cf| {
                let range = rocksdb::Range::new(&start, &end);
                let sizes = self.db.get_approximate_sizes_cf(self.cf(cf), &[range]);
                (cf, sizes.first().copied().unwrap_or(0))
            })
            .collect()
    }

    pub fn property(&self, name: &str) -> u64 {
        ALL_CFS
            .iter()
            .filter_map(|cf| {
                self.db
                    .property_int_value_cf(self.cf(cf), name)
                    .ok()
                    .flatten()
            })
            .sum()
    }

    /// At a graceful stop: the WAL synced, then the memtables written to SST files (and
    /// checked at the next open) so that open replays little.
    pub fn flush(&self) -> Result<()> {
        self.db.flush_wal(true)?;
        let cfs: Vec<_> = ALL_CFS.iter().map(|n| self.cf(n)).collect();
        // Best effort (a full disk): the synced WAL holds everything anyway.
        if let Err(e) = self.db.flush_cfs_opt(&cfs, &Default::default()) {
            tracing::warn!(error = %e, "memtables not flushed at stop; the next open replays the WAL");
        }
        Ok(())
    }
}

/// Builds the response recorded for a request id from what its batch changed.
pub type Respond<'a> = dyn Fn(&BatchEffect) -> WriteBatchResponse + 'a;

fn request_key(key: &ShardKey, id: &str) -> Vec<u8> {
    let mut k = key.key(b"r");
    k.extend_from_slice(id.as_bytes());
    k
}

fn request_order_key(key: &ShardKey, ts: u64, id: &str) -> Vec<u8> {
    let mut k = key.key(b"q");
    k.extend_from_slice(&ts.to_be_bytes());
    k.extend_from_slice(id.as_bytes());
    k
}

fn pb(m: &impl protobuf::Message) -> Result<Vec<u8>> {
    m.write_to_bytes()
        .map_err(|e| ShardError::Corrupt(format!("encode raft record: {e}")))
}

fn encode_vector(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn decode_vector(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn encode_ids(ids: &[&str]) -> Vec<u8> {
    let mut out = Vec::with_capacity(ids.iter().map(|s| s.len() + 4).sum());
    for id in ids {
        out.extend_from_slice(&(id.len() as u32).to_be_bytes());
        out.extend_from_slice(id.as_bytes());
    }
    out
}

fn decode_ids(mut v: &[u8]) -> Result<Vec<String>> {
    let mut out = Vec::new();
    while !v.is_empty() {
        let bad = || ShardError::Corrupt("document record".into());
        let len =
            u32::from_be_bytes(v.get(..4).ok_or_else(bad)?.try_into().map_err(|_| bad())?) as usize;
        let s = v.get(4..4 + len).ok_or_else(bad)?;
        out.push(String::from_utf8(s.to_vec()).map_err(|_| bad())?);
        v = &v[4 + len..];
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn id_lists_round_trip() {
        let ids = ["a#0", "", "ü#12"];
        assert_eq!(decode_ids(&encode_ids(&ids)).unwrap(), ids);
    }

    #[test]
    fn shard_keys_parse_and_order() {
        let k = ShardKey::new("docs", 3);
        let full = k.key(b"x#1");
        let (p, rest) = ShardKey::parse(&full).unwrap();
        assert_eq!(p, k);
        assert_eq!(rest, b"x#1");
        assert!(k.key(&[0xff; 8]) < k.end());
        assert!(ShardKey::new("docs", 2).key(&[0xff; 8]) < k.prefix());
    }
}
