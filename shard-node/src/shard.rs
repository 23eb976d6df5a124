//! One shard replica: the state machine of its Raft group (`crate::raft::machine`) and the
//! reads it serves. Batches arrive only as committed log entries, in log order; the seq of a
//! batch is its Raft index.
//!
//! Write path (one entry at a time, on the group's Raft thread):
//!   1. RocksDB: chunks, document records, applied index, request-id record and the op-log
//!      entry in one atomic write (the Raft log before it is already durable).
//!   2. The batch goes to the shard's index worker (`index::worker`), which updates HNSW and
//!      tantivy off the Raft thread, committing tantivy once per group of batches.
//!   3. The proposer is answered once the batch is visible to searches.
//!
//! Recovery (`index::recovery`): the HNSW graph is loaded from its newest dump (`index::hnsw::dump`) and caught up
//! by re-reading from RocksDB the documents that op-log entries after the dump touched; the
//! BM25 index is caught up by replaying op-log entries newer than its committed seq. Either is
//! rebuilt from RocksDB when its dump or the log does not reach back far enough.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use ragcluster_proto::v1::{
    Chunk, GlobalBm25Stats, ShardHit, WriteBatchRequest, WriteBatchResponse,
};

use crate::error::{Result, ShardError};
use crate::index::hnsw::dump::Dumps;
use crate::index::hnsw::{self, HnswParams};
use crate::index::recovery;
use crate::index::worker::{Committing, Compaction, Dumping, Following, IndexWorker, Job, Policy};
use crate::index::{Filter, Indexes};
use crate::storage::{ScanSpec, Scanned, ShardKey, ShardMeta, Store};

/// What a search returns for each hit (`Bm25SearchRequest.ids_only` / `encoded_chunks`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HitForm {
    /// The chunk id only: query-then-fetch, the caller loads the few chunks it keeps.
    Id,
    /// The chunk decoded, without its embedding.
    Chunk,
    /// The chunk id and the chunk as stored, undecoded: the caller decodes those it keeps.
    Encoded,
}

impl HitForm {
    pub fn of(ids_only: bool, encoded: bool) -> Self {
        match (ids_only, encoded) {
            (true, _) => Self::Id,
            (false, true) => Self::Encoded,
            (false, false) => Self::Chunk,
        }
    }
}

pub struct Shard {
    pub key: ShardKey,
    pub dimension: u32,
    pub params: HnswParams,
    store: Arc<Store>,
    indexes: Arc<Indexes>,
    worker: IndexWorker,
    pub(crate) dumps: Arc<Dumps>,
    /// The applied index as durable in RocksDB (written by the Raft thread only).
    applied: AtomicU64,
    /// Live documents as of `applied`: counted once at open, then kept by the write path.
    documents: AtomicU64,
    /// Where received snapshot files wait to be installed.
    pub(crate) snap_dir: PathBuf,
    /// When a snapshot last asked the index worker for a fresh dump: (the newest dump then,
    /// time).
    dump_asked: parking_lot::Mutex<Option<(Option<u64>, Instant)>>,
    /// Stamps for the entries this replica proposes (see `shard::clock`).
    pub(crate) clock: clock::LogClock,
}

/// A snapshot waits for a fresh HNSW dump when more points than this changed since the last
/// one: the receiver inserts each of them again (~1 ms a point on 2 busy cores), while a dump
/// takes well under a second per 100k points.
const FRESH_DUMP_POINTS: usize = 1000;
/// How long a snapshot waits for that dump before it ships the older one.
const FRESH_DUMP_WAIT: std::time::Duration = std::time::Duration::from_secs(30);

pub struct ShardOptions {
    pub bm25_writer_memory: usize,
    pub compaction: Compaction,
    pub dumping: Dumping,
    pub following: Following,
    pub committing: Committing,
}

