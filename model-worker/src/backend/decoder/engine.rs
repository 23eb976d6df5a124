//! Continuous batching for generation: one decode thread per model runs every active stream
//! in one forward per step (`decoder`: the CPU or the CUDA llama decoder). New streams join
//! at step boundaries; their prompts are prefilled in chunks within the same forwards, so a
//! long prompt does not stall the streams already decoding. A stream leaves when it
//! finishes, when its caller stops listening, or when it is cancelled. On the CPU a stream
//! that ends leaves its keys and values in the prefix cache (`prefix`), and a new prompt
//! that begins the same way prefills only the rest.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;

use rayon::prelude::*;

use super::prefix::{FirstPick, Hit, PrefixCache};
use super::sampling::{Sampler, greedy, logprob};
use super::{Cache, Decoder, Row, Sampled, Want};
use crate::error::ModelError;

/// How a generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    /// End-of-sequence token or a stop string.
    Stop,
    /// `max_tokens` reached.
    Length,
    /// The client went away.
    Cancelled,
}

impl Finish {
    pub fn as_str(self) -> &'static str {
        match self {
            Finish::Stop => "stop",
            Finish::Length => "length",
            Finish::Cancelled => "cancelled",
        }
    }
}

/// Decoding parameters, validated by the service.
#[derive(Debug, Clone)]
pub struct GenParams {
    pub max_tokens: usize,
    /// 0 = greedy.
    pub temperature: f64,
    pub top_p: f64,
    pub stop: Vec<String>,
    pub seed: u64,
    /// The reply begins with one of these strings (empty: no constraint); see `Starts`.
    pub starts_with: Vec<String>,
    /// Empty or one per `starts_with`: added to the first token's logit before the pick.
    pub starts_bias: Vec<f32>,
}

/// One generated token as streamed: the text it adds (possibly empty while a multi-byte
/// character or a possible stop string is incomplete) and its log-probability under the
/// model's distribution (temperature 1, before top-p).
pub struct Piece {
    pub text: String,
    pub token_id: u32,
    pub logprob: f32,
    /// On the first piece of a constrained reply: each beginning's first-token log-prob.
    pub start_logprobs: Vec<f32>,
    /// Prompt tokens whose keys and values came from the prefix cache (every piece).
    pub cached_tokens: usize,
    /// The stream ends with this piece (a stop or its length): its `Done` follows in the
    /// same step, so a caller that marks the last message waits for nothing else.
    pub last: bool,
}

/// How a stream ended and how many tokens it generated.
type Outcome = Result<(Finish, usize), ModelError>;

/// What a stream hears from the decode thread.
pub enum Event {
    Piece(Piece),
    Done(Outcome),
}

/// One generation handed to the decode thread.
pub struct Job {
    pub prompt: Vec<u32>,
    pub params: GenParams,
    pub events: mpsc::Sender<Event>,
    /// Set by the caller when its client has gone.
    pub cancel: Arc<AtomicBool>,
    /// `params.starts_with` as token ids.
    pub starts: Vec<Vec<u32>>,
}

/// The reply's allowed beginnings (a prefix trie walked token by token): while some are
/// open, the next token is picked, greedy or sampled as any token is, from the logits
/// restricted to the tokens that continue an open beginning; once one is complete the
/// reply goes on unconstrained. How a yes/no question gets "Yes" or "No" as its first
/// word, chosen by the model's own preference between the two, whatever the prompt's
/// wording leads a small model to start with.
#[derive(Debug, Default)]
struct Starts {
    open: Vec<Vec<u32>>,
    at: usize,
    /// (first token, bias) of the first pick.
    bias: Vec<(u32, f32)>,
}

impl Starts {
    fn new(open: Vec<Vec<u32>>, bias: &[f32]) -> Self {
        let mut firsts: Vec<(u32, f32)> = Vec::new();
        for (c, b) in open.iter().zip(bias) {
            if let Some(&t) = c.first()
                && !firsts.iter().any(|f| f.0 == t)
            {
                firsts.push((t, *b));
            }
        }
        Self {
            open,
            at: 0,
            bias: firsts,
        }
    }

    fn active(&self) -> bool {
        !self.open.is_empty()
    }

