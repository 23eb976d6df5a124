//! Restores (`Admin.RestoreDocuments`, `ragctl backup restore`): documents written back as a
//! backup saved them, chunks with their vectors and model revisions, so nothing is chunked or
//! embedded again and the restored collection answers as the source did. Each document goes
//! to the shard that owns its id in the target collection, whatever the source's layout; a
//! batch is checked whole first and written as an upsert is (all-or-nothing per shard,
//! reported per document; retrying is safe, a document is replaced whole).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::{Duration, Instant};

use ragcluster_proto::v1::*;

use super::{Ingestor, Report, check_collection, check_id, raise, vector_problem};
use crate::error::{CoordError, Result};
use crate::limits::{MAX_DOC_BYTES, MAX_DOCS_PER_BATCH, MAX_METADATA_ENTRIES, MAX_TITLE_BYTES};
use crate::placement;
use crate::read_token::ReadToken;
use crate::schema;
use crate::shards::Batch;

impl Ingestor {
    /// Writes a batch of backed-up documents into `r.collection`.
    pub async fn restore(
        &self,
        r: RestoreDocumentsRequest,
        client_timeout: Option<Duration>,
    ) -> Result<UpsertDocumentsResponse> {
        let started = Instant::now();
        check_collection("collection", &r.collection)?;
        let (info, mirror) = self.catalog.write_route(&r.collection)?;
        check_restore(&r.documents, &info)?;
        let ids: Vec<String> = r.documents.iter().map(|d| d.doc_id.clone()).collect();
        let chunks_of: HashMap<String, usize> = r
            .documents
            .iter()
            .map(|d| (d.doc_id.clone(), d.chunks.len()))
            .collect();
        let mut per_shard: BTreeMap<u32, Vec<DocumentWrite>> = BTreeMap::new();
        for d in r.documents {
            let shard = placement::shard_for_doc(&d.doc_id, info.shard_count);
            per_shard.entry(shard).or_default().push(d);
        }
        let copies = mirror.as_ref().map(|_| per_shard.clone());
        let batches = per_shard
            .into_iter()
            .map(|(s, w)| (s, Batch::Writes(w)))
            .collect();
        let timeout = self.timeout(client_timeout, started);
        let outcomes = (self.write_shards(&info, batches, mirror.as_ref(), timeout)).await;
        if let (Some(m), Some(copies)) = (&mirror, copies) {
            self.mirror_writes(m, copies, &outcomes, timeout).await?;
        }
        let mut token = ReadToken::default();
        raise(&mut token, &outcomes);
        let mut report = Report::new(&ids, &chunks_of, outcomes, &info.name);
        report.response.read_token = token.encode(&info);
        metrics::counter!("coordinator_restored_documents_total")
            .increment(u64::from(report.response.documents));
        report.into_result()
    }
}

/// Checks a restore batch whole: ids, each chunk against its document and position (ids
/// `doc#position`, positions increasing), sizes, vectors of the collection's dimension, and
/// fields the collection's schema has with the same types.
pub fn check_restore(docs: &[DocumentWrite], info: &CollectionInfo) -> Result<()> {
    if docs.is_empty() {
        return Err(CoordError::invalid("documents", "is empty"));
    }
    if docs.len() > MAX_DOCS_PER_BATCH {
        return Err(CoordError::TooLarge {
            field: "documents".into(),
            reason: format!(
                "{} documents in one call, at most {MAX_DOCS_PER_BATCH}",
                docs.len()
            ),
        });
    }
    let mut seen = HashSet::new();
    for (i, d) in docs.iter().enumerate() {
        let at = format!("documents[{i}]");
        check_id(&format!("{at}.doc_id"), &d.doc_id)?;
        if !seen.insert(d.doc_id.as_str()) {
            return Err(CoordError::invalid(
                format!("{at}.doc_id"),
                format!("{:?} appears more than once in the batch", d.doc_id),
            ));
        }
        if d.delete {
            return Err(CoordError::invalid(
                format!("{at}.delete"),
                "is set: a restore writes documents",
            ));
        }
        if d.chunks.is_empty() {
            return Err(CoordError::invalid(format!("{at}.chunks"), "is empty"));
        }
        for (j, c) in d.chunks.iter().enumerate() {
            check_chunk(&format!("{at}.chunks[{j}]"), d, j, c, info.dimension)?;
        }
    }
    let unknown = schema::chunk_growth(docs, info)?;
    if let Some(f) = unknown.first() {
        return Err(CoordError::invalid(
            "documents",
            format!(
                "field {:?} is not in the schema of {} (a restore creates the collection with \
                 the backup's schema first)",
                f.name, info.name
            ),
        ));
    }
    Ok(())
}

