//! Writes into a re-embedding's other collection (`reembed`): documents as the serving
//! collection holds them, every chunk embedded again by the other collection's model (a
//! vector it already holds for the same text and model revision is reused), written to the
//! shard of the same number, versioned by the job's epoch and the serving shard's log index
//! (`Batch::Versioned`, `ragcluster_common::versions`), so that whichever of the copy and
//! the mirrored writes reaches the other side last, the newest content stays. Both
//! collections have as many shards, so a document's shard is the same in both.
//!
//! A write to a collection being re-embedded is acknowledged once both collections hold it:
//! the primary write is versioned by its own log index in the epoch it resolved its
//! collection in (`Batch::InEpoch`), the mirror runs after the serving shards applied it,
//! with their applied seqs. A write that resolved before a switch and lands after it keeps
//! its older epoch on both sides, so it cannot replace one made after the switch.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use ragcluster_proto::v1::*;

use ragcluster_common::versions::version;

use super::{Ingestor, embedding_text};
use crate::catalog::Mirror;
use crate::error::{CoordError, Result};
use crate::read_token::NO_TOKEN;
use crate::shards::{Batch, ReadPlan};

/// Texts per model call of a background write (see `Ingestor::write_reembedded`).
const BACKGROUND_EMBED_TEXTS: usize = 8;

/// What a copy did.
#[derive(Debug, Default, Clone, Copy)]
pub struct Copied {
    /// Documents written (or deleted) in the target.
    pub written: u64,
    /// Chunks embedded by the target's model, and chunks whose stored vector was reused.
    pub embedded: u64,
    pub reused: u64,
    /// Documents the target held in the same or a newer version.
    pub newer: u64,
}

impl std::ops::AddAssign for Copied {
    fn add_assign(&mut self, o: Self) {
        self.written += o.written;
        self.embedded += o.embedded;
        self.reused += o.reused;
        self.newer += o.newer;
    }
}

/// One shard's outcome of a primary write.
type Outcome = (u32, Vec<String>, Result<WriteBatchResponse>);

fn mirror_failed(target: &str, e: CoordError) -> CoordError {
    CoordError::Unavailable {
        what: format!("re-embedding copy {target}"),
        reason: format!(
            "the write was applied to the collection but not yet to its re-embedding copy \
             ({e}); retrying the same call is safe"
        ),
        retry_after_ms: e.retry_after_ms().unwrap_or(500),
    }
}

impl Ingestor {
    /// Writes each shard's documents (with its version, `ragcluster_common::versions`) into
    /// `target`, chunks embedded by its model; deletes pass through. A `background` write
    /// (the copy) sends its texts to the model a few at a time, one call after another, so
    /// that the encoder's queue never holds more than that of it ahead of a mirrored write
    /// or a query: on a busy CPU encoder a whole batch queued at once made them wait past
    /// their deadline.
    pub async fn write_reembedded(
        &self,
        target: &CollectionInfo,
        per_shard: BTreeMap<u32, (Vec<DocumentWrite>, u64)>,
        background: bool,
        timeout: Duration,
    ) -> Result<Copied> {
        let label = target
            .chunking
            .as_ref()
            .and_then(|c| c.label_with_title)
            .unwrap_or(true);
        let model = &target.embedding_model;
        let text_of = |c: &Chunk| embedding_text(&c.title, &c.section, &c.text, label);
        let mut ids: Vec<String> = Vec::new();
        for (w, _) in per_shard.values() {
            ids.extend(w.iter().filter(|w| !w.delete).map(|w| w.doc_id.clone()));
        }
        let revision = self.models.meta(model).and_then(|m| m.revision);
        let stored = match &revision {
            Some(rev) => {
                self.stored_vectors_of(target, &ids, rev, label, timeout)
                    .await
            }
            None => HashMap::new(),
        };
        let mut todo: Vec<String> = Vec::new();
        let mut seen = std::collections::HashSet::new();
        let mut copied = Copied::default();
        for (w, _) in per_shard.values() {
            for c in w.iter().flat_map(|w| &w.chunks) {
                let t = text_of(c);
                if stored.contains_key(&t) {
                    copied.reused += 1;
                } else if seen.insert(t.clone()) {
                    todo.push(t);
                }
            }
        }
        let slice = if background {
            BACKGROUND_EMBED_TEXTS
        } else {
            todo.len().max(1)
        };
        let (mut fresh, mut fresh_rev) = (Vec::with_capacity(todo.len()), None);
        for texts in todo.chunks(slice) {
            let (v, rev) = (self.models)
                .embed_revised(model, texts.to_vec(), EmbedInput::Document)
                .await?;
            fresh.extend(v);
            fresh_rev = fresh_rev.or(rev);
        }
        copied.embedded = fresh.len() as u64;
        let fresh: HashMap<String, Vec<f32>> = todo.into_iter().zip(fresh).collect();
        let fresh_rev = fresh_rev.unwrap_or_default();
        let stored_rev = revision.unwrap_or_default();
        let writes = per_shard.into_iter().map(|(shard, (mut w, version))| {
            for c in w.iter_mut().flat_map(|w| &mut w.chunks) {
                let t = text_of(c);
                (c.embedding, c.embedding_revision) = match stored.get(&t) {
                    Some(v) => (v.clone(), stored_rev.clone()),
                    None => (
                        fresh.get(&t).cloned().unwrap_or_default(),
                        fresh_rev.clone(),
                    ),
                };
            }
            let n = w.len() as u64;
            async move {
                let Some(p) = target.shards.get(shard as usize) else {
                    return Err(CoordError::Catalog(format!(
                        "{} has no shard {shard}",
                        target.name
                    )));
                };
                let r = (self.shards)
                    .write(
                        &target.name,
                        shard,
                        &p.nodes,
                        Batch::Versioned(w, version),
                        timeout,
                    )
                    .await?;
                Ok((n, r.stale.len() as u64))
            }
        });
        for r in futures::future::join_all(writes).await {
            let (n, stale) = r?;
            copied.written += n - stale;
            copied.newer += stale;
        }
        Ok(copied)
    }

