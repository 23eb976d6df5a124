//! Harness for black-box tests of the compiled binaries: starts a model worker, shard nodes and
//! a coordinator as real processes on loopback (ports picked by the OS and read back from port
//! files, never fixed ports plus sleeps), kills them with SIGKILL and restarts them on the same
//! port and data directory.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

pub mod decodeprof;
pub mod engines;
pub mod inproc;
pub mod llama;
pub mod load;
pub mod metrics;
pub mod pipeline;
mod proc;
pub mod replicas;
pub mod scale;
pub mod threads;
pub mod workerload;

pub use proc::Proc;

use anyhow::{Context, Result, bail};
use ragcluster_proto::v1::admin_client::AdminClient;
use ragcluster_proto::v1::coordinator_client::CoordinatorClient;
use ragcluster_proto::v1::{
    ChunkingConfig, ChunkingStrategy, ClusterStatusRequest, CreateCollectionRequest, Document,
    MemberState, NodeStatus, UpsertDocumentsRequest, UpsertDocumentsResponse,
};
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
/// The SmolLM2-135M-Instruct GGUF fetched by scripts/fetch-models.sh.
pub fn generate_model() -> Result<PathBuf> {
    let p = models_dir().join("smollm2-135m-instruct.Q4_1.gguf");
    anyhow::ensure!(
        p.exists(),
        "{} missing: run scripts/fetch-models.sh",
        p.display()
    );
    Ok(p)
}

pub fn datasets_dir() -> PathBuf {
    std::env::var_os("RAGCLUSTER_DATASETS")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace().join("../shared/datasets"))
}

/// A coordinator with no configured members at a fixed port (`coordinator_config` as its
/// TOML), then `model_workers` model workers and `shard_nodes` shard nodes that join it
/// (registering and heartbeating), once every one of them is UP in its member table.
pub struct Joined {
    pub dir: tempfile::TempDir,
    pub coordinator: Proc,
    pub model_workers: Vec<Proc>,
    pub shards: Vec<Proc>,
    /// `[shard_node]` TOML of every shard node, if any.
    pub shard_config: Option<PathBuf>,
}

impl Joined {
    pub fn start(
        shard_nodes: usize,
        model_workers: usize,
        coordinator_config: &str,
        shard_config: Option<&str>,
    ) -> Result<Self> {
        let mut dir = tempfile::Builder::new()
            .prefix("ragcluster-test-joined-")
            .tempdir()?;
        if std::env::var_os("RAGCLUSTER_KEEP_TEST_DIRS").is_some() {
            dir.disable_cleanup(true);
            eprintln!("keeping {}", dir.path().display());
        }
        let d = dir.path();
        let co_cfg = d.join("coordinator.toml");
        std::fs::write(&co_cfg, coordinator_config)?;
        let shard_config = match shard_config {
            Some(t) => {
                let p = d.join("shard-node.toml");
                std::fs::write(&p, t)?;
                Some(p)
            }
            None => None,
        };
        let coordinator = Proc::start(
            "coordinator",
            "coordinator",
            vec![
                "--listen".into(),
                "127.0.0.1:0".into(),
                "--data-dir".into(),
                d.join("coordinator/data").display().to_string(),
                "--shard-nodes".into(),
                String::new(),
                "--model-worker".into(),
                String::new(),
                "--embedding-tokenizer".into(),
                embed_model()?.join("tokenizer.json").display().to_string(),
                "--config".into(),
                co_cfg.display().to_string(),
            ],
            d,
            Duration::from_secs(60),
        )?;
        let mut workers = Vec::new();
        for i in 0..model_workers {
            workers.push(Proc::joining_model_worker(
                &format!("model-worker-{i}"),
                d,
                &coordinator.grpc,
            )?);
        }
        let mut shards = Vec::new();
        for i in 0..shard_nodes {
            shards.push(Proc::joining_shard_node(
                &format!("shard-{i}"),
                d,
                &coordinator.grpc,
                shard_config.as_deref(),
            )?);
        }
        let j = Self {
            dir,
            coordinator,
            model_workers: workers,
            shards,
            shard_config,
        };
        Ok(j)
    }

