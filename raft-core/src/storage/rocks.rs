//! A group's log in RocksDB, under a key prefix in one column family, so one database holds
//! many groups (every shard replica of a node) next to their state machines:
//!
//! | key            | value                                   |
//! |----------------|-----------------------------------------|
//! | prefix `h`     | hard state                              |
//! | prefix `c`     | conf state as of the applied index      |
//! | prefix `t`     | truncated (index, term), u64 BE each    |
//! | prefix `e` idx | entry at `idx` (u64 BE), `eraftpb.Entry` |
//!
//! State machines sharing the database write `c` (and, on snapshot restore, the whole group)
//! in their own atomic writes through `Keys`.

use std::sync::{Arc, OnceLock, Weak, mpsc};

use protobuf::Message as _;
use raft::eraftpb::{ConfState, Entry, HardState};
use rocksdb::{DB, Direction, IteratorMode, WriteBatch, WriteOptions};

use super::{LogStore, Persisted};
use crate::error::Fatal;

/// Key layout of one group.
#[derive(Debug, Clone)]
pub struct Keys {
    prefix: Vec<u8>,
}

impl Keys {
    pub fn new(prefix: Vec<u8>) -> Self {
        Self { prefix }
    }

    fn key(&self, suffix: &[u8]) -> Vec<u8> {
        let mut k = Vec::with_capacity(self.prefix.len() + suffix.len());
        k.extend_from_slice(&self.prefix);
        k.extend_from_slice(suffix);
        k
    }

    pub fn hard_state(&self) -> Vec<u8> {
        self.key(b"h")
    }

    pub fn conf_state(&self) -> Vec<u8> {
        self.key(b"c")
    }

    pub fn truncated(&self) -> Vec<u8> {
        self.key(b"t")
    }

    pub fn entry(&self, index: u64) -> Vec<u8> {
        let mut k = self.key(b"e");
        k.extend_from_slice(&index.to_be_bytes());
        k
    }

    fn entry_index(&self, k: &[u8]) -> Option<u64> {
        let rest = k.strip_prefix(self.key(b"e").as_slice())?;
        Some(u64::from_be_bytes(rest.try_into().ok()?))
    }

    /// Adds to `b` what resets the group to a snapshot at (`index`, `term`): every entry
    /// dropped, the truncation point, the conf state and the hard state.
    pub fn reset_into(
        &self,
        b: &mut WriteBatch,
        cf: &rocksdb::ColumnFamily,
        index: u64,
        term: u64,
        cs: &ConfState,
        hs: &HardState,
    ) -> Result<(), Fatal> {
        b.delete_range_cf(cf, self.entry(0), self.entry(u64::MAX));
        b.put_cf(cf, self.truncated(), truncated_value(index, term));
        b.put_cf(cf, self.conf_state(), cs.write_to_bytes()?);
        b.put_cf(cf, self.hard_state(), hs.write_to_bytes()?);
        Ok(())
    }
}

fn truncated_value(index: u64, term: u64) -> Vec<u8> {
    let mut t = index.to_be_bytes().to_vec();
    t.extend(term.to_be_bytes());
    t
}

fn decode<M: protobuf::Message + Default>(b: &[u8], what: &str) -> Result<M, Fatal> {
    let mut m = M::default();
    m.merge_from_bytes(b)
        .map_err(|e| Fatal(format!("{what}: {e}")))?;
    Ok(m)
}

pub struct RocksLog {
    db: Arc<DB>,
    cf: &'static str,
    keys: Keys,
    /// fsync appends (the log is what makes an acknowledged write durable).
    sync: bool,
}

impl RocksLog {
    pub fn new(db: Arc<DB>, cf: &'static str, prefix: Vec<u8>, sync: bool) -> Self {
        Self {
            db,
            cf,
            keys: Keys::new(prefix),
            sync,
        }
    }

    pub fn keys(&self) -> &Keys {
        &self.keys
    }

    fn cf(&self) -> Result<&rocksdb::ColumnFamily, Fatal> {
        self.db
            .cf_handle(self.cf)
            .ok_or_else(|| Fatal(format!("column family {} missing", self.cf)))
    }

    fn write(&self, b: WriteBatch, sync: bool) -> Result<(), Fatal> {
        let mut w = WriteOptions::default();
        w.set_sync(sync);
        self.db.write_opt(b, &w)?;
        Ok(())
    }

