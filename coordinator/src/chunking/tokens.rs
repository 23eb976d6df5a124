//! Token spans for the chunkers: the embedding model's own tokenizer, so "200 tokens" means
//! what the model will see, and whitespace-separated words for tests and fuzzing. The
//! tokenizer runs word by word with a cache (`ragcluster_common::tokens`): the whole HF
//! tokenizer over every document was most of the coordinator's CPU during ingest.

use std::path::Path;

use ragcluster_common::tokens::{RunTokenizer, runs_between};

use crate::error::{CoordError, Result};

/// Counts tokens: byte spans of each token of a text, without special tokens.
pub trait Tokens: Send + Sync {
    fn spans(&self, text: &str) -> Vec<(usize, usize)>;
}

pub struct HfTokens(RunTokenizer);

impl HfTokens {
    pub fn load(path: &Path) -> Result<Self> {
        let t = tokenizers::Tokenizer::from_file(path)
            .map_err(|e| CoordError::Tokenizer(format!("{}: {e}", path.display())))?;
        Self::new(t)
    }

    pub fn new(tokenizer: tokenizers::Tokenizer) -> Result<Self> {
        RunTokenizer::new(tokenizer)
            .map(Self)
            .map_err(|e| CoordError::Tokenizer(e.to_string()))
    }

    /// The same tokenizer over every whole text, never cached (the reference `chunkbench`
    /// and the tests compare against).
    pub fn without_cache(self) -> Self {
        Self(self.0.without_cache())
    }

    /// Whether spans come from the per-run cache.
    pub fn caches_runs(&self) -> bool {
        self.0.caches_runs()
    }
}

impl Tokens for HfTokens {
    fn spans(&self, text: &str) -> Vec<(usize, usize)> {
        self.0
            .tokens(text, None)
            .map(|t| {
                t.into_iter()
                    .map(|p| (p.start, p.end))
                    .filter(|(a, b)| b > a)
                    .collect()
            })
            .unwrap_or_default()
    }
}

/// Whitespace-separated words as tokens: for tests, fuzzing and counting without a model.
pub struct WordTokens;

impl Tokens for WordTokens {
    fn spans(&self, text: &str) -> Vec<(usize, usize)> {
        runs_between(text, char::is_whitespace)
    }
}