/// Where a shard's derived files live.
pub struct ShardDirs<'a> {
    pub bm25: &'a Path,
    pub hnsw: &'a Path,
    /// Shared by the node's shards: received snapshot files.
    pub snap: &'a Path,
}

/// A shard's figures, all describing one visible state.
#[derive(Debug, Clone, Default)]
pub struct Figures {
    pub documents: u64,
    pub chunks: u64,
    pub visible_seq: u64,
    pub bm25_index_bytes: u64,
    pub hnsw_points: u64,
    pub hnsw_tombstones: u64,
    /// Of `hnsw_points`, those not in the graph yet (searched by brute force beside it).
    pub hnsw_pending: u64,
    pub dimension: u32,
}

impl Shard {
    /// Opens a shard and brings its indexes up to the applied seq recorded in RocksDB.
    pub fn open(
        key: ShardKey,
        meta: ShardMeta,
        store: Arc<Store>,
        dirs: &ShardDirs<'_>,
        opts: &ShardOptions,
    ) -> Result<Self> {
        let applied = store.applied_seq(&key)?;
        let bm25 = recovery::open_bm25(&key, dirs.bm25, opts.bm25_writer_memory)?;
        let dumps = Arc::new(Dumps::new(dirs.hnsw.to_path_buf()));
        dumps.remove_leftovers();
        let (hnsw, dump_state) = recovery::open_hnsw(&key, &meta, &store, &dumps, applied)?;
        recovery::catch_up_bm25(&key, &store, &bm25, applied)?;
        store.truncate_oplog(&key, dump_state.dumped.unwrap_or(applied))?;
        let documents = store.count_docs(&key)?;
        let live = hnsw.counts().0;
        tracing::info!(shard = %key, applied, chunks = live, documents, "shard open");
        let indexes = Arc::new(Indexes {
            bm25,
            hnsw,
            update: Default::default(),
        });
        let worker = IndexWorker::start(
            key.clone(),
            store.clone(),
            indexes.clone(),
            applied,
            dumps.clone(),
            dump_state,
            Policy {
                compaction: opts.compaction,
                dumping: opts.dumping,
                following: opts.following,
                committing: opts.committing,
            },
        )?;
        Ok(Self {
            key,
            dimension: meta.dimension,
            params: meta.hnsw,
            store,
            indexes,
            worker,
            dumps,
            applied: AtomicU64::new(applied),
            documents: AtomicU64::new(documents),
            clock: Default::default(),
            snap_dir: dirs.snap.to_path_buf(),
            dump_asked: Default::default(),
        })
    }

    /// The applied index as durable.
    pub fn applied_seq(&self) -> u64 {
        self.applied.load(Ordering::Acquire)
    }

    /// The highest seq searches see.
    pub fn visible_seq(&self) -> u64 {
        self.worker.visible()
    }

    /// Waits until `seq` is visible to searches (or fails at `deadline`).
    pub async fn wait_visible(&self, seq: u64, deadline: Instant) -> Result<()> {
        self.worker.wait_visible(seq, deadline).await
    }

    /// Called whenever the indexes caught up a little further.
    pub fn on_progress(&self, f: Box<dyn Fn() + Send + Sync>) {
        self.worker.on_progress(f);
    }

