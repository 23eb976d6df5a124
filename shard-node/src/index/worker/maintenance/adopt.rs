//! A follower adopts its leader's dump: the leader ships the graph it built, so a shard's
//! graph is built once, not once per replica (`holding`, `raft::graph_follow`).

use std::sync::atomic::Ordering;
use std::time::Instant;

use super::super::{Worker, crash_point};
use crate::index::recovery;
use crate::storage::ShardMeta;

impl Worker {
    /// Loads the leader's dump of `seq` (received beside this replica's dumps) caught up to
    /// the applied seq from the op log, replacing the graph and the pending points it covers.
    /// A dump that cannot be caught up is removed and the graph kept.
    pub(super) fn adopt(&mut self, seq: u64) {
        let t = Instant::now();
        let newer = self.state.dumped.is_none_or(|d| d < seq);
        if !self.defers() || !newer || seq > self.at || !self.dumps.promote_received(seq) {
            self.dumps.discard_received(seq);
            metrics::counter!("shard_hnsw_graph_adoptions_total", "outcome" => "skipped")
                .increment(1);
            return;
        }
        crash_point!("index_adopt_promoted");
        let hnsw = &self.indexes.hnsw;
        let meta = ShardMeta {
            dimension: hnsw.dim() as u32,
            hnsw: hnsw.params(),
        };
        let pending_before = hnsw.pending_len();
        match recovery::caught_up_dump(&self.key, &meta, &self.store, &self.dumps, self.at) {
            Ok(Some((graph, state))) if state.dumped == Some(seq) => {
                {
                    let _g = self.indexes.update.lock();
                    hnsw.replace(graph);
                }
                self.dumps.remove_except(Some(seq));
                self.shared.dumped.store(seq, Ordering::Release);
                self.state = state;
                self.shared
                    .undumped
                    .store(self.state.changes, Ordering::Release);
                metrics::counter!("shard_hnsw_graph_adoptions_total", "outcome" => "adopted")
                    .increment(1);
                tracing::info!(shard = %self.key, dump = seq, applied = self.at,
                    points = hnsw.counts().0, pending_before, pending = hnsw.pending_len(),
                    ms = t.elapsed().as_millis() as u64, "leader's hnsw graph adopted");
            }
            other => {
                if let Err(e) = &other {
                    tracing::warn!(shard = %self.key, dump = seq, error = %e,
                        "leader's hnsw dump not adopted");
                }
                self.dumps.remove(seq);
                metrics::counter!("shard_hnsw_graph_adoptions_total", "outcome" => "refused")
                    .increment(1);
            }
        }
    }
}
