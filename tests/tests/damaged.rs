//! Damaged storage on a shard replica, with real processes on loopback (issue 67). A follower
//! is SIGKILLed and the newest RocksDB write-ahead log in its data directory is cut to half
//! its length, as a torn or damaged file leaves it: RocksDB's point-in-time recovery opens the
//! database at an earlier point, so the replica's Raft log (and state) ends before entries it
//! had acknowledged. Restarted, the replica must not go on serving that state: either the
//! leader's first heartbeat shows the loss (it commits past the end of the replica's log) and
//! the replica goes out of service (reads and writes refused with UNAVAILABLE,
//! `raft_member_failed` 1, its status naming the cause) until the catalog leader rebuilds it
//! from its peers, or a snapshot from the leader replaces the state first. Either way no
//! thread panics, the other two replicas keep taking writes, every acknowledged document is
//! found through the coordinator, and the replica ends identical to its peers.
//!
//! A damaged BM25 index (a flipped byte in a tantivy segment file of a stopped node) is found
//! by its checksums at open and rebuilt from RocksDB; a damaged HNSW dump fails its checksum
//! at load and the graph is rebuilt: either way the replica ends identical to its peers.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use ragcluster_proto::v1::*;
use ragcluster_tests::cluster::replicas::*;
use ragcluster_tests::{Cluster, http_get, metric_sum, shard_client};

/// The newest `*.log` (RocksDB write-ahead log) under `dir`.
fn newest_wal(dir: &std::path::Path) -> Result<std::path::PathBuf> {
    let mut logs: Vec<(std::time::SystemTime, std::path::PathBuf)> = std::fs::read_dir(dir)?
        .flatten()
        .filter(|e| e.path().extension().is_some_and(|x| x == "log"))
        .filter_map(|e| Some((e.metadata().ok()?.modified().ok()?, e.path())))
        .collect();
    logs.sort();
    logs.pop()
        .map(|(_, p)| p)
        .with_context(|| format!("no write-ahead log in {}", dir.display()))
}

/// Flips a byte in the middle of `file`, or cuts it to half its length.
fn damage(file: &std::path::Path, cut: bool) -> Result<()> {
    let mut bytes = std::fs::read(file)?;
    let mid = bytes.len() / 2;
    if cut {
        bytes.truncate(mid);
    } else {
        bytes[mid] ^= 0x5a;
    }
    std::fs::write(file, bytes)?;
    Ok(())
}

/// The largest SST file of a stopped node's RocksDB (a graceful stop flushes the memtables).
fn largest_sst(dir: &std::path::Path) -> Result<std::path::PathBuf> {
    std::fs::read_dir(dir)?
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "sst"))
        .max_by_key(|p| std::fs::metadata(p).map_or(0, |m| m.len()))
        .with_context(|| format!("no SST file in {}", dir.display()))
}

/// No process of the cluster logged a panic (Rust's "thread 'x' panicked at file:line"; a
/// tantivy error quoting "...or panicked." is not one).
fn no_panic(c: &Cluster) -> Result<()> {
    for p in &c.shards {
        let log = std::fs::read_to_string(p.log())?;
        ensure!(
            !log.contains("panicked at"),
            "{} panicked:\n{}",
            p.name,
            p.log_tail()
        );
    }
    Ok(())
}