    /// Checks a batch before anything is written. Normalises embeddings in place. Runs on the
    /// leader before proposing and again at apply (deterministic, so replicas agree).
    pub fn validate(&self, req: &mut WriteBatchRequest) -> Result<()> {
        let bad = |m: String| Err(ShardError::InvalidArgument(m));
        if req.request_id.len() > 128 {
            return bad("request_id is longer than 128 bytes".into());
        }
        if !req.changes.is_empty() && !req.writes.is_empty() {
            return bad("a batch carries writes or changes, not both".into());
        }
        changes::validate(&req.changes)?;
        if req.version > 0 && !req.changes.is_empty() {
            return bad("a versioned batch carries writes only".into());
        }
        if req.version_epoch > 0 && req.version > 0 {
            return bad("a batch carries version or version_epoch, not both".into());
        }
        if req.version_epoch > ragcluster_common::versions::MAX_EPOCH {
            return bad(format!(
                "version_epoch is above {}",
                ragcluster_common::versions::MAX_EPOCH
            ));
        }
        let mut seen = std::collections::HashSet::new();
        for (i, w) in req.writes.iter_mut().enumerate() {
            if w.doc_id.is_empty() {
                return bad(format!("writes[{i}].doc_id is empty"));
            }
            if !seen.insert(w.doc_id.clone()) {
                return bad(format!(
                    "writes[{i}].doc_id {:?} appears twice in the batch",
                    w.doc_id
                ));
            }
            if w.delete && !w.chunks.is_empty() {
                return bad(format!("writes[{i}] deletes and carries chunks"));
            }
            let mut ids = std::collections::HashSet::new();
            for (j, c) in w.chunks.iter_mut().enumerate() {
                if c.doc_id != w.doc_id {
                    return bad(format!(
                        "writes[{i}].chunks[{j}].doc_id differs from the write's doc_id"
                    ));
                }
                if c.chunk_id.is_empty() || !ids.insert(c.chunk_id.clone()) {
                    return bad(format!(
                        "writes[{i}].chunks[{j}].chunk_id is empty or repeated"
                    ));
                }
                if c.embedding.len() != self.dimension as usize {
                    return bad(format!(
                        "writes[{i}].chunks[{j}].embedding has dimension {}, shard expects {}",
                        c.embedding.len(),
                        self.dimension
                    ));
                }
                if !hnsw::normalize(&mut c.embedding) {
                    return bad(format!(
                        "writes[{i}].chunks[{j}].embedding is zero or not finite"
                    ));
                }
            }
        }
        Ok(())
    }

    /// Applies the committed log entry `seq` carrying a batch proposed at `proposed_at_ms`.
    /// A request id applied before is not applied again (its first outcome is returned with
    /// `duplicate`); a batch failing validation changes nothing but the applied index.
    /// `Err` only for storage failures, which stop the replica.
    pub fn apply_entry(
        &self,
        seq: u64,
        mut req: WriteBatchRequest,
        proposed_at_ms: u64,
    ) -> Result<std::result::Result<WriteBatchResponse, ShardError>> {
        self.clock.applied(proposed_at_ms);
        if !req.request_id.is_empty()
            && let Some(mut first) = self.store.request_result(&self.key, &req.request_id)?
        {
            self.apply_noop(seq, None)?;
            first.duplicate = true;
            metrics::counter!("shard_duplicate_requests_total").increment(1);
            return Ok(Ok(first));
        }
        if let Err(e) = self.validate(&mut req) {
            self.apply_noop(seq, None)?;
            return Ok(Err(e));
        }
        // 0. Changes become plain writes against the state at this entry (`changes`).
        let resolved = if req.changes.is_empty() {
            changes::Resolved::default()
        } else {
            let mut r = match changes::resolve(&self.store, &self.key, &req.changes) {
                Ok(r) => r,
                Err(e @ ShardError::InvalidArgument(_)) => {
                    self.apply_noop(seq, None)?;
                    return Ok(Err(e));
                }
                Err(e) => return Err(e),
            };
            req.changes.clear();
            req.writes = std::mem::take(&mut r.writes);
            r
        };
        let changed_ids: Vec<String> = if resolved.changed > 0 {
            req.writes.iter().map(|w| w.doc_id.clone()).collect()
        } else {
            Vec::new()
        };
        // A versioned write older than what the shard holds is dropped (`storage::versions`);
        // a write in a re-embedding's epoch is versioned by this entry.
        if req.version_epoch > 0 {
            req.version = ragcluster_common::versions::version(req.version_epoch, seq);
        }
        let stale = self.drop_stale(&mut req)?;
        // 1. Durable. A failure here leaves nothing behind (atomic write) and nothing
        // acknowledged.
        let respond = |e: &crate::storage::BatchEffect| WriteBatchResponse {
            applied_seq: seq,
            existed: e.existed,
            not_found: [&e.not_found[..], &resolved.not_found[..]].concat(),
            duplicate: false,
            forwarded_to: String::new(),
            changed: resolved.changed,
            stale: stale.clone(),
            changed_ids: changed_ids.clone(),
        };
        let effect =
            self.store
                .commit_batch(&self.key, seq, &req, Some((proposed_at_ms, &respond)))?;
        // Every upsert adds one document, every document that existed before the batch
        // (replaced or deleted) takes one away.
        let upserts = req.writes.iter().filter(|w| !w.delete).count() as u64;
        let docs = (self.documents.load(Ordering::Relaxed) + upserts)
            .saturating_sub(u64::from(effect.existed));
        self.documents.store(docs, Ordering::Relaxed);
        self.applied.store(seq, Ordering::Release);
        // 2. The indexes, off this thread: replaced chunks not written again leave HNSW.
        let new_ids: std::collections::HashSet<&str> = req
            .writes
            .iter()
            .flat_map(|w| w.chunks.iter().map(|c| c.chunk_id.as_str()))
            .collect();
        let removed: Vec<String> = effect
            .removed_chunks
            .iter()
            .filter(|id| !new_ids.contains(id.as_str()))
            .cloned()
            .collect();
        let response = respond(&effect);
        self.worker.push(Job::Batch {
            seq,
            writes: req.writes,
            removed,
        });
        metrics::counter!("shard_write_batches_total").increment(1);
        Ok(Ok(response))
    }