    /// Whether the group was ever initialised here.
    pub fn exists(&self) -> Result<bool, Fatal> {
        Ok(self
            .db
            .get_cf(self.cf()?, self.keys.hard_state())?
            .is_some())
    }

    /// Initialises an empty group with `cs` (its first voters, or none for a joining member),
    /// dropping whatever an earlier group under this prefix left.
    pub fn init(&self, cs: &ConfState) -> Result<(), Fatal> {
        let cf = self.cf()?;
        let mut b = WriteBatch::default();
        self.keys
            .reset_into(&mut b, cf, 0, 0, cs, &HardState::default())?;
        self.write(b, true)
    }
}

impl LogStore for RocksLog {
    fn load(&self) -> Result<Persisted, Fatal> {
        let cf = self.cf()?;
        let hs = match self.db.get_cf(cf, self.keys.hard_state())? {
            Some(v) => decode(&v, "hard state")?,
            None => HardState::default(),
        };
        let cs = match self.db.get_cf(cf, self.keys.conf_state())? {
            Some(v) => decode(&v, "conf state")?,
            None => ConfState::default(),
        };
        let (truncated_index, truncated_term) = match self.db.get_cf(cf, self.keys.truncated())? {
            Some(v) if v.len() == 16 => (
                u64::from_be_bytes(v[..8].try_into().unwrap_or_default()),
                u64::from_be_bytes(v[8..].try_into().unwrap_or_default()),
            ),
            _ => (0, 0),
        };
        // The last entry: seek to the end of the group's entry range.
        let mut last_index = truncated_index;
        let mut it = self.db.raw_iterator_cf(cf);
        it.seek_for_prev(self.keys.entry(u64::MAX));
        if let Some(k) = it.key()
            && let Some(idx) = self.keys.entry_index(k)
        {
            last_index = last_index.max(idx);
        }
        it.status()?;
        Ok(Persisted {
            hs,
            cs,
            truncated_index,
            truncated_term,
            last_index,
        })
    }

    fn entries(&self, lo: u64, hi: u64, max_size: Option<u64>) -> Result<Vec<Entry>, Fatal> {
        let cf = self.cf()?;
        let start = self.keys.entry(lo);
        let end = self.keys.entry(hi);
        let mut out = Vec::with_capacity((hi - lo).min(1024) as usize);
        let mut size = 0u64;
        for item in self
            .db
            .iterator_cf(cf, IteratorMode::From(&start, Direction::Forward))
        {
            let (k, v) = item?;
            if *k >= *end {
                break;
            }
            size += v.len() as u64;
            if !out.is_empty() && max_size.is_some_and(|m| size > m) {
                break;
            }
            out.push(decode::<Entry>(&v, "raft entry")?);
        }
        let contiguous = out
            .iter()
            .enumerate()
            .all(|(i, e)| e.index == lo + i as u64);
        if out.is_empty() && lo < hi || !contiguous {
            return Err(Fatal(format!("raft log has a gap at {lo}")));
        }
        Ok(out)
    }

    fn term(&self, index: u64) -> Result<Option<u64>, Fatal> {
        match self.db.get_cf(self.cf()?, self.keys.entry(index))? {
            Some(v) => Ok(Some(decode::<Entry>(&v, "raft entry")?.term)),
            None => Ok(None),
        }
    }

    fn append(
        &mut self,
        entries: &[Entry],
        old_last: u64,
        hs: Option<&HardState>,
    ) -> Result<(), Fatal> {
        let cf = self.cf()?;
        let mut b = WriteBatch::default();
        if let Some(first) = entries.first()
            && first.index <= old_last
        {
            b.delete_range_cf(
                cf,
                self.keys.entry(first.index),
                self.keys.entry(old_last + 1),
            );
        }
        for e in entries {
            b.put_cf(cf, self.keys.entry(e.index), e.write_to_bytes()?);
        }
        if let Some(hs) = hs {
            b.put_cf(cf, self.keys.hard_state(), hs.write_to_bytes()?);
        }
        self.write(b, self.sync)
    }

    fn set_hard_state(&mut self, hs: &HardState) -> Result<(), Fatal> {
        let mut b = WriteBatch::default();
        b.put_cf(self.cf()?, self.keys.hard_state(), hs.write_to_bytes()?);
        self.write(b, false)
    }

