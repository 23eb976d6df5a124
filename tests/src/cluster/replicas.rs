//! Helpers of the process-level fault tests (`tests/raft.rs`, `tests/crash_recovery.rs`):
//! one collection of one shard replicated over the shard nodes, written through the
//! coordinator with precomputed embeddings (no model time), and the check that every replica
//! converged to the same complete state: every acknowledged document on every replica exactly
//! once, nothing that was never written, BM25, HNSW and RocksDB agreeing.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use ragcluster_proto::v1::coordinator_client::CoordinatorClient;
use ragcluster_proto::v1::shard_client::ShardClient;
use ragcluster_proto::v1::*;
use rand::{Rng, SeedableRng};
use tonic::transport::Channel;

use crate::{Cluster, set_failpoint, shard_client};

pub const DIM: usize = 384;
pub const SHARD_CONFIG: &str = r#"
[shard_node]
raft_tick = "50ms"
raft_election_ticks = 10
raft_heartbeat_ticks = 2
raft_log_gc_threshold = 200
write_timeout = "5s"
"#;
/// Election timeout of SHARD_CONFIG: 10 ticks of 50 ms (randomised up to twice that).
pub const ELECTION_TIMEOUT: Duration = Duration::from_millis(500);

pub fn vector(seed: u64) -> Vec<f32> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let v: Vec<f32> = (0..DIM).map(|_| rng.random_range(-1.0..1.0)).collect();
    let n = v.iter().map(|x| x * x).sum::<f32>().sqrt();
    v.into_iter().map(|x| x / n).collect()
}

pub fn doc(id: u64) -> Document {
    Document {
        id: format!("d{id}"),
        title: String::new(),
        text: format!("raftdoc number {id}"),
        embedding: vector(id),
        ..Default::default()
    }
}

pub fn sref(collection: &str) -> Option<ShardRef> {
    Some(ShardRef {
        collection: collection.into(),
        shard: 0,
    })
}

pub async fn create(c: &mut CoordinatorClient<Channel>, name: &str) -> Result<()> {
    c.create_collection(CreateCollectionRequest {
        name: name.into(),
        shard_count: 1,
        replication_factor: 3,
        ..Default::default()
    })
    .await?;
    Ok(())
}

/// Upserts documents `ids` in one call with a client deadline; true = acknowledged.
pub async fn write(c: &mut CoordinatorClient<Channel>, coll: &str, ids: &[u64]) -> bool {
    write_docs(c, coll, ids.iter().map(|i| doc(*i)).collect()).await
}

/// Upserts documents `ids` in one call with a client deadline, carrying `token` (a
/// previous write's): the write's read token, which covers both, once acknowledged.
pub async fn write_pinned(
    c: &mut CoordinatorClient<Channel>,
    coll: &str,
    ids: &[u64],
    token: &str,
) -> Option<String> {
    let mut req = tonic::Request::new(UpsertDocumentsRequest {
        collection: coll.into(),
        documents: ids.iter().map(|i| doc(*i)).collect(),
        read_token: token.into(),
    });
    req.set_timeout(Duration::from_secs(15));
    Some(c.upsert_documents(req).await.ok()?.into_inner().read_token)
}

/// Upserts `documents` in one call with a client deadline; true = acknowledged.
pub async fn write_docs(
    c: &mut CoordinatorClient<Channel>,
    coll: &str,
    documents: Vec<Document>,
) -> bool {
    let mut req = tonic::Request::new(UpsertDocumentsRequest {
        collection: coll.into(),
        documents,
        ..Default::default()
    });
    req.set_timeout(Duration::from_secs(15));
    c.upsert_documents(req).await.is_ok()
}

/// How many documents a BM25 search through the coordinator finds by the word every test
/// document holds ("raftdoc"), at `consistency`.
pub async fn found(
    c: &mut CoordinatorClient<Channel>,
    coll: &str,
    consistency: Consistency,
) -> Result<usize> {
    found_pinned(c, coll, consistency, "").await
}

/// As `found`, read from replicas that applied the write of `token` (a read token).
pub async fn found_pinned(
    c: &mut CoordinatorClient<Channel>,
    coll: &str,
    consistency: Consistency,
    token: &str,
) -> Result<usize> {
    let hits = c
        .search(SearchRequest {
            collection: coll.into(),
            query: "raftdoc".into(),
            top_k: 1000,
            mode: SearchMode::Bm25 as i32,
            consistency: consistency as i32,
            read_token: token.into(),
            ..Default::default()
        })
        .await?
        .into_inner()
        .hits;
    Ok(hits.len())
}

