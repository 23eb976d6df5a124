//! A member on its own thread: wall-clock ticks, a mailbox, and `Member`, the handle callers
//! use to propose, change membership, read and wait for status changes (a watch channel, so
//! nobody polls).

use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use raft::eraftpb::{ConfChangeSingle, ConfChangeType, ConfChangeV2, ConfState};
use tokio::sync::{oneshot, watch};

use crate::error::{Fatal, RaftError};
use crate::machine::StateMachine;
use crate::mailbox::Msg;
use crate::node::RaftNode;
use crate::options::Options;
use crate::status::Status;
use crate::storage::LogStore;
use crate::transport::Outbox;

/// Handle of a member running on its own thread.
pub struct Member<R> {
    tx: Sender<Msg<R>>,
    status: watch::Receiver<Status>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
    /// Set before the thread is told to stop: a write waiting for disk space gives up.
    stopping: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

/// One membership change as a `ConfChangeV2`, with the member's address as context.
pub fn conf_change(kind: ConfChangeType, id: u64, address: &str) -> ConfChangeV2 {
    let mut single = ConfChangeSingle::default();
    single.set_change_type(kind);
    single.node_id = id;
    ConfChangeV2 {
        changes: vec![single],
        context: address.as_bytes().to_vec(),
        ..Default::default()
    }
}

impl<R: Send + 'static> Member<R> {
    /// Opens the member over `store` and `sm` and starts its thread.
    pub fn start<L: LogStore, M: StateMachine<Response = R>>(
        opts: Options,
        store: L,
        sm: std::sync::Arc<M>,
        outbox: std::sync::Arc<dyn Outbox>,
        (tx, rx): (Sender<Msg<R>>, Receiver<Msg<R>>),
    ) -> Result<Self, Fatal> {
        let tick = opts.tick;
        let name = opts.name.clone();
        let (node, status) = RaftNode::new(opts, store, sm, outbox)?;
        let stopping = node.stop_flag();
        let thread = std::thread::Builder::new()
            .name(format!("raft-{name}"))
            .spawn(move || run(node, rx, tick, name))
            .map_err(|e| Fatal(format!("spawn raft thread: {e}")))?;
        Ok(Self {
            tx,
            status,
            thread: Mutex::new(Some(thread)),
            stopping,
        })
    }

    pub fn status(&self) -> Status {
        self.status.borrow().clone()
    }

    pub fn watch(&self) -> watch::Receiver<Status> {
        self.status.clone()
    }

    pub fn mailbox(&self) -> Sender<Msg<R>> {
        self.tx.clone()
    }

    fn send(&self, m: Msg<R>) -> Result<(), RaftError> {
        self.tx.send(m).map_err(|_| RaftError::Stopped)
    }

    async fn wait<T>(
        rx: oneshot::Receiver<Result<T, RaftError>>,
        timeout: Duration,
        what: &'static str,
    ) -> Result<T, RaftError> {
        match tokio::time::timeout(timeout, rx).await {
            Ok(Ok(r)) => r,
            Ok(Err(_)) => Err(RaftError::Stopped),
            Err(_) => Err(RaftError::Timeout {
                what,
                after: timeout,
            }),
        }
    }

    /// Proposes `data` and waits until it is committed and applied here.
    pub async fn propose(&self, data: Vec<u8>, timeout: Duration) -> Result<R, RaftError> {
        let (reply, rx) = oneshot::channel();
        self.send(Msg::Propose { data, reply })?;
        Self::wait(rx, timeout, "proposal").await
    }

    pub async fn change(
        &self,
        cc: ConfChangeV2,
        timeout: Duration,
    ) -> Result<ConfState, RaftError> {
        let (reply, rx) = oneshot::channel();
        self.send(Msg::ConfChange { cc, reply })?;
        Self::wait(rx, timeout, "membership change").await
    }

    /// Waits until this member has applied everything committed before the call; returns that
    /// read index.
    pub async fn read_index(&self, timeout: Duration) -> Result<u64, RaftError> {
        let (reply, rx) = oneshot::channel();
        self.send(Msg::ReadIndex { reply })?;
        Self::wait(rx, timeout, "read index").await
    }

    pub fn transfer_leader(&self, to: u64) -> Result<(), RaftError> {
        self.send(Msg::TransferLeader(to))
    }

