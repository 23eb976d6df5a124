//! The Docker Compose cluster of `deploy/` as an operator runs it: images built FROM scratch by
//! `deploy/build-images.sh`, a coordinator, three shard nodes and a model worker on a private
//! network, every collection replicated three ways. While a client writes and searches
//! without pause, one shard-node container is cut off the network (`docker network
//! disconnect`), later reconnected, and another is killed (`docker kill`) and restarted.
//! Writes and searches must go on through both, every acknowledged document must be found
//! afterwards, and the replicas must converge. Skipped, with a message, where no Docker engine
//! or docker-compose is reachable.

use std::process::Command;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use ragcluster_proto::v1::admin_client::AdminClient;
use ragcluster_proto::v1::*;
use ragcluster_tests::load::{Load, converged};
use ragcluster_tests::{bin_dir, coordinator_client, free_port, workspace};
use tonic::transport::Channel;

fn docker_available() -> Option<String> {
    let ok = |cmd: &str, args: &[&str]| {
        Command::new(cmd)
            .args(args)
            .output()
            .is_ok_and(|o| o.status.success())
    };
    if !ok("docker", &["info"]) {
        return Some("no Docker engine (docker info failed)".into());
    }
    if !ok("docker-compose", &["version"]) {
        return Some("no docker-compose".into());
    }
    None
}

/// A compose project; `down -v` when dropped.
struct Compose {
    project: String,
    env: Vec<(String, String)>,
}

impl Compose {
    fn cmd(&self, args: &[&str]) -> Result<String> {
        let o = Command::new("docker-compose")
            .current_dir(workspace())
            .args(["-p", &self.project, "-f", "deploy/compose.yaml"])
            .args(args)
            .envs(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .output()?;
        ensure!(
            o.status.success(),
            "docker-compose {args:?}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        Ok(String::from_utf8_lossy(&o.stdout).into_owned())
    }

    fn container(&self, service: &str) -> String {
        format!("{}_{service}_1", self.project)
    }

    fn network(&self) -> String {
        format!("{}_ragnet", self.project)
    }
}

impl Drop for Compose {
    fn drop(&mut self) {
        let _ = self.cmd(&["down", "-v", "--remove-orphans", "-t", "5"]);
    }
}

fn docker(args: &[&str]) -> Result<()> {
    let o = Command::new("docker").args(args).output()?;
    ensure!(
        o.status.success(),
        "docker {args:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    Ok(())
}

/// Waits until `more` further writes and searches succeed (the cluster works in this state).
async fn progress(load: &Load, more: usize, what: &str) -> Result<()> {
    let (w0, s0) = (
        load.acked.lock().await.len(),
        load.searches.load(Ordering::Relaxed),
    );
    let t = Instant::now();
    loop {
        let (w, s) = (
            load.acked.lock().await.len(),
            load.searches.load(Ordering::Relaxed),
        );
        if w >= w0 + more && s >= s0 + more {
            eprintln!(
                "{what}: {} writes and {} searches in {:.1} s",
                w - w0,
                s - s0,
                t.elapsed().as_secs_f64()
            );
            return Ok(());
        }
        if t.elapsed() > Duration::from_secs(180) {
            bail!(
                "{what}: only {} writes and {} searches in 180 s",
                w - w0,
                s - s0
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compose_cluster_survives_partition_and_kill() -> Result<()> {
    if let Some(why) = docker_available() {
        ragcluster_common::skip::skipped(
            ragcluster_common::skip::SkipReason::NoDocker,
            "docker::compose_cluster_survives_partition_and_kill",
            &why,
        );
        return Ok(());
    }
    let target = bin_dir()
        .parent()
        .context("target dir")?
        .display()
        .to_string();
    let built = Command::new("bash")
        .current_dir(workspace())
        .args(["deploy/build-images.sh", "--no-build"])
        .env("CARGO_TARGET_DIR", &target)
        .env("TAG", "test")
        .output()?;
    ensure!(
        built.status.success(),
        "build-images: {}",
        String::from_utf8_lossy(&built.stderr)
    );
    println!("{}", String::from_utf8_lossy(&built.stdout));
    let port = free_port()?;
    let compose = Compose {
        project: format!("ragtest{}", std::process::id()),
        env: vec![
            ("TAG".into(), "test".into()),
            ("RAGCLUSTER_PORT".into(), port.to_string()),
            ("RAGCLUSTER_METRICS_PORT".into(), free_port()?.to_string()),
            (
                "RAGCLUSTER_MODELS".into(),
                ragcluster_tests::models_dir().display().to_string(),
            ),
        ],
    };
    compose.cmd(&["up", "-d"])?;
    let result = scenario(&compose, port).await;
    if result.is_err() {
        eprintln!(
            "{}",
            compose.cmd(&["logs", "--tail", "40"]).unwrap_or_default()
        );
    }
    result
}

async fn scenario(compose: &Compose, port: u16) -> Result<()> {
    let addr = format!("http://127.0.0.1:{port}");
    let t = Instant::now();
    let mut admin = loop {
        if let Ok(ch) = Channel::from_shared(addr.clone())?.connect().await {
            let mut a = AdminClient::new(ch);
            if let Ok(st) = a.cluster_status(ClusterStatusRequest {}).await
                && st.get_ref().nodes.iter().all(|n| n.health == "SERVING")
            {
                break a;
            }
        }
        ensure!(
            t.elapsed() < Duration::from_secs(120),
            "the compose cluster did not become healthy"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    eprintln!("cluster healthy after {:.1} s", t.elapsed().as_secs_f64());
    let mut c = coordinator_client(&addr).await?;
    c.create_collection(CreateCollectionRequest {
        name: "docker".into(),
        shard_count: 2,
        replication_factor: 3,
        ..Default::default()
    })
    .await?;

    let load = Load::start(c.clone(), "docker", "kx", SearchMode::Bm25);
    progress(&load, 20, "healthy").await?;

    // A partition: shard-2 loses the network while writes go on.
    let (net, shard2) = (compose.network(), compose.container("shard-2"));
    docker(&["network", "disconnect", &net, &shard2])?;
    progress(&load, 30, "shard-2 cut off").await?;
    docker(&["network", "connect", "--alias", "shard-2", &net, &shard2])?;
    progress(&load, 10, "shard-2 reconnected").await?;

    // A crash: shard-3's container is killed (SIGKILL), later started again on its volume.
    let shard3 = compose.container("shard-3");
    docker(&["kill", &shard3])?;
    progress(&load, 30, "shard-3 killed").await?;
    docker(&["start", &shard3])?;
    progress(&load, 10, "shard-3 restarted").await?;

    load.stop().await?;
    let took = converged(&mut admin, "docker", 3, Duration::from_secs(120)).await?;
    eprintln!(
        "replicas converged {:.1} s after the load stopped",
        took.as_secs_f64()
    );
    load.verify(c).await?;
    Ok(())
}
