//! `ragctl local up|down|restart` (a whole cluster as local processes) and `ragctl health`.

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

/// The generators a local cluster's model worker serves when `scripts/fetch-models.sh` fetched
/// them, the default first: Qwen2.5-Coder-0.5B answers CMU QA questions from their article
/// far better than SmolLM2-135M (docs/evaluation.md, "Choosing the generator"); the 1.5B
/// only where `scripts/fetch-models.sh qwen1.5b` fetched it (three times the 0.5B's time).
const GENERATORS: [&str; 3] = [
    "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    "smollm2-135m-instruct.Q4_1.gguf",
    "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
];

/// Embedders served beside all-MiniLM-L6-v2 (the default) when fetched, named after the
/// file's stem: `ragctl ingest --embedding-model nomic-embed-text-v1.5.f16` picks it.
const EMBEDDERS: [&str; 1] = ["nomic-embed-text-v1.5.f16.gguf"];

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

/// Starts `bin`; dropping the returned child leaves the process running.
fn spawn(bin: &Path, args: &[String], log: &Path) -> Result<std::process::Child> {
    let out = std::fs::File::create(log)?;
    use std::os::unix::process::CommandExt;
    Command::new(bin)
        .args(args)
        .stdin(Stdio::null())
        .stdout(out.try_clone()?)
        .stderr(out)
        // Own process group: the cluster outlives this command and the terminal's Ctrl-C.
        .process_group(0)
        .spawn()
        .with_context(|| format!("starting {}", bin.display()))
}

/// The last lines of a process's log, for an error message.
fn log_tail(log: &Path) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(15)..].join("\n")
}

