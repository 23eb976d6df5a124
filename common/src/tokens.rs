//! A BERT-style tokenizer run word by word with a cache: the coordinator counts chunk tokens
//! with it and the model worker makes Embed sequences with it, both with the HF tokenizer's
//! exact output.
//!
//! The whole HF tokenizer over a text was most of the CPU of both processes during ingest
//! (BertNormalizer's per-character Unicode lookups with alignment tracking, then WordPiece:
//! about 2 MB/s per core). For a BERT-style tokenizer, a space, tab, CR or LF always ends a
//! pre-token and never belongs to one, so each run of text between them tokenizes on its own
//! exactly as it does inside the text. `RunTokenizer` keeps the tokens of each run it has
//! seen (natural text repeats its words) and tokenizes only the runs it has not, all in one
//! call.

use std::collections::HashMap;

use parking_lot::Mutex;
use tokenizers::{Encoding, NormalizerWrapper, PreTokenizerWrapper, Tokenizer};

/// Runs kept before the cache starts over (~10 MB of short words).
const MAX_CACHED_RUNS: usize = 100_000;
/// Runs longer than this are not kept (hashes, base64, URLs: unlikely to come back).
const MAX_CACHED_RUN_BYTES: usize = 64;

#[derive(Debug, thiserror::Error)]
#[error("tokenize: {0}")]
pub struct TokenizeError(pub String);

/// One token: its id and byte span in the text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece {
    pub id: u32,
    pub start: usize,
    pub end: usize,
}

/// The characters that always separate BERT pre-tokens. Other Unicode whitespace separates
/// them too, but a form feed or vertical tab is a control character that BertNormalizer
/// deletes, joining its neighbours, so only these four are safe to cut at.
pub fn is_cut(c: char) -> bool {
    matches!(c, ' ' | '\t' | '\n' | '\r')
}

