//! Reading a shard back in document order: the `docs` family (document id -> its chunk ids,
//! in position order) walked from a point, the chunks of many documents loaded in one
//! multi-get. Serves Scroll pages (`Shard::scan`) and GetDocuments (`doc_chunks`); a
//! selective filter's page walks the chunk ids the BM25 index matched instead (`scan_ids`).

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
    /// Encoded bytes of `chunks`.
    bytes: usize,
}

impl Scanned {
    fn new() -> Self {
        Self {
            chunks: Vec::new(),
            done: false,
            bytes: 0,
        }
    }

    /// Adds `c` unless the page is full (at its limit, or `c` would pass the byte cap of a
    /// page that has a chunk); false when full.
    fn add(&mut self, c: Chunk, spec: &ScanSpec<'_>) -> bool {
        let size = prost::Message::encoded_len(&c);
        let full = self.chunks.len() >= spec.limit
            || (spec.max_bytes > 0
                && !self.chunks.is_empty()
                && self.bytes + size > spec.max_bytes);
        if !full {
            self.bytes += size;
            self.chunks.push(c);
        }
        !full
    }
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
        let mut out = Scanned::new();
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
                if keep(&c) && !out.add(c, spec) {
                    return Ok(out);
                }
            }
            if end {
                out.done = true;
                return Ok(out);
            }
        }
    }

    /// As `scan`, over the chunks `ids` only (a filter's matches, in any order): those after
    /// `spec.after` in (doc_id, position) order, loaded a batch at a time.
    pub fn scan_ids(
        &self,
        key: &ShardKey,
        spec: &ScanSpec<'_>,
        ids: Vec<String>,
        keep: impl Fn(&Chunk) -> bool,
    ) -> Result<Scanned> {
        let after = spec.after.map(|a| (a.doc_id.as_bytes(), a.position));
        let mut keyed: Vec<(usize, u32, String)> = ids
            .into_iter()
            .filter_map(|id| {
                let (doc, pos) = id.rsplit_once('#')?;
                let pos: u32 = pos.parse().ok()?;
                let doc_len = doc.len();
                let past = after.is_none_or(|a| (doc.as_bytes(), pos) > a);
                past.then_some((doc_len, pos, id))
            })
            .collect();
        keyed.sort_unstable_by(|a, b| {
            (&a.2.as_bytes()[..a.0], a.1).cmp(&(&b.2.as_bytes()[..b.0], b.1))
        });
        keyed.dedup_by(|a, b| a.2 == b.2);
        let mut out = Scanned::new();
        for batch in keyed.chunks(LOAD_BATCH) {
            let ids: Vec<String> = batch.iter().map(|k| k.2.clone()).collect();
            for c in self
                .get_chunks(key, &ids, spec.with_embedding)?
                .into_iter()
                .flatten()
            {
                if keep(&c) && !out.add(c, spec) {
                    return Ok(out);
                }
            }
        }
        out.done = true;
        Ok(out)
    }
}
