//! Wall-clock jumps on one shard node (issue 67). Each shard node runs under libfaketime
//! (`LD_PRELOAD`, the Debian `faketime` package) with the monotonic clock left alone, so a
//! rewrite of the node's timestamp file steps only what `CLOCK_REALTIME` says in that process,
//! as `date -s` or an NTP step would, without touching the test or the other nodes. The
//! leader's clock, then a follower's, jumps +2 h, -2 h, +1 d and -1 d, each held 3 s, while
//! one client writes a document at a time and three more record per-document histories.
//! Leases, election and heartbeat timeouts, deadlines and retries all run on monotonic
//! clocks, so nothing may change: every write acknowledged (none refused or timed out), the
//! leader kept, every replica identical, every history linearizable. `date` run under the
//! node's library and file shows the jump took effect.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use ragcluster_common::skip::{SkipReason, skipped};
use ragcluster_tests::Cluster;
use ragcluster_tests::cluster::replicas::*;
use ragcluster_tests::linearizability::recorder::Recorder;
use tokio::sync::Mutex;

/// libfaketime's multi-threaded build, where Debian's `faketime` package puts it.
fn libfaketime() -> Option<std::path::PathBuf> {
    ["x86_64-linux-gnu", "aarch64-linux-gnu"]
        .iter()
        .map(|a| std::path::PathBuf::from(format!("/usr/lib/{a}/faketime/libfaketimeMT.so.1")))
        .find(|p| p.exists())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn wall_clock_jumps_on_one_node_change_nothing() -> Result<()> {
    let Some(lib) = libfaketime() else {
        skipped(
            SkipReason::NotSetUp,
            "wall_clock_jumps_on_one_node_change_nothing",
            "no libfaketime (scripts/setup.sh installs the faketime package)",
        );
        return Ok(());
    };
    let mut c = Cluster::start_with(3, Some(SHARD_CONFIG))?;
    // Every shard node restarted under libfaketime, its clock file at +0.
    let mut clocks = Vec::new();
    for p in c.shards.iter_mut() {
        let file = p.data_dir().with_file_name("faketime");
        std::fs::write(&file, "+0\n")?;
        p.env = vec![
            ("LD_PRELOAD".into(), lib.display().to_string()),
            ("FAKETIME_TIMESTAMP_FILE".into(), file.display().to_string()),
            ("FAKETIME_DONT_FAKE_MONOTONIC".into(), "1".into()),
            ("FAKETIME_CACHE_DURATION".into(), "0".into()),
        ];
        p.restart(Duration::from_secs(60))?;
        let maps = std::fs::read_to_string(format!("/proc/{}/maps", p.pid().context("pid")?))?;
        ensure!(
            maps.contains("libfaketime"),
            "{} runs without libfaketime",
            p.name
        );
        clocks.push(file);
    }
    let mut cc = c.client().await?;
    create(&mut cc, "clock").await?;
    create(&mut cc, "clocklin").await?;
    let w = Arc::new(Mutex::new(Writes::default()));
    for batch in (0..100u64).collect::<Vec<_>>().chunks(20) {
        ensure!(write(&mut cc, "clock", batch).await, "write {batch:?}");
        let mut g = w.lock().await;
        g.acked.extend(batch.iter().copied());
        g.attempted.extend(batch.iter().copied());
    }
    let recorder = Recorder::start(&cc, "clocklin", 3, 3, 68);
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let task = tokio::spawn(writer(cc.clone(), "clock", w.clone(), stop.clone()));
    let tomorrow = date_in(86_400)?;
    let mut saw_tomorrow = false;
    for role in ["leader", "follower"] {
        for jump in ["+2h", "-2h", "+1d", "-1d"] {
            let l = leader(&c, "clock", Duration::from_secs(20)).await?;
            let n = if role == "leader" { l } else { (l + 1) % 3 };
            let start = Instant::now();
            std::fs::write(&clocks[n], format!("{jump}\n"))?;
            if jump == "+1d" {
                // What a process under the same library and file reads as the date.
                let out = std::process::Command::new("date")
                    .args(["-u", "+%Y-%m-%d"])
                    .envs(c.shards[n].env.iter().map(|(k, v)| (k, v)))
                    .output()?;
                saw_tomorrow |= String::from_utf8_lossy(&out.stdout).trim() == tomorrow;
            }
            tokio::time::sleep(Duration::from_secs(3)).await;
            std::fs::write(&clocks[n], "+0\n")?;
            let back = Instant::now();
            tokio::time::sleep(Duration::from_secs(1)).await;
            let ok_at = w.lock().await.ok_at.clone();
            let gap = window(&ok_at, start, back);
            let writes = ok_at.iter().filter(|t| **t > start && **t < back).count();
            let after = leader(&c, "clock", Duration::from_secs(20)).await?;
            eprintln!(
                "{role:8} {} clock {jump:>3}: longest without a write {:4} ms, {writes} writes \
                 in 3 s, leader after: {}",
                c.shards[n].name,
                gap.as_millis(),
                c.shards[after].name
            );
            ensure!(
                after == l,
                "the leader changed after a clock jump on {}",
                c.shards[n].name
            );
        }
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    task.await?;
    ensure!(
        saw_tomorrow,
        "libfaketime did not move the clock to {tomorrow}"
    );
    let lin = recorder.finish().await.context("linearizability")?;
    let g = w.lock().await;
    ensure!(
        g.acked == g.attempted,
        "{} of {} writes failed during clock jumps",
        g.attempted.len() - g.acked.len(),
        g.attempted.len()
    );
    settled(&c, "clock", &g, &lin).await?;
    Ok(())
}

/// `YYYY-MM-DD` of now + `secs` (UTC).
fn date_in(secs: u64) -> Result<String> {
    let out = std::process::Command::new("date")
        .args(["-u", "-d", &format!("@{}", unix_now()? + secs), "+%Y-%m-%d"])
        .output()?;
    Ok(String::from_utf8(out.stdout)?.trim().to_owned())
}

fn unix_now() -> Result<u64> {
    Ok(std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_secs())
}