/// Flips a byte in the middle of `victim` (a file of stopped node `f`), or with `cut` cuts the
/// file to half its length; restarts the node, writes documents 200..240 while it catches up,
/// and checks every replica ends with the same chunks, the damaged one included, and that its
/// log names the repair (`reported`).
async fn flip_restart_converge(
    c: &mut Cluster,
    f: usize,
    (victim, cut): (&std::path::Path, bool),
    coll: &str,
    acked: &mut std::collections::BTreeSet<u64>,
    reported: &str,
) -> Result<()> {
    damage(victim, cut)?;
    eprintln!(
        "{}: {} {}",
        c.shards[f].name,
        if cut {
            "cut to half"
        } else {
            "flipped a byte of"
        },
        victim.display()
    );
    c.shards[f].restart(Duration::from_secs(60))?;
    let mut cc = c.client().await?;
    for batch in (200..240u64).collect::<Vec<_>>().chunks(20) {
        ensure!(write(&mut cc, coll, batch).await, "write {batch:?}");
        acked.extend(batch.iter().copied());
    }
    // Compared through each replica's own BM25 index; its graph must hold every chunk.
    converged(c, coll, acked, acked).await?;
    let log = std::fs::read_to_string(c.shards[f].log())?;
    ensure!(
        log.contains(reported),
        "the damage was not reported:\n{}",
        c.shards[f].log_tail()
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_replica_whose_wal_lost_acknowledged_entries_never_serves_them() -> Result<()> {
    let mut c = Cluster::start_with(3, Some(SHARD_CONFIG))?;
    let mut cc = c.client().await?;
    create(&mut cc, "wal").await?;
    let mut acked = Vec::new();
    for batch in (0..300u64).collect::<Vec<_>>().chunks(10) {
        ensure!(write(&mut cc, "wal", batch).await, "write {batch:?}");
        acked.extend_from_slice(batch);
    }
    let l = leader(&c, "wal", Duration::from_secs(10)).await?;
    let f = (l + 1) % 3;
    let before = statuses(&c, "wal").await[f]
        .clone()
        .context("follower status")?;
    c.shards[f].kill9();
    let wal = newest_wal(&c.shards[f].data_dir().join("rocksdb"))?;
    let len = std::fs::metadata(&wal)?.len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&wal)?
        .set_len(len / 2)?;
    eprintln!(
        "{}: {} cut from {len} to {} bytes (applied index {} before the kill)",
        c.shards[f].name,
        wal.display(),
        len / 2,
        before.applied_index
    );
    c.shards[f].restart(Duration::from_secs(60))?;
    let restarted = Instant::now();

    // Out of service, or replaced by a snapshot: never serving the cut state for long.
    let mut sc = shard_client(&c.shards[f].grpc).await?;
    let outcome = loop {
        let info = sc
            .shard_info(ShardInfoRequest { shard: sref("wal") })
            .await?
            .into_inner();
        let raft = info.raft.clone().unwrap_or_default();
        if !raft.failed.is_empty() {
            break format!("out of service: {}", raft.failed);
        }
        if raft.applied_index >= before.applied_index && info.chunks as usize == acked.len() {
            break format!("restored by the leader (applied {})", raft.applied_index);
        }
        if restarted.elapsed() > Duration::from_secs(30) {
            bail!("the damaged replica neither failed nor caught up: {info:?}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    eprintln!(
        "{}: {outcome} after {} ms",
        c.shards[f].name,
        restarted.elapsed().as_millis()
    );
    if outcome.starts_with("out of service") {
        ensure!(
            outcome.contains("lost acknowledged log entries"),
            "cause: {outcome}"
        );
        read_refused(&mut sc, "wal", "out of service").await?;
    }

    // The shard goes on: writes are acknowledged by the other two, and every acknowledged
    // document is found through the coordinator, again and again (reads avoid the damaged
    // replica, and the replica rebuilt in its place while it catches up). The reads carry the
    // last write's read token: an eventual read may otherwise miss the last writes on a
    // follower (the proto says so), such as the rebuilt replica just after its promotion.
    let mut token = String::new();
    for batch in (300..350u64).collect::<Vec<_>>().chunks(10) {
        token = write_pinned(&mut cc, "wal", batch, &token)
            .await
            .with_context(|| format!("write {batch:?}"))?;
        acked.extend_from_slice(batch);
    }
    for _ in 0..20 {
        let n = found_pinned(&mut cc, "wal", Consistency::Eventual, &token).await?;
        ensure!(
            n == acked.len(),
            "a search found {n} of {} acknowledged documents",
            acked.len()
        );
    }
    // The catalog leader rebuilds the replica in place from its peers (removed, dropped,
    // re-added as a learner that catches up by snapshot, promoted): it ends identical to them.
    if outcome.starts_with("out of service") {
        let until = Instant::now() + Duration::from_secs(60);
        while metric_sum(
            &http_get(&c.coordinator.metrics).await?,
            "coordinator_replica_repairs_total",
        ) < 1.0
        {
            ensure!(Instant::now() < until, "the failed replica was not rebuilt");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        eprintln!(
            "{}: rebuilt from its peers {} ms after its restart",
            c.shards[f].name,
            restarted.elapsed().as_millis()
        );
    }
    let acked: std::collections::BTreeSet<u64> = acked.into_iter().collect();
    converged(&c, "wal", &acked, &acked).await?;
    no_panic(&c)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_damaged_bm25_segment_is_rebuilt_from_rocksdb() -> Result<()> {
    let mut c = Cluster::start_with(3, Some(SHARD_CONFIG))?;
    let mut cc = c.client().await?;
    create(&mut cc, "seg").await?;
    let mut acked = std::collections::BTreeSet::new();
    for batch in (0..200u64).collect::<Vec<_>>().chunks(20) {
        ensure!(write(&mut cc, "seg", batch).await, "write {batch:?}");
        acked.extend(batch.iter().copied());
    }
    let l = leader(&c, "seg", Duration::from_secs(10)).await?;
    let f = (l + 1) % 3;
    c.shards[f].terminate()?;
    let dir = c.shards[f].data_dir().join("bm25").join("seg").join("0");
    // Only a segment the committed meta lists: a merged-away segment's files can stay on
    // disk until tantivy's next garbage collection, and damage there harms nothing.
    let meta: serde_json::Value = serde_json::from_slice(&std::fs::read(dir.join("meta.json"))?)?;
    let live: Vec<String> = meta["segments"]
        .as_array()
        .context("meta.json lists segments")?
        .iter()
        .filter_map(|s| s["segment_id"].as_str().map(|id| id.replace('-', "")))
        .collect();
    let victim = std::fs::read_dir(&dir)?
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.extension()
                .is_some_and(|x| x == "idx" || x == "term" || x == "store")
                && p.file_stem()
                    .and_then(|s| s.to_str())
                    .is_some_and(|s| live.iter().any(|id| id == s))
        })
        .max_by_key(|p| std::fs::metadata(p).map_or(0, |m| m.len()))
        .context("a tantivy segment file")?;
    let reported = "bm25 index damaged; rebuilding it from rocksdb";
    flip_restart_converge(&mut c, f, (&victim, false), "seg", &mut acked, reported).await?;
    let page = http_get(&c.shards[f].metrics).await?;
    ensure!(metric_sum(&page, "shard_bm25_rebuilds_total") >= 1.0);
    no_panic(&c)
}

/// A flipped byte in the newest HNSW dump of a stopped leader: the dump fails its checksum at
/// load, is never used, and the graph is rebuilt from RocksDB (or an older dump); the replica
/// ends identical to its peers, its graph holding every chunk.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_damaged_hnsw_dump_is_rejected_and_the_graph_rebuilt() -> Result<()> {
    let mut c = Cluster::start_with(3, Some(SHARD_CONFIG))?;
    let mut cc = c.client().await?;
    create(&mut cc, "dump").await?;
    let mut acked = std::collections::BTreeSet::new();
    for batch in (0..200u64).collect::<Vec<_>>().chunks(20) {
        ensure!(write(&mut cc, "dump", batch).await, "write {batch:?}");
        acked.extend(batch.iter().copied());
    }
    // The leader builds its graph itself (followers may hold theirs beside the leader's dumps),
    // inserts the written-behind points once writes pause, and dumps the graph when it stops.
    let f = leader(&c, "dump", Duration::from_secs(10)).await?;
    tokio::time::sleep(Duration::from_secs(1)).await;
    c.shards[f].terminate()?;
    let dir = c.shards[f].data_dir().join("hnsw").join("dump").join("0");
    let newest = std::fs::read_dir(&dir)?
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("dump-"))
        })
        .max()
        .context("an hnsw dump after a graceful stop")?;
    let victim = std::fs::read_dir(&newest)?
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.file_name().is_some_and(|n| n != "manifest.json"))
        .max_by_key(|p| std::fs::metadata(p).map_or(0, |m| m.len()))
        .context("a dump file")?;
    let reported = "hnsw dump unusable";
    flip_restart_converge(&mut c, f, (&victim, false), "dump", &mut acked, reported).await?;
    let page = http_get(&c.shards[f].metrics).await?;
    ensure!(metric_sum(&page, "shard_hnsw_dump_rejected_total") >= 1.0);
    no_panic(&c)
}

