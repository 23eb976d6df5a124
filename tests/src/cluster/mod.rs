//! Clusters for the tests: real processes on loopback (`Cluster`: a model worker, shard nodes
//! and one or three coordinators configured with each other; `Joined`: a coordinator that
//! nodes join), each a `Proc` that can be SIGKILLed and restarted in place; the in-process
//! cluster (`inproc`); and the checks that compare replicas (`replicas`).

pub mod inproc;
mod proc;
pub mod replicas;

pub use proc::Proc;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Result;
use ragcluster_proto::v1::admin_client::AdminClient;
use ragcluster_proto::v1::coordinator_client::CoordinatorClient;
use ragcluster_proto::v1::{ClusterStatusRequest, MemberState, NodeStatus};
use tonic::transport::Channel;

use crate::{coordinator_client, embed_model};

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

/// A coordinator's flags: where it listens and keeps its catalog, its seed shard nodes and
/// model worker, and the embedding model's tokenizer.
fn coordinator_args(
    listen: &str,
    data_dir: &std::path::Path,
    shards: &[Proc],
    model_worker: &Proc,
    model: &std::path::Path,
) -> Vec<String> {
    let seeds: Vec<String> = shards.iter().map(|s| s.grpc.clone()).collect();
    vec![
        "--listen".into(),
        listen.into(),
        "--data-dir".into(),
        data_dir.display().to_string(),
        "--shard-nodes".into(),
        seeds.join(","),
        "--model-worker".into(),
        model_worker.grpc.clone(),
        "--embedding-tokenizer".into(),
        model.join("tokenizer.json").display().to_string(),
    ]
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
    /// More flags for the model worker (e.g. a second `--embed-model`).
    pub model_worker_args: &'a [&'a str],
    /// The first coordinator is the `colocated` binary: one more shard node in its process
    /// (configured by `shard_config` too), besides the `shard_nodes` separate ones.
    pub colocated: bool,
    /// The shard nodes also heartbeat to the first coordinator (then on a fixed port), as
    /// members started with `coordinators` do: they learn from its answers which peers' disks
    /// are full.
    pub shard_heartbeats: bool,
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
            shard_heartbeats: false,
            model_worker_args: &[],
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
            shard_heartbeats: false,
            model_worker_args: &[],
        })
    }

    /// A cluster on hosts of `net` (`crate::netns`): the coordinator and the model worker on
    /// host 0, shard node `i` alone on host `i + 1` (configured by `shard_config`), every
    /// process listening on its host's address, so iptables rules and netem between hosts act
    /// on real traffic between processes.
    pub fn start_in(
        net: &crate::netns::Net,
        shard_nodes: usize,
        shard_config: Option<&str>,
    ) -> Result<Self> {
        let dir = tempfile::Builder::new()
            .prefix("ragcluster-test-netns-")
            .tempdir()?;
        let config = match shard_config {
            Some(t) => {
                let p = dir.path().join("shard-node.toml");
                std::fs::write(&p, t)?;
                Some(p)
            }
            None => None,
        };
        let model = embed_model()?;
        let h0 = net.addr(0);
        let mw = Proc::start_in(
            &net.ns(0),
            &h0,
            "model-worker",
            "model-worker",
            vec![
                "--listen".into(),
                format!("{h0}:0"),
                "--embed-model".into(),
                model.display().to_string(),
            ],
            dir.path(),
            Duration::from_secs(300),
        )?;
        let mut shards = Vec::new();
        for i in 0..shard_nodes {
            let host = net.addr(i + 1);
            let name = format!("shard-{i}");
            let mut args = vec![
                "--listen".into(),
                format!("{host}:0"),
                "--data-dir".into(),
                dir.path().join(&name).join("data").display().to_string(),
            ];
            if let Some(c) = &config {
                args.extend(["--config".into(), c.display().to_string()]);
            }
            shards.push(Proc::start_in(
                &net.ns(i + 1),
                &host,
                &name,
                "shard-node",
                args,
                dir.path(),
                Duration::from_secs(120),
            )?);
        }
        let coordinator = Proc::start_in(
            &net.ns(0),
            &h0,
            "coordinator",
            "coordinator",
            coordinator_args(
                &format!("{h0}:0"),
                &dir.path().join("coordinator/data"),
                &shards,
                &mw,
                &model,
            ),
            dir.path(),
            Duration::from_secs(60),
        )?;
        Ok(Self {
            dir,
            model_worker: mw,
            shards,
            coordinator,
            more_coordinators: Vec::new(),
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
            Proc::model_worker_with(dir.path(), false, mw_config.as_deref(), o.model_worker_args)?
        };
        // Coordinators must know each other's addresses up front, and heartbeating shard
        // nodes theirs: fixed ports then.
        let ports: Vec<u16> = if o.coordinators > 1 || o.shard_heartbeats {
            (0..o.coordinators)
                .map(|_| free_port())
                .collect::<Result<_>>()?
        } else {
            vec![0]
        };
        let mut shards = Vec::new();
        for i in 0..o.shard_nodes {
            let name = format!("shard-{i}");
            shards.push(if o.shard_heartbeats {
                let first = format!("http://127.0.0.1:{}", ports[0]);
                Proc::joining_shard_node(&name, dir.path(), &first, config.as_deref())?
            } else {
                Proc::shard_node_with(&name, dir.path(), config.as_deref())?
            });
        }
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
            let mut args = coordinator_args(
                &format!("127.0.0.1:{port}"),
                &dir.path().join(&name).join("data"),
                &shards,
                &mw,
                &model,
            );
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

    pub async fn admin(&self) -> Result<AdminClient<Channel>> {
        Ok(AdminClient::new(
            Channel::from_shared(self.coordinator.grpc.clone())?
                .connect()
                .await?,
        ))
    }
}
