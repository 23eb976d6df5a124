//! Ingest: validate a batch, chunk every document, embed the (source-labelled) chunk texts in
//! batches through the model worker, and write each shard's documents as one batch. A call
//! returns only when every touched shard has acknowledged, i.e. made the batch durable and
//! searchable. Upserts replace whole documents, so retrying a failed call is safe.

use std::collections::{BTreeMap, HashSet};
use std::time::{Duration, Instant};

use futures::stream::{self, StreamExt, TryStreamExt};
use ragcluster_proto::v1::*;

use crate::chunking::{self, ChunkParams, Strategy};
use crate::error::{CoordError, Result};
use crate::fanout::{call, request};
use crate::{State, placement};

pub const MAX_DOCS_PER_BATCH: usize = 256;
pub const MAX_DOC_BYTES: usize = 1 << 20;
pub const MAX_ID_BYTES: usize = 512;
pub const MAX_TITLE_BYTES: usize = 4096;
pub const MAX_METADATA_ENTRIES: usize = 64;

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
            .find(|k| k.is_empty() || k.len() > 256 || k.contains('\u{1f}'))
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

impl State {
    /// Embeds texts through the model worker, `embed_batch` at a time with
    /// `embed_concurrency` calls in flight.
    pub async fn embed(&self, model: &str, texts: Vec<String>) -> Result<Vec<Vec<f32>>> {
        let batches: Vec<Vec<String>> = texts
            .chunks(self.cfg.embed_batch)
            .map(<[String]>::to_vec)
            .collect();
        let timeout = self.cfg.embed_timeout;
        let out: Vec<Vec<Vec<f32>>> = stream::iter(batches)
            .map(|b| async move {
                let mut c = self.clients.model_worker()?;
                let req = request(
                    EmbedRequest {
                        model: model.to_owned(),
                        texts: b,
                    },
                    timeout,
                );
                let r = call("model worker", timeout, c.embed(req)).await?;
                Ok::<_, CoordError>(
                    r.embeddings
                        .into_iter()
                        .map(|e| e.values)
                        .collect::<Vec<_>>(),
                )
            })
            .buffered(self.cfg.embed_concurrency)
            .try_collect()
            .await?;
        Ok(out.into_iter().flatten().collect())
    }

