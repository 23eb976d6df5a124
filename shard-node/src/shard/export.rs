//! Backups (`Shard.Export`): the shard's documents as of one moment, read from one RocksDB
//! snapshot while writes go on. The snapshot pins the versions it reads until the export
//! ends, as a Raft snapshot being sent does; the stream is cut into messages of about
//! `max_bytes` so that neither side holds more than a few of them.

use prost::Message;
use ragcluster_proto::v1::ExportPart;

use super::Shard;
use crate::error::Result;

/// Default and largest size of one message's documents.
pub const DEFAULT_PART_BYTES: usize = 1 << 20;
pub const MAX_PART_BYTES: usize = 16 << 20;

impl Shard {
    /// Sends every document as of now to `send` in parts of about `max_bytes` (the last one
    /// marked done), stopping early when `send` answers false (the caller went away). Returns
    /// the applied seq the parts hold.
    pub fn export(
        &self,
        max_bytes: usize,
        mut send: impl FnMut(ExportPart) -> bool,
    ) -> Result<u64> {
        let snap = self.store.read_snapshot();
        let seq = snap.applied_seq(&self.key)?;
        let empty = || ExportPart {
            seq,
            ..Default::default()
        };
        let (mut part, mut bytes, mut open) = (empty(), 0, true);
        snap.for_each_document(&self.key, |d| {
            let size = d.encoded_len();
            if !part.documents.is_empty() && bytes + size > max_bytes {
                open = send(std::mem::replace(&mut part, empty()));
                bytes = 0;
            }
            bytes += size;
            part.documents.push(d);
            Ok(open)
        })?;
        if open {
            part.done = true;
            send(part);
        }
        metrics::counter!("shard_exports_total").increment(1);
        Ok(seq)
    }
}
