//! Dynamic batching in front of an encoder thread (the TEI approach, on CPU).
//!
//! Requests arrive already tokenised and wait in a bounded queue (full -> RESOURCE_EXHAUSTED
//! with a retry hint, never unbounded growth). The encoder thread takes the first waiting
//! request, then keeps collecting for at most `max_wait` after it was queued (or until a
//! batch's worth of tokens is waiting), drops requests whose caller has gone, sorts every
//! sequence by length (longest first) and packs batches so that
//! `sequences x longest sequence <= max_batch_tokens`: padding stays small and one long text
//! cannot make a huge padded batch. A request is answered as soon as its last sequence is
//! done, not when the whole round is.
//!
//! Small requests (a query's one text: at most an eighth of a batch in sequences and tokens)
//! do not wait behind bulk ones. A round computes its small requests first, in passes of their
//! own, and between two passes over bulk requests it takes the small requests that were queued
//! meanwhile out of the queue and computes them before the next bulk pass. Without that a
//! query embedded during an ingest waited for the rest of the round and then for every bulk
//! request queued before it (seconds on CPU); now it waits for at most one pass. Bulk requests
//! keep their order, and at least every other pass is theirs.
//!
//! A bulk request whose caller set a deadline is refused up front (RESOURCE_EXHAUSTED, with
//! a retry hint of when enough of the queue should be done) when the bulk work queued ahead
//! of it would take more than three quarters of that deadline at the encoder's measured rate:
//! an ingest sending more than a CPU encoder can do within the deadline gets told to wait,
//! instead of every call timing out after the whole deadline (and the encoder computing
//! answers nobody waits for any more). Small requests skip ahead of bulk ones and are never refused for it.
//!
//! With `batching = false` every request runs alone (its own texts still form one batch):
//! the baseline the benchmark compares against.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};
use tokio::sync::oneshot;

use crate::backend::{Encoder, Seq};
use crate::error::ModelError;

/// Batching limits of one model.
#[derive(Debug, Clone)]
pub struct BatchConfig {
    /// Sequences per forward pass.
    pub max_batch: usize,
    /// Padded tokens (sequences x longest) per forward pass.
    pub max_batch_tokens: usize,
    /// How long the first request of a batch may wait for company.
    pub max_wait: Duration,
    /// Requests waiting before new ones are refused.
    pub max_queue: usize,
    /// Merge concurrent requests into shared batches.
    pub batching: bool,
    /// Compute small requests ahead of bulk ones (false: arrival order only).
    pub small_first: bool,
}

impl BatchConfig {
    /// Whether a request of `seqs` sequences and `tokens` tokens may skip ahead of bulk ones.
    fn is_small(&self, seqs: usize, tokens: usize) -> bool {
        self.small_first
            && seqs <= (self.max_batch / 8).max(1)
            && tokens <= (self.max_batch_tokens / 8).max(1)
    }
}

type Reply = oneshot::Sender<Result<Vec<Vec<f32>>, ModelError>>;

struct Job {
    seqs: Vec<Seq>,
    tokens: usize,
    /// May skip ahead of bulk requests (`BatchConfig::is_small`).
    small: bool,
    reply: Reply,
    enqueued: Instant,
}

/// A bulk request is admitted while the queued bulk work takes at most this share of its
/// deadline (the rest covers the round in progress and a rate that moves).
const ADMIT_SHARE: f64 = 0.75;
/// How far the measured rate follows each round (exponential moving average).
const RATE_WEIGHT: f64 = 0.3;

/// The waiting requests. A queue of our own rather than a channel: the encoder thread takes
/// small requests out of the middle of it, and `max_queue` counts exactly what waits.
struct Queue {
    name: String,
    cap: usize,
    state: Mutex<QueueState>,
    ready: Condvar,
    /// Tokens the encoder computes per second of rounds (f64 bits; 0: not measured yet).
    rate: AtomicU64,
}

#[derive(Default)]
struct QueueState {
    jobs: VecDeque<Job>,
    /// Tokens of the bulk requests waiting.
    bulk_tokens: usize,
    /// The `Batcher` was dropped: the encoder thread ends once the queue is empty.
    closed: bool,
}

