//! Bringing a shard's indexes up to the applied seq recorded in RocksDB when it opens: the
//! HNSW graph from its newest dump caught up from the op log (or rebuilt), BM25 by replaying
//! the op log after its committed seq (or rebuilt). Both indexes are derived from the chunks
//! in RocksDB, so a damaged one is rebuilt from there, never served: BM25's files are checked
//! against their checksums at open (`open_bm25`), dumps are checked when loaded.

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::time::Instant;

use super::bm25::Bm25Index;
use super::hnsw::HnswIndex;
use super::hnsw::dump::{DumpState, Dumps};
use super::point;
use crate::error::Result;
use crate::storage::{ShardKey, ShardMeta, Store};

/// The HNSW graph as of `applied`: the newest dump caught up from the op log, or else rebuilt
/// from RocksDB. Also says how far the graph is ahead of the dump it came from.
pub fn open_hnsw(
    key: &ShardKey,
    meta: &ShardMeta,
    store: &Store,
    dumps: &Dumps,
    applied: u64,
) -> Result<(HnswIndex, DumpState)> {
    if let Some(caught_up) = caught_up_dump(key, meta, store, dumps, applied)? {
        return Ok(caught_up);
    }
    let started = Instant::now();
    let dim = meta.dimension as usize;
    dumps.remove_except(None);
    let mut points = Vec::new();
    store.for_each_chunk(key, true, |c| {
        points.push(point(&c));
        Ok(())
    })?;
    let live = points.len();
    let hnsw = HnswIndex::new(dim, meta.hnsw, live);
    hnsw.rebuild(points);
    metrics::counter!("shard_hnsw_rebuilds_total").increment(1);
    tracing::info!(shard = %key, chunks = live, ms = started.elapsed().as_millis() as u64,
        "hnsw graph rebuilt from rocksdb");
    let state = DumpState {
        dumped: None,
        changes: live.max(1),
    };
    Ok((hnsw, state))
}

/// The graph of the newest dump caught up to `applied` from the op log, or None when there
/// is no dump or it cannot be caught up (the caller rebuilds, or keeps the graph it has).
pub fn caught_up_dump(
    key: &ShardKey,
    meta: &ShardMeta,
    store: &Store,
    dumps: &Dumps,
    applied: u64,
) -> Result<Option<(HnswIndex, DumpState)>> {
    let started = Instant::now();
    let dim = meta.dimension as usize;
    let fetch = |ids: &[String]| store.get_vectors(key, ids);
    if let Some(loaded) = dumps.load(dim, meta.hnsw, applied, &fetch) {
        let (idx, seq) = (loaded.index, loaded.seq);
        let load_ms = started.elapsed().as_millis() as u64;
        let log = store.oplog_after(key, seq)?;
        // Entries past `applied` (a snapshot's receiver applies on while its worker catches
        // the shipped dump up) only make the catch-up read newer states of their documents;
        // their own jobs follow and leave the same graph.
        let reaches = seq == applied
            || (log.first().is_some_and(|(s, _)| *s == seq + 1)
                && log.last().is_some_and(|(s, _)| *s >= applied));
        // The final state of every document an entry after the dump wrote is its last write
        // in the log: entries hold each chunk with its vector exactly as it was applied, so
        // the points come from the log already read, not from RocksDB document by document
        // (about 0.1 ms a point after a burst held back tens of thousands).
        let mut last: HashMap<&str, (usize, usize)> = HashMap::new();
        for (e, (_, r)) in log.iter().enumerate() {
            for (i, w) in r.writes.iter().enumerate() {
                last.insert(&w.doc_id, (e, i));
            }
        }
        let touched: HashSet<String> = last.keys().map(|d| (*d).to_owned()).collect();
        // A vector that changed without an entry after the dump means the dump and RocksDB
        // disagree: never serve such a graph.
        let unexplained = loaded.stale_docs.difference(&touched).count();
        if reaches && unexplained == 0 {
            let removed = idx.tombstone_docs(&touched);
            let mut points = Vec::new();
            for (e, (_, r)) in log.iter().enumerate() {
                for (i, w) in r.writes.iter().enumerate() {
                    if !w.delete && last.get(w.doc_id.as_str()) == Some(&(e, i)) {
                        points.extend(w.chunks.iter().map(point));
                    }
                }
            }
            // Searched exactly beside the graph until the index worker has inserted them.
            let inserted = points.len();
            idx.set_pending(points, seq);
            tracing::info!(shard = %key, dump = seq, applied, entries = log.len(), removed,
                pending = inserted, load_ms, ms = started.elapsed().as_millis() as u64,
                "hnsw dump caught up");
            let state = DumpState {
                dumped: Some(seq),
                changes: removed + inserted,
            };
            return Ok(Some((idx, state)));
        }
        tracing::warn!(shard = %key, dump = seq, applied, reaches, unexplained,
            "hnsw dump cannot be caught up (op log does not reach back to it, or vectors \
             changed outside it)");
    }
    Ok(None)
}

