//! Member-to-member traffic. Outgoing: one task per peer member drains a bounded queue into a
//! connection that the application's `Dialer` opens (a gRPC stream between shard nodes, unary
//! calls between coordinators) and batches what queued up meanwhile; when the connection
//! breaks it reports the peer unreachable to every local group and reconnects with
//! exponential backoff (100 ms .. 2 s). Queues drop on overflow: Raft resends what matters.
//! Snapshots may take a side channel (`Dialer::send_snapshot`), reported back to the group.
//! Incoming messages are routed to their group's mailbox; unknown groups are ignored.

use std::collections::HashMap;
use std::fmt::{Debug, Display};
use std::hash::Hash;
use std::sync::Arc;
use std::sync::mpsc::Sender;
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use parking_lot::RwLock;
use protobuf::Message as _;
use raft::eraftpb::{Message, MessageType};
use tokio::sync::mpsc;

use crate::mailbox::Msg;

/// Where a member's outgoing messages go (the transport for one group, or the simulation).
pub trait Outbox: Send + Sync {
    fn send(&self, msgs: Vec<Message>);
    /// A membership change named member `id`'s address.
    fn learn_peer(&self, id: u64, address: &str);
}

/// Identifies a group among those a process hosts.
pub trait GroupId: Clone + Eq + Hash + Send + Sync + Debug + Display + 'static {}
impl<T: Clone + Eq + Hash + Send + Sync + Debug + Display + 'static> GroupId for T {}

/// One encoded `eraftpb::Message` of a group.
pub type Envelope<G> = (G, Vec<u8>);

/// How this process reaches its peers (the gRPC services live in the process crates).
pub trait Dialer<G>: Send + Sync + 'static {
    /// Carries batches to member `to` at `address` until the connection breaks (`Err`) or the
    /// receiver closes (`Ok`).
    fn stream(
        &self,
        to: u64,
        address: String,
        batches: mpsc::Receiver<Vec<Envelope<G>>>,
    ) -> BoxFuture<'static, Result<(), String>>;

    /// Sends a snapshot message on a side channel (its data streamed apart), returning the
    /// bytes sent; `None` sends it inline like any message.
    fn send_snapshot(
        &self,
        _to: u64,
        _address: String,
        _group: G,
        _msg: Message,
    ) -> Option<BoxFuture<'static, Result<u64, String>>> {
        None
    }
}

/// Called with the whole address table when it changes (to persist it).
pub type OnLearn = Box<dyn Fn(&[(u64, String)]) + Send + Sync>;

/// Which incoming message kinds this process turns away for now (a shard node whose disk is
/// full takes no new log entries, snapshots or leadership; heartbeats and votes still pass).
pub type Refuse = Arc<dyn Fn(MessageType) -> bool + Send + Sync>;

const QUEUE: usize = 16_384;
const MAX_BATCH: usize = 512;

/// What `deliver` did with a message.
#[derive(Debug, PartialEq, Eq)]
pub enum Delivery {
    Routed,
    UnknownGroup,
    Invalid,
    /// Dropped by the `raft_isolate` failpoint.
    Isolated,
    /// Turned away by the process for now (`Transport::set_refuse`).
    Refused,
}

pub struct Transport<G: GroupId, R> {
    id: u64,
    rt: tokio::runtime::Handle,
    addresses: RwLock<HashMap<u64, String>>,
    peers: RwLock<HashMap<u64, mpsc::Sender<Envelope<G>>>>,
    router: RwLock<HashMap<G, Sender<Msg<R>>>>,
    dialer: Arc<dyn Dialer<G>>,
    on_learn: OnLearn,
    metrics_prefix: &'static str,
    /// Set by `close`: nothing more is sent and the peer loops end.
    closed: std::sync::atomic::AtomicBool,
    refuse: RwLock<Option<Refuse>>,
}

/// Whether traffic with member `peer` is cut (failpoint `raft_isolate`, whose `return` value
/// lists member ids separated by commas). Without the `failpoints` feature this is `false`.
#[cfg(feature = "failpoints")]
pub fn isolated(peer: u64) -> bool {
    fail::fail_point!("raft_isolate", |ids: Option<String>| {
        ids.is_some_and(|s| s.split(',').any(|p| p.trim().parse() == Ok(peer)))
    });
    false
}

