//! Ingest: validate a batch, chunk every document, embed the (source-labelled) chunk texts in
//! batches through the model worker, and write each shard's documents as one batch. A call
//! returns only when every touched shard has acknowledged, i.e. made the batch durable and
//! searchable. Upserts replace whole documents, so retrying a failed call is safe.

use std::collections::{BTreeMap, HashSet};
use std::time::Duration;

use ragcluster_proto::v1::*;

use std::sync::Arc;

use crate::catalog::Catalog;
use crate::chunking::{self, ChunkParams, Strategy};
use crate::error::{CoordError, Result};
use crate::limits::{
    MAX_DOC_BYTES, MAX_DOCS_PER_BATCH, MAX_ID_BYTES, MAX_METADATA_ENTRIES, MAX_METADATA_KEY_BYTES,
    MAX_TITLE_BYTES,
};
use crate::models::Models;
use crate::placement;
use crate::shards::Shards;

fn check_id(field: &str, id: &str) -> Result<()> {
    if id.is_empty() {
        return Err(CoordError::invalid(field, "is empty"));
    }
    if id.len() > MAX_ID_BYTES {
        return Err(CoordError::invalid(
            field,
            format!("is longer than {MAX_ID_BYTES} bytes"),
        ));
    }
    if id.chars().any(char::is_control) {
        return Err(CoordError::invalid(field, "contains control characters"));
    }
    Ok(())
}

/// Checks a batch of documents; nothing is written unless all pass.
pub fn validate_documents(docs: &[Document], max_docs: usize) -> Result<()> {
    if docs.is_empty() {
        return Err(CoordError::invalid("documents", "is empty"));
    }
    let max_docs = max_docs.min(MAX_DOCS_PER_BATCH);
    if docs.len() > max_docs {
        return Err(CoordError::TooLarge {
            field: "documents".into(),
            reason: format!(
                "{} documents in one batch, at most {max_docs} (limits.max_batch_documents)",
                docs.len()
            ),
        });
    }
    let mut seen = HashSet::new();
    for (i, d) in docs.iter().enumerate() {
        check_id(&format!("documents[{i}].id"), &d.id)?;
        if !seen.insert(d.id.as_str()) {
            return Err(CoordError::invalid(
                format!("documents[{i}].id"),
                format!("{:?} appears more than once in the batch", d.id),
            ));
        }
        if d.text.trim().is_empty() {
            return Err(CoordError::invalid(
                format!("documents[{i}].text"),
                "is empty",
            ));
        }
        if d.text.len() > MAX_DOC_BYTES {
            return Err(CoordError::TooLarge {
                field: format!("documents[{i}].text"),
                reason: format!("{} bytes, at most {MAX_DOC_BYTES}", d.text.len()),
            });
        }
        if d.title.len() > MAX_TITLE_BYTES {
            return Err(CoordError::invalid(
                format!("documents[{i}].title"),
                format!("is longer than {MAX_TITLE_BYTES} bytes"),
            ));
        }
        if d.metadata.len() > MAX_METADATA_ENTRIES {
            return Err(CoordError::invalid(
                format!("documents[{i}].metadata"),
                format!("has more than {MAX_METADATA_ENTRIES} entries"),
            ));
        }
        if let Some(k) = d
            .metadata
            .keys()
            .find(|k| k.is_empty() || k.len() > MAX_METADATA_KEY_BYTES || k.contains('\u{1f}'))
        {
            return Err(CoordError::invalid(
                format!("documents[{i}].metadata"),
                format!("key {k:?} is empty, too long or has U+001F"),
            ));
        }
    }
    Ok(())
}

pub fn chunk_params(c: &ChunkingConfig) -> ChunkParams {
    let strategy = match ChunkingStrategy::try_from(c.strategy) {
        Ok(ChunkingStrategy::Fixed) => Strategy::Fixed,
        Ok(ChunkingStrategy::Markdown) => Strategy::Markdown,
        _ => Strategy::Sentence,
    };
    ChunkParams {
        strategy,
        chunk_size: c.chunk_size as usize,
        overlap: c.chunk_overlap as usize,
        min_tokens: c.min_chunk_tokens as usize,
    }
}

/// The text that is embedded: "title > section" on its own line before the chunk
/// (UniversalRAG's source labelling), or the bare chunk.
pub fn embedding_text(title: &str, section: &str, text: &str, label: bool) -> String {
    let label_text = match (label, title.is_empty(), section.is_empty()) {
        (false, _, _) | (true, true, true) => return text.to_owned(),
        (true, false, true) => title.to_owned(),
        (true, true, false) => section.to_owned(),
        (true, false, false) => format!("{title} > {section}"),
    };
    format!("{label_text}\n{text}")
}

