//! `ragctl ingest`: Markdown/text files, JSON-lines files and BEIR corpora into a collection,
//! with several upserts in flight so the coordinator can keep the model worker and the shards
//! busy at once. The progress bar shows chunks/s and where the time goes (the coordinator's
//! per-call chunk / embed / write timings); calls refused for load (RESOURCE_EXHAUSTED or
//! UNAVAILABLE with a `retry-after-ms` hint) are retried after the hint, which is safe because
//! upserts replace whole documents.

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use futures::{StreamExt, TryStreamExt, stream};
use indicatif::{ProgressBar, ProgressStyle};
use ragcluster_common::client::{KeyedChannel, retry_after_ms};
use ragcluster_proto::v1::coordinator_client::CoordinatorClient;
use ragcluster_proto::v1::*;
use serde::Deserialize;

use crate::Chunker;

/// Where documents come from.
#[derive(Debug, Clone, PartialEq)]
enum Source {
    /// A Markdown or text file: one document, id = its path, title = its first heading.
    File(PathBuf),
    /// JSON lines, one document each (a BEIR `corpus.jsonl` among them).
    Jsonl(PathBuf),
}

/// One JSON line: BEIR's `_id`/`title`/`text`, or `id`, plus optional metadata (scalar values
/// are stored as their text) and typed `fields` (`json_value`).
#[derive(Deserialize)]
struct JsonDoc {
    #[serde(rename = "_id", alias = "id")]
    id: serde_json::Value,
    #[serde(default)]
    title: String,
    #[serde(default)]
    text: String,
    #[serde(default)]
    metadata: HashMap<String, serde_json::Value>,
    #[serde(default)]
    fields: HashMap<String, serde_json::Value>,
}

/// A JSON value as a typed field: an integer, a float, a boolean, a string (keyword), an
/// array of strings (keyword list), or `{"datetime": "2024-05-01T00:00:00Z"}` (RFC 3339, UTC).
pub(crate) fn json_value(v: serde_json::Value) -> std::result::Result<Value, String> {
    use serde_json::Value as J;
    use value::Kind;
    let kind = match v {
        J::Bool(b) => Kind::Boolean(b),
        J::Number(n) => match n.as_i64() {
            Some(i) => Kind::Integer(i),
            None => Kind::Float(n.as_f64().ok_or("not a finite number")?),
        },
        J::String(s) => Kind::Keyword(s),
        J::Array(items) => Kind::Keywords(KeywordList {
            values: items
                .into_iter()
                .map(|x| match x {
                    J::String(s) => Ok(s),
                    other => Err(format!("a keyword list holds strings, not {other}")),
                })
                .collect::<std::result::Result<_, _>>()?,
        }),
        J::Object(m) => match m.get("datetime") {
            Some(J::String(t)) if m.len() == 1 => Kind::DatetimeUs(ragctl::filter::datetime_us(t)?),
            _ => return Err("an object field must be {\"datetime\": \"RFC 3339\"}".into()),
        },
        J::Null => return Err("null is not a value".into()),
    };
    Ok(Value { kind: Some(kind) })
}

fn text_of(v: serde_json::Value) -> String {
    match v {
        serde_json::Value::String(s) => s,
        v => v.to_string(),
    }
}

/// The sources under `paths`: a directory holding `corpus.jsonl` is a BEIR dataset (only its
/// corpus is read), other directories are walked for .md/.markdown/.txt files; files are
/// taken by extension.
fn sources(paths: &[PathBuf]) -> Result<Vec<Source>> {
    fn walk(p: &Path, out: &mut Vec<Source>, top: bool) -> Result<()> {
        if p.is_dir() {
            let corpus = p.join("corpus.jsonl");
            if corpus.is_file() {
                out.push(Source::Jsonl(corpus));
                return Ok(());
            }
            let mut entries: Vec<_> = std::fs::read_dir(p)
                .with_context(|| p.display().to_string())?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .collect();
            entries.sort();
            for e in entries {
                walk(&e, out, false)?;
            }
            return Ok(());
        }
        match p.extension().and_then(|e| e.to_str()) {
            Some("md" | "markdown" | "txt") => out.push(Source::File(p.to_path_buf())),
            Some("jsonl") if top => out.push(Source::Jsonl(p.to_path_buf())),
            _ if top => bail!(
                "{}: not a .md/.markdown/.txt/.jsonl file, a directory of them or a BEIR \
                 dataset directory (corpus.jsonl)",
                p.display()
            ),
            _ => {}
        }
        Ok(())
    }
    let mut out = Vec::new();
    for p in paths {
        if !p.exists() {
            bail!("{}: no such file or directory", p.display());
        }
        walk(p, &mut out, true)?;
    }
    if out.is_empty() {
        bail!("no .md/.txt/.jsonl files or BEIR corpora under the given paths");
    }
    Ok(out)
}

