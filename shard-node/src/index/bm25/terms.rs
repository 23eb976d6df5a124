//! Term lookups shared by every BM25 search of one searcher generation, and term-at-a-time
//! scoring for indexes small enough to score every match.
//!
//! Tantivy walks the term dictionary (an FST, cache misses) for each query term twice per
//! segment: for its document frequency (the BM25 weight) and for its postings. `TermCache`
//! keeps both answers per generation, so a term seen before costs a hash lookup.
//!
//! `score_all` then adds each term's BM25 contribution into a dense per-document array, one
//! postings block at a time, and picks the top k in one pass over the array. Over a few
//! hundred thousand documents this is cheaper than tantivy's generic scorer tree (a boxed
//! scorer per term, moved a few times, a bucketed union) for the same scores: each term's
//! weight is tantivy's own `Bm25Weight`, summed in query order.

use std::cmp::Ordering as CmpOrdering;
use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::Mutex;
use tantivy::fieldnorm::FieldNormReader;
use tantivy::postings::{BlockSegmentPostings, TermInfo};
use tantivy::query::{Bm25StatisticsProvider, Bm25Weight};
use tantivy::schema::{Field, IndexRecordOption};
use tantivy::{DocAddress, Score, Searcher, Term};

/// What one term is in one searcher generation: its postings per segment and its document
/// frequency over all of them.
pub struct TermEntry {
    /// By segment ordinal; `None` where the segment lacks the term.
    infos: Vec<Option<TermInfo>>,
    doc_freq: u64,
}

/// Terms kept per generation at most (then the cache starts over).
const TERM_CACHE_TERMS: usize = 100_000;

/// The body field's term lookups and token count for one searcher generation.
#[derive(Default)]
pub struct TermCache {
    generation: u64,
    total_tokens: Option<u64>,
    terms: HashMap<Term, Arc<TermEntry>>,
}

/// The shard's own statistics, the body field's through a `TermCache`.
///
/// Searches of two generations run side by side (one took its searcher just before a commit
/// reloaded the reader), so the cache holds the newest generation only and a search reads or
/// fills it only while it holds the search's own: an entry of another generation has other
/// segments (its ordinals and document frequency belong to them), and a stale "absent here"
/// would hide a document the newer generation holds.
pub struct LocalStats<'a> {
    searcher: &'a Searcher,
    body: Field,
    cache: &'a Mutex<TermCache>,
    generation: u64,
}

impl<'a> LocalStats<'a> {
    /// Starts the cache over when `searcher` is a newer generation than it holds (or the
    /// cache is full); an older searcher leaves it alone and looks its terms up uncached.
    pub fn new(searcher: &'a Searcher, body: Field, cache: &'a Mutex<TermCache>) -> Self {
        let generation = searcher.generation().generation_id();
        let mut c = cache.lock();
        let newer = generation > c.generation;
        if newer || (generation == c.generation && c.terms.len() >= TERM_CACHE_TERMS) {
            *c = TermCache {
                generation,
                ..Default::default()
            };
        }
        drop(c);
        Self {
            searcher,
            body,
            cache,
            generation,
        }
    }

    /// The cache, when it holds this search's generation.
    fn cached(&self) -> Option<parking_lot::MutexGuard<'a, TermCache>> {
        let c = self.cache.lock();
        (c.generation == self.generation).then_some(c)
    }

    pub fn searcher(&self) -> &'a Searcher {
        self.searcher
    }

    /// Term `term` of the body field, looked up once per generation.
    pub fn entry(&self, term: &Term) -> tantivy::Result<Arc<TermEntry>> {
        if let Some(e) = self.cached().and_then(|c| c.terms.get(term).cloned()) {
            return Ok(e);
        }
        let mut infos = Vec::with_capacity(self.searcher.segment_readers().len());
        let mut doc_freq = 0u64;
        for seg in self.searcher.segment_readers() {
            let info = seg.inverted_index(self.body)?.get_term_info(term)?;
            doc_freq += info.as_ref().map_or(0, |i| u64::from(i.doc_freq));
            infos.push(info);
        }
        let e = Arc::new(TermEntry { infos, doc_freq });
        if let Some(mut c) = self.cached() {
            c.terms.insert(term.clone(), e.clone());
        }
        Ok(e)
    }
}

impl Bm25StatisticsProvider for LocalStats<'_> {
    fn total_num_tokens(&self, field: Field) -> tantivy::Result<u64> {
        if field != self.body {
            return Bm25StatisticsProvider::total_num_tokens(self.searcher, field);
        }
        if let Some(n) = self.cached().and_then(|c| c.total_tokens) {
            return Ok(n);
        }
        let n = Bm25StatisticsProvider::total_num_tokens(self.searcher, field)?;
        if let Some(mut c) = self.cached() {
            c.total_tokens = Some(n);
        }
        Ok(n)
    }

    fn total_num_docs(&self) -> tantivy::Result<u64> {
        Bm25StatisticsProvider::total_num_docs(self.searcher)
    }

    fn doc_freq(&self, term: &Term) -> tantivy::Result<u64> {
        if term.field() != self.body {
            return self.searcher.doc_freq(term);
        }
        Ok(self.entry(term)?.doc_freq)
    }
}