    /// Starts one more joining shard node, `shard-{i}`.
    pub fn add_shard_node(&mut self) -> Result<&Proc> {
        let name = format!("shard-{}", self.shards.len());
        let p = Proc::joining_shard_node(
            &name,
            self.dir.path(),
            &self.coordinator.grpc,
            self.shard_config.as_deref(),
        )?;
        self.shards.push(p);
        Ok(&self.shards[self.shards.len() - 1])
    }

    pub async fn client(&self) -> Result<CoordinatorClient<Channel>> {
        coordinator_client(&self.coordinator.grpc).await
    }

    pub async fn admin(&self) -> Result<AdminClient<Channel>> {
        Ok(AdminClient::new(
            Channel::from_shared(self.coordinator.grpc.clone())?
                .connect()
                .await?,
        ))
    }

    /// Waits until every address in `addresses` is an UP member; returns the member rows.
    pub async fn wait_up(
        &self,
        addresses: &[String],
        timeout: Duration,
    ) -> Result<Vec<NodeStatus>> {
        let mut admin = self.admin().await?;
        let t = Instant::now();
        loop {
            let st = admin
                .cluster_status(ClusterStatusRequest {})
                .await?
                .into_inner();
            let up = |a: &String| {
                st.nodes
                    .iter()
                    .any(|n| &n.address == a && n.state() == MemberState::Up && n.node_id != 0)
            };
            if addresses.iter().all(up) {
                return Ok(st.nodes);
            }
            anyhow::ensure!(
                t.elapsed() < timeout,
                "members not UP within {timeout:?}: want {addresses:?}, have {:?}",
                st.nodes
                    .iter()
                    .map(|n| (n.node_id, n.address.clone(), n.state().as_str_name()))
                    .collect::<Vec<_>>()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Every member's address.
    pub fn addresses(&self) -> Vec<String> {
        self.model_workers
            .iter()
            .chain(&self.shards)
            .map(|p| p.grpc.clone())
            .collect()
    }
}

/// A whole local cluster in a temporary directory.
pub struct Cluster {
    pub dir: tempfile::TempDir,
    pub model_worker: Proc,
    pub shards: Vec<Proc>,
    /// The first coordinator (the only one unless `Options::coordinators` > 1).
    pub coordinator: Proc,
    /// The other coordinators, replicas of the catalog.
    pub more_coordinators: Vec<Proc>,
    /// `coordinator` also hosts a shard node (`Options::colocated`).
    pub colocated: bool,
}

impl Cluster {
    /// The processes that hold shard replicas: the shard nodes, and the first coordinator
    /// when it hosts one.
    pub fn shard_processes(&self) -> impl Iterator<Item = &Proc> {
        self.shards
            .iter()
            .chain(self.colocated.then_some(&self.coordinator))
    }

    /// CPU seconds used so far by the coordinator and the shard nodes (the processes a write
    /// or search goes through; the model worker is left out).
    pub fn data_path_cpu_seconds(&self) -> f64 {
        std::iter::once(&self.coordinator)
            .chain(&self.more_coordinators)
            .chain(&self.shards)
            .filter_map(Proc::cpu_seconds)
            .sum()
    }
}

/// What `Cluster::start_opts` starts.
#[derive(Default)]
pub struct Options<'a> {
    pub shard_nodes: usize,
    /// TOML read by every shard node (its `[shard_node]` section).
    pub shard_config: Option<&'a str>,
    /// Coordinators replicating the catalog (1 or 3; 0 means 1).
    pub coordinators: usize,
    /// TOML read by every coordinator (its `[coordinator]` section).
    pub coordinator_config: Option<&'a str>,
    /// The model worker also serves SmolLM2 generation and MiniLM MaxSim reranking (Ask).
    pub generation: bool,
    /// TOML read by the model worker (its `[model_worker]` section).
    pub model_worker_config: Option<&'a str>,
    /// The first coordinator is the `colocated` binary: one more shard node in its process
    /// (configured by `shard_config` too), besides the `shard_nodes` separate ones.
    pub colocated: bool,
}

impl Options<'_> {
    /// Replicated coordinators dial each other over TLS when their config enables it.
    fn peer_scheme(&self) -> &'static str {
        match self.coordinator_config {
            Some(c) if c.contains("[coordinator.tls]") => "https",
            _ => "http",
        }
    }
}

