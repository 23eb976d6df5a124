//! A full disk under real shard node processes (issue 67). Each node's data directory is a
//! size-limited tmpfs the test mounts (CI runs as root); a node's disk is filled by writing a
//! file into it until the kernel answers ENOSPC, and emptied by removing that file.
//!
//! - The shard leader's disk fills: it refuses writes (RESOURCE_EXHAUSTED) and hands its
//!   leadership to a replica with room, so writes go on after a short pause; it keeps
//!   serving reads; `ragctl status` and `disk_full` show it.
//! - A second node's disk fills: two of three voters cannot write, and the leader refuses
//!   writes with RESOURCE_EXHAUSTED naming the full nodes and the cause, proposing nothing.
//! - Both disks are emptied: writes are taken again within seconds, without a restart, and
//!   every replica ends with every acknowledged document.
//!
//! No process restarts or panics on the way, and nothing acknowledged is lost.

use std::collections::BTreeSet;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use ragcluster_common::skip::{SkipReason, skipped};
use ragcluster_proto::v1::*;
use ragcluster_tests::cluster::replicas::*;
use ragcluster_tests::{Cluster, Options, http_get, metric_sum, ragctl_at, shard_client};

/// Size of each node's tmpfs, and what the nodes keep free and in reserve there.
const TMPFS_MB: u64 = 160;
const CONFIG_DISK: &str = r#"
disk_min_free_bytes = 8388608
disk_reserve_bytes = 8388608
disk_check_interval = "100ms"
"#;

/// tmpfs mounts made by the test, unmounted (lazily: processes may still hold files) on drop.
struct Mounts(Vec<PathBuf>);

impl Drop for Mounts {
    fn drop(&mut self) {
        for p in &self.0 {
            let _ = std::process::Command::new("umount")
                .arg("-l")
                .arg(p)
                .status();
        }
    }
}

/// Moves `dir` (a stopped node's data directory) onto a fresh tmpfs of `TMPFS_MB`.
fn onto_tmpfs(dir: &Path, mounts: &mut Mounts) -> Result<bool> {
    let aside = dir.with_extension("aside");
    std::fs::rename(dir, &aside)?;
    std::fs::create_dir_all(dir)?;
    let ok = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", &format!("size={TMPFS_MB}m"), "tmpfs"])
        .arg(dir)
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        std::fs::remove_dir(dir)?;
        std::fs::rename(&aside, dir)?;
        return Ok(false);
    }
    mounts.0.push(dir.to_owned());
    let copied = std::process::Command::new("cp")
        .arg("-a")
        .arg(format!("{}/.", aside.display()))
        .arg(dir)
        .status()?;
    ensure!(
        copied.success(),
        "copying {} onto the tmpfs",
        aside.display()
    );
    std::fs::remove_dir_all(&aside)?;
    Ok(true)
}

/// Writes `dir/filler` until the file system is full; returns the bytes written.
fn fill(dir: &Path) -> Result<u64> {
    let mut f = std::fs::File::create(dir.join("filler"))?;
    let block = vec![0x5au8; 1 << 20];
    let mut n = 0u64;
    loop {
        match f.write(&block) {
            Ok(0) => break,
            Ok(k) => n += k as u64,
            Err(e) if e.raw_os_error() == Some(28) => break,
            Err(e) => return Err(e.into()),
        }
    }
    // Whatever fits in the last partial block, too.
    let _ = f.flush();
    Ok(n)
}

/// One write of `ids`: Ok, or the status it was refused with.
async fn try_write(
    cc: &mut ragcluster_proto::v1::coordinator_client::CoordinatorClient<tonic::transport::Channel>,
    coll: &str,
    ids: &[u64],
) -> std::result::Result<(), tonic::Status> {
    let mut req = tonic::Request::new(UpsertDocumentsRequest {
        collection: coll.into(),
        documents: ids.iter().map(|i| doc(*i)).collect(),
        ..Default::default()
    });
    req.set_timeout(Duration::from_secs(15));
    cc.upsert_documents(req).await.map(|_| ())
}

