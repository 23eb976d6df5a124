//! On-disk dumps of a shard's HNSW graph, so that a restart loads the graph instead of
//! rebuilding it from RocksDB (minutes at 100k points on 2 cores).
//!
//! A dump is a directory `dump-<seq>` holding the graph (without the live points' vectors,
//! which RocksDB holds: `hnsw_vectors`), the slot table and, written last,
//! `manifest.json` with the applied seq the dump reflects and a CRC32 of every file. It is
//! written as `tmp-<seq>` and renamed once complete and fsynced, so a crash mid-dump leaves at
//! worst a `tmp-` directory (removed later) and the previous dump. At open the newest dump whose
//! manifest and checksums hold is loaded and caught up from the op log (`Shard::open`); any
//! other is removed. A missing or corrupt dump means a rebuild, never a wrong graph.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::time::Instant;

use serde::{Deserialize, Serialize};

use super::hnsw::{HnswIndex, HnswParams};
use super::hnsw_vectors::FetchVectors;
use crate::error::{Result, ShardError};

const MANIFEST: &str = "manifest.json";

#[derive(Serialize, Deserialize)]
struct Manifest {
    /// The applied seq whose state the dump holds.
    seq: u64,
    dimension: usize,
    points: usize,
    /// (file name, length, crc32) of every other file in the directory.
    files: Vec<(String, u64, u32)>,
}

/// A dump as loaded.
pub struct Loaded {
    pub index: HnswIndex,
    /// The applied seq the dump reflects.
    pub seq: u64,
    /// Documents of live points whose stored vector changed after the dump: the catch-up must
    /// cover them, or the dump is not usable.
    pub stale_docs: HashSet<String>,
}

/// The dump directory of one shard replica.
pub struct Dumps {
    dir: PathBuf,
}

impl Dumps {
    pub fn new(dir: PathBuf) -> Self {
        Self { dir }
    }

    /// Dump directories by seq, newest first (names that do not parse are ignored).
    fn listed(&self, prefix: &str) -> Vec<(u64, PathBuf)> {
        let Ok(rd) = std::fs::read_dir(&self.dir) else {
            return Vec::new();
        };
        let mut out: Vec<(u64, PathBuf)> = rd
            .filter_map(|e| e.ok())
            .filter_map(|e| {
                let name = e.file_name().into_string().ok()?;
                let seq = name.strip_prefix(prefix)?.parse().ok()?;
                Some((seq, e.path()))
            })
            .collect();
        out.sort_by_key(|d| std::cmp::Reverse(d.0));
        out
    }

    /// Loads the newest intact dump with seq <= `max_seq` (a dump ahead of the applied index
    /// cannot be caught up and is ignored), with live points' vectors from `fetch` (RocksDB).
    /// Returns None when there is no dump or none intact (the caller rebuilds). Failures are
    /// logged, not returned.
    pub fn load(
        &self,
        dim: usize,
        params: HnswParams,
        max_seq: u64,
        fetch: FetchVectors,
    ) -> Option<Loaded> {
        for (seq, path) in self.listed("dump-") {
            if seq > max_seq {
                continue;
            }
            let started = Instant::now();
            match load_dir(&path, dim, params, fetch) {
                Ok((index, stale_docs)) => {
                    tracing::info!(dir = %path.display(), seq, points = index.counts().0,
                        stale_docs = stale_docs.len(),
                        ms = started.elapsed().as_millis() as u64, "hnsw graph loaded from dump");
                    return Some(Loaded {
                        index,
                        seq,
                        stale_docs,
                    });
                }
                Err(e) => {
                    metrics::counter!("shard_hnsw_dump_rejected_total").increment(1);
                    tracing::warn!(dir = %path.display(), error = %e,
                        "hnsw dump unusable; trying an older one or rebuilding");
                }
            }
        }
        None
    }

