//! Document versions on the target of a re-embedding. Its copy and its mirror write each
//! document with the log index of the source shard the content comes from
//! (`WriteBatchRequest.version`); the target keeps that index per document (`meta` key `v`
//! then the doc id, u64 BE), deletes included, so a copy older than a mirrored write (or a delete)
//! that got there first is skipped instead of bringing back old content. A plain write
//! forgets the record: the document is then the target's own.

use rocksdb::{Direction, IteratorMode, WriteBatch};

use super::{CF_META, ShardKey, Store};
use crate::error::Result;
use ragcluster_proto::v1::WriteBatchRequest;

fn version_key(key: &ShardKey, doc_id: &str) -> Vec<u8> {
    let mut k = key.key(b"v");
    k.extend_from_slice(doc_id.as_bytes());
    k
}

impl Store {
    /// The version recorded for `doc_id` by a versioned write, if any.
    pub fn doc_version(&self, key: &ShardKey, doc_id: &str) -> Result<Option<u64>> {
        let v = self.db.get_cf(self.cf(CF_META), version_key(key, doc_id))?;
        Ok(v.and_then(|v| <[u8; 8]>::try_from(v.as_slice()).ok())
            .map(u64::from_be_bytes))
    }

    /// Whether any document of the shard has a version record.
    pub fn has_versions(&self, key: &ShardKey) -> Result<bool> {
        let start = key.key(b"v");
        let mut it = self.db.iterator_cf(
            self.cf(CF_META),
            IteratorMode::From(&start, Direction::Forward),
        );
        match it.next() {
            Some(item) => Ok(item?.0.starts_with(&start)),
            None => Ok(false),
        }
    }

    /// Adds to `b` the version records `req` leaves: its version for each document it
    /// writes or deletes, or, for a plain batch on a shard that holds versions, none.
    pub(super) fn record_versions(
        &self,
        key: &ShardKey,
        req: &WriteBatchRequest,
        b: &mut WriteBatch,
    ) -> Result<()> {
        let cf = self.cf(CF_META);
        if req.version > 0 {
            for w in &req.writes {
                b.put_cf(cf, version_key(key, &w.doc_id), req.version.to_be_bytes());
            }
        } else if !req.writes.is_empty() && self.has_versions(key)? {
            for w in &req.writes {
                b.delete_cf(cf, version_key(key, &w.doc_id));
            }
        }
        Ok(())
    }
}