fn pids(c: &Cluster) -> Vec<Option<u32>> {
    c.shards.iter().map(|p| p.pid()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_full_disk_refuses_writes_keeps_reads_and_recovers_by_itself() -> Result<()> {
    let config = format!("{SHARD_CONFIG}{CONFIG_DISK}");
    let mut c = Cluster::start_opts(Options {
        shard_nodes: 3,
        shard_config: Some(&config),
        shard_heartbeats: true,
        ..Default::default()
    })?;
    let mut mounts = Mounts(Vec::new());
    for i in 0..3 {
        c.shards[i].terminate()?;
        if !onto_tmpfs(&c.shards[i].data_dir(), &mut mounts)? {
            skipped(
                SkipReason::NotSetUp,
                "a_full_disk_refuses_writes_keeps_reads_and_recovers_by_itself",
                "cannot mount a tmpfs (the test needs root, as on CI)",
            );
            return Ok(());
        }
        c.shards[i].restart(Duration::from_secs(60))?;
    }
    let mut cc = c.client().await?;
    create(&mut cc, "full").await?;
    let mut acked = BTreeSet::new();
    let mut attempted = BTreeSet::new();
    for batch in (0..100u64).collect::<Vec<_>>().chunks(20) {
        attempted.extend(batch.iter().copied());
        ensure!(write(&mut cc, "full", batch).await, "write {batch:?}");
        acked.extend(batch.iter().copied());
    }
    let started = pids(&c);

    // 1. The leader's disk fills: leadership moves to a replica with room.
    let l = leader(&c, "full", Duration::from_secs(10)).await?;
    let t0 = Instant::now();
    let filled = fill(&c.shards[l].data_dir())?;
    eprintln!(
        "{}: leader's disk filled ({filled} bytes)",
        c.shards[l].name
    );
    let mut next = 100u64;
    let mut first_ok = None;
    let mut refused = 0;
    while first_ok.is_none() {
        ensure!(
            t0.elapsed() < Duration::from_secs(30),
            "no write went through after the leader's disk filled"
        );
        let ids: Vec<u64> = (next..next + 5).collect();
        next += 5;
        attempted.extend(ids.iter().copied());
        match try_write(&mut cc, "full", &ids).await {
            Ok(()) => {
                acked.extend(ids);
                first_ok = Some(t0.elapsed());
            }
            Err(s) => {
                refused += 1;
                eprintln!("  write refused: {:?} {}", s.code(), s.message());
            }
        }
    }
    let l2 = leader(&c, "full", Duration::from_secs(10)).await?;
    ensure!(l2 != l, "the full node still leads");
    eprintln!(
        "leadership moved from {} to {}: writes again {} ms after the disk filled ({refused} \
         refused meanwhile)",
        c.shards[l].name,
        c.shards[l2].name,
        first_ok.unwrap_or_default().as_millis()
    );
    for batch in (next..next + 40).collect::<Vec<_>>().chunks(10) {
        attempted.extend(batch.iter().copied());
        ensure!(
            write(&mut cc, "full", batch).await,
            "write {batch:?} with one disk full"
        );
        acked.extend(batch.iter().copied());
    }
    next += 40;
    // The full node still answers reads from what it holds.
    let mut sc = shard_client(&c.shards[l].grpc).await?;
    let held = bm25_ids(&mut sc, "full", "raftdoc", 10_000).await?;
    ensure!(
        held.len() >= 100,
        "the full node serves {} chunks",
        held.len()
    );
    let page = http_get(&c.shards[l].metrics).await?;
    ensure!(
        metric_sum(&page, "disk_full") == 1.0,
        "disk_full is not 1 on the full node"
    );
    let until = Instant::now() + Duration::from_secs(10);
    loop {
        let status = ragctl_at(&c.coordinator.grpc, &["status"])?;
        if status.contains("FULL:") {
            break;
        }
        ensure!(
            Instant::now() < until,
            "ragctl status does not show the full disk:\n{status}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // 2. A second node fills: too few voters can write, and the leader says so.
    let f = (0..3)
        .find(|i| *i != l && *i != l2)
        .context("a third node")?;
    fill(&c.shards[f].data_dir())?;
    let t1 = Instant::now();
    let refusal = loop {
        ensure!(
            t1.elapsed() < Duration::from_secs(30),
            "writes were not refused for full disks"
        );
        let ids: Vec<u64> = (next..next + 5).collect();
        next += 5;
        attempted.extend(ids.iter().copied());
        match try_write(&mut cc, "full", &ids).await {
            Ok(()) => acked.extend(ids),
            Err(s) if s.code() == tonic::Code::ResourceExhausted => break s,
            Err(s) => eprintln!("  write failed: {:?} {}", s.code(), s.message()),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    eprintln!(
        "with two disks full: {:?} {} (after {} ms)",
        refusal.code(),
        refusal.message(),
        t1.elapsed().as_millis()
    );
    ensure!(
        refusal.message().contains("disk") && refusal.message().contains("node"),
        "the refusal does not name the node and the cause: {}",
        refusal.message()
    );
    ensure!(
        refusal.metadata().get("retry-after-ms").is_some(),
        "no retry hint"
    );

    // 3. Space comes back: writes resume by themselves.
    for n in [l, f] {
        std::fs::remove_file(c.shards[n].data_dir().join("filler"))?;
    }
    let t2 = Instant::now();
    loop {
        ensure!(
            t2.elapsed() < Duration::from_secs(30),
            "writes did not resume within 30 s of the space coming back"
        );
        let ids: Vec<u64> = (next..next + 5).collect();
        next += 5;
        attempted.extend(ids.iter().copied());
        if try_write(&mut cc, "full", &ids).await.is_ok() {
            acked.extend(ids);
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    eprintln!(
        "writes taken again {} ms after the space came back",
        t2.elapsed().as_millis()
    );
    for batch in (next..next + 40).collect::<Vec<_>>().chunks(10) {
        attempted.extend(batch.iter().copied());
        ensure!(
            write(&mut cc, "full", batch).await,
            "write {batch:?} after recovery"
        );
        acked.extend(batch.iter().copied());
    }
    converged(&c, "full", &acked, &attempted).await?;
    ensure!(pids(&c) == started, "a shard node restarted");
    for p in &c.shards {
        let log = std::fs::read_to_string(p.log())?;
        ensure!(!log.contains("panicked at"), "{} panicked", p.name);
        ensure!(
            !log.contains("raft member failed"),
            "{}: a raft member failed:\n{}",
            p.name,
            p.log_tail()
        );
    }
    let page = http_get(&c.shards[l].metrics).await?;
    ensure!(metric_sum(&page, "disk_full") == 0.0);
    ensure!(metric_sum(&page, "disk_full_events_total") >= 1.0);
    eprintln!(
        "{} documents acknowledged, every replica holds each of them",
        acked.len()
    );
    // `mounts` goes before `c` (declared after it): unmounted lazily, then the processes are
    // killed and the (now plain) directories removed.
    Ok(())
}

/// The last line of defence, when a write meets ENOSPC before the free-space guard saw it
/// coming: a follower's tantivy commits fail as on a full disk (failpoint
/// `bm25_commit_enospc`, three times). Its index worker does not die: the writer is restarted
/// from its last commit with the op log replayed, the writes meanwhile stay durable, and the
/// replica ends identical to its peers without a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_bm25_commit_failing_for_want_of_space_restarts_the_writer() -> Result<()> {
    let c = Cluster::start_with(3, Some(SHARD_CONFIG))?;
    let mut cc = c.client().await?;
    create(&mut cc, "commit").await?;
    let mut acked = BTreeSet::new();
    for batch in (0..50u64).collect::<Vec<_>>().chunks(10) {
        ensure!(write(&mut cc, "commit", batch).await, "write {batch:?}");
        acked.extend(batch.iter().copied());
    }
    let l = leader(&c, "commit", Duration::from_secs(10)).await?;
    let f = (l + 1) % 3;
    let started = pids(&c);
    ragcluster_tests::set_failpoint(&c.shards[f].grpc, "bm25_commit_enospc", "3*return").await?;
    for batch in (50..150u64).collect::<Vec<_>>().chunks(10) {
        ensure!(write(&mut cc, "commit", batch).await, "write {batch:?}");
        acked.extend(batch.iter().copied());
    }
    converged(&c, "commit", &acked, &acked).await?;
    ensure!(pids(&c) == started, "a shard node restarted");
    let page = http_get(&c.shards[f].metrics).await?;
    let restarts = metric_sum(&page, "shard_bm25_writer_restarts_total");
    ensure!(
        restarts >= 1.0,
        "no bm25 writer restart on {}",
        c.shards[f].name
    );
    let log = std::fs::read_to_string(c.shards[f].log())?;
    ensure!(
        log.contains("bm25 writer restarted"),
        "{}",
        c.shards[f].log_tail()
    );
    ensure!(!log.contains("panicked at"));
    eprintln!(
        "{}: {restarts} bm25 writer restart(s); every replica holds the {} documents",
        c.shards[f].name,
        acked.len()
    );
    Ok(())
}
