//! Moving a collection to another embedding model while it serves (`Admin.Reembed`,
//! `ragctl collection reembed`): the documents go to a new collection (the target) with the
//! new model, filled by a copy on the server, while every write to the source is mirrored to
//! the target (`ingest::mirror`); a switch then moves the source's aliases to the target in
//! one catalog entry, after which writes to the target are mirrored back, so a rollback loses
//! nothing until the source is dropped.
//!
//! Every write during the job carries a version: the job's epoch (counted by the catalog:
//! one at the start, one more at each switch and rollback) above a log index of the
//! collection serving in that epoch. The copy exports each serving shard at one log index
//! (`seq`) and writes its documents to the other's shard of the same number at that
//! version: a mirrored write that got there first carries a higher index and is kept.
//! Documents the other side holds but the export does not are deleted at the same version,
//! so deletes made during the copy hold too. A write that resolved its collection before a
//! switch or a rollback and lands after it keeps its older epoch on both sides, so it never
//! replaces a later one. A copy is idempotent: an interrupted one is resumed by asking
//! again, and a sync (run by the switch) re-embeds only what changed, since vectors of
//! unchanged texts are reused. A write that read the catalog before the job began is not
//! mirrored; the switch's sync starts at least a write timeout after the job, so it copies
//! such writes. A coordinator cut off from the catalog for longer keeps writing only to the
//! collection it knows (as with any alias switch).

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use futures::TryStreamExt;
use ragcluster_common::versions::version;
use ragcluster_proto::v1::*;
use tokio::sync::mpsc::Sender;
use tonic::Status;

use crate::catalog::Catalog;
use crate::collections::Collections;
use crate::error::{CoordError, Result};
use crate::ingest::{Copied, Ingestor};
use crate::limits::{DEFAULT_REEMBED_PARALLEL, MAX_REEMBED_PARALLEL, REEMBED_BATCH_DOCUMENTS};
use crate::read_token::NO_TOKEN;
use crate::shards::{ReadPlan, Shards};

/// Catalog changes and one copy batch's writes.
const STEP_TIMEOUT: Duration = Duration::from_secs(60);
/// Tries of one copy batch that the model worker or a shard refused for now.
const COPY_BATCH_ATTEMPTS: u32 = 6;
/// Chunks per page while the target's document ids are listed.
const LIST_PAGE: u32 = 10_000;

pub type Progress = Sender<std::result::Result<ReembedProgress, Status>>;

pub struct Reembedder {
    pub catalog: Arc<Catalog>,
    pub shards: Arc<Shards>,
    pub collections: Arc<Collections>,
    pub ingestor: Arc<Ingestor>,
    /// `coordinator.write_timeout`: how long a write that began before the job (and so is
    /// not mirrored) may still land in the source. The switch's sync starts no sooner.
    pub write_timeout: Duration,
}

