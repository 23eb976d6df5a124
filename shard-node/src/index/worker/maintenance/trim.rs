//! Op-log trims: the entries no restart needs any more leave RocksDB.

use super::super::{Worker, crash_point};

impl Worker {
    /// Drops the op-log entries no restart needs, BM25 having committed through the visible
    /// seq. Entries after the HNSW dump stay: a restart catches the dump up from them. So do
    /// the entries after the last one whose points are all in the graph: a leader's dump is
    /// caught up from them. A failure is logged and the trim tried again later; the op log
    /// only stays longer meanwhile.
    pub(in super::super) fn trim_oplog(&mut self) {
        let committed = *self.visible.borrow();
        let keep_after = self
            .state
            .dumped
            .map_or(committed, |d| d.min(committed))
            .min(self.indexes.hnsw.graph_through(committed));
        if keep_after <= self.trimmed {
            return;
        }
        crash_point!("index_trim_oplog");
        match self.store.truncate_oplog(&self.key, keep_after) {
            Ok(()) => self.trimmed = keep_after,
            Err(e) => {
                tracing::warn!(shard = %self.key, error = %e, keep_after, "op log not trimmed")
            }
        }
    }
}