/// Title of a file: its first Markdown heading, else the file name.
fn title_of(path: &Path, text: &str) -> String {
    text.lines()
        .find_map(|l| l.strip_prefix("# ").map(|t| t.trim().to_owned()))
        .unwrap_or_else(|| {
            path.file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_default()
        })
}

fn file_document(f: &Path) -> Result<Document> {
    let text = std::fs::read_to_string(f).with_context(|| f.display().to_string())?;
    let mut metadata = HashMap::new();
    metadata.insert("path".to_string(), f.display().to_string());
    Ok(Document {
        fields: Default::default(),
        id: f.display().to_string(),
        title: title_of(f, &text),
        text,
        metadata,
        embedding: vec![],
    })
}

/// A JSON line as a document; None for a blank line or a row with neither text nor title
/// (BEIR corpora have a few; there is nothing to index).
fn json_document(path: &Path, n: usize, line: &str) -> Result<Option<Document>> {
    if line.trim().is_empty() {
        return Ok(None);
    }
    let d: JsonDoc = serde_json::from_str(line)
        .with_context(|| format!("{}:{n}: not a document line", path.display()))?;
    let id = text_of(d.id);
    if id.is_empty() {
        bail!("{}:{n}: empty id", path.display());
    }
    let metadata = d
        .metadata
        .into_iter()
        .map(|(k, v)| (k, text_of(v)))
        .collect();
    let mut fields = HashMap::new();
    for (k, v) in d.fields {
        let v = json_value(v)
            .map_err(|e| anyhow::anyhow!("{}:{n}: field {k:?}: {e}", path.display()))?;
        fields.insert(k, v);
    }
    Ok(corpus_document(id, d.title, d.text, metadata).map(|doc| Document { fields, ..doc }))
}

/// A corpus row as a document: a row without text is indexed by its title (BEIR corpora
/// have such rows), one with neither is None (nothing to index).
pub fn corpus_document(
    id: String,
    title: String,
    text: String,
    metadata: HashMap<String, String>,
) -> Option<Document> {
    let text = if text.trim().is_empty() {
        title.clone()
    } else {
        text
    };
    (!text.trim().is_empty()).then_some(Document {
        fields: Default::default(),
        id,
        title,
        text,
        metadata,
        embedding: vec![],
    })
}

/// Every document of `sources`, read lazily (a corpus is never held whole in memory).
fn documents(sources: Vec<Source>) -> impl Iterator<Item = Result<Option<Document>>> {
    sources
        .into_iter()
        .flat_map(|s| -> Box<dyn Iterator<Item = Result<Option<Document>>>> {
            match s {
                Source::File(f) => Box::new(std::iter::once(file_document(&f).map(Some))),
                Source::Jsonl(path) => match File::open(&path) {
                    Err(e) => Box::new(std::iter::once(
                        Err(e).with_context(|| path.display().to_string()),
                    )),
                    Ok(f) => Box::new(BufReader::new(f).lines().enumerate().map(move |(i, l)| {
                        let l = l.with_context(|| path.display().to_string())?;
                        json_document(&path, i + 1, &l)
                    })),
                },
            }
        })
}

/// Reads every source once before anything is sent, so a malformed line is reported before
/// the collection changes: (documents, rows skipped for having no text).
fn scan(sources: &[Source]) -> Result<(u64, u64)> {
    let (mut docs, mut empty) = (0, 0);
    for d in documents(sources.to_vec()) {
        match d? {
            Some(_) => docs += 1,
            None => empty += 1,
        }
    }
    Ok((docs, empty))
}

/// What an upload did, summed over its calls.
#[derive(Debug, Default, Clone, Copy)]
pub struct Totals {
    pub documents: u64,
    pub chunks: u64,
    /// Calls sent again after a load refusal or a deadline (`retry_wait`).
    pub retries: u64,
    /// Of those, the ones resent because the call ran out of time.
    pub late_resends: u64,
    pub chunk: Duration,
    pub embed: Duration,
    pub write: Duration,
}

impl Totals {
    fn add(&mut self, r: &UpsertDocumentsResponse) {
        self.documents += u64::from(r.documents);
        self.chunks += u64::from(r.chunks);
        if let Some(t) = &r.timings {
            self.chunk += Duration::from_micros(t.chunk_us);
            self.embed += Duration::from_micros(t.embed_us);
            self.write += Duration::from_micros(t.write_us);
        }
    }

