//! The handle of one replica: the shard it serves plus its running Raft member. RPC handlers
//! write, read and change membership through it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use prost::Message as _;
use ragcluster_proto::v1::{RaftCommand, WriteBatchRequest, WriteBatchResponse};
use ragcluster_raft::eraftpb::{ConfChangeType, ConfState};
use ragcluster_raft::{Member, Options, RaftError, RocksLog, Status};

use super::LeaderHint;
use super::machine::ShardResponse;
use super::transport::ShardTransport;
use crate::error::{Result, ShardError};
use crate::shard::Shard;
use crate::space::Space;

pub struct Replica {
    pub shard: Arc<Shard>,
    member: Member<ShardResponse>,
    transport: Arc<ShardTransport>,
    space: Arc<Space>,
}

impl Replica {
    /// Starts the replica's member; its mailbox is registered with the transport first so no
    /// message for it is lost. With `damaged`, the member is failed before it reads any
    /// message (its data was found damaged at open): it never votes, leads or serves, and the
    /// catalog leader rebuilds it from its peers.
    pub fn start(
        shard: Arc<Shard>,
        log: RocksLog,
        opts: Options,
        transport: Arc<ShardTransport>,
        space: Arc<Space>,
        damaged: Option<String>,
    ) -> Result<Arc<Self>> {
        let key = shard.key.clone();
        let mailbox = ragcluster_raft::mailbox();
        if let Some(why) = damaged {
            let _ = mailbox.0.send(ragcluster_raft::Msg::Fail(why));
        }
        transport.register(key.clone(), mailbox.0.clone());
        let member = Member::start(
            opts,
            log,
            shard.clone(),
            transport.outbox(key.clone()),
            mailbox,
        )
        .map_err(|e| {
            transport.unregister(&key);
            ShardError::Corrupt(e.0)
        })?;
        // The member republishes its status as the indexes catch up.
        let wake = member.mailbox();
        shard.on_progress(Box::new(move || {
            let _ = wake.send(ragcluster_raft::Msg::Wake);
        }));
        Ok(Arc::new(Self {
            shard,
            member,
            transport,
            space,
        }))
    }

    pub fn status(&self) -> Status {
        self.member.status()
    }

    /// Takes the replica out of service for `why` (the scrub found its data damaged): the
    /// member stops, and the catalog leader rebuilds the replica from its peers.
    pub fn fail(&self, why: String) {
        self.member.fail(why);
    }

    /// Whether the replica may serve: not once its Raft member failed (`Status::failed`),
    /// since what it holds may be behind what it acknowledged. The coordinator then reads from
    /// the other replicas, and the group goes on without this one.
    pub fn serving(&self) -> Result<()> {
        match self.status().failed {
            None => Ok(()),
            Some(why) => Err(ShardError::Unavailable(format!(
                "replica {} is out of service: {why}",
                self.shard.key
            ))),
        }
    }

    /// Whether the replica may answer reads: in service (`serving`) and a voter of its group.
    /// A replica that is not a voter holds less than the group acknowledged: an empty one that
    /// joined and waits for its snapshot, a learner still catching up (a move, or a failed
    /// replica rebuilt in place while the catalog still lists it), one removed from the group.
    /// It refuses with UNAVAILABLE, and the coordinator reads from another replica.
    pub fn readable(&self) -> Result<()> {
        self.serving()?;
        let st = self.status();
        if st.voters.contains(&st.id) {
            return Ok(());
        }
        Err(ShardError::Unavailable(format!(
            "replica {} is not a voter of its group (catching up as a learner, or removed): \
             it serves no reads; read another replica",
            self.shard.key
        )))
    }

    /// The leader's id and address when another replica leads.
    pub fn leader_hint(&self) -> LeaderHint {
        let id = self.status().other_leader()?;
        Some((id, self.transport.address(id).unwrap_or_default()))
    }

    pub fn leader_address(&self, id: u64) -> String {
        self.transport.address(id).unwrap_or_default()
    }

