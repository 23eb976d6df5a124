//! A shard replica as the state machine of its Raft group.

use prost::Message as _;
use ragcluster_proto::v1::{RaftCommand, WriteBatchResponse};
use ragcluster_raft::eraftpb::{ConfState, HardState, SnapshotMetadata};
use ragcluster_raft::{Fatal, SnapshotError, StateMachine};

use super::snapshot;
use crate::error::ShardError;
use crate::shard::Shard;

/// What a proposer of a batch learns: the outcome, or why the batch was refused at apply.
pub type ShardResponse = Result<WriteBatchResponse, ShardError>;

fn fatal(shard: &Shard, e: ShardError) -> Fatal {
    Fatal(format!("shard {}: {e}", shard.key))
}

impl StateMachine for Shard {
    type Response = ShardResponse;

    fn applied_index(&self) -> u64 {
        self.applied_seq()
    }

    fn visible_index(&self) -> u64 {
        self.visible_seq()
    }

    fn apply(&self, index: u64, _term: u64, data: &[u8]) -> Result<ShardResponse, Fatal> {
        let cmd = RaftCommand::decode(data)
            .map_err(|e| Fatal(format!("shard {}: entry {index}: {e}", self.key)))?;
        self.apply_entry(index, cmd.batch.unwrap_or_default(), cmd.proposed_at_ms)
            .map_err(|e| fatal(self, e))
    }

    fn apply_empty(&self, index: u64, _term: u64, conf: Option<&ConfState>) -> Result<(), Fatal> {
        self.apply_noop(index, conf).map_err(|e| fatal(self, e))
    }

    /// Dumps the shard into a file; the snapshot message carries only its descriptor, and the
    /// transport streams the file. Waits first for a fresh HNSW dump when the last one is far
    /// behind (`Shard::wants_fresh_dump`).
    fn snapshot(&self, index: u64, term: u64, to: u64) -> Result<Vec<u8>, SnapshotError> {
        if self.wants_fresh_dump(index) {
            return Err(SnapshotError::NotYet);
        }
        let path = snapshot::generated_path(&self.snap_dir, &self.key, index, term);
        let started = std::time::Instant::now();
        let g = snapshot::generate(self.store(), &self.dumps, &self.key, index, &path).map_err(
            |e| match e {
                // A full disk or another I/O failure writing the file: raft-rs asks again
                // later (any other answer stops the member).
                ShardError::Io(_) | ShardError::Storage(_) => {
                    let _ = std::fs::remove_file(&path);
                    tracing::warn!(shard = %self.key, index, error = %e,
                        "snapshot not generated; raft asks again later");
                    SnapshotError::NotYet
                }
                e => SnapshotError::Fatal(fatal(self, e)),
            },
        )?;
        snapshot::remove_others(&self.snap_dir, "gen", &self.key, Some(&path));
        let (dump_seq, dump_bytes) = g.dump.unzip();
        tracing::info!(shard = %self.key, index, term, to, records = g.records,
            bytes = g.desc.size, ?dump_seq, ?dump_bytes,
            ms = started.elapsed().as_millis() as u64, "snapshot generated");
        Ok(g.desc.encode())
    }

    /// Installs the snapshot file the transport received and checked before Raft saw it.
    fn restore(&self, meta: &SnapshotMetadata, data: &[u8], hs: &HardState) -> Result<(), Fatal> {
        let path = snapshot::received_path(&self.snap_dir, &self.key, meta.index, meta.term);
        let desc = snapshot::Descriptor::decode(data).map_err(|e| fatal(self, e))?;
        snapshot::verify(&path, &desc).map_err(|e| fatal(self, e))?;
        self.install_snapshot(&path, meta, hs)
            .map_err(|e| fatal(self, e))?;
        let _ = std::fs::remove_file(&path);
        metrics::counter!("raft_snapshots_installed_total").increment(1);
        Ok(())
    }
}
