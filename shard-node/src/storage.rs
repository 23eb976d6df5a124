//! The node's RocksDB: the source of truth for every shard it hosts. One database per node,
//! one column family per record kind; keys start with the shard prefix
//! `collection 0x00 shard(u32 BE)` so a shard is one contiguous key range in each family.
//!
//! | cf       | key suffix       | value                                           |
//! |----------|------------------|-------------------------------------------------|
//! | `meta`   | `m`              | shard parameters (`OpenShardRequest`)            |
//! | `meta`   | `s`              | applied sequence number (u64 BE)                 |
//! | `chunks` | chunk id         | `Chunk` (prost), embedding left out              |
//! | `vectors`| chunk id         | the embedding, f32 little-endian                 |
//! | `docs`   | doc id           | the document's chunk ids (u32-length-prefixed)   |
//! | `oplog`  | seq (u64 BE)     | the `WriteBatchRequest` applied at that seq      |
//!
//! Vectors sit apart from chunk records so that loading the text of search hits never reads
//! them. A write batch is one atomic RocksDB write (fsync'd when `sync_writes`), so after a crash a
//! batch is either wholly present or wholly absent. The op log keeps the batches the BM25
//! index has not committed yet, to catch it up on restart.

use std::fmt;
use std::path::Path;

use prost::Message;
use ragcluster_proto::v1::{Chunk, OpenShardRequest, WriteBatchRequest};
use rocksdb::{
    ColumnFamilyDescriptor, DB, Direction, IteratorMode, Options, WriteBatch, WriteOptions,
};

use crate::error::{Result, ShardError};

const CF_META: &str = "meta";
const CF_CHUNKS: &str = "chunks";
const CF_DOCS: &str = "docs";
const CF_OPLOG: &str = "oplog";
const CF_VECTORS: &str = "vectors";
const ALL_CFS: [&str; 5] = [CF_META, CF_CHUNKS, CF_VECTORS, CF_DOCS, CF_OPLOG];

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

    fn prefix(&self) -> Vec<u8> {
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

/// What a committed batch changed, for the in-memory indexes.
#[derive(Debug, Default)]
pub struct BatchEffect {
    /// Chunk ids that existed before the batch for the documents it touched.
    pub removed_chunks: Vec<String>,
    pub existed: u32,
    pub not_found: Vec<String>,
}

pub struct Store {
    db: DB,
    sync: bool,
}

impl Store {
    pub fn open(path: &Path, sync: bool) -> Result<Self> {
        let mut opts = Options::default();
        opts.create_if_missing(true);
        opts.create_missing_column_families(true);
        opts.set_compression_type(rocksdb::DBCompressionType::Lz4);
        opts.enable_statistics();
        let cfs = ALL_CFS
            .into_iter()
            .map(|n| ColumnFamilyDescriptor::new(n, opts.clone()));
        let db = DB::open_cf_descriptors(&opts, path, cfs)?;
        Ok(Self { db, sync })
    }

    fn cf(&self, name: &str) -> &rocksdb::ColumnFamily {
        self.db
            .cf_handle(name)
            .expect("column families are created at open")
    }

    fn write(&self, batch: WriteBatch) -> Result<()> {
        let mut wo = WriteOptions::default();
        wo.set_sync(self.sync);
        self.db.write_opt(batch, &wo)?;
        Ok(())
    }

    /// Every shard recorded on this node with its parameters.
    pub fn list_shards(&self) -> Result<Vec<(ShardKey, OpenShardRequest)>> {
        let mut out = Vec::new();
        for item in self.db.iterator_cf(self.cf(CF_META), IteratorMode::Start) {
            let (k, v) = item?;
            if let Some((key, b"m")) = ShardKey::parse(&k) {
                let meta = OpenShardRequest::decode(&*v)
                    .map_err(|e| ShardError::Corrupt(format!("shard meta {key}: {e}")))?;
                out.push((key, meta));
            }
        }
        Ok(out)
    }

    pub fn put_shard_meta(&self, key: &ShardKey, meta: &OpenShardRequest) -> Result<()> {
        let mut b = WriteBatch::default();
        b.put_cf(self.cf(CF_META), key.key(b"m"), meta.encode_to_vec());
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
        let cf = self.cf(CF_CHUNKS);
        let keys: Vec<_> = ids.iter().map(|id| (cf, key.key(id.as_bytes()))).collect();
        let mut chunks = self
            .db
            .multi_get_cf(keys)
            .into_iter()
            .map(|r| match r? {
                None => Ok(None),
                Some(v) => Chunk::decode(&*v)
                    .map(Some)
                    .map_err(|e| ShardError::Corrupt(format!("chunk in {key}: {e}"))),
            })
            .collect::<Result<Vec<_>>>()?;
        if with_embedding {
            let cf = self.cf(CF_VECTORS);
            let keys: Vec<_> = ids.iter().map(|id| (cf, key.key(id.as_bytes()))).collect();
            for (c, v) in chunks.iter_mut().zip(self.db.multi_get_cf(keys)) {
                if let (Some(c), Some(v)) = (c.as_mut(), v?) {
                    c.embedding = decode_vector(&v);
                }
            }
        }
        Ok(chunks)
    }

    /// Commits one write batch atomically together with its sequence number and op-log entry.
    /// Writes within the batch are applied in order; the caller serialises batches per shard.
    pub fn commit_batch(
        &self,
        key: &ShardKey,
        seq: u64,
        req: &WriteBatchRequest,
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
        b.put_cf(self.cf(CF_META), key.key(b"s"), seq.to_be_bytes());
        b.put_cf(
            self.cf(CF_OPLOG),
            key.key(&seq.to_be_bytes()),
            req.encode_to_vec(),
        );
        self.write(b)?;
        Ok(effect)
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
        Ok(())
    }

    pub fn drop_shard(&self, key: &ShardKey) -> Result<()> {
        let mut b = WriteBatch::default();
        for cf in ALL_CFS {
            b.delete_range_cf(self.cf(cf), key.prefix(), key.end());
        }
        self.write(b)
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

    pub fn flush(&self) -> Result<()> {
        self.db.flush_wal(true)?;
        Ok(())
    }
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