impl Queue {
    fn gauge(&self, depth: usize) {
        metrics::gauge!("model_queue_depth", "model" => self.name.clone()).set(depth as f64);
    }

    fn push(&self, job: Job, deadline: Option<Duration>) -> Result<(), ModelError> {
        let mut s = self.state.lock();
        if s.jobs.len() >= self.cap {
            return Err(ModelError::Overloaded(self.name.clone()));
        }
        if let (false, Some(d), Some(rate)) = (job.small, deadline, self.rate()) {
            // Alone in the queue a request is always taken, however long it is.
            let wait = (s.bulk_tokens + job.tokens) as f64 / rate;
            let budget = d.as_secs_f64() * ADMIT_SHARE;
            if s.bulk_tokens > 0 && wait > budget {
                metrics::counter!("model_backlog_refusals_total", "model" => self.name.clone())
                    .increment(1);
                return Err(ModelError::Backlog {
                    model: self.name.clone(),
                    wait_ms: (wait * 1e3) as u64,
                    deadline_ms: d.as_millis() as u64,
                    retry_after_ms: ((wait - budget) * 1e3).clamp(50.0, 10_000.0) as u64,
                });
            }
        }
        if !job.small {
            s.bulk_tokens += job.tokens;
        }
        s.jobs.push_back(job);
        self.gauge(s.jobs.len());
        drop(s);
        self.ready.notify_one();
        Ok(())
    }

    /// The oldest request, waiting for one; None once closed and empty.
    fn pop(&self) -> Option<Job> {
        let mut s = self.state.lock();
        loop {
            if let Some(j) = s.pop_front() {
                self.gauge(s.jobs.len());
                return Some(j);
            }
            if s.closed {
                return None;
            }
            self.ready.wait(&mut s);
        }
    }

    /// The oldest request, waiting until `deadline` at most.
    fn pop_until(&self, deadline: Instant) -> Option<Job> {
        let mut s = self.state.lock();
        loop {
            if let Some(j) = s.pop_front() {
                self.gauge(s.jobs.len());
                return Some(j);
            }
            if s.closed || self.ready.wait_until(&mut s, deadline).timed_out() {
                return None;
            }
        }
    }

    /// Takes the waiting small requests, oldest first, up to a batch's worth of sequences
    /// and tokens.
    fn take_small(&self, cfg: &BatchConfig) -> Vec<Job> {
        let mut s = self.state.lock();
        let mut taken = Vec::new();
        let (mut seqs, mut tokens) = (0, 0);
        let mut i = 0;
        while i < s.jobs.len() {
            let j = &s.jobs[i];
            if j.small
                && seqs + j.seqs.len() <= cfg.max_batch
                && tokens + j.tokens <= cfg.max_batch_tokens
            {
                seqs += j.seqs.len();
                tokens += j.tokens;
                taken.extend(s.jobs.remove(i));
            } else {
                i += 1;
            }
        }
        if !taken.is_empty() {
            self.gauge(s.jobs.len());
        }
        taken
    }

    fn close(&self) {
        self.state.lock().closed = true;
        self.ready.notify_all();
    }

    /// The measured rate in tokens per second, once there is one.
    fn rate(&self) -> Option<f64> {
        let r = f64::from_bits(self.rate.load(Ordering::Relaxed));
        (r > 0.0).then_some(r)
    }

    /// Folds a round of `tokens` computed in `took` into the rate.
    fn observe(&self, tokens: usize, took: Duration) {
        let secs = took.as_secs_f64();
        if tokens == 0 || secs < 1e-4 {
            return;
        }
        let now = tokens as f64 / secs;
        let r = match self.rate() {
            Some(old) => old + RATE_WEIGHT * (now - old),
            None => now,
        };
        self.rate.store(r.to_bits(), Ordering::Relaxed);
    }
}

impl QueueState {
    fn pop_front(&mut self) -> Option<Job> {
        let j = self.jobs.pop_front()?;
        if !j.small {
            self.bulk_tokens -= j.tokens;
        }
        Some(j)
    }
}

