//! The coordinator's end of `Shard.Reads`: one long-lived stream per shard node carrying the
//! small reads of every query (see the proto), as TiKV's client batches its commands. Calls are
//! queued, sent in batches of what is queued, and their replies matched back by id; a broken
//! stream fails its calls in flight as UNAVAILABLE (reads: another replica may answer) and the
//! next call opens a new one. A call whose caller stops waiting before its reply (a client
//! that went away, a query failed on another shard) is cancelled on the node. A node without the method (an older build during a rolling
//! upgrade) is called unary, and asked again after `RECHECK_UNSUPPORTED`.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use futures::StreamExt;
use parking_lot::Mutex;
use ragcluster_common::batch::batches;
use ragcluster_proto::v1::read_call::Call;
use ragcluster_proto::v1::read_reply::Reply;
use ragcluster_proto::v1::shard_client::ShardClient;
use ragcluster_proto::v1::{ReadCall, ReadCalls};
use tokio::sync::{mpsc, oneshot};
use tonic::transport::Channel;
use tonic::{Code, Status};

use crate::error::ShardCallError;

type Result<T> = std::result::Result<T, ShardCallError>;

/// Calls per message at most.
const MAX_CALLS_PER_MESSAGE: usize = 64;
/// Items (hits, chunk ids) a read may ask for and still go on the stream; a bigger answer
/// would hold up the replies queued behind it, so it gets a unary call of its own.
pub const MAX_STREAM_ITEMS: usize = 256;
/// How long a node that lacks `Reads` is called unary before it is asked again.
const RECHECK_UNSUPPORTED: Duration = Duration::from_secs(30);

type Waiter = oneshot::Sender<std::result::Result<Option<Reply>, Status>>;

/// What the caller and the stream's reader task share.
#[derive(Default)]
struct Pending {
    waiters: Mutex<HashMap<u64, Waiter>>,
    next_id: AtomicU64,
    /// Set (under the `waiters` lock) when the stream broke: no call may wait on it any more.
    dead: AtomicBool,
}

impl Pending {
    /// Fails every call still waiting and refuses new ones.
    fn fail_all(&self, why: &str) {
        let waiting = {
            let mut w = self.waiters.lock();
            self.dead.store(true, Ordering::Release);
            std::mem::take(&mut *w)
        };
        for (_, tx) in waiting {
            let _ = tx.send(Err(Status::unavailable(why.to_owned())));
        }
    }
}

/// One open stream.
pub struct Conn {
    tx: mpsc::UnboundedSender<ReadCall>,
    pending: Arc<Pending>,
}

/// Removes a call's waiter when its caller stops waiting (deadline, dropped future), and
/// then tells the node to drop the call: its answer would go unread.
struct Waiting<'a> {
    conn: &'a Conn,
    id: u64,
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        let unanswered = self.conn.pending.waiters.lock().remove(&self.id).is_some();
        if unanswered && self.conn.alive() {
            let cancel = ReadCall {
                id: self.id,
                cancel: true,
                ..Default::default()
            };
            if self.conn.tx.send(cancel).is_ok() {
                metrics::counter!("coordinator_read_calls_cancelled_total").increment(1);
            }
        }
    }
}

fn unavailable(why: &str) -> ShardCallError {
    ShardCallError::from_status(Status::unavailable(why.to_owned()))
}

impl Conn {
    fn alive(&self) -> bool {
        !self.pending.dead.load(Ordering::Acquire)
    }

