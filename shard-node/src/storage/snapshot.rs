//! A shard's state-machine records as a Raft snapshot stream: written by the leader from one
//! RocksDB snapshot (so the index worker trimming the op log meanwhile cannot tear it), and
//! installed by a receiver in one atomic write.
//!
//! Stream: records `[family tag u8][key block][value block]`, blocks u32-BE-length-prefixed,
//! until the end of input or the byte `SECTION_END`, after which the caller's own section
//! follows (the HNSW dump, `raft::snapshot`). Tags index `SNAPSHOT_CFS`; older snapshots,
//! which carry no op log and no section, read the same.

use std::io::{Read, Write};

use prost::Message;
use ragcluster_proto::v1::{Chunk, DocumentWrite};
use rocksdb::{DB, Direction, IteratorMode, SnapshotWithThreadMode, WriteBatch};

use super::{
    ALL_CFS, CF_CHUNKS, CF_DOCS, CF_META, CF_OPLOG, CF_RAFT, CF_VECTORS, ShardKey, Store,
    decode_ids, decode_vector,
};
use crate::error::{Result, ShardError};
use ragcluster_raft::Keys;
use ragcluster_raft::eraftpb::{ConfState, HardState};

/// Families a snapshot carries, by tag. The first four are the state machine; the op log
/// travels only from a shipped HNSW dump's seq on, so the receiver can catch that dump up.
const SNAPSHOT_CFS: [&str; 5] = [CF_META, CF_CHUNKS, CF_VECTORS, CF_DOCS, CF_OPLOG];
const STATE_TAGS: usize = 4;
const OPLOG_TAG: u8 = 4;

/// Ends the records; what follows belongs to the caller.
pub const SECTION_END: u8 = 0xff;

/// The store as of one moment, for writing a snapshot.
pub struct StoreSnapshot<'a> {
    store: &'a Store,
    snap: SnapshotWithThreadMode<'a, DB>,
}

impl Store {
    /// A consistent view for `StoreSnapshot::write_records`.
    pub fn read_snapshot(&self) -> StoreSnapshot<'_> {
        StoreSnapshot {
            store: self,
            snap: self.db.snapshot(),
        }
    }

    /// Replaces the shard's state and Raft log with a snapshot in one atomic write: its
    /// records (read from `input` up to its end or `SECTION_END`), applied index = `index`,
    /// the log truncated at (`index`, `term`) and the snapshot's conf state. Returns the
    /// record count and whether a caller's section follows in `input`.
    pub fn install_snapshot(
        &self,
        key: &ShardKey,
        input: &mut impl Read,
        index: u64,
        term: u64,
        cs: &ConfState,
        hs: &HardState,
    ) -> Result<(u64, bool)> {
        let mut b = WriteBatch::default();
        for name in ALL_CFS {
            if name == CF_META {
                // Keep the shard parameters ("m"); everything else is replaced.
                b.delete_range_cf(self.cf(name), key.key(b"n"), key.end());
                b.delete_range_cf(self.cf(name), key.prefix(), key.key(b"m"));
            } else {
                b.delete_range_cf(self.cf(name), key.prefix(), key.end());
            }
        }
        let mut n = 0;
        let mut section = false;
        let bad = |what: &str| ShardError::Corrupt(format!("snapshot of {key}: {what}"));
        loop {
            let mut tag = [0u8; 1];
            match input.read_exact(&mut tag) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => break,
                Err(e) => return Err(e.into()),
            }
            if tag[0] == SECTION_END {
                section = true;
                break;
            }
            let name = SNAPSHOT_CFS
                .get(tag[0] as usize)
                .ok_or_else(|| bad("unknown column family"))?;
            let k = read_block(input).map_err(|_| bad("truncated key"))?;
            let v = read_block(input).map_err(|_| bad("truncated value"))?;
            if *name == CF_META && k == b"m" {
                continue;
            }
            b.put_cf(self.cf(name), key.key(&k), v);
            n += 1;
        }
        b.put_cf(self.cf(CF_META), key.key(b"s"), index.to_be_bytes());
        Keys::new(key.prefix())
            .reset_into(&mut b, self.cf(CF_RAFT), index, term, cs, hs)
            .map_err(|e| ShardError::Corrupt(e.0))?;
        self.write_opt(b, true)?;
        Ok((n, section))
    }
}

