//! raft-rs `Storage` over the node's RocksDB (`Store::raft_*`). The in-memory fields mirror
//! what is persisted; the group thread updates both in one place after each write.

use std::path::PathBuf;
use std::sync::Arc;

use raft::eraftpb::{ConfState, Entry, HardState, Snapshot};
use raft::{GetEntriesContext, RaftState, StorageError};

use super::snapshot;
use crate::error::ShardError;
use crate::shard::Shard;
use crate::storage::{RaftPersisted, ShardKey, Store};

pub struct GroupLog {
    pub key: ShardKey,
    store: Arc<Store>,
    shard: Arc<Shard>,
    snap_dir: PathBuf,
    pub hs: HardState,
    /// Conf state as of the applied index.
    pub cs: ConfState,
    pub truncated_index: u64,
    pub truncated_term: u64,
    pub last_index: u64,
}

fn other(e: ShardError) -> raft::Error {
    raft::Error::Store(StorageError::Other(Box::new(e)))
}

impl GroupLog {
    pub fn new(
        key: ShardKey,
        store: Arc<Store>,
        shard: Arc<Shard>,
        snap_dir: PathBuf,
        p: RaftPersisted,
    ) -> Self {
        let mut hs = p.hs;
        // Entries are applied before the hard state that committed them is written (raft-rs'
        // Ready order); whatever was applied was committed.
        hs.commit = hs.commit.max(shard.applied_seq()).min(p.last_index);
        Self {
            key,
            store,
            shard,
            snap_dir,
            hs,
            cs: p.cs,
            truncated_index: p.truncated_index,
            truncated_term: p.truncated_term,
            last_index: p.last_index,
        }
    }

    /// Persists new entries and/or a new hard state (one write, synced per config).
    pub fn append(&mut self, entries: &[Entry], hs: Option<&HardState>) -> Result<(), ShardError> {
        self.store
            .raft_append(&self.key, entries, self.last_index, hs)?;
        if let Some(last) = entries.last() {
            self.last_index = last.index;
        }
        if let Some(hs) = hs {
            self.hs = hs.clone();
        }
        Ok(())
    }

    pub fn set_commit(&mut self, commit: u64) -> Result<(), ShardError> {
        self.hs.commit = commit;
        self.store.raft_put_hard_state(&self.key, &self.hs)
    }

    /// Drops entries up to `index` (applied) from the log.
    pub fn compact(&mut self, index: u64) -> Result<(), ShardError> {
        if index <= self.truncated_index {
            return Ok(());
        }
        let term =
            raft::Storage::term(self, index).map_err(|e| ShardError::Corrupt(e.to_string()))?;
        self.store.raft_compact(&self.key, index, term)?;
        self.truncated_index = index;
        self.truncated_term = term;
        Ok(())
    }

    /// After a snapshot was installed: the log restarts at its index.
    pub fn snapshot_installed(&mut self, index: u64, term: u64, cs: ConfState, hs: HardState) {
        self.truncated_index = index;
        self.truncated_term = term;
        self.last_index = index;
        self.cs = cs;
        self.hs = hs;
    }
}

impl raft::Storage for GroupLog {
    fn initial_state(&self) -> raft::Result<RaftState> {
        Ok(RaftState::new(self.hs.clone(), self.cs.clone()))
    }

    fn entries(
        &self,
        low: u64,
        high: u64,
        max_size: impl Into<Option<u64>>,
        _context: GetEntriesContext,
    ) -> raft::Result<Vec<Entry>> {
        if low <= self.truncated_index {
            return Err(raft::Error::Store(StorageError::Compacted));
        }
        if high > self.last_index + 1 {
            return Err(raft::Error::Store(StorageError::Unavailable));
        }
        self.store
            .raft_entries(&self.key, low, high, max_size.into())
            .map_err(other)
    }

    fn term(&self, idx: u64) -> raft::Result<u64> {
        if idx == self.truncated_index {
            return Ok(self.truncated_term);
        }
        if idx < self.truncated_index {
            return Err(raft::Error::Store(StorageError::Compacted));
        }
        if idx > self.last_index {
            return Err(raft::Error::Store(StorageError::Unavailable));
        }
        match self.store.raft_term(&self.key, idx).map_err(other)? {
            Some(t) => Ok(t),
            None => Err(raft::Error::Store(StorageError::Unavailable)),
        }
    }

    fn first_index(&self) -> raft::Result<u64> {
        Ok(self.truncated_index + 1)
    }

    fn last_index(&self) -> raft::Result<u64> {
        Ok(self.last_index)
    }

    /// Cuts a snapshot at the applied index. Called on the group thread, which is also the
    /// only one applying entries, so the dump is consistent with (index, term, conf state).
    fn snapshot(&self, request_index: u64, to: u64) -> raft::Result<Snapshot> {
        let index = self.shard.applied_seq();
        if index < request_index {
            return Err(raft::Error::Store(
                StorageError::SnapshotTemporarilyUnavailable,
            ));
        }
        let term = self.term(index)?;
        let path = snapshot::generated_path(&self.snap_dir, &self.key, index, term);
        let started = std::time::Instant::now();
        let (desc, records) = snapshot::generate(&self.store, &self.key, &path).map_err(other)?;
        snapshot::remove_others(&self.snap_dir, "gen", &self.key, Some(&path));
        tracing::info!(shard = %self.key, index, term, to, records, bytes = desc.size,
            ms = started.elapsed().as_millis() as u64, "snapshot generated");
        let mut s = Snapshot {
            data: desc.encode(),
            ..Default::default()
        };
        let m = s.mut_metadata();
        m.index = index;
        m.term = term;
        m.set_conf_state(self.cs.clone());
        Ok(s)
    }
}
