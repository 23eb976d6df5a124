//! A member that cannot trust its log stops on its own and says why (`Status::failed`),
//! without taking its process down: a leader's heartbeat committing past the end of its log
//! (storage lost entries it had acknowledged) fails it before raft-rs would panic, and a
//! panic on the member's thread is caught and fails it the same way.

use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use ragcluster_raft::eraftpb::{ConfState, HardState, Message, MessageType, SnapshotMetadata};
use ragcluster_raft::{
    Fatal, MemLog, Member, Msg, Options, Outbox, Role, SnapshotError, StateMachine, mailbox,
};

/// Applies nothing but the index; panics on a command when told to.
#[derive(Default)]
struct Machine {
    applied: Mutex<u64>,
    panic_on_apply: bool,
}

impl StateMachine for Machine {
    type Response = u64;

    fn applied_index(&self) -> u64 {
        *self.applied.lock()
    }

    fn apply(&self, index: u64, _term: u64, _data: &[u8]) -> Result<u64, Fatal> {
        assert!(!self.panic_on_apply, "the machine broke applying {index}");
        *self.applied.lock() = index;
        Ok(index)
    }

    fn apply_empty(&self, index: u64, _term: u64, _conf: Option<&ConfState>) -> Result<(), Fatal> {
        *self.applied.lock() = index;
        Ok(())
    }

    fn snapshot(&self, _index: u64, _term: u64, _to: u64) -> Result<Vec<u8>, SnapshotError> {
        Err(SnapshotError::NotYet)
    }

    fn restore(&self, meta: &SnapshotMetadata, _data: &[u8], _hs: &HardState) -> Result<(), Fatal> {
        *self.applied.lock() = meta.index;
        Ok(())
    }
}

struct Nowhere;

impl Outbox for Nowhere {
    fn send(&self, _msgs: Vec<Message>) {}
    fn learn_peer(&self, _id: u64, _address: &str) {}
}

fn options(id: u64, campaign: bool) -> Options {
    options_created(id, campaign, false)
}

fn options_created(id: u64, campaign: bool, created: bool) -> Options {
    Options {
        id,
        tick: Duration::from_millis(10),
        election_ticks: 10,
        heartbeat_ticks: 2,
        log_gc_threshold: 1000,
        compact_applied: false,
        campaign,
        created,
        fixed_election_timeout: None,
        name: format!("failure-{id}"),
        metrics_prefix: "test",
    }
}

fn heartbeat(from: u64, to: u64, term: u64, commit: u64) -> Msg<u64> {
    let mut hb = Message::default();
    hb.set_msg_type(MessageType::MsgHeartbeat);
    hb.from = from;
    hb.to = to;
    hb.term = term;
    hb.commit = commit;
    Msg::Raft(Box::new(hb))
}

fn voters(ids: &[u64]) -> ConfState {
    ConfState {
        voters: ids.to_vec(),
        ..Default::default()
    }
}

#[tokio::test]
async fn a_heartbeat_past_the_end_of_the_log_fails_the_member_without_a_panic() {
    let (tx, rx) = mailbox();
    let member = Member::start(
        options(3, false),
        MemLog::new(voters(&[1, 2, 3])),
        Arc::new(Machine::default()),
        Arc::new(Nowhere),
        (tx.clone(), rx),
    )
    .unwrap();
    // Leader 1 of term 1 believes member 3 acknowledged up to 50: its log is empty.
    tx.send(heartbeat(1, 3, 1, 50)).unwrap();
    let st = member
        .wait_for(Duration::from_secs(5), |s| s.has_failed())
        .await
        .expect("the member fails");
    let why = st.failed.unwrap();
    assert!(why.contains("lost acknowledged log entries"), "{why}");
    assert!(
        why.contains("commits 50") && why.contains("ends at 0"),
        "{why}"
    );
    assert_eq!(st.role, Role::Stopped);
    // Stopped for good: callers are told so.
    assert!(member.read_index(Duration::from_secs(1)).await.is_err());
}

#[tokio::test]
async fn a_panic_on_the_members_thread_fails_only_that_member() {
    let (tx, rx) = mailbox();
    let member = Member::start(
        options(1, true),
        MemLog::new(voters(&[1])),
        Arc::new(Machine {
            panic_on_apply: true,
            ..Default::default()
        }),
        Arc::new(Nowhere),
        (tx, rx),
    )
    .unwrap();
    member
        .wait_for(Duration::from_secs(5), |s| s.is_leader())
        .await
        .expect("a lone member leads");
    let e = member.propose(vec![1], Duration::from_secs(5)).await;
    assert!(e.is_err(), "{e:?}");
    let st = member
        .wait_for(Duration::from_secs(5), |s| s.has_failed())
        .await
        .expect("the member fails");
    let why = st.failed.unwrap();
    assert!(
        why.contains("raft panicked") && why.contains("the machine broke"),
        "{why}"
    );
}

/// A replica rebuilt from its peers joins empty under the node id of the one it replaced; a
/// heartbeat the leader sent that one (committing what it had acknowledged) can arrive after
/// it. The new member, created by this process, lost nothing: it drops the heartbeat and
/// follows the leader's next one.
#[tokio::test]
async fn a_created_member_drops_a_heartbeat_meant_for_the_replica_it_replaced() {
    let (tx, rx) = mailbox();
    let member = Member::start(
        options_created(3, false, true),
        MemLog::new(ConfState::default()),
        Arc::new(Machine::default()),
        Arc::new(Nowhere),
        (tx.clone(), rx),
    )
    .unwrap();
    tx.send(heartbeat(1, 3, 1, 50)).unwrap();
    // The leader's own heartbeat for the new member commits what it matched there: nothing.
    tx.send(heartbeat(1, 3, 1, 0)).unwrap();
    let st = member
        .wait_for(Duration::from_secs(5), |s| s.leader_id == 1)
        .await
        .expect("the member follows leader 1");
    assert!(st.failed.is_none(), "{:?}", st.failed);
    assert_eq!((st.term, st.commit_index), (1, 0));
}
