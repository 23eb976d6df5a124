//! Helpers for the crate's unit tests that drive real shards (RocksDB, tantivy, hnsw_rs) in a
//! temporary directory, applying batches as the Raft apply loop does.

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use ragcluster_proto::v1::{Chunk, DocumentWrite, WriteBatchRequest, WriteBatchResponse};

use crate::error::Result;
use crate::index::hnsw::HnswParams;
use crate::index::worker::{Committing, Compaction, Dumping, Following};
use crate::shard::{HitForm, Shard, ShardDirs, ShardOptions};
use crate::storage::{ShardKey, ShardMeta, Store};

pub(crate) const DIM: usize = 8;

pub(crate) fn opts(compact_min: usize) -> ShardOptions {
    ShardOptions {
        bm25_writer_memory: 20_000_000,
        compaction: Compaction {
            ratio: 0.25,
            min: compact_min,
        },
        dumping: Dumping {
            min_changes: 10_000,
            interval: std::time::Duration::from_secs(3600),
        },
        following: Following {
            enabled: true,
            pending_max: 20_000,
            // Inserted before each write is acknowledged; write-behind has its own tests.
            behind_max: 0,
        },
        // One commit per group: each applied batch is searchable before `apply` returns.
        committing: Committing {
            interval: std::time::Duration::ZERO,
            max_chunks: usize::MAX,
        },
    }
}

pub(crate) fn meta() -> ShardMeta {
    ShardMeta {
        dimension: DIM as u32,
        hnsw: HnswParams {
            m: 8,
            ef_construction: 50,
            ef_search: 32,
        },
    }
}

pub(crate) fn open(dir: &Path, key: ShardKey, store: Arc<Store>, compact_min: usize) -> Shard {
    open_with(dir, key, store, &opts(compact_min))
}

pub(crate) fn open_with(dir: &Path, key: ShardKey, store: Arc<Store>, o: &ShardOptions) -> Shard {
    let dirs = ShardDirs {
        bm25: &dir.join("bm25"),
        hnsw: &dir.join("hnsw"),
        snap: dir,
    };
    Shard::open(key, meta(), store, &dirs, o).unwrap()
}

pub(crate) fn doc(id: &str, words: &str, seed: f32) -> DocumentWrite {
    let embedding: Vec<f32> = (0..DIM).map(|i| (seed + i as f32).sin()).collect();
    DocumentWrite {
        doc_id: id.into(),
        chunks: vec![Chunk {
            chunk_id: format!("{id}#0"),
            doc_id: id.into(),
            text: words.into(),
            embedding,
            ..Default::default()
        }],
        delete: false,
    }
}

/// A write that deletes document `id`.
pub(crate) fn deleted(id: &str) -> DocumentWrite {
    DocumentWrite {
        doc_id: id.into(),
        chunks: vec![],
        delete: true,
    }
}

pub(crate) fn batch(writes: Vec<DocumentWrite>) -> WriteBatchRequest {
    WriteBatchRequest {
        writes,
        ..Default::default()
    }
}

/// Applies as the next log entry, as the Raft apply loop does, and waits until searches
/// see it, as the write path does before acknowledging.
pub(crate) fn apply(shard: &Shard, b: WriteBatchRequest) -> Result<WriteBatchResponse> {
    let r = shard.apply_entry(shard.applied_seq() + 1, b, 1_000)?;
    settle(shard);
    r
}

pub(crate) fn settle(shard: &Shard) {
    let until = Instant::now() + std::time::Duration::from_secs(10);
    while shard.visible_seq() < shard.applied_seq() && Instant::now() < until {
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    assert_eq!(
        shard.visible_seq(),
        shard.applied_seq(),
        "indexes caught up"
    );
}

pub(crate) fn vec_of(seed: f32) -> Vec<f32> {
    (0..DIM).map(|i| (seed + i as f32).sin()).collect()
}

pub(crate) fn top(shard: &Shard, seed: f32) -> String {
    shard
        .vector_search(
            &vec_of(seed),
            1,
            crate::index::hnsw::Scan::Walk(32),
            &crate::index::Filter::default(),
            HitForm::Id,
        )
        .unwrap()
        .pop()
        .and_then(|h| h.chunk)
        .map(|c| c.chunk_id)
        .unwrap_or_default()
}
