//! Followers load their leader's HNSW graph instead of building their own. Every replica
//! applies every write (RocksDB, BM25), but inserting a point into the graph is most of a
//! write's CPU, so building one graph per replica made replication factor 3 cost about three
//! times factor 1 on shared cores. A follower holds the points it applied pending (searched
//! exactly beside its graph, `index::hnsw`), asks its leader for the leader's newest dump that
//! it can catch up (`FetchGraphDump`), and loads it from its own RocksDB vectors and op log
//! (`index::worker`, `Job::Adopt`), much as OpenSearch's segment replication copies segments
//! instead of re-indexing. Leaders dump on their usual schedule (`hnsw_dump_min_changes`);
//! a follower whose pending points reach `hnsw_follower_pending_max` inserts new points itself.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use parking_lot::Mutex;
use ragcluster_proto::v1::FetchGraphDumpRequest;

use super::Replica;
use super::transport::{GrpcDialer, shard_ref};
use crate::storage::ShardKey;

/// How often roles are read and pending points counted.
const TICK: Duration = Duration::from_millis(250);
/// A follower asks once this many points are pending...
const ASK_PENDING: usize = 1000;
/// ...or, with fewer, once this long passed since it last asked.
const ASK_IDLE: Duration = Duration::from_secs(20);
/// Least time between two asks of one replica (a leader dumps every 10k changes or a tenth of
/// its graph, so most asks early in a load find nothing newer).
const ASK_GAP: Duration = Duration::from_secs(1);
/// One fetch, end to end.
const FETCH_TIMEOUT: Duration = Duration::from_secs(60);

#[derive(Default)]
struct Asked {
    at: Option<Instant>,
    running: bool,
}

/// Runs until aborted: keeps each replica's index worker told of its role and fetches leader
/// dumps for followers with pending points.
pub fn spawn(
    replicas: impl Fn() -> Vec<Arc<Replica>> + Send + 'static,
    tls: Option<Arc<ragcluster_common::tls::Tls>>,
    enabled: bool,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let asked: Arc<Mutex<HashMap<ShardKey, Asked>>> = Arc::default();
        let mut tick = tokio::time::interval(TICK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let replicas = replicas();
            asked
                .lock()
                .retain(|k, _| replicas.iter().any(|r| &r.shard.key == k));
            for r in replicas {
                let following = !r.status().is_leader();
                r.shard.set_following(following);
                let pending = r.shard.pending_points();
                if !enabled || !following || pending == 0 {
                    continue;
                }
                let key = r.shard.key.clone();
                {
                    let mut a = asked.lock();
                    let a = a.entry(key.clone()).or_default();
                    let since = a.at.map(|t| t.elapsed());
                    let due = match since {
                        None => true,
                        Some(s) => s >= ASK_GAP && (pending >= ASK_PENDING || s >= ASK_IDLE),
                    };
                    if a.running || !due {
                        continue;
                    }
                    a.at = Some(Instant::now());
                    a.running = true;
                }
                let Some((_, address)) = r.leader_hint() else {
                    if let Some(a) = asked.lock().get_mut(&key) {
                        a.running = false;
                    }
                    continue;
                };
                let (tls, asked) = (tls.clone(), asked.clone());
                tokio::spawn(async move {
                    let req = FetchGraphDumpRequest {
                        shard: Some(shard_ref(&key)),
                        after_seq: r.shard.graph_dump_seq(),
                        max_seq: r.shard.visible_seq(),
                    };
                    let got = tokio::time::timeout(FETCH_TIMEOUT, fetch(tls, &address, req)).await;
                    let outcome = match got {
                        Ok(Ok(section)) if section.is_empty() => Ok(None),
                        Ok(Ok(section)) => {
                            let bytes = section.len();
                            let shard = r.shard.clone();
                            tokio::task::spawn_blocking(move || shard.receive_graph(&section))
                                .await
                                .map_err(|e| e.to_string())
                                .and_then(|r| r.map_err(|e| e.to_string()))
                                .map(|seq| Some((seq, bytes)))
                        }
                        Ok(Err(e)) => Err(e),
                        Err(_) => Err(format!("no answer within {FETCH_TIMEOUT:?}")),
                    };
                    match outcome {
                        Ok(Some((seq, bytes))) => {
                            metrics::counter!("shard_hnsw_graph_fetched_bytes_total")
                                .increment(bytes as u64);
                            tracing::info!(shard = %key, dump = seq, bytes, pending = r.shard.pending_points(),
                                "leader's hnsw dump fetched");
                        }
                        Ok(None) => {}
                        Err(e) => {
                            tracing::debug!(shard = %key, leader = %address, error = %e,
                                "leader's hnsw dump not fetched");
                        }
                    }
                    if let Some(a) = asked.lock().get_mut(&key) {
                        a.running = false;
                    }
                });
            }
        }
    })
}

/// The leader's dump section (empty when it has none newer than `after_seq`).
async fn fetch(
    tls: Option<Arc<ragcluster_common::tls::Tls>>,
    address: &str,
    req: FetchGraphDumpRequest,
) -> Result<Vec<u8>, String> {
    let mut client = GrpcDialer::connect(tls, address).await?;
    let mut stream = client
        .fetch_graph_dump(req)
        .await
        .map_err(|e| e.to_string())?
        .into_inner();
    let mut out = Vec::new();
    while let Some(chunk) = stream.next().await {
        out.extend_from_slice(&chunk.map_err(|e| e.to_string())?.data);
    }
    Ok(out)
}
