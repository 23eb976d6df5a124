//! Token spans for the chunkers: the embedding model's own tokenizer, so "200 tokens" means
//! what the model will see, and whitespace-separated words for tests and fuzzing.
//!
//! Running the whole tokenizer over every document was most of the coordinator's CPU during
//! ingest (BertNormalizer's per-character Unicode lookups with alignment tracking, then
//! WordPiece). For a BERT-style tokenizer, a space, tab, CR or LF always ends a pre-token and
//! never belongs to one, so each run of text between them tokenizes on its own exactly as it
//! does inside the document. `HfTokens` keeps the spans of each such run it has seen (natural
//! text repeats its words), and tokenizes only the runs it has not, all in one call.

use std::collections::HashMap;
use std::path::Path;

use parking_lot::Mutex;
use tokenizers::{NormalizerWrapper, PreTokenizerWrapper};

use crate::error::{CoordError, Result};

/// Counts tokens: byte spans of each token of a text, without special tokens.
pub trait Tokens: Send + Sync {
    fn spans(&self, text: &str) -> Vec<(usize, usize)>;
}

/// Runs kept before the cache starts over (~10 MB of short words).
const MAX_CACHED_RUNS: usize = 100_000;
/// Runs longer than this are not kept (hashes, base64, URLs: unlikely to come back).
const MAX_CACHED_RUN_BYTES: usize = 64;

/// The characters that always separate BERT pre-tokens. Other Unicode whitespace separates
/// them too, but a form feed or vertical tab is a control character that BertNormalizer
/// deletes, joining its neighbours, so only these four are safe to cut at.
fn is_cut(c: char) -> bool {
    matches!(c, ' ' | '\t' | '\n' | '\r')
}