/// Writes documents: chunked, embedded through the model worker, and written to each shard's
/// Raft leader as one batch per shard.
pub struct Ingestor {
    catalog: Arc<Catalog>,
    shards: Arc<Shards>,
    models: Arc<Models>,
    tokens: Arc<dyn chunking::Tokens>,
    /// Deadline of one shard's write (retries included).
    write_timeout: Duration,
    /// `limits.max_batch_documents`.
    max_batch: usize,
}

/// A document cut into chunk texts (a document with its own embedding is one chunk, as given).
struct Chunked {
    doc: Document,
    pieces: Vec<chunking::ChunkText>,
}

impl Ingestor {
    pub fn new(
        catalog: Arc<Catalog>,
        shards: Arc<Shards>,
        models: Arc<Models>,
        tokens: Arc<dyn chunking::Tokens>,
        write_timeout: Duration,
        max_batch: usize,
    ) -> Self {
        Self {
            catalog,
            shards,
            models,
            tokens,
            write_timeout,
            max_batch,
        }
    }

    pub async fn upsert(&self, r: UpsertDocumentsRequest) -> Result<UpsertDocumentsResponse> {
        let info = self.catalog.get(&r.collection)?;
        validate_documents(&r.documents, self.max_batch)?;
        for (i, d) in r.documents.iter().enumerate() {
            if !d.embedding.is_empty() && d.embedding.len() != info.dimension as usize {
                return Err(CoordError::invalid(
                    format!("documents[{i}].embedding"),
                    format!(
                        "has dimension {}, the collection has {}",
                        d.embedding.len(),
                        info.dimension
                    ),
                ));
            }
        }
        let chunking = info.chunking.unwrap_or_default();
        let docs = self.chunk(r.documents, &chunking).await?;
        let total_chunks: usize = docs.iter().map(|d| d.pieces.len()).sum();
        let label = chunking.label_with_title.unwrap_or(true);
        let texts: Vec<String> = docs
            .iter()
            .filter(|d| d.doc.embedding.is_empty())
            .flat_map(|d| {
                d.pieces
                    .iter()
                    .map(|p| embedding_text(&d.doc.title, &p.section, &p.text, label))
            })
            .collect();
        let vectors = if texts.is_empty() {
            Vec::new()
        } else {
            self.models.embed(&info.embedding_model, texts).await?
        };
        let per_shard = writes(docs, vectors, info.shard_count);
        let n_docs = per_shard.values().map(Vec::len).sum::<usize>() as u32;
        self.write_shards(&info, per_shard).await?;
        metrics::counter!("coordinator_ingested_documents_total").increment(u64::from(n_docs));
        metrics::counter!("coordinator_ingested_chunks_total").increment(total_chunks as u64);
        Ok(UpsertDocumentsResponse {
            documents: n_docs,
            chunks: total_chunks as u32,
        })
    }

    /// Chunking is CPU work: it runs off the async workers.
    async fn chunk(&self, docs: Vec<Document>, c: &ChunkingConfig) -> Result<Vec<Chunked>> {
        let params = chunk_params(c);
        let tokens = self.tokens.clone();
        tokio::task::spawn_blocking(move || {
            docs.into_iter()
                .map(|doc| {
                    let pieces = if doc.embedding.is_empty() {
                        chunking::chunk(&doc.text, &params, tokens.as_ref())
                    } else {
                        vec![chunking::ChunkText {
                            text: doc.text.clone(),
                            section: String::new(),
                        }]
                    };
                    Chunked { doc, pieces }
                })
                .collect()
        })
        .await
        .map_err(|e| CoordError::Catalog(e.to_string()))
    }

    pub async fn delete(&self, r: DeleteDocumentsRequest) -> Result<DeleteDocumentsResponse> {
        let info = self.catalog.get(&r.collection)?;
        if r.ids.is_empty() {
            return Err(CoordError::invalid("ids", "is empty"));
        }
        let max = self.max_batch.min(MAX_DOCS_PER_BATCH);
        if r.ids.len() > max {
            return Err(CoordError::TooLarge {
                field: "ids".into(),
                reason: format!("at most {max} per call (limits.max_batch_documents)"),
            });
        }
        let mut seen = HashSet::new();
        let mut per_shard: BTreeMap<u32, Vec<DocumentWrite>> = BTreeMap::new();
        for (i, id) in r.ids.iter().enumerate() {
            check_id(&format!("ids[{i}]"), id)?;
            if !seen.insert(id) {
                return Err(CoordError::invalid(
                    format!("ids[{i}]"),
                    format!("{id:?} appears more than once"),
                ));
            }
            per_shard
                .entry(placement::shard_for_doc(id, info.shard_count))
                .or_default()
                .push(DocumentWrite {
                    doc_id: id.clone(),
                    chunks: vec![],
                    delete: true,
                });
        }
        let results = self.write_shards(&info, per_shard).await?;
        let not_found: Vec<String> = results.into_iter().flat_map(|r| r.not_found).collect();
        Ok(DeleteDocumentsResponse {
            deleted: (r.ids.len() - not_found.len()) as u32,
            not_found,
        })
    }

