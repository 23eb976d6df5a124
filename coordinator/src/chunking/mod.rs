//! Chunkers from the seeds (the basic-RAG article and Modular RAG's indexing operators):
//! fixed size + overlap by tokens of the embedding tokenizer (`fixed`), sentence packing with
//! merging of short pieces (`sentence`), and Markdown structure-aware chunking that keeps the
//! heading path (`markdown`). Chunk text is always a verbatim slice of the document, so what
//! is stored and shown is what the author wrote.

pub mod fixed;
pub mod markdown;
pub mod sentence;
mod tokens;

pub use tokens::{HfTokens, Tokens, WordTokens};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Strategy {
    Fixed,
    Sentence,
    Markdown,
}

#[derive(Debug, Clone, Copy)]
pub struct ChunkParams {
    pub strategy: Strategy,
    pub chunk_size: usize,
    pub overlap: usize,
    pub min_tokens: usize,
}

/// A chunk before embedding: verbatim text and the heading path it sits under.
#[derive(Debug, Clone, PartialEq)]
pub struct ChunkText {
    pub text: String,
    pub section: String,
}

/// Chunks one document's text.
pub fn chunk(text: &str, p: &ChunkParams, tok: &dyn Tokens) -> Vec<ChunkText> {
    match p.strategy {
        Strategy::Fixed => fixed::chunk(text, &tok.spans(text), p.chunk_size, p.overlap)
            .into_iter()
            .map(|text| ChunkText {
                text,
                section: String::new(),
            })
            .collect(),
        Strategy::Sentence => sentence::chunk(text, &tok.spans(text), p)
            .into_iter()
            .map(|text| ChunkText {
                text,
                section: String::new(),
            })
            .collect(),
        Strategy::Markdown => markdown::chunk(text, tok, p),
    }
}
