//! The catalog as the state machine of the coordinators' Raft group: every applied entry is
//! one `CatalogCommand`, persisted (synced) with the applied index before the proposer hears.

use parking_lot::RwLock;
use prost::Message as _;
use ragcluster_proto::v1::{CatalogCommand, CatalogState};
use ragcluster_raft::eraftpb::{ConfState, HardState, SnapshotMetadata};
use ragcluster_raft::{Fatal, SnapshotError, StateMachine};
use tokio::sync::watch;

use super::store::CatalogStore;
use super::view::View;
use crate::error::{CoordError, Result};

/// The outcome of a catalog change, for its proposer.
pub type CatalogResponse = Result<()>;

pub struct CatalogMachine {
    store: CatalogStore,
    view: RwLock<View>,
    /// The applied index, so that callers wait for a change instead of polling.
    applied: watch::Sender<u64>,
}

fn fatal(e: CoordError) -> Fatal {
    Fatal(e.to_string())
}

impl CatalogMachine {
    pub fn open(store: CatalogStore) -> Result<Self> {
        let st = store.load_state()?;
        let applied = st.applied_index;
        Ok(Self {
            store,
            view: RwLock::new(View::from_state(st)),
            applied: watch::channel(applied).0,
        })
    }

    pub fn view(&self) -> parking_lot::RwLockReadGuard<'_, View> {
        self.view.read()
    }

    pub fn changes(&self) -> watch::Receiver<u64> {
        self.applied.subscribe()
    }

    /// Moves to `next` once it is durable.
    fn commit(&self, next: View, conf: Option<&ConfState>) -> Result<()> {
        self.store.put_state(&next.state(), conf)?;
        let index = next.applied_index;
        *self.view.write() = next;
        self.applied.send_replace(index);
        Ok(())
    }
}

impl StateMachine for CatalogMachine {
    type Response = CatalogResponse;

    fn applied_index(&self) -> u64 {
        self.view.read().applied_index
    }

    fn apply(
        &self,
        index: u64,
        term: u64,
        data: &[u8],
    ) -> std::result::Result<CatalogResponse, Fatal> {
        let cmd = CatalogCommand::decode(data)
            .map_err(|e| Fatal(format!("catalog log entry {index}: {e}")))?;
        let mut next = self.view.read().clone();
        let outcome = next.apply(cmd);
        next.applied_index = index;
        next.applied_term = term;
        self.commit(next, None).map_err(fatal)?;
        Ok(outcome)
    }

    fn apply_empty(
        &self,
        index: u64,
        term: u64,
        conf: Option<&ConfState>,
    ) -> std::result::Result<(), Fatal> {
        let mut next = self.view.read().clone();
        next.applied_index = index;
        next.applied_term = term;
        self.commit(next, conf).map_err(fatal)
    }

    /// The whole catalog (a few KB) travels inside the snapshot message.
    fn snapshot(
        &self,
        index: u64,
        _term: u64,
        _to: u64,
    ) -> std::result::Result<Vec<u8>, SnapshotError> {
        let v = self.view.read();
        if v.applied_index != index {
            return Err(SnapshotError::NotYet);
        }
        Ok(v.state().encode_to_vec())
    }

    fn restore(
        &self,
        meta: &SnapshotMetadata,
        data: &[u8],
        hs: &HardState,
    ) -> std::result::Result<(), Fatal> {
        let mut st = CatalogState::decode(data)
            .map_err(|e| Fatal(format!("catalog snapshot from the leader: {e}")))?;
        st.applied_index = meta.index;
        st.applied_term = meta.term;
        let cs = meta.conf_state.clone().unwrap_or_default();
        self.store.install(&st, &cs, hs).map_err(fatal)?;
        *self.view.write() = View::from_state(st);
        self.applied.send_replace(meta.index);
        tracing::info!(
            index = meta.index,
            "catalog replaced by the leader's snapshot"
        );
        Ok(())
    }
}
