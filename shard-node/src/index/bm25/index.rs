//! The tantivy index of one shard: staging and committing writes with the applied seq as
//! payload, searches with local or collection-wide statistics, segment merges.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, Ordering};

use parking_lot::Mutex;
use ragcluster_proto::v1::{Chunk, DocumentWrite, GlobalBm25Stats};
use tantivy::collector::{Count, TopDocs};
use tantivy::query::{
    Bm25StatisticsProvider, BooleanQuery, ConstScoreQuery, EmptyQuery, Occur, Query, TermQuery,
};
use tantivy::schema::{Field, IndexRecordOption};
use tantivy::{Index, IndexReader, IndexWriter, ReloadPolicy, TantivyDocument, Term};

use super::ids::{IdCache, SegmentIds};
use super::terms::{LocalStats, TermCache, score_all};
use super::{
    CHUNK_ID, EXHAUSTIVE_BELOW_DOCS, Scoring, TERM_AT_A_TIME_BELOW_DOCS, TOKENIZER, analyzer,
    indexed_text, schema,
};
use crate::error::{Result, ShardError};
use crate::index::Filter;

pub struct Bm25Index {
    index: Index,
    writer: Mutex<IndexWriter>,
    pub(super) reader: IndexReader,
    f_chunk_id: Field,
    f_doc_id: Field,
    f_body: Field,
    pub(super) f_meta: Field,
    /// Chunk ids of hits by segment, decoded once per segment.
    pub(super) ids: IdCache,
    /// A `merge_segments` merge is running.
    merging: Arc<AtomicBool>,
    /// How long the last merge took, in milliseconds.
    merge_ms: Arc<AtomicU64>,
    /// How searches traverse the postings (`Scoring`, as u8).
    scoring: AtomicU8,
    term_cache: Mutex<TermCache>,
}

impl Bm25Index {
    pub fn open(dir: &Path, writer_memory: usize) -> Result<Self> {
        std::fs::create_dir_all(dir)?;
        let mmap =
            tantivy::directory::MmapDirectory::open(dir).map_err(|e| ShardError::Bm25(e.into()))?;
        let index = Index::open_or_create(mmap, schema())?;
        index.tokenizers().register(TOKENIZER, analyzer());
        let schema = index.schema();
        let field = |n: &str| schema.get_field(n).map_err(ShardError::Bm25);
        let writer = index.writer_with_num_threads(1, writer_memory)?;
        // A kill between a commit's files and its meta.json leaves files no meta names, such
        // as a delete bitset named after an opstamp that the replay after restart reaches
        // again (its commit then fails on FileAlreadyExists): tantivy's collector removes
        // the files it wrote that the committed meta does not use.
        writer.garbage_collect_files().wait()?;
        let reader = index
            .reader_builder()
            .reload_policy(ReloadPolicy::Manual)
            .try_into()?;
        Ok(Self {
            f_chunk_id: field(CHUNK_ID)?,
            f_doc_id: field("doc_id")?,
            f_body: field("body")?,
            f_meta: field("meta")?,
            index,
            writer: Mutex::new(writer),
            reader,
            ids: IdCache::default(),
            merging: Arc::default(),
            merge_ms: Arc::default(),
            scoring: AtomicU8::new(Scoring::Auto as u8),
            term_cache: Mutex::default(),
        })
    }

    /// Files of the committed segments whose content fails its checksum (empty when sound).
    pub fn damaged_files(&self) -> Result<std::collections::HashSet<std::path::PathBuf>> {
        Ok(self.index.validate_checksum()?)
    }

    /// Sequence number of the last committed batch (0 for a new index).
    pub fn committed_seq(&self) -> Result<u64> {
        let metas = self.index.load_metas()?;
        Ok(metas
            .payload
            .as_deref()
            .and_then(|p| p.parse().ok())
            .unwrap_or(0))
    }

    /// Stages a batch: replaced or deleted documents lose all their chunks, new chunks are added.
    pub fn stage(&self, writes: &[DocumentWrite]) -> Result<()> {
        let w = self.writer.lock();
        for dw in writes {
            w.delete_term(Term::from_field_text(self.f_doc_id, &dw.doc_id));
            if dw.delete {
                continue;
            }
            for c in &dw.chunks {
                w.add_document(self.document(c))?;
            }
        }
        Ok(())
    }

