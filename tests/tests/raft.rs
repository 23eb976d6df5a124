//! Raft fault behaviour with real processes on loopback: three shard nodes, one shard replicated
//! three ways, writes through the coordinator (documents with precomputed embeddings, so no
//! model time), faults by SIGKILL and by the shard nodes' failpoints (`raft_isolate`,
//! `raft_snapshot_corrupt`; the binaries are built with the `failpoints` feature by `make test`). After every fault the replicas must converge to the same chunks and
//! the same index contents, holding every acknowledged write exactly once.
//! `RAGCLUSTER_FAULT_SEEDS` sets how many randomised schedules run (default 20).

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use ragcluster_proto::v1::shard_client::ShardClient;
use ragcluster_proto::v1::*;
use ragcluster_tests::cluster::replicas::*;
use ragcluster_tests::linearizability::recorder::Recorder;
use ragcluster_tests::{Cluster, http_get, metric_sum, set_failpoint, shard_client};
use rand::{Rng, SeedableRng};
use tokio::sync::Mutex;
use tonic::transport::Channel;

/// 1. Kill -9 the leader while a client streams writes: a new leader within two election
///    timeouts (the first write after the kill measures the unavailability window), retries
///    succeed, every acknowledged write present exactly once on every replica.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn leader_kill_during_writes_loses_nothing() -> Result<()> {
    let mut c = Cluster::start_with(3, Some(SHARD_CONFIG))?;
    let mut cc = c.client().await?;
    create(&mut cc, "lk").await?;
    let mut acked = BTreeSet::new();
    let mut attempted = BTreeSet::new();
    for i in 0..40 {
        attempted.insert(i);
        ensure!(
            write(&mut cc, "lk", &[i]).await,
            "write {i} before the fault"
        );
        acked.insert(i);
    }
    let l = leader(&c, "lk", Duration::from_secs(5)).await?;
    let survivors: Vec<String> = (0..c.shards.len())
        .filter(|i| *i != l)
        .map(|i| c.shards[i].grpc.clone())
        .collect();
    let killed = Instant::now();
    c.shards[l].kill9();
    // Meanwhile, when do the survivors have a leader (the election alone)?
    let elected = tokio::spawn(async move {
        loop {
            for a in &survivors {
                if let Ok(mut sc) = shard_client(a).await
                    && let Ok(r) = sc.shard_info(ShardInfoRequest { shard: sref("lk") }).await
                    && r.into_inner()
                        .raft
                        .is_some_and(|s| s.role() == RaftRole::Leader)
                {
                    return killed.elapsed();
                }
            }
            if killed.elapsed() > Duration::from_secs(30) {
                return Duration::MAX;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    });
    let mut first_ok = None;
    for i in 40..120 {
        attempted.insert(i);
        if write(&mut cc, "lk", &[i]).await {
            acked.insert(i);
            first_ok.get_or_insert(killed.elapsed());
        }
    }
    let window = first_ok.context("no write succeeded after the leader was killed")?;
    let new_leader = leader(&c, "lk", Duration::from_secs(5)).await?;
    ensure!(new_leader != l);
    let elected = elected.await?;
    let term = statuses(&c, "lk").await[new_leader]
        .as_ref()
        .map_or(0, |s| s.term);
    eprintln!(
        "failover: new leader elected {} ms and first acknowledged write {} ms after kill -9 \
         of the leader (election timeout {} ms, randomised up to twice that; term now {term})",
        elected.as_millis(),
        window.as_millis(),
        ELECTION_TIMEOUT.as_millis()
    );
    c.shards[l].restart(Duration::from_secs(60))?;
    converged(&c, "lk", &acked, &attempted).await?;
    ensure!(
        acked.len() >= 100,
        "only {} of 120 writes acknowledged",
        acked.len()
    );
    Ok(())
}

/// 2. Partition the leader from its followers: it cannot acknowledge writes; the majority
///    elects a leader and goes on; after healing the old leader steps down and converges.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn partitioned_leader_cannot_acknowledge() -> Result<()> {
    let c = Cluster::start_with(3, Some(SHARD_CONFIG))?;
    let mut cc = c.client().await?;
    create(&mut cc, "part").await?;
    let mut acked = BTreeSet::new();
    let mut attempted = BTreeSet::new();
    for i in 0..20 {
        attempted.insert(i);
        ensure!(write(&mut cc, "part", &[i]).await);
        acked.insert(i);
    }
    let l = leader(&c, "part", Duration::from_secs(5)).await?;
    partition(&c, "part", l).await?;
    let mut sl = shard_client(&c.shards[l].grpc).await?;
    // The minority side cannot acknowledge: a direct write to the old leader fails in time.
    attempted.insert(1000);
    let mut req = tonic::Request::new(WriteBatchRequest {
        shard: sref("part"),
        writes: vec![DocumentWrite {
            doc_id: "d1000".into(),
            chunks: vec![Chunk {
                chunk_id: "d1000#0".into(),
                doc_id: "d1000".into(),
                text: "raftdoc number 1000".into(),
                embedding: vector(1000),
                ..Default::default()
            }],
            delete: false,
        }],
        request_id: "minority-write".into(),
        ..Default::default()
    });
    req.set_timeout(Duration::from_secs(3));
    let t = Instant::now();
    let r = sl.write_batch(req).await;
    ensure!(r.is_err(), "the isolated leader acknowledged a write");
    let code = r.unwrap_err().code();
    ensure!(
        matches!(
            code,
            tonic::Code::Unavailable | tonic::Code::DeadlineExceeded | tonic::Code::Cancelled
        ),
        "minority write failed with {code:?}"
    );
    ensure!(t.elapsed() < Duration::from_secs(6), "minority write hung");
    // The majority goes on through the coordinator.
    for i in 20..60 {
        attempted.insert(i);
        if write(&mut cc, "part", &[i]).await {
            acked.insert(i);
        }
    }
    ensure!(
        acked.len() >= 50,
        "majority acknowledged only {} writes",
        acked.len()
    );
    let st = statuses(&c, "part").await;
    ensure!(
        st[l].as_ref().is_some_and(|s| s.role() != RaftRole::Leader),
        "isolated leader did not step down: {:?}",
        st[l]
    );
    heal(&c).await?;
    converged(&c, "part", &acked, &attempted).await?;
    Ok(())
}

