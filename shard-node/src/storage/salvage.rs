//! Opening the node's RocksDB with its files checked, and rebuilding it without a damaged
//! file. One database holds every shard of the node, so a damaged file (a flipped byte in an
//! SST, a truncated one that keeps RocksDB from opening at all) must not take the node down:
//! the salvage copies, with every block's checksum verified, what is still whole into a fresh
//! database: the node's records and every shard that reads back completely, with its Raft
//! state. A shard with a key in the damaged file keeps only its parameters and a mark saying
//! why (`x` in `meta`): its replica starts failed (it neither votes, leads nor serves) and the
//! catalog leader rebuilds it from its peers through a Raft snapshot. The old database is kept
//! beside it as `rocksdb.damaged` until the next salvage.
//!
//! A shard with no other replica cannot be rebuilt: the node then refuses to start, naming the
//! file, and leaves the old database as it was.

use std::path::Path;

use protobuf::Message as _;
use ragcluster_raft::Keys;
use ragcluster_raft::eraftpb::ConfState;
use rocksdb::{ColumnFamilyDescriptor, DB, IteratorMode, Options, ReadOptions, WriteBatch};

use super::scrub::{Ledger, Pace, sst_named_in};
use super::{ALL_CFS, CF_META, CF_RAFT, NODE_ID_KEY, ShardKey, Store};
use crate::error::{Result, ShardError};

/// Bytes of copied keys per write while salvaging.
const COPY_BATCH_BYTES: usize = 4 << 20;

/// Marks a shard whose data was in a damaged file (the value says which and why).
const DAMAGED_SUFFIX: &[u8] = b"x";

impl Store {
    /// Why the shard's data was dropped by a salvage, if it was (see the module doc).
    pub fn damaged(&self, key: &ShardKey) -> Result<Option<String>> {
        Ok(self
            .db
            .get_cf(self.cf(CF_META), key.key(DAMAGED_SUFFIX))?
            .map(|v| String::from_utf8_lossy(&v).into_owned()))
    }
}

/// Opens the database at `path` and verifies every file not verified before (all of them the
/// first time); a database that cannot be opened, holds a damaged file or one the scrub found
/// damaged while the node ran is salvaged first (see the module doc). Returns the store and,
/// when it was salvaged, why.
pub fn open_checked(path: &Path, sync: bool) -> Result<(Store, Option<String>)> {
    let mut ledger = Ledger::load(path);
    let trouble = match Store::open(path, sync) {
        Err(e) => e.to_string(),
        Ok(store) => match check(&store, &mut ledger) {
            None => return Ok((store, None)),
            Some(why) => why,
        },
    };
    tracing::error!(path = %path.display(), error = %trouble,
        "rocksdb damaged; salvaging what is whole, rebuilding the rest from peers");
    metrics::counter!("shard_store_salvages_total").increment(1);
    salvage(path, &trouble)?;
    ledger.verified.clear();
    ledger.damaged.clear();
    let store = Store::open(path, sync)?;
    if let Some(why) = check(&store, &mut ledger) {
        return Err(ShardError::Corrupt(format!(
            "{}: still damaged after a salvage: {why}",
            path.display()
        )));
    }
    Ok((store, Some(trouble)))
}

/// The damage found in the opened store: a file the scrub marked that is still live, or a
/// file failing its checksums among those not verified yet. Saves the ledger when sound.
fn check(store: &Store, ledger: &mut Ledger) -> Option<String> {
    let live = store.sst_files().unwrap_or_default();
    if let Some((name, why)) = ledger
        .damaged
        .iter()
        .find(|(n, _)| live.iter().any(|f| &f.name == *n))
    {
        return Some(format!("damaged file {name} (found by the scrub): {why}"));
    }
    let shards: Vec<ShardKey> = Vec::new();
    let started = std::time::Instant::now();
    match store.verify_files(ledger, &shards, &mut Pace::new(0), false) {
        Err(d) => Some(d.to_string()),
        Ok(scan) => {
            ledger.damaged.clear();
            if let Err(e) = ledger.save() {
                tracing::warn!(error = %e, "could not save the scrub ledger");
            }
            metrics::counter!("shard_scrub_files_total").increment(scan.files);
            metrics::counter!("shard_scrub_bytes_total").increment(scan.bytes);
            tracing::info!(
                files = scan.files,
                bytes = scan.bytes,
                ms = started.elapsed().as_millis() as u64,
                "rocksdb files verified at open"
            );
            None
        }
    }
}

