//! The catalog as of an applied index, and how one command changes it.

use std::collections::BTreeMap;

use ragcluster_proto::v1::{
    ApiKeyRecord, CatalogCommand, CatalogState, CollectionInfo, catalog_command::Op,
};

use crate::error::{CoordError, Result};

/// The catalog as of an applied index.
#[derive(Clone, Default)]
pub struct View {
    pub collections: BTreeMap<String, CollectionInfo>,
    /// API keys by id (hashed; see `auth`).
    pub api_keys: BTreeMap<String, ApiKeyRecord>,
    pub applied_index: u64,
    pub applied_term: u64,
}

impl View {
    pub(super) fn from_state(st: CatalogState) -> Self {
        Self {
            collections: st
                .collections
                .into_iter()
                .map(|c| (c.name.clone(), c))
                .collect(),
            api_keys: st
                .api_keys
                .into_iter()
                .filter_map(|k| Some((k.info.as_ref()?.id.clone(), k)))
                .collect(),
            applied_index: st.applied_index,
            applied_term: st.applied_term,
        }
    }

    pub(super) fn state(&self) -> CatalogState {
        CatalogState {
            applied_index: self.applied_index,
            applied_term: self.applied_term,
            collections: self.collections.values().cloned().collect(),
            api_keys: self.api_keys.values().cloned().collect(),
        }
    }
}

impl View {
    /// One catalog change; the outcome goes back to the proposer.
    pub(super) fn apply(&mut self, cmd: CatalogCommand) -> Result<()> {
        match cmd.op {
            Some(Op::CreateCollection(c)) => {
                if self.collections.contains_key(&c.name) {
                    return Err(CoordError::CollectionExists(c.name));
                }
                self.collections.insert(c.name.clone(), c);
                Ok(())
            }
            Some(Op::DropCollection(name)) => self
                .collections
                .remove(&name)
                .map(|_| ())
                .ok_or(CoordError::UnknownCollection(name)),
            Some(Op::SetPlacement(p)) => {
                let c = self
                    .collections
                    .get_mut(&p.collection)
                    .ok_or_else(|| CoordError::UnknownCollection(p.collection.clone()))?;
                let shard = c
                    .shards
                    .get_mut(p.shard as usize)
                    .ok_or_else(|| CoordError::invalid("shard", format!("no shard {}", p.shard)))?;
                shard.nodes = p.nodes;
                Ok(())
            }
            Some(Op::CreateApiKey(k)) => {
                let id = k.info.as_ref().map(|i| i.id.clone()).unwrap_or_default();
                if id.is_empty() || self.api_keys.contains_key(&id) {
                    return Err(CoordError::invalid(
                        "api key",
                        format!("id {id:?} is taken"),
                    ));
                }
                self.api_keys.insert(id, k);
                Ok(())
            }
            Some(Op::RevokeApiKey(r)) => {
                let info = self
                    .api_keys
                    .get_mut(&r.id)
                    .and_then(|k| k.info.as_mut())
                    .ok_or_else(|| CoordError::UnknownApiKey(r.id.clone()))?;
                // Revoking twice keeps the first time.
                if info.revoked_at_ms == 0 {
                    info.revoked_at_ms = r.at_ms.max(1);
                }
                Ok(())
            }
            None => Ok(()),
        }
    }
}