/// 2a. Reads pinned to a write. A follower cut off from its group applies nothing more, so
///     eventual reads that it serves miss the writes the other two acknowledge. Given a
///     write's read token, every eventual read sees that write: the lagging follower refuses
///     (it never heard of the token's index) and the coordinator asks another replica. A token
///     chained through a later write covers both; a malformed or foreign token is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_eventual_read_with_a_write_token_sees_the_write_through_replica_lag() -> Result<()> {
    let c = Cluster::start_with(3, Some(SHARD_CONFIG))?;
    let mut cc = c.client().await?;
    create(&mut cc, "tok").await?;
    create(&mut cc, "other").await?;
    for i in 0..20 {
        ensure!(write(&mut cc, "tok", &[i]).await);
    }
    let l = leader(&c, "tok", Duration::from_secs(5)).await?;
    partition(&c, "tok", (l + 1) % 3).await?;
    let upsert = |ids: std::ops::Range<u64>, token: String| UpsertDocumentsRequest {
        collection: "tok".into(),
        documents: ids.map(doc).collect(),
        read_token: token,
    };
    let first = cc.upsert_documents(upsert(20..30, String::new())).await?;
    let token = first.into_inner().read_token;
    // Chained: the second write's token covers the first one's too.
    let token = cc
        .upsert_documents(upsert(30..40, token))
        .await?
        .into_inner()
        .read_token;
    ensure!(token.starts_with("rt1."), "token {token:?}");
    let search = |read_token: &str| SearchRequest {
        collection: "tok".into(),
        query: "raftdoc".into(),
        top_k: 1000,
        mode: SearchMode::Bm25 as i32,
        consistency: Consistency::Eventual as i32,
        read_token: read_token.into(),
        ..Default::default()
    };
    // Without the token, the follower's share of the eventual reads miss the new writes.
    let (mut missed, mut plain) = (0, Vec::new());
    for _ in 0..30 {
        let t = Instant::now();
        let n = cc.search(search("")).await?.into_inner().hits.len();
        plain.push(t.elapsed());
        missed += usize::from(n < 40);
    }
    ensure!(
        missed > 0,
        "no read without a token missed the writes: no lag to test"
    );
    let mut pinned = Vec::new();
    for i in 0..30 {
        let t = Instant::now();
        let n = cc.search(search(&token)).await?.into_inner().hits.len();
        ensure!(n == 40, "read {i} with the token found {n} of 40");
        ensure!(
            t.elapsed() < Duration::from_secs(2),
            "read {i} took {:?}",
            t.elapsed()
        );
        pinned.push(t.elapsed());
    }
    plain.sort();
    pinned.sort();
    eprintln!(
        "without a token {missed} of 30 reads missed writes (p50 {:?}, max {:?}); with it none \
         did (p50 {:?}, max {:?})",
        plain[15], plain[29], pinned[15], pinned[29]
    );
    for (bad, why) in [
        ("rt1.????", "not a read token"),
        ("nope", "not a read token"),
    ] {
        let e = cc.search(search(bad)).await.unwrap_err();
        ensure!(
            e.code() == tonic::Code::InvalidArgument && e.message().contains(why),
            "{bad}: {e:?}"
        );
    }
    let foreign = cc
        .upsert_documents(UpsertDocumentsRequest {
            collection: "other".into(),
            documents: vec![doc(1)],
            ..Default::default()
        })
        .await?
        .into_inner()
        .read_token;
    let e = cc.search(search(&foreign)).await.unwrap_err();
    ensure!(
        e.code() == tonic::Code::InvalidArgument && e.message().contains("\"other\""),
        "a token of another collection: {e:?}"
    );
    let e = cc
        .ask(AskRequest {
            collection: "tok".into(),
            question: "what does raftdoc 39 hold?".into(),
            read_token: foreign.clone(),
            ..Default::default()
        })
        .await
        .err()
        .context("an Ask with a foreign token ran")?;
    ensure!(e.code() == tonic::Code::InvalidArgument, "Ask: {e:?}");
    // A refused write changes nothing, a foreign token included.
    let e = cc
        .upsert_documents(upsert(40..41, foreign))
        .await
        .unwrap_err();
    ensure!(e.code() == tonic::Code::InvalidArgument, "{e:?}");
    heal(&c).await?;
    let acked: BTreeSet<u64> = (0..40).collect();
    converged(&c, "tok", &acked, &acked).await
}