/// Raft status of the shard on every node that answers.
pub async fn statuses(c: &Cluster, coll: &str) -> Vec<Option<RaftStatus>> {
    let mut out = Vec::new();
    for p in &c.shards {
        let st = async {
            let mut sc = shard_client(&p.grpc).await.ok()?;
            let mut req = tonic::Request::new(ShardInfoRequest { shard: sref(coll) });
            req.set_timeout(Duration::from_secs(1));
            sc.shard_info(req).await.ok()?.into_inner().raft
        }
        .await;
        out.push(st);
    }
    out
}

/// Cuts node `n` off from the other two (both directions) with the `raft_isolate` failpoint.
pub async fn partition(c: &Cluster, coll: &str, n: usize) -> Result<Vec<u64>> {
    let st = statuses(c, coll).await;
    let ids: Vec<u64> = st
        .iter()
        .map(|s| s.as_ref().map_or(0, |s| s.node_id))
        .collect();
    for (i, p) in c.shards.iter().enumerate() {
        let cut: Vec<String> = if i == n {
            (0..ids.len())
                .filter(|j| *j != n)
                .map(|j| ids[j].to_string())
                .collect()
        } else {
            vec![ids[n].to_string()]
        };
        set_failpoint(
            &p.grpc,
            "raft_isolate",
            &format!("return({})", cut.join(",")),
        )
        .await?;
    }
    Ok(ids)
}

/// Clears every partition.
pub async fn heal(c: &Cluster) -> Result<()> {
    for p in &c.shards {
        set_failpoint(&p.grpc, "raft_isolate", "off").await?;
    }
    Ok(())
}

