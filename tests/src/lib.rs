//! Harness for black-box tests of the compiled binaries: starts a model worker, shard nodes and
//! a coordinator as real processes on loopback (ports picked by the OS and read back from port
//! files, never fixed ports plus sleeps), kills them with SIGKILL and restarts them on the same
//! port and data directory.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub mod metrics;

use anyhow::{Context, Result, bail};
use ragcluster_proto::v1::coordinator_client::CoordinatorClient;
use serde::Deserialize;
use tonic::transport::Channel;

/// Root of the workspace.
pub fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("workspace root")
        .to_path_buf()
}

/// Directory of the binaries built with the same profile as this test.
pub fn bin_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("current exe");
    let dir = exe.parent().expect("deps dir");
    if dir.ends_with("deps") {
        dir.parent().expect("profile dir").to_path_buf()
    } else {
        dir.to_path_buf()
    }
}

pub fn models_dir() -> PathBuf {
    std::env::var_os("RAGCLUSTER_MODELS")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace().join("models"))
}

pub fn embed_model() -> Result<PathBuf> {
    let p = models_dir().join("all-MiniLM-L6-v2");
    if !p.join("model.safetensors").exists() {
        bail!(
            "model missing at {}: run scripts/setup.sh (or scripts/fetch-models.sh)",
            p.display()
        );
    }
    Ok(p)
}

/// BEIR datasets shipped beside the checkout (`../shared/datasets`).
pub fn datasets_dir() -> PathBuf {
    std::env::var_os("RAGCLUSTER_DATASETS")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace().join("../shared/datasets"))
}

#[derive(Deserialize)]
struct PortFile {
    grpc: String,
    metrics: String,
}

/// One running process of ours.
pub struct Proc {
    pub name: String,
    bin: PathBuf,
    args: Vec<String>,
    dir: PathBuf,
    child: Option<Child>,
    pub grpc: String,
    pub metrics: String,
}

impl Proc {
    /// Starts `bin` with `args` plus `--port-file`, and waits for the port file.
    pub fn start(
        name: &str,
        bin: &str,
        args: Vec<String>,
        dir: &Path,
        timeout: Duration,
    ) -> Result<Self> {
        let mut p = Proc {
            name: name.to_owned(),
            bin: bin_dir().join(bin),
            args,
            dir: dir.join(name),
            child: None,
            grpc: String::new(),
            metrics: String::new(),
        };
        p.launch(timeout)?;
        Ok(p)
    }

    /// A shard node named `name` with its data under `dir/name/data`.
    pub fn shard_node(name: &str, dir: &Path) -> Result<Self> {
        Self::shard_node_with(name, dir, None)
    }

    /// A shard node reading the `[shard_node]` settings of the TOML file `config`.
    pub fn shard_node_with(name: &str, dir: &Path, config: Option<&Path>) -> Result<Self> {
        let data = dir.join(name).join("data");
        let mut args = vec![
            "--listen".into(),
            "127.0.0.1:0".into(),
            "--data-dir".into(),
            data.display().to_string(),
        ];
        if let Some(c) = config {
            args.push("--config".into());
            args.push(c.display().to_string());
        }
        Self::start(name, "shard-node", args, dir, Duration::from_secs(120))
    }

    fn port_file(&self) -> PathBuf {
        self.dir.join("port.json")
    }

    pub fn log(&self) -> PathBuf {
        self.dir.join("log")
    }

