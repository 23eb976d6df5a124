//! On-disk dumps of a shard's HNSW graph, so that a restart loads the graph instead of
//! rebuilding it from RocksDB (minutes at 100k points on 2 cores).
//!
//! A dump is a directory `dump-<seq>` holding the graph (without the live points' vectors,
//! which RocksDB holds: `hnsw::vectors`), the slot table and, written last,
//! `manifest.json` with the applied seq the dump reflects and a CRC32 of every file. It is
//! written as `tmp-<seq>` and renamed once complete and fsynced, so a crash mid-dump leaves at
//! worst a `tmp-` directory (removed later) and the previous dump. At open the newest dump whose
//! manifest and checksums hold is loaded and caught up from the op log (`Shard::open`); any
//! other is removed. A missing or corrupt dump means a rebuild, never a wrong graph.

use std::collections::HashSet;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

use parking_lot::{Mutex, MutexGuard};
use serde::{Deserialize, Serialize};

use super::{FetchVectors, HnswIndex, HnswParams};
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

/// Where the HNSW graph stands against its dumps (at open, and as the index worker keeps it).
pub struct DumpState {
    /// Seq of the dump on disk, if any.
    pub dumped: Option<u64>,
    /// Points inserted or removed since then.
    pub changes: usize,
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
    /// Held while the set of finished dumps changes, and while a snapshot picks the dump it
    /// ships (`Dumps::lock`): the index worker then cannot replace that dump, nor trim the op
    /// log past it, before the snapshot has read both.
    files: Mutex<()>,
}

impl Dumps {
    pub fn new(dir: PathBuf) -> Self {
        Self {
            dir,
            files: Mutex::new(()),
        }
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
        let _files = self.files.lock();
        self.publish(&tmp, &format!("dump-{seq}"))?;
        self.remove_unlocked(Some(seq));
        Ok(bytes)
    }

    /// Renames the finished directory `tmp` to `name` (replacing one of that name) and
    /// syncs the parent, so a crash leaves either the whole directory or none. The caller
    /// holds `files`.
    fn publish(&self, tmp: &Path, name: &str) -> Result<()> {
        let done = self.dir.join(name);
        if done.exists() {
            std::fs::remove_dir_all(&done)?;
        }
        std::fs::rename(tmp, &done)?;
        std::fs::File::open(&self.dir)?.sync_all()?;
        Ok(())
    }

    /// Removes every dump but the one at `keep`, and every unfinished one.
    pub fn remove_except(&self, keep: Option<u64>) {
        let _files = self.files.lock();
        self.remove_unlocked(keep);
    }

    fn remove_unlocked(&self, keep: Option<u64>) {
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

    /// Seq of the newest finished dump.
    pub fn newest(&self) -> Option<u64> {
        self.listed("dump-").first().map(|d| d.0)
    }

    /// Holds the finished dumps as they are (see `files`).
    pub fn lock(&self) -> MutexGuard<'_, ()> {
        self.files.lock()
    }

    /// Hard-links the files of the newest finished dump with seq <= `max_seq` into a
    /// directory of their own, so they stay readable after the lock is gone and the worker
    /// replaced the dump. The caller holds `lock`. None when there is no such dump.
    pub fn link_newest(&self, _held: &MutexGuard<'_, ()>, max_seq: u64) -> Option<Linked> {
        let (seq, path) = self
            .listed("dump-")
            .into_iter()
            .find(|(seq, _)| *seq <= max_seq)?;
        // A name of its own per call: a snapshot and followers may ship the same dump at once.
        static SHIPS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = SHIPS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = self.dir.join(format!("ship-{n}"));
        let linked = (|| -> Result<Vec<String>> {
            if dir.exists() {
                std::fs::remove_dir_all(&dir)?;
            }
            std::fs::create_dir(&dir)?;
            let mut names = Vec::new();
            for e in std::fs::read_dir(&path)? {
                let name = e?.file_name();
                std::fs::hard_link(path.join(&name), dir.join(&name))?;
                names.push(name.to_string_lossy().into_owned());
            }
            names.sort();
            Ok(names)
        })();
        match linked {
            Ok(names) => Some(Linked { seq, dir, names }),
            Err(e) => {
                tracing::warn!(dump = %path.display(), error = %e,
                    "could not link the hnsw dump for a snapshot; the receiver rebuilds");
                let _ = std::fs::remove_dir_all(&dir);
                None
            }
        }
    }

