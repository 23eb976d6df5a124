//! Exact counts by metadata filter, and the chunk ids a filter matches (filtered scans): the filter's metadata terms intersected by tantivy, every
//! live match counted, and its document told apart by the chunk id that the segment's id cache
//! already holds (`ids`), so counting reads no stored field and decompresses nothing.

use std::collections::HashSet;

use tantivy::collector::{Collector, SegmentCollector};
use tantivy::query::{BooleanQuery, Occur, Query, TermQuery};
use tantivy::schema::IndexRecordOption;
use tantivy::{DocId, Score, SegmentOrdinal, SegmentReader, Term};

use super::META_SEP;
use super::index::Bm25Index;
use crate::error::Result;
use crate::index::Filter;

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
    /// Every metadata pair of `filter` as one conjunction (None for an empty filter).
    pub(super) fn filter_query(&self, filter: &Filter) -> Option<Box<dyn Query>> {
        if filter.is_empty() {
            return None;
        }
        let must: Vec<(Occur, Box<dyn Query>)> = filter
            .iter()
            .map(|(k, v)| {
                let q: Box<dyn Query> = Box::new(TermQuery::new(
                    Term::from_field_text(self.f_meta, &format!("{k}{META_SEP}{v}")),
                    IndexRecordOption::Basic,
                ));
                (Occur::Must, q)
            })
            .collect();
        Some(Box::new(BooleanQuery::new(must)))
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