/// Handle to one model's queue and encoder thread.
pub struct Batcher {
    queue: Arc<Queue>,
    cfg: BatchConfig,
}

impl Drop for Batcher {
    fn drop(&mut self) {
        self.queue.close();
    }
}

impl Batcher {
    pub fn start(name: String, backend: Box<dyn Encoder>, cfg: BatchConfig) -> Self {
        Self::start_probed(name, backend, cfg, &[])
    }

    /// As `start`, after one forward over `probe` whose speed seeds the measured rate: the
    /// backlog check then holds from the first request. Without it a cold worker admits
    /// everything, and a slow model (nomic-embed on two cores, ~600 tokens/s) let a burst of
    /// ingest calls queue minutes of work that then ran past their deadlines.
    pub fn start_probed(
        name: String,
        mut backend: Box<dyn Encoder>,
        cfg: BatchConfig,
        probe: &[Seq],
    ) -> Self {
        let queue = Arc::new(Queue {
            name: name.clone(),
            cap: cfg.max_queue.max(1),
            state: Mutex::new(QueueState::default()),
            ready: Condvar::new(),
            rate: AtomicU64::new(0),
        });
        if !probe.is_empty() {
            let refs: Vec<&Seq> = probe.iter().collect();
            let t = Instant::now();
            match backend.forward(&refs) {
                Ok(_) => queue.observe(probe.iter().map(|s| s.ids.len()).sum(), t.elapsed()),
                Err(e) => tracing::warn!(model = %name, error = %e, "rate probe failed"),
            }
        }
        {
            let queue = queue.clone();
            let name = name.clone();
            let cfg = cfg.clone();
            std::thread::Builder::new()
                .name(format!("encode-{name}"))
                .spawn(move || Worker { name, backend, cfg }.run(&queue))
                .expect("spawn encoder thread");
        }
        Self { queue, cfg }
    }

    /// Queues the sequences and waits for one output per sequence, in order. Dropping the
    /// future (a cancelled RPC) drops the request from the queue. `deadline`: how long the
    /// caller waits (its gRPC deadline), for the backlog check.
    pub async fn run(
        &self,
        seqs: Vec<Seq>,
        deadline: Option<Duration>,
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        if seqs.is_empty() {
            return Ok(Vec::new());
        }
        let (reply, rx) = oneshot::channel();
        let tokens = seqs.iter().map(|s| s.ids.len()).sum();
        let small = self.cfg.is_small(seqs.len(), tokens);
        let job = Job {
            seqs,
            tokens,
            small,
            reply,
            enqueued: Instant::now(),
        };
        self.queue.push(job, deadline)?;
        rx.await
            .map_err(|_| ModelError::Inference("encoder dropped the request".into()))?
    }
}

/// A request being computed: outputs fill in as its sequences' batches finish.
struct Active {
    job: Job,
    out: Vec<Option<Vec<f32>>>,
    left: usize,
}

struct Worker {
    name: String,
    backend: Box<dyn Encoder>,
    cfg: BatchConfig,
}

impl Worker {
    fn run(mut self, queue: &Queue) {
        while let Some(first) = queue.pop() {
            let jobs = if self.cfg.batching {
                let mut jobs = self.gather(first, queue);
                // Small requests queued behind the bulk ones gathered go first.
                if self.cfg.small_first {
                    jobs.extend(queue.take_small(&self.cfg));
                }
                jobs
            } else {
                vec![first]
            };
            self.round(jobs, queue);
        }
    }

    /// The first job plus whatever arrives within `max_wait` of its enqueueing, up to a few
    /// batches' worth of tokens (more waiting would only delay the first).
    fn gather(&self, first: Job, queue: &Queue) -> Vec<Job> {
        let deadline = first.enqueued + self.cfg.max_wait;
        let enough = self.cfg.max_batch_tokens;
        let cap = enough * 4;
        let mut tokens = first.tokens;
        let mut jobs = vec![first];
        while tokens < cap {
            // Past the deadline, or with a batch's worth waiting, only take what is queued.
            let until = if tokens >= enough {
                Instant::now()
            } else {
                deadline
            };
            let Some(j) = queue.pop_until(until) else {
                break;
            };
            tokens += j.tokens;
            jobs.push(j);
        }
        jobs
    }

