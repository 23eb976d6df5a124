//! Tokenisation on threads of its own, ahead of the batchers (text-embeddings-inference's
//! tokenization workers). An Embed or Rerank call may carry 32 MB of text, which the HF
//! tokenizer takes seconds to read on one core (it reads a text whole before truncating it);
//! on the async runtime that would stall every other call, health checks included. Here a
//! call's texts are cut into pieces of at most `PIECE_BYTES` (a longer text is a piece of its
//! own) spread over the pool, so a large call is tokenised in parallel and the runtime only
//! waits on a channel. Pieces of small calls go first, so a one-sentence Embed waits for a
//! worker to finish its current piece, not for a 32 MB call queued before it. Beside one
//! call per thread, at most `max_queue` calls (all models together) wait; one more is refused
//! with RESOURCE_EXHAUSTED (and a retry hint) before anything is queued, as the batchers
//! refuse. Any single call fits an idle pool, however many pieces it makes.
//!
//! Single texts of a BERT-style tokenizer go word by word through a cache
//! (`ragcluster_common::tokens`, `TextTokenizer`): the whole HF tokenizer was most of the
//! worker's CPU during a GPU ingest (~0.5 ms per chunk, more than the GPU's forward).

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use parking_lot::{Condvar, Mutex};
use ragcluster_common::tokens::{RunTokenizer, encoding_of};
use tokenizers::{PostProcessor, Tokenizer, TruncationDirection, TruncationStrategy};
use tokio::sync::oneshot;

use crate::backend::Seq;
use crate::backend::encoder::bert;
use crate::error::ModelError;

/// A call of at most this many bytes is one piece, and goes before the pieces of larger calls.
const SMALL_BYTES: usize = 16 * 1024;
/// Pieces of larger calls hold about this many bytes (~0.1 s of tokenising on one core), so
/// a small call never waits long for a worker.
const PIECE_BYTES: usize = 256 * 1024;

/// What one piece holds: texts, or passages paired with a query (cross-encoders).
enum Input {
    Texts(Vec<String>),
    Pairs(Arc<str>, Vec<String>),
}

struct Job {
    tokenizer: Arc<TextTokenizer>,
    input: Input,
    reply: oneshot::Sender<Result<Vec<Seq>, ModelError>>,
}

#[derive(Default)]
struct Queue {
    small: VecDeque<Job>,
    large: VecDeque<Job>,
    closed: bool,
}

impl Queue {
    fn len(&self) -> usize {
        self.small.len() + self.large.len()
    }
}

#[derive(Default)]
struct Shared {
    queue: Mutex<Queue>,
    ready: Condvar,
}

/// Handle to the pool; its threads stop when it is dropped.
pub struct TokenizerPool {
    shared: Arc<Shared>,
    threads: usize,
    /// Calls admitted and not yet answered (or cancelled).
    calls: AtomicUsize,
    /// Calls admitted at most: `max_queue` waiting plus one per thread.
    max_calls: usize,
}

/// One admitted call; leaves the count when answered or dropped (a cancelled RPC).
struct Admitted<'a>(&'a AtomicUsize);

impl Drop for Admitted<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl TokenizerPool {
    /// Starts `threads` workers (0: one per core) behind a queue of `max_queue` pieces.
    pub fn start(threads: usize, max_queue: usize) -> Self {
        let threads = if threads == 0 {
            std::thread::available_parallelism().map_or(1, |n| n.get())
        } else {
            threads
        };
        let shared = Arc::new(Shared::default());
        for i in 0..threads {
            let shared = shared.clone();
            std::thread::Builder::new()
                .name(format!("tokenize-{i}"))
                .spawn(move || work(&shared))
                .expect("spawn tokenizer thread");
        }
        Self {
            shared,
            threads,
            calls: AtomicUsize::new(0),
            max_calls: max_queue.max(1) + threads,
        }
    }

