//! raft-rs `Storage` of the catalog group: the log lives in a `MemStorage` mirror of the
//! durable `CatalogStore`; snapshots are the applied catalog itself (a few KB), built on demand.

use std::sync::Arc;

use parking_lot::RwLock;
use prost::Message as _;
use raft::eraftpb::{ConfState, Entry, Snapshot};
use raft::storage::MemStorage;
use raft::{GetEntriesContext, RaftState, Storage, StorageError};

use super::View;

pub struct CatalogLog {
    pub mem: MemStorage,
    pub view: Arc<RwLock<View>>,
    /// Coordinator membership is static (from config), so the conf state never changes.
    pub conf: ConfState,
}

impl Storage for CatalogLog {
    fn initial_state(&self) -> raft::Result<RaftState> {
        self.mem.initial_state()
    }

    fn entries(
        &self,
        low: u64,
        high: u64,
        max_size: impl Into<Option<u64>>,
        context: GetEntriesContext,
    ) -> raft::Result<Vec<Entry>> {
        self.mem.entries(low, high, max_size, context)
    }

    fn term(&self, idx: u64) -> raft::Result<u64> {
        self.mem.term(idx)
    }

    fn first_index(&self) -> raft::Result<u64> {
        self.mem.first_index()
    }

    fn last_index(&self) -> raft::Result<u64> {
        self.mem.last_index()
    }

    /// The catalog as of the applied index. raft-rs only asks when a follower needs entries
    /// that were compacted, and those are all applied here.
    fn snapshot(&self, request_index: u64, _to: u64) -> raft::Result<Snapshot> {
        let v = self.view.read();
        if v.applied_index == 0 || v.applied_index < request_index {
            return Err(raft::Error::Store(
                StorageError::SnapshotTemporarilyUnavailable,
            ));
        }
        let mut s = Snapshot {
            data: v.state().encode_to_vec(),
            ..Default::default()
        };
        let m = s.mut_metadata();
        m.index = v.applied_index;
        m.term = v.applied_term;
        m.set_conf_state(self.conf.clone());
        Ok(s)
    }
}