#[cfg(not(feature = "failpoints"))]
pub fn isolated(_peer: u64) -> bool {
    false
}

impl<G: GroupId, R: Send + 'static> Transport<G, R> {
    pub fn new(
        id: u64,
        rt: tokio::runtime::Handle,
        dialer: Arc<dyn Dialer<G>>,
        addresses: Vec<(u64, String)>,
        on_learn: OnLearn,
        metrics_prefix: &'static str,
    ) -> Arc<Self> {
        Arc::new(Self {
            id,
            rt,
            addresses: RwLock::new(addresses.into_iter().collect()),
            peers: RwLock::new(HashMap::new()),
            router: RwLock::new(HashMap::new()),
            dialer,
            on_learn,
            metrics_prefix,
            closed: Default::default(),
            refuse: RwLock::new(None),
        })
    }

    /// Sets which incoming message kinds `deliver` turns away.
    pub fn set_refuse(&self, refuse: Refuse) {
        *self.refuse.write() = Some(refuse);
    }

    /// Stops sending: every peer connection ends and later messages are dropped, so the
    /// transport (and what its callbacks hold) is released once its last user lets go.
    pub fn close(&self) {
        self.closed
            .store(true, std::sync::atomic::Ordering::Release);
        self.peers.write().clear();
    }

    fn is_closed(&self) -> bool {
        self.closed.load(std::sync::atomic::Ordering::Acquire)
    }

    pub fn id(&self) -> u64 {
        self.id
    }

    pub fn address(&self, id: u64) -> Option<String> {
        self.addresses.read().get(&id).cloned()
    }

    pub fn addresses(&self) -> Vec<(u64, String)> {
        let mut v: Vec<_> = self
            .addresses
            .read()
            .iter()
            .map(|(k, v)| (*k, v.clone()))
            .collect();
        v.sort();
        v
    }

    /// Records a member's address (from a group's creation or a membership change).
    pub fn learn_peer(&self, id: u64, address: &str) {
        if id == self.id || address.is_empty() {
            return;
        }
        let mut g = self.addresses.write();
        if g.get(&id).map(String::as_str) == Some(address) {
            return;
        }
        g.insert(id, address.to_owned());
        let mut list: Vec<(u64, String)> = g.iter().map(|(k, v)| (*k, v.clone())).collect();
        drop(g);
        list.sort();
        (self.on_learn)(&list);
    }

    pub fn register(&self, group: G, mailbox: Sender<Msg<R>>) {
        self.router.write().insert(group, mailbox);
    }

    pub fn unregister(&self, group: &G) {
        self.router.write().remove(group);
    }

    pub fn mailbox(&self, group: &G) -> Option<Sender<Msg<R>>> {
        self.router.read().get(group).cloned()
    }

    /// The outbox of one group.
    pub fn outbox(self: &Arc<Self>, group: G) -> Arc<dyn Outbox> {
        Arc::new(GroupOutbox {
            transport: self.clone(),
            group,
        })
    }

    /// Queues messages for their peers; drops them when a peer is cut off or its queue full.
    pub fn send(self: &Arc<Self>, group: &G, msgs: Vec<Message>) {
        if self.is_closed() {
            return;
        }
        for m in msgs {
            let to = m.to;
            if isolated(to) {
                continue;
            }
            if m.get_msg_type() == MessageType::MsgSnapshot
                && let Some(addr) = self.address(to)
                && let Some(f) = self
                    .dialer
                    .send_snapshot(to, addr, group.clone(), m.clone())
            {
                self.track_snapshot(group.clone(), to, f);
                continue;
            }
            let snapshot = m.get_msg_type() == MessageType::MsgSnapshot;
            let Ok(bytes) = m.write_to_bytes() else {
                continue;
            };
            let queued = self.peer(to).try_send((group.clone(), bytes)).is_ok();
            if !queued {
                metrics::counter!(format!("{}_messages_dropped_total", self.metrics_prefix))
                    .increment(1);
            }
            // raft-rs waits for a snapshot's outcome before it replicates to that member again.
            // An inline snapshot counts as sent once queued: if it is lost, the member's next
            // answer makes the leader probe and send another.
            if snapshot && let Some(tx) = self.mailbox(group) {
                let _ = tx.send(Msg::SnapshotStatus { to, ok: queued });
            }
        }
    }

    fn track_snapshot(
        self: &Arc<Self>,
        group: G,
        to: u64,
        f: BoxFuture<'static, Result<u64, String>>,
    ) {
        let this = self.clone();
        self.rt.spawn(async move {
            let ok = f.await.is_ok();
            if let Some(tx) = this.mailbox(&group) {
                let _ = tx.send(Msg::SnapshotStatus { to, ok });
            }
        });
    }

    fn peer(self: &Arc<Self>, to: u64) -> mpsc::Sender<Envelope<G>> {
        if let Some(tx) = self.peers.read().get(&to) {
            return tx.clone();
        }
        let mut g = self.peers.write();
        g.entry(to)
            .or_insert_with(|| {
                let (tx, rx) = mpsc::channel(QUEUE);
                let this = self.clone();
                self.rt.spawn(async move { this.peer_loop(to, rx).await });
                tx
            })
            .clone()
    }

    /// Tells every local group that member `peer` could not be reached.
    fn report_unreachable(&self, peer: u64) {
        for tx in self.router.read().values() {
            let _ = tx.send(Msg::Unreachable(peer));
        }
    }

    async fn peer_loop(self: Arc<Self>, to: u64, mut rx: mpsc::Receiver<Envelope<G>>) {
        let mut backoff = Duration::from_millis(100);
        loop {
            if rx.is_closed() {
                return;
            }
            let Some(addr) = self.address(to) else {
                // Unknown address: drop what queued up, Raft resends from its own state.
                while rx.try_recv().is_ok() {}
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(2));
                continue;
            };
            let (btx, brx) = mpsc::channel::<Vec<Envelope<G>>>(64);
            let mut call = self.rt.spawn(self.dialer.stream(to, addr, brx));
            let connected = Instant::now();
            loop {
                tokio::select! {
                    m = rx.recv() => {
                        let Some(m) = m else {
                            call.abort();
                            return;
                        };
                        let mut batch = vec![m];
                        while batch.len() < MAX_BATCH {
                            match rx.try_recv() {
                                Ok(m) => batch.push(m),
                                Err(_) => break,
                            }
                        }
                        if btx.send(batch).await.is_err() {
                            break;
                        }
                    }
                    r = &mut call => {
                        tracing::debug!(peer = to, result = ?r, "raft connection ended");
                        break;
                    }
                }
            }
            call.abort();
            self.report_unreachable(to);
            while rx.try_recv().is_ok() {}
            if connected.elapsed() > Duration::from_secs(5) {
                backoff = Duration::from_millis(100);
            }
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_secs(2));
        }
    }

    /// Routes a message from member `from` to its group. Unknown groups and undecodable or
    /// misaddressed messages are ignored: a sender ahead of us (a group not created here yet)
    /// or behind (dropped).
    pub fn deliver(&self, from: u64, group: &G, bytes: &[u8]) -> Delivery {
        if isolated(from) {
            return Delivery::Isolated;
        }
        let Some(tx) = self.mailbox(group) else {
            metrics::counter!(format!(
                "{}_messages_unknown_group_total",
                self.metrics_prefix
            ))
            .increment(1);
            return Delivery::UnknownGroup;
        };
        let mut msg = Message::default();
        if msg.merge_from_bytes(bytes).is_err() || msg.to != self.id || msg.from != from {
            metrics::counter!(format!("{}_messages_invalid_total", self.metrics_prefix))
                .increment(1);
            return Delivery::Invalid;
        }
        if self
            .refuse
            .read()
            .as_ref()
            .is_some_and(|r| r(msg.get_msg_type()))
        {
            metrics::counter!(format!("{}_messages_refused_total", self.metrics_prefix))
                .increment(1);
            return Delivery::Refused;
        }
        let _ = tx.send(Msg::Raft(Box::new(msg)));
        Delivery::Routed
    }
}

struct GroupOutbox<G: GroupId, R> {
    transport: Arc<Transport<G, R>>,
    group: G,
}

impl<G: GroupId, R: Send + 'static> Outbox for GroupOutbox<G, R> {
    fn send(&self, msgs: Vec<Message>) {
        if !msgs.is_empty() {
            self.transport.send(&self.group, msgs);
        }
    }

    fn learn_peer(&self, id: u64, address: &str) {
        self.transport.learn_peer(id, address);
    }
}
