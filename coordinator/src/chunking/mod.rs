//! Chunkers from the seeds (the basic-RAG article and Modular RAG's indexing operators):
//! fixed size + overlap by tokens of the embedding tokenizer (`fixed`), sentence packing with
//! merging of short pieces (`sentence`), and Markdown structure-aware chunking that keeps the
//! heading path (`markdown`). Chunk text is always a verbatim slice of the document, so what
//! is stored and shown is what the author wrote.

pub mod fixed;
pub mod markdown;
pub mod sentence;

use std::path::Path;

use crate::error::{CoordError, Result};

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

/// Counts tokens: byte spans of each token of a text, without special tokens.
pub trait Tokens: Send + Sync {
    fn spans(&self, text: &str) -> Vec<(usize, usize)>;
}

/// The embedding model's own tokenizer (tokenizer.json), so "200 tokens" means what the model
/// will see.
pub struct HfTokens(tokenizers::Tokenizer);

impl HfTokens {
    pub fn load(path: &Path) -> Result<Self> {
        let mut t = tokenizers::Tokenizer::from_file(path)
            .map_err(|e| CoordError::Tokenizer(format!("{}: {e}", path.display())))?;
        t.with_truncation(None)
            .map_err(|e| CoordError::Tokenizer(e.to_string()))?;
        t.with_padding(None);
        Ok(Self(t))
    }
}

impl Tokens for HfTokens {
    fn spans(&self, text: &str) -> Vec<(usize, usize)> {
        match self.0.encode(text, false) {
            Ok(enc) => enc
                .get_offsets()
                .iter()
                .copied()
                .filter(|(a, b)| b > a)
                .collect(),
            Err(_) => Vec::new(),
        }
    }
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

/// Whitespace-separated words as tokens: for tests, fuzzing and counting without a model.
pub struct WordTokens;

impl Tokens for WordTokens {
    fn spans(&self, text: &str) -> Vec<(usize, usize)> {
        let mut out = Vec::new();
        let mut start = None;
        for (i, c) in text.char_indices() {
            match (c.is_whitespace(), start) {
                (true, Some(s)) => {
                    out.push((s, i));
                    start = None;
                }
                (false, None) => start = Some(i),
                _ => {}
            }
        }
        if let Some(s) = start {
            out.push((s, text.len()));
        }
        out
    }
}