/// Waits for the port file `child` writes once it serves; fails as soon as the child exits
/// first (with how it ended: a signal leaves nothing in the log) or after `timeout`.
async fn wait_port_file(
    child: &mut std::process::Child,
    path: &Path,
    log: &Path,
    timeout: Duration,
) -> Result<PortFile> {
    let start = Instant::now();
    loop {
        if let Ok(s) = std::fs::read_to_string(path) {
            return Ok(serde_json::from_str(&s)?);
        }
        if let Some(status) = child.try_wait()? {
            bail!(
                "pid {} exited before it served ({}); log {}:\n{}",
                child.id(),
                exit_description(status),
                log.display(),
                log_tail(log)
            );
        }
        if start.elapsed() > timeout {
            bail!(
                "{} did not start within {:?} ({}); log {}:\n{}",
                path.display(),
                timeout,
                waiting_in(child.id()),
                log.display(),
                log_tail(log)
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Where the threads of a process that does not come up are waiting: kernel wait channels
/// with their thread counts, e.g. "threads in flock_lock_inode_wait: 1, futex_wait_queue: 9".
fn waiting_in(pid: u32) -> String {
    let mut counts = std::collections::BTreeMap::<String, usize>::new();
    if let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) {
        for t in tasks.flatten() {
            let w = std::fs::read_to_string(t.path().join("wchan")).unwrap_or_default();
            let w = if w.is_empty() || w == "0" {
                "running".to_string()
            } else {
                w
            };
            *counts.entry(w).or_default() += 1;
        }
    }
    if counts.is_empty() {
        return format!("pid {pid} not found");
    }
    let list: Vec<String> = counts.iter().map(|(w, n)| format!("{w}: {n}")).collect();
    format!("pid {pid}, threads in {}", list.join(", "))
}

/// "exit code N" or "killed by signal N".
fn exit_description(status: std::process::ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exit code {code}"),
        (None, Some(sig)) => format!("killed by signal {sig}"),
        _ => status.to_string(),
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

/// The loopback address a process of the cluster listens on: the port it bound last time
/// while that port is free (its port.json outlives `local down`), else any free port: shard
/// nodes and the model worker register their address with the coordinator wherever they are.
fn listen_addr(port_file: &Path) -> String {
    let port = std::fs::read_to_string(port_file)
        .ok()
        .and_then(|s| serde_json::from_str::<PortFile>(&s).ok())
        .and_then(|p| p.grpc.rsplit(':').next()?.parse::<u16>().ok())
        .filter(|p| std::net::TcpListener::bind(("127.0.0.1", *p)).is_ok())
        .unwrap_or(0);
    format!("127.0.0.1:{port}")
}

/// How the processes of a local cluster are started.
struct Launcher {
    dir: std::path::PathBuf,
    bin_dir: std::path::PathBuf,
    models: std::path::PathBuf,
}

impl Launcher {
    /// Processes of the cluster in `dir`, from the binaries beside this one.
    fn new(dir: &Path, models: &Path) -> Result<Self> {
        Ok(Self {
            dir: dir.to_path_buf(),
            bin_dir: std::env::current_exe()?
                .parent()
                .context("binary directory")?
                .to_path_buf(),
            models: models.canonicalize()?,
        })
    }

    fn port_file(&self, name: &str) -> std::path::PathBuf {
        self.dir.join(name).join("port.json")
    }

    fn log(&self, name: &str) -> std::path::PathBuf {
        self.dir.join(name).join("log")
    }

    /// Binary and arguments of process `name`; shard nodes and the model worker register with
    /// the coordinator at `coordinator`.
    fn command(&self, name: &str, coordinator: &str) -> (std::path::PathBuf, Vec<String>) {
        let listen = listen_addr(&self.port_file(name));
        let data = self.dir.join(name).join("data").display().to_string();
        let pf = self.port_file(name).display().to_string();
        let model_dir = self.models.join("all-MiniLM-L6-v2");
        if name == "coordinator" {
            let args = vec![
                "--listen".into(),
                listen,
                "--data-dir".into(),
                data,
                // Members register themselves: no seed addresses.
                "--shard-nodes".into(),
                String::new(),
                "--model-worker".into(),
                String::new(),
                "--embedding-tokenizer".into(),
                model_dir.join("tokenizer.json").display().to_string(),
                "--port-file".into(),
                pf,
            ];
            return (self.bin_dir.join("coordinator"), args);
        }
        // Members: where they listen, keep their data and register.
        let mut args = vec![
            "--listen".into(),
            listen,
            "--data-dir".into(),
            data,
            "--coordinators".into(),
            coordinator.into(),
            "--port-file".into(),
            pf,
        ];
        if name == "model-worker" {
            args.extend(["--embed-model".into(), model_dir.display().to_string()]);
            // Every other embedder that was fetched (a collection picks one at creation).
            for file in EMBEDDERS {
                let gguf = self.models.join(file);
                if gguf.exists() {
                    args.extend(["--embed-model".into(), gguf.display().to_string()]);
                }
            }
            args.extend([
                // MaxSim reranking over the same MiniLM weights.
                "--rerank-model".into(),
                model_dir.display().to_string(),
            ]);
            // Every generator that was fetched, the default first.
            for file in GENERATORS {
                let gguf = self.models.join(file);
                if gguf.exists() {
                    args.extend(["--generate-model".into(), gguf.display().to_string()]);
                }
            }
            return (self.bin_dir.join("model-worker"), args);
        }
        (self.bin_dir.join("shard-node"), args)
    }

    /// Starts `name`; `wait_started` waits for its port file.
    fn spawn(&self, name: &str, coordinator: &str) -> Result<std::process::Child> {
        std::fs::create_dir_all(self.dir.join(name))?;
        let (bin, args) = self.command(name, coordinator);
        let _ = std::fs::remove_file(self.port_file(name));
        spawn(&bin, &args, &self.log(name))
    }

    async fn wait_started(
        &self,
        name: &str,
        child: &mut std::process::Child,
    ) -> Result<LocalProcess> {
        let timeout = Duration::from_secs(if name.starts_with("shard") { 300 } else { 120 });
        let p = wait_port_file(child, &self.port_file(name), &self.log(name), timeout)
            .await
            .with_context(|| format!("{name} did not start"))?;
        Ok(process(name, &p))
    }
}

/// The shard-node names a cluster directory holds (`shard-0`, `shard-1`, ...).
fn shard_names(dir: &Path) -> usize {
    (0..)
        .take_while(|i| dir.join(format!("shard-{i}")).join("data").exists())
        .count()
}

fn read_cluster(dir: &Path) -> Option<LocalCluster> {
    let s = std::fs::read_to_string(dir.join("cluster.json")).ok()?;
    serde_json::from_str(&s).ok()
}

/// Starts whatever of the cluster of `dir` is not running, on its data: everything the first
/// time or after `local down`, only the missing processes after one died, and new shard nodes
/// up to `n` (they join through the coordinator; `ragctl rebalance` gives them replicas).
pub async fn local_up(dir: &Path, n: usize, models: &Path) -> Result<()> {
    let model_dir = models.join("all-MiniLM-L6-v2");
    if !model_dir.join("model.safetensors").exists() {
        bail!(
            "no model at {}; run scripts/fetch-models.sh",
            model_dir.display()
        );
    }
    std::fs::create_dir_all(dir)?;
    let dir = dir.canonicalize()?;
    let l = Launcher::new(&dir, models)?;
    let had = shard_names(&dir);
    if n < had {
        println!(
            "{had} shard nodes exist (more than --shard-nodes {n}); all are started. \
             `ragctl node remove ID` takes one out of the cluster."
        );
    }
    let names: Vec<String> = std::iter::once("coordinator".to_string())
        .chain(std::iter::once("model-worker".to_string()))
        .chain((0..n.max(had)).map(|i| format!("shard-{i}")))
        .collect();
    let old = read_cluster(&dir);
    // Decided once, before anything starts: a process started here may reuse an old pid.
    let alive_before: Vec<LocalProcess> = old
        .iter()
        .flat_map(|c| c.processes.iter())
        .filter(|p| alive(&p.pid))
        .cloned()
        .collect();
    let running = |name: &str| alive_before.iter().find(|p| p.name == name).cloned();
    let missing: Vec<&String> = names.iter().filter(|n| running(n).is_none()).collect();
    if missing.is_empty() {
        let c = old.context("cluster.json")?;
        println!(
            "local cluster already running; coordinator at {}",
            c.coordinator
        );
        return Ok(());
    }
    if missing.len() < names.len() {
        let m: Vec<&str> = missing.iter().map(|s| s.as_str()).collect();
        println!("starting {} (the rest is running)", m.join(", "));
    }
    let co = match running("coordinator") {
        Some(p) => p,
        None => {
            let mut child = l.spawn("coordinator", "")?;
            l.wait_started("coordinator", &mut child).await?
        }
    };
    let mut processes = vec![co.clone()];
    let mut started = Vec::new();
    for name in names.iter().skip(1) {
        match running(name) {
            Some(p) => processes.push(p),
            None => started.push((name, l.spawn(name, &co.grpc)?)),
        }
    }
    for (name, mut child) in started {
        processes.push(l.wait_started(name, &mut child).await?);
    }
    processes.sort_by_key(|p| names.iter().position(|n| *n == p.name));
    let cluster = write_cluster(&dir, processes)?;
    wait_registered(&cluster, names.len() - 1).await?;
    print_health(&cluster, &dir).await
}

/// Records the processes in cluster.json.
fn write_cluster(dir: &Path, processes: Vec<LocalProcess>) -> Result<LocalCluster> {
    let find = |n: &str| processes.iter().find(|p| p.name == n);
    let co = find("coordinator").context("coordinator")?;
    let cluster = LocalCluster {
        coordinator: co.grpc.clone(),
        coordinator_metrics: co.metrics.clone(),
        model_worker: find("model-worker")
            .map(|p| p.grpc.clone())
            .unwrap_or_default(),
        shard_nodes: processes
            .iter()
            .filter(|p| p.name.starts_with("shard-"))
            .map(|p| p.grpc.clone())
            .collect(),
        pids: processes.iter().map(|p| p.pid).collect(),
        processes,
    };
    std::fs::write(
        dir.join("cluster.json"),
        serde_json::to_string_pretty(&cluster)?,
    )?;
    Ok(cluster)
}

/// Waits until `members` members are UP at their current addresses in the coordinator's
/// member table (they register within a heartbeat of starting).
async fn wait_registered(cluster: &LocalCluster, members: usize) -> Result<()> {
    let ch = connect(&cluster.coordinator, Duration::from_secs(5)).await?;
    let mut admin = AdminClient::new(ch);
    let current: Vec<&str> = cluster
        .processes
        .iter()
        .filter(|p| p.name != "coordinator")
        .map(|p| p.grpc.as_str())
        .collect();
    let start = Instant::now();
    loop {
        let st = admin
            .cluster_status(ClusterStatusRequest {})
            .await?
            .into_inner();
        let up = st
            .nodes
            .iter()
            .filter(|n| n.state() == MemberState::Up && current.contains(&n.address.as_str()))
            .count();
        if up >= members {
            return Ok(());
        }
        if start.elapsed() > Duration::from_secs(60) {
            bail!("only {up} of {members} members registered with the coordinator within 60 s");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// `ragctl local restart NAME`: stops one process of the cluster (SIGTERM, then SIGKILL) and
/// starts it again on its data; a shard node or model worker rejoins from wherever it lands.
pub async fn local_restart(dir: &Path, name: &str, models: &Path) -> Result<()> {
    let dir = dir.canonicalize()?;
    let c = read_cluster(&dir).context("no local cluster (cluster.json missing)")?;
    let Some(p) = c.processes.iter().find(|p| p.name == name).cloned() else {
        let names: Vec<&str> = c.processes.iter().map(|p| p.name.as_str()).collect();
        bail!("no process {name:?}; processes: {}", names.join(", "));
    };
    stop(&[p.pid], &c);
    let l = Launcher::new(&dir, models)?;
    let co = if name == "coordinator" {
        ""
    } else {
        c.coordinator.as_str()
    };
    let mut child = l.spawn(name, co)?;
    let started = l.wait_started(name, &mut child).await?;
    println!("{name} restarted at {} (pid {})", started.grpc, started.pid);
    let processes = c
        .processes
        .iter()
        .map(|x| {
            if x.name == name {
                started.clone()
            } else {
                x.clone()
            }
        })
        .collect();
    let cluster = write_cluster(&dir, processes)?;
    if name != "coordinator" {
        wait_registered(&cluster, cluster.processes.len() - 1).await?;
    }
    Ok(())
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

/// SIGTERM to `pids` (in reverse order), then waits; what is still running after
/// `DOWN_GRACE` gets SIGKILL. Returns those.
fn stop(pids: &[u32], c: &LocalCluster) -> (Vec<String>, Duration) {
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
    for pid in pids.iter().rev() {
        signal("-TERM", *pid);
    }
    let start = Instant::now();
    while pids.iter().any(alive) && start.elapsed() < DOWN_GRACE {
        std::thread::sleep(Duration::from_millis(100));
    }
    let stuck: Vec<u32> = pids.iter().copied().filter(alive).collect();
    for pid in &stuck {
        signal("-KILL", *pid);
    }
    // Gone for good before anything restarts on the same data (RocksDB's lock, the ports).
    let killed = Instant::now();
    while stuck.iter().any(alive) && killed.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(50));
    }
    (stuck.into_iter().map(name_of).collect(), start.elapsed())
}

/// SIGTERM to every process, then waits; what is still running after `DOWN_GRACE` gets
/// SIGKILL, and is named.
pub fn local_down(dir: &Path) -> Result<()> {
    let c = read_cluster(dir).context("no local cluster (cluster.json missing)")?;
    // Members first, the coordinator last (it marks nothing down while they leave).
    let mut pids: Vec<u32> = c
        .processes
        .iter()
        .filter(|p| p.name == "coordinator")
        .map(|p| p.pid)
        .collect();
    pids.extend(
        c.processes
            .iter()
            .filter(|p| p.name != "coordinator")
            .map(|p| p.pid),
    );
    if pids.is_empty() {
        pids.clone_from(&c.pids);
    }
    let (stuck, took) = stop(&pids, &c);
    std::fs::remove_file(dir.join("cluster.json"))?;
    if stuck.is_empty() {
        println!(
            "local cluster stopped ({} processes exited in {:.1} s)",
            pids.len(),
            took.as_secs_f64()
        );
    } else {
        println!(
            "local cluster stopped; killed after {} s without exiting: {}",
            DOWN_GRACE.as_secs(),
            stuck.join(", ")
        );
    }
    Ok(())
}