    /// Reads a dump section written by `Linked::write_to` into `recv-<seq>` (complete and
    /// fsynced, or absent). Its manifest is checked when the dump is loaded. Returns the seq.
    pub fn receive(&self, input: &mut impl Read) -> Result<u64> {
        std::fs::create_dir_all(&self.dir)?;
        let bad = |m: &str| ShardError::Corrupt(format!("shipped hnsw dump: {m}"));
        let seq = get_u64(input)?;
        let count = get_u64(input)?;
        if count > MAX_SHIPPED_FILES {
            return Err(bad("too many files"));
        }
        let tmp = self.dir.join(format!("rtmp-{seq}"));
        if tmp.exists() {
            std::fs::remove_dir_all(&tmp)?;
        }
        std::fs::create_dir(&tmp)?;
        if let Err(e) = receive_files(input, &tmp, count) {
            let _ = std::fs::remove_dir_all(&tmp);
            return Err(e);
        }
        let _files = self.files.lock();
        self.publish(&tmp, &format!("recv-{seq}"))?;
        Ok(seq)
    }

    /// Makes the received dump `seq` the only dump (the state it describes replaced this
    /// replica's), and removes older received ones. False when it is gone (a later snapshot
    /// of the same seq is on its way, or the node restarted).
    pub fn adopt_received(&self, seq: u64) -> bool {
        let _files = self.files.lock();
        self.remove_unlocked(None);
        let from = self.dir.join(format!("recv-{seq}"));
        let adopted =
            from.exists() && std::fs::rename(&from, self.dir.join(format!("dump-{seq}"))).is_ok();
        for (s, path) in self.listed("recv-") {
            if s < seq {
                let _ = std::fs::remove_dir_all(path);
            }
        }
        adopted
    }

    /// Makes the received dump `seq` a finished dump beside the others (a follower's graph
    /// from its leader): the caller loads it, then keeps it alone or removes it. False when it
    /// is gone or this replica already has a dump of that seq.
    pub fn promote_received(&self, seq: u64) -> bool {
        let _files = self.files.lock();
        let from = self.dir.join(format!("recv-{seq}"));
        let to = self.dir.join(format!("dump-{seq}"));
        if !from.exists() || to.exists() {
            let _ = std::fs::remove_dir_all(&from);
            return false;
        }
        std::fs::rename(&from, &to).is_ok()
            && std::fs::File::open(&self.dir)
                .and_then(|d| d.sync_all())
                .is_ok()
    }

    /// Removes the received dump of `seq` (not adopted).
    pub fn discard_received(&self, seq: u64) {
        let _files = self.files.lock();
        let _ = std::fs::remove_dir_all(self.dir.join(format!("recv-{seq}")));
    }

    /// Removes the dump of `seq` (one that could not be caught up).
    pub fn remove(&self, seq: u64) {
        let _files = self.files.lock();
        let _ = std::fs::remove_dir_all(self.dir.join(format!("dump-{seq}")));
    }

    /// Removes received dumps never adopted and links left by snapshots (at open).
    pub fn remove_leftovers(&self) {
        let _files = self.files.lock();
        let stale = ["recv-", "rtmp-", "ship-"].map(|p| self.listed(p)).concat();
        for (_, path) in stale {
            let _ = std::fs::remove_dir_all(path);
        }
    }

    /// Removes the whole directory (the shard is dropped).
    pub fn remove_all(&self) -> Result<()> {
        if self.dir.exists() {
            std::fs::remove_dir_all(&self.dir)?;
        }
        Ok(())
    }
}

/// Most files a shipped dump may hold (ours hold four or five).
const MAX_SHIPPED_FILES: u64 = 16;

/// A finished dump's files, hard-linked for a snapshot; the links go when this is dropped.
pub struct Linked {
    pub seq: u64,
    dir: PathBuf,
    names: Vec<String>,
}

