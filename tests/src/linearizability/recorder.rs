//! Clients that record per-document histories through the coordinator while a fault test
//! runs: each picks one of a few documents at random and upserts it with a new version,
//! deletes it, or reads it with a STRONG search for the document's marker word. A write that
//! fails or times out is recorded with an unknown outcome; a failed read is left out. Every
//! client also reads EVENTUAL, and counts where its own session's reads went back (a version
//! older than one of the same writer it saw before). EVENTUAL promises no session order (any
//! replica answers), so those are reported, not failed, until reads can be pinned to a
//! write.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use parking_lot::Mutex;
use ragcluster_proto::v1::coordinator_client::CoordinatorClient;
use ragcluster_proto::v1::*;
use rand::{Rng, SeedableRng};
use tokio::task::JoinHandle;
use tonic::transport::Channel;

use super::{Kind, Op, check, render};
use crate::cluster::replicas::vector;

/// The running clients of one collection.
pub struct Recorder {
    collection: String,
    keys: usize,
    stop: Arc<AtomicBool>,
    ops: Arc<Mutex<HashMap<usize, Vec<Op>>>>,
    tasks: Vec<JoinHandle<Result<(usize, usize)>>>,
}

/// What a check found: keys, operations, unknown outcomes, EVENTUAL reads and how many of
/// those went back in their session.
#[derive(Debug, Default, Clone, Copy)]
pub struct Checked {
    pub keys: usize,
    pub ops: usize,
    pub unknown: usize,
    pub eventual_reads: usize,
    pub eventual_regressions: usize,
}

/// The marker word that finds document `key` by BM25, and its id.
fn marker(key: usize) -> String {
    format!("linreg{key}q")
}

fn doc_id(key: usize) -> String {
    format!("lin-{key}")
}

/// How long a client waits for one call.
const CALL_TIMEOUT: Duration = Duration::from_secs(5);

impl Recorder {
    /// Starts `clients` clients over `keys` documents of `collection` (384-d, with vectors
    /// made here so no model is called), seeded by `seed`.
    pub fn start(
        c: &CoordinatorClient<Channel>,
        collection: &str,
        keys: usize,
        clients: usize,
        seed: u64,
    ) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let ops: Arc<Mutex<HashMap<usize, Vec<Op>>>> = Arc::default();
        let tasks = (0..clients)
            .map(|client| {
                let session = Session {
                    c: c.clone(),
                    collection: collection.to_owned(),
                    keys,
                    client,
                    rng: rand::rngs::StdRng::seed_from_u64(seed * 1000 + client as u64),
                    seq: 0,
                    seen: HashMap::new(),
                };
                tokio::spawn(session.run(stop.clone(), ops.clone()))
            })
            .collect();
        Self {
            collection: collection.to_owned(),
            keys,
            stop,
            ops,
            tasks,
        }
    }

    /// Stops the clients and checks every document's history; a violation names the
    /// collection and key and prints the history.
    pub async fn finish(self) -> Result<Checked> {
        self.stop.store(true, Ordering::Relaxed);
        let mut out = Checked {
            keys: self.keys,
            ..Default::default()
        };
        for t in self.tasks {
            let (reads, regressions) = t.await??;
            out.eventual_reads += reads;
            out.eventual_regressions += regressions;
        }
        let ops = std::mem::take(&mut *self.ops.lock());
        for (key, h) in &ops {
            out.ops += h.len();
            out.unknown += h.iter().filter(|o| o.ret.is_none()).count();
            if let Err(v) = check(h) {
                bail!(
                    "{} key {}: not linearizable: {v}\n{}",
                    self.collection,
                    doc_id(*key),
                    render(h)
                );
            }
        }
        Ok(out)
    }
}

/// One client: its connection, its random choices and what it saw EVENTUAL per key.
struct Session {
    c: CoordinatorClient<Channel>,
    collection: String,
    keys: usize,
    client: usize,
    rng: rand::rngs::StdRng,
    seq: u64,
    /// Per key: the write sequence (client, n) of the newest version an EVENTUAL read showed.
    seen: HashMap<usize, (usize, u64)>,
}

