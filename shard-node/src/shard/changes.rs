//! Partial updates and deletes by filter (`WriteBatchRequest.changes`), resolved when the entry
//! is applied: the documents a change selects (by id, or by a filter over the chunks stored at
//! that point of the log) become ordinary writes, each document rewritten with its metadata
//! patched and the same chunks and vectors, or deleted. Every replica applies the entry
//! against the same state, so every replica selects the same documents; and the resolved
//! batch is what the op log keeps, so the index worker, recovery and replay see plain writes.
//!
//! Resolving is deterministic: documents are selected in storage order, changes apply in
//! the order given, and a later change sees what an earlier one of the same batch did.

use std::collections::{BTreeMap, HashMap};

use ragcluster_proto::v1::{Chunk, DocumentChange, DocumentWrite, MetadataPatch};

use crate::error::{Result, ShardError};
use crate::index::Filter;
use crate::storage::{After, ScanSpec, ShardKey, Store};

/// Matching chunks read per page while a filter selects documents.
const SCAN_PAGE: usize = 4096;

/// The metadata key the chunker owns (each chunk's heading path).
pub const SECTION_KEY: &str = "section";

/// The writes a batch's changes come to, and what to report.
#[derive(Debug, Default)]
pub struct Resolved {
    pub writes: Vec<DocumentWrite>,
    /// Documents patched or deleted.
    pub changed: u32,
    /// Ids asked for by id that are not stored.
    pub not_found: Vec<String>,
}

/// Checks changes before anything is proposed or applied (as `Shard::validate` does writes).
pub fn validate(changes: &[DocumentChange]) -> Result<()> {
    let bad = |m: String| Err(ShardError::InvalidArgument(m));
    for (i, c) in changes.iter().enumerate() {
        match (c.doc_ids.is_empty(), &c.conditions) {
            (true, None) => return bad(format!("changes[{i}] selects no documents")),
            (false, Some(_)) => {
                return bad(format!("changes[{i}] has both doc_ids and conditions"));
            }
            (_, Some(f)) => {
                Filter::of_request(&HashMap::new(), Some(f))
                    .map_err(|e| ShardError::InvalidArgument(format!("changes[{i}]: {e}")))?;
            }
            _ => {}
        }
        if c.doc_ids.iter().any(String::is_empty) {
            return bad(format!("changes[{i}] has an empty doc id"));
        }
        let empty = c.patch.as_ref().is_none_or(patch_is_empty);
        if c.delete && !empty {
            return bad(format!("changes[{i}] deletes and patches"));
        }
        if !c.delete && empty {
            return bad(format!("changes[{i}] changes nothing"));
        }
        if let Some(p) = &c.patch
            && (p.set_metadata.contains_key(SECTION_KEY)
                || p.delete_metadata.iter().any(|k| k == SECTION_KEY))
        {
            return bad(format!("changes[{i}] sets or deletes {SECTION_KEY:?}"));
        }
    }
    Ok(())
}

pub fn patch_is_empty(p: &MetadataPatch) -> bool {
    p.set_metadata.is_empty()
        && p.delete_metadata.is_empty()
        && p.set_fields.is_empty()
        && p.delete_fields.is_empty()
}

/// Applies `p` to one chunk. A key set in one namespace leaves the other, so that a name is
/// never both a string metadata key and a typed field.
pub fn patch_chunk(c: &mut Chunk, p: &MetadataPatch) {
    for k in &p.delete_metadata {
        c.metadata.remove(k);
    }
    for k in &p.delete_fields {
        c.fields.remove(k);
    }
    for (k, v) in &p.set_metadata {
        c.fields.remove(k);
        c.metadata.insert(k.clone(), v.clone());
    }
    for (k, v) in &p.set_fields {
        c.metadata.remove(k);
        c.fields.insert(k.clone(), v.clone());
    }
}

/// Refuses (the whole batch) a patch that takes a document past the change's bounds.
fn within_bounds(id: &str, chunks: &[Chunk], change: &DocumentChange) -> Result<()> {
    let Some(c) = chunks.first() else {
        return Ok(());
    };
    let metadata = c.metadata.keys().filter(|k| *k != SECTION_KEY).count();
    let over = |n: usize, max: u32| max > 0 && n > max as usize;
    if over(metadata, change.max_metadata) || over(c.fields.len(), change.max_fields) {
        return Err(ShardError::InvalidArgument(format!(
            "the patch would leave document {id:?} with {metadata} metadata keys and {} \
             fields; at most {} and {}",
            c.fields.len(),
            change.max_metadata,
            change.max_fields
        )));
    }
    Ok(())
}

/// Documents as this batch leaves them: `None` deleted; absent ones are as stored.
struct Staged<'a> {
    store: &'a Store,
    key: &'a ShardKey,
    docs: HashMap<String, Option<Vec<Chunk>>>,
    /// Documents in the order they were first touched (the order of the writes). Changes
    /// never create documents, so each was stored before the batch.
    order: Vec<String>,
}