/// 2b. The coordinator cut off from a shard's leader while the nodes still reach each other
///     (failpoint `cut_from_clients` on the leader: its writes and strong reads from
///     clients are refused, its peers' traffic passes). The leader keeps its quorum, so no
///     election comes to the rescue: writes go through a follower, which forwards them to the
///     leader, and strong reads through a follower's own read index. No write fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_leader_cut_off_from_the_coordinator_is_reached_through_a_follower() -> Result<()> {
    let c = Cluster::start_with(3, Some(SHARD_CONFIG))?;
    let mut cc = c.client().await?;
    create(&mut cc, "cut").await?;
    let mut acked = BTreeSet::new();
    for i in 0..20 {
        ensure!(write(&mut cc, "cut", &[i]).await);
        acked.insert(i);
    }
    let l = leader(&c, "cut", Duration::from_secs(5)).await?;
    set_failpoint(&c.shards[l].grpc, "cut_from_clients", "return").await?;
    let cut = Instant::now();
    let mut slowest = Duration::ZERO;
    for i in 20..70 {
        let t = Instant::now();
        ensure!(
            write(&mut cc, "cut", &[i]).await,
            "write {i} through a follower"
        );
        slowest = slowest.max(t.elapsed());
        acked.insert(i);
    }
    let strong = found(&mut cc, "cut", Consistency::Strong).await?;
    ensure!(
        strong == acked.len(),
        "a strong read through a follower saw {strong} of {} writes",
        acked.len()
    );
    let forwarded: f64 = {
        let mut n = 0.0;
        for p in &c.shards {
            n += metric_sum(&http_get(&p.metrics).await?, "shard_writes_forwarded_total");
        }
        n
    };
    eprintln!(
        "leader cut off from the coordinator: 50 writes in {} ms (slowest {} ms), {forwarded} \
         forwarded by followers; strong read through a follower saw all {strong}",
        cut.elapsed().as_millis(),
        slowest.as_millis(),
    );
    ensure!(forwarded >= 1.0, "no write was forwarded");
    ensure!(
        leader(&c, "cut", Duration::from_secs(5)).await? == l,
        "the leader kept its quorum and its leadership"
    );
    set_failpoint(&c.shards[l].grpc, "cut_from_clients", "off").await?;
    converged(&c, "cut", &acked, &acked).await?;
    Ok(())
}