    pub async fn upsert(&self, r: UpsertDocumentsRequest) -> Result<UpsertDocumentsResponse> {
        let info = self.catalog.get(&r.collection)?;
        validate_documents(&r.documents, self.cfg.limits.max_batch_documents)?;
        let chunking = info.chunking.unwrap_or_default();
        let params = chunk_params(&chunking);
        let label = chunking.label_with_title.unwrap_or(true);
        let tokens = self.tokens.clone();
        let docs = r.documents;
        // Chunking is CPU work: keep it off the async workers.
        for (i, d) in docs.iter().enumerate() {
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
        let (docs, pieces) = tokio::task::spawn_blocking(move || {
            // A document with its own embedding is one chunk, as given.
            let pieces: Vec<Vec<chunking::ChunkText>> = docs
                .iter()
                .map(|d| {
                    if d.embedding.is_empty() {
                        chunking::chunk(&d.text, &params, tokens.as_ref())
                    } else {
                        vec![chunking::ChunkText {
                            text: d.text.clone(),
                            section: String::new(),
                        }]
                    }
                })
                .collect();
            (docs, pieces)
        })
        .await
        .map_err(|e| CoordError::Catalog(e.to_string()))?;
        let mut texts = Vec::new();
        let mut total_chunks = 0;
        for (d, ps) in docs.iter().zip(&pieces) {
            total_chunks += ps.len();
            if d.embedding.is_empty() {
                for p in ps {
                    texts.push(embedding_text(&d.title, &p.section, &p.text, label));
                }
            }
        }
        let to_embed = texts.len();
        let mut vectors = if to_embed == 0 {
            Vec::new().into_iter()
        } else {
            self.embed(&info.embedding_model, texts).await?.into_iter()
        };
        if vectors.len() != to_embed {
            return Err(CoordError::Unavailable {
                what: "model worker".into(),
                reason: format!("returned {} embeddings for {to_embed} texts", vectors.len()),
                retry_after_ms: 100,
            });
        }
        let mut per_shard: BTreeMap<u32, Vec<DocumentWrite>> = BTreeMap::new();
        for (mut d, ps) in docs.into_iter().zip(pieces) {
            let own = std::mem::take(&mut d.embedding);
            let ids: Vec<String> = (0..ps.len()).map(|i| format!("{}#{i}", d.id)).collect();
            let chunks = ps
                .into_iter()
                .enumerate()
                .map(|(i, p)| {
                    let mut metadata = d.metadata.clone();
                    if !p.section.is_empty() {
                        metadata.insert("section".into(), p.section.clone());
                    }
                    Chunk {
                        chunk_id: ids[i].clone(),
                        doc_id: d.id.clone(),
                        position: i as u32,
                        prev_chunk_id: if i > 0 {
                            ids[i - 1].clone()
                        } else {
                            String::new()
                        },
                        next_chunk_id: ids.get(i + 1).cloned().unwrap_or_default(),
                        title: d.title.clone(),
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
            let shard = placement::shard_for_doc(&d.id, info.shard_count);
            per_shard.entry(shard).or_default().push(DocumentWrite {
                doc_id: d.id,
                chunks,
                delete: false,
            });
        }
        let n_docs = per_shard.values().map(Vec::len).sum::<usize>() as u32;
        self.write_shards(&info, per_shard).await?;
        metrics::counter!("coordinator_ingested_documents_total").increment(u64::from(n_docs));
        metrics::counter!("coordinator_ingested_chunks_total").increment(total_chunks as u64);
        Ok(UpsertDocumentsResponse {
            documents: n_docs,
            chunks: total_chunks as u32,
        })
    }

    pub async fn delete(&self, r: DeleteDocumentsRequest) -> Result<DeleteDocumentsResponse> {
        let info = self.catalog.get(&r.collection)?;
        if r.ids.is_empty() {
            return Err(CoordError::invalid("ids", "is empty"));
        }
        let max = self.cfg.limits.max_batch_documents.min(MAX_DOCS_PER_BATCH);
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
        let writes = per_shard
            .into_iter()
            .map(|(shard, writes)| self.write_shard(info, shard, writes));
        futures::future::join_all(writes)
            .await
            .into_iter()
            .collect()
    }

    /// Writes one shard's batch through its Raft leader: follows NotLeader hints, tries the
    /// other replicas with backoff when the leader is unknown or down, all within
    /// `write_timeout`. Every attempt carries the same request id, so a batch whose first
    /// attempt timed out but did commit is not applied twice.
    async fn write_shard(
        &self,
        info: &CollectionInfo,
        shard: u32,
        writes: Vec<DocumentWrite>,
    ) -> Result<WriteBatchResponse> {
        let replicas = &info
            .shards
            .get(shard as usize)
            .ok_or_else(|| CoordError::Catalog(format!("{} has no shard {shard}", info.name)))?
            .nodes;
        let req = WriteBatchRequest {
            shard: Some(ShardRef {
                collection: info.name.clone(),
                shard,
            }),
            writes,
            request_id: format!("{:032x}", rand::random::<u128>()),
        };
        let deadline = Instant::now() + self.cfg.write_timeout;
        let mut target = self.routing.leader(&info.name, shard, replicas);
        let mut backoff = Duration::from_millis(20);
        let mut last_error = String::from("no attempt");
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                metrics::counter!("coordinator_write_failures_total").increment(1);
                return Err(CoordError::Unavailable {
                    what: format!("shard {shard} of {}", info.name),
                    reason: format!(
                        "not committed within {} ms (last error: {last_error}); retrying the \
                         same call is safe",
                        self.cfg.write_timeout.as_millis()
                    ),
                    retry_after_ms: 500,
                });
            }
            // One attempt may hang on a cut-off leader; keep time for the others.
            let attempt = left.min(ATTEMPT_TIMEOUT);
            let mut c = self.clients.shard(&target)?;
            let res =
                tokio::time::timeout(attempt, c.write_batch(request(req.clone(), attempt))).await;
            let status = match res {
                Ok(Ok(r)) => {
                    self.routing.set_leader(&info.name, shard, &target);
                    return Ok(r.into_inner());
                }
                Ok(Err(s)) => s,
                Err(_) => tonic::Status::deadline_exceeded("attempt timed out"),
            };
            metrics::counter!("coordinator_write_retries_total").increment(1);
            last_error = format!("{target}: {}", status.message());
            match status.code() {
                tonic::Code::Unavailable
                | tonic::Code::DeadlineExceeded
                | tonic::Code::Unknown
                | tonic::Code::Cancelled => {}
                // Bad input or a missing shard: retrying cannot help.
                _ => {
                    return Err(CoordError::upstream(
                        &format!("shard {shard} on {target}"),
                        status,
                    ));
                }
            }
            let hint = status
                .metadata()
                .get("x-ragcluster-leader")
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.split_once(' '))
                .map(|(_, addr)| addr.to_owned())
                .filter(|a| !a.is_empty() && *a != target);
            match hint {
                Some(addr) => {
                    self.routing.set_leader(&info.name, shard, &addr);
                    target = addr;
                }
                None => {
                    // A live replica without a leader means an election is running: poll
                    // again soon (those answers are cheap) so the write lands right after it.
                    let electing = status.metadata().get("x-ragcluster-leader").is_some()
                        || status.message().contains("not the shard leader");
                    if !electing {
                        // Unreachable or timed out: avoid it for a moment.
                        self.routing.mark_down(&target);
                    }
                    target = self.routing.next_replica(replicas, &target);
                    tokio::time::sleep(backoff.min(left)).await;
                    let cap = if electing { 50 } else { 500 };
                    backoff = (backoff * 2).min(Duration::from_millis(cap));
                }
            }
        }
    }
}

/// Per-attempt limit of a shard write (the whole write gets `write_timeout`).
const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(3);

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