/// A candidate of the top k: higher score first, then the lower address (tantivy's order).
#[derive(Clone, Copy)]
struct Hit(Score, DocAddress);

impl Hit {
    fn better_than(&self, other: &Hit) -> bool {
        match self.0.partial_cmp(&other.0) {
            Some(CmpOrdering::Greater) => true,
            Some(CmpOrdering::Less) => false,
            _ => self.1 < other.1,
        }
    }
}

thread_local! {
    /// Per-document score sums of the segment being scored, all zero between calls.
    static SCORES: std::cell::RefCell<Vec<Score>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// The `top_k` best documents for the body terms `terms` (repeats count again), every match
/// scored as tantivy's `BooleanQuery` of `TermQuery` SHOULD clauses scores it: the same
/// weights (`provider`'s statistics), ties to the lower address. Deleted documents are
/// skipped.
pub fn score_all(
    local: &LocalStats<'_>,
    terms: &[Term],
    provider: &dyn Bm25StatisticsProvider,
    top_k: usize,
) -> tantivy::Result<Vec<(Score, DocAddress)>> {
    if terms.is_empty() || top_k == 0 {
        return Ok(Vec::new());
    }
    let mut weighted = Vec::with_capacity(terms.len());
    for t in terms {
        let entry = local.entry(t)?;
        if entry.doc_freq == 0 {
            continue;
        }
        let weight = Bm25Weight::for_terms(provider, std::slice::from_ref(t))?;
        weighted.push((entry, weight));
    }
    // Best first; once full, `top[top_k - 1]` is the bar to pass.
    let mut top: Vec<Hit> = Vec::with_capacity(top_k + 1);
    let scored = SCORES.with_borrow_mut(|scores| {
        let r = score_segments(local, &weighted, top_k, scores, &mut top);
        if r.is_err() {
            // A segment left half-added: the buffer must be all zero for the next query.
            scores.fill(0.0);
        }
        r
    });
    scored?;
    Ok(top.into_iter().map(|h| (h.0, h.1)).collect())
}

/// Adds every term's contribution per segment into `scores` and moves the segment's best
/// into `top` (zeroing `scores` on the way).
fn score_segments(
    local: &LocalStats<'_>,
    weighted: &[(Arc<TermEntry>, Bm25Weight)],
    top_k: usize,
    scores: &mut Vec<Score>,
    top: &mut Vec<Hit>,
) -> tantivy::Result<()> {
    // One postings reader, reset from term to term (opened with term frequencies).
    let mut postings: Option<BlockSegmentPostings> = None;
    for (ord, seg) in local.searcher().segment_readers().iter().enumerate() {
        let mut any = false;
        let max_doc = seg.max_doc() as usize;
        if scores.len() < max_doc {
            scores.resize(max_doc, 0.0);
        }
        let inverted = seg.inverted_index(local.body)?;
        let norms = match seg.fieldnorms_readers().get_field(local.body)? {
            Some(n) => n,
            None => FieldNormReader::constant(seg.max_doc(), 1),
        };
        for (entry, weight) in weighted {
            let Some(info) = &entry.infos[ord] else {
                continue;
            };
            any = true;
            let postings = match &mut postings {
                Some(p) => {
                    inverted.reset_block_postings_from_terminfo(info, p)?;
                    p
                }
                None => postings.insert(
                    inverted
                        .read_block_postings_from_terminfo(info, IndexRecordOption::WithFreqs)?,
                ),
            };
            loop {
                let docs = postings.docs();
                if docs.is_empty() {
                    break;
                }
                for (&d, &tf) in docs.iter().zip(postings.freqs()) {
                    scores[d as usize] += weight.score(norms.fieldnorm_id(d), tf);
                }
                postings.advance();
            }
        }
        if !any {
            continue;
        }
        let alive = seg.alive_bitset();
        // Documents come in address order, so a tie never displaces an earlier hit: a
        // candidate must beat the bar strictly (every match scores above zero).
        let mut bar = if top.len() == top_k {
            top[top_k - 1].0
        } else {
            0.0
        };
        for (d, &score) in scores[..max_doc].iter().enumerate() {
            if score <= bar {
                continue;
            }
            let d = d as u32;
            if alive.is_some_and(|a| a.is_deleted(d)) {
                continue;
            }
            let hit = Hit(score, DocAddress::new(ord as u32, d));
            let at = top.partition_point(|h| h.better_than(&hit));
            top.insert(at, hit);
            top.truncate(top_k);
            if top.len() == top_k {
                bar = top[top_k - 1].0;
            }
        }
        scores[..max_doc].fill(0.0);
    }
    Ok(())
}
