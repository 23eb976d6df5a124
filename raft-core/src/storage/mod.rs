//! Durable Raft log storage. `LogStore` is what an application persists (RocksDB in
//! production: `rocks::RocksLog`; memory for tests and the simulation: `mem::MemLog`);
//! `RaftLog` puts raft-rs' `Storage` on top of it, with an in-memory mirror of the hard state,
//! conf state and log bounds that the member's thread updates right after each write.

pub mod mem;
pub mod rocks;

use std::sync::Arc;

use raft::eraftpb::{ConfState, Entry, HardState, Snapshot};
use raft::{GetEntriesContext, RaftState, StorageError};

use crate::error::Fatal;
use crate::machine::{SnapshotError, StateMachine};

/// What a log store holds at start.
#[derive(Debug, Clone, Default)]
pub struct Persisted {
    pub hs: HardState,
    pub cs: ConfState,
    /// Entries up to here were compacted into the state machine.
    pub truncated_index: u64,
    pub truncated_term: u64,
    pub last_index: u64,
}

/// One group's log, hard state and conf state.
pub trait LogStore: Send + 'static {
    fn load(&self) -> Result<Persisted, Fatal>;

    /// Entries in `[lo, hi)`, stopping once `max_size` bytes are exceeded (at least one).
    fn entries(&self, lo: u64, hi: u64, max_size: Option<u64>) -> Result<Vec<Entry>, Fatal>;

    fn term(&self, index: u64) -> Result<Option<u64>, Fatal>;

    /// Appends `entries`, dropping older entries from the first new index up to `old_last`,
    /// together with `hs`, in one durable write.
    fn append(
        &mut self,
        entries: &[Entry],
        old_last: u64,
        hs: Option<&HardState>,
    ) -> Result<(), Fatal>;

    /// A hard state whose only change is the commit index: need not be synced (raft-rs
    /// recovers commit from its peers).
    fn set_hard_state(&mut self, hs: &HardState) -> Result<(), Fatal>;

    /// Drops entries up to and including `index` (applied), remembering its `term`.
    fn compact(&mut self, index: u64, term: u64) -> Result<(), Fatal>;

    /// Gives back now, in the background, the disk still held by entries up to `index`
    /// (compacted already), where dropping them alone frees it only later: called once a
    /// group's log has gone idle.
    fn reclaim(&mut self, _index: u64) {}

    /// After the state machine restored a snapshot: the log restarts at (`index`, `term`).
    /// Stores that share the state machine's database were reset by `restore` already; this
    /// must then be idempotent.
    fn reset(&mut self, index: u64, term: u64, cs: &ConfState, hs: &HardState)
    -> Result<(), Fatal>;
}

/// raft-rs `Storage` over a `LogStore`, cutting snapshots from the state machine.
pub struct RaftLog<L, M> {
    pub(crate) store: L,
    pub(crate) sm: Arc<M>,
    pub hs: HardState,
    /// Conf state as of the applied index.
    pub cs: ConfState,
    pub truncated_index: u64,
    pub truncated_term: u64,
    pub last_index: u64,
    /// About how many bytes the entries after the truncation point hold (counted since
    /// this process opened the log; older entries are not counted).
    entry_bytes: u64,
}

fn store_err(e: Fatal) -> raft::Error {
    raft::Error::Store(StorageError::Other(Box::new(e)))
}

impl<L: LogStore, M: StateMachine> RaftLog<L, M> {
    pub fn open(store: L, sm: Arc<M>) -> Result<Self, Fatal> {
        let p = store.load()?;
        let mut hs = p.hs;
        // Entries are applied before the hard state that committed them is written (raft-rs'
        // ready order): whatever was applied was committed.
        hs.commit = hs.commit.max(sm.applied_index()).min(p.last_index);
        Ok(Self {
            store,
            sm,
            hs,
            cs: p.cs,
            truncated_index: p.truncated_index,
            truncated_term: p.truncated_term,
            last_index: p.last_index,
            entry_bytes: 0,
        })
    }

    pub fn append(&mut self, entries: &[Entry], hs: Option<&HardState>) -> Result<(), Fatal> {
        self.store.append(entries, self.last_index, hs)?;
        self.entry_bytes += entries
            .iter()
            .map(|e| (e.data.len() + e.context.len()) as u64)
            .sum::<u64>();
        if let Some(last) = entries.last() {
            self.last_index = last.index;
        }
        if let Some(hs) = hs {
            self.hs = hs.clone();
        }
        Ok(())
    }

    pub fn set_commit(&mut self, commit: u64) -> Result<(), Fatal> {
        self.hs.commit = commit;
        self.store.set_hard_state(&self.hs)
    }

    /// Drops entries up to `index` (applied) from the log.
    pub fn compact(&mut self, index: u64) -> Result<(), Fatal> {
        if index <= self.truncated_index {
            return Ok(());
        }
        let term = raft::Storage::term(self, index).map_err(Fatal::from)?;
        self.store.compact(index, term)?;
        // Entries are taken to be alike in size: the share that stays keeps its share.
        let (kept, all) = (
            self.last_index.saturating_sub(index),
            self.entry_count().max(1),
        );
        self.entry_bytes =
            (u128::from(self.entry_bytes) * u128::from(kept.min(all)) / u128::from(all)) as u64;
        self.truncated_index = index;
        self.truncated_term = term;
        Ok(())
    }

    /// See `LogStore::reclaim`.
    pub fn reclaim(&mut self, index: u64) {
        self.store.reclaim(index.min(self.truncated_index));
    }

    pub fn reset(
        &mut self,
        index: u64,
        term: u64,
        cs: ConfState,
        hs: HardState,
    ) -> Result<(), Fatal> {
        self.store.reset(index, term, &cs, &hs)?;
        self.entry_bytes = 0;
        self.truncated_index = index;
        self.truncated_term = term;
        self.last_index = index;
        self.cs = cs;
        self.hs = hs;
        Ok(())
    }

    pub fn entry_count(&self) -> u64 {
        self.last_index.saturating_sub(self.truncated_index)
    }

    pub fn entry_bytes(&self) -> u64 {
        self.entry_bytes
    }
}

impl<L: LogStore, M: StateMachine> raft::Storage for RaftLog<L, M> {
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
            .entries(low, high, max_size.into())
            .map_err(store_err)
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
        match self.store.term(idx).map_err(store_err)? {
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

    /// A snapshot at the applied index. raft-rs calls this on the member's thread, the only
    /// one applying entries, so the data matches (index, term, conf state).
    fn snapshot(&self, request_index: u64, to: u64) -> raft::Result<Snapshot> {
        let index = self.sm.applied_index();
        if index < request_index || index == 0 {
            return Err(raft::Error::Store(
                StorageError::SnapshotTemporarilyUnavailable,
            ));
        }
        let term = self.term(index)?;
        let data = match self.sm.snapshot(index, term, to) {
            Ok(d) => d,
            Err(SnapshotError::NotYet) => {
                return Err(raft::Error::Store(
                    StorageError::SnapshotTemporarilyUnavailable,
                ));
            }
            Err(SnapshotError::Fatal(e)) => return Err(store_err(e)),
        };
        let mut s = Snapshot {
            data,
            ..Default::default()
        };
        let m = s.mut_metadata();
        m.index = index;
        m.term = term;
        m.set_conf_state(self.cs.clone());
        Ok(s)
    }
}
