//! One process of ours under test (`Proc`): started with its flags in a data directory of
//! its own, its ports read back from the port file it writes, killed with SIGKILL and
//! restarted on the same port and directory.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde::Deserialize;

use crate::{bin_dir, embed_model, generate_model};

#[derive(Deserialize)]
struct PortFile {
    grpc: String,
    metrics: String,
    /// The process serves TLS: its address is https://.
    #[serde(default)]
    tls: bool,
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
    /// Network namespace the process runs in (`ip netns exec`), listening on `host`.
    netns: Option<(String, String)>,
    /// Extra environment of the next start (`restart`), e.g. libfaketime's.
    pub env: Vec<(String, String)>,
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
        Self::launched(name, bin, args, dir, timeout, None)
    }

    /// As `start`, inside network namespace `ns` (made by the test: `crate::netns`), its
    /// metrics endpoint on `host` too so the test reaches both from outside.
    pub fn start_in(
        ns: &str,
        host: &str,
        name: &str,
        bin: &str,
        args: Vec<String>,
        dir: &Path,
        timeout: Duration,
    ) -> Result<Self> {
        let netns = Some((ns.to_owned(), host.to_owned()));
        Self::launched(name, bin, args, dir, timeout, netns)
    }

    fn launched(
        name: &str,
        bin: &str,
        args: Vec<String>,
        dir: &Path,
        timeout: Duration,
        netns: Option<(String, String)>,
    ) -> Result<Self> {
        let mut p = Proc {
            name: name.to_owned(),
            bin: bin_dir().join(bin),
            args,
            dir: dir.join(name),
            child: None,
            grpc: String::new(),
            metrics: String::new(),
            netns,
            env: Vec::new(),
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
        Self::shard_node_args(name, dir, config, &[])
    }

    /// A shard node that registers itself with the coordinator at `coordinator` (membership)
    /// rather than being one of its configured addresses; `config` as in `shard_node_with`.
    pub fn joining_shard_node(
        name: &str,
        dir: &Path,
        coordinator: &str,
        config: Option<&Path>,
    ) -> Result<Self> {
        Self::shard_node_args(name, dir, config, &["--coordinators", coordinator])
    }

    fn shard_node_args(
        name: &str,
        dir: &Path,
        config: Option<&Path>,
        extra: &[&str],
    ) -> Result<Self> {
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
        args.extend(extra.iter().map(|s| s.to_string()));
        Self::start(name, "shard-node", args, dir, Duration::from_secs(120))
    }

    /// A MiniLM model worker named `name` that registers with `coordinator`.
    pub fn joining_model_worker(name: &str, dir: &Path, coordinator: &str) -> Result<Self> {
        let args = vec![
            "--listen".into(),
            "127.0.0.1:0".into(),
            "--embed-model".into(),
            embed_model()?.display().to_string(),
            "--coordinators".into(),
            coordinator.into(),
            "--data-dir".into(),
            dir.join(name).join("data").display().to_string(),
        ];
        Self::start(name, "model-worker", args, dir, Duration::from_secs(300))
    }

    /// A MiniLM model worker serving MiniLM embeddings and, with `generate`, SmolLM2 generation,
    /// reading the `[model_worker]` settings of `config` when given.
    pub fn model_worker(dir: &Path, generate: bool, config: Option<&Path>) -> Result<Self> {
        Self::model_worker_with(dir, generate, config, &[])
    }

    /// As `model_worker`, with extra flags.
    pub fn model_worker_with(
        dir: &Path,
        generate: bool,
        config: Option<&Path>,
        extra: &[&str],
    ) -> Result<Self> {
        let mut args: Vec<String> = vec![
            "--listen".into(),
            "127.0.0.1:0".into(),
            "--embed-model".into(),
            embed_model()?.display().to_string(),
        ];
        if generate {
            let gguf = generate_model()?;
            args.extend(["--generate-model".into(), gguf.display().to_string()]);
        }
        if let Some(c) = config {
            args.extend(["--config".into(), c.display().to_string()]);
        }
        args.extend(extra.iter().map(|s| s.to_string()));
        Self::start(
            "model-worker",
            "model-worker",
            args,
            dir,
            Duration::from_secs(300),
        )
    }

    fn port_file(&self) -> PathBuf {
        self.dir.join("port.json")
    }

    /// The running process's id.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Resident memory of the running process (Linux `/proc`), for RAM-per-chunk figures.
    pub fn rss_bytes(&self) -> Option<u64> {
        let pid = self.child.as_ref()?.id();
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
        let kb = status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))?
            .trim()
            .trim_end_matches("kB")
            .trim()
            .parse::<u64>()
            .ok()?;
        Some(kb * 1024)
    }

    /// CPU time (user + system) the running process has used so far (Linux `/proc`), for
    /// CPU-per-operation figures.
    pub fn cpu_seconds(&self) -> Option<f64> {
        let pid = self.child.as_ref()?.id();
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        // Fields after the command name (which may hold spaces) start at its closing paren;
        // utime and stime are the 14th and 15th fields of the whole line.
        let rest = &stat[stat.rfind(')')? + 2..];
        let f: Vec<&str> = rest.split(' ').collect();
        let ticks = f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?;
        // USER_HZ is 100 on every Linux this runs on (x86-64, arm64).
        Some(ticks as f64 / 100.0)
    }

    /// The process's data directory (`<dir>/<name>/data`).
    pub fn data_dir(&self) -> PathBuf {
        self.dir.join("data")
    }

    /// Bytes under the process's data directory.
    pub fn data_bytes(&self) -> u64 {
        fn walk(p: &Path) -> u64 {
            std::fs::read_dir(p).map_or(0, |rd| {
                rd.flatten()
                    .map(|e| match e.metadata() {
                        Ok(m) if m.is_dir() => walk(&e.path()),
                        Ok(m) => m.len(),
                        Err(_) => 0,
                    })
                    .sum()
            })
        }
        walk(&self.data_dir())
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
        let mut cmd = match &self.netns {
            // `ip netns exec` enters the namespace and execs the binary: the child is it.
            Some((ns, host)) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns]).arg(&self.bin);
                c.env("RAGCLUSTER__TELEMETRY__METRICS_LISTEN", format!("{host}:0"));
                c
            }
            None => Command::new(&self.bin),
        };
        let child = cmd
            .args(&args)
            .env("RUST_BACKTRACE", "1")
            .envs(self.env.iter().map(|(k, v)| (k, v)))
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
                let scheme = if pf.tls { "https" } else { "http" };
                self.grpc = format!("{scheme}://{}", pf.grpc);
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

    /// The last 30 lines of the log; a binary's final `Error:` (anyhow's exit message, whose
    /// backtrace alone would fill those lines) comes first when it is further up.
    pub fn log_tail(&self) -> String {
        let s = std::fs::read_to_string(self.log()).unwrap_or_default();
        let lines: Vec<&str> = s.lines().collect();
        let from = lines.len().saturating_sub(30);
        let tail = lines[from..].join("\n");
        match lines.iter().rposition(|l| l.starts_with("Error:")) {
            Some(i) if i < from => {
                let cause = lines[i..(i + 6).min(from)].join("\n");
                format!("{cause}\n  ...\n{tail}")
            }
            _ => tail,
        }
    }

    /// Whether the process has ended by itself (a crash or an abort); true when it was
    /// never started or was killed.
    pub fn exited(&mut self) -> bool {
        match self.child.as_mut() {
            Some(c) => c.try_wait().ok().flatten().is_some(),
            None => true,
        }
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

    /// kill -9, then starts again with the same arguments on another port (any free one).
    pub fn restart_elsewhere(&mut self, timeout: Duration) -> Result<()> {
        self.kill9();
        if let Some(i) = self.args.iter().position(|a| a == "--listen") {
            self.args[i + 1] = format!("{}:0", self.host());
        }
        let before = self.grpc.clone();
        self.launch(timeout)?;
        if self.grpc == before {
            // The OS handed the same port back: go again.
            self.kill9();
            self.launch(timeout)?;
        }
        Ok(())
    }

    /// The address the process listens on: loopback, or its namespace's.
    fn host(&self) -> &str {
        self.netns.as_ref().map_or("127.0.0.1", |n| n.1.as_str())
    }

    /// Starts again with the same arguments, on the same port when it had one.
    pub fn restart(&mut self, timeout: Duration) -> Result<()> {
        self.kill9();
        if let Some(port) = self.grpc.rsplit(':').next().map(str::to_owned)
            && let Some(i) = self.args.iter().position(|a| a == "--listen")
        {
            self.args[i + 1] = format!("{}:{port}", self.host());
        }
        self.launch(timeout)
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill9();
    }
}