    async fn write_shards(
        &self,
        info: &CollectionInfo,
        per_shard: BTreeMap<u32, Vec<DocumentWrite>>,
    ) -> Result<Vec<WriteBatchResponse>> {
        let writes = per_shard.into_iter().map(|(shard, writes)| async move {
            let replicas = &info
                .shards
                .get(shard as usize)
                .ok_or_else(|| CoordError::Catalog(format!("{} has no shard {shard}", info.name)))?
                .nodes;
            self.shards
                .write(&info.name, shard, replicas, writes, self.write_timeout)
                .await
        });
        futures::future::join_all(writes)
            .await
            .into_iter()
            .collect()
    }
}

/// Each document's chunks (ids `doc#i`, linked to their neighbours, metadata plus section),
/// grouped by the shard that owns the document.
fn writes(
    docs: Vec<Chunked>,
    vectors: Vec<Vec<f32>>,
    shard_count: u32,
) -> BTreeMap<u32, Vec<DocumentWrite>> {
    let mut vectors = vectors.into_iter();
    let mut per_shard: BTreeMap<u32, Vec<DocumentWrite>> = BTreeMap::new();
    for Chunked { mut doc, pieces } in docs {
        let own = std::mem::take(&mut doc.embedding);
        let ids: Vec<String> = (0..pieces.len())
            .map(|i| format!("{}#{i}", doc.id))
            .collect();
        let chunks = pieces
            .into_iter()
            .enumerate()
            .map(|(i, p)| {
                let mut metadata = doc.metadata.clone();
                if !p.section.is_empty() {
                    metadata.insert("section".into(), p.section.clone());
                }
                Chunk {
                    chunk_id: ids[i].clone(),
                    doc_id: doc.id.clone(),
                    position: i as u32,
                    prev_chunk_id: if i > 0 {
                        ids[i - 1].clone()
                    } else {
                        String::new()
                    },
                    next_chunk_id: ids.get(i + 1).cloned().unwrap_or_default(),
                    title: doc.title.clone(),
                    section: p.section,
                    text: p.text,
                    metadata,
                    embedding: if own.is_empty() {
                        vectors.next().unwrap_or_default()
                    } else {
                        own.clone()
                    },
                }
            })
            .collect();
        let shard = placement::shard_for_doc(&doc.id, shard_count);
        per_shard.entry(shard).or_default().push(DocumentWrite {
            doc_id: doc.id,
            chunks,
            delete: false,
        });
    }
    per_shard
}

#[cfg(test)]
mod tests {
    use super::*;

    fn doc(id: &str, text: &str) -> Document {
        Document {
            id: id.into(),
            text: text.into(),
            ..Default::default()
        }
    }

    #[test]
    fn rejects_bad_batches_naming_the_field() {
        let err = |d: &[Document]| {
            validate_documents(d, MAX_DOCS_PER_BATCH)
                .unwrap_err()
                .to_string()
        };
        assert!(err(&[]).contains("documents"));
        assert!(err(&[doc("a", "x"), doc("a", "y")]).contains("documents[1].id"));
        assert!(err(&[doc("", "x")]).contains("documents[0].id"));
        assert!(err(&[doc("a", "  ")]).contains("documents[0].text"));
        let big = "x".repeat(MAX_DOC_BYTES + 1);
        assert!(matches!(
            validate_documents(&[doc("a", &big)], MAX_DOCS_PER_BATCH),
            Err(CoordError::TooLarge { .. })
        ));
        let many: Vec<Document> = (0..=MAX_DOCS_PER_BATCH)
            .map(|i| doc(&i.to_string(), "x"))
            .collect();
        assert!(matches!(
            validate_documents(&many, MAX_DOCS_PER_BATCH),
            Err(CoordError::TooLarge { .. })
        ));
    }

    #[test]
    fn labels_chunks_with_title_and_section() {
        assert_eq!(
            embedding_text("Guide", "Install > Linux", "Use apt.", true),
            "Guide > Install > Linux\nUse apt."
        );
        assert_eq!(embedding_text("Guide", "", "x", true), "Guide\nx");
        assert_eq!(embedding_text("Guide", "S", "x", false), "x");
    }
}
