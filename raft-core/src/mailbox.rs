//! What a member's mailbox carries: Raft messages from peers, and requests from the handles
//! (proposals, membership changes, read index, leadership transfers), each with its reply.

use raft::eraftpb::{ConfChangeV2, ConfState, Message};
use tokio::sync::oneshot;

use crate::error::RaftError;

pub type Reply<T> = oneshot::Sender<Result<T, RaftError>>;

/// What a member's mailbox carries.
pub enum Msg<R> {
    Raft(Box<Message>),
    Propose {
        data: Vec<u8>,
        reply: Reply<R>,
    },
    /// One membership change (a single `ConfChangeSingle`); the member's address, if it needs
    /// one, rides in the context.
    ConfChange {
        cc: ConfChangeV2,
        reply: Reply<ConfState>,
    },
    /// Answers with an index once this member has applied everything committed before the
    /// request (Raft read index).
    ReadIndex {
        reply: Reply<u64>,
    },
    TransferLeader(u64),
    Campaign,
    Unreachable(u64),
    SnapshotStatus {
        to: u64,
        ok: bool,
    },
    /// Nothing to do but publish a fresh status (the state machine made progress).
    Wake,
    /// Fail the member with this reason, as if its log had lost acknowledged entries: its
    /// replica found its own data damaged (a checksum that no longer holds) and must be
    /// rebuilt from its peers, so it may neither vote nor serve meanwhile.
    Fail(String),
    Stop,
}

/// A mailbox: register the sender with the transport before the member starts.
pub fn mailbox<R>() -> (
    std::sync::mpsc::Sender<Msg<R>>,
    std::sync::mpsc::Receiver<Msg<R>>,
) {
    std::sync::mpsc::channel()
}