    /// "chunk 3% embed 81% write 16%": each stage's share of the summed call time.
    pub fn split(&self) -> String {
        let all = (self.chunk + self.embed + self.write)
            .as_secs_f64()
            .max(1e-9);
        let pct = |d: Duration| 100.0 * d.as_secs_f64() / all;
        format!(
            "chunk {:.0}% embed {:.0}% write {:.0}%",
            pct(self.chunk),
            pct(self.embed),
            pct(self.write)
        )
    }
}

/// How long to wait before sending a failed batch again, or None when resending won't help.
/// Load refusals carry the coordinator's hint. A call that ran out of time (the model
/// worker's queue outgrew the deadline after it took the work, e.g. when the machine became
/// busy) is sent again too, waiting longer each time: an upsert replaces its documents by id,
/// so a second one writes the same thing. `late` counts this batch's earlier calls that ran
/// out of time.
fn retry_wait(s: &tonic::Status, late: u32) -> Option<Duration> {
    match s.code() {
        tonic::Code::ResourceExhausted | tonic::Code::Unavailable => {
            let ms = retry_after_ms(s)?;
            Some(Duration::from_millis(ms.clamp(10, 5_000)))
        }
        tonic::Code::DeadlineExceeded => Some(
            DEADLINE_BACKOFF
                .saturating_mul(1 << late.min(4))
                .min(MAX_DEADLINE_BACKOFF),
        ),
        _ => None,
    }
}

/// The first wait after a batch's call ran out of time, doubled on each further one.
const DEADLINE_BACKOFF: Duration = Duration::from_secs(1);
const MAX_DEADLINE_BACKOFF: Duration = Duration::from_secs(10);

/// Documents per upsert call by default. SciFact into 3 shards with the model excluded
/// (`ingestbench --docs 1500`): 2,000-2,300 chunks/s at 32 documents per call, 2,800-3,800
/// at 128, because each call costs every shard it touches a write of its own.
pub const DEFAULT_BATCH: usize = 128;

/// How long refusals may go on with no batch of the upload acknowledged before it fails. Not
/// per batch: while others go through, a batch refused for load (a slow model worker's
/// backlog) is the cluster asking it to wait its turn, not a failure.
const RETRY_BUDGET: Duration = Duration::from_secs(120);

/// When a batch of the upload was last acknowledged (or the upload started).
type Progress = parking_lot::Mutex<Instant>;

async fn send(
    mut c: CoordinatorClient<KeyedChannel>,
    collection: &str,
    documents: Vec<Document>,
    progress: &Progress,
) -> Result<(UpsertDocumentsResponse, u64, u32)> {
    let (mut retries, mut late) = (0, 0);
    loop {
        let req = UpsertDocumentsRequest {
            collection: collection.to_owned(),
            documents: documents.clone(),
            ..Default::default()
        };
        match c.upsert_documents(req).await {
            Ok(r) => {
                *progress.lock() = Instant::now();
                return Ok((r.into_inner(), retries, late));
            }
            Err(s) => match retry_wait(&s, late) {
                Some(wait) if progress.lock().elapsed() + wait < RETRY_BUDGET => {
                    retries += 1;
                    late += u32::from(s.code() == tonic::Code::DeadlineExceeded);
                    tokio::time::sleep(wait).await;
                }
                _ => {
                    let first = documents.first().map(|d| d.id.as_str()).unwrap_or("");
                    return Err(anyhow::anyhow!(
                        "upsert of {} documents from {first:?} failed: {:?}: {}",
                        documents.len(),
                        s.code(),
                        s.message()
                    ));
                }
            },
        }
    }
}

/// Uploads `docs` in calls of `batch` documents, `concurrency` calls in flight, advancing
/// `bar` by documents and showing chunks/s and the stage split.
pub async fn upload(
    client: &CoordinatorClient<KeyedChannel>,
    collection: &str,
    docs: impl Iterator<Item = Result<Document>>,
    batch: usize,
    concurrency: usize,
    bar: &ProgressBar,
) -> Result<Totals> {
    let started = Instant::now();
    let mut docs = docs.peekable();
    let batches = std::iter::from_fn(move || {
        docs.peek()?;
        Some(docs.by_ref().take(batch.max(1)).collect::<Result<Vec<_>>>())
    });
    let progress = Progress::new(started);
    let progress = &progress;
    let mut calls = stream::iter(batches)
        .map(|b| async move {
            let b = b?;
            let n = b.len() as u64;
            let (r, retries, late) = send(client.clone(), collection, b, progress).await?;
            Ok::<_, anyhow::Error>((n, r, retries, late))
        })
        .buffer_unordered(concurrency.max(1));
    let mut t = Totals::default();
    while let Some((n, r, retries, late)) = calls.try_next().await? {
        t.add(&r);
        t.retries += retries;
        t.late_resends += u64::from(late);
        bar.inc(n);
        let rate = t.chunks as f64 / started.elapsed().as_secs_f64().max(1e-3);
        bar.set_message(format!("{} chunks, {rate:.0}/s, {}", t.chunks, t.split()));
    }
    Ok(t)
}

