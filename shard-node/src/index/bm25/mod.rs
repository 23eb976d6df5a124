//! A shard's BM25 index (tantivy). Derived state: it commits with the shard's applied
//! sequence number as payload, so after a crash the shard knows which batches to replay.
//!
//! Scores can use collection-wide statistics (`GlobalBm25Stats`: summed document count,
//! token count and document frequencies of the query terms over all shards) through tantivy's
//! `Bm25StatisticsProvider`, so a collection split into N shards ranks and scores exactly like
//! one index over the same chunks.
//!
//! `index` owns the tantivy index (writes, commits, searches); `ids` decodes hits' chunk ids
//! once per segment; `terms` caches term lookups and scores small indexes a term at a time.
//! What they share, the schema and its analysis, is here.

mod count;
mod ids;
mod index;
mod terms;

pub use index::Bm25Index;

use tantivy::schema::{FAST, IndexRecordOption, STRING, Schema, TextFieldIndexing, TextOptions};
use tantivy::tokenizer::{
    Language, LowerCaser, RemoveLongFilter, SimpleTokenizer, Stemmer, StopWordFilter, TextAnalyzer,
};

/// The fast field holding each chunk's id.
const CHUNK_ID: &str = "chunk_id";

/// English analysis as in Lucene's EnglishAnalyzer: split on non-alphanumerics, lowercase,
/// drop stop words, Porter-style stemming.
const TOKENIZER: &str = "ragcluster_en";

/// Below this many documents (all segments) a filtered query scores every matching document
/// instead of pruning with block-WAND. With SciFact's queries (about a dozen terms after stop
/// words) block-WAND's bookkeeping (re-sorting the term scorers at each pivot, block maxima,
/// seeks) costs more than the documents it skips, which tantivy's bucketed union scores in
/// passes over a bitset: one thread, `bm25bench`, 61 against 136 us per query at 11k chunks,
/// 287 against 496 at 100k, 805 against 941 at 300k; about even at 600k, block-WAND 10% ahead
/// at 1M.
pub const EXHAUSTIVE_BELOW_DOCS: u64 = 300_000;

/// Below this many documents an unfiltered query is scored a term at a time
/// (`terms::score_all`): `bm25bench`, one thread, 77-78 us per query at 11k chunks
/// against 136-139 for tantivy's every-match traversal and 236-247 for block-WAND; 100k 396-434
/// against 663-761 and 926-1,012; 300k 977-1,172 against 1,349-1,566 and 1,528-1,930; 1M
/// 3,472-3,520 against 4,983-5,063 and 4,776-5,546. Not measured beyond; its score array takes
/// 4 bytes per document of the largest segment on each searching thread.
pub const TERM_AT_A_TIME_BELOW_DOCS: u64 = 1_000_000;

/// How a search walks the postings of its terms.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Scoring {
    /// Term at a time (`terms::score_all`) below `TERM_AT_A_TIME_BELOW_DOCS` documents
    /// without a filter; with one, tantivy's traversal of every match below
    /// `EXHAUSTIVE_BELOW_DOCS`; block-WAND above those.
    Auto = 0,
    /// Tantivy's block-WAND pruning.
    BlockWand = 1,
    /// Tantivy's scorer tree, every match scored.
    EveryMatch = 2,
    /// `terms::score_all` (a filter falls back to `EveryMatch`).
    TermAtATime = 3,
}

pub(crate) fn analyzer() -> TextAnalyzer {
    TextAnalyzer::builder(SimpleTokenizer::default())
        .filter(RemoveLongFilter::limit(40))
        .filter(LowerCaser)
        .filter(
            StopWordFilter::new(Language::English).expect("english stop words ship with tantivy"),
        )
        .filter(Stemmer::new(Language::English))
        .build()
}

fn schema() -> Schema {
    let mut b = Schema::builder();
    // A fast (columnar) field: reading ids of hits avoids decompressing doc-store blocks.
    b.add_text_field(CHUNK_ID, STRING | FAST);
    b.add_text_field("doc_id", STRING);
    let body = TextOptions::default().set_indexing_options(
        TextFieldIndexing::default()
            .set_tokenizer(TOKENIZER)
            .set_index_option(IndexRecordOption::WithFreqs),
    );
    b.add_text_field("body", body);
    // Metadata as raw terms in one multi-valued field (`index::filter::terms`: keywords,
    // order-preserving numbers, presence), so filters are term and term-range queries.
    b.add_text_field("meta", STRING);
    b.build()
}

/// The text BM25 sees for a chunk: title and section path, then the chunk text.
pub fn indexed_text(title: &str, section: &str, text: &str) -> String {
    let mut s = String::with_capacity(title.len() + section.len() + text.len() + 2);
    for part in [title, section, text] {
        if !part.is_empty() {
            if !s.is_empty() {
                s.push('\n');
            }
            s.push_str(part);
        }
    }
    s
}