    fn launch(&mut self, timeout: Duration) -> Result<()> {
        std::fs::create_dir_all(&self.dir)?;
        let _ = std::fs::remove_file(self.port_file());
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log())?;
        let mut args = self.args.clone();
        args.push("--port-file".into());
        args.push(self.port_file().display().to_string());
        let child = Command::new(&self.bin)
            .args(&args)
            .env("RUST_BACKTRACE", "1")
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| {
                format!(
                    "spawn {} (build it first: cargo build --release)",
                    self.bin.display()
                )
            })?;
        self.child = Some(child);
        let start = Instant::now();
        loop {
            if let Ok(s) = std::fs::read_to_string(self.port_file()) {
                let pf: PortFile = serde_json::from_str(&s)?;
                self.grpc = format!("http://{}", pf.grpc);
                self.metrics = format!("http://{}/metrics", pf.metrics);
                return Ok(());
            }
            if let Some(status) = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                bail!(
                    "{} exited with {status} during start; log:\n{}",
                    self.name,
                    self.log_tail()
                );
            }
            if start.elapsed() > timeout {
                bail!(
                    "{} did not start in {timeout:?}; log:\n{}",
                    self.name,
                    self.log_tail()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn log_tail(&self) -> String {
        let s = std::fs::read_to_string(self.log()).unwrap_or_default();
        let lines: Vec<&str> = s.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    }

    /// SIGKILL: no chance to flush anything.
    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGTERM and wait (graceful shutdown).
    pub fn terminate(&mut self) -> Result<std::process::ExitStatus> {
        let mut c = self.child.take().context("not running")?;
        Command::new("kill")
            .arg("-TERM")
            .arg(c.id().to_string())
            .status()?;
        let start = Instant::now();
        loop {
            if let Some(s) = c.try_wait()? {
                return Ok(s);
            }
            if start.elapsed() > Duration::from_secs(30) {
                let _ = c.kill();
                bail!("{} ignored SIGTERM for 30 s", self.name);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Starts again with the same arguments, on the same port when it had one.
    pub fn restart(&mut self, timeout: Duration) -> Result<()> {
        self.kill9();
        if let Some(port) = self.grpc.rsplit(':').next().map(str::to_owned)
            && let Some(i) = self.args.iter().position(|a| a == "--listen")
        {
            self.args[i + 1] = format!("127.0.0.1:{port}");
        }
        self.launch(timeout)
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// A whole local cluster in a temporary directory.
pub struct Cluster {
    pub dir: tempfile::TempDir,
    pub model_worker: Proc,
    pub shards: Vec<Proc>,
    pub coordinator: Proc,
}

impl Cluster {
    pub fn start(shard_nodes: usize) -> Result<Self> {
        Self::start_with(shard_nodes, None)
    }

    /// As `start`, the shard nodes configured by `shard_config` (a TOML document).
    pub fn start_with(shard_nodes: usize, shard_config: Option<&str>) -> Result<Self> {
        let dir = tempfile::Builder::new()
            .prefix("ragcluster-test-")
            .tempdir()?;
        let config = match shard_config {
            Some(toml) => {
                let p = dir.path().join("shard-node.toml");
                std::fs::write(&p, toml)?;
                Some(p)
            }
            None => None,
        };
        let model = embed_model()?;
        let mw = Proc::start(
            "model-worker",
            "model-worker",
            vec![
                "--listen".into(),
                "127.0.0.1:0".into(),
                "--embed-model".into(),
                model.display().to_string(),
            ],
            dir.path(),
            Duration::from_secs(120),
        )?;
        let mut shards = Vec::new();
        for i in 0..shard_nodes {
            shards.push(Proc::shard_node_with(
                &format!("shard-{i}"),
                dir.path(),
                config.as_deref(),
            )?);
        }
        let coordinator = Proc::start(
            "coordinator",
            "coordinator",
            vec![
                "--listen".into(),
                "127.0.0.1:0".into(),
                "--data-dir".into(),
                dir.path().join("coordinator/data").display().to_string(),
                "--shard-nodes".into(),
                shards
                    .iter()
                    .map(|s| s.grpc.clone())
                    .collect::<Vec<_>>()
                    .join(","),
                "--model-worker".into(),
                mw.grpc.clone(),
                "--embedding-tokenizer".into(),
                model.join("tokenizer.json").display().to_string(),
            ],
            dir.path(),
            Duration::from_secs(60),
        )?;
        Ok(Self {
            dir,
            model_worker: mw,
            shards,
            coordinator,
        })
    }

    pub async fn client(&self) -> Result<CoordinatorClient<Channel>> {
        let ch = Channel::from_shared(self.coordinator.grpc.clone())?
            .connect()
            .await?;
        Ok(CoordinatorClient::new(ch)
            .max_decoding_message_size(64 << 20)
            .max_encoding_message_size(300 << 20))
    }
}

/// A BEIR document.
#[derive(Deserialize, Clone)]
pub struct BeirDoc {
    #[serde(rename = "_id")]
    pub id: String,
    #[serde(default)]
    pub title: String,
    pub text: String,
}

#[derive(Deserialize, Clone)]
pub struct BeirQuery {
    #[serde(rename = "_id")]
    pub id: String,
    pub text: String,
}

pub fn read_jsonl<T: serde::de::DeserializeOwned>(path: &Path, limit: usize) -> Result<Vec<T>> {
    let s = std::fs::read_to_string(path).with_context(|| path.display().to_string())?;
    s.lines()
        .filter(|l| !l.trim().is_empty())
        .take(limit)
        .map(|l| Ok(serde_json::from_str(l)?))
        .collect()
}

/// qrels/test.tsv: query id -> relevant doc ids with grades.
pub fn read_qrels(
    path: &Path,
) -> Result<std::collections::HashMap<String, std::collections::HashMap<String, u32>>> {
    let s = std::fs::read_to_string(path).with_context(|| path.display().to_string())?;
    let mut out: std::collections::HashMap<String, std::collections::HashMap<String, u32>> =
        Default::default();
    for line in s.lines().skip(1) {
        let f: Vec<&str> = line.split('\t').collect();
        if f.len() >= 3 {
            out.entry(f[0].to_owned())
                .or_default()
                .insert(f[1].to_owned(), f[2].trim().parse().unwrap_or(0));
        }
    }
    Ok(out)
}

/// Percentile (0..=100) of an unsorted sample, nearest rank.
pub fn percentile(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let idx = ((p / 100.0) * v.len() as f64).ceil() as usize;
    v[idx.saturating_sub(1).min(v.len() - 1)]
}