    /// Adds chunks without deleting anything first (rebuilds and bulk loads).
    pub fn stage_chunks(&self, chunks: &[Chunk]) -> Result<()> {
        let w = self.writer.lock();
        for c in chunks {
            w.add_document(self.document(c))?;
        }
        Ok(())
    }

    fn document(&self, c: &Chunk) -> TantivyDocument {
        let mut doc = TantivyDocument::default();
        doc.add_text(self.f_chunk_id, &c.chunk_id);
        doc.add_text(self.f_doc_id, &c.doc_id);
        doc.add_text(self.f_body, indexed_text(&c.title, &c.section, &c.text));
        for term in crate::index::filter::terms(&crate::index::filter::meta_of(c)) {
            doc.add_text(self.f_meta, term);
        }
        doc
    }

    /// Drops what is staged and starts a fresh tantivy writer at the last commit: a failed
    /// commit (a full disk) or a killed indexing thread leaves the old one unusable.
    pub fn restart_writer(&self) -> Result<()> {
        self.writer.lock().rollback()?;
        Ok(())
    }

    /// Removes every document (before a rebuild from RocksDB).
    pub fn clear(&self) -> Result<()> {
        self.writer.lock().delete_all_documents()?;
        Ok(())
    }

    /// Commits staged changes durably with `seq` as payload and makes them searchable.
    pub fn commit(&self, seq: u64) -> Result<()> {
        // A commit failing as on a full disk (the fault tests arm it on one node).
        #[cfg(feature = "failpoints")]
        fail::fail_point!("bm25_commit_enospc", |_| Err(ShardError::Io(
            std::io::Error::from_raw_os_error(28)
        )));
        {
            let mut w = self.writer.lock();
            let mut prepared = w.prepare_commit()?;
            prepared.set_payload(&seq.to_string());
            prepared.commit()?;
        }
        self.reader.reload()?;
        Ok(())
    }

    /// Merges every segment into one in tantivy's merge thread (a force merge once writes
    /// pause): each query pays per-segment costs in every segment (a term-dictionary lookup
    /// per term, postings and field norms opened, block-max WAND set up), and tantivy's own
    /// policy leaves up to 7 segments per level. Returns false when there is one segment or
    /// a merge still runs. Searches see the merged segment once it is done (the reader is
    /// reloaded then); the commit payload (the applied seq) is kept by tantivy. Document
    /// frequencies count deleted documents until their segment is merged (as in Lucene): a
    /// merge lowers them without moving the visible seq, so statistics a coordinator cached
    /// keep counting them until the next write.
    pub fn merge_segments(&self) -> Result<bool> {
        let ids = self.index.searchable_segment_ids()?;
        if ids.len() < 2 || self.merging.swap(true, Ordering::AcqRel) {
            return Ok(false);
        }
        let started = std::time::Instant::now();
        let merge = self.writer.lock().merge(&ids);
        let (reader, merging, merge_ms) = (
            self.reader.clone(),
            self.merging.clone(),
            self.merge_ms.clone(),
        );
        let segments = ids.len();
        let spawned = std::thread::Builder::new()
            .name("bm25-merge".into())
            .spawn(move || {
                match merge.wait() {
                    Ok(_) => {
                        if let Err(e) = reader.reload() {
                            tracing::warn!(error = %e, "bm25 reader reload after a merge");
                        }
                        let secs = started.elapsed().as_secs_f64();
                        merge_ms.store((secs * 1e3) as u64, Ordering::Release);
                        metrics::histogram!("shard_bm25_merge_seconds").record(secs);
                        tracing::debug!(
                            segments,
                            ms = (secs * 1e3) as u64,
                            "bm25 segments merged into one"
                        );
                    }
                    // Writes that removed a segment meanwhile (a clear) cancel the merge.
                    Err(e) => tracing::debug!(error = %e, "bm25 merge not applied"),
                }
                merging.store(false, Ordering::Release);
            });
        if let Err(e) = spawned {
            self.merging.store(false, Ordering::Release);
            return Err(e.into());
        }
        Ok(true)
    }

    /// How long the last `merge_segments` took.
    pub fn last_merge(&self) -> std::time::Duration {
        std::time::Duration::from_millis(self.merge_ms.load(Ordering::Acquire))
    }

