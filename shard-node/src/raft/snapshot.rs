//! Snapshot files. The leader writes the shard's state-machine records
//! (`StoreSnapshot::write_records`) and its newest HNSW dump into `gen-*.snap` at the applied
//! index; the Raft snapshot message carries only a descriptor
//! (file size and CRC32) so that the bytes travel on their own flow-controlled stream. The
//! receiver writes `recv-*.tmp`, checks size and CRC32, and renames it to `recv-*.snap` before
//! Raft sees the message; a corrupted or truncated stream is rejected and Raft retries.

use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use crate::error::{Result, ShardError};
use crate::index::hnsw::dump::Dumps;
use crate::storage::{SECTION_END, ShardKey, Store};

/// What the Raft snapshot's `data` holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Descriptor {
    pub size: u64,
    pub crc32: u32,
}

impl Descriptor {
    pub fn encode(&self) -> Vec<u8> {
        let mut v = b"RCS1".to_vec();
        v.extend(self.size.to_be_bytes());
        v.extend(self.crc32.to_be_bytes());
        v
    }

    pub fn decode(b: &[u8]) -> Result<Self> {
        if b.len() != 16 || &b[..4] != b"RCS1" {
            return Err(ShardError::Corrupt("snapshot descriptor".into()));
        }
        Ok(Self {
            size: u64::from_be_bytes(b[4..12].try_into().unwrap_or_default()),
            crc32: u32::from_be_bytes(b[12..16].try_into().unwrap_or_default()),
        })
    }
}

fn name(kind: &str, key: &ShardKey, index: u64, term: u64, ext: &str) -> String {
    format!(
        "{kind}-{}-{}-{index}-{term}.{ext}",
        key.collection, key.shard
    )
}

pub fn generated_path(dir: &Path, key: &ShardKey, index: u64, term: u64) -> PathBuf {
    dir.join(name("gen", key, index, term, "snap"))
}

pub fn received_path(dir: &Path, key: &ShardKey, index: u64, term: u64) -> PathBuf {
    dir.join(name("recv", key, index, term, "snap"))
}

pub fn temp_path(dir: &Path, key: &ShardKey, index: u64, term: u64) -> PathBuf {
    dir.join(name("recv", key, index, term, "tmp"))
}

/// Removes this shard's files of `kind` other than `keep`.
pub fn remove_others(dir: &Path, kind: &str, key: &ShardKey, keep: Option<&Path>) {
    let prefix = format!("{kind}-{}-{}-", key.collection, key.shard);
    let Ok(rd) = std::fs::read_dir(dir) else {
        return;
    };
    for e in rd.flatten() {
        let p = e.path();
        let is_ours = e.file_name().to_string_lossy().starts_with(&prefix);
        if is_ours && Some(p.as_path()) != keep {
            let _ = std::fs::remove_file(&p);
        }
    }
}

/// A writer that counts bytes and computes the CRC32 of what passes through.
pub struct Checked<W> {
    inner: W,
    hasher: crc32fast::Hasher,
    size: u64,
}

impl<W: Write> Checked<W> {
    pub fn new(inner: W) -> Self {
        Self {
            inner,
            hasher: crc32fast::Hasher::new(),
            size: 0,
        }
    }

    pub fn finish(mut self) -> Result<(W, Descriptor)> {
        self.inner.flush()?;
        Ok((
            self.inner,
            Descriptor {
                size: self.size,
                crc32: self.hasher.finalize(),
            },
        ))
    }
}

impl<W: Write> Write for Checked<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hasher.update(&buf[..n]);
        self.size += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// What `generate` wrote.
pub struct Generated {
    pub desc: Descriptor,
    pub records: u64,
    /// The shipped HNSW dump: its seq and bytes.
    pub dump: Option<(u64, u64)>,
}

