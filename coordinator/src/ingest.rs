//! Ingest: validate a batch, chunk every document, embed the (source-labelled) chunk texts in
//! batches through the model worker, and write each shard's documents as one batch. A call
//! returns only when every touched shard has acknowledged, i.e. made the batch durable and
//! searchable. Upserts replace whole documents, so retrying a failed call is safe.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::Duration;

use ragcluster_proto::v1::*;

use std::sync::Arc;

use crate::catalog::{Catalog, Mirror};
use crate::chunking::{self, ChunkParams, Strategy};
use crate::error::{CoordError, Result};
use crate::limits::{
    MAX_DOC_BYTES, MAX_DOCS_PER_BATCH, MAX_ID_BYTES, MAX_METADATA_ENTRIES, MAX_METADATA_KEY_BYTES,
    MAX_TITLE_BYTES,
};
use crate::models::Models;
use crate::placement;
use crate::read_token::ReadToken;
use crate::shards::{Batch, Shards};
pub use mirror::Copied;

mod changes;
mod mirror;
mod restore;
mod reuse;
pub use changes::check_patch;

pub(crate) fn check_id(field: &str, id: &str) -> Result<()> {
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

/// Why a vector cannot be stored or searched: the shard normalises it for cosine similarity,
/// which needs finite values and a finite, non-zero norm.
pub fn vector_problem(v: &[f32]) -> Option<&'static str> {
    if v.iter().any(|x| !x.is_finite()) {
        return Some("not finite (NaN or infinite values)");
    }
    let norm = v
        .iter()
        .map(|x| f64::from(*x) * f64::from(*x))
        .sum::<f64>()
        .sqrt();
    if norm == 0.0 {
        Some("all zero (no direction to normalise)")
    } else if norm > 1e30 {
        Some("too large (its norm overflows f32)")
    } else {
        None
    }
}