/// 3. A replica down while 10k writes happen and the log is compacted rejoins through a
///    snapshot (the first one corrupted in flight, rejected, and sent again) and converges.
///    4. Then a full-cluster restart loses nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn lagging_replica_catches_up_by_snapshot_and_full_restart_keeps_all() -> Result<()> {
    // Graph dumps every 2,000 changes: the snapshot ships the newest one with the op-log
    // entries after it.
    let config = format!("{SHARD_CONFIG}hnsw_dump_min_changes = 2000\n");
    let mut c = Cluster::start_with(3, Some(&config))?;
    let mut cc = c.client().await?;
    create(&mut cc, "snap").await?;
    let l = leader(&c, "snap", Duration::from_secs(5)).await?;
    let f = (l + 1) % 3;
    c.shards[f].kill9();
    let mut acked = BTreeSet::new();
    let mut attempted = BTreeSet::new();
    let total = std::env::var("RAGCLUSTER_SNAPSHOT_WRITES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10_000u64);
    let started = Instant::now();
    for b in 0..total / 50 {
        let ids: Vec<u64> = (b * 50..(b + 1) * 50).collect();
        attempted.extend(ids.iter().copied());
        ensure!(
            write(&mut cc, "snap", &ids).await,
            "batch {b} failed with one replica down"
        );
        acked.extend(ids);
    }
    eprintln!(
        "{total} writes with a replica down in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    let st = statuses(&c, "snap").await;
    let l = leader(&c, "snap", Duration::from_secs(5)).await?;
    let first = st[l].as_ref().map_or(0, |s| s.first_log_index);
    ensure!(
        first > 1,
        "leader log was not compacted (first index {first})"
    );
    set_failpoint(&c.shards[l].grpc, "raft_snapshot_corrupt", "1*return").await?;
    let t = Instant::now();
    c.shards[f].restart(Duration::from_secs(60))?;
    converged(&c, "snap", &acked, &attempted).await?;
    eprintln!(
        "replica rejoined by snapshot and converged in {:.1} s",
        t.elapsed().as_secs_f64()
    );
    let m = http_get(&c.shards[l].metrics).await?;
    ensure!(
        m.contains("raft_snapshot_failures_total"),
        "the corrupted snapshot was not rejected"
    );
    ensure!(
        m.contains("raft_snapshots_sent_total"),
        "no snapshot was sent"
    );
    // The follower loaded the graph the snapshot shipped (caught up from the op log it
    // carried) instead of rebuilding it, and the graph finds the documents.
    let fm = http_get(&c.shards[f].metrics).await?;
    ensure!(
        metric_sum(&fm, "shard_snapshot_graphs_total{graph=\"shipped\"}") >= 1.0,
        "the follower did not load a shipped graph:\n{}",
        c.shards[f].log_tail()
    );
    let mut sc = shard_client(&c.shards[f].grpc).await?;
    for id in [0, total / 2, total - 1] {
        let hits = sc
            .vector_search(VectorSearchRequest {
                shard: sref("snap"),
                vector: vector(id),
                top_k: 1,
                ids_only: true,
                ..Default::default()
            })
            .await?
            .into_inner()
            .hits;
        let got = hits
            .first()
            .and_then(|h| h.chunk.as_ref())
            .map(|c| c.chunk_id.clone());
        ensure!(got == Some(format!("d{id}#0")), "nearest to d{id}: {got:?}");
    }

    // A graceful stop ends the peers' Raft streams (which never end by themselves) instead of
    // waiting on them, so SIGTERM exits well inside the 15 s drain limit.
    let t = Instant::now();
    let status = c.shards[f].terminate()?;
    ensure!(status.success(), "SIGTERM exit: {status}");
    ensure!(
        t.elapsed() < Duration::from_secs(10),
        "SIGTERM took {:?}: the drain waited on peers' streams",
        t.elapsed()
    );
    eprintln!(
        "SIGTERM: drained and exited in {} ms",
        t.elapsed().as_millis()
    );
    c.shards[f].restart(Duration::from_secs(60))?;

    // 4. Everything down hard, everything up again.
    for p in &mut c.shards {
        p.kill9();
    }
    for p in &mut c.shards {
        p.restart(Duration::from_secs(120))?;
    }
    leader(&c, "snap", Duration::from_secs(10)).await?;
    converged(&c, "snap", &acked, &attempted).await?;
    Ok(())
}

/// A snapshot send that never finishes (issue 19's Docker flake: a restarted replica stayed
/// behind for good, because raft-rs sends a follower nothing while a snapshot to it is
/// outstanding and the send's outcome never came): the send's deadline reports it failed,
/// the leader sends another, and the replica converges.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn stalled_snapshot_send_is_given_up_and_sent_again() -> Result<()> {
    let config = format!("{SHARD_CONFIG}snapshot_send_timeout = \"2s\"\n");
    let mut c = Cluster::start_with(3, Some(&config))?;
    let mut cc = c.client().await?;
    create(&mut cc, "stall").await?;
    let l = leader(&c, "stall", Duration::from_secs(5)).await?;
    let f = (l + 1) % 3;
    c.shards[f].kill9();
    let mut acked = BTreeSet::new();
    // More log entries than raft_log_gc_threshold (200): the log gets compacted.
    for b in 0..300u64 {
        let ids: Vec<u64> = (b * 4..(b + 1) * 4).collect();
        ensure!(write(&mut cc, "stall", &ids).await, "batch {b} failed");
        acked.extend(ids);
    }
    let l = leader(&c, "stall", Duration::from_secs(5)).await?;
    let first = statuses(&c, "stall").await[l]
        .as_ref()
        .map_or(0, |s| s.first_log_index);
    ensure!(
        first > 1,
        "leader log was not compacted (first index {first})"
    );
    // Every node: whoever leads when the follower is back stalls its first snapshot.
    for p in &c.shards {
        if p.grpc != c.shards[f].grpc {
            set_failpoint(&p.grpc, "raft_snapshot_stall", "1*return").await?;
        }
    }
    let t = Instant::now();
    c.shards[f].restart(Duration::from_secs(60))?;
    converged(&c, "stall", &acked, &acked).await?;
    let l = leader(&c, "stall", Duration::from_secs(5)).await?;
    let m = http_get(&c.shards[l].metrics).await?;
    ensure!(
        metric_sum(&m, "raft_snapshot_failures_total") >= 1.0,
        "the stalled send was not given up"
    );
    eprintln!(
        "figures: replica behind a stalled snapshot send converged {:.1} s after its restart \
         (send deadline 2 s)",
        t.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Applied entries leave the Raft log of every replica once all members have them (the state
/// machine writes through the log's own RocksDB WAL), long before raft_log_gc_threshold (200):
/// the log does not keep a second copy of every chunk. A follower killed after that restarts
/// from its applied state with the short log and converges.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn applied_entries_leave_the_log_early() -> Result<()> {
    let mut c = Cluster::start_with(3, Some(SHARD_CONFIG))?;
    let mut cc = c.client().await?;
    create(&mut cc, "trim").await?;
    let mut acked = BTreeSet::new();
    for b in 0..60u64 {
        let ids: Vec<u64> = (b * 2..(b + 1) * 2).collect();
        ensure!(write(&mut cc, "trim", &ids).await, "batch {b} failed");
        acked.extend(ids);
    }
    let until = Instant::now() + Duration::from_secs(10);
    loop {
        let st = statuses(&c, "trim").await;
        let firsts: Vec<u64> = st
            .iter()
            .map(|s| s.as_ref().map_or(0, |s| s.first_log_index))
            .collect();
        if firsts.iter().all(|f| *f >= 30) {
            break;
        }
        ensure!(
            Instant::now() < until,
            "logs not trimmed after 60 entries: first indexes {firsts:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // A member that falls behind holds the leader's trimming back: it catches up from the
    // log, without a snapshot.
    let l = leader(&c, "trim", Duration::from_secs(5)).await?;
    let f = (l + 1) % 3;
    c.shards[f].kill9();
    for b in 60..80u64 {
        let ids: Vec<u64> = (b * 2..(b + 1) * 2).collect();
        ensure!(write(&mut cc, "trim", &ids).await, "batch {b} failed");
        acked.extend(ids);
    }
    c.shards[f].restart(Duration::from_secs(60))?;
    converged(&c, "trim", &acked, &acked).await?;
    let l = leader(&c, "trim", Duration::from_secs(5)).await?;
    let m = http_get(&c.shards[l].metrics).await?;
    ensure!(
        metric_sum(&m, "raft_snapshots_sent_total") == 0.0,
        "the lagging follower was sent a snapshot"
    );
    Ok(())
}

/// Ends a fault of a randomised schedule: restarts the killed node or heals the partition.
async fn end_fault(c: &mut Cluster, (n, killed): (usize, bool), seed: u64) -> Result<()> {
    if killed {
        c.shards[n]
            .restart(Duration::from_secs(60))
            .with_context(|| format!("seed {seed}: restart {n}"))
    } else {
        heal(c).await.with_context(|| format!("seed {seed}: heal"))
    }
}

/// 5. Randomised schedules: per seed, a fresh collection takes writes while nodes are killed,
///    restarted and partitioned at random (never more than one node at a time, so a quorum
///    stays possible); afterwards no acknowledged write is lost and every replica holds the
///    same complete documents. Meanwhile three clients' upserts, deletes and STRONG reads of
///    three documents are recorded and each document's history must be linearizable
///    (`ragcluster_tests::linearizability`).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn randomised_fault_schedules() -> Result<()> {
    let seeds: u64 = std::env::var("RAGCLUSTER_FAULT_SEEDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20);
    let c = Arc::new(Mutex::new(Cluster::start_with(3, Some(SHARD_CONFIG))?));
    let mut cc = c.lock().await.client().await?;
    for seed in 0..seeds {
        let coll = format!("rnd{seed}");
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        create(&mut cc, &coll)
            .await
            .with_context(|| format!("seed {seed}: create {coll}"))?;
        // Beside the batch writes: three clients upsert, delete and read (STRONG) three
        // documents of another collection on the same nodes, for the linearizability check.
        let lin = format!("lin{seed}");
        create(&mut cc, &lin)
            .await
            .with_context(|| format!("seed {seed}: create {lin}"))?;
        let recorder = Recorder::start(&cc, &lin, 3, 3, seed);
        let mut acked = BTreeSet::new();
        let mut attempted = BTreeSet::new();
        let mut next = 0u64;
        let mut faulty: Option<(usize, bool)> = None; // (node, killed?)
        for step in 0..12 {
            // A fault action every few steps: kill, partition, or heal.
            if step % 3 == 1 {
                let mut g = c.lock().await;
                match faulty.take() {
                    Some(f) => end_fault(&mut g, f, seed).await?,
                    None => {
                        let n = rng.random_range(0..3);
                        if rng.random_bool(0.5) {
                            g.shards[n].kill9();
                            faulty = Some((n, true));
                        } else {
                            partition(&g, &coll, n)
                                .await
                                .with_context(|| format!("seed {seed}: partition {n}"))?;
                            faulty = Some((n, false));
                        }
                    }
                }
            }
            let k = rng.random_range(1..8);
            let ids: Vec<u64> = (next..next + k).collect();
            next += k;
            attempted.extend(ids.iter().copied());
            if write(&mut cc, &coll, &ids).await {
                acked.extend(ids);
            }
        }
        {
            let mut g = c.lock().await;
            if let Some(f) = faulty {
                end_fault(&mut g, f, seed).await?;
            }
        }
        let lin = recorder
            .finish()
            .await
            .with_context(|| format!("seed {seed}"))?;
        let g = c.lock().await;
        converged(&g, &coll, &acked, &attempted)
            .await
            .with_context(|| format!("seed {seed}"))?;
        // Documents are all-or-nothing: a multi-document batch either landed whole or not.
        eprintln!(
            "seed {seed}: {} of {} writes acknowledged; linearizable: {} keys, {} operations \
             ({} of unknown outcome); {} EVENTUAL reads, {} went back in their session",
            acked.len(),
            attempted.len(),
            lin.keys,
            lin.ops,
            lin.unknown,
            lin.eventual_reads,
            lin.eventual_regressions
        );
    }
    Ok(())
}

/// Membership end to end, as an operator moves a replica: a fourth node joins as a learner and
/// catches up by snapshot (the log was compacted), is promoted, takes over leadership, and an
/// old replica is removed and dropped; the new member holds every acknowledged write. A
/// removal that would leave fewer reachable voters than a quorum is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn membership_add_promote_transfer_remove() -> Result<()> {
    let config = SHARD_CONFIG.replace("raft_log_gc_threshold = 200", "raft_log_gc_threshold = 20");
    let mut c = Cluster::start_with(4, Some(&config))?;
    let mut cc = c.client().await?;
    create(&mut cc, "mem").await?;
    let placed = cc
        .describe_collection(DescribeCollectionRequest { name: "mem".into() })
        .await?
        .into_inner()
        .collection
        .context("collection")?
        .shards[0]
        .nodes
        .clone();
    let newcomer = c
        .shards
        .iter()
        .position(|p| !placed.contains(&p.grpc))
        .context("a node without the shard")?;
    let mut ids = Vec::new();
    for p in &c.shards {
        ids.push(
            shard_client(&p.grpc)
                .await?
                .node_info(NodeInfoRequest {})
                .await?
                .into_inner()
                .node_id,
        );
    }
    let mut acked = BTreeSet::new();
    for i in 0..60 {
        ensure!(write(&mut cc, "mem", &[i]).await, "write {i}");
        acked.insert(i);
    }
    let l = leader(&c, "mem", Duration::from_secs(5)).await?;
    let mut lc = shard_client(&c.shards[l].grpc).await?;
    let mut nc = shard_client(&c.shards[newcomer].grpc).await?;
    let addrs: Vec<String> = c.shards.iter().map(|p| p.grpc.clone()).collect();
    let peer = |n: usize| {
        Some(Peer {
            node_id: ids[n],
            address: addrs[n].clone(),
        })
    };
    let change = |kind: ReplicaChange, n: usize| ChangeReplicasRequest {
        shard: sref("mem"),
        change: kind as i32,
        peer: peer(n),
    };

    // Promotion before the node is a caught-up learner is refused.
    let e = lc
        .change_replicas(change(ReplicaChange::Promote, newcomer))
        .await
        .unwrap_err();
    ensure!(
        e.code() == tonic::Code::FailedPrecondition,
        "early promote: {e}"
    );

    // 1. Join as a learner: an empty replica, then the leader adds it and sends a snapshot.
    let members: Vec<Peer> = (0..c.shards.len())
        .filter(|i| placed.contains(&addrs[*i]))
        .filter_map(peer)
        .collect();
    nc.open_shard(OpenShardRequest {
        shard: sref("mem"),
        dimension: DIM as u32,
        hnsw: Some(HnswParams {
            m: 16,
            ef_construction: 200,
            ef_search: 64,
        }),
        peers: members,
        join: true,
    })
    .await?;
    let t = Instant::now();
    let r = lc
        .change_replicas(change(ReplicaChange::AddLearner, newcomer))
        .await?
        .into_inner();
    ensure!(r.learners.contains(&ids[newcomer]), "learner not in {r:?}");
    let until = Instant::now() + Duration::from_secs(30);
    loop {
        let st = statuses(&c, "mem").await;
        let commit = st[l].as_ref().map_or(0, |s| s.commit_index);
        if let Some(s) = &st[newcomer]
            && s.role() == RaftRole::Learner
            && s.applied_index >= commit
            && commit > 0
        {
            break;
        }
        ensure!(
            Instant::now() < until,
            "learner did not catch up: {st:?}\nleader log:\n{}\nlearner log:\n{}",
            c.shards[l].log_tail(),
            c.shards[newcomer].log_tail()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    eprintln!("learner caught up in {} ms", t.elapsed().as_millis());
    let m = http_get(&c.shards[newcomer].metrics).await?;
    ensure!(
        metric_sum(&m, "raft_snapshots_received_total") >= 1.0,
        "the learner did not get a snapshot"
    );
    // A learner serves no reads, even caught up: the coordinator reads from a voter.
    read_refused(&mut nc, "mem", "not a voter").await?;

    // 2. Promote, 3. move leadership to it.
    let r = lc
        .change_replicas(change(ReplicaChange::Promote, newcomer))
        .await?
        .into_inner();
    ensure!(
        r.voters.len() == 4 && r.voters.contains(&ids[newcomer]),
        "after promote: {r:?}"
    );
    lc.transfer_leader(TransferLeaderRequest {
        shard: sref("mem"),
        to_node_id: ids[newcomer],
    })
    .await?;
    let nl = leader(&c, "mem", Duration::from_secs(10)).await?;
    let until = Instant::now() + Duration::from_secs(10);
    let mut nl = nl;
    while nl != newcomer {
        ensure!(
            Instant::now() < until,
            "leadership did not move to the newcomer"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
        nl = leader(&c, "mem", Duration::from_secs(10)).await?;
    }

    // 4. Remove an old replica (the leader cannot remove itself: it is the newcomer now).
    let gone = (0..c.shards.len())
        .find(|i| *i != newcomer && placed.contains(&c.shards[*i].grpc))
        .unwrap();
    let e = nc
        .change_replicas(change(ReplicaChange::Remove, newcomer))
        .await
        .unwrap_err();
    ensure!(
        e.code() == tonic::Code::FailedPrecondition,
        "leader removing itself: {e}"
    );
    let r = nc
        .change_replicas(change(ReplicaChange::Remove, gone))
        .await?
        .into_inner();
    ensure!(
        r.voters.len() == 3 && !r.voters.contains(&ids[gone]),
        "after remove: {r:?}"
    );
    // The removed replica drops its data once it applied its removal; one that missed it is
    // dropped by the operator (ragctl does this after a move).
    let until = Instant::now() + Duration::from_secs(5);
    let mut gc = shard_client(&c.shards[gone].grpc).await?;
    let reaped = loop {
        match gc.shard_info(ShardInfoRequest { shard: sref("mem") }).await {
            Err(s) if s.code() == tonic::Code::NotFound => break true,
            _ if Instant::now() > until => break false,
            _ => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    };
    if !reaped {
        gc.drop_shard(DropShardRequest { shard: sref("mem") })
            .await?;
    }
    eprintln!(
        "removed replica dropped {}",
        if reaped { "by itself" } else { "by DropShard" }
    );

    // The new member holds every acknowledged write, in RocksDB, tantivy and HNSW alike.
    for i in 60..80 {
        ensure!(
            write_direct(&mut nc, i).await?,
            "write {i} through the new leader"
        );
        acked.insert(i);
    }
    let members: Vec<usize> = (0..c.shards.len()).filter(|i| *i != gone).collect();
    let until = Instant::now() + Duration::from_secs(20);
    loop {
        let st = statuses(&c, "mem").await;
        let applied: Vec<u64> = members
            .iter()
            .map(|m| st[*m].as_ref().map_or(0, |s| s.applied_index))
            .collect();
        let commit = st[newcomer].as_ref().map_or(0, |s| s.commit_index);
        if applied.iter().all(|a| *a == commit) {
            break;
        }
        ensure!(Instant::now() < until, "members did not converge: {st:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Published Raft figures may trail by one ready cycle: also wait until every member's
    // store (read under its write lock) holds every acknowledged chunk.
    let until = Instant::now() + Duration::from_secs(20);
    for &m in &members {
        let mut sc = shard_client(&c.shards[m].grpc).await?;
        loop {
            let info = sc
                .shard_info(ShardInfoRequest { shard: sref("mem") })
                .await?
                .into_inner();
            if info.chunks >= acked.len() as u64 {
                break;
            }
            ensure!(
                Instant::now() < until,
                "{} holds {} of {} chunks",
                c.shards[m].name,
                info.chunks,
                acked.len()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    let mut first: Option<BTreeSet<String>> = None;
    for &m in &members {
        let (ids_m, _) = contents(&c.shards[m].grpc, "mem").await?;
        for a in &acked {
            ensure!(
                ids_m.contains(&format!("d{a}#0")),
                "{}: d{a} missing",
                c.shards[m].name
            );
        }
        match &first {
            None => first = Some(ids_m),
            Some(f) => ensure!(*f == ids_m, "{} differs", c.shards[m].name),
        }
    }

    // 5. Below quorum: with one voter down, removing another live voter would leave one of
    //    two reachable. Refused.
    let (down, other) = {
        let olds: Vec<usize> = members.iter().copied().filter(|i| *i != newcomer).collect();
        (olds[0], olds[1])
    };
    c.shards[down].kill9();
    tokio::time::sleep(ELECTION_TIMEOUT * 3).await;
    let e = nc
        .change_replicas(change(ReplicaChange::Remove, other))
        .await
        .unwrap_err();
    ensure!(
        e.code() == tonic::Code::FailedPrecondition,
        "remove below quorum: {e}"
    );
    Ok(())
}

/// One document written straight to a shard leader (no coordinator): Ok(true) = acknowledged.
async fn write_direct(sc: &mut ShardClient<Channel>, id: u64) -> Result<bool> {
    let d = doc(id);
    let mut req = tonic::Request::new(WriteBatchRequest {
        shard: sref("mem"),
        writes: vec![DocumentWrite {
            doc_id: d.id.clone(),
            chunks: vec![Chunk {
                chunk_id: format!("{}#0", d.id),
                doc_id: d.id,
                text: d.text,
                embedding: d.embedding,
                ..Default::default()
            }],
            delete: false,
        }],
        request_id: format!("direct-{id}"),
        ..Default::default()
    });
    req.set_timeout(Duration::from_secs(10));
    Ok(sc.write_batch(req).await.is_ok())
}