    /// The logits with every token that continues no open beginning set to -inf, and the
    /// first pick's biases added.
    fn mask(&self, logits: &[f32]) -> Vec<f32> {
        let mut out = vec![f32::NEG_INFINITY; logits.len()];
        for c in &self.open {
            if let Some(&t) = c.get(self.at)
                && let Some(v) = logits.get(t as usize)
            {
                out[t as usize] = *v;
            }
        }
        if self.at == 0 {
            for &(t, b) in &self.bias {
                if let Some(v) = out.get_mut(t as usize) {
                    *v += b;
                }
            }
        }
        out
    }

    /// Each beginning's first-token log-probability under `logits` (before the first pick).
    fn first_logprobs(&self, logits: &[f32]) -> Vec<f32> {
        if self.at != 0 {
            return Vec::new();
        }
        self.open
            .iter()
            .map(|c| c.first().map_or(f32::NEG_INFINITY, |&t| logprob(logits, t)))
            .collect()
    }

    /// Keeps the beginnings that `token` continues; all close once one is complete.
    fn advance(&mut self, token: u32) {
        let at = self.at;
        self.open.retain(|c| c.get(at) == Some(&token));
        self.at += 1;
        if self.open.iter().any(|c| c.len() == self.at) {
            self.open.clear();
        }
    }
}

/// Turns a stream's sampled tokens into text pieces: detokenises incrementally, holds back
/// incomplete characters and possible starts of stop strings, and ends at a stop string.
pub struct Detok<'a> {
    tokenizer: &'a tokenizers::Tokenizer,
    stop: Vec<String>,
    longest_stop: usize,
    ids: Vec<u32>,
    sent: usize,
}

impl<'a> Detok<'a> {
    pub fn new(tokenizer: &'a tokenizers::Tokenizer, stop: Vec<String>) -> Self {
        Self {
            tokenizer,
            longest_stop: stop.iter().map(String::len).max().unwrap_or(0),
            stop,
            ids: Vec::new(),
            sent: 0,
        }
    }

    /// The text `next` adds, and whether a stop string ended the stream. `last`: no more
    /// tokens follow, so nothing is held back.
    pub fn push(&mut self, next: u32, last: bool) -> Result<(String, bool), ModelError> {
        self.ids.push(next);
        let text = self
            .tokenizer
            .decode(&self.ids, true)
            .map_err(|e| ModelError::Inference(format!("detokenize: {e}")))?;
        let sent = self.sent;
        // A stop string ends the text just before it.
        let from = sent.saturating_sub(self.longest_stop);
        let stop_at = self
            .stop
            .iter()
            .filter_map(|s| text.get(from..)?.find(s.as_str()).map(|i| from + i))
            .min();
        if let Some(end) = stop_at {
            return Ok((text.get(sent..end).unwrap_or_default().to_owned(), true));
        }
        // Hold back an incomplete character and any tail that could start a stop string.
        let mut ready = text.len();
        if text.ends_with('\u{FFFD}') {
            ready = text.rfind('\u{FFFD}').unwrap_or(ready);
        }
        for s in &self.stop {
            for k in (1..s.len()).rev() {
                if s.is_char_boundary(k) && text[..ready].ends_with(&s[..k]) {
                    ready = (ready - k).max(sent);
                    break;
                }
            }
        }
        let end = if last { text.len() } else { ready.max(sent) };
        let delta = text.get(sent..end).unwrap_or_default().to_owned();
        self.sent = end.max(sent);
        Ok((delta, false))
    }
}

struct Stream<'a> {
    job: Job,
    cache: Cache,
    /// Prompt tokens not yet run through the model.
    prefill_at: usize,
    /// None without a temperature: the next token is the argmax, which the decoder may pick
    /// itself.
    sampler: Option<Sampler>,
    detok: Detok<'a>,
    starts: Starts,
    /// The token to feed next (decoding) and how many were generated.
    next: u32,
    generated: usize,
    /// Generated tokens, in order (with the prompt: what the cache holds, for `PrefixCache`).
    replied: Vec<u32>,
    /// Prompt tokens taken from the prefix cache.
    cached: usize,
    /// The decoder's answer after the prompt, kept with the cache for a repeat of the prompt.
    first: Option<FirstPick>,
    /// Whether the stream's cache goes to the prefix cache when it ends (a CPU cache, the
    /// prefix cache on): else nothing is copied for it.
    keeps: bool,
}