/// Opens the damaged database for the copy: read-only, or, when RocksDB refuses even that
/// over a file it names (a cut SST fails its size check at open), a scratch copy of it without
/// that file (SST files hard-linked, the small others copied), opened with RocksDB's
/// best-efforts recovery. That recovers an older consistent state, so `true` then: no shard's
/// data can be trusted to be current, and every shard is rebuilt from its peers.
fn open_damaged(path: &Path) -> std::result::Result<(DB, bool), ShardError> {
    let cfs = || {
        ALL_CFS
            .into_iter()
            .map(|n| ColumnFamilyDescriptor::new(n, Options::default()))
    };
    let e = match DB::open_cf_descriptors_read_only(&Options::default(), path, cfs(), false) {
        Ok(db) => return Ok((db, false)),
        Err(e) => e,
    };
    let Some(bad) = sst_named_in(e.as_ref()) else {
        return Err(e.into());
    };
    let scratch = path.with_extension("salvage-src");
    remove_dir(&scratch)?;
    std::fs::create_dir_all(&scratch)?;
    for entry in std::fs::read_dir(path)? {
        let entry = entry?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if name == bad || name == "LOCK" {
            continue;
        }
        let to = scratch.join(&name);
        if name.ends_with(".sst") {
            std::fs::hard_link(entry.path(), &to)
                .or_else(|_| std::fs::copy(entry.path(), &to).map(drop))?;
        } else {
            std::fs::copy(entry.path(), &to)?;
        }
    }
    let mut base = Options::default();
    let opts = base.get_options_from_string("best_efforts_recovery=true")?;
    Ok((DB::open_cf_descriptors(&opts, &scratch, cfs())?, true))
}

/// Rebuilds the database at `path` from what of it is whole (see the module doc).
fn salvage(path: &Path, trouble: &str) -> Result<()> {
    let named = sst_named_in(trouble).unwrap_or_else(|| "a file".into());
    let refuse = |what: String| {
        ShardError::Corrupt(format!(
            "{}: {trouble}; {what}. The store was left as it is: restore the node from a \
             backup, or move {} aside to start it empty",
            path.display(),
            path.display()
        ))
    };
    let (db, stale) = open_damaged(path)
        .map_err(|e| refuse(format!("it cannot be opened to salvage it ({e})")))?;
    let old = Store {
        db: std::sync::Arc::new(db),
        sync: false,
        damaged: Default::default(),
    };
    let fresh = path.with_extension("salvage");
    remove_dir(&fresh)?;
    let new = Store::open(&fresh, false)?;
    // The node's own records (id, peers): without them it is not the same member.
    let node_id = copy_node_records(&old, &new)
        .map_err(|e| refuse(format!("the node's records are unreadable ({e})")))?;
    let shards = old
        .list_shards()
        .map_err(|e| refuse(format!("the list of shards is unreadable ({e})")))?;
    let mut lone = Vec::new();
    for (key, meta) in &shards {
        let copied = if stale {
            Err(ShardError::Corrupt(
                "the store opened only at an earlier state".into(),
            ))
        } else {
            copy_shard(&old, &new, key)
        };
        let Err(e) = copied else {
            continue;
        };
        let why = format!("its data was in damaged file {named}: {e}");
        tracing::error!(shard = %key, error = %why, "shard dropped by the salvage; to be rebuilt from its peers");
        let mut b = WriteBatch::default();
        for cf in ALL_CFS {
            b.delete_range_cf(new.cf(cf), key.prefix(), key.end());
        }
        new.write_opt(b, false)?;
        new.put_shard_meta(key, meta)?;
        let mut b = WriteBatch::default();
        b.put_cf(new.cf(CF_META), key.key(DAMAGED_SUFFIX), why.as_bytes());
        new.write_opt(b, false)?;
        if only_replica(&old, key, node_id) {
            lone.push(key.to_string());
        }
    }
    if !lone.is_empty() {
        drop((old, new));
        remove_dir(&fresh)?;
        remove_dir(&path.with_extension("salvage-src"))?;
        return Err(refuse(format!(
            "shard(s) {} have no other replica to be rebuilt from",
            lone.join(", ")
        )));
    }
    new.db.flush_wal(true)?;
    let cfs: Vec<_> = ALL_CFS.iter().map(|n| new.cf(n)).collect();
    new.db
        .flush_cfs_opt(&cfs, &rocksdb::FlushOptions::default())?;
    drop((old, new));
    remove_dir(&path.with_extension("salvage-src"))?;
    let kept = path.with_extension("damaged");
    remove_dir(&kept)?;
    std::fs::rename(path, &kept)?;
    std::fs::rename(&fresh, path)?;
    if let Some(parent) = path.parent() {
        std::fs::File::open(parent)?.sync_all()?;
    }
    tracing::warn!(kept = %kept.display(), shards = shards.len(),
        "rocksdb salvaged; the damaged database is kept beside it");
    Ok(())
}

