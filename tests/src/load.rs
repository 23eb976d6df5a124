//! A client load for operations and fault tests: one task upserts single documents, each with
//! a unique marker word, and another searches, both without pause until stopped. Only
//! UNAVAILABLE and DEADLINE_EXCEEDED (which the tasks retry) may fail a request; anything
//! else ends the task with an error. Afterwards every acknowledged document can be looked up
//! by its marker, and the replicas compared.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use ragcluster_proto::v1::admin_client::AdminClient;
use ragcluster_proto::v1::coordinator_client::CoordinatorClient;
use ragcluster_proto::v1::*;
use tokio::sync::Mutex;
use tokio::task::JoinHandle;
use tonic::Code;
use tonic::transport::Channel;

pub struct Load {
    collection: String,
    /// Alphabetic: document ids are `{prefix}-{i}`, markers `{prefix}{i}q`.
    prefix: String,
    pub acked: Mutex<Vec<usize>>,
    pub write_retries: AtomicUsize,
    pub searches: AtomicUsize,
    pub search_retries: AtomicUsize,
    stop: AtomicBool,
    tasks: Mutex<Vec<JoinHandle<Result<()>>>>,
}

fn transient(s: &tonic::Status) -> Result<()> {
    ensure!(
        matches!(s.code(), Code::Unavailable | Code::DeadlineExceeded),
        "a client request failed with {s:?}"
    );
    Ok(())
}

impl Load {
    /// Starts the writer and the searcher (`mode` searches) against `collection`.
    pub fn start(
        c: CoordinatorClient<Channel>,
        collection: &str,
        prefix: &str,
        mode: SearchMode,
    ) -> Arc<Load> {
        let load = Arc::new(Load {
            collection: collection.into(),
            prefix: prefix.into(),
            acked: Mutex::new(Vec::new()),
            write_retries: AtomicUsize::new(0),
            searches: AtomicUsize::new(0),
            search_retries: AtomicUsize::new(0),
            stop: AtomicBool::new(false),
            tasks: Mutex::new(Vec::new()),
        });
        let w = tokio::spawn(load.clone().write(c.clone()));
        let s = tokio::spawn(load.clone().search(c, mode));
        load.tasks.try_lock().expect("fresh").extend([w, s]);
        load
    }

    fn marker(&self, i: usize) -> String {
        format!("{}{i}q", self.prefix)
    }

    async fn write(self: Arc<Self>, mut c: CoordinatorClient<Channel>) -> Result<()> {
        let mut i = 0;
        while !self.stop.load(Ordering::Relaxed) {
            let d = Document {
                id: format!("{}-{i}", self.prefix),
                title: format!("stream document {i}"),
                text: format!(
                    "Stream document {i} carries the unique marker {} for this test.",
                    self.marker(i)
                ),
                metadata: HashMap::new(),
                ..Default::default()
            };
            match c
                .upsert_documents(UpsertDocumentsRequest {
                    collection: self.collection.clone(),
                    documents: vec![d],
                    ..Default::default()
                })
                .await
            {
                Ok(_) => {
                    self.acked.lock().await.push(i);
                    i += 1;
                }
                Err(s) => {
                    transient(&s)?;
                    self.write_retries.fetch_add(1, Ordering::Relaxed);
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
        Ok(())
    }

    async fn search(
        self: Arc<Self>,
        mut c: CoordinatorClient<Channel>,
        mode: SearchMode,
    ) -> Result<()> {
        while !self.stop.load(Ordering::Relaxed) {
            let r = c
                .search(SearchRequest {
                    collection: self.collection.clone(),
                    query: "stream document marker".into(),
                    top_k: 5,
                    mode: mode as i32,
                    ..Default::default()
                })
                .await;
            match r {
                Ok(_) => self.searches.fetch_add(1, Ordering::Relaxed),
                Err(s) => {
                    transient(&s)?;
                    self.search_retries.fetch_add(1, Ordering::Relaxed)
                }
            };
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Ok(())
    }

    pub async fn written(&self) -> usize {
        self.acked.lock().await.len()
    }

    /// Stops both tasks (errors of either come back here) and prints the counts.
    pub async fn stop(&self) -> Result<Vec<usize>> {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.tasks.lock().await.drain(..) {
            t.await??;
        }
        let acked = self.acked.lock().await.clone();
        eprintln!(
            "{} writes acknowledged ({} retried), {} searches ({} retried)",
            acked.len(),
            self.write_retries.load(Ordering::Relaxed),
            self.searches.load(Ordering::Relaxed),
            self.search_retries.load(Ordering::Relaxed)
        );
        Ok(acked)
    }

    /// Every acknowledged document is found by BM25 on its marker.
    pub async fn verify(&self, mut c: CoordinatorClient<Channel>) -> Result<()> {
        for i in self.acked.lock().await.iter().copied() {
            let r = c
                .search(SearchRequest {
                    collection: self.collection.clone(),
                    query: self.marker(i),
                    top_k: 1,
                    mode: SearchMode::Bm25 as i32,
                    ..Default::default()
                })
                .await?
                .into_inner();
            let want = format!("{}-{i}", self.prefix);
            ensure!(
                r.hits.first().is_some_and(|h| h.doc_id == want),
                "acknowledged {want} is missing"
            );
        }
        Ok(())
    }
}

/// Waits until every shard of `collection` has `replicas` replicas that answer with the same
/// applied index and chunk count; returns how long that took.
pub async fn converged(
    admin: &mut AdminClient<Channel>,
    collection: &str,
    replicas: usize,
    timeout: Duration,
) -> Result<Duration> {
    let t = Instant::now();
    loop {
        let st = admin
            .cluster_status(ClusterStatusRequest {})
            .await?
            .into_inner();
        let c = st
            .collections
            .iter()
            .find(|c| c.collection.as_ref().is_some_and(|c| c.name == collection))
            .context("collection missing")?;
        let same = c.shards.iter().all(|s| {
            s.replicas.len() == replicas
                && s.replicas.iter().all(|r| {
                    r.role() != RaftRole::Unreachable
                        && r.applied_index == s.replicas[0].applied_index
                        && r.chunks == s.replicas[0].chunks
                })
        });
        if same {
            return Ok(t.elapsed());
        }
        ensure!(
            t.elapsed() < timeout,
            "replicas did not converge: {:?}",
            c.shards
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