    /// Synced, so the applied state it relies on is durable first (same WAL). Files that hold
    /// only dropped entries go at once (a range delete alone frees nothing until a compaction
    /// reaches them).
    fn compact(&mut self, index: u64, term: u64) -> Result<(), Fatal> {
        let cf = self.cf()?;
        let mut b = WriteBatch::default();
        b.delete_range_cf(cf, self.keys.entry(0), self.keys.entry(index + 1));
        b.put_cf(cf, self.keys.truncated(), truncated_value(index, term));
        self.write(b, true)?;
        self.db
            .delete_file_in_range_cf(cf, self.keys.entry(0), self.keys.entry(index))?;
        Ok(())
    }

    /// A manual compaction of the dropped range: the entries of a small group sit in level-0
    /// files and memtables, which `compact` cannot delete, until enough other writes push a
    /// compaction through them.
    fn reclaim(&mut self, index: u64) {
        reclaim_in_background(Reclaim {
            db: Arc::downgrade(&self.db),
            cf: self.cf,
            start: self.keys.entry(0),
            end: self.keys.entry(index.saturating_add(1)),
        });
    }

    fn reset(
        &mut self,
        index: u64,
        term: u64,
        cs: &ConfState,
        hs: &HardState,
    ) -> Result<(), Fatal> {
        let cf = self.cf()?;
        let mut b = WriteBatch::default();
        self.keys.reset_into(&mut b, cf, index, term, cs, hs)?;
        self.write(b, true)
    }
}

/// One range to compact (`RocksLog::reclaim`).
struct Reclaim {
    /// Weak: a node closing its database is not held open by a pending reclaim.
    db: Weak<DB>,
    cf: &'static str,
    start: Vec<u8>,
    end: Vec<u8>,
}