    /// Tokenises texts (with special tokens, truncated to the tokenizer's limit), in order.
    /// `model` names the refusal when the queue is full.
    pub async fn texts(
        &self,
        model: &str,
        tokenizer: &Arc<TextTokenizer>,
        texts: Vec<String>,
    ) -> Result<Vec<Seq>, ModelError> {
        let (pieces, small) = self.split(texts);
        let inputs = pieces.into_iter().map(Input::Texts).collect();
        self.run(model, tokenizer, inputs, small).await
    }

    /// Tokenises (query, passage) pairs for a cross-encoder, in passage order.
    pub async fn pairs(
        &self,
        model: &str,
        tokenizer: &Arc<TextTokenizer>,
        query: &str,
        passages: Vec<String>,
    ) -> Result<Vec<Seq>, ModelError> {
        let query: Arc<str> = query.into();
        let (pieces, small) = self.split(passages);
        let inputs = pieces
            .into_iter()
            .map(|p| Input::Pairs(query.clone(), p))
            .collect();
        self.run(model, tokenizer, inputs, small).await
    }

    /// Cuts `texts` into pieces of consecutive texts, keeping order: one piece for a small
    /// call (also returns true then); otherwise at least one per thread, each of at most
    /// about `PIECE_BYTES`.
    fn split(&self, texts: Vec<String>) -> (Vec<Vec<String>>, bool) {
        let total: usize = texts.iter().map(String::len).sum();
        if total <= SMALL_BYTES || texts.len() <= 1 {
            return (vec![texts], total <= SMALL_BYTES);
        }
        let target = total.div_ceil(self.threads).min(PIECE_BYTES);
        let mut out = vec![Vec::new()];
        let mut bytes = 0;
        for t in texts {
            if bytes >= target {
                out.push(Vec::new());
                bytes = 0;
            }
            bytes += t.len();
            out.last_mut().expect("one piece at least").push(t);
        }
        (out, false)
    }

    /// Admits the call (or refuses it, queueing nothing), queues its pieces and joins the
    /// answers in order.
    async fn run(
        &self,
        model: &str,
        tokenizer: &Arc<TextTokenizer>,
        inputs: Vec<Input>,
        small: bool,
    ) -> Result<Vec<Seq>, ModelError> {
        if self.calls.fetch_add(1, Ordering::AcqRel) >= self.max_calls {
            self.calls.fetch_sub(1, Ordering::AcqRel);
            return Err(ModelError::Overloaded(format!("{model} (tokenizer)")));
        }
        let _admitted = Admitted(&self.calls);
        let mut waits = Vec::with_capacity(inputs.len());
        {
            let mut q = self.shared.queue.lock();
            let lane = if small { &mut q.small } else { &mut q.large };
            for input in inputs {
                let (reply, rx) = oneshot::channel();
                lane.push_back(Job {
                    tokenizer: tokenizer.clone(),
                    input,
                    reply,
                });
                waits.push(rx);
            }
            metrics::gauge!("model_tokenizer_queue_depth").set(q.len() as f64);
        }
        self.shared.ready.notify_all();
        let mut seqs = Vec::new();
        for rx in waits {
            let piece = rx
                .await
                .map_err(|_| ModelError::Inference("tokenizer dropped a request".into()))??;
            seqs.extend(piece);
        }
        Ok(seqs)
    }

    /// Pieces waiting for a worker.
    pub fn queued(&self) -> usize {
        self.shared.queue.lock().len()
    }
}

impl Drop for TokenizerPool {
    fn drop(&mut self) {
        self.shared.queue.lock().closed = true;
        self.shared.ready.notify_all();
    }
}

/// A model's tokenizer for Embed and Rerank calls. Single texts of a tokenizer whose words
/// tokenize independently (`RunTokenizer`) come from the word cache, then are truncated and
/// given their special tokens as the HF tokenizer does (its post-processor); pairs, and every
/// text of other tokenizers, go through the HF tokenizer whole.
pub struct TextTokenizer {
    /// With the model's truncation.
    hf: Tokenizer,
    /// The word-cached tokenizer and how many content tokens a sequence keeps (the maximum
    /// length less the special tokens).
    runs: Option<(RunTokenizer, usize)>,
}