/// Writes the shard's state at `index` (its applied index) into `path` (through a temp file,
/// fsync'd): its records and, when the replica has an HNSW dump the op log reaches back to,
/// that dump and the op-log entries after it, so the receiver loads the graph instead of
/// rebuilding it (minutes at 100k points).
pub fn generate(
    store: &Store,
    dumps: &Dumps,
    key: &ShardKey,
    index: u64,
    path: &Path,
) -> Result<Generated> {
    // The dump and the store view are fixed together: under the dumps lock the index worker
    // can neither replace the dump nor trim the op log past it.
    let (linked, view) = {
        let held = dumps.lock();
        (dumps.link_newest(&held, index), store.read_snapshot())
    };
    let linked = match linked {
        Some(l) => {
            let span = view.oplog_span(key, l.seq)?;
            let gap = l.seq < index && span != Some((l.seq + 1, index, index - l.seq));
            if gap {
                tracing::warn!(shard = %key, dump = l.seq, index, ?span,
                    "the op log does not reach from the hnsw dump to the snapshot; the \
                     receiver rebuilds the graph");
            }
            (!gap).then_some(l)
        }
        None => None,
    };
    let tmp = path.with_extension("tmp");
    let file = std::fs::File::create(&tmp)?;
    let mut w = Checked::new(BufWriter::with_capacity(1 << 20, file));
    let records = view.write_records(key, linked.as_ref().map(|l| l.seq), &mut w)?;
    let dump = match &linked {
        Some(l) => {
            w.write_all(&[SECTION_END])?;
            Some((l.seq, l.write_to(&mut w)?))
        }
        None => None,
    };
    let (buf, desc) = w.finish()?;
    let file = buf
        .into_inner()
        .map_err(|e| ShardError::Io(e.into_error()))?;
    file.sync_all()?;
    std::fs::rename(&tmp, path)?;
    Ok(Generated {
        desc,
        records,
        dump,
    })
}

