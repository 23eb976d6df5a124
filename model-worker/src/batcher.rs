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
//! With `batching = false` every request runs alone (its own texts still form one batch):
//! the baseline the benchmark compares against.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TryRecvError, TrySendError};
use std::time::{Duration, Instant};

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
}

type Reply = oneshot::Sender<Result<Vec<Vec<f32>>, ModelError>>;

struct Job {
    seqs: Vec<Seq>,
    tokens: usize,
    reply: Reply,
    enqueued: Instant,
}

/// Handle to one model's queue and encoder thread.
pub struct Batcher {
    name: String,
    tx: SyncSender<Job>,
    depth: Arc<AtomicUsize>,
}

impl Batcher {
    pub fn start(name: String, backend: Box<dyn Encoder>, cfg: BatchConfig) -> Self {
        let (tx, rx) = std::sync::mpsc::sync_channel::<Job>(cfg.max_queue.max(1));
        let depth = Arc::new(AtomicUsize::new(0));
        {
            let depth = depth.clone();
            let name = name.clone();
            std::thread::Builder::new()
                .name(format!("encode-{name}"))
                .spawn(move || Worker::new(name, backend, cfg, depth).run(rx))
                .expect("spawn encoder thread");
        }
        Self { name, tx, depth }
    }

    /// Queues the sequences and waits for one output per sequence, in order. Dropping the
    /// future (a cancelled RPC) drops the request from the queue.
    pub async fn run(&self, seqs: Vec<Seq>) -> Result<Vec<Vec<f32>>, ModelError> {
        if seqs.is_empty() {
            return Ok(Vec::new());
        }
        let (reply, rx) = oneshot::channel();
        let tokens = seqs.iter().map(|s| s.ids.len()).sum();
        match self.tx.try_send(Job {
            seqs,
            tokens,
            reply,
            enqueued: Instant::now(),
        }) {
            Ok(()) => {
                let d = self.depth.fetch_add(1, Ordering::Relaxed) + 1;
                metrics::gauge!("model_queue_depth", "model" => self.name.clone()).set(d as f64);
            }
            Err(TrySendError::Full(_)) => return Err(ModelError::Overloaded(self.name.clone())),
            Err(TrySendError::Disconnected(_)) => {
                return Err(ModelError::Inference("encoder thread stopped".into()));
            }
        }
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
    depth: Arc<AtomicUsize>,
}

impl Worker {
    fn new(
        name: String,
        backend: Box<dyn Encoder>,
        cfg: BatchConfig,
        depth: Arc<AtomicUsize>,
    ) -> Self {
        Self {
            name,
            backend,
            cfg,
            depth,
        }
    }

    fn run(mut self, rx: Receiver<Job>) {
        while let Ok(first) = rx.recv() {
            let jobs = if self.cfg.batching {
                self.gather(first, &rx)
            } else {
                vec![first]
            };
            let d = self.depth.fetch_sub(jobs.len(), Ordering::Relaxed) - jobs.len();
            metrics::gauge!("model_queue_depth", "model" => self.name.clone()).set(d as f64);
            self.round(jobs);
        }
    }

    /// The first job plus whatever arrives within `max_wait` of its enqueueing, up to a few
    /// batches' worth of tokens (more waiting would only delay the first).
    fn gather(&self, first: Job, rx: &Receiver<Job>) -> Vec<Job> {
        let deadline = first.enqueued + self.cfg.max_wait;
        let enough = self.cfg.max_batch_tokens;
        let cap = enough * 4;
        let mut tokens = first.tokens;
        let mut jobs = vec![first];
        while tokens < cap {
            let next = match rx.try_recv() {
                Ok(j) => Some(j),
                Err(TryRecvError::Disconnected) => None,
                Err(TryRecvError::Empty) => {
                    let now = Instant::now();
                    if tokens >= enough || now >= deadline {
                        None
                    } else {
                        rx.recv_timeout(deadline - now).ok()
                    }
                }
            };
            let Some(j) = next else { break };
            tokens += j.tokens;
            jobs.push(j);
        }
        jobs
    }

    fn round(&mut self, jobs: Vec<Job>) {
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
            let seqs: Vec<&Seq> = batch.iter().map(|&(j, i)| &active[j].job.seqs[i]).collect();
            let real: usize = seqs.iter().map(|s| s.ids.len()).sum();
            metrics::histogram!("model_batch_size", "model" => name.clone())
                .record(seqs.len() as f64);
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
                    for &(j, _) in &batch {
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
                    for &(j, _) in &batch {
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

    impl Encoder for Recorder {
        fn forward(&mut self, batch: &[&Seq]) -> Result<Vec<Vec<f32>>, ModelError> {
            let lens: Vec<usize> = batch.iter().map(|s| s.ids.len()).collect();
            if lens.contains(&BLOCKER) {
                std::thread::sleep(Duration::from_millis(300));
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
            },
        ));
        // Hold the encoder busy so the three requests are all queued when it next gathers:
        // the test must not depend on thread scheduling.
        let blocker = {
            let b = b.clone();
            tokio::spawn(async move { b.run(vec![seq(BLOCKER)]).await })
        };
        // (Were it merged into their round instead, it would still run first and alone: 99
        // tokens fill the 100-token budget.)
        tokio::time::sleep(Duration::from_millis(50)).await;
        let jobs = [vec![50, 10, 10], vec![30, 5], vec![5, 5, 60, 1]];
        let calls = jobs.iter().map(|lens| {
            let b = b.clone();
            let seqs: Vec<Seq> = lens.iter().map(|&l| seq(l)).collect();
            async move { b.run(seqs).await }
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
            },
        ));
        let calls = (0..4).map(|_| {
            let b = b.clone();
            async move { b.run(vec![seq(3), seq(2)]).await }
        });
        for r in futures::future::join_all(calls).await {
            r.unwrap();
        }
        let batches = seen.lock().unwrap().clone();
        assert_eq!(batches, vec![vec![3, 2]; 4]);
    }
}