/// Options of `ragctl ingest` past the paths and the collection.
pub struct IngestArgs<'a> {
    pub paths: &'a [PathBuf],
    pub collection: &'a str,
    pub batch: usize,
    pub concurrency: usize,
    pub chunking: Option<Chunker>,
    pub shards: Option<u32>,
    pub ef_construction: Option<u32>,
    /// Embedding model of a collection ingest creates (empty: the coordinator's default).
    pub embedding_model: &'a str,
    /// The summary as one JSON object, no progress bar.
    pub json: bool,
}

pub async fn ingest(c: CoordinatorClient<KeyedChannel>, a: IngestArgs<'_>) -> Result<()> {
    let sources = sources(a.paths)?;
    let (total, empty) = scan(&sources)?;
    if total == 0 {
        bail!("the given files hold no document with text");
    }
    let mut client = c;
    let exists = client
        .list_collections(ListCollectionsRequest {})
        .await?
        .into_inner()
        .collections
        .iter()
        .any(|c| c.name == a.collection);
    if !exists {
        // Files keep their headings (Markdown chunking); corpora are prose (sentence).
        let markdown = sources.iter().all(|s| matches!(s, Source::File(_)));
        let chunker = a.chunking.unwrap_or(if markdown {
            Chunker::Markdown
        } else {
            Chunker::Sentence
        });
        let info = client
            .create_collection(CreateCollectionRequest {
                name: a.collection.to_owned(),
                shard_count: a.shards.unwrap_or(0),
                chunking: Some(ChunkingConfig {
                    strategy: chunker.strategy() as i32,
                    ..Default::default()
                }),
                hnsw: a.ef_construction.map(|ef_construction| HnswParams {
                    ef_construction,
                    ..Default::default()
                }),
                embedding_model: a.embedding_model.to_owned(),
                ..Default::default()
            })
            .await?
            .into_inner();
        if !a.json {
            println!(
                "created collection {} ({} chunking, {} shards)",
                a.collection,
                chunker.name(),
                info.collection.map_or(0, |c| c.shard_count)
            );
        }
    } else if a.chunking.is_some() || a.shards.is_some() || a.ef_construction.is_some() {
        eprintln!(
            "note: {} exists; --chunking, --shards and --ef-construction apply only to a \
             collection ingest creates",
            a.collection
        );
    }
    let bar = if a.json {
        ProgressBar::hidden()
    } else {
        ProgressBar::new(total)
    };
    bar.set_style(ProgressStyle::with_template(
        "{bar:30} {pos}/{len} docs {msg} [{elapsed}]",
    )?);
    let started = Instant::now();
    let docs = documents(sources).filter_map(Result::transpose);
    let t = upload(&client, a.collection, docs, a.batch, a.concurrency, &bar).await?;
    bar.finish();
    let secs = started.elapsed().as_secs_f64();
    if a.json {
        println!(
            "{}",
            serde_json::json!({
                "collection": a.collection,
                "documents": t.documents,
                "chunks": t.chunks,
                "seconds": secs,
                "chunks_per_s": t.chunks as f64 / secs.max(1e-3),
                "calls_in_flight": a.concurrency.max(1),
                "chunk_s": t.chunk.as_secs_f64(),
                "embed_s": t.embed.as_secs_f64(),
                "write_s": t.write.as_secs_f64(),
                "retries": t.retries,
                "late_resends": t.late_resends,
                "skipped_without_text": empty,
            })
        );
        return Ok(());
    }
    println!(
        "ingested {} documents as {} chunks into {} in {secs:.1} s ({:.0} chunks/s, {:.0} \
         documents/s); time in calls: {} (chunk {:.1} s, embed {:.1} s, write {:.1} s summed \
         over {} calls in flight){}{}",
        t.documents,
        t.chunks,
        a.collection,
        t.chunks as f64 / secs.max(1e-3),
        t.documents as f64 / secs.max(1e-3),
        t.split(),
        t.chunk.as_secs_f64(),
        t.embed.as_secs_f64(),
        t.write.as_secs_f64(),
        a.concurrency.max(1),
        if empty > 0 {
            format!("; {empty} rows without text skipped")
        } else {
            String::new()
        },
        if t.retries > 0 {
            format!(
                "; {} calls resent after load refusals or deadlines ({} after running out of \
                 time)",
                t.retries, t.late_resends
            )
        } else {
            String::new()
        },
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_jsonl_rows_and_beir_directories() -> Result<()> {
        let d = std::env::temp_dir().join(format!("ragctl-ingest-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(d.join("beir/qrels"))?;
        std::fs::write(
            d.join("beir/corpus.jsonl"),
            "{\"_id\":\"d1\",\"title\":\"T\",\"text\":\"one\"}\n\n\
             {\"_id\":7,\"title\":\"only a title\",\"text\":\"\"}\n\
             {\"_id\":\"d3\",\"title\":\"\",\"text\":\" \"}\n",
        )?;
        std::fs::write(
            d.join("beir/queries.jsonl"),
            "{\"_id\":\"q\",\"text\":\"x\"}\n",
        )?;
        std::fs::write(
            d.join("rows.jsonl"),
            "{\"id\":\"r1\",\"text\":\"two\",\"metadata\":{\"year\":2024,\"lang\":\"en\"},\"fields\":{\"n\":3,\"x\":0.5,\"ok\":true,\"tags\":[\"a\"],\"at\":{\"datetime\":\"1970-01-01T00:00:01Z\"}}}\n",
        )?;
        let s = sources(&[d.join("beir"), d.join("rows.jsonl")])?;
        assert_eq!(
            s,
            vec![
                Source::Jsonl(d.join("beir/corpus.jsonl")),
                Source::Jsonl(d.join("rows.jsonl"))
            ]
        );
        assert_eq!(scan(&s)?, (3, 2));
        let docs: Vec<Document> = documents(s)
            .filter_map(Result::transpose)
            .collect::<Result<_>>()?;
        let ids: Vec<&str> = docs.iter().map(|d| d.id.as_str()).collect();
        assert_eq!(ids, ["d1", "7", "r1"]);
        assert_eq!(docs[1].text, "only a title");
        assert_eq!(docs[2].metadata["year"], "2024");
        assert_eq!(docs[2].metadata["lang"], "en");
        let kind = |k: &str| docs[2].fields[k].kind.clone();
        assert_eq!(kind("n"), Some(value::Kind::Integer(3)));
        assert_eq!(kind("x"), Some(value::Kind::Float(0.5)));
        assert_eq!(kind("ok"), Some(value::Kind::Boolean(true)));
        assert_eq!(kind("at"), Some(value::Kind::DatetimeUs(1_000_000)));
        assert!(json_value(serde_json::json!([1])).is_err());

        std::fs::write(
            d.join("bad.jsonl"),
            "{\"_id\":\"a\",\"text\":\"x\"}\n{oops\n",
        )?;
        let e = scan(&sources(&[d.join("bad.jsonl")])?).unwrap_err();
        assert!(format!("{e:#}").contains("bad.jsonl:2"), "{e:#}");
        let e = sources(&[d.join("beir/qrels")]).unwrap_err();
        assert!(e.to_string().contains("no .md/.txt/.jsonl"), "{e}");
        let e = sources(&[d.join("nothing.csv")]).unwrap_err();
        assert!(e.to_string().contains("no such file"), "{e}");
        std::fs::remove_dir_all(&d)?;
        Ok(())
    }

    #[test]
    fn hinted_load_refusals_and_deadlines_are_retried() {
        let mut s = tonic::Status::resource_exhausted("busy");
        s.metadata_mut()
            .insert("retry-after-ms", "250".parse().unwrap());
        assert_eq!(retry_wait(&s, 0), Some(Duration::from_millis(250)));
        assert_eq!(retry_wait(&s, 3), Some(Duration::from_millis(250)));
        // Too large a batch is RESOURCE_EXHAUSTED too, but without a hint: waiting won't help.
        assert_eq!(
            retry_wait(&tonic::Status::resource_exhausted("too large"), 0),
            None
        );
        let mut s = tonic::Status::invalid_argument("bad");
        s.metadata_mut()
            .insert("retry-after-ms", "250".parse().unwrap());
        assert_eq!(retry_wait(&s, 0), None);
        // Out of time: resent after 1, 2, 4, 8 s, then every 10 s.
        let late = tonic::Status::deadline_exceeded("waiting for model worker");
        let waits: Vec<u64> = (0..6)
            .map(|a| retry_wait(&late, a).unwrap().as_secs())
            .collect();
        assert_eq!(waits, [1, 2, 4, 8, 10, 10]);
    }
}