/// A Python that can `import` every module of `modules` (a comma-separated list):
/// `RAGCLUSTER_PYTHON`, else ~/.cache/ragcluster-pyenv (scripts/setup.sh), else
/// ~/.cache/st-venv (scripts/setup-bench-python.sh), else python3. Tests that need one skip
/// their Python check with a message when there is none.
pub fn python_with(modules: &str) -> Option<String> {
    let mut candidates: Vec<String> = std::env::var("RAGCLUSTER_PYTHON").into_iter().collect();
    if let Some(home) = std::env::var_os("HOME") {
        for venv in ["ragcluster-pyenv", "st-venv"] {
            candidates.push(format!(
                "{}/.cache/{venv}/bin/python",
                home.to_string_lossy()
            ));
        }
    }
    candidates.push("python3".into());
    candidates.into_iter().find(|p| {
        Command::new(p)
            .args(["-c", &format!("import {modules}")])
            .output()
            .is_ok_and(|o| o.status.success())
    })
}

/// The first embed model a model worker at `worker` lists (ListModels).
pub async fn embed_model_info(worker: &str) -> Result<ragcluster_proto::v1::ModelInfo> {
    use ragcluster_proto::v1::ListModelsRequest;
    use ragcluster_proto::v1::model_worker_client::ModelWorkerClient;
    ModelWorkerClient::connect(worker.to_owned())
        .await?
        .list_models(ListModelsRequest {})
        .await?
        .into_inner()
        .models
        .into_iter()
        .find(|m| m.kind == "embed")
        .context("the model worker lists no embed model")
}

/// A free loopback port for a process that must be told its port up front (replicated
/// coordinators list each other). It is bound and released, so something else may take it
/// before the process binds it: taken below the kernel's ephemeral range (where port-0 binds
/// and outgoing connections draw theirs, which once took a coordinator's port between the two
/// binds) and never handed out twice by this process.
pub fn free_port() -> Result<u16> {
    use rand::Rng;
    static GIVEN: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    let ephemeral_low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32768);
    let mut given = GIVEN.lock().unwrap_or_else(|e| e.into_inner());
    if ephemeral_low > 12_000 {
        let mut rng = rand::rng();
        for _ in 0..200 {
            let port = rng.random_range(10_000..ephemeral_low);
            if !given.contains(&port) && std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
                given.push(port);
                return Ok(port);
            }
        }
    }
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    given.push(port);
    Ok(port)
}

impl Cluster {
    pub fn start(shard_nodes: usize) -> Result<Self> {
        Self::start_with(shard_nodes, None)
    }

    /// As `start`, the shard nodes configured by `shard_config` (a TOML document).
    pub fn start_with(shard_nodes: usize, shard_config: Option<&str>) -> Result<Self> {
        Self::start_opts(Options {
            shard_nodes,
            shard_config,
            coordinators: 1,
            coordinator_config: None,
            generation: false,
            model_worker_config: None,
            colocated: false,
        })
    }

    /// The cluster Ask needs: `shard_nodes` shard nodes, one coordinator, and a model worker
    /// that also generates (SmolLM2) and reranks (MiniLM MaxSim).
    pub fn start_for_ask(shard_nodes: usize) -> Result<Self> {
        Self::start_opts(Options {
            shard_nodes,
            shard_config: None,
            coordinators: 1,
            coordinator_config: None,
            generation: true,
            model_worker_config: None,
            colocated: false,
        })
    }

