//! The catalog as of an applied index, and how one command changes it.

use std::collections::BTreeMap;

use ragcluster_proto::v1::{
    Alias, ApiKeyRecord, CatalogCommand, CatalogState, CollectionInfo, Member, MemberState,
    UpdateAliasesRequest, alias_action, catalog_command::Op,
};

use crate::error::{CoordError, Result};
use crate::limits::MAX_ALIASES;

/// The catalog as of an applied index.
#[derive(Clone, Default)]
pub struct View {
    pub collections: BTreeMap<String, CollectionInfo>,
    /// API keys by id (hashed; see `auth`).
    pub api_keys: BTreeMap<String, ApiKeyRecord>,
    /// Shard nodes and model workers by node id (removed ones stay, so ids are never reused).
    pub members: BTreeMap<u64, Member>,
    /// Alias -> the collection it stands for.
    pub aliases: BTreeMap<String, String>,
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
            members: st.members.into_iter().map(|m| (m.node_id, m)).collect(),
            aliases: st
                .aliases
                .into_iter()
                .map(|a| (a.alias, a.collection))
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
            members: self.members.values().cloned().collect(),
            aliases: self.aliases(None),
        }
    }

    /// The collection `name` stands for: itself, or the target of the alias of that name.
    pub fn resolve<'a>(&'a self, name: &'a str) -> &'a str {
        self.aliases.get(name).map_or(name, String::as_str)
    }

    /// Every alias (of `collection` when given), by name.
    pub fn aliases(&self, collection: Option<&str>) -> Vec<Alias> {
        self.aliases
            .iter()
            .filter(|(_, c)| collection.is_none_or(|want| want == c.as_str()))
            .map(|(a, c)| Alias {
                alias: a.clone(),
                collection: c.clone(),
            })
            .collect()
    }

    /// Alias changes in order, on a copy: all of them or none.
    fn update_aliases(&mut self, r: UpdateAliasesRequest) -> Result<()> {
        let mut next = self.aliases.clone();
        for (i, a) in r.actions.into_iter().enumerate() {
            match a.action {
                Some(alias_action::Action::Put(Alias { alias, collection })) => {
                    if self.collections.contains_key(&alias) {
                        return Err(CoordError::invalid(
                            format!("actions[{i}].put.alias"),
                            format!("{alias:?} is a collection's name"),
                        ));
                    }
                    if !self.collections.contains_key(&collection) {
                        return Err(CoordError::UnknownCollection(collection));
                    }
                    next.insert(alias, collection);
                }
                Some(alias_action::Action::Delete(alias)) => {
                    if next.remove(&alias).is_none() {
                        return Err(CoordError::UnknownAlias(alias));
                    }
                }
                None => {
                    return Err(CoordError::invalid(
                        format!("actions[{i}]"),
                        "names neither put nor delete",
                    ));
                }
            }
        }
        if next.len() > MAX_ALIASES && next.len() > self.aliases.len() {
            return Err(CoordError::TooLarge {
                field: "actions".into(),
                reason: format!("the catalog holds at most {MAX_ALIASES} aliases"),
            });
        }
        self.aliases = next;
        Ok(())
    }

    /// The member at `address` (not removed).
    pub fn member_at(&self, address: &str) -> Option<&Member> {
        self.members
            .values()
            .find(|m| m.address == address && m.state() != MemberState::Removed)
    }

    /// Keeps every placement's addresses those of its node ids now, and gives placements
    /// written before node ids existed their ids once every one of their addresses belongs
    /// to a registered member.
    fn resolve_placements(&mut self) {
        let by_address: BTreeMap<&str, u64> = self
            .members
            .values()
            .filter(|m| m.state() != MemberState::Removed)
            .map(|m| (m.address.as_str(), m.node_id))
            .collect();
        for c in self.collections.values_mut() {
            for p in &mut c.shards {
                if p.node_ids.len() == p.nodes.len() {
                    for (id, addr) in p.node_ids.iter().zip(p.nodes.iter_mut()) {
                        // An empty address (a member whose address another one took) is
                        // copied too: calls must not reach the node that holds it now.
                        if let Some(m) = self.members.get(id) {
                            addr.clone_from(&m.address);
                        }
                    }
                } else if let Some(ids) = p
                    .nodes
                    .iter()
                    .map(|a| by_address.get(a.as_str()).copied())
                    .collect::<Option<Vec<u64>>>()
                {
                    p.node_ids = ids;
                }
            }
        }
    }

    /// A registration: the entry is created, or its address, models and hints replaced.
    fn upsert_member(&mut self, m: Member) -> Result<()> {
        if m.node_id == 0 {
            return Err(CoordError::invalid("node_id", "must not be 0"));
        }
        let next = match self.members.get(&m.node_id) {
            None => m,
            Some(old) if old.state() == MemberState::Removed => {
                return Err(CoordError::FailedPrecondition(format!(
                    "node {} was removed from the cluster; give it a new data directory",
                    m.node_id
                )));
            }
            Some(old) if old.kind != m.kind => {
                return Err(CoordError::FailedPrecondition(format!(
                    "node id {} belongs to a member of another kind",
                    m.node_id
                )));
            }
            Some(old) => {
                let mut n = m;
                n.joined_at_ms = old.joined_at_ms;
                // An operator's drain outlives restarts and heartbeats.
                if old.state() == MemberState::Draining {
                    n.set_state(MemberState::Draining);
                }
                if n.state == old.state {
                    n.state_since_ms = old.state_since_ms;
                }
                n
            }
        };
        // Two processes cannot listen on one address: an older entry holding it is stale (a
        // dead member whose port the OS gave to this one). It loses the address and is DOWN
        // until it registers again from wherever it comes back.
        let (id, address, at) = (next.node_id, next.address.clone(), next.state_since_ms);
        for m in self.members.values_mut() {
            if m.node_id != id && m.address == address && m.state() != MemberState::Removed {
                m.address.clear();
                if m.state() != MemberState::Down {
                    m.set_state(MemberState::Down);
                    m.state_since_ms = at;
                }
            }
        }
        self.members.insert(id, next);
        self.resolve_placements();
        Ok(())
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
                if let Some(to) = self.aliases.get(&c.name) {
                    return Err(CoordError::invalid(
                        "name",
                        format!("{:?} is an alias of collection {to:?}", c.name),
                    ));
                }
                self.collections.insert(c.name.clone(), c);
                Ok(())
            }
            Some(Op::DropCollection(name)) => {
                if let Some((source, job)) = self.reembed_job(&name) {
                    return Err(CoordError::FailedPrecondition(format!(
                        "{name} takes part in the re-embedding of {source} into {}: finish or \
                         cancel it (`ragctl collection reembed`)",
                        job.target
                    )));
                }
                self.collections
                    .remove(&name)
                    .ok_or_else(|| CoordError::UnknownCollection(name.clone()))?;
                // Its aliases go with it (as in Qdrant and Elasticsearch).
                self.aliases.retain(|_, c| *c != name);
                Ok(())
            }
            Some(Op::UpdateAliases(r)) => self.update_aliases(r),
            Some(Op::AddFields(r)) => {
                // A re-embedding's two collections share one schema (mirrored writes carry
                // the same fields).
                let pair = self.reembed_job(&r.collection).map(|(source, job)| {
                    if source == r.collection {
                        job.target
                    } else {
                        source
                    }
                });
                let mut changed = Vec::new();
                for name in std::iter::once(r.collection.clone()).chain(pair) {
                    let mut info = self
                        .collections
                        .get(&name)
                        .cloned()
                        .ok_or_else(|| CoordError::UnknownCollection(name.clone()))?;
                    crate::schema::apply_add_fields(&mut info, &r)?;
                    changed.push(info);
                }
                for info in changed {
                    self.collections.insert(info.name.clone(), info);
                }
                Ok(())
            }
            Some(Op::SetReembed(r)) => self.set_reembed(r),
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
                shard.node_ids = p.node_ids;
                self.resolve_placements();
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
            Some(Op::UpsertMember(m)) => self.upsert_member(m),
            Some(Op::SetMemberState(s)) => {
                let m = self
                    .members
                    .get_mut(&s.node_id)
                    .ok_or(CoordError::UnknownNode(s.node_id))?;
                if m.state() == MemberState::Removed {
                    return Err(CoordError::FailedPrecondition(format!(
                        "node {} was removed",
                        s.node_id
                    )));
                }
                if m.state != s.state {
                    m.state = s.state;
                    m.state_since_ms = s.at_ms;
                }
                Ok(())
            }
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ragcluster_proto::v1::{NodeKind, ShardPlacement};

    fn member(id: u64, address: &str) -> Member {
        Member {
            node_id: id,
            kind: NodeKind::ShardNode as i32,
            address: address.into(),
            state: MemberState::Up as i32,
            ..Default::default()
        }
    }

    fn upsert(v: &mut View, m: Member) {
        v.apply(CatalogCommand {
            op: Some(Op::UpsertMember(m)),
        })
        .unwrap();
    }

    #[test]
    fn placements_follow_members_and_never_name_a_taken_address() {
        let mut v = View::default();
        // A catalog written before node ids: addresses only.
        v.collections.insert(
            "c".into(),
            CollectionInfo {
                name: "c".into(),
                shards: vec![ShardPlacement {
                    nodes: vec!["http://a:1".into(), "http://b:1".into()],
                    node_ids: vec![],
                }],
                ..Default::default()
            },
        );
        upsert(&mut v, member(1, "http://a:1"));
        assert!(
            v.collections["c"].shards[0].node_ids.is_empty(),
            "b unknown yet"
        );
        upsert(&mut v, member(2, "http://b:1"));
        assert_eq!(v.collections["c"].shards[0].node_ids, vec![1, 2]);
        // Node 1 comes back elsewhere: the placement follows.
        upsert(&mut v, member(1, "http://a:2"));
        assert_eq!(
            v.collections["c"].shards[0].nodes,
            vec!["http://a:2".to_string(), "http://b:1".to_string()]
        );
        // A new node 3 gets node 2's old port while 2 is dead: 2 loses the address (and is
        // DOWN), and its replica is not sent to node 3.
        upsert(&mut v, member(3, "http://b:1"));
        assert_eq!(v.members[&2].address, "");
        assert_eq!(v.members[&2].state(), MemberState::Down);
        assert_eq!(v.collections["c"].shards[0].nodes[1], "");
        assert_eq!(v.member_at("http://b:1").map(|m| m.node_id), Some(3));
        // Node 2 registers again from its new address.
        upsert(&mut v, member(2, "http://b:2"));
        assert_eq!(v.collections["c"].shards[0].nodes[1], "http://b:2");
    }
}