    /// Removes from a versioned batch the writes of documents this shard holds in the same or
    /// a newer version; returns their ids.
    fn drop_stale(&self, req: &mut WriteBatchRequest) -> Result<Vec<String>> {
        if req.version == 0 {
            return Ok(Vec::new());
        }
        let mut stale = Vec::new();
        let mut keep = Vec::with_capacity(req.writes.len());
        for w in std::mem::take(&mut req.writes) {
            match self.store.doc_version(&self.key, &w.doc_id)? {
                Some(v) if v >= req.version => stale.push(w.doc_id),
                _ => keep.push(w),
            }
        }
        req.writes = keep;
        Ok(stale)
    }

    /// Moves the applied index over an entry without chunk changes (see `Store::commit_noop`).
    pub fn apply_noop(
        &self,
        seq: u64,
        conf: Option<&ragcluster_raft::eraftpb::ConfState>,
    ) -> Result<()> {
        self.store.commit_noop(&self.key, seq, conf)?;
        self.applied.store(seq, Ordering::Release);
        self.worker.push(Job::Skip(seq));
        Ok(())
    }

    /// Whether a snapshot at `index` should wait (raft-rs asks again) for the index worker to
    /// dump the graph first; asks for that dump the first time. It stops waiting once a newer
    /// dump is there, or after `FRESH_DUMP_WAIT`.
    pub(crate) fn wants_fresh_dump(&self, index: u64) -> bool {
        if self.worker.undumped() < FRESH_DUMP_POINTS {
            return false;
        }
        let mut asked = self.dump_asked.lock();
        match *asked {
            Some((before, when))
                if self.dumps.newest() > before || when.elapsed() > FRESH_DUMP_WAIT =>
            {
                *asked = None;
                false
            }
            Some(_) => true,
            None => {
                tracing::info!(shard = %self.key, index, undumped = self.worker.undumped(),
                    "snapshot waits for a fresh hnsw dump");
                self.worker.push(Job::DumpNow);
                *asked = Some((self.dumps.newest(), Instant::now()));
                true
            }
        }
    }