fn remove_dir(p: &Path) -> Result<()> {
    match std::fs::remove_dir_all(p) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e.into()),
        _ => Ok(()),
    }
}

/// Reads with every block's checksum verified and without filling the cache.
fn verifying() -> ReadOptions {
    let mut ro = ReadOptions::default();
    ro.set_verify_checksums(true);
    ro.fill_cache(false);
    ro
}

/// Copies the `~node/...` records of `meta`; returns the node id if it was there.
fn copy_node_records(old: &Store, new: &Store) -> Result<Option<u64>> {
    let mut b = WriteBatch::default();
    let mut id = None;
    let from = IteratorMode::From(b"~", rocksdb::Direction::Forward);
    for item in old.db.iterator_cf_opt(old.cf(CF_META), verifying(), from) {
        let (k, v) = item?;
        if &*k == NODE_ID_KEY {
            id = v.as_ref().try_into().ok().map(u64::from_be_bytes);
        }
        b.put_cf(new.cf(CF_META), k, v);
    }
    new.write_opt(b, false)?;
    Ok(id)
}

/// Copies every key of the shard in every family; fails on the first unreadable block.
fn copy_shard(old: &Store, new: &Store, key: &ShardKey) -> Result<()> {
    for cf in ALL_CFS {
        let mut ro = verifying();
        ro.set_iterate_upper_bound(key.end());
        let from = IteratorMode::From(&key.prefix(), rocksdb::Direction::Forward);
        let mut b = WriteBatch::default();
        for item in old.db.iterator_cf_opt(old.cf(cf), ro, from) {
            let (k, v) = item?;
            b.put_cf(new.cf(cf), k, v);
            if b.size_in_bytes() >= COPY_BATCH_BYTES {
                new.write_opt(std::mem::take(&mut b), false)?;
            }
        }
        new.write_opt(b, false)?;
    }
    Ok(())
}