impl Staged<'_> {
    /// The document's chunks with their vectors, as the batch has left them so far.
    fn chunks(&self, id: &str) -> Result<Option<Vec<Chunk>>> {
        if let Some(d) = self.docs.get(id) {
            return Ok(d.clone());
        }
        let chunks = self.store.doc_chunks(self.key, &[id.to_owned()], true)?;
        Ok((!chunks.is_empty()).then_some(chunks))
    }

    fn set(&mut self, id: String, chunks: Option<Vec<Chunk>>) {
        if !self.docs.contains_key(&id) {
            self.order.push(id.clone());
        }
        self.docs.insert(id, chunks);
    }

    /// Documents with at least one chunk matching `filter`, in id order: the stored ones
    /// (one pass over the shard a page at a time, reading no vectors and keeping only ids)
    /// as this batch has left them.
    fn matching(&self, filter: &Filter) -> Result<Vec<String>> {
        let mut ids: BTreeMap<String, ()> = BTreeMap::new();
        let mut after: Option<After> = None;
        loop {
            let spec = ScanSpec {
                after: after.as_ref(),
                limit: SCAN_PAGE,
                max_bytes: 0,
                with_embedding: false,
            };
            let page = self
                .store
                .scan(self.key, &spec, |c| filter.matches_chunk(c))?;
            if let Some(last) = page.chunks.last() {
                after = Some(After {
                    doc_id: last.doc_id.clone(),
                    position: last.position,
                });
            }
            for c in page.chunks {
                if !self.docs.contains_key(&c.doc_id) {
                    ids.insert(c.doc_id, ());
                }
            }
            if page.done {
                break;
            }
        }
        for (id, d) in &self.docs {
            if let Some(chunks) = d
                && chunks.iter().any(|c| filter.matches_chunk(c))
            {
                ids.insert(id.clone(), ());
            }
        }
        Ok(ids.into_keys().collect())
    }
}