impl Stream<'_> {
    /// Takes the decoder's token (greedy) or samples one from the logits, and tells the
    /// caller. Returns how the stream ended, if it did.
    fn on_sampled(&mut self, out: Sampled, eos: &[u32]) -> Result<Option<Finish>, ModelError> {
        // A repeat of the prompt may start from this answer: logits serve any request, a
        // token only when it is the greedy pick (a GPU draws sampled tokens itself).
        if self.keeps
            && self.generated == 0
            && (self.sampler.is_none() || matches!(out, Sampled::Logits(_)))
        {
            self.first = Some(FirstPick {
                at: self.job.prompt.len(),
                out: out.clone(),
            });
        }
        let mut start_logprobs = Vec::new();
        let (next, logprob) = match out {
            Sampled::Token { token, logprob } => (token, logprob),
            Sampled::Logits(logits) => {
                if self.starts.active() {
                    start_logprobs = self.starts.first_logprobs(&logits);
                }
                let masked;
                let pick_from: &[f32] = if self.starts.active() {
                    masked = self.starts.mask(&logits);
                    &masked
                } else {
                    &logits
                };
                let next = match &mut self.sampler {
                    Some(s) => s.sample(pick_from),
                    None => greedy(pick_from),
                };
                (next, logprob(&logits, next))
            }
        };
        if self.starts.active() {
            self.starts.advance(next);
        }
        self.generated += 1;
        self.replied.push(next);
        let last = self.generated == self.job.params.max_tokens;
        let (text, stopped) = if eos.contains(&next) {
            (String::new(), true)
        } else {
            self.detok.push(next, last)?
        };
        let piece = Piece {
            text,
            token_id: next,
            logprob,
            start_logprobs,
            cached_tokens: self.cached,
            last: stopped || last,
        };
        if self.job.events.send(Event::Piece(piece)).is_err() {
            return Ok(Some(Finish::Cancelled));
        }
        self.next = next;
        Ok(if stopped {
            Some(Finish::Stop)
        } else if last {
            Some(Finish::Length)
        } else {
            None
        })
    }

    fn prefilling(&self) -> bool {
        self.prefill_at < self.job.prompt.len()
    }

    /// Leaves the stream's keys and values to `prefixes` (CPU caches only).
    fn retire(self, prefixes: &mut PrefixCache) {
        if let (true, Cache::Cpu(kv)) = (self.keeps, self.cache) {
            let mut tokens = self.job.prompt;
            tokens.extend(self.replied);
            prefixes.keep(tokens, kv, self.first);
        }
    }
}

/// The decode thread of one model.
pub struct Engine {
    jobs: mpsc::Sender<Job>,
}

impl Engine {
    /// Starts the decode thread; it ends when the engine is dropped and its streams are done.
    /// `prefix_cache` bytes of finished streams' keys and values are kept for prompts that
    /// begin the same way (CPU decoder; 0: none).
    pub fn start(
        name: &str,
        model: Arc<Decoder>,
        tokenizer: Arc<tokenizers::Tokenizer>,
        eos: Vec<u32>,
        prefix_cache: usize,
    ) -> Result<Self, ModelError> {
        let (jobs, rx) = mpsc::channel();
        let label = name.to_owned();
        let prefixes = PrefixCache::new(match *model {
            Decoder::Cpu(_) => prefix_cache,
            Decoder::Cuda(_) => 0,
        });
        std::thread::Builder::new()
            .name(format!("decode-{name}"))
            .spawn(move || run(&label, &model, &tokenizer, &eos, rx, prefixes))
            .map_err(|e| ModelError::Inference(format!("decode thread: {e}")))?;
        Ok(Self { jobs })
    }

    pub fn submit(&self, job: Job) -> Result<(), ModelError> {
        self.jobs
            .send(job)
            .map_err(|_| ModelError::Inference("the decode thread has stopped".into()))
    }
}