impl StoreSnapshot<'_> {
    /// Seqs of the op-log entries after `after`: (first, last, count), None when there are none.
    pub fn oplog_span(&self, key: &ShardKey, after: u64) -> Result<Option<(u64, u64, u64)>> {
        let mut span: Option<(u64, u64, u64)> = None;
        self.each(key, CF_OPLOG, &(after + 1).to_be_bytes(), |suffix, _| {
            let seq = u64::from_be_bytes(
                suffix
                    .try_into()
                    .map_err(|_| ShardError::Corrupt("oplog key".into()))?,
            );
            span = Some(span.map_or((seq, seq, 1), |(f, _, c)| (f, seq, c + 1)));
            Ok(())
        })?;
        Ok(span)
    }

    /// Writes the shard's state-machine records to `out`, and the op-log entries after
    /// `oplog_after` when given. Returns the record count.
    pub fn write_records(
        &self,
        key: &ShardKey,
        oplog_after: Option<u64>,
        out: &mut impl Write,
    ) -> Result<u64> {
        let mut n = 0;
        let mut put = |tag: u8, suffix: &[u8], v: &[u8]| -> Result<()> {
            // Dedupe records are part of the state; node records never match a prefix.
            out.write_all(&[tag])?;
            out.write_all(&(suffix.len() as u32).to_be_bytes())?;
            out.write_all(suffix)?;
            out.write_all(&(v.len() as u32).to_be_bytes())?;
            out.write_all(v)?;
            n += 1;
            Ok(())
        };
        for (tag, name) in SNAPSHOT_CFS[..STATE_TAGS].iter().enumerate() {
            self.each(key, name, &[], |k, v| put(tag as u8, k, v))?;
        }
        if let Some(after) = oplog_after {
            let start = (after + 1).to_be_bytes();
            self.each(key, CF_OPLOG, &start, |k, v| put(OPLOG_TAG, k, v))?;
        }
        Ok(n)
    }

    /// The applied seq as of the snapshot.
    pub fn applied_seq(&self, key: &ShardKey) -> Result<u64> {
        Ok(self
            .snap
            .get_cf(self.store.cf(CF_META), key.key(b"s"))?
            .and_then(|v| v.as_slice().try_into().ok().map(u64::from_be_bytes))
            .unwrap_or(0))
    }

    /// Every document as of the snapshot, in id order, with its chunks in position order and
    /// their vectors (a backup's content): `f` takes each and answers whether to go on.
    pub fn for_each_document(
        &self,
        key: &ShardKey,
        mut f: impl FnMut(DocumentWrite) -> Result<bool>,
    ) -> Result<()> {
        let prefix = key.prefix();
        let mode = IteratorMode::From(&prefix, Direction::Forward);
        let (chunks_cf, vectors_cf) = (self.store.cf(CF_CHUNKS), self.store.cf(CF_VECTORS));
        for item in self.snap.iterator_cf(self.store.cf(CF_DOCS), mode) {
            let (k, v) = item?;
            if !k.starts_with(&prefix) {
                break;
            }
            let doc_id = String::from_utf8(k[prefix.len()..].to_vec())
                .map_err(|_| ShardError::Corrupt(format!("a document id in {key}")))?;
            let ids = decode_ids(&v)?;
            let keys = |cf| ids.iter().map(move |id| (cf, key.key(id.as_bytes())));
            let stored = self.snap.multi_get_cf(keys(chunks_cf));
            let vectors = self.snap.multi_get_cf(keys(vectors_cf));
            let mut chunks = Vec::with_capacity(ids.len());
            for ((id, c), v) in ids.iter().zip(stored).zip(vectors) {
                let c = c?.ok_or_else(|| {
                    ShardError::Corrupt(format!("chunk {id} of {key} is listed but not stored"))
                })?;
                let mut c = Chunk::decode(&*c)
                    .map_err(|e| ShardError::Corrupt(format!("chunk {id} in {key}: {e}")))?;
                if let Some(v) = v? {
                    c.embedding = decode_vector(&v);
                }
                chunks.push(c);
            }
            // Coordinators list chunks in position order; a direct writer may not have.
            chunks.sort_by_key(|c| c.position);
            let write = DocumentWrite {
                doc_id,
                chunks,
                delete: false,
            };
            if !f(write)? {
                break;
            }
        }
        Ok(())
    }

    /// Calls `f(key suffix, value)` for the shard's keys in `cf` from suffix `from` on.
    fn each(
        &self,
        key: &ShardKey,
        cf: &str,
        from: &[u8],
        mut f: impl FnMut(&[u8], &[u8]) -> Result<()>,
    ) -> Result<()> {
        let prefix = key.prefix();
        let start = key.key(from);
        let mode = IteratorMode::From(&start, Direction::Forward);
        for item in self.snap.iterator_cf(self.store.cf(cf), mode) {
            let (k, v) = item?;
            if !k.starts_with(&prefix) {
                break;
            }
            f(&k[prefix.len()..], &v)?;
        }
        Ok(())
    }
}

fn read_block(input: &mut impl Read) -> std::io::Result<Vec<u8>> {
    let mut len = [0u8; 4];
    input.read_exact(&mut len)?;
    let len = u32::from_be_bytes(len) as usize;
    if len > 256 << 20 {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "record too large",
        ));
    }
    let mut v = vec![0u8; len];
    input.read_exact(&mut v)?;
    Ok(v)
}
