//! `ragctl local up|down` (a whole cluster as local processes) and `ragctl health`.

use std::process::{Command, Stdio};

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use comfy_table::{Table, presets::UTF8_FULL_CONDENSED};
use ragcluster_proto::v1::admin_client::AdminClient;
use ragcluster_proto::v1::*;
use serde::{Deserialize, Serialize};

use crate::connect;
use ragcluster_common::names::node_kind_name;

/// What `local up` leaves behind for the other commands.
#[derive(Serialize, Deserialize)]
pub struct LocalCluster {
    pub coordinator: String,
    pub coordinator_metrics: String,
    pub model_worker: String,
    pub shard_nodes: Vec<String>,
    pub pids: Vec<u32>,
    /// Every process: its name, pid, gRPC and metrics addresses.
    #[serde(default)]
    pub processes: Vec<LocalProcess>,
}

#[derive(Serialize, Deserialize, Clone)]
pub struct LocalProcess {
    pub name: String,
    pub pid: u32,
    pub grpc: String,
    pub metrics: String,
}

/// How long `local down` waits for SIGTERM before SIGKILL (every process bounds its own
/// shutdown at `shutdown_timeout`, 10 s by default).
const DOWN_GRACE: Duration = Duration::from_secs(15);

#[derive(Deserialize)]
struct PortFile {
    grpc: String,
    metrics: String,
    pid: u32,
}

pub async fn health(addr: &str, service: &str, timeout: Duration) -> Result<()> {
    use tonic_health::pb::health_check_response::ServingStatus;
    let check = async {
        let ch = connect(addr, timeout)
            .await
            .with_context(|| format!("cannot reach {addr}"))?;
        let r = tonic_health::pb::health_client::HealthClient::new(ch)
            .check(tonic_health::pb::HealthCheckRequest {
                service: service.to_owned(),
            })
            .await?
            .into_inner();
        anyhow::Ok(r.status())
    };
    let status = tokio::time::timeout(timeout, check)
        .await
        .with_context(|| format!("{addr}: no answer within {timeout:?}"))??;
    println!("{addr}: {}", status.as_str_name());
    if status != ServingStatus::Serving {
        bail!("{addr} is {}", status.as_str_name());
    }
    Ok(())
}

fn spawn(bin: &Path, args: &[String], log: &Path) -> Result<u32> {
    let out = std::fs::File::create(log)?;
    let child = {
        use std::os::unix::process::CommandExt;
        Command::new(bin)
            .args(args)
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out)
            // Own process group: the cluster outlives this command and the terminal's Ctrl-C.
            .process_group(0)
            .spawn()
            .with_context(|| format!("starting {}", bin.display()))?
    };
    Ok(child.id())
}