impl TextTokenizer {
    pub fn new(hf: Tokenizer) -> Self {
        let keep = hf
            .get_truncation()
            .filter(|t| {
                t.stride == 0
                    && t.direction == TruncationDirection::Right
                    && matches!(
                        t.strategy,
                        TruncationStrategy::LongestFirst | TruncationStrategy::OnlyFirst
                    )
            })
            .and_then(|t| {
                let added = hf.get_post_processor().map_or(0, |p| p.added_tokens(false));
                t.max_length.checked_sub(added)
            });
        let runs = keep.and_then(|keep| {
            let r = RunTokenizer::new(hf.clone()).ok()?;
            r.caches_runs().then_some((r, keep))
        });
        Self { hf, runs }
    }

    /// The HF tokenizer over every text, never the word cache (the reference of tests).
    pub fn whole(hf: Tokenizer) -> Self {
        Self { hf, runs: None }
    }

    /// Tokenises texts (with special tokens, truncated to the tokenizer's limit), in order.
    pub fn texts(&self, texts: &[String]) -> Result<Vec<Seq>, ModelError> {
        let Some((runs, keep)) = &self.runs else {
            return bert::tokenize(&self.hf, texts);
        };
        let fail = |e: &dyn std::fmt::Display| ModelError::Inference(format!("tokenize: {e}"));
        texts
            .iter()
            .map(|text| {
                let mut tokens = runs.tokens(text, Some(*keep)).map_err(|e| fail(&e))?;
                let truncated = tokens.len() > *keep;
                tokens.truncate(*keep);
                let enc = runs
                    .tokenizer()
                    .post_process(encoding_of(&tokens), None, true)
                    .map_err(|e| fail(&e))?;
                Ok(Seq {
                    ids: enc.get_ids().to_vec(),
                    type_ids: enc.get_type_ids().to_vec(),
                    truncated,
                })
            })
            .collect()
    }

    /// Tokenises (query, passage) pairs for a cross-encoder.
    pub fn pairs(&self, query: &str, passages: &[String]) -> Result<Vec<Seq>, ModelError> {
        bert::tokenize_pairs(&self.hf, query, passages)
    }
}