    /// Replaces the replica's state with the snapshot file at `path` (`Store::install_snapshot`,
    /// which also resets the Raft log) and has both indexes brought to it: the HNSW graph from
    /// the shipped dump when there is one, else rebuilt like BM25.
    pub fn install_snapshot(
        &self,
        path: &Path,
        meta: &ragcluster_raft::eraftpb::SnapshotMetadata,
        hs: &ragcluster_raft::eraftpb::HardState,
    ) -> Result<u64> {
        let started = Instant::now();
        let cs = meta.conf_state.clone().unwrap_or_default();
        let mut f = std::io::BufReader::with_capacity(1 << 20, std::fs::File::open(path)?);
        let (records, section) = self
            .store
            .install_snapshot(&self.key, &mut f, meta.index, meta.term, &cs, hs)?;
        self.documents
            .store(self.store.count_docs(&self.key)?, Ordering::Relaxed);
        self.applied.store(meta.index, Ordering::Release);
        // The state is in; a damaged dump section only costs the receiver a rebuild.
        let dump = section
            .then(|| self.dumps.receive(&mut f))
            .transpose()
            .unwrap_or_else(|e| {
                tracing::warn!(shard = %self.key, error = %e,
                    "shipped hnsw dump unusable; rebuilding the graph");
                None
            });
        self.worker.push(Job::Rebuild {
            seq: meta.index,
            dump,
        });
        tracing::info!(shard = %self.key, index = meta.index, records, ?dump,
            ms = started.elapsed().as_millis() as u64, "snapshot installed");
        Ok(records)
    }

    pub fn bm25_search(
        &self,
        query: &str,
        top_k: usize,
        filter: &Filter,
        stats: Option<&GlobalBm25Stats>,
        form: HitForm,
    ) -> Result<Vec<ShardHit>> {
        let hits = self.indexes.bm25.search(query, top_k, filter, stats)?;
        self.hydrate(hits, form)
    }

    pub fn vector_search(
        &self,
        vector: &[f32],
        top_k: usize,
        scan: hnsw::Scan,
        filter: &Filter,
        form: HitForm,
    ) -> Result<Vec<ShardHit>> {
        if vector.len() != self.dimension as usize {
            return Err(ShardError::InvalidArgument(format!(
                "vector has dimension {}, shard expects {}",
                vector.len(),
                self.dimension
            )));
        }
        let mut q = vector.to_vec();
        if !hnsw::normalize(&mut q) {
            return Err(ShardError::InvalidArgument(
                "vector is zero or not finite".into(),
            ));
        }
        let hits = match scan {
            hnsw::Scan::Walk(ef) => self.indexes.hnsw.search(&q, top_k, ef, filter),
            hnsw::Scan::Exact => self.indexes.hnsw.search_exact(&q, top_k, filter),
        };
        self.hydrate(hits, form)
    }

    /// The estimated cost of `vector_search` with `scan` and `filter`, in graph-walk steps
    /// (`HnswIndex::search_cost`); an exact scan, or a filter only a sample could size, is
    /// `usize::MAX`.
    pub fn vector_search_cost(&self, scan: hnsw::Scan, filter: &Filter) -> usize {
        match scan {
            hnsw::Scan::Walk(ef) => self.indexes.hnsw.search_cost(ef, filter),
            hnsw::Scan::Exact => None,
        }
        .unwrap_or(usize::MAX)
    }