/// The default target name: `<source>-<model>`, lowercased, other characters as '-'.
pub fn default_target(source: &str, model: &str) -> String {
    let slug: String = model
        .chars()
        .map(|c| match c.to_ascii_lowercase() {
            c @ ('a'..='z' | '0'..='9' | '_') => c,
            _ => '-',
        })
        .collect();
    let mut name = format!("{source}-{}", slug.trim_matches('-'));
    name.truncate(64);
    name.trim_end_matches('-').to_owned()
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

fn refused(why: String) -> CoordError {
    CoordError::FailedPrecondition(why)
}

/// Progress of one copy, sent as it goes.
struct Tally {
    source: String,
    target: String,
    job: Option<ReembedJob>,
    total: u64,
    copied: u64,
    deleted: u64,
    c: Copied,
}

impl Tally {
    fn message(&self, phase: &str, done: bool, message: String) -> ReembedProgress {
        ReembedProgress {
            phase: phase.into(),
            source: self.source.clone(),
            target: self.target.clone(),
            job: self.job.clone(),
            documents_copied: self.copied,
            documents_total: self.total,
            chunks_embedded: self.c.embedded,
            chunks_reused: self.c.reused,
            documents_newer: self.c.newer,
            documents_deleted: self.deleted,
            done,
            message,
        }
    }
}

impl Reembedder {
    pub fn arc(
        h: &crate::handles::Handles,
        collections: &Arc<Collections>,
        ingestor: &Arc<Ingestor>,
        write_timeout: Duration,
    ) -> Arc<Self> {
        Arc::new(Self {
            catalog: h.catalog.clone(),
            shards: h.shards.clone(),
            collections: collections.clone(),
            ingestor: ingestor.clone(),
            write_timeout,
        })
    }

    /// Runs one action, streaming progress to `tx`; the last message has `done`.
    pub async fn run(&self, r: ReembedRequest, tx: &Progress) -> Result<()> {
        check(&r)?;
        let parallel = match r.parallel {
            0 => DEFAULT_REEMBED_PARALLEL,
            p => p,
        } as usize;
        let action = r.action();
        let info = self.catalog.get(&r.collection)?;
        let job = self.catalog.reembed_job(&info.name);
        let (source, job) = match (action, job) {
            (ReembedAction::Start, None) => self.start(&info, &r).await?,
            (_, None) => {
                return Err(refused(format!("{} is not being re-embedded", info.name)));
            }
            (_, Some(j)) => j,
        };
        let mut t = Tally {
            source: source.clone(),
            target: job.target.clone(),
            job: Some(job.clone()),
            total: 0,
            copied: 0,
            deleted: 0,
            c: Copied::default(),
        };
        let serving = if job.switched { &job.target } else { &source };
        let other = if job.switched { &source } else { &job.target };
        match action {
            ReembedAction::Start | ReembedAction::Sync => {
                (self.copy(serving, other, parallel, job.epoch, &mut t, tx)).await?;
                let m = format!("{other} holds every document of {serving}");
                send(tx, t.message("copy", true, m)).await;
            }
            ReembedAction::Switch => {
                if job.switched {
                    return Err(refused(format!("{source} was switched to {}", job.target)));
                }
                // A write that read the catalog before the job began is not mirrored; the
                // sync's export must come after it landed.
                let since = Duration::from_millis(now_ms().saturating_sub(job.started_at_ms));
                let settle = self.write_timeout + Duration::from_secs(1);
                if since < settle {
                    tokio::time::sleep(settle - since).await;
                }
                (self.copy(&source, &job.target, parallel, job.epoch, &mut t, tx)).await?;
                let next = ReembedJob {
                    switched: true,
                    ..job
                };
                t.job = Some(self.set_job(&source, next).await?);
                let m = format!(
                    "the aliases of {source} name {}; writes to it are mirrored to {source}",
                    t.target
                );
                send(tx, t.message("switch", true, m)).await;
            }
            ReembedAction::Rollback => {
                if !job.switched {
                    return Err(refused(format!("{source} was not switched")));
                }
                let next = ReembedJob {
                    switched: false,
                    ..job
                };
                t.job = Some(self.set_job(&source, next).await?);
                let m = format!("the aliases name {source} again");
                send(tx, t.message("rollback", true, m)).await;
            }
            ReembedAction::Finish | ReembedAction::Cancel => {
                let finish = action == ReembedAction::Finish;
                if finish != job.switched {
                    return Err(refused(if finish {
                        format!("{source} was not switched: switch first, or cancel")
                    } else {
                        format!("{source} was switched: roll back first, or finish")
                    }));
                }
                let drop = if finish { &source } else { &job.target };
                self.catalog
                    .set_reembed(&source, None, STEP_TIMEOUT)
                    .await?;
                self.collections.remove(drop).await?;
                t.job = None;
                let phase = if finish { "finish" } else { "cancel" };
                send(tx, t.message(phase, true, format!("{drop} dropped"))).await;
            }
            ReembedAction::Status | ReembedAction::Unspecified => {
                t.total = self.count(&self.catalog.get(serving)?).await?;
                t.copied = self.count(&self.catalog.get(other)?).await?;
                let m = format!(
                    "{} documents in {serving}, {} in {other}",
                    t.total, t.copied
                );
                send(tx, t.message("status", true, m)).await;
            }
        }
        Ok(())
    }

    /// Creates the target (the source's layout and schema, the new model) and records the
    /// job; from then on writes to the source are mirrored.
    async fn start(
        &self,
        info: &CollectionInfo,
        r: &ReembedRequest,
    ) -> Result<(String, ReembedJob)> {
        if r.embedding_model.is_empty() {
            return Err(CoordError::invalid(
                "embedding_model",
                "is required to start a re-embedding",
            ));
        }
        let target = match r.target.as_str() {
            "" => default_target(&info.name, &r.embedding_model),
            t => t.to_owned(),
        };
        if self.catalog.contains(&target) || self.catalog.alias_target(&target).is_some() {
            return Err(CoordError::invalid(
                "target",
                format!("{target:?} is the name of a collection or alias"),
            ));
        }
        let create = CreateCollectionRequest {
            name: target.clone(),
            shard_count: info.shard_count,
            replication_factor: info.replication_factor,
            chunking: info.chunking,
            embedding_model: r.embedding_model.clone(),
            hnsw: info.hnsw,
            fields: info.fields.clone(),
        };
        self.collections.create(create).await?;
        let job = ReembedJob {
            target,
            embedding_model: r.embedding_model.clone(),
            switched: false,
            started_at_ms: now_ms(),
            epoch: 0,
        };
        let job = self.set_job(&info.name, job).await?;
        tracing::info!(
            source = info.name,
            target = job.target,
            model = job.embedding_model,
            epoch = job.epoch,
            "re-embedding started"
        );
        Ok((info.name.clone(), job))
    }

    /// Records `job` (the catalog counts its epoch); the job as recorded.
    async fn set_job(&self, source: &str, job: ReembedJob) -> Result<ReembedJob> {
        (self.catalog)
            .set_reembed(source, Some(job), STEP_TIMEOUT)
            .await?;
        self.catalog
            .reembed_job(source)
            .map(|(_, j)| j)
            .ok_or_else(|| refused(format!("the re-embedding of {source} ended meanwhile")))
    }

    /// Documents of a collection (a strong count on every shard).
    async fn count(&self, info: &CollectionInfo) -> Result<u64> {
        let plan = self.plan(info, Consistency::Strong);
        let (targets, _inflight) = self.shards.targets(&plan);
        let counts = (0..info.shard_count).map(|s| {
            let first = targets.get(s as usize).cloned().unwrap_or_default();
            let req = ShardCountRequest::default();
            let plan = &plan;
            async move { self.shards.count(plan, s, &first, req).await }
        });
        let mut n = 0;
        for r in futures::future::join_all(counts).await {
            n += r?.documents;
        }
        Ok(n)
    }

    fn plan<'a>(&self, info: &'a CollectionInfo, consistency: Consistency) -> ReadPlan<'a> {
        ReadPlan {
            collection: &info.name,
            replicas: &info.shards,
            consistency,
            deadline: Instant::now() + STEP_TIMEOUT,
            token: &NO_TOKEN,
        }
    }

    /// Copies every document of `from` into `to`, shard by shard, and deletes from `to` the
    /// documents `from` does not hold, versioned in `epoch`.
    async fn copy(
        &self,
        from: &str,
        to: &str,
        parallel: usize,
        epoch: u32,
        t: &mut Tally,
        tx: &Progress,
    ) -> Result<()> {
        let src = self.catalog.get(from)?;
        t.total = self.count(&src).await?;
        let started = Instant::now();
        for shard in 0..src.shard_count {
            let at = (shard, parallel, epoch);
            let (seq, ids) = self.copy_shard(&src, to, at, t, tx).await?;
            let dst = self.catalog.get(to)?;
            let gone: Vec<String> = self
                .list_ids(&dst, shard)
                .await?
                .into_iter()
                .filter(|id| !ids.contains(id))
                .collect();
            for ids in gone.chunks(REEMBED_BATCH_DOCUMENTS) {
                let deletes = ids
                    .iter()
                    .map(|id| DocumentWrite {
                        doc_id: id.clone(),
                        chunks: Vec::new(),
                        delete: true,
                    })
                    .collect();
                let per_shard = BTreeMap::from([(shard, (deletes, version(epoch, seq)))]);
                let c = (self.ingestor)
                    .write_reembedded(&dst, per_shard, true, STEP_TIMEOUT)
                    .await?;
                t.deleted += c.written;
                t.c.newer += c.newer;
            }
        }
        tracing::info!(
            from,
            to,
            documents = t.copied,
            embedded = t.c.embedded,
            reused = t.c.reused,
            newer = t.c.newer,
            deleted = t.deleted,
            seconds = started.elapsed().as_secs_f64(),
            "re-embedding copy done"
        );
        Ok(())
    }

    /// One shard's export written into `to` (`parallel` batches in flight, versioned in
    /// `epoch`). Returns the export's seq and the ids it held.
    async fn copy_shard(
        &self,
        src: &CollectionInfo,
        to: &str,
        (shard, parallel, epoch): (u32, usize, u32),
        t: &mut Tally,
        tx: &Progress,
    ) -> Result<(u64, HashSet<String>)> {
        let replicas = &src.shards[shard as usize].nodes;
        let what = format!("shard {shard} of {}", src.name);
        let parts = self.shards.export(&src.name, shard, replicas).await?;
        let parts = parts.map_err(|error| CoordError::Shard {
            what: what.clone(),
            error,
        });
        // Every message of an export carries its seq, an empty shard's one message too.
        let seq_seen = std::sync::atomic::AtomicU64::new(0);
        let mut ids = HashSet::new();
        let batches = parts
            .map_ok(|p| {
                seq_seen.store(p.seq, std::sync::atomic::Ordering::Relaxed);
                let docs: Vec<DocumentWrite> = p.documents;
                let batches: Vec<_> = docs
                    .chunks(REEMBED_BATCH_DOCUMENTS)
                    .map(|b| (version(epoch, p.seq), b.to_vec()))
                    .collect();
                futures::stream::iter(batches.into_iter().map(Ok))
            })
            .try_flatten();
        let dst = self.catalog.get(to)?;
        let mut written = batches
            .map_ok(|(s, docs): (u64, Vec<DocumentWrite>)| {
                let doc_ids: Vec<String> = docs.iter().map(|d| d.doc_id.clone()).collect();
                let dst = &dst;
                async move {
                    let docs = docs
                        .into_iter()
                        .map(|mut d| {
                            for c in &mut d.chunks {
                                c.embedding.clear();
                            }
                            d
                        })
                        .collect();
                    let c = self.write_batch(dst, shard, docs, s).await?;
                    Ok::<_, CoordError>((s, doc_ids, c))
                }
            })
            .try_buffered(parallel);
        let mut last_sent = Instant::now();
        while let Some((_, doc_ids, c)) = written.try_next().await? {
            t.copied += doc_ids.len() as u64;
            ids.extend(doc_ids);
            t.c += c;
            if last_sent.elapsed() >= Duration::from_secs(1) {
                last_sent = Instant::now();
                send(tx, t.message("copy", false, format!("shard {shard}"))).await;
            }
        }
        drop(written);
        Ok((seq_seen.into_inner(), ids))
    }

    /// One copy batch written into `dst`, tried again while the model worker or the shard
    /// asks to come back later (a busy encoder serving searches and writes beside the copy):
    /// a copy is background work, and rewriting a batch is harmless (versions).
    async fn write_batch(
        &self,
        dst: &CollectionInfo,
        shard: u32,
        docs: Vec<DocumentWrite>,
        version: u64,
    ) -> Result<Copied> {
        let mut attempt = 1;
        loop {
            let per_shard = BTreeMap::from([(shard, (docs.clone(), version))]);
            let r = (self.ingestor)
                .write_reembedded(dst, per_shard, true, STEP_TIMEOUT)
                .await;
            match r {
                Err(e) if e.is_retryable() && attempt < COPY_BATCH_ATTEMPTS => {
                    let wait = Duration::from_millis(e.retry_after_ms().unwrap_or(1000))
                        .max(Duration::from_secs(attempt.into()));
                    tracing::warn!(collection = dst.name, shard, attempt, error = %e,
                                   "re-embedding copy batch tried again");
                    metrics::counter!("coordinator_reembed_batch_retries_total").increment(1);
                    tokio::time::sleep(wait).await;
                    attempt += 1;
                }
                r => return r,
            }
        }
    }

    /// Every document id one shard of `info` holds (a strong scan, ids in order).
    async fn list_ids(&self, info: &CollectionInfo, shard: u32) -> Result<Vec<String>> {
        let plan = self.plan(info, Consistency::Strong);
        let (targets, _inflight) = self.shards.targets(&plan);
        let first = targets.get(shard as usize).cloned().unwrap_or_default();
        let mut ids: Vec<String> = Vec::new();
        let mut after: Option<(String, u32)> = None;
        loop {
            let req = ScanRequest {
                after: after.is_some(),
                after_doc_id: after.as_ref().map(|a| a.0.clone()).unwrap_or_default(),
                after_position: after.as_ref().map_or(0, |a| a.1),
                limit: LIST_PAGE,
                max_bytes: 4 << 20,
                ..Default::default()
            };
            let page = self.shards.scan(&plan, shard, &first, req).await?;
            for c in &page.chunks {
                if ids.last() != Some(&c.doc_id) {
                    ids.push(c.doc_id.clone());
                }
            }
            match (page.done, page.chunks.last()) {
                (false, Some(c)) => after = Some((c.doc_id.clone(), c.position)),
                _ => return Ok(ids),
            }
        }
    }
}

/// Checks a request before anything runs (the handler answers these errors directly).
pub fn check(r: &ReembedRequest) -> Result<()> {
    crate::ingest::check_collection("collection", &r.collection)?;
    if r.parallel > MAX_REEMBED_PARALLEL {
        return Err(CoordError::invalid(
            "parallel",
            format!("at most {MAX_REEMBED_PARALLEL}"),
        ));
    }
    match r.action() {
        ReembedAction::Unspecified => Err(CoordError::invalid("action", "is required")),
        ReembedAction::Start if !r.target.is_empty() => {
            crate::ingest::check_collection("target", &r.target)
        }
        _ => Ok(()),
    }
}

async fn send(tx: &Progress, m: ReembedProgress) {
    let _ = tx.send(Ok(m)).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_targets_are_collection_names() {
        let n = default_target("docs", "nomic-embed-text-v1.5");
        assert_eq!(n, "docs-nomic-embed-text-v1-5");
        assert!(crate::catalog::valid_name(&n));
        let long = default_target(&"a".repeat(60), "Some/Model_Name");
        assert!(
            long.len() <= 64 && crate::catalog::valid_name(&long),
            "{long}"
        );
    }
}