/// Resolves `changes` against the shard's documents as stored now (see the module doc).
pub fn resolve(store: &Store, key: &ShardKey, changes: &[DocumentChange]) -> Result<Resolved> {
    let mut staged = Staged {
        store,
        key,
        docs: HashMap::new(),
        order: Vec::new(),
    };
    let mut not_found = Vec::new();
    for change in changes {
        let ids = match &change.conditions {
            Some(f) => {
                let filter = Filter::of_request(&HashMap::new(), Some(f))
                    .map_err(|e| ShardError::InvalidArgument(e.to_string()))?;
                staged.matching(&filter)?
            }
            None => change.doc_ids.clone(),
        };
        for id in ids {
            let Some(mut chunks) = staged.chunks(&id)? else {
                if change.conditions.is_none() && !not_found.contains(&id) {
                    not_found.push(id);
                }
                continue;
            };
            if change.delete {
                staged.set(id, None);
            } else if let Some(p) = &change.patch {
                for c in &mut chunks {
                    patch_chunk(c, p);
                }
                within_bounds(&id, &chunks, change)?;
                staged.set(id, Some(chunks));
            }
        }
    }
    let Staged {
        mut docs, order, ..
    } = staged;
    let changed = order.len() as u32;
    let writes = order
        .into_iter()
        .map(|id| {
            let chunks = docs.remove(&id).flatten();
            DocumentWrite {
                delete: chunks.is_none(),
                chunks: chunks.unwrap_or_default(),
                doc_id: id,
            }
        })
        .collect();
    Ok(Resolved {
        writes,
        changed,
        not_found,
    })
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use ragcluster_proto::v1::{self as pb, WriteBatchRequest, condition, value};

    use super::*;
    use crate::index::hnsw::Scan;
    use crate::shard::{HitForm, Shard};
    use crate::testutil::*;

    fn tagged(id: &str, lang: &str, seed: f32) -> DocumentWrite {
        let mut w = doc(id, "apples and pears", seed);
        w.chunks[0].metadata.insert("lang".into(), lang.into());
        w
    }

    fn lang_is(lang: &str) -> pb::Filter {
        pb::Filter {
            must: vec![pb::Condition {
                kind: Some(condition::Kind::Match(pb::Match {
                    field: "lang".into(),
                    value: Some(pb::Value {
                        kind: Some(value::Kind::Keyword(lang.into())),
                    }),
                })),
            }],
            ..Default::default()
        }
    }

    fn changes(changes: Vec<DocumentChange>) -> WriteBatchRequest {
        WriteBatchRequest {
            changes,
            ..Default::default()
        }
    }

    fn gold() -> MetadataPatch {
        MetadataPatch {
            set_metadata: [("tier".to_owned(), "gold".to_owned())].into(),
            set_fields: [(
                "year".to_owned(),
                pb::Value {
                    kind: Some(value::Kind::Integer(2020)),
                },
            )]
            .into(),
            ..Default::default()
        }
    }

    fn docs_matching(shard: &Shard, f: &Filter) -> (Vec<String>, Vec<String>, u64) {
        let v: Vec<f32> = (0..DIM).map(|i| (1.0 + i as f32).sin()).collect();
        let ids = |hits: Vec<pb::ShardHit>| {
            let mut d: Vec<String> = hits.into_iter().map(|h| h.chunk.unwrap().doc_id).collect();
            d.sort();
            d
        };
        let dense = ids(shard
            .vector_search(&v, 10, Scan::Walk(32), f, HitForm::Chunk)
            .unwrap());
        let bm25 = ids(shard
            .bm25_search("apples", 10, f, None, HitForm::Chunk)
            .unwrap());
        (dense, bm25, shard.count(f).unwrap().0)
    }

    /// A patch by filter rewrites exactly the matching documents' metadata, keeps their
    /// vectors and their graph slots (no re-insert), and both indexes filter by the new
    /// values; a delete by filter removes exactly its matches; ids not stored are reported;
    /// a patch past the bounds changes nothing.
    #[test]
    fn changes_select_at_apply_and_patch_in_place() {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(Store::open(&dir.path().join("db"), true).unwrap());
        let shard = open(dir.path(), ShardKey::new("c", 0), store.clone(), 1000);
        let docs = vec![
            tagged("a", "en", 1.0),
            tagged("b", "de", 2.0),
            tagged("c", "en", 3.0),
        ];
        apply(&shard, batch(docs)).unwrap();
        let before = store
            .doc_chunks(&shard.key, &["a".to_owned()], true)
            .unwrap();
        let patch = DocumentChange {
            conditions: Some(lang_is("en")),
            patch: Some(gold()),
            ..Default::default()
        };
        let r = apply(&shard, changes(vec![patch])).unwrap();
        assert_eq!((r.changed, r.existed), (2, 2));
        let after = store
            .doc_chunks(&shard.key, &["a".to_owned()], true)
            .unwrap();
        assert_eq!(after[0].metadata["tier"], "gold");
        assert_eq!(after[0].metadata["lang"], "en");
        assert_eq!(after[0].embedding, before[0].embedding);
        assert_eq!(
            shard.indexes.hnsw.counts(),
            (3, 0),
            "patched points keep their slots"
        );
        let gold_filter = Filter::keywords([("tier", "gold")]);
        let both = vec!["a".to_owned(), "c".to_owned()];
        assert_eq!(docs_matching(&shard, &gold_filter), (both.clone(), both, 2));

        let unknown = DocumentChange {
            doc_ids: vec!["b".into(), "zz".into()],
            patch: Some(MetadataPatch {
                delete_metadata: vec!["lang".into()],
                ..Default::default()
            }),
            ..Default::default()
        };
        let r = apply(&shard, changes(vec![unknown])).unwrap();
        assert_eq!((r.changed, r.not_found), (1, vec!["zz".to_owned()]));
        let b = store
            .doc_chunks(&shard.key, &["b".to_owned()], false)
            .unwrap();
        assert!(!b[0].metadata.contains_key("lang"));

        let over = DocumentChange {
            doc_ids: vec!["a".into()],
            patch: Some(gold()),
            max_metadata: 1,
            ..Default::default()
        };
        let seq = shard.applied_seq();
        assert!(apply(&shard, changes(vec![over])).is_err());
        assert_eq!(
            shard.applied_seq(),
            seq + 1,
            "a refused batch moves the index"
        );

        let delete = DocumentChange {
            conditions: Some(lang_is("en")),
            delete: true,
            ..Default::default()
        };
        let r = apply(&shard, changes(vec![delete])).unwrap();
        assert_eq!(r.changed, 2);
        assert_eq!(
            docs_matching(&shard, &Filter::default()),
            (vec!["b".to_owned()], vec!["b".to_owned()], 1)
        );
    }

    #[test]
    fn bad_changes_are_refused() {
        let bad = |c: DocumentChange| validate(&[c]).unwrap_err().to_string();
        assert!(bad(DocumentChange::default()).contains("selects no documents"));
        let both = DocumentChange {
            doc_ids: vec!["a".into()],
            conditions: Some(pb::Filter::default()),
            delete: true,
            ..Default::default()
        };
        assert!(bad(both).contains("both"));
        let nothing = DocumentChange {
            doc_ids: vec!["a".into()],
            ..Default::default()
        };
        assert!(bad(nothing).contains("changes nothing"));
        let section = DocumentChange {
            doc_ids: vec!["a".into()],
            patch: Some(MetadataPatch {
                delete_metadata: vec![SECTION_KEY.into()],
                ..Default::default()
            }),
            ..Default::default()
        };
        assert!(bad(section).contains("section"));
    }
}