    /// Computes `jobs`: the small ones first, then the rest, taking small requests queued
    /// meanwhile between two passes over the rest.
    fn round(&mut self, jobs: Vec<Job>, queue: &Queue) {
        let started = Instant::now();
        // What will be computed: callers that went away are skipped.
        let tokens = jobs
            .iter()
            .filter(|j| !j.reply.is_closed())
            .map(|j| j.tokens)
            .sum();
        let (small, bulk): (Vec<Job>, Vec<Job>) = jobs.into_iter().partition(|j| j.small);
        if !small.is_empty() {
            self.compute(small, None);
        }
        if !bulk.is_empty() {
            let between = (self.cfg.batching && self.cfg.small_first).then_some(queue);
            self.compute(bulk, between);
        }
        queue.observe(tokens, started.elapsed());
    }

    /// Packs the jobs' sequences into passes (longest first) and answers each job when its
    /// last sequence is done. With `between`, small requests waiting there are computed after
    /// every pass but the last.
    fn compute(&mut self, jobs: Vec<Job>, between: Option<&Queue>) {
        let name = self.name.clone();
        let mut active: Vec<Active> = jobs
            .into_iter()
            // Callers that went away (cancelled RPCs) are not computed.
            .filter(|j| !j.reply.is_closed())
            .map(|job| {
                metrics::histogram!("model_queue_seconds", "model" => name.clone())
                    .record(job.enqueued.elapsed().as_secs_f64());
                let n = job.seqs.len();
                Active {
                    job,
                    out: vec![None; n],
                    left: n,
                }
            })
            .collect();
        // (job, index) of every sequence, longest first.
        let mut order: Vec<(usize, usize)> = active
            .iter()
            .enumerate()
            .flat_map(|(j, a)| (0..a.job.seqs.len()).map(move |i| (j, i)))
            .collect();
        order.sort_by_key(|&(j, i)| std::cmp::Reverse(active[j].job.seqs[i].ids.len()));
        let mut start = 0;
        while start < order.len() {
            let longest = active[order[start].0].job.seqs[order[start].1]
                .ids
                .len()
                .max(1);
            let fit = (self.cfg.max_batch_tokens / longest).clamp(1, self.cfg.max_batch);
            let end = (start + fit).min(order.len());
            let batch: Vec<(usize, usize)> = order[start..end]
                .iter()
                .copied()
                .filter(|&(j, _)| !active[j].job.reply.is_closed())
                .collect();
            start = end;
            if batch.is_empty() {
                continue;
            }
            self.pass(&mut active, &batch, longest);
            if let Some(queue) = between.filter(|_| start < order.len()) {
                let small = queue.take_small(&self.cfg);
                if !small.is_empty() {
                    metrics::counter!("model_small_requests_ahead_total", "model" => name.clone())
                        .increment(small.len() as u64);
                    self.compute(small, None);
                }
            }
        }
    }

