//! Exact counts by metadata filter, and the chunk ids a filter matches (filtered scans): the
//! filter as a query over the metadata terms (`index::filter::terms`), every
//! live match counted, and its document told apart by the chunk id that the segment's id cache
//! already holds (`ids`), so counting reads no stored field and decompresses nothing.

use std::collections::HashSet;

use tantivy::collector::{Collector, SegmentCollector};
use tantivy::query::{AllQuery, BooleanQuery, Occur, Query, RangeQuery, TermQuery, TermSetQuery};
use tantivy::schema::IndexRecordOption;
use tantivy::{DocId, Score, SegmentOrdinal, SegmentReader, Term};

use super::index::Bm25Index;
use crate::error::Result;
use crate::index::Filter;
use crate::index::filter::{self, Cond};

/// Every match, by segment.
struct Matches;

struct SegmentMatches {
    segment: SegmentOrdinal,
    docs: Vec<DocId>,
}

impl Collector for Matches {
    type Fruit = Vec<(SegmentOrdinal, Vec<DocId>)>;
    type Child = SegmentMatches;

    fn for_segment(
        &self,
        segment: SegmentOrdinal,
        _: &SegmentReader,
    ) -> tantivy::Result<Self::Child> {
        Ok(SegmentMatches {
            segment,
            docs: Vec::new(),
        })
    }

    fn requires_scoring(&self) -> bool {
        false
    }

    fn merge_fruits(&self, fruits: Vec<Self::Fruit>) -> tantivy::Result<Self::Fruit> {
        Ok(fruits.into_iter().flatten().collect())
    }
}

impl SegmentCollector for SegmentMatches {
    type Fruit = Vec<(SegmentOrdinal, Vec<DocId>)>;

    fn collect(&mut self, doc: DocId, _: Score) {
        self.docs.push(doc);
    }

    fn harvest(self) -> Self::Fruit {
        vec![(self.segment, self.docs)]
    }
}

/// The document id of chunk id `doc#position`.
fn doc_of(chunk_id: &str) -> &str {
    chunk_id.rsplit_once('#').map_or(chunk_id, |(d, _)| d)
}

impl Bm25Index {
    /// `filter` as a tantivy query over the metadata terms (None for an empty filter).
    pub(super) fn filter_query(&self, filter: &Filter) -> Option<Box<dyn Query>> {
        (!filter.is_empty()).then(|| self.bool_query(filter))
    }

    fn bool_query(&self, f: &Filter) -> Box<dyn Query> {
        let mut clauses: Vec<(Occur, Box<dyn Query>)> = Vec::new();
        for c in &f.must {
            clauses.push((Occur::Must, self.cond_query(c)));
        }
        // tantivy's Should only ranks beside a Must; "at least one" is its own Must group.
        if !f.should.is_empty() {
            let any = f.should.iter().map(|c| (Occur::Should, self.cond_query(c)));
            clauses.push((Occur::Must, Box::new(BooleanQuery::new(any.collect()))));
        }
        if clauses.is_empty() {
            // Only must_not: everything else (tantivy matches nothing from exclusions alone).
            clauses.push((Occur::Must, Box::new(AllQuery)));
        }
        for c in &f.must_not {
            clauses.push((Occur::MustNot, self.cond_query(c)));
        }
        Box::new(BooleanQuery::new(clauses))
    }

    fn term(&self, text: &str) -> Term {
        Term::from_field_text(self.f_meta, text)
    }

    fn cond_query(&self, c: &Cond) -> Box<dyn Query> {
        match c {
            Cond::Eq(field, s) => Box::new(TermQuery::new(
                self.term(&filter::scalar_term(field, s)),
                IndexRecordOption::Basic,
            )),
            Cond::AnyOf(field, set) => Box::new(TermSetQuery::new(
                set.iter()
                    .map(|s| self.term(&filter::scalar_term(field, s))),
            )),
            Cond::Range(field, lo, hi) => {
                let (lo, hi) = filter::range_terms(field, lo, hi);
                let lo = lo.map(|t| self.term(&t));
                let hi = hi.map(|t| self.term(&t));
                Box::new(RangeQuery::new(lo, hi))
            }
            Cond::Exists(field) => Box::new(TermQuery::new(
                self.term(&filter::exists_term(field)),
                IndexRecordOption::Basic,
            )),
            Cond::Nested(f) => self.bool_query(f),
        }
    }

    /// The ids of the chunks matching a non-empty `filter` (a filtered Scroll walks them
    /// instead of every chunk), and how many chunks the index holds; None where a segment
    /// has no id column (an index written before it).
    pub fn matching_ids(&self, filter: &Filter) -> Result<Option<(Vec<String>, u64)>> {
        let searcher = self.reader.searcher();
        let Some(query) = self.filter_query(filter) else {
            return Ok(None);
        };
        let mut out = Vec::new();
        for (seg, docs) in searcher.search(&*query, &Matches)? {
            if docs.is_empty() {
                continue;
            }
            let Some(ids) = self.ids.segment(&searcher, seg)? else {
                return Ok(None);
            };
            out.extend(docs.iter().filter_map(|d| ids.get(*d)).map(str::to_owned));
        }
        Ok(Some((out, searcher.num_docs())))
    }

    /// Chunks matching a non-empty `filter`, and the documents they belong to.
    pub fn count(&self, filter: &Filter) -> Result<(u64, u64)> {
        let searcher = self.reader.searcher();
        let Some(query) = self.filter_query(filter) else {
            return Ok((searcher.num_docs(), 0));
        };
        let matches = searcher.search(&*query, &Matches)?;
        let mut segments = Vec::with_capacity(matches.len());
        for (seg, docs) in &matches {
            if !docs.is_empty() {
                segments.push((self.ids.segment(&searcher, *seg)?, docs));
            }
        }
        let mut chunks = 0u64;
        let mut documents: HashSet<&str> = HashSet::new();
        for (ids, docs) in &segments {
            chunks += docs.len() as u64;
            let Some(ids) = ids else { continue };
            // A document's chunks are indexed together, so its matches mostly follow each
            // other: only a change of document goes to the set (half the work at 50%).
            let mut last = None;
            for doc in docs.iter().filter_map(|d| ids.get(*d)).map(doc_of) {
                if last != Some(doc) {
                    documents.insert(doc);
                    last = Some(doc);
                }
            }
        }
        Ok((chunks, documents.len() as u64))
    }
}

#[cfg(test)]
mod tests {
    use super::doc_of;

    #[test]
    fn a_chunk_id_names_its_document_up_to_the_last_hash() {
        assert_eq!(doc_of("a#0"), "a");
        assert_eq!(doc_of("a#b#12"), "a#b");
        assert_eq!(doc_of("plain"), "plain");
    }
}