/// A new stream, its prompt's cached beginning copied from `prefixes`. A prompt asked whole
/// before starts from that asking's first pick, so it decodes as the first asking did; a
/// stream that ends on that pick (its first token a stop, or `max_tokens` 1) is done here
/// (None).
fn admit<'a>(
    job: Job,
    model: &Decoder,
    tokenizer: &'a tokenizers::Tokenizer,
    eos: &[u32],
    label: &str,
    prefixes: &mut PrefixCache,
) -> Option<Stream<'a>> {
    let p = &job.params;
    // Below 1e-7 a temperature is an argmax (candle's rule, kept).
    let sampler = (p.temperature >= 1e-7).then(|| Sampler::new(p.seed, p.temperature, p.top_p));
    let greedy = sampler.is_none() && job.starts.is_empty();
    let (cache, cached, first) = match prefixes.take(&job.prompt, greedy) {
        Some(Hit { kv, first }) => {
            let n = kv.len();
            (Cache::Cpu(kv), n, first)
        }
        None => (model.new_cache(), 0, None),
    };
    metrics::counter!("model_prefix_cache_tokens_total", "model" => label.to_owned())
        .increment(cached as u64);
    let keeps = prefixes.is_on() && matches!(cache, Cache::Cpu(_));
    let mut s = Stream {
        cache,
        prefill_at: cached,
        sampler,
        detok: Detok::new(tokenizer, job.params.stop.clone()),
        starts: Starts::new(job.starts.clone(), &job.params.starts_bias),
        next: 0,
        generated: 0,
        replied: Vec::new(),
        cached,
        first: None,
        keeps,
        job,
    };
    let Some(out) = first else {
        return Some(s);
    };
    let done = match s.on_sampled(out, eos) {
        Ok(None) => return Some(s),
        Ok(Some(finish)) => Ok((finish, s.generated)),
        Err(e) => Err(e),
    };
    let kept = done.is_ok();
    let _ = s.job.events.send(Event::Done(done));
    if kept {
        s.retire(prefixes);
    }
    None
}

fn run(
    label: &str,
    model: &Decoder,
    tokenizer: &tokenizers::Tokenizer,
    eos: &[u32],
    jobs: mpsc::Receiver<Job>,
    mut prefixes: PrefixCache,
) {
    let mut active: Vec<Stream> = Vec::new();
    loop {
        // Wait only when idle; otherwise take whatever arrived since the last step.
        let arrived: Vec<Job> = if active.is_empty() {
            match jobs.recv() {
                Ok(j) => std::iter::once(j).chain(jobs.try_iter()).collect(),
                Err(_) => return,
            }
        } else {
            jobs.try_iter().collect()
        };
        for job in arrived {
            active.extend(admit(job, model, tokenizer, eos, label, &mut prefixes));
        }
        for s in std::mem::take(&mut active) {
            if s.job.cancel.load(Ordering::Acquire) {
                let _ = s
                    .job
                    .events
                    .send(Event::Done(Ok((Finish::Cancelled, s.generated))));
                s.retire(&mut prefixes);
            } else {
                active.push(s);
            }
        }
        if active.is_empty() {
            continue;
        }
        // A failed (or panicking) forward fails every stream in it; the thread goes on for
        // new ones, so one bad step never leaves the model without a decode thread (a
        // failed step's caches are dropped, not kept).
        let stepped = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            step(model, eos, &mut active, label, &mut prefixes)
        }))
        .unwrap_or_else(|_| Err(ModelError::Inference("decode step panicked".into())));
        if let Err(e) = stepped {
            tracing::error!(model = label, error = %e, streams = active.len(), "decode step failed");
            for s in active.drain(..) {
                let e = ModelError::Inference(e.to_string());
                let _ = s.job.events.send(Event::Done(Err(e)));
            }
        }
    }
}