async fn wait_port_file(path: &Path, log: &Path, timeout: Duration) -> Result<PortFile> {
    let start = Instant::now();
    loop {
        if let Ok(s) = std::fs::read_to_string(path) {
            return Ok(serde_json::from_str(&s)?);
        }
        if start.elapsed() > timeout {
            let tail = std::fs::read_to_string(log).unwrap_or_default();
            let tail: String = tail
                .lines()
                .rev()
                .take(15)
                .collect::<Vec<_>>()
                .into_iter()
                .rev()
                .collect::<Vec<_>>()
                .join("\n");
            bail!(
                "{} did not start within {:?}; log {}:\n{tail}",
                path.display(),
                timeout,
                log.display()
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Whether process `pid` is running: it exists and is not a zombie (our processes outlive
/// the `ragctl` that started them, and whoever inherits them may reap late).
fn alive(pid: &u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.trim_start().chars().next())
            .is_some_and(|state| state != 'Z' && state != 'X'),
        Err(_) => false,
    }
}

/// The loopback address a process of the cluster listens on: the port it bound last time (its
/// port.json outlives `local down`), so a restarted cluster comes back on the addresses its
/// catalog holds; port 0 (any) the first time.
fn listen_addr(port_file: &Path) -> String {
    let port = std::fs::read_to_string(port_file)
        .ok()
        .and_then(|s| serde_json::from_str::<PortFile>(&s).ok())
        .and_then(|p| p.grpc.rsplit(':').next()?.parse::<u16>().ok())
        .unwrap_or(0);
    format!("127.0.0.1:{port}")
}

/// Starts the cluster of `dir`, on its data and previous ports when it ran before. Refuses
/// while part of it still runs (a second copy would fail on the RocksDB locks).
pub async fn local_up(dir: &Path, n: usize, models: &Path) -> Result<()> {
    if let Ok(s) = std::fs::read_to_string(dir.join("cluster.json"))
        && let Ok(c) = serde_json::from_str::<LocalCluster>(&s)
    {
        let running: Vec<u32> = c.pids.iter().copied().filter(alive).collect();
        if running.len() == c.pids.len() {
            println!(
                "local cluster already running; coordinator at {}",
                c.coordinator
            );
            return Ok(());
        }
        if !running.is_empty() {
            let stopped: Vec<String> = c
                .processes
                .iter()
                .filter(|p| !alive(&p.pid))
                .map(|p| p.name.clone())
                .collect();
            bail!(
                "part of the local cluster is still running ({} of {} processes; stopped: {}); \
                 `ragctl local down` stops the rest, then `ragctl local up` brings the whole \
                 cluster back on its data",
                running.len(),
                c.pids.len(),
                stopped.join(", ")
            );
        }
    }
    let bin_dir = std::env::current_exe()?
        .parent()
        .context("binary directory")?
        .to_path_buf();
    let model_dir = models.join("all-MiniLM-L6-v2");
    if !model_dir.join("model.safetensors").exists() {
        bail!(
            "no model at {}; run scripts/fetch-models.sh",
            model_dir.display()
        );
    }
    std::fs::create_dir_all(dir)?;
    let dir = dir.canonicalize()?;
    let mut pids = Vec::new();
    let pf = |name: &str| dir.join(name).join("port.json");
    let mut listen = std::collections::HashMap::new();
    for name in std::iter::once("model-worker".to_string())
        .chain((0..n).map(|i| format!("shard-{i}")))
        .chain(["coordinator".into()])
    {
        std::fs::create_dir_all(dir.join(&name))?;
        listen.insert(name.clone(), listen_addr(&pf(&name)));
        let _ = std::fs::remove_file(pf(&name));
    }
    let mw_log = dir.join("model-worker/log");
    let mut mw_args = vec![
        "--listen".into(),
        listen["model-worker"].clone(),
        "--embed-model".into(),
        model_dir.display().to_string(),
        // MaxSim reranking over the same MiniLM weights.
        "--rerank-model".into(),
        model_dir.display().to_string(),
        "--port-file".into(),
        pf("model-worker").display().to_string(),
    ];
    // The generator too, when it was fetched.
    let gguf = models.join("smollm2-135m-instruct.Q4_1.gguf");
    if gguf.exists() {
        mw_args.extend(["--generate-model".into(), gguf.display().to_string()]);
    }
    pids.push(spawn(&bin_dir.join("model-worker"), &mw_args, &mw_log)?);
    for i in 0..n {
        let name = format!("shard-{i}");
        pids.push(spawn(
            &bin_dir.join("shard-node"),
            &[
                "--listen".into(),
                listen[&name].clone(),
                "--data-dir".into(),
                dir.join(&name).join("data").display().to_string(),
                "--port-file".into(),
                pf(&name).display().to_string(),
            ],
            &dir.join(&name).join("log"),
        )?);
    }
    let co_listen = listen["coordinator"].clone();
    launch_rest(&dir, n, &bin_dir, &model_dir, &mw_log, pids, co_listen).await
}

/// Waits for the model worker and the shard nodes, then starts the coordinator over them.
async fn launch_rest(
    dir: &Path,
    n: usize,
    bin_dir: &Path,
    model_dir: &Path,
    mw_log: &Path,
    mut pids: Vec<u32>,
    co_listen: String,
) -> Result<()> {
    let pf = |name: &str| dir.join(name).join("port.json");
    let mw = wait_port_file(&pf("model-worker"), mw_log, Duration::from_secs(120)).await?;
    let mut shard_addrs = Vec::new();
    let mut processes = vec![process("model-worker", &mw)];
    for i in 0..n {
        let name = format!("shard-{i}");
        let p = wait_port_file(
            &pf(&name),
            &dir.join(&name).join("log"),
            Duration::from_secs(300),
        )
        .await?;
        shard_addrs.push(format!("http://{}", p.grpc));
        processes.push(process(&name, &p));
    }
    let co_log = dir.join("coordinator/log");
    pids.push(spawn(
        &bin_dir.join("coordinator"),
        &[
            "--listen".into(),
            co_listen,
            "--data-dir".into(),
            dir.join("coordinator/data").display().to_string(),
            "--shard-nodes".into(),
            shard_addrs.join(","),
            "--model-worker".into(),
            format!("http://{}", mw.grpc),
            "--embedding-tokenizer".into(),
            model_dir.join("tokenizer.json").display().to_string(),
            "--port-file".into(),
            pf("coordinator").display().to_string(),
        ],
        &co_log,
    )?);
    let co = wait_port_file(&pf("coordinator"), &co_log, Duration::from_secs(60)).await?;
    processes.push(process("coordinator", &co));
    let cluster = LocalCluster {
        coordinator: format!("http://{}", co.grpc),
        coordinator_metrics: format!("http://{}/metrics", co.metrics),
        model_worker: format!("http://{}", mw.grpc),
        shard_nodes: shard_addrs,
        pids: pids.clone(),
        processes,
    };
    std::fs::write(
        dir.join("cluster.json"),
        serde_json::to_string_pretty(&cluster)?,
    )?;
    print_health(&cluster, dir).await
}

fn process(name: &str, p: &PortFile) -> LocalProcess {
    LocalProcess {
        name: name.to_owned(),
        pid: p.pid,
        grpc: format!("http://{}", p.grpc),
        metrics: format!("http://{}/metrics", p.metrics),
    }
}

/// Health through the coordinator's Admin API: every node must answer SERVING.
async fn print_health(cluster: &LocalCluster, dir: &Path) -> Result<()> {
    let ch = connect(&cluster.coordinator, Duration::from_secs(5)).await?;
    let st = AdminClient::new(ch)
        .cluster_status(ClusterStatusRequest {})
        .await?
        .into_inner();
    let mut t = Table::new();
    t.load_preset(UTF8_FULL_CONDENSED)
        .set_header(["role", "address", "health"]);
    t.add_row([
        "coordinator".to_string(),
        cluster.coordinator.clone(),
        "SERVING".into(),
    ]);
    for nstat in &st.nodes {
        t.add_row([
            node_kind_name(nstat.kind()).to_string(),
            nstat.address.clone(),
            nstat.health.clone(),
        ]);
    }
    println!("{t}");
    for p in &cluster.processes {
        println!("metrics of {}: {}", p.name, p.metrics);
    }
    println!("logs and data under {}", dir.display());
    if let Some(bad) = st.nodes.iter().find(|x| x.health != "SERVING") {
        bail!(
            "{} {} is {}",
            node_kind_name(bad.kind()),
            bad.address,
            bad.health
        );
    }
    Ok(())
}

/// SIGTERM to every process, then waits; what is still running after `DOWN_GRACE` gets
/// SIGKILL, and is named.
pub fn local_down(dir: &Path) -> Result<()> {
    let s = std::fs::read_to_string(dir.join("cluster.json"))
        .context("no local cluster (cluster.json missing)")?;
    let c: LocalCluster = serde_json::from_str(&s)?;
    let name_of = |pid: u32| {
        c.processes.iter().find(|p| p.pid == pid).map_or_else(
            || format!("pid {pid}"),
            |p| format!("{} (pid {pid})", p.name),
        )
    };
    let signal = |sig: &str, pid: u32| {
        let _ = Command::new("kill")
            .arg(sig)
            .arg(pid.to_string())
            .stderr(Stdio::null())
            .status();
    };
    for pid in c.pids.iter().rev() {
        signal("-TERM", *pid);
    }
    let start = Instant::now();
    while c.pids.iter().any(alive) && start.elapsed() < DOWN_GRACE {
        std::thread::sleep(Duration::from_millis(100));
    }
    let stuck: Vec<u32> = c.pids.iter().copied().filter(alive).collect();
    for pid in &stuck {
        signal("-KILL", *pid);
    }
    std::fs::remove_file(dir.join("cluster.json"))?;
    if stuck.is_empty() {
        println!(
            "local cluster stopped ({} processes exited in {:.1} s)",
            c.pids.len(),
            start.elapsed().as_secs_f64()
        );
    } else {
        let names: Vec<String> = stuck.iter().map(|p| name_of(*p)).collect();
        println!(
            "local cluster stopped; killed after {} s without exiting: {}",
            DOWN_GRACE.as_secs(),
            names.join(", ")
        );
    }
    Ok(())
}
