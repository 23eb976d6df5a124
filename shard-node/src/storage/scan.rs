//! Reading a shard back in document order: the `docs` family (document id -> its chunk ids,
//! in position order) walked from a point, the chunks of many documents loaded in one
//! multi-get. Serves Scroll pages (`Shard::scan`) and GetDocuments (`doc_chunks`).

use ragcluster_proto::v1::Chunk;
use rocksdb::{Direction, IteratorMode};

use super::{CF_DOCS, ShardKey, Store, decode_ids};
use crate::error::Result;

/// Chunk ids read from `docs` before their chunks are loaded in one multi-get.
const LOAD_BATCH: usize = 256;

/// Where a scan starts: after chunk `position` of document `doc_id`.
#[derive(Debug, Clone, Default)]
pub struct After {
    pub doc_id: String,
    pub position: u32,
}

/// One scan: up to `limit` chunks that pass `keep`, stopping before `max_bytes` of encoded
/// chunks (at least one chunk; 0: no cap).
pub struct ScanSpec<'a> {
    pub after: Option<&'a After>,
    pub limit: usize,
    pub max_bytes: usize,
    pub with_embedding: bool,
}

/// A scan's chunks and whether it reached the shard's end.
pub struct Scanned {
    pub chunks: Vec<Chunk>,
    pub done: bool,
}

impl Store {
    /// Every chunk of documents `ids`, document by document in the order given, each in
    /// position order; ids not stored contribute nothing.
    pub fn doc_chunks(
        &self,
        key: &ShardKey,
        ids: &[String],
        with_embedding: bool,
    ) -> Result<Vec<Chunk>> {
        let mut chunk_ids = Vec::new();
        for id in ids {
            if let Some(list) = self.doc_chunk_ids(key, id)? {
                chunk_ids.extend(list);
            }
        }
        Ok(self
            .get_chunks(key, &chunk_ids, with_embedding)?
            .into_iter()
            .flatten()
            .collect())
    }

    /// Chunks in (doc_id, position) order after `spec.after`, those `keep` accepts, up to
    /// the spec's limits.
    pub fn scan(
        &self,
        key: &ShardKey,
        spec: &ScanSpec<'_>,
        keep: impl Fn(&Chunk) -> bool,
    ) -> Result<Scanned> {
        let prefix = key.prefix();
        let start = key.key(spec.after.map_or("", |a| a.doc_id.as_str()).as_bytes());
        let mut docs = self.db.iterator_cf(
            self.cf(CF_DOCS),
            IteratorMode::From(&start, Direction::Forward),
        );
        let mut out = Scanned {
            chunks: Vec::new(),
            done: false,
        };
        let mut bytes = 0usize;
        let mut pending: Vec<String> = Vec::new();
        loop {
            // Gather ids of the next documents, then load them together.
            let mut end = false;
            let want = (spec.limit - out.chunks.len() + 1).clamp(16, LOAD_BATCH);
            while pending.len() < want {
                let Some(item) = docs.next() else {
                    end = true;
                    break;
                };
                let (k, v) = item?;
                if !k.starts_with(&prefix) {
                    end = true;
                    break;
                }
                let ids = decode_ids(&v)?;
                let skip = match spec.after {
                    // Chunk ids are listed in position order, position i at index i.
                    Some(a) if &k[prefix.len()..] == a.doc_id.as_bytes() => {
                        (a.position as usize).saturating_add(1)
                    }
                    _ => 0,
                };
                pending.extend(ids.into_iter().skip(skip));
            }
            let loaded = self.get_chunks(key, &pending, spec.with_embedding)?;
            pending.clear();
            for c in loaded.into_iter().flatten() {
                if !keep(&c) {
                    continue;
                }
                let size = prost::Message::encoded_len(&c);
                let full = out.chunks.len() >= spec.limit
                    || (spec.max_bytes > 0
                        && !out.chunks.is_empty()
                        && bytes + size > spec.max_bytes);
                if full {
                    return Ok(out);
                }
                bytes += size;
                out.chunks.push(c);
            }
            if end {
                out.done = true;
                return Ok(out);
            }
        }
    }
}