/// A worker: takes pieces, small calls' first, until the pool is dropped; skips pieces whose
/// caller has gone (a cancelled RPC).
fn work(shared: &Shared) {
    loop {
        let job = {
            let mut q = shared.queue.lock();
            loop {
                if let Some(job) = q.small.pop_front().or_else(|| q.large.pop_front()) {
                    metrics::gauge!("model_tokenizer_queue_depth").set(q.len() as f64);
                    break job;
                }
                if q.closed {
                    return;
                }
                shared.ready.wait(&mut q);
            }
        };
        if job.reply.is_closed() {
            continue;
        }
        let out = match &job.input {
            Input::Texts(texts) => job.tokenizer.texts(texts),
            Input::Pairs(query, passages) => job.tokenizer.pairs(query, passages),
        };
        let _ = job.reply.send(out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A small BERT-style WordPiece tokenizer (lower-casing, [CLS]/[SEP], 16 tokens at most).
    fn tokenizer() -> Tokenizer {
        let words = [
            "[PAD]",
            "[UNK]",
            "[CLS]",
            "[SEP]",
            "raft",
            "elects",
            "a",
            "leader",
            "by",
            "vote",
            "log",
            "##s",
            "entries",
            "are",
            "replicated",
            "the",
        ];
        let vocab: serde_json::Map<String, serde_json::Value> = words
            .iter()
            .enumerate()
            .map(|(i, w)| (w.to_string(), i.into()))
            .collect();
        let json = serde_json::json!({
            "version": "1.0",
            "truncation": {"direction": "Right", "max_length": 16,
                           "strategy": "LongestFirst", "stride": 0},
            "padding": null,
            "added_tokens": [],
            "normalizer": {"type": "BertNormalizer", "clean_text": true,
                           "handle_chinese_chars": true, "strip_accents": null,
                           "lowercase": true},
            "pre_tokenizer": {"type": "BertPreTokenizer"},
            "post_processor": {"type": "BertProcessing", "sep": ["[SEP]", 3],
                               "cls": ["[CLS]", 2]},
            "decoder": null,
            "model": {"type": "WordPiece", "unk_token": "[UNK]",
                      "continuing_subword_prefix": "##", "max_input_chars_per_word": 100,
                      "vocab": vocab},
        });
        json.to_string().parse().expect("tokenizer json")
    }

    fn texts(n: usize, len: usize) -> Vec<String> {
        (0..n)
            .map(|i| {
                let words = [
                    "Raft", "elects", "a", "leader", "by", "vote", "logs", "zebra",
                ];
                (0..len + i % 7)
                    .map(|j| words[(i + j) % words.len()])
                    .collect::<Vec<_>>()
                    .join(" ")
            })
            .collect()
    }

    #[tokio::test]
    async fn a_split_call_equals_tokenising_in_one_go_in_order() {
        let tok = tokenizer();
        let cached = Arc::new(TextTokenizer::new(tok.clone()));
        assert!(
            cached.runs.is_some(),
            "a BERT tokenizer takes the word cache"
        );
        let pool = TokenizerPool::start(3, 64);
        // 40 texts of ~5 KB: split into 3 pieces.
        let big = texts(40, 800);
        let direct = bert::tokenize(&tok, &big).unwrap();
        let pooled = pool.texts("m", &cached, big.clone()).await.unwrap();
        let (pieces, small) = pool.split(big);
        assert!(!small && pieces.len() >= 3, "{} pieces", pieces.len());
        assert_eq!(pooled.len(), direct.len());
        for (a, b) in pooled.iter().zip(&direct) {
            assert_eq!(
                (&a.ids, &a.type_ids, a.truncated),
                (&b.ids, &b.type_ids, b.truncated)
            );
        }
        assert!(pooled.iter().all(|s| s.truncated && s.ids.len() == 16));
        assert_eq!(pooled[0].ids[..3], [2, 4, 5], "[CLS] raft elects");
        // Small calls stay one piece; pairs keep passage order and segment ids.
        let (pieces, small) = pool.split(texts(5, 3));
        assert!(small && pieces.len() == 1);
        let passages = texts(30, 700);
        let pairs = pool
            .pairs("m", &cached, "the leader", passages.clone())
            .await
            .unwrap();
        let want = bert::tokenize_pairs(&tok, "the leader", &passages).unwrap();
        assert_eq!(
            pairs.iter().map(|s| &s.ids).collect::<Vec<_>>(),
            want.iter().map(|s| &s.ids).collect::<Vec<_>>()
        );
        assert!(pairs[0].type_ids.contains(&1));
    }

    /// Any one call fits an idle pool; beyond one call per thread and `max_queue` waiting
    /// the next is refused at once and queues nothing.
    #[tokio::test]
    async fn calls_beyond_the_queue_are_refused_and_queue_nothing() {
        // The HF tokenizer whole: the word cache would cut these long texts short.
        let tok = Arc::new(TextTokenizer::whole(tokenizer()));
        let pool = Arc::new(TokenizerPool::start(1, 1));
        let many = texts(8, 20_000);
        assert!(pool.split(many.clone()).0.len() > 1);
        assert_eq!(pool.texts("minilm", &tok, many).await.unwrap().len(), 8);
        let large = {
            let (pool, tok) = (pool.clone(), tok.clone());
            tokio::spawn(async move { pool.texts("minilm", &tok, texts(8, 40_000)).await })
        };
        let waiting = {
            let (pool, tok) = (pool.clone(), tok.clone());
            tokio::spawn(async move { pool.texts("minilm", &tok, texts(8, 40_000)).await })
        };
        while pool.calls.load(Ordering::Acquire) < 2 {
            tokio::task::yield_now().await;
        }
        let err = pool
            .texts("minilm", &tok, vec!["raft".into()])
            .await
            .unwrap_err();
        assert!(
            matches!(err, ModelError::Overloaded(ref m) if m.contains("minilm")),
            "{err}"
        );
        assert!(pool.shared.queue.lock().small.is_empty(), "nothing queued");
        assert_eq!(large.await.unwrap().unwrap().len(), 8);
        assert_eq!(waiting.await.unwrap().unwrap().len(), 8);
        assert_eq!(pool.queued(), 0);
        let ok = pool.texts("minilm", &tok, texts(2, 3)).await.unwrap();
        assert_eq!(ok.len(), 2);
    }

    /// A one-sentence call queued behind a large one is tokenised before the large call's
    /// remaining pieces.
    #[tokio::test]
    async fn small_calls_go_before_the_pieces_of_large_ones() {
        // The HF tokenizer whole: the word cache would cut these long texts short.
        let tok = Arc::new(TextTokenizer::whole(tokenizer()));
        let pool = Arc::new(TokenizerPool::start(1, 1024));
        // About 1.6 MB in ~7 pieces on one thread.
        let large = {
            let (pool, tok) = (pool.clone(), tok.clone());
            tokio::spawn(async move {
                pool.texts("m", &tok, texts(8, 40_000)).await.unwrap();
                std::time::Instant::now()
            })
        };
        while pool.queued() == 0 {
            tokio::task::yield_now().await;
        }
        let small = pool
            .texts("m", &tok, vec!["raft elects a leader".into()])
            .await;
        let small_done = std::time::Instant::now();
        assert_eq!(small.unwrap()[0].ids, [2, 4, 5, 6, 7, 3]);
        assert!(
            pool.queued() > 0,
            "large pieces still wait after the small call"
        );
        assert!(large.await.unwrap() > small_done);
    }

    /// MiniLM's own tokenizer (when fetched): the word cache gives the HF tokenizer's
    /// sequences exactly, truncation and its flag included.
    #[test]
    fn word_cached_sequences_equal_the_hf_tokenizer() {
        let dir = std::env::var("RAGCLUSTER_MODELS")
            .map(std::path::PathBuf::from)
            .unwrap_or_else(|_| std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../models"));
        let path = dir.join("all-MiniLM-L6-v2");
        if !path.join("model.safetensors").exists() {
            ragcluster_common::skip::skipped(
                ragcluster_common::skip::SkipReason::NotSetUp,
                "tokenize::word_cached_sequences_equal_the_hf_tokenizer",
                &format!("no {} (scripts/fetch-models.sh)", path.display()),
            );
            return;
        }
        let enc = bert::BertEncoder::load("minilm", &path, 0, bert::HeadKind::MeanPool).unwrap();
        let hf = enc.tokenizer();
        let cached = TextTokenizer::new(hf.clone());
        assert!(cached.runs.is_some());
        let mut texts: Vec<String> = [
            "Café résumé, naïve — ÉCOLE! 中文字符和English混合",
            "foo\u{0c}bar baz\u{0b}qux a\u{0}b \u{fffd}x [SEP] [MASK]word 🦀🦀 👍🏽",
            "",
            " \u{0} \t",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        // Around the 256-token limit: 250-260 words, then far past it.
        for n in [250, 253, 254, 255, 256, 260, 5000] {
            texts.push(texts_of(n));
        }
        for _ in 0..2 {
            let got = cached.texts(&texts).unwrap();
            let want = bert::tokenize(&hf, &texts).unwrap();
            for ((g, w), t) in got.iter().zip(&want).zip(&texts) {
                assert_eq!(
                    (&g.ids, &g.type_ids, g.truncated),
                    (&w.ids, &w.type_ids, w.truncated),
                    "{}",
                    &t[..t.len().min(80)]
                );
            }
        }
    }

    /// `n` distinct-ish words of prose.
    fn texts_of(n: usize) -> String {
        let words = [
            "raft", "elects", "leaders;", "entries", "(term", "3)", "Café", "x",
        ];
        (0..n)
            .map(|i| words[i % words.len()])
            .collect::<Vec<_>>()
            .join(" ")
    }
}