/// One forward over every decoding stream plus up to `Decoder::prefill_rows` prompt rows; streams
/// that end leave `active`, their caches to `prefixes`.
fn step(
    model: &Decoder,
    eos: &[u32],
    active: &mut Vec<Stream>,
    label: &str,
    prefixes: &mut PrefixCache,
) -> Result<(), ModelError> {
    let mut rows = Vec::new();
    // (stream, row whose logits it samples from)
    let mut sample_at = Vec::new();
    let mut budget = model.prefill_rows();
    for (i, s) in active.iter_mut().enumerate() {
        if s.prefilling() {
            if budget == 0 {
                continue;
            }
            let take = budget.min(s.job.prompt.len() - s.prefill_at);
            for &token in &s.job.prompt[s.prefill_at..s.prefill_at + take] {
                rows.push(Row { seq: i, token });
            }
            s.prefill_at += take;
            budget -= take;
            if !s.prefilling() {
                sample_at.push((i, rows.len() - 1));
            }
        } else {
            rows.push(Row {
                seq: i,
                token: s.next,
            });
            sample_at.push((i, rows.len() - 1));
        }
    }
    if rows.is_empty() {
        return Ok(());
    }
    metrics::histogram!("model_decode_step_rows", "model" => label.to_owned())
        .record(rows.len() as f64);
    let want: Vec<usize> = sample_at.iter().map(|&(_, r)| r).collect();
    // A sampled row is drawn by the decoder when it can (the GPU: two numbers back instead
    // of the row's logits), with the stream's next variate; else sampled here from logits.
    let on_device = model.samples_on_device();
    let how: Vec<Want> = sample_at
        .iter()
        .map(|&(i, _)| {
            let s = &mut active[i];
            // A constrained pick needs the logits to mask.
            if s.starts.active() {
                return Want::Logits;
            }
            match &mut s.sampler {
                None => Want::Greedy,
                Some(s) if on_device => Want::Sample(s.draw()),
                Some(_) => Want::Logits,
            }
        })
        .collect();
    let started = std::time::Instant::now();
    let outs = {
        let mut caches: Vec<&mut Cache> = active.iter_mut().map(|s| &mut s.cache).collect();
        model.forward_sampled(&rows, &mut caches, &want, &how)?
    };
    // The forward alone: against the step rate it shows how much of a step is the model.
    metrics::histogram!("model_decode_forward_seconds", "model" => label.to_owned())
        .record(started.elapsed().as_secs_f64());
    // Sampling, detokenising and sending run per stream in parallel: on the decode thread
    // alone they left the cores idle between forwards.
    let mut by_stream: Vec<Option<Sampled>> = vec![None; active.len()];
    for ((i, _), out) in sample_at.into_iter().zip(outs) {
        by_stream[i] = Some(out);
    }
    let mut ended: Vec<(usize, Outcome)> = active
        .par_iter_mut()
        .zip(by_stream)
        .enumerate()
        .filter_map(|(i, (s, out))| match s.on_sampled(out?, eos) {
            Ok(None) => None,
            Ok(Some(f)) => Some((i, Ok((f, s.generated)))),
            Err(e) => Some((i, Err(e))),
        })
        .collect();
    // Highest index first, so the indexes still to remove stay valid.
    ended.sort_by_key(|e| std::cmp::Reverse(e.0));
    let retired = !ended.is_empty();
    for (i, result) in ended {
        let s = active.swap_remove(i);
        let kept = result.is_ok();
        let _ = s.job.events.send(Event::Done(result));
        if kept {
            s.retire(prefixes);
        }
    }
    if retired {
        metrics::gauge!("model_prefix_cache_bytes", "model" => label.to_owned())
            .set(prefixes.bytes() as f64);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn starts_walk_their_trie_then_let_go() {
        // "Yes" = [5], "No" = [7], "No way" = [7, 2, 3].
        let mut s = Starts::new(vec![vec![5], vec![7, 2, 3], vec![7]], &[]);
        let logits = [0.0, 9.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        let m = s.mask(&logits);
        assert_eq!(greedy(&m), 7);
        assert!(
            m.iter()
                .enumerate()
                .all(|(i, v)| (i == 5 || i == 7) == v.is_finite())
        );
        // "No" is complete after one token: the shorter beginning ends the constraint.
        s.advance(7);
        assert!(!s.active());

        let mut s = Starts::new(vec![vec![5], vec![7, 2, 3]], &[]);
        s.advance(7);
        assert!(s.active());
        assert_eq!(greedy(&s.mask(&logits)), 2, "only [7, 2, 3] is open");
        s.advance(2);
        s.advance(3);
        assert!(!s.active());

        // A bias moves the first pick, and only the first; log-probs are the model's own.
        let s = Starts::new(vec![vec![5], vec![7]], &[2.5, 0.0]);
        assert_eq!(greedy(&s.mask(&logits)), 5);
        let lp = s.first_logprobs(&logits);
        assert!(
            lp[1] > lp[0] && (lp[1] - lp[0] - 2.0).abs() < 1e-5,
            "{lp:?}"
        );
    }
}