    /// Writes a dump of `index` as of `seq`, then removes older dumps and leftovers. Returns
    /// the bytes written.
    pub fn write(&self, index: &HnswIndex, seq: u64) -> Result<u64> {
        std::fs::create_dir_all(&self.dir)?;
        let tmp = self.dir.join(format!("tmp-{seq}"));
        if tmp.exists() {
            std::fs::remove_dir_all(&tmp)?;
        }
        std::fs::create_dir(&tmp)?;
        let points = index.write_parts(&tmp)?;
        let mut files = Vec::new();
        let mut bytes = 0;
        for e in std::fs::read_dir(&tmp)? {
            let e = e?;
            let name = e.file_name().into_string().map_err(|n| {
                ShardError::Corrupt(format!("unexpected file {n:?} in an hnsw dump"))
            })?;
            let (len, crc) = checksum(&e.path(), true)?;
            bytes += len;
            files.push((name, len, crc));
        }
        files.sort();
        let manifest = Manifest {
            seq,
            dimension: index.dim(),
            points,
            files,
        };
        let body = serde_json::to_vec(&manifest)
            .map_err(|e| ShardError::Corrupt(format!("hnsw manifest: {e}")))?;
        write_synced(&tmp.join(MANIFEST), &body)?;
        let done = self.dir.join(format!("dump-{seq}"));
        if done.exists() {
            std::fs::remove_dir_all(&done)?;
        }
        std::fs::rename(&tmp, &done)?;
        std::fs::File::open(&self.dir)?.sync_all()?;
        self.remove_except(Some(seq));
        Ok(bytes)
    }

    /// Removes every dump but the one at `keep`, and every unfinished one.
    pub fn remove_except(&self, keep: Option<u64>) {
        let old = self
            .listed("dump-")
            .into_iter()
            .filter(|(seq, _)| Some(*seq) != keep);
        for (_, path) in old.chain(self.listed("tmp-")) {
            if let Err(e) = std::fs::remove_dir_all(&path) {
                tracing::warn!(dir = %path.display(), error = %e, "could not remove an old hnsw dump");
            }
        }
    }

    /// Bytes of every file under the directory (the current dump, and one being written).
    pub fn bytes(&self) -> u64 {
        ragcluster_common::membership::dir_bytes(&self.dir)
    }

    /// Removes the whole directory (the shard is dropped).
    pub fn remove_all(&self) -> Result<()> {
        if self.dir.exists() {
            std::fs::remove_dir_all(&self.dir)?;
        }
        Ok(())
    }
}

fn load_dir(
    path: &Path,
    dim: usize,
    params: HnswParams,
    fetch: FetchVectors,
) -> Result<(HnswIndex, HashSet<String>)> {
    let corrupt = |m: String| ShardError::Corrupt(m);
    let body = std::fs::read(path.join(MANIFEST))?;
    let m: Manifest =
        serde_json::from_slice(&body).map_err(|e| corrupt(format!("manifest: {e}")))?;
    if m.dimension != dim {
        return Err(corrupt(format!(
            "dump has dimension {}, shard {dim}",
            m.dimension
        )));
    }
    for (name, len, crc) in &m.files {
        let (l, c) = checksum(&path.join(name), false)?;
        if (l, c) != (*len, *crc) {
            return Err(corrupt(format!(
                "{name}: {l} bytes crc {c:08x}, manifest says {len} bytes crc {crc:08x}"
            )));
        }
    }
    let (idx, stale) = HnswIndex::read_parts(path, dim, params, fetch)?;
    let (live, dead) = idx.counts();
    if live + dead != m.points {
        return Err(corrupt(format!(
            "{} points loaded, manifest says {}",
            live + dead,
            m.points
        )));
    }
    Ok((idx, stale))
}

/// (length, crc32) of a file; fsyncs it first when `sync`.
fn checksum(path: &Path, sync: bool) -> Result<(u64, u32)> {
    if sync {
        std::fs::File::open(path)?.sync_all()?;
    }
    Ok(crate::checksum::file_crc32(path)?)
}

fn write_synced(path: &Path, body: &[u8]) -> Result<()> {
    use std::io::Write;
    let mut f = std::fs::File::create(path)?;
    f.write_all(body)?;
    f.sync_all()?;
    Ok(())
}