    /// Loads hit chunks from RocksDB (without embeddings) in the asked form. A hit whose
    /// chunk vanished between index and store read (concurrent delete) is skipped.
    fn hydrate(&self, hits: Vec<(String, f32)>, form: HitForm) -> Result<Vec<ShardHit>> {
        if form == HitForm::Id {
            return Ok(hits
                .into_iter()
                .map(|(chunk_id, score)| ShardHit {
                    chunk: Some(Chunk {
                        chunk_id,
                        ..Default::default()
                    }),
                    score,
                    ..Default::default()
                })
                .collect());
        }
        let ids: Vec<String> = hits.iter().map(|h| h.0.clone()).collect();
        if form == HitForm::Encoded {
            let stored = self.store.get_chunks_encoded(&self.key, &ids)?;
            return Ok(stored
                .into_iter()
                .zip(hits)
                .filter_map(|(v, (chunk_id, score))| {
                    Some(ShardHit {
                        chunk: None,
                        score,
                        chunk_id,
                        chunk_encoded: v?.into(),
                    })
                })
                .collect());
        }
        let chunks = self.store.get_chunks(&self.key, &ids, false)?;
        Ok(chunks
            .into_iter()
            .zip(hits)
            .filter_map(|(c, (_, score))| {
                Some(ShardHit {
                    chunk: Some(c?),
                    score,
                    ..Default::default()
                })
            })
            .collect())
    }

    pub fn term_stats(&self, query: &str) -> Result<GlobalBm25Stats> {
        let (num_docs, total_tokens, doc_freq) = self.indexes.bm25.term_stats(query)?;
        Ok(GlobalBm25Stats {
            num_docs,
            total_tokens,
            doc_freq,
        })
    }

    pub fn get_chunks(&self, ids: &[String], with_embedding: bool) -> Result<Vec<Chunk>> {
        Ok(self
            .store
            .get_chunks(&self.key, ids, with_embedding)?
            .into_iter()
            .flatten()
            .collect())
    }

    /// Every chunk of documents `ids`, in the order given, each in position order.
    pub fn doc_chunks(&self, ids: &[String], with_embedding: bool) -> Result<Vec<Chunk>> {
        self.store.doc_chunks(&self.key, ids, with_embedding)
    }

    /// This shard's part of a Scroll page (`storage::scan`), with the visible seq taken
    /// before reading: the chunks describe that state or a newer one.
    ///
    /// A filter matching at most a quarter of the shard walks the ids its BM25 index matched
    /// (sorted each page) rather than every chunk; a broader one reads in document order and
    /// drops what does not match. Loaded chunks are checked again either way (the index may
    /// be newer than the stored chunk, or the reverse).
    pub fn scan(&self, spec: &ScanSpec<'_>, filter: &Filter) -> Result<(Scanned, u64)> {
        let seq = self.visible_seq();
        let keep = |c: &Chunk| filter.matches_chunk(c);
        if !filter.is_empty()
            && let Some((ids, total)) = self.indexes.bm25.matching_ids(filter)?
            && (ids.len() as u64) * 4 <= total
        {
            return Ok((self.store.scan_ids(&self.key, spec, ids, keep)?, seq));
        }
        Ok((self.store.scan(&self.key, spec, keep)?, seq))
    }

    /// Chunks and documents matching `filter`, exactly, and the visible seq they describe
    /// (at least).
    pub fn count(&self, filter: &Filter) -> Result<(u64, u64, u64)> {
        if filter.is_empty() {
            let f = self.figures();
            return Ok((f.chunks, f.documents, f.visible_seq));
        }
        let seq = self.visible_seq();
        let (chunks, documents) = self.indexes.bm25.count(filter)?;
        Ok((chunks, documents, seq))
    }

    /// Up to `before` preceding and `after` following chunks of the same document, in order,
    /// the anchor included.
    pub fn neighbours(&self, chunk_id: &str, before: u32, after: u32) -> Result<Vec<Chunk>> {
        let Some(anchor) = self.get_chunks(&[chunk_id.to_owned()], false)?.pop() else {
            return Err(ShardError::UnknownShard(format!(
                "chunk {chunk_id} in {}",
                self.key
            )));
        };
        let mut prev = Vec::new();
        let mut cur = anchor.prev_chunk_id.clone();
        while prev.len() < before as usize && !cur.is_empty() {
            match self.get_chunks(&[cur.clone()], false)?.pop() {
                Some(c) => {
                    cur = c.prev_chunk_id.clone();
                    prev.push(c);
                }
                None => break,
            }
        }
        prev.reverse();
        let mut next = Vec::new();
        let mut cur = anchor.next_chunk_id.clone();
        while next.len() < after as usize && !cur.is_empty() {
            match self.get_chunks(&[cur.clone()], false)?.pop() {
                Some(c) => {
                    cur = c.next_chunk_id.clone();
                    next.push(c);
                }
                None => break,
            }
        }
        prev.push(anchor);
        prev.extend(next);
        Ok(prev)
    }