    pub fn campaign(&self) -> Result<(), RaftError> {
        self.send(Msg::Campaign)
    }

    /// Fails the member with `why` (see `Msg::Fail`): it stops stepping messages at once and
    /// its status says why.
    pub fn fail(&self, why: String) {
        let _ = self.tx.send(Msg::Fail(why));
    }

    /// Asks the member to publish a fresh status.
    pub fn wake(&self) {
        let _ = self.tx.send(Msg::Wake);
    }

    /// The first status satisfying `ok` within `timeout`, or the last one seen.
    pub async fn wait_for(
        &self,
        timeout: Duration,
        ok: impl Fn(&Status) -> bool,
    ) -> Result<Status, Status> {
        let mut rx = self.status.clone();
        let r = tokio::time::timeout(timeout, rx.wait_for(|s| ok(s))).await;
        match r {
            Ok(Ok(s)) => Ok(s.clone()),
            _ => Err(self.status()),
        }
    }

    /// Stops the thread and waits for it.
    pub fn stop(&self) {
        self.stopping
            .store(true, std::sync::atomic::Ordering::Release);
        let _ = self.tx.send(Msg::Stop);
        if let Some(t) = self.thread.lock().take() {
            let _ = t.join();
        }
    }
}

impl<R> Drop for Member<R> {
    fn drop(&mut self) {
        self.stopping
            .store(true, std::sync::atomic::Ordering::Release);
        let _ = self.tx.send(Msg::Stop);
        if let Some(t) = self.thread.lock().take() {
            let _ = t.join();
        }
    }
}

fn run<L: LogStore, M: StateMachine>(
    mut node: RaftNode<L, M>,
    rx: Receiver<Msg<M::Response>>,
    tick: Duration,
    name: String,
) {
    // raft-rs panics when its log contradicts what the group knows of it (a replica whose
    // storage lost entries it had acknowledged: "to_commit N is out of range"). The panic
    // stops this member only: it is caught here, the member is failed with the reason, and
    // its replica stops serving (`Status::failed`), instead of the thread dying silently
    // while the replica goes on answering from a state behind what it acknowledged.
    let outcome =
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| drive(&mut node, &rx, tick)));
    let failure = match outcome {
        Ok(None) => None,
        Ok(Some(_)) if node.lost_entries().is_some() => node.lost_entries().map(str::to_owned),
        Ok(Some(e)) => Some(format!("the log could not be persisted: {e}")),
        Err(panic) => Some(format!("raft panicked: {}", panic_message(&panic))),
    };
    let shutdown = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| node.shutdown()));
    if let Some(why) = failure {
        // The member can no longer persist or trust its log: stop it (the others carry on)
        // rather than diverge or acknowledge what is not durable.
        tracing::error!(group = %name, error = %why, "raft member failed; stopped");
        node.publish_failure(why);
    } else if shutdown.is_err() {
        node.publish_failure("raft panicked while stopping".into());
    }
}

/// The member's loop until it is stopped, removed or fails to persist (that error).
fn drive<L: LogStore, M: StateMachine>(
    node: &mut RaftNode<L, M>,
    rx: &Receiver<Msg<M::Response>>,
    tick: Duration,
) -> Option<Fatal> {
    // A member that campaigned at start has a ready to handle before the first message.
    let mut failed = node.on_ready().err();
    node.publish();
    let mut next_tick = Instant::now() + tick;
    while failed.is_none() && !node.removed() {
        let wait = next_tick.saturating_duration_since(Instant::now());
        let mut stop = false;
        match rx.recv_timeout(wait) {
            Ok(Msg::Stop) | Err(RecvTimeoutError::Disconnected) => stop = true,
            Ok(m) => node.handle(m),
            Err(RecvTimeoutError::Timeout) => {}
        }
        for _ in 0..4096 {
            if stop {
                break;
            }
            match rx.try_recv() {
                Ok(Msg::Stop) => stop = true,
                Ok(m) => node.handle(m),
                Err(_) => break,
            }
        }
        if stop {
            break;
        }
        if Instant::now() >= next_tick {
            node.tick();
            next_tick = Instant::now() + tick;
        }
        failed = node.on_ready().err();
        node.publish();
    }
    failed
}

/// The text of a caught panic.
fn panic_message(p: &Box<dyn std::any::Any + Send>) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic without a message".into()
    }
}