/// Byte ranges of the non-empty runs of `text` between characters that `sep` accepts.
fn runs_between(text: &str, sep: impl Fn(char) -> bool) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    let mut start = None;
    for (i, c) in text.char_indices() {
        match (sep(c), start) {
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

/// Byte ranges of the runs of `text` between cut characters.
fn runs(text: &str) -> Vec<(usize, usize)> {
    runs_between(text, is_cut)
}

type Spans = Box<[(u32, u32)]>;

pub struct HfTokens {
    tokenizer: tokenizers::Tokenizer,
    /// Spans of each run seen, relative to the run; None when the tokenizer is not one whose
    /// runs tokenize independently (`runs_are_independent`).
    cache: Option<Mutex<HashMap<Box<str>, Spans>>>,
}

impl HfTokens {
    pub fn load(path: &Path) -> Result<Self> {
        let mut t = tokenizers::Tokenizer::from_file(path)
            .map_err(|e| CoordError::Tokenizer(format!("{}: {e}", path.display())))?;
        t.with_truncation(None)
            .map_err(|e| CoordError::Tokenizer(e.to_string()))?;
        t.with_padding(None);
        Ok(Self::new(t))
    }

    pub fn new(tokenizer: tokenizers::Tokenizer) -> Self {
        let cache = runs_are_independent(&tokenizer).then(|| Mutex::new(HashMap::new()));
        Self { tokenizer, cache }
    }

    /// The same tokenizer over every whole text, never cached (the reference `chunkbench`
    /// and the tests compare against).
    pub fn without_cache(mut self) -> Self {
        self.cache = None;
        self
    }

    /// Whether spans come from the per-run cache.
    pub fn caches_runs(&self) -> bool {
        self.cache.is_some()
    }

    /// The tokenizer over the whole text.
    fn encode(&self, text: &str) -> Vec<(usize, usize)> {
        match self.tokenizer.encode(text, false) {
            Ok(enc) => enc
                .get_offsets()
                .iter()
                .copied()
                .filter(|(a, b)| b > a)
                .collect(),
            Err(_) => Vec::new(),
        }
    }

    /// Spans of `words` (distinct runs) from one tokenizer call over them joined by spaces;
    /// None if a token crossed a join, which a tokenizer that passed `runs_are_independent`
    /// never does.
    fn encode_runs(&self, words: &[&str]) -> Option<Vec<Vec<(u32, u32)>>> {
        let joined = words.join(" ");
        let mut starts = Vec::with_capacity(words.len());
        let mut at = 0;
        for w in words {
            starts.push(at);
            at += w.len() + 1;
        }
        let mut out = vec![Vec::new(); words.len()];
        for (s, e) in self.encode(&joined) {
            let i = starts.partition_point(|&st| st <= s).checked_sub(1)?;
            let (base, len) = (starts[i], words[i].len());
            if e > base + len {
                return None;
            }
            out[i].push(((s - base) as u32, (e - base) as u32));
        }
        Some(out)
    }
}

/// True for a BERT normaliser (or none) and pre-tokeniser whose added tokens neither hold a
/// cut character nor strip the whitespace around them: then a text's tokens are the tokens
/// of its runs, shifted.
fn runs_are_independent(t: &tokenizers::Tokenizer) -> bool {
    let normalizer_ok = matches!(
        t.get_normalizer(),
        None | Some(NormalizerWrapper::BertNormalizer(_))
    );
    let pre_ok = matches!(
        t.get_pre_tokenizer(),
        Some(PreTokenizerWrapper::BertPreTokenizer(_))
    );
    let added_ok = t
        .get_added_tokens_decoder()
        .values()
        .all(|a| !a.lstrip && !a.rstrip && !a.content.chars().any(is_cut));
    normalizer_ok && pre_ok && added_ok
}

impl Tokens for HfTokens {
    fn spans(&self, text: &str) -> Vec<(usize, usize)> {
        let Some(cache) = &self.cache else {
            return self.encode(text);
        };
        let runs = runs(text);
        let mut missing: Vec<&str> = {
            let map = cache.lock();
            runs.iter()
                .map(|&(a, b)| &text[a..b])
                .filter(|w| !map.contains_key(*w))
                .collect()
        };
        missing.sort_unstable();
        missing.dedup();
        let fresh: HashMap<&str, Vec<(u32, u32)>> = if missing.is_empty() {
            HashMap::new()
        } else {
            match self.encode_runs(&missing) {
                Some(spans) => missing.iter().copied().zip(spans).collect(),
                None => return self.encode(text),
            }
        };
        let mut map = cache.lock();
        let mut out = Vec::with_capacity(runs.len() * 2);
        for &(a, b) in &runs {
            let w = &text[a..b];
            let spans = match fresh.get(w) {
                Some(s) => s.as_slice(),
                None => match map.get(w) {
                    Some(s) => &s[..],
                    // Dropped by a concurrent call's reset in between: tokenize afresh.
                    None => return self.encode(text),
                },
            };
            out.extend(spans.iter().map(|&(s, e)| (a + s as usize, a + e as usize)));
        }
        if map.len() + fresh.len() > MAX_CACHED_RUNS {
            map.clear();
        }
        for (w, s) in fresh {
            if w.len() <= MAX_CACHED_RUN_BYTES {
                map.insert(w.into(), s.into_boxed_slice());
            }
        }
        out
    }
}

/// Whitespace-separated words as tokens: for tests, fuzzing and counting without a model.
pub struct WordTokens;

impl Tokens for WordTokens {
    fn spans(&self, text: &str) -> Vec<(usize, usize)> {
        runs_between(text, char::is_whitespace)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn minilm() -> Option<HfTokens> {
        let dir = std::env::var("RAGCLUSTER_MODELS")
            .map(std::path::PathBuf::from)
            .unwrap_or_else(|_| Path::new(env!("CARGO_MANIFEST_DIR")).join("../models"));
        let path = dir.join("all-MiniLM-L6-v2/tokenizer.json");
        if !path.exists() {
            eprintln!("skipped: no {} (scripts/fetch-models.sh)", path.display());
            return None;
        }
        Some(HfTokens::load(&path).expect("tokenizer loads"))
    }

    /// Texts where a shortcut would go wrong: accents, CJK, punctuation glued to words,
    /// control characters (a form feed joins words), other Unicode spaces, long words
    /// (WordPiece's [UNK] above 100 characters), special-token text, emoji.
    const TRICKY: &[&str] = &[
        "Hello, world! Café résumé naïve — ÉCOLE.",
        "Raft elects a leader; the leader (term 3) appends entries.\n\tNext\r\nline",
        "中文字符和English混合, 日本語のテキスト",
        "foo\u{0c}bar baz\u{0b}qux a\u{0}b \u{fffd}x",
        "non\u{a0}breaking\u{2003}em space\u{3000}ideographic",
        "[CLS] text [SEP] [MASK]word [UNK]",
        "🦀 crabs 🦀🦀 ok 👍🏽",
        "",
        "   ",
        "İstanbul ǅ ß ﬁ ligature",
    ];

    #[test]
    fn cached_runs_equal_the_whole_text_tokenizer() {
        let Some(t) = minilm() else { return };
        assert!(
            t.caches_runs(),
            "MiniLM's BERT tokenizer takes the per-run path"
        );
        let long = "x".repeat(130) + " tail " + &"ab".repeat(70);
        let mut texts: Vec<String> = TRICKY.iter().map(|s| s.to_string()).collect();
        texts.push(long);
        let sample = Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/sample");
        if let Ok(dir) = std::fs::read_dir(&sample) {
            for e in dir.flatten() {
                if let Ok(s) = std::fs::read_to_string(e.path()) {
                    texts.push(s);
                }
            }
        }
        // SciFact's first documents, when the shared datasets are beside the checkout.
        let datasets = std::env::var("RAGCLUSTER_DATASETS")
            .map(std::path::PathBuf::from)
            .unwrap_or_else(|_| {
                Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/datasets")
            });
        if let Ok(corpus) = std::fs::read_to_string(datasets.join("scifact/corpus.jsonl")) {
            for line in corpus.lines().take(500) {
                let doc: serde_json::Value = serde_json::from_str(line).expect("corpus line");
                texts.push(doc["text"].as_str().unwrap_or_default().to_string());
            }
        }
        // Twice: the first pass fills the cache, the second reads it.
        for _ in 0..2 {
            for text in &texts {
                assert_eq!(t.spans(text), t.encode(text), "{text:?}");
            }
        }
    }

    #[test]
    fn runs_cut_only_where_bert_always_splits() {
        assert_eq!(runs(" a\tbc\r\n d "), vec![(1, 2), (3, 5), (8, 9)]);
        assert_eq!(runs("a\u{0c}b"), vec![(0, 3)]);
        assert!(runs("").is_empty());
    }
}