impl Linked {
    /// Writes the dump section: seq, file count, then per file its name and bytes, each
    /// u64-BE-length-prefixed.
    pub fn write_to(&self, out: &mut impl Write) -> Result<u64> {
        out.write_all(&self.seq.to_be_bytes())?;
        out.write_all(&(self.names.len() as u64).to_be_bytes())?;
        let mut bytes = 0;
        for name in &self.names {
            let mut f = std::fs::File::open(self.dir.join(name))?;
            let size = f.metadata()?.len();
            out.write_all(&(name.len() as u64).to_be_bytes())?;
            out.write_all(name.as_bytes())?;
            out.write_all(&size.to_be_bytes())?;
            let copied = std::io::copy(&mut (&mut f).take(size), out)?;
            if copied != size {
                return Err(ShardError::Corrupt(format!("{name} shrank while shipped")));
            }
            bytes += size;
        }
        Ok(bytes)
    }
}

impl Drop for Linked {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The files of a shipped dump section into `dir`, each fsynced.
fn receive_files(input: &mut impl Read, dir: &Path, count: u64) -> Result<()> {
    let bad = |m: &str| ShardError::Corrupt(format!("shipped hnsw dump: {m}"));
    for _ in 0..count {
        let len = get_u64(input)?;
        if len == 0 || len > 255 {
            return Err(bad("file name length"));
        }
        let mut name = vec![0u8; len as usize];
        input.read_exact(&mut name)?;
        let name = String::from_utf8(name).map_err(|_| bad("file name"))?;
        // Plain names only: nothing may land outside the directory.
        if name.starts_with('.') || name.contains(['/', '\\']) {
            return Err(bad("file name"));
        }
        let size = get_u64(input)?;
        let mut f = std::fs::File::create(dir.join(&name))?;
        let copied = std::io::copy(&mut input.take(size), &mut f)?;
        if copied != size {
            return Err(bad("truncated"));
        }
        f.sync_all()?;
    }
    Ok(())
}

fn get_u64(input: &mut impl Read) -> Result<u64> {
    let mut b = [0u8; 8];
    input.read_exact(&mut b)?;
    Ok(u64::from_be_bytes(b))
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
    let mut f = std::fs::File::create(path)?;
    f.write_all(body)?;
    f.sync_all()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A dump section cut short, or naming a file outside its directory, is refused and
    /// leaves nothing behind; a whole one lands in `recv-<seq>`.
    #[test]
    fn receive_refuses_bad_sections_and_leaves_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let dumps = Dumps::new(dir.path().join("hnsw"));
        let section = |name: &str, size: u64, body: &[u8]| {
            let mut s = Vec::new();
            s.extend_from_slice(&7u64.to_be_bytes());
            s.extend_from_slice(&1u64.to_be_bytes());
            s.extend_from_slice(&(name.len() as u64).to_be_bytes());
            s.extend_from_slice(name.as_bytes());
            s.extend_from_slice(&size.to_be_bytes());
            s.extend_from_slice(body);
            s
        };
        let leftovers = || dumps.listed("rtmp-").len() + dumps.listed("recv-").len();
        let cut = section("graph.bin", 10, b"12345");
        assert!(dumps.receive(&mut cut.as_slice()).is_err());
        assert_eq!(leftovers(), 0, "a truncated section leaves nothing");
        let escape = section("../graph.bin", 5, b"12345");
        assert!(dumps.receive(&mut escape.as_slice()).is_err());
        assert_eq!(leftovers(), 0);
        assert!(!dir.path().join("graph.bin").exists());
        let whole = section("graph.bin", 5, b"12345");
        assert_eq!(dumps.receive(&mut whole.as_slice()).unwrap(), 7);
        assert_eq!(dumps.listed("recv-").len(), 1);
        assert_eq!(
            std::fs::read(dir.path().join("hnsw/recv-7/graph.bin")).unwrap(),
            b"12345"
        );
        dumps.remove_leftovers();
        assert_eq!(leftovers(), 0);
    }
}
