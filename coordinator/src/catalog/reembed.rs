//! Re-embedding jobs in the catalog (`CollectionInfo.reembed` on the source): which
//! collection a write is mirrored to, and the alias moves of a switch and a rollback, made
//! in the same entry as the state change so that no reader sees one without the other.

use ragcluster_common::versions::MAX_EPOCH;
use ragcluster_proto::v1::{ReembedJob, SetReembed};

use super::View;
use crate::error::{CoordError, Result};

/// The other collection of a re-embedding that a write is also written to.
#[derive(Debug, Clone)]
pub struct Mirror {
    pub to: ragcluster_proto::v1::CollectionInfo,
    /// The job's epoch (`ReembedJob.epoch`): the write and its mirror are versioned in it.
    pub epoch: u32,
}

impl View {
    /// The job `name` takes part in (as source or target), with the source's name.
    pub fn reembed_job(&self, name: &str) -> Option<(String, ReembedJob)> {
        self.collections.values().find_map(|c| {
            let job = c.reembed.as_ref()?;
            (c.name == name || job.target == name).then(|| (c.name.clone(), job.clone()))
        })
    }

    /// Where writes to collection `name` are mirrored: the other collection of its job, with
    /// the epoch their versions carry. Only the collection that serves (the source, or the
    /// target once switched) takes writes: one to the other side is refused, since the next
    /// copy would undo it (a write that resolved its collection before a switch still lands
    /// where it resolved, versioned in its older epoch).
    pub fn mirror(&self, name: &str) -> Result<Option<Mirror>> {
        let Some((source, job)) = self.reembed_job(name) else {
            return Ok(None);
        };
        let (serving, other) = if job.switched {
            (job.target.as_str(), source.as_str())
        } else {
            (source.as_str(), job.target.as_str())
        };
        if name != serving {
            return Err(CoordError::FailedPrecondition(format!(
                "{name} is the copy of a re-embedding of {source} that does not serve: write \
                 to {serving} (or an alias of it), which mirrors writes here"
            )));
        }
        let to = (self.collections.get(other).cloned())
            .ok_or_else(|| CoordError::UnknownCollection(other.to_owned()))?;
        Ok(Some(Mirror {
            to,
            epoch: job.epoch.max(1),
        }))
    }