    fn error(&self, e: RaftError) -> ShardError {
        match e {
            RaftError::NotLeader { leader } => ShardError::NotLeader(
                leader.map(|id| (id, self.transport.address(id).unwrap_or_default())),
            ),
            RaftError::Stopped => {
                ShardError::Unavailable(format!("replica {} stopped", self.shard.key))
            }
            RaftError::Timeout { what, after } => ShardError::Unavailable(format!(
                "{what} not committed within {} ms (no quorum?); the outcome is unknown, retry \
                 with the same request_id",
                after.as_millis()
            )),
            RaftError::FailedPrecondition(m) => ShardError::FailedPrecondition(m),
        }
    }

    /// Proposes a write batch and answers once it is committed, applied here and visible to
    /// searches. Refused before anything is proposed when a full disk (here, or on too many
    /// voters) would keep it from committing.
    pub async fn write(
        &self,
        mut req: WriteBatchRequest,
        timeout: Duration,
    ) -> Result<WriteBatchResponse> {
        self.serving()?;
        let st = self.status();
        if !st.is_leader() {
            return Err(ShardError::NotLeader(self.leader_hint()));
        }
        self.shard.validate(&mut req)?;
        self.space
            .writable(&self.shard.key, &st.voters, |id| self.leader_address(id))?;
        let deadline = Instant::now() + timeout;
        let data = RaftCommand {
            proposed_at_ms: self.shard.clock.stamp(),
            batch: Some(req),
        }
        .encode_to_vec();
        let r = self
            .member
            .propose(data, timeout)
            .await
            .map_err(|e| self.error(e))??;
        self.shard.wait_visible(r.applied_seq, deadline).await?;
        Ok(r)
    }

    /// One membership change of `node` (its address rides along for the others to dial).
    pub async fn change(
        &self,
        kind: ConfChangeType,
        node: u64,
        address: &str,
        timeout: Duration,
    ) -> Result<ConfState> {
        let cc = ragcluster_raft::conf_change(kind, node, address);
        self.member
            .change(cc, timeout)
            .await
            .map_err(|e| self.error(e))
    }

    /// Waits until this replica's searches see everything committed before the call (Raft
    /// read index), so a read that follows sees every acknowledged write.
    pub async fn read_index(&self, timeout: Duration) -> Result<()> {
        self.serving()?;
        let deadline = Instant::now() + timeout;
        let index = self.member.read_index(timeout).await.map_err(|e| match e {
            RaftError::Timeout { .. } => ShardError::Unavailable(format!(
                "no read index for {} within {} ms (no leader or no quorum)",
                self.shard.key,
                timeout.as_millis()
            )),
            e => self.error(e),
        })?;
        self.shard.wait_visible(index, deadline).await
    }

    /// Moves leadership to `to` and waits until it leads. Raft aborts a transfer the target
    /// does not finish within an election timeout (a busy or lagging target), so while this
    /// replica still leads it asks again every second.
    pub async fn transfer_leader(&self, to: u64, timeout: Duration) -> Result<()> {
        let st = self.status();
        if !st.is_leader() {
            return Err(ShardError::NotLeader(self.leader_hint()));
        }
        if !st.voters.contains(&to) {
            return Err(ShardError::FailedPrecondition(format!(
                "node {to} is not a voter of this shard"
            )));
        }
        let until = Instant::now() + timeout;
        while Instant::now() < until {
            self.member.transfer_leader(to).map_err(|e| self.error(e))?;
            let left = until.saturating_duration_since(Instant::now());
            let waited = self
                .member
                .wait_for(left.min(Duration::from_secs(1)), |s| {
                    s.leader_id == to || (s.leader_id != st.id && s.leader_id != 0)
                })
                .await;
            match waited {
                Ok(s) if s.leader_id == to => return Ok(()),
                // Someone else took over: ask the new leader instead.
                Ok(_) => return Err(ShardError::NotLeader(self.leader_hint())),
                Err(_) => {}
            }
        }
        Err(ShardError::Unavailable(format!(
            "leadership did not move to node {to} in time (is it caught up?)"
        )))
    }

    /// Stops the member and waits for it.
    pub fn stop(&self) {
        self.member.stop();
    }
}