/// Checks a file against its descriptor.
pub fn verify(path: &Path, desc: &Descriptor) -> Result<()> {
    let (size, crc32) = crate::checksum::file_crc32(path)?;
    let got = Descriptor { size, crc32 };
    if got != *desc {
        return Err(ShardError::Corrupt(format!(
            "snapshot {}: {} bytes crc {:08x}, expected {} bytes crc {:08x}",
            path.display(),
            got.size,
            got.crc32,
            desc.size,
            desc.crc32
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use ragcluster_raft::StateMachine;
    use ragcluster_raft::eraftpb::{ConfState, HardState, SnapshotMetadata};

    use super::*;
    use crate::index::hnsw;
    use crate::shard::HitForm;
    use crate::shard::Shard;
    use crate::testutil::*;

    /// A leader with a dump at seq 1 and three entries after it (a replaced, a deleted and a
    /// new document).
    fn leader(dir: &Path, key: &ShardKey) -> Shard {
        let store = Arc::new(Store::open(&dir.join("db"), false).unwrap());
        let mut o = opts(1000);
        o.dumping.min_changes = 100;
        let shard = open_with(dir, key.clone(), store, &o);
        let docs = (0..200)
            .map(|i| doc(&format!("d{i}"), "raftdoc words", i as f32))
            .collect();
        apply(&shard, batch(docs)).unwrap();
        apply(&shard, batch(vec![doc("d0", "replaced", 1000.0)])).unwrap();
        let gone = deleted("d1");
        apply(&shard, batch(vec![gone])).unwrap();
        apply(&shard, batch(vec![doc("n0", "newcomer", 2000.0)])).unwrap();
        shard
    }

    /// Installs the leader's snapshot into an empty replica through the state machine, as
    /// Raft does once the file arrived.
    fn install(leader: &Shard, dir: &Path, key: &ShardKey) -> (Shard, Generated) {
        let index = leader.applied_seq();
        let gen_path = generated_path(dir, key, index, 1);
        let g = generate(leader.store(), &leader.dumps, key, index, &gen_path).unwrap();
        let store = Arc::new(Store::open(&dir.join("db"), false).unwrap());
        let replica = open(dir, key.clone(), store, 1000);
        std::fs::rename(&gen_path, received_path(dir, key, index, 1)).unwrap();
        let mut meta = SnapshotMetadata {
            index,
            term: 1,
            ..Default::default()
        };
        meta.set_conf_state(ConfState {
            voters: vec![1],
            ..Default::default()
        });
        let hs = HardState {
            term: 1,
            commit: index,
            ..Default::default()
        };
        replica.restore(&meta, &g.desc.encode(), &hs).unwrap();
        settle(&replica);
        (replica, g)
    }

    fn answers(shard: &Shard) {
        assert_eq!(top(shard, 1000.0), "d0#0");
        assert_eq!(top(shard, 2000.0), "n0#0");
        assert_ne!(top(shard, 1.0), "d1#0");
        assert_eq!(top(shard, 7.0), "d7#0");
        let hits = shard
            .bm25_search(
                "newcomer",
                5,
                &crate::index::Filter::default(),
                None,
                HitForm::Id,
            )
            .unwrap();
        assert_eq!(hits.len(), 1);
        let f = shard.figures();
        assert_eq!((f.documents, f.chunks), (200, 200));
    }

    /// The receiver loads the graph the leader dumped and catches it up from the op-log entries
    /// the snapshot carried: the caught-up documents leave tombstones, which a rebuild never
    /// does, and every answer matches the leader's.
    #[test]
    fn snapshot_ships_the_hnsw_dump_and_the_receiver_catches_it_up() {
        let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let key = ShardKey::new("c", 0);
        let leader = leader(a.path(), &key);
        answers(&leader);
        let (replica, g) = install(&leader, b.path(), &key);
        assert_eq!(g.dump.map(|d| d.0), Some(1), "the dump at seq 1 travelled");
        let f = replica.figures();
        assert_eq!((f.hnsw_points, f.hnsw_tombstones), (200, 2));
        answers(&replica);
        let left: Vec<_> = std::fs::read_dir(b.path().join("hnsw"))
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        assert!(
            left.iter().all(|n| n.starts_with("dump-")) && left.len() == 1,
            "one dump and nothing received left over: {left:?}"
        );
        let shipped = std::fs::read_dir(a.path().join("hnsw")).unwrap().count();
        assert_eq!(shipped, 1, "the leader's links for shipping are gone");
    }

    /// A graph far ahead of its last dump (here: never dumped) makes the snapshot wait while
    /// the index worker dumps it, then ship that dump, which needs no catch-up.
    #[test]
    fn a_snapshot_waits_for_a_fresh_dump_when_the_last_is_far_behind() {
        let a = tempfile::tempdir().unwrap();
        let key = ShardKey::new("c", 0);
        let store = Arc::new(Store::open(&a.path().join("db"), false).unwrap());
        let mut o = opts(1000);
        o.dumping.min_changes = 1_000_000;
        let shard = open_with(a.path(), key.clone(), store, &o);
        let docs = (0..1200)
            .map(|i| doc(&format!("d{i}"), "w", i as f32))
            .collect();
        apply(&shard, batch(docs)).unwrap();
        let index = shard.applied_seq();
        assert_eq!(shard.dumps.newest(), None);
        assert!(
            shard.wants_fresh_dump(index),
            "1,200 points were never dumped"
        );
        let until = std::time::Instant::now() + std::time::Duration::from_secs(20);
        while shard.wants_fresh_dump(index) {
            assert!(std::time::Instant::now() < until, "no fresh dump");
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        assert_eq!(shard.dumps.newest(), Some(index));
        let g = generate(
            shard.store(),
            &shard.dumps,
            &key,
            index,
            &a.path().join("s"),
        )
        .unwrap();
        assert_eq!(g.dump.map(|d| d.0), Some(index));
        assert!(!shard.wants_fresh_dump(index), "nothing changed since");
    }

    /// A dump damaged on the leader travels with a checksum that no longer holds: the receiver
    /// refuses it and rebuilds the graph (no tombstones), with the same answers.
    #[test]
    fn a_damaged_shipped_dump_is_refused_and_the_graph_rebuilt() {
        let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let key = ShardKey::new("c", 0);
        let leader = leader(a.path(), &key);
        let graph = a
            .path()
            .join(format!("hnsw/dump-1/{}.hnsw.graph", hnsw::GRAPH_BASENAME));
        let mut bytes = std::fs::read(&graph).unwrap();
        let mid = bytes.len() / 2;
        bytes[mid] ^= 0xff;
        std::fs::write(&graph, bytes).unwrap();
        let (replica, g) = install(&leader, b.path(), &key);
        assert!(g.dump.is_some());
        let f = replica.figures();
        assert_eq!((f.hnsw_points, f.hnsw_tombstones), (200, 0));
        answers(&replica);
    }
}