/// Chunk `j` of document `d`: its ids and position, sizes and vector. Neighbour links are
/// written back as saved (a shard stores what its writer linked).
fn check_chunk(at: &str, d: &DocumentWrite, j: usize, c: &Chunk, dimension: u32) -> Result<()> {
    if c.doc_id != d.doc_id {
        return Err(CoordError::invalid(
            format!("{at}.doc_id"),
            format!("is {:?}; the chunk is in document {:?}", c.doc_id, d.doc_id),
        ));
    }
    let id = format!("{}#{}", d.doc_id, c.position);
    if c.chunk_id != id {
        return Err(CoordError::invalid(
            format!("{at}.chunk_id"),
            format!(
                "is {:?}; the chunk at position {} has {id:?}",
                c.chunk_id, c.position
            ),
        ));
    }
    if j > 0 && c.position <= d.chunks[j - 1].position {
        return Err(CoordError::invalid(
            format!("{at}.position"),
            format!(
                "is {}, not after the previous chunk's {}",
                c.position,
                d.chunks[j - 1].position
            ),
        ));
    }
    if c.text.trim().is_empty() {
        return Err(CoordError::invalid(format!("{at}.text"), "is empty"));
    }
    if c.text.len() > MAX_DOC_BYTES {
        return Err(CoordError::TooLarge {
            field: format!("{at}.text"),
            reason: format!("{} bytes, at most {MAX_DOC_BYTES}", c.text.len()),
        });
    }
    if c.title.len() > MAX_TITLE_BYTES || c.section.len() > MAX_TITLE_BYTES {
        return Err(CoordError::invalid(
            format!("{at}.title"),
            format!("title or section is longer than {MAX_TITLE_BYTES} bytes"),
        ));
    }
    // The document's metadata and the chunker's `section`.
    if c.metadata.len() > MAX_METADATA_ENTRIES + 1 {
        return Err(CoordError::invalid(
            format!("{at}.metadata"),
            format!("has more than {MAX_METADATA_ENTRIES} entries"),
        ));
    }
    if c.embedding.len() != dimension as usize {
        return Err(CoordError::invalid(
            format!("{at}.embedding"),
            format!(
                "has dimension {}; the collection's is {dimension}",
                c.embedding.len()
            ),
        ));
    }
    if let Some(why) = vector_problem(&c.embedding) {
        return Err(CoordError::invalid(format!("{at}.embedding"), why));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info() -> CollectionInfo {
        CollectionInfo {
            name: "c".into(),
            shard_count: 2,
            dimension: 2,
            fields: vec![FieldSchema {
                name: "year".into(),
                r#type: FieldType::Integer as i32,
            }],
            ..Default::default()
        }
    }

    fn doc(id: &str, n: usize) -> DocumentWrite {
        let chunks = (0..n)
            .map(|j| Chunk {
                chunk_id: format!("{id}#{j}"),
                doc_id: id.into(),
                position: j as u32,
                prev_chunk_id: if j > 0 {
                    format!("{id}#{}", j - 1)
                } else {
                    String::new()
                },
                next_chunk_id: if j + 1 < n {
                    format!("{id}#{}", j + 1)
                } else {
                    String::new()
                },
                text: format!("chunk {j}"),
                embedding: vec![0.6, 0.8],
                fields: [(
                    "year".to_owned(),
                    Value {
                        kind: Some(value::Kind::Integer(2001)),
                    },
                )]
                .into(),
                ..Default::default()
            })
            .collect();
        DocumentWrite {
            doc_id: id.into(),
            chunks,
            delete: false,
        }
    }

    #[test]
    fn restored_documents_are_checked_whole_naming_the_path() {
        let info = info();
        let err = |docs: &[DocumentWrite]| check_restore(docs, &info).unwrap_err().to_string();
        assert!(check_restore(&[doc("a", 3), doc("b", 1)], &info).is_ok());
        assert!(err(&[]).contains("documents"));
        assert!(err(&[doc("a", 1), doc("a", 2)]).contains("documents[1].doc_id"));
        let mut d = doc("a", 3);
        d.chunks[1].chunk_id = "a#7".into();
        assert!(err(&[d]).contains("documents[0].chunks[1].chunk_id"));
        let mut d = doc("a", 3);
        d.chunks.remove(1);
        assert!(check_restore(&[d], &info).is_ok(), "positions may skip");
        let mut d = doc("a", 3);
        d.chunks.swap(1, 2);
        assert!(err(&[d]).contains("documents[0].chunks[2].position"));
        let mut d = doc("a", 2);
        d.chunks[1].doc_id = "b".into();
        assert!(err(&[d]).contains("documents[0].chunks[1].doc_id"));
        let mut d = doc("a", 2);
        d.chunks[1].embedding = vec![1.0, 0.0, 0.0];
        assert!(err(&[d]).contains("documents[0].chunks[1].embedding: has dimension 3"));
        let mut d = doc("a", 1);
        d.chunks[0].fields.insert(
            "year".into(),
            Value {
                kind: Some(value::Kind::Keyword("x".into())),
            },
        );
        assert!(err(&[d]).contains("documents[0].chunks[0].fields[\"year\"]"));
        let mut d = doc("a", 1);
        d.chunks[0].metadata.insert("lang".into(), "en".into());
        assert!(err(&[d]).contains("\"lang\" is not in the schema"));
        let mut d = doc("a", 1);
        d.delete = true;
        assert!(err(&[d]).contains("documents[0].delete"));
        let many: Vec<DocumentWrite> = (0..=MAX_DOCS_PER_BATCH)
            .map(|i| doc(&i.to_string(), 1))
            .collect();
        assert!(matches!(
            check_restore(&many, &info),
            Err(CoordError::TooLarge { .. })
        ));
    }
}
