//! Vectors an upsert need not compute again: a document upserted again (a nightly sync, a
//! fixed typo in one paragraph, changed metadata sent as a whole document) keeps the stored
//! vector of every chunk whose embedded text (title, section and text, as labelled) is
//! unchanged and was embedded by the same model revision (`Chunk.embedding_revision`); only
//! new or changed chunks go to the model worker. Unlike the coordinator's embedding cache
//! this holds across coordinator restarts and for any corpus size, because the vectors come
//! from the shards.
//!
//! The stored chunks are read at eventual consistency: a stale replica can only miss a chunk
//! (which is then embedded), never give a wrong vector, since a vector is reused only for the
//! exact text and revision it was computed from. A failed read costs the reuse, not the
//! upsert.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use ragcluster_proto::v1::{CollectionInfo, Consistency};

use super::{Chunked, Ingestor, embedding_text};
use crate::placement;
use crate::read_token::NO_TOKEN;
use crate::shards::ReadPlan;

/// The most time the read of stored chunks may take out of an upsert's deadline.
const READ_BUDGET: Duration = Duration::from_secs(2);

impl Ingestor {
    /// Stored vectors of `docs`' documents by embedded text, for chunks embedded by
    /// `revision` (empty when none are stored, or the read failed).
    pub(super) async fn stored_vectors(
        &self,
        info: &CollectionInfo,
        docs: &[Chunked],
        revision: &str,
        label: bool,
        timeout: Duration,
    ) -> HashMap<String, Vec<f32>> {
        let ids: Vec<String> = docs
            .iter()
            .filter(|d| d.doc.embedding.is_empty())
            .map(|d| d.doc.id.clone())
            .collect();
        self.stored_vectors_of(info, &ids, revision, label, timeout)
            .await
    }

    /// As `stored_vectors`, for documents by id.
    pub(super) async fn stored_vectors_of(
        &self,
        info: &CollectionInfo,
        doc_ids: &[String],
        revision: &str,
        label: bool,
        timeout: Duration,
    ) -> HashMap<String, Vec<f32>> {
        let mut per_shard: BTreeMap<u32, Vec<String>> = BTreeMap::new();
        for id in doc_ids {
            per_shard
                .entry(placement::shard_for_doc(id, info.shard_count))
                .or_default()
                .push(id.clone());
        }
        let plan = ReadPlan {
            collection: &info.name,
            replicas: &info.shards,
            consistency: Consistency::Eventual,
            deadline: Instant::now() + timeout.min(READ_BUDGET),
            token: &NO_TOKEN,
        };
        let (targets, _inflight) = self.shards.targets(&plan);
        let reads = per_shard.into_iter().map(|(shard, ids)| {
            let first = targets.get(shard as usize).cloned().unwrap_or_default();
            let plan = &plan;
            async move { self.shards.documents(plan, shard, &first, ids, true).await }
        });
        let mut out = HashMap::new();
        for r in futures::future::join_all(reads).await {
            match r {
                Ok(chunks) => {
                    for c in chunks {
                        if c.embedding_revision == revision && !c.embedding.is_empty() {
                            let text = embedding_text(&c.title, &c.section, &c.text, label);
                            out.insert(text, c.embedding);
                        }
                    }
                }
                Err(e) => {
                    tracing::debug!(collection = %info.name, error = %e,
                                    "stored vectors not read; the batch is embedded whole");
                }
            }
        }
        out
    }
}