/// A damaged SST file of a stopped follower (a flipped byte RocksDB would not notice at open,
/// or a cut file that keeps RocksDB from opening at all): the node finds it at open, rebuilds
/// its RocksDB from what is whole, its replica of the shard goes out of service and is rebuilt
/// from its peers by the catalog leader, and it ends identical to them.
async fn damaged_sst(cut: bool) -> Result<()> {
    let coll = if cut { "cut" } else { "sst" };
    let mut c = Cluster::start_with(3, Some(SHARD_CONFIG))?;
    let mut cc = c.client().await?;
    create(&mut cc, coll).await?;
    let mut acked = std::collections::BTreeSet::new();
    for batch in (0..200u64).collect::<Vec<_>>().chunks(20) {
        ensure!(write(&mut cc, coll, batch).await, "write {batch:?}");
        acked.extend(batch.iter().copied());
    }
    let l = leader(&c, coll, Duration::from_secs(10)).await?;
    let f = (l + 1) % 3;
    c.shards[f].terminate()?;
    let victim = largest_sst(&c.shards[f].data_dir().join("rocksdb"))?;
    let started = Instant::now();
    let reported = "rocksdb damaged; salvaging";
    flip_restart_converge(&mut c, f, (&victim, cut), coll, &mut acked, reported).await?;
    eprintln!(
        "{}: damaged SST ({}) repaired, replicas identical, {} ms after the restart",
        c.shards[f].name,
        if cut { "cut" } else { "flipped byte" },
        started.elapsed().as_millis()
    );
    let page = http_get(&c.shards[f].metrics).await?;
    ensure!(metric_sum(&page, "shard_store_salvages_total") >= 1.0);
    // The counter moves once the rebuilt replica is promoted, which may come just after it
    // caught up.
    let until = Instant::now() + Duration::from_secs(30);
    while metric_sum(
        &http_get(&c.coordinator.metrics).await?,
        "coordinator_replica_repairs_total",
    ) < 1.0
    {
        ensure!(
            Instant::now() < until,
            "the damaged replica was not rebuilt"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    no_panic(&c)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_flipped_byte_in_an_sst_is_found_at_open_and_repaired_from_peers() -> Result<()> {
    damaged_sst(false).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_cut_sst_that_keeps_rocksdb_from_opening_is_repaired_from_peers() -> Result<()> {
    damaged_sst(true).await
}

/// A shard with one replica has no peer to be rebuilt from: its node refuses to start, naming
/// the damaged file, and leaves its data as it was.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lone_replica_with_a_damaged_sst_refuses_to_start_naming_the_file() -> Result<()> {
    let mut c = Cluster::start_with(1, Some(SHARD_CONFIG))?;
    let mut cc = c.client().await?;
    cc.create_collection(CreateCollectionRequest {
        name: "lone".into(),
        shard_count: 1,
        replication_factor: 1,
        ..Default::default()
    })
    .await?;
    for batch in (0..200u64).collect::<Vec<_>>().chunks(20) {
        ensure!(write(&mut cc, "lone", batch).await, "write {batch:?}");
    }
    c.shards[0].terminate()?;
    let dir = c.shards[0].data_dir().join("rocksdb");
    let victim = largest_sst(&dir)?;
    damage(&victim, false)?;
    let refused = c.shards[0].restart(Duration::from_secs(30));
    ensure!(
        refused.is_err(),
        "the node started over a damaged lone replica"
    );
    let log = std::fs::read_to_string(c.shards[0].log())?;
    let name = victim.file_name().context("file name")?.to_string_lossy();
    ensure!(
        log.contains(&*name) && log.contains("no other replica"),
        "the refusal does not name the file:\n{}",
        c.shards[0].log_tail()
    );
    ensure!(dir.exists() && !dir.with_extension("damaged").exists());
    ensure!(!log.contains("panicked at"), "{}", c.shards[0].log_tail());
    Ok(())
}