/// Index of the node leading the shard, waiting up to `timeout` for one.
pub async fn leader(c: &Cluster, coll: &str, timeout: Duration) -> Result<usize> {
    let until = Instant::now() + timeout;
    loop {
        let st = statuses(c, coll).await;
        if let Some(i) = st
            .iter()
            .position(|s| s.as_ref().is_some_and(|s| s.role() == RaftRole::Leader))
        {
            return Ok(i);
        }
        if Instant::now() > until {
            bail!("no leader for {coll} within {timeout:?}: {st:?}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A BM25 read sent straight to a replica is refused: UNAVAILABLE, the message naming `why`
/// (a replica out of service, one that is not a voter).
pub async fn read_refused(sc: &mut ShardClient<Channel>, coll: &str, why: &str) -> Result<()> {
    let e = sc
        .bm25_search(Bm25SearchRequest {
            shard: sref(coll),
            query: "raftdoc".into(),
            top_k: 10,
            ..Default::default()
        })
        .await
        .err()
        .context("the read was served")?;
    ensure!(
        e.code() == tonic::Code::Unavailable && e.message().contains(why),
        "a read of the replica: {e:?}"
    );
    Ok(())
}

/// Chunk ids of a replica's BM25 hits for `query` (its tantivy index, not RocksDB).
pub async fn bm25_ids(
    sc: &mut ShardClient<Channel>,
    coll: &str,
    query: &str,
    top_k: u32,
) -> Result<BTreeSet<String>> {
    let hits = sc
        .bm25_search(Bm25SearchRequest {
            shard: sref(coll),
            query: query.into(),
            top_k,
            ids_only: true,
            ..Default::default()
        })
        .await?
        .into_inner()
        .hits;
    Ok(hits
        .into_iter()
        .filter_map(|h| h.chunk.map(|c| c.chunk_id))
        .collect())
}

/// What a replica holds: chunk ids by BM25 (the tantivy index), by an exact vector lookup of
/// each chunk (the HNSW graph) and the stored chunk count.
pub async fn contents(addr: &str, coll: &str) -> Result<(BTreeSet<String>, u64)> {
    let mut sc = shard_client(addr).await?;
    let ids = bm25_ids(&mut sc, coll, "raftdoc", 10_000).await?;
    let info = sc
        .shard_info(ShardInfoRequest { shard: sref(coll) })
        .await?
        .into_inner();
    ensure!(
        info.hnsw_points == info.chunks,
        "{addr}: hnsw has {} points, bm25 {} chunks",
        info.hnsw_points,
        info.chunks
    );
    Ok((ids, info.chunks))
}

/// Waits until every replica is a voter and applied the same index, then checks they hold
/// the same chunks, every acknowledged document exactly once, and nothing outside what was
/// attempted.
pub async fn converged(
    c: &Cluster,
    coll: &str,
    acked: &BTreeSet<u64>,
    attempted: &BTreeSet<u64>,
) -> Result<()> {
    let until = Instant::now() + Duration::from_secs(60);
    loop {
        let st = statuses(c, coll).await;
        let applied: Vec<u64> = st
            .iter()
            .map(|s| s.as_ref().map_or(0, |s| s.applied_index))
            .collect();
        // Every replica up and a voter (a learner, such as a replica rebuilt from its peers
        // before its promotion, serves no reads).
        let all_up = st
            .iter()
            .all(|s| s.as_ref().is_some_and(|s| s.voters.contains(&s.node_id)));
        if all_up
            && applied.iter().all(|a| *a == applied[0])
            && st
                .iter()
                .any(|s| s.as_ref().is_some_and(|s| s.role() == RaftRole::Leader))
        {
            break;
        }
        if Instant::now() > until {
            bail!("replicas did not converge: {st:?}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mut first: Option<BTreeSet<String>> = None;
    for p in &c.shards {
        let (ids, chunks) = contents(&p.grpc, coll).await?;
        ensure!(
            chunks as usize == ids.len(),
            "{}: {chunks} chunks stored, {} indexed",
            p.name,
            ids.len()
        );
        for a in acked {
            ensure!(
                ids.contains(&format!("d{a}#0")),
                "{}: acknowledged d{a} missing",
                p.name
            );
        }
        for id in &ids {
            let n: u64 = id
                .trim_start_matches('d')
                .trim_end_matches("#0")
                .parse()
                .context("chunk id")?;
            ensure!(attempted.contains(&n), "{}: {id} was never written", p.name);
        }
        match &first {
            None => first = Some(ids),
            Some(f) => ensure!(*f == ids, "{} differs from {}", p.name, c.shards[0].name),
        }
    }
    Ok(())
}

/// Acknowledged and attempted document ids, and when each acknowledged call ended.
#[derive(Default)]
pub struct Writes {
    pub acked: BTreeSet<u64>,
    pub attempted: BTreeSet<u64>,
    pub ok_at: Vec<Instant>,
}

/// One document of `coll` per call, one call at a time, until `stop`.
pub async fn writer(
    mut cc: CoordinatorClient<Channel>,
    coll: &'static str,
    w: std::sync::Arc<tokio::sync::Mutex<Writes>>,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
) {
    let mut id = 1_000_000u64;
    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
        id += 1;
        w.lock().await.attempted.insert(id);
        let mut req = tonic::Request::new(UpsertDocumentsRequest {
            collection: coll.into(),
            documents: vec![doc(id)],
            ..Default::default()
        });
        req.set_timeout(Duration::from_secs(3));
        if cc.upsert_documents(req).await.is_ok() {
            let mut g = w.lock().await;
            g.acked.insert(id);
            g.ok_at.push(Instant::now());
        } else {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// The longest time without an acknowledged write from `from` on, among the gaps that begin
/// before `until` (a gap that begins at `from` is counted from there).
pub fn window(ok_at: &[Instant], from: Instant, until: Instant) -> Duration {
    let mut last = from;
    let mut longest = Duration::ZERO;
    for t in ok_at.iter().filter(|t| **t > from) {
        if last < until {
            longest = longest.max(t.duration_since(last));
        }
        last = *t;
    }
    longest
}

/// After a fault run: every acknowledged write on every replica, what the linearizability
/// check found printed, and no process of the cluster logged a panic (Rust's "panicked at";
/// tantivy's error text "...or panicked." is not one).
pub async fn settled(
    c: &Cluster,
    coll: &str,
    w: &Writes,
    lin: &crate::linearizability::recorder::Checked,
) -> Result<()> {
    converged(c, coll, &w.acked, &w.attempted).await?;
    eprintln!(
        "{} of {} writes acknowledged, all on every replica; linearizable: {} keys, {} \
         operations ({} of unknown outcome), {} EVENTUAL reads went back of {}",
        w.acked.len(),
        w.attempted.len(),
        lin.keys,
        lin.ops,
        lin.unknown,
        lin.eventual_regressions,
        lin.eventual_reads
    );
    for p in c.shards.iter().chain([&c.coordinator]) {
        let log = std::fs::read_to_string(p.log())?;
        ensure!(!log.contains("panicked at"), "{} panicked", p.name);
    }
    Ok(())
}