/// Whether the shard's last known membership is this node alone (read from the damaged store;
/// unknown counts as not alone: the catalog leader refuses the rebuild then, saying so).
fn only_replica(old: &Store, key: &ShardKey, node_id: Option<u64>) -> bool {
    let Some(me) = node_id else {
        return false;
    };
    let keys = Keys::new(key.prefix());
    let Ok(Some(v)) = old
        .db
        .get_cf_opt(old.cf(CF_RAFT), keys.conf_state(), &verifying())
    else {
        return false;
    };
    let mut cs = ConfState::default();
    if cs.merge_from_bytes(&v).is_err() {
        return false;
    }
    let members: Vec<u64> = cs.voters.iter().chain(&cs.learners).copied().collect();
    !members.is_empty() && members.iter().all(|id| *id == me)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::storage::{HnswParams, ShardMeta};

    const META: ShardMeta = ShardMeta {
        dimension: 4,
        hnsw: HnswParams {
            m: 16,
            ef_construction: 100,
            ef_search: 64,
        },
    };

    /// A store with shards `t/0` and `t/1`, each in SST files of its own (flushed apart),
    /// the given voters in both; returns the node id and the chunk files of `t/0`.
    fn two_shards(path: &Path, voters: impl Fn(u64) -> Vec<u64>) -> (u64, Vec<std::path::PathBuf>) {
        let store = Store::open(path, true).unwrap();
        let id = store.node_id().unwrap();
        let mut files = Vec::new();
        for shard in 0..2 {
            let key = ShardKey::new("t", shard);
            let cs = ConfState {
                voters: voters(id),
                ..Default::default()
            };
            store.raft_log(&key).init(&cs).unwrap();
            store.put_shard_meta(&key, &META).unwrap();
            let mut b = WriteBatch::default();
            for i in 0..2000u32 {
                let v = format!("chunk {i} of shard {shard} ").repeat(8);
                b.put_cf(
                    store.cf(super::super::CF_CHUNKS),
                    key.key(&i.to_be_bytes()),
                    v,
                );
            }
            store.write(b).unwrap();
            let cfs: Vec<_> = ALL_CFS.iter().map(|n| store.cf(n)).collect();
            store
                .db
                .flush_cfs_opt(&cfs, &rocksdb::FlushOptions::default())
                .unwrap();
            if shard == 0 {
                for f in store.sst_files().unwrap() {
                    if f.cf == super::super::CF_CHUNKS {
                        files.push(path.join(f.name.trim_start_matches('/')));
                    }
                }
            }
        }
        (id, files)
    }

    fn chunks(store: &Store, shard: u32) -> usize {
        let key = ShardKey::new("t", shard);
        let mut ro = ReadOptions::default();
        ro.set_iterate_upper_bound(key.end());
        let from = IteratorMode::From(&key.prefix(), rocksdb::Direction::Forward);
        store
            .db
            .iterator_cf_opt(store.cf(super::super::CF_CHUNKS), ro, from)
            .inspect(|r| assert!(r.is_ok(), "{r:?}"))
            .count()
    }

    fn flip_middle(file: &Path) {
        let mut bytes = std::fs::read(file).unwrap();
        let at = bytes.len() / 3;
        bytes[at] ^= 0x5a;
        std::fs::write(file, bytes).unwrap();
    }

    #[test]
    fn a_flipped_byte_is_found_at_open_and_only_its_shard_is_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("rocksdb");
        let (id, files) = two_shards(&path, |id| vec![id, id + 1, id + 2]);
        assert_eq!(files.len(), 1);
        flip_middle(&files[0]);
        let (store, salvaged) = open_checked(&path, true).unwrap();
        let why = salvaged.expect("salvaged");
        assert!(why.contains(".sst"), "{why}");
        assert_eq!(store.node_id().unwrap(), id);
        let damaged = store
            .damaged(&ShardKey::new("t", 0))
            .unwrap()
            .expect("t/0 marked");
        assert!(damaged.contains("damaged file"), "{damaged}");
        assert_eq!(store.damaged(&ShardKey::new("t", 1)).unwrap(), None);
        assert_eq!(chunks(&store, 0), 0);
        assert_eq!(chunks(&store, 1), 2000);
        assert_eq!(store.list_shards().unwrap().len(), 2);
        assert!(path.with_extension("damaged").exists());
        drop(store);
        // The next open finds nothing to salvage.
        let (_, again) = open_checked(&path, true).unwrap();
        assert_eq!(again, None);
    }

    #[test]
    fn a_truncated_file_that_keeps_rocksdb_from_opening_is_salvaged() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("rocksdb");
        let (id, files) = two_shards(&path, |id| vec![id, id + 1]);
        let len = std::fs::metadata(&files[0]).unwrap().len();
        std::fs::OpenOptions::new()
            .write(true)
            .open(&files[0])
            .unwrap()
            .set_len(len / 2)
            .unwrap();
        assert!(Store::open(&path, true).is_err());
        let (store, salvaged) = open_checked(&path, true).unwrap();
        assert!(salvaged.is_some());
        // Opened only at an earlier state: every shard is rebuilt from its peers, the node
        // stays the same member.
        assert_eq!(store.node_id().unwrap(), id);
        for shard in 0..2 {
            assert!(store.damaged(&ShardKey::new("t", shard)).unwrap().is_some());
            assert_eq!(chunks(&store, shard), 0);
        }
        assert!(!path.with_extension("salvage-src").exists());
    }

    #[test]
    fn a_lone_replica_refuses_to_start_naming_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("rocksdb");
        let (_, files) = two_shards(&path, |id| vec![id]);
        flip_middle(&files[0]);
        let e = open_checked(&path, true)
            .err()
            .expect("refused")
            .to_string();
        let name = files[0].file_name().unwrap().to_string_lossy().into_owned();
        assert!(e.contains(&name) && e.contains("t/0"), "{e}");
        assert!(!path.with_extension("damaged").exists());
        assert!(!path.with_extension("salvage").exists());
    }
    /// The background scrub meets a byte flipped under a running store: it reports the file
    /// with the shard in it, records it in the ledger, and the next open salvages the store.
    #[test]
    fn the_scrub_finds_a_flipped_byte_and_the_next_open_salvages() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("rocksdb");
        let (_, files) = two_shards(&path, |id| vec![id, id + 1]);
        let (store, _) = open_checked(&path, true).unwrap();
        let store = std::sync::Arc::new(store);
        flip_middle(&files[0]);
        let (tx, rx) = std::sync::mpsc::channel();
        let all = vec![ShardKey::new("t", 0), ShardKey::new("t", 1)];
        let scrubber = crate::storage::scrub::Scrubber::spawn(
            store.clone(),
            std::time::Duration::from_millis(50),
            64 << 20,
            move || all.clone(),
            move |d| {
                let _ = tx.send(d.clone());
            },
        )
        .unwrap();
        let d = rx
            .recv_timeout(std::time::Duration::from_secs(20))
            .expect("the scrub reports the damage");
        drop(scrubber);
        assert_eq!(d.shards, vec![ShardKey::new("t", 0)]);
        assert!(
            d.file
                .ends_with(&*files[0].file_name().unwrap().to_string_lossy()),
            "{d}"
        );
        drop(store);
        let (store, salvaged) = open_checked(&path, true).unwrap();
        assert!(salvaged.unwrap().contains("found by the scrub"));
        assert!(store.damaged(&ShardKey::new("t", 0)).unwrap().is_some());
        assert_eq!(chunks(&store, 1), 2000);
    }
}