    pub(super) fn set_reembed(&mut self, r: SetReembed) -> Result<()> {
        let source = self
            .collections
            .get(&r.source)
            .ok_or_else(|| CoordError::UnknownCollection(r.source.clone()))?;
        let before = source.reembed.clone();
        let last_epoch = source.reembed_epoch;
        let Some(mut job) = r.job else {
            // Both collections keep the last epoch: their shards hold versions up to it.
            if let Some(b) = &before {
                for name in [&r.source, &b.target] {
                    if let Some(c) = self.collections.get_mut(name) {
                        c.reembed = None;
                        c.reembed_epoch = c.reembed_epoch.max(b.epoch);
                    }
                }
            }
            return Ok(());
        };
        let target = self
            .collections
            .get(&job.target)
            .ok_or_else(|| CoordError::UnknownCollection(job.target.clone()))?;
        if target.shard_count != source.shard_count {
            return Err(CoordError::FailedPrecondition(format!(
                "{} has {} shards, {} has {}",
                job.target, target.shard_count, r.source, source.shard_count
            )));
        }
        match &before {
            Some(b) if b.target != job.target => {
                return Err(CoordError::FailedPrecondition(format!(
                    "{} is being re-embedded into {}",
                    r.source, b.target
                )));
            }
            None if self.reembed_job(&job.target).is_some() => {
                return Err(CoordError::FailedPrecondition(format!(
                    "{} takes part in another re-embedding",
                    job.target
                )));
            }
            _ => {}
        }
        let was = before.as_ref().is_some_and(|b| b.switched);
        // The epoch is the catalog's to count (every replica applies the same commands).
        job.epoch = match &before {
            None => last_epoch.max(target.reembed_epoch) + 1,
            Some(b) if b.switched != job.switched => b.epoch + 1,
            Some(b) => b.epoch,
        };
        if job.epoch > MAX_EPOCH {
            return Err(CoordError::FailedPrecondition(format!(
                "{} has switched and rolled back {MAX_EPOCH} times: finish or cancel",
                r.source
            )));
        }
        if job.switched != was {
            let (from, to) = if job.switched {
                (r.source.as_str(), job.target.as_str())
            } else {
                (job.target.as_str(), r.source.as_str())
            };
            for c in self.aliases.values_mut() {
                if c == from {
                    *c = to.to_owned();
                }
            }
        }
        if let Some(c) = self.collections.get_mut(&r.source) {
            c.reembed = Some(job);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ragcluster_proto::v1::{
        AddFieldsRequest, CatalogCommand, CollectionInfo, FieldSchema, FieldType,
        catalog_command::Op,
    };

    fn collection(name: &str, shards: u32) -> CollectionInfo {
        CollectionInfo {
            name: name.into(),
            shard_count: shards,
            ..Default::default()
        }
    }

    fn set(v: &mut View, source: &str, job: Option<ReembedJob>) -> Result<()> {
        v.apply(CatalogCommand {
            op: Some(Op::SetReembed(SetReembed {
                source: source.into(),
                job,
            })),
        })
    }

    fn job(target: &str, switched: bool) -> ReembedJob {
        ReembedJob {
            target: target.into(),
            embedding_model: "m2".into(),
            switched,
            started_at_ms: 1,
            epoch: 0,
        }
    }

    /// The other side and epoch of writes to `n`; None when not mirrored, "refused" when
    /// `n` does not serve.
    fn mirror(v: &View, n: &str) -> Option<(String, u32)> {
        match v.mirror(n) {
            Ok(m) => m.map(|m| (m.to.name, m.epoch)),
            Err(_) => Some(("refused".into(), 0)),
        }
    }

    /// Mirrors follow the switch, aliases move with it in the same change, a collection in
    /// a job cannot be dropped, and the two share schema growth.
    #[test]
    fn a_job_mirrors_writes_and_switches_aliases_in_one_change() {
        let mut v = View::default();
        for (n, s) in [("a", 2), ("b", 2), ("c", 3), ("d", 2)] {
            v.collections.insert(n.into(), collection(n, s));
        }
        v.aliases.insert("live".into(), "a".into());
        v.aliases.insert("other".into(), "d".into());
        assert!(
            set(&mut v, "a", Some(job("c", false))).is_err(),
            "shard counts differ"
        );
        set(&mut v, "a", Some(job("b", false))).unwrap();
        assert_eq!(mirror(&v, "a"), Some(("b".into(), 1)));
        assert_eq!(mirror(&v, "b"), Some(("refused".into(), 0)));
        assert_eq!(mirror(&v, "d"), None);
        assert!(
            set(&mut v, "d", Some(job("b", false))).is_err(),
            "b is taken"
        );
        assert!(
            set(&mut v, "a", Some(job("d", false))).is_err(),
            "another target"
        );
        let drop = |v: &mut View, n: &str| {
            v.apply(CatalogCommand {
                op: Some(Op::DropCollection(n.into())),
            })
        };
        assert!(drop(&mut v, "a").is_err() && drop(&mut v, "b").is_err());
        let add = AddFieldsRequest {
            collection: "a".into(),
            fields: vec![FieldSchema {
                name: "year".into(),
                r#type: FieldType::Integer as i32,
            }],
        };
        v.apply(CatalogCommand {
            op: Some(Op::AddFields(add)),
        })
        .unwrap();
        assert_eq!(
            v.collections["b"].fields.len(),
            1,
            "the target's schema grew too"
        );

        set(&mut v, "a", Some(job("b", true))).unwrap();
        assert_eq!(v.resolve("live"), "b");
        assert_eq!(v.resolve("other"), "d", "other aliases stay");
        assert_eq!(
            mirror(&v, "b"),
            Some(("a".into(), 2)),
            "epoch 2 after the switch"
        );
        assert_eq!(mirror(&v, "a"), Some(("refused".into(), 0)));
        set(&mut v, "a", Some(job("b", false))).unwrap();
        assert_eq!(v.resolve("live"), "a", "rolled back");
        assert_eq!(mirror(&v, "a"), Some(("b".into(), 3)));
        set(&mut v, "a", None).unwrap();
        assert_eq!(mirror(&v, "a"), None);
        drop(&mut v, "b").unwrap();
        // The next job of `a` starts above the epochs its shards hold versions of.
        v.collections.insert("e".into(), collection("e", 2));
        set(&mut v, "a", Some(job("e", false))).unwrap();
        assert_eq!(mirror(&v, "a"), Some(("e".into(), 4)));
    }
}