    /// One forward pass over `batch` ((job, sequence) pairs of `active`).
    fn pass(&mut self, active: &mut [Active], batch: &[(usize, usize)], longest: usize) {
        let name = self.name.clone();
        let seqs: Vec<&Seq> = batch.iter().map(|&(j, i)| &active[j].job.seqs[i]).collect();
        let real: usize = seqs.iter().map(|s| s.ids.len()).sum();
        metrics::histogram!("model_batch_size", "model" => name.clone()).record(seqs.len() as f64);
        metrics::histogram!("model_batch_tokens", "model" => name.clone())
            .record((seqs.len() * longest) as f64);
        let t = Instant::now();
        let result = self.backend.forward(&seqs);
        metrics::histogram!("model_device_seconds", "model" => name.clone())
            .record(t.elapsed().as_secs_f64());
        match result {
            Ok(outs) => {
                metrics::counter!("model_tokens_total", "model" => name.clone())
                    .increment(real as u64);
                for (&(j, i), v) in batch.iter().zip(outs) {
                    let a = &mut active[j];
                    a.out[i] = Some(v);
                    a.left -= 1;
                }
                // Answer every request that is now complete.
                for &(j, _) in batch {
                    if active[j].left == 0 && !active[j].out.is_empty() {
                        let out = std::mem::take(&mut active[j].out);
                        let (tx, _) = oneshot::channel();
                        let reply = std::mem::replace(&mut active[j].job.reply, tx);
                        let _ = reply.send(Ok(out.into_iter().flatten().collect()));
                    }
                }
            }
            Err(e) => {
                tracing::warn!(model = %name, error = %e, "forward pass failed");
                for &(j, _) in batch {
                    let a = &mut active[j];
                    if !a.out.is_empty() {
                        a.out.clear();
                        let (tx, _) = oneshot::channel();
                        let reply = std::mem::replace(&mut a.job.reply, tx);
                        let _ = reply.send(Err(ModelError::Inference(e.to_string())));
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;

    /// Answers each sequence with its length and records the shape of every batch, so the
    /// packing rules can be checked without a model. A sequence of `BLOCKER` tokens takes
    /// 300 ms, holding the encoder busy while a test fills the queue.
    struct Recorder(Arc<Mutex<Vec<Vec<usize>>>>);

    const BLOCKER: usize = 99;
    /// A sequence of this many tokens takes 100 ms (a bulk pass that a test can overtake).
    const SLOW: usize = 40;

    impl Encoder for Recorder {
        fn forward(&mut self, batch: &[&Seq]) -> Result<Vec<Vec<f32>>, ModelError> {
            let lens: Vec<usize> = batch.iter().map(|s| s.ids.len()).collect();
            if lens.contains(&BLOCKER) {
                std::thread::sleep(Duration::from_millis(300));
            } else if lens.contains(&SLOW) {
                std::thread::sleep(Duration::from_millis(100));
            }
            self.0.lock().unwrap().push(lens.clone());
            Ok(lens.into_iter().map(|l| vec![l as f32]).collect())
        }
    }

    fn seq(len: usize) -> Seq {
        Seq {
            ids: vec![1; len],
            type_ids: vec![0; len],
            truncated: false,
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn packs_by_token_budget_longest_first_and_keeps_request_order() {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let b = Arc::new(Batcher::start(
            "t".into(),
            Box::new(Recorder(seen.clone())),
            BatchConfig {
                max_batch: 4,
                max_batch_tokens: 100,
                max_wait: Duration::from_millis(50),
                max_queue: 16,
                batching: true,
                small_first: true,
            },
        ));
        // Hold the encoder busy so the three requests are all queued when it next gathers:
        // the test must not depend on thread scheduling.
        let blocker = {
            let b = b.clone();
            tokio::spawn(async move { b.run(vec![seq(BLOCKER)], None).await })
        };
        // (Were it merged into their round instead, it would still run first and alone: 99
        // tokens fill the 100-token budget.)
        tokio::time::sleep(Duration::from_millis(50)).await;
        let jobs = [vec![50, 10, 10], vec![30, 5], vec![5, 5, 60, 1]];
        let calls = jobs.iter().map(|lens| {
            let b = b.clone();
            let seqs: Vec<Seq> = lens.iter().map(|&l| seq(l)).collect();
            async move { b.run(seqs, None).await }
        });
        let out = futures::future::join_all(calls).await;
        for (lens, got) in jobs.iter().zip(out) {
            let got: Vec<usize> = got.unwrap().into_iter().map(|v| v[0] as usize).collect();
            assert_eq!(&got, lens, "outputs must come back in request order");
        }
        blocker.await.unwrap().unwrap();
        let mut batches = seen.lock().unwrap().clone();
        assert_eq!(batches.remove(0), vec![BLOCKER]);
        let total: usize = batches.iter().map(Vec::len).sum();
        assert_eq!(total, 9);
        // All three requests were merged into one round (all were waiting).
        assert!(batches.len() <= 5, "{batches:?}");
        for b in &batches {
            let longest = *b.iter().max().unwrap();
            assert!(b.len() <= 4, "{batches:?}");
            assert!(b.len() == 1 || b.len() * longest <= 100, "{batches:?}");
            assert!(
                b.windows(2).all(|w| w[0] >= w[1]),
                "longest first: {batches:?}"
            );
        }
        // The longest sequences lead: 60 and 50 cannot share a 100-token batch with others.
        assert_eq!(batches[0], vec![60]);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn without_batching_requests_run_alone() {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let b = Arc::new(Batcher::start(
            "t".into(),
            Box::new(Recorder(seen.clone())),
            BatchConfig {
                max_batch: 64,
                max_batch_tokens: 10_000,
                max_wait: Duration::from_millis(50),
                max_queue: 16,
                batching: false,
                small_first: true,
            },
        ));
        let calls = (0..4).map(|_| {
            let b = b.clone();
            async move { b.run(vec![seq(3), seq(2)], None).await }
        });
        for r in futures::future::join_all(calls).await {
            r.unwrap();
        }
        let batches = seen.lock().unwrap().clone();
        assert_eq!(batches, vec![vec![3, 2]; 4]);
    }

    fn config(max_batch: usize, max_batch_tokens: usize, max_queue: usize) -> BatchConfig {
        BatchConfig {
            max_batch,
            max_batch_tokens,
            max_wait: Duration::from_millis(5),
            max_queue,
            batching: true,
            small_first: true,
        }
    }

    /// Two bulk requests (4 and 2 sequences of `SLOW` tokens: passes of two under an 80-token
    /// budget) and a one-sequence request queued while the first one's first pass runs. The
    /// batches the encoder saw, and how long the small request took.
    async fn small_behind_bulk(small_first: bool) -> (Vec<Vec<usize>>, Duration) {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let b = Arc::new(Batcher::start(
            "t".into(),
            Box::new(Recorder(seen.clone())),
            BatchConfig {
                small_first,
                ..config(8, 80, 16)
            },
        ));
        let send = |lens: Vec<usize>, after_ms: u64| {
            let b = b.clone();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(after_ms)).await;
                let t = Instant::now();
                let out = b
                    .run(lens.iter().map(|&l| seq(l)).collect(), None)
                    .await
                    .unwrap();
                let got: Vec<usize> = out.into_iter().map(|v| v[0] as usize).collect();
                assert_eq!(got, lens);
                t.elapsed()
            })
        };
        let first = send(vec![SLOW; 4], 0);
        let second = send(vec![SLOW; 2], 20);
        let small = send(vec![3], 50);
        let small_wait = small.await.unwrap();
        first.await.unwrap();
        second.await.unwrap();
        let batches = seen.lock().unwrap().clone();
        (batches, small_wait)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_small_request_overtakes_queued_bulk_between_passes() {
        // Small: one sequence of at most 10 tokens. Queued after the second bulk request, it
        // is computed before it and before the first's second pass.
        let (batches, wait) = small_behind_bulk(true).await;
        assert_eq!(
            batches,
            vec![vec![SLOW; 2], vec![3], vec![SLOW; 2], vec![SLOW; 2]],
            "{batches:?}"
        );
        assert!(wait < Duration::from_millis(250), "{wait:?}");
        // The baseline: arrival order.
        let (batches, _) = small_behind_bulk(false).await;
        assert_eq!(
            batches,
            vec![vec![SLOW; 2], vec![SLOW; 2], vec![SLOW; 2], vec![3]],
            "{batches:?}"
        );
    }

    type Outputs = Result<Vec<Vec<f32>>, ModelError>;

    /// A batcher whose encoder is busy with the 300 ms `BLOCKER` request (already taken out
    /// of the queue), the batches it sees, and the blocker's call.
    async fn blocked(
        cfg: BatchConfig,
    ) -> (
        Arc<Batcher>,
        Arc<Mutex<Vec<Vec<usize>>>>,
        tokio::task::JoinHandle<Outputs>,
    ) {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let b = Arc::new(Batcher::start(
            "t".into(),
            Box::new(Recorder(seen.clone())),
            cfg,
        ));
        let blocker = {
            let b = b.clone();
            tokio::spawn(async move { b.run(vec![seq(BLOCKER)], None).await })
        };
        tokio::time::sleep(Duration::from_millis(50)).await;
        (b, seen, blocker)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn small_requests_gathered_with_bulk_ones_go_first() {
        // Small: at most two sequences and 25 tokens.
        let (b, seen, blocker) = blocked(config(16, 200, 16)).await;
        // Both wait behind the blocker; the bulk one was queued first.
        let bulk = {
            let b = b.clone();
            tokio::spawn(async move { b.run(vec![seq(30); 5], None).await })
        };
        tokio::time::sleep(Duration::from_millis(20)).await;
        b.run(vec![seq(4), seq(2)], None).await.unwrap();
        bulk.await.unwrap().unwrap();
        blocker.await.unwrap().unwrap();
        let batches = seen.lock().unwrap().clone();
        assert_eq!(
            batches,
            vec![vec![BLOCKER], vec![4, 2], vec![30; 5]],
            "{batches:?}"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_queue_holds_max_queue_requests_and_refuses_the_next() {
        let (b, _, blocker) = blocked(config(8, 200, 2)).await;
        // The blocker is being computed; two more may wait, small or not.
        let waiting: Vec<_> = [vec![seq(3)], vec![seq(30); 3]]
            .into_iter()
            .map(|seqs| {
                let b = b.clone();
                tokio::spawn(async move { b.run(seqs, None).await })
            })
            .collect();
        tokio::time::sleep(Duration::from_millis(50)).await;
        match b.run(vec![seq(2)], None).await {
            Err(ModelError::Overloaded(_)) => {}
            other => panic!("expected a refusal, got {other:?}"),
        }
        for w in waiting {
            w.await.unwrap().unwrap();
        }
        blocker.await.unwrap().unwrap();
        // Room again once they are done.
        b.run(vec![seq(2)], None).await.unwrap();
    }

    /// Takes 1 ms per token of each pass: a known rate (~1,000 tokens/s) for the backlog check.
    struct Paced;

    impl Encoder for Paced {
        fn forward(&mut self, batch: &[&Seq]) -> Result<Vec<Vec<f32>>, ModelError> {
            let tokens: usize = batch.iter().map(|s| s.ids.len()).sum();
            std::thread::sleep(Duration::from_millis(tokens as u64));
            Ok(batch.iter().map(|s| vec![s.ids.len() as f32]).collect())
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn bulk_work_past_most_of_a_deadline_is_refused_with_a_hint() {
        let b = Arc::new(Batcher::start(
            "t".into(),
            Box::new(Paced),
            config(8, 200, 16),
        ));
        let short = Some(Duration::from_millis(200));
        // No rate measured yet: nothing is refused for a backlog.
        b.run(vec![seq(100)], short).await.unwrap();
        // Measured now (~1,000 tokens/s). A 150 ms pass holds the encoder while the queue fills.
        let queue = |seqs: Vec<Seq>, deadline: Option<Duration>| {
            let b = b.clone();
            tokio::spawn(async move { b.run(seqs, deadline).await })
        };
        let busy = queue(vec![seq(150)], None);
        tokio::time::sleep(Duration::from_millis(20)).await;
        // Alone in the queue: taken although 160 tokens outlast 3/4 of 200 ms.
        let alone = queue(vec![seq(40); 4], short);
        tokio::time::sleep(Duration::from_millis(10)).await;
        // 250 tokens ahead would take ~250 ms: refused, with a hint of when there is room.
        match b.run(vec![seq(30); 3], short).await {
            Err(ModelError::Backlog {
                wait_ms,
                deadline_ms: 200,
                retry_after_ms,
                ..
            }) => {
                assert!((200..450).contains(&wait_ms), "{wait_ms}");
                assert!((50..300).contains(&retry_after_ms), "{retry_after_ms}");
            }
            other => panic!("expected a backlog refusal, got {other:?}"),
        }
        // Taken: no deadline, a deadline long enough, a small request whatever its deadline.
        let waiting = [
            queue(vec![seq(30); 3], None),
            queue(vec![seq(30); 3], Some(Duration::from_secs(10))),
            queue(vec![seq(3)], Some(Duration::from_millis(1))),
        ];
        for w in waiting {
            w.await.unwrap().unwrap();
        }
        alone.await.unwrap().unwrap();
        busy.await.unwrap().unwrap();
    }
}