    /// Starts the processes in a fresh temporary directory, removed afterwards unless
    /// `RAGCLUSTER_KEEP_TEST_DIRS` is set (logs and data for a post-mortem).
    pub fn start_opts(mut o: Options) -> Result<Self> {
        o.coordinators = o.coordinators.max(1);
        let mut dir = tempfile::Builder::new()
            .prefix("ragcluster-test-")
            .tempdir()?;
        if std::env::var_os("RAGCLUSTER_KEEP_TEST_DIRS").is_some() {
            dir.disable_cleanup(true);
            eprintln!("keeping {}", dir.path().display());
        }
        let write = |name: &str, toml: Option<&str>| -> Result<Option<PathBuf>> {
            match toml {
                Some(toml) => {
                    let p = dir.path().join(name);
                    std::fs::write(&p, toml)?;
                    Ok(Some(p))
                }
                None => Ok(None),
            }
        };
        let config = write("shard-node.toml", o.shard_config)?;
        let coord_config = write("coordinator.toml", o.coordinator_config)?;
        let mw_config = write("model-worker.toml", o.model_worker_config)?;
        let model = embed_model()?;
        let mw = if o.generation {
            let rerank = model.display().to_string();
            Proc::model_worker_with(
                dir.path(),
                true,
                mw_config.as_deref(),
                &["--rerank-model", &rerank],
            )?
        } else {
            Proc::model_worker(dir.path(), false, mw_config.as_deref())?
        };
        let mut shards = Vec::new();
        for i in 0..o.shard_nodes {
            shards.push(Proc::shard_node_with(
                &format!("shard-{i}"),
                dir.path(),
                config.as_deref(),
            )?);
        }
        // Coordinators must know each other's addresses up front: fixed ports when replicated.
        let ports: Vec<u16> = if o.coordinators > 1 {
            (0..o.coordinators)
                .map(|_| free_port())
                .collect::<Result<_>>()?
        } else {
            vec![0]
        };
        let peers = ports
            .iter()
            .enumerate()
            .map(|(i, p)| format!("{}={}://127.0.0.1:{p}", i + 1, o.peer_scheme()))
            .collect::<Vec<_>>()
            .join(",");
        let mut coordinators = Vec::new();
        for (i, port) in ports.iter().enumerate() {
            let name = if i == 0 {
                "coordinator".to_owned()
            } else {
                format!("coordinator-{}", i + 1)
            };
            let mut args = vec![
                "--listen".into(),
                format!("127.0.0.1:{port}"),
                "--data-dir".into(),
                dir.path().join(&name).join("data").display().to_string(),
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
            ];
            if o.coordinators > 1 {
                args.extend([
                    "--node-id".into(),
                    (i + 1).to_string(),
                    "--peers".into(),
                    peers.clone(),
                ]);
            }
            let colocated = o.colocated && i == 0;
            if colocated {
                let own = dir.path().join(&name);
                // A fixed port: restarted, the node keeps the address its peers know.
                args.extend([
                    "--shard-listen".into(),
                    format!("127.0.0.1:{}", free_port()?),
                    "--shard-data-dir".into(),
                    own.join("data").join("shard-node").display().to_string(),
                    "--shard-port-file".into(),
                    own.join("shard-node.port").display().to_string(),
                ]);
            }
            // The colocated binary reads one file: the coordinator's sections, then the shard
            // node's.
            let file = match (&coord_config, colocated.then_some(o.shard_config).flatten()) {
                (Some(c), Some(sc)) if o.coordinator_config == Some(sc) => Some(c.clone()),
                (Some(c), Some(sc)) => {
                    let both = dir.path().join("colocated.toml");
                    std::fs::write(&both, format!("{}\n{sc}", std::fs::read_to_string(c)?))?;
                    Some(both)
                }
                (Some(c), None) => Some(c.clone()),
                (None, _) if colocated => config.clone(),
                (None, _) => None,
            };
            if let Some(c) = &file {
                args.extend(["--config".into(), c.display().to_string()]);
            }
            coordinators.push(Proc::start(
                &name,
                if colocated {
                    "colocated"
                } else {
                    "coordinator"
                },
                args,
                dir.path(),
                Duration::from_secs(60),
            )?);
        }
        let coordinator = coordinators.remove(0);
        Ok(Self {
            dir,
            model_worker: mw,
            shards,
            coordinator,
            more_coordinators: coordinators,
            colocated: o.colocated,
        })
    }

    /// Every coordinator, the first one first.
    pub fn coordinators_mut(&mut self) -> Vec<&mut Proc> {
        std::iter::once(&mut self.coordinator)
            .chain(self.more_coordinators.iter_mut())
            .collect()
    }

    pub async fn client(&self) -> Result<CoordinatorClient<Channel>> {
        coordinator_client(&self.coordinator.grpc).await
    }
}

