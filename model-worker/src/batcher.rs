//! Admission and batching in front of a backend thread. Requests wait in a bounded queue
//! (full -> RESOURCE_EXHAUSTED, never unbounded growth); the backend thread takes whatever is
//! queued, drops requests whose caller has gone, sorts the texts by length so padding stays
//! small, and runs them in batches of `max_batch`.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError, sync_channel};
use std::time::Instant;

use tokio::sync::oneshot;

use crate::backend::Embedder;
use crate::error::ModelError;

type Reply = oneshot::Sender<Result<(Vec<Vec<f32>>, usize), ModelError>>;

struct Job {
    texts: Vec<String>,
    reply: Reply,
    enqueued: Instant,
}

pub struct EmbedBatcher {
    name: String,
    tx: SyncSender<Job>,
    depth: Arc<AtomicUsize>,
    pub dimension: usize,
    pub max_sequence_length: usize,
}

impl EmbedBatcher {
    pub fn start(
        name: String,
        mut backend: Box<dyn Embedder>,
        max_queue: usize,
        max_batch: usize,
    ) -> Self {
        let (tx, rx) = sync_channel::<Job>(max_queue);
        let depth = Arc::new(AtomicUsize::new(0));
        let dimension = backend.dimension();
        let max_sequence_length = backend.max_sequence_length();
        {
            let depth = depth.clone();
            let name = name.clone();
            std::thread::Builder::new()
                .name(format!("embed-{name}"))
                .spawn(move || backend_loop(&name, backend.as_mut(), rx, depth, max_batch))
                .expect("spawn backend thread");
        }
        Self {
            name,
            tx,
            depth,
            dimension,
            max_sequence_length,
        }
    }

    pub async fn embed(&self, texts: Vec<String>) -> Result<(Vec<Vec<f32>>, usize), ModelError> {
        let (reply, rx) = oneshot::channel();
        match self.tx.try_send(Job {
            texts,
            reply,
            enqueued: Instant::now(),
        }) {
            Ok(()) => {
                let d = self.depth.fetch_add(1, Ordering::Relaxed) + 1;
                metrics::gauge!("model_queue_depth", "model" => self.name.clone()).set(d as f64);
            }
            Err(TrySendError::Full(_)) => return Err(ModelError::Overloaded(self.name.clone())),
            Err(TrySendError::Disconnected(_)) => {
                return Err(ModelError::Inference("backend thread stopped".into()));
            }
        }
        rx.await
            .map_err(|_| ModelError::Inference("backend dropped the request".into()))?
    }
}

fn backend_loop(
    name: &str,
    backend: &mut dyn Embedder,
    rx: Receiver<Job>,
    depth: Arc<AtomicUsize>,
    max_batch: usize,
) {
    while let Ok(first) = rx.recv() {
        let mut jobs = vec![first];
        let mut queued_texts = jobs[0].texts.len();
        while queued_texts < max_batch * 8 {
            match rx.try_recv() {
                Ok(j) => {
                    queued_texts += j.texts.len();
                    jobs.push(j);
                }
                Err(_) => break,
            }
        }
        let d = depth.fetch_sub(jobs.len(), Ordering::Relaxed) - jobs.len();
        metrics::gauge!("model_queue_depth", "model" => name.to_owned()).set(d as f64);
        // Callers that went away (cancelled RPCs) are not computed.
        jobs.retain(|j| !j.reply.is_closed());
        for j in &jobs {
            metrics::histogram!("model_queue_seconds", "model" => name.to_owned())
                .record(j.enqueued.elapsed().as_secs_f64());
        }
        // (job, index) for every text, longest first, so each batch pads little.
        let mut order: Vec<(usize, usize)> = jobs
            .iter()
            .enumerate()
            .flat_map(|(j, job)| (0..job.texts.len()).map(move |i| (j, i)))
            .collect();
        order.sort_by_key(|&(j, i)| std::cmp::Reverse(jobs[j].texts[i].len()));
        let mut out: Vec<Vec<Option<Vec<f32>>>> =
            jobs.iter().map(|j| vec![None; j.texts.len()]).collect();
        let mut tokens = vec![0usize; jobs.len()];
        let mut failed: Option<ModelError> = None;
        let started = Instant::now();
        for batch in order.chunks(max_batch) {
            let texts: Vec<String> = batch
                .iter()
                .map(|&(j, i)| jobs[j].texts[i].clone())
                .collect();
            metrics::histogram!("model_batch_size", "model" => name.to_owned())
                .record(texts.len() as f64);
            match backend.embed(&texts) {
                Ok((vecs, n)) => {
                    metrics::counter!("model_tokens_total", "model" => name.to_owned())
                        .increment(n as u64);
                    for (&(j, i), v) in batch.iter().zip(vecs) {
                        out[j][i] = Some(v);
                        tokens[j] += n / batch.len().max(1);
                    }
                }
                Err(e) => {
                    failed = Some(e);
                    break;
                }
            }
        }
        metrics::histogram!("model_device_seconds", "model" => name.to_owned())
            .record(started.elapsed().as_secs_f64());
        for ((job, vecs), t) in jobs.into_iter().zip(out).zip(tokens) {
            let result = match &failed {
                Some(e) => Err(ModelError::Inference(e.to_string())),
                None => Ok((vecs.into_iter().map(|v| v.unwrap_or_default()).collect(), t)),
            };
            let _ = job.reply.send(result);
        }
    }
}
