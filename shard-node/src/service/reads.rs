//! `Shard.Reads`: the coordinator's small reads multiplexed on one long-lived stream (see the
//! proto). Each call runs on its own task through the same handler as its unary RPC, so both
//! paths answer alike; a semaphore caps the calls of one stream in flight, and past it the
//! stream is not read (HTTP/2 flow control then holds the caller back). A `cancel` from the
//! caller aborts its call's task: the handler's future is dropped where it waits (a read
//! index round, a blocking search's result) and no reply is sent.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use futures::{Stream, StreamExt};
use parking_lot::Mutex;
use ragcluster_common::batch::batches;
use ragcluster_proto::v1::read_call::Call;
use ragcluster_proto::v1::read_reply::Reply;
use ragcluster_proto::v1::shard_server::Shard as ShardRpc;
use ragcluster_proto::v1::*;
use tokio::sync::Semaphore;
use tokio::task::AbortHandle;
use tonic::{Request, Status, Streaming};

use super::ShardService;

/// Calls of one stream running at once (the proto documents this number).
pub const MAX_IN_FLIGHT: usize = 1024;

/// Replies per message at most.
const MAX_REPLIES_PER_MESSAGE: usize = 64;

pub type ReadsStream = std::pin::Pin<Box<dyn Stream<Item = Result<ReadReplies, Status>> + Send>>;

/// Answers the calls of `input` until it ends or the node closes; the reply stream ends once
/// the calls already started have answered.
pub fn serve(svc: ShardService, mut input: Streaming<ReadCalls>) -> ReadsStream {
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel::<ReadReply>();
    let permits = Arc::new(Semaphore::new(MAX_IN_FLIGHT));
    let running = Arc::new(Running::default());
    tokio::spawn(async move {
        let node = svc.node.clone();
        let closed = node.closed();
        tokio::pin!(closed);
        loop {
            let batch = tokio::select! {
                m = input.message() => m,
                () = &mut closed => break,
            };
            let calls = match batch {
                Ok(Some(b)) => b.calls,
                Ok(None) => break,
                Err(e) => {
                    tracing::debug!(error = %e, "read stream broken by the caller");
                    break;
                }
            };
            for call in calls {
                if call.cancel {
                    running.cancel(call.id);
                    continue;
                }
                let Ok(permit) = permits.clone().acquire_owned().await else {
                    return;
                };
                let (svc, tx, done) = (svc.clone(), tx.clone(), running.clone());
                let id = call.id;
                // Registered before the task can finish (it deregisters under the same lock).
                let mut tasks = running.tasks.lock();
                let seq = running.next.fetch_add(1, Ordering::Relaxed);
                let task = tokio::spawn(async move {
                    let _ = tx.send(svc.answer(call).await);
                    done.finished(id, seq);
                    drop(permit);
                });
                tasks.insert(id, (seq, task.abort_handle()));
            }
        }
    });
    Box::pin(batches(rx, MAX_REPLIES_PER_MESSAGE).map(|replies| Ok(ReadReplies { replies })))
}

/// The calls of one stream still running, by the caller's id, so that a `cancel` can abort
/// one. `seq` tells a call from a later one that reused its id.
#[derive(Default)]
struct Running {
    tasks: Mutex<HashMap<u64, (u64, AbortHandle)>>,
    next: AtomicU64,
}

impl Running {
    fn cancel(&self, id: u64) {
        if let Some((_, task)) = self.tasks.lock().remove(&id) {
            task.abort();
            metrics::counter!("shard_read_calls_cancelled_total").increment(1);
        }
    }

    fn finished(&self, id: u64, seq: u64) {
        let mut tasks = self.tasks.lock();
        if tasks.get(&id).is_some_and(|(s, _)| *s == seq) {
            tasks.remove(&id);
        }
    }
}

/// Test hook (feature `failpoints`): `shard_read_call_stall` set to `return(MS)` holds every
/// read call for MS milliseconds before it runs, inside its deadline.
#[cfg(feature = "failpoints")]
async fn stall() {
    let ms = (|| -> Option<u64> {
        fail::fail_point!("shard_read_call_stall", |v| v.and_then(|s| s.parse().ok()));
        None
    })();
    if let Some(ms) = ms {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
}

#[cfg(not(feature = "failpoints"))]
async fn stall() {}

impl ShardService {
    /// One call's reply, through the handler of its unary RPC.
    async fn answer(&self, call: ReadCall) -> ReadReply {
        let started = Instant::now();
        let kind = match &call.call {
            Some(Call::Bm25(_)) => "Bm25Search",
            Some(Call::Vector(_)) => "VectorSearch",
            Some(Call::TermStats(_)) => "TermStatistics",
            Some(Call::Chunks(_)) => "GetChunks",
            None => "none",
        };
        let timeout_us = call.timeout_us;
        let run = async {
            stall().await;
            match call.call {
                Some(Call::Bm25(r)) => self
                    .bm25_search(timed(r, timeout_us))
                    .await
                    .map(|r| Reply::Search(r.into_inner())),
                Some(Call::Vector(r)) => self
                    .vector_search(timed(r, timeout_us))
                    .await
                    .map(|r| Reply::Search(r.into_inner())),
                Some(Call::TermStats(r)) => self
                    .term_statistics(timed(r, timeout_us))
                    .await
                    .map(|r| Reply::TermStats(r.into_inner())),
                Some(Call::Chunks(r)) => self
                    .get_chunks(timed(r, timeout_us))
                    .await
                    .map(|r| Reply::Chunks(r.into_inner())),
                None => Err(Status::invalid_argument("read call carries no request")),
            }
        };
        let res = match call.timeout_us {
            0 => run.await,
            us => tokio::time::timeout(Duration::from_micros(us), run)
                .await
                .unwrap_or_else(|_| Err(Status::deadline_exceeded("read call deadline passed"))),
        };
        let code = match &res {
            Ok(_) => "0",
            Err(s) => code_label(s.code()),
        };
        metrics::counter!("shard_read_calls_total", "call" => kind, "code" => code).increment(1);
        metrics::histogram!("shard_read_call_seconds", "call" => kind)
            .record(started.elapsed().as_secs_f64());
        ReadReply {
            id: call.id,
            reply: Some(res.unwrap_or_else(|s| {
                Reply::Error(CallStatus {
                    code: s.code() as i32,
                    message: s.message().to_owned(),
                    details: s.details().to_vec(),
                })
            })),
        }
    }
}

/// The call's request, carrying what is left of the caller's deadline as a unary call's
/// would (a read waiting for its token's index gives up before it passes).
fn timed<T>(r: T, timeout_us: u64) -> Request<T> {
    let mut req = Request::new(r);
    if timeout_us > 0 {
        req.set_timeout(Duration::from_micros(timeout_us));
    }
    req
}

/// The numeric code as a static label (the per-RPC metrics spell codes the same way).
fn code_label(c: tonic::Code) -> &'static str {
    use tonic::Code::*;
    match c {
        Ok => "0",
        Cancelled => "1",
        Unknown => "2",
        InvalidArgument => "3",
        DeadlineExceeded => "4",
        NotFound => "5",
        AlreadyExists => "6",
        PermissionDenied => "7",
        ResourceExhausted => "8",
        FailedPrecondition => "9",
        Aborted => "10",
        OutOfRange => "11",
        Unimplemented => "12",
        Internal => "13",
        Unavailable => "14",
        DataLoss => "15",
        Unauthenticated => "16",
    }
}