    /// Analysed query terms, in query order (repeats kept: a repeated term weighs more, as in
    /// Lucene's BooleanQuery).
    pub fn analyze(&self, text: &str) -> Vec<String> {
        let mut a = analyzer();
        let mut ts = a.token_stream(text);
        let mut out = Vec::new();
        while ts.advance() {
            out.push(ts.token().text.clone());
        }
        out
    }

    /// Local statistics for the query's terms: (documents incl. deleted ones not yet merged
    /// away, tokens in the body field, document frequency per term), i.e. exactly what tantivy
    /// itself would use for one index.
    pub fn term_stats(&self, text: &str) -> Result<(u64, u64, HashMap<String, u64>)> {
        let searcher = self.reader.searcher();
        let mut df = HashMap::new();
        for t in self.analyze(text) {
            let term = Term::from_field_text(self.f_body, &t);
            let n = searcher.doc_freq(&term)?;
            df.insert(t, n);
        }
        Ok((
            Bm25StatisticsProvider::total_num_docs(&searcher)?,
            Bm25StatisticsProvider::total_num_tokens(&searcher, self.f_body)?,
            df,
        ))
    }

    pub fn search(
        &self,
        text: &str,
        top_k: usize,
        filter: &Filter,
        stats: Option<&GlobalBm25Stats>,
    ) -> Result<Vec<(String, f32)>> {
        let searcher = self.reader.searcher();
        let terms = self.analyze(text);
        if terms.is_empty() || top_k == 0 {
            return Ok(Vec::new());
        }
        let terms: Vec<Term> = terms
            .iter()
            .map(|t| Term::from_field_text(self.f_body, t))
            .collect();
        let local = LocalStats::new(&searcher, self.f_body, &self.term_cache);
        let global = stats.map(|s| GlobalStats {
            stats: s,
            local: &local,
            body: self.f_body,
        });
        let provider: &dyn Bm25StatisticsProvider = match &global {
            Some(g) => g,
            None => &local,
        };
        let docs = searcher.num_docs();
        let (taat, every) = match self.scoring() {
            Scoring::Auto => (
                docs < TERM_AT_A_TIME_BELOW_DOCS,
                docs < EXHAUSTIVE_BELOW_DOCS,
            ),
            Scoring::BlockWand => (false, false),
            Scoring::EveryMatch => (false, true),
            Scoring::TermAtATime => (true, true),
        };
        let top = if taat && filter.is_empty() {
            score_all(&local, &terms, provider, top_k)?
        } else {
            let query = self.query(terms, filter, searcher.num_docs() == 0);
            let collector = TopDocs::with_limit(top_k).order_by_score();
            if every {
                // Paired with a count, the top-k collector takes tantivy's plain `for_each`
                // traversal (a tuple of collectors cannot prune).
                let both = (collector, Count);
                searcher
                    .search_with_statistics_provider(&*query, &both, provider)?
                    .0
            } else {
                searcher.search_with_statistics_provider(&*query, &collector, provider)?
            }
        };
        let mut segments: Vec<Option<Arc<SegmentIds>>> =
            vec![None; searcher.segment_readers().len()];
        let mut out = Vec::with_capacity(top.len());
        for (score, addr) in top {
            let seg = addr.segment_ord as usize;
            if segments[seg].is_none() {
                segments[seg] = self.ids.segment(&searcher, addr.segment_ord)?;
            }
            if let Some(id) = segments[seg].as_ref().and_then(|s| s.get(addr.doc_id)) {
                out.push((id.to_owned(), score));
            }
        }
        Ok(out)
    }

    /// The tantivy query: the body terms as SHOULD clauses, every filter pair a MUST clause
    /// that scores zero.
    fn query(&self, terms: Vec<Term>, filter: &Filter, empty_index: bool) -> Box<dyn Query> {
        if empty_index {
            return Box::new(EmptyQuery);
        }
        let should: Vec<(Occur, Box<dyn Query>)> = terms
            .into_iter()
            .map(|t| {
                let q: Box<dyn Query> = Box::new(TermQuery::new(t, IndexRecordOption::WithFreqs));
                (Occur::Should, q)
            })
            .collect();
        let query: Box<dyn Query> = Box::new(BooleanQuery::new(should));
        let Some(filter_q) = self.filter_query(filter) else {
            return query;
        };
        // The filter must not change scores: wrap it in a zero constant score.
        let filter_q: Box<dyn Query> = Box::new(ConstScoreQuery::new(filter_q, 0.0));
        Box::new(BooleanQuery::new(vec![
            (Occur::Must, filter_q),
            (Occur::Must, query),
        ]))
    }