/// A client of the coordinator at `addr` with the message limits our tests need.
pub async fn coordinator_client(addr: &str) -> Result<CoordinatorClient<Channel>> {
    let ch = Channel::from_shared(addr.to_owned())?.connect().await?;
    Ok(CoordinatorClient::new(ch)
        .max_decoding_message_size(64 << 20)
        .max_encoding_message_size(300 << 20))
}

/// A BEIR document.
pub use ragctl::eval::beir::{BeirDoc, BeirQuery, read_jsonl, read_qrels};

/// Percentile (0..=100) of an unsorted sample, nearest rank.
pub fn percentile(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let idx = ((p / 100.0) * v.len() as f64).ceil() as usize;
    v[idx.saturating_sub(1).min(v.len() - 1)]
}

/// n, p50, p99 and max of latencies in ms, as the benches print them.
pub fn latency_summary(mut lat: Vec<f64>) -> serde_json::Value {
    let max = lat.iter().copied().fold(0.0, f64::max);
    serde_json::json!({"n": lat.len(), "p50_ms": percentile(&mut lat, 50.0),
        "p99_ms": percentile(&mut lat, 99.0), "max_ms": max})
}

/// GET over plain HTTP/1.1 (the /metrics endpoints); the body must come with 200.
pub async fn http_get(url: &str) -> Result<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let rest = url.trim_start_matches("http://");
    let (host, path) = rest.split_once('/').unwrap_or((rest, ""));
    let mut s = tokio::net::TcpStream::connect(host).await?;
    s.write_all(format!("GET /{path} HTTP/1.1\r\nhost: {host}\r\n\r\n").as_bytes())
        .await?;
    let mut out = String::new();
    s.read_to_string(&mut out).await?;
    anyhow::ensure!(
        out.starts_with("HTTP/1.1 200"),
        "GET {url}: {}",
        out.lines().next().unwrap_or_default()
    );
    Ok(out)
}

/// A metric's value summed over its series, from a Prometheus text page.
pub fn metric_sum(page: &str, name: &str) -> f64 {
    page.lines()
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|r| r.starts_with(' ') || r.starts_with('{'))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// POST a JSON body over plain HTTP/1.1 (`connection: close`); returns the status code and
/// the body (content-length bodies only: what the OpenAI-compatible API sends unstreamed).
pub async fn http_post_json(url: &str, body: &serde_json::Value) -> Result<(u16, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let rest = url.trim_start_matches("http://");
    let (host, path) = rest.split_once('/').unwrap_or((rest, ""));
    let mut s = tokio::net::TcpStream::connect(host).await?;
    let body = body.to_string();
    s.write_all(
        format!(
            "POST /{path} HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
            body.len()
        )
        .as_bytes(),
    )
    .await?;
    let mut out = String::new();
    s.read_to_string(&mut out).await?;
    let status = out
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = out
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    Ok((status, body))
}

/// Creates `collection` (Markdown chunking, 96-token chunks, `shards` shards) and upserts the
/// files of docs/sample, titled by their first heading, as the demo's `ragctl ingest` does.
pub async fn ingest_sample<T>(
    c: &mut CoordinatorClient<T>,
    collection: &str,
    shards: u32,
) -> Result<UpsertDocumentsResponse>
where
    T: tonic::client::GrpcService<tonic::body::Body, ResponseBody = tonic::body::Body>,
    T::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    c.create_collection(CreateCollectionRequest {
        name: collection.into(),
        shard_count: shards,
        chunking: Some(ChunkingConfig {
            strategy: ChunkingStrategy::Markdown as i32,
            chunk_size: 96,
            ..Default::default()
        }),
        ..Default::default()
    })
    .await?;
    let mut files: Vec<PathBuf> = std::fs::read_dir(workspace().join("docs/sample"))?
        .map(|e| e.map(|e| e.path()))
        .collect::<std::io::Result<_>>()?;
    files.sort();
    let mut documents = Vec::new();
    for f in files {
        let text = std::fs::read_to_string(&f)?;
        let title = text
            .lines()
            .next()
            .unwrap_or_default()
            .trim_start_matches("# ")
            .to_owned();
        documents.push(Document {
            id: f
                .file_name()
                .unwrap_or_default()
                .to_string_lossy()
                .into_owned(),
            title,
            text,
            ..Default::default()
        });
    }
    Ok(c.upsert_documents(UpsertDocumentsRequest {
        collection: collection.into(),
        documents,
    })
    .await?
    .into_inner())
}

