//! Chunk ids of BM25 hits without decompressing anything per query.
//!
//! The `chunk_id` fast field stores its strings in a zstd-compressed sstable; tantivy's
//! `ord_to_str` decompresses a block with a fresh zstd context for every hit, which was 15% of
//! the CPU of a one-shard BM25 load (perf, 2026-11-24). Segments never change once written, so
//! each segment's ids are decoded once, in ordinal order, into one string with offsets, plus
//! each document's ordinal (about 12 bytes per chunk beyond the ids themselves), and looked up
//! by document afterwards. The first search that meets a new segment pays its decoding.

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::Mutex;
use tantivy::Searcher;
use tantivy::columnar::StrColumn;
use tantivy::index::SegmentId;

use super::CHUNK_ID;
use crate::error::{Result, ShardError};

/// One segment's chunk ids by document.
pub struct SegmentIds {
    bytes: String,
    /// End offset in `bytes` of each term ordinal's id.
    ends: Vec<usize>,
    /// Term ordinal of each document (`u32::MAX`: none).
    ord_of_doc: Vec<u32>,
}

impl SegmentIds {
    fn load(col: &StrColumn, max_doc: u32) -> Result<Self> {
        let dict = col.dictionary();
        let mut bytes = String::new();
        let mut ends = Vec::with_capacity(dict.num_terms());
        let mut stream = dict.stream()?;
        while stream.advance() {
            let key = std::str::from_utf8(stream.key())
                .map_err(|e| ShardError::Corrupt(format!("chunk id in the BM25 index: {e}")))?;
            bytes.push_str(key);
            ends.push(bytes.len());
        }
        let ord_of_doc = (0..max_doc)
            .map(|d| {
                col.term_ords(d)
                    .next()
                    .and_then(|o| u32::try_from(o).ok())
                    .unwrap_or(u32::MAX)
            })
            .collect();
        Ok(Self {
            bytes,
            ends,
            ord_of_doc,
        })
    }

    /// The chunk id of document `doc` of this segment.
    pub fn get(&self, doc: u32) -> Option<&str> {
        let ord = *self.ord_of_doc.get(doc as usize)? as usize;
        let end = *self.ends.get(ord)?;
        let start = if ord == 0 { 0 } else { self.ends[ord - 1] };
        self.bytes.get(start..end)
    }
}

/// Decoded segments, dropped once the searcher no longer holds them (merged away).
#[derive(Default)]
pub struct IdCache {
    segments: Mutex<HashMap<SegmentId, Arc<SegmentIds>>>,
}

impl IdCache {
    /// The ids of `searcher`'s segment `seg` (decoded now if this segment is new; None when
    /// it has no chunk id column, i.e. no documents).
    pub fn segment(&self, searcher: &Searcher, seg: u32) -> Result<Option<Arc<SegmentIds>>> {
        let reader = searcher.segment_reader(seg);
        let id = reader.segment_id();
        if let Some(s) = self.segments.lock().get(&id) {
            return Ok(Some(s.clone()));
        }
        let Some(col) = reader.fast_fields().str(CHUNK_ID)? else {
            return Ok(None);
        };
        // Decoded outside the lock: another search may decode the same segment meanwhile,
        // which costs time once but never a wrong id.
        let ids = Arc::new(SegmentIds::load(&col, reader.max_doc())?);
        let mut m = self.segments.lock();
        if m.len() >= 2 * searcher.segment_readers().len() + 8 {
            let live: std::collections::HashSet<SegmentId> = searcher
                .segment_readers()
                .iter()
                .map(|r| r.segment_id())
                .collect();
            m.retain(|k, _| live.contains(k));
        }
        m.insert(id, ids.clone());
        Ok(Some(ids))
    }
}