    /// Forces a traversal (default `Scoring::Auto`), for benchmarks and tests that compare
    /// them.
    pub fn set_scoring(&self, scoring: Scoring) {
        self.scoring.store(scoring as u8, Ordering::Relaxed);
    }

    fn scoring(&self) -> Scoring {
        match self.scoring.load(Ordering::Relaxed) {
            1 => Scoring::BlockWand,
            2 => Scoring::EveryMatch,
            3 => Scoring::TermAtATime,
            _ => Scoring::Auto,
        }
    }

    pub fn num_docs(&self) -> u64 {
        self.reader.searcher().num_docs()
    }

    /// Bytes of the index's segment files.
    pub fn size_bytes(&self) -> u64 {
        self.reader
            .searcher()
            .space_usage()
            .map(|u| u.total().get_bytes())
            .unwrap_or(0)
    }
}

/// Collection-wide statistics for body terms; anything else (the metadata filter, scored at
/// zero anyway) falls back to the shard's own numbers.
struct GlobalStats<'a> {
    stats: &'a GlobalBm25Stats,
    local: &'a LocalStats<'a>,
    body: Field,
}

impl Bm25StatisticsProvider for GlobalStats<'_> {
    fn total_num_tokens(&self, field: Field) -> tantivy::Result<u64> {
        if field == self.body {
            Ok(self.stats.total_tokens)
        } else {
            Bm25StatisticsProvider::total_num_tokens(self.local, field)
        }
    }

    fn total_num_docs(&self) -> tantivy::Result<u64> {
        // Never below the local count, so idf stays defined even with stale global numbers.
        Ok(self
            .stats
            .num_docs
            .max(Bm25StatisticsProvider::total_num_docs(self.local)?))
    }

    fn doc_freq(&self, term: &Term) -> tantivy::Result<u64> {
        let local = self.local.doc_freq(term)?;
        if term.field() != self.body {
            return Ok(local);
        }
        let global = term
            .value()
            .as_str()
            .and_then(|t| self.stats.doc_freq.get(t).copied())
            .unwrap_or(local);
        Ok(global.max(local))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(doc: &str, texts: &[&str]) -> DocumentWrite {
        DocumentWrite {
            doc_id: doc.into(),
            chunks: texts
                .iter()
                .enumerate()
                .map(|(i, t)| Chunk {
                    chunk_id: format!("{doc}#{i}"),
                    doc_id: doc.into(),
                    text: t.to_string(),
                    metadata: [(
                        "lang".to_string(),
                        if doc == "b" { "de" } else { "en" }.to_string(),
                    )]
                    .into(),
                    ..Default::default()
                })
                .collect(),
            delete: false,
        }
    }

    #[test]
    fn stems_stops_and_filters() {
        let dir = tempfile::tempdir().unwrap();
        let idx = Bm25Index::open(dir.path(), 20_000_000).unwrap();
        assert_eq!(idx.analyze("The Running of the Dogs"), vec!["run", "dog"]);
        idx.stage(&[
            write("a", &["dogs are running fast", "cats sleep"]),
            write("b", &["a dog runs"]),
        ])
        .unwrap();
        idx.commit(7).unwrap();
        assert_eq!(idx.committed_seq().unwrap(), 7);
        let hits = idx
            .search("running dog", 10, &crate::index::Filter::default(), None)
            .unwrap();
        assert_eq!(hits.len(), 2);
        let hits = idx
            .search(
                "dog",
                10,
                &crate::index::Filter::keywords([("lang", "de")]),
                None,
            )
            .unwrap();
        assert_eq!(
            hits.iter().map(|h| h.0.as_str()).collect::<Vec<_>>(),
            vec!["b#0"]
        );
        // Replacing a document removes its old chunks.
        idx.stage(&[write("a", &["birds"])]).unwrap();
        idx.commit(8).unwrap();
        let hits = idx
            .search("dog cats", 10, &crate::index::Filter::default(), None)
            .unwrap();
        assert_eq!(
            hits.iter().map(|h| h.0.as_str()).collect::<Vec<_>>(),
            vec!["b#0"]
        );
    }

    /// A search that took its searcher before a commit runs beside searches of the new
    /// generation: its term lookups must not fill the shared cache for them (a document the
    /// new generation holds would be scored as absent; the seed-3 linearizability failure of
    /// the Raft fault schedules).
    #[test]
    fn an_older_searcher_leaves_the_term_cache_to_the_newest_generation() {
        let dir = tempfile::tempdir().unwrap();
        let idx = Bm25Index::open(dir.path(), 20_000_000).unwrap();
        idx.stage(&[write("a", &["alpha"])]).unwrap();
        idx.commit(1).unwrap();
        let old = idx.reader.searcher();
        idx.stage(&[write("b", &["zeta holds"])]).unwrap();
        idx.commit(2).unwrap();
        let new = idx.reader.searcher();
        let zeta = Term::from_field_text(idx.f_body, "zeta");
        let fresh = LocalStats::new(&new, idx.f_body, &idx.term_cache);
        let stale = LocalStats::new(&old, idx.f_body, &idx.term_cache);
        assert_eq!(Bm25StatisticsProvider::doc_freq(&stale, &zeta).unwrap(), 0);
        assert_eq!(
            Bm25StatisticsProvider::total_num_tokens(&stale, idx.f_body).unwrap(),
            1
        );
        assert_eq!(Bm25StatisticsProvider::doc_freq(&fresh, &zeta).unwrap(), 1);
        assert_eq!(
            Bm25StatisticsProvider::total_num_tokens(&fresh, idx.f_body).unwrap(),
            3
        );
        let hits = idx
            .search("zeta", 3, &crate::index::Filter::default(), None)
            .unwrap();
        assert_eq!(
            hits.iter().map(|h| h.0.as_str()).collect::<Vec<_>>(),
            ["b#0"]
        );
        // The older searcher, asked again after the newer one filled the cache, still
        // answers for its own segments.
        let stale = LocalStats::new(&old, idx.f_body, &idx.term_cache);
        assert_eq!(Bm25StatisticsProvider::doc_freq(&stale, &zeta).unwrap(), 0);
    }

    /// Hit ids come from the per-segment id cache: right across many segments, after
    /// replacements (deleted docs keep their place in a segment) and after a merge.
    #[test]
    fn hit_ids_stay_right_across_segments_and_merges() {
        let dir = tempfile::tempdir().unwrap();
        let idx = Bm25Index::open(dir.path(), 20_000_000).unwrap();
        for (seq, doc) in ["p", "q", "r", "s"].iter().enumerate() {
            let texts: Vec<String> = (0..5).map(|i| format!("common word{i} {doc}x")).collect();
            let refs: Vec<&str> = texts.iter().map(String::as_str).collect();
            idx.stage(&[write(doc, &refs)]).unwrap();
            idx.commit(seq as u64 + 1).unwrap();
        }
        let ids = |q: &str| -> Vec<String> {
            let mut v: Vec<String> = idx
                .search(q, 50, &crate::index::Filter::default(), None)
                .unwrap()
                .into_iter()
                .map(|h| h.0)
                .collect();
            v.sort();
            v
        };
        assert_eq!(
            ids("rx"),
            (0..5).map(|i| format!("r#{i}")).collect::<Vec<_>>()
        );
        assert_eq!(ids("word3").len(), 4);
        assert_eq!(ids("word3")[2], "r#3");
        // q replaced by two chunks: the old five are deleted in their segment.
        idx.stage(&[write("q", &["fresh qx", "fresh word3"])])
            .unwrap();
        idx.commit(5).unwrap();
        assert_eq!(ids("qx"), vec!["q#0".to_string()]);
        assert_eq!(ids("word3"), ["p#3", "q#1", "r#3", "s#3"].map(String::from));
        // One merged segment (`merge_segments`, as the index worker runs it when writes
        // pause): new segment ids, ids still right, the commit payload kept.
        assert!(idx.index.searchable_segment_ids().unwrap().len() > 1);
        assert!(idx.merge_segments().unwrap());
        let until = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while idx.reader.searcher().segment_readers().len() > 1 {
            assert!(std::time::Instant::now() < until, "merge not visible");
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert!(
            !idx.merge_segments().unwrap(),
            "one segment: nothing to merge"
        );
        assert_eq!(idx.committed_seq().unwrap(), 5);
        assert_eq!(ids("word3"), ["p#3", "q#1", "r#3", "s#3"].map(String::from));
        assert_eq!(ids("sx").len(), 5);
        // Reopened: the merged segment and the payload are durable.
        drop(idx);
        let idx = Bm25Index::open(dir.path(), 20_000_000).unwrap();
        assert_eq!(idx.index.searchable_segment_ids().unwrap().len(), 1);
        assert_eq!(idx.committed_seq().unwrap(), 5);
    }

    /// Block-WAND pruning, tantivy scoring every match and term-at-a-time scoring rank alike:
    /// same scores, deleted documents skipped, a filter and global statistics applied.
    #[test]
    fn exhaustive_and_block_wand_agree() {
        let dir = tempfile::tempdir().unwrap();
        let idx = Bm25Index::open(dir.path(), 20_000_000).unwrap();
        let words = [
            "alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta",
        ];
        for seq in 0..3u64 {
            let writes: Vec<DocumentWrite> = (0..200u64)
                .map(|d| {
                    let n = d * 7 + seq * 3;
                    let text: Vec<&str> =
                        (0..12).map(|i| words[((n + i * i) % 8) as usize]).collect();
                    let t = text.join(" ");
                    write(&format!("d{}", d % 150), &[t.as_str()])
                })
                .collect();
            idx.stage(&writes).unwrap();
            idx.commit(seq + 1).unwrap();
        }
        let stats = GlobalBm25Stats {
            num_docs: 1000,
            total_tokens: 20_000,
            doc_freq: [("alpha".to_string(), 400)].into(),
        };
        let filter = crate::index::Filter::keywords([("lang", "en")]);
        for q in [
            "alpha beta",
            "gamma delta epsilon zeta eta",
            "theta alpha theta",
        ] {
            for (f, s) in [
                (&crate::index::Filter::default(), None),
                (&crate::index::Filter::default(), Some(&stats)),
                (&filter, None),
            ] {
                // 1,000: every live match, so the counts must agree too.
                for k in [10, 1000] {
                    let run = |scoring| {
                        idx.set_scoring(scoring);
                        idx.search(q, k, f, s).unwrap()
                    };
                    let wand = run(Scoring::BlockWand);
                    for other in [Scoring::EveryMatch, Scoring::TermAtATime] {
                        let hits = run(other);
                        assert_eq!(wand.len(), hits.len(), "{q} {other:?}");
                        for (a, b) in wand.iter().zip(&hits) {
                            assert!((a.1 - b.1).abs() < 1e-5, "{q}: {wand:?} vs {hits:?}");
                        }
                    }
                }
            }
        }
    }

    /// Cached term statistics follow the index: after a commit that adds documents with a
    /// term, its scores are those of a freshly opened index (no cache).
    #[test]
    fn cached_term_statistics_follow_commits() {
        let dir = tempfile::tempdir().unwrap();
        let idx = Bm25Index::open(dir.path(), 20_000_000).unwrap();
        idx.stage(&[write("a", &["rare word here"]), write("c", &["other text"])])
            .unwrap();
        idx.commit(1).unwrap();
        let before = idx
            .search("rare", 10, &crate::index::Filter::default(), None)
            .unwrap();
        idx.stage(&[write("b", &["rare again", "rare thrice"])])
            .unwrap();
        idx.commit(2).unwrap();
        let after = idx
            .search("rare", 10, &crate::index::Filter::default(), None)
            .unwrap();
        drop(idx);
        let fresh = Bm25Index::open(dir.path(), 20_000_000).unwrap();
        let expected = fresh
            .search("rare", 10, &crate::index::Filter::default(), None)
            .unwrap();
        assert_eq!(after.len(), 3);
        assert_eq!(after, expected);
        let score_a = |v: &[(String, f32)]| v.iter().find(|h| h.0 == "a#0").unwrap().1;
        assert!(
            score_a(&after) < score_a(&before),
            "idf of a commoner term is lower"
        );
    }
}