/// Upserts `n` documents `{prefix}-{i}` ("document {i} of {prefix}: {topic}") with their own
/// pseudo-random vectors of `dim` dimensions (deterministic; no model call), 256 a call.
pub async fn upsert_with_vectors(
    c: &mut CoordinatorClient<Channel>,
    collection: &str,
    prefix: &str,
    topic: &str,
    dim: usize,
    n: usize,
) -> Result<()> {
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        (x >> 40) as f32 / (1u64 << 24) as f32 - 0.5
    };
    for start in (0..n).step_by(256) {
        let documents = (start..(start + 256).min(n))
            .map(|i| Document {
                id: format!("{prefix}-{i}"),
                text: format!("document {i} of {prefix}: {topic}"),
                embedding: (0..dim).map(|_| next()).collect(),
                ..Default::default()
            })
            .collect();
        c.upsert_documents(UpsertDocumentsRequest {
            collection: collection.into(),
            documents,
        })
        .await?;
    }
    Ok(())
}

/// Configures a failpoint of the shard node at `addr` (the binaries `make test` builds carry
/// the `failpoints` feature and serve the test-only `Failpoints` service).
pub async fn set_failpoint(addr: &str, name: &str, actions: &str) -> Result<()> {
    use ragcluster_proto::v1::SetFailpointRequest;
    use ragcluster_proto::v1::failpoints_client::FailpointsClient;
    let ch = Channel::from_shared(addr.to_owned())?
        .connect_timeout(Duration::from_secs(1))
        .connect()
        .await?;
    FailpointsClient::new(ch)
        .set(SetFailpointRequest {
            name: name.into(),
            actions: actions.into(),
        })
        .await
        .map_err(|s| {
            if s.code() == tonic::Code::Unimplemented {
                anyhow::anyhow!(
                    "{addr} serves no failpoints: build with `--features shard-node/failpoints` \
                     (`make test` does)"
                )
            } else {
                anyhow::anyhow!("failpoint {name} on {addr}: {s}")
            }
        })?;
    Ok(())
}

/// Runs this build's `ragctl --dir DIR ARGS...`: whether it succeeded and what it printed
/// (stdout, then stderr).
pub fn ragctl(dir: &Path, args: &[&str]) -> Result<(bool, String)> {
    let out = Command::new(bin_dir().join("ragctl"))
        .arg("--dir")
        .arg(dir)
        .args(args)
        .output()?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok((out.status.success(), text))
}

/// This build's `ragctl --coordinator ADDR ARGS...`, failing unless it succeeds; prints how
/// long it took and what it said (operator commands in load tests).
pub fn ragctl_at(coordinator: &str, args: &[&str]) -> Result<String> {
    let t = Instant::now();
    let o = Command::new(bin_dir().join("ragctl"))
        .args(["--coordinator", coordinator])
        .args(args)
        .env("RUST_BACKTRACE", "0")
        .output()?;
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    anyhow::ensure!(
        o.status.success(),
        "ragctl {args:?}: {out}{}",
        String::from_utf8_lossy(&o.stderr)
    );
    eprintln!(
        "ragctl {} took {:.1} s\n{out}",
        args.join(" "),
        t.elapsed().as_secs_f64()
    );
    Ok(out)
}

/// As `ragctl`, failing unless the command succeeds.
pub fn ragctl_ok(dir: &Path, args: &[&str]) -> Result<String> {
    let (success, text) = ragctl(dir, args)?;
    anyhow::ensure!(success, "ragctl {args:?}: {text}");
    Ok(text)
}

/// A client of the shard node at `addr`, connected (1 s to connect).
pub async fn shard_client(
    addr: &str,
) -> Result<ragcluster_proto::v1::shard_client::ShardClient<Channel>> {
    Ok(ragcluster_proto::v1::shard_client::ShardClient::new(
        Channel::from_shared(addr.to_owned())?
            .connect_timeout(Duration::from_secs(1))
            .connect()
            .await?,
    ))
}