    /// Mirrors an upsert's documents (as written to the serving collection, per shard) to
    /// the other one, for each shard that applied its batch, at that batch's seq.
    pub(super) async fn mirror_writes(
        &self,
        m: &Mirror,
        mut copies: BTreeMap<u32, Vec<DocumentWrite>>,
        outcomes: &[Outcome],
        timeout: Duration,
    ) -> Result<()> {
        let per_shard: BTreeMap<u32, (Vec<DocumentWrite>, u64)> = outcomes
            .iter()
            .filter_map(|(s, _, r)| {
                let seq = r.as_ref().ok()?.applied_seq;
                Some((*s, (copies.remove(s)?, version(m.epoch, seq))))
            })
            .collect();
        self.write_reembedded(&m.to, per_shard, false, timeout)
            .await
            .map(|_| ())
            .map_err(|e| mirror_failed(&m.to.name, e))
    }

    /// Mirrors patches and deletes: the documents each shard changed, read back from the
    /// source (a document read later than the change can only be newer, and its own write's
    /// mirror carries a higher version), copied at the change's seq.
    pub(super) async fn mirror_changes(
        &self,
        source: &CollectionInfo,
        m: &Mirror,
        outcomes: &[Outcome],
        timeout: Duration,
    ) -> Result<()> {
        let target = &m.to;
        let mut per_shard = BTreeMap::new();
        for (shard, _, r) in outcomes {
            let Ok(w) = r else { continue };
            if w.changed_ids.is_empty() {
                continue;
            }
            let docs = self
                .read_documents(source, *shard, w.changed_ids.clone(), timeout)
                .await
                .map_err(|e| mirror_failed(&target.name, e))?;
            per_shard.insert(*shard, (docs, version(m.epoch, w.applied_seq)));
        }
        if per_shard.is_empty() {
            return Ok(());
        }
        self.write_reembedded(target, per_shard, false, timeout)
            .await
            .map(|_| ())
            .map_err(|e| mirror_failed(&target.name, e))
    }

    /// Documents `ids` of one shard as they are now (a strong read), each as a write of its
    /// chunks in position order, or as a delete when it is gone.
    pub async fn read_documents(
        &self,
        info: &CollectionInfo,
        shard: u32,
        ids: Vec<String>,
        timeout: Duration,
    ) -> Result<Vec<DocumentWrite>> {
        let plan = ReadPlan {
            collection: &info.name,
            replicas: &info.shards,
            consistency: Consistency::Strong,
            deadline: Instant::now() + timeout,
            token: &NO_TOKEN,
        };
        let (targets, _inflight) = self.shards.targets(&plan);
        let first = targets.get(shard as usize).cloned().unwrap_or_default();
        let chunks = (self.shards)
            .documents(&plan, shard, &first, ids.clone(), false)
            .await?;
        let mut by_doc: HashMap<String, Vec<Chunk>> = HashMap::new();
        for c in chunks {
            by_doc.entry(c.doc_id.clone()).or_default().push(c);
        }
        Ok(ids
            .into_iter()
            .map(|id| match by_doc.remove(&id) {
                Some(mut chunks) => {
                    chunks.sort_by_key(|c| c.position);
                    DocumentWrite {
                        doc_id: id,
                        chunks,
                        delete: false,
                    }
                }
                None => DocumentWrite {
                    doc_id: id,
                    chunks: Vec::new(),
                    delete: true,
                },
            })
            .collect())
    }
}