/// Opens the shard's BM25 index with every file of its committed segments checked against
/// its checksum (a flipped byte or a cut file). An index that is damaged or cannot be opened
/// is removed and opened empty, so `catch_up_bm25` rebuilds it from RocksDB (its committed
/// seq is then 0); it is never served, and never left for tantivy's merges to trip over.
pub fn open_bm25(key: &ShardKey, dir: &Path, writer_memory: usize) -> Result<Bm25Index> {
    let started = Instant::now();
    let why = match Bm25Index::open(dir, writer_memory) {
        Ok(b) => match b.damaged_files() {
            Ok(d) if d.is_empty() => {
                tracing::debug!(shard = %key, ms = started.elapsed().as_millis() as u64,
                    "bm25 checksums verified");
                return Ok(b);
            }
            Ok(d) => format!("files failing their checksum: {d:?}"),
            Err(e) => format!("checksums could not be read: {e}"),
        },
        Err(e) => format!("cannot be opened: {e}"),
    };
    tracing::warn!(shard = %key, dir = %dir.display(), problem = %why,
        "bm25 index damaged; rebuilding it from rocksdb");
    metrics::counter!("shard_bm25_rebuilds_total").increment(1);
    std::fs::remove_dir_all(dir)?;
    Bm25Index::open(dir, writer_memory)
}

/// Replays op-log entries newer than BM25's committed seq through `applied`, or rebuilds BM25
/// from RocksDB when the log does not reach back that far. (The log may already hold entries
/// past `applied` when the index worker restarts its writer while the Raft thread applies on:
/// their own jobs follow.)
pub fn catch_up_bm25(key: &ShardKey, store: &Store, bm25: &Bm25Index, applied: u64) -> Result<()> {
    let committed = bm25.committed_seq()?;
    if committed >= applied {
        return Ok(());
    }
    let log = store.oplog_after(key, committed)?;
    let contiguous = log.first().is_some_and(|(s, _)| *s == committed + 1)
        && log.last().is_some_and(|(s, _)| *s >= applied);
    if contiguous {
        tracing::info!(shard = %key, from = committed + 1, to = applied, "replaying op log into bm25");
        for (_, req) in log.iter().take_while(|(s, _)| *s <= applied) {
            bm25.stage(&req.writes)?;
        }
    } else {
        tracing::warn!(shard = %key, committed, applied, "op log incomplete; rebuilding bm25 from rocksdb");
        bm25.clear()?;
        store.for_each_chunk(key, false, |c| bm25.stage_chunks(std::slice::from_ref(&c)))?;
    }
    bm25.commit(applied)
}

#[cfg(test)]
mod tests {
    use ragcluster_proto::v1::{Chunk, DocumentWrite};

    use super::*;

    fn key() -> ShardKey {
        ShardKey {
            collection: "c".into(),
            shard: 0,
        }
    }

    /// A committed index of a few chunks at seq 5 in `dir`.
    fn committed(dir: &Path) {
        let b = Bm25Index::open(dir, 20_000_000).unwrap();
        let chunks = (0..20)
            .map(|i| Chunk {
                chunk_id: format!("d{i}#0"),
                doc_id: format!("d{i}"),
                text: format!("chunk number {i} about checksums and damaged segment files"),
                ..Default::default()
            })
            .collect();
        b.stage(&[DocumentWrite {
            doc_id: "d".into(),
            chunks,
            delete: false,
        }])
        .unwrap();
        b.commit(5).unwrap();
    }

    /// The largest file of a segment in `dir`.
    fn biggest_segment_file(dir: &Path) -> std::path::PathBuf {
        std::fs::read_dir(dir)
            .unwrap()
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|x| x != "json" && x != "lock"))
            .max_by_key(|p| std::fs::metadata(p).map_or(0, |m| m.len()))
            .unwrap()
    }

    #[test]
    fn a_sound_bm25_index_opens_as_it_is() {
        let dir = tempfile::tempdir().unwrap();
        committed(dir.path());
        let b = open_bm25(&key(), dir.path(), 20_000_000).unwrap();
        assert_eq!(b.committed_seq().unwrap(), 5);
    }

    #[test]
    fn a_flipped_byte_or_a_cut_file_makes_bm25_start_over() {
        for cut in [false, true] {
            let dir = tempfile::tempdir().unwrap();
            committed(dir.path());
            let f = biggest_segment_file(dir.path());
            let mut bytes = std::fs::read(&f).unwrap();
            if cut {
                bytes.truncate(bytes.len() / 2);
            } else {
                let mid = bytes.len() / 2;
                bytes[mid] ^= 0xff;
            }
            std::fs::write(&f, bytes).unwrap();
            let b = open_bm25(&key(), dir.path(), 20_000_000).unwrap();
            // Empty, so the shard's catch-up rebuilds it from RocksDB.
            assert_eq!(b.committed_seq().unwrap(), 0, "cut: {cut}");
            assert!(b.damaged_files().unwrap().is_empty());
        }
    }
}