/// Byte ranges of the non-empty runs of `text` between characters that `sep` accepts.
pub fn runs_between(text: &str, sep: impl Fn(char) -> bool) -> Vec<(usize, usize)> {
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
pub fn runs(text: &str) -> Vec<(usize, usize)> {
    runs_between(text, is_cut)
}

/// True for a BERT normaliser (or none) and pre-tokeniser whose added tokens neither hold a
/// cut character nor strip the whitespace around them: then a text's tokens are the tokens
/// of its runs, shifted.
fn runs_are_independent(t: &Tokenizer) -> bool {
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

/// (id, start, end) of each token of a run, relative to the run.
type RunTokens = Vec<(u32, u32, u32)>;
type Cached = Box<[(u32, u32, u32)]>;

/// A tokenizer (truncation and padding off) with the per-run cache where its kind allows.
pub struct RunTokenizer {
    tokenizer: Tokenizer,
    /// (id, start, end) of each token of each run seen, relative to the run; None when the
    /// tokenizer is not one whose runs tokenize independently.
    cache: Option<Mutex<HashMap<Box<str>, Cached>>>,
}

impl RunTokenizer {
    pub fn new(mut tokenizer: Tokenizer) -> Result<Self, TokenizeError> {
        tokenizer
            .with_truncation(None)
            .map_err(|e| TokenizeError(e.to_string()))?;
        tokenizer.with_padding(None);
        let cache = runs_are_independent(&tokenizer).then(|| Mutex::new(HashMap::new()));
        Ok(Self { tokenizer, cache })
    }

    /// The same tokenizer over every whole text, never cached (the reference benchmarks and
    /// tests compare against).
    pub fn without_cache(mut self) -> Self {
        self.cache = None;
        self
    }

    /// Whether tokens come from the per-run cache.
    pub fn caches_runs(&self) -> bool {
        self.cache.is_some()
    }

    /// The tokenizer (truncation and padding off).
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// The tokens of `text` without special tokens, as the tokenizer gives them over the
    /// whole text. With `limit`, tokenizing may stop once more than `limit` tokens are known
    /// (a caller that truncates needs no more).
    pub fn tokens(&self, text: &str, limit: Option<usize>) -> Result<Vec<Piece>, TokenizeError> {
        let Some(cache) = &self.cache else {
            return self.whole(text);
        };
        let runs = runs(text);
        // A run yields any number of tokens, none included (a run of control characters):
        // walk the runs in windows of `limit + 1` and stop once past the limit.
        let window = limit.map_or(runs.len(), |l| l.saturating_add(1)).max(1);
        let mut out = Vec::with_capacity(runs.len().min(window) * 2);
        for part in runs.chunks(window) {
            if !self.cached(cache, text, part, &mut out)? {
                return self.whole(text);
            }
            if limit.is_some_and(|l| out.len() > l) {
                break;
            }
        }
        Ok(out)
    }

    /// The tokenizer over the whole text.
    fn whole(&self, text: &str) -> Result<Vec<Piece>, TokenizeError> {
        let enc = self
            .tokenizer
            .encode(text, false)
            .map_err(|e| TokenizeError(e.to_string()))?;
        Ok(pieces(&enc))
    }

    /// Appends the tokens of `runs` (ranges of `text`) to `out` from the cache, tokenizing the
    /// runs it lacks in one call; false when the caller must tokenize the whole text instead.
    fn cached(
        &self,
        cache: &Mutex<HashMap<Box<str>, Cached>>,
        text: &str,
        runs: &[(usize, usize)],
        out: &mut Vec<Piece>,
    ) -> Result<bool, TokenizeError> {
        let mut missing: Vec<&str> = {
            let map = cache.lock();
            runs.iter()
                .map(|&(a, b)| &text[a..b])
                .filter(|w| !map.contains_key(*w))
                .collect()
        };
        missing.sort_unstable();
        missing.dedup();
        let fresh: HashMap<&str, RunTokens> = if missing.is_empty() {
            HashMap::new()
        } else {
            match self.encode_runs(&missing)? {
                Some(tokens) => missing.iter().copied().zip(tokens).collect(),
                None => return Ok(false),
            }
        };
        let mut map = cache.lock();
        for &(a, b) in runs {
            let w = &text[a..b];
            let tokens = match fresh.get(w) {
                Some(t) => t.as_slice(),
                None => match map.get(w) {
                    Some(t) => &t[..],
                    // Dropped by a concurrent call's reset in between: tokenize afresh.
                    None => return Ok(false),
                },
            };
            out.extend(tokens.iter().map(|&(id, s, e)| Piece {
                id,
                start: a + s as usize,
                end: a + e as usize,
            }));
        }
        if map.len() + fresh.len() > MAX_CACHED_RUNS {
            map.clear();
        }
        for (w, t) in fresh {
            if w.len() <= MAX_CACHED_RUN_BYTES {
                map.insert(w.into(), t.into_boxed_slice());
            }
        }
        Ok(true)
    }

    /// Tokens of `words` (distinct runs) from one tokenizer call over them joined by spaces;
    /// None if a token crossed a join, which a tokenizer that passed `runs_are_independent`
    /// never does.
    fn encode_runs(&self, words: &[&str]) -> Result<Option<Vec<RunTokens>>, TokenizeError> {
        let joined = words.join(" ");
        let mut starts = Vec::with_capacity(words.len());
        let mut at = 0;
        for w in words {
            starts.push(at);
            at += w.len() + 1;
        }
        let mut out = vec![Vec::new(); words.len()];
        for p in self.whole(&joined)? {
            let Some(i) = starts.partition_point(|&st| st <= p.start).checked_sub(1) else {
                return Ok(None);
            };
            let (base, len) = (starts[i], words[i].len());
            if p.end > base + len || p.start < base {
                return Ok(None);
            }
            out[i].push((p.id, (p.start - base) as u32, (p.end - base) as u32));
        }
        Ok(Some(out))
    }
}

fn pieces(enc: &Encoding) -> Vec<Piece> {
    enc.get_ids()
        .iter()
        .zip(enc.get_offsets())
        .map(|(&id, &(start, end))| Piece { id, start, end })
        .collect()
}

/// `tokens` as an `Encoding` of the first sequence, for the tokenizer's post-processor (which
/// adds the special tokens and type ids).
pub fn encoding_of(tokens: &[Piece]) -> Encoding {
    Encoding::from_tokens(
        tokens
            .iter()
            .map(|p| tokenizers::Token::new(p.id, String::new(), (p.start, p.end)))
            .collect(),
        0,
    )
}

#[cfg(test)]
mod tests {
    use std::path::{Path, PathBuf};

    use super::*;

    fn minilm() -> Option<Tokenizer> {
        let dir = std::env::var("RAGCLUSTER_MODELS")
            .map(PathBuf::from)
            .unwrap_or_else(|_| Path::new(env!("CARGO_MANIFEST_DIR")).join("../models"));
        let path = dir.join("all-MiniLM-L6-v2/tokenizer.json");
        if !path.exists() {
            crate::skip::skipped(
                crate::skip::SkipReason::NotSetUp,
                "tokens::tests",
                &format!("no {} (scripts/fetch-models.sh)", path.display()),
            );
            return None;
        }
        Some(Tokenizer::from_file(&path).expect("tokenizer loads"))
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
        "\u{0} \u{0}\u{0} \u{1}",
        "İstanbul ǅ ß ﬁ ligature",
    ];

    /// The tricky texts, the repository's sample documents and SciFact's first 500 documents
    /// (when the shared datasets are beside the checkout).
    fn texts() -> Vec<String> {
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
        let datasets = std::env::var("RAGCLUSTER_DATASETS")
            .map(PathBuf::from)
            .unwrap_or_else(|_| {
                Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/datasets")
            });
        if let Ok(corpus) = std::fs::read_to_string(datasets.join("scifact/corpus.jsonl")) {
            for line in corpus.lines().take(500) {
                let doc: serde_json::Value = serde_json::from_str(line).expect("corpus line");
                texts.push(doc["text"].as_str().unwrap_or_default().to_string());
            }
        }
        texts
    }

    #[test]
    fn cached_runs_equal_the_whole_text_tokenizer() {
        let Some(t) = minilm() else { return };
        let cached = RunTokenizer::new(t.clone()).unwrap();
        let whole = RunTokenizer::new(t).unwrap().without_cache();
        assert!(
            cached.caches_runs(),
            "MiniLM's BERT tokenizer takes the per-run path"
        );
        let texts = texts();
        // Twice: the first pass fills the cache, the second reads it.
        for _ in 0..2 {
            for text in &texts {
                let want = whole.tokens(text, None).unwrap();
                assert_eq!(cached.tokens(text, None).unwrap(), want, "{text:?}");
                // With a limit: a prefix of the whole, past the limit or complete.
                for limit in [0, 1, 7, 254] {
                    let got = cached.tokens(text, Some(limit)).unwrap();
                    assert_eq!(got, want[..got.len()], "{text:?} limit {limit}");
                    assert!(got.len() > limit || got.len() == want.len(), "{text:?}");
                }
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