/// Checks a batch of documents for a collection of `dimension`; nothing is written unless all
/// pass (the shards would refuse the same things, after other shards had committed).
pub fn validate_documents(docs: &[Document], max_docs: usize, dimension: u32) -> Result<()> {
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
        if !d.embedding.is_empty() {
            let field = format!("documents[{i}].embedding");
            if d.embedding.len() != dimension as usize {
                return Err(CoordError::invalid(
                    field,
                    format!(
                        "has dimension {}, the collection has {dimension}",
                        d.embedding.len()
                    ),
                ));
            }
            if let Some(why) = vector_problem(&d.embedding) {
                return Err(CoordError::invalid(field, why));
            }
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

    /// Checks a batch for `info` whole: documents, embeddings, and their fields' types against
    /// the schema (fields new to it are let through: the caller adds them first).
    pub fn validate(&self, docs: &[Document], info: &CollectionInfo) -> Result<()> {
        validate_documents(docs, self.max_batch, info.dimension)?;
        crate::schema::growth(docs, info).map(|_| ())
    }

    /// Upserts a batch; `client_timeout` (the caller's deadline) shortens `write_timeout`.
    pub async fn upsert(
        &self,
        r: UpsertDocumentsRequest,
        client_timeout: Option<Duration>,
    ) -> Result<UpsertDocumentsResponse> {
        let started = std::time::Instant::now();
        check_collection("collection", &r.collection)?;
        // A collection being re-embedded: the other side gets the same documents (`mirror`).
        let (info, mirror) = self.catalog.write_route(&r.collection)?;
        self.validate(&r.documents, &info)?;
        let mut token = ReadToken::parse("read_token", &r.read_token, &info, &r.collection)?;
        let ids: Vec<String> = r.documents.iter().map(|d| d.id.clone()).collect();
        let chunking = info.chunking.unwrap_or_default();
        let t_chunk = std::time::Instant::now();
        let docs = self.chunk(r.documents, &chunking).await?;
        let chunk_took = t_chunk.elapsed();
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
        let t_embed = std::time::Instant::now();
        let timeout = self.timeout(client_timeout, started);
        let (vectors, reused) = self.vectors(&info, &docs, texts, label, timeout).await?;
        let embed_took = t_embed.elapsed();
        let per_shard = writes(docs, vectors, info.shard_count);
        let chunks_of: HashMap<String, usize> = per_shard
            .values()
            .flatten()
            .map(|w| (w.doc_id.clone(), w.chunks.len()))
            .collect();
        let timeout = self.timeout(client_timeout, started);
        let t_write = std::time::Instant::now();
        let copies = mirror.as_ref().map(|_| per_shard.clone());
        let batches = per_shard
            .into_iter()
            .map(|(s, w)| (s, Batch::Writes(w)))
            .collect();
        let outcomes = (self.write_shards(&info, batches, mirror.as_ref(), timeout)).await;
        if let (Some(m), Some(copies)) = (&mirror, copies) {
            let timeout = self.timeout(client_timeout, started);
            self.mirror_writes(m, copies, &outcomes, timeout).await?;
        }
        let write_took = t_write.elapsed();
        let timings = IngestTimings {
            chunk_us: chunk_took.as_micros() as u64,
            embed_us: embed_took.as_micros() as u64,
            write_us: write_took.as_micros() as u64,
        };
        for (stage, took) in [
            ("chunk", chunk_took),
            ("embed", embed_took),
            ("write", write_took),
        ] {
            metrics::histogram!("coordinator_ingest_stage_seconds", "stage" => stage)
                .record(took.as_secs_f64());
        }
        raise(&mut token, &outcomes);
        let mut report = Report::new(&ids, &chunks_of, outcomes, &info.name);
        report.response.timings = Some(timings);
        report.response.reused_chunks = reused as u32;
        report.response.read_token = token.encode(&info);
        metrics::counter!("coordinator_ingested_documents_total")
            .increment(u64::from(report.response.documents));
        metrics::counter!("coordinator_ingested_chunks_total")
            .increment(u64::from(report.response.chunks));
        report.into_result()
    }

    /// The vector of each text (in order) and the model revision it comes from: stored ones
    /// where the text is unchanged (`reuse`), the rest embedded. Also returns how many were
    /// reused.
    async fn vectors(
        &self,
        info: &CollectionInfo,
        docs: &[Chunked],
        texts: Vec<String>,
        label: bool,
        timeout: Duration,
    ) -> Result<(Vec<(Vec<f32>, String)>, usize)> {
        if texts.is_empty() {
            return Ok((Vec::new(), 0));
        }
        let model = &info.embedding_model;
        let revision = self.models.meta(model).and_then(|m| m.revision);
        let stored = match &revision {
            Some(rev) => self.stored_vectors(info, docs, rev, label, timeout).await,
            None => HashMap::new(),
        };
        let todo: Vec<String> = texts
            .iter()
            .filter(|t| !stored.contains_key(*t))
            .cloned()
            .collect();
        let reused = texts.len() - todo.len();
        let (fresh, fresh_rev) = if todo.is_empty() {
            (Vec::new(), None)
        } else {
            self.models
                .embed_revised(model, todo, EmbedInput::Document)
                .await?
        };
        let mut fresh = fresh.into_iter();
        let fresh_rev = fresh_rev.unwrap_or_default();
        let revision = revision.unwrap_or_default();
        metrics::counter!("coordinator_reused_vectors_total").increment(reused as u64);
        let vectors = texts
            .into_iter()
            .map(|t| match stored.get(&t) {
                // A text twice in the batch takes the stored vector each time.
                Some(v) => (v.clone(), revision.clone()),
                None => (fresh.next().unwrap_or_default(), fresh_rev.clone()),
            })
            .collect();
        Ok((vectors, reused))
    }

    /// The write deadline: `write_timeout`, or less when the caller's deadline is nearer.
    fn timeout(&self, client: Option<Duration>, started: std::time::Instant) -> Duration {
        match client {
            Some(c) => self
                .write_timeout
                .min(c.saturating_sub(started.elapsed()))
                .max(Duration::from_millis(1)),
            None => self.write_timeout,
        }
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

    /// Writes every shard's batch in parallel (versioned in the epoch of a re-embedding that
    /// mirrors them); each outcome with the shard and its doc ids.
    async fn write_shards(
        &self,
        info: &CollectionInfo,
        per_shard: BTreeMap<u32, Batch>,
        mirror: Option<&Mirror>,
        timeout: Duration,
    ) -> Vec<(u32, Vec<String>, Result<WriteBatchResponse>)> {
        let writes = per_shard.into_iter().map(|(shard, batch)| async move {
            let docs: Vec<String> = match &batch {
                Batch::Writes(w) | Batch::Versioned(w, _) => {
                    w.iter().map(|w| w.doc_id.clone()).collect()
                }
                Batch::Changes(c) => c.iter().flat_map(|c| c.doc_ids.clone()).collect(),
                Batch::InEpoch(..) => Vec::new(),
            };
            let batch = match mirror {
                Some(m) => Batch::InEpoch(Box::new(batch), m.epoch),
                None => batch,
            };
            let r = match info.shards.get(shard as usize) {
                Some(p) => {
                    self.shards
                        .write(&info.name, shard, &p.nodes, batch, timeout)
                        .await
                }
                None => Err(CoordError::Catalog(format!(
                    "{} has no shard {shard}",
                    info.name
                ))),
            };
            (shard, docs, r)
        });
        futures::future::join_all(writes).await
    }
}

/// Raises `token` to the index at which each shard applied its batch.
fn raise(token: &mut ReadToken, outcomes: &[(u32, Vec<String>, Result<WriteBatchResponse>)]) {
    for (shard, _, r) in outcomes {
        if let Ok(w) = r {
            token.raise(*shard, w.applied_seq);
        }
    }
}

/// Checks a collection name given by a client (`field` names it in the error): a malformed
/// name is the request's fault, not a missing collection.
pub fn check_collection(field: &str, name: &str) -> Result<()> {
    if crate::catalog::valid_name(name) {
        Ok(())
    } else {
        Err(CoordError::invalid(
            field,
            format!("{name:?} is not a collection name ([a-z0-9_-]{{1,64}})"),
        ))
    }
}

/// What became of each document of an upsert, from the shards' outcomes.
struct Report {
    response: UpsertDocumentsResponse,
    /// The first failure, when some shard's batch failed.
    failure: Option<CoordError>,
    failed_shards: Vec<u32>,
}

impl Report {
    fn new(
        ids: &[String],
        chunks_of: &HashMap<String, usize>,
        outcomes: Vec<(u32, Vec<String>, Result<WriteBatchResponse>)>,
        collection: &str,
    ) -> Self {
        let mut failed: HashMap<String, (i32, String)> = HashMap::new();
        let mut failure = None;
        let mut failed_shards = Vec::new();
        for (shard, docs, r) in outcomes {
            if let Err(e) = r {
                let code = e.to_status_code() as i32;
                let msg = format!("shard {shard} of {collection}: {e}");
                for d in docs {
                    failed.insert(d, (code, msg.clone()));
                }
                failed_shards.push(shard);
                failure.get_or_insert(e);
            }
        }
        let results: Vec<DocumentResult> = ids
            .iter()
            .map(|id| match failed.get(id) {
                Some((code, message)) => DocumentResult {
                    id: id.clone(),
                    stored: false,
                    code: *code,
                    message: message.clone(),
                },
                None => DocumentResult {
                    id: id.clone(),
                    stored: true,
                    ..Default::default()
                },
            })
            .collect();
        let stored: Vec<&DocumentResult> = results.iter().filter(|r| r.stored).collect();
        let chunks = stored
            .iter()
            .map(|r| chunks_of.get(&r.id).copied().unwrap_or(0))
            .sum::<usize>();
        Self {
            response: UpsertDocumentsResponse {
                documents: stored.len() as u32,
                chunks: chunks as u32,
                results,
                ..Default::default()
            },
            failure,
            failed_shards,
        }
    }

    /// OK when every document is stored; else the first failure's code, a message that says
    /// how many were stored, and this response in the status details.
    fn into_result(self) -> Result<UpsertDocumentsResponse> {
        let Some(first) = self.failure else {
            return Ok(self.response);
        };
        let total = self.response.results.len();
        let shards: Vec<String> = self.failed_shards.iter().map(u32::to_string).collect();
        let retry_after_ms = first.retry_after_ms().unwrap_or(500);
        tracing::warn!(stored = self.response.documents, total, shards = %shards.join(","),
                       error = %first, "upsert partly failed");
        Err(CoordError::Partial {
            code: first.to_status_code(),
            reason: format!(
                "{} of {total} documents stored; not stored: those of shards {} ({first}); \
                 retrying the whole batch is safe (the status details list each document)",
                self.response.documents,
                shards.join(", ")
            ),
            retry_after_ms,
            details: prost::Message::encode_to_vec(&self.response),
        })
    }
}

/// Each document's chunks (ids `doc#i`, linked to their neighbours, metadata plus section),
/// grouped by the shard that owns the document.
fn writes(
    docs: Vec<Chunked>,
    vectors: Vec<(Vec<f32>, String)>,
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
                    fields: doc.fields.clone(),
                    ..if own.is_empty() {
                        let (embedding, embedding_revision) = vectors.next().unwrap_or_default();
                        Chunk {
                            embedding,
                            embedding_revision,
                            ..Default::default()
                        }
                    } else {
                        Chunk {
                            embedding: own.clone(),
                            ..Default::default()
                        }
                    }
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
            validate_documents(d, MAX_DOCS_PER_BATCH, 3)
                .unwrap_err()
                .to_string()
        };
        assert!(err(&[]).contains("documents"));
        assert!(err(&[doc("a", "x"), doc("a", "y")]).contains("documents[1].id"));
        assert!(err(&[doc("", "x")]).contains("documents[0].id"));
        assert!(err(&[doc("a", "  ")]).contains("documents[0].text"));
        let big = "x".repeat(MAX_DOC_BYTES + 1);
        assert!(matches!(
            validate_documents(&[doc("a", &big)], MAX_DOCS_PER_BATCH, 3),
            Err(CoordError::TooLarge { .. })
        ));
        let many: Vec<Document> = (0..=MAX_DOCS_PER_BATCH)
            .map(|i| doc(&i.to_string(), "x"))
            .collect();
        assert!(matches!(
            validate_documents(&many, MAX_DOCS_PER_BATCH, 3),
            Err(CoordError::TooLarge { .. })
        ));
        let with = |embedding: Vec<f32>| Document {
            embedding,
            ..doc("v", "x")
        };
        assert!(
            err(&[with(vec![1.0, f32::NAN, 0.0])]).contains("documents[0].embedding: not finite")
        );
        assert!(err(&[with(vec![f32::INFINITY, 0.0, 0.0])]).contains("not finite"));
        assert!(err(&[with(vec![0.0; 3])]).contains("all zero"));
        assert!(err(&[with(vec![1e30, 1e30, 0.0])]).contains("too large"));
        assert!(err(&[with(vec![1.0; 4])]).contains("dimension 4"));
        assert!(validate_documents(&[with(vec![0.0, 2.0, 0.0])], MAX_DOCS_PER_BATCH, 3).is_ok());
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