    /// The shard's figures, taken under the indexes' update lock so that they describe one
    /// visible state: never a batch half-applied (its points in HNSW, its chunks not yet in
    /// BM25).
    pub fn figures(&self) -> Figures {
        let _guard = self.indexes.update.lock();
        let (live, dead) = self.indexes.hnsw.counts();
        Figures {
            documents: self.documents.load(Ordering::Relaxed),
            chunks: self.indexes.bm25.num_docs(),
            visible_seq: self.visible_seq(),
            bm25_index_bytes: self.indexes.bm25.size_bytes(),
            hnsw_points: live as u64,
            hnsw_tombstones: dead as u64,
            hnsw_pending: self.indexes.hnsw.pending_len() as u64,
            dimension: self.dimension,
        }
    }

    /// What this replica keeps on disk, by place (see `ShardInfoResponse.bytes_by_family`).
    pub fn disk_bytes(&self) -> Vec<(String, u64)> {
        let mut out: Vec<(String, u64)> = self
            .store
            .shard_bytes(&self.key)
            .into_iter()
            .map(|(cf, b)| (cf.to_owned(), b))
            .collect();
        out.push(("tantivy".into(), self.indexes.bm25.size_bytes()));
        out.push(("hnsw_dump".into(), self.dumps.bytes()));
        out
    }

    /// Tells the index worker whether this replica follows (it then defers inserts to its
    /// leader's dumps, when configured).
    pub fn set_following(&self, following: bool) {
        self.worker.set_following(following);
    }

    /// Points written here but not in the graph yet (searched exactly beside it).
    pub fn pending_points(&self) -> usize {
        self.indexes.hnsw.pending_len()
    }

    /// Seq of the dump this replica's graph comes from (0: none).
    pub fn graph_dump_seq(&self) -> u64 {
        self.worker.dumped_seq()
    }

    /// This replica's newest HNSW dump with `after < seq <= max_seq`, as a dump section
    /// (`Linked::write_to`) for a follower to load. None when there is no such dump.
    pub fn graph_dump_after(&self, after: u64, max_seq: u64) -> Result<Option<Vec<u8>>> {
        let linked = {
            let held = self.dumps.lock();
            self.dumps.link_newest(&held, max_seq)
        };
        match linked {
            Some(l) if l.seq > after => {
                let mut out = Vec::new();
                l.write_to(&mut out)?;
                Ok(Some(out))
            }
            _ => Ok(None),
        }
    }

    /// Stores a dump section fetched from the leader and has the index worker load it.
    pub fn receive_graph(&self, mut section: &[u8]) -> Result<u64> {
        let seq = self.dumps.receive(&mut section)?;
        self.worker.push(Job::Adopt(seq));
        Ok(seq)
    }

    /// Stops the index worker without dumping anything (the shard is being dropped).
    pub fn stop_indexing(&self) {
        self.worker.stop(false);
    }

    pub fn store(&self) -> &Arc<Store> {
        &self.store
    }

    /// Lets the index worker finish what is queued and dump the HNSW graph if it changed, then
    /// commits BM25 (shutdown).
    pub fn flush(&self) -> Result<()> {
        self.worker.stop(true);
        let _guard = self.indexes.update.lock();
        self.indexes.bm25.commit(self.visible_seq())
    }
}

pub mod changes;
pub mod clock;
pub mod export;
#[cfg(test)]
mod tests;