    /// Sends `call` and waits for its reply under `timeout`.
    pub async fn call(&self, call: Call, timeout: Duration) -> Result<Reply> {
        let id = self.pending.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        {
            let mut w = self.pending.waiters.lock();
            if self.pending.dead.load(Ordering::Acquire) {
                return Err(unavailable("read stream to the shard node closed"));
            }
            w.insert(id, tx);
        }
        let _waiting = Waiting { conn: self, id };
        let sent = self.tx.send(ReadCall {
            id,
            timeout_us: u64::try_from(timeout.as_micros()).unwrap_or(u64::MAX),
            call: Some(call),
            cancel: false,
        });
        if sent.is_err() {
            return Err(unavailable("read stream to the shard node closed"));
        }
        match tokio::time::timeout(timeout, rx).await {
            Err(_) => Err(ShardCallError::Deadline),
            // The reader dropped the waiter without an answer: it is gone.
            Ok(Err(_)) => Err(unavailable("read stream to the shard node closed")),
            Ok(Ok(Err(s))) => Err(ShardCallError::from_status(s)),
            Ok(Ok(Ok(Some(Reply::Error(e))))) => Err(ShardCallError::from_status(
                Status::with_details(Code::from(e.code), e.message, e.details.into()),
            )),
            Ok(Ok(Ok(Some(r)))) => Ok(r),
            Ok(Ok(Ok(None))) => Err(ShardCallError::Rejected(Status::internal(
                "shard node sent an empty read reply",
            ))),
        }
    }
}

/// The stream to one node, opened on first use and again after it breaks.
pub struct ReadStream {
    client: ShardClient<Channel>,
    conn: Mutex<Option<Arc<Conn>>>,
    /// One opener at a time; the others wait for its stream.
    opening: tokio::sync::Mutex<()>,
    unsupported_until: Mutex<Option<Instant>>,
}

impl ReadStream {
    pub fn new(client: ShardClient<Channel>) -> Self {
        Self {
            client,
            conn: Mutex::new(None),
            opening: tokio::sync::Mutex::new(()),
            unsupported_until: Mutex::new(None),
        }
    }

    fn current(&self) -> Option<Arc<Conn>> {
        self.conn.lock().as_ref().filter(|c| c.alive()).cloned()
    }

    /// The open stream, opening one within `timeout` if needed; None when the node does not
    /// serve `Reads` (call it unary).
    pub async fn conn(&self, timeout: Duration) -> Result<Option<Arc<Conn>>> {
        if let Some(c) = self.current() {
            return Ok(Some(c));
        }
        if self
            .unsupported_until
            .lock()
            .is_some_and(|t| Instant::now() < t)
        {
            return Ok(None);
        }
        match tokio::time::timeout(timeout, self.open()).await {
            Err(_) => Err(ShardCallError::Deadline),
            Ok(r) => r,
        }
    }

    async fn open(&self) -> Result<Option<Arc<Conn>>> {
        let _one = self.opening.lock().await;
        if let Some(c) = self.current() {
            return Ok(Some(c));
        }
        let (tx, rx) = mpsc::unbounded_channel();
        let outbound = batches(rx, MAX_CALLS_PER_MESSAGE).map(|calls| ReadCalls { calls });
        let mut client = self.client.clone();
        let mut inbound = match client.reads(outbound).await {
            Ok(r) => r.into_inner(),
            Err(s) if s.code() == Code::Unimplemented => {
                tracing::info!("shard node has no Reads stream; calling it unary");
                *self.unsupported_until.lock() = Some(Instant::now() + RECHECK_UNSUPPORTED);
                return Ok(None);
            }
            Err(s) => return Err(ShardCallError::from_status(s)),
        };
        let pending = Arc::new(Pending::default());
        let reader = pending.clone();
        tokio::spawn(async move {
            let why = loop {
                match inbound.message().await {
                    Ok(Some(batch)) => {
                        for r in batch.replies {
                            let waiter = reader.waiters.lock().remove(&r.id);
                            if let Some(tx) = waiter {
                                let _ = tx.send(Ok(r.reply));
                            }
                        }
                    }
                    Ok(None) => break "shard node ended the read stream".to_owned(),
                    Err(s) => {
                        break format!("read stream to the shard node broke: {}", s.message());
                    }
                }
            };
            tracing::debug!(reason = %why, "read stream closed");
            metrics::counter!("coordinator_read_streams_closed_total").increment(1);
            reader.fail_all(&why);
        });
        let conn = Arc::new(Conn { tx, pending });
        *self.conn.lock() = Some(conn.clone());
        Ok(Some(conn))
    }
}