/// Runs `job` on the process's reclaim thread, one compaction at a time: a manual compaction
/// can outlast an election timeout, and a member's own thread must keep heartbeating.
fn reclaim_in_background(job: Reclaim) {
    static QUEUE: OnceLock<Option<mpsc::Sender<Reclaim>>> = OnceLock::new();
    let queue = QUEUE.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<Reclaim>();
        let spawned = std::thread::Builder::new()
            .name("raft-log-reclaim".into())
            .spawn(move || {
                for job in rx {
                    let Some(db) = job.db.upgrade() else { continue };
                    if let Some(cf) = db.cf_handle(job.cf) {
                        db.compact_range_cf(cf, Some(&job.start[..]), Some(&job.end[..]));
                    }
                }
            });
        match spawned {
            Ok(_) => Some(tx),
            Err(e) => {
                tracing::warn!(error = %e, "no raft log reclaim thread; idle logs keep their disk until RocksDB compacts them");
                None
            }
        }
    });
    if let Some(tx) = queue {
        let _ = tx.send(job);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn open_db(dir: &std::path::Path) -> Arc<DB> {
        let mut o = rocksdb::Options::default();
        o.create_if_missing(true);
        o.create_missing_column_families(true);
        o.set_target_file_size_base(256 << 10);
        let cf = rocksdb::ColumnFamilyDescriptor::new("raft", o.clone());
        Arc::new(DB::open_cf_descriptors(&o, dir, [cf]).unwrap())
    }

    /// An entry of `len` incompressible bytes (xorshift), like vectors.
    fn big(index: u64, len: usize) -> Entry {
        Entry {
            index,
            term: 1,
            data: (0..len)
                .scan(index | 1, |x, _| {
                    *x ^= *x << 13;
                    *x ^= *x >> 7;
                    *x ^= *x << 17;
                    Some(*x as u8)
                })
                .collect(),
            ..Default::default()
        }
    }

    /// A database holding groups `a` and `b`, both initialised.
    fn two_groups(dir: &std::path::Path) -> (Arc<DB>, RocksLog, RocksLog) {
        let db = open_db(dir);
        let a = RocksLog::new(db.clone(), "raft", b"a\0".to_vec(), false);
        let b = RocksLog::new(db.clone(), "raft", b"b\0".to_vec(), false);
        a.init(&ConfState::default()).unwrap();
        b.init(&ConfState::default()).unwrap();
        (db, a, b)
    }

    fn live_sst_bytes(db: &DB) -> u64 {
        let cf = db.cf_handle("raft").unwrap();
        db.property_int_value_cf(cf, "rocksdb.live-sst-files-size")
            .unwrap()
            .unwrap()
    }

    fn entry(index: u64, term: u64) -> Entry {
        Entry {
            index,
            term,
            data: vec![index as u8],
            ..Default::default()
        }
    }

    #[test]
    fn groups_share_a_database_without_seeing_each_other() {
        let dir = tempfile::tempdir().unwrap();
        let db = open_db(dir.path());
        let mut a = RocksLog::new(db.clone(), "raft", b"a\0".to_vec(), false);
        let mut b = RocksLog::new(db, "raft", b"ab\0".to_vec(), false);
        let cs = ConfState {
            voters: vec![1, 2, 3],
            ..Default::default()
        };
        a.init(&cs).unwrap();
        b.init(&ConfState::default()).unwrap();
        a.append(&[entry(1, 1), entry(2, 1), entry(3, 2)], 0, None)
            .unwrap();
        b.append(&[entry(1, 5)], 0, None).unwrap();
        // A conflicting suffix replaces the old one.
        a.append(&[entry(3, 3)], 3, None).unwrap();
        let p = a.load().unwrap();
        assert_eq!((p.last_index, p.cs.voters.clone()), (3, vec![1, 2, 3]));
        assert_eq!(a.term(3).unwrap(), Some(3));
        assert_eq!(b.load().unwrap().last_index, 1);
        a.compact(2, 1).unwrap();
        let p = a.load().unwrap();
        assert_eq!(
            (p.truncated_index, p.truncated_term, p.last_index),
            (2, 1, 3)
        );
        assert_eq!(a.entries(3, 4, None).unwrap()[0].term, 3);
        assert!(a.entries(1, 3, None).is_err(), "compacted entries are gone");
        a.reset(10, 4, &cs, &HardState::default()).unwrap();
        let p = a.load().unwrap();
        assert_eq!((p.truncated_index, p.last_index), (10, 10));
        assert_eq!(b.term(1).unwrap(), Some(5), "the other group is untouched");
    }

    /// Compacting gives the disk of dropped entries back at once where whole files hold
    /// nothing else, and leaves the other groups' entries in place.
    #[test]
    fn compaction_deletes_files_of_dropped_entries() {
        let dir = tempfile::tempdir().unwrap();
        let (db, mut a, mut b) = two_groups(dir.path());
        let big = |index| big(index, 64 << 10);
        let cf = db.cf_handle("raft").unwrap();
        let live = || live_sst_bytes(&db);
        b.append(&[big(1)], 0, None).unwrap();
        let entries: Vec<Entry> = (1..=64).map(big).collect();
        a.append(&entries, 0, None).unwrap();
        // Out of level 0 (whose files are never deleted this way), rewritten into files of
        // 256 KB.
        db.flush_cf(cf).unwrap();
        let mut c = rocksdb::CompactOptions::default();
        c.set_bottommost_level_compaction(rocksdb::BottommostLevelCompaction::Force);
        db.compact_range_cf_opt(cf, None::<&[u8]>, None::<&[u8]>, &c);
        let before = live();
        a.compact(64, 1).unwrap();
        assert!(live() < before / 4, "{} of {before} bytes left", live());
        assert_eq!(b.entries(1, 2, None).unwrap()[0].data.len(), 64 << 10);
        assert_eq!(a.load().unwrap().truncated_index, 64);
    }

    /// Entries still in level 0 (a small group's whole log) stay on disk after `compact`
    /// until `reclaim`'s compaction, which leaves the other groups' entries in place.
    #[test]
    fn reclaim_gives_back_level_zero_entries() {
        let dir = tempfile::tempdir().unwrap();
        let (db, mut a, mut b) = two_groups(dir.path());
        let big = |index| big(index, 32 << 10);
        let cf = db.cf_handle("raft").unwrap();
        let live = || live_sst_bytes(&db);
        let entries: Vec<Entry> = (1..=32).map(big).collect();
        a.append(&entries, 0, None).unwrap();
        b.append(&[big(1)], 0, None).unwrap();
        db.flush_cf(cf).unwrap();
        let before = live();
        a.compact(32, 1).unwrap();
        assert!(live() >= before, "level-0 files are not deleted by compact");
        a.reclaim(32);
        let t = std::time::Instant::now();
        while live() > before / 8 {
            assert!(
                t.elapsed() < std::time::Duration::from_secs(20),
                "{} of {before} bytes left",
                live()
            );
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        assert_eq!(b.entries(1, 2, None).unwrap()[0].data.len(), 32 << 10);
        assert_eq!(a.load().unwrap().truncated_index, 32);
    }
}