impl Session {
    /// Runs until `stop`; returns how many EVENTUAL reads it made and how many went back.
    async fn run(
        mut self,
        stop: Arc<AtomicBool>,
        ops: Arc<Mutex<HashMap<usize, Vec<Op>>>>,
    ) -> Result<(usize, usize)> {
        let (mut eventual, mut regressions) = (0, 0);
        while !stop.load(Ordering::Relaxed) {
            let key = self.rng.random_range(0..self.keys);
            let roll: f64 = self.rng.random();
            let call = Instant::now();
            let (kind, ok) = if roll < 0.35 {
                self.seq += 1;
                let v = format!("c{}n{}", self.client, self.seq);
                let ok = self.put(key, &v).await;
                (Kind::Put(v), ok)
            } else if roll < 0.45 {
                (Kind::Delete, self.delete(key).await)
            } else if roll < 0.85 {
                match self.read(key, Consistency::Strong).await {
                    Some(seen) => (Kind::Read(seen), true),
                    None => continue,
                }
            } else {
                if let Some(seen) = self.read(key, Consistency::Eventual).await {
                    eventual += 1;
                    regressions += usize::from(self.went_back(key, seen.as_deref()));
                }
                continue;
            };
            let ret = ok.then(Instant::now);
            ops.lock().entry(key).or_default().push(Op {
                client: self.client,
                call,
                ret,
                kind,
            });
            let pause = self.rng.random_range(0..20);
            tokio::time::sleep(Duration::from_millis(pause)).await;
        }
        Ok((eventual, regressions))
    }

    async fn put(&mut self, key: usize, version: &str) -> bool {
        let mut req = tonic::Request::new(UpsertDocumentsRequest {
            collection: self.collection.clone(),
            documents: vec![Document {
                id: doc_id(key),
                text: format!("register {} holds {version}", marker(key)),
                embedding: vector(key as u64 + 1_000_000),
                ..Default::default()
            }],
            ..Default::default()
        });
        req.set_timeout(CALL_TIMEOUT);
        self.c.upsert_documents(req).await.is_ok()
    }

    async fn delete(&mut self, key: usize) -> bool {
        let mut req = tonic::Request::new(DeleteDocumentsRequest {
            collection: self.collection.clone(),
            ids: vec![doc_id(key)],
            ..Default::default()
        });
        req.set_timeout(CALL_TIMEOUT);
        self.c.delete_documents(req).await.is_ok()
    }

    /// The version the document holds (Some(None): no document), or None when the read
    /// failed.
    async fn read(&mut self, key: usize, consistency: Consistency) -> Option<Option<String>> {
        let mut req = tonic::Request::new(SearchRequest {
            collection: self.collection.clone(),
            query: marker(key),
            top_k: 3,
            mode: SearchMode::Bm25 as i32,
            consistency: consistency as i32,
            timeout_ms: CALL_TIMEOUT.as_millis() as u32,
            ..Default::default()
        });
        req.set_timeout(CALL_TIMEOUT);
        let hits = self.c.search(req).await.ok()?.into_inner().hits;
        let id = doc_id(key);
        Some(
            hits.iter()
                .find(|h| h.doc_id == id)
                .and_then(|h| h.text.split_whitespace().last().map(str::to_owned)),
        )
    }

    /// Whether this EVENTUAL read went back: it shows a version older than one of the same
    /// writer this session saw before. (Versions of different writers are not ordered, and
    /// an absent document may be a delete, so only same-writer regressions count.)
    fn went_back(&mut self, key: usize, seen: Option<&str>) -> bool {
        let Some(v) = seen.and_then(parse_version) else {
            return false;
        };
        let back = self
            .seen
            .get(&key)
            .is_some_and(|prev| prev.0 == v.0 && v.1 < prev.1);
        if !back {
            self.seen.insert(key, v);
        }
        back
    }
}

/// "c3n17" -> (3, 17).
fn parse_version(v: &str) -> Option<(usize, u64)> {
    let (c, n) = v.strip_prefix('c')?.split_once('n')?;
    Some((c.parse().ok()?, n.parse().ok()?))
}
